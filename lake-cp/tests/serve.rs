//! `lake serve`, the pool an engine in another process attaches to: it must
//! stop cleanly on SIGTERM (drained, flushed, a "stopped" line, exit 0)
//! and remove what it made. Its data plane once read the same signal from
//! a signalfd of its own, stopped alone, and left the command waiting for
//! ever.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn serve_stops_on_sigterm_and_cleans_up() {
    let dir = std::env::temp_dir().join(format!("lake-serve-test-{}", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_lake"))
        .args(["serve", "--block-bytes", "65536", "--l1-slots", "32", "--l2-slots", "32", "--dir"])
        .arg(&dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut serving = String::new();
    out.read_line(&mut serving).unwrap();
    assert!(serving.contains("\"event\":\"serving\""), "{serving}");
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
