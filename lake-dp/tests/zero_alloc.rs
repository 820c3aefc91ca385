//! Init, then seal: after `Poller::seal` the poll loop never allocates.
//!
//! A counting global allocator watches the real poller drive sustained
//! simulated L1↔L2 traffic — writes, reads, flushes, cancellations, injected
//! faults, retries, stale completions — for a million poll iterations, and
//! the count of allocations in that window must be zero. (No test harness:
//! `main` is this file's, so no other thread allocates meanwhile.)
//!
//! A second window does the same for the L1 arena's hot operations:
//! allocate, pin, retire, reclaim, unpin, over a real `/dev/shm` arena.

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
    println!("\n2 passed, 0 failed");
}

fn arena_operations_do_not_allocate() {
    use lake_dp::arena::{Arena, ArenaConfig};
    use lake_dp::region::SlotClass;

    const ROUNDS: u32 = 200_000;
    let path = format!("/dev/shm/lake-zero-alloc-{}", std::process::id());
    let classes = [SlotClass::for_payload(4096, 16), SlotClass::for_payload(65536, 8)];
    let config = ArenaConfig { agents_max: 2, pins_per_agent: 8, ..ArenaConfig::shm(&path, &classes) };
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
    println!("{ROUNDS} arena rounds: {pinned} pins, {freed} slots freed, {allocations} allocations");
    assert!(pinned > u64::from(ROUNDS) / 2 && freed > u64::from(ROUNDS) / 2, "too little work");
    assert_eq!(allocations, 0, "the arena's hot operations allocated");
    println!("test zero_alloc_arena ... ok");
}
