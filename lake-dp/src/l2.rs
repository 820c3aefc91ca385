//! The L2 tier: slot files on NVMe, driven by io_uring with O_DIRECT.
//!
//! ```text
//! 0            slot_bytes           ...   slots * slot_bytes
//! | slot 0     | slot 1     | ...  | superblock A (4 KiB) | superblock B (4 KiB) |
//! ```
//!
//! Every slot holds one stored object (4 KiB header, then the payload;
//! `docs/formats.md`), at the offset the poller computes. Files are written
//! in full when formatted — zeros, never unwritten extents — so a later
//! write never needs the filesystem to commit metadata, and an fdatasync
//! flushes data only. The superblock, kept twice (a torn update leaves the
//! other copy), names the file (tier set id, index, region), its geometry,
//! the current region epoch (bumped and persisted at every open, before any
//! I/O of the new incarnation) and the epoch of the last clean shutdown.
//!
//! Durability words (DESIGN §3): a write is *acked* when its O_DIRECT
//! write completes (the bytes are on the device: they survive a process
//! crash) and *durable* after a later fdatasync completes (they survive a
//! power loss). A clean shutdown flushes every file, so every object an
//! incarnation up to the last clean one wrote is durable; objects written
//! since (by an incarnation that crashed) are suspect and get their payload
//! CRCs checked at re-adoption before they are served (every read checks
//! them again anyway).

use core::mem::{offset_of, size_of};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use bytemuck::{Pod, Zeroable};

use crate::constants::{DIRECT_IO_ALIGN_BYTES, STORED_HEADER_BYTES};
use crate::io::{IoBackend, IoCompletion, IoKind, IoOp};
use crate::lock;
use crate::model::replica::RegionId;
use crate::poller::L2Geometry;
use crate::region::SlotRegion;
use crate::stored::{DecodedHeader, ObjectMeta, StoredError, decode_header};
use crate::tag::Tag;
use crate::uring::UringBackend;
use crate::usize_from;

/// The first eight bytes of an L2 file's superblock.
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"LAKEL2F\0";

/// The superblock version this build writes and reads.
pub const SUPERBLOCK_VERSION: u32 = 1;

/// Bytes re-adoption reads per slot: the stored header only.
const HEADER_READ_BYTES: u32 = 4096;
const _: () = assert!(HEADER_READ_BYTES as usize == STORED_HEADER_BYTES);

/// Bytes of one superblock copy.
pub const SUPERBLOCK_BYTES: u64 = 4096;

/// The superblock as it lies on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Superblock {
    /// [`SUPERBLOCK_MAGIC`].
    pub magic: [u8; 8],
    /// [`SUPERBLOCK_VERSION`].
    pub version: u32,
    /// The file's index in its tier.
    pub file_index: u16,
    /// The file's region id.
    pub region: u16,
    /// Random at format time, shared by every file of one tier: a file of
    /// another tier is refused.
    pub set_id: [u8; 16],
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots in the file.
    pub slots: u32,
    /// Files in the tier.
    pub files: u16,
    /// Zero.
    pub reserved_a: u16,
    /// Bumped at every write of the superblock; the valid copy with the
    /// higher sequence is current.
    pub sequence: u64,
    /// The region epoch of the incarnation that opened the file last.
    pub epoch: u64,
    /// The epoch of the last incarnation that shut down cleanly (0: none).
    pub clean_epoch: u64,
    /// When the tier was formatted (Unix ns).
    pub formatted_unix_ns: u64,
    /// Zero.
    pub reserved_b: u32,
    /// CRC32 of every byte before this field.
    pub crc: u32,
}

const _: () = assert!(size_of::<Superblock>() == 88);
const _: () = assert!(offset_of!(Superblock, crc) == 84);
const _: () = assert!(size_of::<Superblock>() as u64 <= SUPERBLOCK_BYTES);

/// Why the tier could not be formatted, opened or re-adopted.
#[derive(Debug)]
pub enum L2Error {
    /// A configuration field is wrong; the text names it.
    Config(&'static str),
    /// A system call failed.
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A file is not a usable L2 file of this tier; the text says why.
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// Another process drives this file.
    InUse {
        /// The file.
        path: PathBuf,
    },
}

impl core::fmt::Display for L2Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Config(what) => write!(f, "L2 config: {what}"),
            Self::Io { what, path, source } => write!(f, "L2: {what} {}: {source}", path.display()),
            Self::File { path, what } => write!(f, "L2 file {}: {what}", path.display()),
            Self::InUse { path } => write!(f, "L2 file {}: in use by another lake-dp", path.display()),
        }
    }
}

impl std::error::Error for L2Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> L2Error {
    let path = path.to_path_buf();
    move |source| L2Error::Io { what, path, source }
}

/// The tier as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L2Config {
    /// One file per path, in order (file index = position).
    pub paths: Vec<PathBuf>,
    /// Slots per file.
    pub slots_per_file: u32,
    /// Bytes per slot (a multiple of 4096).
    pub slot_bytes: u64,
    /// Region id of the first file; file `i` is `region_first + i`.
    pub region_first: u16,
}

impl L2Config {
    fn check(&self) -> Result<(), L2Error> {
        if self.paths.is_empty() || self.paths.len() > usize::from(u16::MAX) {
            return Err(L2Error::Config("paths: between 1 and 65535 files"));
        }
        if self.slots_per_file == 0 {
            return Err(L2Error::Config("slots_per_file: at least 1"));
        }
        if self.slot_bytes < 2 * STORED_HEADER_BYTES as u64
            || !self.slot_bytes.is_multiple_of(DIRECT_IO_ALIGN_BYTES as u64)
            || self.slot_bytes > u64::from(u32::MAX)
        {
            return Err(L2Error::Config("slot_bytes: a multiple of 4096, at least 8192, below 4 GiB"));
        }
        self.data_bytes().ok_or(L2Error::Config("slots_per_file * slot_bytes overflows"))?;
        Ok(())
    }

    /// Bytes of a file's slot area.
    fn data_bytes(&self) -> Option<u64> {
        u64::from(self.slots_per_file).checked_mul(self.slot_bytes)
    }

    /// Bytes of a whole file.
    pub fn file_bytes(&self) -> u64 {
        self.data_bytes().unwrap_or(0) + 2 * SUPERBLOCK_BYTES
    }

    /// The geometry the poller addresses.
    pub fn geometry(&self) -> L2Geometry {
        L2Geometry {
            files: u16::try_from(self.paths.len()).unwrap_or(u16::MAX),
            slots_per_file: self.slots_per_file,
            slot_bytes: self.slot_bytes,
            region_first: self.region_first,
        }
    }
}

fn superblock_crc(superblock: &Superblock) -> u32 {
    crc32fast::hash(&bytemuck::bytes_of(superblock)[..offset_of!(Superblock, crc)])
}

/// Checks one superblock copy (4 KiB as read).
pub fn decode_superblock(bytes: &[u8]) -> Result<Superblock, String> {
    let raw = bytes.get(..size_of::<Superblock>()).ok_or("superblock: short read")?;
    let superblock: Superblock = bytemuck::pod_read_unaligned(raw);
    if superblock.magic == [0; 8] {
        return Err("superblock: empty".into());
    }
    if superblock.magic != SUPERBLOCK_MAGIC {
        return Err("superblock: bad magic (not a Lake L2 file)".into());
    }
    if superblock.crc != superblock_crc(&superblock) {
        return Err("superblock: CRC mismatch (damaged)".into());
    }
    if superblock.version != SUPERBLOCK_VERSION {
        return Err(format!("superblock: version {}, this build reads {SUPERBLOCK_VERSION}", superblock.version));
    }
    if superblock.reserved_a != 0 || superblock.reserved_b != 0 {
        return Err("superblock: reserved fields are not zero".into());
    }
    if bytes[size_of::<Superblock>()..].iter().any(|&b| b != 0) {
        return Err("superblock: bytes after the superblock are not zero".into());
    }
    Ok(superblock)
}

/// 4 KiB-aligned scratch memory for O_DIRECT I/O outside the arena.
fn aligned(bytes: u64, slots: u32) -> io::Result<SlotRegion> {
    SlotRegion::heap(bytes, slots).map_err(|e| io::Error::other(e.to_string()))
}

fn open_direct(path: &Path, create: bool) -> Result<File, L2Error> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(create)
        .mode(0o600)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_error(if create { "creating" } else { "opening" }, path))
}

fn write_all_at(file: &File, path: &Path, buf: &[u8], offset: u64) -> Result<(), L2Error> {
    std::os::unix::fs::FileExt::write_all_at(file, buf, offset).map_err(io_error("writing", path))
}

fn read_exact_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<(), L2Error> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset).map_err(io_error("reading", path))
}

fn datasync(file: &File, path: &Path) -> Result<(), L2Error> {
    file.sync_data().map_err(io_error("flushing", path))
}

fn now_unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn random_set_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    if crate::auth::random_bytes(&mut id).is_err() {
        // No entropy source: time and pid still tell two tiers apart.
        id[..8].copy_from_slice(&now_unix_ns().to_le_bytes());
        id[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    id
}

/// Writes `superblock` into the copy its sequence selects.
fn write_superblock(file: &File, path: &Path, data_bytes: u64, superblock: &Superblock) -> Result<(), L2Error> {
    let mut buf = aligned(SUPERBLOCK_BYTES, 1).map_err(io_error("allocating", path))?;
    let mut sealed = *superblock;
    sealed.crc = superblock_crc(&sealed);
    let region = &mut buf;
    // SAFETY: a private buffer this function owns.
    let bytes = unsafe { region.slot_mut(0) }.expect("one slot");
    bytes[..size_of::<Superblock>()].copy_from_slice(bytemuck::bytes_of(&sealed));
    let copy = sealed.sequence % 2;
    write_all_at(file, path, bytes, data_bytes + copy * SUPERBLOCK_BYTES)
}

/// Creates and writes in full every file of a new tier. Refuses to touch
/// an existing file.
pub fn format(config: &L2Config) -> Result<(), L2Error> {
    config.check()?;
    let set_id = random_set_id();
    let data_bytes = config.data_bytes().unwrap_or(0);
    let files = u16::try_from(config.paths.len()).unwrap_or(u16::MAX);
    const CHUNK: u64 = 1 << 20;
    let zeros = aligned(CHUNK, 1).map_err(io_error("allocating", &config.paths[0]))?;
    // SAFETY: a private zeroed buffer, only read.
    let zeros = unsafe { zeros.slot(0) }.expect("one slot");
    for (index, path) in config.paths.iter().enumerate() {
        let file = open_direct(path, true)?;
        let mut offset = 0;
        while offset < data_bytes {
            let len = CHUNK.min(data_bytes - offset);
            write_all_at(&file, path, &zeros[..usize_from(len)], offset)?;
            offset += len;
        }
        let index = u16::try_from(index).unwrap_or(u16::MAX);
        let mut superblock = Superblock {
            magic: SUPERBLOCK_MAGIC,
            version: SUPERBLOCK_VERSION,
            file_index: index,
            region: config.region_first.wrapping_add(index),
            set_id,
            slot_bytes: config.slot_bytes,
            slots: config.slots_per_file,
            files,
            reserved_a: 0,
            sequence: 0,
            epoch: 0,
            clean_epoch: 0,
            formatted_unix_ns: now_unix_ns(),
            reserved_b: 0,
            crc: 0,
        };
        // Both copies, so neither reads as damaged.
        write_superblock(&file, path, data_bytes, &superblock)?;
        superblock.sequence = 1;
        write_superblock(&file, path, data_bytes, &superblock)?;
        datasync(&file, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(io_error("flushing the directory of", path))?;
        }
    }
    Ok(())
}

/// An opened tier: files locked, superblocks checked, the region epoch of
/// this incarnation persisted.
#[derive(Debug)]
pub struct L2Tier {
    config: L2Config,
    files: Vec<File>,
    superblocks: Vec<Superblock>,
    epoch: u64,
    clean_epoch: u64,
}

impl L2Tier {
    /// Opens every file of the tier, checks it against `config`, and
    /// persists a new region epoch (one above the highest found).
    pub fn open(config: &L2Config) -> Result<Self, L2Error> {
        config.check()?;
        let data_bytes = config.data_bytes().unwrap_or(0);
        let mut files = Vec::with_capacity(config.paths.len());
        let mut superblocks: Vec<Superblock> = Vec::with_capacity(config.paths.len());
        for (index, path) in config.paths.iter().enumerate() {
            let bad = |what: String| L2Error::File { path: path.clone(), what };
            let file = open_direct(path, false)?;
            if !lock::try_lock(&file, 0).map_err(io_error("locking", path))? {
                return Err(L2Error::InUse { path: path.clone() });
            }
            let len = file.metadata().map_err(io_error("reading the size of", path))?.len();
            if len != config.file_bytes() {
                return Err(bad(format!("{len} bytes, the config implies {}", config.file_bytes())));
            }
            let buf = aligned(SUPERBLOCK_BYTES, 2).map_err(io_error("allocating", path))?;
            let mut copies = [Err(String::new()), Err(String::new())];
            for (copy, result) in (0u32..).zip(copies.iter_mut()) {
                // SAFETY: a private buffer this function owns.
                let bytes = unsafe { buf.slot_mut(copy) }.expect("two slots");
                read_exact_at(&file, path, bytes, data_bytes + u64::from(copy) * SUPERBLOCK_BYTES)?;
                *result = decode_superblock(bytes);
            }
            drop(buf);
            let superblock = match copies {
                [Ok(a), Ok(b)] => {
                    if a.sequence >= b.sequence {
                        a
                    } else {
                        b
                    }
                }
                [Ok(a), Err(_)] => a,
                [Err(_), Ok(b)] => b,
                [Err(a), Err(_)] => return Err(bad(a)),
            };
            let expect_index = u16::try_from(index).unwrap_or(u16::MAX);
            if superblock.file_index != expect_index {
                return Err(bad(format!("file_index {} where the config puts it at {index}", superblock.file_index)));
            }
            if superblock.region != config.region_first.wrapping_add(expect_index) {
                return Err(bad(format!("region {} differs from the config's", superblock.region)));
            }
            if superblock.slot_bytes != config.slot_bytes {
                return Err(bad(format!(
                    "slot_bytes {} differs from the config's {}",
                    superblock.slot_bytes, config.slot_bytes
                )));
            }
            if superblock.slots != config.slots_per_file {
                return Err(bad(format!(
                    "slots {} differs from the config's slots_per_file {}",
                    superblock.slots, config.slots_per_file
                )));
            }
            if usize::from(superblock.files) != config.paths.len() {
                return Err(bad(format!(
                    "formatted as one of {} files, the config lists {}",
                    superblock.files,
                    config.paths.len()
                )));
            }
            if let Some(first) = superblocks.first()
                && first.set_id != superblock.set_id
            {
                return Err(bad("belongs to another tier (set id differs from the first file's)".into()));
            }
            files.push(file);
            superblocks.push(superblock);
        }
        let epoch = superblocks.iter().map(|s| s.epoch).max().unwrap_or(0) + 1;
        // The crash-safe view: a file whose last incarnation did not shut
        // down cleanly lowers the tier's clean epoch.
        let clean_epoch = superblocks.iter().map(|s| s.clean_epoch).min().unwrap_or(0);
        let mut tier = Self { config: config.clone(), files, superblocks, epoch, clean_epoch };
        tier.persist(|superblock| superblock.epoch = epoch)?;
        Ok(tier)
    }

    fn persist(&mut self, edit: impl Fn(&mut Superblock)) -> Result<(), L2Error> {
        let data_bytes = self.config.data_bytes().unwrap_or(0);
        for ((file, superblock), path) in self.files.iter().zip(&mut self.superblocks).zip(&self.config.paths) {
            edit(superblock);
            superblock.sequence += 1;
            write_superblock(file, path, data_bytes, superblock)?;
            datasync(file, path)?;
        }
        Ok(())
    }

    /// The region epoch of this incarnation (persisted).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The epoch of the last clean shutdown (0: none since format).
    pub fn clean_epoch(&self) -> u64 {
        self.clean_epoch
    }

    /// Whether the previous incarnation shut down cleanly.
    pub fn previous_shutdown_clean(&self) -> bool {
        self.clean_epoch + 1 == self.epoch
    }

    /// The geometry the poller addresses.
    pub fn geometry(&self) -> L2Geometry {
        self.config.geometry()
    }

    /// The open files, in order (for the I/O backend).
    pub fn files(&self) -> &[File] {
        &self.files
    }

    /// The files opened again (new open file descriptions, O_DIRECT) for an
    /// I/O backend. Not duplicates: a ring tears down asynchronously and
    /// may hold its files a while after it is dropped, and the tier's lock
    /// must not live on in them.
    pub fn backend_files(&self) -> Result<Vec<File>, L2Error> {
        self.files
            .iter()
            .zip(&self.config.paths)
            .map(|(file, path)| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
                    .open(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(file)))
                    .map_err(io_error("reopening", path))
            })
            .collect()
    }

    /// Records a clean shutdown: call after every write has completed and
    /// been flushed (the poller drained, a final fdatasync done). Flushes
    /// every file itself too.
    pub fn shut_down_clean(mut self) -> Result<(), L2Error> {
        for (file, path) in self.files.iter().zip(&self.config.paths) {
            datasync(file, path)?;
        }
        let epoch = self.epoch;
        self.persist(|superblock| superblock.clean_epoch = epoch)
    }

    /// Reads every slot's header (never a payload) and returns the committed
    /// objects, then checks the payload CRCs of every object not known
    /// durable (written after the last clean shutdown), dropping those that
    /// fail. `queue_depth` reads are in flight at once.
    pub fn readopt(&self, queue_depth: u32) -> Result<Readoption, L2Error> {
        let path0 = &self.config.paths[0];
        let mut backend = UringBackend::new(self.backend_files()?, queue_depth)
            .map_err(io_error("setting up io_uring for", path0))?;
        // io_uring completes in real time: its clock is not read.
        let mut now = || 0;
        readopt_over(&mut backend, &mut now, self.geometry(), self.epoch, self.clean_epoch)
            .map_err(|(what, source)| io_error(what, path0)(source))
    }
}

/// Re-adoption's scan of every L2 slot over `backend` (io_uring, or the
/// simulated disk), `now` its clock: every slot's header read (never a
/// payload), then the payload CRCs of every object not known durable
/// (written after the clean shutdown of epoch `clean_epoch`) checked, and
/// those that fail dropped. An error names what it was doing.
pub fn readopt_over<B: IoBackend>(
    backend: &mut B,
    now: &mut dyn FnMut() -> u64,
    geometry: L2Geometry,
    epoch: u64,
    clean_epoch: u64,
) -> Result<Readoption, (&'static str, io::Error)> {
    let depth = backend.queue_depth();
    let depth_u32 = u32::try_from(depth).unwrap_or(u32::MAX);
    let headers = aligned(STORED_HEADER_BYTES as u64, depth_u32).map_err(|e| ("allocating buffers for", e))?;
    let slots_total = u64::from(geometry.files) * u64::from(geometry.slots_per_file);
    let mut result = Readoption { epoch, clean_epoch, ..Readoption::default() };
    let mut suspects = Vec::new();
    // Pass 1: headers.
    let locate = |index: u64| {
        let file = u16::try_from(index / u64::from(geometry.slots_per_file)).unwrap_or(u16::MAX);
        let slot = u32::try_from(index % u64::from(geometry.slots_per_file)).unwrap_or(u32::MAX);
        (file, slot)
    };
    run_reads(
        backend,
        now,
        epoch,
        &headers,
        slots_total,
        |index| {
            let (file, slot) = locate(index);
            (file, geometry.offset(slot), HEADER_READ_BYTES)
        },
        |index, bytes, io_result| {
            let (file, slot) = locate(index);
            if io_result < 0 {
                result.unreadable.push((file, slot, io_result));
                return;
            }
            match decode_header(bytes) {
                Err(StoredError::Empty) => result.empty += 1,
                Err(e) => result.damaged.push((file, slot, e.to_string())),
                Ok(header) => {
                    let meta = *header.meta();
                    if meta.slot != slot || meta.region != geometry.region(file) {
                        result.damaged.push((
                            file,
                            slot,
                            "header names another slot or region (misdirected write)".into(),
                        ));
                    } else if meta.region_epoch > clean_epoch {
                        suspects.push(Adopted { file, slot, meta, verified: false });
                    } else {
                        result.adopted.push(Adopted { file, slot, meta, verified: false });
                    }
                }
            }
        },
    )
    .map_err(|e| ("reading slot headers of", e))?;
    drop(headers);
    // Pass 2: whole objects of the suspects, CRC-checked.
    if !suspects.is_empty() {
        let buffers = aligned(geometry.slot_bytes, depth_u32).map_err(|e| ("allocating buffers for", e))?;
        let count = suspects.len() as u64;
        let mut verified = Vec::with_capacity(suspects.len());
        run_reads(
            backend,
            now,
            epoch,
            &buffers,
            count,
            |index| {
                let suspect = &suspects[usize_from(index)];
                let len = crate::stored::object_bytes(suspect.meta.payload_len).min(geometry.slot_bytes);
                (suspect.file, geometry.offset(suspect.slot), u32::try_from(len).unwrap_or(u32::MAX))
            },
            |index, bytes, io_result| {
                let mut suspect = suspects[usize_from(index)];
                if io_result < 0 {
                    result.unreadable.push((suspect.file, suspect.slot, io_result));
                    return;
                }
                match verify_object(bytes, &suspect.meta) {
                    Ok(()) => {
                        suspect.verified = true;
                        verified.push(suspect);
                    }
                    Err(e) => result.torn.push((suspect.file, suspect.slot, e)),
                }
            },
        )
        .map_err(|e| ("reading suspect objects of", e))?;
        result.scrubbed = count;
        result.adopted.extend(verified);
    }
    result.adopted.sort_by_key(|a| (a.file, a.slot));
    Ok(result)
}

fn verify_object(bytes: &[u8], meta: &ObjectMeta) -> Result<(), String> {
    let header: DecodedHeader = decode_header(bytes).map_err(|e| e.to_string())?;
    if header.meta() != meta {
        return Err("header changed between passes".into());
    }
    let end = STORED_HEADER_BYTES + usize_from(meta.payload_len);
    let payload = bytes.get(STORED_HEADER_BYTES..end).ok_or("object longer than its slot")?;
    header.verify_payload(payload).map_err(|e| e.to_string())
}

/// Drives `count` reads through `backend`, `buffers.slots()` at a time:
/// `plan(i)` gives read `i`'s (file, offset, len); `done(i, bytes, result)`
/// gets its bytes (valid only when `result >= 0`, a byte count). A short
/// read counts as an error (`-EIO`).
fn run_reads<B: IoBackend>(
    backend: &mut B,
    now: &mut dyn FnMut() -> u64,
    epoch: u64,
    buffers: &SlotRegion,
    count: u64,
    plan: impl Fn(u64) -> (u16, u64, u32),
    mut done: impl FnMut(u64, &[u8], i32),
) -> io::Result<()> {
    let lanes = buffers.slots().min(u32::try_from(backend.queue_depth()).unwrap_or(u32::MAX));
    // Which read each lane carries.
    let mut lane_read: Vec<Option<u64>> = vec![None; lanes as usize];
    let mut next = 0u64;
    let mut finished = 0u64;
    let mut completions = vec![IoCompletion::default(); lanes as usize];
    while finished < count {
        for lane in 0..lanes {
            if next >= count || lane_read[lane as usize].is_some() {
                continue;
            }
            let (file, offset, len) = plan(next);
            let op = IoOp {
                kind: IoKind::Read,
                file,
                offset,
                buf: buffers.slot_ptr(lane).expect("lane in range"),
                len,
                tag: read_tag(epoch, lane, next),
            };
            // SAFETY: the lane's buffer is this function's alone until its
            // completion comes back below.
            if unsafe { backend.push(op) }.is_err() {
                break;
            }
            lane_read[lane as usize] = Some(next);
            next += 1;
        }
        backend.submit(now())?;
        let got = backend.complete(now(), &mut completions);
        if got == 0 {
            std::thread::yield_now();
            continue;
        }
        for completion in &completions[..got] {
            let lane = completion.tag.slot();
            // Only the completion of the read the lane carries now: not a
            // stale duplicate of an earlier one, nor one of an op a crashed
            // incarnation left on the device (another epoch).
            let Some(slot) = lane_read.get_mut(lane as usize) else { continue };
            let Some(index) = slot.filter(|&index| completion.tag == read_tag(epoch, lane, index)) else { continue };
            *slot = None;
            let (_, _, len) = plan(index);
            // SAFETY: the read into this lane has completed; nothing else
            // touches the buffer until the lane is reused.
            let bytes = unsafe { buffers.slot(lane) }.expect("lane in range");
            let result = if u32::try_from(completion.result).is_ok_and(|got| got != len) {
                -libc::EIO
            } else {
                completion.result
            };
            done(index, &bytes[..len as usize], result);
            finished += 1;
        }
    }
    Ok(())
}

/// The tag of read `index` of a re-adoption scan in `lane`: the scan's
/// epoch, the lane, and the read's number (its low 24 bits).
fn read_tag(epoch: u64, lane: u32, index: u64) -> Tag {
    Tag::new(epoch, lane, u32::try_from(index & 0xff_ffff).unwrap_or(0))
}

/// A committed object found in an L2 slot at re-adoption.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Adopted {
    /// Its file.
    pub file: u16,
    /// Its slot.
    pub slot: u32,
    /// Its header.
    pub meta: ObjectMeta,
    /// Whether its payload CRCs were checked at re-adoption (it was not
    /// known durable).
    pub verified: bool,
}

/// What re-adoption found.
#[derive(Clone, Debug, Default)]
pub struct Readoption {
    /// The new incarnation's region epoch.
    pub epoch: u64,
    /// The epoch of the last clean shutdown.
    pub clean_epoch: u64,
    /// Committed objects, ready to serve, by (file, slot).
    pub adopted: Vec<Adopted>,
    /// Slots that were never written (all-zero header).
    pub empty: u64,
    /// Slots whose header is damaged or misdirected: (file, slot, why).
    pub damaged: Vec<(u16, u32, String)>,
    /// Suspect objects whose payload failed its CRCs (torn by a crash):
    /// (file, slot, why). Never served.
    pub torn: Vec<(u16, u32, String)>,
    /// Slots that could not be read: (file, slot, -errno).
    pub unreadable: Vec<(u16, u32, i32)>,
    /// Suspect objects whose payloads were read and checked.
    pub scrubbed: u64,
}

impl Readoption {
    /// The highest generation seen per region, so new writes continue above
    /// it.
    pub fn max_generation(&self, region: RegionId) -> u32 {
        self.adopted.iter().filter(|a| a.meta.region == region).map(|a| a.meta.generation).max().unwrap_or(0)
    }
}

/// Why an L2 slot operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L2SlotError {
    /// No such file or slot.
    OutOfRange,
    /// The slot is not in use (double release).
    NotInUse,
}

impl core::fmt::Display for L2SlotError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::OutOfRange => "L2 slots: no such slot",
            Self::NotInUse => "L2 slots: the slot is not in use",
        })
    }
}

impl std::error::Error for L2SlotError {}

/// A free L2 slot handed out for a write, with the generation to stamp in
/// its header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L2Grant {
    /// Where to write.
    pub slot: crate::op::L2Slot,
    /// The generation the new object carries (above every earlier one in
    /// this slot, across restarts).
    pub generation: u32,
}

/// `lake-dp`'s allocator of L2 slots, rebuilt at every start from what
/// re-adoption found. Every list is sized at construction: allocating and
/// releasing never allocate memory.
#[derive(Debug)]
pub struct L2Slots {
    geometry: L2Geometry,
    in_use: Vec<bool>,
    /// The generation of each slot's last object (0: never written).
    generation: Vec<u32>,
    /// Free slots per file, popped from the end (lowest first).
    free: Vec<Vec<u32>>,
    /// The file the next allocation tries first (round robin spreads
    /// writes over devices).
    next_file: usize,
    /// Files being drained: nothing new is written there.
    draining: Vec<bool>,
    bytes_in_use: u64,
}

impl L2Slots {
    /// Every slot free except those re-adoption found holding objects;
    /// generations continue above the highest on disk in every slot.
    pub fn from_readoption(geometry: L2Geometry, found: &Readoption) -> Self {
        let files = usize::from(geometry.files);
        let per_file = geometry.slots_per_file as usize;
        let mut in_use = vec![false; files * per_file];
        let mut generation = vec![0u32; files * per_file];
        for adopted in &found.adopted {
            let index = usize::from(adopted.file) * per_file + adopted.slot as usize;
            if let Some(used) = in_use.get_mut(index) {
                *used = true;
                generation[index] = adopted.meta.generation;
            }
        }
        // A torn or damaged slot held some generation once: nothing is
        // known of it, so its next object starts above every generation
        // seen in the region.
        let mut bump = vec![0u32; files];
        for adopted in &found.adopted {
            if let Some(max) = bump.get_mut(usize::from(adopted.file)) {
                *max = (*max).max(adopted.meta.generation);
            }
        }
        let unknown = found.torn.iter().map(|(f, s, _)| (*f, *s)).chain(found.damaged.iter().map(|(f, s, _)| (*f, *s)));
        for (file, slot) in unknown {
            let index = usize::from(file) * per_file + slot as usize;
            if let (Some(g), Some(max)) = (generation.get_mut(index), bump.get(usize::from(file))) {
                *g = *max;
            }
        }
        // Slots the device could not read are kept out of use.
        let mut quarantined = vec![false; files * per_file];
        for &(file, slot, _) in &found.unreadable {
            if let Some(q) = quarantined.get_mut(usize::from(file) * per_file + slot as usize) {
                *q = true;
            }
        }
        let free = (0..files)
            .map(|file| {
                (0..geometry.slots_per_file)
                    .rev()
                    .filter(|&slot| {
                        let index = file * per_file + slot as usize;
                        !in_use[index] && !quarantined[index]
                    })
                    .collect()
            })
            .collect();
        let bytes_in_use = in_use.iter().filter(|&&used| used).count() as u64 * geometry.slot_bytes;
        Self { geometry, in_use, generation, free, next_file: 0, draining: vec![false; files], bytes_in_use }
    }

    fn index(&self, slot: crate::op::L2Slot) -> Option<usize> {
        (slot.file < self.geometry.files && slot.slot < self.geometry.slots_per_file)
            .then(|| usize::from(slot.file) * self.geometry.slots_per_file as usize + slot.slot as usize)
    }

    /// A free slot (files taken in turn, draining ones passed over), or
    /// `None` when the tier is full.
    pub fn allocate(&mut self) -> Option<L2Grant> {
        self.allocate_avoiding(None)
    }

    /// A free slot as [`Self::allocate`] gives, in a file other than
    /// `avoid` (a block moving off it).
    pub fn allocate_avoiding(&mut self, avoid: Option<u16>) -> Option<L2Grant> {
        let files = self.free.len();
        for step in 0..files {
            let file = (self.next_file + step) % files;
            if self.draining[file] || avoid.is_some_and(|a| usize::from(a) == file) {
                continue;
            }
            if let Some(slot) = self.free[file].pop() {
                self.next_file = (file + 1) % files;
                let slot = crate::op::L2Slot { file: u16::try_from(file).ok()?, slot };
                let index = self.index(slot)?;
                self.in_use[index] = true;
                self.bytes_in_use += self.geometry.slot_bytes;
                // 0 is never a generation; wrap to 1.
                let generation = self.generation[index].checked_add(1).unwrap_or(1);
                self.generation[index] = generation;
                return Some(L2Grant { slot, generation });
            }
        }
        None
    }

    /// Frees a slot whose object was evicted (or whose write failed).
    pub fn release(&mut self, slot: crate::op::L2Slot) -> Result<(), L2SlotError> {
        let index = self.index(slot).ok_or(L2SlotError::OutOfRange)?;
        if !self.in_use[index] {
            return Err(L2SlotError::NotInUse);
        }
        self.in_use[index] = false;
        self.bytes_in_use -= self.geometry.slot_bytes;
        // Capacity is the file's slot count: never grows.
        self.free[usize::from(slot.file)].push(slot.slot);
        Ok(())
    }

    /// Whether `slot` is allocated (holds an object, or one is being
    /// written there).
    pub fn in_use(&self, slot: crate::op::L2Slot) -> bool {
        self.index(slot).is_some_and(|index| self.in_use[index])
    }

    /// Bytes of slots holding objects.
    pub fn bytes_in_use(&self) -> u64 {
        self.bytes_in_use
    }

    /// Free slots, all files together.
    pub fn free_slots(&self) -> u64 {
        self.free.iter().map(|f| f.len() as u64).sum()
    }

    /// Drains `file` (nothing new is written there) or uses it again.
    /// Errors if the tier has no such file.
    pub fn set_draining(&mut self, file: u16, draining: bool) -> Result<(), L2SlotError> {
        let flag = self.draining.get_mut(usize::from(file)).ok_or(L2SlotError::OutOfRange)?;
        *flag = draining;
        Ok(())
    }

    /// Uses every file again (a new control plane holds no drain yet).
    pub fn undrain_all(&mut self) {
        self.draining.iter_mut().for_each(|d| *d = false);
    }

    /// Whether `file` is being drained.
    pub fn is_draining(&self, file: u16) -> bool {
        self.draining.get(usize::from(file)).copied().unwrap_or(false)
    }

    /// Slots of `file` holding objects.
    pub fn in_use_in(&self, file: u16) -> u64 {
        let per_file = self.geometry.slots_per_file as usize;
        let start = usize::from(file) * per_file;
        self.in_use.get(start..start + per_file).map_or(0, |s| s.iter().filter(|&&u| u).count() as u64)
    }
}
