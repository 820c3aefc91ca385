//! One object store shared by the pool's nodes, across processes: three
//! `lake serve` nodes (members of a cluster in a real etcd, streaming to a
//! `lake summary` leader) where nodes 2 and 3 keep L3 in one store — a
//! directory, or a bucket of a real S3 server (moto) — and node 1 in a
//! store of its own. What node 2 wrote outlives it:
//! killed, its L3 blocks stay in every node's view, node 3's engine pulls
//! them and node 3's data plane reads them from the store by name, byte
//! for byte — in the directory, all but one damaged there, where the hit
//! ends — while
//! node 1 — whose store lacks them, and whose pull the
//! dead holder cannot serve — gets a clean miss. Node 2 started again on
//! a new directory finds the store's objects by its scan, holds them in
//! L3 only, and serves node 1's pull by reading each object first and
//! sending it over the transport.

#[path = "common/cluster.rs"]
mod cluster;
#[path = "common/etcd.rs"]
mod etcd_server;
#[path = "common/scratch.rs"]
mod scratch;
#[path = "common/supervise.rs"]
mod supervise;

use std::path::Path;
use std::time::{Duration, Instant};

use lake_agent::{Agent, SaveBlock, SavePayload};
use lake_dp::mirror::view::{Holder, Where};
use lake_dp::{BlockKey, NamespaceId, NodeId, Tier};

use cluster::{Proc, agent_of, field, http_get, leader};
use scratch::Scratch;

fn key(chain: u8, i: u32) -> BlockKey {
    let mut bytes = [0x5e; 16];
    bytes[0] = chain;
    bytes[4..8].copy_from_slice(&i.to_le_bytes());
    BlockKey(bytes)
}

fn chain(id: u8) -> Vec<BlockKey> {
    (0..12).map(|i| key(id, i)).collect()
}

fn agent(serving: &str) -> Agent {
    agent_of(serving, NamespaceId(47), "shared-store-test")
}

/// Block `i` of chain `id`: bytes of its own.
fn payload(id: u8, i: u32) -> Vec<u8> {
    (0..16 * 1024u32).map(|b| (b ^ i).to_le_bytes()[0] ^ id).collect()
}

fn save(serving: &str, id: u8) {
    let mut agent = agent(serving);
    for (i, key) in (0u32..).zip(chain(id)) {
        let payload = payload(id, i);
        let parent = if i == 0 { BlockKey::NONE } else { self::key(id, i - 1) };
        let block = SaveBlock { key, parent, block_index: i, payload: SavePayload::Bytes(&payload) };
        assert_eq!(agent.save(&[block]), 1, "chain {id} block {i}");
    }
}

/// The `lake_tier_blocks` of `tier` on the pool `serving`.
fn tier_blocks(serving: &str, tier: &str) -> u64 {
    let (_, metrics) = http_get(&field(serving, "metrics"), "/metrics");
    let line = format!("lake_tier_blocks{{tier=\"{tier}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&line)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Where `keys` are as the pool `serving` sees the whole pool, once `done`
/// holds (within 20 s).
fn wait_places(serving: &str, keys: &[BlockKey], done: impl Fn(&[Where]) -> bool) -> Vec<Where> {
    let mut agent = agent(serving);
    let mut places = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        agent.lookup_cluster(keys, &mut places);
        if done(&places) || Instant::now() > deadline {
            return places;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pulls chain `id` into the pool `serving` (within `within`) and checks
/// every block it then holds byte for byte; returns its hit.
fn pull_and_read(serving: &str, id: u8, within: Duration) -> usize {
    let keys = chain(id);
    let mut puller = agent(serving);
    let mut table = Vec::new();
    let hit = puller.pull_cluster(&keys, within, &mut table);
    assert!(table[..hit].iter().all(|e| e.tier == Tier::L1Dram), "{table:?}");
    let delivered = puller.fetch(&keys[..hit], &table[..hit], |i, bytes| {
        assert_eq!(bytes, &payload(id, u32::try_from(i).unwrap())[..], "chain {id} block {i}");
    });
    assert_eq!(delivered, hit, "{:?}", puller.last_fetch_failure());
    hit
}

fn metrics_of(serving: &str) -> String {
    http_get(&field(serving, "metrics"), "/metrics").1
}

fn free_address() -> String {
    format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port())
}

/// Where the nodes keep L3.
enum Stores {
    /// Directories under the test's own.
    Dir,
    /// Buckets of the S3 server at this endpoint.
    S3(String),
}

struct Cluster {
    endpoint: String,
    listen: String,
    base: std::path::PathBuf,
    stores: Stores,
}

impl Cluster {
    /// `lake serve` as node `node` on `dir`, with `extra` flags.
    fn node(&self, node: u32, dir: &Path, extra: &[String]) -> (Proc, String) {
        let mut args: Vec<String> =
            ["serve", "--metrics", "127.0.0.1:0", "--node", &node.to_string(), "--dir", &dir.display().to_string()]
                .iter()
                .map(ToString::to_string)
                .collect();
        args.extend(["--block-bytes", "16384", "--summary-to", &self.listen].map(String::from));
        args.extend(["--etcd", &self.endpoint, "--cluster", "store", "--member-ttl", "2"].map(String::from));
        args.extend(extra.iter().cloned());
        // moto takes any key.
        let keys = [("LAKE_S3_ACCESS_KEY", "lake-test"), ("LAKE_S3_SECRET_KEY", "lake-test")];
        let proc = Proc::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>(), &keys);
        let serving = proc
            .wait_for(&format!("node {node} serves"), Duration::from_secs(20), |l| l.contains("\"event\":\"serving\""));
        (proc, serving)
    }

    /// The flags of store `name`.
    fn store_flags(&self, name: &str) -> Vec<String> {
        match &self.stores {
            Stores::Dir => vec!["--l3-dir".into(), self.base.join(name).display().to_string()],
            Stores::S3(endpoint) => ["--l3-endpoint", endpoint, "--l3-bucket", name, "--l3-create-bucket"]
                .iter()
                .map(ToString::to_string)
                .chain(["--l3-region".into(), "eu-west-1".into()])
                .collect(),
        }
    }
}

#[test]
fn a_directory_store_shared_by_the_nodes() {
    shared_store(Stores::Dir, "dir");
}

#[test]
fn an_s3_bucket_shared_by_the_nodes() {
    let Some(moto) = lake_tests::moto::moto_server() else {
        assert!(std::env::var_os("CI").is_none(), "no moto_server: .ci/run installs it");
        println!("SKIPPED: no moto_server (LAKE_MOTO_SERVER, or ~/.cache/lake-moto)");
        return;
    };
    let server = lake_tests::moto::Server::start(moto, lake_tests::moto::free_port());
    shared_store(Stores::S3(format!("http://127.0.0.1:{}", server.port)), "s3");
}

/// An object one node wrote is read by every node sharing the store, and
/// served by its holder to the others.
fn shared_store(stores: Stores, name: &str) {
    let Some(etcd) = etcd_server::EtcdServer::start(&format!("store-{name}")) else { return };
    let base = std::env::temp_dir().join(format!("lake-shared-store-{name}-{}", std::process::id()));
    let _scratch = Scratch(base.clone(), Vec::new());
    let cluster = Cluster { endpoint: etcd.endpoint(), listen: free_address(), base: base.clone(), stores };
    // Blocks stay where they were saved: node 2's blocks must be only its
    // own (and the store's) when it is killed.
    let _leader = leader(&cluster.listen, &cluster.endpoint, "store", Some("saved"), &["--id", "leader"]);

    // Node 1 has a store of its own; node 2 writes every block it saves
    // to the shared store at once; node 3 shares it. Node 2 sends blocks
    // to node 1.
    let transport = free_address();
    let mut one_flags = cluster.store_flags("lake-one");
    one_flags.extend(["--transport-listen".into(), transport.clone()]);
    let (_one, serving_one) = cluster.node(1, &base.join("node1"), &one_flags);
    let mut two_flags = cluster.store_flags("lake-shared");
    two_flags.extend(["--l3-write-back".into(), "eager".into(), "--transport-peer".into(), format!("1={transport}")]);
    let (mut two, serving_two) = cluster.node(2, &base.join("node2"), &two_flags);
    let (_three, serving_three) = cluster.node(3, &base.join("node3"), &cluster.store_flags("lake-shared"));

    // Node 2 saves two chains; both reach the store.
    save(&serving_two, 0xa);
    save(&serving_two, 0xc);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tier_blocks(&serving_two, "L3") < 24 {
        assert!(Instant::now() < deadline, "node 2's 24 blocks in L3: {}", tier_blocks(&serving_two, "L3"));
        std::thread::sleep(Duration::from_millis(50));
    }

    // Node 2 dies. Once its membership lapses, its L1 and L2 leave the
    // views; its L3 — the store's — stays.
    two.kill();
    supervise::reclaim_killed(&base.join("node2"));
    let in_store = Where::Remote(Holder { node: NodeId(2), tier: Tier::L3Object });
    for serving in [&serving_one, &serving_three] {
        let places = wait_places(serving, &chain(0xa), |p| p.len() == 12 && p.iter().all(|w| *w == in_store));
        assert!(places.len() == 12 && places.iter().all(|w| *w == in_store), "{places:?}");
    }

    // In the directory, block 6 of chain A is damaged (a payload byte).
    let damaged = matches!(cluster.stores, Stores::Dir);
    if damaged {
        let object = base.join("lake-shared").join(lake_dp::l3::object_name("lake", NamespaceId(47), &key(0xa, 6)));
        let mut bytes = std::fs::read(&object).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        std::fs::write(&object, bytes).unwrap();
    }

    // Node 3 shares the store: its data plane reads the objects by name.
    // A damaged one never lands (nor does its relay to the dead holder):
    // node 3's hit is the six before it, each byte for byte.
    let read = Instant::now();
    let (hit, read_ok) = if damaged { (6, 11) } else { (12, 12) };
    assert_eq!(pull_and_read(&serving_three, 0xa, Duration::from_secs(3)), hit);
    println!(
        "store ({name}): a dead node's blocks read from the shared store into node 3's L1 in {:?}",
        read.elapsed()
    );
    let metrics = metrics_of(&serving_three);
    assert!(metrics.contains(&format!("lake_cluster_pulls_total{{result=\"store\"}} {read_ok}\n")), "{metrics}");
    let failed = 12 - read_ok;
    assert!(metrics.contains(&format!("lake_cluster_pulls_total{{result=\"store_failed\"}} {failed}\n")), "{metrics}");
    // Read and checked, the objects are node 3's L3 too (its catalog and
    // its control plane's index), as its own scan would have found them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tier_blocks(&serving_three, "L3") < read_ok && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(tier_blocks(&serving_three, "L3"), read_ok, "{}", metrics_of(&serving_three));
    // Node 1's store lacks them and node 2 is gone: a clean miss, no
    // wrong bytes.
    assert_eq!(pull_and_read(&serving_one, 0xc, Duration::from_millis(1500)), 0);
    // Each failed read is counted as its answer comes (two tests share
    // the machine's cores: some come after the engine gave up).
    let all_failed = "lake_cluster_pulls_total{result=\"store_failed\"} 12\n";
    let deadline = Instant::now() + Duration::from_secs(10);
    while !metrics_of(&serving_one).contains(all_failed) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let metrics = metrics_of(&serving_one);
    assert!(metrics.contains(all_failed), "{metrics}");

    // Node 2 again, on a new directory: its scan of the store finds every
    // object, so it holds chain C in L3 only; node 1's pull has it read
    // the objects into its L1 and send them over the transport.
    let mut again_flags = cluster.store_flags("lake-shared");
    again_flags.extend(["--transport-peer".into(), format!("1={transport}")]);
    let (_two, _serving_two) = cluster.node(2, &base.join("node2-again"), &again_flags);
    let places = wait_places(&serving_one, &chain(0xc), |p| p.len() == 12 && p.iter().all(|w| *w == in_store));
    assert!(places.len() == 12 && places.iter().all(|w| *w == in_store), "{places:?}");
    let pulled = Instant::now();
    assert_eq!(pull_and_read(&serving_one, 0xc, Duration::from_secs(10)), 12, "node 2 read its objects and sent them");
    println!("store ({name}): node 2's 12 L3-only blocks sent to node 1 (another store) in {:?}", pulled.elapsed());
    let metrics = metrics_of(&serving_one);
    assert!(metrics.contains("lake_cluster_pulls_total{result=\"store\"} 0\n"), "{metrics}");
}
