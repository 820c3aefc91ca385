//! One tenant's engine, or another tenant's trying to reach its blocks, as
//! whoever runs it (the tenant partition test runs it as two users): an
//! agent attached to `lake-dp`'s socket, working on the four blocks of
//! namespace NAMESPACE (keys and bytes made from it).
//!
//! - `save`: saves them, waits for them to be published, loads them back:
//!   prints `saved N`, `loaded N exact|differs`.
//! - `check`: looks them up and loads them: `hits N`, `loaded N
//!   exact|differs`.
//! - `reach PID`: what another tenant's engine can do to them: opens each
//!   of PID's (the pool's) descriptors through `/proc` (`pool fds open:
//!   N`), looks them up and loads them (`hits N`, `loaded N`), and saves
//!   blocks of its own bytes under their keys (`forged saved N`).
//! - `resize`: grows and shrinks every descriptor of the pool's memory it
//!   was given (`given N (WHAT), resized M`), then saves and loads its own, as
//!   `save` does: a data plane whose memory was shrunk under it faults.
//!
//! Every run ends with `mapped: PATHS` (the pool's shared-memory files in
//! this process's mappings) and exits 0; `dp refused: WHY` if not let in.
//!
//! Usage: lake-partition-probe DP_SOCKET MIRROR NAMESPACE save|check|resize|reach [PID]

use std::path::Path;

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_dp::model::replica::ObjectKind;

const BLOCKS: usize = 4;

fn keys(namespace: u64) -> Vec<lake_dp::BlockKey> {
    (0..BLOCKS)
        .map(|i| {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&namespace.to_le_bytes());
            key[8] = u8::try_from(i).unwrap_or(u8::MAX);
            key[9] = 0x77;
            lake_dp::BlockKey(key)
        })
        .collect()
}

/// Block `i` of `namespace`'s bytes, or an attacker's (`forged`).
fn payload(namespace: u64, i: usize, forged: bool) -> Vec<u8> {
    let byte = namespace.to_le_bytes()[0] ^ u8::try_from(i).unwrap_or(0) ^ if forged { 0xff } else { 0 };
    vec![byte; 4096]
}

fn save(agent: &mut Agent, namespace: u64, forged: bool) -> usize {
    let keys = keys(namespace);
    let payloads: Vec<Vec<u8>> = (0..BLOCKS).map(|i| payload(namespace, i, forged)).collect();
    let blocks: Vec<SaveBlock<'_>> = (0..BLOCKS)
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { lake_dp::BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap_or(u32::MAX),
            payload: SavePayload::Bytes(&payloads[i]),
        })
        .collect();
    agent.save(&blocks)
}

/// Looks the blocks up (waiting up to `wait` for `want` hits) and loads
/// them: hits, loaded, and whether every byte loaded is the tenant's own.
fn load(agent: &mut Agent, namespace: u64, want: usize, wait: std::time::Duration) -> (usize, usize, bool) {
    let keys = keys(namespace);
    let mut table = Vec::new();
    let deadline = std::time::Instant::now() + wait;
    let mut hits = agent.lookup(&keys, &mut table);
    while hits < want && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
        hits = agent.lookup(&keys, &mut table);
    }
    let mut exact = true;
    let loaded =
        agent.fetch(&keys[..hits], &table[..hits], |i, bytes| exact &= bytes == &payload(namespace, i, false)[..]);
    (hits, loaded, exact)
}

/// The pool's shared-memory files in this process's mappings.
fn mapped() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut paths: Vec<String> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|p| p.contains("lake-l1-"))
        .map(str::to_owned)
        .collect();
    paths.sort();
    paths.dedup();
    paths
}

/// Grows by a page and shrinks to nothing every descriptor of the pool's
/// memory this process holds (its arena, partition, ports, mirror): how
/// many there are, and how many changed size.
fn resize_given() -> (Vec<String>, usize) {
    use std::os::fd::AsRawFd;

    let (mut given, mut resized) = (Vec::new(), 0);
    let fds: Vec<_> = std::fs::read_dir("/proc/self/fd").map(|dir| dir.flatten().collect()).unwrap_or_default();
    for entry in fds {
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        if !target.to_string_lossy().contains("lake") {
            continue;
        }
        let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        // SAFETY: this process's own descriptor, duplicated; the copy is
        // closed when `file` drops.
        let dup = unsafe { libc::dup(fd) };
        if dup < 0 {
            continue;
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(dup) };
        given.push(target.display().to_string());
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        // SAFETY: an open descriptor; a length in range.
        let grown = unsafe { libc::ftruncate(file.as_raw_fd(), i64::try_from(len).unwrap_or(0) + 4096) } == 0;
        // SAFETY: as above.
        let shrunk = unsafe { libc::ftruncate(file.as_raw_fd(), 0) } == 0;
        resized += usize::from(shrunk || grown);
    }
    (given, resized)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dp, mirror, namespace, action, rest) = match &args[..] {
        [dp, mirror, namespace, action, rest @ ..] => (dp, mirror, namespace, action.as_str(), rest),
        _ => {
            eprintln!("usage: lake-partition-probe DP_SOCKET MIRROR NAMESPACE save|check|resize|reach [PID]");
            std::process::exit(2);
        }
    };
    let Ok(namespace) = u64::from_str_radix(namespace, 16) else {
        eprintln!("NAMESPACE: hex");
        std::process::exit(2);
    };
    let config = AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(mirror),
        cp_socket: None,
        name: "partition-probe",
        namespace: lake_dp::NamespaceId(namespace),
        layout_fingerprint: 1,
        segment_bytes: 4096,
        object_kind: ObjectKind::KvBlock,
    };
    let mut agent = match Agent::connect(&config, Path::new(dp)) {
        Ok(agent) => agent,
        Err(e) => {
            println!("dp refused: {e}");
            return;
        }
    };
    let wait = std::time::Duration::from_secs(10);
    match (action, rest) {
        ("save" | "resize", []) => {
            if action == "resize" {
                let (given, resized) = resize_given();
                println!("given {} ({}), resized {resized}", given.len(), given.join(", "));
            }
            println!("saved {}", save(&mut agent, namespace, false));
            let (_, loaded, exact) = load(&mut agent, namespace, BLOCKS, wait);
            println!("loaded {loaded} {}", if exact { "exact" } else { "differs" });
        }
        ("check", []) => {
            let (hits, loaded, exact) = load(&mut agent, namespace, BLOCKS, wait);
            println!("hits {hits}");
            println!("loaded {loaded} {}", if exact { "exact" } else { "differs" });
        }
        ("reach", [pid]) => {
            let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .map(|dir| dir.flatten().filter(|entry| std::fs::File::open(entry.path()).is_ok()).count());
            println!("pool fds open: {}", fds.unwrap_or(0));
            let (hits, loaded, _) = load(&mut agent, namespace, BLOCKS, std::time::Duration::ZERO);
            println!("hits {hits}");
            println!("loaded {loaded}");
            println!("forged saved {}", save(&mut agent, namespace, true));
        }
        _ => {
            eprintln!("usage: lake-partition-probe DP_SOCKET MIRROR NAMESPACE save|check|resize|reach [PID]");
            std::process::exit(2);
        }
    }
    println!("mapped: {}", mapped().join(" "));
}
