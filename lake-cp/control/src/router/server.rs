//! The router's HTTP side: one thread polling its listener and its
//! connections (mio), requests parsed by `httparse`, every answer JSON.
//! A hostile or broken client costs it a bounded share: at most
//! `connections_max` connections (one past it is accepted and closed at
//! once), a request's head and body within [`BODY_BYTES_MAX`], a
//! connection that is not answered within [`REQUEST_TIMEOUT`] or sits idle
//! between requests past it closed, and a failed accept (out of
//! descriptors) pausing the listener a moment instead of ending the loop.
//! Connections are kept alive between requests (HTTP/1.1), as a gateway
//! keeps its pool of them.

use std::collections::HashMap;
use std::io;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token};

use super::{Answer, Router};
use crate::server::{read_available, write_pending};

/// Bytes a request's head and body may take together.
pub const BODY_BYTES_MAX: usize = 4 << 20;

/// How long a request may take to arrive whole, and a kept-alive
/// connection may sit idle.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

const LISTENER: Token = Token(usize::MAX);

/// What the server let go, and why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerCounters {
    /// Connections taken.
    pub accepted: u64,
    /// Connections closed as they came: the cap was reached.
    pub over_cap: u64,
    /// Connections closed for taking too long (or idling).
    pub timed_out: u64,
    /// Requests refused for their size.
    pub too_large: u64,
    /// Requests that were not HTTP.
    pub malformed: u64,
}

#[derive(Debug)]
struct Client {
    stream: TcpStream,
    input: Vec<u8>,
    output: Vec<u8>,
    written: usize,
    /// When the request now arriving started (or the connection went
    /// idle).
    since: Instant,
    /// Closed once its answer is written.
    closing: bool,
}

/// The router's listener and connections.
#[derive(Debug)]
pub struct Server {
    poll: Poll,
    listener: TcpListener,
    clients: HashMap<Token, Client>,
    next: usize,
    paused_until: Option<Instant>,
    cap: usize,
    /// What it let go.
    pub counters: ServerCounters,
}

impl Server {
    /// Listens on `listener` (bound by the caller, who reports the
    /// address), holding at most `cap` connections.
    pub fn new(listener: std::net::TcpListener, cap: usize) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let mut listener = TcpListener::from_std(listener);
        let poll = Poll::new()?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        Ok(Self {
            poll,
            listener,
            clients: HashMap::new(),
            next: 0,
            paused_until: None,
            cap,
            counters: ServerCounters::default(),
        })
    }

    /// Serves until `stop` says so (asked at least every 100 ms).
    pub fn run(&mut self, router: &mut Router, mut stop: impl FnMut() -> bool) -> io::Result<()> {
        let mut events = Events::with_capacity(256);
        while !stop() {
            match self.poll.poll(&mut events, Some(Duration::from_millis(100))) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            for event in &events {
                if event.token() == LISTENER {
                    self.accept();
                } else {
                    self.serve(event.token(), router);
                }
            }
            self.sweep();
        }
        Ok(())
    }

    fn accept(&mut self) {
        if self.paused_until.is_some_and(|until| Instant::now() < until) {
            return;
        }
        self.paused_until = None;
        loop {
            let mut stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted || e.kind() == io::ErrorKind::ConnectionAborted => {
                    continue;
                }
                Err(_) => {
                    // Out of descriptors (or the like): the connections
                    // waiting are taken once some close.
                    self.paused_until = Some(Instant::now() + Duration::from_millis(100));
                    return;
                }
            };
            if self.clients.len() >= self.cap {
                self.counters.over_cap += 1;
                drop(stream);
                continue;
            }
            self.next = (self.next + 1) % (usize::MAX - 1);
            let token = Token(self.next);
            if self.poll.registry().register(&mut stream, token, Interest::READABLE | Interest::WRITABLE).is_err() {
                continue;
            }
            self.counters.accepted += 1;
            let client = Client {
                stream,
                input: Vec::new(),
                output: Vec::new(),
                written: 0,
                since: Instant::now(),
                closing: false,
            };
            self.clients.insert(token, client);
        }
    }

    fn serve(&mut self, token: Token, router: &mut Router) {
        let Some(client) = self.clients.get_mut(&token) else { return };
        loop {
            if client.output.is_empty() {
                // Past the limit it reads no more: the request is refused
                // by its size, then the connection closed.
                let closed = read_available(&mut client.stream, &mut client.input, BODY_BYTES_MAX);
                match take_request(&mut client.input, &mut self.counters, router) {
                    Some((answer, close)) => {
                        client.output = render(&answer, close || closed);
                        client.written = 0;
                        client.closing = close || closed;
                    }
                    None if closed => break,
                    None => return,
                }
            }
            if write_pending(&mut client.stream, &client.output, &mut client.written) {
                break;
            }
            if client.written < client.output.len() {
                // The rest when it is writable.
                return;
            }
            if client.closing {
                break;
            }
            client.output.clear();
            client.since = Instant::now();
        }
        self.close(token);
    }

    fn close(&mut self, token: Token) {
        if let Some(mut client) = self.clients.remove(&token) {
            let _ = self.poll.registry().deregister(&mut client.stream);
        }
    }

    fn sweep(&mut self) {
        let late: Vec<Token> =
            self.clients.iter().filter(|(_, c)| c.since.elapsed() > REQUEST_TIMEOUT).map(|(&token, _)| token).collect();
        for token in late {
            self.counters.timed_out += 1;
            self.close(token);
        }
    }
}

/// The answer to the request at the front of `input`, once it is whole
/// (taken out of `input`), and whether the connection closes after it.
fn take_request(input: &mut Vec<u8>, counters: &mut ServerCounters, router: &mut Router) -> Option<(Answer, bool)> {
    if input.is_empty() {
        return None;
    }
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut request = httparse::Request::new(&mut headers);
    let head = match request.parse(input) {
        Ok(httparse::Status::Complete(head)) => head,
        Ok(httparse::Status::Partial) if input.len() > BODY_BYTES_MAX => {
            counters.too_large += 1;
            return Some((super::refuse(431, "the request's head is too large"), true));
        }
        Ok(httparse::Status::Partial) => return None,
        Err(e) => {
            counters.malformed += 1;
            return Some((super::refuse(400, format!("not an HTTP request: {e}")), true));
        }
    };
    let header = |name: &str| {
        request.headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| String::from_utf8_lossy(h.value))
    };
    if header("transfer-encoding").is_some() {
        counters.malformed += 1;
        return Some((super::refuse(411, "send the body with a Content-Length, not chunked"), true));
    }
    let length = match header("content-length").map(|v| v.trim().parse::<usize>()) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            counters.malformed += 1;
            return Some((super::refuse(400, "Content-Length is not a number"), true));
        }
    };
    if head.saturating_add(length) > BODY_BYTES_MAX {
        counters.too_large += 1;
        return Some((super::refuse(413, format!("a request takes at most {BODY_BYTES_MAX} bytes")), true));
    }
    if input.len() < head + length {
        return None;
    }
    let close = request.version == Some(0)
        || header("connection").is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")));
    let (method, path) = (request.method.unwrap_or("").to_owned(), request.path.unwrap_or("").to_owned());
    let path = path.split('?').next().unwrap_or("").to_owned();
    let answer = router.answer(&method, &path, &input[head..head + length]);
    input.drain(..head + length);
    Some((answer, close))
}

fn render((status, body): &Answer, close: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    };
    // A text body (the metrics) goes as it is; every other is JSON.
    let (text, kind) = match body {
        serde_json::Value::String(text) => (text.clone(), "text/plain; version=0.0.4"),
        body => (format!("{body}\n"), "application/json"),
    };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n{}\r\n",
        text.len(),
        if close { "Connection: close\r\n" } else { "" }
    )
    .into_bytes();
    out.extend_from_slice(text.as_bytes());
    out
}
