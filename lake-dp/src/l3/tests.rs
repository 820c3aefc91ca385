//! The client over the directory store (the S3 service is exercised in
//! `tests/l3_s3.rs`, against a real server).

use super::dir::DirStore;
use super::*;
use crate::model::replica::{ObjectKind, RegionId};
use crate::stored::{ObjectMeta, encode_object, object_bytes};

fn object(key: &BlockKey, namespace: NamespaceId, payload_len: usize) -> Vec<u8> {
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: *key,
        parent_key: BlockKey::NONE,
        block_index: 0,
        namespace,
        layout_fingerprint: 9,
        region: RegionId(2),
        region_epoch: 1,
        slot: 3,
        generation: 1,
        committed_unix_ns: 1,
        payload_len: payload_len as u64,
        segment_bytes: 16 * 1024,
    };
    let payload: Vec<u8> = (0..payload_len).map(|i| (i % 251) as u8 ^ key.0[0]).collect();
    let mut out = vec![0u8; usize::try_from(object_bytes(payload_len as u64)).unwrap()];
    let len = encode_object(&meta, &payload, &mut out).unwrap();
    out.truncate(len);
    out
}

fn wait(client: &mut L3Client, want: usize) -> Vec<L3Completion> {
    let mut done = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while done.len() < want {
        assert!(std::time::Instant::now() < deadline, "{} of {want} L3 completions", done.len());
        if client.poll(&mut done, 64) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    done
}

#[test]
fn blocks_go_to_the_directory_and_come_back_checked() {
    let root = std::env::temp_dir().join(format!("lake-l3-dir-{}", std::process::id()));
    let store_root = root.clone();
    let mut client = L3Client::start(L3Config { workers: 3, ..L3Config::default() }, "pool-a", move || {
        Ok(Box::new(DirStore::open(&store_root)?) as Box<dyn ObjectStore>)
    })
    .unwrap();
    let namespace = NamespaceId(77);
    let keys: Vec<BlockKey> = (0..24u8).map(|i| BlockKey([i + 1; 16])).collect();
    let objects: Vec<Vec<u8>> = keys.iter().enumerate().map(|(i, k)| object(k, namespace, 1000 + 997 * i)).collect();
    for (i, (key, bytes)) in keys.iter().zip(&objects).enumerate() {
        let request = L3Request::Put { key: *key, namespace, source: bytes.as_ptr(), len: bytes.len() as u64 };
        // SAFETY: `objects` outlives the completions (waited for below).
        unsafe { client.submit(i as u64, request) }.unwrap();
    }
    let done = wait(&mut client, keys.len());
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(client.in_flight(), 0);

    // Read back into other memory, every object checked.
    let mut back: Vec<Vec<u8>> = objects.iter().map(|o| vec![0u8; o.len() + 4096]).collect();
    for (i, (key, target)) in keys.iter().zip(back.iter_mut()).enumerate() {
        let request =
            L3Request::Get { key: *key, namespace, target: target.as_mut_ptr(), capacity: target.len() as u64 };
        // SAFETY: `back` outlives the completions and nothing else touches it.
        unsafe { client.submit(100 + i as u64, request) }.unwrap();
    }
    for completion in wait(&mut client, keys.len()) {
        let i = (completion.id - 100) as usize;
        assert_eq!(completion.result, Ok(objects[i].len() as u64));
        assert!(back[i][..objects[i].len()] == objects[i][..], "object {i} read back differs");
    }

    // A changed byte on disk is caught, not handed on; a missing object and
    // a block of another namespace are told apart; a put that does not
    // check is refused before it reaches the source of truth.
    let name = object_name("pool-a", namespace, &keys[5]);
    let mut file = std::fs::read(root.join(&name)).unwrap();
    file[4096 + 10] ^= 1;
    std::fs::write(root.join(&name), &file).unwrap();
    let mut target = vec![0u8; objects[5].len()];
    let requests = [
        L3Request::Get { key: keys[5], namespace, target: target.as_mut_ptr(), capacity: target.len() as u64 },
        L3Request::Get {
            key: BlockKey([200; 16]),
            namespace,
            target: target.as_mut_ptr(),
            capacity: target.len() as u64,
        },
        L3Request::Get {
            key: keys[6],
            namespace: NamespaceId(78),
            target: target.as_mut_ptr(),
            capacity: target.len() as u64,
        },
    ];
    for (i, request) in requests.into_iter().enumerate() {
        // SAFETY: `target` outlives the completion; one request at a time.
        unsafe { client.submit(200 + i as u64, request) }.unwrap();
        let done = wait(&mut client, 1);
        match (i, &done[0].result) {
            (0, Err(L3Error::Corrupt(_))) | (1 | 2, Err(L3Error::NotFound)) => {}
            other => panic!("request {i}: {other:?}"),
        }
    }
    let mut lying = objects[7].clone();
    lying[5000] ^= 0x40;
    let request = L3Request::Put { key: keys[7], namespace, source: lying.as_ptr(), len: lying.len() as u64 };
    // SAFETY: `lying` outlives the completion.
    unsafe { client.submit(300, request) }.unwrap();
    assert!(matches!(wait(&mut client, 1)[0].result, Err(L3Error::Corrupt(_))));
    let mut small = vec![0u8; 100];
    let request = L3Request::Get { key: keys[8], namespace, target: small.as_mut_ptr(), capacity: 100 };
    // SAFETY: `small` outlives the completion.
    unsafe { client.submit(301, request) }.unwrap();
    assert!(matches!(wait(&mut client, 1)[0].result, Err(L3Error::TooLarge(_))));

    // Delete, and list what is left.
    let request = L3Request::Delete { key: keys[0], namespace };
    // SAFETY: no memory.
    unsafe { client.submit(400, request) }.unwrap();
    assert_eq!(wait(&mut client, 1)[0].result, Ok(0));
    let mut store = DirStore::open(&root).unwrap();
    let listed = store.list("pool-a/").unwrap();
    assert_eq!(listed.len(), keys.len() - 1);
    assert!(!listed.contains(&object_name("pool-a", namespace, &keys[0])));
    assert!(store.put("../outside", b"x").is_err(), "a name that leaves the store is refused");
    drop(client);
    let _ = std::fs::remove_dir_all(&root);
}

/// A store that fails transiently a number of times before it works.
struct Flaky {
    failures_left: u32,
    inner: DirStore,
}

impl ObjectStore for Flaky {
    fn put(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        if self.failures_left > 0 {
            self.failures_left -= 1;
            return Err(StoreError::Transient("connection reset (injected)".into()));
        }
        self.inner.put(name, bytes)
    }
    fn get(&mut self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.inner.get(name)
    }
    fn delete(&mut self, name: &str) -> Result<(), StoreError> {
        self.inner.delete(name)
    }
    fn list(&mut self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.inner.list(prefix)
    }
}

#[test]
fn transient_failures_are_retried_a_bounded_number_of_times() {
    let root = std::env::temp_dir().join(format!("lake-l3-flaky-{}", std::process::id()));
    let namespace = NamespaceId(5);
    let key = BlockKey([3; 16]);
    let bytes = object(&key, namespace, 5000);
    for (failures, attempts, ok) in [(2, 4, true), (4, 4, false)] {
        let store_root = root.clone();
        let config = L3Config { workers: 1, attempts, backoff: Duration::from_millis(1), ..L3Config::default() };
        let mut client = L3Client::start(config, "p", move || {
            Ok(Box::new(Flaky { failures_left: failures, inner: DirStore::open(&store_root)? }) as Box<dyn ObjectStore>)
        })
        .unwrap();
        let request = L3Request::Put { key, namespace, source: bytes.as_ptr(), len: bytes.len() as u64 };
        // SAFETY: `bytes` outlives the completion.
        unsafe { client.submit(1, request) }.unwrap();
        let result = wait(&mut client, 1).remove(0).result;
        assert_eq!(result.is_ok(), ok, "{failures} failures, {attempts} tries: {result:?}");
        if !ok {
            assert!(matches!(result, Err(L3Error::Store(StoreError::Transient(_)))));
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_full_queue_hands_the_request_back() {
    let root = std::env::temp_dir().join(format!("lake-l3-full-{}", std::process::id()));
    let store_root = root.clone();
    let config = L3Config { workers: 1, queue_depth: 2, ..L3Config::default() };
    let mut client =
        L3Client::start(config, "p", move || Ok(Box::new(DirStore::open(&store_root)?) as Box<dyn ObjectStore>))
            .unwrap();
    let namespace = NamespaceId(1);
    let objects: Vec<Vec<u8>> = (0..64u8).map(|i| object(&BlockKey([i + 1; 16]), namespace, 200_000)).collect();
    let mut refused = 0;
    for (i, bytes) in objects.iter().enumerate() {
        let key = BlockKey([i as u8 + 1; 16]);
        let request = L3Request::Put { key, namespace, source: bytes.as_ptr(), len: bytes.len() as u64 };
        // SAFETY: `objects` outlives the completions.
        if unsafe { client.submit(i as u64, request) }.is_err() {
            refused += 1;
        }
    }
    assert!(refused > 0, "a queue of 2 took 64 requests at once");
    let accepted = objects.len() - refused;
    assert!(wait(&mut client, accepted).iter().all(|c| c.result.is_ok()));
    assert!(L3Client::start(L3Config { workers: 0, ..L3Config::default() }, "p", || unreachable!()).is_err());
    drop(client);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_header_given_apart_is_stored_with_its_payload_and_a_scan_reads_the_headers_back() {
    let root = std::env::temp_dir().join(format!("lake-l3-scan-{}", std::process::id()));
    let store_root = root.clone();
    let woken = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = std::sync::Arc::clone(&woken);
    let notify: std::sync::Arc<dyn Fn() + Send + Sync> =
        std::sync::Arc::new(move || _ = count.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let mut client = L3Client::start_notifying(
        L3Config::default(),
        "scan",
        move || Ok(Box::new(DirStore::open(&store_root)?) as Box<dyn ObjectStore>),
        Some(notify),
    )
    .unwrap();
    let namespace = NamespaceId(5);
    let keys: Vec<BlockKey> = (0..6u8).map(|i| BlockKey([0x40 + i; 16])).collect();
    let objects: Vec<Vec<u8>> = keys.iter().map(|k| object(k, namespace, 20_000)).collect();
    for (i, (key, bytes)) in keys.iter().zip(&objects).enumerate() {
        // The header and the payload from two places (a slot keeps its
        // own header for its readers).
        let (header, payload) = bytes.split_at(STORED_HEADER_BYTES);
        let request = L3Request::PutWithHeader {
            key: *key,
            namespace,
            header: header.as_ptr(),
            payload: payload.as_ptr(),
            payload_len: payload.len() as u64,
            seal_with: core::ptr::null(),
        };
        // SAFETY: `objects` outlives the completions (waited for below).
        unsafe { client.submit(i as u64, request) }.unwrap();
    }
    let done = wait(&mut client, keys.len());
    assert!(done.iter().all(|c| c.result == Ok(objects[0].len() as u64)), "{done:?}");
    assert_eq!(woken.load(std::sync::atomic::Ordering::Relaxed), 6, "notified after each completion");
    // A header given apart must still name the block: one for another key
    // is refused before it goes.
    let wrong = L3Request::PutWithHeader {
        key: keys[0],
        namespace,
        header: objects[1].as_ptr(),
        payload: objects[0][STORED_HEADER_BYTES..].as_ptr(),
        payload_len: (objects[0].len() - STORED_HEADER_BYTES) as u64,
        seal_with: core::ptr::null(),
    };
    // SAFETY: as above.
    unsafe { client.submit(9, wrong) }.unwrap();
    assert!(matches!(wait(&mut client, 1)[0].result, Err(L3Error::Corrupt(_))));
    drop(client);

    // One object's header damaged, one foreign file under the prefix.
    let damaged = root.join(object_name("scan", namespace, &keys[2]));
    let mut bytes = std::fs::read(&damaged).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&damaged, &bytes).unwrap();
    std::fs::write(root.join("scan/0000000000000005/not-a-block"), b"hello").unwrap();
    let mut store = DirStore::open(&root).unwrap();
    let scanned = |store: &mut DirStore, limit| {
        let mut keys = Vec::new();
        let scan = scan(store, "scan", limit, &mut |meta| {
            keys.push(meta.key);
            true
        })
        .unwrap();
        (keys, scan)
    };
    let (mut found, scan) = scanned(&mut store, 100);
    found.sort_unstable();
    assert_eq!(found, [keys[0], keys[1], keys[3], keys[4], keys[5]]);
    assert_eq!(scan.damaged.len(), 2, "{:?}", scan.damaged);
    // A limit stops the scan: the rest are counted, not read.
    let (limited, scan) = scanned(&mut store, 2);
    assert_eq!((limited.len(), scan.skipped), (2, 5));
    // One batched delete takes three objects (one was gone already).
    let store_root = root.clone();
    let mut client = L3Client::start(L3Config::default(), "scan", move || {
        Ok(Box::new(DirStore::open(&store_root)?) as Box<dyn ObjectStore>)
    })
    .unwrap();
    let _ = std::fs::remove_file(root.join(object_name("scan", namespace, &keys[1])));
    let batch = [(namespace, keys[0]), (namespace, keys[1]), (namespace, keys[4])];
    // SAFETY: `batch` outlives the completion (waited for below).
    unsafe { client.submit(1, L3Request::DeleteMany { blocks: batch.as_ptr(), count: batch.len() }) }.unwrap();
    assert_eq!(wait(&mut client, 1)[0].result, Ok(3));
    let (left, _) = scanned(&mut store, 100);
    assert!(left.len() == 2 && left.contains(&keys[3]) && left.contains(&keys[5]), "{left:?}");
    let _ = std::fs::remove_dir_all(&root);
}

/// A store whose gets wait until the test opens the gate, counting them.
struct Gated {
    inner: DirStore,
    gets: std::sync::Arc<std::sync::atomic::AtomicU32>,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl ObjectStore for Gated {
    fn put(&mut self, name: &str, bytes: &[u8]) -> Result<(), StoreError> {
        while !self.open.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.inner.put(name, bytes)
    }
    fn get(&mut self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.gets.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        while !self.open.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.inner.get(name)
    }
    fn delete(&mut self, name: &str) -> Result<(), StoreError> {
        self.inner.delete(name)
    }
    fn list(&mut self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.inner.list(prefix)
    }
}

#[test]
fn a_read_cancelled_queued_never_reaches_the_store_and_one_under_way_never_lands() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let root = std::env::temp_dir().join(format!("lake-l3-cancel-{}", std::process::id()));
    let (gets, open) = (std::sync::Arc::new(AtomicU32::new(0)), std::sync::Arc::new(AtomicBool::new(true)));
    let (store_root, store_gets, store_open) = (root.clone(), gets.clone(), open.clone());
    let config = L3Config { workers: 1, ..L3Config::default() };
    let mut client = L3Client::start(config, "c", move || {
        let inner = DirStore::open(&store_root)?;
        Ok(Box::new(Gated { inner, gets: store_gets.clone(), open: store_open.clone() }) as Box<dyn ObjectStore>)
    })
    .unwrap();
    let namespace = NamespaceId(9);
    let keys = [BlockKey([0x71; 16]), BlockKey([0x72; 16])];
    let objects: Vec<Vec<u8>> = keys.iter().map(|k| object(k, namespace, 30_000)).collect();
    for (i, (key, bytes)) in keys.iter().zip(&objects).enumerate() {
        let request = L3Request::Put { key: *key, namespace, source: bytes.as_ptr(), len: bytes.len() as u64 };
        // SAFETY: `objects` outlives the completions (waited for below).
        unsafe { client.submit(i as u64, request) }.unwrap();
    }
    assert!(wait(&mut client, 2).iter().all(|c| c.result.is_ok()));

    // The one worker holds the first read at the gate; the second waits
    // in the queue.
    open.store(false, Ordering::SeqCst);
    let mut targets = vec![vec![0u8; 64 * 1024]; 2];
    for (i, key) in keys.iter().enumerate() {
        let request =
            L3Request::Get { key: *key, namespace, target: targets[i].as_mut_ptr(), capacity: targets[i].len() as u64 };
        // SAFETY: `targets` outlives the completions and nobody else
        // touches them meanwhile.
        unsafe { client.submit(i as u64, request) }.unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while gets.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "the worker never took the first read");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(client.cancel(0), "the first read is under way: it stops before its bytes land");
    assert!(client.cancel(1), "the second is still queued");
    assert!(!client.cancel(1) && !client.cancel(0), "once");
    open.store(true, Ordering::SeqCst);
    let mut done = wait(&mut client, 2);
    done.sort_unstable_by_key(|c| c.id);
    assert_eq!(done[0].result, Err(L3Error::Cancelled));
    assert_eq!(done[1].result, Err(L3Error::Cancelled));
    assert_eq!(gets.load(Ordering::SeqCst), 1, "the store was asked once: the queued read never");
    assert!(targets.iter().all(|t| t.iter().all(|&b| b == 0)), "neither read's memory was touched");

    // Reads that land, and a write under way, are not cancelled.
    let request =
        L3Request::Get { key: keys[0], namespace, target: targets[0].as_mut_ptr(), capacity: targets[0].len() as u64 };
    // SAFETY: as above.
    unsafe { client.submit(0, request) }.unwrap();
    assert_eq!(wait(&mut client, 1)[0].result, Ok(objects[0].len() as u64));
    assert!(!client.cancel(0), "it landed");
    assert_eq!(&targets[0][..objects[0].len()], &objects[0][..]);
    open.store(false, Ordering::SeqCst);
    let put = L3Request::Put { key: keys[1], namespace, source: objects[1].as_ptr(), len: objects[1].len() as u64 };
    // SAFETY: `objects` outlives the completion.
    unsafe { client.submit(1, put) }.unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(!client.cancel(1), "a write under way runs on");
    open.store(true, Ordering::SeqCst);
    assert_eq!(wait(&mut client, 1)[0].result, Ok(objects[1].len() as u64));
    drop(client);
    let _ = std::fs::remove_dir_all(&root);
}
