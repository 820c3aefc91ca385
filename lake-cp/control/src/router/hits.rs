//! The hit view of a request, read from the pool on the router's host:
//! its mirror (this node's blocks, with their tiers) and its cluster view
//! (every other node's), both lock-free shared memory the router maps
//! read-only, found through the pool's `pool.json` and found again when
//! the pool restarts.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lake_dp::mirror::MirrorReader;
use lake_dp::mirror::view::ViewReader;
use lake_dp::route::HitView;
use lake_dp::{BlockKey, NodeId};

/// How often a missing or stale pool is looked for again.
const RETRY: Duration = Duration::from_secs(1);

/// The pool's shared memory, as the router reads it.
#[derive(Debug)]
pub(super) struct PoolReader {
    dir: PathBuf,
    mirror: Option<MirrorReader>,
    view: Option<ViewReader>,
    why: String,
    next_check: Instant,
}

impl PoolReader {
    /// The pool whose home is `dir`; nothing opened yet.
    pub(super) fn new(dir: &Path) -> Self {
        Self { dir: dir.to_owned(), mirror: None, view: None, why: "not opened yet".into(), next_check: Instant::now() }
    }

    /// Opens the pool's mirror and view again where either is gone or
    /// retired (at most once a [`RETRY`]).
    fn refresh(&mut self) {
        let now = Instant::now();
        if now < self.next_check {
            return;
        }
        self.next_check = now + RETRY;
        let stale = |alive: bool, ready: bool| !alive || !ready;
        let mirror_stale = self.mirror.as_ref().is_none_or(|m| stale(m.writer_alive(), m.is_ready()));
        let view_stale = self.view.as_ref().is_none_or(|v| stale(v.writer_alive(), v.is_ready()));
        if !mirror_stale && !view_stale {
            return;
        }
        match self.open() {
            Ok((mirror, view)) => {
                self.mirror = Some(mirror);
                self.view = view;
                self.why.clear();
            }
            Err(why) => {
                self.mirror = None;
                self.view = None;
                self.why = why;
            }
        }
    }

    fn open(&self) -> Result<(MirrorReader, Option<ViewReader>), String> {
        let record = self.dir.join("pool.json");
        let text = std::fs::read_to_string(&record).map_err(|e| format!("{}: {e}", record.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", record.display()))?;
        let path = |name: &str| value.get(name).and_then(serde_json::Value::as_str).map(PathBuf::from);
        let mirror_path = path("mirror").ok_or_else(|| format!("{}: no mirror", record.display()))?;
        let mirror = MirrorReader::attach(&mirror_path).map_err(|e| format!("{}: {e}", mirror_path.display()))?;
        let view = path("cluster_view").and_then(|p| ViewReader::attach(&p).ok());
        Ok((mirror, view))
    }

    /// This node's id, and whether the other nodes' blocks are seen (a
    /// cluster view is open); why not, where the pool cannot be read.
    pub(super) fn state(&mut self) -> Result<(NodeId, bool), String> {
        self.refresh();
        match &self.mirror {
            Some(mirror) => Ok((NodeId(mirror.header().node), self.view.is_some())),
            None => Err(self.why.clone()),
        }
    }

    /// The hit view of `keys` (a prompt's blocks, in order), the nodes of
    /// `down` left out ([`lake_dp::route::hits::hit_view`]). Empty where
    /// the pool cannot be read.
    pub(super) fn hits(&mut self, keys: &[BlockKey], down: &[NodeId]) -> HitView {
        self.refresh();
        let Some(mirror) = &self.mirror else { return HitView::default() };
        lake_dp::route::hits::hit_view(mirror, self.view.as_ref(), keys, down)
    }
}
