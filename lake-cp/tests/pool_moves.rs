//! Where the pool keeps a block across nodes, with real processes: a
//! chain another node reads moves to it (the holder's copies go) and a
//! shared prefix is copied; a copy waiting to go is read by no other
//! node; a full node's victims spill into the member with room; a prefix
//! whose front moves away while its tail is pulled still lands whole.
//! Nodes are `lake serve`, members of a cluster in a real etcd under a
//! `lake summary` leader with its default placement.

#[path = "common/cluster.rs"]
mod cluster;
#[path = "common/etcd.rs"]
mod etcd_server;
#[path = "common/pool.rs"]
mod pool;
#[path = "common/scratch.rs"]
mod scratch;
#[path = "common/supervise.rs"]
mod supervise;

use std::time::{Duration, Instant};

use lake_agent::{SaveBlock, SavePayload};
use lake_dp::mirror::view::{Holder, Where};
use lake_dp::{BlockKey, NodeId};

use cluster::{Proc, field, leader};
use etcd_server::EtcdServer;
use pool::{agent, key, node_in, payload, sample, save, save_shared, start_nodes, tier_here, wait_places};
use scratch::Scratch;

/// A cluster `name` of `count` nodes (`room(node)` their flags) led by a
/// `lake summary` with its default placement, every node a member; its
/// parts stop in the order they are declared.
struct Members {
    nodes: Vec<(Proc, String)>,
    leader: Proc,
    _scratch: Scratch,
    _etcd: EtcdServer,
}

/// [`Members`], or none where no etcd runs here.
fn members(name: &str, count: u32, room: impl Fn(u32) -> &'static [&'static str]) -> Option<Members> {
    let etcd = EtcdServer::start(name)?;
    let endpoint = etcd.endpoint();
    let base = std::env::temp_dir().join(format!("lake-{name}-{}", std::process::id()));
    let scratch = Scratch(base.clone(), Vec::new());
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let leader = leader(&listen, &endpoint, name, None, &[]);
    let nodes = start_nodes(&base, (&listen, &endpoint, name), count, room);
    leader.wait_for("every node a member", Duration::from_secs(20), |l| {
        l.contains("\"event\":\"summary\"")
            && (1..=count).all(|n| node_in(l, n).is_some_and(|v| v.contains("\"member\":true")))
    });
    Some(Members { nodes, leader, _scratch: scratch, _etcd: etcd })
}

/// The sample of `name` with label `label` in `/metrics` at `address`.
fn sample_of(address: &str, name: &str, label: &str) -> u64 {
    sample(address, &format!("{name}{{{label}}}"))
}

#[test]
fn a_chain_another_node_reads_moves_to_it_and_back_and_a_shared_prefix_is_copied_to_it() {
    // `lake summary`'s default placement: a block stays where it was last
    // read.
    let Some(pool) = members("moves", 2, |_| &["--l1-slots", "256"]) else { return };
    let serving: Vec<&str> = pool.nodes.iter().map(|(_, s)| s.as_str()).collect();
    let metrics: Vec<String> = serving.iter().map(|s| field(s, "metrics")).collect();
    let chain: Vec<BlockKey> = (0..8).map(|i| key(1, i)).collect();
    save(serving[0], 1, 0..8);
    // The whole chain on `node`, as another node's engines see the pool.
    let all_on = |places: &[Where], node| {
        places.len() == chain.len()
            && places.iter().all(|w| *w == Where::Remote(Holder { node: NodeId(node), tier: lake_dp::Tier::L1Dram }))
    };
    let seen = wait_places(serving[1], &chain, Duration::from_secs(20), |p| all_on(p, 1));
    assert!(all_on(&seen, 1), "node 2's engines see node 1's chain: {seen:?}");

    // Each reader in turn pulls the chain, reads it byte for byte from its
    // own L1, and the chain then lives there only: the holder's copies go.
    for (reader, holder, reader_node) in [(1usize, 0usize, 2u32), (0, 1, 1)] {
        let mut agent = agent(serving[reader]);
        let mut table = Vec::new();
        let landed = agent.pull_cluster(&chain, Duration::from_secs(5), &mut table);
        assert_eq!(landed, 8, "node {} pulled {landed} of 8", reader + 1);
        let got = agent.fetch(&chain, &table, |_, bytes| assert_eq!(bytes, &payload(1)[..]));
        assert_eq!(got, 8, "{:?}", agent.last_fetch_failure());
        drop(agent);
        let deadline = Instant::now() + Duration::from_secs(10);
        while chain.iter().any(|&k| tier_here(serving[holder], k).is_some()) {
            assert!(Instant::now() < deadline, "node {}'s copies stayed after the chain moved", holder + 1);
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(chain.iter().all(|&k| tier_here(serving[reader], k) == Some(lake_dp::Tier::L1Dram)));
        assert_eq!(sample(&metrics[holder], "lake_blocks_moved_to_readers_total"), 8);
        // The old holder's engines find it on the reader now.
        let seen = wait_places(serving[holder], &chain, Duration::from_secs(10), |p| all_on(p, reader_node));
        assert!(all_on(&seen, reader_node), "{seen:?}");
    }

    // A shared prefix: a system prompt of two blocks that two requests
    // continue on node 1. Node 2 pulls the prompt and one continuation:
    // the continuation moves, the prompt is copied — node 1's other
    // request still starts with it.
    let prompt = [key(1, 998), key(1, 999)];
    save_shared(agent(serving[0]), 1, &prompt, 2);
    let read = [prompt[0], prompt[1], key(1, 1000)];
    let seen = wait_places(serving[1], &read, Duration::from_secs(20), |p| p.len() == 3);
    assert_eq!(seen.len(), 3, "node 2's engines see node 1's shared prefix: {seen:?}");
    let mut reader = agent(serving[1]);
    let mut table = Vec::new();
    assert_eq!(reader.pull_cluster(&read, Duration::from_secs(5), &mut table), 3);
    assert_eq!(reader.fetch(&read, &table, |_, bytes| assert_eq!(bytes, &payload(1)[..])), 3);
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(10);
    while tier_here(serving[0], key(1, 1000)).is_some() {
        assert!(Instant::now() < deadline, "node 1's copy of the continuation stayed after it moved");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(sample(&metrics[0], "lake_blocks_moved_to_readers_total"), 9);
    assert_eq!(sample(&metrics[0], "lake_pulled_blocks_kept_total"), 2);
    for (node, serving) in [(1, serving[0]), (2, serving[1])] {
        for key in prompt {
            assert_eq!(tier_here(serving, key), Some(lake_dp::Tier::L1Dram), "the prompt on node {node}");
        }
    }
    assert_eq!(tier_here(serving[0], key(1, 1001)), Some(lake_dp::Tier::L1Dram), "the other request's block");
}

#[test]
fn a_copy_waiting_to_go_is_read_by_no_other_node_and_the_pool_keeps_one_copy_of_each_block() {
    let Some(pool) = members("waiting", 3, |_| &["--l1-slots", "256"]) else { return };
    let serving: Vec<&str> = pool.nodes.iter().map(|(_, s)| s.as_str()).collect();
    let metrics: Vec<String> = serving.iter().map(|s| field(s, "metrics")).collect();
    let chain: Vec<BlockKey> = (0..8).map(|i| key(1, i)).collect();
    save(serving[0], 1, 0..8);
    // Blocks `range` of the chain all held by `node` alone, in L1, as an
    // engine of another node sees the pool.
    let on = |places: &[Where], range: std::ops::Range<usize>, node| {
        places.len() == chain.len()
            && places[range]
                .iter()
                .all(|w| *w == Where::Remote(Holder { node: NodeId(node), tier: lake_dp::Tier::L1Dram }))
    };
    for reader in [1, 2] {
        let seen = wait_places(serving[reader], &chain, Duration::from_secs(20), |p| on(p, 0..8, 1));
        assert!(on(&seen, 0..8, 1), "node {}'s engines see node 1's chain: {seen:?}", reader + 1);
    }

    // Node 2 reads the chain's first six blocks: they move there, but
    // node 1's copies of them wait to go — blocks 6 and 7, not read,
    // continue them there, and a copy goes once it is a leaf.
    let front = &chain[..6];
    let mut reader = agent(serving[1]);
    let mut table = Vec::new();
    assert_eq!(reader.pull_cluster(front, Duration::from_secs(5), &mut table), 6);
    assert_eq!(reader.fetch(front, &table, |_, bytes| assert_eq!(bytes, &payload(1)[..])), 6);
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(10);
    while sample(&metrics[0], "lake_blocks_moved_to_readers_total") < 6 {
        assert!(Instant::now() < deadline, "node 1 never counted the six blocks moved");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(sample(&metrics[0], "lake_tier_placed_away_waiting"), 6);
    assert!(front.iter().all(|&k| tier_here(serving[0], k) == Some(lake_dp::Tier::L1Dram)), "node 1's copies wait");

    // Node 3's engines find the six on node 2 alone: the copies waiting on
    // node 1 are not offered to the pool. Blocks 6 and 7 are on node 1.
    let seen = wait_places(serving[2], &chain, Duration::from_secs(10), |p| on(p, 0..6, 2) && on(p, 6..8, 1));
    assert!(on(&seen, 0..6, 2) && on(&seen, 6..8, 1), "node 3's engines see {seen:?}");

    // Node 3 reads the whole chain: each block moves to it from the node
    // whose copy is the pool's, and the pool is left with one copy of
    // each, node 3's.
    let mut reader = agent(serving[2]);
    assert_eq!(reader.pull_cluster(&chain, Duration::from_secs(5), &mut table), 8);
    assert_eq!(reader.fetch(&chain, &table, |_, bytes| assert_eq!(bytes, &payload(1)[..])), 8);
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(10);
    for (node, serving) in [(1, serving[0]), (2, serving[1])] {
        loop {
            let kept: Vec<usize> = (0..8).filter(|&i| tier_here(serving, chain[i]).is_some()).collect();
            if kept.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "node {node} keeps blocks {kept:?} that moved to node 3");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert!(chain.iter().all(|&k| tier_here(serving[2], k) == Some(lake_dp::Tier::L1Dram)));
    assert_eq!(sample(&metrics[0], "lake_tier_placed_away_waiting"), 0);
}

#[test]
fn a_full_nodes_victims_spill_into_the_member_with_room_and_the_pool_loses_none() {
    // Node 1 holds 64 blocks in L1 and 2 × 16 in L2; node 2, ten times
    // that.
    let Some(pool) = members("spills", 2, |node| {
        if node == 1 { &["--l1-slots", "64", "--l2-slots", "16"] } else { &["--l1-slots", "640", "--l2-slots", "160"] }
    }) else {
        return;
    };
    let (nodes, leader) = (&pool.nodes, &pool.leader);
    let serving: Vec<&str> = nodes.iter().map(|(_, s)| s.as_str()).collect();
    let metrics: Vec<String> = serving.iter().map(|s| field(s, "metrics")).collect();
    leader.wait_for("two members taking placements", Duration::from_secs(20), |l| {
        l.contains("\"event\":\"summary\"")
            && (1..=2).all(|n| node_in(l, n).is_some_and(|v| v.contains("\"takes_placements\":true")))
    });

    // 100 prompts of two blocks each, saved on node 1: twice what it holds.
    let mut saver = agent(serving[0]);
    let bytes = payload(1);
    let mut keys = Vec::new();
    for p in 0..100 {
        for i in 0..2 {
            let block = SaveBlock {
                key: key(1, p * 2 + i),
                parent: if i == 0 { BlockKey::NONE } else { key(1, p * 2) },
                block_index: i,
                payload: SavePayload::Bytes(&bytes),
            };
            keys.push(block.key);
            let deadline = Instant::now() + Duration::from_secs(20);
            while saver.save(&[block]) == 0 {
                assert!(Instant::now() < deadline, "prompt {p} block {i} not saved in 20 s");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    drop(saver);

    // Every block is in the pool once the spills settled (each offered
    // answered): node 1's victims went to node 2, whose engines read them
    // from their own L1 byte for byte.
    let spills = |event: &str| sample_of(&metrics[0], "lake_l1_spills_total", &format!("event=\"{event}\""));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = (0, 0);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let now = (spills("offered"), spills("landed") + spills("unplaced"));
        if (now.0 == now.1 && now == last) || Instant::now() > deadline {
            break;
        }
        last = now;
    }
    let (landed, unplaced) = (spills("landed"), spills("unplaced"));
    let mut finder = agent(serving[1]);
    let mut places = Vec::new();
    let held = keys.iter().filter(|k| finder.lookup_cluster(std::slice::from_ref(k), &mut places) == 1).count();
    let on_two: Vec<BlockKey> = keys.iter().copied().filter(|&k| tier_here(serving[1], k).is_some()).collect();
    let on_one = keys.iter().filter(|&&k| tier_here(serving[0], k).is_some()).count();
    println!("spills: {} of 200 on node 1, {} on node 2; {landed} spills landed, {unplaced} not", on_one, on_two.len());
    assert_eq!(held, keys.len(), "the pool lost blocks node 1 had no room for");
    assert!(on_one <= 96 && on_two.len() >= 100, "node 1 holds {on_one}, node 2 {}", on_two.len());
    assert!(landed >= on_two.len() as u64 && unplaced == 0, "{landed} landed, {unplaced} unplaced");
    let mut reader = agent(serving[1]);
    let mut table = Vec::new();
    for k in on_two.iter().take(8) {
        assert_eq!(reader.lookup(std::slice::from_ref(k), &mut table), 1);
        let got = reader.fetch(std::slice::from_ref(k), &table, |_, b| assert_eq!(b, &payload(1)[..]));
        assert_eq!(got, 1, "{:?}", reader.last_fetch_failure());
    }
    let summary = leader.wait_for("spills counted", Duration::from_secs(5), |l| l.contains("\"event\":\"summary\""));
    assert!(summary.contains("\"spills\":{\"placed\":"), "{summary}");
}

#[test]
fn a_prefix_whose_front_moves_away_while_its_tail_is_pulled_still_lands_whole() {
    let Some(pool) = members("front", 2, |_| &["--l1-slots", "2048"]) else { return };
    let serving: Vec<String> = pool.nodes.iter().map(|(_, s)| s.clone()).collect();
    let mut two = agent(&serving[1]);
    let mut table = Vec::new();
    // Each round: a chain whose tail node 2 read (it moved there). Node
    // 1's engine asks for the whole chain: it holds the front, and pulls
    // the tail — and while the tail comes, node 2 reads the front, which
    // leaves node 1. It is pulled back from node 2.
    for round in 10..13 {
        let chain: Vec<BlockKey> = (0..401).map(|i| key(round, i)).collect();
        save(&serving[0], round, 0..401);
        let seen = wait_places(&serving[1], &chain, Duration::from_secs(20), |p| p.len() == chain.len());
        assert_eq!(seen.len(), chain.len(), "node 2's engines see node 1's chain");
        // More blocks at once than the holder's data plane has sends.
        let landed = two.pull_cluster(&chain[1..], Duration::from_secs(10), &mut table);
        assert_eq!(landed, 400, "round {round}: node 2 landed {landed} of the tail's 400");
        // Node 1 may keep copies of the tail it marked to go; the rest it
        // sees on node 2.
        let seen = wait_places(&serving[0], &chain[1..], Duration::from_secs(20), |p| p.len() == 400);
        assert_eq!(seen.len(), 400, "node 1's engines see the tail");
        assert_eq!(tier_here(&serving[0], chain[0]), Some(lake_dp::Tier::L1Dram));
        let asking = std::sync::Arc::new(std::sync::Barrier::new(2));
        let reader = {
            let (serving, chain, asking) = (serving[0].clone(), chain.clone(), asking.clone());
            std::thread::spawn(move || {
                let mut one = agent(&serving);
                let mut table = Vec::new();
                asking.wait();
                let started = Instant::now();
                let landed = one.pull_cluster(&chain, Duration::from_secs(10), &mut table);
                let got = one.fetch(&chain[..landed], &table, |_, bytes| assert_eq!(bytes, &payload(round)[..]));
                (landed, got, started.elapsed())
            })
        };
        asking.wait();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(two.pull_cluster(&chain[..1], Duration::from_secs(10), &mut table), 1);
        let (landed, got, took) = reader.join().unwrap();
        assert_eq!((landed, got), (401, 401), "round {round}: node 1 landed {landed} of 401 in {took:?}");
    }
}
