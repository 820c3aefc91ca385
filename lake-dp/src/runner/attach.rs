//! The attach socket: how an engine in another process becomes an agent of
//! this `lake-dp`.
//!
//! The agent connects to `[agents] socket` and sends a `Hello` (role
//! agent). `lake-dp` answers `HelloAck` (the common wire version) and
//! `Attached` (its port number, ring depth, epoch, arena region) in one
//! message that carries, as `SCM_RIGHTS`, the L1 arena, the port file and
//! the wake-up eventfd. From then on the connection carries nothing: it is
//! the agent's liveness. When it closes — the agent detached, or its
//! process died — the port goes back and the agent's reservations are
//! taken back (its pins go with its process: the arena's record lock).
//! Anything but a hello, a second agent when every port is taken, or a
//! version with nothing in common gets an `Error` frame and a close; a
//! connection that says nothing within a second is closed.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::os;
use super::pool::Pool;
use crate::agent::port::DpPort;
use crate::agent::shm::{DpShmPort, PortFile};
use crate::arena::SlotTable;
use crate::wire::hello::{self, HELLO_WIRE_VERSION, Identity};
use crate::wire::message::{Attached, ErrorBody, ErrorCode, Hello, PushCap, PushCaps, Records, Role, text_field};
use crate::wire::{FLAG_REPLY, FrameMeta, Limits, Message, WireError, decode_frame, encode_frame};

/// A connection that has not said hello within this time is closed.
pub const HELLO_TIMEOUT_NS: u64 = 1_000_000_000;

/// Bytes of hello a connection may send (a hello frame is far smaller).
const HELLO_BYTES_MAX: usize = 512;

#[allow(clippy::large_enum_variant)] // a fixed hello buffer: attaching never allocates
enum Stage {
    /// Waiting for the hello; what arrived so far (no allocation: agents
    /// attach while the runner is sealed).
    Hello {
        since_ns: u64,
        input: [u8; HELLO_BYTES_MAX],
        have: usize,
    },
    Attached,
}

struct Connection {
    stream: UnixStream,
    stage: Stage,
}

/// What the attach socket has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttachCounters {
    /// Agents attached.
    pub attached: u64,
    /// Agents gone (detached or died).
    pub detached: u64,
    /// Connections refused (bad hello, no free port, silence).
    pub refused: u64,
    /// Agents detached for breaking their ring.
    pub broken: u64,
    /// Connections refused for their peer's credentials (not on the
    /// allow-list).
    pub strangers: u64,
}

/// The attach socket. See the module docs.
pub struct AttachServer {
    listener: UnixListener,
    path: PathBuf,
    ports: Arc<PortFile>,
    /// One place per shared port.
    connections: Vec<Option<Connection>>,
    local: Hello,
    epoch: u64,
    arena_region: u16,
    /// Who may attach.
    policy: crate::auth::PeerPolicy,
    /// The last connection refused for its credentials, and why (for the
    /// log; taken by [`AttachServer::take_refusal`]).
    refusal: Option<String>,
    /// Caps on tenants' pushes, told to every agent that takes them.
    push_caps: Vec<crate::wire::message::PushCap>,
    /// What it has done.
    pub counters: AttachCounters,
}

impl core::fmt::Debug for AttachServer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AttachServer").field("path", &self.path).field("counters", &self.counters).finish()
    }
}

impl AttachServer {
    /// Listens on `path` (a stale socket file is replaced) for agents of
    /// the ports in `ports`. The file appears only once it is listening
    /// (bound under another name, then renamed): whoever sees it (an
    /// embedder waiting for readiness, an engine) can connect at once.
    pub fn bind(path: &Path, ports: Arc<PortFile>, identity: &Identity<'_>, arena_region: u16) -> io::Result<Self> {
        let mut building = path.as_os_str().to_owned();
        building.push(format!(".{}", std::process::id()));
        let building = std::path::PathBuf::from(building);
        let _ = std::fs::remove_file(&building);
        let listener = UnixListener::bind(&building)?;
        if let Err(e) = std::fs::rename(&building, path) {
            let _ = std::fs::remove_file(&building);
            return Err(e);
        }
        listener.set_nonblocking(true)?;
        let local = hello::hello(identity).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let count = ports.header().ports as usize;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            ports,
            connections: (0..count).map(|_| None).collect(),
            local,
            epoch: identity.region_epoch,
            arena_region,
            policy: crate::auth::PeerPolicy::own_user(),
            refusal: None,
            push_caps: Vec::new(),
            counters: AttachCounters::default(),
        })
    }

    /// Tells every agent attaching from now on (that takes them) the caps
    /// on its tenants' pushes: `(namespaces, bytes per second)`, one a
    /// tenant. More than [`crate::wire::message::PUSH_CAPS_MAX`]
    /// namespaces in all is refused.
    pub fn push_caps(&mut self, tenants: &[(Vec<u64>, u64)]) -> Result<(), String> {
        let mut caps = Vec::new();
        for (tenant, (namespaces, bytes_per_s)) in tenants.iter().enumerate() {
            let tenant = u32::try_from(tenant).map_err(|_| "too many tenants".to_owned())?;
            for &namespace in namespaces {
                caps.push(crate::wire::message::PushCap { namespace, tenant, reserved: 0, bytes_per_s: *bytes_per_s });
            }
        }
        if caps.len() > crate::wire::message::PUSH_CAPS_MAX {
            return Err(format!(
                "{} namespaces with push caps: at most {}",
                caps.len(),
                crate::wire::message::PUSH_CAPS_MAX
            ));
        }
        self.push_caps = caps;
        Ok(())
    }

    /// Who may attach (checked on the peer's credentials as the kernel
    /// gives them; by default this process's user and root), and the
    /// socket file's mode and group.
    pub fn restrict(&mut self, policy: crate::auth::PeerPolicy, mode: u32, gid: Option<u32>) -> io::Result<()> {
        crate::auth::peer::restrict(&self.path, mode, gid)?;
        self.policy = policy;
        Ok(())
    }

    /// The last connection refused for its credentials since the last
    /// call, and why.
    pub fn take_refusal(&mut self) -> Option<String> {
        self.refusal.take()
    }

    /// Tells agents whether the runner parks (they write its eventfd only
    /// then).
    pub fn set_parked(&self, parked: bool) {
        self.ports.set_parked(parked);
    }

    /// Tells agents whether saves are refused now.
    pub fn set_save_pressure(&self, pressure: bool) {
        self.ports.set_save_pressure(pressure);
    }

    /// The descriptors to wait on when parking: the listener and every
    /// connection (a close wakes the runner). At most `out.len()`.
    pub fn fds(&self, out: &mut [RawFd]) -> usize {
        let mut n = 0;
        let all = core::iter::once(self.listener.as_raw_fd())
            .chain(self.connections.iter().flatten().map(|c| c.stream.as_raw_fd()));
        for (place, fd) in out.iter_mut().zip(all) {
            *place = fd;
            n += 1;
        }
        n
    }

    /// Accepts, answers hellos, notices closes; attaches and detaches the
    /// agents' ports in `pool`.
    pub fn poll(&mut self, pool: &mut Pool, table: &mut SlotTable, arena_fd: RawFd, wakeup_fd: RawFd, now_ns: u64) {
        while let Some(place) = pool.take_broken() {
            self.counters.broken += 1;
            let port = (0..self.connections.len()).find(|&p| pool.shared_place(port_number(p)) == usize::from(place));
            if let Some(port) = port {
                self.close(port, pool, table);
            }
        }
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => self.take(stream, now_ns),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        for port in 0..self.connections.len() {
            self.serve(port, pool, table, arena_fd, wakeup_fd, now_ns);
        }
    }

    fn take(&mut self, stream: UnixStream, now_ns: u64) {
        if let Err(why) = self.policy.check(&stream) {
            refuse(&stream, ErrorCode::Unauthorized, "this user may not attach");
            self.counters.strangers += 1;
            self.refusal = Some(why);
            return;
        }
        let Some(port) = self.connections.iter().position(Option::is_none) else {
            refuse(&stream, ErrorCode::QueueFull, "every agent port is taken");
            self.counters.refused += 1;
            return;
        };
        if stream.set_nonblocking(true).is_err() {
            self.counters.refused += 1;
            return;
        }
        self.connections[port] =
            Some(Connection { stream, stage: Stage::Hello { since_ns: now_ns, input: [0; HELLO_BYTES_MAX], have: 0 } });
    }

    fn serve(&mut self, port: usize, pool: &mut Pool, table: &mut SlotTable, arena: RawFd, wakeup: RawFd, now: u64) {
        let Some(connection) = &mut self.connections[port] else { return };
        let mut chunk = [0u8; 256];
        let mut closed = false;
        let mut hello = None;
        loop {
            match (&connection.stream).read(&mut chunk) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => match &mut connection.stage {
                    Stage::Hello { input, have, .. } if *have + n <= HELLO_BYTES_MAX => {
                        input[*have..*have + n].copy_from_slice(&chunk[..n]);
                        *have += n;
                    }
                    // Too much before a hello, or anything after attach.
                    _ => {
                        refuse(&connection.stream, ErrorCode::BadFrame, "nothing is expected on this socket now");
                        closed = true;
                        break;
                    }
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    closed = true;
                    break;
                }
            }
        }
        if let Stage::Hello { since_ns, input, have } = &connection.stage
            && !closed
        {
            match decode_frame(&input[..*have], &Limits::default()) {
                Err(WireError::Incomplete { .. }) if now.saturating_sub(*since_ns) < HELLO_TIMEOUT_NS => {}
                Err(WireError::Incomplete { .. }) => {
                    refuse(&connection.stream, ErrorCode::DeadlineExceeded, "no hello within a second");
                    closed = true;
                }
                Err(e) => {
                    refuse(&connection.stream, ErrorCode::BadFrame, &e.to_string());
                    closed = true;
                }
                Ok(frame) => match frame.message {
                    Message::Hello(remote) if Role::from_u8(remote.role) == Some(Role::Agent) => hello = Some(remote),
                    _ => {
                        refuse(&connection.stream, ErrorCode::BadFrame, "the first frame must be an agent's hello");
                        closed = true;
                    }
                },
            }
        }
        if let Some(remote) = hello {
            match self.attach(port, &remote, arena, wakeup) {
                Ok(shm) => {
                    pool.attach(pool.shared_place(port_number(port)), DpPort::Shared(shm));
                    if let Some(connection) = &mut self.connections[port] {
                        connection.stage = Stage::Attached;
                    }
                    self.counters.attached += 1;
                }
                Err(()) => closed = true,
            }
        }
        if closed {
            self.close(port, pool, table);
        }
    }

    /// Answers a hello: `HelloAck` and `Attached`, with the descriptors.
    fn attach(&mut self, port: usize, remote: &Hello, arena: RawFd, wakeup: RawFd) -> Result<DpShmPort, ()> {
        let Some(connection) = &self.connections[port] else { return Err(()) };
        let ack = match hello::accept(&self.local, remote, 0) {
            Ok(ack) => ack,
            Err(e) => {
                refuse(&connection.stream, ErrorCode::VersionMismatch, &e.to_string());
                self.counters.refused += 1;
                return Err(());
            }
        };
        let shm = DpShmPort::open(Arc::clone(&self.ports), u32::try_from(port).map_err(|_| ())?).map_err(|_| ())?;
        let attached = Attached {
            port: u32::try_from(port).map_err(|_| ())?,
            depth: self.ports.header().depth,
            epoch: self.epoch,
            arena_region: self.arena_region,
            reserved: [0; 6],
        };
        let caps = ack.features & crate::wire::FEATURE_PUSH_CAPS != 0 && !self.push_caps.is_empty();
        let mut bytes = vec![0u8; 256 + if caps { self.push_caps.len() * size_of::<PushCap>() } else { 0 }];
        let meta = FrameMeta { version: HELLO_WIRE_VERSION, flags: FLAG_REPLY, request_id: 1, leader_term: 0 };
        let mut len = encode_frame(meta, &Message::HelloAck(ack), &mut bytes).map_err(|_| ())?;
        let meta = FrameMeta { version: ack.version, ..meta };
        if caps {
            // Before `Attached`: the agent has them once it is attached.
            let head = PushCaps { count: u32::try_from(self.push_caps.len()).map_err(|_| ())?, reserved: 0 };
            let message = Message::PushCaps(head, Records::from_slice(&self.push_caps));
            len += encode_frame(meta, &message, &mut bytes[len..]).map_err(|_| ())?;
        }
        len += encode_frame(meta, &Message::Attached(attached), &mut bytes[len..]).map_err(|_| ())?;
        let fds = [arena, self.ports.file().as_raw_fd(), wakeup];
        // Small enough to go in one piece on a fresh socket (a few KiB at
        // most, with push caps).
        match os::send_with_fds(connection.stream.as_raw_fd(), &bytes[..len], &fds) {
            Ok(sent) if sent == len => Ok(shm),
            _ => Err(()),
        }
    }

    fn close(&mut self, port: usize, pool: &mut Pool, table: &mut SlotTable) {
        let Some(connection) = self.connections[port].take() else { return };
        match connection.stage {
            Stage::Attached => {
                pool.detach(pool.shared_place(port_number(port)), table);
                self.counters.detached += 1;
            }
            Stage::Hello { .. } => self.counters.refused += 1,
        }
    }
}

impl Drop for AttachServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A port's number (ports are fewer than 2^32: the file says so).
fn port_number(port: usize) -> u32 {
    u32::try_from(port).unwrap_or(u32::MAX)
}

/// Sends an `Error` frame (best effort; the connection is closed after).
fn refuse(stream: &UnixStream, code: ErrorCode, detail: &str) {
    let mut end = detail.len().min(48);
    while !detail.is_char_boundary(end) {
        end -= 1;
    }
    let body = ErrorBody {
        code: code as u32,
        reserved: 0,
        failed_request: 0,
        detail: text_field("error.detail", &detail[..end]).unwrap_or([0; 48]),
    };
    let mut bytes = [0u8; 256];
    let meta = FrameMeta { version: HELLO_WIRE_VERSION, flags: FLAG_REPLY, request_id: 0, leader_term: 0 };
    if let Ok(len) = encode_frame(meta, &Message::Error(body), &mut bytes) {
        let _ = os::send_with_fds(stream.as_raw_fd(), &bytes[..len], &[]);
    }
}
