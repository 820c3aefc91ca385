//! P→D's receiving half: a peer (a prefill node's agent) sends blocks over
//! TCP to any slot of this node's L1; the node's `lake-dp` reserves a slot
//! for each, lands it, checks it (header and every CRC) and reports it to
//! its `lake-cp`, which publishes it — and this node's engine finds the
//! prefix in shared memory and loads it, byte for byte. A block whose
//! bytes lie is refused as corrupt and never published.

#![allow(clippy::cast_possible_truncation)] // small test sizes

#[path = "common/metrics.rs"]
mod metrics;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::runner::RunnerStats;
use lake_dp::stored::{ObjectMeta, encode_object, object_bytes};
use lake_dp::transport::frame::BlockAddr;
use lake_dp::transport::tcp::{Outgoing, TcpConfig, TcpTransport};
use lake_dp::transport::{ANY_SLOT, Completion, Landing, TransferError};
use lake_dp::{BlockKey, NamespaceId, ObjectKind, Priority, RegionId};

const PAYLOAD: usize = 100 * 1024;

fn key(i: u32) -> BlockKey {
    let mut bytes = [0x3c; 16];
    bytes[..4].copy_from_slice(&i.to_le_bytes());
    BlockKey(bytes)
}

fn payload(i: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|b| (b as u32).wrapping_mul(i + 7).to_le_bytes()[1]).collect()
}

/// Block `i` of the prompt as the prefill node's slot holds it.
fn object(i: u32) -> Vec<u8> {
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: key(i),
        parent_key: if i == 0 { BlockKey::NONE } else { key(i - 1) },
        block_index: i,
        namespace: NamespaceId(7),
        layout_fingerprint: 0xfeed,
        region: RegionId(40),
        region_epoch: 3,
        slot: 100 + i,
        generation: 9,
        committed_unix_ns: 1,
        payload_len: PAYLOAD as u64,
        segment_bytes: 16 * 1024,
    };
    let mut out = vec![0u8; object_bytes(PAYLOAD as u64) as usize];
    let len = encode_object(&meta, &payload(i), &mut out).unwrap();
    out.truncate(len);
    out
}

/// The sender keeps nothing landing: it only sends.
struct NoLanding;

impl Landing for NoLanding {
    fn place(&mut self, _: &BlockAddr, _: u64) -> Result<*mut u8, lake_dp::transport::frame::AckStatus> {
        Err(lake_dp::transport::frame::AckStatus::Refused)
    }
    fn landed(&mut self, _: &BlockAddr, _: u64) -> lake_dp::transport::frame::AckStatus {
        lake_dp::transport::frame::AckStatus::Refused
    }
    fn abandoned(&mut self, _: &BlockAddr) {}
}

fn free_port() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// A pool of node `node`, its transport listening on `listen` and sending
/// to `peers` (node, address).
fn start(name: &str, node: u32, listen: Option<SocketAddr>, peers: Vec<(u32, SocketAddr)>) -> EmbeddedPool {
    start_keyed(name, node, listen, peers, None)
}

/// [`start`], its links authenticated with `key` if given.
fn start_keyed(
    name: &str,
    node: u32,
    listen: Option<SocketAddr>,
    peers: Vec<(u32, SocketAddr)>,
    key: Option<lake_dp::auth::LinkKey>,
) -> EmbeddedPool {
    start_with(name, node, listen, peers, key, None)
}

/// [`start_keyed`], offering RDMA on `rdma` to each peer if given.
fn start_with(
    name: &str,
    node: u32,
    listen: Option<SocketAddr>,
    peers: Vec<(u32, SocketAddr)>,
    key: Option<lake_dp::auth::LinkKey>,
    rdma: Option<&str>,
) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        link_key: key,
        rdma: rdma.map(|device| lake_dp::runner::RdmaDevice::parse(device).unwrap()),
        ..config(name, node, listen, peers)
    })
    .unwrap()
}

/// The config of [`start`]'s pools: one engine, 32 L1 slots of 128 KiB.
fn config(name: &str, node: u32, listen: Option<SocketAddr>, peers: Vec<(u32, SocketAddr)>) -> EmbeddedConfig {
    EmbeddedConfig {
        block_bytes: 131_072,
        l1_slots: 32,
        l2_slots_per_file: 32,
        local_agents: 1,
        remote_agents: 0,
        transport_listen: listen,
        transport_peers: peers.into_iter().map(|(n, a)| (n, vec![lake_dp::transport::tcp::Rail::to(a)])).collect(),
        node,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-transport-{name}-{}", std::process::id())))
    }
}

/// The pool's engine (in-process agent, namespace 7, layout 0xfeed).
fn engine(pool: &mut EmbeddedPool, name: &'static str) -> Agent {
    engine_of(pool, name, 7)
}

/// An engine of namespace `namespace` (layout 0xfeed) on the pool.
fn engine_of(pool: &mut EmbeddedPool, name: &'static str, namespace: u64) -> Agent {
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name,
        namespace: NamespaceId(namespace),
        layout_fingerprint: 0xfeed,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).unwrap()
}

/// The L1 of node `node`, whose engine is `engine`, as a copy's target
/// (any slot).
fn l1_of(engine: &Agent, node: u32) -> lake_dp::model::replica::ReplicaWire {
    lake_dp::model::replica::ReplicaWire {
        tier: lake_dp::Tier::L1Dram as u8,
        reserved: 0,
        region: engine.arena_region(),
        node,
        region_epoch: engine.arena_epoch(),
        slot: 0,
        generation: 0,
    }
}

/// Saves blocks `first..first + count` as one prompt through `agent` and
/// waits until they are published; their keys and payloads.
fn save_prompt(agent: &mut Agent, first: u32, count: u32) -> (Vec<BlockKey>, Vec<Vec<u8>>) {
    use lake_agent::{SaveBlock, SavePayload};
    let keys: Vec<BlockKey> = (first..first + count).map(key).collect();
    let payloads: Vec<Vec<u8>> = (first..first + count).map(payload).collect();
    let blocks: Vec<SaveBlock<'_>> = (0..count as usize)
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: i as u32,
            payload: SavePayload::Bytes(&payloads[i]),
        })
        .collect();
    assert_eq!(agent.save(&blocks), count as usize);
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < count as usize {
        assert!(Instant::now() < deadline, "the saves were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
    (keys, payloads)
}

#[test]
fn blocks_a_peer_sends_land_in_the_pool_checked_and_published() {
    let listen = free_port();
    let mut pool = start("push", 0, Some(listen), Vec::new());
    let mut agent = engine(&mut pool, "decode-engine");
    let any = BlockAddr { region: agent.arena_region(), epoch: agent.arena_epoch(), slot: ANY_SLOT, generation: 0 };

    // The prefill side: 6 blocks of a prompt, and one whose bytes lie.
    let start = Instant::now();
    let now = || start.elapsed().as_nanos() as u64;
    let mut sender = TcpTransport::new(TcpConfig::default(), None).unwrap();
    let peer = sender.add_peer(listen).unwrap();
    let mut blocks: Vec<Vec<u8>> = (0..6).map(object).collect();
    let mut lying = object(6);
    let at = lying.len() - 1000;
    lying[at] ^= 0x11;
    blocks.push(lying);
    let mut written = 0;
    let mut done: Vec<Completion> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.len() < blocks.len() {
        assert!(Instant::now() < deadline, "{} of {} ended: {done:?}", done.len(), blocks.len());
        if written < blocks.len() {
            let bytes = &blocks[written];
            let block = Outgoing {
                transfer: written as u64,
                peer,
                source: bytes.as_ptr(),
                len: bytes.len() as u64,
                target: any,
                priority: Priority::PrefillToDecode,
                trace: 0,
                namespace: 0,
            };
            // SAFETY: `blocks` outlives every completion.
            match unsafe { sender.write(&block, now()) } {
                Ok(()) => written += 1,
                Err(TransferError::PeerLost(_)) => {}
                Err(e) => panic!("{e}"),
            }
        }
        sender.poll_wait(&mut NoLanding, now(), &mut done, Duration::from_millis(1));
    }
    done.sort_by_key(|c| c.transfer);
    assert!(done[..6].iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(done[6].result, Err(TransferError::Corrupt));
    let mut slots: Vec<u32> = done[..6].iter().map(|c| c.target.slot).collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 6, "each block in a slot of its own: {done:?}");

    // The decode engine finds the prefix and loads it.
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < 6 {
        assert!(Instant::now() < deadline, "the pushed blocks were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered = agent.fetch(&keys, &table, |i, bytes| assert_eq!(bytes, &payload(i as u32)[..], "block {i}"));
    assert_eq!(delivered, 6);
    let mut lied = Vec::new();
    assert_eq!(agent.lookup(&[key(6)], &mut lied), 0, "the lying block is not published");

    drop(agent);
    let (stats, _server) = pool.stop().unwrap();
    assert_eq!(stats.pool.remote_landed, 6, "{stats:?}");
    assert_eq!(stats.pool.commits_corrupt, 1, "{stats:?}");
}

/// P→D whole: the prefill node's engine saves a prompt's blocks into its
/// own pool, then its agent pushes them from the pinned L1 slots to the
/// decode node's pool (another `lake-cp` + `lake-dp`, over TCP); the
/// decode engine finds the prompt in its own shared memory and loads it.
#[test]
fn prefill_pushes_a_prompt_to_the_decode_pool_and_decode_loads_it() {
    use lake_agent::push::Pusher;
    let decode_address = free_port();
    let mut prefill = start("prefill", 0, None, Vec::new());
    let mut decode = start("decode", 0, Some(decode_address), Vec::new());
    let mut prefill_agent = engine(&mut prefill, "prefill-engine");
    let mut decode_agent = engine(&mut decode, "decode-engine");

    // Prefill computes and saves 8 blocks locally...
    let (keys, payloads) = save_prompt(&mut prefill_agent, 100, 8);
    let mut table = Vec::new();
    assert_eq!(prefill_agent.lookup(&keys, &mut table), 8);

    // ...and pushes them to the decode node.
    let start = Instant::now();
    let now = || start.elapsed().as_nanos() as u64;
    let pins = prefill_agent.claim_pin_array().unwrap();
    let mut pusher =
        Pusher::new(TcpTransport::new(TcpConfig::default(), None).unwrap(), pins, prefill_agent.arena_region());
    let peer = pusher.transport().add_peer(decode_address).unwrap();
    let to = (decode_agent.arena_region(), decode_agent.arena_epoch());
    let deadline = Instant::now() + Duration::from_secs(10);
    while pusher.transport().connected(peer) == 0 {
        assert!(Instant::now() < deadline, "no connection to the decode node");
        pusher.poll(now(), &mut Vec::new());
    }
    for (key, entry) in keys.iter().zip(&table) {
        pusher.push(key, entry, peer, to, Priority::PrefillToDecode, 0, now()).unwrap();
    }
    let mut done = Vec::new();
    while done.len() < 8 {
        assert!(Instant::now() < deadline, "{} of 8 pushed: {done:?}", done.len());
        pusher.poll(now(), &mut done);
    }
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(pusher.in_flight(), 0, "every pin released");

    // Decode finds the whole prompt in its own pool and loads it.
    let mut decode_table = Vec::new();
    while decode_agent.lookup(&keys, &mut decode_table) < 8 {
        assert!(Instant::now() < deadline, "the pushed prompt was not published at the decode node");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered =
        decode_agent.fetch(&keys, &decode_table, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, 8);
    drop((prefill_agent, decode_agent, pusher));
    let (decode_stats, _) = decode.stop().unwrap();
    assert_eq!(decode_stats.pool.remote_landed, 8, "{decode_stats:?}");
    drop(prefill.stop());
}

/// Replication driven by `lake-cp`: node 1's control plane asks its data
/// plane to copy blocks into node 2's L1; the copies go over TCP from the
/// held L1 slots, land checked, are published by node 2's control plane,
/// and node 1 hears each landed (its TransferDone names the slot).
#[test]
fn a_control_plane_copies_blocks_into_another_nodes_l1() {
    use lake_dp::model::replica::ReplicaWire;
    let node_b = free_port();
    let mut a = start("copy-a", 1, None, vec![(2, node_b)]);
    let mut b = start("copy-b", 2, Some(node_b), Vec::new());
    let mut engine_a = engine(&mut a, "engine-a");
    let mut engine_b = engine(&mut b, "engine-b");
    let (keys, payloads) = save_prompt(&mut engine_a, 200, 5);
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let to = l1_of(&engine_b, 2);
    for key in &keys {
        a.copy_to(key, to, Priority::Replication).unwrap();
    }
    // A copy to this node itself, or of a block it does not hold, is refused.
    assert!(a.copy_to(&keys[0], ReplicaWire { node: 1, ..to }, Priority::Replication).is_err());
    assert!(a.copy_to(&key(999), to, Priority::Replication).is_err());

    let mut copied = Vec::new();
    while engine_b.lookup(&keys, &mut copied) < 5 {
        assert!(Instant::now() < deadline, "the copies were not published at node 2");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered = engine_b.fetch(&keys, &copied, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, 5);
    // Node 1 keeps its own copies.
    assert_eq!(engine_a.lookup(&keys, &mut table), 5);
    drop((engine_a, engine_b));
    // Node 1's control plane hears each copy landed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed) < 5 {
        assert!(Instant::now() < deadline, "node 1 never heard its copies landed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (stats_b, _) = b.stop().unwrap();
    let (stats_a, server_a) = a.stop().unwrap();
    assert_eq!(stats_b.pool.remote_landed, 5, "{stats_b:?}");
    assert_eq!(stats_a.pool.remote_sent, 5, "{stats_a:?}");
    assert_eq!((server_a.node().copies_landed, server_a.node().copies_failed), (5, 0));
}

/// `lake-dp` as the *sender* over RDMA: node 1's copies (asked by its
/// control plane) are offered on the negotiated RDMA link, and node 2 READs
/// them from node 1's L1 slots, checks and publishes them. Both pools run in
/// this process, over the in-process verbs (`loopback`), their links real
/// TCP; with RDMA off at either end, node 2 READs none and this fails.
#[test]
fn a_control_plane_copies_blocks_over_rdma_where_both_nodes_offer_it() {
    let node_b = free_port();
    let mut a = start_with("rdma-copy-a", 1, None, vec![(2, node_b)], None, Some("loopback"));
    let mut b = start_with("rdma-copy-b", 2, Some(node_b), Vec::new(), None, Some("loopback"));
    let mut engine_a = engine(&mut a, "engine-a");
    let mut engine_b = engine(&mut b, "engine-b");
    let to = l1_of(&engine_b, 2);
    let mut copied = Vec::new();
    let (warm, warm_payloads) = save_prompt(&mut engine_a, 300, 4);
    let (keys, payloads) = save_prompt(&mut engine_a, 400, 8);
    let mut copy = |pool: &mut EmbeddedPool, keys: &[BlockKey]| {
        for key in keys {
            pool.copy_to(key, to, Priority::Replication).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while engine_b.lookup(keys, &mut copied) < keys.len() {
            assert!(Instant::now() < deadline, "the copies were not published at node 2");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    // One at a time while the link negotiates RDMA (the first goes over
    // TCP), then a prompt's worth at once.
    for key in &warm {
        copy(&mut a, std::slice::from_ref(key));
    }
    copy(&mut a, &keys);
    engine_b.lookup(&keys, &mut copied);
    let delivered = engine_b.fetch(&keys, &copied, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, 8);
    engine_b.lookup(&warm, &mut copied);
    let delivered = engine_b.fetch(&warm, &copied, |i, bytes| assert_eq!(bytes, &warm_payloads[i][..], "block {i}"));
    assert_eq!(delivered, 4);
    drop((engine_a, engine_b));
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.gauges.copies_landed.load(std::sync::atomic::Ordering::Relaxed) < 12 {
        assert!(Instant::now() < deadline, "node 1 never heard its copies landed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (stats_b, _) = b.stop().unwrap();
    let (stats_a, server_a) = a.stop().unwrap();
    assert_eq!(stats_b.pool.remote_landed, 12, "{stats_b:?}");
    assert_eq!(stats_a.pool.remote_sent, 12, "{stats_a:?}");
    assert_eq!((server_a.node().copies_landed, server_a.node().copies_failed), (12, 0));
    // Every block after the link came up was READ by node 2 (and a block is
    // its object: payload and header, at least the payload).
    assert!(stats_b.rdma_landed >= 8, "node 2 READ {} of the copies: {stats_b:?}", stats_b.rdma_landed);
    assert!(stats_b.rdma_landed <= 12, "{stats_b:?}");
    assert!(stats_b.rdma_read_bytes >= stats_b.rdma_landed * payloads[0].len() as u64, "{stats_b:?}");
}

/// Which end holds the tenant to its cap.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CapAt {
    /// Node 1, on what it sends (`net-send`).
    Sender,
    /// Node 2, on what it receives (`net-receive`).
    Receiver,
    /// As `Receiver`, the two nodes offering RDMA (over the in-process
    /// verbs, `loopback`): node 2 READs what node 1 offers.
    ReceiverOverRdma,
}

/// Two pools, node 1 copying to node 2 (room for two prompts each, two
/// engines a pool), the tenant of namespace 7 capped at `rate` bytes per
/// second on the network at one end, under `tiers`.
fn capped_pair(name: &str, rate: u64, tiers: lake_cp::tier::TierConfig) -> (EmbeddedPool, EmbeddedPool) {
    capped_pair_at(name, rate, tiers, CapAt::Sender)
}

fn capped_pair_at(name: &str, rate: u64, tiers: lake_cp::tier::TierConfig, at: CapAt) -> (EmbeddedPool, EmbeddedPool) {
    let node_b = free_port();
    let capped = lake_dp::runner::config::TenantSection {
        name: "capped".into(),
        namespaces: vec![format!("{:016x}", 7)],
        l2_read_bytes_per_s: None,
        l2_write_bytes_per_s: None,
        l3_read_bytes_per_s: None,
        l3_write_bytes_per_s: None,
        net_send_bytes_per_s: (at == CapAt::Sender).then_some(rate),
        push_bytes_per_s: None,
        net_receive_bytes_per_s: (at != CapAt::Sender).then_some(rate),
    };
    let (capped_a, capped_b) =
        if at == CapAt::Sender { (vec![capped], Vec::new()) } else { (Vec::new(), vec![capped]) };
    let start_config = |name: String, node: u32, listen, peers, tenant_rates| EmbeddedConfig {
        l1_slots: 64,
        l2_slots_per_file: 64,
        local_agents: 2,
        tenant_rates,
        tiers: tiers.clone(),
        rdma: (at == CapAt::ReceiverOverRdma).then(|| lake_dp::runner::RdmaDevice::parse("loopback").unwrap()),
        ..config(&name, node, listen, peers)
    };
    let a = EmbeddedPool::start(&start_config(format!("{name}-a"), 1, None, vec![(2, node_b)], capped_a)).unwrap();
    // Node 2 serves /metrics: who waited to be received shows there.
    let b = EmbeddedPool::start(&EmbeddedConfig {
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..start_config(format!("{name}-b"), 2, Some(node_b), Vec::new(), capped_b)
    })
    .unwrap();
    (a, b)
}

/// A tenant capped on the network (`[[tenants]] net_send_bytes_per_s`,
/// `lake serve --tenant-rate NAME:net-send=…`): node 1's copies of its
/// blocks leave no faster than the cap, while another tenant's, asked
/// right after, are not held behind them; every block lands byte for byte.
#[test]
fn a_tenant_capped_on_the_network_copies_no_faster_than_its_cap_and_the_other_is_not_held() {
    let (stats_a, _) = copies_under_a_cap("net-cap", CapAt::Sender);
    assert!(stats_a.pool.sends_throttled > 0, "{stats_a:?}");
}

/// The same cap held by the receiving node (`net_receive_bytes_per_s`,
/// `--tenant-rate NAME:net-receive=…`): node 2 answers the reservations of
/// the capped tenant's blocks "later" and node 1's transport asks again
/// after the wait — node 1 holds no cap of its own, and neither tenant's
/// copies fail.
#[test]
fn a_tenant_capped_on_what_a_node_receives_lands_no_faster_than_its_cap() {
    let (stats_a, stats_b) = copies_under_a_cap("receive-cap", CapAt::Receiver);
    assert_eq!(stats_a.pool.sends_throttled, 0, "node 1 holds no cap: {stats_a:?}");
    assert_eq!(stats_b.pool.sends_throttled, 0, "{stats_b:?}");
}

/// The same over RDMA: node 2 answers node 1's offers of the capped
/// tenant's blocks *later*, and node 1 offers them again after the wait.
#[test]
fn a_tenant_capped_on_what_a_node_receives_over_rdma_lands_no_faster_than_its_cap() {
    let (stats_a, stats_b) = copies_under_a_cap("receive-cap-rdma", CapAt::ReceiverOverRdma);
    assert_eq!(stats_a.pool.sends_throttled, 0, "node 1 holds no cap: {stats_a:?}");
    println!("over RDMA: {} of 24 copies", stats_b.rdma_landed);
    assert!(stats_b.rdma_landed > 0, "no copy went over RDMA: {stats_b:?}");
}

/// Node 1 copies twelve blocks of a tenant capped at 1 MiB/s (at `at`) and
/// twelve of another to node 2: the capped ones land no faster than the
/// cap, the others not held behind them, all byte for byte; both nodes'
/// figures.
fn copies_under_a_cap(name: &str, at: CapAt) -> (RunnerStats, RunnerStats) {
    const RATE: u64 = 1 << 20;
    const BLOCKS: u32 = 12;
    let (mut a, mut b) = capped_pair_at(name, RATE, lake_cp::tier::TierConfig::default(), at);
    let (mut a7, mut a8) = (engine_of(&mut a, "a7", 7), engine_of(&mut a, "a8", 8));
    let (mut b7, mut b8) = (engine_of(&mut b, "b7", 7), engine_of(&mut b, "b8", 8));
    let (capped_keys, capped_payloads) = save_prompt(&mut a7, 700, BLOCKS);
    let (free_keys, free_payloads) = save_prompt(&mut a8, 800, BLOCKS);
    let to = l1_of(&b7, 2);
    let mut table = Vec::new();
    // Over RDMA, the link negotiates it while its first copies go over
    // TCP (and a block sent over TCP stays there): warmed up first with
    // four of the free tenant's blocks, one at a time.
    let warmed: u64 = if at == CapAt::ReceiverOverRdma { 4 } else { 0 };
    let (warm, _) = save_prompt(&mut a8, 850, u32::try_from(warmed).unwrap());
    for key in &warm {
        a.copy_to(key, to, Priority::Replication).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while b8.lookup(std::slice::from_ref(key), &mut table) < 1 {
            assert!(Instant::now() < deadline, "a warm-up copy was not published at node 2");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let asked = Instant::now();
    for key in capped_keys.iter().chain(&free_keys) {
        a.copy_to(key, to, Priority::Replication).unwrap();
    }
    let landed = |engine: &mut Agent, keys: &[BlockKey], table: &mut Vec<_>| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while engine.lookup(keys, table) < keys.len() {
            assert!(Instant::now() < deadline, "the copies were not published at node 2");
            std::thread::sleep(Duration::from_millis(2));
        }
        asked.elapsed()
    };
    let free_time = landed(&mut b8, &free_keys, &mut table);
    let delivered = b8.fetch(&free_keys, &table, |i, bytes| assert_eq!(bytes, &free_payloads[i][..], "block {i}"));
    assert_eq!(delivered, BLOCKS as usize);
    let capped_time = landed(&mut b7, &capped_keys, &mut table);
    let delivered = b7.fetch(&capped_keys, &table, |i, bytes| assert_eq!(bytes, &capped_payloads[i][..], "block {i}"));
    assert_eq!(delivered, BLOCKS as usize);
    // At least its bytes past the bucket's burst (a tenth of a second's
    // worth) and the one block it may go into debt by, at the rate; a
    // block travels as its stored object.
    let object = (lake_dp::constants::STORED_HEADER_BYTES + PAYLOAD) as u64;
    let beyond = u64::from(BLOCKS) * object - RATE / 10 - object;
    let at_rate = Duration::from_nanos(beyond * 1_000_000_000 / RATE);
    println!(
        "capped: {BLOCKS} copies in {capped_time:?} (the cap allows {at_rate:?} at the least); free: {free_time:?}"
    );
    assert!(capped_time >= at_rate.mul_f64(0.9), "{capped_time:?} for {BLOCKS} blocks at {RATE} B/s");
    assert!(free_time < capped_time / 2, "the uncapped tenant was held: {free_time:?} vs {capped_time:?}");
    if at != CapAt::Sender {
        // Node 2's operator sees the tenant's blocks held at their sender
        // (sent with the data plane's stats, once a second).
        let address = b.metrics.unwrap();
        let waited = |path: &str| {
            metrics::metric(address, &format!("lake_tenant_throttled_total{{tenant=\"capped\",path=\"{path}\"}}"))
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while waited("net_receive").unwrap_or(0) == 0 {
            assert!(Instant::now() < deadline, "no held receptions in /metrics");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(waited("net_send"), Some(0));
    }
    drop((a7, a8, b7, b8));
    let (stats_b, _) = b.stop().unwrap();
    let (stats_a, server_a) = a.stop().unwrap();
    assert_eq!(stats_b.pool.remote_landed, u64::from(2 * BLOCKS) + warmed, "{stats_b:?}");
    assert_eq!(server_a.node().copies_failed, 0);
    (stats_a, stats_b)
}

/// A node holding namespace 7 to 4 blocks of L1 refuses copies of its
/// blocks past that as it refuses its own engines' saves: the refused ones
/// are never published there (no lookup finds more than the quota) and
/// fail at their sender; another namespace's copies all land, exact.
#[test]
fn copies_into_a_node_past_a_namespaces_l1_quota_are_refused_and_another_namespaces_land() {
    const BLOCKS: u32 = 12;
    let node_b = free_port();
    let slot = object_bytes(131_072);
    let mut a = EmbeddedPool::start(&EmbeddedConfig {
        local_agents: 2,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..config("quota-a", 1, None, vec![(2, node_b)])
    })
    .unwrap();
    let mut b_config = config("quota-b", 2, Some(node_b), Vec::new());
    b_config.local_agents = 2;
    b_config.tiers.quotas = vec![lake_cp::tier::Quota { namespace: 7, tier: lake_dp::Tier::L1Dram, bytes: 4 * slot }];
    let mut b = EmbeddedPool::start(&b_config).unwrap();
    let mut a7 = engine_of(&mut a, "a7", 7);
    let (keys7, _) = save_prompt(&mut a7, 700, BLOCKS);
    let mut a8 = engine_of(&mut a, "a8", 8);
    let (keys8, payloads8) = save_prompt(&mut a8, 800, BLOCKS);
    let (mut b7, mut b8) = (engine_of(&mut b, "b7", 7), engine_of(&mut b, "b8", 8));
    let to = l1_of(&b7, 2);
    for key in keys7.iter().chain(&keys8) {
        a.copy_to(key, to, Priority::Replication).unwrap();
    }
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while b8.lookup(&keys8, &mut table) < keys8.len() {
        assert!(Instant::now() < deadline, "namespace 8's copies were not published at node 2");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered = b8.fetch(&keys8, &table, |i, bytes| assert_eq!(bytes, &payloads8[i][..], "block {i}"));
    assert_eq!(delivered, BLOCKS as usize);
    // Every copy answered, landed or failed (node 1's figures, as
    // /metrics shows them).
    let address = a.metrics.unwrap();
    let ended = |result: &str| {
        metrics::metric(address, &format!("lake_copies_to_nodes_total{{result=\"{result}\"}}")).unwrap_or(0)
    };
    while ended("landed") + ended("failed") < u64::from(2 * BLOCKS) {
        assert!(Instant::now() < deadline, "{} copies landed, {} failed", ended("landed"), ended("failed"));
        std::thread::sleep(Duration::from_millis(5));
    }
    let found: usize = keys7.iter().filter(|key| b7.lookup(std::slice::from_ref(key), &mut table) == 1).count();
    drop((a7, a8, b7, b8));
    let (stats_b, _) = b.stop().unwrap();
    let (_, server_a) = a.stop().unwrap();
    println!(
        "namespace 7: {found} of {BLOCKS} copies held at node 2, {} refused over its quota",
        stats_b.pool.saves_refused_quota
    );
    assert!(stats_b.pool.saves_refused_quota > 0, "{stats_b:?}");
    assert!(found < BLOCKS as usize, "{found} of namespace 7's copies published past its quota");
    assert_eq!(server_a.node().copies_failed, stats_b.pool.saves_refused_quota);
}

/// Copies `lake-cp` takes back (`Node::cancel_copy`, wire `Cancel`):
/// those still waiting in the data plane (here behind their tenant's cap
/// on the network) end `Cancelled` at once, their slots released, and
/// never reach the other node; what had gone lands.
#[test]
fn copies_taken_back_before_they_go_end_cancelled_and_never_land() {
    const RATE: u64 = 128 * 1024;
    const BLOCKS: u32 = 12;
    let (mut a, mut b) = capped_pair("cancel", RATE, lake_cp::tier::TierConfig::default());
    let mut a7 = engine_of(&mut a, "a7", 7);
    let mut b7 = engine_of(&mut b, "b7", 7);
    let (keys, _) = save_prompt(&mut a7, 900, BLOCKS);
    let to = l1_of(&b7, 2);
    let requests: Vec<u64> = keys.iter().map(|key| a.copy_to(key, to, Priority::Replication).unwrap()).collect();
    // At 128 KiB/s the first goes, the rest wait: taken back now.
    std::thread::sleep(Duration::from_millis(300));
    let asked = Instant::now();
    let out = requests.iter().filter(|&&request| a.cancel_copy(request).unwrap()).count();
    assert!(out >= BLOCKS as usize - 2, "{out} copies still out (the first may have landed)");
    assert!(!a.cancel_copy(12345).unwrap(), "no such copy");
    // A second later every copy has ended, landed or cancelled (the cap
    // would have taken ~9 s to send them all).
    std::thread::sleep(Duration::from_secs(1));
    let mut table = Vec::new();
    let landed_at_b = b7.lookup(&keys, &mut table);
    drop((a7, b7));
    let (stats_a, server_a) = a.stop().unwrap();
    let (stats_b, _) = b.stop().unwrap();
    let node = server_a.node();
    println!(
        "cancel: {} landed, {} cancelled in {:?}; node 2 holds {landed_at_b}",
        node.copies_landed,
        node.copies_cancelled,
        asked.elapsed()
    );
    assert_eq!(node.copies_landed + node.copies_cancelled + node.copies_failed, u64::from(BLOCKS), "every copy ended");
    assert!(node.copies_cancelled >= u64::from(BLOCKS) - 3, "those waiting were cancelled: {}", node.copies_cancelled);
    assert_eq!(node.copies_failed, 0);
    assert!(stats_a.pool.sends_cancelled >= node.copies_cancelled, "{stats_a:?}");
    assert_eq!(stats_b.pool.remote_landed, node.copies_landed, "what was cancelled never landed");
}

/// Every copy carries a deadline (`TierConfig::copy_deadline_ms`): one
/// still waiting in its data plane by then — here behind its tenant's
/// cap on the network — is dropped there, its slot released, and
/// answered `DeadlineExceeded`; it never reaches the other node.
#[test]
fn copies_waiting_past_their_deadline_are_dropped() {
    const RATE: u64 = 128 * 1024;
    const BLOCKS: u32 = 12;
    let tiers = lake_cp::tier::TierConfig { copy_deadline_ms: 500, ..lake_cp::tier::TierConfig::default() };
    let (mut a, mut b) = capped_pair("deadline", RATE, tiers);
    let mut a7 = engine_of(&mut a, "a7", 7);
    let b7 = engine_of(&mut b, "b7", 7);
    let (keys, _) = save_prompt(&mut a7, 950, BLOCKS);
    let to = l1_of(&b7, 2);
    for key in &keys {
        a.copy_to(key, to, Priority::Replication).unwrap();
    }
    // The cap sends one block in ~0.8 s: past 0.5 s the rest are dropped.
    std::thread::sleep(Duration::from_millis(1500));
    drop((a7, b7));
    let (stats_a, server_a) = a.stop().unwrap();
    let (stats_b, _) = b.stop().unwrap();
    let node = server_a.node();
    println!(
        "deadline: {} landed, {} failed, {} expired in the data plane",
        node.copies_landed, node.copies_failed, stats_a.pool.sends_expired
    );
    assert_eq!(node.copies_landed + node.copies_failed, u64::from(BLOCKS), "every copy ended");
    assert!(stats_a.pool.sends_expired >= u64::from(BLOCKS) - 2, "{stats_a:?}");
    assert_eq!(node.copies_failed, stats_a.pool.sends_expired, "the failed ones are those expired");
    assert_eq!(stats_b.pool.remote_landed, node.copies_landed, "what expired never landed");
}

#[test]
fn pools_holding_the_link_key_copy_blocks_and_one_holding_another_gets_none_in() {
    use lake_dp::auth::LinkKey;
    let (cluster, stranger) = (LinkKey::from_bytes([0x21; 32]), LinkKey::from_bytes([0x22; 32]));
    let node_b = free_port();
    let mut a = start_keyed("keyed-a", 1, None, vec![(2, node_b)], Some(cluster.clone()));
    let mut b = start_keyed("keyed-b", 2, Some(node_b), Vec::new(), Some(cluster));
    let mut c = start_keyed("keyed-c", 3, None, vec![(2, node_b)], Some(stranger));
    let mut engine_a = engine(&mut a, "engine-a");
    let mut engine_b = engine(&mut b, "engine-b");
    let mut engine_c = engine(&mut c, "engine-c");
    let (keys, payloads) = save_prompt(&mut engine_a, 300, 3);
    let (strange_keys, _) = save_prompt(&mut engine_c, 400, 3);
    let to = l1_of(&engine_b, 2);
    for (key, strange) in keys.iter().zip(&strange_keys) {
        a.copy_to(key, to, Priority::Replication).unwrap();
        c.copy_to(strange, to, Priority::Replication).unwrap();
    }
    let mut copied = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine_b.lookup(&keys, &mut copied) < 3 {
        assert!(Instant::now() < deadline, "the key holder's copies were not published at node 2");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered = engine_b.fetch(&keys, &copied, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, 3);
    // The stranger's copies fail at their deadline (no connection of its
    // ever passes the handshake); none reaches node 2 — given the time the
    // key holder's took, and as long again.
    std::thread::sleep(Duration::from_millis(500));
    drop((engine_a, engine_c));
    let (stats_c, server_c) = c.stop().unwrap();
    assert_eq!(stats_c.pool.remote_sent, 0, "{stats_c:?}");
    let _ = server_c;
    assert_eq!(engine_b.lookup(&strange_keys, &mut copied), 0, "a stranger's block was published");
    drop(engine_b);
    let (stats_b, _) = b.stop().unwrap();
    assert_eq!(stats_b.pool.remote_landed, 3, "{stats_b:?}");
    drop(a);
}

#[test]
fn a_pool_asked_for_rdma_it_cannot_open_says_why_and_does_not_start() {
    let dir = std::env::temp_dir().join(format!("lake-cp-transport-rdma-{}", std::process::id()));
    let refused = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 8,
        l2_slots_per_file: 8,
        local_agents: 1,
        remote_agents: 0,
        transport_listen: Some(free_port()),
        rdma: Some(lake_dp::runner::RdmaDevice::parse("any").unwrap()),
        ..EmbeddedConfig::new(dir.clone())
    });
    let Err(why) = refused else { panic!("no RDMA device here (and none in CI): the pool must not start") };
    let why = why.to_string();
    // Built without the feature it says so; built with it, there is no
    // device to open on this machine.
    assert!(why.contains("transport.rdma"), "{why}");
    assert!(why.contains("`rdma` feature") || why.to_lowercase().contains("device"), "{why}");
    let _ = std::fs::remove_dir_all(dir);
}
