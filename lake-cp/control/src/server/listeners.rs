//! The server's three listeners — the cp socket, the metrics port and the
//! operator's socket — and what keeps a hostile neighbour from exhausting
//! the process through them: each holds at most its cap of connections
//! (one past it is accepted and closed at once); a connection that does
//! not get through its first exchange in time, or sits idle too long, is
//! closed; and a failed accept (the process or the system out of file
//! descriptors) pauses that listener for a moment instead of ending the
//! loop. What each let go is counted by listener and why.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use mio::net::UnixStream;
use mio::{Interest, Token};

use super::{AdminClient, HttpClient, Peer, Server, Session, Stage};

/// A listener of the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// The cp socket: data planes and engines' agents.
    Cp = 0,
    /// The metrics port (`/metrics`, `/healthz`, `/readyz`).
    Metrics = 1,
    /// The operator's socket.
    Admin = 2,
}

impl Listener {
    /// Every listener, in index order.
    pub const ALL: [Self; 3] = [Self::Cp, Self::Metrics, Self::Admin];

    /// Its token in the server's poll (a connection's are the others).
    pub(super) fn token(self) -> Token {
        match self {
            Self::Cp => Token(0),
            Self::Metrics => Token(1),
            Self::Admin => Token(usize::MAX),
        }
    }

    /// The listener whose token `token` is, if one's is.
    pub(super) fn of(token: Token) -> Option<Self> {
        Self::ALL.into_iter().find(|listener| listener.token() == token)
    }

    /// Its name in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cp => "cp",
            Self::Metrics => "metrics",
            Self::Admin => "admin",
        }
    }
}

/// How many connections each listener holds at once, at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// On the cp socket: a data plane and one per attached engine.
    pub cp: usize,
    /// On the metrics port: scrapers and health checks.
    pub metrics: usize,
    /// On the operator's socket.
    pub admin: usize,
}

impl Default for ConnectionCaps {
    fn default() -> Self {
        Self { cp: 512, metrics: 32, admin: 16 }
    }
}

impl ConnectionCaps {
    /// The cap of `listener`.
    pub fn of(&self, listener: Listener) -> usize {
        match listener {
            Listener::Cp => self.cp,
            Listener::Metrics => self.metrics,
            Listener::Admin => self.admin,
        }
    }
}

/// Connections a listener let go, by why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shed {
    /// Accepted past the cap, and closed at once.
    pub over_cap: u64,
    /// Closed for not getting through their first exchange in time (a
    /// hello, an HTTP request and its answer) or sitting idle too long.
    pub timed_out: u64,
    /// Accepts that failed (out of file descriptors, most often): the
    /// listener paused for [`ACCEPT_PAUSE`].
    pub accept_failed: u64,
}

/// How long a listener rests after a failed accept. The connections
/// waiting meanwhile stay in the kernel's queue.
pub const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// A peer on the cp socket has this long to say its hello.
pub const HELLO_DEADLINE: Duration = Duration::from_secs(5);

/// A metrics client has this long from its connect to its answer written.
pub const HTTP_DEADLINE: Duration = Duration::from_secs(5);

/// An operator's client saying nothing this long is closed.
pub const ADMIN_IDLE: Duration = Duration::from_secs(15 * 60);

/// How often the deadlines are looked at.
const SWEEP_EVERY: Duration = Duration::from_millis(100);

/// The listeners' state beyond their sockets.
#[derive(Debug)]
pub(super) struct Gate {
    pub(super) caps: ConnectionCaps,
    /// Until when each listener rests after a failed accept.
    paused_until: [Option<Instant>; 3],
    next_sweep: Instant,
}

impl Default for Gate {
    fn default() -> Self {
        Self { caps: ConnectionCaps::default(), paused_until: [None; 3], next_sweep: Instant::now() }
    }
}

/// What one accept came to.
enum Accepted<S> {
    /// A connection to keep.
    Stream(S),
    /// Nothing more waits, or the listener pauses.
    Done,
    /// One taken and let go (over the cap, a stranger): go on.
    Next,
}

impl Server {
    /// How many connections each listener holds at most (see
    /// [`ConnectionCaps`]); connections already open stay.
    pub fn set_caps(&mut self, caps: ConnectionCaps) {
        self.gate.caps = caps;
    }

    /// The caps in force.
    pub fn caps(&self) -> ConnectionCaps {
        self.gate.caps
    }

    /// Connections open on `listener`.
    pub fn open_on(&self, listener: Listener) -> usize {
        match listener {
            Listener::Cp => self.peers.len(),
            Listener::Metrics => self.http.len(),
            Listener::Admin => self.admin_clients.len(),
        }
    }

    /// Accepts on `listener` what waits, unless it rests.
    pub(super) fn accept_on(&mut self, listener: Listener) {
        let now = Instant::now();
        if self.gate.paused_until[listener as usize].is_some_and(|until| now < until) {
            return;
        }
        self.gate.paused_until[listener as usize] = None;
        match listener {
            Listener::Cp => self.accept_peers(),
            Listener::Metrics => self.accept_http(),
            Listener::Admin => self.accept_admin(),
        }
    }

    /// Listeners whose rest is over accept again (the kernel does not say
    /// twice that connections wait); deadlines passed close their
    /// connections.
    pub(super) fn sweep(&mut self) {
        let now = Instant::now();
        for listener in Listener::ALL {
            if self.gate.paused_until[listener as usize].is_some_and(|until| now >= until) {
                self.accept_on(listener);
            }
        }
        if now < self.gate.next_sweep {
            return;
        }
        self.gate.next_sweep = now + SWEEP_EVERY;
        let late: Vec<Token> = self
            .peers
            .iter()
            .filter(|(_, p)| p.session.stage == Stage::Hello && now.duration_since(p.since) > HELLO_DEADLINE)
            .map(|(&t, _)| t)
            .collect();
        for token in late {
            self.counters.shed[Listener::Cp as usize].timed_out += 1;
            self.close(token);
        }
        let late: Vec<Token> =
            self.http.iter().filter(|(_, c)| now.duration_since(c.since) > HTTP_DEADLINE).map(|(&t, _)| t).collect();
        for token in late {
            self.counters.shed[Listener::Metrics as usize].timed_out += 1;
            self.close_http(token);
        }
        let idle: Vec<Token> = self
            .admin_clients
            .iter()
            .filter(|(_, c)| now.duration_since(c.last) > ADMIN_IDLE)
            .map(|(&t, _)| t)
            .collect();
        for token in idle {
            self.counters.shed[Listener::Admin as usize].timed_out += 1;
            self.close_admin(token);
        }
    }

    fn close_http(&mut self, token: Token) {
        if let Some(mut client) = self.http.remove(&token) {
            let _ = self.poll.registry().deregister(&mut client.stream);
        }
    }

    fn close_admin(&mut self, token: Token) {
        if let Some(mut client) = self.admin_clients.remove(&token) {
            let _ = self.poll.registry().deregister(&mut client.stream);
        }
    }

    /// One accept on `listener`, with its cap and its failures counted.
    fn take<S>(&mut self, listener: Listener, accept: impl FnOnce(&Self) -> io::Result<S>) -> Accepted<S> {
        match accept(self) {
            Ok(stream) if self.open_on(listener) >= self.gate.caps.of(listener) => {
                // Closed as it goes: the peer sees its connection end.
                drop(stream);
                self.counters.shed[listener as usize].over_cap += 1;
                Accepted::Next
            }
            Ok(stream) => Accepted::Stream(stream),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Accepted::Done,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Accepted::Next,
            Err(_) => {
                // EMFILE, ENFILE, ENOBUFS, ENOMEM: no room now. The waiting
                // connections stay queued; the listener tries again soon.
                self.counters.shed[listener as usize].accept_failed += 1;
                self.gate.paused_until[listener as usize] = Some(Instant::now() + ACCEPT_PAUSE);
                Accepted::Done
            }
        }
    }

    /// Registers an accepted stream under a new token; none where the
    /// registration fails (the stream is closed, counted as a failed
    /// accept).
    fn register(&mut self, listener: Listener, stream: &mut impl mio::event::Source) -> Option<Token> {
        let token = Token(self.next_token);
        match self.poll.registry().register(stream, token, Interest::READABLE | Interest::WRITABLE) {
            Ok(()) => {
                self.next_token += 1;
                Some(token)
            }
            Err(_) => {
                self.counters.shed[listener as usize].accept_failed += 1;
                None
            }
        }
    }

    fn accept_peers(&mut self) {
        loop {
            let mut stream = match self.take(Listener::Cp, |s| s.listener.accept().map(|(stream, _)| stream)) {
                Accepted::Stream(stream) => stream,
                Accepted::Next => continue,
                Accepted::Done => return,
            };
            let peer = match self.policy.check(&stream) {
                Ok(peer) => peer,
                Err(why) => {
                    self.counters.strangers += 1;
                    if self.refusals.len() < 64 {
                        self.refusals.push(format!("{}: {why}", self.path.display()));
                    }
                    continue;
                }
            };
            let Some(token) = self.register(Listener::Cp, &mut stream) else { continue };
            let session = Session::new(token.0 as u64);
            self.node.engine_came(token.0 as u64, peer.uid, peer.gid);
            self.peers.insert(token, Peer { stream, session, output: Vec::new(), since: Instant::now() });
            self.counters.accepted += 1;
        }
    }

    fn accept_http(&mut self) {
        loop {
            let accept = |s: &Self| match &s.metrics {
                Some(listener) => listener.accept().map(|(stream, _)| stream),
                None => Err(io::ErrorKind::WouldBlock.into()),
            };
            let mut stream = match self.take(Listener::Metrics, accept) {
                Accepted::Stream(stream) => stream,
                Accepted::Next => continue,
                Accepted::Done => return,
            };
            let Some(token) = self.register(Listener::Metrics, &mut stream) else { continue };
            let client =
                HttpClient { stream, input: Vec::new(), output: Vec::new(), written: 0, since: Instant::now() };
            self.http.insert(token, client);
        }
    }

    pub(super) fn serve_http(&mut self, token: Token) {
        let view = self.uplink.as_ref().and_then(|uplink| {
            let (_, _, blocks, nodes) = uplink.view_figures()?;
            let c = uplink.counters;
            Some(crate::metrics::ViewGauges {
                blocks,
                nodes: nodes as u64,
                deltas: c.view_deltas,
                snapshots: c.view_snapshots,
                gaps: c.view_gaps,
                refused: c.view_refused,
                unnamed: c.view_unnamed,
                pulls_sent: c.pulls_sent,
                pulls_dropped: c.pulls_dropped,
                pulls_from_store: self.node.store_reads_done,
                pulls_from_store_failed: self.node.store_reads_failed,
                pulls_refused: self.node.pulls_refused,
                pull_ns_per_block: self.node.pull_ns_per_block,
            })
        });
        let gauges = crate::metrics::ServerGauges { caps: self.gate.caps, open: self.open_counts(), view };
        let Some(client) = self.http.get_mut(&token) else { return };
        let mut done = false;
        if client.output.is_empty() {
            done = read_available(&mut client.stream, &mut client.input, crate::metrics::REQUEST_BYTES_MAX);
            let (node, counters, peers) = (&self.node, &self.counters, &self.peers);
            let ready = || {
                let l1 = peers.values().any(|p| {
                    p.session.role == Some(lake_dp::wire::message::Role::DataPlane)
                        && p.session
                            .regions
                            .iter()
                            .any(|&r| node.locations.region(r).is_some_and(|i| i.tier == lake_dp::Tier::L1Dram))
                });
                if node.draining {
                    Err("draining: an operator is taking this node out (lake drain-node)".to_owned())
                } else if l1 {
                    Ok(())
                } else {
                    Err("no data plane has registered its L1 with this node".to_owned())
                }
            };
            if let Some(response) =
                crate::metrics::respond(&client.input, || crate::metrics::render(node, counters, &gauges), ready)
            {
                client.output = response;
                done = false;
            }
        }
        done |= write_pending(&mut client.stream, &client.output, &mut client.written);
        if !client.output.is_empty() && client.written == client.output.len() {
            done = true;
        }
        if done {
            self.close_http(token);
        }
    }

    /// Connections open on each listener, in [`Listener::ALL`]'s order.
    fn open_counts(&self) -> [usize; 3] {
        Listener::ALL.map(|listener| self.open_on(listener))
    }

    fn accept_admin(&mut self) {
        loop {
            let accept = |s: &Self| match &s.admin {
                Some((listener, _)) => listener.accept().map(|(stream, _)| stream),
                None => Err(io::ErrorKind::WouldBlock.into()),
            };
            let mut stream: UnixStream = match self.take(Listener::Admin, accept) {
                Accepted::Stream(stream) => stream,
                Accepted::Next => continue,
                Accepted::Done => return,
            };
            // The operator's socket: this user and root, whatever the cp
            // socket's allow-list lets in.
            if let Err(why) = lake_dp::auth::PeerPolicy::own_user().check(&stream) {
                self.counters.strangers += 1;
                if self.refusals.len() < 64
                    && let Some((_, path)) = &self.admin
                {
                    self.refusals.push(format!("{}: {why}", path.display()));
                }
                continue;
            }
            let Some(token) = self.register(Listener::Admin, &mut stream) else { continue };
            let client =
                AdminClient { stream, input: Vec::new(), output: Vec::new(), closing: false, last: Instant::now() };
            self.admin_clients.insert(token, client);
        }
    }

    pub(super) fn serve_admin_client(&mut self, token: Token) {
        let sessions: Vec<&Session> = self.peers.values().map(|peer| &peer.session).collect();
        let Some(client) = self.admin_clients.get_mut(&token) else { return };
        client.last = Instant::now();
        let mut done = !client.closing
            && read_available(&mut client.stream, &mut client.input, crate::admin::LINE_BYTES_MAX + 4096);
        while let Some(end) = client.input.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = client.input.drain(..=end).collect();
            let answer = crate::admin::respond(&mut self.node, &self.counters, &sessions, &line[..end]);
            client.output.extend_from_slice(answer.to_string().as_bytes());
            client.output.push(b'\n');
        }
        if client.input.len() > crate::admin::LINE_BYTES_MAX {
            let why = format!("a request line longer than {} bytes", crate::admin::LINE_BYTES_MAX);
            client.output.extend_from_slice(serde_json::json!({ "error": why }).to_string().as_bytes());
            client.output.push(b'\n');
            client.input.clear();
            client.closing = true;
        }
        let mut written = 0;
        done |= write_pending(&mut client.stream, &client.output, &mut written);
        client.output.drain(..written);
        // A client not reading its answers is let go.
        if client.output.len() > super::OUT_BYTES_MAX || (client.closing && client.output.is_empty()) {
            done = true;
        }
        if done {
            self.close_admin(token);
        }
    }
}

/// Reads what `stream` has into `input`, until it would block or `input`
/// holds more than `limit` bytes. Returns whether the connection is done
/// (closed by the peer, failed, or over the limit).
pub(crate) fn read_available(stream: &mut impl Read, input: &mut Vec<u8>, limit: usize) -> bool {
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => return true,
            Ok(n) => input.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
        if input.len() > limit {
            return true;
        }
    }
}

/// Writes `output[*written..]` to `stream` until it would block, moving
/// `written` on. Returns whether the connection failed.
pub(crate) fn write_pending(stream: &mut impl Write, output: &[u8], written: &mut usize) -> bool {
    while *written < output.len() {
        match stream.write(&output[*written..]) {
            Ok(0) => return true,
            Ok(n) => *written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
    false
}
