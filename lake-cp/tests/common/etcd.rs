//! An etcd of a test's own (Debian's `etcd-server`, which `.ci/run`
//! installs) on ports of its own, killed with SIGKILL where a crash is
//! the point; over plain HTTP, or over https asking for client
//! certificates. Without an `etcd` binary a test says so and skips —
//! except in CI (`CI` set), where that is a failure.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_cp::etcd::{Etcd, EtcdTls};
use lake_tests::tls::Certs;

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
    /// Serving clients over https with these, asking for their
    /// certificates.
    tls: Option<Certs>,
}

impl EtcdServer {
    #[allow(dead_code)] // a test of etcd over TLS starts only `start_tls`
    pub(crate) fn start(name: &str) -> Option<Self> {
        Self::start_with(name, None)
    }

    /// An etcd serving clients over https only, with `certs`' server
    /// certificate, asking each client for a certificate its CA signed.
    #[allow(dead_code)] // not every test speaks TLS to etcd
    pub(crate) fn start_tls(name: &str, certs: &Certs) -> Option<Self> {
        Self::start_with(name, Some(certs.clone()))
    }

    fn start_with(name: &str, tls: Option<Certs>) -> Option<Self> {
        let Some(binary) = etcd_binary() else {
            assert!(std::env::var_os("CI").is_none(), "no etcd binary: .ci/run installs etcd-server");
            eprintln!("SKIPPED: no etcd binary (apt install etcd-server, or LAKE_ETCD=path)");
            return None;
        };
        let dir = std::env::temp_dir().join(format!("lake-etcd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut server = Self { binary, dir, client: free_port(), peer: free_port(), child: None, tls };
        server.run();
        Some(server)
    }

    pub(crate) fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client)
    }

    /// What a client needs to be let in: the CA and a client certificate
    /// (nothing over plain HTTP).
    pub(crate) fn client_tls(&self) -> EtcdTls {
        self.tls.as_ref().map_or_else(EtcdTls::default, |certs| EtcdTls {
            ca: Some(certs.ca.clone()),
            cert: Some(certs.client_cert.clone()),
            key: Some(certs.client_key.clone()),
        })
    }

    /// Starts etcd on the same directory and ports; waits until healthy.
    pub(crate) fn run(&mut self) -> Duration {
        let (client, peer) = (self.endpoint(), format!("http://127.0.0.1:{}", self.peer));
        let log = std::fs::File::create(self.dir.with_extension("log")).unwrap();
        let mut command = Command::new(&self.binary);
        command
            .args(["--name", "lake-test", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("lake-test={peer}")]);
        if let Some(certs) = &self.tls {
            command.arg("--client-cert-auth").arg("--trusted-ca-file").arg(&certs.ca);
            command.arg("--cert-file").arg(&certs.server_cert).arg("--key-file").arg(&certs.server_key);
        }
        let child = command.stdout(Stdio::null()).stderr(log).spawn().expect("starting etcd");
        self.child = Some(child);
        let started = Instant::now();
        let probe = Etcd::with_tls(&[&self.endpoint()], Duration::from_millis(300), &self.client_tls()).unwrap();
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
