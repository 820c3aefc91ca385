//! L3, the object store: the single source of truth (DESIGN §1, §3). A
//! block is one object in the stored-object format v1 — its
//! self-describing header, then the payload — named
//! `{prefix}/{namespace}/{key}`, so a store holds enough to rebuild the
//! index from its objects alone.
//!
//! - [`ObjectStore`]: what a store does (put, get, delete, list), with the
//!   two kinds of failure that matter — worth another try, or not.
//! - [`dir::DirStore`]: a directory (the embedded default); [`s3::S3Store`]:
//!   an S3-compatible service over HTTP.
//! - [`L3Client`]: the stores' calls block, so they run on worker threads
//!   of their own, never on a poll core; the poller hands requests over a
//!   bounded queue and takes completions from another, without blocking.
//!   Every object read is checked (header, key, namespace, every segment
//!   CRC) before it is reported landed; transient failures are retried with
//!   backoff, a bounded number of times.

pub mod dir;
pub mod s3;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::BlockKey;
use crate::constants::STORED_HEADER_BYTES;
use crate::model::namespace::NamespaceId;
use crate::stored::{ObjectMeta, decode_header, decode_object};

/// Why a store call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The service or the network failed this time (a connection refused
    /// or reset, a 5xx, a timeout): another try may work.
    Transient(String),
    /// It will fail again the same way (refused credentials, a bad name, a
    /// missing bucket).
    Permanent(String),
}

impl core::fmt::Display for StoreError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Transient(why) => write!(f, "object store (transient): {why}"),
            Self::Permanent(why) => write!(f, "object store: {why}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// An object store. Calls block; [`L3Client`] runs them off the poll core.
pub trait ObjectStore: Send {
    /// Stores `bytes` as `name` (whole, or not at all).
    fn put(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError>;
    /// The object `name`, or `None` if there is none.
    fn get(&mut self, name: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Removes `name` (absent already is fine).
    fn delete(&mut self, name: &str) -> Result<(), StoreError>;
    /// Removes every one of `names` (absent ones are fine), in as few
    /// calls as the store allows; the default removes them one by one.
    fn delete_many(&mut self, names: &[String]) -> Result<(), StoreError> {
        names.iter().try_for_each(|name| self.delete(name))
    }
    /// The names under `prefix`.
    fn list(&mut self, prefix: &str) -> Result<Vec<String>, StoreError>;
    /// The first `len` bytes of `name` (fewer if it is shorter), or `None`
    /// if there is none: what a catalog scan reads of each object (its
    /// header). The default reads the whole object.
    fn get_head(&mut self, name: &str, len: usize) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.get(name)?.map(|mut bytes| {
            bytes.truncate(len);
            bytes
        }))
    }
}

/// The name of a block's object: `{prefix}/{namespace:016x}/{key}`.
pub fn object_name(prefix: &str, namespace: NamespaceId, key: &BlockKey) -> String {
    format!("{prefix}/{:016x}/{key}", namespace.0)
}

/// Seals the stored object in `bytes` (checked, in the clear) under
/// `data_key`: its payload encrypted in place, its header saying so, its
/// CRCs over the ciphertext.
fn seal_object(data_key: &crate::auth::at_rest::DataKey, bytes: &mut [u8]) -> Result<(), L3Error> {
    use crate::stored::{decode_header, encode_header_sealed, segment_crcs};
    let meta = *decode_header(bytes).map_err(|e| L3Error::Corrupt(e.to_string()))?.meta();
    let (head, body) = bytes.split_at_mut(STORED_HEADER_BYTES);
    let len = usize::try_from(meta.payload_len).map_err(|_| L3Error::TooLarge(meta.payload_len))?;
    let payload = body.get_mut(..len).ok_or_else(|| L3Error::Corrupt("payload shorter than its header says".into()))?;
    let seal = crate::auth::at_rest::seal(data_key, &meta, payload).map_err(|e| L3Error::Corrupt(e.to_string()))?;
    let mut crcs = [0u32; crate::constants::SEGMENTS_MAX];
    let count = segment_crcs(payload, meta.segment_bytes, &mut crcs).map_err(|e| L3Error::Corrupt(e.to_string()))?;
    let head: &mut [u8; STORED_HEADER_BYTES] =
        head.try_into().map_err(|_| L3Error::Corrupt("a short header".into()))?;
    encode_header_sealed(&meta, &crcs[..usize::from(count)], Some(&seal), head)
        .map_err(|e| L3Error::Corrupt(e.to_string()))
}

/// Checks an object read back as the block `key` of `namespace`: the
/// stored header decodes, names that key and namespace, and every segment
/// matches its CRC.
pub fn verify(bytes: &[u8], namespace: NamespaceId, key: &BlockKey) -> Result<(), L3Error> {
    let (header, _) = decode_object(bytes).map_err(|e| L3Error::Corrupt(e.to_string()))?;
    let meta = header.meta();
    if meta.key != *key || meta.namespace != namespace {
        return Err(L3Error::Corrupt("the object names another block".into()));
    }
    Ok(())
}

/// Why an L3 request did not complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum L3Error {
    /// No such object.
    NotFound,
    /// The object read back does not check: never handed on.
    Corrupt(String),
    /// It does not fit the memory given for it (its length).
    TooLarge(u64),
    /// The store failed: permanently, or transiently every time it was
    /// tried (the last reason).
    Store(StoreError),
    /// Cancelled ([`L3Client::cancel`]): before a worker took it (the store
    /// was not asked), or a read under way stopped before its bytes were
    /// copied (its memory not touched either way).
    Cancelled,
}

impl core::fmt::Display for L3Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NotFound => f.write_str("no such object in L3"),
            Self::Corrupt(why) => write!(f, "the L3 object does not check: {why}"),
            Self::TooLarge(len) => write!(f, "the L3 object ({len} bytes) does not fit the memory given"),
            Self::Store(e) => e.fmt(f),
            Self::Cancelled => f.write_str("cancelled before its bytes landed"),
        }
    }
}

impl std::error::Error for L3Error {}

/// A request to L3. The memory a put reads or a get writes is the caller's
/// (an L1 or L2 staging slot), held unchanged until the request completes.
#[derive(Clone, Copy, Debug)]
pub enum L3Request {
    /// Store the stored object at `source` (`len` bytes) as block `key`.
    Put {
        /// The block.
        key: BlockKey,
        /// Its namespace.
        namespace: NamespaceId,
        /// The stored object.
        source: *const u8,
        /// Its bytes.
        len: u64,
    },
    /// Store block `key` as the header at `header` (its
    /// `STORED_HEADER_BYTES`, naming the object as it will be stored) and
    /// the payload at `payload` (`payload_len` bytes): a block whose slot
    /// keeps its own header for its readers.
    PutWithHeader {
        /// The block.
        key: BlockKey,
        /// Its namespace.
        namespace: NamespaceId,
        /// The stored header.
        header: *const u8,
        /// The payload.
        payload: *const u8,
        /// Its bytes.
        payload_len: u64,
        /// The tenant's data key to seal the payload with on its way out
        /// (encryption at rest; the object stored is then sealed, its CRCs
        /// over the ciphertext), or null to store it in the clear.
        seal_with: *const crate::auth::at_rest::DataKey,
    },
    /// Read block `key` into `target` (room for `capacity` bytes), checked.
    Get {
        /// The block.
        key: BlockKey,
        /// Its namespace.
        namespace: NamespaceId,
        /// Where it goes.
        target: *mut u8,
        /// Room there.
        capacity: u64,
    },
    /// Remove block `key`.
    Delete {
        /// The block.
        key: BlockKey,
        /// Its namespace.
        namespace: NamespaceId,
    },
    /// Remove the `count` blocks at `blocks` in one batch (S3's
    /// multi-object delete: up to 1,000 a call).
    DeleteMany {
        /// The blocks, with their namespaces.
        blocks: *const (NamespaceId, BlockKey),
        /// How many.
        count: usize,
    },
}

// SAFETY: the pointers name memory the caller keeps valid and unchanged
// (or written by this request only) until the request's completion, the
// contract of `L3Client::submit`; the worker thread is the only one that
// touches it meanwhile.
unsafe impl Send for L3Request {}

/// The end of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L3Completion {
    /// The caller's id for the request.
    pub id: u64,
    /// Bytes moved (the object's length), or why not.
    pub result: Result<u64, L3Error>,
}

/// How the client runs.
#[derive(Clone, Copy, Debug)]
pub struct L3Config {
    /// Worker threads (requests in flight at once), 1 to 64.
    pub workers: usize,
    /// Requests waiting at most (the queue is bounded: a full one hands
    /// the request back).
    pub queue_depth: usize,
    /// Tries of a call that fails transiently, at least 1.
    pub attempts: u32,
    /// The first retry's wait; each next one doubles it.
    pub backoff: Duration,
}

impl Default for L3Config {
    fn default() -> Self {
        Self { workers: 4, queue_depth: 256, attempts: 4, backoff: Duration::from_millis(20) }
    }
}

/// The client the poller drives (see the module docs).
#[derive(Debug)]
pub struct L3Client {
    runs: Runs,
    prefix: String,
    in_flight: usize,
}

/// Where a client's requests run.
#[derive(Debug)]
enum Runs {
    /// On worker threads of their own.
    Workers {
        requests: Option<SyncSender<(u64, L3Request)>>,
        completions: Receiver<L3Completion>,
        workers: Vec<JoinHandle<()>>,
        /// Per request id below the queue's depth: [`QUEUED`],
        /// [`STARTED`], [`READING`], [`CANCELLED`] or [`STOPPING`] — who
        /// came first, the worker or a cancel.
        claims: std::sync::Arc<Vec<AtomicU8>>,
    },
    /// On the caller's thread, inside [`L3Client::poll`].
    Inline(Box<Inline>),
}

/// A client whose requests run inside [`L3Client::poll`], on the caller's
/// thread: the deterministic simulator's. Its PRNG picks how many of the
/// waiting requests run at each poll, and which, so requests overtake one
/// another and linger across passes as they do over workers.
struct Inline {
    store: Box<dyn ObjectStore>,
    config: L3Config,
    waiting: Vec<(u64, L3Request)>,
    /// Requests cancelled while they waited: they end [`L3Error::Cancelled`].
    cancelled: Vec<u64>,
    rng: crate::rng::SimRng,
}

impl core::fmt::Debug for Inline {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Inline").field("waiting", &self.waiting.len()).finish_non_exhaustive()
    }
}

/// A request waits in the queue.
const QUEUED: u8 = 0;
/// A worker took it (a write: it runs to its end).
const STARTED: u8 = 1;
/// Cancelled before a worker took it: it ends [`L3Error::Cancelled`].
const CANCELLED: u8 = 2;
/// A worker took it, a read: a cancel may still stop it.
const READING: u8 = 3;
/// A read cancelled under way: it stops at its next step (before another
/// try, before its bytes are copied) and ends [`L3Error::Cancelled`].
const STOPPING: u8 = 4;

/// The claim word of request `id` (none past the queue's depth).
fn claim(claims: &[AtomicU8], id: u64) -> Option<&AtomicU8> {
    usize::try_from(id).ok().and_then(|i| claims.get(i))
}

impl L3Client {
    /// Starts `config.workers` threads, each with a store from
    /// `make_store`, naming objects under `prefix`.
    pub fn start(
        config: L3Config,
        prefix: &str,
        make_store: impl Fn() -> Result<Box<dyn ObjectStore>, StoreError>,
    ) -> Result<Self, StoreError> {
        Self::start_notifying(config, prefix, make_store, None)
    }

    /// [`L3Client::start`], with `notify` called after every completion is
    /// handed back (a poller parked on an eventfd is woken by it).
    pub fn start_notifying(
        config: L3Config,
        prefix: &str,
        make_store: impl Fn() -> Result<Box<dyn ObjectStore>, StoreError>,
        notify: Option<std::sync::Arc<dyn Fn() + Send + Sync>>,
    ) -> Result<Self, StoreError> {
        if !(1..=64).contains(&config.workers) || config.queue_depth == 0 || config.attempts == 0 {
            return Err(StoreError::Permanent("L3 config: 1 to 64 workers, a queue and at least one try".into()));
        }
        let (requests, requests_rx) = sync_channel::<(u64, L3Request)>(config.queue_depth);
        // Room for every request that can be in flight: a worker never
        // waits to hand a completion back.
        let (completions_tx, completions) = sync_channel(config.queue_depth + config.workers);
        let shared = std::sync::Arc::new(std::sync::Mutex::new(requests_rx));
        let claims: std::sync::Arc<Vec<AtomicU8>> =
            std::sync::Arc::new((0..config.queue_depth).map(|_| AtomicU8::new(QUEUED)).collect());
        let mut workers = Vec::with_capacity(config.workers);
        for n in 0..config.workers {
            let mut store = make_store()?;
            let (queue, done) = (std::sync::Arc::clone(&shared), completions_tx.clone());
            let claims = std::sync::Arc::clone(&claims);
            let prefix = prefix.to_owned();
            let notify = notify.clone();
            let worker = std::thread::Builder::new()
                .name(format!("lake-l3-{n}"))
                .spawn(move || {
                    loop {
                        // One worker takes the next request; the others wait.
                        let next = queue.lock().map_err(|_| ()).and_then(|rx| rx.recv().map_err(|_| ()));
                        let Ok((id, request)) = next else { return };
                        let started = if matches!(request, L3Request::Get { .. }) { READING } else { STARTED };
                        let claimed = claim(&claims, id);
                        let cancelled = claimed.is_some_and(|c| {
                            c.compare_exchange(QUEUED, started, Ordering::AcqRel, Ordering::Acquire) == Err(CANCELLED)
                        });
                        let result = if cancelled {
                            Err(L3Error::Cancelled)
                        } else {
                            run(store.as_mut(), &prefix, &request, &config, claimed)
                        };
                        if done.send(L3Completion { id, result }).is_err() {
                            return;
                        }
                        if let Some(notify) = &notify {
                            notify();
                        }
                    }
                })
                .map_err(|e| StoreError::Permanent(format!("starting an L3 worker: {e}")))?;
            workers.push(worker);
        }
        let runs = Runs::Workers { requests: Some(requests), completions, workers, claims };
        Ok(Self { runs, prefix: prefix.to_owned(), in_flight: 0 })
    }

    /// A client over `store` whose requests run inside [`L3Client::poll`],
    /// on the caller's thread, chosen by a PRNG seeded with `seed` (see
    /// [`Inline`]): the simulator's. Transient failures are tried again
    /// `config.attempts` times, at once.
    pub(crate) fn inline(
        config: L3Config,
        prefix: &str,
        store: Box<dyn ObjectStore>,
        seed: u64,
    ) -> Result<Self, StoreError> {
        if config.queue_depth == 0 || config.attempts == 0 {
            return Err(StoreError::Permanent("L3 config: a queue and at least one try".into()));
        }
        let config = L3Config { backoff: Duration::ZERO, ..config };
        let inline = Inline {
            store,
            config,
            waiting: Vec::with_capacity(config.queue_depth),
            cancelled: Vec::new(),
            rng: crate::rng::SimRng::new(seed),
        };
        Ok(Self { runs: Runs::Inline(Box::new(inline)), prefix: prefix.to_owned(), in_flight: 0 })
    }

    /// Cancels request `id`: one no worker has taken yet completes
    /// [`L3Error::Cancelled`] without the store being asked; a read under
    /// way stops at its next step — before another try, before its bytes
    /// are copied — and completes the same, its memory untouched (the
    /// object's transfer already under way finishes: at most one try's
    /// worth more). Returns whether it will (false: a write under way runs
    /// on, or it ran, and completes as it would have). Only ids below the
    /// queue's depth can be cancelled.
    pub fn cancel(&mut self, id: u64) -> bool {
        match &mut self.runs {
            Runs::Workers { claims, .. } => claim(claims, id).is_some_and(|c| {
                c.compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire).is_ok()
                    || c.compare_exchange(READING, STOPPING, Ordering::AcqRel, Ordering::Acquire).is_ok()
            }),
            Runs::Inline(inline) => {
                let Some(at) = inline.waiting.iter().position(|(waiting, _)| *waiting == id) else { return false };
                inline.waiting.swap_remove(at);
                inline.cancelled.push(id);
                true
            }
        }
    }

    /// Queues `request` as `id`; a full queue hands it back.
    ///
    /// # Safety
    ///
    /// The memory the request names is valid for its length and, for a
    /// put, unchanged — for a get, not read or written by anyone else —
    /// until its completion has been returned by [`L3Client::poll`].
    pub unsafe fn submit(&mut self, id: u64, request: L3Request) -> Result<(), (u64, L3Request)> {
        let (requests, claims) = match &mut self.runs {
            Runs::Workers { requests: Some(requests), claims, .. } => (requests, claims),
            Runs::Workers { requests: None, .. } => return Err((id, request)),
            Runs::Inline(inline) => {
                if inline.waiting.len() + inline.cancelled.len() >= inline.config.queue_depth {
                    return Err((id, request));
                }
                inline.waiting.push((id, request));
                self.in_flight += 1;
                return Ok(());
            }
        };
        if let Some(claim) = claim(claims, id) {
            // The id's previous request has completed (ids are reused
            // only then): this one starts queued.
            claim.store(QUEUED, Ordering::Release);
        }
        match requests.try_send((id, request)) {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(TrySendError::Full(back) | TrySendError::Disconnected(back)) => Err(back),
        }
    }

    /// Moves up to `max` completions into `out`, without waiting; returns
    /// how many.
    pub fn poll(&mut self, out: &mut Vec<L3Completion>, max: usize) -> usize {
        let completions = match &mut self.runs {
            Runs::Workers { completions, .. } => completions,
            Runs::Inline(inline) => {
                let taken = inline.run_some(&self.prefix, out, max);
                self.in_flight -= taken;
                return taken;
            }
        };
        let mut taken = 0;
        while taken < max {
            match completions.try_recv() {
                Ok(completion) => {
                    out.push(completion);
                    taken += 1;
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        self.in_flight -= taken;
        taken
    }

    /// Requests submitted and not yet returned by [`L3Client::poll`].
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The name prefix of this client's objects.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl Drop for L3Client {
    fn drop(&mut self) {
        if let Runs::Workers { requests, workers, .. } = &mut self.runs {
            // Closing the queue ends every worker once its request is done.
            *requests = None;
            for worker in workers.drain(..) {
                let _ = worker.join();
            }
        }
    }
}

impl Inline {
    /// Ends what was cancelled, then runs a share of the waiting requests
    /// the PRNG picks (none, some or all), in the order it picks; at most
    /// `max` completions in all, into `out`. Returns how many.
    fn run_some(&mut self, prefix: &str, out: &mut Vec<L3Completion>, max: usize) -> usize {
        let mut taken = 0;
        while taken < max
            && let Some(id) = self.cancelled.pop()
        {
            out.push(L3Completion { id, result: Err(L3Error::Cancelled) });
            taken += 1;
        }
        let runs = self.rng.below(self.waiting.len() as u64 + 1);
        for _ in 0..runs {
            if taken >= max || self.waiting.is_empty() {
                break;
            }
            let at = usize::try_from(self.rng.below(self.waiting.len() as u64)).unwrap_or(0);
            let (id, request) = self.waiting.swap_remove(at);
            let result = run(self.store.as_mut(), prefix, &request, &self.config, None);
            out.push(L3Completion { id, result });
            taken += 1;
        }
        taken
    }
}

/// Runs one request on a worker thread, retrying transient failures.
/// A read cancelled under way (`claim`: its claim word) stops.
fn run(
    store: &mut dyn ObjectStore,
    prefix: &str,
    request: &L3Request,
    config: &L3Config,
    claim: Option<&AtomicU8>,
) -> Result<u64, L3Error> {
    let mut wait = config.backoff;
    let mut attempt = 1;
    let stopping = || claim.is_some_and(|c| c.load(Ordering::Acquire) == STOPPING);
    // A read about to copy its bytes: no cancel can stop it from here on
    // (false: one already did).
    let land = || {
        claim.is_none_or(|c| c.compare_exchange(READING, STARTED, Ordering::AcqRel, Ordering::Acquire) != Err(STOPPING))
    };
    loop {
        if stopping() {
            return Err(L3Error::Cancelled);
        }
        match once(store, prefix, request, &land) {
            Err(L3Error::Store(StoreError::Transient(_))) if attempt < config.attempts => {
                std::thread::sleep(wait);
                wait = wait.saturating_mul(2);
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn once(
    store: &mut dyn ObjectStore,
    prefix: &str,
    request: &L3Request,
    land: &dyn Fn() -> bool,
) -> Result<u64, L3Error> {
    match *request {
        L3Request::Put { key, namespace, source, len } => {
            let len_usize = usize::try_from(len).map_err(|_| L3Error::TooLarge(len))?;
            // SAFETY: `len` valid, unchanged bytes until this request
            // completes (the contract of `L3Client::submit`).
            let bytes = unsafe { core::slice::from_raw_parts(source, len_usize) };
            // What goes to the source of truth is checked first: a block
            // that does not check here would never read back.
            verify(bytes, namespace, &key)?;
            store.put(&object_name(prefix, namespace, &key), bytes).map_err(L3Error::Store)?;
            Ok(len)
        }
        L3Request::PutWithHeader { key, namespace, header, payload, payload_len, seal_with } => {
            let len = usize::try_from(payload_len).map_err(|_| L3Error::TooLarge(payload_len))?;
            let mut bytes = Vec::with_capacity(STORED_HEADER_BYTES + len);
            // SAFETY: a header's bytes, valid and unchanged until this
            // request completes (the contract of `L3Client::submit`).
            let header = unsafe { core::slice::from_raw_parts(header, STORED_HEADER_BYTES) };
            // SAFETY: `payload_len` payload bytes, likewise.
            let payload = unsafe { core::slice::from_raw_parts(payload, len) };
            bytes.extend_from_slice(header);
            bytes.extend_from_slice(payload);
            verify(&bytes, namespace, &key)?;
            if !seal_with.is_null() {
                // SAFETY: the caller's key, held unchanged until this
                // request completes (the contract of `L3Client::submit`).
                let data_key = unsafe { &*seal_with };
                seal_object(data_key, &mut bytes)?;
                verify(&bytes, namespace, &key)?;
            }
            store.put(&object_name(prefix, namespace, &key), &bytes).map_err(L3Error::Store)?;
            Ok(bytes.len() as u64)
        }
        L3Request::Get { key, namespace, target, capacity } => {
            let bytes = store.get(&object_name(prefix, namespace, &key)).map_err(L3Error::Store)?;
            let bytes = bytes.ok_or(L3Error::NotFound)?;
            let len = bytes.len() as u64;
            if len > capacity {
                return Err(L3Error::TooLarge(len));
            }
            verify(&bytes, namespace, &key)?;
            if !land() {
                return Err(L3Error::Cancelled);
            }
            // SAFETY: room for `capacity` >= len bytes that only this
            // request writes until it completes (the contract of `submit`).
            unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), target, bytes.len()) };
            Ok(len)
        }
        L3Request::Delete { key, namespace } => {
            store.delete(&object_name(prefix, namespace, &key)).map_err(L3Error::Store)?;
            Ok(0)
        }
        L3Request::DeleteMany { blocks, count } => {
            // SAFETY: `count` pairs, valid and unchanged until this request
            // completes (the contract of `L3Client::submit`).
            let blocks = unsafe { core::slice::from_raw_parts(blocks, count) };
            let names: Vec<String> = blocks.iter().map(|(ns, key)| object_name(prefix, *ns, key)).collect();
            store.delete_many(&names).map_err(L3Error::Store)?;
            Ok(count as u64)
        }
    }
}

/// What a catalog scan met besides the objects it handed on.
#[derive(Debug, Default)]
pub struct Scan {
    /// Objects whose header does not decode or names another block
    /// (left in place, never served).
    pub damaged: Vec<String>,
    /// Objects past `limit`, not read.
    pub skipped: usize,
}

/// Reads the header of every object under `prefix` (at most `limit`) and
/// hands each one that checks and names its object to `found`, as it is
/// read (`false` from it stops the scan): the catalog a data plane starts
/// with, or — every process lost — the blocks a control plane rebuilds
/// its index from. The payloads are checked when read.
pub fn scan(
    store: &mut dyn ObjectStore,
    prefix: &str,
    limit: usize,
    found: &mut dyn FnMut(&ObjectMeta) -> bool,
) -> Result<Scan, StoreError> {
    let mut scan = Scan::default();
    let mut taken = 0;
    let names = store.list(&format!("{prefix}/"))?;
    for name in names {
        if taken >= limit {
            scan.skipped += 1;
            continue;
        }
        let Some(head) = store.get_head(&name, STORED_HEADER_BYTES)? else { continue };
        match decode_header(&head) {
            Ok(header) if object_name(prefix, header.meta().namespace, &header.meta().key) == name => {
                taken += 1;
                if !found(header.meta()) {
                    break;
                }
            }
            _ => scan.damaged.push(name),
        }
    }
    Ok(scan)
}

#[cfg(test)]
mod tests;
