//! TLS to the servers a pool depends on, against the real ones started
//! with certificates of the test's own (a CA, a server certificate for
//! 127.0.0.1, a client certificate; `openssl` makes them):
//!
//! - etcd over https asking for client certificates: a client with the CA
//!   and its certificate reads and writes; without its certificate, with
//!   another CA, or over plain http it gets nothing; `lake serve` joins a
//!   cluster there, and without its certificate it exits saying why.
//! - moto's S3 over https: `lake serve` trusting the private CA
//!   (`SSL_CERT_FILE`) creates its bucket and writes every saved block to
//!   L3 eagerly; trusting only the system's roots it exits at start naming
//!   the certificate.
//!
//! Without `etcd`, moto or `openssl` a test says `SKIPPED` — except in CI
//! (`CI` set), where that is a failure.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lake_cp::etcd::{Etcd, EtcdError, EtcdTls};
use lake_cp::ha::Cluster;

use etcd_server::EtcdServer;

#[path = "common/chain.rs"]
mod chain;
#[path = "common/etcd.rs"]
mod etcd_server;
#[path = "common/scratch.rs"]
mod scratch;
#[path = "common/served.rs"]
mod served;
#[path = "common/supervise.rs"]
mod supervise;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Certificates in a scratch directory, or `None` (said) where this
/// machine cannot make them.
fn certs(name: &str) -> Option<(scratch::Scratch, lake_tests::tls::Certs)> {
    let dir = std::env::temp_dir().join(format!("lake-tls-{name}-{}", std::process::id()));
    match lake_tests::tls::make(&dir) {
        Ok(certs) => Some((scratch::Scratch(dir, Vec::new()), certs)),
        Err(why) => {
            assert!(std::env::var_os("CI").is_none(), "no certificates: {why}");
            println!("SKIPPED: {why}");
            None
        }
    }
}

/// A process stopped as a supervisor would when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        supervise::stop(&mut self.0);
    }
}

/// `lake serve` on `dir` with `extra` arguments and environment (and no
/// `SSL_CERT_FILE` but the one given).
fn serve(dir: &std::path::Path, extra: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Result<served::Served, String> {
    served::start(
        Command::new(env!("CARGO_BIN_EXE_lake"))
            .args(["serve", "--metrics", "off", "--block-bytes", "65536", "--l1-slots", "32", "--l2-slots", "32"])
            .arg("--dir")
            .arg(dir)
            .args(extra)
            .env_remove("SSL_CERT_FILE")
            .envs(env.iter().copied()),
    )
}

#[test]
fn etcd_over_https_asks_for_and_gets_a_client_certificate() {
    let Some((_scratch, certs)) = certs("etcd") else { return };
    let Some(server) = EtcdServer::start_tls("tls", &certs) else { return };
    let endpoint = server.endpoint();
    let timeout = Duration::from_secs(2);
    let good = server.client_tls();
    let etcd = Etcd::with_tls(&[&endpoint], timeout, &good).unwrap();
    etcd.put(b"/lake-tls/k", b"v", None).unwrap();
    assert_eq!(etcd.get(b"/lake-tls/k").unwrap().map(|kv| kv.value), Some(b"v".to_vec()));

    // No client certificate, another CA, plain http: nothing.
    let anonymous = EtcdTls { ca: Some(certs.ca.clone()), ..EtcdTls::default() };
    let refused = Etcd::with_tls(&[&endpoint], timeout, &anonymous).unwrap().get(b"/lake-tls/k");
    assert!(matches!(refused, Err(EtcdError::Unreachable(_))), "{refused:?}");
    let wrong_ca = EtcdTls { ca: Some(certs.other_ca.clone()), ..good.clone() };
    let refused = Etcd::with_tls(&[&endpoint], timeout, &wrong_ca).unwrap().get(b"/lake-tls/k");
    assert!(matches!(&refused, Err(EtcdError::Unreachable(why)) if why.contains("certificate")), "{refused:?}");
    let plain = endpoint.replacen("https", "http", 1);
    assert!(Etcd::new(&[&plain], timeout).unwrap().get(b"/lake-tls/k").is_err());
    // Half a client certificate, or TLS settings for http: said at once.
    let half = EtcdTls { key: None, ..good.clone() };
    assert!(matches!(Etcd::with_tls(&[&endpoint], timeout, &half), Err(EtcdError::Tls(_))));
    assert!(matches!(Etcd::with_tls(&[&plain], timeout, &good), Err(EtcdError::Tls(_))));

    // A pool joins the cluster over it; without its certificate it cannot.
    let dir = certs.ca.with_file_name("pool");
    let (ca, cert, key) =
        (certs.ca.to_str().unwrap(), certs.client_cert.to_str().unwrap(), certs.client_key.to_str().unwrap());
    let cluster = ["--etcd", &endpoint, "--cluster", "tls", "--node", "7", "--etcd-ca", ca];
    let _pool = serve(&dir, &[&cluster[..], &["--etcd-cert", cert, "--etcd-key", key]].concat(), &[]).unwrap();
    let members = Cluster::new(Etcd::with_tls(&[&endpoint], timeout, &good).unwrap(), "tls").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !members.members().unwrap().iter().any(|(node, _)| *node == 7) {
        assert!(Instant::now() < deadline, "the pool never joined over https");
        std::thread::sleep(Duration::from_millis(100));
    }
    let Err(why) = serve(&dir.with_extension("anonymous"), &cluster, &[]) else {
        panic!("a pool without its client certificate joined");
    };
    assert!(why.contains("etcd"), "{why}");
}

#[test]
fn s3_over_https_trusts_a_private_ca_and_refuses_an_unknown_one() {
    let Some(moto) = lake_tests::moto::moto_server() else {
        assert!(std::env::var_os("CI").is_none(), "no moto_server: .ci/run installs it");
        println!("SKIPPED: no moto_server (LAKE_MOTO_SERVER, or ~/.cache/lake-moto)");
        return;
    };
    let Some((_scratch, certs)) = certs("s3") else { return };
    let port = free_port();
    let _server = Killed(
        Command::new(&moto)
            .args(["-H", "127.0.0.1", "-p", &port.to_string(), "-c"])
            .arg(&certs.server_cert)
            .arg("-k")
            .arg(&certs.server_key)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "moto_server did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let endpoint = format!("https://127.0.0.1:{port}");
    let l3 = ["--l3-endpoint", &endpoint, "--l3-bucket", "lake-tls", "--l3-region", "eu-west-1", "--l3-create-bucket"];
    let l3 = [&l3[..], &["--l3-write-back", "eager"]].concat();
    let keys = [("LAKE_S3_ACCESS_KEY", "lake".as_ref()), ("LAKE_S3_SECRET_KEY", "lake-secret".as_ref())];
    let dir = certs.ca.with_file_name("pool");

    // Trusting the system's roots only: the start stops at the bucket.
    let Err(why) = serve(&dir.with_extension("untrusting"), &l3, &keys) else {
        panic!("a pool that does not trust the server's CA made its bucket");
    };
    assert!(why.contains("l3") && why.to_lowercase().contains("certificate"), "{why}");

    // Trusting the private CA: blocks go to L3 over https.
    let trusting = [&keys[..], &[("SSL_CERT_FILE", certs.ca.as_os_str())]].concat();
    let mut pool = serve(&dir, &l3, &trusting).unwrap();
    let mut agent = served::engine(&dir, &pool.field("mirror"), 0x7c).unwrap();
    let blocks: Vec<lake_dp::BlockKey> = (0..6u8).map(|i| lake_dp::BlockKey([0x7c ^ i; 16])).collect();
    chain::save_chain(&mut agent, &blocks, |i| vec![u8::try_from(i).unwrap_or(0); 32 * 1024]);
    drop(agent);
    supervise::stop(&mut pool.child);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut pool.out, &mut rest);
    let writes = rest.split("\"l3_writes\":").nth(1).and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next());
    let writes: u64 = writes.and_then(|w| w.parse().ok()).unwrap_or(0);
    assert!(writes >= 6, "{writes} L3 writes over https for 6 blocks saved: {rest}");
}
