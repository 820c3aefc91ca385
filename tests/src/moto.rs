//! A real S3-compatible server for the tests: moto's `moto_server` (from
//! PyPI; `.ci/run` installs it), started on a free local port.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The moto server program: `$LAKE_MOTO_SERVER`, or the one `.ci/run`
/// installs in `~/.cache/lake-moto`; `None` if neither exists.
pub fn moto_server() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("LAKE_MOTO_SERVER") {
        return Some(path.into());
    }
    let home = std::env::var_os("HOME")?;
    let path = PathBuf::from(home).join(".cache/lake-moto/bin/moto_server");
    path.exists().then_some(path)
}

/// A running moto server, killed when dropped.
#[derive(Debug)]
pub struct Server {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// The program, to start it again.
    pub binary: PathBuf,
}

impl Server {
    /// Starts `binary` on 127.0.0.1:`port`; returns once it listens. A
    /// server that exits meanwhile (the port taken by another process
    /// between its choice and the server's bind: what answered was not
    /// this server) is started again on another free port — `port` then
    /// says which.
    pub fn start(binary: PathBuf, port: u16) -> Self {
        let mut port = port;
        for _ in 0..5 {
            let mut child = Command::new(&binary)
                .args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("starting moto_server");
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut exited = false;
            while !exited && std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(Instant::now() < deadline, "moto_server did not listen on {port} within 30 s");
                std::thread::sleep(Duration::from_millis(50));
                exited = matches!(child.try_wait(), Ok(Some(_)));
            }
            // Listening, and still this server's: a moment later it runs.
            std::thread::sleep(Duration::from_millis(100));
            if !exited && matches!(child.try_wait(), Ok(None)) {
                return Self { child, port, binary };
            }
            let _ = child.kill();
            let _ = child.wait();
            port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port");
        }
        panic!("moto_server exited at start five times (see its output: run it by hand)");
    }

    /// Kills it.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}
