//! An engine-side agent for the cross-process arena tests: attaches to the
//! L1 arena at the path given, claims an agent record, and pins the
//! `slot generation` pairs it reads from standard input.
//!
//! `lake-arena-agent PATH read`: pins each pair, checks the stored object
//! in the slot (CRCs, slot, generation) twice with a pause between, unpins;
//! at end of input prints `read R stale S corrupt C`.
//!
//! `lake-arena-agent PATH hold`: pins each pair and keeps every pin; at end
//! of input prints `holding N` and sleeps until killed.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use lake_dp::arena::{Arena, PinError};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(path), Some(mode)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: lake-arena-agent PATH read|hold");
        return ExitCode::from(2);
    };
    let arena = match Arena::attach(&PathBuf::from(path)) {
        Ok(arena) => arena,
        Err(e) => {
            eprintln!("lake-arena-agent: {e}");
            return ExitCode::from(1);
        }
    };
    let mut pins = match arena.claim_agent() {
        Ok(pins) => pins,
        Err(e) => {
            eprintln!("lake-arena-agent: {e}");
            return ExitCode::from(1);
        }
    };
    let (mut read, mut stale, mut corrupt) = (0u64, 0u64, 0u64);
    let mut held = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace().map(str::parse::<u32>);
        let (Some(Ok(slot)), Some(Ok(generation))) = (words.next(), words.next()) else {
            eprintln!("lake-arena-agent: bad line {line:?}");
            return ExitCode::from(2);
        };
        match pins.pin(slot, generation) {
            Ok(pin) if mode == "hold" => held.push(pin),
            Ok(pin) => {
                for _ in 0..2 {
                    if let Err(e) = lake_tests::check_stamped(pins.bytes(&pin), slot, generation) {
                        eprintln!("lake-arena-agent: slot {slot} generation {generation}: {e}");
                        corrupt += 1;
                    }
                    std::thread::yield_now();
                }
                pins.unpin(pin);
                read += 1;
            }
            Err(PinError::Stale { .. }) => stale += 1,
            Err(e) => {
                eprintln!("lake-arena-agent: {e}");
                return ExitCode::from(1);
            }
        }
    }
    let mut out = std::io::stdout().lock();
    if mode == "hold" {
        let _ = writeln!(out, "holding {}", held.len());
        let _ = out.flush();
        drop(out);
        loop {
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    }
    let _ = writeln!(out, "read {read} stale {stale} corrupt {corrupt}");
    ExitCode::SUCCESS
}
