//! Rolling upgrade against a real binary of the previous release (issue
//! [10]): the `lake-dp` of the last landed release (`tests/previous-release`
//! names its commit; `.ci/run` builds it and names the binary in
//! `LAKE_PREVIOUS_DP`) runs under this build's `lake-cp` with this build's
//! agent attached over its socket. Blocks saved through it are demoted to
//! its L2 by this control plane's tier manager and read back byte for
//! byte; what it did not offer at hello (`lake-cp`'s `peers` shows it) is
//! never sent to it — a drain of an L2 file runs where it took drains and
//! is refused, saying why, where it did not — and it stops clean on
//! SIGTERM.
//!
//! Without `LAKE_PREVIOUS_DP` the test says SKIPPED and why (a checkout
//! without the old binary built); CI always builds it.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

#[path = "common/chain.rs"]
mod chain;
#[path = "common/etcd.rs"]
mod etcd_server;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chain::save_chain;
use lake_agent::{Agent, AgentConfig};
use lake_cp::node::Node;
use lake_cp::server::Server;
use lake_cp::tier::TierConfig;
use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorEntry, MirrorWriter};
use lake_dp::{BlockKey, NamespaceId, NodeId};

const PAYLOAD: usize = 60 * 1024;
const BLOCKS: u32 = 40;

fn key(block: u32) -> BlockKey {
    let mut bytes = [0x9b; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    BlockKey(bytes)
}

fn payload(block: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|i| (i as u8).wrapping_mul(29) ^ (block as u8)).collect()
}

/// `request` on the operator socket; the answer.
fn admin(socket: &Path, request: &str) -> serde_json::Value {
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream.write_all(format!("{request}\n").as_bytes()).unwrap();
    let mut line = String::new();
    std::io::BufReader::new(stream).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A data plane's config, in a form every release since the previous one
/// reads (no field added since): L1 of 16 blocks at `arena`, two L2 files
/// in `dir`, `lake-cp` at `cp`, agents at `dp`.
fn dp_config(arena: &str, dir: &Path, cp: &Path, dp: &Path) -> String {
    let slot_bytes = lake_dp::stored::object_bytes(PAYLOAD as u64);
    format!(
        r#"
[node]
id = 0

[l1]
path = "{arena}"
classes = [{{ payload_bytes = {PAYLOAD}, slots = 16 }}]
lock = false
agents_max = 8

[l2]
paths = ["{dir}/l2-0.lake", "{dir}/l2-1.lake"]
slots_per_file = 64
slot_bytes = {slot_bytes}
format_if_missing = true
queue_depth = 32

[poller]
ops_max = 64
park_max_ms = 20

[cp]
socket = "{cp}"

[agents]
socket = "{dp}"
ports = 2
"#,
        dir = dir.display(),
        cp = cp.display(),
        dp = dp.display(),
    )
}

/// This build's agent, attached over `dp_socket` (namespace `namespace`),
/// having saved [`BLOCKS`] blocks and seen 20 or more of them demoted to
/// L2; their keys.
fn saved_and_demoted(
    mirror: &Path,
    cp_socket: &Path,
    dp_socket: &Path,
    namespace: u64,
    log: &dyn Fn() -> String,
) -> (Agent, Vec<BlockKey>) {
    let agent_config = AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror,
        cp_socket: Some(cp_socket),
        name: "engine-n",
        namespace: NamespaceId(namespace),
        layout_fingerprint: 0x77,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = Agent::connect(&agent_config, dp_socket).unwrap_or_else(|e| panic!("{e}\n{}", log()));
    let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
    save_chain(&mut agent, &keys, |i| payload(i as u32));
    let mut table = Vec::new();
    wait_until("the blocks published and demoted to L2", || {
        let hits = agent.lookup(&keys, &mut table);
        hits == keys.len() && table.iter().filter(|e| e.tier == lake_dp::Tier::L2Nvme).count() >= 20
    });
    (agent, keys)
}

/// Reads every one of `keys` back, a few at a time, each checked against
/// its bytes; `check` sees each lookup's table first.
fn read_back(agent: &mut Agent, keys: &[BlockKey], log: &dyn Fn() -> String, check: &dyn Fn(&[MirrorEntry])) {
    let mut table = Vec::new();
    let mut delivered = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    while delivered < keys.len() {
        assert!(Instant::now() < deadline, "{delivered} of {BLOCKS} read back\n{}", log());
        assert_eq!(agent.lookup(keys, &mut table), keys.len());
        check(&table);
        let end = keys.len().min(delivered + 4);
        delivered += agent.fetch(&keys[delivered..end], &table[delivered..end], |i, bytes| {
            assert_eq!(bytes, &payload((delivered + i) as u32)[..], "block {}", delivered + i);
        });
    }
}

/// A process of the previous release (its data plane, its control plane),
/// killed if the test fails before it stops it.
struct Old(Child);

impl Drop for Old {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_previous_releases_lake_dp_serves_this_releases_control_plane_and_agents() {
    let Some(binary) = std::env::var_os("LAKE_PREVIOUS_DP").map(PathBuf::from) else {
        println!("SKIPPED: LAKE_PREVIOUS_DP names no lake-dp of the previous release (.ci/run builds one)");
        return;
    };
    assert!(binary.is_file(), "LAKE_PREVIOUS_DP={} is not a file", binary.display());
    let unique = std::process::id();
    let dir = std::env::temp_dir().join(format!("lake-previous-{unique}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (arena, mirror) = (
        PathBuf::from(format!("/dev/shm/lake-l1-prev-{unique}")),
        PathBuf::from(format!("/dev/shm/lake-mirror-prev-{unique}")),
    );
    let (cp_socket, dp_socket, admin_socket) = (dir.join("cp.sock"), dir.join("dp.sock"), dir.join("admin.sock"));

    // This build's control plane, in this process.
    let writer = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(mirror.clone()), 1024)).unwrap();
    let tiers = TierConfig { high_percent: 80, low_percent: 60, ..TierConfig::default() };
    let node = Node::new(NodeId(0), 1, Some(writer)).with_tiers(tiers);
    let mut server = Server::bind(&cp_socket, node, 1).unwrap();
    server.serve_admin(&admin_socket).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let cp = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                server.poll_once(Some(Duration::from_millis(5))).unwrap();
            }
            server
        })
    };

    // The previous release's data plane, with a config it reads (no field
    // added since).
    let config = dp_config(&arena.display().to_string(), &dir, &cp_socket, &dp_socket);
    let config_path = dir.join("lake-dp.toml");
    std::fs::write(&config_path, config).unwrap();
    let log = std::fs::File::create(dir.join("lake-dp.log")).unwrap();
    let mut old = Old(Command::new(&binary)
        .arg("--config")
        .arg(&config_path)
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap());
    let log_text = || std::fs::read_to_string(dir.join("lake-dp.log")).unwrap_or_default();
    wait_until("the old lake-dp registered L1 and both L2 files", || {
        let regions = admin(&admin_socket, "{\"op\":\"regions\"}");
        regions["regions"].as_array().is_some_and(|r| r.len() == 3) && dp_socket.exists()
    });

    // This build's agent attached to it.
    let (mut agent, keys) = saved_and_demoted(&mirror, &cp_socket, &dp_socket, 0x5e, &log_text);
    // Read back under a trace id: sent only where the old data plane
    // offered trace ids at attach (one built before them refuses a request
    // carrying one); the agent's spans then have none of its time.
    eprintln!("the previous data plane takes trace ids: {}", agent.traces_taken());
    agent.set_trace(0x01d0_7ace);
    read_back(&mut agent, &keys, &log_text, &|_| {});

    agent.set_trace(0);
    let mut spans = Vec::new();
    agent.take_spans(|span| spans.push(*span));
    assert!(!spans.is_empty(), "no traced load from its L2");
    let timed = spans.iter().filter(|span| span.data_plane_us > 0).count();
    assert_eq!(timed, if agent.traces_taken() { spans.len() } else { 0 }, "{spans:?}");

    // What its hello offered is what it is sent: the drain (kind 28) only
    // where it took it, else the drain is refused, saying why.
    let peers = admin(&admin_socket, "{\"op\":\"peers\"}");
    let old_dp = peers["peers"].as_array().unwrap().iter().find(|p| p["role"] == "data_plane").cloned();
    let old_dp = old_dp.unwrap_or_else(|| panic!("no data plane among the peers: {peers}"));
    assert_eq!(old_dp["name"], "lake-dp", "{old_dp}");
    let drains_too = old_dp["features"].as_array().unwrap().iter().any(|f| f == "drain");
    // Its fuller L2 file.
    let regions = admin(&admin_socket, "{\"op\":\"regions\"}");
    let drained = regions["regions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["tier"] == "l2")
        .max_by_key(|r| r["blocks"].as_u64())
        .and_then(|r| r["region"].as_u64())
        .unwrap_or_else(|| panic!("no L2 file among the regions: {regions}"));
    let drains = admin(&admin_socket, &format!("{{\"op\":\"drain\",\"region\":{drained}}}"));
    assert!(drains["drains"].is_array(), "{drains}");
    eprintln!("the previous data plane takes drains: {drains_too}");
    if drains_too {
        wait_until("the old data plane drained its L2 file", || {
            let drains = admin(&admin_socket, "{\"op\":\"drains\"}");
            drains["drains"][0]["done"] == true && drains["drains"][0]["refused"].is_null()
        });
        // Nothing was lost: every block reads back from where it went.
        read_back(&mut agent, &keys, &log_text, &|table| {
            assert!(
                table.iter().all(|e| e.tier != lake_dp::Tier::L2Nvme || u64::from(e.region.0) != drained),
                "a block left on the drained file"
            );
        });
    } else {
        wait_until("the drain's refusal", || {
            let drains = admin(&admin_socket, "{\"op\":\"drains\"}");
            drains["drains"][0]["refused"] == "its lake-dp does not drain (an older build)"
        });
    }
    // Its stats (once a second) time its L2 writes, on the four paths it
    // knows.
    wait_until("its L2 writes timed", || {
        let top = admin(&admin_socket, "{\"op\":\"top\"}");
        top["paths"][2]["count"].as_u64().is_some_and(|n| n >= 20)
    });
    let top = admin(&admin_socket, "{\"op\":\"top\"}");
    // The data plane's (the engines' own come after them, as they report).
    let paths: Vec<&str> = top["paths"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["path"].as_str())
        .filter(|p| !p.starts_with("agent_"))
        .collect();
    assert_eq!(paths, ["l2_read_critical", "l2_read_background", "l2_write", "transfer_storage"], "{top}");

    // It stops clean on SIGTERM, its link to this control plane intact to
    // the end.
    drop(agent);
    // SAFETY: kill(2) on the child's pid, which has not been reaped.
    assert_eq!(unsafe { libc::kill(i32::try_from(old.0.id()).unwrap(), libc::SIGTERM) }, 0);
    let status = old.0.wait().unwrap();
    assert!(status.success(), "the old lake-dp exited {status}\n{}", log_text());
    stop.store(true, Ordering::Release);
    let server = cp.join().unwrap();
    assert_eq!(server.counters.bad_frames, 0, "no frame either side could not read");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&arena);
    let _ = std::fs::remove_file(&mirror);
}

/// Rolling upgrade, the control plane a release behind: the previous
/// release's real `lake cp` (`LAKE_PREVIOUS_LAKE`, built by `.ci/run`)
/// leads in etcd and serves this build's `lake-dp` (the runner, on a
/// thread) and this build's agent, attached over the data plane's socket:
/// the blocks saved are published by the old control plane, demoted by
/// its tier manager to this data plane's L2 and read back byte for byte,
/// and no frame either side could not read closes a link (the data plane
/// never reconnects).
#[test]
fn the_previous_releases_lake_cp_serves_this_releases_data_plane_and_agents() {
    use lake_dp::runner::config::RunnerConfig;
    use lake_dp::runner::{RunnerOptions, RunnerPorts, run_with};
    let Some(binary) = std::env::var_os("LAKE_PREVIOUS_LAKE").map(PathBuf::from) else {
        println!("SKIPPED: LAKE_PREVIOUS_LAKE names no `lake` of the previous release (.ci/run builds one)");
        return;
    };
    assert!(binary.is_file(), "LAKE_PREVIOUS_LAKE={} is not a file", binary.display());
    let Some(etcd) = etcd_server::EtcdServer::start("previous-cp") else { return };
    let unique = std::process::id();
    let dir = std::env::temp_dir().join(format!("lake-previous-cp-{unique}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (arena, mirror) =
        (format!("/dev/shm/lake-l1-prevcp-{unique}"), PathBuf::from(format!("/dev/shm/lake-mirror-prevcp-{unique}")));
    let (cp_socket, dp_socket) = (dir.join("cp.sock"), dir.join("dp.sock"));
    let log = std::fs::File::create(dir.join("lake-cp.log")).unwrap();
    let old = Old(Command::new(&binary)
        .args(["cp", "--socket"])
        .arg(&cp_socket)
        .arg("--mirror")
        .arg(&mirror)
        .args(["--etcd", &etcd.endpoint(), "--cluster", "previous", "--id", "old-cp", "--entries", "4096"])
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap());
    let log_text = || std::fs::read_to_string(dir.join("lake-cp.log")).unwrap_or_default();
    wait_until("the old lake cp leads and serves its socket", || cp_socket.exists());

    // This build's data plane: L1 of 16 blocks, two L2 files.
    let config = RunnerConfig::parse(&dp_config(&arena, &dir, &cp_socket, &dp_socket)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let dp = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let ports = RunnerPorts { stop: Some(stop), ..RunnerPorts::default() };
            run_with(&config, &RunnerOptions::default(), ports, &mut std::io::sink())
        })
    };
    wait_until("this data plane's socket", || dp_socket.exists() || dp.is_finished());
    assert!(!dp.is_finished(), "the data plane stopped: {:?}", dp.join());

    let (mut agent, keys) = saved_and_demoted(&mirror, &cp_socket, &dp_socket, 0x5f, &log_text);
    read_back(&mut agent, &keys, &log_text, &|_| {});
    drop(agent);
    stop.store(true, Ordering::Release);
    let stats = dp.join().unwrap().unwrap();
    assert_eq!(stats.cp_reconnects, 0, "a link to the old control plane closed: {stats:?}\n{}", log_text());
    assert!(stats.pool.demotions >= 20 && stats.pool.promotions > 0, "{stats:?}");
    drop(old);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&arena);
    let _ = std::fs::remove_file(&mirror);
}
