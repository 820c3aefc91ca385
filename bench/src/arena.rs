//! `pin`: the L1 arena's pin protocol. An agent's pin + unpin of a slot
//! against the raw operation beneath it — a store, a SeqCst fence, a load
//! and a clearing store on plain atomics — and `lake-dp`'s reclaim scan of
//! every agent's pin entries against a raw loop loading the same number of
//! words. Interleaved round by round in the same run.

use core::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::hint::black_box;
use std::time::Instant;

use lake_dp::arena::{Arena, ArenaConfig};
use lake_dp::region::SlotClass;

use crate::report::{Report, median};

struct ShmFile(String);

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct PinArgs {
    /// Agent records.
    #[arg(long, default_value_t = 16)]
    pub(crate) agents: u32,
    /// Pins each agent holds.
    #[arg(long, default_value_t = 256)]
    pub(crate) pins: u32,
    /// Rounds measured.
    #[arg(long, default_value_t = 31)]
    pub(crate) rounds: usize,
    /// Pin+unpin pairs timed.
    #[arg(long, default_value_t = 200_000)]
    pub(crate) pairs: u32,
}

pub(crate) fn run(args: &PinArgs) -> Result<Report, String> {
    let agents: u32 = args.agents;
    let pins_held: u32 = args.pins;
    let rounds: usize = args.rounds;
    let pairs: u32 = args.pairs;
    if rounds == 0 || pairs == 0 || agents == 0 || pins_held == 0 {
        return Err("--agents, --pins, --rounds and --pairs must be positive".into());
    }
    let path = ShmFile(format!("/dev/shm/lake-bench-pin-{}", std::process::id()));
    let classes = [SlotClass::for_payload(4096, 64)];
    let config =
        ArenaConfig { agents_max: agents, pins_per_agent: pins_held + 1, ..ArenaConfig::shm(&path.0, &classes) };
    let (arena, mut table) = Arena::create(&config).map_err(|e| e.to_string())?;
    let agent = Arena::attach(std::path::Path::new(&path.0)).map_err(|e| e.to_string())?;

    // Every agent record holds `pins_held` pins on one published slot, so
    // the reclaim scan reads agents * pins_held live entries.
    let anchor = table.allocate(0).ok_or("no slot")?;
    let mut records = Vec::new();
    let mut held = Vec::new();
    for _ in 0..agents {
        let mut pins = agent.claim_agent().map_err(|e| e.to_string())?;
        for _ in 0..pins_held {
            held.push(pins.pin(anchor.slot, anchor.generation).map_err(|e| e.to_string())?);
        }
        records.push(pins);
    }
    let target = table.allocate(0).ok_or("no slot")?;
    let last = records.len() - 1;

    let raw_entry = AtomicU64::new(0);
    let raw_generation = AtomicU32::new(target.generation);
    let raw_words: Vec<AtomicU64> = (0..u64::from(agents) * u64::from(pins_held)).map(AtomicU64::new).collect();

    let (mut pin_ns, mut raw_pin_ns, mut scan_ns, mut raw_scan_ns) = (vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..pairs {
            let reader = &mut records[last];
            let pin = reader.pin(black_box(target.slot), target.generation).map_err(|e| e.to_string())?;
            reader.unpin(pin);
        }
        pin_ns.push(start.elapsed().as_nanos() as f64 / f64::from(pairs));

        // Behind black_box so the compiler cannot see the words are local.
        let (entry, generation) = (black_box(&raw_entry), black_box(&raw_generation));
        let start = Instant::now();
        for _ in 0..pairs {
            entry.store(black_box(0x1_0000_0001), Ordering::Relaxed);
            fence(Ordering::SeqCst);
            if generation.load(Ordering::Acquire) != target.generation {
                return Err("raw generation moved".into());
            }
            entry.store(0, Ordering::Release);
        }
        raw_pin_ns.push(start.elapsed().as_nanos() as f64 / f64::from(pairs));

        // One retire + reclaim of an unpinned slot: a full scan.
        let slot = table.allocate(0).ok_or("no slot")?;
        table.retire(slot.slot).map_err(|e| e.to_string())?;
        let start = Instant::now();
        let reclaim = table.reclaim();
        scan_ns.push(start.elapsed().as_nanos() as f64);
        if reclaim.freed != 1 {
            return Err(format!("reclaim freed {} slots, expected 1", reclaim.freed));
        }

        let start = Instant::now();
        let mut live = 0u64;
        fence(Ordering::SeqCst);
        for word in black_box(&raw_words) {
            live += u64::from(word.load(Ordering::Acquire) != 0);
        }
        black_box(live);
        raw_scan_ns.push(start.elapsed().as_nanos() as f64);
    }
    // Each pin goes back to the record that took it (held in order).
    for (i, pin) in held.into_iter().enumerate() {
        records[i / pins_held as usize].unpin(pin);
    }
    drop(arena);

    let entries = u64::from(agents) * u64::from(pins_held);
    let (pin, raw_pin) = (median(&mut pin_ns), median(&mut raw_pin_ns));
    let (scan, raw_scan) = (median(&mut scan_ns), median(&mut raw_scan_ns));
    let mut report = Report::new("pin");
    report.int("agents", u64::from(agents));
    report.int("pins_held_per_agent", u64::from(pins_held));
    report.int("rounds", rounds as u64);
    report.float("pin_unpin_ns", pin);
    report.float("raw_pin_unpin_ns", raw_pin);
    report.float("pin_ratio", pin / raw_pin);
    report.int("scan_entries", entries);
    report.float("reclaim_scan_us", scan / 1000.0);
    report.float("raw_scan_us", raw_scan / 1000.0);
    report.float("scan_ratio", scan / raw_scan);
    report.float("reclaim_ns_per_entry", scan / entries as f64);
    Ok(report)
}
