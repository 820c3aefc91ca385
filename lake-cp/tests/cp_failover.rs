//! The leader `lake-cp` SIGKILLed with a standby beside it (the
//! crash matrix): two `lake cp` processes stand for leadership in a real
//! etcd (`common/etcd.rs`); a `lake-dp` (the runner, on a thread here)
//! serves an engine's blocks and reports them to the leader. The leader is
//! killed; the standby takes over within its lease, serves the same socket
//! and writes the mirror under a higher term, and the data plane connects
//! to it again and re-adopts everything it holds — so every block saved
//! before the kill is found and loads with its bytes, and the time from
//! the kill to the whole view rebuilt is reported.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload, SaveStatus};
use lake_cp::etcd::Etcd;
use lake_cp::ha::Cluster;
use lake_dp::mirror::MirrorReader;
use lake_dp::runner::config::RunnerConfig;
use lake_dp::runner::{RunnerOptions, RunnerPorts, run_with};
use lake_dp::{BlockKey, NamespaceId};

#[path = "common/etcd.rs"]
mod etcd_server;
use etcd_server::EtcdServer;

const PAYLOAD: usize = 16 * 1024;
const BLOCKS: u32 = 40;

#[path = "common/scratch.rs"]
mod scratch;
use scratch::Scratch;

#[path = "common/cluster.rs"]
#[allow(dead_code)] // its processes and engines are the cluster tests'
mod cluster;
use cluster::http_get;
#[path = "common/supervise.rs"]
#[allow(dead_code)]
mod supervise;

/// A `lake cp` child and its event lines.
struct Cp {
    child: Child,
    lines: BufReader<ChildStdout>,
}

impl Cp {
    fn start(etcd: &str, socket: &Path, mirror: &Path, id: &str, ttl: u32) -> Self {
        Self::start_with(etcd, socket, mirror, id, ttl, &[])
    }

    /// Started with `extra` arguments.
    fn start_with(etcd: &str, socket: &Path, mirror: &Path, id: &str, ttl: u32, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
            .args(["cp", "--socket"])
            .arg(socket)
            .arg("--mirror")
            .arg(mirror)
            .args(["--etcd", etcd, "--cluster", "failover", "--id", id, "--ttl", &ttl.to_string(), "--entries", "4096"])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("lake cp starts");
        let lines = BufReader::new(child.stdout.take().unwrap());
        Self { child, lines }
    }

    /// The next event line naming `event`, and its term.
    fn wait_for(&mut self, event: &str) -> u64 {
        let mut line = String::new();
        loop {
            line.clear();
            assert!(self.lines.read_line(&mut line).unwrap() > 0, "lake cp ended before {event}");
            if line.contains(&format!("\"event\":\"{event}\"")) {
                let at = line.find("\"term\":").unwrap() + 7;
                return line[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap();
            }
        }
    }
}

impl Drop for Cp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn key(block: u32) -> BlockKey {
    let mut bytes = [0x5c; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    BlockKey(bytes)
}

fn payload(key: &BlockKey) -> Vec<u8> {
    (0..PAYLOAD).map(|i| key.0[i % 4] ^ (i / 7).to_le_bytes()[0]).collect()
}

fn dp_config(dir: &Path, shm: &str, cp: &Path, dp: &Path) -> RunnerConfig {
    RunnerConfig::parse(&format!(
        r#"
[node]
id = 0

[l1]
path = "{shm}"
classes = [{{ payload_bytes = {PAYLOAD}, slots = 24 }}]
lock = false

[l2]
paths = ["{dir}/l2-0.lake", "{dir}/l2-1.lake"]
slots_per_file = 64
slot_bytes = {slot}
format_if_missing = true
queue_depth = 16

[poller]
ops_max = 16
batch_max = 8
park_max_ms = 20

[cp]
socket = "{cp}"

[agents]
socket = "{dp}"
ports = 4
"#,
        dir = dir.display(),
        cp = cp.display(),
        dp = dp.display(),
        slot = PAYLOAD + 4096,
    ))
    .unwrap()
}

fn agent_config<'a>(mirror: &'a Path, cp: &'a Path) -> AgentConfig<'a> {
    AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror,
        cp_socket: Some(cp),
        name: "failover-engine",
        namespace: NamespaceId(21),
        layout_fingerprint: 0xf41,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    }
}

/// How many of `keys` the mirror at `path` (attached anew: a new leader
/// writes a new one) holds.
fn published(path: &Path, keys: &[BlockKey]) -> usize {
    let Ok(reader) = MirrorReader::attach(path) else { return 0 };
    if !reader.is_ready() {
        return 0;
    }
    let mut table = Vec::new();
    reader.lookup(keys, &mut table)
}

/// How many of `keys` have an L1 replica, by the mirror.
fn in_l1(path: &Path, keys: &[BlockKey]) -> usize {
    let Ok(reader) = MirrorReader::attach(path) else { return 0 };
    let mut table = Vec::new();
    reader.lookup(keys, &mut table);
    table.iter().filter(|e| e.tiers & (1 << lake_dp::Tier::L1Dram as u8) != 0).count()
}

/// Two `lake cp` (A leading, B standing by), a `lake-dp` and an engine
/// that saved `BLOCKS` blocks, some of them demoted to L2 only.
struct Rig {
    // Dropped in this order: the engine and the data plane before the
    // control planes, the files last.
    engine: Option<Agent>,
    stop: Arc<AtomicBool>,
    dp: Option<std::thread::JoinHandle<lake_dp::runner::RunnerStats>>,
    a: Cp,
    b: Cp,
    first: u64,
    keys: Vec<BlockKey>,
    payloads: Vec<Vec<u8>>,
    mirror: PathBuf,
    cp_socket: PathBuf,
    dp_socket: PathBuf,
    etcd: EtcdServer,
    _scratch: Scratch,
}

impl Rig {
    fn start(name: &str, ttl: u32) -> Option<Self> {
        let etcd = EtcdServer::start(name)?;
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("lake-{name}-{pid}"));
        let shm = format!("/dev/shm/lake-{name}-l1-{pid}");
        let mirror = PathBuf::from(format!("/dev/shm/lake-{name}-mirror-{pid}"));
        let scratch = Scratch(dir.clone(), vec![PathBuf::from(&shm), mirror.clone()]);
        std::fs::create_dir_all(&dir).unwrap();
        let (cp_socket, dp_socket) = (dir.join("cp.sock"), dir.join("dp.sock"));

        let mut a = Cp::start(&etcd.endpoint(), &cp_socket, &mirror, "cp-a", ttl);
        let first = a.wait_for("leading");
        let mut b = Cp::start(&etcd.endpoint(), &cp_socket, &mirror, "cp-b", ttl);
        assert_eq!(b.wait_for("standby"), first, "the standby sees the leader's term");

        let stop = Arc::new(AtomicBool::new(false));
        let dp = {
            let (config, stop) = (dp_config(&dir, &shm, &cp_socket, &dp_socket), Arc::clone(&stop));
            std::thread::spawn(move || {
                let ports = RunnerPorts { stop: Some(stop), ..RunnerPorts::default() };
                run_with(&config, &RunnerOptions::default(), ports, &mut std::io::sink()).expect("the data plane runs")
            })
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !dp_socket.exists() {
            assert!(Instant::now() < deadline && !dp.is_finished(), "the data plane did not start");
            std::thread::sleep(Duration::from_millis(10));
        }

        // An engine saves a prompt's blocks, two at a time; the leader
        // publishes them and, L1 holding 24 (demotion above 95%, down to
        // 90%), demotes the oldest to L2. It stays attached throughout. A
        // save refused `NoSpace` (L1 full while demotions land, on a
        // loaded machine) is made again, as an engine would; any other
        // refusal fails the test, naming it.
        let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
        let payloads: Vec<Vec<u8>> = keys.iter().map(payload).collect();
        let mut engine = Agent::connect(&agent_config(&mirror, &cp_socket), &dp_socket).unwrap();
        for first in (0..BLOCKS as usize).step_by(2) {
            let blocks: Vec<SaveBlock<'_>> = (first..first + 2)
                .map(|i| SaveBlock {
                    key: keys[i],
                    parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
                    block_index: u32::try_from(i).unwrap(),
                    payload: SavePayload::Bytes(&payloads[i]),
                })
                .collect();
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut statuses = [SaveStatus::NotSent; 2];
            while engine.save_with_statuses(&blocks, &mut statuses) < 2 {
                let no_space = SaveStatus::Refused(lake_dp::agent::port::AgentError::NoSpace);
                let full = statuses.contains(&no_space)
                    && statuses
                        .iter()
                        .all(|s| matches!(s, SaveStatus::Saved | SaveStatus::ParentUnsaved) || *s == no_space);
                assert!(full && Instant::now() < deadline, "blocks {first}..: {statuses:?}");
                std::thread::sleep(Duration::from_millis(20));
            }
            while published(&mirror, &keys[..first + 2]) < first + 2 || in_l1(&mirror, &keys) > 22 {
                assert!(Instant::now() < deadline, "the leader never published (or demoted) the blocks");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        assert!(in_l1(&mirror, &keys) < keys.len(), "some blocks are in L2 only");
        Some(Self {
            engine: Some(engine),
            stop,
            dp: Some(dp),
            a,
            b,
            first,
            keys,
            payloads,
            mirror,
            cp_socket,
            dp_socket,
            etcd,
            _scratch: scratch,
        })
    }

    /// Waits until the mirror holds every block; the time since `since`.
    fn rebuilt(&self, since: Instant) -> Duration {
        let deadline = since + Duration::from_secs(15);
        while published(&self.mirror, &self.keys) < self.keys.len() {
            assert!(
                Instant::now() < deadline,
                "the new leader's view lacks blocks: {}",
                published(&self.mirror, &self.keys)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        since.elapsed()
    }

    /// The engine from before and a new one load every block exactly, the
    /// L2 ones under the new leader's leases.
    fn load_everything(&mut self, after: &str, relinks: u64) {
        let fresh = Agent::connect(&agent_config(&self.mirror, &self.cp_socket), &self.dp_socket).unwrap();
        let engines = [("the engine from before", self.engine.take().unwrap()), ("a new engine", fresh)];
        for (name, mut agent) in engines {
            let mut table = Vec::new();
            let keys = &self.keys;
            assert_eq!(agent.lookup(keys, &mut table), keys.len(), "{name}");
            let l2_only = table.iter().filter(|e| e.tier == lake_dp::Tier::L2Nvme).count();
            println!("after {after}, {name}: {} blocks, {l2_only} of them in L2 only", keys.len());
            assert!(l2_only > 0, "L2 blocks are in the view too");
            // Four at a time, each after a fresh lookup: the L2 blocks are
            // promoted into an L1 of 24 slots that the leader keeps below
            // 95% (one fetch of all 40 would run out of L1 part-way,
            // failover or not).
            let mut delivered = 0;
            let deadline = Instant::now() + Duration::from_secs(20);
            while delivered < keys.len() {
                assert!(Instant::now() < deadline, "{name}: {delivered} of {} blocks loaded", keys.len());
                let end = (delivered + 4).min(keys.len());
                assert!(agent.lookup(&keys[..end], &mut table) == end, "block {delivered}.. went missing");
                let from = delivered;
                delivered += agent.fetch(&keys[from..end], &table[from..end], |i, bytes| {
                    assert_eq!(bytes, &self.payloads[from + i][..], "{name}: block {}", from + i);
                });
                if delivered < end {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            if name == "the engine from before" {
                assert_eq!(agent.stats.cp_relinks, relinks, "its lake-cp link made again {relinks} times");
            }
        }
    }

    /// Stops the data plane; its figures.
    fn stop_dp(&mut self) -> lake_dp::runner::RunnerStats {
        self.stop.store(true, Ordering::Release);
        self.dp.take().unwrap().join().unwrap()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.engine = None;
        self.stop.store(true, Ordering::Release);
        if let Some(dp) = self.dp.take() {
            let _ = dp.join();
        }
    }
}

#[test]
fn the_leader_killed_a_standby_takes_over_and_the_data_plane_readopts_everything() {
    let Some(mut rig) = Rig::start("cp-failover", 2) else { return };
    let (first, mirror) = (rig.first, rig.mirror.clone());

    // The leader dies.
    let old_mirror = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&mirror).unwrap());
    let killed = Instant::now();
    let _ = rig.a.child.kill();
    let _ = rig.a.child.wait();
    let second = rig.b.wait_for("leading");
    let took_over = killed.elapsed();
    assert!(second > first, "terms only grow: {first} then {second}");
    let rebuilt = rig.rebuilt(killed);
    // The new leader took the mirror over: the same file engines mapped,
    // its term the new one, a live writer.
    let reader = MirrorReader::attach(&mirror).unwrap();
    assert_eq!(std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&mirror).unwrap()), old_mirror);
    assert!(reader.writer_alive() && reader.term() == second, "term {} of {second}", reader.term());
    println!(
        "failover: standby leading {} ms after the SIGKILL (lease 2 s), every block in its mirror at {} ms",
        took_over.as_millis(),
        rebuilt.as_millis()
    );
    assert!(rebuilt < Duration::from_secs(8), "{rebuilt:?}");
    rig.load_everything("the SIGKILL", 1);
    assert_eq!(rig.stop_dp().cp_reconnects, 1, "one new link, to the new leader");
}

#[test]
fn a_leader_stopped_past_its_lease_is_deposed_when_it_wakes_and_hands_over() {
    let Some(mut rig) = Rig::start("cp-stopped", 2) else { return };
    let first = rig.first;
    let pid = i32::try_from(rig.a.child.id()).unwrap();
    // SAFETY: a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped = Instant::now();
    // The standby wins the election but cannot write the mirror: the
    // stopped leader still holds it, so it waits (no two writers).
    let second = rig.b.wait_for("elected");
    let elected = stopped.elapsed();
    assert!(second > first);
    assert_eq!(rig.b.wait_for("waiting"), second);
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let woke = Instant::now();
    // It renews before it acts: deposed, it stops; the new leader serves.
    assert_eq!(rig.a.wait_for("deposed"), first);
    assert!(!rig.a.child.wait().unwrap().success(), "a deposed leader exits with a failure");
    assert_eq!(rig.b.wait_for("leading"), second);
    let rebuilt = rig.rebuilt(woke);
    println!(
        "stopped leader: the standby elected {} ms into the stop; the old leader deposed on waking, \
         every block in the new mirror {} ms after",
        elected.as_millis(),
        rebuilt.as_millis()
    );
    rig.load_everything("the stop", 1);
    assert_eq!(rig.stop_dp().cp_reconnects, 1);
}

#[test]
fn etcd_restarted_under_a_running_pool_keeps_its_leader_and_every_block() {
    // A lease of 4 s outlives etcd's restart (~1.5 s): the leader rides it.
    let Some(mut rig) = Rig::start("cp-etcd", 4) else { return };
    let first = rig.first;
    rig.etcd.kill();
    // With etcd down the pool serves on: the engine reads its L1 hits.
    let engine = rig.engine.as_mut().unwrap();
    let mut table = Vec::new();
    assert_eq!(engine.lookup(&rig.keys, &mut table), rig.keys.len());
    let in_l1: Vec<usize> = (0..rig.keys.len()).filter(|&i| table[i].tier == lake_dp::Tier::L1Dram).collect();
    assert!(!in_l1.is_empty());
    for &i in &in_l1 {
        let read = engine.fetch(&rig.keys[i..=i], &table[i..=i], |_, bytes| assert_eq!(bytes, &rig.payloads[i][..]));
        assert_eq!(read, 1, "block {i} from L1 with etcd down");
    }
    let restart = rig.etcd.run();
    // The same leader, the same term; the standby still stands by.
    let etcd = Etcd::new(&[&rig.etcd.endpoint()], Duration::from_secs(2)).unwrap();
    let cluster = Cluster::new(etcd, "failover").unwrap();
    assert_eq!(cluster.leader().unwrap(), Some(("cp-a".into(), first)));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(cluster.leader().unwrap(), Some(("cp-a".into(), first)), "it renewed after the restart");
    assert!(rig.a.child.try_wait().unwrap().is_none(), "the leader was not deposed");
    println!(
        "etcd restart: {} ms down; the leader kept term {first}; {} L1 blocks read meanwhile",
        restart.as_millis(),
        in_l1.len()
    );
    assert_eq!(published(&rig.mirror, &rig.keys), rig.keys.len());
    rig.load_everything("the etcd restart", 0);
    assert_eq!(rig.stop_dp().cp_reconnects, 0, "the data plane kept its link");
}

#[test]
fn a_socket_path_holding_a_file_not_lakes_is_refused_and_the_file_kept() {
    let Some(etcd) = EtcdServer::start("not-a-socket") else { return };
    let dir = std::env::temp_dir().join(format!("lake-not-a-socket-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mirror = PathBuf::from(format!("/dev/shm/lake-mirror-not-a-socket-{}", std::process::id()));
    let _scratch = Scratch(dir.clone(), vec![mirror.clone()]);
    // An operator's file where `--socket` points.
    let socket = dir.join("cp.sock");
    std::fs::write(&socket, "the operator's notes\n").unwrap();
    let mut cp = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["cp", "--socket"])
        .arg(&socket)
        .arg("--mirror")
        .arg(&mirror)
        .args(["--etcd", &etcd.endpoint(), "--cluster", "not-a-socket", "--id", "cp-a", "--entries", "4096"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = cp.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = cp.kill();
            let _ = cp.wait();
            panic!("lake cp serves in place of the operator's file: {:?}", std::fs::read_to_string(&socket));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut said = String::new();
    std::io::Read::read_to_string(&mut cp.stderr.take().unwrap(), &mut said).unwrap();
    assert!(!status.success() && said.contains("not a socket"), "{status}: {said}");
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "the operator's notes\n");
}

/// A node's control planes, each serving health checks at its own
/// `--metrics` address, with no file: the standby says it is alive but
/// not ready (a supervisor keeps it, a load balancer sends it nothing)
/// and leads nothing; once it takes over, the same address serves the
/// pool's metrics. An address it cannot bind stops it, saying why.
#[test]
fn a_standby_answers_health_checks_at_its_own_address_and_serves_the_pool_there_once_it_leads() {
    let Some(etcd) = EtcdServer::start("cp-health") else { return };
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("lake-cp-health-{pid}"));
    let mirror = PathBuf::from(format!("/dev/shm/lake-cp-health-mirror-{pid}"));
    let _scratch = Scratch(dir.clone(), vec![mirror.clone()]);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("cp.sock");
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (at_a, at_b) = (free(), free());

    // An address taken already: refused before it stands for anything.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_at = taken.local_addr().unwrap().to_string();
    let refused = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["cp", "--socket"])
        .arg(&socket)
        .arg("--mirror")
        .arg(&mirror)
        .args(["--etcd", &etcd.endpoint(), "--cluster", "failover", "--id", "cp-x", "--metrics", &taken_at])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && said.contains(&format!("--metrics {taken_at}")), "{said}");

    let mut a = Cp::start_with(&etcd.endpoint(), &socket, &mirror, "cp-a", 2, &["--metrics", &at_a]);
    a.wait_for("leading");
    let mut b = Cp::start_with(&etcd.endpoint(), &socket, &mirror, "cp-b", 2, &["--metrics", &at_b]);
    b.wait_for("standby");
    assert_eq!(http_get(&at_b, "/healthz"), ("HTTP/1.1 200 OK".to_owned(), "ok\n".to_owned()));
    let (status, body) = http_get(&at_b, "/readyz");
    assert!(status.contains(" 503 ") && body.contains("standing by"), "{status}: {body}");
    let (_, metrics) = http_get(&at_b, "/metrics");
    assert!(metrics.contains("lake_cp_leading 0\n") && !metrics.contains("lake_cp_blocks"), "{metrics}");
    let (_, metrics) = http_get(&at_a, "/metrics");
    assert!(metrics.contains("lake_cp_leading 1\n") && metrics.contains("lake_cp_blocks "), "{metrics}");

    // A client that connects and says nothing holds up neither the
    // standby's answers nor its takeover.
    let _silent = std::net::TcpStream::connect(&at_b).unwrap();
    assert_eq!(http_get(&at_b, "/healthz").0, "HTTP/1.1 200 OK");
    let _ = a.child.kill();
    let _ = a.child.wait();
    b.wait_for("leading");
    let (_, metrics) = http_get(&at_b, "/metrics");
    assert!(metrics.contains("lake_cp_leading 1\n") && metrics.contains("lake_cp_blocks "), "{metrics}");
    assert_eq!(http_get(&at_b, "/healthz").0, "HTTP/1.1 200 OK");
    // Ready once a data plane registers with it; none has.
    let (status, body) = http_get(&at_b, "/readyz");
    assert!(status.contains(" 503 ") && !body.contains("standing by"), "{status}: {body}");
}
