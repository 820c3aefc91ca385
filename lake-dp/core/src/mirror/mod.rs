//! The shared-memory mirror of a node's location view: the table engines
//! and `lake-dp` read, lock-free, to find a prompt's longest cached prefix
//! and its block table without asking `lake-cp`.
//!
//! One writer — the node's `lake-cp`, holding an OFD lock on byte 0 of the
//! file for as long as it writes — and any number of readers in other
//! processes, who map the file read-only. The table is open addressing
//! with linear probing from a key's home bucket (the key's first eight
//! bytes scaled to the bucket count); each 32-byte bucket holds the whole
//! key and a compact location under a per-bucket sequence lock
//! ([`seqlock`]), so a reader verifies the key and never sees a torn entry.
//!
//! - **Removal moves entries back** (backward-shift deletion), so probes
//!   stay short under churn and the table never fills with markers. An
//!   entry is copied to its new bucket before its old one is reused, so it
//!   is never absent — but a reader whose probe passed the new bucket just
//!   before the copy could miss it. A table-wide move count (odd while
//!   moving, like a bucket's sequence count) closes that: a reader whose
//!   probe missed re-checks the count and looks again if it changed. Hits
//!   need no such check. The writer keeps a tenth of the buckets empty, so
//!   every miss ends at an empty bucket;
//!   [`MirrorControl::max_probe`](layout::MirrorControl) bounds every
//!   probe.
//! - **A writer that dies mid-update** leaves one bucket with an odd count:
//!   readers give up on it after a few attempts (a miss, never a wrong
//!   answer), and the next writer's [`MirrorWriter::take_over`] repairs it
//!   (marks it void: skipped by probes, reused by inserts; the new
//!   `lake-cp` re-publishes what its index holds), drops the duplicate a
//!   move cut short may have left, and writes its higher term.
//! - **Generation-checked**: an entry names the replica's slot and the
//!   slot's generation; a reader pins the slot and re-checks the
//!   generation in the arena before trusting the bytes (DESIGN §3), so a
//!   stale entry costs a miss, not wrong data.
//!
//! Layout in [`layout`]; `docs/formats.md` has the same in prose.

pub mod layout;
mod raw;
pub mod seqlock;
pub mod table;
pub mod view;
mod wake;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use memmap2::{Mmap, MmapOptions, MmapRaw};

use crate::model::key::BlockKey;
use crate::model::replica::{NodeId, ObjectKind, RegionId, Tier};
use crate::{lock, shm};
use layout::{
    BUCKET_BYTES, BUCKETS_OFFSET, CONTROL_OFFSET, MirrorControl, MirrorHeader, REGIONS_MAX, REGIONS_OFFSET,
    STATE_READY, STATE_RETIRED,
};
use seqlock::{Bucket, Snapshot};
use table::{STATE_LIVE, STATE_VOID, Table, home};

/// The lock byte the writer holds.
const WRITER_LOCK_BYTE: u64 = 0;

/// Why a mirror operation failed.
#[derive(Debug)]
pub enum MirrorError {
    /// A configuration field is wrong; the text names it.
    Config(&'static str),
    /// A system call failed.
    Io {
        /// What was being done.
        what: &'static str,
        /// The file, where there is one.
        path: Option<PathBuf>,
        /// The error.
        source: io::Error,
    },
    /// Not enough shared memory or huge pages.
    NoSpace {
        /// Bytes asked for.
        bytes: u64,
        /// What to check.
        hint: &'static str,
    },
    /// The header is wrong; the text names the field.
    Header(&'static str),
    /// Another layout version made the mirror.
    Version {
        /// The mirror's version.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The writer has not finished building it (or died doing it).
    NotReady,
    /// Its writer retired it.
    Retired,
    /// A live writer holds it.
    InUse {
        /// Its pid as recorded (0 if unreadable).
        pid: u32,
    },
    /// Taking over needs a term above the mirror's.
    StaleTerm {
        /// The mirror's term.
        current: u64,
        /// The term offered.
        offered: u64,
    },
    /// The table is as full as it may get (9/10 of its buckets live).
    Full,
    /// An entry cannot be stored; the text names the field.
    Entry(&'static str),
}

impl PartialEq for MirrorError {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Config(a), Self::Config(b))
            | (Self::Header(a), Self::Header(b))
            | (Self::Entry(a), Self::Entry(b)) => a == b,
            (Self::Io { what: a, path: p, source: s }, Self::Io { what: b, path: q, source: t }) => {
                a == b && p == q && s.kind() == t.kind()
            }
            (Self::NoSpace { bytes: a, .. }, Self::NoSpace { bytes: b, .. }) => a == b,
            (Self::Version { found: a, supported: x }, Self::Version { found: b, supported: y }) => a == b && x == y,
            (Self::InUse { pid: a }, Self::InUse { pid: b }) => a == b,
            (Self::StaleTerm { current: a, offered: x }, Self::StaleTerm { current: b, offered: y }) => {
                a == b && x == y
            }
            (Self::NotReady, Self::NotReady) | (Self::Retired, Self::Retired) | (Self::Full, Self::Full) => true,
            _ => false,
        }
    }
}

impl core::fmt::Display for MirrorError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Config(field) => write!(f, "mirror config: {field}"),
            Self::Io { what, path: Some(path), source } => write!(f, "mirror: {what} {}: {source}", path.display()),
            Self::Io { what, path: None, source } => write!(f, "mirror: {what}: {source}"),
            Self::NoSpace { bytes, hint } => write!(f, "mirror: no room for {bytes} bytes: {hint}"),
            Self::Header(field) => write!(f, "mirror header: {field}"),
            Self::Version { found, supported } => {
                write!(f, "mirror layout version {found}; this build reads version {supported}")
            }
            Self::NotReady => f.write_str("mirror: its writer has not finished building it"),
            Self::Retired => f.write_str("mirror: retired by its writer"),
            Self::InUse { pid } => write!(f, "mirror: a live writer (pid {pid}) holds it"),
            Self::StaleTerm { current, offered } => {
                write!(f, "mirror: term {offered} offered, the mirror is at term {current}")
            }
            Self::Full => f.write_str("mirror: table full (9/10 of buckets used); rebuild it larger"),
            Self::Entry(field) => write!(f, "mirror entry: {field}"),
        }
    }
}

impl std::error::Error for MirrorError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn io_error(what: &'static str, path: Option<&Path>) -> impl FnOnce(io::Error) -> MirrorError {
    let path = path.map(Path::to_path_buf);
    move |source| MirrorError::Io { what, path, source }
}

/// What memory backs the mirror (a file on a tmpfs can be taken over by
/// a later writer).
pub use crate::shm::Backing as MirrorBacking;

/// How to build a mirror.
#[derive(Clone, Debug)]
pub struct MirrorConfig {
    /// Where its memory comes from.
    pub backing: MirrorBacking,
    /// Buckets in the table (rounded up to fill the last page).
    pub buckets: u64,
    /// The node whose replicas it shows.
    pub node: NodeId,
    /// The writer's term.
    pub term: u64,
    /// Permission bits of the file.
    pub mode: u32,
}

impl MirrorConfig {
    /// A mirror for `entries` live entries at a load of 0.7 (probes stay
    /// short).
    pub fn for_entries(backing: MirrorBacking, entries: u64) -> Self {
        Self { backing, buckets: (entries.saturating_mul(10) / 7).max(64), node: NodeId(0), term: 1, mode: 0o600 }
    }
}

/// A mirror entry: where the block's fastest ready replica is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MirrorEntry {
    /// What the object is.
    pub kind: ObjectKind,
    /// The tier of the replica named here.
    pub tier: Tier,
    /// Every tier holding a ready replica: bit `tier as u8`.
    pub tiers: u8,
    /// The replica's region (below [`layout::REGIONS_MAX`]).
    pub region: RegionId,
    /// The region epoch's tag (see [`RegionRecord::epoch_tag`]).
    pub epoch_tag: u8,
    /// The slot in the region.
    pub slot: u32,
    /// The slot's generation when the replica was written.
    pub generation: u32,
}

fn tier_from(bits: u32) -> Tier {
    Tier::ALL[(bits & 3) as usize]
}

fn kind_bits(kind: ObjectKind) -> u32 {
    match kind {
        ObjectKind::KvBlock => 1,
        ObjectKind::RecurrentState => 2,
    }
}

impl MirrorEntry {
    fn encode(&self, key: &BlockKey) -> Result<Snapshot, MirrorError> {
        if u32::from(self.region.0) >= REGIONS_MAX {
            return Err(MirrorError::Entry("region: at most 1023 in a mirror"));
        }
        if self.tiers > 0xf {
            return Err(MirrorError::Entry("tiers: one bit per tier, four tiers"));
        }
        let meta = STATE_LIVE
            | kind_bits(self.kind) << 2
            | (self.tier as u32) << 4
            | u32::from(self.tiers) << 6
            | u32::from(self.epoch_tag) << 10
            | u32::from(self.region.0) << 18;
        let (lo, hi) = key_words(key);
        Ok(Snapshot { meta, words: [lo, hi, u64::from(self.slot) | u64::from(self.generation) << 32] })
    }

    fn decode(snapshot: &Snapshot) -> Option<Self> {
        let meta = snapshot.meta;
        if meta & 3 != STATE_LIVE {
            return None;
        }
        let kind = match (meta >> 2) & 3 {
            1 => ObjectKind::KvBlock,
            2 => ObjectKind::RecurrentState,
            _ => return None,
        };
        #[allow(clippy::cast_possible_truncation)] // masked fields of a packed word
        Some(Self {
            kind,
            tier: tier_from(meta >> 4),
            tiers: ((meta >> 6) & 0xf) as u8,
            epoch_tag: ((meta >> 10) & 0xff) as u8,
            region: RegionId(((meta >> 18) & 0x3ff) as u16),
            slot: snapshot.words[2] as u32,
            generation: (snapshot.words[2] >> 32) as u32,
        })
    }
}

/// A region as the mirror records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionRecord {
    /// Its tier.
    pub tier: Tier,
    /// Its current epoch.
    pub epoch: u64,
    /// The tag entries written under this epoch carry.
    pub epoch_tag: u8,
    /// Its node.
    pub node: NodeId,
}

impl RegionRecord {
    fn encode(&self) -> Snapshot {
        Snapshot {
            meta: 1 | (self.tier as u32) << 1 | u32::from(self.epoch_tag) << 8,
            words: [self.epoch, u64::from(self.node.0), 0],
        }
    }

    fn decode(snapshot: &Snapshot) -> Option<Self> {
        if snapshot.meta & 1 == 0 {
            return None;
        }
        #[allow(clippy::cast_possible_truncation)] // masked fields of a packed word
        Some(Self {
            tier: tier_from(snapshot.meta >> 1),
            epoch: snapshot.words[0],
            epoch_tag: ((snapshot.meta >> 8) & 0xff) as u8,
            node: NodeId(snapshot.words[1] as u32),
        })
    }
}

#[inline]
fn key_words(key: &BlockKey) -> (u64, u64) {
    let k = &key.0;
    (
        u64::from_le_bytes([k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]]),
        u64::from_le_bytes([k[8], k[9], k[10], k[11], k[12], k[13], k[14], k[15]]),
    )
}

/// The mapped file, for reader and writer alike.
struct Shared {
    base: *const u8,
    header: MirrorHeader,
}

// SAFETY: `base` points into a shared mapping that lives as long as the
// owning reader or writer; every access through it is an atomic access of
// a `Bucket` or of the control words, which are safe to share.
unsafe impl Send for Shared {}
// SAFETY: as above: only atomics are reached through `base`.
unsafe impl Sync for Shared {}

impl Shared {
    fn control(&self) -> &MirrorControl {
        // SAFETY: the mapping holds page 0 (decode_header checked the file
        // size, which is at least BUCKETS_OFFSET); CONTROL_OFFSET is 8-byte
        // aligned in a page-aligned mapping; the control words are atomics,
        // valid for any bit pattern.
        unsafe { &*self.base.wrapping_add(CONTROL_OFFSET).cast::<MirrorControl>() }
    }

    fn buckets(&self) -> &[Bucket] {
        // SAFETY: decode_header checked total_bytes = BUCKETS_OFFSET +
        // buckets × 32 and that it equals the mapped file's size; the
        // offset is 32-byte aligned in a page-aligned mapping; a Bucket is
        // atomics only, valid for any bit pattern and shared by design.
        unsafe {
            core::slice::from_raw_parts(
                self.base.wrapping_add(crate::usize_from(BUCKETS_OFFSET)).cast::<Bucket>(),
                crate::usize_from(self.header.buckets),
            )
        }
    }

    fn regions(&self) -> &[Bucket] {
        // SAFETY: as for `buckets`: the region records lie between page 0
        // and the table, inside the checked mapping.
        unsafe {
            core::slice::from_raw_parts(
                self.base.wrapping_add(crate::usize_from(REGIONS_OFFSET)).cast::<Bucket>(),
                REGIONS_MAX as usize,
            )
        }
    }

    #[inline]
    fn bucket(&self, position: u64) -> &Bucket {
        &self.buckets()[crate::usize_from(position)]
    }

    fn table(&self) -> Table<'_> {
        let control = self.control();
        Table { buckets: self.buckets(), moves: &control.moves, max_probe: &control.max_probe }
    }

    #[inline]
    fn prefetch(&self, key: &BlockKey) {
        let (lo, _) = key_words(key);
        let position = home(lo, self.header.buckets);
        prefetch(core::ptr::from_ref(self.bucket(position)).cast());
    }

    /// The live entry for `key`: `Ok(None)` if absent, `Err(())` if that
    /// could not be told (see [`Table::find`]).
    #[inline]
    fn find(&self, key: &BlockKey) -> Result<Option<MirrorEntry>, ()> {
        let (lo, hi) = key_words(key);
        let found = self.table().find(lo, hi).map_err(|table::Untold| ())?;
        Ok(found.and_then(|snapshot| MirrorEntry::decode(&snapshot)))
    }
}

#[inline]
fn prefetch(ptr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults, whatever the address;
    // SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

impl From<shm::ShmError> for MirrorError {
    fn from(error: shm::ShmError) -> Self {
        match error {
            shm::ShmError::Io { what, path, source } => Self::Io { what, path, source },
            shm::ShmError::NotTmpfs => Self::Config("backing: the path is not on a tmpfs"),
            shm::ShmError::NotHugetlbfs => Self::Config("backing: the path is not on a hugetlbfs mount"),
            shm::ShmError::NoSpace { bytes, hint } => Self::NoSpace { bytes, hint },
            shm::ShmError::TooLarge => Self::Config("mirror too large"),
        }
    }
}

/// The writer: the node's `lake-cp`. See the module docs.
pub struct MirrorWriter {
    shared: Shared,
    map: MmapRaw,
    file: File,
    path: Option<PathBuf>,
    live: u64,
    /// An entry published since the readers were last woken.
    published: bool,
}

impl core::fmt::Debug for MirrorWriter {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MirrorWriter")
            .field("path", &self.path)
            .field("buckets", &self.shared.header.buckets)
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

impl MirrorWriter {
    /// Builds a new mirror (under a temporary name, renamed into place when
    /// ready, so a reader never finds half a mirror). A file at the path
    /// whose writer is alive is refused; one whose writer is gone is
    /// replaced.
    pub fn create(config: &MirrorConfig) -> Result<Self, MirrorError> {
        Self::create_as(config, layout::MIRROR)
    }

    /// [`MirrorWriter::create`] of a table of this layout of another kind
    /// (the cluster view).
    pub(crate) fn create_as(config: &MirrorConfig, kind: layout::TableKind) -> Result<Self, MirrorError> {
        let (file, target, building) = open_backing(config)?;
        let result = Self::build(config, kind, file, target.as_deref(), building.as_deref());
        if result.is_err()
            && let Some(building) = &building
        {
            let _ = std::fs::remove_file(building);
        }
        result
    }

    fn build(
        config: &MirrorConfig,
        kind: layout::TableKind,
        file: File,
        target: Option<&Path>,
        building: Option<&Path>,
    ) -> Result<Self, MirrorError> {
        let (huge, block_bytes) = shm::check(&config.backing, &file, building)?;
        let page = if huge { block_bytes.max(4096) } else { 4096 };
        if config.buckets == 0 {
            return Err(MirrorError::Config("buckets: at least 1"));
        }
        // Fill the last page with buckets.
        let bytes = (BUCKETS_OFFSET + config.buckets.saturating_mul(u64::from(BUCKET_BYTES))).next_multiple_of(page);
        let buckets = (bytes - BUCKETS_OFFSET) / u64::from(BUCKET_BYTES);
        let header = layout::plan_as(kind, buckets, config.node.0)?;
        file.set_len(header.total_bytes).map_err(io_error("sizing", building))?;
        if !lock::try_lock(&file, WRITER_LOCK_BYTE).map_err(io_error("locking", building))? {
            return Err(MirrorError::Config("backing: another process locked the new mirror file"));
        }
        let map = shm::reserve_and_map(&file, header.total_bytes, huge, building)?;
        let bytes = bytemuck::bytes_of(&header);
        // SAFETY: the header fits in page 0 of the fresh mapping, which no
        // reader can have found yet (building name or unshared memfd).
        unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), map.as_mut_ptr(), bytes.len()) };
        // The buckets and region records are zero: empty, absent.
        let writer = Self {
            shared: Shared { base: map.as_ptr(), header },
            map,
            file,
            path: target.map(Path::to_path_buf),
            live: 0,
            published: false,
        };
        let control = writer.shared.control();
        control.term.store(config.term, Ordering::Relaxed);
        control.writer_pid.store(std::process::id(), Ordering::Relaxed);
        // Release: publishes the header to readers' Acquire load of the
        // state.
        control.state.store(STATE_READY, Ordering::Release);
        shm::publish(building, target)?;
        Ok(writer)
    }

    /// Takes over the mirror at `path` whose writer died: checks it, takes
    /// the writer lock, repairs every bucket left mid-update (marks it
    /// void and rebuilds its cluster), recounts, and writes `term` (which must be above the
    /// mirror's). Readers keep reading throughout. Returns the writer and
    /// how many buckets were repaired.
    pub fn take_over(path: &Path, term: u64) -> Result<(Self, u64), MirrorError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_error("opening", Some(path)))?;
        let size = file.metadata().map_err(io_error("reading", Some(path)))?.len();
        let mut page = vec![0u8; size_of::<MirrorHeader>()];
        read_exact_at(&file, &mut page, 0).map_err(io_error("reading the header of", Some(path)))?;
        let header = layout::decode_header(&page, size)?;
        if !lock::try_lock(&file, WRITER_LOCK_BYTE).map_err(io_error("locking", Some(path)))? {
            let map = MmapOptions::new().len(HEADER_BYTES_USIZE).map_raw_read_only(&file);
            let pid =
                map.map_or(0, |map| Shared { base: map.as_ptr(), header }.control().writer_pid.load(Ordering::Relaxed));
            return Err(MirrorError::InUse { pid });
        }
        let map = MmapOptions::new()
            .len(crate::usize_from(header.total_bytes))
            .map_raw(&file)
            .map_err(io_error("mapping", Some(path)))?;
        let mut writer = Self {
            shared: Shared { base: map.as_ptr(), header },
            map,
            file,
            path: Some(path.to_path_buf()),
            live: 0,
            published: false,
        };
        let control = writer.shared.control();
        match control.state.load(Ordering::Acquire) {
            STATE_READY => {}
            STATE_RETIRED => return Err(MirrorError::Retired),
            _ => return Err(MirrorError::NotReady),
        }
        let current = control.term.load(Ordering::Relaxed);
        if term <= current {
            return Err(MirrorError::StaleTerm { current, offered: term });
        }
        let repaired = writer.repair();
        let control = writer.shared.control();
        control.repaired.fetch_add(repaired, Ordering::Relaxed);
        control.writer_pid.store(std::process::id(), Ordering::Relaxed);
        control.term.store(term, Ordering::Release);
        Ok((writer, repaired))
    }

    /// Repairs what a dead writer left: buckets mid-update are voided and
    /// their clusters rebuilt (every cluster, if it died moving entries),
    /// so each entry is in the table once and in order; recounts live
    /// entries and the probe bound. Returns how many buckets and
    /// duplicates it fixed.
    fn repair(&mut self) -> u64 {
        let void = Snapshot { meta: STATE_VOID, words: [0; 3] };
        let mut repaired = 0;
        for record in self.shared.regions() {
            if record.is_mid_update() {
                record.repair(Snapshot { meta: 0, words: [0; 3] });
                repaired += 1;
            }
        }
        for bucket in self.shared.buckets() {
            if bucket.is_mid_update() {
                bucket.repair(void);
                repaired += 1;
            }
        }
        let table = self.shared.table();
        let moving = table.moves.load(Ordering::Relaxed) & 1 == 1;
        let (live, dropped, _) = table.rebuild(moving);
        self.live = live;
        self.publish_counts();
        repaired + dropped
    }

    /// Publishes `entry` for `key` (inserting or replacing).
    pub fn upsert(&mut self, key: &BlockKey, entry: &MirrorEntry) -> Result<(), MirrorError> {
        let snapshot = entry.encode(key)?;
        self.upsert_raw(key, snapshot)
    }

    /// Publishes the bucket words of `key` as they are (a table of this
    /// layout whose entries are not [`MirrorEntry`]s: the cluster view).
    pub(crate) fn upsert_raw(&mut self, key: &BlockKey, snapshot: Snapshot) -> Result<(), MirrorError> {
        if key.is_none() {
            return Err(MirrorError::Entry("key: the all-zero key is reserved"));
        }
        let table = self.shared.table();
        if let Some(position) = self.position(key) {
            table.bucket(position).write(snapshot);
            self.published = true;
            return Ok(());
        }
        if (self.live + 1) * 10 > table.len() * 9 || !table.insert(snapshot) {
            return Err(MirrorError::Full);
        }
        self.live += 1;
        self.published = true;
        self.publish_counts();
        Ok(())
    }

    /// The bucket words published for `key`, as the writer sees them.
    pub(crate) fn get_raw(&self, key: &BlockKey) -> Option<Snapshot> {
        self.position(key).map(|p| self.shared.bucket(p).peek())
    }

    /// Writes record `index` of the region records as it is.
    pub(crate) fn set_record_raw(&mut self, index: usize, snapshot: Snapshot) -> Result<(), MirrorError> {
        let slot = self.shared.regions().get(index).ok_or(MirrorError::Entry("record: at most 1023"))?;
        slot.write(snapshot);
        Ok(())
    }

    /// Withdraws `key`, moving later entries of its cluster back (see the
    /// module docs). Returns whether it was published.
    pub fn remove(&mut self, key: &BlockKey) -> bool {
        let Some(position) = self.position(key) else { return false };
        self.shared.table().remove_at(position);
        self.live -= 1;
        self.publish_counts();
        true
    }

    /// Withdraws every entry (a new leader that took the mirror over
    /// republishes what its data planes re-adopt; nothing of its
    /// predecessor's view outlives that). Readers see misses meanwhile.
    /// Returns how many were withdrawn.
    pub fn clear(&mut self) -> u64 {
        let table = self.shared.table();
        let mut removed = 0;
        for position in 0..table.len() {
            // A removal moves a later entry of the cluster into the hole.
            while table.bucket(position).peek().meta & 3 == STATE_LIVE {
                table.remove_at(position);
                removed += 1;
            }
        }
        self.live = 0;
        self.publish_counts();
        removed
    }

    fn position(&self, key: &BlockKey) -> Option<u64> {
        let (lo, hi) = key_words(key);
        self.shared.table().position(lo, hi)
    }

    /// The entry published for `key`, as the writer sees it.
    pub fn get(&self, key: &BlockKey) -> Option<MirrorEntry> {
        self.position(key).and_then(|p| MirrorEntry::decode(&self.shared.bucket(p).peek()))
    }

    fn publish_counts(&self) {
        self.shared.control().live.store(self.live, Ordering::Relaxed);
    }

    /// Publishes a region's record (tier, epoch, tag).
    pub fn set_region(&mut self, region: RegionId, record: &RegionRecord) -> Result<(), MirrorError> {
        let slot =
            self.shared.regions().get(usize::from(region.0)).ok_or(MirrorError::Entry("region: at most 1023"))?;
        slot.write(record.encode());
        Ok(())
    }

    /// Withdraws a region's record.
    pub fn clear_region(&mut self, region: RegionId) -> Result<(), MirrorError> {
        let slot =
            self.shared.regions().get(usize::from(region.0)).ok_or(MirrorError::Entry("region: at most 1023"))?;
        slot.write(Snapshot { meta: 0, words: [0; 3] });
        Ok(())
    }

    /// Marks the mirror retired (readers detach) and lets go of it.
    pub fn retire(self) {
        self.shared.control().state.store(STATE_RETIRED, Ordering::Release);
    }

    /// Live entries.
    pub fn live(&self) -> u64 {
        self.live
    }

    /// The longest probe a live entry needs.
    pub fn max_probe(&self) -> u32 {
        self.shared.control().max_probe.load(Ordering::Relaxed)
    }

    /// The header.
    pub fn header(&self) -> &MirrorHeader {
        &self.shared.header
    }

    /// The file's path (none for a memfd).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The mirror's descriptor (to pass a memfd to readers).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Leaves the bucket of `key` mid-update, as a writer killed inside a
    /// write would (for tests of the repair).
    #[doc(hidden)]
    pub fn abandon_update_of(&self, key: &BlockKey) -> bool {
        self.position(key).is_some_and(|p| {
            self.shared.bucket(p).abandon_update();
            true
        })
    }

    /// Bytes mapped (for reports).
    pub fn mapped_bytes(&self) -> usize {
        self.map.len()
    }
}

const HEADER_BYTES_USIZE: usize = layout::HEADER_BYTES as usize;

fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

fn open_backing(config: &MirrorConfig) -> Result<(File, Option<PathBuf>, Option<PathBuf>), MirrorError> {
    // A live writer keeps its mirror.
    if let MirrorBacking::Shm(path) | MirrorBacking::HugetlbFs(path) = &config.backing
        && let Ok(existing) = OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path)
        && lock::held_by_other(&existing, WRITER_LOCK_BYTE).map_err(io_error("checking the lock of", Some(path)))?
    {
        return Err(MirrorError::InUse { pid: 0 });
    }
    Ok(shm::create(&config.backing, config.mode, "lake-mirror")?)
}

/// A reader: an engine's agent or `lake-dp`. Maps the mirror read-only.
pub struct MirrorReader {
    shared: Shared,
    _map: Mmap,
    file: File,
}

impl core::fmt::Debug for MirrorReader {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MirrorReader").field("buckets", &self.shared.header.buckets).finish_non_exhaustive()
    }
}

/// What a lookup of one key found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Published: where.
    Hit(MirrorEntry),
    /// Not published.
    Miss,
    /// Could not be told: a bucket on the key's path was left mid-update
    /// by a dead writer (until the next writer repairs it), or the writer
    /// kept moving entries under every attempt. Treat as a miss.
    Unreadable,
}

impl Lookup {
    /// Whether the key is published.
    pub fn is_hit(&self) -> bool {
        matches!(self, Self::Hit(_))
    }
}

impl MirrorReader {
    /// Maps the mirror at `path`.
    pub fn attach(path: &Path) -> Result<Self, MirrorError> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_error("opening", Some(path)))?;
        Self::attach_file(file, Some(path))
    }

    /// Maps the mirror behind `fd` (passed over a socket).
    pub fn attach_fd(fd: OwnedFd) -> Result<Self, MirrorError> {
        Self::attach_file(File::from(fd), None)
    }

    /// Maps the table of this layout of another kind at `path` (the
    /// cluster view).
    pub(crate) fn attach_as(path: &Path, kind: layout::TableKind) -> Result<Self, MirrorError> {
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_error("opening", Some(path)))?;
        Self::attach_file_as(file, Some(path), kind)
    }

    /// Maps the same mirror again, through a copy of its descriptor (for
    /// another thread's reads).
    pub fn reopen(&self) -> Result<Self, MirrorError> {
        self.reopen_as(layout::MIRROR)
    }

    /// Maps the table behind `fd` (passed over a socket), of this layout
    /// of another kind (the cluster view).
    pub(crate) fn attach_fd_as(fd: OwnedFd, kind: layout::TableKind) -> Result<Self, MirrorError> {
        Self::attach_file_as(File::from(fd), None, kind)
    }

    /// [`MirrorReader::reopen`] of a table of this layout of another kind.
    pub(crate) fn reopen_as(&self, kind: layout::TableKind) -> Result<Self, MirrorError> {
        Self::attach_file_as(self.file.try_clone().map_err(io_error("duplicating", None))?, None, kind)
    }

    fn attach_file(file: File, path: Option<&Path>) -> Result<Self, MirrorError> {
        Self::attach_file_as(file, path, layout::MIRROR)
    }

    fn attach_file_as(file: File, path: Option<&Path>, kind: layout::TableKind) -> Result<Self, MirrorError> {
        let size = file.metadata().map_err(io_error("reading", path))?.len();
        let mut page = vec![0u8; size_of::<MirrorHeader>()];
        read_exact_at(&file, &mut page, 0).map_err(io_error("reading the header of", path))?;
        let header = layout::decode_header_as(kind, &page, size)?;
        // SAFETY: the file is a mirror of `size` bytes (checked above);
        // mapped shared and read-only, it is only ever read through
        // atomics, so the writer's concurrent stores are no data race.
        let map =
            unsafe { MmapOptions::new().len(crate::usize_from(size)).map(&file) }.map_err(io_error("mapping", path))?;
        let reader = Self { shared: Shared { base: map.as_ptr(), header }, _map: map, file };
        match reader.shared.control().state.load(Ordering::Acquire) {
            STATE_READY => Ok(reader),
            STATE_RETIRED => Err(MirrorError::Retired),
            _ => Err(MirrorError::NotReady),
        }
    }

    /// Whether the mirror is valid (its writer has not retired it).
    pub fn is_ready(&self) -> bool {
        self.shared.control().state.load(Ordering::Acquire) == STATE_READY
    }

    /// The writer's term.
    pub fn term(&self) -> u64 {
        self.shared.control().term.load(Ordering::Acquire)
    }

    /// Whether a writer holds the mirror now (a system call: ask now and
    /// then, not per lookup).
    pub fn writer_alive(&self) -> bool {
        lock::held_by_other(&self.file, WRITER_LOCK_BYTE).unwrap_or(false)
    }

    /// Buckets found mid-update and repaired so far.
    pub fn repaired(&self) -> u64 {
        self.shared.control().repaired.load(Ordering::Relaxed)
    }

    /// Live entries (as the writer last counted).
    pub fn live(&self) -> u64 {
        self.shared.control().live.load(Ordering::Relaxed)
    }

    /// The header.
    pub fn header(&self) -> &MirrorHeader {
        &self.shared.header
    }

    /// Looks one key up.
    #[inline]
    pub fn get(&self, key: &BlockKey) -> Lookup {
        match self.shared.find(key) {
            Ok(Some(entry)) => Lookup::Hit(entry),
            Ok(None) => Lookup::Miss,
            Err(()) => Lookup::Unreadable,
        }
    }

    /// The bucket words published for `key`: `Err(())` where that could not
    /// be told (see [`Lookup::Unreadable`]).
    #[inline]
    pub(crate) fn get_raw(&self, key: &BlockKey) -> Result<Option<Snapshot>, ()> {
        let (lo, hi) = key_words(key);
        self.shared.table().find(lo, hi).map_err(|table::Untold| ())
    }

    #[inline]
    pub(crate) fn prefetch(&self, key: &BlockKey) {
        self.shared.prefetch(key);
    }

    /// Record `index` of the region records as it is (none while it is
    /// being written).
    pub(crate) fn record_raw(&self, index: usize) -> Option<Snapshot> {
        self.shared.regions().get(index)?.read()
    }

    /// A region's record.
    pub fn region(&self, region: RegionId) -> Option<RegionRecord> {
        let record = self.shared.regions().get(usize::from(region.0))?.read()?;
        RegionRecord::decode(&record)
    }

    /// How many leading keys of a prompt's chain are published, assuming
    /// the published set is prefix-closed (eviction is leaf-first): a
    /// binary search, prefetching both possible next probes. Cheap, and an
    /// upper bound only where the set has a hole: [`MirrorReader::block_table`]
    /// reads every entry and stops at the first missing one, which makes
    /// the pair exact whatever the set.
    pub fn longest_prefix(&self, keys: &[BlockKey]) -> usize {
        fn mid(lo: usize, hi: usize) -> usize {
            lo + (hi - lo) / 2
        }
        let (mut lo, mut hi) = (0usize, keys.len());
        while lo < hi {
            let m = mid(lo, hi);
            // Two levels ahead: whichever way this probe and the next go,
            // their buckets are already on the way.
            for (a, b) in [(m + 1, hi), (lo, m)] {
                if a < b {
                    let n = mid(a, b);
                    self.shared.prefetch(&keys[n]);
                    for (c, d) in [(n + 1, b), (a, n)] {
                        if c < d {
                            self.shared.prefetch(&keys[mid(c, d)]);
                        }
                    }
                }
            }
            if matches!(self.shared.find(&keys[m]), Ok(Some(_))) {
                lo = m + 1;
            } else {
                hi = m;
            }
        }
        lo
    }

    /// The entries of `keys` in order, into `out` (cleared first), up to
    /// the first key not published (or unreadable). Returns how many.
    pub fn block_table(&self, keys: &[BlockKey], out: &mut Vec<MirrorEntry>) -> usize {
        // Buckets are fetched this many keys ahead, so their misses overlap
        // (Robin Hood order keeps most entries on their home's line).
        const AHEAD: usize = 16;
        out.clear();
        for key in keys.iter().take(AHEAD) {
            self.shared.prefetch(key);
        }
        for (i, key) in keys.iter().enumerate() {
            if let Some(next) = keys.get(i + AHEAD) {
                self.shared.prefetch(next);
            }
            match self.shared.find(key) {
                Ok(Some(entry)) => out.push(entry),
                _ => break,
            }
        }
        out.len()
    }

    /// The longest usable prefix and its block table: a binary search, then
    /// every entry read and checked (see [`MirrorReader::longest_prefix`]).
    pub fn lookup(&self, keys: &[BlockKey], out: &mut Vec<MirrorEntry>) -> usize {
        let bound = self.longest_prefix(keys);
        self.block_table(&keys[..bound], out)
    }

    /// Where a hybrid model resumes: the KV hit of [`MirrorReader::lookup`]
    /// (its block table into `out`), the deepest position `p` at most that
    /// hit whose block `keys[p - 1]` has a recurrent-state checkpoint
    /// published ([`BlockKey::state_key`]; 0 for none), and the
    /// checkpoint's entry. Probes back from the hit one key at a time: it
    /// costs the distance to the checkpoint (the engine's checkpoint
    /// interval), not the prompt.
    pub fn lookup_with_state(
        &self,
        keys: &[BlockKey],
        out: &mut Vec<MirrorEntry>,
    ) -> (usize, usize, Option<MirrorEntry>) {
        let kv = self.lookup(keys, out);
        for position in (1..=kv).rev() {
            if let Ok(Some(entry)) = self.shared.find(&keys[position - 1].state_key())
                && entry.kind == ObjectKind::RecurrentState
            {
                return (kv, position, Some(entry));
            }
        }
        (kv, 0, None)
    }
}

#[cfg(test)]
mod tests;
