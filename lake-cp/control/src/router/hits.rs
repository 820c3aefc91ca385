//! The hit view of a request, read from the pool on the router's host:
//! its mirror (this node's blocks, with their tiers) and its cluster view
//! (every other node's) — and each tenant's it keeps apart — all
//! lock-free shared memory the router maps read-only, found through the
//! pool's `pool.json` and found again when the pool restarts.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lake_dp::mirror::MirrorReader;
use lake_dp::mirror::view::ViewReader;
use lake_dp::route::HitView;
use lake_dp::{BlockKey, NodeId};

/// How often a missing or stale pool is looked for again.
const RETRY: Duration = Duration::from_secs(1);

/// One partition of the pool as the router reads it: a mirror (this
/// node's blocks of its namespaces) and, where the node keeps one, its
/// cluster view (the other nodes').
#[derive(Debug)]
struct Partition {
    mirror: MirrorReader,
    view: Option<ViewReader>,
}

impl Partition {
    fn stale(&self) -> bool {
        let stale = |alive: bool, ready: bool| !alive || !ready;
        stale(self.mirror.writer_alive(), self.mirror.is_ready())
            || self.view.as_ref().is_none_or(|v| stale(v.writer_alive(), v.is_ready()))
    }
}

/// The pool's shared memory, as the router reads it: the pool's
/// partition first, then each tenant's kept apart (`pool.json`'s
/// `partitions`). A prompt's blocks are of one namespace, so all of them
/// are in one partition: the first where its first block is held.
#[derive(Debug)]
pub(super) struct PoolReader {
    dir: PathBuf,
    partitions: Vec<Partition>,
    why: String,
    next_check: Instant,
}

impl PoolReader {
    /// The pool whose home is `dir`; nothing opened yet.
    pub(super) fn new(dir: &Path) -> Self {
        Self { dir: dir.to_owned(), partitions: Vec::new(), why: "not opened yet".into(), next_check: Instant::now() }
    }

    /// Opens the pool's mirrors and views again where any is gone or
    /// retired (at most once a [`RETRY`]).
    fn refresh(&mut self) {
        let now = Instant::now();
        if now < self.next_check {
            return;
        }
        self.next_check = now + RETRY;
        if !self.partitions.is_empty() && !self.partitions.iter().any(Partition::stale) {
            return;
        }
        match self.open() {
            Ok(partitions) => {
                self.partitions = partitions;
                self.why.clear();
            }
            Err(why) => {
                self.partitions.clear();
                self.why = why;
            }
        }
    }

    fn open(&self) -> Result<Vec<Partition>, String> {
        let record = self.dir.join("pool.json");
        let text = std::fs::read_to_string(&record).map_err(|e| format!("{}: {e}", record.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", record.display()))?;
        let tenants = value.get("partitions").and_then(serde_json::Value::as_array).map_or(&[][..], Vec::as_slice);
        std::iter::once(&value)
            .chain(tenants)
            .map(|files| {
                let path = |name: &str| files.get(name).and_then(serde_json::Value::as_str).map(PathBuf::from);
                let mirror_path =
                    path("mirror").ok_or_else(|| format!("{}: no mirror in {files}", record.display()))?;
                let mirror =
                    MirrorReader::attach(&mirror_path).map_err(|e| format!("{}: {e}", mirror_path.display()))?;
                let view = path("cluster_view").and_then(|p| ViewReader::attach(&p).ok());
                Ok(Partition { mirror, view })
            })
            .collect()
    }

    /// This node's id, whether the other nodes' blocks are seen (the
    /// pool's cluster view is open), and the tenants' partitions read;
    /// why not, where the pool cannot be read.
    pub(super) fn state(&mut self) -> Result<(NodeId, bool, usize), String> {
        self.refresh();
        match self.partitions.first() {
            Some(pool) => Ok((NodeId(pool.mirror.header().node), pool.view.is_some(), self.partitions.len() - 1)),
            None => Err(self.why.clone()),
        }
    }

    /// The hit view of `keys` (a prompt's blocks, in order), the nodes of
    /// `down` left out ([`lake_dp::route::hits::hit_view`]), from the
    /// partition that holds its first block. Empty where the pool cannot
    /// be read.
    pub(super) fn hits(&mut self, keys: &[BlockKey], down: &[NodeId]) -> HitView {
        self.refresh();
        let mut views =
            self.partitions.iter().map(|p| lake_dp::route::hits::hit_view(&p.mirror, p.view.as_ref(), keys, down));
        views.find(|v| !v.nodes.is_empty() || !v.pool.is_empty() || v.l3_through > 0).unwrap_or_default()
    }
}
