//! The L2 crash test: a child `lake-dp` stand-in writes blocks to a real L2
//! file through the poller and io_uring and is killed with SIGKILL at a
//! random moment, round after round (50 by default;
//! `LAKE_CRASH_ROUNDS=N` for more). After every kill the tier is opened
//! again (new epoch) and re-adopted from its headers, and:
//!
//! - every block whose write was acked before the kill, and not overwritten
//!   since, is re-adopted with exactly that key;
//! - a slot with a write in flight at the kill holds its last acked block,
//!   the in-flight one, or is reported torn — never anything else;
//! - no re-adopted block fails its CRCs (checked again here, independently).

#![allow(clippy::cast_possible_truncation)] // small test numbers

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_dp::l2::L2Tier;
use lake_dp::stored::decode_object;
use lake_tests::{crash_key, crash_l2_config};

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Killed(Option<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct SlotModel {
    acked: Option<u64>,
    in_flight: Option<u64>,
}

fn apply(line: &str, slots: &mut [SlotModel]) {
    let mut words = line.split_whitespace();
    let (Some(kind), Some(slot), Some(seq)) = (words.next(), words.next(), words.next()) else { return };
    let (Ok(slot), Ok(seq)) = (slot.parse::<usize>(), seq.parse::<u64>()) else { return };
    match kind {
        "submit" => slots[slot].in_flight = Some(seq),
        "acked" => {
            slots[slot].acked = Some(seq);
            if slots[slot].in_flight == Some(seq) {
                slots[slot].in_flight = None;
            }
        }
        _ => {}
    }
}

#[test]
fn acked_writes_survive_sigkill_and_nothing_torn_is_served() {
    let rounds: u64 = std::env::var("LAKE_CRASH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let dir = Dir(std::env::temp_dir().join(format!("lake-l2-crash-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&dir.0);
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = crash_l2_config(&dir.0);
    let mut slots = vec![SlotModel::default(); config.slots_per_file as usize];
    let mut rng = 0x5eed_u64 ^ u64::from(std::process::id());
    let (mut acked_total, mut in_flight_total, mut torn_total, mut checked_total) = (0u64, 0u64, 0usize, 0usize);

    for round in 0..rounds {
        let mut child = Killed(Some(
            Command::new(env!("CARGO_BIN_EXE_lake-l2-writer"))
                .arg(&dir.0)
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("start lake-l2-writer"),
        ));
        let stdout = child.0.as_mut().unwrap().stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let ready = lines.next().expect("writer output").expect("utf-8");
        assert!(ready.starts_with("ready"), "round {round}: {ready}");
        // Kill after a random number of acks (or a random time, whichever
        // comes first), so kills land at every point of a write's life.
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let acks_wanted = 1 + (rng >> 33) % 120;
        let deadline = Instant::now() + Duration::from_millis(5 + (rng >> 20) % 40);
        let mut acks = 0;
        let mut pending_lines = Vec::new();
        while acks < acks_wanted && Instant::now() < deadline {
            let Some(Ok(line)) = lines.next() else { break };
            if line.starts_with("acked") {
                acks += 1;
            }
            pending_lines.push(line);
        }
        let mut process = child.0.take().unwrap();
        process.kill().expect("SIGKILL");
        process.wait().expect("reap");
        // Everything printed before the kill counts: drain the pipe.
        for line in lines.map_while(Result::ok) {
            pending_lines.push(line);
        }
        for line in &pending_lines {
            apply(line, &mut slots);
            if line.starts_with("acked") {
                acked_total += 1;
            }
        }

        let tier = L2Tier::open(&config).expect("reopen after the kill");
        let found = tier.readopt(16).expect("re-adopt");
        assert!(found.damaged.is_empty(), "round {round}: damaged headers {:?}", found.damaged);
        assert!(found.unreadable.is_empty(), "round {round}: unreadable {:?}", found.unreadable);
        let adopted: HashMap<u32, lake_dp::BlockKey> = found.adopted.iter().map(|a| (a.slot, a.meta.key)).collect();
        let torn: Vec<u32> = found.torn.iter().map(|t| t.1).collect();
        torn_total += torn.len();
        let file = std::fs::File::open(&config.paths[0]).unwrap();
        for (slot, model) in slots.iter_mut().enumerate() {
            let slot_u32 = slot as u32;
            let acked_key = model.acked.map(|seq| crash_key(slot_u32, seq));
            let in_flight_key = model.in_flight.map(|seq| crash_key(slot_u32, seq));
            match (adopted.get(&slot_u32), model.in_flight) {
                (found, None) => assert_eq!(
                    found.copied(),
                    acked_key,
                    "round {round}: slot {slot} lost or changed an acked block (torn: {torn:?})"
                ),
                (Some(key), Some(_)) => {
                    in_flight_total += 1;
                    assert!(
                        Some(*key) == acked_key || Some(*key) == in_flight_key,
                        "round {round}: slot {slot} holds a block that was never written there"
                    );
                }
                (None, Some(_)) => {
                    in_flight_total += 1;
                    // Torn (reported) or never reached the disk.
                    assert!(
                        torn.contains(&slot_u32) || acked_key.is_none(),
                        "round {round}: slot {slot} lost its acked block without being reported torn"
                    );
                }
            }
            // What re-adoption serves must pass its CRCs: check it here,
            // independently of lake-dp's own scrub.
            if let Some(key) = adopted.get(&slot_u32) {
                let mut bytes = vec![0u8; config.slot_bytes as usize];
                file.read_exact_at(&mut bytes, u64::from(slot_u32) * config.slot_bytes).unwrap();
                let (header, _) = decode_object(&bytes).unwrap_or_else(|e| panic!("round {round}: slot {slot}: {e}"));
                assert_eq!(header.meta().key, *key);
                checked_total += 1;
            }
            // The new state: what re-adoption found is the truth now.
            model.acked = adopted.get(&slot_u32).map(|key| u64::from_le_bytes(key.0[4..12].try_into().unwrap()));
            model.in_flight = None;
        }
        drop(tier);
    }
    println!(
        "{rounds} kills: {acked_total} acked writes tracked, {in_flight_total} writes in flight at a kill, \
         {torn_total} torn objects caught, {checked_total} re-adopted objects re-checked"
    );
    assert!(acked_total > rounds, "too few writes were acked to test anything");
}
