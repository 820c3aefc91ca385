//! Encryption at rest, every part real: a tenant's blocks
//! that the tier manager moves out of a small L1 lie in the L2 files as
//! AES-256-GCM ciphertext (their plaintext nowhere in the files, their
//! headers sealed), while another namespace without a key is stored in
//! the clear (so the search below can find plaintext where there is some);
//! they come back byte for byte, and the key is in no file. Forgetting the
//! key purges the tenant's blocks from every tier, from the headers alone,
//! and nothing else; blocks sealed with a key the pool no longer holds are
//! never served.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

#[path = "common/chain.rs"]
mod chain;
#[path = "common/scratch.rs"]
mod scratch;

use std::path::Path;
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::auth::at_rest::{DataKey, KeyChange};
use lake_dp::{BlockKey, NamespaceId, Tier};

use chain::save_chain;
use scratch::Scratch;

const PAYLOAD: usize = 60 * 1024;
const BLOCKS: u32 = 40;
const SEALED_NS: NamespaceId = NamespaceId(0x7e7e);
const CLEAR_NS: NamespaceId = NamespaceId(0x8e8e);

fn key(ns: NamespaceId, block: u32) -> BlockKey {
    let mut bytes = [0x5c; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    bytes[4..12].copy_from_slice(&ns.0.to_le_bytes());
    BlockKey(bytes)
}

/// A payload that says whose it is in its first bytes (what a search of
/// the raw files looks for), then a pattern.
fn payload(ns: NamespaceId, block: u32) -> Vec<u8> {
    let mark = marker(ns, block);
    let mut out: Vec<u8> = (0..PAYLOAD).map(|i| (i as u8).wrapping_mul(7) ^ block as u8).collect();
    out[..mark.len()].copy_from_slice(&mark);
    out
}

fn marker(ns: NamespaceId, block: u32) -> Vec<u8> {
    format!("PLAINTEXT-MARK ns {:016x} block {block:04}", ns.0).into_bytes()
}

fn data_key() -> DataKey {
    DataKey::from_bytes([0x99; 32])
}

fn start(dir: &Path, keys: Vec<(NamespaceId, DataKey)>) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 16,
        l2_slots_per_file: 64,
        local_agents: 2,
        remote_agents: 0,
        tenant_keys: keys,
        ..EmbeddedConfig::new(dir.to_path_buf())
    })
    .unwrap()
}

fn engine(pool: &mut EmbeddedPool, ns: NamespaceId) -> Agent {
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "tenant",
        namespace: ns,
        layout_fingerprint: 0x5eed,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).unwrap()
}

fn keys(ns: NamespaceId) -> Vec<BlockKey> {
    (0..BLOCKS).map(|i| key(ns, i)).collect()
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

/// Loads what `ns` has, a few blocks at a time (L1 holds 16 and moves
/// under the load), looked up again before each; every block delivered
/// must be its own bytes. Returns how many were delivered, and why the
/// last load stopped short.
fn fetch_all(agent: &mut Agent, ns: NamespaceId) -> (usize, Option<lake_agent::FetchFailure>) {
    let keys = keys(ns);
    let mut table = Vec::new();
    let (mut delivered, mut tries, mut failure) = (0, 0, None);
    while tries < 100 {
        tries += 1;
        let hits = agent.lookup(&keys, &mut table);
        if delivered >= hits {
            break;
        }
        let (from, end) = (delivered, hits.min(delivered + 4));
        let got = agent.fetch(&keys[from..end], &table[from..end], |i, bytes| {
            let i = from + i;
            assert_eq!(bytes, &payload(ns, i as u32)[..], "block {i} of {:x} came back wrong", ns.0);
        });
        delivered += got;
        if got < end - from {
            failure = agent.last_fetch_failure();
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    (delivered, failure)
}

fn files_contain(dir: &Path, needle: &[u8]) -> bool {
    ["l2-0.lake", "l2-1.lake"]
        .iter()
        .any(|f| std::fs::read(dir.join(f)).unwrap().windows(needle.len()).any(|w| w == needle))
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 20 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_tenants_blocks_lie_sealed_in_l2_come_back_whole_and_die_with_its_key() {
    let dir = std::env::temp_dir().join(format!("lake-cp-encryption-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _scratch = Scratch(dir.clone(), Vec::new());

    let mut first = start(&dir, vec![(SEALED_NS, data_key())]);
    let mut tenant = engine(&mut first, SEALED_NS);
    let mut other = engine(&mut first, CLEAR_NS);
    save(&mut tenant, SEALED_NS);
    save(&mut other, CLEAR_NS);
    // L1 holds 16: most of both namespaces are moved to L2.
    wait_until("both namespaces demoted", || {
        found(&mut tenant, SEALED_NS).1 >= 20 && found(&mut other, CLEAR_NS).1 >= 20
    });
    // The files hold the clear namespace's plaintext (the search works)…
    let clear_found = (0..BLOCKS).filter(|&i| files_contain(&dir, &marker(CLEAR_NS, i))).count();
    assert!(clear_found >= 20, "only {clear_found} plaintext blocks found in the clear namespace");
    // …and none of the tenant's.
    for i in 0..BLOCKS {
        assert!(!files_contain(&dir, &marker(SEALED_NS, i)), "block {i}'s plaintext is in the L2 files");
    }
    // Both come back byte for byte (the sealed ones opened on promotion).
    assert_eq!(fetch_all(&mut tenant, SEALED_NS).0, BLOCKS as usize);
    assert_eq!(fetch_all(&mut other, CLEAR_NS).0, BLOCKS as usize);
    // The key is nowhere on disk: it lives in the pool's memory only.
    let secret = [0x99u8; 32];
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            let bytes = std::fs::read(&path).unwrap();
            assert!(!bytes.windows(32).any(|w| w == secret), "the data key is in {}", path.display());
        }
    }

    // Forgetting the key purges the tenant from every tier, from headers
    // alone; the other namespace keeps its blocks.
    let clear_before = found(&mut other, CLEAR_NS).0;
    first.tenant_keys.change(KeyChange::Forget(SEALED_NS));
    wait_until("the tenant purged", || found(&mut tenant, SEALED_NS).0 == 0);
    assert_eq!(found(&mut other, CLEAR_NS).0, clear_before, "the purge touched another namespace");

    // A new key for the tenant: new blocks are sealed with it and read
    // back; then the key is replaced by one that did not seal them (the
    // old one lost): what lies sealed below L1 can no longer be opened,
    // and none of it is ever served.
    first.tenant_keys.change(KeyChange::Set(SEALED_NS, DataKey::from_bytes([0x42; 32])));
    save(&mut tenant, SEALED_NS);
    save(&mut other, CLEAR_NS);
    wait_until("the tenant demoted again", || found(&mut tenant, SEALED_NS).1 >= 20);
    first.tenant_keys.change(KeyChange::Set(SEALED_NS, DataKey::from_bytes([0x43; 32])));
    std::thread::sleep(Duration::from_millis(50));
    let (hits, in_l2) = found(&mut tenant, SEALED_NS);
    let (delivered, why) = fetch_all(&mut tenant, SEALED_NS);
    assert!(in_l2 > 0 && delivered < hits, "{delivered} of {hits} delivered, {in_l2} in L2");
    assert!(why.is_some(), "the loads did not fail");
    drop((tenant, other));
    let (stats, _) = first.stop().unwrap();
    assert!(stats.pool.sealed >= 40 && stats.pool.opened >= 1, "{:?}", stats.pool);
    assert!(stats.pool.purged >= 1 && stats.pool.unreadable >= 1, "{:?}", stats.pool);
}

/// Every whole object file under `dir`, read (the store writes each as
/// a `.part-` file renamed into place, and deletes some while this runs:
/// a file gone between the listing and the read is skipped).
fn all_files(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&at) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if !path.to_string_lossy().contains(".part-")
                && let Ok(bytes) = std::fs::read(&path)
            {
                out.push((path, bytes));
            }
        }
    }
    out
}

/// Saves each block of `ns` as a prefix of its own (any block may then
/// be the tier manager's victim, as in `l3_tier`).
fn save_roots(agent: &mut Agent, ns: NamespaceId) {
    for i in 0..BLOCKS {
        let payload = payload(ns, i);
        let block = || SaveBlock {
            key: key(ns, i),
            parent: BlockKey::NONE,
            block_index: 0,
            payload: SavePayload::Bytes(&payload),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while agent.save(&[block()]) != 1 {
            assert!(Instant::now() < deadline, "block {i} not saved in 30 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Loads each block of `ns` (a prefix of its own) that is found; returns
/// how many came back, from which tiers — each checked byte for byte.
fn fetch_each(agent: &mut Agent, ns: NamespaceId) -> (usize, [usize; 4]) {
    let (mut delivered, mut tiers) = (0, [0; 4]);
    for i in 0..BLOCKS {
        let keys = [key(ns, i)];
        let mut table = Vec::new();
        for _ in 0..50 {
            if agent.lookup(&keys, &mut table) == 0 {
                break;
            }
            let tier = table[0].tier as usize;
            let got = agent.fetch(&keys, &table[..1], |_, bytes| {
                assert_eq!(bytes, &payload(ns, i)[..], "block {i} came back wrong");
            });
            if got == 1 {
                delivered += 1;
                tiers[tier.min(3)] += 1;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    (delivered, tiers)
}

#[test]
fn blocks_written_from_l1_to_l3_are_sealed_too_and_read_back_through() {
    use lake_cp::tier::{L3WriteBack, TierConfig};
    use lake_dp::runner::config::L3Section;
    let base = std::env::temp_dir().join(format!("lake-cp-encryption-l3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let _scratch = Scratch(base.clone(), Vec::new());
    let l3 = base.join("l3");
    // Every saved block is also copied to L3 from L1 (eager write-back):
    // sealed on the L3 worker on its way out. L1 holds 48 and L2 16 of
    // the 80 blocks, so some are read back from L3.
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 48,
        l2_slots_per_file: 8,
        local_agents: 2,
        remote_agents: 0,
        tenant_keys: vec![(SEALED_NS, data_key())],
        tiers: TierConfig {
            high_percent: 80,
            low_percent: 60,
            l3_write_back: L3WriteBack::Eager,
            ..TierConfig::default()
        },
        l3: Some(L3Section { objects: 4096, ..L3Section::dir(l3.clone()) }),
        ..EmbeddedConfig::new(base.join("pool"))
    })
    .unwrap();
    let mut tenant = engine(&mut pool, SEALED_NS);
    let mut other = engine(&mut pool, CLEAR_NS);
    save_roots(&mut tenant, SEALED_NS);
    save_roots(&mut other, CLEAR_NS);
    let objects = |ns: NamespaceId| {
        let name = format!("{:016x}", ns.0);
        all_files(&l3).into_iter().filter(|(p, _)| p.to_string_lossy().contains(&name)).count()
    };
    wait_until("both namespaces in L3", || objects(SEALED_NS) >= 30 && objects(CLEAR_NS) >= 30);
    let files = all_files(&l3);
    let mut sealed = 0;
    for (path, bytes) in &files {
        let header = lake_dp::stored::decode_header(bytes).unwrap();
        if header.meta().namespace == SEALED_NS {
            assert!(header.seal().is_some(), "{} is not sealed", path.display());
            sealed += 1;
        } else {
            assert!(header.seal().is_none(), "{} is sealed without a key", path.display());
        }
    }
    assert!(sealed >= 30, "{sealed} sealed objects");
    let clear = (0..BLOCKS)
        .filter(|&i| files.iter().any(|(_, b)| b.windows(40).any(|w| w == &marker(CLEAR_NS, i)[..40])))
        .count();
    assert!(clear >= 30, "the clear namespace's plaintext found in only {clear} objects");
    for i in 0..BLOCKS {
        let mark = marker(SEALED_NS, i);
        assert!(!files.iter().any(|(_, b)| b.windows(mark.len()).any(|w| w == mark)), "block {i}'s plaintext is in L3");
    }
    // Read back through every tier, byte for byte.
    let (delivered, tiers) = fetch_each(&mut tenant, SEALED_NS);
    assert_eq!(delivered, BLOCKS as usize, "from tiers {tiers:?}");
    drop((tenant, other));
    let (stats, _) = pool.stop().unwrap();
    assert!(stats.pool.opened >= 1, "{:?}", stats.pool);
    println!("sealed blocks read back by tier (L0..L3): {tiers:?}, opened {}", stats.pool.opened);
}
