//! The in-process port between an agent and the `lake-dp` runner: a
//! request ring and a completion ring (bounded SPSC, allocated at start)
//! and the runner's wake-up eventfd. Agents in other processes send the
//! same requests over rings in shared memory (`agent::shm`).

use std::sync::Arc;

use crate::model::key::BlockKey;
use crate::model::replica::{Priority, ReplicaWire};
use crate::os::Wakeup;
use crate::ring::{Consumer, Producer, ring};

/// Loads an agent asks of the data plane at once (one fetch's batch of
/// lower-tier blocks); a pool keeps that many L1 slots for loads by
/// default.
pub const LOAD_BATCH: usize = 8;

/// What an agent asks of the data plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentRequest {
    /// Reserve an L1 slot for an object of `object_bytes` (stored header
    /// included). Phase one of a save.
    Reserve {
        /// Echoed in the completion.
        cookie: u64,
        /// Header plus padded payload.
        object_bytes: u64,
    },
    /// The reserved slot holds a complete object (header naming this slot
    /// and generation, payload matching its CRCs): publish it. Phase two.
    Commit {
        /// Echoed in the completion.
        cookie: u64,
        /// The reserved slot.
        slot: u32,
        /// Its generation at reservation.
        generation: u32,
        /// Where the CRCs in its header came from: what the data plane's
        /// commit check may take on trust (see `CommitCheck`).
        crcs: CrcOrigin,
    },
    /// Give a reserved slot back unused.
    Abort {
        /// Echoed in the completion.
        cookie: u64,
        /// The reserved slot.
        slot: u32,
        /// Its generation at reservation.
        generation: u32,
    },
    /// Bring a block from L2 into L1, verified, and keep it there (the
    /// agent then reads it through a pin, like any L1 hit).
    Load {
        /// Echoed in the completion.
        cookie: u64,
        /// The block.
        key: BlockKey,
        /// Its L2 replica (from a lease).
        source: ReplicaWire,
        /// Its class.
        priority: Priority,
        /// The engine's trace id for the request this load serves (0:
        /// untraced): the data plane logs the load under it and answers
        /// with its time on it.
        trace: u64,
    },
    /// Stop the load asked with cookie `load` if it has not been read yet
    /// (its request was aborted): a load still queued is dropped — its
    /// answer `Cancelled` — and one already reading is answered when the
    /// read ends. Answered `Ok` when it stopped one, `Stale` when there was
    /// none left to stop.
    Cancel {
        /// Echoed in the completion.
        cookie: u64,
        /// The load's cookie.
        load: u64,
    },
}

/// Where the segment CRCs of a committed block came from. The data plane
/// checks payloads against them inline or off the commit's path by this
/// (`CommitCheck::Auto`); readers check every segment they read whatever
/// it says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CrcOrigin {
    /// Not said (an agent other than Lake's own): checked before the
    /// block is published.
    #[default]
    Unknown,
    /// Computed by Lake's agent from the bytes it copied into the slot,
    /// as it copied them.
    Slot,
    /// Computed by Lake's GPU kernel over the engine's registered memory,
    /// in the stream order of the copies that wrote the slot.
    Kernel,
}

impl CrcOrigin {
    /// Its code on a shared port.
    pub fn code(self) -> u8 {
        match self {
            Self::Unknown => 0,
            Self::Slot => 1,
            Self::Kernel => 2,
        }
    }

    /// Decodes a port code (`None`: out of its domain).
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(Self::Unknown),
            1 => Some(Self::Slot),
            2 => Some(Self::Kernel),
            _ => None,
        }
    }
}

/// Why an agent request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentError {
    /// No free slot (L1 full, or no L2 room), and no victim to take in
    /// time: the pool is full of blocks it cannot yet let go of.
    NoSpace,
    /// The slot or replica named is not what it was (evicted, reused).
    Stale,
    /// The object failed its checks (header, CRC): not published; the
    /// engine recomputes.
    Corrupt,
    /// The device failed.
    Io,
    /// The data plane is too busy to start it now (retry later).
    Busy,
    /// The request was malformed.
    Invalid,
    /// The agent cancelled it ([`AgentRequest::Cancel`]).
    Cancelled,
    /// A save refused: the free L1 slots left are the load reserve, kept
    /// for loads (`load-reserve-slots`).
    Reserved,
    /// Refused: the pool is stopping (saves are closed while it writes L1
    /// down and drains).
    Stopping,
    /// A save refused at its commit: the block would take its namespace,
    /// or its tenant across its namespaces, past an L1 quota.
    OverQuota,
}

impl core::fmt::Display for AgentError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::NoSpace => "no space in the tier",
            Self::Stale => "the slot or replica is gone",
            Self::Corrupt => "the block failed its checks",
            Self::Io => "device error",
            Self::Busy => "data plane busy",
            Self::Invalid => "invalid request",
            Self::Cancelled => "cancelled by the agent",
            Self::Reserved => "only the load reserve is free",
            Self::Stopping => "the pool is stopping",
            Self::OverQuota => "its namespace or tenant is at its L1 quota",
        })
    }
}

impl AgentError {
    /// Its name in logs (`"no_space"`, …).
    pub fn name(self) -> &'static str {
        match self {
            Self::NoSpace => "no_space",
            Self::Stale => "stale",
            Self::Corrupt => "corrupt",
            Self::Io => "io",
            Self::Busy => "busy",
            Self::Invalid => "invalid",
            Self::Cancelled => "cancelled",
            Self::Reserved => "load_reserve",
            Self::Stopping => "stopping",
            Self::OverQuota => "over_quota",
        }
    }
}

impl std::error::Error for AgentError {}

/// The answer to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentCompletion {
    /// The request's cookie.
    pub cookie: u64,
    /// The L1 slot and generation (reserved, committed or loaded into), or
    /// why not.
    pub result: Result<(u32, u32), AgentError>,
    /// A traced load's time in the data plane, from taking the request to
    /// this answer, in µs (saturating); 0 for any other.
    pub took_us: u32,
}

/// The data plane's end of a port: in-process rings, or a port in shared
/// memory for an agent in another process.
pub enum DpPort {
    /// In-process rings.
    Local {
        /// Requests in.
        requests: Consumer<AgentRequest>,
        /// Completions out.
        completions: Producer<AgentCompletion>,
    },
    /// A shared-memory port.
    Shared(super::shm::DpShmPort),
}

impl DpPort {
    /// The next request (or a malformed one, or a broken ring).
    pub fn pop(&mut self) -> Option<super::shm::Popped> {
        match self {
            Self::Local { requests, .. } => requests.pop().map(super::shm::Popped::Request),
            Self::Shared(port) => port.pop(),
        }
    }

    /// Whether a request waits.
    pub fn has_requests(&mut self) -> bool {
        match self {
            Self::Local { requests, .. } => !requests.is_empty(),
            Self::Shared(port) => port.has_requests(),
        }
    }

    /// Free completion places.
    pub fn free(&mut self) -> usize {
        match self {
            Self::Local { completions, .. } => completions.free(),
            Self::Shared(port) => port.free(),
        }
    }

    /// Queues a completion (room was checked with `free`).
    pub fn push(&mut self, completion: AgentCompletion) {
        match self {
            Self::Local { completions, .. } => {
                let _ = completions.push(completion);
            }
            Self::Shared(port) => {
                let _ = port.push(&completion);
            }
        }
    }
}

impl core::fmt::Debug for DpPort {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("DpPort").finish_non_exhaustive()
    }
}

/// The agent's end of a port.
pub enum AgentPort {
    /// In-process rings to a runner in this process.
    Local {
        /// Requests out.
        requests: Producer<AgentRequest>,
        /// Completions in.
        completions: Consumer<AgentCompletion>,
        /// The runner's wake-up.
        wakeup: Arc<Wakeup>,
    },
    /// A port in shared memory of a `lake-dp` in another process.
    Shared {
        /// The port.
        port: super::shm::AgentShmPort,
        /// The data plane's wake-up eventfd.
        wakeup: std::os::fd::OwnedFd,
    },
}

impl core::fmt::Debug for AgentPort {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AgentPort").finish_non_exhaustive()
    }
}

/// Reads whether a data plane refuses saves now, from any thread, with
/// no request: the flag it keeps where its agents see it.
#[derive(Clone)]
pub enum SavePressure {
    /// A runner in this process.
    Local(Arc<Wakeup>),
    /// A `lake-dp` in another process: its port file.
    Shared(Arc<super::shm::PortFile>),
}

impl SavePressure {
    /// Whether saves are refused now.
    pub fn get(&self) -> bool {
        match self {
            Self::Local(wakeup) => wakeup.save_pressure(),
            Self::Shared(file) => file.save_pressure(),
        }
    }
}

impl core::fmt::Debug for SavePressure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_tuple("SavePressure").field(&self.get()).finish()
    }
}

/// A port with room for `depth` requests in flight (a power of two).
pub fn port(depth: usize, wakeup: Arc<Wakeup>) -> (AgentPort, DpPort) {
    let (request_tx, request_rx) = ring(depth);
    let (completion_tx, completion_rx) = ring(depth);
    (
        AgentPort::Local { requests: request_tx, completions: completion_rx, wakeup },
        DpPort::Local { requests: request_rx, completions: completion_tx },
    )
}

impl AgentPort {
    /// Whether the data plane refuses saves now (no room it can make in
    /// time, or stopping): read from shared memory, no request sent.
    pub fn save_pressure(&self) -> bool {
        self.save_pressure_probe().get()
    }

    /// A handle that reads [`AgentPort::save_pressure`] from any thread.
    pub fn save_pressure_probe(&self) -> SavePressure {
        match self {
            Self::Local { wakeup, .. } => SavePressure::Local(Arc::clone(wakeup)),
            Self::Shared { port, .. } => SavePressure::Shared(Arc::clone(&port.file)),
        }
    }

    /// Queues a request and wakes the data plane; a full ring hands it
    /// back.
    pub fn submit(&mut self, request: AgentRequest) -> Result<(), AgentRequest> {
        match self {
            Self::Local { requests, wakeup, .. } => {
                requests.push(request)?;
                wakeup.wake_if_parked();
            }
            Self::Shared { port, wakeup } => {
                port.push(&request).map_err(|_| request)?;
                if port.file.wake_needed() {
                    wake_fd(wakeup);
                }
            }
        }
        Ok(())
    }

    /// The next completion, if any.
    pub fn complete(&mut self) -> Option<AgentCompletion> {
        match self {
            Self::Local { completions, .. } => completions.pop(),
            Self::Shared { port, .. } => port.pop(),
        }
    }
}

/// Writes 1 to an eventfd (a full counter already means "awake").
fn wake_fd(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    let one = 1u64;
    // SAFETY: writes 8 bytes from a valid u64 to a descriptor we own.
    let _ = unsafe { libc::write(fd.as_raw_fd(), (&raw const one).cast(), 8) };
}
