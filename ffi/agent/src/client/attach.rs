//! Attaching from another process: the hello on the data plane's attach
//! socket, its answer with the arena, the port file and the wake-up
//! eventfd, and why an attach failed.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use lake_core::arena::{Arena, ArenaError};
use lake_core::os::recv_with_fds;
use lake_core::wire::hello::{HELLO_WIRE_VERSION, Identity};
use lake_core::wire::message::{ErrorCode, Role};
use lake_core::wire::{FrameMeta, Limits, Message, WireError, decode_frame, encode_frame};

use super::{Agent, AgentConfig, WAIT_MAX};
use crate::port::AgentPort;
use crate::shm::AgentShmPort;

/// Why attaching failed.
#[derive(Debug)]
pub enum AttachError {
    /// The data plane refused this agent at hello, with its code (`None`
    /// for one this build does not know) and why: `VersionMismatch` (no
    /// wire version in common), `QueueFull` (every agent port is taken:
    /// try again later), `Unauthorized` (a peer it does not allow).
    Refused {
        /// The data plane's attach socket.
        socket: PathBuf,
        /// Its error code.
        code: Option<ErrorCode>,
        /// What it said.
        detail: String,
    },
    /// The attach socket failed: not there, not answering in time, or
    /// closed before the attach completed.
    Socket {
        /// The data plane's attach socket.
        socket: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        error: std::io::Error,
    },
    /// The answer broke the attach protocol: a frame that does not
    /// decode, a message out of order, descriptors missing or not those
    /// announced.
    Protocol(String),
    /// The pool's shared memory could not be mapped: the arena, the
    /// agent's port, the mirror, a pin array.
    Memory(String),
    /// Every agent record in the L1 arena is claimed: the engines attached
    /// hold them all (an engine takes one for its agent, one for its agent
    /// thread, one for its pushes and one per copy lane). One frees as an
    /// engine detaches or dies.
    RecordsFull,
    /// The link to the control plane (leases, reports) could not be made.
    ControlPlane(String),
    /// The configuration is not one an agent can attach with.
    Invalid(&'static str),
}

impl core::fmt::Display for AttachError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("agent attach: ")?;
        match self {
            Self::Refused { socket, code, detail } => write!(f, "{}: refused ({code:?}): {detail}", socket.display()),
            Self::Socket { socket, what, error } => write!(f, "{}: {what}: {error}", socket.display()),
            Self::Protocol(why) | Self::Memory(why) => f.write_str(why),
            Self::RecordsFull => f.write_str("every agent record in the L1 arena is claimed by the engines attached"),
            Self::ControlPlane(why) => write!(f, "the control plane: {why}"),
            Self::Invalid(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for AttachError {}

impl AttachError {
    /// Why an agent record could not be claimed.
    pub(super) fn of_claim(error: ArenaError) -> Self {
        match error {
            ArenaError::AgentsFull => Self::RecordsFull,
            other => Self::Memory(other.to_string()),
        }
    }
}

impl Agent {
    /// Attaches to the `lake-dp` listening on `dp_socket` (its `[agents]
    /// socket`) from another process: hello, then the arena, the port file
    /// and the wake-up eventfd arrive over the socket, which stays open as
    /// this agent's liveness (`config.arena` is not used).
    pub fn connect(config: &AgentConfig<'_>, dp_socket: &Path) -> Result<Self, AttachError> {
        let socket = |what: &'static str| {
            move |error: std::io::Error| AttachError::Socket { socket: dp_socket.to_path_buf(), what, error }
        };
        let protocol = |what: &str, e: &dyn core::fmt::Display| {
            AttachError::Protocol(format!("{}: {what}: {e}", dp_socket.display()))
        };
        let stream = UnixStream::connect(dp_socket).map_err(socket("connecting"))?;
        stream.set_read_timeout(Some(WAIT_MAX)).map_err(socket("setting a timeout"))?;
        let identity = Identity {
            role: Role::Agent,
            node: 0,
            pid: std::process::id(),
            region_epoch: 0,
            features: lake_core::wire::ATTACH_FEATURES,
            name: config.name,
        };
        let hello = lake_core::wire::hello::hello(&identity).map_err(|e| protocol("hello", &e))?;
        let mut frame = [0u8; 256];
        let meta = FrameMeta { version: HELLO_WIRE_VERSION, flags: 0, request_id: 1, leader_term: 0 };
        let len = encode_frame(meta, &Message::Hello(hello), &mut frame).map_err(|e| protocol("hello", &e))?;
        // A refusal may come before the hello is read (lake-dp refuses a
        // peer it does not allow as it connects, and closes): the answer is
        // read even when sending failed, so the refusal is what is said.
        let mut unsent = (&stream).write_all(&frame[..len]).err();
        // The answer: `HelloAck`, the push caps (up to 1024 entries), then
        // `Attached` with the descriptors.
        let mut input = vec![0u8; 1024 + lake_core::wire::message::PUSH_CAPS_MAX * 24];
        let mut push_caps = Vec::new();
        let mut have = 0;
        let mut fds = Vec::new();
        let mut ack = None;
        let mut found = None;
        let attached = loop {
            let received = recv_with_fds(stream.as_raw_fd(), &mut input[have..], &mut fds);
            if !matches!(received, Ok(n) if n > 0)
                && let Some(error) = unsent.take()
            {
                return Err(socket("sending the hello")(error));
            }
            let n = received.map_err(socket("waiting for the answer"))?;
            if n == 0 {
                let closed = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "lake-dp closed the connection");
                return Err(socket("waiting for the answer")(closed));
            }
            have += n;
            loop {
                let frame = match decode_frame(&input[..have], &Limits::default()) {
                    Err(WireError::Incomplete { .. }) => break,
                    Err(e) => return Err(protocol("answer", &e)),
                    Ok(frame) => frame,
                };
                let used = frame.len();
                let message = frame.message;
                match message {
                    Message::HelloAck(a) => ack = Some(a),
                    Message::PushCaps(_, caps) if ack.is_some() => push_caps = caps.iter().collect(),
                    Message::Attached(attached) if ack.is_some() => found = Some(attached),
                    Message::Error(e) => {
                        return Err(AttachError::Refused {
                            socket: dp_socket.to_path_buf(),
                            code: ErrorCode::from_u32(e.code),
                            detail: e.detail().to_owned(),
                        });
                    }
                    other => return Err(protocol("unexpected answer", &format_args!("{other:?}"))),
                }
                input.copy_within(used..have, 0);
                have -= used;
            }
            if let Some(attached) = found {
                break attached;
            }
        };
        // The arena, the port file, the wake-up eventfd, the file of the
        // partition this agent maps (in a partitioned arena: one is named,
        // as its number plus 1), and the mirror where the data plane
        // passes it, then the cluster view where it passes that too.
        let takes = |feature: u64| ack.is_some_and(|ack| ack.features & feature != 0);
        let partitions = takes(lake_core::wire::FEATURE_PARTITIONS);
        let named = if partitions { usize::from(attached.partition).checked_sub(1) } else { None };
        let least = 3 + usize::from(named.is_some());
        let most = least + 1 + usize::from(takes(lake_core::wire::FEATURE_VIEW_FD));
        if !(least..=most).contains(&fds.len()) {
            let why = format_args!("expected {least} to {most}, got {}", fds.len());
            return Err(protocol("descriptors", &why));
        }
        let mut fds = fds.into_iter();
        let (Some(arena_fd), Some(ports), Some(wakeup)) = (fds.next(), fds.next(), fds.next()) else {
            return Err(protocol("descriptors", &"fewer than 3"));
        };
        let partition_fd = if named.is_some() { fds.next() } else { None };
        let mirror = fds.next();
        let view = fds.next();
        // A tenant's engine (partition past 0) reads the view passed, its
        // tenant's, and never opens one by its path: the one beside the
        // pool's mirror shows the pool's blocks, not its tenant's. A view
        // that cannot be mapped is none (lookups find this node's blocks
        // only), not a failed attach.
        let tenant = named.is_some_and(|partition| partition > 0);
        let fallback = (!tenant).then(|| lake_core::mirror::view::ViewOpener::path_beside(config.mirror));
        let cluster = lake_core::mirror::view::ViewOpener::passed(
            view.and_then(|fd| lake_core::mirror::view::ViewReader::attach_fd(fd).ok()),
            fallback,
        );
        let ports = File::from(ports);
        // An open of the arena made for this agent where the data plane
        // makes one (its records' locks are taken on it), mapped with only
        // the partition it is given.
        let own = takes(lake_core::wire::FEATURE_OWN_FDS);
        let arena = match (own, partitions) {
            (true, true) => Arena::attach_partition(arena_fd, named.unwrap_or(0), partition_fd),
            (true, false) => Arena::attach_own_fd(arena_fd),
            (false, _) => Arena::attach_fd(arena_fd),
        }
        .map_err(|e| AttachError::Memory(e.to_string()))?;
        if arena.header().epoch != attached.epoch || arena.header().region != attached.arena_region {
            return Err(protocol("descriptors", &"the arena passed is not the one announced"));
        }
        let port = AgentShmPort::attach(ports, attached.port).map_err(|e| AttachError::Memory(e.to_string()))?;
        // A data plane built before trace ids refuses a request carrying one.
        let traces_taken = takes(lake_core::wire::FEATURE_TRACE);
        let shared = AgentPort::Shared { port, wakeup };
        let mut agent = Self::with(config, (arena, mirror), shared, Some(stream), traces_taken)?;
        agent.push_caps = push_caps;
        agent.cluster = cluster;
        Ok(agent)
    }

    /// The caps on tenants' pushes its data plane told it at attach (none
    /// from one built before them), as buckets: the engine's pushes keep
    /// to them ([`crate::push::Pusher::with_caps`]).
    pub fn push_rates(&self) -> lake_core::rates::TenantRates {
        use lake_core::rates::{RATE_PATHS, RatePath, TenantRate};
        let mut tenants: Vec<TenantRate> = Vec::new();
        for cap in &self.push_caps {
            let index = cap.tenant as usize;
            while tenants.len() <= index {
                tenants.push(TenantRate {
                    name: format!("tenant-{}", tenants.len()),
                    namespaces: Vec::new(),
                    bytes_per_s: [None; RATE_PATHS],
                });
            }
            tenants[index].namespaces.push(cap.namespace);
            tenants[index].bytes_per_s[RatePath::NetSend as usize] = Some(cap.bytes_per_s);
        }
        tenants.retain(|t| !t.namespaces.is_empty());
        lake_core::rates::TenantRates::new(&tenants)
    }
}
