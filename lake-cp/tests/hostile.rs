//! `lake serve` next to a hostile local user. Another uid that can reach
//! the pool's TCP ports (the metrics port every local user reaches, the
//! transport port every host on the network reaches) holds as many
//! connections as it can open: the pool sheds what it cannot hold and
//! serves on — its sockets stay, `/healthz` answers, and a new engine
//! attaches, saves and loads exact bytes once the flood is over. Another
//! uid allowed to attach holds 50 silent connections on the attach socket,
//! opening a new one for each closed: real engines still attach, save and
//! load while it does. Needs root (to run the floods as `nobody` and give
//! the pool a low fd limit) and `/usr/bin/python3` (the floods are Python
//! scripts): skipped, with the reason printed, otherwise.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/chain.rs"]
mod chain;
#[path = "common/scratch.rs"]
mod scratch;
#[path = "common/served.rs"]
mod served;
#[path = "common/supervise.rs"]
mod supervise;

const NOBODY: u32 = 65_534;

/// Opens connections to each address in turn, as many as it is told (a
/// connect the pool does not take within half a second counts as
/// refused), holds them all for the seconds it is told, then closes them.
/// Prints `held N refused M`.
const FLOOD: &str = r#"
import socket, sys, time
count, hold = int(sys.argv[1]), float(sys.argv[2])
targets = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in sys.argv[3:]]
held, refused = [], 0
for i in range(count):
    s = socket.socket()
    s.settimeout(0.5)
    try:
        s.connect(targets[i % len(targets)])
        held.append(s)
    except OSError:
        refused += 1
        s.close()
print("held", len(held), "refused", refused, flush=True)
time.sleep(hold)
for s in held:
    s.close()
"#;

/// Holds as many connections as it is told to the Unix socket it is told,
/// silent, opening a new one for each the other end closes, for the
/// seconds it is told. Prints `held N reopened M` at the start and the end.
const SILENT_ON_UNIX: &str = r#"
import socket, sys, time
path, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.setblocking(False)
    return s
held, reopened = [connect() for _ in range(count)], 0
print("held", len(held), "reopened", reopened, flush=True)
end = time.time() + seconds
while time.time() < end:
    for i, s in enumerate(held):
        try:
            gone = s.recv(256) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            s.close()
            held[i] = connect()
            reopened += 1
    time.sleep(0.01)
print("held", len(held), "reopened", reopened, flush=True)
"#;

/// Whether this test can run here; says why not otherwise.
fn can_run_floods() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIPPED: running the flood as another user and lowering the pool's fd limit need root");
        return false;
    }
    if !std::path::Path::new("/usr/bin/python3").exists() {
        println!("SKIPPED: the flood is a /usr/bin/python3 script, and there is none");
        return false;
    }
    true
}

/// `/usr/bin/python3 -c SCRIPT ARGS...` as `nobody`: the process, its
/// stdout, and the first line it said.
fn flood_as_nobody(script_and_args: &[&str]) -> (std::process::Child, BufReader<std::process::ChildStdout>, String) {
    let mut flood = Command::new("/usr/bin/python3")
        .arg("-c")
        .args(script_and_args)
        .uid(NOBODY)
        .gid(NOBODY)
        .current_dir("/")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(flood.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    (flood, out, first)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET path` at `address` with a deadline; the status line and body, or
/// why not.
fn get(address: &str, path: &str) -> Result<String, String> {
    let mut stream = std::net::TcpStream::connect_timeout(&address.parse().unwrap(), Duration::from_secs(1))
        .map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).map_err(|e| e.to_string())?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: lake\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|e| format!("read: {e}"))?;
    Ok(answer)
}

/// An engine of another process: attaches over `dp.sock`, saves `blocks`
/// blocks (`first` on) and loads them back; whether every byte came back.
fn engine_round_trip(dir: &std::path::Path, mirror: &str, first: u32, blocks: u32) -> Result<(), String> {
    let mut agent = served::engine(dir, mirror, 0xf1).map_err(|e| format!("attach: {e:?}"))?;
    let keys: Vec<lake_dp::BlockKey> = (first..first + blocks)
        .map(|b| {
            let mut key = [0xf1; 16];
            key[..4].copy_from_slice(&b.to_le_bytes());
            lake_dp::BlockKey(key)
        })
        .collect();
    let payload = |i: usize| vec![u8::try_from(i % 251).unwrap_or(0) ^ 0x5a; 32 * 1024];
    chain::save_chain(&mut agent, &keys, payload);
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < keys.len() {
        if Instant::now() > deadline {
            return Err("the saves were not published".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut wrong = Vec::new();
    let delivered = agent.fetch(&keys, &table, |i, bytes| {
        if bytes != payload(i) {
            wrong.push(i);
        }
    });
    if delivered != keys.len() || !wrong.is_empty() {
        return Err(format!("{delivered} of {} blocks delivered, other bytes in {wrong:?}", keys.len()));
    }
    Ok(())
}

#[test]
fn a_connection_flood_from_another_user_under_a_low_fd_limit_leaves_the_pool_serving() {
    if !can_run_floods() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lake-hostile-flood-{}", std::process::id()));
    let _scratch = scratch::Scratch(dir.clone(), Vec::new());
    let transport = format!("127.0.0.1:{}", free_port());
    // 256 descriptors, soft and hard: the pool cannot raise its way out.
    let mut pool = served::start(
        Command::new("prlimit")
            .arg("--nofile=256:256")
            .arg(env!("CARGO_BIN_EXE_lake"))
            .args(["serve", "--metrics", "127.0.0.1:0", "--block-bytes", "65536", "--l1-slots", "64"])
            .args(["--l2-slots", "64", "--transport-listen", &transport, "--dir"])
            .arg(&dir),
    )
    .unwrap();
    let (metrics, mirror) = (pool.field("metrics"), pool.field("mirror"));

    // 1,100 connections from `nobody`, held 3 s.
    let (mut flood, _, tally) = flood_as_nobody(&[FLOOD, "1100", "3", &metrics, &transport]);
    // All opened (or refused): the pool holds at its worst now.
    assert!(pool.child.try_wait().unwrap().is_none(), "the pool exited under the flood ({tally})");
    for socket in ["cp.sock", "dp.sock", "admin.sock"] {
        assert!(dir.join(socket).exists(), "{socket} went under the flood");
    }
    assert!(flood.wait().unwrap().success());

    // The flood is over: the pool serves as before it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let healthz = loop {
        match get(&metrics, "/healthz") {
            Ok(answer) if answer.starts_with("HTTP/1.1 200") => break answer,
            other if Instant::now() > deadline => panic!("/healthz after the flood: {other:?} ({tally})"),
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    assert!(healthz.contains("200"), "{healthz}");
    engine_round_trip(&dir, &mirror, 0, 8).unwrap();
    let scraped = get(&metrics, "/metrics").unwrap();
    assert!(pool.child.try_wait().unwrap().is_none(), "the pool exited after the flood");
    supervise::stop(&mut pool.child);
    let status = pool.child.wait().unwrap();
    let mut stderr = String::new();
    let _ = pool.child.stderr.take().unwrap().read_to_string(&mut stderr);
    assert!(status.success(), "{status}: {stderr}");
    println!("flood: {}; the pool's shedding: {}", tally.trim(), shed_lines(&scraped));
}

/// The metrics lines about shed connections, for the log.
fn shed_lines(scraped: &str) -> String {
    scraped.lines().filter(|l| l.contains("connections_shed_total{")).collect::<Vec<_>>().join("; ")
}

/// 50 silent connections from another user allowed to attach, each closed
/// one replaced at once, against 4 agent ports: three engines, one after
/// the other, attach, save and load exact bytes meanwhile. Before, each
/// silent connection held a port until its hello deadline, and an engine
/// found every port taken.
#[test]
fn silent_connections_on_the_attach_socket_do_not_keep_a_real_engine_out() {
    use std::os::unix::fs::PermissionsExt;
    if !can_run_floods() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("lake-hostile-attach-{}", std::process::id()));
    let _scratch = scratch::Scratch(dir.clone(), Vec::new());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut pool = served::start(
        Command::new(env!("CARGO_BIN_EXE_lake"))
            .args(["serve", "--metrics", "127.0.0.1:0", "--block-bytes", "65536", "--l1-slots", "64"])
            .args(["--l2-slots", "64", "--agents", "4", "--allow-uid", &NOBODY.to_string(), "--socket-mode", "666"])
            .arg("--dir")
            .arg(&dir),
    )
    .unwrap();
    let (metrics, mirror) = (pool.field("metrics"), pool.field("mirror"));
    let dp = dir.join("dp.sock");
    let (mut flood, mut flood_out, started) = flood_as_nobody(&[SILENT_ON_UNIX, dp.to_str().unwrap(), "50", "6"]);
    assert!(started.starts_with("held 50"), "{started}");
    // Past the hello deadline: the flood has had its connections closed
    // and opened new ones.
    std::thread::sleep(Duration::from_millis(1500));
    for engine in 0..3 {
        engine_round_trip(&dir, &mirror, engine * 8, 8).unwrap_or_else(|e| panic!("engine {engine}: {e}"));
    }
    let mut ended = String::new();
    flood_out.read_line(&mut ended).unwrap();
    assert!(flood.wait().unwrap().success());
    // What the attach socket let go reaches the metrics (the data plane
    // sends its figures about once a second).
    let shed = |scraped: &str| -> u64 {
        scraped
            .lines()
            .filter(|l| l.starts_with("lake_dp_connections_shed_total{listener=\"attach\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let scraped = loop {
        let scraped = get(&metrics, "/metrics").unwrap_or_default();
        if shed(&scraped) > 0 || Instant::now() > deadline {
            break scraped;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(shed(&scraped) > 0, "no shed attach connection in the metrics");
    supervise::stop(&mut pool.child);
    assert!(pool.child.wait().unwrap().success());
    let lines: Vec<&str> = scraped.lines().filter(|l| l.starts_with("lake_dp_connections_shed_total{")).collect();
    println!("flood on the attach socket: {}; the pool's shedding: {}", ended.trim(), lines.join("; "));
}
