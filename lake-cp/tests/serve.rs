//! `lake serve`, the pool an engine in another process attaches to: it must
//! stop cleanly on SIGTERM (drained, flushed, a "stopped" line, exit 0)
//! and remove what it made and does not keep — never a file of the
//! operator's, never the L2 files a restart re-adopts. Its data plane once
//! read the same signal from a signalfd of its own, stopped alone, and
//! left the command waiting for ever; it once removed its whole directory,
//! L2 and the operator's files with it, at every stop.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A `lake serve` process, killed if a test ends (or fails) with it running.
struct Serve(std::process::Child);

impl std::ops::Deref for Serve {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Serve {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `lake serve` of a small pool with `extra` arguments, once it says it is
/// serving; its stdout, past that line.
fn serving<S: AsRef<std::ffi::OsStr>>(
    extra: impl IntoIterator<Item = S>,
) -> (Serve, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--block-bytes", "65536", "--l1-slots", "32", "--l2-slots", "32"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let child = Serve(child);
    let mut serving = String::new();
    out.read_line(&mut serving).unwrap();
    assert!(serving.contains("\"event\":\"serving\""), "{serving}");
    (child, out)
}

#[test]
fn serve_stops_on_sigterm_and_cleans_up() {
    let dir = std::env::temp_dir().join(format!("lake-serve-test-{}", std::process::id()));
    let (mut child, out) = serving([std::ffi::OsStr::new("--dir"), dir.as_os_str()]);
    assert!(dir.join("dp.sock").exists(), "the attach socket is there while serving");

    sigterm(&child);
    let status = exited(&mut child, 20);
    let mut rest = String::new();
    for line in out.lines() {
        rest += &line.unwrap();
    }
    assert!(status.success(), "{status}: {rest}");
    assert!(rest.contains("\"event\":\"stopped\""), "{rest}");
    // Its sockets, lock and record go; its L2 files stay for the next start.
    assert_nothing_of_a_running_pool_left(&dir);
    assert!(dir.join("l2-0.lake").exists() && dir.join("l2-1.lake").exists(), "the L2 files went");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pool's sockets, lock and record are gone from `dir`.
fn assert_nothing_of_a_running_pool_left(dir: &std::path::Path) {
    for gone in ["dp.sock", "cp.sock", "admin.sock", "lake.lock", "pool.json"] {
        assert!(!dir.join(gone).exists(), "{gone} is left behind");
    }
}

/// Waits for `child` to exit within `seconds`; its status.
fn exited(child: &mut std::process::Child, seconds: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("lake serve did not exit within {seconds} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn sigterm(child: &std::process::Child) {
    // SAFETY: a plain syscall on the child's pid.
    assert_eq!(unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) }, 0);
}

/// A field of the `serving` line.
fn field(line: &str, name: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(line).unwrap();
    value[name].as_str().unwrap_or_default().to_owned()
}

const BLOCKS: u32 = 40;
const PAYLOAD: usize = 60 * 1024;

fn key(block: u32) -> lake_dp::BlockKey {
    let mut bytes = [0x5c; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    lake_dp::BlockKey(bytes)
}

fn payload(block: u32) -> Vec<u8> {
    let seed = block.to_le_bytes()[0];
    (0..PAYLOAD).map(|i| seed.wrapping_mul(31) ^ (i * 7 + i / 251).to_le_bytes()[0]).collect()
}

fn engine(dir: &std::path::Path, mirror: &str) -> lake_dp::agent::Agent {
    let cp = dir.join("cp.sock");
    let config = lake_dp::agent::AgentConfig {
        arena: std::path::Path::new("/nonexistent"),
        mirror: std::path::Path::new(mirror),
        cp_socket: Some(&cp),
        name: "restart-test",
        namespace: lake_dp::NamespaceId(0x5c),
        layout_fingerprint: 0x5c5c,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    lake_dp::agent::Agent::connect(&config, &dir.join("dp.sock")).unwrap()
}

/// The directory is the operator's and the pool's L2 its recovery point:
/// 40 acked blocks, only in L1 when it stops, are exact after SIGTERM and a restart (the
/// stop wrote them down to L2, the start re-adopted them); a file of the
/// operator's in the directory survives both stops; nothing is left in
/// /dev/shm.
#[test]
fn acked_blocks_and_the_operators_files_survive_a_clean_restart() {
    let dir = std::env::temp_dir().join(format!("lake-serve-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let canary = dir.join("operator-notes.txt");
    std::fs::write(&canary, b"not Lake's").unwrap();
    let args = || {
        [
            "--dir".into(),
            dir.clone().into_os_string(),
            "--l1-slots".into(),
            "64".into(),
            "--l2-slots".into(),
            "64".into(),
        ]
    };
    let keys: Vec<lake_dp::BlockKey> = (0..BLOCKS).map(key).collect();
    let payloads: Vec<Vec<u8>> = (0..BLOCKS).map(payload).collect();

    let (mut first, mut out) = serving(args());
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let (arena, mirror) = (field(&record, "arena"), field(&record, "mirror"));
    let mut agent = engine(&dir, &mirror);
    let blocks: Vec<lake_dp::agent::SaveBlock<'_>> = (0..BLOCKS as usize)
        .map(|i| lake_dp::agent::SaveBlock {
            key: keys[i],
            parent: if i == 0 { lake_dp::BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: lake_dp::agent::SavePayload::Bytes(&payloads[i]),
        })
        .collect();
    assert_eq!(agent.save(&blocks), BLOCKS as usize, "every save acked");
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < keys.len() {
        assert!(Instant::now() < deadline, "the saves were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(agent);
    sigterm(&first);
    assert!(exited(&mut first, 60).success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(rest.contains("\"event\":\"l1_written_down\",\"blocks_left\":0"), "{rest}");
    assert_eq!(std::fs::read(&canary).unwrap(), b"not Lake's");
    assert!(!std::path::Path::new(&arena).exists() && !std::path::Path::new(&mirror).exists(), "shm left");

    let (mut second, _out) = serving(args());
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let mut agent = engine(&dir, &field(&record, "mirror"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while agent.lookup(&keys, &mut table) < keys.len() {
        assert!(Instant::now() < deadline, "the restarted pool did not re-adopt the blocks");
        std::thread::sleep(Duration::from_millis(20));
    }
    let delivered = agent.fetch(&keys, &table, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, keys.len());
    drop(agent);
    sigterm(&second);
    assert!(exited(&mut second, 60).success());
    assert_eq!(std::fs::read(&canary).unwrap(), b"not Lake's");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One pool per directory: a second `lake serve` on it exits non-zero at
/// once, naming the first's pid, and touches nothing of it — the first
/// keeps serving (its engines still attach).
#[test]
fn a_second_pool_on_the_same_directory_is_refused_and_the_first_serves_on() {
    let dir = std::env::temp_dir().join(format!("lake-serve-twice-{}", std::process::id()));
    let (mut first, _out) = serving([std::ffi::OsStr::new("--dir"), dir.as_os_str()]);
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let started = Instant::now();
    let mut second = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--block-bytes", "65536", "--l1-slots", "32", "--l2-slots", "32", "--dir"])
        .arg(&dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = String::new();
    let mut pipe = second.stderr.take().unwrap();
    let status = exited(&mut second, 10);
    std::io::Read::read_to_string(&mut pipe, &mut stderr).unwrap();
    assert!(!status.success());
    assert!(started.elapsed() < Duration::from_secs(5), "refused only after {:?}", started.elapsed());
    assert!(stderr.contains(&format!("another pool serves this directory (pid {})", first.id())), "{stderr}");
    assert_eq!(std::fs::read_to_string(dir.join("pool.json")).unwrap(), record, "the first's record was touched");
    let agent = engine(&dir, &field(&record, "mirror"));
    assert!(agent.data_plane_alive(), "the first pool no longer serves");
    drop(agent);
    sigterm(&first);
    assert!(exited(&mut first, 60).success());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `lake serve`'s security flags: a key file others may read is refused
/// by name before anything starts; a good link key, a tenant key, a quota
/// and the socket's mode are taken, and the socket is made so.
#[test]
fn serve_takes_its_keys_only_from_owner_only_files() {
    use std::os::unix::fs::PermissionsExt;
    let base = std::env::temp_dir().join(format!("lake-serve-keys-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let keygen = |name: &str| {
        let path = base.join(name);
        let out = Command::new(env!("CARGO_BIN_EXE_lake")).arg("keygen").arg(&path).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("\"key_id\""));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        path
    };
    let (link, tenant) = (keygen("cluster.key"), keygen("tenant.key"));
    let keys = base.join("tenants");
    std::fs::create_dir_all(&keys).unwrap();
    let other_tenant = keygen("tenants/8e8e.key");
    // keygen never overwrites a key.
    let again = Command::new(env!("CARGO_BIN_EXE_lake")).arg("keygen").arg(&link).output().unwrap();
    assert!(!again.status.success());

    let exposed = base.join("exposed.key");
    std::fs::copy(&link, &exposed).unwrap();
    std::fs::set_permissions(&exposed, std::fs::Permissions::from_mode(0o644)).unwrap();
    let dir = base.join("pool");
    let refused = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--link-key"])
        .arg(&exposed)
        .arg("--dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("chmod 600") && said.contains("exposed.key"), "{said}");
    assert!(!dir.exists(), "nothing started");
    let too_many = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--tag-threads", "1000", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!too_many.status.success());
    assert!(String::from_utf8_lossy(&too_many.stderr).contains("--tag-threads 1000: 1000 tag threads: at most 64"));
    // A tenant quota needs the tenant's namespaces; a namespace has one tenant.
    for (args, said) in [
        (&["--tenant-quota", "acme:l1=4096"][..], "no --tenant acme=NAMESPACE"),
        (&["--tenant", "acme=7e7e,7f7f", "--tenant", "beta=7f7f"][..], "tenant acme's already"),
        (&["--tenant", "acme=7e7e,zz"][..], "NAME=NAMESPACE(hex)"),
        (
            &["--tenant", "acme=7e7e", "--tenant-rate", "acme:net-sent=1000"][..],
            "net-send|net-receive|push=BYTES_PER_S",
        ),
        (&["--tenant", "acme=7e7e", "--tenant-rate", "acme:net-send=0"][..], "(at least 1)"),
        (&["--l1-class", "28672"][..], "--l1-class 28672: PAYLOAD_BYTES:SLOTS"),
    ] {
        let out =
            Command::new(env!("CARGO_BIN_EXE_lake")).arg("serve").args(args).arg("--dir").arg(&dir).output().unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(said), "{args:?}: {stderr}");
    }
    assert!(!dir.exists(), "nothing started");

    let quota = [
        "--quota",
        "7e7e:l2=1048576",
        "--tenant-rate",
        "acme:net-send=1048576",
        "--tenant",
        "acme=7e7e,7f7f",
        "--tenant-quota",
        "acme:l1=4194304",
        "--socket-mode",
        "660",
        "--transport-listen",
        "127.0.0.1:0",
    ];
    let mut extra: Vec<std::ffi::OsString> = quota.iter().map(std::ffi::OsString::from).collect();
    extra.extend(["--link-key".into(), link.clone().into_os_string(), "--tag-threads".into(), "2".into()]);
    extra.push("--tenant-key".into());
    extra.push(format!("7e7e={}", tenant.display()).into());
    extra.extend(["--dir".into(), dir.clone().into_os_string(), "--tenant-keys".into(), keys.clone().into_os_string()]);
    let (mut child, mut out) = serving(extra);
    assert_eq!(std::fs::metadata(dir.join("dp.sock")).unwrap().permissions().mode() & 0o777, 0o660);
    // Crypto-shredding from the shell: the tenant's key file goes, SIGHUP,
    // and the pool forgets it (purging its blocks).
    std::fs::remove_file(&other_tenant).unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: a plain syscall on the child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    let mut reloaded = String::new();
    out.read_line(&mut reloaded).unwrap();
    assert!(
        reloaded.contains("\"event\":\"tenant_keys\"") && reloaded.contains("\"forgotten\":[\"0000000000008e8e\"]"),
        "{reloaded}"
    );
    // SAFETY: a plain syscall on the child's pid.
    assert_eq!(unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) }, 0);
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&base);
}

/// A start that cannot serve exits non-zero within seconds, saying why,
/// and leaves nothing in /dev/shm and no file of the operator's touched:
/// a truncated L2 file, an L1 larger than shared memory.
#[test]
fn a_start_that_cannot_serve_exits_at_once_leaving_nothing_behind() {
    let root = std::env::temp_dir().join(format!("lake-serve-fails-{}", std::process::id()));
    let truncated = root.join("truncated");
    std::fs::create_dir_all(&truncated).unwrap();
    std::fs::write(truncated.join("l2-0.lake"), [7u8; 100]).unwrap();
    std::fs::write(truncated.join("operator-notes.txt"), b"mine").unwrap();
    for (dir, extra, said) in
        [(&truncated, "32", "l2-0.lake: 100 bytes"), (&root.join("huge"), "4000000", "cannot reserve")]
    {
        let started = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
            .args(["serve", "--block-bytes", "65536", "--l2-slots", "32", "--l1-slots", extra, "--dir"])
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let status = exited(&mut child, 10);
        let (mut stdout, mut stderr) = (String::new(), String::new());
        std::io::Read::read_to_string(&mut out, &mut stdout).unwrap();
        std::io::Read::read_to_string(&mut err, &mut stderr).unwrap();
        assert!(!status.success(), "{stdout}");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        assert!(stderr.contains(said), "{stderr}");
        assert!(!stdout.contains("\"event\":\"serving\""), "said serving: {stdout}");
        let left: Vec<String> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with("lake-") && name.contains(&format!("-{pid}-")))
            .collect();
        assert!(left.is_empty(), "left in /dev/shm: {left:?}");
        assert_nothing_of_a_running_pool_left(dir);
    }
    assert_eq!(std::fs::read(truncated.join("operator-notes.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read(truncated.join("l2-0.lake")).unwrap(), [7u8; 100], "a file it did not make was changed");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A pool killed (SIGKILL) leaves its shared memory; the next pool of the
/// same directory removes it (the lock file names it) and serves.
#[test]
fn the_next_pool_of_a_directory_removes_what_a_killed_one_left_in_shm() {
    let dir = std::env::temp_dir().join(format!("lake-serve-killed-{}", std::process::id()));
    let (mut killed, _out) = serving([std::ffi::OsStr::new("--dir"), dir.as_os_str()]);
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let left = [field(&record, "arena"), field(&record, "mirror")];
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(left.iter().all(|path| std::path::Path::new(path).exists()), "a killed pool's shm is still there");
    let (mut next, _out) = serving([std::ffi::OsStr::new("--dir"), dir.as_os_str()]);
    for path in &left {
        assert!(!std::path::Path::new(path).exists(), "{path} is left behind");
    }
    sigterm(&next);
    assert!(exited(&mut next, 60).success());
    std::fs::remove_dir_all(&dir).unwrap();
}
