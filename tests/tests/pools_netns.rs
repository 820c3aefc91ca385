//! Two pools — each a `lake-cp` and a `lake-dp` with its arena, in its own
//! process and its own network namespace, joined by a veth pair: node 1's
//! control plane copies a prompt's blocks into node 2's L1 over the link
//! while the link is cut for a second and restored; every copy lands,
//! checked, node 2's engine loads the prompt byte for byte, and node 1
//! hears each copy landed. Needs root (CI is); elsewhere it says why it
//! skipped.

#![allow(clippy::cast_possible_truncation)] // small test sizes

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_dp::model::replica::ReplicaWire;
use lake_dp::{BlockKey, NamespaceId, Priority, Tier};
use lake_tests::netns::{Killed, Link, child_lines};

const TEST: &str = "a_prompt_copied_between_pools_in_two_namespaces_survives_a_cut";
const BLOCKS: u32 = 12;
const PAYLOAD: usize = 200 * 1024;
const PORT: u16 = 7421;

fn key(i: u32) -> BlockKey {
    let mut bytes = [0x77; 16];
    bytes[..4].copy_from_slice(&i.to_le_bytes());
    BlockKey(bytes)
}

fn payload(i: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|b| (b as u32 ^ i.wrapping_mul(40_503)).to_le_bytes()[0]).collect()
}

fn pool(node: u32, listen: Option<SocketAddr>, peers: Vec<(u32, SocketAddr)>) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: 262_144,
        l1_slots: 32,
        l2_slots_per_file: 32,
        local_agents: 1,
        remote_agents: 0,
        transport_listen: listen,
        transport_peers: peers,
        node,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-netns-pool-{node}-{}", std::process::id())))
    })
    .expect("the pool starts")
}

fn engine(pool: &mut EmbeddedPool) -> Agent {
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "engine",
        namespace: NamespaceId(5),
        layout_fingerprint: 0xabc,
        segment_bytes: 32 * 1024,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).expect("the engine attaches")
}

/// Node 2: serves, says where its L1 is, loads the prompt once it is
/// published, says how many blocks were right; runs until killed.
fn node_two(listen: SocketAddr) {
    let mut pool = pool(2, Some(listen), Vec::new());
    let mut engine = engine(&mut pool);
    println!("READY {} {}", engine.arena_region(), engine.arena_epoch());
    let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.lookup(&keys, &mut table) < BLOCKS as usize {
        assert!(Instant::now() < deadline, "the copies never all arrived");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut right = 0;
    let delivered = engine.fetch(&keys, &table, |i, bytes| right += usize::from(bytes == payload(i as u32)));
    println!("VERIFIED {delivered} {right}");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Node 1: saves the prompt, asks its control plane to copy every block to
/// node 2, waits to hear them all landed.
fn node_one(peer: SocketAddr, region: u16, epoch: u64) {
    let mut pool = pool(1, None, vec![(2, peer)]);
    let mut engine = engine(&mut pool);
    let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
    let payloads: Vec<Vec<u8>> = (0..BLOCKS).map(payload).collect();
    let blocks: Vec<SaveBlock<'_>> = (0..BLOCKS as usize)
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: i as u32,
            payload: SavePayload::Bytes(&payloads[i]),
        })
        .collect();
    assert_eq!(engine.save(&blocks), BLOCKS as usize);
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.lookup(&keys, &mut table) < BLOCKS as usize {
        assert!(Instant::now() < deadline, "the saves were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("SAVED");
    // The parent cuts the link on hearing that: the copies go into a cut.
    std::thread::sleep(Duration::from_millis(300));
    let to = ReplicaWire {
        tier: Tier::L1Dram as u8,
        reserved: 0,
        region,
        node: 2,
        region_epoch: epoch,
        slot: 0,
        generation: 0,
    };
    let asked = Instant::now();
    for key in &keys {
        pool.copy_to(key, to, Priority::Replication).expect("the copy is asked");
    }
    while pool.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed) < u64::from(BLOCKS) {
        assert!(Instant::now() < deadline, "node 1 never heard its copies landed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let landed = pool.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed);
    println!("COPIED {landed} {}", asked.elapsed().as_millis());
}

#[test]
fn a_prompt_copied_between_pools_in_two_namespaces_survives_a_cut() {
    if let Ok(role) = std::env::var("LAKE_NETNS_ROLE") {
        let rails = std::env::var("LAKE_NETNS_RAILS").unwrap();
        let (_, remote) = rails.split_once('>').unwrap();
        let address: SocketAddr = remote.parse().unwrap();
        let parts: Vec<&str> = role.split(':').collect();
        match parts[0] {
            "two" => node_two(SocketAddr::from(([0, 0, 0, 0], address.port()))),
            "one" => node_one(address, parts[1].parse().unwrap(), parts[2].parse().unwrap()),
            other => panic!("unknown role {other}"),
        }
        return;
    }
    let link = match Link::new(1, 2, TEST) {
        Ok(link) => link,
        Err(why) => {
            println!("SKIPPED: network namespaces are not available here ({why})");
            return;
        }
    };
    let rails = link.rails(PORT);
    link.rate(0, "200mbit").expect("a tbf rate limit");
    const OURS: &[&str] = &["READY", "VERIFIED", "SAVED", "COPIED"];
    let mut two = Killed(link.spawn(&link.b, "two", &rails));
    let mut from_two = child_lines(&mut two.0, OURS);
    let ready = from_two.next().expect("node 2 starts");
    let parts: Vec<&str> = ready.split(' ').collect();
    assert_eq!(parts[0], "READY", "{ready}");
    let mut one = Killed(link.spawn(&link.a, &format!("one:{}:{}", parts[1], parts[2]), &rails));
    let mut from_one = child_lines(&mut one.0, OURS);
    assert_eq!(from_one.next().as_deref(), Some("SAVED"));
    // Cut before node 1 asks for the copies (it waits 300 ms): they are
    // asked and sent into the cut; restored a second later.
    link.up(0, false).unwrap();
    let cut = Instant::now();
    std::thread::sleep(Duration::from_millis(1000));
    link.up(0, true).unwrap();
    let copied = from_one.next().expect("node 1 ends");
    let parts: Vec<&str> = copied.split(' ').collect();
    assert_eq!(parts[..2], ["COPIED", &BLOCKS.to_string()], "{copied}");
    // Asked 300 ms into a 1 s cut: they crossed it.
    let took_ms: u64 = parts[2].parse().unwrap();
    assert!(took_ms >= 500, "the copies landed in {took_ms} ms: the cut missed them");
    assert!(cut.elapsed() >= Duration::from_millis(1000));
    let verified = from_two.next().expect("node 2 loads the prompt");
    assert_eq!(verified, format!("VERIFIED {BLOCKS} {BLOCKS}"), "every block loaded, every byte right");
    one.0.wait().unwrap();
    println!(
        "a {BLOCKS}-block prompt copied from node 1 to node 2 across a 1 s cut: all landed in {took_ms} ms and loaded"
    );
}
