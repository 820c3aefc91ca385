//! A pool of several `lake serve` nodes, members of one cluster in a real
//! etcd under a `lake summary` leader, and what the pool tests read of it:
//! chains saved, where each block is as an engine sees the pool, a node's
//! metrics.

use std::time::{Duration, Instant};

use lake_agent::{Agent, SaveBlock, SavePayload};
use lake_dp::mirror::view::Where;
use lake_dp::{BlockKey, NamespaceId};

use crate::cluster::{Proc, agent_of, http_get};

/// `node`'s entry in a summary line: its JSON object.
pub(crate) fn node_in(line: &str, node: u32) -> Option<String> {
    let start = line.find(&format!("{{\"node\":{node},"))?;
    let end = start + line[start..].find('}')?;
    Some(line[start..=end].to_owned())
}

pub(crate) fn key(node: u32, i: u32) -> BlockKey {
    let mut bytes = [0x77; 16];
    bytes[..4].copy_from_slice(&node.to_le_bytes());
    bytes[4..8].copy_from_slice(&i.to_le_bytes());
    BlockKey(bytes)
}

pub(crate) fn agent(serving: &str) -> Agent {
    agent_of(serving, NamespaceId(31), "summary-test")
}

pub(crate) fn payload(node: u32) -> Vec<u8> {
    vec![node.to_le_bytes()[0]; 16 * 1024]
}

/// Saves the chain of `node`'s blocks `blocks` (each continues the one
/// before).
pub(crate) fn save(serving: &str, node: u32, blocks: std::ops::Range<u32>) {
    let mut agent = agent(serving);
    let payload = payload(node);
    for i in blocks {
        let block = SaveBlock {
            key: key(node, i),
            parent: if i == 0 { BlockKey::NONE } else { key(node, i - 1) },
            block_index: i,
            payload: SavePayload::Bytes(&payload),
        };
        assert_eq!(agent.save(&[block]), 1, "node {node} block {i}");
    }
}

/// Where the blocks of `keys` are, as an engine of the pool `serving` sees
/// the whole pool, once `done` holds (within `within`).
pub(crate) fn wait_places(
    serving: &str,
    keys: &[BlockKey],
    within: Duration,
    done: impl Fn(&[Where]) -> bool,
) -> Vec<Where> {
    let mut agent = agent(serving);
    let mut places = Vec::new();
    let deadline = Instant::now() + within;
    loop {
        agent.lookup_cluster(keys, &mut places);
        if done(&places) || Instant::now() > deadline {
            return places;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A shared prefix `agent` saves on `node`: the chain `prompt`, its last
/// block continued by `children` blocks (`node`'s blocks 1000 on).
pub(crate) fn save_shared(mut agent: Agent, node: u32, prompt: &[BlockKey], children: u32) {
    let payload = payload(node);
    let block =
        |key, parent, block_index| SaveBlock { key, parent, block_index, payload: SavePayload::Bytes(&payload) };
    let mut parent = BlockKey::NONE;
    for (i, &key) in (0..).zip(prompt) {
        assert_eq!(agent.save(&[block(key, parent, i)]), 1);
        parent = key;
    }
    let at = u32::try_from(prompt.len()).unwrap();
    for c in 0..children {
        assert_eq!(agent.save(&[block(key(node, 1000 + c), parent, at)]), 1);
    }
}

/// The value of the sample `name` (with its labels, as exposed) in
/// `/metrics` at `address`.
pub(crate) fn sample(address: &str, name: &str) -> u64 {
    let metrics = http_get(address, "/metrics").1;
    metrics.lines().find_map(|l| l.strip_prefix(&format!("{name} "))).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// The tier `serving`'s own mirror holds `key` in (none: not here).
pub(crate) fn tier_here(serving: &str, key: BlockKey) -> Option<lake_dp::Tier> {
    let mut table = Vec::new();
    (agent(serving).mirror().lookup(&[key], &mut table) == 1).then(|| table[0].tier)
}

/// `count` `lake serve` nodes (1 to `count`, 16 KiB blocks, `room(node)`
/// their flags for L1 and L2 slots), members of `cluster` in etcd at
/// `endpoint` reporting to the summary at `listen`, each a transport peer
/// of the others: each process and its `serving` line.
pub(crate) fn start_nodes(
    base: &std::path::Path,
    (listen, endpoint, cluster): (&str, &str, &str),
    count: u32,
    room: impl Fn(u32) -> &'static [&'static str],
) -> Vec<(Proc, String)> {
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let transports: Vec<String> = (0..count).map(|_| format!("127.0.0.1:{}", port())).collect();
    (1..=count)
        .map(|node| {
            let dir = base.join(format!("node{node}")).display().to_string();
            let name = node.to_string();
            let mut args = vec!["serve", "--metrics", "127.0.0.1:0", "--node", &name, "--dir", &dir];
            args.extend(["--block-bytes", "16384"]);
            args.extend(room(node));
            args.extend(["--summary-to", listen, "--etcd", endpoint, "--cluster", cluster, "--member-ttl", "2"]);
            let mut owned: Vec<String> = vec!["--transport-listen".into(), transports[node as usize - 1].clone()];
            for other in (1..=count).filter(|&o| o != node) {
                owned.push("--transport-peer".into());
                owned.push(format!("{other}={}", transports[other as usize - 1]));
            }
            args.extend(owned.iter().map(String::as_str));
            let proc = Proc::start(&args);
            let serving = proc.wait_for("a node serves", Duration::from_secs(20), |l| l.contains("\"serving\""));
            (proc, serving)
        })
        .collect()
}
