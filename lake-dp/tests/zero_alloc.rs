//! Init, then seal: after `Poller::seal` the poll loop never allocates.
//!
//! A counting global allocator watches the real poller drive sustained
//! simulated L1↔L2 traffic — writes, reads, flushes, cancellations, injected
//! faults, retries, stale completions — for a million poll iterations, and
//! the count of allocations in that window must be zero. (No test harness:
//! `main` is this file's, so no other thread allocates meanwhile.)
//!
//! A second window does the same for the L1 arena's hot operations:
//! allocate, pin, retire, reclaim, unpin, over a real `/dev/shm` arena. A
//! third runs the poller over real io_uring and a real O_DIRECT L2 file
//! (fixed buffers, registered files) for another million poll iterations
//! of writes and verified reads.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counters are plain atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if COUNTING.load(Ordering::Relaxed) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded with the caller's pointer and layouts.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's pointer and layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const POLLS: u64 = 1_000_000;

fn main() {
    let polls: u64 = std::env::var("LAKE_ZERO_ALLOC_POLLS").ok().and_then(|v| v.parse().ok()).unwrap_or(POLLS);
    // Built and sealed here: everything is allocated before counting starts.
    let mut harness = common::Harness::new(0x2e20_a110c, false);
    // Prove the counter counts, then measure the sealed loop.
    COUNTING.store(true, Ordering::SeqCst);
    drop(std::hint::black_box(vec![1u8; 16]));
    let probe = ALLOCATIONS.swap(0, Ordering::SeqCst);
    assert_eq!(probe, 1, "the counting allocator must see a known allocation");

    let mut failure = None;
    for _ in 0..polls {
        if let Err(message) = harness.step() {
            failure = Some(message);
            break;
        }
    }
    if failure.is_none()
        && let Err(message) = harness.drain()
    {
        failure = Some(message);
    }
    COUNTING.store(false, Ordering::SeqCst);
    let allocations = ALLOCATIONS.load(Ordering::SeqCst);
    if let Some(message) = failure {
        panic!("workload failed: {message}");
    }
    let tally = harness.tally;
    println!("{polls} poll iterations after seal: {allocations} allocations; traffic {tally:?}");
    assert!(tally.polls >= polls, "ran {} polls", tally.polls);
    assert!(tally.writes_ok > 10_000 && tally.reads_ok > 10_000, "too little traffic: {tally:?}");
    assert_eq!(allocations, 0, "the sealed poll loop allocated");
    println!("test zero_alloc_after_seal ... ok");
    arena_operations_do_not_allocate();
    io_uring_traffic_does_not_allocate(polls);
    println!("\n4 passed, 0 failed");
}

fn arena_operations_do_not_allocate() {
    // Classes owning their slots, then sharing chunks (memory moving
    // between them, a chunk emptied now and then).
    arena_rounds(0);
    arena_rounds(4 * 69_632);
    shared_chunks_change_class();
}

/// Two classes sharing two chunks, each filling them in turn: every turn
/// takes the chunks the other class emptied.
fn shared_chunks_change_class() {
    use lake_dp::arena::{Arena, ArenaConfig};
    use lake_dp::region::SlotClass;

    const TURNS: u32 = 20_000;
    let path = format!("/dev/shm/lake-zero-alloc-turns-{}", std::process::id());
    let classes = [SlotClass::for_payload(4096, 8), SlotClass::for_payload(65536, 1)];
    let config =
        ArenaConfig { agents_max: 2, pins_per_agent: 8, chunk_bytes: 69_632, ..ArenaConfig::shm(&path, &classes) };
    let (_arena, mut table) = Arena::create(&config).expect("create the arena");
    let mut held = [0u32; 32];
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for turn in 0..TURNS {
        let class = (turn % 2) as usize;
        let mut count = 0;
        while count < held.len()
            && let Some(grant) = table.allocate(class)
        {
            held[count] = grant.slot;
            count += 1;
        }
        // Every chunk is this class's and full: none for the other to
        // empty by moving blocks (they would have nowhere to go).
        assert_eq!(table.chunk_to_evacuate(1 - class, 0), None);
        for &slot in &held[..count] {
            table.retire(slot).expect("retire a held slot");
        }
        table.reclaim();
    }
    COUNTING.store(false, Ordering::SeqCst);
    let allocations = ALLOCATIONS.load(Ordering::SeqCst);
    let moved = table.stats().chunks_moved;
    println!(
        "{TURNS} turns of two classes over two shared chunks: {moved} chunks changed class, {allocations} allocations"
    );
    assert!(moved >= u64::from(TURNS), "the classes did not take each other's chunks: {moved}");
    assert_eq!(allocations, 0, "chunks changing class allocated");
    println!("test zero_alloc_shared_arena ... ok");
}

fn arena_rounds(chunk_bytes: u64) {
    use lake_dp::arena::{Arena, ArenaConfig};
    use lake_dp::region::SlotClass;

    const ROUNDS: u32 = 200_000;
    let path = format!("/dev/shm/lake-zero-alloc-{}-{chunk_bytes}", std::process::id());
    let classes = [SlotClass::for_payload(4096, 16), SlotClass::for_payload(65536, 8)];
    let config = ArenaConfig { agents_max: 2, pins_per_agent: 8, chunk_bytes, ..ArenaConfig::shm(&path, &classes) };
    let (arena, mut table) = Arena::create(&config).expect("create the arena");
    let mut pins = arena.claim_agent().expect("claim an agent record");
    let mut held = [None, None, None];
    let (mut pinned, mut freed) = (0u64, 0u64);
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    for round in 0..ROUNDS {
        let class = (round % 2) as usize;
        let Some(grant) = table.allocate(class) else {
            freed += u64::from(table.reclaim().freed);
            continue;
        };
        let index = (round % 3) as usize;
        if let Some(old) = held[index].take() {
            pins.unpin(old);
        }
        if let Ok(pin) = pins.pin(grant.slot, grant.generation) {
            held[index] = Some(pin);
            pinned += 1;
        }
        table.retire(grant.slot).expect("retire a held slot");
        freed += u64::from(table.reclaim().freed);
    }
    COUNTING.store(false, Ordering::SeqCst);
    let allocations = ALLOCATIONS.load(Ordering::SeqCst);
    for pin in held.into_iter().flatten() {
        pins.unpin(pin);
    }
    println!(
        "{ROUNDS} arena rounds (chunk_bytes {chunk_bytes}): {pinned} pins, {freed} slots freed, {allocations} allocations"
    );
    assert!(pinned > u64::from(ROUNDS) / 2 && freed > u64::from(ROUNDS) / 2, "too little work");
    assert_eq!(allocations, 0, "the arena's hot operations allocated");
    println!("test zero_alloc_arena ... ok");
}

fn io_uring_traffic_does_not_allocate(polls: u64) {
    use std::sync::Arc;

    use lake_dp::l2::{L2Config, L2Tier, format};
    use lake_dp::op::{Command, Event, L2Slot, ReadBlock, Request, WriteBlock};
    use lake_dp::poller::{Poller, PollerConfig};
    use lake_dp::region::SlotRegion;
    use lake_dp::stored::ObjectMeta;
    use lake_dp::uring::UringBackend;
    use lake_dp::{BlockKey, Durability, NamespaceId, ObjectKind, Priority};

    const SLOT_BYTES: u64 = 16 * 1024;
    const L2_SLOTS: u32 = 32;
    const L1_SLOTS: u32 = 8;
    const PAYLOAD: u64 = 10_000;
    let dir = std::env::temp_dir().join(format!("lake-zero-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = L2Config {
        paths: vec![dir.join("l2.lake")],
        slots_per_file: L2_SLOTS,
        slot_bytes: SLOT_BYTES,
        region_first: 0,
    };
    format(&config).expect("format");
    let tier = L2Tier::open(&config).expect("open");
    let l1 = Arc::new(SlotRegion::heap(SLOT_BYTES, L1_SLOTS).expect("L1"));
    let mut backend = UringBackend::new(tier.backend_files().expect("files"), 16).expect("io_uring");
    // SAFETY: `l1` outlives the backend (dropped at the end of this function,
    // after the poller).
    unsafe { backend.register_region(&l1) }.expect("register");
    let poller_config = PollerConfig {
        epoch: tier.epoch(),
        ops_max: L1_SLOTS,
        batch_max: 8,
        io_retries_max: 2,
        flush_delay_ns: 50_000,
        flush_batch: 4,
        l2: tier.geometry(),
        background_in_flight_max: 0,
    };
    let mut poller = Poller::new(poller_config, backend, l1.clone()).expect("poller");
    poller.seal();
    let meta = |slot: u32| ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey([u8::try_from(slot).unwrap_or(0) + 1; 16]),
        parent_key: BlockKey::NONE,
        block_index: slot,
        namespace: NamespaceId(1),
        layout_fingerprint: 1,
        region: tier.geometry().region(0),
        region_epoch: tier.epoch(),
        slot,
        generation: 1,
        committed_unix_ns: 0,
        payload_len: PAYLOAD,
        segment_bytes: 4096,
    };
    let mut free_l1 = [true; L1_SLOTS as usize];
    let mut written = [false; L2_SLOTS as usize];
    // One op per L2 slot at a time: a read racing a write of the same slot
    // could see it half written.
    let mut busy = [false; L2_SLOTS as usize];
    let mut events = [Event::placeholder(); 8];
    let (mut writes, mut reads, mut next) = (0u64, 0u64, 0u32);
    let clock = lake_dp::io::MonotonicClock;
    ALLOCATIONS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    // At least `polls` iterations, and on until enough traffic went
    // through (a loaded machine completes fewer I/Os per iteration), up to
    // twenty times as many.
    let mut ran = 0u64;
    while ran < polls || ((writes <= 1000 || reads <= 1000) && ran < polls.saturating_mul(20)) {
        ran += 1;
        for (l1_slot, free) in (0u32..).zip(free_l1.iter_mut()) {
            if !*free {
                continue;
            }
            let slot = next % L2_SLOTS;
            next = next.wrapping_add(7);
            let index = slot as usize;
            if busy[index] {
                continue;
            }
            let command = if written[index] && next % 3 != 0 {
                Command::Read(ReadBlock {
                    source: L2Slot { file: 0, slot },
                    l1_slot,
                    key: meta(slot).key,
                    generation: 1,
                    payload_len: PAYLOAD,
                })
            } else {
                let durability = if next % 5 == 0 { Durability::Durable } else { Durability::Acked };
                Command::Write(WriteBlock {
                    l1_slot,
                    target: L2Slot { file: 0, slot },
                    meta: meta(slot),
                    durability,
                    seal: None,
                })
            };
            let request = Request { command, priority: Priority::WriteBack, deadline_ns: 0, cookie: u64::from(slot) };
            if poller.submit(request).is_ok() {
                *free = false;
                busy[index] = true;
                if matches!(command, Command::Write(_)) {
                    // Readers wait for the write's event before reading.
                    written[index] = false;
                }
            }
        }
        poller.poll(lake_dp::io::Clock::now_ns(&clock), 8);
        let count = poller.reap(&mut events);
        for event in &events[..count] {
            if let Err(e) = event.outcome {
                COUNTING.store(false, Ordering::SeqCst);
                panic!("io_uring op failed: {e}");
            }
            match event.command {
                Command::Write(write) => {
                    writes += 1;
                    written[write.target.slot as usize] = true;
                    busy[write.target.slot as usize] = false;
                    free_l1[write.l1_slot as usize] = true;
                }
                Command::Read(read) => {
                    reads += 1;
                    busy[read.source.slot as usize] = false;
                    free_l1[read.l1_slot as usize] = true;
                }
                Command::Flush { .. } => {}
            }
        }
    }
    COUNTING.store(false, Ordering::SeqCst);
    let allocations = ALLOCATIONS.load(Ordering::SeqCst);
    let stats = poller.backend_mut().stats();
    drop(poller);
    drop(tier);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{ran} poll iterations over io_uring: {writes} writes, {reads} verified reads, {stats:?}, {allocations} allocations"
    );
    assert!(writes > 1000 && reads > 1000, "too little traffic");
    assert_eq!(stats.unfixed, 0, "every transfer through a fixed buffer");
    assert_eq!(allocations, 0, "the poller over io_uring allocated");
    println!("test zero_alloc_io_uring ... ok");
}
