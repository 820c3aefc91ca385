//! The `lake-dp` binary as an operator runs it: the node's `lake.toml` (the
//! file `lake serve` reads), a pinned poll thread, the built-in workload,
//! SIGTERM draining to a clean stop, SIGKILL leading to a scrubbed restart,
//! an idle daemon parking instead of spinning, config errors that name the
//! key, and the data plane under a control plane in another process with an
//! engine attached, its blocks read back exact.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_cp::embedded::EmbeddedConfig;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let (arena, _) = EmbeddedConfig::new(self.0.clone()).shared_memory();
        let _ = std::fs::remove_file(arena);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Dir {
    let dir = std::env::temp_dir().join(format!("lake-runner-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Dir(dir)
}

/// A `lake.toml` for the node in `dir`, the same schema `lake serve`
/// reads: 32 L1 slots of 64 KiB, two L2 files of 128 slots; `extra` added.
fn config(dir: &Dir, extra: &str) -> PathBuf {
    let text = format!(
        "dir = {:?}\nblock-bytes = \"64KiB\"\nl1-slots = 32\nl2-slots = 128\n{extra}\n",
        dir.0.display().to_string()
    );
    let path = dir.0.join("lake.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// This build's control plane for a `lake-dp` in `dir`, in this test's
/// process: serving `DIR/cp.sock`, writing a mirror, until dropped.
struct ControlPlane {
    mirror: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<lake_cp::server::Server>>,
}

impl ControlPlane {
    fn start(dir: &Dir) -> Self {
        use lake_cp::node::Node;
        use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorWriter};

        let mirror = PathBuf::from(format!(
            "/dev/shm/lake-mirror-dp-test-{}-{}",
            std::process::id(),
            dir.0.file_name().unwrap().to_str().unwrap()
        ));
        let writer =
            MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(mirror.clone()), 1024)).unwrap();
        let tiers = lake_cp::tier::TierConfig { high_percent: 80, low_percent: 60, ..Default::default() };
        let node = Node::new(lake_dp::NodeId(0), 1, Some(writer)).with_tiers(tiers);
        let mut server = lake_cp::server::Server::bind(&dir.0.join("cp.sock"), node, 1).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                    server.poll_once(Some(Duration::from_millis(5))).unwrap();
                }
                server
            })
        };
        Self { mirror, stop, thread: Some(thread) }
    }

    /// Stops it; the server, for its counters.
    fn stop(mut self) -> lake_cp::server::Server {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.mirror);
    }
}

struct Daemon(Option<Child>);

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn start(config: &PathBuf, args: &[&str]) -> (Daemon, std::io::Lines<BufReader<std::process::ChildStdout>>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake-dp"))
        .arg("--config")
        .arg(config)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start lake-dp");
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    (Daemon(Some(child)), lines)
}

/// The value of `"key":value` in a JSON line (numbers and booleans).
fn field(line: &str, key: &str) -> String {
    let start = line.find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("{key} in {line}")) + key.len() + 3;
    line[start..].split([',', '}']).next().unwrap().to_owned()
}

fn number(line: &str, key: &str) -> u64 {
    field(line, key).parse().unwrap_or_else(|_| panic!("{key} in {line}"))
}

fn signal(daemon: &Daemon, signal: i32) {
    let pid = i32::try_from(daemon.0.as_ref().unwrap().id()).unwrap();
    // SAFETY: sends a signal to our own child.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

fn wait(mut daemon: Daemon, limit: Duration) -> std::process::ExitStatus {
    let mut child = daemon.0.take().unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("lake-dp did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn selftest_runs_then_a_restart_readopts_everything() {
    let dir = dir("selftest");
    let config = config(&dir, "");
    let (daemon, mut lines) = start(&config, &["--selftest-blocks", "400", "--cores", "0"]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(field(&serving, "event"), "\"serving\"");
    assert_eq!(number(&serving, "epoch"), 1);
    assert_eq!(number(&serving, "core"), 0);
    let stopped = lines.next().unwrap().unwrap();
    assert!(wait(daemon, Duration::from_secs(60)).success());
    assert_eq!(field(&stopped, "event"), "\"stopped\"", "{stopped}");
    assert_eq!(number(&stopped, "selftest_written"), 400);
    assert!(number(&stopped, "selftest_read") > 0);
    assert_eq!(number(&stopped, "ops_failed"), 0);
    assert!(number(&stopped, "busy_ns") > 0);

    let (daemon, mut lines) = start(&config, &["--selftest-blocks", "1"]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(number(&serving, "epoch"), 2);
    assert_eq!(field(&serving, "previous_shutdown_clean"), "true");
    assert_eq!(number(&serving, "adopted"), 256, "the 400 writes filled all 256 slots");
    assert_eq!(number(&serving, "scrubbed"), 0, "a clean shutdown leaves nothing to scrub");
    let _ = lines.next();
    assert!(wait(daemon, Duration::from_secs(60)).success());
}

#[test]
fn sigterm_drains_and_stops_clean_while_sigkill_leaves_suspects() {
    let dir = dir("signals");
    let config = config(&dir, "");
    let (daemon, mut lines) = start(&config, &["--selftest-blocks", "100000000"]);
    let _serving = lines.next().unwrap().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    signal(&daemon, libc::SIGTERM);
    let stopped = lines.next().unwrap().unwrap();
    assert!(wait(daemon, Duration::from_secs(30)).success());
    assert_eq!(field(&stopped, "event"), "\"stopped\"", "{stopped}");
    assert_eq!(number(&stopped, "abandoned"), 0);
    let written = number(&stopped, "selftest_written");
    assert!(written > 0);

    // SIGKILL mid-write: the next start scrubs what was written since.
    let (daemon, mut lines) = start(&config, &["--selftest-blocks", "100000000"]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(field(&serving, "previous_shutdown_clean"), "true");
    assert_eq!(number(&serving, "adopted"), written.min(256));
    std::thread::sleep(Duration::from_millis(300));
    signal(&daemon, libc::SIGKILL);
    assert!(!wait(daemon, Duration::from_secs(10)).success());
    let _cp = ControlPlane::start(&dir);
    let (daemon, mut lines) = start(&config, &[]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(field(&serving, "previous_shutdown_clean"), "false");
    assert!(number(&serving, "scrubbed") > 0, "{serving}");
    assert_eq!(number(&serving, "torn") + number(&serving, "damaged"), 0, "{serving}");
    signal(&daemon, libc::SIGINT);
    assert!(wait(daemon, Duration::from_secs(30)).success());
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat (11 and 12 after the name).
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[test]
fn an_idle_lake_dp_parks_instead_of_spinning() {
    let dir = dir("idle");
    let config = config(&dir, "");
    let _cp = ControlPlane::start(&dir);
    let (daemon, mut lines) = start(&config, &[]);
    let _serving = lines.next().unwrap().unwrap();
    let pid = daemon.0.as_ref().unwrap().id();
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(1));
    let used = cpu_ticks(pid) - before;
    // SAFETY: sysconf is a plain query.
    let ticks_per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap();
    assert!(used * 10 < ticks_per_second, "an idle lake-dp used {used} of {ticks_per_second} ticks in a second");
    signal(&daemon, libc::SIGTERM);
    let stopped = lines.next().unwrap().unwrap();
    assert!(wait(daemon, Duration::from_secs(30)).success());
    assert!(number(&stopped, "parks") >= 10, "{stopped}");
    assert!(number(&stopped, "parked_ns") > 900_000_000, "{stopped}");
}

#[test]
fn bad_configs_and_flags_are_named() {
    let dir = dir("bad");
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_lake-dp")).args(args).output().unwrap();
        (output.status.code(), String::from_utf8_lossy(&output.stderr).into_owned())
    };
    let typo = config(&dir, "spin-uss = 3");
    let (code, err) = run(&["--config", typo.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(err.contains("spin-uss: no such setting"), "{err}");
    // The sectioned file this binary read before is refused, saying how
    // the one file is written.
    let sectioned = dir.0.join("sectioned.toml");
    std::fs::write(&sectioned, "[node]\nid = 0\n").unwrap();
    let (code, err) = run(&["--config", sectioned.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(err.contains("node: a table: the file is flat"), "{err}");
    let good = config(&dir, "");
    // Settings this machine cannot serve exit 2 too: the shipped unit
    // does not restart a process that will fail the same way again.
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--cores", "4000"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--cores: core 4000"), "{err}");
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--numa-node", "777"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--numa-node"), "{err}");
    // So does `lake serve` (the unit's command), leaving nothing behind.
    for (flag, value) in [("--cores", "4000"), ("--numa-node", "777")] {
        let pool = dir.0.join(&flag[2..]);
        let args = ["serve", "--metrics", "off", "--l1-slots", "16", "--l2-slots", "16", flag, value, "--dir"];
        let out = Command::new(env!("CARGO_BIN_EXE_lake")).args(args).arg(&pool).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "lake serve {flag} {value}: {err}");
        assert!(err.contains(flag), "{err}");
        let (arena, mirror) = lake_cp::embedded::EmbeddedConfig::new(pool.clone()).shared_memory();
        assert!(!arena.exists() && !mirror.exists() && !pool.exists(), "{flag}: a failed start left its files");
    }
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--cores", "x"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("invalid value 'x' for '--cores"), "{err}");
    let (code, err) = run(&["--cores", "1"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--dir (or `dir` in the file) is needed"), "{err}");
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--l1-slots", "0"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("l1"), "{err}");
    // Help and version are answers, not errors.
    for flag in ["--help", "--version"] {
        let output = Command::new(env!("CARGO_BIN_EXE_lake-dp")).arg(flag).output().unwrap();
        assert!(output.status.success(), "{flag}: {output:?}");
        let shown = String::from_utf8_lossy(&output.stdout);
        assert!(shown.contains(if flag == "--help" { "Usage: lake-dp" } else { env!("CARGO_PKG_VERSION") }), "{shown}");
    }
}

#[test]
fn one_file_configures_lake_serve_and_lake_dp() {
    let dir = dir("one-file");
    // The control plane's keys too: `lake-dp` checks them and leaves them
    // to it.
    let file = config(&dir, "metrics = \"off\"\nquota = [\"7e:l2=1MiB\"]\nl1-lock = false\nlog-level = \"warn\"");
    let file_arg = file.to_str().unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_lake")).args(["config", "check", file_arg]).output().unwrap();
    assert!(check.status.success(), "{check:?}");

    let (daemon, mut lines) = start(&file, &["--selftest-blocks", "10"]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(field(&serving, "event"), "\"serving\"", "{serving}");
    assert_eq!(number(&serving, "l2_free_slots"), 256, "l2-slots from the file: {serving}");
    let l1_bytes = number(&serving, "l1_bytes");
    let stopped = lines.next().unwrap().unwrap();
    assert!(wait(daemon, Duration::from_secs(60)).success());
    assert_eq!(number(&stopped, "selftest_written"), 10, "{stopped}");
    // A flag overrides the file: 32 more L1 slots of 64 KiB (and their
    // 4 KiB headers).
    let (daemon, mut lines) = start(&file, &["--selftest-blocks", "1", "--l1-slots", "64"]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(number(&serving, "l1_bytes") - l1_bytes, 32 * 69_632, "{serving}");
    let _ = lines.next();
    assert!(wait(daemon, Duration::from_secs(60)).success());

    // `lake serve` runs the same file, and re-adopts what lake-dp wrote.
    let mut serve = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--config", file_arg])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut serve_lines = BufReader::new(serve.stdout.take().unwrap()).lines();
    let serving = serve_lines.next().unwrap().unwrap();
    assert!(serving.contains("\"event\":\"serving\""), "{serving}");
    let pool: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.0.join("pool.json")).unwrap()).unwrap();
    let (arena, _) = EmbeddedConfig::new(dir.0.clone()).shared_memory();
    assert_eq!(pool["arena"], arena.display().to_string(), "one arena name for both: {pool}");
    let daemon = Daemon(Some(serve));
    signal(&daemon, libc::SIGTERM);
    assert!(wait(daemon, Duration::from_secs(60)).success());
}

/// `lake-dp` under this build's control plane in another process (this
/// test's), an engine attached to it: 40 blocks saved into an L1 of 32,
/// demoted to L2 by the control plane, every one read back exact; then a
/// clean stop on SIGTERM.
#[test]
fn lake_dp_serves_engines_under_a_control_plane_in_another_process() {
    use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
    use lake_dp::{BlockKey, NamespaceId};

    const PAYLOAD: usize = 60 * 1024;
    let dir = dir("under-cp");
    let cp = ControlPlane::start(&dir);
    let (mirror, cp_socket) = (cp.mirror.clone(), dir.0.join("cp.sock"));
    let file = config(&dir, "");
    let (daemon, mut lines) = start(&file, &[]);
    let serving = lines.next().unwrap().unwrap();
    assert_eq!(field(&serving, "event"), "\"serving\"", "{serving}");
    let agent_config = AgentConfig {
        arena: std::path::Path::new("/nonexistent"),
        mirror: &mirror,
        cp_socket: Some(&cp_socket),
        name: "engine",
        namespace: NamespaceId(0x51),
        layout_fingerprint: 0x77,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = Agent::connect(&agent_config, &dir.0.join("dp.sock")).unwrap();
    let key = |i: usize| {
        let mut bytes = [0x3c; 16];
        bytes[..8].copy_from_slice(&(i as u64).to_le_bytes());
        BlockKey(bytes)
    };
    #[allow(clippy::cast_possible_truncation)] // a byte pattern
    let payload = |i: usize| -> Vec<u8> { (0..PAYLOAD).map(|b| (b as u8).wrapping_mul(31) ^ (i as u8)).collect() };
    let keys: Vec<BlockKey> = (0..40).map(key).collect();
    for (i, &key) in keys.iter().enumerate() {
        let bytes = payload(i);
        let deadline = Instant::now() + Duration::from_secs(20);
        let block = || SaveBlock {
            key,
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: SavePayload::Bytes(&bytes),
        };
        while agent.save(&[block()]) != 1 {
            assert!(Instant::now() < deadline, "block {i} not saved in 20 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent.lookup(&keys, &mut table) < keys.len()
        || table.iter().filter(|e| e.tier == lake_dp::Tier::L2Nvme).count() < 8
    {
        assert!(Instant::now() < deadline, "not all published, 8 in L2: {table:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut delivered = 0;
    while delivered < keys.len() {
        assert!(Instant::now() < deadline, "{delivered} of 40 read back");
        assert_eq!(agent.lookup(&keys, &mut table), keys.len());
        let end = keys.len().min(delivered + 4);
        delivered += agent.fetch(&keys[delivered..end], &table[delivered..end], |i, bytes| {
            assert_eq!(bytes, &payload(delivered + i)[..], "block {}", delivered + i);
        });
    }
    drop(agent);
    signal(&daemon, libc::SIGTERM);
    let stopped = lines.next().unwrap().unwrap();
    assert!(wait(daemon, Duration::from_secs(30)).success(), "{stopped}");
    assert_eq!(number(&stopped, "ops_failed"), 0, "{stopped}");
    assert_eq!(cp.stop().counters.bad_frames, 0);
}

/// An operator's file where the engines' socket goes is not Lake's to
/// delete: `lake-dp` refuses to start, says why, and leaves it.
#[test]
fn a_file_not_a_socket_at_the_engines_socket_path_is_refused_and_kept() {
    let dir = dir("not-a-socket");
    let _cp = ControlPlane::start(&dir);
    let socket = dir.0.join("dp.sock");
    std::fs::write(&socket, "the operator's notes\n").unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_lake-dp"))
        .arg("--config")
        .arg(config(&dir, ""))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut daemon = Daemon(Some(child));
    let mut stderr = daemon.0.as_mut().unwrap().stderr.take().unwrap();
    let status = wait(daemon, Duration::from_secs(20));
    let mut said = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut said).unwrap();
    assert!(!status.success() && said.contains("not a socket"), "{status}: {said}");
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "the operator's notes\n");
}
