//! The L1 arena: host DRAM in shared memory, carved into fixed-size slots
//! per size class, mapped by `lake-dp` and by every engine agent on the
//! node.
//!
//! `lake-dp` creates it ([`Arena::create`]) — a file in `/dev/shm`, on a
//! hugetlbfs mount, or a hugetlb memfd — pre-allocated with `fallocate` and
//! mapped with `MAP_POPULATE` (never by touching pages), `mlock`ed, built
//! under a temporary name and renamed into place once ready, so an attacher
//! never sees half an arena. Agents map it ([`Arena::attach`]), check its
//! versioned header, claim an agent record and pin slots through it
//! ([`PinArray`]); `lake-dp` alone allocates and frees slots
//! ([`SlotTable`]). The pin protocol (DESIGN §3) is in [`pins`]; the byte
//! layout in [`layout`].
//!
//! Each slot holds a block as it lies in an L2 slot (4 KiB stored header,
//! then the padded payload), so the slot area doubles as the poller's
//! [`SlotRegion`] and as the buffer CUDA and RDMA register once
//! ([`Arena::register`]).

pub mod layout;

pub mod pins;
pub mod slots;
mod view;

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use memmap2::MmapOptions;

use self::layout::{
    AgentControl, ArenaControl, ArenaGeometry, ArenaHeader, CONTROL_OFFSET, PartitionSpan, Plan, STATE_BUILDING,
    STATE_READY, STATE_RETIRED, decode_header,
};
pub use self::pins::{Pin, PinArray, PinError};
pub use self::slots::{Reclaim, SlotError, SlotGrant, SlotStats, SlotTable};
use self::view::{Mapping, Piece, Pieces};
use crate::model::replica::{NodeId, RegionId};
use crate::region::{RegionError, SlotClass, SlotRegion};
use crate::usize_from;
use crate::{lock, numa, shm};

/// The byte of the arena file whose lock `lake-dp` holds while it serves
/// the arena (see [`lock`]).
const OWNER_LOCK_BYTE: u64 = 0;

/// The byte of the arena file whose lock agent record `agent` holds while
/// its agent owns it: the record's first byte.
fn agent_lock_byte(header: &ArenaHeader, agent: u32) -> u64 {
    header.agents_offset + u64::from(agent) * header.agent_stride
}

/// Why an arena could not be created, attached or used.
#[derive(Debug)]
pub enum ArenaError {
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
    /// Not enough shared memory or huge pages for the arena.
    NoSpace {
        /// Bytes asked for.
        bytes: u64,
        /// What to check.
        hint: &'static str,
    },
    /// The header is wrong; the text names the field.
    Header(&'static str),
    /// The arena was made by another layout version.
    Version {
        /// The arena's version.
        found: u32,
        /// The version this build reads.
        supported: u32,
    },
    /// The creator has not finished building the arena (or died doing it).
    NotReady,
    /// The owning `lake-dp` retired the arena; attach to its successor.
    Retired,
    /// A live `lake-dp` serves an arena at that path (it holds the owner
    /// lock).
    InUse {
        /// Its pid as recorded in the arena (0 if unreadable).
        pid: u32,
    },
    /// The slot geometry is wrong.
    Region(RegionError),
    /// Every agent record is claimed.
    AgentsFull,
    /// The arena is already registered with this kind of device.
    AlreadyRegistered(&'static str),
}

impl core::fmt::Display for ArenaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Config(what) => write!(f, "arena config: {what}"),
            Self::Io { what, path: Some(path), source } => write!(f, "arena: {what} {}: {source}", path.display()),
            Self::Io { what, path: None, source } => write!(f, "arena: {what}: {source}"),
            Self::NoSpace { bytes, hint } => write!(f, "arena: cannot reserve {bytes} bytes: {hint}"),
            Self::Header(field) => write!(f, "arena header: {field}"),
            Self::Version { found, supported } => {
                write!(f, "arena header: version {found}, this build reads version {supported}")
            }
            Self::NotReady => write!(f, "arena: not ready (its lake-dp is still building it, or died doing so)"),
            Self::Retired => write!(f, "arena: retired by its lake-dp; attach to the current one"),
            Self::InUse { pid: 0 } => write!(f, "arena: held by a live process (an arena this build cannot read)"),
            Self::InUse { pid } => write!(f, "arena: served by a live lake-dp (pid {pid}); stop it first"),
            Self::Region(e) => write!(f, "arena: {e}"),
            Self::AgentsFull => write!(f, "arena: every agent record is claimed (raise agents_max)"),
            Self::AlreadyRegistered(kind) => write!(f, "arena: already registered with {kind}"),
        }
    }
}

impl std::error::Error for ArenaError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            Self::Region(e) => Some(e),
            _ => None,
        }
    }
}

fn io_error(what: &'static str, path: Option<&Path>) -> impl FnOnce(io::Error) -> ArenaError {
    let path = path.map(Path::to_path_buf);
    move |source| ArenaError::Io { what, path, source }
}

/// What memory backs the arena.
pub use crate::shm::Backing as ArenaBacking;

/// How to build an arena.
#[derive(Clone, Debug)]
pub struct ArenaConfig {
    /// Where its memory comes from.
    pub backing: ArenaBacking,
    /// Size classes, one per block layout served (see [`SlotClass::for_payload`]).
    pub classes: Vec<SlotClass>,
    /// Agent records (engine processes attached at once).
    pub agents_max: u32,
    /// Pins one agent may hold at once.
    pub pins_per_agent: u32,
    /// The node.
    pub node: NodeId,
    /// The arena's region id.
    pub region: RegionId,
    /// The region epoch of this `lake-dp` incarnation.
    pub epoch: u64,
    /// `mlock` the arena (needs CAP_IPC_LOCK or a large enough
    /// RLIMIT_MEMLOCK).
    pub lock: bool,
    /// Permission bits of the arena file.
    pub mode: u32,
    /// Allocate every page of the arena on this NUMA node (the node of the
    /// `lake-dp` that serves it and of the NICs and GPUs it feeds).
    pub numa_node: Option<u32>,
    /// Let the classes share the memory in chunks of this many bytes (a
    /// multiple of 4 KiB holding at least one slot of every class), so
    /// that a class short of slots takes memory another does not use; the
    /// classes' slot counts then only size the arena. 0: each class owns
    /// its slots (an arena every earlier build reads).
    pub chunk_bytes: u64,
    /// Partitions past partition 0 (which `classes` sizes), each in memory
    /// of its own, as partition 0 then is too: an arena of layout version
    /// 3. Empty: not partitioned. A partitioned arena is never opened by a
    /// path: its records and each partition are memfds, passed to those
    /// that may map them, sealed at their size (no process holding one
    /// can shrink it and fault the others), named as their backings'
    /// files (partition 0: the arena's path with [`SHARED_SUFFIX`]).
    pub partitions: Vec<ArenaPartition>,
}

/// What a partitioned arena's partition 0 is named: the arena's path with
/// this added.
pub const SHARED_SUFFIX: &str = ".shared";

/// The name of a partitioned arena's partition 0, for the arena at `path`.
pub fn shared_partition_path(path: &Path) -> PathBuf {
    let mut path = path.as_os_str().to_owned();
    path.push(SHARED_SUFFIX);
    PathBuf::from(path)
}

/// A partition of the arena's slots in memory of its own, passed only to
/// the processes that may map it.
#[derive(Clone, Debug)]
pub struct ArenaPartition {
    /// Its memory (the same kind as the arena's; its file's name names it).
    pub backing: ArenaBacking,
    /// Slots of each of the arena's size classes, in their order.
    pub slots: Vec<u32>,
}

impl ArenaConfig {
    /// A `/dev/shm` arena with the defaults: 64 agents of 4096 pins,
    /// locked, readable and writable by the owner only.
    pub fn shm(path: impl Into<PathBuf>, classes: &[SlotClass]) -> Self {
        Self {
            backing: ArenaBacking::Shm(path.into()),
            classes: classes.to_vec(),
            agents_max: 64,
            pins_per_agent: 4096,
            node: NodeId(0),
            region: RegionId(0),
            epoch: 1,
            lock: true,
            mode: 0o600,
            numa_node: None,
            chunk_bytes: 0,
            partitions: Vec::new(),
        }
    }
}

impl SlotClass {
    /// The class that holds objects of `payload_bytes` (4 KiB header plus
    /// the payload padded to 4 KiB), `slots` of them.
    pub fn for_payload(payload_bytes: u64, slots: u32) -> Self {
        Self { slot_bytes: crate::stored::object_bytes(payload_bytes), slots }
    }
}

/// A device that registers the slot area once: CUDA (`cuMemHostRegister`),
/// RDMA (`ibv_reg_mr`), io_uring fixed buffers.
pub trait MemoryRegistration {
    /// A short name for errors ("cuda", "rdma", "io_uring").
    fn kind(&self) -> &'static str;
    /// Registers `len` bytes at `base`.
    fn register(&mut self, base: NonNull<u8>, len: usize) -> io::Result<()>;
}

/// One mapping of an arena, shared by every handle in this process.
struct ArenaMap {
    map: Mapping,
    file: File,
    geometry: ArenaGeometry,
    /// The partitions' files, where this process has them (the creator
    /// has every one).
    partition_files: Vec<Option<File>>,
    /// The one partition this process maps, or `None` for all of them.
    visible: Option<usize>,
    /// Set for the creator, which retires the arena and unlinks its file
    /// when the last handle goes.
    created: Option<Created>,
    registered: Mutex<heapless::Vec<&'static str, 4>>,
    /// `file` is this process's own open of the arena, opened for it by
    /// the data plane: its records' locks are taken on it (not on a reopen
    /// of the file, which the file's mode may not allow this user).
    own_file: bool,
}

struct Created {
    path: Option<PathBuf>,
    inode: u64,
}

impl ArenaMap {
    fn header(&self) -> &ArenaHeader {
        &self.geometry.header
    }

    fn control(&self) -> &ArenaControl {
        control_of(&self.map)
    }

    /// The generation word of `slot` (panics out of range).
    fn generation(&self, slot: u32) -> &AtomicU32 {
        &self.generations()[slot as usize]
    }

    fn agent_base(&self, agent: u32) -> *mut u8 {
        assert!(agent < self.header().agents_max, "agent {agent} out of range");
        let offset = self.header().agents_offset + u64::from(agent) * self.header().agent_stride;
        self.map.as_mut_ptr().wrapping_add(usize_from(offset))
    }

    /// The control words of agent record `agent` (in range).
    fn agent(&self, agent: u32) -> &AgentControl {
        let ptr = self.agent_base(agent).cast::<AgentControl>();
        // SAFETY: the checked header puts agents_max records of
        // agent_stride (a multiple of 64) bytes at agents_offset (a multiple
        // of 4096) inside the mapping, so the record is in bounds and 64-byte
        // aligned; AgentControl is atomics only, valid for any bits.
        unsafe { &*ptr }
    }

    /// The pin entries of agent record `agent` (in range).
    fn pins(&self, agent: u32) -> &[AtomicU64] {
        let ptr = self.agent_base(agent).wrapping_add(usize_from(layout::AGENT_CONTROL_BYTES)).cast::<AtomicU64>();
        // SAFETY: agent_stride >= 64 + 8 * pins_per_agent (checked header),
        // so the entries lie inside the record, 8-byte aligned; AtomicU64
        // has u64's layout and any bits are valid; the mapping outlives the
        // borrow; shared memory is only touched through atomics.
        unsafe { core::slice::from_raw_parts(ptr, self.header().pins_per_agent as usize) }
    }

    /// The generation words, one per slot.
    fn generations(&self) -> &[AtomicU32] {
        let offset = usize_from(self.header().generations_offset);
        let ptr = self.map.as_mut_ptr().wrapping_add(offset).cast::<AtomicU32>();
        // SAFETY: the checked header puts `slots` u32s at
        // generations_offset (4096) inside the mapping, 4-byte aligned;
        // atomics only, valid for any bits; the mapping outlives the borrow.
        unsafe { core::slice::from_raw_parts(ptr, self.header().slots as usize) }
    }
}

fn control_of(map: &Mapping) -> &ArenaControl {
    assert!(map.len() >= CONTROL_OFFSET + size_of::<ArenaControl>());
    let ptr = map.as_mut_ptr().wrapping_add(CONTROL_OFFSET).cast::<ArenaControl>();
    // SAFETY: in bounds (asserted), 64-byte aligned (page-aligned base plus
    // 2048), atomics only so any bits are a valid value, and the mapping
    // outlives the borrow.
    unsafe { &*ptr }
}

impl Drop for ArenaMap {
    fn drop(&mut self) {
        let Some(created) = &self.created else { return };
        // Release: pairs with the Acquire of an attacher's state check, so
        // whoever sees "retired" sees everything this process wrote.
        self.control().state.store(STATE_RETIRED, Ordering::Release);
        // Unlink only our own files, not a successor's under the same name.
        if let Some(path) = &created.path
            && std::fs::metadata(path).is_ok_and(|m| m.ino() == created.inode)
        {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A handle to a mapped arena; clones share one mapping.
#[derive(Clone)]
pub struct Arena {
    map: Arc<ArenaMap>,
}

impl core::fmt::Debug for Arena {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Arena").field("header", self.header()).finish()
    }
}

impl Arena {
    /// Creates the arena described by `config` and returns it with the one
    /// [`SlotTable`] that allocates its slots.
    pub fn create(config: &ArenaConfig) -> Result<(Self, SlotTable), ArenaError> {
        if config.mode & !0o777 != 0 {
            return Err(ArenaError::Config("mode: permission bits only (at most 0o777)"));
        }
        let (file, target, building) = open_backing(config)?;
        let result = build(config, file, target.as_deref(), building.as_deref());
        if result.is_err()
            && let Some(building) = &building
        {
            let _ = std::fs::remove_file(building);
        }
        let arena = result?;
        let table = SlotTable::new(arena.clone());
        Ok((arena, table))
    }

    /// Maps the arena at `path`, checking its header. The arena must be
    /// ready, not retired.
    pub fn attach(path: &Path) -> Result<Self, ArenaError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(io_error("opening", Some(path)))?;
        Self::attach_file(file, Some(path), false, None)
    }

    /// Maps the arena behind `fd` (passed over a socket: the data plane's
    /// own open of it).
    pub fn attach_fd(fd: OwnedFd) -> Result<Self, ArenaError> {
        Self::attach_file(File::from(fd), None, false, None)
    }

    /// Maps the arena behind `fd`, an open of its file made for this
    /// process alone (the data plane opened it afresh for this agent): the
    /// records' locks are taken on it, so the file itself need not be
    /// openable by this user.
    pub fn attach_own_fd(fd: OwnedFd) -> Result<Self, ArenaError> {
        Self::attach_file(File::from(fd), None, true, None)
    }

    /// Maps the arena behind `fd` (as [`Arena::attach_own_fd`]) with only
    /// partition `partition` of its slots, whose file `partition_fd` is.
    /// An arena that is not partitioned takes only partition 0 (all of it,
    /// no file).
    pub fn attach_partition(fd: OwnedFd, partition: usize, partition_fd: Option<OwnedFd>) -> Result<Self, ArenaError> {
        Self::attach_file(File::from(fd), None, true, Some((partition, partition_fd.map(File::from))))
    }

    /// Maps the arena in `file`: the whole of it, or in a partitioned arena
    /// its records and the partition `given` (with its file).
    fn attach_file(
        file: File,
        path: Option<&Path>,
        own_file: bool,
        given: Option<(usize, Option<File>)>,
    ) -> Result<Self, ArenaError> {
        let bytes = file.metadata().map_err(io_error("reading the size of", path))?.len();
        if bytes < 4096 {
            return Err(ArenaError::Header("too short to hold an arena header"));
        }
        // The whole file: every slot of an arena not partitioned, only the
        // records of a partitioned one (its slots are in other files).
        let len = usize::try_from(bytes).map_err(|_| ArenaError::Header("total_bytes"))?;
        let whole = MmapOptions::new().len(len).populate().map_raw(&file).map_err(io_error("mapping", path))?;
        let first = Mapping::Whole(whole);
        // Acquire: pairs with the creator's Release store of READY, so the
        // header it wrote before is visible here.
        match control_of(&first).state.load(Ordering::Acquire) {
            STATE_READY => {}
            STATE_BUILDING => return Err(ArenaError::NotReady),
            STATE_RETIRED => return Err(ArenaError::Retired),
            _ => return Err(ArenaError::Header("state word")),
        }
        let mut page = [0u8; size_of::<ArenaHeader>()];
        // SAFETY: the mapping is at least 4096 bytes, more than the header;
        // the header is immutable once the state is ready (and a copy is
        // all that is kept: everything below checks the copy).
        unsafe { core::ptr::copy_nonoverlapping(first.as_mut_ptr(), page.as_mut_ptr(), page.len()) };
        let geometry = decode_header(&page, bytes)?;
        let (partition, partition_file) = given.unwrap_or((0, None));
        let visible = geometry.partitioned().then_some(partition);
        let map = if geometry.partitioned() {
            drop(first);
            map_partition(&file, &geometry, partition, partition_file.as_ref())?
        } else if partition != 0 {
            return Err(ArenaError::Config("partition: the arena is not partitioned"));
        } else {
            first
        };
        let mut partition_files: Vec<Option<File>> = (0..geometry.partitions.len()).map(|_| None).collect();
        if let (Some(slot), Some(partition_file)) = (partition_files.get_mut(partition), partition_file) {
            *slot = Some(partition_file);
        }
        let registered = Mutex::new(heapless::Vec::new());
        let map = ArenaMap { map, file, geometry, partition_files, visible, created: None, registered, own_file };
        Ok(Self { map: Arc::new(map) })
    }

    /// The checked header.
    pub fn header(&self) -> &ArenaHeader {
        self.map.header()
    }

    /// The checked geometry: size classes and partitions.
    pub fn geometry(&self) -> &ArenaGeometry {
        &self.map.geometry
    }

    /// The partition this process maps, or `None` when it maps them all.
    pub fn visible_partition(&self) -> Option<usize> {
        self.map.visible
    }

    /// The file of partition `partition`, where this process has it: to
    /// pass to an agent that may map it.
    pub fn partition_fd(&self, partition: usize) -> Option<BorrowedFd<'_>> {
        self.map.partition_files.get(partition)?.as_ref().map(AsFd::as_fd)
    }

    /// The descriptor of the arena's memory (to pass a memfd to an agent).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.map.file.as_fd()
    }

    /// Whether the owning `lake-dp` still serves this arena: it has not
    /// retired it and its process is alive (it holds the owner lock; a
    /// `lake-dp` killed outright retires nothing, but the kernel drops its
    /// lock).
    pub fn is_live(&self) -> bool {
        // Acquire: pairs with the Release of the retire in ArenaMap::drop.
        if self.map.control().state.load(Ordering::Acquire) != STATE_READY {
            return false;
        }
        // The creator's own handle holds the lock itself. On doubt (a
        // failing fcntl), call the owner alive.
        self.map.created.is_some() || lock::held_by_other(&self.map.file, OWNER_LOCK_BYTE).unwrap_or(true)
    }

    /// The pid of the `lake-dp` that created it.
    pub fn owner_pid(&self) -> u32 {
        self.map.control().owner_pid.load(Ordering::Relaxed)
    }

    /// The current generation of `slot`, or `None` out of range.
    pub fn generation(&self, slot: u32) -> Option<u32> {
        // Acquire: pairs with lake-dp's generation bump; see pins.rs.
        (slot < self.header().slots).then(|| self.map.generation(slot).load(Ordering::Acquire))
    }

    /// The slot area as a poller region (slots numbered across classes);
    /// it keeps the mapping alive.
    pub fn region(&self) -> Result<Arc<SlotRegion>, ArenaError> {
        let keeper: Arc<dyn Send + Sync> = self.map.clone();
        let chunk_bytes = u64::from(self.header().chunk_bytes);
        let spans = &self.map.geometry.spans;
        let header = self.header();
        let base = NonNull::new(self.map.map.as_mut_ptr().wrapping_add(usize_from(header.slots_offset)))
            .expect("mapping is not null");
        let len = header.slots_bytes;
        // SAFETY: the slot area is `len` bytes of the mapping's range (checked
        // header), of which the region touches only what this process maps
        // (`visible`), and `keeper` keeps the mapping alive for the region.
        let region = unsafe { SlotRegion::from_spans(base, len, spans, chunk_bytes, Some(keeper)) };
        let region = match self.visible_span() {
            Some(span) => {
                region.map(|r| r.restrict(span.first_slot..span.first_slot + span.slots, span.offset, span.bytes))
            }
            None => region,
        };
        region.map(Arc::new).map_err(ArenaError::Region)
    }

    /// The partition this process maps alone, if it does not map them all.
    fn visible_span(&self) -> Option<PartitionSpan> {
        self.map.visible.and_then(|p| self.map.geometry.partitions.get(p).copied())
    }

    /// The slot area this process maps: what CUDA, RDMA and io_uring
    /// register (in a partitioned arena mapped in part, the partition).
    pub fn slot_area(&self) -> (NonNull<u8>, usize) {
        let header = self.header();
        let (offset, len) = self.visible_span().map_or((0, header.slots_bytes), |span| (span.offset, span.bytes));
        let ptr = self.map.map.as_mut_ptr().wrapping_add(usize_from(header.slots_offset + offset));
        // The mapping's base is not null and the offset is inside it.
        (NonNull::new(ptr).expect("mapping is not null"), usize_from(len))
    }

    /// Registers the slot area with a device, once per kind.
    pub fn register(&self, device: &mut dyn MemoryRegistration) -> Result<(), ArenaError> {
        let kind = device.kind();
        let mut registered = self.map.registered.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if registered.contains(&kind) {
            return Err(ArenaError::AlreadyRegistered(kind));
        }
        if registered.is_full() {
            return Err(ArenaError::Config("too many device registrations"));
        }
        let (base, len) = self.slot_area();
        device.register(base, len).map_err(io_error("registering the slot area", None))?;
        let _ = registered.push(kind);
        Ok(())
    }

    /// Claims a free agent record for this process's pins.
    pub fn claim_agent(&self) -> Result<PinArray, ArenaError> {
        PinArray::claim(self.clone())
    }

    /// The pins agents hold on `slot` now, each as (agent, generation
    /// pinned): a scan of every agent's pin array up to its high-water
    /// mark — for the operator (`lake inspect --arena`), not the data path.
    pub fn pins_on(&self, slot: u32) -> Vec<(u32, u32)> {
        let map = self.map();
        let header = *map.header();
        let mut out = Vec::new();
        for agent in 0..header.agents_max {
            // Acquire: pairs with the agent's release of each pin word.
            let high = map.agent(agent).high_water.load(Ordering::Acquire).min(header.pins_per_agent);
            for word in &map.pins(agent)[..high as usize] {
                if let Some((pinned, generation)) = pins::decode(word.load(Ordering::Acquire))
                    && pinned == slot
                {
                    out.push((agent, generation));
                }
            }
        }
        out
    }

    fn map(&self) -> &ArenaMap {
        &self.map
    }
}

/// Opens the backing memory: the file under its building name (for file
/// backings) or a memfd. Returns the file, the final path and the building
/// path.
fn open_backing(config: &ArenaConfig) -> Result<(File, Option<PathBuf>, Option<PathBuf>), ArenaError> {
    // A live owner keeps its arena; a stale one (its lake-dp died) is
    // retired so agents still mapping it learn to detach. Anything else at
    // the configured path is replaced by the rename in `build`.
    if let ArenaBacking::Shm(path) | ArenaBacking::HugetlbFs(path) = &config.backing
        && let Err(e @ ArenaError::InUse { .. }) = retire_stale(path)
    {
        return Err(e);
    }
    if !config.partitions.is_empty() {
        // A partitioned arena is passed to its engines alone, never opened
        // by a path: memory sealed at its size (see `map_created`).
        return Ok((shm::sealable_memfd(&config.backing, &memfd_name(&config.backing, "lake-l1"))?, None, None));
    }
    Ok(shm::create(&config.backing, config.mode, "lake-l1")?)
}

/// The name of a memfd standing for `backing`'s file (its file name, as
/// `/proc/PID/maps` shows it), or `otherwise`.
fn memfd_name(backing: &ArenaBacking, otherwise: &str) -> String {
    let path = match backing {
        ArenaBacking::Shm(path) | ArenaBacking::HugetlbFs(path) => path.file_name(),
        ArenaBacking::HugetlbMemfd => None,
    };
    path.map_or_else(|| otherwise.to_owned(), |name| name.to_string_lossy().into_owned())
}

impl From<shm::ShmError> for ArenaError {
    fn from(error: shm::ShmError) -> Self {
        match error {
            shm::ShmError::Io { what, path, source } => Self::Io { what, path, source },
            shm::ShmError::NotTmpfs => {
                Self::Config("backing: the path is not on a tmpfs (an L1 arena on a disk file would page to disk)")
            }
            shm::ShmError::NotHugetlbfs => Self::Config("backing: the path is not on a hugetlbfs mount"),
            shm::ShmError::NoSpace { bytes, hint } => Self::NoSpace { bytes, hint },
            shm::ShmError::TooLarge => Self::Config("arena too large"),
        }
    }
}

fn build(
    config: &ArenaConfig,
    file: File,
    target: Option<&Path>,
    building: Option<&Path>,
) -> Result<Arena, ArenaError> {
    let (huge, block_bytes) = shm::check(&config.backing, &file, building)?;
    let page_bytes = if huge { block_bytes } else { 4096 };
    let geometry = plan_of(config, page_bytes)?;
    let bytes = geometry.file_bytes();
    file.set_len(bytes).map_err(io_error("sizing", building))?;
    // Held for the arena's life by this open file: how agents and a
    // successor tell that this lake-dp is alive.
    if !lock::try_lock(&file, OWNER_LOCK_BYTE).map_err(io_error("locking", building))? {
        return Err(ArenaError::Config("backing: another process locked the new arena file"));
    }
    let parts = PartitionFiles::create(config, (huge, block_bytes))?;
    let map = on_numa_node(config.numa_node, || map_created(&file, &geometry, &parts, huge, building))?;
    if config.lock {
        map.lock().map_err(|source| ArenaError::Io {
            what: "locking (mlock; needs CAP_IPC_LOCK or RLIMIT_MEMLOCK above the arena size)",
            path: building.map(Path::to_path_buf),
            source,
        })?;
    }
    let inode = file.metadata().map_err(io_error("reading", building))?.ino();
    let partition_files = parts.0.into_iter().map(Some).collect();
    let arena = ArenaMap {
        map,
        file,
        geometry,
        partition_files,
        visible: None,
        // Until renamed into place there is nothing to unlink but the
        // building name (which the caller removes on error).
        created: Some(Created { path: None, inode }),
        registered: Mutex::new(heapless::Vec::new()),
        own_file: false,
    };
    let header = bytemuck::bytes_of(arena.header());
    // SAFETY: the header fits in page 0 of the fresh mapping, which no
    // other process can have found yet (it is under its building name or
    // an unshared memfd).
    unsafe { core::ptr::copy_nonoverlapping(header.as_ptr(), arena.map.as_mut_ptr(), header.len()) };
    for slot in 0..arena.header().slots {
        // Generation 0 is never handed out, so a zeroed pin or mirror entry
        // can never name a live slot.
        arena.generation(slot).store(1, Ordering::Relaxed);
    }
    let control = arena.control();
    control.owner_pid.store(std::process::id(), Ordering::Relaxed);
    control.claims.store(0, Ordering::Relaxed);
    // Release: publishes the header and generations above to attachers
    // (their Acquire load of the state).
    control.state.store(STATE_READY, Ordering::Release);
    let mut arena = arena;
    shm::publish(building, target)?;
    if let (Some(target), Some(created)) = (target, arena.created.as_mut()) {
        created.path = Some(target.to_path_buf());
    }
    Ok(Arena { map: Arc::new(arena) })
}

/// The memory of a new arena's partitions, 0 first: sealable memfds,
/// which no process opens by a path (see [`shm::sealable_memfd`]).
struct PartitionFiles(Vec<File>);

impl PartitionFiles {
    /// Creates the memory of `config`'s partitions, 0 first, each of the
    /// arena's kind (`memory`: huge pages, and the page size), named as
    /// its backing's file. None for an arena not partitioned.
    fn create(config: &ArenaConfig, memory: (bool, u64)) -> Result<Self, ArenaError> {
        let mut parts = Self(Vec::with_capacity(config.partitions.len() + 1));
        if config.partitions.is_empty() {
            return Ok(parts);
        }
        let shared = match &config.backing {
            ArenaBacking::Shm(path) => ArenaBacking::Shm(shared_partition_path(path)),
            ArenaBacking::HugetlbFs(path) => ArenaBacking::HugetlbFs(shared_partition_path(path)),
            ArenaBacking::HugetlbMemfd => ArenaBacking::HugetlbMemfd,
        };
        for backing in [&shared].into_iter().chain(config.partitions.iter().map(|p| &p.backing)) {
            let part = shm::sealable_memfd(backing, &memfd_name(backing, "lake-l1-partition"))?;
            if shm::check(backing, &part, None)? != memory {
                return Err(ArenaError::Config("partitions: each on the same kind of memory as the arena"));
            }
            parts.0.push(part);
        }
        Ok(parts)
    }
}

/// The geometry `config` asks for, on pages of `page_bytes`.
fn plan_of(config: &ArenaConfig, page_bytes: u64) -> Result<ArenaGeometry, ArenaError> {
    let classes = all_classes(config)?;
    let partitions = if config.partitions.is_empty() { 0 } else { config.partitions.len() + 1 };
    layout::plan(&Plan {
        classes: &classes,
        agents_max: config.agents_max,
        pins_per_agent: config.pins_per_agent,
        page_bytes,
        node: config.node.0,
        region: config.region.0,
        epoch: config.epoch,
        chunk_bytes: config.chunk_bytes,
        partitions: u32::try_from(partitions).map_err(|_| ArenaError::Config("partitions: too many"))?,
    })
}

/// The size classes of every partition, partition 0's (`config.classes`)
/// first.
fn all_classes(config: &ArenaConfig) -> Result<Vec<SlotClass>, ArenaError> {
    let mut classes = config.classes.clone();
    for partition in &config.partitions {
        if partition.slots.len() != config.classes.len() {
            return Err(ArenaError::Config("partitions: slots for each size class of the arena"));
        }
        classes.extend(config.classes.iter().zip(&partition.slots).map(|(c, &slots)| SlotClass { slots, ..*c }));
    }
    Ok(classes)
}

/// Reserves every page of a new arena and maps it: its file whole, and in
/// a partitioned arena each partition's file at its place.
fn map_created(
    file: &File,
    geometry: &ArenaGeometry,
    parts: &PartitionFiles,
    huge: bool,
    building: Option<&Path>,
) -> Result<Mapping, ArenaError> {
    let bytes = geometry.file_bytes();
    if !geometry.partitioned() {
        return Ok(Mapping::Whole(shm::reserve_and_map(file, bytes, huge, building)?));
    }
    // Every file's size sealed once its pages are reserved: an engine
    // holding one cannot shrink it and fault this process (SIGBUS).
    let seal = |file: &File| shm::seal(file).map_err(io_error("sealing the size of", None));
    shm::reserve_all(file, bytes, huge, building)?;
    seal(file)?;
    let header = &geometry.header;
    let mut pieces = vec![Piece { fd: file.as_fd(), at: 0, len: usize_from(bytes), file_offset: 0 }];
    for (part, span) in parts.0.iter().zip(&geometry.partitions) {
        part.set_len(span.bytes).map_err(io_error("sizing a partition", None))?;
        shm::reserve_all(part, span.bytes, huge, None)?;
        seal(part)?;
        let at = usize_from(header.slots_offset + span.offset);
        pieces.push(Piece { fd: part.as_fd(), at, len: usize_from(span.bytes), file_offset: 0 });
    }
    let align = usize_from(header.page_bytes);
    Ok(Mapping::Pieces(
        Pieces::map(usize_from(header.total_bytes), align, &pieces).map_err(io_error("mapping", building))?,
    ))
}

/// Maps, for an attaching process, a partitioned arena's records (from
/// the arena's file) and its partition `partition` (from `partition_file`).
fn map_partition(
    file: &File,
    geometry: &ArenaGeometry,
    partition: usize,
    partition_file: Option<&File>,
) -> Result<Mapping, ArenaError> {
    let header = &geometry.header;
    let span =
        geometry.partitions.get(partition).ok_or(ArenaError::Config("partition: the arena has no such partition"))?;
    let part = partition_file.ok_or(ArenaError::Config("partition: its file was not given"))?;
    let bytes = part.metadata().map_err(io_error("reading the size of a partition", None))?.len();
    if bytes != span.bytes {
        return Err(ArenaError::Header("a partition's file differs from its size in the header"));
    }
    let pieces = [
        Piece { fd: file.as_fd(), at: 0, len: usize_from(header.slots_offset), file_offset: 0 },
        Piece {
            fd: part.as_fd(),
            at: usize_from(header.slots_offset + span.offset),
            len: usize_from(span.bytes),
            file_offset: 0,
        },
    ];
    let align = usize_from(header.page_bytes);
    Ok(Mapping::Pieces(Pieces::map(usize_from(header.total_bytes), align, &pieces).map_err(io_error("mapping", None))?))
}

/// Runs `f` with this thread's memory policy bound to `node`, so the pages
/// it allocates (tmpfs and hugetlb pages alike fall back to the task's
/// policy) come from that node; restores the default policy after.
fn on_numa_node<T>(node: Option<u32>, f: impl FnOnce() -> Result<T, ArenaError>) -> Result<T, ArenaError> {
    let Some(node) = node else { return f() };
    if !numa::node_exists(node) {
        return Err(ArenaError::Config("numa_node: no such NUMA node on this machine"));
    }
    numa::bind_thread(node).map_err(io_error("binding memory to the NUMA node", None))?;
    let result = f();
    numa::unbind_thread().map_err(io_error("restoring the memory policy", None))?;
    result
}

/// Retires `path`'s arena if its creator is gone (a stale file left by a
/// crashed `lake-dp`), so agents still attached to it learn to detach, and
/// removes the file. Refuses while a live `lake-dp` holds it. Returns
/// whether a file was removed.
pub fn retire_stale(path: &Path) -> Result<bool, ArenaError> {
    let file = match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_error("opening", Some(path))(e)),
    };
    let old = Arena::attach_file(file, Some(path), false, None);
    if let Ok(old) = &old {
        if lock::held_by_other(&old.map.file, OWNER_LOCK_BYTE).map_err(io_error("checking the lock of", Some(path)))? {
            return Err(ArenaError::InUse { pid: old.owner_pid() });
        }
        // Release: as in ArenaMap::drop.
        old.map.control().state.store(STATE_RETIRED, Ordering::Release);
    } else {
        // Not an arena this build can read (another version, or damaged):
        // still refuse to remove it while its owner lives.
        let file = File::open(path).map_err(io_error("opening", Some(path)))?;
        if lock::held_by_other(&file, OWNER_LOCK_BYTE).map_err(io_error("checking the lock of", Some(path)))? {
            return Err(ArenaError::InUse { pid: 0 });
        }
    }
    std::fs::remove_file(path).map_err(io_error("removing", Some(path)))?;
    Ok(true)
}

#[cfg(test)]
mod tests;
