//! The `lake-dp` binary as an operator runs it: a TOML config, a pinned
//! poll thread, the built-in workload, SIGTERM draining to a clean stop,
//! SIGKILL leading to a scrubbed restart, an idle daemon parking instead
//! of spinning, and config errors that name the field.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::remove_file(shm_path(&self.0));
    }
}

fn shm_path(dir: &std::path::Path) -> String {
    format!("/dev/shm/lake-runner-test-{}", dir.file_name().unwrap().to_str().unwrap())
}

fn dir(name: &str) -> Dir {
    let dir = std::env::temp_dir().join(format!("lake-runner-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Dir(dir)
}

fn config(dir: &Dir, extra: &str) -> PathBuf {
    let text = format!(
        r#"
[node]
id = 0

[l1]
path = "{shm}"
classes = [{{ payload_bytes = 65536, slots = 32 }}]
lock = false

[l2]
paths = ["{dir}/l2-0.lake", "{dir}/l2-1.lake"]
slots_per_file = 128
slot_bytes = 69632
format_if_missing = true
queue_depth = 16

[poller]
ops_max = 8
batch_max = 8
park_max_ms = 50
{extra}
"#,
        shm = shm_path(&dir.0),
        dir = dir.0.display()
    );
    let path = dir.0.join("lake-dp.toml");
    std::fs::write(&path, text).unwrap();
    path
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
    let typo = config(&dir, "spin_uss = 3");
    let (code, err) = run(&["--config", typo.to_str().unwrap()]);
    assert_eq!(code, Some(2));
    assert!(err.contains("spin_uss"), "{err}");
    let good = config(&dir, "");
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--cores", "4000"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--cores: core 4000"), "{err}");
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--numa-node", "777"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--numa-node"), "{err}");
    let (code, err) = run(&["--config", good.to_str().unwrap(), "--cores", "x"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("invalid value 'x' for '--cores"), "{err}");
    let (code, err) = run(&["--cores", "1"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("required") && err.contains("--config <FILE>"), "{err}");
    // Help and version are answers, not errors.
    for flag in ["--help", "--version"] {
        let output = Command::new(env!("CARGO_BIN_EXE_lake-dp")).arg(flag).output().unwrap();
        assert!(output.status.success(), "{flag}: {output:?}");
        let shown = String::from_utf8_lossy(&output.stdout);
        assert!(shown.contains(if flag == "--help" { "Usage: lake-dp" } else { env!("CARGO_PKG_VERSION") }), "{shown}");
    }
}
