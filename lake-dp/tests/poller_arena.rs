//! The poller over a real L1 arena in shared memory: it moves blocks
//! between arena slots of different classes and the (simulated) L2, and an
//! agent mapping the arena sees what landed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use lake_dp::RegionId;
use lake_dp::arena::{Arena, ArenaConfig};
use lake_dp::region::SlotClass;

/// A unique `/dev/shm` path, removed on drop.
struct ShmPath(PathBuf);

impl ShmPath {
    fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        Self(PathBuf::from(format!("/dev/shm/lake-test-{}-{name}-{n}", std::process::id())))
    }
}

impl Drop for ShmPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

const CLASSES: [SlotClass; 2] = [SlotClass { slot_bytes: 8192, slots: 6 }, SlotClass { slot_bytes: 16384, slots: 3 }];

fn config(path: &ShmPath) -> ArenaConfig {
    ArenaConfig { agents_max: 4, pins_per_agent: 8, epoch: 5, ..ArenaConfig::shm(&path.0, &CLASSES) }
}

/// The poller moves blocks between arena slots of different classes and
/// the (simulated) L2, and refuses an object larger than its L1 slot.
#[test]
fn the_poller_runs_over_the_arena() {
    use lake_dp::model::key::BlockKey;
    use lake_dp::model::namespace::NamespaceId;
    use lake_dp::model::replica::{Durability, ObjectKind, Priority};
    use lake_dp::op::{Command, L2Slot, ReadBlock, RejectReason, Request, WriteBlock};
    use lake_dp::poller::{L2Geometry, Poller, PollerConfig};
    use lake_dp::sim::{SimDisk, SimFaults};
    use lake_dp::stored::ObjectMeta;

    let path = ShmPath::new("poller");
    let (arena, mut table) = Arena::create(&config(&path)).unwrap();
    let l2 = L2Geometry { files: 1, slots_per_file: 2, slot_bytes: 16384, region_first: 1 };
    let config = PollerConfig {
        epoch: 5,
        ops_max: 4,
        batch_max: 4,
        io_retries_max: 0,
        flush_delay_ns: 0,
        flush_batch: 1,
        l2,
        background_in_flight_max: 0,
    };
    let disk = SimDisk::new(1, SimFaults::none(1_000), 4, 1, 2 * 16384);
    let mut poller = Poller::new(config, disk, arena.region().unwrap()).unwrap();
    poller.seal();

    let payload_len = 10_000u64;
    let class = table.class_for(lake_dp::stored::object_bytes(payload_len)).unwrap();
    assert_eq!(class, 1);
    let source = table.allocate(class).unwrap();
    // SAFETY: the table granted this slot to the test; no I/O yet.
    unsafe { arena.region().unwrap().slot_mut(source.slot).unwrap()[4096..4096 + 10_000].fill(0x3c) };
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey([9; 16]),
        parent_key: BlockKey::NONE,
        block_index: 0,
        namespace: NamespaceId(1),
        layout_fingerprint: 2,
        region: RegionId(1),
        region_epoch: 5,
        slot: 1,
        generation: 3,
        committed_unix_ns: 0,
        payload_len,
        segment_bytes: 4096,
    };
    let target = L2Slot { file: 0, slot: 1 };
    let write = WriteBlock { l1_slot: source.slot, target, meta, durability: Durability::Acked, seal: None };
    let request = |command| Request { command, priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
    poller.submit(request(Command::Write(write))).unwrap();

    let small = table.allocate(0).unwrap();
    let read = |l1_slot| ReadBlock { source: target, l1_slot, key: BlockKey([9; 16]), generation: 3, payload_len };
    let refused = poller.submit(request(Command::Read(read(small.slot)))).unwrap_err();
    assert_eq!(refused.reason, RejectReason::Invalid("payload does not fit the L1 slot"));

    let mut now = 0;
    let mut events = Vec::new();
    let mut buf = [lake_dp::op::Event::placeholder(); 4];
    let mut run = |poller: &mut Poller<SimDisk>, events: &mut Vec<_>| {
        for _ in 0..1000 {
            now += 1_000;
            poller.poll(now, 8);
            let n = poller.reap(&mut buf);
            events.extend_from_slice(&buf[..n]);
            if !poller.has_work() {
                break;
            }
        }
    };
    run(&mut poller, &mut events);
    let landing = table.allocate(1).unwrap();
    poller.submit(request(Command::Read(read(landing.slot)))).unwrap();
    run(&mut poller, &mut events);
    assert_eq!(events.len(), 2);
    assert!(events.iter().all(|e| e.outcome.is_ok()), "{events:?}");
    // The agent sees the promoted block through its own mapping.
    let agent = Arena::attach(&path.0).unwrap();
    let mut pins = agent.claim_agent().unwrap();
    let pin = pins.pin(landing.slot, landing.generation).unwrap();
    let bytes = pins.bytes(&pin);
    let header = lake_dp::stored::decode_header(bytes).unwrap();
    assert_eq!(header.meta().key, BlockKey([9; 16]));
    header.verify_payload(&bytes[4096..4096 + 10_000]).unwrap();
    assert!(bytes[4096..4096 + 10_000].iter().all(|&b| b == 0x3c));
    pins.unpin(pin);
}
