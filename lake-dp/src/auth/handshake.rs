//! The pre-shared-key handshake that opens every authenticated link.
//!
//! Three messages, fixed sizes, no allocation; nothing but the key's id
//! and fresh nonces in the clear:
//!
//! | message | bytes | fields |
//! |---|---:|---|
//! | client hello | 64 | magic `LKAU`, version, kind 1, key id, node id, the client's 32-byte nonce |
//! | server hello | 96 | magic, version, kind 2, status, key id, node id, the server's nonce, the server's 32-byte proof |
//! | client finish | 32 | the client's proof |
//!
//! A proof is the keyed BLAKE3 hash, under a key derived from the link
//! key, of a side label and every byte of the handshake before it: only a
//! holder of the key makes one, and one made for a connection proves
//! nothing on another (each side's nonce is fresh). The session's four
//! keys (each direction's header and payload keys) are derived from the
//! link key and the whole transcript. A server that holds another key, or
//! does not speak the version offered, answers with a status saying so
//! (and no proof, and for a version the latest it speaks) and closes, so
//! the operator on either side reads which.
//!
//! Versions, for rolling upgrades: a client offers the latest it speaks
//! to that peer; a server takes any version from [`AUTH_VERSION_MIN`] to
//! its latest and answers in it, and refuses a later one naming its own
//! latest, which the client then offers on its next connection (as
//! version 1 code answers version 2). Both proofs cover the version bytes,
//! so what a completed handshake settled on was not changed on the way; a
//! forged refusal can only make two nodes speak an older version, which
//! is as safe (version 1's tags are as strong; they spread less well over
//! threads).

use super::key::LinkKey;
use super::session::Session;
use super::{AuthError, tags_equal};

/// Bytes of a client hello.
pub const CLIENT_HELLO_BYTES: usize = 64;
/// Bytes of a server hello.
pub const SERVER_HELLO_BYTES: usize = 96;
/// Bytes of a client finish.
pub const CLIENT_FINISH_BYTES: usize = 32;

/// "LKAU", little-endian: the first bytes of an authenticated link.
pub const AUTH_MAGIC: [u8; 4] = *b"LKAU";
/// The link protocol version this code speaks (2: a payload tag hashes
/// the bytes before the sequence number, so it can be spread over threads;
/// a peer speaking 1 is told so by the handshake).
pub const AUTH_VERSION: u8 = 2;

/// The oldest link protocol version this code still speaks (to a peer
/// one release behind during a rolling upgrade).
pub const AUTH_VERSION_MIN: u8 = 1;

const KIND_CLIENT_HELLO: u8 = 1;
const KIND_SERVER_HELLO: u8 = 2;

const STATUS_OK: u8 = 0;
const STATUS_WRONG_KEY: u8 = 1;
const STATUS_VERSION: u8 = 2;

const CONTEXT_PROOF: &str = "lake 2026-12 link handshake proof";
const CONTEXT_SESSION: &str = "lake 2026-12 link session keys";

fn proof_key(key: &LinkKey) -> [u8; 32] {
    blake3::derive_key(CONTEXT_PROOF, key.secret())
}

fn proof(key: &LinkKey, label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_keyed(&proof_key(key));
    hasher.update(label);
    for part in parts {
        hasher.update(part);
    }
    *hasher.finalize().as_bytes()
}

fn session_keys(key: &LinkKey, client_hello: &[u8], server_hello: &[u8]) -> [[u8; 32]; 4] {
    let mut hasher = blake3::Hasher::new_derive_key(CONTEXT_SESSION);
    hasher.update(key.secret());
    hasher.update(client_hello);
    hasher.update(server_hello);
    let mut out = [0u8; 128];
    hasher.finalize_xof().fill(&mut out);
    let mut keys = [[0u8; 32]; 4];
    for (k, chunk) in keys.iter_mut().zip(out.chunks_exact(32)) {
        k.copy_from_slice(chunk);
    }
    zeroize::Zeroize::zeroize(&mut out);
    keys
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// The opening checks every handshake message gets: magic, kind, a
/// version from [`AUTH_VERSION_MIN`] to `latest`.
fn check_opening(bytes: &[u8], kind: u8, latest: u8) -> Result<(), AuthError> {
    if bytes[..4] != AUTH_MAGIC || bytes[5] != kind {
        return Err(AuthError::NotAHandshake);
    }
    if !(AUTH_VERSION_MIN..=latest).contains(&bytes[4]) {
        return Err(AuthError::Version(bytes[4]));
    }
    Ok(())
}

/// Whether this code speaks link version `version`.
pub fn speaks(version: u8) -> bool {
    (AUTH_VERSION_MIN..=AUTH_VERSION).contains(&version)
}

/// The client's side, between its hello and the server's answer.
#[derive(Debug)]
pub struct ClientHandshake {
    key: LinkKey,
    hello: [u8; CLIENT_HELLO_BYTES],
}

impl ClientHandshake {
    /// Starts a handshake as `node` with `nonce` (fresh: [`super::nonce`]),
    /// offering the latest version; returns it and the hello to send.
    pub fn start(key: &LinkKey, node: u64, nonce: [u8; 32]) -> (Self, [u8; CLIENT_HELLO_BYTES]) {
        Self::offering(key, node, nonce, AUTH_VERSION)
    }

    /// [`ClientHandshake::start`], offering `version` (one this code
    /// speaks, [`speaks`]; else the latest): to a peer that refused a
    /// later one.
    pub fn offering(key: &LinkKey, node: u64, nonce: [u8; 32], version: u8) -> (Self, [u8; CLIENT_HELLO_BYTES]) {
        let mut hello = [0u8; CLIENT_HELLO_BYTES];
        hello[..4].copy_from_slice(&AUTH_MAGIC);
        hello[4] = if speaks(version) { version } else { AUTH_VERSION };
        hello[5] = KIND_CLIENT_HELLO;
        hello[8..16].copy_from_slice(&key.id().to_le_bytes());
        hello[16..24].copy_from_slice(&node.to_le_bytes());
        hello[24..56].copy_from_slice(&nonce);
        (Self { key: key.clone(), hello }, hello)
    }

    /// Checks the server's answer; returns the finish to send, the
    /// session, and the node id the server gave.
    pub fn finish(
        self,
        answer: &[u8; SERVER_HELLO_BYTES],
    ) -> Result<([u8; CLIENT_FINISH_BYTES], Session, u64), AuthError> {
        // A refusal may come in any version (a later server's, or an
        // earlier one naming the latest it speaks).
        if answer[..4] != AUTH_MAGIC || answer[5] != KIND_SERVER_HELLO {
            return Err(AuthError::NotAHandshake);
        }
        let theirs = u64_at(answer, 8);
        match answer[6] {
            STATUS_OK => {}
            STATUS_WRONG_KEY => return Err(AuthError::WrongKey { theirs, ours: self.key.id() }),
            STATUS_VERSION => return Err(AuthError::Version(answer[7])),
            _ => return Err(AuthError::NotAHandshake),
        }
        // Accepted: in the version offered, and no other.
        let version = self.hello[4];
        if answer[4] != version {
            return Err(AuthError::Version(answer[4]));
        }
        if theirs != self.key.id() {
            return Err(AuthError::WrongKey { theirs, ours: self.key.id() });
        }
        let expected = proof(&self.key, b"server", &[&self.hello, &answer[..56]]);
        if !tags_equal(&expected, &answer[56..88]) {
            return Err(AuthError::BadProof);
        }
        let finish = proof(&self.key, b"client", &[&self.hello, answer]);
        let keys = session_keys(&self.key, &self.hello, answer);
        Ok((finish, Session::client(keys, version), u64_at(answer, 16)))
    }
}

/// A server hello.
pub type ServerHello = [u8; SERVER_HELLO_BYTES];

/// Why a server refused a hello, and the answer to send before closing,
/// if the client is to be told (another key, another version).
pub type Refusal = (AuthError, Option<ServerHello>);

/// The server's side, between its answer and the client's finish.
#[derive(Debug)]
pub struct ServerHandshake {
    key: LinkKey,
    hello: [u8; CLIENT_HELLO_BYTES],
    answer: [u8; SERVER_HELLO_BYTES],
    peer_node: u64,
}

impl ServerHandshake {
    /// Answers a client's hello as `node` with `nonce`, speaking any
    /// version up to the latest. On an error the bytes to send before
    /// closing come with it, if any (a status the client can report:
    /// another key, another version).
    #[allow(clippy::result_large_err)] // the refusal carries the answer to send
    pub fn answer(
        key: &LinkKey,
        node: u64,
        nonce: [u8; 32],
        hello: &[u8; CLIENT_HELLO_BYTES],
    ) -> Result<(Self, ServerHello), Refusal> {
        Self::answer_up_to(key, node, nonce, hello, AUTH_VERSION)
    }

    /// [`ServerHandshake::answer`], speaking versions up to `latest` (a
    /// node held at an older version while its peers are upgraded).
    #[allow(clippy::result_large_err)] // the refusal carries the answer to send
    pub fn answer_up_to(
        key: &LinkKey,
        node: u64,
        nonce: [u8; 32],
        hello: &[u8; CLIENT_HELLO_BYTES],
        latest: u8,
    ) -> Result<(Self, ServerHello), Refusal> {
        let latest = if speaks(latest) { latest } else { AUTH_VERSION };
        let mut answer = [0u8; SERVER_HELLO_BYTES];
        answer[..4].copy_from_slice(&AUTH_MAGIC);
        answer[4] = latest;
        answer[5] = KIND_SERVER_HELLO;
        answer[8..16].copy_from_slice(&key.id().to_le_bytes());
        answer[16..24].copy_from_slice(&node.to_le_bytes());
        match check_opening(hello, KIND_CLIENT_HELLO, latest) {
            Ok(()) => {}
            Err(AuthError::Version(v)) => {
                answer[6] = STATUS_VERSION;
                answer[7] = latest;
                return Err((AuthError::Version(v), Some(answer)));
            }
            Err(e) => return Err((e, None)),
        }
        // In the client's version.
        answer[4] = hello[4];
        let theirs = u64_at(hello, 8);
        if theirs != key.id() {
            answer[6] = STATUS_WRONG_KEY;
            return Err((AuthError::WrongKey { theirs, ours: key.id() }, Some(answer)));
        }
        answer[6] = STATUS_OK;
        answer[24..56].copy_from_slice(&nonce);
        let server_proof = proof(key, b"server", &[hello, &answer[..56]]);
        answer[56..88].copy_from_slice(&server_proof);
        Ok((Self { key: key.clone(), hello: *hello, answer, peer_node: u64_at(hello, 16) }, answer))
    }

    /// Checks the client's finish; returns the session and the node id the
    /// client gave.
    pub fn finish(self, finish: &[u8; CLIENT_FINISH_BYTES]) -> Result<(Session, u64), AuthError> {
        let expected = proof(&self.key, b"client", &[&self.hello, &self.answer]);
        if !tags_equal(&expected, finish) {
            return Err(AuthError::BadProof);
        }
        let version = self.answer[4];
        Ok((Session::server(session_keys(&self.key, &self.hello, &self.answer), version), self.peer_node))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(client_key: &LinkKey, server_key: &LinkKey) -> Result<(Session, Session), AuthError> {
        let (client, hello) = ClientHandshake::start(client_key, 1, [1; 32]);
        let (server, answer) = ServerHandshake::answer(server_key, 2, [2; 32], &hello).map_err(|(e, _)| e)?;
        let (finish, client_session, node) = client.finish(&answer)?;
        assert_eq!(node, 2);
        let (server_session, node) = server.finish(&finish)?;
        assert_eq!(node, 1);
        Ok((client_session, server_session))
    }

    #[test]
    fn two_holders_of_the_key_agree_on_a_session() {
        let key = LinkKey::from_bytes([9; 32]);
        let (mut client, mut server) = pair(&key, &key).unwrap();
        let tags = client.seal(b"header", b"payload");
        let check = server.open_header(b"header", &tags).unwrap();
        assert!(check.verify(b"payload").is_ok());
        let back = server.seal(b"ack", b"");
        assert!(client.open_header(b"ack", &back).is_ok());
    }

    #[test]
    fn another_key_is_named_on_both_sides() {
        let ours = LinkKey::from_bytes([9; 32]);
        let theirs = LinkKey::from_bytes([8; 32]);
        let (client, hello) = ClientHandshake::start(&theirs, 1, [1; 32]);
        let (error, answer) = ServerHandshake::answer(&ours, 2, [2; 32], &hello).unwrap_err();
        assert_eq!(error, AuthError::WrongKey { theirs: theirs.id(), ours: ours.id() });
        let told = client.finish(&answer.unwrap()).unwrap_err();
        assert_eq!(told, AuthError::WrongKey { theirs: ours.id(), ours: theirs.id() });
    }

    #[test]
    fn a_forged_proof_or_a_replayed_handshake_fails() {
        let key = LinkKey::from_bytes([9; 32]);
        let (client, hello) = ClientHandshake::start(&key, 1, [1; 32]);
        let (server, mut answer) = ServerHandshake::answer(&key, 2, [2; 32], &hello).unwrap();
        answer[60] ^= 1;
        assert_eq!(client.finish(&answer).unwrap_err(), AuthError::BadProof);
        // A finish recorded from another connection (another server nonce).
        let (client, hello) = ClientHandshake::start(&key, 1, [1; 32]);
        let (_, old_answer) = ServerHandshake::answer(&key, 2, [3; 32], &hello).unwrap();
        let (old_finish, _, _) = client.finish(&old_answer).unwrap();
        assert_eq!(server.finish(&old_finish).unwrap_err(), AuthError::BadProof);
    }

    #[test]
    fn versions_settle_on_the_older_side_and_a_later_offer_is_told_the_latest() {
        let key = LinkKey::from_bytes([9; 32]);
        // An older client (version 1) to this server: answered in 1.
        let (client, hello) = ClientHandshake::offering(&key, 1, [1; 32], 1);
        assert_eq!(hello[4], 1);
        let (server, answer) = ServerHandshake::answer(&key, 2, [2; 32], &hello).unwrap();
        let (finish, mut ours, _) = client.finish(&answer).unwrap();
        let (mut theirs, _) = server.finish(&finish).unwrap();
        assert_eq!((ours.version(), theirs.version()), (1, 1));
        let tags = ours.seal(b"h", b"p");
        assert!(theirs.open_header(b"h", &tags).unwrap().verify(b"p").is_ok());
        // This client to a server held at 1 (as version 1 code was): told
        // 1, and a second offer of 1 goes through.
        let (client, hello) = ClientHandshake::start(&key, 1, [1; 32]);
        let (error, answer) = ServerHandshake::answer_up_to(&key, 2, [2; 32], &hello, 1).unwrap_err();
        assert_eq!(error, AuthError::Version(2));
        assert_eq!(client.finish(&answer.unwrap()).unwrap_err(), AuthError::Version(1));
        let (client, hello) = ClientHandshake::offering(&key, 1, [1; 32], 1);
        let (server, answer) = ServerHandshake::answer_up_to(&key, 2, [2; 32], &hello, 1).unwrap();
        let (finish, ours, _) = client.finish(&answer).unwrap();
        assert_eq!((ours.version(), server.finish(&finish).unwrap().0.version()), (1, 1));
        // An answer in another version than offered, its proof aside, is
        // refused; so is one whose version byte was bent (the proof).
        let (client, hello) = ClientHandshake::start(&key, 1, [1; 32]);
        let (_, mut answer) = ServerHandshake::answer(&key, 2, [2; 32], &hello).unwrap();
        answer[4] = 1;
        assert_eq!(client.finish(&answer).unwrap_err(), AuthError::Version(1));
        let (client, mut hello) = ClientHandshake::start(&key, 1, [1; 32]);
        let (_, answer) = ServerHandshake::answer(&key, 2, [2; 32], &hello).unwrap();
        hello[4] = 1;
        let bent = ClientHandshake { key: key.clone(), hello };
        assert_eq!(bent.finish(&answer).unwrap_err(), AuthError::Version(2));
        let _ = client;
    }

    #[test]
    fn plain_frames_and_other_versions_are_not_handshakes() {
        let key = LinkKey::from_bytes([9; 32]);
        let mut plain = [0u8; CLIENT_HELLO_BYTES];
        plain[..4].copy_from_slice(b"LKTX");
        assert_eq!(ServerHandshake::answer(&key, 2, [2; 32], &plain).unwrap_err().0, AuthError::NotAHandshake);
        let (_, mut hello) = ClientHandshake::start(&key, 1, [1; 32]);
        hello[4] = 9;
        let (error, answer) = ServerHandshake::answer(&key, 2, [2; 32], &hello).unwrap_err();
        assert_eq!(error, AuthError::Version(9));
        let (client, _) = ClientHandshake::start(&key, 1, [1; 32]);
        assert_eq!(client.finish(&answer.unwrap()).unwrap_err(), AuthError::Version(AUTH_VERSION));
    }
}
