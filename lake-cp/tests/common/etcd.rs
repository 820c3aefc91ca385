//! An etcd of a test's own (Debian's `etcd-server`, which `.ci/run`
//! installs) on ports of its own, killed with SIGKILL where a crash is
//! the point. Without an `etcd` binary a test says so and skips — except
//! in CI (`CI` set), where that is a failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_cp::etcd::Etcd;

fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("LAKE_ETCD") {
        return Some(path.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain([PathBuf::from("/usr/bin")]).map(|d| d.join("etcd")).find(|p| p.is_file())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// An etcd of the test's own; killed and its directory removed on drop.
pub(crate) struct EtcdServer {
    binary: PathBuf,
    dir: PathBuf,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

impl EtcdServer {
    pub(crate) fn start(name: &str) -> Option<Self> {
        let Some(binary) = etcd_binary() else {
            assert!(std::env::var_os("CI").is_none(), "no etcd binary: .ci/run installs etcd-server");
            eprintln!("SKIPPED: no etcd binary (apt install etcd-server, or LAKE_ETCD=path)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("lake-etcd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut server = Self { binary, dir, client: free_port(), peer: free_port(), child: None };
        server.run();
        Some(server)
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client)
    }

    /// Starts etcd on the same directory and ports; waits until healthy.
    pub(crate) fn run(&mut self) -> Duration {
        let (client, peer) = (format!("http://127.0.0.1:{}", self.client), format!("http://127.0.0.1:{}", self.peer));
        let log = std::fs::File::create(self.dir.with_extension("log")).unwrap();
        let child = Command::new(&self.binary)
            .args(["--name", "lake-test", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("lake-test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting etcd");
        self.child = Some(child);
        let started = Instant::now();
        let probe = Etcd::new(&[&self.endpoint()], Duration::from_millis(300)).unwrap();
        while !probe.healthy() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "etcd not healthy: see {:?}",
                self.dir.with_extension("log")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    }

    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(self.dir.with_extension("log"));
    }
}
