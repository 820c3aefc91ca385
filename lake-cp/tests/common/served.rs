//! A `lake serve` process a test started, as an engine in another process
//! meets it: its serving record, and agents attached over its `dp.sock`.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};

/// A `lake serve` that said it serves: stopped as a supervisor would
/// (SIGTERM, then SIGKILL) when dropped.
pub(crate) struct Served {
    pub(crate) child: Child,
    /// Its stdout past the serving line, held open while it serves (some
    /// tests read its stopped line; the others only keep the pipe).
    #[allow(dead_code)]
    pub(crate) out: std::io::BufReader<ChildStdout>,
    /// The serving line.
    pub(crate) record: serde_json::Value,
}

impl Served {
    /// A field of the serving record.
    pub(crate) fn field(&self, name: &str) -> String {
        self.record[name].as_str().unwrap_or_default().to_owned()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        crate::supervise::stop(&mut self.child);
    }
}

/// Starts `command` (a `lake serve`, its stdout taken here); the pool once
/// it says it serves, or what it said on stderr as it exited.
pub(crate) fn start(command: &mut Command) -> Result<Served, String> {
    let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    if let Ok(record) = serde_json::from_str::<serde_json::Value>(&line)
        && record["event"] == "serving"
    {
        return Ok(Served { child, out, record });
    }
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr);
    assert!(!status.success(), "lake serve exited 0 without serving: {line}{stderr}");
    Err(stderr)
}

/// An engine of this process attached over the pool's `dp.sock` in `dir`,
/// with its mirror at `mirror`, in namespace `namespace`.
pub(crate) fn engine(dir: &Path, mirror: &str, namespace: u64) -> Result<lake_agent::Agent, lake_agent::AttachError> {
    let cp = dir.join("cp.sock");
    let config = lake_agent::AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(mirror),
        cp_socket: Some(&cp),
        name: "remote-test-engine",
        namespace: lake_dp::NamespaceId(namespace),
        layout_fingerprint: namespace ^ 0x5c5c,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    lake_agent::Agent::connect(&config, &dir.join("dp.sock"))
}
