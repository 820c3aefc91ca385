//! The mirror stress test's writer: creates the mirror at a path (or takes
//! it over from a dead writer with a higher term), then publishes,
//! replaces and removes entries of keys `0..keys` as fast as it can until
//! killed. Prints "ready <repaired>" once it writes.
//!
//! `lake-mirror-writer <path> <keys> <term> <seed>`

#![allow(clippy::cast_possible_truncation)] // small test numbers

use std::io::Write;
use std::path::PathBuf;

use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorWriter};
use lake_dp::rng::SimRng;
use lake_tests::{mirror_entry, mirror_key};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 5 {
        eprintln!("usage: lake-mirror-writer <path> <keys> <term> <seed>");
        std::process::exit(2);
    }
    let path = PathBuf::from(&args[1]);
    let (Ok(keys), Ok(term), Ok(seed)) = (args[2].parse::<u64>(), args[3].parse::<u64>(), args[4].parse::<u64>())
    else {
        eprintln!("keys, term and seed are integers");
        std::process::exit(2);
    };
    let (mut writer, repaired) = if term == 1 {
        let mut config = MirrorConfig::for_entries(MirrorBacking::Shm(path), keys);
        config.term = 1;
        (MirrorWriter::create(&config).unwrap_or_else(|e| fail(&e)), 0)
    } else {
        MirrorWriter::take_over(&path, term).unwrap_or_else(|e| fail(&e))
    };
    println!("ready {repaired}");
    let _ = std::io::stdout().flush();
    let mut rng = SimRng::new(seed);
    // Versions continue above every earlier writer's: the term is the high
    // byte, so a reader never sees one (key, version) with two meanings.
    let mut version = (term as u32) << 24;
    loop {
        let i = rng.below(keys);
        if rng.below(4) == 0 {
            writer.remove(&mirror_key(i));
        } else {
            version = version.wrapping_add(1);
            writer.upsert(&mirror_key(i), &mirror_entry(i, version)).unwrap_or_else(|e| fail(&e));
        }
    }
}

fn fail(e: &dyn std::fmt::Display) -> ! {
    eprintln!("lake-mirror-writer: {e}");
    std::process::exit(1);
}
