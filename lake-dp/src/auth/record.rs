//! An authenticated byte stream for links that carry wire frames (the
//! summary link between `lake-cp`s): the handshake, then records.
//!
//! Sans I/O: the caller reads and writes the socket, this turns bytes
//! read into checked plain bytes and plain bytes to send into records. A
//! record is `[length u32][tags 32][body]`; its header (the length) is
//! checked before the body is waited for, so a forged length is refused
//! before anything is buffered for it.

use super::AuthError;
use super::handshake::{CLIENT_FINISH_BYTES, CLIENT_HELLO_BYTES, ClientHandshake, SERVER_HELLO_BYTES, ServerHandshake};
use super::key::LinkKey;
use super::session::{PayloadCheck, Session, TAGS_BYTES};

/// Bytes before a record's body.
pub const RECORD_HEAD_BYTES: usize = 4 + TAGS_BYTES;

enum State {
    /// A client that sent its hello.
    Client(Option<ClientHandshake>),
    /// A server waiting for the hello, speaking versions up to `latest`.
    Server { key: LinkKey, node: u64, latest: u8 },
    /// A server that answered, waiting for the finish.
    Answered(Option<ServerHandshake>),
    /// Up.
    Ready { session: Session, peer: u64 },
    /// Broken: every later call fails with this.
    Failed(AuthError),
}

/// One end of an authenticated record stream. See the module docs.
pub struct RecordLink {
    state: State,
    /// Plain bytes to send once the session is up.
    waiting: Vec<u8>,
    /// Wire bytes read and not yet used.
    input: Vec<u8>,
    /// The header of the record being read, checked, with its length.
    open: Option<(usize, PayloadCheck)>,
    record_max: usize,
}

impl core::fmt::Debug for RecordLink {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RecordLink").field("ready", &self.is_ready()).finish_non_exhaustive()
    }
}

impl RecordLink {
    /// A client end as `node`: the link and the hello to send first.
    pub fn client(key: &LinkKey, node: u64, record_max: usize) -> std::io::Result<(Self, Vec<u8>)> {
        Self::client_offering(key, node, record_max, super::handshake::AUTH_VERSION)
    }

    /// [`RecordLink::client`] offering link version `version` (to a peer
    /// that said it speaks no later one: [`AuthError::Version`]).
    pub fn client_offering(
        key: &LinkKey,
        node: u64,
        record_max: usize,
        version: u8,
    ) -> std::io::Result<(Self, Vec<u8>)> {
        let (handshake, hello) = ClientHandshake::offering(key, node, super::nonce()?, version);
        Ok((Self::with(State::Client(Some(handshake)), record_max), hello.to_vec()))
    }

    /// A server end as `node`.
    pub fn server(key: &LinkKey, node: u64, record_max: usize) -> Self {
        Self::server_up_to(key, node, record_max, super::handshake::AUTH_VERSION)
    }

    /// [`RecordLink::server`] speaking link versions up to `latest`.
    pub fn server_up_to(key: &LinkKey, node: u64, record_max: usize, latest: u8) -> Self {
        Self::with(State::Server { key: key.clone(), node, latest }, record_max)
    }

    fn with(state: State, record_max: usize) -> Self {
        Self { state, waiting: Vec::new(), input: Vec::new(), open: None, record_max }
    }

    /// Whether the handshake is done.
    pub fn is_ready(&self) -> bool {
        matches!(self.state, State::Ready { .. })
    }

    /// The node id the peer gave, once the handshake is done.
    pub fn peer_node(&self) -> Option<u64> {
        match &self.state {
            State::Ready { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// Sends `plain` as one record to `wire` (held until the handshake is
    /// done).
    pub fn send(&mut self, plain: &[u8], wire: &mut Vec<u8>) {
        match &mut self.state {
            State::Ready { session, .. } => seal_into(session, plain, wire),
            State::Failed(_) => {}
            _ => self.waiting.extend_from_slice(plain),
        }
    }

    /// Takes `bytes` read from the socket: the plain bytes of every whole
    /// record go to `plain`, handshake answers to `wire`. An error breaks
    /// the link for good (close it).
    pub fn receive(&mut self, bytes: &[u8], plain: &mut Vec<u8>, wire: &mut Vec<u8>) -> Result<(), AuthError> {
        if let State::Failed(e) = &self.state {
            return Err(e.clone());
        }
        self.input.extend_from_slice(bytes);
        let result = self.advance(plain, wire);
        if let Err(e) = &result {
            self.state = State::Failed(e.clone());
            self.input.clear();
        }
        result
    }

    fn advance(&mut self, plain: &mut Vec<u8>, wire: &mut Vec<u8>) -> Result<(), AuthError> {
        let mut used = 0;
        let result = loop {
            let input = &self.input[used..];
            match &mut self.state {
                State::Failed(e) => break Err(e.clone()),
                State::Client(handshake) => {
                    let Some(answer) = input.get(..SERVER_HELLO_BYTES) else { break Ok(()) };
                    let mut fixed = [0u8; SERVER_HELLO_BYTES];
                    fixed.copy_from_slice(answer);
                    used += SERVER_HELLO_BYTES;
                    let Some(handshake) = handshake.take() else { break Err(AuthError::NotAHandshake) };
                    let (finish, mut session, peer) = match handshake.finish(&fixed) {
                        Ok(done) => done,
                        Err(e) => break Err(e),
                    };
                    wire.extend_from_slice(&finish);
                    let waiting = core::mem::take(&mut self.waiting);
                    if !waiting.is_empty() {
                        seal_into(&mut session, &waiting, wire);
                    }
                    self.state = State::Ready { session, peer };
                }
                State::Server { key, node, latest } => {
                    let Some(hello) = input.get(..CLIENT_HELLO_BYTES) else { break Ok(()) };
                    let mut fixed = [0u8; CLIENT_HELLO_BYTES];
                    fixed.copy_from_slice(hello);
                    used += CLIENT_HELLO_BYTES;
                    let nonce = match super::nonce() {
                        Ok(nonce) => nonce,
                        Err(_) => break Err(AuthError::NotAHandshake),
                    };
                    match ServerHandshake::answer_up_to(key, *node, nonce, &fixed, *latest) {
                        Ok((handshake, answer)) => {
                            wire.extend_from_slice(&answer);
                            self.state = State::Answered(Some(handshake));
                        }
                        Err((e, answer)) => {
                            if let Some(answer) = answer {
                                wire.extend_from_slice(&answer);
                            }
                            break Err(e);
                        }
                    }
                }
                State::Answered(handshake) => {
                    let Some(finish) = input.get(..CLIENT_FINISH_BYTES) else { break Ok(()) };
                    let mut fixed = [0u8; CLIENT_FINISH_BYTES];
                    fixed.copy_from_slice(finish);
                    used += CLIENT_FINISH_BYTES;
                    let Some(handshake) = handshake.take() else { break Err(AuthError::NotAHandshake) };
                    let (mut session, peer) = match handshake.finish(&fixed) {
                        Ok(done) => done,
                        Err(e) => break Err(e),
                    };
                    let waiting = core::mem::take(&mut self.waiting);
                    if !waiting.is_empty() {
                        seal_into(&mut session, &waiting, wire);
                    }
                    self.state = State::Ready { session, peer };
                }
                State::Ready { session, .. } => match &self.open {
                    None => {
                        let Some(head) = input.get(..RECORD_HEAD_BYTES) else { break Ok(()) };
                        let mut tags = [0u8; TAGS_BYTES];
                        tags.copy_from_slice(&head[4..]);
                        let check = match session.open_header(&head[..4], &tags) {
                            Ok(check) => check,
                            Err(e) => break Err(e),
                        };
                        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
                        if len > self.record_max {
                            break Err(AuthError::TooLong(len));
                        }
                        used += RECORD_HEAD_BYTES;
                        self.open = Some((len, check));
                    }
                    Some((len, check)) => {
                        let Some(body) = input.get(..*len) else { break Ok(()) };
                        if let Err(e) = check.verify(body) {
                            break Err(e);
                        }
                        plain.extend_from_slice(body);
                        used += *len;
                        self.open = None;
                    }
                },
            }
        };
        self.input.drain(..used);
        result
    }
}

fn seal_into(session: &mut Session, plain: &[u8], wire: &mut Vec<u8>) {
    let len = u32::try_from(plain.len()).unwrap_or(u32::MAX).to_le_bytes();
    let tags = session.seal(&len, plain);
    wire.reserve(RECORD_HEAD_BYTES + plain.len());
    wire.extend_from_slice(&len);
    wire.extend_from_slice(&tags);
    wire.extend_from_slice(plain);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moves `wire` bytes from one end into the other, a few at a time.
    fn deliver(to: &mut RecordLink, wire: &mut Vec<u8>, back: &mut Vec<u8>) -> Result<Vec<u8>, AuthError> {
        let mut plain = Vec::new();
        for chunk in core::mem::take(wire).chunks(7) {
            to.receive(chunk, &mut plain, back)?;
        }
        Ok(plain)
    }

    fn up(key_c: &LinkKey, key_s: &LinkKey) -> Result<(RecordLink, RecordLink), AuthError> {
        let (mut client, mut to_server) = RecordLink::client(key_c, 1, 1 << 20).unwrap();
        let mut server = RecordLink::server(key_s, 2, 1 << 20);
        client.send(b"early", &mut to_server);
        let mut to_client = Vec::new();
        assert!(deliver(&mut server, &mut to_server, &mut to_client)?.is_empty());
        assert!(deliver(&mut client, &mut to_client, &mut to_server)?.is_empty());
        assert_eq!(deliver(&mut server, &mut to_server, &mut to_client)?, b"early");
        assert_eq!((client.peer_node(), server.peer_node()), (Some(2), Some(1)));
        Ok((client, server))
    }

    #[test]
    fn a_client_told_an_older_version_offers_it_and_the_link_comes_up() {
        let key = LinkKey::from_bytes([5; 32]);
        let (mut client, to_server) = RecordLink::client(&key, 1, 1 << 20).unwrap();
        let mut old = RecordLink::server_up_to(&key, 2, 1 << 20, 1);
        let (mut plain, mut back) = (Vec::new(), Vec::new());
        assert_eq!(old.receive(&to_server, &mut plain, &mut back).unwrap_err(), AuthError::Version(2));
        assert_eq!(client.receive(&back, &mut plain, &mut Vec::new()).unwrap_err(), AuthError::Version(1));
        let (mut client, to_server) = RecordLink::client_offering(&key, 1, 1 << 20, 1).unwrap();
        let mut old = RecordLink::server_up_to(&key, 2, 1 << 20, 1);
        let mut back = Vec::new();
        old.receive(&to_server, &mut plain, &mut back).unwrap();
        let mut finish = Vec::new();
        client.receive(&back, &mut plain, &mut finish).unwrap();
        old.receive(&finish, &mut plain, &mut Vec::new()).unwrap();
        assert!(client.is_ready() && old.is_ready());
        let mut wire = Vec::new();
        client.send(b"a delta", &mut wire);
        old.receive(&wire, &mut plain, &mut Vec::new()).unwrap();
        assert_eq!(plain, b"a delta");
    }

    #[test]
    fn records_go_both_ways_after_the_handshake() {
        let key = LinkKey::from_bytes([5; 32]);
        let (mut client, mut server) = up(&key, &key).unwrap();
        let (mut wire, mut back) = (Vec::new(), Vec::new());
        server.send(b"one", &mut wire);
        server.send(b"two", &mut wire);
        assert_eq!(deliver(&mut client, &mut wire, &mut back).unwrap(), b"onetwo");
    }

    #[test]
    fn tampered_replayed_and_truncated_records_are_refused() {
        let key = LinkKey::from_bytes([5; 32]);
        let (mut client, mut server) = up(&key, &key).unwrap();
        let (mut wire, mut back) = (Vec::new(), Vec::new());
        client.send(b"payload", &mut wire);
        let recorded = wire.clone();
        assert_eq!(deliver(&mut server, &mut wire, &mut back).unwrap(), b"payload");
        // Replayed: the counter moved on.
        let mut replay = recorded.clone();
        assert_eq!(deliver(&mut server, &mut replay, &mut back).unwrap_err(), AuthError::BadTag);
        // Broken for good afterwards.
        client.send(b"next", &mut wire);
        assert_eq!(deliver(&mut server, &mut wire, &mut back).unwrap_err(), AuthError::BadTag);

        let (mut client, mut server) = up(&key, &key).unwrap();
        client.send(b"payload", &mut wire);
        let last = wire.len() - 1;
        wire[last] ^= 0x80;
        assert_eq!(deliver(&mut server, &mut wire, &mut back).unwrap_err(), AuthError::BadTag);

        // Truncated: nothing comes out of half a record.
        let (mut client, mut server) = up(&key, &key).unwrap();
        client.send(b"payload", &mut wire);
        wire.truncate(wire.len() - 3);
        assert!(deliver(&mut server, &mut wire, &mut back).unwrap().is_empty());
    }

    #[test]
    fn a_wrong_key_or_a_plain_peer_never_gets_a_byte_through() {
        let (key, other) = (LinkKey::from_bytes([5; 32]), LinkKey::from_bytes([6; 32]));
        assert!(matches!(up(&other, &key), Err(AuthError::WrongKey { .. })));
        let mut server = RecordLink::server(&key, 2, 1 << 20);
        let (mut plain, mut back) = (Vec::new(), Vec::new());
        let error = server.receive(&[0x4c; 200], &mut plain, &mut back).unwrap_err();
        assert_eq!(error, AuthError::NotAHandshake);
        assert!(plain.is_empty() && back.is_empty());
    }

    #[test]
    fn a_record_longer_than_the_reader_takes_is_refused_from_its_header() {
        let key = LinkKey::from_bytes([5; 32]);
        // A server that takes records of 4 bytes at most.
        let (mut small_client, mut to_server) = RecordLink::client(&key, 1, 1 << 20).unwrap();
        let mut small = RecordLink::server(&key, 2, 4);
        let mut to_client = Vec::new();
        deliver(&mut small, &mut to_server, &mut to_client).unwrap();
        deliver(&mut small_client, &mut to_client, &mut to_server).unwrap();
        deliver(&mut small, &mut to_server, &mut to_client).unwrap();
        small_client.send(b"too long", &mut to_server);
        let head = to_server[..RECORD_HEAD_BYTES].to_vec();
        let (mut plain, mut back) = (Vec::new(), Vec::new());
        assert_eq!(small.receive(&head, &mut plain, &mut back).unwrap_err(), AuthError::TooLong(8));
    }
}
