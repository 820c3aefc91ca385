//! A real S3-compatible server for the tests: moto's `moto_server` (from
//! PyPI; `.ci/run` installs it), started on a free local port.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A free port on 127.0.0.1 that this process has not handed out before:
/// tests run side by side, and a port one of them just let go of is the
/// kernel's to give the next — whose moto server would then find it
/// taken, or whose check would find the other's listener.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let given = given.get_or_insert_with(HashSet::new);
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if given.insert(port) {
            return port;
        }
    }
}

/// Whether an HTTP server answers on 127.0.0.1:`port`: a listener that
/// takes the connection but says nothing (another test's port being
/// chosen) is not one.
fn answers_http(port: u16) -> bool {
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut head = [0u8; 5];
    stream.write_all(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_ok()
        && stream.read_exact(&mut head).is_ok()
        && &head == b"HTTP/"
}

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
    /// Starts `binary` on 127.0.0.1:`port`; returns once it answers HTTP. A
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
            while !exited && !answers_http(port) {
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
            port = free_port();
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
