//! A link's session after its handshake: each frame's two tags.
//!
//! Each direction has its own header key, payload key and frame counter.
//! A frame's payload tag is the keyed BLAKE3 hash of its bytes and then
//! its sequence number (link version 2; version 1, which a node still
//! speaks to a peer that speaks no later one, hashed the number first);
//! its header tag that of its sequence number, header and payload tag. The sequence number is not sent: each end counts frames,
//! so a frame replayed, dropped or moved fails at the next tag. Tags are
//! the hashes' first 16 bytes.

use zeroize::Zeroize;

use super::{AuthError, tags_equal};

/// Bytes of one tag.
pub const TAG_BYTES: usize = 16;
/// Bytes a frame's tags take on the wire: header tag, then payload tag.
pub const TAGS_BYTES: usize = 2 * TAG_BYTES;

struct Direction {
    header_key: [u8; 32],
    payload_key: [u8; 32],
    seq: u64,
}

impl Drop for Direction {
    fn drop(&mut self) {
        self.header_key.zeroize();
        self.payload_key.zeroize();
    }
}

/// The threads payload tags are spread over, once set for the process.
static TAG_THREADS: std::sync::OnceLock<rayon_core::ThreadPool> = std::sync::OnceLock::new();

/// Most threads tags may be spread over.
pub const TAG_THREADS_MAX: usize = 64;

/// Payloads shorter than this are tagged on the calling thread: spreading
/// one costs more than it saves.
pub const SPREAD_MIN_BYTES: usize = 256 * 1024;

/// Spreads the tags of payloads of [`SPREAD_MIN_BYTES`] or more over
/// `threads` threads of their own (`lake-tag-N`) for the rest of the
/// process: the thread that asks waits for them, so a link's one polling
/// thread tags at several cores' rate. Same tags either way (BLAKE3's
/// tree). Set once; 0 or 1 keeps tagging on the caller's thread.
pub fn spread_tags(threads: usize) -> Result<(), String> {
    if threads <= 1 {
        return Ok(());
    }
    if threads > TAG_THREADS_MAX {
        return Err(format!("{threads} tag threads: at most {TAG_THREADS_MAX}"));
    }
    if let Some(pool) = TAG_THREADS.get() {
        return if pool.current_num_threads() == threads {
            Ok(())
        } else {
            Err(format!("tags are already spread over {} threads", pool.current_num_threads()))
        };
    }
    let pool = rayon_core::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lake-tag-{i}"))
        .build()
        .map_err(|e| format!("starting {threads} tag threads: {e}"))?;
    // A racing caller's pool wins; the same count either way.
    let _ = TAG_THREADS.set(pool);
    Ok(())
}

/// The threads tags are spread over (0: the caller's own).
pub fn tag_threads() -> usize {
    TAG_THREADS.get().map_or(0, rayon_core::ThreadPool::current_num_threads)
}

/// Payloads at least this long are tagged or checked on the tag threads
/// while the link's thread goes on ([`Session::seal_later`],
/// [`PayloadCheck::verify_later`]), where tags are spread.
pub const LATER_MIN_BYTES: usize = 64 * 1024;

/// Whether a payload of `len` bytes is tagged or checked on the tag
/// threads while the caller goes on.
pub fn tags_later(len: usize) -> bool {
    len >= LATER_MIN_BYTES && TAG_THREADS.get().is_some()
}

/// A pointer a tag thread reads through.
struct Bytes(*const u8, usize);

// SAFETY: only read, while the caller of `seal_later` / `verify_later`
// keeps the bytes valid and unchanged (their contract).
unsafe impl Send for Bytes {}

/// The `len` bytes at `at` (none for 0).
///
/// # Safety
///
/// Valid for `len` bytes while the slice lives.
unsafe fn bytes_at<'a>(at: *const u8, len: usize) -> &'a [u8] {
    // SAFETY: valid for `len` bytes (contract).
    if len == 0 { &[] } else { unsafe { core::slice::from_raw_parts(at, len) } }
}

/// Runs `work` over the `len` bytes at `at` on one of `pool`'s threads;
/// what it makes comes with the returned [`Later`].
///
/// # Safety
///
/// The bytes stay valid and unchanged until it is made.
unsafe fn on_tag_thread<T: Send + Sync + 'static>(
    pool: &rayon_core::ThreadPool,
    at: *const u8,
    len: usize,
    work: impl FnOnce(&[u8]) -> T + Send + 'static,
) -> Later<T> {
    let done = std::sync::Arc::new(std::sync::OnceLock::new());
    let out = std::sync::Arc::clone(&done);
    let bytes = Bytes(at, len);
    pool.spawn(move || {
        let bytes = bytes;
        // SAFETY: valid and unchanged until the result is set (contract).
        let _ = out.set(work(unsafe { bytes_at(bytes.0, bytes.1) }));
    });
    Later(done)
}

/// Tags (or a verdict) being made on the tag threads.
#[derive(Debug)]
pub struct Later<T>(std::sync::Arc<std::sync::OnceLock<T>>);

impl<T: Copy> Later<T> {
    /// What was made, if it is done.
    pub fn get(&self) -> Option<T> {
        self.0.get().copied()
    }

    /// Waits for it (a tag thread is on it: a hash's time at most).
    pub fn wait(&self) -> T {
        loop {
            if let Some(done) = self.get() {
                return done;
            }
            std::thread::yield_now();
        }
    }
}

fn payload_tag(key: &[u8; 32], seq: u64, payload: &[u8], version: u8) -> [u8; TAG_BYTES] {
    let mut hasher = blake3::Hasher::new_keyed(key);
    if version == 1 {
        // Version 1: the sequence number first (no spreading gains much).
        hasher.update(&seq.to_le_bytes());
        hasher.update(payload);
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(&hasher.finalize().as_bytes()[..TAG_BYTES]);
        return tag;
    }
    // The payload first, from BLAKE3's chunk 0, so its subtrees align and
    // spread evenly; the fixed-size sequence number after it.
    match TAG_THREADS.get() {
        Some(pool) if payload.len() >= SPREAD_MIN_BYTES => pool.install(|| {
            hasher.update_rayon(payload);
        }),
        _ => {
            hasher.update(payload);
        }
    }
    hasher.update(&seq.to_le_bytes());
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&hasher.finalize().as_bytes()[..TAG_BYTES]);
    tag
}

fn header_tag(key: &[u8; 32], seq: u64, header: &[u8], payload_tag: &[u8]) -> [u8; TAG_BYTES] {
    let mut hasher = blake3::Hasher::new_keyed(key);
    hasher.update(&seq.to_le_bytes());
    hasher.update(&(header.len() as u64).to_le_bytes());
    hasher.update(header);
    hasher.update(payload_tag);
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&hasher.finalize().as_bytes()[..TAG_BYTES]);
    tag
}

/// One connection's keys and counters. See the module docs.
pub struct Session {
    send: Direction,
    recv: Direction,
    /// The link version the handshake settled on.
    version: u8,
}

impl core::fmt::Debug for Session {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Session").field("sent", &self.send.seq).field("received", &self.recv.seq).finish()
    }
}

impl Session {
    fn of(send: (&[u8; 32], &[u8; 32]), recv: (&[u8; 32], &[u8; 32]), version: u8) -> Self {
        Self {
            send: Direction { header_key: *send.0, payload_key: *send.1, seq: 0 },
            recv: Direction { header_key: *recv.0, payload_key: *recv.1, seq: 0 },
            version,
        }
    }

    /// The client's session from the four derived keys (client-to-server
    /// header and payload, then server-to-client), at link `version`.
    pub(crate) fn client(mut keys: [[u8; 32]; 4], version: u8) -> Self {
        let session = Self::of((&keys[0], &keys[1]), (&keys[2], &keys[3]), version);
        keys.zeroize();
        session
    }

    /// The server's session from the same keys.
    pub(crate) fn server(mut keys: [[u8; 32]; 4], version: u8) -> Self {
        let session = Self::of((&keys[2], &keys[3]), (&keys[0], &keys[1]), version);
        keys.zeroize();
        session
    }

    /// The link version the handshake settled on.
    pub fn version(&self) -> u8 {
        self.version
    }

    /// The tags of the next frame sent (`header`, then `payload`): header
    /// tag, payload tag. Frames must go out in the order they are sealed.
    pub fn seal(&mut self, header: &[u8], payload: &[u8]) -> [u8; TAGS_BYTES] {
        let seq = self.send.seq;
        self.send.seq += 1;
        let payload = payload_tag(&self.send.payload_key, seq, payload, self.version);
        let header = header_tag(&self.send.header_key, seq, header, &payload);
        let mut tags = [0u8; TAGS_BYTES];
        tags[..TAG_BYTES].copy_from_slice(&header);
        tags[TAG_BYTES..].copy_from_slice(&payload);
        tags
    }

    /// [`Session::seal`], the tags made on the tag threads: the frame's
    /// place in the count is taken now, its tags come with the returned
    /// [`Later`]. Where tags are not spread ([`tags_later`] false), `Err`
    /// with the tags made here.
    ///
    /// # Safety
    ///
    /// `payload` is valid for `len` bytes, unchanged, until the tags are
    /// done (`get` returns them, or `wait` returned).
    pub unsafe fn seal_later(
        &mut self,
        header: &[u8; 64],
        payload: *const u8,
        len: usize,
    ) -> Result<Later<[u8; TAGS_BYTES]>, [u8; TAGS_BYTES]> {
        let Some(pool) = TAG_THREADS.get().filter(|_| len >= LATER_MIN_BYTES) else {
            // SAFETY: valid for `len` bytes (contract).
            return Err(self.seal(header, unsafe { bytes_at(payload, len) }));
        };
        let seq = self.send.seq;
        self.send.seq += 1;
        let version = self.version;
        let (mut header_key, mut payload_key) = (self.send.header_key, self.send.payload_key);
        let header = *header;
        // SAFETY: valid and unchanged until the tags are made (contract).
        let later = unsafe {
            on_tag_thread(pool, payload, len, move |payload| {
                let payload = payload_tag(&payload_key, seq, payload, version);
                let header = header_tag(&header_key, seq, &header, &payload);
                header_key.zeroize();
                payload_key.zeroize();
                let mut tags = [0u8; TAGS_BYTES];
                tags[..TAG_BYTES].copy_from_slice(&header);
                tags[TAG_BYTES..].copy_from_slice(&payload);
                tags
            })
        };
        Ok(later)
    }

    /// Checks the next frame received's header against its tags; the
    /// header may then be acted on. Returns the check its payload must
    /// pass before its bytes count.
    pub fn open_header(&mut self, header: &[u8], tags: &[u8; TAGS_BYTES]) -> Result<PayloadCheck, AuthError> {
        let seq = self.recv.seq;
        let (header_got, payload_got) = tags.split_at(TAG_BYTES);
        let expected = header_tag(&self.recv.header_key, seq, header, payload_got);
        if !tags_equal(&expected, header_got) {
            return Err(AuthError::BadTag);
        }
        self.recv.seq += 1;
        let mut tag = [0u8; TAG_BYTES];
        tag.copy_from_slice(payload_got);
        Ok(PayloadCheck { key: self.recv.payload_key, seq, tag, version: self.version })
    }

    /// Frames sealed so far.
    pub fn sent(&self) -> u64 {
        self.send.seq
    }

    /// Frames opened so far.
    pub fn received(&self) -> u64 {
        self.recv.seq
    }
}

/// What a frame's payload must hash to (from [`Session::open_header`]).
pub struct PayloadCheck {
    key: [u8; 32],
    seq: u64,
    tag: [u8; TAG_BYTES],
    version: u8,
}

impl core::fmt::Debug for PayloadCheck {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PayloadCheck").field("seq", &self.seq).finish_non_exhaustive()
    }
}

impl Drop for PayloadCheck {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

impl PayloadCheck {
    /// Whether `payload` is the payload the header was sealed with.
    pub fn verify(&self, payload: &[u8]) -> Result<(), AuthError> {
        let tag = payload_tag(&self.key, self.seq, payload, self.version);
        if tags_equal(&tag, &self.tag) { Ok(()) } else { Err(AuthError::BadTag) }
    }

    /// [`PayloadCheck::verify`] on the tag threads: the verdict (`true`:
    /// the sealed payload) comes with the returned [`Later`]. Where tags
    /// are not spread ([`tags_later`] false), `Err` with the verdict made
    /// here.
    ///
    /// # Safety
    ///
    /// `payload` is valid for `len` bytes, unchanged, until the verdict is
    /// done (`get` returns it, or `wait` returned).
    pub unsafe fn verify_later(self, payload: *const u8, len: usize) -> Result<Later<bool>, Result<(), AuthError>> {
        let Some(pool) = TAG_THREADS.get().filter(|_| len >= LATER_MIN_BYTES) else {
            // SAFETY: valid for `len` bytes (contract).
            return Err(self.verify(unsafe { bytes_at(payload, len) }));
        };
        // SAFETY: valid and unchanged until the verdict is made (contract).
        Ok(unsafe { on_tag_thread(pool, payload, len, move |payload| self.verify(payload).is_ok()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Session, Session) {
        let keys = [[1u8; 32], [2; 32], [3; 32], [4; 32]];
        (Session::client(keys, 2), Session::server(keys, 2))
    }

    #[test]
    fn version_1_tags_hash_the_sequence_number_first_as_that_version_did() {
        let keys = [[1u8; 32], [2; 32], [3; 32], [4; 32]];
        let (mut client, mut server) = (Session::client(keys, 1), Session::server(keys, 1));
        let payload = b"a block's bytes";
        let tags = client.seal(b"header", payload);
        // Version 1's payload tag, from its definition (docs/formats.md).
        let mut v1 = blake3::Hasher::new_keyed(&[2; 32]);
        v1.update(&0u64.to_le_bytes());
        v1.update(payload);
        assert_eq!(tags[TAG_BYTES..], v1.finalize().as_bytes()[..TAG_BYTES]);
        assert!(server.open_header(b"header", &tags).unwrap().verify(payload).is_ok());
        // A version 2 end does not take them.
        let mut later = Session::server(keys, 2);
        let check = later.open_header(b"header", &tags);
        assert!(check.is_err() || check.unwrap().verify(payload).is_err());
    }

    #[test]
    fn spread_tags_are_the_same_tags() {
        let payload: Vec<u8> = (0..3 * SPREAD_MIN_BYTES + 4321).map(|i| (i % 251) as u8).collect();
        let alone = payload_tag(&[7; 32], 9, &payload, 2);
        spread_tags(3).unwrap();
        assert_eq!(tag_threads(), 3);
        assert!(spread_tags(4).unwrap_err().contains("already"));
        assert!(spread_tags(TAG_THREADS_MAX + 1).unwrap_err().contains("at most"));
        assert_eq!(payload_tag(&[7; 32], 9, &payload, 2), alone);
        assert_ne!(payload_tag(&[7; 32], 10, &payload, 2), alone);
    }

    #[test]
    fn tags_made_later_are_the_tags_made_now_and_a_bent_payload_fails_later_too() {
        spread_tags(3).unwrap();
        let payload: Vec<u8> = (0..LATER_MIN_BYTES * 5 + 17).map(|i| (i % 253) as u8).collect();
        let header = [9u8; 64];
        let (mut now, mut later) = (pair().0, pair().0);
        let (_, mut server) = pair();
        for _ in 0..3 {
            let tags = now.seal(&header, &payload);
            // SAFETY: `payload` outlives the wait.
            let made = unsafe { later.seal_later(&header, payload.as_ptr(), payload.len()) }.unwrap();
            assert_eq!(made.wait(), tags);
            let check = server.open_header(&header, &tags).unwrap();
            // SAFETY: as above.
            let verdict = unsafe { check.verify_later(payload.as_ptr(), payload.len()) }.unwrap();
            assert!(verdict.wait());
        }
        // Short payloads are tagged on the caller's thread.
        // SAFETY: as above.
        let short = unsafe { pair().0.seal_later(&header, payload.as_ptr(), 100) };
        assert_eq!(short.unwrap_err(), pair().0.seal(&header, &payload[..100]));
        let tags = now.seal(&header, &payload);
        let check = server.open_header(&header, &tags).unwrap();
        let mut bent = payload.clone();
        bent[LATER_MIN_BYTES * 3] ^= 1;
        // SAFETY: `bent` outlives the wait.
        assert!(!unsafe { check.verify_later(bent.as_ptr(), bent.len()) }.unwrap().wait());
    }

    #[test]
    fn a_tampered_header_or_payload_fails_and_so_does_a_replay() {
        let (mut client, mut server) = pair();
        let first = client.seal(b"h1", b"p1");
        let second = client.seal(b"h2", b"p2");
        // Tampered header.
        assert_eq!(server.open_header(b"h0", &first).unwrap_err(), AuthError::BadTag);
        // Tampered payload tag (so the header tag fails too).
        let mut bent = first;
        bent[TAG_BYTES] ^= 1;
        assert_eq!(server.open_header(b"h1", &bent).unwrap_err(), AuthError::BadTag);
        // Out of order.
        assert_eq!(server.open_header(b"h2", &second).unwrap_err(), AuthError::BadTag);
        let check = server.open_header(b"h1", &first).unwrap();
        assert_eq!(check.verify(b"p0").unwrap_err(), AuthError::BadTag);
        assert!(check.verify(b"p1").is_ok());
        // Replayed.
        assert_eq!(server.open_header(b"h1", &first).unwrap_err(), AuthError::BadTag);
        assert!(server.open_header(b"h2", &second).unwrap().verify(b"p2").is_ok());
        // The other direction has keys of its own.
        let back = client.seal(b"h3", b"");
        assert_eq!(client.open_header(b"h3", &back).unwrap_err(), AuthError::BadTag);
    }
}
