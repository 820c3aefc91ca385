//! Arena tests over real shared memory (`/dev/shm`, and hugetlb memfds
//! where huge pages are reserved).

use core::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use super::layout::{ARENA_VERSION, STATE_BUILDING};
use super::*;

/// A unique `/dev/shm` path, removed (with its building leftovers) on drop.
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

#[test]
fn create_then_attach_shares_the_memory() {
    let path = ShmPath::new("attach");
    let (arena, _table) = Arena::create(&config(&path)).unwrap();
    let meta = std::fs::metadata(&path.0).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), arena.header().total_bytes);
    assert_eq!(arena.header().slots, 9);
    assert_eq!(arena.header().epoch, 5);
    assert_eq!(arena.owner_pid(), std::process::id());

    let agent = Arena::attach(&path.0).unwrap();
    assert_eq!(agent.header(), arena.header());
    assert!(agent.is_live());
    assert_eq!(agent.generation(0), Some(1));
    assert_eq!(agent.generation(9), None);

    let mine = arena.region().unwrap();
    let theirs = agent.region().unwrap();
    assert_eq!(theirs.slots(), 9);
    assert_eq!(theirs.slot_len(5), Some(8192));
    assert_eq!(theirs.slot_len(6), Some(16384));
    assert_eq!(theirs.slot_ptr(0).unwrap() as usize % 4096, 0);
    // SAFETY: the test owns every slot; no pins, no I/O.
    unsafe { mine.slot_mut(7).unwrap()[100] = 0x5a };
    // SAFETY: as above.
    assert_eq!(unsafe { theirs.slot(7) }.unwrap()[100], 0x5a);
}

#[test]
fn a_live_arena_is_not_replaced_and_a_dead_one_is() {
    let path = ShmPath::new("owner");
    let (first, table) = Arena::create(&config(&path)).unwrap();
    let err = Arena::create(&config(&path)).unwrap_err();
    assert!(matches!(err, ArenaError::InUse { pid } if pid == std::process::id()), "{err}");

    let attached = Arena::attach(&path.0).unwrap();
    assert!(attached.is_live());
    // Its lake-dp "dies": the kernel would drop its owner lock.
    lock::unlock(&first.map().file, OWNER_LOCK_BYTE).unwrap();
    assert!(!attached.is_live(), "an agent notices its lake-dp is gone");
    let (second, second_table) = Arena::create(&config(&path)).unwrap();
    assert!(!attached.is_live(), "agents of the stale arena learn it is retired");
    assert!(second.is_live());
    drop(table);
    drop(first);
    // The stale arena's last handle must not unlink its successor's file.
    assert!(path.0.exists());
    assert_eq!(Arena::attach(&path.0).unwrap().header(), second.header());
    drop(second);
    assert!(path.0.exists(), "the slot table still holds the arena");
    drop(second_table);
    assert!(!path.0.exists(), "the creator unlinks its file when its last handle goes");
    assert!(!attached.is_live());
}

#[test]
fn attach_names_what_is_wrong() {
    let path = ShmPath::new("bad");
    let expect = |what: &str| {
        let err = Arena::attach(&path.0).unwrap_err().to_string();
        assert!(err.contains(what), "{what}: got {err}");
    };
    expect("No such file");
    std::fs::write(&path.0, b"short").unwrap();
    expect("too short");
    std::fs::write(&path.0, vec![0u8; 8192]).unwrap();
    expect("not ready");
    assert_eq!(STATE_BUILDING, 0);
    let mut junk = vec![0x41u8; 8192];
    junk[CONTROL_OFFSET..CONTROL_OFFSET + 4].copy_from_slice(&STATE_READY.to_le_bytes());
    std::fs::write(&path.0, &junk).unwrap();
    expect("magic");

    // A real arena, then damaged in place.
    std::fs::remove_file(&path.0).unwrap();
    let (arena, _table) = Arena::create(&config(&path)).unwrap();
    let mut header = *arena.header();
    header.version = layout::ARENA_VERSION_PARTITIONED + 1;
    let bytes = bytemuck::bytes_of(&header);
    // SAFETY: page 0 of a mapping this test owns; nobody else reads it.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), arena.map().map.as_mut_ptr(), bytes.len()) };
    expect("version 4");
    header.version = ARENA_VERSION;
    header.slots_bytes += 1;
    let bytes = bytemuck::bytes_of(&header);
    // SAFETY: as above.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), arena.map().map.as_mut_ptr(), bytes.len()) };
    expect("crc");
    // Truncated under the agent's feet.
    let file = OpenOptions::new().write(true).open(&path.0).unwrap();
    file.set_len(arena.header().total_bytes - 4096).unwrap();
    // The header was damaged above; restore it so the size check is what fails.
    let good = bytemuck::bytes_of(arena.header());
    // SAFETY: as above.
    unsafe { core::ptr::copy_nonoverlapping(good.as_ptr(), arena.map().map.as_mut_ptr(), good.len()) };
    expect("total_bytes");
}

#[test]
fn config_errors_are_named() {
    let path = ShmPath::new("config");
    let check = |config: ArenaConfig, what: &str| {
        let err = Arena::create(&config).unwrap_err().to_string();
        assert!(err.contains(what), "{what}: got {err}");
        assert!(!path.0.exists(), "a failed create leaves no file");
    };
    check(ArenaConfig { agents_max: 0, ..config(&path) }, "agents_max");
    check(ArenaConfig { pins_per_agent: 0, ..config(&path) }, "pins_per_agent");
    check(ArenaConfig { mode: 0o1777, ..config(&path) }, "mode");
    check(ArenaConfig { classes: vec![SlotClass { slot_bytes: 1000, slots: 1 }], ..config(&path) }, "multiple of 4096");
    check(ArenaConfig { classes: vec![], ..config(&path) }, "size classes");
    let tmp_is_tmpfs = crate::shm::filesystem(&File::open("/tmp").unwrap()).unwrap().0 == crate::shm::TMPFS_MAGIC;
    if tmp_is_tmpfs {
        println!("skipped the disk-file check: /tmp is a tmpfs here");
    } else {
        let disk = PathBuf::from(format!("/tmp/lake-test-{}-disk", std::process::id()));
        let err = Arena::create(&ArenaConfig::shm(&disk, &CLASSES)).unwrap_err().to_string();
        assert!(err.contains("not on a tmpfs"), "{err}");
        assert!(!disk.exists());
        let mut building = disk.into_os_string();
        building.push(format!(".building-{}", std::process::id()));
        assert!(!PathBuf::from(building).exists(), "the building file is removed");
    }
}

#[test]
fn slots_are_freed_only_when_unpinned() {
    let path = ShmPath::new("pins");
    let (arena, mut table) = Arena::create(&config(&path)).unwrap();
    assert_eq!(table.class_for(8192), Some(0));
    assert_eq!(table.class_for(8193), Some(1));
    assert_eq!(table.class_for(16385), None);
    let grant = table.allocate(0).unwrap();
    assert_eq!((grant.slot, grant.generation, grant.slot_bytes), (0, 1, 8192));
    assert_eq!(table.stats().bytes_in_use, 8192);

    let agent_arena = Arena::attach(&path.0).unwrap();
    let mut pins = agent_arena.claim_agent().unwrap();
    assert_eq!(pins.pin(0, 2), Err(PinError::Stale { current: 1 }));
    assert_eq!(pins.pin(9, 1), Err(PinError::OutOfRange));
    let pin = pins.pin(0, 1).unwrap();
    assert_eq!(pins.bytes(&pin).len(), 8192);

    table.retire(0).unwrap();
    assert_eq!(table.retire(0), Err(SlotError::NotHeld));
    assert_eq!(arena.generation(0), Some(2));
    assert_eq!(table.reclaim(), Reclaim { freed: 0, pinned: 1 });
    assert_eq!(table.stats().draining, 1);
    // A reader arriving after the retire misses.
    assert_eq!(pins.pin(0, 1), Err(PinError::Stale { current: 2 }));
    pins.unpin(pin);
    assert_eq!(table.reclaim(), Reclaim { freed: 1, pinned: 0 });
    assert_eq!(table.stats().bytes_in_use, 0);
    let again = table.allocate(0).unwrap();
    assert_eq!((again.slot, again.generation), (0, 2));

    // A pin of another generation of the same slot does not hold it.
    let other = pins.pin(0, 2).unwrap();
    table.retire(0).unwrap();
    let stale_pin_holds = table.reclaim();
    assert_eq!(stale_pin_holds, Reclaim { freed: 0, pinned: 1 });
    pins.unpin(other);
    assert_eq!(table.reclaim().freed, 1);

    // Entries run out, and come back.
    let grants: Vec<_> = (0..8).map(|_| table.allocate(0)).collect();
    assert_eq!(grants.iter().filter(|g| g.is_some()).count(), 6, "class 0 has six slots");
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(pins.pin(1, 1).unwrap());
    }
    assert_eq!(pins.pin(1, 1), Err(PinError::Full));
    assert_eq!(pins.pinned(), 8);
    for pin in held {
        pins.unpin(pin);
    }
    assert_eq!(pins.pinned(), 0);
}

/// Two classes sharing four 40 KiB chunks: five 8 KiB slots or two
/// 20 KiB slots per chunk.
fn shared_config(path: &ShmPath) -> ArenaConfig {
    let classes = [SlotClass { slot_bytes: 8192, slots: 10 }, SlotClass { slot_bytes: 20480, slots: 3 }];
    ArenaConfig { chunk_bytes: 40960, ..ArenaConfig { classes: classes.to_vec(), ..config(path) } }
}

#[test]
fn a_class_short_of_slots_takes_a_chunk_another_class_emptied() {
    let path = ShmPath::new("shared");
    let (arena, mut table) = Arena::create(&shared_config(&path)).unwrap();
    assert_eq!((arena.header().version, arena.header().slots), (layout::ARENA_VERSION_SHARED, 28));
    let agent = Arena::attach(&path.0).unwrap();
    let (mine, theirs) = (arena.region().unwrap(), agent.region().unwrap());
    assert_eq!(theirs.chunk_bytes(), 40960);
    let stats = table.stats();
    assert_eq!((stats.free[0], stats.free[1], stats.chunks_unowned), (20, 8, 4), "every chunk is anyone's");

    // The large class takes every chunk.
    let large: Vec<SlotGrant> = (0..8).map(|_| table.allocate(1).unwrap()).collect();
    assert_eq!(table.stats().chunks_owned[1], 4);
    assert!(table.allocate(1).is_none());
    assert_eq!(table.free_slots(0), 0, "no chunk is free for the small class");
    assert!(table.allocate(0).is_none());
    for grant in &large {
        // SAFETY: the test holds every slot; nobody else writes them.
        unsafe { mine.slot_mut(grant.slot).unwrap().fill(grant.slot as u8) };
    }

    // One of chunk 3's two blocks goes: the chunk still holds the other.
    let (a, b) = (large[6].slot, large[7].slot);
    assert_eq!(theirs.slot_ptr(b).unwrap() as usize - theirs.slot_ptr(a).unwrap() as usize, 20480);
    table.retire(a).unwrap();
    assert_eq!(table.reclaim().freed, 1);
    assert!(table.allocate(0).is_none(), "a chunk holding a block never changes class");

    // The other goes too, but a reader still pins it: not yet.
    let mut pins = agent.claim_agent().unwrap();
    let pin = pins.pin(b, large[7].generation).unwrap();
    table.retire(b).unwrap();
    assert_eq!(table.reclaim(), Reclaim { freed: 0, pinned: 1 });
    assert!(table.allocate(0).is_none(), "a pinned block holds its chunk");
    pins.unpin(pin);
    assert_eq!(table.reclaim().freed, 1);

    // Now chunk 3 is empty: the small class takes it, five slots over the
    // bytes the two large ones had.
    assert_eq!(table.free_slots(0), 5);
    let small: Vec<SlotGrant> = (0..5).map(|_| table.allocate(0).unwrap()).collect();
    assert!(table.allocate(0).is_none());
    let stats = table.stats();
    assert_eq!((stats.chunks_owned[0], stats.chunks_owned[1], stats.chunks_moved), (1, 3, 1));
    let chunk_3 = mine.slot_ptr(a).unwrap() as usize;
    for grant in &small {
        let at = mine.slot_ptr(grant.slot).unwrap() as usize;
        assert!(at >= chunk_3 && at + 8192 <= chunk_3 + 40960, "slot {} lies in chunk 3", grant.slot);
        // SAFETY: the test holds the slot.
        unsafe { mine.slot_mut(grant.slot).unwrap().fill(0xee) };
    }
    for grant in &large[..6] {
        // SAFETY: the test holds the slot; no writer.
        let bytes = unsafe { theirs.slot(grant.slot) }.unwrap();
        assert!(bytes.iter().all(|&x| x == grant.slot as u8), "live slot {} untouched", grant.slot);
    }

    // The small class empties its chunk; the large class takes it back.
    for grant in &small {
        table.retire(grant.slot).unwrap();
    }
    assert_eq!(table.reclaim().freed, 5);
    assert_eq!(table.free_slots(1), 2);
    let back = table.allocate(1).unwrap();
    assert_eq!(back.slot, a, "the lowest slot of the chunk, with its generation moved on");
    assert_eq!(back.generation, large[6].generation + 1);
    assert_eq!(table.stats().chunks_moved, 2);
    assert_eq!(table.stats().free[0], 0);
}

#[test]
fn a_chunk_emptied_by_moving_its_blocks_goes_to_the_class_short_of_slots() {
    let path = ShmPath::new("evacuate");
    let (_arena, mut table) = Arena::create(&shared_config(&path)).unwrap();
    let large: Vec<SlotGrant> = (0..8).map(|_| table.allocate(1).unwrap()).collect();
    // One block leaves chunk 0 and one chunk 1: half of each is free, but
    // no chunk is empty, so the small class gets nothing.
    table.retire(large[1].slot).unwrap();
    table.retire(large[3].slot).unwrap();
    assert_eq!(table.reclaim().freed, 2);
    assert!(table.allocate(0).is_none());
    assert_eq!(table.chunk_to_evacuate(1, 0), None, "never a chunk of the class short of slots");
    assert_eq!(table.chunk_to_evacuate(0, 1), None, "the large class would keep no free slot of its own");
    let chunk = table.chunk_to_evacuate(0, 0).unwrap();
    assert_eq!(chunk, 0);
    assert_eq!(table.chunk_slot_range(chunk), Some((20, 2)));
    assert!(table.evacuate(chunk));
    assert!(!table.evacuate(1), "one chunk at a time");
    assert_eq!(table.chunk_to_evacuate(0, 0), None);
    // Its block moves to chunk 1's free slot (the holder copies it), and
    // the old slot is freed: the chunk is nobody's, then the small class's.
    assert_eq!(table.own_free_slots(1), 1);
    let target = table.allocate(1).unwrap();
    assert_eq!(target.slot, large[3].slot, "not into the chunk being emptied");
    assert!(table.allocate(0).is_none(), "not before its last block is freed");
    table.retire(large[0].slot).unwrap();
    assert_eq!(table.reclaim().freed, 1);
    assert_eq!(table.evacuating(), None);
    let stats = table.stats();
    assert_eq!((stats.chunks_evacuated, stats.chunks_unowned, stats.chunks_owned[1]), (1, 1, 3));
    let small = table.allocate(0).unwrap();
    assert_eq!(small.slot, 0, "chunk 0's first small slot");
    assert_eq!(table.class_of_slot(small.slot), Some(0));
}

#[test]
fn a_kept_slot_drains_to_its_holder_not_to_the_free_list() {
    let path = ShmPath::new("kept");
    let (_arena, mut table) = Arena::create(&config(&path)).unwrap();
    let agent_arena = Arena::attach(&path.0).unwrap();
    let mut pins = agent_arena.claim_agent().unwrap();
    let grant = table.allocate(0).unwrap();
    let pin = pins.pin(grant.slot, grant.generation).unwrap();
    table.retire_kept(grant.slot).unwrap();
    assert_eq!(table.reclaim(), Reclaim { freed: 0, pinned: 1 });
    assert!(!table.is_drained(grant.slot), "still pinned");
    assert_eq!(table.free_drained(grant.slot), Err(SlotError::NotHeld));
    pins.unpin(pin);
    assert_eq!(table.reclaim(), Reclaim { freed: 0, pinned: 0 });
    assert!(table.is_drained(grant.slot));
    // Neither free nor pinnable: every other slot of the class is handed
    // out, this one is not.
    let others: Vec<_> = std::iter::from_fn(|| table.allocate(0)).collect();
    assert_eq!(others.len(), 5);
    assert!(others.iter().all(|g| g.slot != grant.slot));
    assert!(pins.pin(grant.slot, grant.generation).is_err());
    assert_eq!(table.stats().bytes_in_use, 6 * 8192);
    table.free_drained(grant.slot).unwrap();
    assert_eq!(table.stats().bytes_in_use, 5 * 8192);
    assert_eq!(table.allocate(0).map(|g| g.slot), Some(grant.slot));
}

#[test]
fn a_dead_agents_pins_are_dropped() {
    let path = ShmPath::new("dead");
    let (_arena, mut table) = Arena::create(&config(&path)).unwrap();
    let agent_arena = Arena::attach(&path.0).unwrap();
    let mut records: Vec<PinArray> = (0..4).map(|_| agent_arena.claim_agent().unwrap()).collect();
    assert!(matches!(agent_arena.claim_agent(), Err(ArenaError::AgentsFull)));
    // A dropped record is free again.
    let freed_index = records.pop().unwrap().agent();
    let reclaimed = agent_arena.claim_agent().unwrap();
    assert_eq!(reclaimed.agent(), freed_index);
    records.push(reclaimed);

    let grant = table.allocate(1).unwrap();
    let pin = records[2].pin(grant.slot, grant.generation).unwrap();
    table.retire(grant.slot).unwrap();
    assert_eq!(table.reclaim().pinned, 1);
    assert_eq!(table.release_dead_agents(), 0, "every agent is alive");

    // Agent 2's process dies: the kernel drops its record lock.
    let dead = records[2].agent();
    records[2].simulate_death();
    assert_eq!(table.release_dead_agents(), 1);
    assert_eq!(table.reclaim(), Reclaim { freed: 1, pinned: 0 });
    // The (supposedly dead) record's handle now finds it not its own and
    // leaves it alone; the record can be claimed again.
    let _abandoned = pin; // the dead process never unpins
    drop(records.remove(2));
    assert_eq!(agent_arena.claim_agent().unwrap().agent(), dead);
    assert_eq!(table.release_agent(4), Err(SlotError::NoAgent));
}

/// An agent of another user takes its records' locks on the open of the
/// arena its data plane made for it (it may not reopen the file): every
/// claim of the process goes through that one open file, yet each takes a
/// record of its own, and none is taken for dead as others come and go
/// (a failed claim's unlock would drop a sibling's lock on the same open
/// file).
#[test]
fn records_claimed_through_an_open_of_its_own_are_distinct_and_stay_alive() {
    let path = ShmPath::new("own");
    let (arena, mut table) = Arena::create(&config(&path)).unwrap();
    let own = crate::lock::reopen_fd(arena.fd().as_raw_fd()).unwrap();
    let agent_arena = Arena::attach_own_fd(std::os::fd::OwnedFd::from(own)).unwrap();
    let mut records: Vec<PinArray> = (0..3).map(|_| agent_arena.claim_agent().unwrap()).collect();
    let mut ids: Vec<u32> = records.iter().map(PinArray::agent).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 3, "three records, each its own");
    assert_eq!(table.release_dead_agents(), 0, "every record's lock is held");
    let gone = records.remove(1).agent();
    assert_eq!(table.release_dead_agents(), 0, "a sibling's release leaves the others' locks");
    records.push(agent_arena.claim_agent().unwrap());
    assert_eq!(records[2].agent(), gone, "the record given back is the one taken again");
    records.push(agent_arena.claim_agent().unwrap());
    assert!(matches!(agent_arena.claim_agent(), Err(ArenaError::AgentsFull)));
    assert_eq!(table.release_dead_agents(), 0);
    // A claim from the data plane's side (another open) finds them all held.
    let other = Arena::attach(&path.0).unwrap();
    assert!(matches!(other.claim_agent(), Err(ArenaError::AgentsFull)));
    drop(records);
    assert!(other.claim_agent().is_ok(), "given back, the records are free again");
}

#[test]
fn registration_happens_once_per_device() {
    struct Recorder(Vec<(usize, usize)>);
    impl MemoryRegistration for Recorder {
        fn kind(&self) -> &'static str {
            "test-device"
        }
        fn register(&mut self, base: NonNull<u8>, len: usize) -> io::Result<()> {
            self.0.push((base.as_ptr() as usize, len));
            Ok(())
        }
    }
    let path = ShmPath::new("register");
    let (arena, _table) = Arena::create(&config(&path)).unwrap();
    let mut device = Recorder(Vec::new());
    arena.register(&mut device).unwrap();
    let (base, len) = arena.slot_area();
    assert_eq!(device.0, vec![(base.as_ptr() as usize, len)]);
    assert_eq!(len, 6 * 8192 + 3 * 16384);
    assert_eq!(base.as_ptr() as usize, arena.region().unwrap().base() as usize);
    assert!(matches!(arena.clone().register(&mut device), Err(ArenaError::AlreadyRegistered("test-device"))));
}

fn stamp(slot: u32, generation: u32) -> u64 {
    pins::encode(slot, generation) ^ 0x9e37_79b9_7f4a_7c15
}

/// Words of a slot, read and written atomically so that a broken protocol
/// shows up as a wrong stamp rather than as undefined behaviour.
fn words(region: &SlotRegion, slot: u32) -> &[AtomicU64] {
    let ptr = region.slot_ptr(slot).unwrap().cast::<AtomicU64>();
    // SAFETY: slots are 4 KiB aligned and at least 8 KiB long; only
    // atomics touch these 64 words in this test.
    unsafe { core::slice::from_raw_parts(ptr, 64) }
}

/// lake-dp retires, reclaims, reallocates and rewrites slots as fast as it
/// can while agents pin whatever the "mirror" publishes and check that the
/// bytes never change under a pin.
#[test]
fn pinned_bytes_never_change_under_churn() {
    let path = ShmPath::new("churn");
    let config = ArenaConfig { agents_max: 4, pins_per_agent: 16, ..config(&path) };
    let (arena, mut table) = Arena::create(&config).unwrap();
    let region = arena.region().unwrap();
    let slots = arena.header().slots;
    // The mirror: per published entry, encode(slot, generation), or 0.
    let mirror: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let agents: Vec<_> = (0..2u64)
        .map(|seed| {
            let (arena, mirror, stop) = (Arena::attach(&path.0).unwrap(), mirror.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut pins = arena.claim_agent().unwrap();
                let region = arena.region().unwrap();
                let (mut read, mut missed, mut torn) = (0u64, 0u64, 0u64);
                let mut i = seed;
                while !stop.load(Ordering::Relaxed) {
                    i = i.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    // Acquire: pairs with the publisher's Release; the
                    // slot's bytes were written before.
                    let entry = mirror[(i >> 40) as usize % mirror.len()].load(Ordering::Acquire);
                    let Some((slot, generation)) = pins::decode(entry) else { continue };
                    match pins.pin(slot, generation) {
                        Ok(pin) => {
                            let expect = stamp(slot, generation);
                            for _ in 0..4 {
                                torn +=
                                    words(&region, slot).iter().filter(|w| w.load(Ordering::Relaxed) != expect).count()
                                        as u64;
                                std::hint::spin_loop();
                            }
                            pins.unpin(pin);
                            read += 1;
                        }
                        Err(PinError::Stale { .. }) => missed += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                (read, missed, torn)
            })
        })
        .collect();

    let publish = |table: &mut SlotTable, index: usize| {
        let class = index % 2;
        let grant = loop {
            if let Some(grant) = table.allocate(class) {
                break grant;
            }
            table.reclaim();
        };
        for word in words(&region, grant.slot) {
            word.store(stamp(grant.slot, grant.generation), Ordering::Relaxed);
        }
        // Release: pairs with the agents' Acquire of the mirror.
        mirror[index].store(pins::encode(grant.slot, grant.generation), Ordering::Release);
    };
    for index in 0..mirror.len() {
        publish(&mut table, index);
    }
    let mut reclaimed = Reclaim::default();
    for round in 0..20_000u32 {
        let index = (round as usize * 7) % mirror.len();
        let entry = mirror[index].swap(0, Ordering::AcqRel);
        let (slot, _) = pins::decode(entry).unwrap();
        table.retire(slot).unwrap();
        let pass = table.reclaim();
        reclaimed.freed += pass.freed;
        reclaimed.pinned += pass.pinned;
        publish(&mut table, index);
    }
    stop.store(true, Ordering::Relaxed);
    let (mut read, mut missed, mut torn) = (0, 0, 0);
    for agent in agents {
        let (r, m, t) = agent.join().unwrap();
        read += r;
        missed += m;
        torn += t;
    }
    println!("reads {read}, misses {missed}, torn words {torn}, reclaims {reclaimed:?}, slots {slots}");
    assert_eq!(torn, 0, "bytes changed under a pin");
    assert!(read > 0, "agents never pinned anything");
    assert!(reclaimed.freed > 0);
}

/// Huge pages, where the machine has them reserved: an anonymous hugetlb
/// memfd, mapped a second time through /proc as an agent would.
#[test]
fn hugetlb_memfd_arena_when_huge_pages_exist() {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    let free_bytes = field("HugePages_Free:") * field("Hugepagesize:") * 1024;
    let classes = [SlotClass { slot_bytes: 1 << 20, slots: 2 }];
    if free_bytes < 8 << 20 {
        println!(
            "skipped: {free_bytes} bytes of free huge pages (want 8 MiB; reserve with \
             `echo 8 > /proc/sys/vm/nr_hugepages`)"
        );
        return;
    }
    let config = ArenaConfig { backing: ArenaBacking::HugetlbMemfd, ..ArenaConfig::shm("", &classes) };
    let (arena, mut table) = Arena::create(&config).unwrap();
    let page = arena.header().page_bytes;
    assert!(page >= 2 << 20, "page {page}");
    assert_eq!(arena.header().slots_offset % page, 0);
    let proc_path = PathBuf::from(format!("/proc/self/fd/{}", arena.fd().as_raw_fd()));
    let agent = Arena::attach(&proc_path).unwrap();
    assert_eq!(agent.header(), arena.header());
    let grant = table.allocate(0).unwrap();
    let mut pins = agent.claim_agent().unwrap();
    let pin = pins.pin(grant.slot, grant.generation).unwrap();
    // SAFETY: the table holds the slot; the pinned reader reads after.
    unsafe { arena.region().unwrap().slot_mut(grant.slot).unwrap()[12345] = 7 };
    assert_eq!(pins.bytes(&pin)[12345], 7);
    pins.unpin(pin);
}

/// Every page of an arena bound to a NUMA node is on that node and
/// present (fallocate + MAP_POPULATE, not first touch). Binds to the
/// highest node, so that on a machine with several the default (local)
/// placement would not pass by accident.
#[test]
fn numa_binding_places_every_page_on_its_node() {
    let node = std::fs::read_dir("/sys/devices/system/node")
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.strip_prefix("node")?.parse::<u32>().ok())
        .max();
    let Some(node) = node else {
        println!("skipped: no /sys/devices/system/node on this machine");
        return;
    };
    let path = ShmPath::new("numa");
    let (arena, _table) = Arena::create(&ArenaConfig { numa_node: Some(node), ..config(&path) }).unwrap();
    let maps = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
    let name = path.0.to_str().unwrap();
    let line = maps.lines().find(|l| l.contains(name)).expect("the arena in numa_maps");
    let mut on_node = 0u64;
    for field in line.split_whitespace() {
        let Some((key, value)) = field.split_once('=') else { continue };
        let Some(n) = key.strip_prefix('N').and_then(|n| n.parse::<u32>().ok()) else { continue };
        assert_eq!(n, node, "pages on node {n}: {line}");
        on_node += value.parse::<u64>().unwrap();
    }
    assert_eq!(on_node * 4096, arena.header().total_bytes, "every page present: {line}");

    let other = ShmPath::new("numa-bad");
    let err = Arena::create(&ArenaConfig { numa_node: Some(1000), ..config(&other) }).unwrap_err().to_string();
    assert!(err.contains("numa_node"), "{err}");
}

/// Agents map the arena writable; what one scribbles on shared memory
/// must not steer or crash lake-dp's slot table.
#[test]
fn scribbled_shared_memory_does_not_steer_the_slot_table() {
    let path = ShmPath::new("scribble");
    let (arena, mut table) = Arena::create(&config(&path)).unwrap();
    let grant = table.allocate(0).unwrap();
    let map = arena.map();
    // A rogue agent zeroes a generation, fills its pin entries with
    // nonsense and claims an absurd high-water mark.
    map.generation(grant.slot).store(0, Ordering::Relaxed);
    let mut rogue = arena.claim_agent().unwrap();
    let record = rogue.agent();
    map.agent(record).high_water.store(u32::MAX, Ordering::Relaxed);
    for (i, word) in map.pins(record).iter().enumerate() {
        word.store(u64::MAX - i as u64, Ordering::Relaxed);
    }
    table.retire(grant.slot).unwrap();
    assert_eq!(arena.generation(grant.slot), Some(2), "the table publishes its own count");
    let reclaim = table.reclaim();
    assert_eq!(reclaim.freed, 1, "nonsense entries pin nothing");
    let again = table.allocate(0).unwrap();
    assert_eq!((again.slot, again.generation), (grant.slot, 2));
    // The rogue's own record still works once it stops scribbling.
    for word in map.pins(record) {
        word.store(0, Ordering::Relaxed);
    }
    let pin = rogue.pin(again.slot, again.generation).unwrap();
    rogue.unpin(pin);
}

/// A hugetlbfs backing must be on a hugetlbfs mount; where one exists, an
/// arena is built there with its page size.
#[test]
fn hugetlbfs_backing_needs_a_hugetlbfs_mount() {
    let path = ShmPath::new("not-hugetlbfs");
    let config = ArenaConfig { backing: ArenaBacking::HugetlbFs(path.0.clone()), ..config(&path) };
    let err = Arena::create(&config).unwrap_err().to_string();
    assert!(err.contains("not on a hugetlbfs mount"), "{err}");
    assert!(!path.0.exists());

    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let Some(mount) = mounts.lines().find_map(|l| {
        let mut fields = l.split_whitespace();
        let dir = fields.nth(1)?;
        (fields.next()? == "hugetlbfs").then(|| dir.to_owned())
    }) else {
        println!("skipped the hugetlbfs arena: no hugetlbfs mount in /proc/mounts");
        return;
    };
    let file = PathBuf::from(format!("{mount}/lake-test-{}", std::process::id()));
    let classes = [SlotClass { slot_bytes: 1 << 20, slots: 2 }];
    let config = ArenaConfig { backing: ArenaBacking::HugetlbFs(file.clone()), ..ArenaConfig::shm(&file, &classes) };
    match Arena::create(&config) {
        Ok((arena, _table)) => assert!(arena.header().page_bytes >= 2 << 20),
        Err(ArenaError::NoSpace { .. }) => println!("skipped the hugetlbfs arena: no free huge pages"),
        Err(e) => panic!("{e}"),
    }
    let _ = std::fs::remove_file(file);
}

/// The mapping lines of this process's address range `[start, start+len)`.
fn mapped_lines(start: usize, len: usize) -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let range = |line: &str| {
        let (a, b) = line.split_whitespace().next()?.split_once('-')?;
        Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
    };
    let lines = maps.lines().filter(|line| range(line).is_some_and(|(a, b)| a < start + len && b > start));
    lines.map(str::to_owned).collect()
}

#[test]
fn a_partitioned_arena_maps_for_each_process_only_the_partition_it_was_given() {
    let (path, first, second) = (ShmPath::new("parted"), ShmPath::new("part-1"), ShmPath::new("part-2"));
    let partition = |file: &ShmPath| ArenaPartition { backing: ArenaBacking::Shm(file.0.clone()), slots: vec![3, 1] };
    let config = ArenaConfig { partitions: vec![partition(&first), partition(&second)], ..config(&path) };
    let (arena, mut table) = Arena::create(&config).unwrap();
    let geometry = arena.geometry().clone();
    assert_eq!((arena.header().version, geometry.partitions.len(), arena.header().slots), (3, 3, 9 + 4 + 4));
    // Nothing of it is at a path: its records and every partition, 0
    // too, are memory of their own, each sealed at its size — no process
    // holding one can shrink it (faulting the others) or grow it.
    let shared_file = shared_partition_path(&path.0);
    assert!(![&path.0, &shared_file, &first.0, &second.0].iter().any(|p| p.exists()));
    let records = (arena.fd(), arena.header().slots_offset);
    let parts = (0..3).map(|p| (arena.partition_fd(p).unwrap(), geometry.partitions[p].bytes));
    for (fd, bytes) in [records].into_iter().chain(parts) {
        let file = std::fs::File::from(fd.try_clone_to_owned().unwrap());
        assert_eq!(file.metadata().unwrap().len(), bytes);
        // SAFETY: an open descriptor; F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_eq!(seals & crate::shm::SEALS, crate::shm::SEALS);
        for len in [0, bytes / 2, bytes * 2] {
            let err = file.set_len(len).unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EPERM), "resized to {len}: {err}");
        }
    }
    // Each partition allocates from its own slots.
    let grant =
        |table: &mut SlotTable, partition: usize| table.allocate(table.class_in(partition, 8192).unwrap()).unwrap();
    let slots = [grant(&mut table, 0).slot, grant(&mut table, 1).slot, grant(&mut table, 2).slot];
    assert_eq!(slots.map(|s| table.partition_of(s)), [Some(0), Some(1), Some(2)]);
    assert_eq!(table.class_for(8192), table.class_in(0, 8192));
    let mine = arena.region().unwrap();
    for (i, &slot) in slots.iter().enumerate() {
        // SAFETY: the test holds the slot; no pins, no I/O.
        unsafe { mine.slot_mut(slot).unwrap()[..4].copy_from_slice(&[0xa0 + i as u8; 4]) };
    }
    let dup = |fd: BorrowedFd<'_>| fd.try_clone_to_owned().unwrap();
    // An agent given partition 1 reads its slots, and no other slot is
    // there for it: the other partitions are not mapped in its view.
    let agent = Arena::attach_partition(dup(arena.fd()), 1, Some(dup(arena.partition_fd(1).unwrap()))).unwrap();
    assert_eq!(agent.visible_partition(), Some(1));
    let theirs = agent.region().unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { theirs.slot(slots[1]) }.unwrap()[..4], [0xa1; 4]);
    assert!(theirs.slot_ptr(slots[0]).is_none() && theirs.slot_ptr(slots[2]).is_none());
    let (base, len) = agent.slot_area();
    assert_eq!(len as u64, geometry.partitions[1].bytes);
    let second_at = base.as_ptr() as usize + len;
    let unmapped = mapped_lines(second_at, usize_from(geometry.partitions[2].bytes));
    assert!(!unmapped.is_empty() && unmapped.iter().all(|l| l.contains("---p")), "{unmapped:?}");
    let mapped = mapped_lines(base.as_ptr() as usize, len);
    assert!(mapped.iter().all(|l| l.contains("rw-s") && l.contains("memfd:") && l.contains("part-1")), "{mapped:?}");
    // Partition 0, with its memory; without any, none.
    let by_path = Arena::attach_partition(dup(arena.fd()), 0, Some(dup(arena.partition_fd(0).unwrap()))).unwrap();
    assert_eq!(by_path.visible_partition(), Some(0));
    let shared = by_path.region().unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { shared.slot(slots[0]) }.unwrap()[..4], [0xa0; 4]);
    assert!(shared.slot_ptr(slots[1]).is_none());
    let err = Arena::attach_partition(dup(arena.fd()), 2, None).unwrap_err().to_string();
    assert!(err.contains("file was not given"), "{err}");
    let err = Arena::attach_own_fd(dup(arena.fd())).unwrap_err().to_string();
    assert!(err.contains("file was not given"), "the arena's file alone maps no slot: {err}");
    let err = Arena::attach_partition(dup(arena.fd()), 3, None).unwrap_err().to_string();
    assert!(err.contains("no such partition"), "{err}");
    drop((agent, theirs, by_path, shared, mine, table, arena));
}
