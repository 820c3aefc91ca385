//! The L2 tier over real files and real io_uring: format, open (epoch
//! bumped and persisted), the poller writing and reading through registered
//! files and fixed buffers in an L1 arena, clean and unclean shutdowns,
//! re-adoption from headers with suspect objects scrubbed, and bad files
//! refused with named errors.

#![allow(clippy::cast_possible_truncation)] // small test numbers

use std::path::PathBuf;
use std::sync::Arc;

use lake_dp::arena::{Arena, ArenaConfig, SlotTable};
use lake_dp::l2::{L2Config, L2Tier, format};
use lake_dp::op::{Command, Event, L2Slot, OpError, ReadBlock, Request, WriteBlock};
use lake_dp::poller::{Poller, PollerConfig};
use lake_dp::region::{SlotClass, SlotRegion};
use lake_dp::stored::ObjectMeta;
use lake_dp::uring::UringBackend;
use lake_dp::{BlockKey, Durability, NamespaceId, ObjectKind, Priority};

const SLOT_BYTES: u64 = 64 * 1024;
const SLOTS: u32 = 16;
const PAYLOAD: u64 = 50_000;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("lake-l2-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn config(&self, files: usize) -> L2Config {
        L2Config {
            paths: (0..files).map(|i| self.0.join(format!("l2-{i}.lake"))).collect(),
            slots_per_file: SLOTS,
            slot_bytes: SLOT_BYTES,
            region_first: 10,
        }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Node {
    poller: Poller<UringBackend>,
    table: SlotTable,
    region: Arc<SlotRegion>,
    _arena: Arena,
    shm: PathBuf,
    now: u64,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.shm);
    }
}

fn node(tier: &L2Tier, name: &str) -> Node {
    let shm = PathBuf::from(format!("/dev/shm/lake-l2-test-{}-{name}", std::process::id()));
    let classes = [SlotClass { slot_bytes: SLOT_BYTES, slots: 8 }];
    let (arena, table) = Arena::create(&ArenaConfig { lock: false, ..ArenaConfig::shm(&shm, &classes) }).unwrap();
    let region = arena.region().unwrap();
    let mut backend = UringBackend::new(tier.backend_files().unwrap(), 16).unwrap();
    // SAFETY: the region (and the arena behind it) outlives the backend:
    // the Node drops the poller first.
    unsafe { backend.register_region(&region) }.unwrap();
    assert_eq!(backend.fixed_buffers(), 1);
    let config = PollerConfig {
        epoch: tier.epoch(),
        ops_max: 8,
        batch_max: 8,
        io_retries_max: 2,
        flush_delay_ns: 0,
        flush_batch: 1,
        l2: tier.geometry(),
        background_in_flight_max: 0,
    };
    let mut poller = Poller::new(config, backend, region.clone()).unwrap();
    poller.seal();
    Node { poller, table, region, _arena: arena, shm, now: 0 }
}

fn key(file: u16, slot: u32, epoch: u64) -> BlockKey {
    let mut key = [0u8; 16];
    key[..2].copy_from_slice(&file.to_le_bytes());
    key[2..6].copy_from_slice(&slot.to_le_bytes());
    key[6..14].copy_from_slice(&epoch.to_le_bytes());
    BlockKey(key)
}

fn fill(file: u16, slot: u32, epoch: u64) -> u8 {
    (u64::from(file) * 31 + u64::from(slot) * 7 + epoch) as u8 | 1
}

fn run(node: &mut Node, want: usize) -> Vec<Event> {
    let mut events = Vec::new();
    let mut buf = [Event::placeholder(); 8];
    for _ in 0..1_000_000 {
        node.now += 1_000;
        node.poller.poll(node.now, 8);
        let n = node.poller.reap(&mut buf);
        events.extend_from_slice(&buf[..n]);
        if events.len() >= want {
            return events;
        }
    }
    panic!("only {} of {want} events", events.len());
}

fn write_block(node: &mut Node, tier: &L2Tier, file: u16, slot: u32, durability: Durability) {
    let grant = node.table.allocate(0).unwrap();
    let epoch = tier.epoch();
    // SAFETY: the table granted the slot; no I/O uses it yet.
    let bytes = unsafe { node.region.slot_mut(grant.slot) }.unwrap();
    bytes[4096..4096 + PAYLOAD as usize].fill(fill(file, slot, epoch));
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: key(file, slot, epoch),
        parent_key: BlockKey::NONE,
        block_index: slot,
        namespace: NamespaceId(5),
        layout_fingerprint: 9,
        region: tier.geometry().region(file),
        region_epoch: epoch,
        slot,
        generation: 1,
        committed_unix_ns: 0,
        payload_len: PAYLOAD,
        segment_bytes: 16 * 1024,
    };
    let write = WriteBlock { l1_slot: grant.slot, target: L2Slot { file, slot }, meta, durability, seal: None };
    let request = Request { command: Command::Write(write), priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
    node.poller.submit(request).unwrap();
    let events = run(node, 1);
    assert_eq!(events[0].outcome.map(|d| d.durability), Ok(durability));
    node.table.retire(grant.slot).unwrap();
    node.table.reclaim();
}

fn read_block(node: &mut Node, file: u16, slot: u32, epoch: u64) -> Result<(), OpError> {
    let grant = node.table.allocate(0).unwrap();
    let read = ReadBlock {
        source: L2Slot { file, slot },
        l1_slot: grant.slot,
        key: key(file, slot, epoch),
        generation: 1,
        payload_len: PAYLOAD,
    };
    let request = Request { command: Command::Read(read), priority: Priority::CriticalLoad, deadline_ns: 0, cookie: 0 };
    node.poller.submit(request).unwrap();
    let outcome = run(node, 1)[0].outcome;
    if outcome.is_ok() {
        // SAFETY: the read completed; the table still grants the slot.
        let bytes = unsafe { node.region.slot(grant.slot) }.unwrap();
        assert!(bytes[4096..4096 + PAYLOAD as usize].iter().all(|&b| b == fill(file, slot, epoch)));
    }
    node.table.retire(grant.slot).unwrap();
    node.table.reclaim();
    outcome.map(|_| ())
}

#[test]
fn write_shut_down_reopen_readopt() {
    let dir = TempDir::new("cycle");
    let config = dir.config(2);
    format(&config).unwrap();
    assert!(format(&config).unwrap_err().to_string().contains("creating"), "format never overwrites");

    let tier = L2Tier::open(&config).unwrap();
    assert_eq!(tier.epoch(), 1);
    assert!(L2Tier::open(&config).unwrap_err().to_string().contains("in use"));
    let mut node = node(&tier, "cycle-1");
    write_block(&mut node, &tier, 0, 3, Durability::Durable);
    write_block(&mut node, &tier, 1, 15, Durability::Acked);
    read_block(&mut node, 0, 3, 1).unwrap();
    read_block(&mut node, 1, 15, 1).unwrap();
    assert_eq!(read_block(&mut node, 1, 14, 1), Err(OpError::Corrupt(lake_dp::stored::StoredError::Empty)));
    let stats = node.poller.backend_mut().stats();
    assert_eq!((stats.fixed, stats.unfixed), (5, 0), "every slot transfer through a fixed buffer: {stats:?}");
    assert!(stats.fsyncs >= 1);
    drop(node);
    tier.shut_down_clean().unwrap();

    let tier = L2Tier::open(&config).unwrap();
    assert_eq!((tier.epoch(), tier.clean_epoch()), (2, 1));
    assert!(tier.previous_shutdown_clean());
    let found = tier.readopt(8).unwrap();
    let places: Vec<(u16, u32)> = found.adopted.iter().map(|a| (a.file, a.slot)).collect();
    assert_eq!(places, vec![(0, 3), (1, 15)]);
    assert_eq!(found.scrubbed, 0, "everything was written before a clean shutdown");
    assert_eq!(found.empty, u64::from(2 * SLOTS) - 2);
    assert!(found.damaged.is_empty() && found.torn.is_empty());
    assert_eq!(found.adopted[0].meta.key, key(0, 3, 1));
}

#[test]
fn objects_of_a_crashed_incarnation_are_scrubbed() {
    let dir = TempDir::new("crash");
    let config = dir.config(1);
    format(&config).unwrap();
    let tier = L2Tier::open(&config).unwrap();
    let mut node = node(&tier, "crash-1");
    for slot in [1, 2, 5] {
        write_block(&mut node, &tier, 0, slot, Durability::Acked);
    }
    drop(node);
    drop(tier); // no clean shutdown: a crash

    // Damage slot 2's payload and slot 5's header behind lake-dp's back.
    let path = &config.paths[0];
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0xee], 2 * SLOT_BYTES + 4096 + 1000).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0xee], 5 * SLOT_BYTES + 20).unwrap();
    file.sync_all().unwrap();

    let tier = L2Tier::open(&config).unwrap();
    assert_eq!((tier.epoch(), tier.clean_epoch()), (2, 0));
    assert!(!tier.previous_shutdown_clean());
    let found = tier.readopt(4).unwrap();
    assert_eq!(found.adopted.iter().map(|a| (a.slot, a.verified)).collect::<Vec<_>>(), vec![(1, true)]);
    assert_eq!(found.scrubbed, 2, "slots 1 and 2 were suspects; 5's header is damaged");
    assert_eq!(found.torn.iter().map(|t| t.1).collect::<Vec<_>>(), vec![2]);
    assert_eq!(found.damaged.iter().map(|d| d.1).collect::<Vec<_>>(), vec![5]);
}

#[test]
fn wrong_files_are_refused_by_name() {
    let dir = TempDir::new("wrong");
    let config = dir.config(2);
    format(&config).unwrap();
    let other = TempDir::new("wrong-other");
    let other_config = other.config(2);
    format(&other_config).unwrap();
    let check = |config: &L2Config, expect: &str| {
        let err = L2Tier::open(config).unwrap_err().to_string();
        assert!(err.contains(expect), "{expect}: got {err}");
    };
    check(&L2Config { slot_bytes: SLOT_BYTES * 2, ..config.clone() }, "bytes, the config implies");
    check(&L2Config { slots_per_file: SLOTS / 2, ..config.clone() }, "bytes, the config implies");
    check(&L2Config { region_first: 11, ..config.clone() }, "region");
    check(&L2Config { paths: vec![config.paths[1].clone(), config.paths[0].clone()], ..config.clone() }, "file_index");
    check(
        &L2Config { paths: vec![config.paths[0].clone(), other_config.paths[1].clone()], ..config.clone() },
        "another tier",
    );
    check(&L2Config { paths: vec![config.paths[0].clone()], ..config.clone() }, "formatted as one of 2 files");
    check(&L2Config { slot_bytes: 5000, ..config.clone() }, "slot_bytes");
    // Both superblock copies damaged.
    let file = std::fs::OpenOptions::new().write(true).open(&config.paths[1]).unwrap();
    let data = u64::from(SLOTS) * SLOT_BYTES;
    std::os::unix::fs::FileExt::write_all_at(&file, b"X", data).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, b"X", data + 4096).unwrap();
    check(&config, "bad magic");
    // One copy damaged: the other still opens the tier.
    std::os::unix::fs::FileExt::write_all_at(&file, b"L", data + 4096).unwrap();
    L2Tier::open(&config).unwrap();
}

#[test]
fn slots_are_rebuilt_from_readoption() {
    use lake_dp::l2::{L2SlotError, L2Slots};
    use lake_dp::op::L2Slot;

    let dir = TempDir::new("slots");
    let config = dir.config(2);
    format(&config).unwrap();
    let tier = L2Tier::open(&config).unwrap();
    let mut node = node(&tier, "slots-1");
    write_block(&mut node, &tier, 0, 0, Durability::Acked);
    write_block(&mut node, &tier, 1, 0, Durability::Acked);
    drop(node);
    drop(tier);
    let tier = L2Tier::open(&config).unwrap();
    let found = tier.readopt(8).unwrap();
    let mut slots = L2Slots::from_readoption(tier.geometry(), &found);
    assert_eq!(slots.bytes_in_use(), 2 * SLOT_BYTES);
    assert_eq!(slots.free_slots(), u64::from(2 * SLOTS) - 2);
    // Round robin over files, lowest free slot first, generations above
    // what the disk holds (the test wrote generation 1 everywhere).
    let a = slots.allocate().unwrap();
    let b = slots.allocate().unwrap();
    assert_eq!((a.slot, a.generation), (L2Slot { file: 0, slot: 1 }, 1));
    assert_eq!((b.slot, b.generation), (L2Slot { file: 1, slot: 1 }, 1));
    assert_eq!(slots.release(L2Slot { file: 0, slot: 0 }), Ok(()));
    assert_eq!(slots.release(L2Slot { file: 0, slot: 0 }), Err(L2SlotError::NotInUse));
    assert_eq!(slots.release(L2Slot { file: 2, slot: 0 }), Err(L2SlotError::OutOfRange));
    let mut granted = 0;
    while let Some(grant) = slots.allocate() {
        if grant.slot == (L2Slot { file: 0, slot: 0 }) {
            assert_eq!(grant.generation, 2, "a reused slot's generation moves on");
        }
        granted += 1;
    }
    assert_eq!(granted, 2 * SLOTS - 3);
    assert_eq!(slots.bytes_in_use(), u64::from(2 * SLOTS) * SLOT_BYTES);
}

#[test]
fn a_draining_file_gets_no_new_object_until_it_is_used_again() {
    use lake_dp::l2::{L2SlotError, L2Slots};

    let dir = TempDir::new("draining");
    let config = dir.config(2);
    format(&config).unwrap();
    let tier = L2Tier::open(&config).unwrap();
    let found = tier.readopt(8).unwrap();
    let mut slots = L2Slots::from_readoption(tier.geometry(), &found);
    assert_eq!(slots.set_draining(2, true), Err(L2SlotError::OutOfRange));
    slots.set_draining(0, true).unwrap();
    assert!(slots.is_draining(0) && !slots.is_draining(1));
    // Every grant is in file 1 while file 0 drains; a move off file 1
    // finds nowhere to go.
    for _ in 0..SLOTS {
        assert_eq!(slots.allocate().unwrap().slot.file, 1);
    }
    assert!(slots.allocate().is_none(), "file 0's free slots are not handed out");
    assert!(slots.allocate_avoiding(Some(1)).is_none());
    assert_eq!(slots.in_use_in(0), 0);
    assert_eq!(slots.in_use_in(1), u64::from(SLOTS));
    // A control plane linked anew holds no drain: file 0 is written again.
    slots.undrain_all();
    assert_eq!(slots.allocate_avoiding(Some(1)).unwrap().slot.file, 0);
}
