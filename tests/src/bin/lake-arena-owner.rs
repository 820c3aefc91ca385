//! A stand-in `lake-dp` for the cross-process arena tests: creates the L1
//! arena at the path given, prints `ready`, and serves it (sleeps) until
//! killed.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use lake_dp::arena::{Arena, ArenaConfig};
use lake_dp::region::SlotClass;

fn main() -> ExitCode {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: lake-arena-owner PATH");
        return ExitCode::from(2);
    };
    let classes = [SlotClass::for_payload(lake_tests::STAMPED_PAYLOAD_BYTES, 4)];
    let config = ArenaConfig { agents_max: 4, pins_per_agent: 16, ..ArenaConfig::shm(PathBuf::from(path), &classes) };
    let (_arena, _table) = match Arena::create(&config) {
        Ok(created) => created,
        Err(e) => {
            eprintln!("lake-arena-owner: {e}");
            return ExitCode::from(1);
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "ready");
    let _ = out.flush();
    drop(out);
    loop {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}
