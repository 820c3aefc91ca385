//! The pre-shared-key handshake that opens every authenticated link.
//!
//! Three messages, fixed sizes, no allocation; nothing but the key's id
//! and fresh nonces in the clear:
//!
//! | message | bytes | fields |
//! |---|---:|---|
//! | client hello | 64 | magic `LKAU`, version 1, kind 1, key id, node id, the client's 32-byte nonce |
//! | server hello | 96 | magic, version, kind 2, status, key id, node id, the server's nonce, the server's 32-byte proof |
//! | client finish | 32 | the client's proof |
//!
//! A proof is the keyed BLAKE3 hash, under a key derived from the link
//! key, of a side label and every byte of the handshake before it: only a
//! holder of the key makes one, and one made for a connection proves
//! nothing on another (each side's nonce is fresh). The session's four
//! keys (each direction's header and payload keys) are derived from the
//! link key and the whole transcript. A server that holds another key, or
//! speaks another version, answers with a status saying so (and no proof)
//! and closes, so the operator on either side reads which.

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

/// The opening checks every handshake message gets: magic, version, kind.
fn check_opening(bytes: &[u8], kind: u8) -> Result<(), AuthError> {
    if bytes[..4] != AUTH_MAGIC || bytes[5] != kind {
        return Err(AuthError::NotAHandshake);
    }
    if bytes[4] != AUTH_VERSION {
        return Err(AuthError::Version(bytes[4]));
    }
    Ok(())
}

/// The client's side, between its hello and the server's answer.
#[derive(Debug)]
pub struct ClientHandshake {
    key: LinkKey,
    hello: [u8; CLIENT_HELLO_BYTES],
}

impl ClientHandshake {
    /// Starts a handshake as `node` with `nonce` (fresh: [`super::nonce`]);
    /// returns it and the hello to send.
    pub fn start(key: &LinkKey, node: u64, nonce: [u8; 32]) -> (Self, [u8; CLIENT_HELLO_BYTES]) {
        let mut hello = [0u8; CLIENT_HELLO_BYTES];
        hello[..4].copy_from_slice(&AUTH_MAGIC);
        hello[4] = AUTH_VERSION;
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
        check_opening(answer, KIND_SERVER_HELLO)?;
        let theirs = u64_at(answer, 8);
        match answer[6] {
            STATUS_OK => {}
            STATUS_WRONG_KEY => return Err(AuthError::WrongKey { theirs, ours: self.key.id() }),
            STATUS_VERSION => return Err(AuthError::Version(answer[7])),
            _ => return Err(AuthError::NotAHandshake),
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
        Ok((finish, Session::client(keys), u64_at(answer, 16)))
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
    /// Answers a client's hello as `node` with `nonce`. On an error the
    /// bytes to send before closing come with it, if any (a status the
    /// client can report: another key, another version).
    #[allow(clippy::result_large_err)] // the refusal carries the answer to send
    pub fn answer(
        key: &LinkKey,
        node: u64,
        nonce: [u8; 32],
        hello: &[u8; CLIENT_HELLO_BYTES],
    ) -> Result<(Self, ServerHello), Refusal> {
        let mut answer = [0u8; SERVER_HELLO_BYTES];
        answer[..4].copy_from_slice(&AUTH_MAGIC);
        answer[4] = AUTH_VERSION;
        answer[5] = KIND_SERVER_HELLO;
        answer[8..16].copy_from_slice(&key.id().to_le_bytes());
        answer[16..24].copy_from_slice(&node.to_le_bytes());
        match check_opening(hello, KIND_CLIENT_HELLO) {
            Ok(()) => {}
            Err(AuthError::Version(v)) => {
                answer[6] = STATUS_VERSION;
                answer[7] = AUTH_VERSION;
                return Err((AuthError::Version(v), Some(answer)));
            }
            Err(e) => return Err((e, None)),
        }
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
        Ok((Session::server(session_keys(&self.key, &self.hello, &self.answer)), self.peer_node))
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
