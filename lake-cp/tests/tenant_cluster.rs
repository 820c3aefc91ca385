//! Tenants kept apart across a cluster: two `lake serve` nodes, members of
//! one cluster in a real etcd under a `lake summary` leader, each keeping
//! tenants `acme` and `bolt` in partitions of their own, with engines —
//! the real agent library, in processes of their own — run by this test
//! as three unprivileged users: acme's, bolt's, and one of the pool's
//! other namespaces. What one tenant's engine saved on node 1, the same
//! tenant's engine on node 2 finds in its own cluster view (handed to it
//! at attach, as its mirror is: the views are the pool user's, mode
//! 0600), pulls and loads byte for byte; the other tenant's engine and
//! the pool's find none of it, and a pull of it by another tenant's
//! engine is refused, nothing copied. The pool's engine, unprivileged
//! too, finds and pulls the pool's blocks of node 1 through the pool's
//! view. And a node of the cluster that keeps no tenant apart is shown
//! none of the tenants' blocks of the others, and sent none when asked.
//! Needs root to run processes as other users: skipped, with the reason
//! printed, otherwise.

#[path = "common/as_user.rs"]
mod as_user;
#[path = "common/cluster.rs"]
mod cluster;
#[path = "common/etcd.rs"]
mod etcd_server;
#[path = "common/pool.rs"]
#[allow(dead_code)] // its nodes and metrics only, not its chains
mod pool;
#[path = "common/scratch.rs"]
mod scratch;
#[path = "common/supervise.rs"]
mod supervise;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig};
use lake_dp::mirror::view::{Holder, Where};
use lake_dp::{BlockKey, NodeId, Tier};
use serde_json::json;

use as_user::{load_and_say, published, run_engine, save_at_once};
use cluster::{field, http_ask, leader, start_router};
use pool::{sample, start_nodes};
use scratch::Scratch;

const ACME_UID: u32 = 65_534;
const BOLT_UID: u32 = 65_533;
/// A user of no tenant: its engines map the pool's partition.
const POOL_UID: u32 = 65_532;
const ACME: u64 = 0xa1;
const BOLT: u64 = 0xb1;
/// A namespace no tenant kept apart holds: the pool's.
const OTHER: u64 = 0xc1;
const BLOCKS: usize = 4;
const ENGINE: &str = "LAKE_TENANT_CLUSTER_ENGINE";
const THIS_TEST: &str = "a_tenants_blocks_are_seen_and_pulled_across_nodes_by_its_engines_alone";

/// Each node's flags: two tenants kept apart, their users let in.
const TENANTS: &[&str] = &[
    "--allow-uid",
    "65534,65533,65532",
    "--socket-mode",
    "666",
    "--tenant",
    "acme=a1",
    "--tenant",
    "bolt=b1",
    "--tenant-quota",
    "acme:l1=1MiB",
    "--tenant-quota",
    "bolt:l1=1MiB",
    "--tenant-partition",
    "acme:uid=65534",
    "--tenant-partition",
    "bolt:uid=65533",
];

fn keys(namespace: u64) -> Vec<BlockKey> {
    (0..BLOCKS)
        .map(|i| {
            let mut key = [0x5au8; 16];
            key[..8].copy_from_slice(&namespace.to_le_bytes());
            key[8] = u8::try_from(i).unwrap();
            BlockKey(key)
        })
        .collect()
}

fn payload(namespace: u64, i: usize) -> Vec<u8> {
    vec![namespace.to_le_bytes()[0] ^ u8::try_from(i).unwrap(); 16 * 1024]
}

/// The engine, in the child process: `DP|CP|MIRROR|NAMESPACE|ACTION`.
/// `save` saves the namespace's chain and loads it; `peek` looks it up
/// across the pool once; `pull` pulls it here and loads it; `steal` asks
/// node 1's copies of it pulled here, whatever the view shows. Says what
/// it saw on lines starting `engine:`.
fn engine_child(spec: &str) {
    let [dp, cp, mirror, namespace, action] = spec.split('|').collect::<Vec<_>>()[..] else { panic!("{spec}") };
    let namespace = u64::from_str_radix(namespace, 16).unwrap();
    let config = AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(mirror),
        cp_socket: Some(Path::new(cp)),
        name: "tenant-engine",
        namespace: lake_dp::NamespaceId(namespace),
        layout_fingerprint: 1,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = match Agent::connect(&config, Path::new(dp)) {
        Ok(agent) => agent,
        Err(e) => return println!("engine: refused: {e}"),
    };
    let keys = keys(namespace);
    let mut table = Vec::new();
    let load = |agent: &mut Agent, hits: usize, table: &[lake_dp::mirror::MirrorEntry]| {
        load_and_say(agent, &keys, table, hits, |i| payload(namespace, i));
    };
    match action {
        "save" => {
            println!("engine: saved {}", save_at_once(&mut agent, &keys, |i| payload(namespace, i)));
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut hits = agent.lookup(&keys, &mut table);
            while hits < BLOCKS && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
                hits = agent.lookup(&keys, &mut table);
            }
            load(&mut agent, hits, &table);
        }
        "peek" => {
            let mut places = Vec::new();
            let found = agent.lookup_cluster(&keys, &mut places);
            let remote = places.iter().filter(|p| matches!(p, Where::Remote(_))).count();
            let store = places.iter().filter(|p| matches!(p, Where::Remote(h) if h.tier == Tier::L3Object)).count();
            println!("engine: found {found} remote {remote} in L3 {store}");
        }
        "pull" => {
            let hits = agent.pull_cluster(&keys, Duration::from_secs(10), &mut table);
            println!("engine: hits {hits}");
            load(&mut agent, hits, &table);
        }
        "steal" => {
            let holder = Holder { node: NodeId(1), tier: lake_dp::Tier::L1Dram };
            let pulls: Vec<(BlockKey, Holder)> = keys.iter().map(|&key| (key, holder)).collect();
            println!("engine: asked {}", agent.pull(&pulls));
            // Long enough for the control plane to have read the asks.
            std::thread::sleep(Duration::from_millis(300));
        }
        other => panic!("{other}"),
    }
}

/// Runs the engine as `uid` against the node whose serving line is
/// `serving`: what it said.
fn engine(uid: u32, serving: &str, namespace: u64, action: &str) -> String {
    let spec = ["dp_socket", "cp_socket", "mirror"].map(|name| field(serving, name)).join("|");
    let said = run_engine(THIS_TEST, ENGINE, uid, &format!("{spec}|{namespace:x}|{action}"));
    println!("uid {uid}, namespace {namespace:x}, {action}:\n{said}");
    said
}

/// `lake route` beside node 2 reads its pool, every tenant's partition
/// with the pool's: each namespace's chain, saved on node 1, is a hit
/// there, in node 1's L1.
fn a_router_beside_node_2_finds_every_partitions_blocks(base: &Path, one: &str, two: &str) {
    let (_router, address) = start_router(&base.join("route.toml"), &base.join("node2"), &[(1, one), (2, two)], "");
    for namespace in [ACME, BOLT, OTHER] {
        let hex: Vec<String> =
            keys(namespace).iter().map(|k| k.0.iter().map(|b| format!("{b:02x}")).collect()).collect();
        let request = json!({ "keys": hex }).to_string();
        let deadline = Instant::now() + Duration::from_secs(20);
        let answer = loop {
            let (status, answer) = http_ask(&address, "POST /route HTTP/1.1", request.as_bytes());
            if status == 200 && answer["down"] == json!([]) {
                break answer;
            }
            assert!(Instant::now() < deadline, "namespace {namespace:x}: {status} {answer}");
            std::thread::sleep(Duration::from_millis(100));
        };
        println!("router, namespace {namespace:x}: {answer}");
        assert_eq!(answer["pool"], json!({ "node": 2, "cluster_view": true, "partitions": 2 }), "{answer}");
        assert_eq!(answer["hit_blocks"], 4, "namespace {namespace:x}: {answer}");
        assert_eq!(answer["moves"][0]["from_node"], 1, "namespace {namespace:x}: {answer}");
    }
}

fn beside(path: &Path, name: &str) -> PathBuf {
    PathBuf::from(format!("{}.{name}", path.display()))
}

/// Waits (20 s at most) for the sample `name` of the metrics at `address`
/// to reach `least`.
fn wait_for_sample(address: &str, name: &str, least: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while sample(address, name) < least {
        assert!(Instant::now() < deadline, "{what}: {} of {least}", sample(address, name));
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free_address() -> String {
    format!("127.0.0.1:{}", std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port())
}

/// A cluster of `count` `lake serve` nodes (`flags` of each) under a
/// `lake summary` leader (blocks stay where they were saved; `leader_flags`
/// its others) in a real etcd, in a scratch directory that other users
/// may enter ([`base`]): `None` (said why) where it cannot run here.
struct Deployment {
    leader: cluster::Proc,
    nodes: Vec<(cluster::Proc, String)>,
    base: PathBuf,
    /// Where the leader listens, and etcd.
    listen: String,
    etcd: etcd_server::EtcdServer,
    _scratch: Scratch,
}

/// The scratch directory of deployment `name`.
fn base(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lake-{name}-{}", std::process::id()))
}

fn deploy(
    name: &str,
    count: u32,
    flags: impl Fn(u32) -> &'static [&'static str],
    leader_flags: &[&str],
) -> Option<Deployment> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: running processes as other users needs root");
        return None;
    }
    let etcd = etcd_server::EtcdServer::start(name)?;
    let base = base(name);
    let scratch = Scratch(base.clone(), Vec::new());
    std::fs::create_dir_all(&base).unwrap();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
    let listen = free_address();
    let leader = leader(&listen, &etcd.endpoint(), name, Some("saved"), leader_flags);
    let nodes = start_nodes(&base, (&listen, &etcd.endpoint(), name), count, flags);
    Some(Deployment { leader, nodes, base, listen, etcd, _scratch: scratch })
}

#[test]
fn a_tenants_blocks_are_seen_and_pulled_across_nodes_by_its_engines_alone() {
    if let Ok(spec) = std::env::var(ENGINE) {
        return engine_child(&spec);
    }
    // Blocks stay where they were saved: node 2 holds none until pulled.
    let Some(deployment) = deploy("tenant-cluster", 2, |_| TENANTS, &[]) else { return };
    let (base, nodes) = (&deployment.base, &deployment.nodes);
    let (one, two) = (&nodes[0].1, &nodes[1].1);
    let metrics = field(two, "metrics");

    // Each tenant, and the pool's other namespace, saves its chain on
    // node 1 (as its own user).
    for (uid, namespace) in [(ACME_UID, ACME), (BOLT_UID, BOLT), (POOL_UID, OTHER)] {
        let said = engine(uid, one, namespace, "save");
        assert!(said.contains("saved 4") && said.contains("loaded 4 exact"), "{said}");
    }
    // Node 2's views hold the twelve, each in its own.
    wait_for_sample(&metrics, "lake_cluster_view_blocks", 12, "node 2's views");
    let mirror_two = PathBuf::from(field(two, "mirror"));
    for view in
        [beside(&mirror_two, "cluster"), beside(&mirror_two, "acme.cluster"), beside(&mirror_two, "bolt.cluster")]
    {
        let meta = std::fs::metadata(&view).unwrap_or_else(|e| panic!("{}: {e}", view.display()));
        assert_eq!(meta.mode() & 0o777, 0o600, "{}: the pool's user's alone", view.display());
    }

    a_router_beside_node_2_finds_every_partitions_blocks(base, one, two);

    // Each engine on node 2 sees its own namespace's blocks on node 1,
    // and none of another's.
    assert!(engine(ACME_UID, two, ACME, "peek").contains("found 4 remote 4"));
    assert!(engine(BOLT_UID, two, BOLT, "peek").contains("found 4 remote 4"));
    assert!(engine(POOL_UID, two, OTHER, "peek").contains("found 4 remote 4"));
    assert!(engine(BOLT_UID, two, ACME, "peek").contains("found 0"), "acme's, in bolt's view");
    assert!(engine(POOL_UID, two, ACME, "peek").contains("found 0"), "acme's, in the pool's view");
    assert!(engine(ACME_UID, two, OTHER, "peek").contains("found 0"), "the pool's, in acme's view");

    // Bolt's engine asks for acme's blocks all the same: refused, and
    // nothing of them lands on node 2.
    assert!(engine(BOLT_UID, two, ACME, "steal").contains("asked 4"));
    let refused = "lake_cluster_pulls_total{result=\"refused\"}";
    wait_for_sample(&metrics, refused, 4, "the pulls refused");
    std::thread::sleep(Duration::from_millis(500));
    let acme_two = beside(&mirror_two, "acme");
    assert_eq!(published(&acme_two, &keys(ACME)), 0, "nothing of acme's pulled by bolt's engine");
    assert_eq!(sample(&metrics, "lake_cluster_pulls_total{result=\"sent\"}"), 0);

    // Acme's engine pulls them: copied from node 1 into acme's partition
    // on node 2, published in acme's mirror there, loaded byte for byte.
    let said = engine(ACME_UID, two, ACME, "pull");
    assert!(said.contains("hits 4") && said.contains("loaded 4 exact"), "{said}");
    assert_eq!(published(&acme_two, &keys(ACME)), BLOCKS);
    assert_eq!(published(&mirror_two, &keys(ACME)), 0, "acme's blocks in acme's mirror alone");
    // So does the pool's engine, of the pool's blocks, through the pool's
    // view.
    let said = engine(POOL_UID, two, OTHER, "pull");
    assert!(said.contains("hits 4") && said.contains("loaded 4 exact"), "{said}");
    assert_eq!(sample(&metrics, "lake_cluster_pulls_total{result=\"sent\"}"), 8);
    assert_eq!(sample(&metrics, refused), 4);
}

/// A node's flags that keep no tenant apart, and let the tests' users in.
const POOL_ONLY: &[&str] = &["--allow-uid", "65534,65533,65532", "--socket-mode", "666"];

/// Three nodes, of which node 2 keeps no tenant apart: acme's blocks saved
/// on node 1 are shown in node 3's acme view, and in no view of node 2's,
/// and when node 2's pool engine asks for them all the same the leader
/// asks no copy, and nothing of them lands there. The pool's blocks pass
/// everywhere.
#[test]
fn a_node_not_keeping_a_tenant_apart_is_shown_and_sent_none_of_its_blocks() {
    let leader_metrics = free_address();
    let flags = |node| if node == 2 { POOL_ONLY } else { TENANTS };
    let Some(deployment) = deploy("tenant-unlike", 3, flags, &["--metrics", &leader_metrics]) else { return };
    let [(_, one), (_, two), (_, three)] = &deployment.nodes[..] else { unreachable!() };
    for (uid, namespace) in [(ACME_UID, ACME), (POOL_UID, OTHER)] {
        let said = engine(uid, one, namespace, "save");
        assert!(said.contains("saved 4") && said.contains("loaded 4 exact"), "{said}");
    }
    let (metrics_two, metrics_three) = (field(two, "metrics"), field(three, "metrics"));
    wait_for_sample(&metrics_three, "lake_cluster_view_blocks", 8, "node 3's views");
    // The same leader's stream, a moment more: node 2 holds the pool's
    // four alone.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(sample(&metrics_two, "lake_cluster_view_blocks"), 4, "node 2's view: the pool's blocks alone");
    assert!(engine(POOL_UID, two, ACME, "peek").contains("found 0"), "acme's, on a node not keeping acme apart");
    assert!(engine(POOL_UID, two, OTHER, "peek").contains("found 4 remote 4"));
    assert!(engine(ACME_UID, three, ACME, "peek").contains("found 4 remote 4"), "acme's, where kept apart alike");

    // Node 2's pool engine asks for acme's blocks all the same: node 2
    // relays the pulls (it keeps nothing apart), the leader asks no copy.
    assert!(engine(POOL_UID, two, ACME, "steal").contains("asked 4"));
    wait_for_sample(&leader_metrics, "lake_summary_copies_kept_apart_total", 4, "copies not asked");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(published(Path::new(&field(two, "mirror")), &keys(ACME)), 0, "nothing of acme's landed on node 2");
    let said = deployment.leader.wait_for("the leader says", Duration::from_secs(5), |l| l.contains("tenants_unlike"));
    assert!(said.contains("\"node\":2") || said.contains("\"unlike\":[2"), "{said}");
    // The pool's blocks pass as ever.
    let said = engine(POOL_UID, two, OTHER, "pull");
    assert!(said.contains("hits 4") && said.contains("loaded 4 exact"), "{said}");
}

/// Node 1 keeps acme apart and writes its blocks to L3 as it saves them;
/// node 2 keeps no tenant apart. Node 1 dies — its L3 blocks, the store's,
/// stay in every view — and then the leader: the standby that takes over
/// from its checkpoint still keeps acme's blocks from node 2, though node
/// 1 never connects to it to say what it keeps apart. Node 3, keeping
/// acme apart alike, sees them.
#[test]
fn a_leader_restored_from_its_checkpoint_keeps_a_gone_nodes_tenant_blocks_apart() {
    let name = "tenant-restored";
    let checkpoints = base(name).join("checkpoints").display().to_string();
    let summary_flags = ["--checkpoint-dir", checkpoints.as_str(), "--checkpoint-ms", "100"];
    let store = base(name).join("node1-l3").display().to_string();
    let writer: &'static [&'static str] = [TENANTS, &["--l3-write-back", "eager", "--l3-dir"]].concat().leak();
    let writer: &'static [&'static str] = [writer, &[String::leak(store)]].concat().leak();
    let flags = |node| match node {
        1 => writer,
        2 => POOL_ONLY,
        _ => TENANTS,
    };
    let Some(mut deployment) = deploy(name, 3, flags, &summary_flags) else { return };
    let mut standby_args = vec!["summary", "--listen", &deployment.listen, "--cluster", name, "--ttl", "2"];
    let endpoint = deployment.etcd.endpoint();
    standby_args.extend(["--etcd", &endpoint, "--placement", "saved"]);
    standby_args.extend(summary_flags);
    let standby = cluster::Proc::start(&standby_args);
    let [(one_proc, one), (_, two), (_, three)] = &mut deployment.nodes[..] else { unreachable!() };
    for (uid, namespace) in [(ACME_UID, ACME), (POOL_UID, OTHER)] {
        let said = engine(uid, one, namespace, "save");
        assert!(said.contains("saved 4") && said.contains("loaded 4 exact"), "{said}");
    }
    let (metrics_two, metrics_three) = (field(two, "metrics"), field(three, "metrics"));
    wait_for_sample(&metrics_three, "lake_cluster_view_blocks", 8, "node 3's views");

    // Node 1 dies: once its membership lapses its blocks are seen in L3
    // alone, on node 3 (acme's) and on node 2 (the pool's).
    one_proc.kill();
    let in_store = |uid, serving: &str, namespace| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !engine(uid, serving, namespace, "peek").contains("found 4 remote 4 in L3 4") {
            assert!(Instant::now() < deadline, "node 1's blocks of {namespace:x}, in L3 alone");
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    in_store(ACME_UID, three, ACME);
    in_store(POOL_UID, two, OTHER);
    // A checkpoint of it, and the leader dies: the standby leads from it.
    std::thread::sleep(Duration::from_millis(500));
    let snapshot = "lake_cluster_view_frames_total{kind=\"snapshot\"}";
    let snapshots = [&metrics_two, &metrics_three].map(|m| sample(m, snapshot));
    deployment.leader.kill();
    standby.wait_for("the standby leads", Duration::from_secs(20), |l| l.contains("\"event\":\"leading\""));
    for (metrics, before) in [&metrics_two, &metrics_three].into_iter().zip(snapshots) {
        wait_for_sample(metrics, snapshot, before + 1, "a view snapshot from the new leader");
    }
    wait_for_sample(&metrics_three, "lake_cluster_view_blocks", 8, "node 3's views, from the new leader");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(sample(&metrics_two, "lake_cluster_view_blocks"), 4, "node 2's view: the pool's blocks alone");
    assert!(engine(POOL_UID, two, ACME, "peek").contains("found 0"), "acme's, on a node not keeping acme apart");
    assert!(engine(ACME_UID, three, ACME, "peek").contains("found 4 remote 4 in L3 4"));
}
