//! The L1 arena shared between a `lake-dp` (this test) and engine agents
//! in other processes: pins taken in another process hold slots against
//! reuse, bytes never change under a pin, a killed agent's pins are
//! dropped, and a killed `lake-dp`'s arena is noticed and replaced.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use lake_dp::arena::{Arena, ArenaConfig, SlotTable};
use lake_dp::region::{SlotClass, SlotRegion};
use lake_tests::{STAMPED_PAYLOAD_BYTES, write_stamped};

struct ShmPath(PathBuf);

impl Drop for ShmPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn arena(name: &str, slots: u32) -> (ShmPath, Arena, SlotTable) {
    let path = ShmPath(PathBuf::from(format!("/dev/shm/lake-xproc-{}-{name}", std::process::id())));
    let classes = [SlotClass::for_payload(STAMPED_PAYLOAD_BYTES, slots)];
    let config = ArenaConfig { agents_max: 4, pins_per_agent: 64, ..ArenaConfig::shm(&path.0, &classes) };
    let (arena, table) = Arena::create(&config).expect("create the arena");
    (path, arena, table)
}

/// A child agent, killed if the test fails before it exits.
struct Agent(Option<Child>);

impl Agent {
    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("agent running")
    }

    fn wait_with_output(mut self) -> std::process::Output {
        self.0.take().expect("agent running").wait_with_output().expect("agent output")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn agent(path: &ShmPath, mode: &str) -> Agent {
    spawn(Command::new(env!("CARGO_BIN_EXE_lake-arena-agent")).arg(&path.0).arg(mode))
}

fn spawn(command: &mut Command) -> Agent {
    let child =
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("start the child");
    Agent(Some(child))
}

/// Allocates a slot (reclaiming retired ones while none is free), writes
/// its stamped object and returns `(slot, generation)`.
fn fill(table: &mut SlotTable, region: &SlotRegion) -> (u32, u32) {
    loop {
        if let Some(grant) = table.allocate(0) {
            // SAFETY: the table granted this slot; nobody pins a generation
            // that has not been published yet.
            write_stamped(grant.slot, grant.generation, unsafe { region.slot_mut(grant.slot) }.expect("slot"));
            return (grant.slot, grant.generation);
        }
        table.reclaim();
        std::thread::yield_now();
    }
}

/// Tells the agent a block to pin: a stand-in for the mirror (a pipe
/// orders the slot's bytes, written before, ahead of the agent's read).
fn publish(to_agent: &mut impl Write, (slot, generation): (u32, u32)) {
    writeln!(to_agent, "{slot} {generation}").expect("write to agent");
}

#[test]
fn pins_from_another_process_hold_slots_against_reuse() {
    let (path, arena, mut table) = arena("churn", 6);
    let region = arena.region().expect("region");
    let mut child = agent(&path, "read");
    let mut to_child = child.child().stdin.take().expect("stdin");
    let mut published: Vec<(u32, u32)> = (0..4).map(|_| fill(&mut table, &region)).collect();
    let mut pinned_seen = 0u64;
    for round in 0..3000usize {
        publish(&mut to_child, published[round % published.len()]);
        if round % 3 == 0 {
            // Evict one: retire it, then refill from whatever is free.
            let victim = (round / 3) % published.len();
            table.retire(published[victim].0).expect("retire");
            pinned_seen += u64::from(table.reclaim().pinned);
            published[victim] = fill(&mut table, &region);
        }
    }
    drop(to_child);
    let output = child.wait_with_output();
    assert!(output.status.success(), "agent failed");
    let report = String::from_utf8(output.stdout).expect("utf-8");
    println!("agent: {report} (retired slots seen pinned {pinned_seen} times)");
    let numbers: Vec<u64> = report.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    let [read, stale, corrupt] = numbers[..] else { panic!("bad report {report:?}") };
    assert_eq!(corrupt, 0, "bytes changed under another process's pin");
    assert!(read > 0, "the agent never pinned anything");
    assert_eq!(read + stale, 3000);
}

#[test]
fn a_killed_agents_pins_are_dropped() {
    let (path, arena, mut table) = arena("kill", 8);
    let region = arena.region().expect("region");
    let mut child = agent(&path, "hold");
    let mut to_child = child.child().stdin.take().expect("stdin");
    let held: Vec<(u32, u32)> = (0..5).map(|_| fill(&mut table, &region)).collect();
    for &block in &held {
        publish(&mut to_child, block);
    }
    drop(to_child);
    let mut line = String::new();
    BufReader::new(child.child().stdout.take().expect("stdout")).read_line(&mut line).expect("agent report");
    assert_eq!(line.trim(), "holding 5");

    for (slot, _) in &held {
        table.retire(*slot).expect("retire");
    }
    assert_eq!(table.reclaim().pinned, 5, "the live agent's pins hold the slots");
    assert_eq!(table.release_dead_agents(), 0, "the agent is alive");

    child.child().kill().expect("SIGKILL the agent");
    child.child().wait().expect("reap the agent");
    assert_eq!(table.reclaim().pinned, 5, "a dead agent's pins stay until it is released");
    assert_eq!(table.release_dead_agents(), 1);
    let reclaim = table.reclaim();
    assert_eq!((reclaim.freed, reclaim.pinned), (5, 0));
    assert_eq!(table.stats().free[0], 8);
    assert!(arena.is_live());
}

#[test]
fn an_agent_cannot_attach_to_a_retired_arena() {
    let (path, arena, table) = arena("retired", 2);
    let pid = arena.owner_pid();
    assert_eq!(pid, std::process::id());
    drop((arena, table));
    let child = agent(&path, "read");
    let output = child.wait_with_output();
    assert!(!output.status.success(), "attached to an arena whose lake-dp is gone");
}

#[test]
fn a_killed_lake_dps_arena_is_noticed_and_replaced() {
    let path = ShmPath(PathBuf::from(format!("/dev/shm/lake-xproc-{}-owner", std::process::id())));
    let mut owner = spawn(Command::new(env!("CARGO_BIN_EXE_lake-arena-owner")).arg(&path.0));
    let mut line = String::new();
    BufReader::new(owner.child().stdout.take().expect("stdout")).read_line(&mut line).expect("owner report");
    assert_eq!(line.trim(), "ready");

    let attached = Arena::attach(&path.0).expect("attach to the child's arena");
    assert!(attached.is_live());
    assert_ne!(attached.owner_pid(), std::process::id());
    let classes = [SlotClass::for_payload(STAMPED_PAYLOAD_BYTES, 4)];
    let config = ArenaConfig { agents_max: 4, pins_per_agent: 16, ..ArenaConfig::shm(&path.0, &classes) };
    let refused = Arena::create(&config).expect_err("a live lake-dp's arena must not be replaced");
    assert!(refused.to_string().contains("live lake-dp"), "{refused}");

    owner.child().kill().expect("SIGKILL the owner");
    owner.child().wait().expect("reap the owner");
    assert!(!attached.is_live(), "the agent notices its lake-dp died");
    let (successor, _table) = Arena::create(&config).expect("replace the dead lake-dp's arena");
    assert!(successor.is_live());
    assert!(!attached.is_live());
    let reattached = Arena::attach(&path.0).expect("attach to the successor");
    assert_eq!(reattached.owner_pid(), std::process::id());
}
