//! A `lake-dp` stand-in for the L2 crash test: opens (formatting first if
//! needed) a one-file L2 tier in the directory given, re-adopts it, then
//! writes blocks round-robin over its slots through the real poller and
//! io_uring, several in flight, until it is killed. It prints
//! `submit SLOT SEQ` before handing a write to the poller and
//! `acked SLOT SEQ` when the write completed (acked durability), so the
//! test knows exactly which writes were acked before the kill.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use lake_dp::l2::{L2Tier, format};
use lake_dp::op::{Command, Event, L2Slot, Request, WriteBlock};
use lake_dp::poller::{Poller, PollerConfig};
use lake_dp::region::SlotRegion;
use lake_dp::uring::UringBackend;
use lake_dp::{Durability, Priority};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lake-l2-writer: {e}");
            ExitCode::from(1)
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).ok_or("usage: lake-l2-writer DIR")?);
    let config = lake_tests::crash_l2_config(&dir);
    if !config.paths[0].exists() {
        format(&config)?;
    }
    let tier = L2Tier::open(&config)?;
    let epoch = tier.epoch();
    let found = tier.readopt(16)?;
    let l1_slots = 4u32;
    let l1 = Arc::new(SlotRegion::heap(config.slot_bytes, l1_slots)?);
    let mut backend = UringBackend::new(tier.backend_files()?, 16)?;
    // SAFETY: `l1` lives until the process ends (it is killed while
    // writing), longer than the backend.
    unsafe { backend.register_region(&l1) }?;
    let poller_config = PollerConfig {
        epoch,
        ops_max: l1_slots,
        batch_max: 8,
        io_retries_max: 2,
        flush_delay_ns: 0,
        flush_batch: 1,
        l2: tier.geometry(),
        background_in_flight_max: 0,
    };
    let mut poller = Poller::new(poller_config, backend, l1.clone())?;
    poller.seal();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready epoch {epoch} adopted {} torn {}", found.adopted.len(), found.torn.len())?;

    let mut free_l1: Vec<u32> = (0..l1_slots).collect();
    let mut next_slot = u32::try_from(epoch % u64::from(config.slots_per_file))?;
    let mut counter = 0u32;
    let mut events = [Event::placeholder(); 8];
    let clock = lake_dp::io::MonotonicClock;
    loop {
        while let Some(l1_slot) = free_l1.pop() {
            let seq = epoch << 32 | u64::from(counter);
            counter += 1;
            let slot = next_slot;
            next_slot = (next_slot + 1) % config.slots_per_file;
            // SAFETY: this L1 slot is free: no op uses it.
            let bytes = unsafe { l1.slot_mut(l1_slot) }.ok_or("L1 slot")?;
            let meta = lake_tests::crash_write(slot, seq, bytes);
            let write = WriteBlock {
                l1_slot,
                target: L2Slot { file: 0, slot },
                meta,
                durability: Durability::Acked,
                seal: None,
            };
            let request =
                Request { command: Command::Write(write), priority: Priority::WriteBack, deadline_ns: 0, cookie: seq };
            writeln!(out, "submit {slot} {seq}")?;
            poller.submit(request).map_err(|r| format!("submit refused: {}", r.reason))?;
        }
        poller.poll(lake_dp::io::Clock::now_ns(&clock), 8);
        let count = poller.reap(&mut events);
        for event in &events[..count] {
            let Command::Write(write) = event.command else { continue };
            event.outcome.map_err(|e| format!("write failed: {e}"))?;
            writeln!(out, "acked {} {}", write.target.slot, event.cookie)?;
            free_l1.push(write.l1_slot);
        }
    }
}
