//! Tenants kept apart on a node run as an operator runs it in a cluster:
//! a real etcd, the node's control plane `lake cp --config lake.toml` and
//! its data plane `lake-dp --config lake.toml` (the same file, with two
//! tenants kept apart), and two tenants' engines — the real agent library,
//! in processes of their own, run by this test as two users (`nobody` and
//! 65533), attached to both processes as the file allows them
//! (`allow-uid`, `socket-mode`). The data plane refuses a tenant's engine while its tenant's
//! mirror is not there, rather than give it the pool's. Once `lake cp`
//! leads, each tenant's blocks are published in its own mirror alone: the
//! other tenant's engine finds none of its keys, and the pool's mirror
//! holds neither tenant's. A `lake cp` that takes over after its
//! predecessor is killed takes the tenants' mirrors over too (the same
//! files) and republishes every block there. Needs root to run processes
//! as other users: skipped, with the reason printed, otherwise.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig};
use lake_cp::embedded::EmbeddedConfig;
use lake_dp::BlockKey;

#[path = "common/etcd.rs"]
mod etcd_server;
use etcd_server::EtcdServer;

#[path = "common/scratch.rs"]
mod scratch;
use scratch::Scratch;

#[path = "common/as_user.rs"]
mod as_user;
use as_user::{load_and_say, published, run_engine, save_at_once};

const ACME_UID: u32 = 65_534;
const BOLT_UID: u32 = 65_533;
const ACME: u64 = 0xa1;
const BOLT: u64 = 0xb1;
/// A namespace no tenant kept apart holds: partition 0, the pool's mirror.
const OTHER: u64 = 0xc1;
const BLOCKS: usize = 4;
const ENGINE: &str = "LAKE_TENANT_ENGINE";
const THIS_TEST: &str = "lake_cp_publishes_each_tenant_kept_apart_in_its_own_mirror_and_takes_them_over";

fn keys(namespace: u64) -> Vec<BlockKey> {
    (0..BLOCKS)
        .map(|i| {
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&namespace.to_le_bytes());
            key[8] = u8::try_from(i).unwrap();
            key[9] = 0x3c;
            BlockKey(key)
        })
        .collect()
}

fn payload(namespace: u64, i: usize) -> Vec<u8> {
    vec![namespace.to_le_bytes()[0] ^ u8::try_from(i).unwrap(); 4096]
}

/// The engine, in the child process: `DP_SOCKET|MIRROR|NAMESPACE|ACTION`.
/// `save` saves the namespace's blocks; `save` and `check` then wait for
/// their hits and load them; `peek` looks them up once. Says what it saw
/// on lines starting `engine:`.
fn engine_child(spec: &str) {
    let [dp, mirror, namespace, action] = spec.split('|').collect::<Vec<_>>()[..] else { panic!("{spec}") };
    let namespace = u64::from_str_radix(namespace, 16).unwrap();
    // Attached as an engine attaches: to the node's control plane too.
    let cp = Path::new(dp).with_file_name("cp.sock");
    let config = AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(mirror),
        cp_socket: Some(&cp),
        name: "tenant-engine",
        namespace: lake_dp::NamespaceId(namespace),
        layout_fingerprint: 1,
        segment_bytes: 4096,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = match Agent::connect(&config, Path::new(dp)) {
        Ok(agent) => agent,
        Err(e) => return println!("engine: refused: {e}"),
    };
    let keys = keys(namespace);
    if action == "save" {
        println!("engine: saved {}", save_at_once(&mut agent, &keys, |i| payload(namespace, i)));
    }
    let wait = if action == "peek" { Duration::ZERO } else { Duration::from_secs(10) };
    let deadline = Instant::now() + wait;
    let mut table = Vec::new();
    let mut hits = agent.lookup(&keys, &mut table);
    while hits < BLOCKS && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        hits = agent.lookup(&keys, &mut table);
    }
    println!("engine: hits {hits}");
    if action != "peek" {
        load_and_say(&mut agent, &keys, &table, hits, |i| payload(namespace, i));
    }
}

/// Runs the engine as `uid`: what it said.
fn engine(uid: u32, dp: &Path, mirror: &Path, namespace: u64, action: &str) -> String {
    let spec = format!("{}|{}|{namespace:x}|{action}", dp.display(), mirror.display());
    let said = run_engine(THIS_TEST, ENGINE, uid, &spec);
    println!("uid {uid}, namespace {namespace:x}, {action}:\n{said}");
    said
}

/// A child, with what it has said on stdout (read as it comes, so it
/// never waits on a full pipe); killed when dropped.
struct Process(Child, std::sync::Arc<std::sync::Mutex<String>>);

impl Process {
    fn start(command: &mut Command) -> Self {
        let mut child = command.stdout(Stdio::piped()).spawn().unwrap();
        let said = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (out, into) = (BufReader::new(child.stdout.take().unwrap()), std::sync::Arc::clone(&said));
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let mut said = into.lock().unwrap();
                said.push_str(&line);
                said.push('\n');
            }
        });
        Self(child, said)
    }

    /// Waits until it has said `what`.
    fn wait_for(&mut self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.1.lock().unwrap().contains(what) {
            assert!(Instant::now() < deadline, "never said {what}: {}", self.1.lock().unwrap());
            assert!(self.0.try_wait().unwrap().is_none(), "ended before {what}: {}", self.1.lock().unwrap());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `lake cp` for the node in `dir`, then `more` arguments.
fn control_plane(etcd: &str, dir: &Path, id: &str, more: &[&std::ffi::OsStr]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_lake"));
    command.args(["cp", "--socket"]).arg(dir.join("cp.sock")).args(more);
    command.args(["--etcd", etcd, "--cluster", "tenants", "--id", id, "--ttl", "2", "--entries", "4096"]);
    command
}

#[test]
fn lake_cp_publishes_each_tenant_kept_apart_in_its_own_mirror_and_takes_them_over() {
    if let Ok(spec) = std::env::var(ENGINE) {
        return engine_child(&spec);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: running processes as other users needs root");
        return;
    }
    let Some(etcd) = EtcdServer::start("tenant-mirrors") else { return };
    let dir = std::env::temp_dir().join(format!("lake-tenant-mirrors-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (arena, mirror) = EmbeddedConfig::new(dir.clone()).shared_memory();
    let beside = |path: &Path, name: &str| PathBuf::from(format!("{}.{name}", path.display()));
    let (acme_mirror, bolt_mirror) = (beside(&mirror, "acme"), beside(&mirror, "bolt"));
    let files = ["shared", "acme", "bolt"].map(|name| beside(&arena, name));
    let _scratch =
        Scratch(dir.clone(), [&[arena, mirror.clone(), acme_mirror.clone(), bolt_mirror.clone()][..], &files].concat());
    let config = dir.join("lake.toml");
    std::fs::write(
        &config,
        format!(
            "dir = {:?}\nblock-bytes = \"64KiB\"\nl1-slots = 32\nl2-slots = 64\nsocket-mode = \"666\"\n\
             metrics = \"127.0.0.1:0\"\n\
             allow-uid = [{ACME_UID}, {BOLT_UID}]\ntenant = [\"acme={ACME:x}\", \"bolt={BOLT:x}\"]\n\
             tenant-quota = [\"acme:l1=1MiB\", \"bolt:l1=1MiB\"]\n\
             tenant-partition = [\"acme:uid={ACME_UID}\", \"bolt:uid={BOLT_UID}\"]\n",
            dir.display().to_string()
        ),
    )
    .unwrap();
    let dp_socket = dir.join("dp.sock");

    let etcd = etcd.endpoint();
    let with_config = [std::ffi::OsStr::new("--config"), config.as_os_str()];

    // A `--mirror` other than the one the data plane gives its engines
    // is refused before anything starts.
    let wrong = Path::new("/dev/shm/lake-tenant-mirrors-elsewhere");
    let out =
        control_plane(&etcd, &dir, "cp-wrong", &[&with_config[..], &["--mirror".as_ref(), wrong.as_ref()]].concat())
            .output()
            .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("gives its engines"), "{err}");
    assert!(!wrong.exists());

    // A control plane not told of the tenants (no `--config`) makes the
    // pool's mirror alone: the data plane refuses a tenant's engine
    // rather than give it the pool's mirror.
    let mut cp = Process::start(&mut control_plane(&etcd, &dir, "cp-0", &["--mirror".as_ref(), mirror.as_os_str()]));
    cp.wait_for("\"event\":\"leading\"");
    let mut dp = Process::start(Command::new(env!("CARGO_BIN_EXE_lake-dp")).arg("--config").arg(&config));
    dp.wait_for("\"event\":\"serving\"");
    let said = engine(ACME_UID, &dp_socket, &mirror, ACME, "peek");
    assert!(said.contains("refused") && said.contains("mirror cannot be opened yet"), "{said}");
    assert!(!acme_mirror.exists());

    // One told (`--config`, the data plane's file) takes over from it.
    drop(cp);
    let mut cp = Process::start(&mut control_plane(&etcd, &dir, "cp-a", &with_config));
    cp.wait_for("\"event\":\"leading\"");
    for path in [&acme_mirror, &bolt_mirror] {
        let meta = std::fs::metadata(path).expect("a mirror of the tenant's own");
        assert_eq!(meta.mode() & 0o777, 0o600, "{}: the pool's user's alone", path.display());
    }

    // Each tenant saves and loads its own; neither finds the other's.
    let said = engine(ACME_UID, &dp_socket, &mirror, ACME, "save");
    assert!(said.contains("saved 4") && said.contains("loaded 4 exact"), "{said}");
    let said = engine(BOLT_UID, &dp_socket, &mirror, BOLT, "save");
    assert!(said.contains("saved 4") && said.contains("loaded 4 exact"), "{said}");
    assert!(engine(BOLT_UID, &dp_socket, &mirror, ACME, "peek").contains("hits 0"));
    assert!(engine(ACME_UID, &dp_socket, &mirror, BOLT, "peek").contains("hits 0"));
    // The pool's own user saves a namespace of no tenant kept apart.
    let said = engine(0, &dp_socket, &mirror, OTHER, "save");
    assert!(said.contains("saved 4") && said.contains("loaded 4 exact"), "{said}");
    // Where each is published: in its own mirror, and no other.
    let count = |path: &Path| [ACME, BOLT, OTHER].map(|namespace| published(path, &keys(namespace)));
    assert_eq!(count(&acme_mirror), [4, 0, 0], "acme's mirror");
    assert_eq!(count(&bolt_mirror), [0, 4, 0], "bolt's mirror");
    assert_eq!(count(&mirror), [0, 0, 4], "the pool's mirror");

    // The leader is killed; the next takes the same files over and the
    // data plane's re-adopted blocks are published in them again.
    let inode = std::fs::metadata(&acme_mirror).unwrap().ino();
    drop(cp);
    let mut cp = Process::start(&mut control_plane(&etcd, &dir, "cp-b", &with_config));
    cp.wait_for("\"event\":\"leading\"");
    assert_eq!(std::fs::metadata(&acme_mirror).unwrap().ino(), inode, "acme's mirror taken over, not made anew");
    let said = engine(ACME_UID, &dp_socket, &mirror, ACME, "check");
    assert!(said.contains("hits 4") && said.contains("loaded 4 exact"), "{said}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&acme_mirror) != [4, 0, 0] || count(&bolt_mirror) != [0, 4, 0] || count(&mirror) != [0, 0, 4] {
        assert!(
            Instant::now() < deadline,
            "after the takeover: {:?}",
            [&acme_mirror, &bolt_mirror, &mirror].map(|m| count(m))
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // SIGTERM: the data plane stops cleanly.
    // SAFETY: the pid is the data plane's, a child not yet waited for.
    assert_eq!(unsafe { libc::kill(i32::try_from(dp.0.id()).unwrap(), libc::SIGTERM) }, 0);
    assert!(dp.0.wait().unwrap().success(), "lake-dp stops cleanly");
    drop(cp);
}
