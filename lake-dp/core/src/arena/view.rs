//! How a process maps an arena: the whole file at once (versions 1 and 2),
//! or, for a partitioned arena, a reservation of the whole arena's address
//! range with only the pieces this process was given mapped into it — the
//! arena's file (header, generations, agent records, and partition 0 where
//! given) and each other partition's file at its place. What is not given
//! stays unmapped (`PROT_NONE`): a stray access faults instead of reading
//! another tenant's blocks, and nothing of it is in this process's memory.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use memmap2::MmapRaw;

/// One file range mapped at an offset of the view.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece<'a> {
    /// The file.
    pub fd: BorrowedFd<'a>,
    /// Where in the view its first byte goes.
    pub at: usize,
    /// Bytes mapped.
    pub len: usize,
    /// Offset in the file.
    pub file_offset: u64,
}

/// A mapped arena.
pub(super) enum Mapping {
    /// The whole file, in one mapping.
    Whole(MmapRaw),
    /// A reserved range with the given pieces mapped into it.
    Pieces(Pieces),
}

impl Mapping {
    pub(super) fn as_mut_ptr(&self) -> *mut u8 {
        match self {
            Self::Whole(map) => map.as_mut_ptr(),
            Self::Pieces(pieces) => pieces.base,
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Whole(map) => map.len(),
            Self::Pieces(pieces) => pieces.len,
        }
    }

    /// `mlock`s what is mapped.
    pub(super) fn lock(&self) -> io::Result<()> {
        match self {
            Self::Whole(map) => map.lock(),
            Self::Pieces(pieces) => {
                for &(at, len) in &pieces.mapped {
                    // SAFETY: a range this mapping holds.
                    if unsafe { libc::mlock(pieces.base.wrapping_add(at).cast(), len) } != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            }
        }
    }
}

/// A reserved address range of `len` bytes at `base`, with `mapped`
/// (offset, length) pieces of files mapped shared into it; unmapped as a
/// whole on drop.
pub(super) struct Pieces {
    base: *mut u8,
    len: usize,
    mapped: Vec<(usize, usize)>,
}

// SAFETY: the raw base is the start of a mapping this value owns; the
// memory is shared memory, touched through the arena's protocols.
unsafe impl Send for Pieces {}
// SAFETY: as for Send.
unsafe impl Sync for Pieces {}

impl Pieces {
    /// Reserves `len` bytes aligned to `align` (a power of two: the page
    /// size backing the files) and maps `pieces` into them, populated.
    pub(super) fn map(len: usize, align: usize, pieces: &[Piece<'_>]) -> io::Result<Self> {
        debug_assert!(align.is_power_of_two());
        let invalid = || io::Error::from(io::ErrorKind::InvalidInput);
        if pieces.iter().any(|p| p.at.checked_add(p.len).is_none_or(|end| end > len) || p.at % align != 0) {
            return Err(invalid());
        }
        let span = len.checked_add(align).ok_or_else(invalid)?;
        // SAFETY: a fresh anonymous reservation; no memory is touched.
        let raw = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                span,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = raw as usize;
        let base = start.next_multiple_of(align);
        if base > start {
            // SAFETY: the slack before the aligned range is part of the
            // reservation just made.
            unsafe { libc::munmap(raw, base - start) };
        }
        let after = span - (base - start) - len;
        if after > 0 {
            // SAFETY: as is the slack after it.
            unsafe { libc::munmap((base + len) as *mut libc::c_void, after) };
        }
        let mut view = Self { base: base as *mut u8, len, mapped: Vec::with_capacity(pieces.len()) };
        for piece in pieces {
            let offset = libc::off_t::try_from(piece.file_offset).map_err(|_| invalid())?;
            // SAFETY: MAP_FIXED over a range of this reservation (checked
            // above), so nothing else of the process is replaced.
            let got = unsafe {
                libc::mmap(
                    view.base.wrapping_add(piece.at).cast(),
                    piece.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                    piece.fd.as_raw_fd(),
                    offset,
                )
            };
            if got == libc::MAP_FAILED {
                // `view` unmaps the whole range as it drops.
                return Err(io::Error::last_os_error());
            }
            view.mapped.push((piece.at, piece.len));
        }
        Ok(view)
    }
}

impl Drop for Pieces {
    fn drop(&mut self) {
        // SAFETY: the whole range is this value's reservation.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}
