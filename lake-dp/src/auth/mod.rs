//! Authenticated links: who may talk to a Lake process, and proof that
//! what arrives is what a peer holding the cluster's key sent, in order,
//! once.
//!
//! Between processes on different hosts (the transport's connections,
//! the summary link between `lake-cp`s) every connection opens with a
//! pre-shared-key handshake ([`handshake`]): both ends prove they hold the
//! [`LinkKey`] without sending it, over fresh nonces from each side, and
//! derive the connection's own session keys from it. From then on every
//! frame carries two tags ([`session`]): one over its sequence number and
//! header, checked before the header is acted on, one over its bytes,
//! checked before they count. A forged, tampered, replayed, reordered or
//! truncated frame fails its tag; the connection is closed, what it was
//! carrying is dropped unpublished, and nothing else on the node notices.
//! The tags are keyed BLAKE3 (the crate the block keys already use; one
//! pass over the bytes at ~6 GB/s a core here, the cheapest keyed hash
//! measured on these machines). CRCs stay for corruption; tags are for
//! tampering.
//!
//! Between processes on one host (agents attaching to `lake-dp`,
//! `lake-dp` and agents to `lake-cp`) the Unix socket's peer credentials
//! (`SO_PEERCRED`) are checked against an allow-list ([`peer`]), and the
//! sockets and shared-memory files are created with restrictive modes.

pub mod at_rest;
pub mod handshake;
pub mod key;
pub mod peer;
pub mod record;
pub mod session;

pub use handshake::{ClientHandshake, ServerHandshake};
pub use key::{KeyError, LinkKey};
pub use peer::{Credentials, PeerPolicy};
pub use record::RecordLink;
pub use session::{
    LATER_MIN_BYTES, Later, PayloadCheck, SPREAD_MIN_BYTES, Session, TAGS_BYTES, spread_tags, tag_threads, tags_later,
};

/// Why a link's authentication failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// What arrived is not a Lake handshake (a peer without a key
    /// configured, or something else on the port).
    NotAHandshake,
    /// The peer speaks a handshake version this code does not.
    Version(u8),
    /// The peer holds another key (its key id, ours).
    WrongKey {
        /// The id of the key the peer holds.
        theirs: u64,
        /// The id of ours.
        ours: u64,
    },
    /// The peer's proof of the key does not check: it does not hold the
    /// key it names, or the handshake was tampered with.
    BadProof,
    /// A frame's tag does not check: forged, tampered with, replayed or
    /// out of order.
    BadTag,
    /// A record longer than the reader takes.
    TooLong(usize),
}

impl core::fmt::Display for AuthError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotAHandshake => f.write_str("not a Lake handshake (a peer with no link key?)"),
            Self::Version(v) => write!(f, "handshake version {v} is not spoken here"),
            Self::WrongKey { theirs, ours } => {
                write!(f, "the peer holds another link key (id {theirs:016x}; ours is {ours:016x})")
            }
            Self::BadProof => f.write_str("the peer's proof of the link key does not check"),
            Self::BadTag => f.write_str("a frame failed its authentication tag (tampered, replayed or reordered)"),
            Self::TooLong(n) => write!(f, "a {n}-byte record is longer than this link takes"),
        }
    }
}

impl std::error::Error for AuthError {}

/// Fills `out` from the kernel's random source (`getrandom`, blocking only
/// until the pool is first seeded at boot).
pub fn random_bytes(out: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < out.len() {
        let rest = &mut out[filled..];
        // SAFETY: getrandom writes at most `rest.len()` bytes into `rest`.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if got < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        filled += got.unsigned_abs();
    }
    Ok(())
}

/// A fresh 32-byte nonce.
pub fn nonce() -> std::io::Result<[u8; 32]> {
    let mut nonce = [0u8; 32];
    random_bytes(&mut nonce)?;
    Ok(nonce)
}

/// Compares two tags in time that does not depend on where they differ.
/// A secret key's public id: the first 8 bytes of BLAKE3's derivation
/// of it under `context`, little-endian.
pub(crate) fn key_id(context: &str, secret: &[u8; 32]) -> u64 {
    let derived = blake3::derive_key(context, secret);
    let mut first = [0u8; 8];
    first.copy_from_slice(&derived[..8]);
    u64::from_le_bytes(first)
}

pub(crate) fn tags_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    // Kept from being turned into an early-exit comparison.
    core::hint::black_box(difference) == 0
}
