//! Processes of a cluster test: `lake` children whose output lines are
//! read as they come, and what their serving lines and metrics say.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// A child process whose stdout lines arrive on a channel.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) lines: Receiver<String>,
}

impl Proc {
    pub(crate) fn start(args: &[&str]) -> Self {
        Self::start_with(args, &[])
    }

    /// Started with `env` added to its environment.
    pub(crate) fn start_with(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_lake"));
        command.args(args).envs(env.iter().copied());
        Self::spawn(command)
    }

    /// `command` started, its stdout read line by line.
    pub(crate) fn spawn(mut command: Command) -> Self {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, lines }
    }

    /// The first line (from now) that `want` accepts.
    pub(crate) fn wait_for(&self, what: &str, within: Duration, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if want(&line) => return line,
                Ok(line) => last = line,
                Err(_) => panic!("{what}: not within {within:?}; last line: {last}"),
            }
        }
    }

    #[allow(dead_code)] // not every cluster test kills a process
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        crate::supervise::stop(&mut self.child);
    }
}

/// A `lake summary` leader of `cluster` in etcd at `endpoint`, listening
/// on `listen` (lease 2 s), keeping blocks by `placement` (`None`: its
/// default), with `extra` flags: once it leads.
pub(crate) fn leader(listen: &str, endpoint: &str, cluster: &str, placement: Option<&str>, extra: &[&str]) -> Proc {
    let mut args = vec!["summary", "--listen", listen, "--etcd", endpoint, "--cluster", cluster, "--ttl", "2"];
    args.extend(placement.map(|p| ["--placement", p]).iter().flatten());
    args.extend(extra);
    let leader = Proc::start(&args);
    leader.wait_for("the summary leads", Duration::from_secs(20), |l| l.contains("\"event\":\"leading\""));
    leader
}

pub(crate) fn field(line: &str, name: &str) -> String {
    let start = line.find(&format!("\"{name}\":\"")).unwrap_or_else(|| panic!("{name} in {line}")) + name.len() + 4;
    line[start..start + line[start..].find('"').unwrap()].to_owned()
}

/// `GET path` on `address`: the status line and the body.
#[allow(dead_code)] // not every cluster test reads a node's metrics
pub(crate) fn http_get(address: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: lake\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (head.lines().next().unwrap_or("").to_owned(), body.to_owned())
}

/// `lake route` over the pool whose home is `pool_dir` (its settings in
/// `config`), every node of `nodes` (its id and serving line) running
/// prefill and decode — 0.5 ms to compute a block, 0.05 ms to load one
/// from L1, 0.1 ms to pull one — with `extra` settings before the
/// nodes': the process, and the address it answers at once it listens.
#[allow(dead_code)] // not every cluster test runs a router
pub(crate) fn start_router(
    config: &std::path::Path,
    pool_dir: &std::path::Path,
    nodes: &[(u32, &str)],
    extra: &str,
) -> (Proc, String) {
    let nodes: String = nodes
        .iter()
        .map(|(id, serving)| {
            format!(
                "[[nodes]]\nid = {id}\nroles = [\"prefill\", \"decode\"]\nlake_metrics = \"{}\"\n\
                 compute_ns_per_block = 500000\nload_ns_per_block = [0, 50000, 400000, 3000000]\n\
                 pull_ns_per_block = 100000\ncnic_ns_per_block = 100000\n\n",
                field(serving, "metrics")
            )
        })
        .collect();
    let settings = format!("listen = \"127.0.0.1:0\"\npool_dir = \"{}\"\n{extra}\n{nodes}", pool_dir.display());
    std::fs::write(config, settings).unwrap();
    let router = Proc::start(&["route", "--config", &config.display().to_string()]);
    let routing = router.wait_for("the router listens", Duration::from_secs(20), |l| l.contains("\"routing\""));
    let address = field(&routing, "listen");
    (router, address)
}

/// One request (`head`: its request line) on a connection of its own:
/// the status and the JSON body (0 and null where the connection was
/// closed unanswered).
#[allow(dead_code)] // not every cluster test asks a router
pub(crate) fn http_ask(address: &str, head: &str, body: &[u8]) -> (u16, serde_json::Value) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut request = format!("{head}\r\nHost: lake\r\nConnection: close\r\nContent-Length: {}\r\n\r\n", body.len());
    request.push_str(std::str::from_utf8(body).unwrap());
    let _ = stream.write_all(request.as_bytes());
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    let (status_line, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = status_line.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, serde_json::from_str(body).unwrap_or(serde_json::Value::Null))
}

/// An engine's agent of the pool whose serving line is `serving`, saving
/// into `namespace` as `name`.
#[allow(dead_code)] // not every cluster test attaches an engine
pub(crate) fn agent_of(serving: &str, namespace: lake_dp::NamespaceId, name: &str) -> lake_agent::Agent {
    use std::path::Path;
    let (dp, cp, mirror) = (field(serving, "dp_socket"), field(serving, "cp_socket"), field(serving, "mirror"));
    let config = lake_agent::AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(&mirror),
        cp_socket: Some(Path::new(&cp)),
        name,
        namespace,
        layout_fingerprint: namespace.0,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    lake_agent::Agent::connect(&config, Path::new(&dp)).unwrap()
}
