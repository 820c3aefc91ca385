//! The shared-memory files the L1 arena and the mirror are both made of,
//! and the one way they are made: a hugetlb memfd, or a file created under
//! a temporary name ([`create`]) and renamed into place once built
//! ([`publish`]), so nobody finds it half made; the filesystem under it
//! checked against its [`Backing`] ([`check`]); every page reserved up
//! front, since a later page fault must not find the tmpfs or the huge page
//! pool empty, and mapped populated ([`reserve_and_map`]). Each owner turns
//! a [`ShmError`] into its own error.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use memmap2::{MmapOptions, MmapRaw};

/// What memory backs a shared-memory file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A file on a tmpfs, normally under `/dev/shm`; base pages.
    Shm(PathBuf),
    /// A file on a hugetlbfs mount; the mount's huge page size.
    HugetlbFs(PathBuf),
    /// An anonymous hugetlb memfd (the default huge page size); other
    /// processes map it through a passed descriptor or
    /// `/proc/<pid>/fd/<fd>`.
    HugetlbMemfd,
}

/// Why a shared-memory file could not be made.
#[derive(Debug)]
pub enum ShmError {
    /// A system call failed.
    Io {
        /// What was being done.
        what: &'static str,
        /// The file, where there is one.
        path: Option<PathBuf>,
        /// The error.
        source: io::Error,
    },
    /// A [`Backing::Shm`] path on neither a tmpfs nor a hugetlbfs.
    NotTmpfs,
    /// A [`Backing::HugetlbFs`] path not on a hugetlbfs.
    NotHugetlbfs,
    /// Not enough shared memory or huge pages.
    NoSpace {
        /// Bytes asked for.
        bytes: u64,
        /// What to check.
        hint: &'static str,
    },
    /// Larger than a file can be.
    TooLarge,
}

fn io_error(what: &'static str, path: Option<&Path>) -> impl FnOnce(io::Error) -> ShmError {
    let path = path.map(Path::to_path_buf);
    move |source| ShmError::Io { what, path, source }
}

/// Makes the file of `backing` with exactly `mode` (a memfd is named
/// `memfd_name`): a file is created under its building name. Returns the
/// file, the path it is to have, and its building name (`None`, `None` for
/// a memfd).
pub fn create(
    backing: &Backing,
    mode: u32,
    memfd_name: &str,
) -> Result<(File, Option<PathBuf>, Option<PathBuf>), ShmError> {
    let path = match backing {
        Backing::Shm(path) | Backing::HugetlbFs(path) => path,
        Backing::HugetlbMemfd => {
            let file = hugetlb_memfd(memfd_name).map_err(io_error("creating a hugetlb memfd", None))?;
            return Ok((file, None, None));
        }
    };
    let building = building_path(path);
    let file = create_building(&building, mode).map_err(io_error("creating", Some(&building)))?;
    Ok((file, Some(path.clone()), Some(building)))
}

/// Checks the filesystem under `file` (named `building`) against
/// `backing`. Whether its pages are huge, and its block size.
pub fn check(backing: &Backing, file: &File, building: Option<&Path>) -> Result<(bool, u64), ShmError> {
    let (fs_type, block_bytes) = filesystem(file).map_err(io_error("reading the filesystem of", building))?;
    match (backing, fs_type) {
        (Backing::Shm(_), TMPFS_MAGIC | HUGETLBFS_MAGIC)
        | (Backing::HugetlbFs(_), HUGETLBFS_MAGIC)
        | (Backing::HugetlbMemfd, _) => Ok((fs_type == HUGETLBFS_MAGIC, block_bytes)),
        (Backing::Shm(_), _) => Err(ShmError::NotTmpfs),
        (Backing::HugetlbFs(_), _) => Err(ShmError::NotHugetlbfs),
    }
}

/// Reserves every page of `file`'s first `bytes` now and maps them,
/// populated (`huge`: its pages are huge ones, for the hint).
pub fn reserve_and_map(file: &File, bytes: u64, huge: bool, building: Option<&Path>) -> Result<MmapRaw, ShmError> {
    reserve_all(file, bytes, huge, building)?;
    map_populated(file, bytes).map_err(io_error("mapping", building))
}

/// Reserves every page of `file`'s first `bytes` now (`huge`: its pages
/// are huge ones, for the hint).
pub fn reserve_all(file: &File, bytes: u64, huge: bool, building: Option<&Path>) -> Result<(), ShmError> {
    match reserve(file, bytes) {
        Ok(()) => Ok(()),
        Err(ReserveError::NoSpace) => {
            Err(ShmError::NoSpace { bytes, hint: if huge { NO_HUGE_PAGES } else { NO_TMPFS_ROOM } })
        }
        Err(ReserveError::TooLarge) => Err(ShmError::TooLarge),
        Err(ReserveError::Io(e)) => Err(io_error("reserving memory for", building)(e)),
    }
}

/// Renames a built file into place (nothing to do for a memfd).
pub fn publish(building: Option<&Path>, target: Option<&Path>) -> Result<(), ShmError> {
    if let (Some(target), Some(building)) = (target, building) {
        std::fs::rename(building, target).map_err(io_error("renaming into place", Some(target)))?;
    }
    Ok(())
}

/// `statfs.f_type` of a tmpfs.
pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `statfs.f_type` of a hugetlbfs.
pub(crate) const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// What to check when a hugetlb reservation fails.
pub(crate) const NO_HUGE_PAGES: &str =
    "not enough free huge pages (see /proc/sys/vm/nr_hugepages and HugePages_Free in /proc/meminfo)";
/// What to check when a tmpfs reservation fails.
pub(crate) const NO_TMPFS_ROOM: &str = "the tmpfs is too small (see df /dev/shm; raise its size= mount option)";

/// An anonymous hugetlb memfd named `name` (close-on-exec).
pub(crate) fn hugetlb_memfd(name: &str) -> io::Result<File> {
    memfd(name, libc::MFD_HUGETLB)
}

/// An anonymous memfd named `name` (close-on-exec) that can be sealed
/// ([`seal`]): on huge pages or base ones, as `backing`'s memory is.
pub fn sealable_memfd(backing: &Backing, name: &str) -> Result<File, ShmError> {
    let huge = if matches!(backing, Backing::Shm(_)) { 0 } else { libc::MFD_HUGETLB };
    memfd(name, libc::MFD_ALLOW_SEALING | huge).map_err(io_error("creating a memfd", None))
}

fn memfd(name: &str, flags: libc::c_uint) -> io::Result<File> {
    let name = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a valid NUL-terminated name; the flags are constants.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The seals [`seal`] sets: the size is fixed and the seals too.
pub const SEALS: i32 = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Fixes the size of a [`sealable_memfd`] for good: no process holding it
/// can shrink it (which would fault every process mapping the pages it
/// took away) or grow it, through any descriptor.
pub fn seal(file: &File) -> io::Result<()> {
    // SAFETY: an open descriptor; F_ADD_SEALS takes an int of seal bits.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The temporary name a file for `path` is built under.
pub(crate) fn building_path(path: &Path) -> PathBuf {
    let mut building = path.as_os_str().to_owned();
    building.push(format!(".building-{}", std::process::id()));
    PathBuf::from(building)
}

/// Creates `building` afresh (a leftover of an earlier attempt by this pid
/// goes) with exactly `mode` (the umask may not narrow it).
pub(crate) fn create_building(building: &Path, mode: u32) -> io::Result<File> {
    let _ = std::fs::remove_file(building);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_CLOEXEC)
        .open(building)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    Ok(file)
}

/// The filesystem type and block size under `file`.
pub(crate) fn filesystem(file: &File) -> io::Result<(i64, u64)> {
    // SAFETY: statfs is plain data; all zeroes is a valid value.
    let mut stat: libc::statfs = unsafe { core::mem::zeroed() };
    // SAFETY: a valid descriptor and a valid out-pointer.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &raw mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((stat.f_type, u64::try_from(stat.f_bsize).unwrap_or(0)))
}

/// Why [`reserve`] failed.
#[derive(Debug)]
pub(crate) enum ReserveError {
    /// No room: the pool or the tmpfs is too small (hint: [`NO_HUGE_PAGES`]
    /// or [`NO_TMPFS_ROOM`]).
    NoSpace,
    /// Larger than a file can be.
    TooLarge,
    /// Anything else.
    Io(io::Error),
}

/// Allocates every page of `file`'s first `bytes` now.
pub(crate) fn reserve(file: &File, bytes: u64) -> Result<(), ReserveError> {
    let len = i64::try_from(bytes).map_err(|_| ReserveError::TooLarge)?;
    // hugetlbfs checks for a pending signal between pages and gives up with
    // EINTR (seen with a process whose other threads take signals); mode 0
    // keeps what is already allocated, so asking again finishes the rest.
    for _ in 0..RESERVE_ATTEMPTS_MAX {
        // SAFETY: a valid descriptor; mode 0 allocates the range.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } == 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::ENOSPC) => return Err(ReserveError::NoSpace),
            _ => return Err(ReserveError::Io(error)),
        }
    }
    Err(ReserveError::Io(io::Error::from_raw_os_error(libc::EINTR)))
}

/// Times [`reserve`] asks again after an interrupted allocation.
const RESERVE_ATTEMPTS_MAX: u32 = 1000;

/// Maps `bytes` of `file` shared and writable, every page populated.
pub(crate) fn map_populated(file: &File, bytes: u64) -> io::Result<MmapRaw> {
    MmapOptions::new().len(crate::usize_from(bytes)).populate().map_raw(file)
}
