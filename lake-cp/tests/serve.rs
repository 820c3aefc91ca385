//! `lake serve`, the pool an engine in another process attaches to: it must
//! stop cleanly on SIGTERM (drained, flushed, a "stopped" line, exit 0)
//! and remove what it made and does not keep — never a file of the
//! operator's, never the L2 files a restart re-adopts. Its data plane once
//! read the same signal from a signalfd of its own, stopped alone, and
//! left the command waiting for ever; it once removed its whole directory,
//! L2 and the operator's files with it, at every stop.

#[path = "common/served.rs"]
#[allow(dead_code)] // this file starts its pools its own way
mod served;
#[path = "common/supervise.rs"]
mod supervise;

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
        .args(["serve", "--metrics", "127.0.0.1:0", "--block-bytes", "65536", "--l1-slots", "32", "--l2-slots", "32"])
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

/// One prompt's blocks to save: each the child of the one before.
fn chain<'a>(keys: &[lake_dp::BlockKey], payloads: &'a [Vec<u8>]) -> Vec<lake_agent::SaveBlock<'a>> {
    (0..keys.len())
        .map(|i| lake_agent::SaveBlock {
            key: keys[i],
            parent: if i == 0 { lake_dp::BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: lake_agent::SavePayload::Bytes(&payloads[i]),
        })
        .collect()
}

fn engine(dir: &std::path::Path, mirror: &str) -> lake_agent::Agent {
    served::engine(dir, mirror, 0x5c).unwrap()
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
    let blocks = chain(&keys, &payloads);
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

    restarted_pool_serves_them_exact(args(), &dir, &keys, &payloads);
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
        .args([
            "serve",
            "--metrics",
            "127.0.0.1:0",
            "--block-bytes",
            "65536",
            "--l1-slots",
            "32",
            "--l2-slots",
            "32",
            "--dir",
        ])
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
        (&["--tenant", "acme=7e7e,zz"][..], "namespace \"zz\": not hex"),
        (
            &["--tenant", "acme=7e7e", "--tenant-rate", "acme:net-sent=1000"][..],
            "net-send|push|net-receive=SIZE (bytes per second)",
        ),
        (&["--tenant", "acme=7e7e", "--tenant-rate", "acme:net-send=0"][..], "at least 1 byte per second"),
        (&["--l1-class", "28672"][..], "PAYLOAD_SIZE:SLOTS"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_lake"))
            .args(["serve", "--metrics", "127.0.0.1:0"])
            .args(args)
            .arg("--dir")
            .arg(&dir)
            .output()
            .unwrap();
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
            .args([
                "serve",
                "--metrics",
                "127.0.0.1:0",
                "--block-bytes",
                "65536",
                "--l2-slots",
                "32",
                "--l1-slots",
                extra,
                "--dir",
            ])
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
        let _ = pid;
        let (arena, mirror) = lake_cp::embedded::EmbeddedConfig::new(dir.clone()).shared_memory();
        assert!(!arena.exists() && !mirror.exists(), "left in /dev/shm: {arena:?} {mirror:?}");
        assert_nothing_of_a_running_pool_left(dir);
        // No L2 file this start made stays; a directory it made goes.
        assert!(!dir.join("l2-1.lake").exists(), "a failed start left an L2 file it formatted");
        if dir.ends_with("huge") {
            assert!(!dir.exists(), "a failed start left the directory it made");
        }
    }
    assert_eq!(std::fs::read(truncated.join("operator-notes.txt")).unwrap(), b"mine");
    assert_eq!(std::fs::read(truncated.join("l2-0.lake")).unwrap(), [7u8; 100], "a file it did not make was changed");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A pool killed (SIGKILL) leaves its shared memory; the next pool of the
/// same directory removes it (the lock file names it) and serves.
#[test]
fn the_next_pool_of_a_directory_removes_what_a_killed_one_left_in_shm() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("lake-serve-killed-{}", std::process::id()));
    let (mut killed, _out) = serving([std::ffi::OsStr::new("--dir"), dir.as_os_str()]);
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let left = [field(&record, "arena"), field(&record, "mirror")];
    killed.kill().unwrap();
    killed.wait().unwrap();
    let inode = |path: &str| std::fs::metadata(path).map(|m| m.ino()).ok();
    let before: Vec<_> = left.iter().map(|p| inode(p)).collect();
    assert!(before.iter().all(Option::is_some), "a killed pool's shm is still there");
    let (mut next, _out) = serving([std::ffi::OsStr::new("--dir"), dir.as_os_str()]);
    // The same names (an engine's config names them), new files.
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    assert_eq!([field(&record, "arena"), field(&record, "mirror")], left, "names are the directory's");
    for (path, old) in left.iter().zip(&before) {
        assert_ne!(inode(path), *old, "{path}: the killed pool's file is still there");
    }
    sigterm(&next);
    assert!(exited(&mut next, 60).success());
    for path in &left {
        assert!(!std::path::Path::new(path).exists(), "{path} is left behind");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn names_and_metrics_address_stay_across_restarts_and_a_closed_stdout_is_no_crash() {
    let dir = std::env::temp_dir().join(format!("lake-serve-names-{}", std::process::id()));
    // A port free now, named as an operator's scrape config would.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let metrics = format!("127.0.0.1:{port}");
    let args = |dir: &std::path::Path| -> Vec<std::ffi::OsString> {
        vec!["--dir".into(), dir.into(), "--metrics".into(), metrics.clone().into()]
    };
    let mut names = Vec::new();
    for run in 0..2 {
        let (mut pool, out) = serving(args(&dir));
        let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
        names.push([field(&record, "arena"), field(&record, "mirror"), field(&record, "metrics")]);
        assert_eq!(field(&record, "metrics"), metrics);
        let scraped = http_get(&metrics, "/metrics");
        assert!(scraped.contains("lake_build_info{version=\""), "{scraped}");
        assert!(scraped.contains("process_resident_memory_bytes "), "{scraped}");
        assert!(scraped.contains("process_start_time_seconds "), "{scraped}");
        if run == 1 {
            // The reader of its stdout goes (a supervisor's pipe closed):
            // the pool serves on and still stops cleanly.
            drop(out);
            std::thread::sleep(Duration::from_millis(200));
            assert!(pool.try_wait().unwrap().is_none(), "it died with its stdout");
        }
        sigterm(&pool);
        let status = exited(&mut pool, 60);
        assert!(status.success(), "run {run}: {status}");
    }
    assert_eq!(names[0], names[1], "names change from one start to the next");
    assert!(names[0][0].starts_with("/dev/shm/lake-l1-"), "{:?}", names[0]);
    // Another directory, other names.
    let other = dir.with_extension("other");
    let mut extra = args(&other);
    extra[3] = "127.0.0.1:0".into();
    let (mut pool, _out) = serving(extra);
    let record = std::fs::read_to_string(other.join("pool.json")).unwrap();
    assert_ne!(field(&record, "arena"), names[0][0]);
    assert_ne!(field(&record, "mirror"), names[0][1]);
    sigterm(&pool);
    assert!(exited(&mut pool, 60).success());
    // A metrics address in use: the start fails at once, saying so.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--metrics", &busy.local_addr().unwrap().to_string(), "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("metrics on 127.0.0.1:"), "{out:?}");
    for d in [&dir, &other] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// One plain HTTP GET; the body.
fn http_get(address: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or(answer)
}

/// Every subcommand of `lake`.
const SUBCOMMANDS: [&str; 16] = [
    "demo",
    "serve",
    "config",
    "top",
    "inspect",
    "namespaces",
    "purge",
    "persist",
    "regions",
    "peers",
    "drain",
    "drain-node",
    "cp",
    "summary",
    "keygen",
    "config check",
];

#[test]
fn help_and_version_on_every_subcommand_and_errors_in_a_line() {
    let scratch = std::env::temp_dir().join(format!("lake-help-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let lake =
        |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_lake")).current_dir(&scratch).args(args).output().unwrap();
    let version = format!(" {}", env!("CARGO_PKG_VERSION"));
    for sub in SUBCOMMANDS {
        let words: Vec<&str> = sub.split(' ').collect();
        let help = lake(&[&words[..], &["--help"]].concat());
        let text = String::from_utf8_lossy(&help.stdout);
        assert!(help.status.success(), "{sub} --help: {help:?}");
        assert!(text.contains(&format!("Usage: lake {sub}")), "{sub}: {text}");
        let shown = lake(&[&words[..], &["--version"]].concat());
        assert!(shown.status.success(), "{sub} --version: {shown:?}");
        assert!(String::from_utf8_lossy(&shown.stdout).contains(&version), "{sub}: {shown:?}");
    }
    // Defaults are in the help.
    let help = String::from_utf8_lossy(&lake(&["serve", "--help"]).stdout).into_owned();
    assert!(help.contains("[default: 64KiB]") && help.contains("[default: 127.0.0.1:9477]"), "{help}");
    // `keygen --help` is help, not a key file named `--help`.
    assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0, "a file was written");
    // A bad value: refused, in a line and a hint, not pages of usage; a
    // boolean is a boolean.
    for (args, said) in [
        (&["serve", "--require-encryption", "maybe"][..], "invalid value 'maybe'"),
        (&["serve", "--l3-create-bucket=yes"][..], "invalid value 'yes'"),
        (&["serve", "--block-bytes", "2XB"][..], "unit \"XB\""),
        (&["serve", "--l1-slots", "x"][..], "--l1-slots"),
        (&["demo", "--help=x"][..], "--help"),
        (&["top"][..], "--admin"),
    ] {
        let out = lake(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(said), "{args:?}: {stderr}");
        assert!(stderr.lines().count() <= 6, "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}

#[test]
fn a_config_file_is_the_flags_checked_before_anything_starts() {
    let dir = std::env::temp_dir().join(format!("lake-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lake = |args: &[&std::ffi::OsStr]| Command::new(env!("CARGO_BIN_EXE_lake")).args(args).output().unwrap();
    // The example in the repository is checked as it stands.
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lake.toml");
    let checked = lake(&["config".as_ref(), "check".as_ref(), example.as_os_str()]);
    assert!(checked.status.success(), "{checked:?}");
    assert!(String::from_utf8_lossy(&checked.stdout).contains("\"event\":\"config_ok\""), "{checked:?}");
    // Each bad key is named with its file, and nothing starts.
    let file = dir.join("lake.toml");
    for (text, said) in [
        ("blok-bytes = \"2MiB\"\n", "blok-bytes: no such setting"),
        ("block-bytes = \"2 XiB\"\n", "block-bytes: invalid value"),
        ("require-encryption = \"yes\"\n", "require-encryption: invalid value"),
        ("l1-class = [\"2MiB\"]\n", "l1-class: invalid value"),
        ("tenant-quota = [\"acme:l1=4GiB\"]\n", "no --tenant acme=NAMESPACE"),
        ("l3-endpoint = \"http://127.0.0.1:1\"\n", "--l3-bucket"),
    ] {
        std::fs::write(&file, text).unwrap();
        let checked = lake(&["config".as_ref(), "check".as_ref(), file.as_os_str()]);
        assert!(!checked.status.success(), "{text}");
        let stderr = String::from_utf8_lossy(&checked.stderr);
        assert!(stderr.contains(said), "{text}: {stderr}");
        let started = Command::new(env!("CARGO_BIN_EXE_lake"))
            .args([
                "serve".as_ref(),
                "--config".as_ref(),
                file.as_os_str(),
                "--dir".as_ref(),
                dir.join("pool").as_os_str(),
            ])
            .output()
            .unwrap();
        // Settings that cannot run: status 2, which a supervisor does not
        // restart on (the unit's RestartPreventExitStatus).
        assert_eq!(started.status.code(), Some(2), "{text}: {started:?}");
        assert!(String::from_utf8_lossy(&started.stderr).contains(said), "{text}: {started:?}");
        assert!(!dir.join("pool").exists(), "{text}: a pool started");
    }
    // A good file serves; a flag overrides its value.
    std::fs::write(&file, "block-bytes = \"128KiB\"\nl1-slots = 16\nl2-slots = 16\nmetrics = \"127.0.0.1:0\"\n")
        .unwrap();
    let pool_dir = dir.join("pool");
    let l2 = dir.join("l2-device.lake");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve".as_ref(), "--config".as_ref(), file.as_os_str(), "--l1-slots".as_ref(), "24".as_ref()])
        .args(["--dir".as_ref(), pool_dir.as_os_str(), "--l2-file".as_ref(), l2.as_os_str()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut child = Serve(child);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let record: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(record["block_bytes"], 128 * 1024, "{line}");
    assert_eq!(record["l1_classes"][0][1], 24, "the flag overrode the file: {line}");
    assert!(l2.exists(), "the L2 file on the command line is made");
    sigterm(&child);
    assert!(exited(&mut child, 60).success());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Saves an L1 cannot take are refused — and said: a `saves_refused` line
/// on stderr (once a second at most, with how many) and a count in `lake
/// top`, not silence and 0% hits.
#[test]
fn refused_saves_are_logged_and_shown_in_top() {
    let dir = std::env::temp_dir().join(format!("lake-serve-refused-{}", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--metrics", "127.0.0.1:0", "--block-bytes", "65536", "--l1-slots", "16", "--l2-slots", "8"])
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let stderr = child.stderr.take().unwrap();
    let mut child = Serve(child);
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let mut agent = engine(&dir, &field(&line, "mirror"));
    // Far more blocks in one call than L1 has slots.
    let many = 200;
    let keys: Vec<lake_dp::BlockKey> = (0..many).map(key).collect();
    let payloads: Vec<Vec<u8>> = (0..many).map(payload).collect();
    let blocks = chain(&keys, &payloads);
    let acked = agent.save(&blocks);
    assert!(acked < many as usize, "an L1 of 16 slots took {acked} of {many} in one call");
    // The count reaches lake-cp with the data plane's next report (once a
    // second); the call is over, so the one after that is final.
    let admin = dir.join("admin.sock");
    let top = || -> serde_json::Value {
        let shown = Command::new(env!("CARGO_BIN_EXE_lake"))
            .args(["top", "--once", "--json", "--admin"])
            .arg(&admin)
            .output()
            .unwrap();
        serde_json::from_slice(&shown.stdout).unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while top()["saves"]["refused"].as_u64().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "lake top never showed the refusals: {}", top());
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_millis(1500));
    let top = top();
    // Refused by the data plane, each counted; the blocks after the first
    // refused one are not even asked for (their prefix is broken: the
    // agent gives their slots back unwritten).
    let refused = top["saves"]["refused"].as_u64().unwrap();
    assert!(refused >= 1 && refused <= u64::try_from(many as usize - acked).unwrap(), "{top}");
    assert!(top["saves"]["saved"].as_u64().unwrap() >= u64::try_from(acked).unwrap(), "{top}");
    dashboard_queries_name_exported_metrics(&http_get(&field(&line, "metrics"), "/metrics"));
    let text = Command::new(env!("CARGO_BIN_EXE_lake")).args(["top", "--once", "--dir"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    let by = &top["saves"]["refused_by"];
    let why = format!(
        "{refused} refused ({} L1 full, {} only the load reserve free, 0 stopping, 0 over quota)",
        by["no_space"], by["load_reserve"]
    );
    assert!(text.contains(&why), "{text}");
    drop(agent);
    sigterm(&child);
    assert!(exited(&mut child, 60).success());
    let mut logged = String::new();
    std::io::Read::read_to_string(&mut BufReader::new(stderr), &mut logged).unwrap();
    let lines: Vec<&str> = logged.lines().filter(|l| l.contains("\"event\":\"saves_refused\"")).collect();
    assert!(!lines.is_empty(), "nothing logged: {logged}");
    let events: Vec<serde_json::Value> = lines.iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(events.iter().all(|e| e["level"] == "WARN"), "{logged}");
    let total: u64 = events.iter().map(|e| e["blocks"].as_u64().unwrap()).sum();
    assert_eq!(total, refused, "{logged}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Under systemd (`Type=notify`): `READY=1` once engines can attach — not
/// before `pool.json` is there — and `STOPPING=1` when a stop begins, on
/// the datagram socket `$NOTIFY_SOCKET` names. systemd is not PID 1 on a
/// test machine, so the socket here is the test's own, read as systemd
/// reads it; the unit file itself is checked by `systemd-analyze verify`.
#[test]
fn serve_tells_a_service_manager_it_is_ready_and_stopping() {
    let dir = std::env::temp_dir().join(format!("lake-serve-notify-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket_path = dir.join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let pool_dir = dir.join("pool");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--metrics", "127.0.0.1:0", "--l1-slots", "32", "--l2-slots", "32", "--dir"])
        .arg(&pool_dir)
        .env("NOTIFY_SOCKET", &socket_path)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut buffer = [0u8; 256];
    let n = socket.recv(&mut buffer).unwrap();
    assert_eq!(&buffer[..n], b"READY=1");
    assert!(pool_dir.join("pool.json").exists(), "ready before engines can find the pool");
    sigterm(&child);
    let n = socket.recv(&mut buffer).unwrap();
    assert_eq!(&buffer[..n], b"STOPPING=1");
    assert!(exited(&mut child, 60).success());

    // The unit in the repository, as systemd reads it (with this build's
    // binary, which must exist for it to pass).
    let unit = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lake.service");
    let text = std::fs::read_to_string(&unit).unwrap();
    assert!(text.contains("Type=notify") && text.contains("ExecStart=/usr/local/bin/lake serve"), "{text}");
    let here = dir.join("lake.service");
    std::fs::write(&here, text.replace("/usr/local/bin/lake ", &format!("{} ", env!("CARGO_BIN_EXE_lake")))).unwrap();
    match Command::new("systemd-analyze").arg("verify").arg(&here).output() {
        Err(e) => println!("SKIPPED: systemd-analyze verify ({e})"),
        Ok(checked) => {
            let said =
                format!("{}{}", String::from_utf8_lossy(&checked.stdout), String::from_utf8_lossy(&checked.stderr));
            assert!(checked.status.success() && said.trim().is_empty(), "examples/lake.service: {said}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every metric a query of the Grafana dashboard in the repository names
/// is one `scraped` (a running pool's `/metrics`) has: a dashboard of
/// empty panels is a dashboard that lies.
fn dashboard_queries_name_exported_metrics(scraped: &str) {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/grafana-lake.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let exported: std::collections::HashSet<&str> =
        scraped.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let mut named = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find(|c: char| c.is_ascii_lowercase()) {
                rest = &rest[at..];
                let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
                let word = &rest[..end];
                if word.starts_with("lake_") || word.starts_with("process_") {
                    named += 1;
                    assert!(exported.contains(word), "{}: {word} is not exported", panel["title"]);
                }
                rest = &rest[end..];
            }
        }
    }
    assert!(named >= 15, "the dashboard names {named} metrics");
}

/// Acked blocks live in L1 until demoted (or written below ahead of
/// demand, once L1 is half full: here it holds 40 of 128); `lake persist
/// --wait` writes every L1-only block to L2 while keeping it in L1, and
/// returns once none is left: the blocks then survive the pool's SIGKILL
/// (no clean stop to write them down), exact, and L1 still served them
/// before it.
#[test]
fn persisted_blocks_survive_a_kill_and_stay_in_l1() {
    persist_then_kill(false);
}

/// The same for a tenant with a data key: the write-back seals its
/// blocks (its staging copy, not the L1 copy engines read), so L2 holds
/// no plaintext of them, and they come back exact through the key.
#[test]
fn persisted_blocks_of_a_keyed_tenant_are_sealed_on_l2() {
    persist_then_kill(true);
}

fn persist_then_kill(sealed: bool) {
    let base = std::env::temp_dir().join(format!("lake-serve-persist-{sealed}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let dir = base.join("pool");
    let key_file = base.join("5c.key");
    let made = Command::new(env!("CARGO_BIN_EXE_lake")).arg("keygen").arg(&key_file).output().unwrap();
    assert!(made.status.success());
    let args = || {
        let mut args: Vec<std::ffi::OsString> =
            vec!["--dir".into(), dir.clone().into_os_string(), "--l1-slots".into(), "128".into()];
        if sealed {
            let mut tenant = std::ffi::OsString::from("5c=");
            tenant.push(&key_file);
            args.extend(["--tenant-key".into(), tenant]);
        }
        args
    };
    let keys: Vec<lake_dp::BlockKey> = (0..BLOCKS).map(key).collect();
    let payloads: Vec<Vec<u8>> = (0..BLOCKS).map(payload).collect();
    let (mut first, _out) = serving(args());
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let mut agent = engine(&dir, &field(&record, "mirror"));
    assert_eq!(agent.save(&chain(&keys, &payloads)), BLOCKS as usize);
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < keys.len() {
        assert!(Instant::now() < deadline, "the saves were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
    let lake =
        |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_lake")).args(args).arg("--dir").arg(&dir).output().unwrap();
    let top: serde_json::Value = serde_json::from_slice(&lake(&["top", "--once", "--json"]).stdout).unwrap();
    assert_eq!(top["l1_only_blocks"], u64::from(BLOCKS), "{top}");
    let persisted = lake(&["persist", "--wait", "30"]);
    let said = String::from_utf8_lossy(&persisted.stdout);
    assert!(persisted.status.success(), "{persisted:?}");
    assert!(said.contains("\"event\":\"persisted\""), "{said}");
    let top: serde_json::Value = serde_json::from_slice(&lake(&["top", "--once", "--json"]).stdout).unwrap();
    assert_eq!(top["l1_only_blocks"], 0, "{top}");
    assert_eq!(top["tier_commands"]["l2_write_backs"], u64::from(BLOCKS), "{top}");
    // Still in L1 (and now in L2 too): read from L1 as before.
    assert_eq!(agent.lookup(&keys, &mut table), keys.len());
    assert!(table.iter().all(|t| t.tier == lake_dp::Tier::L1Dram), "moved out of L1");
    let (l1, l2) = (1u8 << lake_dp::Tier::L1Dram as u8, 1u8 << lake_dp::Tier::L2Nvme as u8);
    assert!(table.iter().all(|t| t.tiers & (l1 | l2) == l1 | l2), "not in both L1 and L2: {table:?}");
    let delivered = agent.fetch(&keys, &table, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, keys.len());
    drop(agent);
    // Killed: no clean stop writes anything down.
    first.kill().unwrap();
    first.wait().unwrap();
    // What L2 holds of the first block's payload in the clear.
    let window = &payloads[0][1000..1064];
    let plain = ["l2-0.lake", "l2-1.lake"]
        .iter()
        .any(|file| std::fs::read(dir.join(file)).unwrap().windows(window.len()).any(|w| w == window));
    assert_eq!(plain, !sealed, "plaintext on L2: {plain}");
    restarted_pool_serves_them_exact(args(), &dir, &keys, &payloads);
    std::fs::remove_dir_all(&base).unwrap();
}

/// A pool started on `dir` (with `args`) re-adopts `keys` from L2 and an
/// engine reads each back exact; then it stops cleanly.
fn restarted_pool_serves_them_exact(
    args: impl IntoIterator<Item = std::ffi::OsString>,
    dir: &std::path::Path,
    keys: &[lake_dp::BlockKey],
    payloads: &[Vec<u8>],
) {
    let (mut pool, _out) = serving(args);
    let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
    let mut agent = engine(dir, &field(&record, "mirror"));
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while agent.lookup(keys, &mut table) < keys.len() {
        assert!(Instant::now() < deadline, "the restarted pool did not re-adopt the blocks");
        std::thread::sleep(Duration::from_millis(20));
    }
    let delivered = agent.fetch(keys, &table, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, keys.len());
    drop(agent);
    sigterm(&pool);
    assert!(exited(&mut pool, 60).success());
}

/// A full pool takes what is new: L1 (256 slots) full of an older
/// 256-block prefix, a new 256-block prefix saved in one call is at least
/// 95% acked — the data plane takes the victims the control plane marked
/// ahead, no command on the save's way — and every acked block is found at
/// once, byte for byte. With room in L2 the old prefix is written there
/// ahead of demand (waited for) and is still found whole; with next to
/// none (8 slots a file) its blocks are the ones dropped, never the new
/// prefix's own.
#[test]
fn a_new_prefix_saved_into_a_full_l1_is_taken_and_found_whole() {
    for l2_slots in ["1024", "8"] {
        let dir = std::env::temp_dir().join(format!("lake-serve-full-{l2_slots}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (mut pool, _out) = serving([
            "--dir",
            dir.to_str().unwrap(),
            "--l1-slots",
            "256",
            "--l2-slots",
            l2_slots,
            "--block-bytes",
            "64KiB",
        ]);
        let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
        let mut agent = engine(&dir, &field(&record, "mirror"));
        let old: Vec<lake_dp::BlockKey> = (0..256).map(|i| key(10_000 + i)).collect();
        let new: Vec<lake_dp::BlockKey> = (0..256).map(|i| key(20_000 + i)).collect();
        let old_payloads: Vec<Vec<u8>> = (0..256).map(|i| payload(10_000 + i)).collect();
        let new_payloads: Vec<Vec<u8>> = (0..256).map(|i| payload(20_000 + i + 7)).collect();
        let old_acked = agent.save(&chain(&old, &old_payloads));
        assert!(old_acked >= 243, "an empty pool took {old_acked} of 256");
        let lake = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_lake")).args(args).arg("--dir").arg(&dir).output();
        std::thread::sleep(Duration::from_secs(1));
        if l2_slots == "1024" {
            // With room below, the old prefix is written there ahead of
            // demand (a second is enough on an idle machine; on a loaded
            // one it is waited for, as the pool's state, not a time).
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let top: serde_json::Value =
                    serde_json::from_slice(&lake(&["top", "--once", "--json"]).unwrap().stdout).unwrap();
                if top["l1_only_blocks"] == 0 {
                    break;
                }
                assert!(Instant::now() < deadline, "the old prefix was not written below: {top}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let acked = agent.save(&chain(&new, &new_payloads));
        // Found at once: every acked block, as the prefix it is.
        let mut table = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while agent.lookup(&new, &mut table) < acked {
            assert!(
                Instant::now() < deadline,
                "L2 {l2_slots}: {acked} acked, {} found",
                agent.lookup(&new, &mut table)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(500));
        let found = agent.lookup(&new, &mut table);
        let top = String::from_utf8_lossy(&lake(&["top", "--once", "--json"]).unwrap().stdout).into_owned();
        println!("L2 {l2_slots} slots a file: {acked} of 256 acked, {found} found; {top}");
        assert!(acked >= 243, "L2 {l2_slots}: {acked} of 256 acked into a full L1: {top}");
        assert_eq!(found, acked, "L2 {l2_slots}: acked blocks not found: {top}");
        let delivered = agent.fetch(&new[..found], &table[..found], |i, bytes| {
            assert_eq!(bytes, &new_payloads[i][..], "block {i}");
        });
        assert_eq!(delivered, found);
        if l2_slots == "1024" {
            assert_eq!(agent.lookup(&old, &mut table), old_acked, "the old prefix, written below ahead of demand");
        }
        drop(agent);
        sigterm(&pool);
        assert!(exited(&mut pool, 60).success());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A refused save says why, to the engine (a status per block) and the
/// operator (`lake top`, the metrics): here an engine holds every L1 slot
/// a save may take, reserved and not yet committed, so nothing can be
/// made room for. With a load reserve left free the reason is the
/// reserve; with none, a full L1. The agent sees the pool refusing saves
/// without asking, and a later save under a refused block is not sent.
#[test]
fn a_refused_save_says_why_and_the_pool_says_it_refuses_saves() {
    use lake_agent::SaveStatus;
    use lake_agent::port::AgentError;
    for (reserve, why, reason) in [("1", AgentError::Reserved, "load_reserve"), ("0", AgentError::NoSpace, "no_space")]
    {
        let dir = std::env::temp_dir().join(format!("lake-serve-why-{reason}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (mut pool, _out) = serving(["--dir", dir.to_str().unwrap(), "--l1-load-reserve", reserve]);
        let record = std::fs::read_to_string(dir.join("pool.json")).unwrap();
        let mut holder = engine(&dir, &field(&record, "mirror"));
        let mut saver = engine(&dir, &field(&record, "mirror"));
        // The holder asks for more slots than L1 has and keeps them
        // reserved while the saver saves.
        let held: Vec<lake_dp::BlockKey> = (0..40).map(|i| key(30_000 + i)).collect();
        let segment = usize::try_from(holder.segment_bytes_for(PAYLOAD as u64)).unwrap();
        let crcs: Vec<u32> = payload(0).chunks(segment).map(crc32fast::hash).collect();
        let prepared: Vec<lake_agent::PreparedSave<'_>> = (0..held.len())
            .map(|i| lake_agent::PreparedSave {
                key: held[i],
                parent: lake_dp::BlockKey::NONE,
                block_index: 0,
                len: PAYLOAD,
                crcs: &crcs,
                crcs_from: lake_agent::CrcOrigin::Slot,
            })
            .collect();
        let keys: Vec<lake_dp::BlockKey> = (0..3).map(|i| key(40_000 + i)).collect();
        let payloads: Vec<Vec<u8>> = (0..3).map(|i| payload(40_000 + i)).collect();
        let blocks = chain(&keys, &payloads);
        let mut refused = vec![SaveStatus::NotSent; 2];
        let mut pressure = false;
        let mut held_statuses = vec![SaveStatus::NotSent; held.len()];
        holder.save_prepared(&prepared, &mut held_statuses, |bodies| {
            assert!(!bodies.is_empty());
            saver.save_with_statuses(&blocks[..2], &mut refused);
            pressure = saver.save_pressure();
            false
        });
        assert_eq!(refused, [SaveStatus::Refused(why), SaveStatus::ParentUnsaved], "reserve {reserve}");
        assert!(pressure, "the saver did not see the pool refusing saves");
        // The holder's own asks past L1 were refused for the same reason;
        // it gave the rest back.
        assert!(held_statuses.contains(&SaveStatus::Refused(why)), "{held_statuses:?}");
        // The flag clears once saves are taken again (none refused for a
        // while).
        let deadline = Instant::now() + Duration::from_secs(5);
        while saver.save_pressure() {
            assert!(Instant::now() < deadline, "the pool still says it refuses saves");
            std::thread::sleep(Duration::from_millis(10));
        }
        // Under the refused block nothing is sent, even now.
        let mut later = vec![SaveStatus::NotSent; 1];
        assert_eq!(saver.save_with_statuses(&blocks[2..], &mut later), 0);
        assert_eq!(later, [SaveStatus::ParentUnsaved]);
        // The same prefix saved again from its start is taken whole.
        let mut again = vec![SaveStatus::NotSent; 3];
        assert_eq!(saver.save_with_statuses(&blocks, &mut again), 3, "{again:?}");

        // The operator's view: the reason, counted, in top and the metrics.
        let top = || -> serde_json::Value {
            let out = Command::new(env!("CARGO_BIN_EXE_lake"))
                .args(["top", "--once", "--json", "--dir"])
                .arg(&dir)
                .output()
                .unwrap();
            serde_json::from_slice(&out.stdout).unwrap()
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while top()["saves"]["refused_by"][reason].as_u64().unwrap_or(0) == 0 {
            assert!(Instant::now() < deadline, "lake top never showed the reason: {}", top());
            std::thread::sleep(Duration::from_millis(200));
        }
        let shown = top();
        let by = &shown["saves"]["refused_by"];
        let sum: u64 = ["no_space", "load_reserve", "stopping"].iter().map(|r| by[r].as_u64().unwrap()).sum();
        assert_eq!(sum, shown["saves"]["refused"].as_u64().unwrap(), "{shown}");
        assert_eq!(by["stopping"], 0, "{shown}");
        let scraped = http_get(&field(&record, "metrics"), "/metrics");
        let line = scraped
            .lines()
            .find(|l| l.starts_with(&format!("lake_dp_saves_refused_total{{reason=\"{reason}\"}}")))
            .unwrap_or_else(|| panic!("no {reason} refusals in the metrics: {scraped}"));
        assert!(!line.ends_with(" 0"), "{line}");
        drop((holder, saver));
        sigterm(&pool);
        assert!(exited(&mut pool, 60).success());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
