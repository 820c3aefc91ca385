//! `lake serve`, the pool an engine in another process attaches to: it must
//! stop cleanly on SIGTERM (drained, flushed, a "stopped" line, exit 0)
//! and remove what it made. Its data plane once read the same signal from
//! a signalfd of its own, stopped alone, and left the command waiting for
//! ever.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `lake serve` of a small pool with `extra` arguments, once it says it is
/// serving; its stdout, past that line.
fn serving<S: AsRef<std::ffi::OsStr>>(
    extra: impl IntoIterator<Item = S>,
) -> (std::process::Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--block-bytes", "65536", "--l1-slots", "32", "--l2-slots", "32"])
        .args(extra)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
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

    // SAFETY: a plain syscall on the child's pid.
    assert_eq!(unsafe { libc::kill(i32::try_from(child.id()).unwrap(), libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("lake serve did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    for line in out.lines() {
        rest += &line.unwrap();
    }
    assert!(status.success(), "{status}: {rest}");
    assert!(rest.contains("\"event\":\"stopped\""), "{rest}");
    assert!(!dir.exists(), "lake serve removes its directory");
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
