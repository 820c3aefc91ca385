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
//!
//! A connection waiting for its hello holds no port: ports go to hellos.
//! At most [`PENDING_MAX`] connections wait at once, [`PENDING_PER_UID`]
//! of one user; a connection past either crowds out the oldest waiting
//! connection of the user with the most waiting (its own, past its share)
//! — so silent connections cannot keep a real engine, which says its hello
//! as it connects, from a port. A user may be held to fewer ports than
//! there are ([`AttachServer::limit_ports_per_uid`]).

use std::fs::File;
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

/// Connections waiting for their hello at once, at most.
pub const PENDING_MAX: usize = 32;

/// Connections of one user waiting for their hello at once, at most.
pub const PENDING_PER_UID: usize = 8;

/// A connection waiting for its hello; what arrived so far (a fixed
/// buffer, no allocation: agents attach while the runner is sealed).
struct Pending {
    stream: UnixStream,
    uid: u32,
    gid: u32,
    since_ns: u64,
    input: [u8; HELLO_BYTES_MAX],
    have: usize,
}

impl Pending {
    /// Reads what arrived; whether the connection is done (closed by the
    /// peer, failed, or more than a hello's bytes: refused).
    fn read(&mut self) -> bool {
        let mut chunk = [0u8; 256];
        loop {
            match (&self.stream).read(&mut chunk) {
                Ok(0) => return true,
                Ok(n) if self.have + n <= HELLO_BYTES_MAX => {
                    self.input[self.have..self.have + n].copy_from_slice(&chunk[..n]);
                    self.have += n;
                }
                Ok(_) => {
                    refuse(&self.stream, ErrorCode::BadFrame, "nothing is expected on this socket now");
                    return true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return true,
            }
        }
    }
}

/// An attached agent's connection: its liveness.
struct Connection {
    stream: UnixStream,
    uid: u32,
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
    /// Connections closed for saying no hello in time.
    pub hello_timeouts: u64,
    /// Connections waiting for their hello crowded out by newer ones.
    pub crowded_out: u64,
    /// Hellos refused because their user held its ports already.
    pub user_ports_full: u64,
}

/// The attach socket. See the module docs.
pub struct AttachServer {
    listener: UnixListener,
    path: PathBuf,
    ports: Arc<PortFile>,
    /// One place per shared port.
    connections: Vec<Option<Connection>>,
    /// Connections waiting for their hello ([`PENDING_MAX`] places).
    pending: Vec<Option<Pending>>,
    /// Ports one user may hold at once.
    ports_per_uid: usize,
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
    /// The mirror's file, opened for each agent that takes it as a
    /// descriptor ([`crate::wire::FEATURE_OWN_FDS`]).
    mirror: Option<PathBuf>,
    /// A partitioned arena's partitions (whose users map which), and the
    /// file of each, passed to its users' agents alone.
    partitions: Option<(crate::runner::config::Partitions, Vec<std::os::fd::OwnedFd>)>,
    /// What it has done.
    pub counters: AttachCounters,
}

impl core::fmt::Debug for AttachServer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AttachServer").field("path", &self.path).field("counters", &self.counters).finish()
    }
}

impl AttachServer {
    /// Listens on `path` (a stale socket file is replaced; anything else
    /// there is refused) for agents of the ports in `ports`. The file appears only once it is listening
    /// (bound under another name, then renamed): whoever sees it (an
    /// embedder waiting for readiness, an engine) can connect at once.
    pub fn bind(path: &Path, ports: Arc<PortFile>, identity: &Identity<'_>, arena_region: u16) -> io::Result<Self> {
        let mut building = path.as_os_str().to_owned();
        building.push(format!(".{}", std::process::id()));
        let building = std::path::PathBuf::from(building);
        crate::auth::peer::clear_stale_socket(path)?;
        crate::auth::peer::clear_stale_socket(&building)?;
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
            pending: (0..PENDING_MAX).map(|_| None).collect(),
            ports_per_uid: count,
            local,
            epoch: identity.region_epoch,
            arena_region,
            policy: crate::auth::PeerPolicy::own_user(),
            refusal: None,
            push_caps: Vec::new(),
            mirror: None,
            partitions: None,
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

    /// The arena is partitioned: each agent maps the partition of its
    /// user (or group) in `partitions`, or partition 0; `files` are the
    /// partitions', in order. Agents that cannot map a partitioned arena
    /// are refused.
    pub fn partition(&mut self, partitions: crate::runner::config::Partitions, files: Vec<std::os::fd::OwnedFd>) {
        self.partitions = Some((partitions, files));
    }

    /// Passes the mirror at `path` to each agent that takes it as a
    /// descriptor, opened read-only as it attaches (none: agents open it
    /// themselves).
    pub fn pass_mirror(&mut self, path: Option<PathBuf>) {
        self.mirror = path;
    }

    /// Holds each user to `ports` agent ports at once (at least one; by
    /// default, all of them): a hello past it is refused `QueueFull`.
    pub fn limit_ports_per_uid(&mut self, ports: usize) {
        self.ports_per_uid = ports.max(1);
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
            .chain(self.connections.iter().flatten().map(|c| c.stream.as_raw_fd()))
            .chain(self.pending.iter().flatten().map(|p| p.stream.as_raw_fd()));
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
                // Served as it comes: an engine's hello is there already.
                Ok((stream, _)) => {
                    if let Some(place) = self.take(stream, now_ns) {
                        self.serve_pending(place, pool, arena_fd, wakeup_fd, now_ns);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        for place in 0..self.pending.len() {
            self.serve_pending(place, pool, arena_fd, wakeup_fd, now_ns);
        }
        for port in 0..self.connections.len() {
            self.serve(port, pool, table);
        }
    }

    /// A new connection waits for its hello, in a place freed for it where
    /// none is; where, if it was let in.
    fn take(&mut self, stream: UnixStream, now_ns: u64) -> Option<usize> {
        let (uid, gid) = match self.policy.check(&stream) {
            Ok(peer) => (peer.uid, peer.gid),
            Err(why) => {
                refuse(&stream, ErrorCode::Unauthorized, "this user may not attach");
                self.counters.strangers += 1;
                self.refusal = Some(why);
                return None;
            }
        };
        if stream.set_nonblocking(true).is_err() {
            self.counters.refused += 1;
            return None;
        }
        let place = match self.pending.iter().position(Option::is_none) {
            Some(free) if self.waiting_of(uid) < PENDING_PER_UID => free,
            _ => {
                let victim = self.crowded_out(uid)?;
                if let Some(old) = self.pending[victim].take() {
                    refuse(&old.stream, ErrorCode::QueueFull, "crowded out: no hello yet, newer ones came");
                    self.counters.crowded_out += 1;
                }
                victim
            }
        };
        let input = [0; HELLO_BYTES_MAX];
        self.pending[place] = Some(Pending { stream, uid, gid, since_ns: now_ns, input, have: 0 });
        Some(place)
    }

    /// Connections of `uid` waiting for their hello.
    fn waiting_of(&self, uid: u32) -> usize {
        self.pending.iter().flatten().filter(|p| p.uid == uid).count()
    }

    /// The place to free for a connection of `uid`: its own oldest if it
    /// has its share waiting, else the oldest of the user with the most.
    fn crowded_out(&self, uid: u32) -> Option<usize> {
        let oldest_of = |uid: u32| {
            (0..self.pending.len())
                .filter(|&i| self.pending[i].as_ref().is_some_and(|p| p.uid == uid))
                .min_by_key(|&i| self.pending[i].as_ref().map_or(u64::MAX, |p| p.since_ns))
        };
        if self.waiting_of(uid) >= PENDING_PER_UID {
            return oldest_of(uid);
        }
        let most = self.pending.iter().flatten().map(|p| p.uid).max_by_key(|&u| self.waiting_of(u))?;
        oldest_of(most)
    }

    /// Reads what waiting connection `place` sent; attaches it on a hello,
    /// closes it on anything else or on its deadline.
    fn serve_pending(&mut self, place: usize, pool: &mut Pool, arena: RawFd, wakeup: RawFd, now: u64) {
        let Some(waiting) = &mut self.pending[place] else { return };
        let mut closed = waiting.read();
        let mut hello = None;
        if !closed {
            match decode_frame(&waiting.input[..waiting.have], &Limits::default()) {
                Err(WireError::Incomplete { .. }) if now.saturating_sub(waiting.since_ns) < HELLO_TIMEOUT_NS => {}
                Err(WireError::Incomplete { .. }) => {
                    refuse(&waiting.stream, ErrorCode::DeadlineExceeded, "no hello within a second");
                    self.counters.hello_timeouts += 1;
                    closed = true;
                }
                Err(e) => {
                    refuse(&waiting.stream, ErrorCode::BadFrame, &e.to_string());
                    closed = true;
                }
                Ok(frame) => match frame.message {
                    Message::Hello(remote) if Role::from_u8(remote.role) == Some(Role::Agent) => hello = Some(remote),
                    _ => {
                        refuse(&waiting.stream, ErrorCode::BadFrame, "the first frame must be an agent's hello");
                        closed = true;
                    }
                },
            }
        }
        if closed {
            self.pending[place] = None;
            self.counters.refused += 1;
            return;
        }
        let Some(remote) = hello else { return };
        let Some(waiting) = self.pending[place].take() else { return };
        let held = self.connections.iter().flatten().filter(|c| c.uid == waiting.uid).count();
        let Some(port) = self.connections.iter().position(Option::is_none) else {
            refuse(&waiting.stream, ErrorCode::QueueFull, "every agent port is taken");
            self.counters.refused += 1;
            return;
        };
        if held >= self.ports_per_uid {
            refuse(&waiting.stream, ErrorCode::QueueFull, "this user holds all the ports it may");
            self.counters.user_ports_full += 1;
            self.counters.refused += 1;
            return;
        }
        let partition = self.partitions.as_ref().map_or(0, |(p, _)| p.of_peer(waiting.uid, waiting.gid));
        let partition = u8::try_from(partition).unwrap_or(u8::MAX);
        match self.attach(&waiting.stream, port, &remote, arena, wakeup, partition) {
            Ok(shm) => {
                pool.attach(pool.shared_place(port_number(port)), DpPort::Shared(shm), partition);
                self.connections[port] = Some(Connection { stream: waiting.stream, uid: waiting.uid });
                self.counters.attached += 1;
            }
            Err(()) => self.counters.refused += 1,
        }
    }

    /// An attached agent's connection: closed when it closes, or when it
    /// sends anything (nothing is expected once attached).
    fn serve(&mut self, port: usize, pool: &mut Pool, table: &mut SlotTable) {
        let Some(connection) = &self.connections[port] else { return };
        let mut chunk = [0u8; 64];
        let closed = loop {
            match (&connection.stream).read(&mut chunk) {
                Ok(0) => break true,
                Ok(_) => {
                    refuse(&connection.stream, ErrorCode::BadFrame, "nothing is expected on this socket now");
                    break true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break true,
            }
        };
        if closed {
            self.close(port, pool, table);
        }
    }

    /// Answers a hello: `HelloAck` and `Attached`, with the descriptors
    /// (partition `partition`'s file among them, in a partitioned arena).
    fn attach(
        &self,
        stream: &UnixStream,
        port: usize,
        remote: &Hello,
        arena_fd: RawFd,
        wakeup: RawFd,
        partition: u8,
    ) -> Result<DpShmPort, ()> {
        let ack = match hello::accept(&self.local, remote, 0) {
            Ok(ack) => ack,
            Err(e) => {
                refuse(stream, ErrorCode::VersionMismatch, &e.to_string());
                return Err(());
            }
        };
        let needs = crate::wire::FEATURE_OWN_FDS | crate::wire::FEATURE_PARTITIONS;
        let partitioned = self.partitions.is_some();
        if partitioned && ack.features & needs != needs {
            let why = "this pool keeps tenants apart in partitions of its L1 arena; this agent cannot map one";
            refuse(stream, ErrorCode::VersionMismatch, why);
            return Err(());
        }
        let (partition_file, tenant_mirror) = self.partition_files(stream, partition)?;
        let shm = DpShmPort::open(Arc::clone(&self.ports), u32::try_from(port).map_err(|_| ())?).map_err(|_| ())?;
        let attached = Attached {
            port: u32::try_from(port).map_err(|_| ())?,
            depth: self.ports.header().depth,
            epoch: self.epoch,
            arena_region: self.arena_region,
            // Partition `p` of a partitioned arena is told as `p + 1`.
            partition: if partitioned { partition.saturating_add(1) } else { 0 },
            reserved: [0; 5],
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
        // An agent that takes descriptors of its own gets a fresh open of
        // the arena (its records' locks are its own, apart from this
        // process's).
        let own = ack.features & crate::wire::FEATURE_OWN_FDS != 0;
        let arena = if own { Some(crate::lock::reopen_fd(arena_fd).map_err(|_| ())?) } else { None };
        let passed = self.mirror_files(tenant_mirror, own, ack.features);
        let mut fds = vec![arena.as_ref().map_or(arena_fd, AsRawFd::as_raw_fd), self.ports.file().as_raw_fd(), wakeup];
        fds.extend(partition_file);
        fds.extend(passed.iter().flatten().map(AsRawFd::as_raw_fd));
        // Small enough to go in one piece on a fresh socket (a few KiB at
        // most, with push caps).
        match os::send_with_fds(stream.as_raw_fd(), &bytes[..len], &fds) {
            Ok(sent) if sent == len => Ok(shm),
            _ => Err(()),
        }
    }

    /// The mirror an agent is passed: its tenant's (`tenant_mirror`), or,
    /// to one that takes descriptors of its own (`own`), the pool's as it
    /// is now (a control plane that restarted made a new one). A mirror
    /// that cannot be opened is left out: the agent opens it itself,
    /// saying why it could not either. Then the cluster view beside it,
    /// where the agent takes it (`features`) and the node keeps one.
    fn mirror_files(&self, tenant_mirror: Option<MirrorFile<'_>>, own: bool, features: u64) -> [Option<File>; 2] {
        let pool = || self.mirror.as_deref().filter(|_| own).and_then(|p| Some((File::open(p).ok()?, p)));
        let Some((mirror, path)) = tenant_mirror.or_else(pool) else { return [None, None] };
        let view = (features & crate::wire::FEATURE_VIEW_FD != 0)
            .then(|| File::open(crate::mirror::view::ViewOpener::path_beside(path)).ok())
            .flatten();
        [Some(mirror), view]
    }

    /// Partition `partition`'s file and its tenant's mirror, opened (past
    /// partition 0), in a partitioned arena. A tenant's engines read its
    /// own mirror, never the pool's: one that cannot be opened (its
    /// control plane has not made it) refuses the attach, saying why.
    fn partition_files(
        &self,
        stream: &UnixStream,
        partition: u8,
    ) -> Result<(Option<RawFd>, Option<MirrorFile<'_>>), ()> {
        let Some((partitions, files)) = &self.partitions else { return Ok((None, None)) };
        let file = files.get(usize::from(partition)).ok_or(())?.as_raw_fd();
        let Some(path) = usize::from(partition).checked_sub(1).and_then(|tenant| partitions.mirrors.get(tenant)) else {
            return Ok((Some(file), None));
        };
        match File::open(path) {
            Ok(mirror) => Ok((Some(file), Some((mirror, path.as_path())))),
            Err(e) => {
                tracing::warn!(event = "tenant_mirror_unopened", path = %path.display(), partition, error = %e);
                refuse(stream, ErrorCode::Io, "its tenant's mirror cannot be opened yet");
                Err(())
            }
        }
    }

    fn close(&mut self, port: usize, pool: &mut Pool, table: &mut SlotTable) {
        if self.connections[port].take().is_some() {
            pool.detach(pool.shared_place(port_number(port)), table);
            self.counters.detached += 1;
        }
    }
}

impl Drop for AttachServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A mirror opened for an agent, and where it lies (its view lies beside
/// it).
type MirrorFile<'a> = (File, &'a Path);

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
