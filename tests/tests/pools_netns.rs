//! Two pools — each a `lake-cp` and a `lake-dp` with its arena, in its own
//! process and its own network namespace, joined by a veth pair: node 1's
//! control plane copies a prompt's blocks into node 2's L1 over the link
//! while the link is cut for a second and restored; every copy lands,
//! checked, node 2's engine loads the prompt byte for byte, and node 1
//! hears each copy landed. And two pools joined by two veth pairs (two
//! rails of the storage network): the copies spread over both, and node
//! 1's control plane accounts for each rail's bytes in its metrics. Needs
//! root (CI is); elsewhere it says why it skipped.

#![allow(clippy::cast_possible_truncation)] // small test sizes

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::model::replica::ReplicaWire;
use lake_dp::transport::tcp::Rail;
use lake_dp::{BlockKey, NamespaceId, Priority, Tier};
use lake_tests::netns::{Killed, Link, Star, child_lines};

const TEST: &str = "a_prompt_copied_between_pools_in_two_namespaces_survives_a_cut";
const BLOCKS: u32 = 12;
const PAYLOAD: usize = 200 * 1024;
const PORT: u16 = 7421;
const RAILS_TEST: &str = "copies_spread_over_two_rails_and_each_rail_is_accounted";
const RAILS_PORT: u16 = 7425;
const THREE_TEST: &str = "a_cut_link_to_one_peer_leaves_the_copies_to_another_unaffected";
const THREE_PORT: u16 = 7429;

fn key(i: u32) -> BlockKey {
    let mut bytes = [0x77; 16];
    bytes[..4].copy_from_slice(&i.to_le_bytes());
    BlockKey(bytes)
}

fn payload(i: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|b| (b as u32 ^ i.wrapping_mul(40_503)).to_le_bytes()[0]).collect()
}

/// The directory of the pool a node's process (`pid`) serves.
fn pool_dir(pid: u32) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("lake-netns-pool-{pid}"))
}

/// A node's process, killed when dropped; what its pool left in /dev/shm
/// and its directory go with it (a killed pool cannot remove them).
struct Node(Killed);

impl Drop for Node {
    fn drop(&mut self) {
        let child = &mut self.0.0;
        let _ = child.kill();
        let _ = child.wait();
        let dir = pool_dir(child.id());
        let (arena, mirror) = EmbeddedConfig::new(dir.clone()).shared_memory();
        for file in [arena, mirror] {
            let _ = std::fs::remove_file(file);
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}

fn pool(node: u32, listen: Option<SocketAddr>, peers: Vec<(u32, Vec<Rail>)>) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: 262_144,
        l1_slots: 32,
        l2_slots_per_file: 32,
        local_agents: 1,
        remote_agents: 0,
        transport_listen: listen,
        transport_peers: peers,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        node,
        ..EmbeddedConfig::new(pool_dir(std::process::id()))
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
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).expect("the engine attaches")
}

/// Node `node` (2 or 3): serves, says where its L1 is, loads the prompt
/// once it is published, says how many blocks were right; runs until
/// killed.
fn node_two(node: u32, listen: SocketAddr) {
    let mut pool = pool(node, Some(listen), Vec::new());
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

/// Node 1's storage-network rail bytes to node 2, from its `/metrics`.
fn rail_bytes(pool: &EmbeddedPool) -> Vec<u64> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(pool.metrics.expect("metrics served")).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let mut bytes = Vec::new();
    for rail in 0.. {
        let label = format!("lake_rail_bytes_total{{network=\"storage\",sender=\"dp\",node=\"2\",rail=\"{rail}\"}} ");
        let Some(line) = text.lines().find(|l| l.starts_with(&label)) else { break };
        bytes.push(line[label.len()..].trim().parse().unwrap());
    }
    bytes
}

/// Node 1's engine saves the prompt and waits until it is published; says
/// `SAVED`. The engine (kept attached) and the prompt's keys.
fn save_prompt(pool: &mut EmbeddedPool) -> (Agent, Vec<BlockKey>) {
    let mut engine = engine(pool);
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
    (engine, keys)
}

/// Asks node 1's control plane to copy every block of `keys` to any slot
/// of `node`'s L1 (its region and epoch).
fn copy_all(pool: &EmbeddedPool, keys: &[BlockKey], node: u32, (region, region_epoch): (u16, u64)) {
    let to = ReplicaWire { tier: Tier::L1Dram as u8, reserved: 0, region, node, region_epoch, slot: 0, generation: 0 };
    for key in keys {
        pool.copy_to(key, to, Priority::Replication).expect("the copy is asked");
    }
}

/// Node 1: saves the prompt, asks its control plane to copy every block to
/// node 2 over `rails`, waits to hear them all landed; with `report`, says
/// what its metrics say each rail carried.
fn node_one(rails: Vec<Rail>, region: u16, epoch: u64, report: bool) {
    let mut pool = pool(1, None, vec![(2, rails)]);
    let (_engine, keys) = save_prompt(&mut pool);
    let deadline = Instant::now() + Duration::from_secs(60);
    // The parent cuts the link on hearing that: the copies go into a cut.
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    copy_all(&pool, &keys, 2, (region, epoch));
    while pool.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed) < u64::from(BLOCKS) {
        assert!(Instant::now() < deadline, "node 1 never heard its copies landed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let landed = pool.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed);
    println!("COPIED {landed} {}", asked.elapsed().as_millis());
    if report {
        // The data plane reports its rails with its stats, once a second.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut bytes = rail_bytes(&pool);
        while bytes.iter().sum::<u64>() < u64::from(BLOCKS) * PAYLOAD as u64 {
            assert!(Instant::now() < deadline, "the rails' bytes never reached the metrics: {bytes:?}");
            std::thread::sleep(Duration::from_millis(200));
            bytes = rail_bytes(&pool);
        }
        println!("RAILS {}", bytes.iter().map(u64::to_string).collect::<Vec<_>>().join(" "));
    }
}

/// Node 1 of three: copies the prompt to node 2 over the first rail and to
/// node 3 over the second, each its own link.
fn hub(rails: &[Rail], targets: [(u16, u64); 2]) {
    let mut pool = pool(1, None, vec![(2, vec![rails[0]]), (3, vec![rails[1]])]);
    let (_engine, keys) = save_prompt(&mut pool);
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::sleep(Duration::from_millis(300));
    for (node, target) in [2u32, 3].into_iter().zip(targets) {
        copy_all(&pool, &keys, node, target);
    }
    while pool.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed) < 2 * u64::from(BLOCKS) {
        assert!(Instant::now() < deadline, "node 1 never heard all its copies landed");
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("COPIED {}", pool.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed));
}

/// A child's role: `two`, `leaf:NODE`, `hub:R2:E2:R3:E3` or
/// `one:REGION:EPOCH[:report]`.
fn child(role: &str) {
    let rails = Rail::parse_list(&std::env::var("LAKE_NETNS_RAILS").unwrap()).unwrap();
    let parts: Vec<&str> = role.split(':').collect();
    let any = |port: u16| SocketAddr::from(([0, 0, 0, 0], port));
    match parts[0] {
        "two" => node_two(2, any(rails[0].remote.port())),
        "leaf" => node_two(parts[1].parse().unwrap(), any(rails[0].remote.port())),
        "hub" => {
            let n: Vec<u64> = parts[1..5].iter().map(|p| p.parse().unwrap()).collect();
            hub(&rails, [(n[0] as u16, n[1]), (n[2] as u16, n[3])]);
        }
        "one" => node_one(rails, parts[1].parse().unwrap(), parts[2].parse().unwrap(), parts.len() > 3),
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_cut_link_to_one_peer_leaves_the_copies_to_another_unaffected() {
    if let Ok(role) = std::env::var("LAKE_NETNS_ROLE") {
        child(&role);
        return;
    }
    let star = match Star::new(2, 4, THREE_TEST) {
        Ok(star) => star,
        Err(why) => {
            println!("SKIPPED: network namespaces are not available here ({why})");
            return;
        }
    };
    let rails = format!("{},{}", star.rail(0, THREE_PORT), star.rail(1, THREE_PORT));
    const OURS: &[&str] = &["READY", "VERIFIED", "SAVED", "COPIED"];
    let mut leaves = Vec::new();
    let mut targets = Vec::new();
    for (leaf, node) in [(0, 2), (1, 3)] {
        let mut child =
            Node(Killed(star.spawn(&star.leaves[leaf], &format!("leaf:{node}"), &star.rail(leaf, THREE_PORT))));
        let mut lines = child_lines(&mut child.0.0, OURS);
        let ready = lines.next().expect("a leaf node starts");
        let parts: Vec<String> = ready.split(' ').map(str::to_owned).collect();
        assert_eq!(parts[0], "READY", "{ready}");
        targets.push(format!("{}:{}", parts[1], parts[2]));
        leaves.push((child, lines));
    }
    let mut one = Node(Killed(star.spawn(&star.hub, &format!("hub:{}:{}", targets[0], targets[1]), &rails)));
    let mut from_one = child_lines(&mut one.0.0, OURS);
    assert_eq!(from_one.next().as_deref(), Some("SAVED"));
    // Node 3's link is cut before the copies are asked, for 1.2 s (within
    // the transport's stall limit: its connections wait, then carry on).
    star.up(1, false).unwrap();
    let cut = Instant::now();
    let verified = leaves[0].1.next().expect("node 2 loads the prompt");
    let node_two_ms = cut.elapsed().as_millis();
    assert_eq!(verified, format!("VERIFIED {BLOCKS} {BLOCKS}"));
    assert!(node_two_ms < 1200, "node 2's copies waited for node 3's link: {node_two_ms} ms");
    std::thread::sleep(Duration::from_millis(1200).saturating_sub(cut.elapsed()));
    star.up(1, true).unwrap();
    let restored_ms = cut.elapsed().as_millis();
    let verified = leaves[1].1.next().expect("node 3 loads the prompt");
    let node_three_ms = cut.elapsed().as_millis();
    assert_eq!(verified, format!("VERIFIED {BLOCKS} {BLOCKS}"));
    assert!(node_three_ms >= restored_ms, "node 3 had its blocks through a cut link");
    assert_eq!(from_one.next(), Some(format!("COPIED {}", 2 * BLOCKS)));
    one.0.0.wait().unwrap();
    println!(
        "three nodes: node 2's {BLOCKS} copies landed {node_two_ms} ms into node 3's 1.2 s cut; node 3's \
         {node_three_ms} ms after it began ({restored_ms} ms restored)"
    );
}

#[test]
fn copies_spread_over_two_rails_and_each_rail_is_accounted() {
    if let Ok(role) = std::env::var("LAKE_NETNS_ROLE") {
        child(&role);
        return;
    }
    let link = match Link::new(2, 3, RAILS_TEST) {
        Ok(link) => link,
        Err(why) => {
            println!("SKIPPED: network namespaces are not available here ({why})");
            return;
        }
    };
    let rails = link.rails(RAILS_PORT);
    for rail in 0..2 {
        link.rate(rail, "200mbit").expect("a tbf rate limit");
    }
    const OURS: &[&str] = &["READY", "VERIFIED", "SAVED", "COPIED", "RAILS"];
    let mut two = Node(Killed(link.spawn(&link.b, "two", &rails)));
    let mut from_two = child_lines(&mut two.0.0, OURS);
    let ready = from_two.next().expect("node 2 starts");
    let parts: Vec<&str> = ready.split(' ').collect();
    assert_eq!(parts[0], "READY", "{ready}");
    let mut one = Node(Killed(link.spawn(&link.a, &format!("one:{}:{}:report", parts[1], parts[2]), &rails)));
    let mut from_one = child_lines(&mut one.0.0, OURS);
    assert_eq!(from_one.next().as_deref(), Some("SAVED"));
    let copied = from_one.next().expect("node 1 copies");
    assert!(copied.starts_with(&format!("COPIED {BLOCKS} ")), "{copied}");
    let accounted = from_one.next().expect("node 1 reports its rails");
    let bytes: Vec<u64> = accounted.split(' ').skip(1).map(|b| b.parse().unwrap()).collect();
    assert_eq!(bytes.len(), 2, "one figure per rail: {accounted}");
    assert!(bytes.iter().all(|&b| b > 0), "both rails carried copies: {bytes:?}");
    // Each block crossed once (plus frame headers; retries would add more).
    let payloads = u64::from(BLOCKS) * PAYLOAD as u64;
    assert!(bytes.iter().sum::<u64>() < 2 * payloads, "{bytes:?} for {payloads} bytes of blocks");
    let verified = from_two.next().expect("node 2 loads the prompt");
    assert_eq!(verified, format!("VERIFIED {BLOCKS} {BLOCKS}"), "every block loaded, every byte right");
    one.0.0.wait().unwrap();
    println!("{BLOCKS} blocks copied over two rails, {bytes:?} bytes on each, all loaded");
}

#[test]
fn a_prompt_copied_between_pools_in_two_namespaces_survives_a_cut() {
    if let Ok(role) = std::env::var("LAKE_NETNS_ROLE") {
        child(&role);
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
    let mut two = Node(Killed(link.spawn(&link.b, "two", &rails)));
    let mut from_two = child_lines(&mut two.0.0, OURS);
    let ready = from_two.next().expect("node 2 starts");
    let parts: Vec<&str> = ready.split(' ').collect();
    assert_eq!(parts[0], "READY", "{ready}");
    let mut one = Node(Killed(link.spawn(&link.a, &format!("one:{}:{}", parts[1], parts[2]), &rails)));
    let mut from_one = child_lines(&mut one.0.0, OURS);
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
    one.0.0.wait().unwrap();
    println!(
        "a {BLOCKS}-block prompt copied from node 1 to node 2 across a 1 s cut: all landed in {took_ms} ms and loaded"
    );
}
