//! The mirror across processes: a writer process publishes, replaces and
//! removes entries as fast as it can while two reader processes look keys
//! up; the writer is SIGKILLed at random moments and a new one takes the
//! mirror over with a higher term (repairing any bucket the dead one left
//! mid-update), round after round. Readers must never see a torn entry,
//! must see the terms advance, and the mirror must end consistent.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use lake_dp::mirror::MirrorWriter;
use lake_dp::rng::SimRng;
use lake_tests::{mirror_entry, mirror_key};

const KEYS: u64 = 20_000;
const READ_MILLIS: u64 = 3000;

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a writer at `term` and waits for its "ready <repaired>" line.
fn writer(path: &Path, term: u64) -> (Killed, u64) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake-mirror-writer"))
        .args([path.to_str().unwrap(), &KEYS.to_string(), &term.to_string(), &(term * 7919).to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting lake-mirror-writer");
    let stdout: ChildStdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let repaired = line
        .strip_prefix("ready ")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("writer at term {term} said {line:?}"));
    (Killed(child), repaired)
}

#[test]
fn readers_never_see_a_torn_entry_while_writers_die_and_take_over() {
    let scratch = Scratch(PathBuf::from(format!("/dev/shm/lake-test-mirror-stress-{}", std::process::id())));
    let _ = std::fs::remove_file(&scratch.0);
    let (mut current, _) = writer(&scratch.0, 1);
    let readers: Vec<Child> = (0..2)
        .map(|seed| {
            Command::new(env!("CARGO_BIN_EXE_lake-mirror-reader"))
                .args([scratch.0.to_str().unwrap(), &KEYS.to_string(), &READ_MILLIS.to_string(), &seed.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .expect("starting lake-mirror-reader")
        })
        .collect();
    let mut rng = SimRng::new(42);
    let (mut term, mut repaired) = (1u64, 0u64);
    let end = Instant::now() + Duration::from_millis(READ_MILLIS - 500);
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50 + rng.below(250)));
        // SIGKILL, wherever the writer is.
        drop(current);
        term += 1;
        let (next, fixed) = writer(&scratch.0, term);
        current = next;
        repaired += fixed;
    }
    drop(current);
    let mut total_hits = 0;
    for reader in readers {
        let output = reader.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        println!("reader: {text}");
        assert!(output.status.success(), "a reader saw a torn entry: {text}");
        let words: Vec<&str> = text.split_whitespace().collect();
        let field = |name: &str| -> &str { words[words.iter().position(|w| *w == name).unwrap() + 1] };
        assert_eq!(field("torn"), "0");
        total_hits += field("hits").parse::<u64>().unwrap();
        let terms: Vec<u64> = field("terms").split('-').map(|t| t.parse().unwrap()).collect();
        assert!(terms[1] > terms[0], "the reader saw no take-over: {text}");
    }
    assert!(total_hits > 0);
    // The last writer is dead too: take over here and check every entry.
    let (last, fixed) = MirrorWriter::take_over(&scratch.0, term + 1).unwrap();
    repaired += fixed;
    let mut live = 0;
    for i in 0..KEYS {
        if let Some(entry) = last.get(&mirror_key(i)) {
            live += 1;
            assert_eq!(entry, mirror_entry(i, entry.slot), "key {i} inconsistent in the mirror");
        }
    }
    assert_eq!(live, last.live());
    println!("{} writers killed, {repaired} buckets repaired, {live} live entries at the end", term);
}
