//! Deterministic simulation: the real poller over the simulated disk, many
//! seeds, with EIO, short transfers, torn writes, reordering, latency,
//! stale completions, failed fdatasyncs and crash-and-restart. Every
//! request must end exactly once; nothing stale or damaged is ever reported
//! ready; acked writes survive a process crash and durable ones a power
//! loss.
//!
//! `LAKE_SIM_SEEDS=N` runs N seeds (default 1000); `LAKE_SIM_SEED=S` replays
//! one seed (a failure prints the command).

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use common::{Harness, Tally};

const STEPS: usize = 400;

fn run_seed(seed: u64) -> Result<Tally, String> {
    let mut harness = Harness::new(seed, true);
    for _ in 0..STEPS {
        harness.step()?;
    }
    harness.drain()?;
    Ok(harness.tally)
}

#[test]
fn simulation_over_many_seeds() {
    let seeds: Vec<u64> = match std::env::var("LAKE_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("LAKE_SIM_SEED must be a number")],
        Err(_) => {
            let count: u64 = std::env::var("LAKE_SIM_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
            // Spread the seeds; the base changes nothing but coverage.
            (0..count).map(|i| 0x5eed_0000 + i).collect()
        }
    };
    let mut total = Tally::default();
    for &seed in &seeds {
        let result = catch_unwind(AssertUnwindSafe(|| run_seed(seed))).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            Err(format!("seed {seed}: panicked: {message}"))
        });
        match result {
            Ok(tally) => {
                total.writes_ok += tally.writes_ok;
                total.reads_ok += tally.reads_ok;
                total.errors += tally.errors;
                total.corrupt_caught += tally.corrupt_caught;
                total.rotted += tally.rotted;
                total.cancelled += tally.cancelled;
                total.crashes += tally.crashes;
                total.polls += tally.polls;
                total.stale_seen += tally.stale_seen;
                total.stale_injected += tally.stale_injected;
            }
            Err(message) => panic!("{message}\nreplay: LAKE_SIM_SEED={seed} cargo test -p lake-dp --test sim"),
        }
    }
    println!("{} seeds: {total:?}", seeds.len());
    if seeds.len() >= 100 {
        // The run exercised what it claims to: successes, failures,
        // caught corruption, cancellations, crashes and stale completions.
        assert!(total.writes_ok > 0 && total.reads_ok > 0, "{total:?}");
        assert!(total.errors > 0 && total.corrupt_caught > 0, "{total:?}");
        assert!(total.cancelled > 0 && total.crashes > 0 && total.stale_seen > 0, "{total:?}");
    }
}
