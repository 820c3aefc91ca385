//! `store-pull`: a pull of blocks another node holds only in L3, read from
//! the object store the nodes share (a directory), against reading the
//! same objects' files straight (the raw operation the pull wraps). Two
//! `lake serve` nodes on loopback, members of a cluster in a real etcd
//! with a `lake summary` leader, keep L3 in one directory; node 2 writes
//! every block it saves there at once and is SIGKILLed, so its blocks stay
//! in node 1's view in L3 only. Node 1's agent pulls them one at a time
//! and as one batch: its `lake-cp` has its `lake-dp` read each object by
//! name, check it and land it in L1. Needs etcd.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lake_dp::mirror::view::{Holder, Where};
use lake_dp::{BlockKey, NamespaceId, NodeId, Tier};

use crate::cluster_hits::{
    BLOCK_BYTES, Binaries, NAMESPACE, Proc, Scratch, agent, command_again, key, pull_each, save,
};
use crate::report::{Report, percentile};

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct StorePullArgs {
    /// The `lake` and etcd binaries.
    #[command(flatten)]
    pub(crate) binaries: Binaries,
    /// Blocks pulled one at a time, and as one batch.
    #[arg(long, default_value_t = 64)]
    pub(crate) pulls: u32,
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

/// etcd and a leading summary on loopback: the processes and etcd's URL.
fn control(lake: &Path, etcd: &Path, base: &Path) -> Result<(Proc, Proc, String, String), String> {
    let (client, peer) = (format!("http://127.0.0.1:{}", free_port()?), format!("http://127.0.0.1:{}", free_port()?));
    let mut command = std::process::Command::new(etcd);
    command.args(["--name", "store", "--data-dir"]).arg(base.join("etcd"));
    command.args(["--listen-client-urls", &client, "--advertise-client-urls", &client]);
    command.args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer]);
    command.args(["--initial-cluster", &format!("store={peer}")]);
    let etcd = Proc::start(command)?;
    let summary_at = format!("127.0.0.1:{}", free_port()?);
    let mut command = std::process::Command::new(lake);
    command.args(["summary", "--listen", &summary_at, "--etcd", &client, "--cluster", "store", "--ttl", "2"]);
    // The blocks stay with the node that saved them, to be left in the
    // store when it dies.
    command.args(["--placement", "saved"]);
    // etcd may take a moment to answer: the summary retries its start.
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let started = Proc::start(command_again(&command))?;
        if started.wait_for("the summary leads", |l| l.contains("\"leading\"")).is_ok() {
            return Ok((etcd, started, client, summary_at));
        }
    }
    Err("the summary never led".into())
}

pub(crate) fn run(args: &StorePullArgs) -> Result<Report, String> {
    let lake = args.binaries.lake()?;
    let base = Scratch(std::env::temp_dir().join(format!("lake-bench-store-{}", std::process::id())));
    std::fs::create_dir_all(&base.0).map_err(|e| e.to_string())?;
    let store = base.0.join("store");
    let (_etcd, _summary, endpoint, summary_at) = control(&lake, &args.binaries.etcd, &base.0)?;
    let node = |id: u32, extra: &[&str]| -> Result<(Proc, String), String> {
        let mut command = std::process::Command::new(&lake);
        command
            .args(["serve", "--metrics", "off", "--node", &id.to_string(), "--dir"])
            .arg(base.0.join(format!("n{id}")));
        command.args(["--block-bytes", &BLOCK_BYTES.to_string(), "--l1-slots", "1024"]);
        command.args(["--etcd", &endpoint, "--cluster", "store", "--member-ttl", "2", "--summary-to", &summary_at]);
        command.arg("--l3-dir").arg(&store).args(extra);
        let proc = Proc::start(command)?;
        let serving = proc.wait_for("a node serves", |l| l.contains("\"serving\""))?;
        Ok((proc, serving))
    };
    let (_one, serving_one) = node(1, &[])?;
    let (two, serving_two) = node(2, &["--l3-write-back", "eager"])?;
    let count = args.pulls as usize;
    // Each key a chain of its own (pulled alone).
    let keys: Vec<BlockKey> = (0..2 * args.pulls).map(|i| key(2_000_000 + i, 100)).collect();
    let mut writer = agent(&serving_two)?;
    for k in &keys {
        if save(&mut writer, std::slice::from_ref(k), 0) != 1 {
            return Err("node 2 did not take a block".into());
        }
    }
    let names: Vec<PathBuf> =
        keys.iter().map(|k| store.join(lake_dp::l3::object_name("lake", NamespaceId(NAMESPACE), k))).collect();
    wait_stored(&names)?;
    drop(writer);
    // SIGKILLed: its membership lapses, its L3 blocks stay in the view.
    let mut two = two;
    let _ = two.child.kill();
    let _ = two.child.wait();
    let mut puller = agent(&serving_one)?;
    wait_in_store_only(&mut puller, &keys)?;
    drop(two);
    cleanup_killed(&serving_two);
    let (mut singles, batch_s) = pulls(&mut puller, &keys, count)?;
    let (mut raw, raw_batch_s) = raw_reads(&names, &keys, count)?;

    let mut report = Report::new("store-pull");
    report.int("blocks", u64::from(args.pulls));
    report.int("block_bytes", BLOCK_BYTES as u64);
    report.float("store_pull_p50_ns", percentile(&mut singles, 500));
    report.float("store_pull_p99_ns", percentile(&mut singles, 990));
    let blocks = f64::from(args.pulls);
    report.float("store_pull_batch_ns_per_block", batch_s * 1e9 / blocks);
    report.float("store_pull_batch_mb_per_s", blocks * BLOCK_BYTES as f64 / batch_s / 1e6);
    report.float("raw_read_p50_ns", percentile(&mut raw, 500));
    report.float("raw_read_p99_ns", percentile(&mut raw, 990));
    report.float("raw_read_batch_ns_per_block", raw_batch_s * 1e9 / blocks);
    report.float("raw_read_batch_mb_per_s", blocks * BLOCK_BYTES as f64 / raw_batch_s / 1e6);
    Ok(report)
}

/// Waits until every object of `names` is in the store.
fn wait_stored(names: &[PathBuf]) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while names.iter().any(|n| !n.exists()) {
        if Instant::now() > deadline {
            let there = names.iter().filter(|n| n.exists()).count();
            return Err(format!("{there} of node 2's {} blocks reached the store", names.len()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Waits until `puller`'s view shows each of `keys` only in node 2's L3.
fn wait_in_store_only(puller: &mut lake_agent::Agent, keys: &[BlockKey]) -> Result<(), String> {
    let in_store = Where::Remote(Holder { node: NodeId(2), tier: Tier::L3Object });
    let mut places = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while keys.iter().any(|k| puller.lookup_cluster(std::slice::from_ref(k), &mut places) != 1 || places[0] != in_store)
    {
        if Instant::now() > deadline {
            return Err("node 2's blocks never showed in node 1's view as L3 only".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// The first `count` of `keys` pulled one at a time (ns each), the rest
/// as one batch (seconds).
fn pulls(puller: &mut lake_agent::Agent, keys: &[BlockKey], count: usize) -> Result<(Vec<f64>, f64), String> {
    let mut table = Vec::new();
    let mut singles = Vec::with_capacity(count);
    for k in &keys[..count] {
        let started = Instant::now();
        if puller.pull_cluster(std::slice::from_ref(k), Duration::from_secs(5), &mut table) != 1 {
            return Err("a pull from the store did not land".into());
        }
        singles.push(started.elapsed().as_nanos() as f64);
    }
    let started = Instant::now();
    let batch = &keys[count..];
    let landed = pull_each(puller, batch, &mut table);
    if landed != batch.len() {
        return Err(format!("{landed} of {} blocks pulled from the store landed", batch.len()));
    }
    Ok((singles, started.elapsed().as_secs_f64()))
}

/// The raw operation: the same objects' files read (and checked, as the
/// store's reads are), the first `count` one at a time (ns each), the
/// rest all together (seconds).
fn raw_reads(names: &[PathBuf], keys: &[BlockKey], count: usize) -> Result<(Vec<f64>, f64), String> {
    let read = |name: &PathBuf, key: &BlockKey| -> Result<(), String> {
        let bytes = std::fs::read(name).map_err(|e| e.to_string())?;
        lake_dp::l3::verify(&bytes, NamespaceId(NAMESPACE), key).map_err(|e| e.to_string())
    };
    let mut raw = Vec::with_capacity(count);
    for (name, key) in names[..count].iter().zip(keys) {
        let started = Instant::now();
        read(name, key)?;
        raw.push(started.elapsed().as_nanos() as f64);
    }
    let started = Instant::now();
    for (name, key) in names[count..].iter().zip(&keys[count..]) {
        read(name, key)?;
    }
    Ok((raw, started.elapsed().as_secs_f64()))
}

/// Removes the shared memory the SIGKILLed node left (its arena, mirror
/// and view, named in its serving line).
fn cleanup_killed(serving: &str) {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(serving) else { return };
    for name in ["arena", "mirror", "cluster_view"] {
        if let Some(path) = value[name].as_str() {
            let _ = std::fs::remove_file(path);
        }
    }
}
