//! A real `lake-dp` runner (the library the `lake-dp` binary runs, on a
//! thread here) connects to the control plane's socket, registers its
//! regions, and reports every block it writes, evicts and — after a
//! restart — re-adopts; the control plane's view and its mirror follow.

use std::path::PathBuf;
use std::time::Duration;

use lake_cp::node::Node;
use lake_cp::server::Server;
use lake_dp::NodeId;
use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorReader, MirrorWriter};
use lake_dp::runner::config::RunnerConfig;
use lake_dp::runner::{RunnerOptions, RunnerStats, run};

#[path = "common/scratch.rs"]
mod scratch;
use scratch::Scratch;

fn config(dir: &std::path::Path, shm: &str, socket: &std::path::Path) -> RunnerConfig {
    RunnerConfig::parse(&format!(
        r#"
[node]
id = 0

[l1]
path = "{shm}"
classes = [{{ payload_bytes = 65536, slots = 32 }}]
lock = false

[l2]
paths = ["{dir}/l2-0.lake", "{dir}/l2-1.lake"]
slots_per_file = 64
slot_bytes = 69632
format_if_missing = true
queue_depth = 16

[poller]
ops_max = 8
batch_max = 8
park_max_ms = 20

[cp]
socket = "{socket}"
"#,
        dir = dir.display(),
        socket = socket.display()
    ))
    .unwrap()
}

/// Runs the data plane with `blocks` of its built-in workload while the
/// server answers; returns its stats and what it printed.
fn run_dp(server: &mut Server, config: &RunnerConfig, blocks: u64) -> (RunnerStats, String) {
    let config = config.clone();
    let dp = std::thread::spawn(move || {
        let mut out = Vec::new();
        let options = RunnerOptions { selftest_blocks: blocks, ..RunnerOptions::default() };
        let stats = run(&config, &options, &mut out).expect("the runner runs");
        (stats, String::from_utf8(out).unwrap())
    });
    while !dp.is_finished() {
        server.poll_once(Some(Duration::from_millis(5))).unwrap();
    }
    let result = dp.join().unwrap();
    // What it wrote just before it stopped.
    for _ in 0..20 {
        server.poll_once(Some(Duration::from_millis(5))).unwrap();
    }
    result
}

fn field(text: &str, name: &str) -> u64 {
    let at = text.find(&format!("\"{name}\":")).unwrap_or_else(|| panic!("no {name} in {text}")) + name.len() + 3;
    text[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

#[test]
fn the_data_plane_reports_and_the_control_plane_follows_across_a_restart() {
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("lake-cp-link-{pid}"));
    let shm = format!("/dev/shm/lake-cp-link-l1-{pid}");
    let mirror_path = PathBuf::from(format!("/dev/shm/lake-cp-link-mirror-{pid}"));
    let _scratch = Scratch(dir.clone(), vec![PathBuf::from(&shm), mirror_path.clone()]);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("cp.sock");
    let mirror =
        MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(mirror_path.clone()), 1000)).unwrap();
    let reader = MirrorReader::attach(&mirror_path).unwrap();
    let mut server = Server::bind(&socket, Node::new(NodeId(0), 1, Some(mirror)), 1).unwrap();
    let config = config(&dir, &shm, &socket);

    // First run: 300 blocks into 128 L2 slots, so the oldest are evicted.
    let (stats, out) = run_dp(&mut server, &config, 300);
    assert!(stats.selftest_written >= 300, "{out}");
    assert_eq!((stats.cp_dropped, stats.cp_refused), (0, 0), "{out}");
    let node = server.node();
    assert_eq!(node.counters.regions, 3, "two L2 files and the L1 arena");
    assert_eq!(node.counters.committed, stats.selftest_written);
    assert!(node.counters.evicted > 0);
    let live = node.counters.committed - node.counters.evicted;
    assert!(live <= 128);
    assert_eq!(reader.live(), live, "the mirror holds what is ready");
    assert_eq!(node.counters.refused, 0);
    // Above its high-water mark the control plane evicted from L2 itself,
    // and the data plane carried each command out.
    assert!(stats.pool.evictions > 0, "{out}");
    assert!(node.tiers.counters.drops[lake_dp::Tier::L2Nvme as usize] >= stats.pool.evictions);

    // Restart: a new epoch; what re-adoption finds is reported again and
    // becomes ready under it.
    let (stats, out) = run_dp(&mut server, &config, 10);
    let adopted = field(&out, "adopted");
    // Every block live at the stop comes back; so may blocks the control
    // plane evicted whose slots were not written again (an evicted object
    // stays intact on disk until its slot is reused).
    assert!(adopted >= live && adopted <= 128, "{adopted} adopted, {live} live: {out}");
    let node = server.node();
    assert_eq!(node.counters.regions, 6);
    assert_eq!(node.counters.readopted, adopted);
    assert_eq!(node.counters.refused, 0, "{:?}", node.counters);
    assert_eq!(stats.cp_refused, 0);
    assert!(server.counters.bad_frames == 0);
}
