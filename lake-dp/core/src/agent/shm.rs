//! Agent ports in shared memory: how an engine in another process talks to
//! its node's `lake-dp` with no system call on the fast path.
//!
//! `lake-dp` creates one memfd at start holding `ports` ports (its
//! `agents_max`), each a request ring (agent → data plane) and a
//! completion ring (data plane → agent): single-producer single-consumer,
//! power-of-two depth, free-running `u64` indices on their own 128-byte
//! lines, fixed-size plain-data entries. An agent attaching gets the memfd
//! and its port number over the attach socket (see `runner::attach`).
//!
//! ```text
//! 0      PortHeader (4 KiB page)
//! 4096   port 0: req.head | req.tail | done.head | done.tail   (128 B each)
//!               requests: depth × 128 B | completions: depth × 32 B
//!        port 1: ...  (each port rounded up to 4 KiB)
//! ```
//!
//! The agent is another process and is not trusted: the data plane copies
//! each request out of shared memory with one volatile read before looking
//! at it, checks every field (a bad one is answered `Invalid`, nothing
//! else happens), and treats an index that runs ahead of the ring (more
//! than `depth` unread) as a broken agent — the port is reset and the
//! agent detached. Ordering is the in-process ring's: the producer writes
//! the entry, then Release-stores its tail; the consumer Acquire-loads the
//! tail, then reads the entry, then Release-stores its head.

use core::sync::atomic::{AtomicU64, Ordering};
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::sync::Arc;

use bytemuck::{Pod, Zeroable};
use memmap2::MmapRaw;

use super::port::{AgentCompletion, AgentError, AgentRequest, CrcOrigin};
use crate::model::key::BlockKey;
use crate::model::replica::{Priority, ReplicaWire};

/// The first bytes of a port file.
pub const PORT_MAGIC: [u8; 8] = *b"LAKEPORT";
/// Its layout version.
pub const PORT_VERSION: u32 = 1;
/// Bytes of a request entry.
pub const REQUEST_BYTES: u32 = 128;
/// Bytes of a completion entry.
pub const COMPLETION_BYTES: u32 = 32;
const HEADER_BYTES: u64 = 4096;
/// Where the "data plane parked" flag lives, on a line of its own.
const PARKED_OFFSET: usize = 2048;
/// Where the "saves refused lately" flag lives, on a line of its own (zero
/// in a file of a data plane that never sets it).
const PRESSURE_OFFSET: usize = 2176;
const INDEX_BYTES: u64 = 128;
/// The deepest ring a port may have.
pub const DEPTH_MAX: u32 = 1 << 16;

/// The port file's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PortHeader {
    /// [`PORT_MAGIC`].
    pub magic: [u8; 8],
    /// [`PORT_VERSION`].
    pub version: u32,
    /// Ports in the file.
    pub ports: u32,
    /// Entries per ring (a power of two).
    pub depth: u32,
    /// [`REQUEST_BYTES`].
    pub request_bytes: u32,
    /// [`COMPLETION_BYTES`].
    pub completion_bytes: u32,
    /// Zero.
    pub reserved: u32,
    /// Bytes per port.
    pub port_bytes: u64,
    /// Bytes of the file.
    pub total_bytes: u64,
    /// CRC32 of the bytes before it.
    pub crc: u32,
    /// Zero.
    pub reserved_b: u32,
}

const HEADER_CRC_END: usize = core::mem::offset_of!(PortHeader, crc);

/// A request as it lies in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RequestEntry {
    /// 1 reserve, 2 commit, 3 abort, 4 load, 5 cancel a load (its cookie
    /// in `object_bytes`).
    pub kind: u8,
    /// [`Priority`] code (loads).
    pub priority: u8,
    /// Zero.
    pub reserved_a: u16,
    /// The slot (commit, abort).
    pub slot: u32,
    /// Echoed in the completion.
    pub cookie: u64,
    /// The slot's generation (commit, abort).
    pub generation: u32,
    /// Zero.
    pub reserved_b: u32,
    /// Header plus padded payload (reserve).
    pub object_bytes: u64,
    /// The block (load).
    pub key: BlockKey,
    /// Its L2 replica (load).
    pub source: ReplicaWire,
    /// The engine's trace id (load; zero untraced, and always from an agent
    /// built before [`crate::wire::FEATURE_TRACE`]).
    pub trace: u64,
    /// Zero.
    pub reserved_c: [u8; 48],
}

/// A completion as it lies in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct CompletionEntry {
    /// The request's cookie.
    pub cookie: u64,
    /// 0, or an [`AgentError`] code.
    pub status: u32,
    /// The slot.
    pub slot: u32,
    /// Its generation.
    pub generation: u32,
    /// A traced load's time in the data plane, µs (else 0).
    pub took_us: u32,
    /// Zero.
    pub reserved: [u8; 8],
}

const _: () = assert!(size_of::<RequestEntry>() == REQUEST_BYTES as usize);
const _: () = assert!(size_of::<CompletionEntry>() == COMPLETION_BYTES as usize);
const _: () = assert!(size_of::<PortHeader>() as u64 <= HEADER_BYTES);

impl AgentError {
    /// Its code in a completion (never 0).
    pub fn code(self) -> u32 {
        match self {
            Self::NoSpace => 1,
            Self::Stale => 2,
            Self::Corrupt => 3,
            Self::Io => 4,
            Self::Busy => 5,
            Self::Invalid => 6,
            Self::Cancelled => 7,
            Self::Reserved => 8,
            Self::Stopping => 9,
            Self::OverQuota => 10,
        }
    }

    /// Decodes a completion code (an unknown one reads as `Invalid`).
    pub fn from_code(code: u32) -> Self {
        match code {
            1 => Self::NoSpace,
            2 => Self::Stale,
            3 => Self::Corrupt,
            4 => Self::Io,
            5 => Self::Busy,
            7 => Self::Cancelled,
            8 => Self::Reserved,
            9 => Self::Stopping,
            10 => Self::OverQuota,
            _ => Self::Invalid,
        }
    }
}

impl RequestEntry {
    /// The entry for `request`.
    pub fn encode(request: &AgentRequest) -> Self {
        let mut entry = Self::zeroed();
        match *request {
            AgentRequest::Reserve { cookie, object_bytes } => {
                entry.kind = 1;
                entry.cookie = cookie;
                entry.object_bytes = object_bytes;
            }
            AgentRequest::Commit { cookie, slot, generation, crcs } => {
                entry.kind = 2;
                entry.cookie = cookie;
                entry.slot = slot;
                entry.generation = generation;
                // A commit has no class: its CRCs' origin rides there.
                entry.priority = crcs.code();
            }
            AgentRequest::Abort { cookie, slot, generation } => {
                entry.kind = 3;
                entry.cookie = cookie;
                entry.slot = slot;
                entry.generation = generation;
            }
            AgentRequest::Load { cookie, key, source, priority, trace } => {
                entry.kind = 4;
                entry.cookie = cookie;
                entry.key = key;
                entry.source = source;
                entry.priority = priority as u8;
                entry.trace = trace;
            }
            AgentRequest::Cancel { cookie, load } => {
                entry.kind = 5;
                entry.cookie = cookie;
                // The load's cookie rides in the size field.
                entry.object_bytes = load;
            }
        }
        entry
    }

    /// The request, or `Err(cookie)` when a field is out of its domain
    /// (answered `Invalid`).
    pub fn decode(&self) -> Result<AgentRequest, u64> {
        let cookie = self.cookie;
        let reserved = self.reserved_a != 0 || self.reserved_b != 0 || self.reserved_c.iter().any(|&b| b != 0);
        if reserved {
            return Err(cookie);
        }
        match self.kind {
            1..=3 if self.trace != 0 => Err(cookie),
            1 if self.object_bytes > 0 => Ok(AgentRequest::Reserve { cookie, object_bytes: self.object_bytes }),
            2 => {
                let crcs = CrcOrigin::from_code(self.priority).ok_or(cookie)?;
                Ok(AgentRequest::Commit { cookie, slot: self.slot, generation: self.generation, crcs })
            }
            3 => Ok(AgentRequest::Abort { cookie, slot: self.slot, generation: self.generation }),
            4 => {
                let priority = Priority::from_u8(self.priority).ok_or(cookie)?;
                if self.key.is_none() || self.source.reserved != 0 {
                    return Err(cookie);
                }
                Ok(AgentRequest::Load { cookie, key: self.key, source: self.source, priority, trace: self.trace })
            }
            5 if self.trace == 0 => Ok(AgentRequest::Cancel { cookie, load: self.object_bytes }),
            _ => Err(cookie),
        }
    }
}

impl CompletionEntry {
    fn encode(completion: &AgentCompletion) -> Self {
        let (status, slot, generation) = match completion.result {
            Ok((slot, generation)) => (0, slot, generation),
            Err(e) => (e.code(), 0, 0),
        };
        Self { cookie: completion.cookie, status, slot, generation, took_us: completion.took_us, reserved: [0; 8] }
    }

    fn decode(&self) -> AgentCompletion {
        let result =
            if self.status == 0 { Ok((self.slot, self.generation)) } else { Err(AgentError::from_code(self.status)) };
        AgentCompletion { cookie: self.cookie, result, took_us: self.took_us }
    }
}

/// Why a port file was refused.
#[derive(Debug)]
pub enum PortError {
    /// The system refused.
    Io(io::Error),
    /// The file is not a port file of this version, or is damaged: what.
    Header(&'static str),
    /// A port number or depth out of range.
    Config(&'static str),
}

impl core::fmt::Display for PortError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "agent ports: {e}"),
            Self::Header(what) => write!(f, "agent ports: header: {what}"),
            Self::Config(what) => write!(f, "agent ports: {what}"),
        }
    }
}

impl std::error::Error for PortError {}

/// The mapped port file.
pub struct PortFile {
    map: MmapRaw,
    file: File,
    header: PortHeader,
}

impl core::fmt::Debug for PortFile {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PortFile").field("header", &self.header).finish_non_exhaustive()
    }
}

fn port_bytes(depth: u32) -> u64 {
    let depth = u64::from(depth);
    (4 * INDEX_BYTES + depth * u64::from(REQUEST_BYTES + COMPLETION_BYTES)).next_multiple_of(4096)
}

impl PortFile {
    /// Creates a memfd with `ports` ports of `depth` entries per ring
    /// (rounded up to a power of two), every page reserved.
    pub fn create(ports: u32, depth: u32) -> Result<Self, PortError> {
        if ports == 0 || depth == 0 || depth > DEPTH_MAX {
            return Err(PortError::Config("ports and depth must be above 0, depth at most 65536"));
        }
        let depth = depth.next_power_of_two();
        let port_bytes = port_bytes(depth);
        let total_bytes = HEADER_BYTES + u64::from(ports) * port_bytes;
        let name = c"lake-agent-ports";
        // SAFETY: a valid NUL-terminated name; constant flags.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(PortError::Io(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let file = File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) });
        crate::shm::reserve(&file, total_bytes).map_err(|e| match e {
            crate::shm::ReserveError::Io(e) => PortError::Io(e),
            _ => PortError::Config("no room for the agent ports in memory"),
        })?;
        // Its size sealed: an engine given it cannot shrink it and fault
        // the data plane.
        crate::shm::seal(&file).map_err(PortError::Io)?;
        let map = crate::shm::map_populated(&file, total_bytes).map_err(PortError::Io)?;
        let mut header = PortHeader {
            magic: PORT_MAGIC,
            version: PORT_VERSION,
            ports,
            depth,
            request_bytes: REQUEST_BYTES,
            completion_bytes: COMPLETION_BYTES,
            reserved: 0,
            port_bytes,
            total_bytes,
            crc: 0,
            reserved_b: 0,
        };
        header.crc = crc32fast::hash(&bytemuck::bytes_of(&header)[..HEADER_CRC_END]);
        // SAFETY: the map is at least a page; nobody else maps it yet.
        unsafe { map.as_mut_ptr().cast::<PortHeader>().write(header) };
        Ok(Self { map, file, header })
    }

    /// Maps a port file received from `lake-dp`, checking its header.
    pub fn attach(file: File) -> Result<Self, PortError> {
        let size = file.metadata().map_err(PortError::Io)?.len();
        if size < HEADER_BYTES {
            return Err(PortError::Header("shorter than its header"));
        }
        let map = memmap2::MmapOptions::new().len(crate::usize_from(size)).map_raw(&file).map_err(PortError::Io)?;
        // SAFETY: at least a page is mapped; PortHeader is plain data read
        // by value (unaligned read tolerated).
        let header: PortHeader = unsafe { map.as_ptr().cast::<PortHeader>().read_unaligned() };
        if header.magic != PORT_MAGIC {
            return Err(PortError::Header("magic: not a Lake agent port file"));
        }
        if header.version != PORT_VERSION {
            return Err(PortError::Header("version: not this library's"));
        }
        if header.crc != crc32fast::hash(&bytemuck::bytes_of(&header)[..HEADER_CRC_END]) {
            return Err(PortError::Header("crc"));
        }
        let geometry_ok = header.request_bytes == REQUEST_BYTES
            && header.completion_bytes == COMPLETION_BYTES
            && header.depth.is_power_of_two()
            && header.depth <= DEPTH_MAX
            && header.port_bytes == port_bytes(header.depth)
            && Some(header.total_bytes)
                == u64::from(header.ports).checked_mul(header.port_bytes).map(|b| b + HEADER_BYTES)
            && header.total_bytes == size;
        if !geometry_ok {
            return Err(PortError::Header("geometry differs from the file's"));
        }
        Ok(Self { map, file, header })
    }

    /// The header.
    pub fn header(&self) -> &PortHeader {
        &self.header
    }

    /// The file (to pass to an agent).
    pub fn file(&self) -> &File {
        &self.file
    }

    fn parked_flag(&self) -> &core::sync::atomic::AtomicU32 {
        // SAFETY: inside the header page of the mapping, 4-byte aligned;
        // AtomicU32 has u32's layout; the mapping lives as long as self.
        unsafe { &*self.map.as_mut_ptr().wrapping_add(PARKED_OFFSET).cast::<core::sync::atomic::AtomicU32>() }
    }

    /// The data plane is about to park (`true`) or woke (`false`); after
    /// `true` it must look at the rings once more before parking (see
    /// [`PortFile::wake_needed`]).
    pub fn set_parked(&self, parked: bool) {
        self.parked_flag().store(u32::from(parked), Ordering::Relaxed);
        // SeqCst: the store-buffer pattern with `wake_needed`.
        core::sync::atomic::fence(Ordering::SeqCst);
    }

    fn pressure_flag(&self) -> &core::sync::atomic::AtomicU32 {
        // SAFETY: as `parked_flag`.
        unsafe { &*self.map.as_mut_ptr().wrapping_add(PRESSURE_OFFSET).cast::<core::sync::atomic::AtomicU32>() }
    }

    /// The data plane refuses saves now (`true`: it has no room it can make
    /// in time), or has room again.
    pub fn set_save_pressure(&self, pressure: bool) {
        self.pressure_flag().store(u32::from(pressure), Ordering::Relaxed);
    }

    /// Whether the data plane refuses saves now: an engine's connector
    /// skips saving a request rather than send saves to be refused.
    pub fn save_pressure(&self) -> bool {
        self.pressure_flag().load(Ordering::Relaxed) != 0
    }

    /// Whether an agent that just queued a request must write the data
    /// plane's eventfd.
    pub fn wake_needed(&self) -> bool {
        core::sync::atomic::fence(Ordering::SeqCst);
        self.parked_flag().load(Ordering::Relaxed) != 0
    }

    fn base(&self, port: u32) -> *mut u8 {
        let offset = HEADER_BYTES + u64::from(port) * self.header.port_bytes;
        self.map.as_mut_ptr().wrapping_add(crate::usize_from(offset))
    }

    fn index(&self, port: u32, which: u64) -> &AtomicU64 {
        // SAFETY: in the mapping (port < ports, checked by the callers'
        // constructors); 128-byte aligned (page-aligned port + k × 128);
        // AtomicU64 has u64's layout; the mapping lives as long as self.
        unsafe { &*self.base(port).wrapping_add(crate::usize_from(which * INDEX_BYTES)).cast::<AtomicU64>() }
    }

    fn request_ptr(&self, port: u32, index: u64) -> *mut RequestEntry {
        let at = 4 * INDEX_BYTES + (index & u64::from(self.header.depth - 1)) * u64::from(REQUEST_BYTES);
        self.base(port).wrapping_add(crate::usize_from(at)).cast()
    }

    fn completion_ptr(&self, port: u32, index: u64) -> *mut CompletionEntry {
        let depth = u64::from(self.header.depth);
        let at =
            4 * INDEX_BYTES + depth * u64::from(REQUEST_BYTES) + (index & (depth - 1)) * u64::from(COMPLETION_BYTES);
        self.base(port).wrapping_add(crate::usize_from(at)).cast()
    }
}

const REQ_HEAD: u64 = 0;
const REQ_TAIL: u64 = 1;
const DONE_HEAD: u64 = 2;
const DONE_TAIL: u64 = 3;

/// The data plane's end of one shared port.
#[derive(Debug)]
pub struct DpShmPort {
    file: Arc<PortFile>,
    port: u32,
    req_head: u64,
    done_tail: u64,
}

/// The agent's end of one shared port.
#[derive(Debug)]
pub struct AgentShmPort {
    /// The port file.
    pub file: Arc<PortFile>,
    port: u32,
    req_tail: u64,
    done_head: u64,
}

/// A ring had no room: the entry was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Full;

/// What the data plane found in a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Popped {
    /// A well-formed request.
    Request(AgentRequest),
    /// A malformed one: answer its cookie `Invalid`.
    Invalid(u64),
    /// The agent broke the ring (an index ran ahead): detach it.
    Broken,
}

impl DpShmPort {
    /// Port `port` of `file`, reset to empty (call before handing it to a
    /// new agent).
    pub fn open(file: Arc<PortFile>, port: u32) -> Result<Self, PortError> {
        if port >= file.header.ports {
            return Err(PortError::Config("no such port"));
        }
        for which in [REQ_HEAD, REQ_TAIL, DONE_HEAD, DONE_TAIL] {
            file.index(port, which).store(0, Ordering::Release);
        }
        Ok(Self { file, port, req_head: 0, done_tail: 0 })
    }

    fn depth(&self) -> u64 {
        u64::from(self.file.header.depth)
    }

    /// The oldest request, if any.
    pub fn pop(&mut self) -> Option<Popped> {
        // Acquire: pairs with the agent's Release store of its tail.
        let tail = self.file.index(self.port, REQ_TAIL).load(Ordering::Acquire);
        if tail == self.req_head {
            return None;
        }
        if tail.wrapping_sub(self.req_head) > self.depth() {
            return Some(Popped::Broken);
        }
        // SAFETY: in the mapping; the agent published this entry (tail
        // past it). Read once, by value: whatever the agent writes later
        // cannot change what is checked below.
        let entry = unsafe { self.file.request_ptr(self.port, self.req_head).read_volatile() };
        self.req_head += 1;
        // Release: our read of the entry happens before the agent reuses it.
        self.file.index(self.port, REQ_HEAD).store(self.req_head, Ordering::Release);
        Some(match entry.decode() {
            Ok(request) => Popped::Request(request),
            Err(cookie) => Popped::Invalid(cookie),
        })
    }

    /// Whether a request waits.
    pub fn has_requests(&self) -> bool {
        self.file.index(self.port, REQ_TAIL).load(Ordering::Acquire) != self.req_head
    }

    /// Free completion places (a lower bound; 0 when the agent broke the
    /// ring).
    pub fn free(&self) -> usize {
        // Acquire: pairs with the agent's Release store of its head.
        let head = self.file.index(self.port, DONE_HEAD).load(Ordering::Acquire);
        let used = self.done_tail.wrapping_sub(head);
        usize::try_from(self.depth().saturating_sub(used)).unwrap_or(0)
    }

    /// Queues a completion; a full ring hands it back.
    pub fn push(&mut self, completion: &AgentCompletion) -> Result<(), Full> {
        if self.free() == 0 {
            return Err(Full);
        }
        // SAFETY: in the mapping; the agent has released this place (free
        // check) and will not read it before the tail below says so.
        unsafe {
            self.file.completion_ptr(self.port, self.done_tail).write_volatile(CompletionEntry::encode(completion));
        }
        self.done_tail += 1;
        // Release: publishes the entry to the agent's Acquire load.
        self.file.index(self.port, DONE_TAIL).store(self.done_tail, Ordering::Release);
        Ok(())
    }
}

impl AgentShmPort {
    /// Port `port` of the file `lake-dp` passed at attach.
    pub fn attach(file: File, port: u32) -> Result<Self, PortError> {
        let file = Arc::new(PortFile::attach(file)?);
        if port >= file.header.ports {
            return Err(PortError::Config("no such port"));
        }
        let req_tail = file.index(port, REQ_TAIL).load(Ordering::Acquire);
        let done_head = file.index(port, DONE_HEAD).load(Ordering::Acquire);
        Ok(Self { file, port, req_tail, done_head })
    }

    /// Queues a request; a full ring hands it back.
    pub fn push(&mut self, request: &AgentRequest) -> Result<(), Full> {
        // Acquire: pairs with the data plane's Release store of its head.
        let head = self.file.index(self.port, REQ_HEAD).load(Ordering::Acquire);
        if self.req_tail.wrapping_sub(head) >= u64::from(self.file.header.depth) {
            return Err(Full);
        }
        // SAFETY: in the mapping; the data plane has read this place (head
        // check) and will not read it again before the tail below.
        unsafe { self.file.request_ptr(self.port, self.req_tail).write_volatile(RequestEntry::encode(request)) };
        self.req_tail += 1;
        // Release: publishes the entry to the data plane's Acquire load.
        self.file.index(self.port, REQ_TAIL).store(self.req_tail, Ordering::Release);
        Ok(())
    }

    /// The next completion, if any.
    pub fn pop(&mut self) -> Option<AgentCompletion> {
        // Acquire: pairs with the data plane's Release store of its tail.
        let tail = self.file.index(self.port, DONE_TAIL).load(Ordering::Acquire);
        if tail == self.done_head {
            return None;
        }
        // SAFETY: in the mapping; published by the data plane.
        let entry = unsafe { self.file.completion_ptr(self.port, self.done_head).read_volatile() };
        self.done_head += 1;
        // Release: our read happens before the data plane reuses the place.
        self.file.index(self.port, DONE_HEAD).store(self.done_head, Ordering::Release);
        Some(entry.decode())
    }
}

// SAFETY: the ends touch shared memory only through atomics and volatile
// copies of plain data, as the protocol above says; each end is used by
// one thread at a time (it is `&mut self` for every operation).
unsafe impl Send for DpShmPort {}
// SAFETY: as above.
unsafe impl Send for AgentShmPort {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_completions_cross_and_bad_entries_are_named() {
        let file = Arc::new(PortFile::create(4, 8).unwrap());
        let mut dp = DpShmPort::open(Arc::clone(&file), 2).unwrap();
        let mut agent = AgentShmPort::attach(file.file().try_clone().unwrap(), 2).unwrap();
        let requests = [
            AgentRequest::Reserve { cookie: 1, object_bytes: 8192 },
            AgentRequest::Commit { cookie: 2, slot: 3, generation: 4, crcs: CrcOrigin::Unknown },
            AgentRequest::Commit { cookie: 2, slot: 3, generation: 4, crcs: CrcOrigin::Slot },
            AgentRequest::Commit { cookie: 2, slot: 3, generation: 4, crcs: CrcOrigin::Kernel },
            AgentRequest::Abort { cookie: 3, slot: 5, generation: 6 },
            AgentRequest::Load {
                cookie: 4,
                key: BlockKey([7; 16]),
                source: ReplicaWire {
                    tier: 2,
                    reserved: 0,
                    region: 1,
                    node: 0,
                    region_epoch: 3,
                    slot: 9,
                    generation: 2,
                },
                priority: Priority::CriticalLoad,
                trace: 0x7ace_0000_0000_0042,
            },
            AgentRequest::Cancel { cookie: 5, load: 4 },
        ];
        for request in &requests {
            agent.push(request).unwrap();
        }
        for request in &requests {
            assert_eq!(dp.pop(), Some(Popped::Request(*request)));
        }
        assert_eq!(dp.pop(), None);
        // Full at depth 8.
        for i in 0..8 {
            agent.push(&AgentRequest::Reserve { cookie: i, object_bytes: 1 }).unwrap();
        }
        assert!(agent.push(&AgentRequest::Reserve { cookie: 9, object_bytes: 1 }).is_err());
        while dp.pop().is_some() {}
        // Completions back.
        dp.push(&AgentCompletion { cookie: 1, result: Ok((3, 4)), took_us: 17 }).unwrap();
        dp.push(&AgentCompletion { cookie: 2, result: Err(AgentError::Corrupt), took_us: 0 }).unwrap();
        assert_eq!(agent.pop(), Some(AgentCompletion { cookie: 1, result: Ok((3, 4)), took_us: 17 }));
        assert_eq!(agent.pop(), Some(AgentCompletion { cookie: 2, result: Err(AgentError::Corrupt), took_us: 0 }));
        assert_eq!(agent.pop(), None);
        // A scribbled entry is answered Invalid; a runaway tail is broken.
        // A trace id on anything but a load is out of its domain.
        let mut traced = RequestEntry::encode(&requests[1]);
        traced.trace = 9;
        assert_eq!(traced.decode(), Err(2));
        // A commit's CRC origin is one of three.
        let mut origin = RequestEntry::encode(&requests[3]);
        origin.priority = 3;
        assert_eq!(origin.decode(), Err(2));
        let mut bad = RequestEntry::encode(&requests[0]);
        bad.reserved_c[3] = 1;
        // SAFETY: test: writes the next request place as a rogue agent.
        unsafe { file.request_ptr(2, agent.req_tail).write(bad) };
        file.index(2, REQ_TAIL).store(agent.req_tail + 1, Ordering::Release);
        assert_eq!(dp.pop(), Some(Popped::Invalid(1)));
        file.index(2, REQ_TAIL).store(agent.req_tail + 1000, Ordering::Release);
        assert_eq!(dp.pop(), Some(Popped::Broken));
        // Another port is untouched.
        let mut other = DpShmPort::open(Arc::clone(&file), 3).unwrap();
        assert_eq!(other.pop(), None);
    }

    #[test]
    fn files_that_are_not_port_files_are_refused() {
        use std::os::unix::fs::FileExt;

        let file = PortFile::create(1, 4).unwrap();
        // Its size is sealed: an engine given it can neither shrink it
        // (faulting the data plane) nor grow it.
        let copy = file.file().try_clone().unwrap();
        for len in [0, 4096, file.header().total_bytes + 4096] {
            assert_eq!(copy.set_len(len).unwrap_err().raw_os_error(), Some(libc::EPERM), "{len}");
        }
        // Its header in a file of another size.
        let other = tempfile_in_shm();
        other.set_len(file.header().total_bytes + 4096).unwrap();
        other.write_all_at(bytemuck::bytes_of(file.header()), 0).unwrap();
        assert!(matches!(PortFile::attach(other), Err(PortError::Header("geometry differs from the file's"))));
        let empty = tempfile_in_shm();
        assert!(matches!(PortFile::attach(empty), Err(PortError::Header(_))));
        assert!(matches!(PortFile::create(0, 4), Err(PortError::Config(_))));
    }

    fn tempfile_in_shm() -> File {
        let path = format!("/dev/shm/lake-test-ports-{}", std::process::id());
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(8192).unwrap();
        let _ = std::fs::remove_file(&path);
        file
    }
}
