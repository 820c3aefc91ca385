//! Draining a disk (capacity management) on a real embedded
//! pool with two L2 files: `lake drain FILE --wait` tells the data plane
//! to write nothing new to the file and moves every block it holds to the
//! other file — sealed (encrypted) blocks as their ciphertext, clear ones
//! as they are — until it is empty; every block still comes back byte for
//! byte, blocks saved afterwards are demoted to the other file only, and
//! `lake regions` / `lake top` show it. Bad requests are named.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

#[path = "common/chain.rs"]
mod chain;
#[path = "common/scratch.rs"]
mod scratch;

use std::path::Path;
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::auth::at_rest::DataKey;
use lake_dp::{BlockKey, NamespaceId, Tier};

use chain::{lake, save_chain};
use scratch::Scratch;

const PAYLOAD: usize = 60 * 1024;
/// Per namespace: two of them (48 blocks) fit L1 (16) and one L2 file
/// (64) together, so the drain need not drop anything.
const BLOCKS: u32 = 24;
const SEALED_NS: NamespaceId = NamespaceId(0x7e7e);
const CLEAR_NS: NamespaceId = NamespaceId(0x8e8e);
const LATER_NS: NamespaceId = NamespaceId(0x9e9e);

fn key(ns: NamespaceId, block: u32) -> BlockKey {
    let mut bytes = [0x6d; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    bytes[4..12].copy_from_slice(&ns.0.to_le_bytes());
    BlockKey(bytes)
}

fn payload(ns: NamespaceId, block: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|i| (i as u8).wrapping_mul(13) ^ (block as u8) ^ (ns.0 as u8)).collect()
}

fn keys(ns: NamespaceId) -> Vec<BlockKey> {
    (0..BLOCKS).map(|i| key(ns, i)).collect()
}

fn engine(pool: &mut EmbeddedPool, ns: NamespaceId) -> Agent {
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "drain-test",
        namespace: ns,
        layout_fingerprint: 0xd2a1,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).unwrap()
}

fn save(agent: &mut Agent, ns: NamespaceId) {
    save_chain(agent, &keys(ns), |i| payload(ns, i as u32));
}

/// Blocks of `ns` found, and how many of them in L2.
fn found(agent: &mut Agent, ns: NamespaceId) -> (usize, usize) {
    let mut table = Vec::new();
    let hits = agent.lookup(&keys(ns), &mut table);
    (hits, table[..hits].iter().filter(|e| e.tier == Tier::L2Nvme).count())
}

/// Loads every block of `ns`, a few at a time (L1 is small), each checked
/// against its own bytes; how many were delivered.
fn fetch_all(agent: &mut Agent, ns: NamespaceId) -> usize {
    let keys = keys(ns);
    let mut table = Vec::new();
    let (mut delivered, mut tries) = (0, 0);
    while tries < 200 && delivered < keys.len() {
        tries += 1;
        let hits = agent.lookup(&keys, &mut table);
        if delivered >= hits {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        let (from, end) = (delivered, hits.min(delivered + 4));
        delivered += agent.fetch(&keys[from..end], &table[from..end], |i, bytes| {
            let i = from + i;
            assert_eq!(bytes, &payload(ns, i as u32)[..], "block {i} of {:x} came back wrong", ns.0);
        });
    }
    delivered
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 20 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Each region as `lake regions --json` shows it: (id, tier, name,
/// blocks, draining).
fn regions(admin: &str) -> Vec<(u64, String, String, u64, bool)> {
    let text = lake(&["regions", "--admin", admin, "--json"]).unwrap();
    let value: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    value["regions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["region"].as_u64().unwrap(),
                r["tier"].as_str().unwrap().to_owned(),
                r["name"].as_str().unwrap().to_owned(),
                r["blocks"].as_u64().unwrap(),
                r["draining"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn l2_blocks(admin: &str) -> Vec<(u64, String, u64, bool)> {
    regions(admin).into_iter().filter(|r| r.1 == "l2").map(|(id, _, name, blocks, d)| (id, name, blocks, d)).collect()
}

fn start(dir: &Path) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 16,
        l2_slots_per_file: 64,
        local_agents: 3,
        remote_agents: 0,
        tenant_keys: vec![(SEALED_NS, DataKey::from_bytes([0x31; 32]))],
        ..EmbeddedConfig::new(dir.to_path_buf())
    })
    .unwrap()
}

#[test]
fn a_drained_l2_file_is_emptied_into_the_other_and_written_no_more() {
    let dir = std::env::temp_dir().join(format!("lake-cp-drain-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _scratch = Scratch(dir.clone(), Vec::new());
    let mut pool = start(&dir);
    let admin = pool.admin_socket.display().to_string();
    let mut sealed = engine(&mut pool, SEALED_NS);
    let mut clear = engine(&mut pool, CLEAR_NS);
    save(&mut sealed, SEALED_NS);
    save(&mut clear, CLEAR_NS);
    // L1 holds 16: most of both are demoted, spread over both files.
    wait_until("both namespaces demoted", || {
        found(&mut sealed, SEALED_NS).1 >= 12 && found(&mut clear, CLEAR_NS).1 >= 12
    });
    // Read back once: the blocks read last are in L1 too now, their L2
    // copies kept (a block with two replicas is moved too).
    assert_eq!(fetch_all(&mut sealed, SEALED_NS), BLOCKS as usize);
    assert_eq!(fetch_all(&mut clear, CLEAR_NS), BLOCKS as usize);
    std::thread::sleep(Duration::from_millis(300));
    let before = l2_blocks(&admin);
    assert_eq!(before.len(), 2, "two L2 files: {before:?}");
    assert!(before.iter().all(|r| r.2 > 0 && !r.3), "both files hold blocks: {before:?}");
    let held: u64 = before.iter().map(|r| r.2).sum();
    let (drained, kept) = (&before[0], &before[1]);
    assert!(drained.1.ends_with("l2-0.lake"), "a region is named by its file: {before:?}");

    let out = lake(&["drain", "--admin", &admin, "--wait", "30", &drained.1]).unwrap();
    assert!(out.contains("\"event\":\"drained\""), "{out}");
    let after = l2_blocks(&admin);
    assert_eq!((after[0].0, after[0].2, after[0].3), (drained.0, 0, true), "{after:?}");
    assert_eq!((after[1].0, after[1].2, after[1].3), (kept.0, held, false), "moved, none dropped: {after:?}");

    // Every block comes back whole: the sealed ones opened from the
    // ciphertext that was moved.
    assert_eq!(fetch_all(&mut sealed, SEALED_NS), BLOCKS as usize);
    assert_eq!(fetch_all(&mut clear, CLEAR_NS), BLOCKS as usize);

    // Blocks saved now are demoted into the other file only.
    let mut later = engine(&mut pool, LATER_NS);
    save(&mut later, LATER_NS);
    wait_until("the later blocks demoted", || found(&mut later, LATER_NS).1 >= 8);
    let now = l2_blocks(&admin);
    assert_eq!(now[0].2, 0, "nothing new in the drained file: {now:?}");
    assert!(now[1].2 >= held + 8, "{now:?}");
    let top = lake(&["top", "--admin", &admin, "--once"]).unwrap();
    assert!(top.contains(&format!("draining region {}: 0 blocks left", drained.0)) && top.contains("(done)"), "{top}");

    // Bad requests are named; nothing changes.
    let l1 = regions(&admin).into_iter().find(|r| r.1 == "l1").unwrap().0.to_string();
    let bad = lake(&["drain", "--admin", &admin, &l1]).unwrap_err();
    assert!(bad.contains("not an L2 file"), "{bad}");
    let bad = lake(&["drain", "--admin", &admin, "/no/such/file"]).unwrap_err();
    assert!(bad.contains("no region is named"), "{bad}");
    // Used again.
    let out = lake(&["drain", "--admin", &admin, "--undo", &drained.1]).unwrap();
    assert!(out.contains("undrained"), "{out}");
    assert!(!l2_blocks(&admin)[0].3);
    drop((sealed, clear, later));
    pool.stop().unwrap();
}
