//! The mirror stress test's reader: maps the mirror read-only and looks up
//! random keys of `0..keys` for `millis` milliseconds, checking that every
//! entry found is whole (all its fields derive from its key and version).
//! Prints "reads <n> hits <n> misses <n> unreadable <n> torn <n> terms
//! <first>-<last>"; exits 1 if any entry was torn.
//!
//! `lake-mirror-reader <path> <keys> <millis> <seed>`

#![allow(clippy::cast_possible_truncation)] // small test numbers

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lake_dp::mirror::{Lookup, MirrorReader};
use lake_dp::rng::SimRng;
use lake_tests::{mirror_entry, mirror_key};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: lake-mirror-reader <path> <keys> <millis> <seed>");
        std::process::exit(2);
    }
    let path = PathBuf::from(&args[1]);
    let (Ok(keys), Ok(millis), Ok(seed)) = (args[2].parse::<u64>(), args[3].parse::<u64>(), args[4].parse::<u64>())
    else {
        eprintln!("keys, millis and seed are integers");
        std::process::exit(2);
    };
    let reader = MirrorReader::attach(&path).unwrap_or_else(|e| {
        eprintln!("lake-mirror-reader: {e}");
        std::process::exit(1);
    });
    let mut rng = SimRng::new(seed);
    let (mut reads, mut hits, mut misses, mut unreadable, mut torn) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let first_term = reader.term();
    let end = Instant::now() + Duration::from_millis(millis);
    while Instant::now() < end {
        for _ in 0..1000 {
            let i = rng.below(keys);
            reads += 1;
            match reader.get(&mirror_key(i)) {
                Lookup::Hit(entry) => {
                    hits += 1;
                    if entry != mirror_entry(i, entry.slot) {
                        torn += 1;
                        eprintln!("torn entry for key {i}: {entry:?}");
                    }
                }
                Lookup::Miss => misses += 1,
                Lookup::Unreadable => unreadable += 1,
            }
        }
    }
    println!(
        "reads {reads} hits {hits} misses {misses} unreadable {unreadable} torn {torn} terms {first_term}-{}",
        reader.term()
    );
    std::process::exit(i32::from(torn > 0));
}
