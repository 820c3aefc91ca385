//! The cluster view: which other nodes of the pool hold which blocks, and
//! in which tier — what the leader's summary streams down to every node's
//! `lake-cp`, published beside the node's mirror for its engines to read
//! lock-free, as they read the mirror.
//!
//! The table is the mirror's (the same header, region records, seqlocked
//! 32-byte buckets, probing and repair) under its own magic, `LAKEVIEW`,
//! so neither is ever taken for the other. A bucket holds a block's key
//! and up to [`HOLDERS_KEPT`] other nodes holding it, each with the
//! fastest tier it holds it in, fastest first:
//!
//! ```text
//! meta      bits 0-1 state (as the mirror's), 2-3 kind, 4-7 the tiers
//!           held anywhere (bit per tier), 8-31 zero
//! words[0]  key bytes 0..8      words[1]  key bytes 8..16
//! words[2]  holder i at bits 12i..12i+11 (i below 5): bits 0-1 its tier
//!           (1 L1, 2 L2, 3 L3; 0 ends the list), 2-11 its node slot;
//!           by tier, then slot
//! ```
//!
//! Region record `i` (below [`VIEW_NODES_MAX`], 1024) names slot `i`'s
//! node: meta bit 0 present, `words[0]` the node id. A slot keeps its
//! node while any entry names it, and a slot no entry names goes to
//! another node only once every slot has been taken; a reader that read
//! an entry just before may then take its block for the new node's — a
//! pull there finds nothing, a miss, never another block. A block held by
//! more nodes than a bucket names shows the fastest; its writer keeps the
//! rest, and names the next when one of those goes. The node's own blocks
//! are not in its view: its mirror has them, with their slots.
//!
//! Version 1 of the view (still read) named at most 32 nodes, two bits a
//! node slot in `words[2]` (slot i: bits 2i, 2i+1, its tier as above).

use std::collections::HashMap;
use std::path::Path;

use super::layout::{REGIONS_MAX, TableKind};
use super::seqlock::Snapshot;
use super::table::STATE_LIVE;
use super::{MirrorConfig, MirrorEntry, MirrorError, MirrorReader, MirrorWriter, kind_bits};
use crate::model::key::BlockKey;
use crate::model::replica::{NodeId, ObjectKind, Tier};

/// The first eight bytes of every cluster view.
pub const VIEW_MAGIC: [u8; 8] = *b"LAKEVIEW";

/// The cluster view's kind: this build writes version 2 and reads 1 too.
pub const VIEW: TableKind = TableKind { magic: VIEW_MAGIC, version: 2, oldest: 1 };

/// Nodes one view names (besides its own): a region record each.
pub const VIEW_NODES_MAX: usize = REGIONS_MAX as usize;

/// Holders a bucket names: the fastest.
pub const HOLDERS_KEPT: usize = 5;

/// Another node holding a block, and its fastest tier of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The node.
    pub node: NodeId,
    /// L1, L2 or L3.
    pub tier: Tier,
}

/// Where a block of a prompt is, as a node's engines see the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Where {
    /// On this node: its mirror entry.
    Local(MirrorEntry),
    /// Only on another node: the fastest holder.
    Remote(Holder),
}

/// Why the view could not take a change.
#[derive(Debug, PartialEq)]
pub enum ViewError {
    /// The table.
    Table(MirrorError),
    /// Every node slot names another node.
    NodesFull,
    /// L0 is never in a view.
    Tier,
}

impl core::fmt::Display for ViewError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Table(e) => write!(f, "cluster view: {e}"),
            Self::NodesFull => write!(f, "cluster view: names {VIEW_NODES_MAX} nodes already"),
            Self::Tier => f.write_str("cluster view: L0 is no other node's to read"),
        }
    }
}

impl std::error::Error for ViewError {}

impl From<MirrorError> for ViewError {
    fn from(error: MirrorError) -> Self {
        Self::Table(error)
    }
}

fn tier_code(tier: Tier) -> Option<u64> {
    match tier {
        Tier::L0Hbm => None,
        Tier::L1Dram => Some(1),
        Tier::L2Nvme => Some(2),
        Tier::L3Object => Some(3),
    }
}

fn tier_of_code(code: u64) -> Option<Tier> {
    match code {
        1 => Some(Tier::L1Dram),
        2 => Some(Tier::L2Nvme),
        3 => Some(Tier::L3Object),
        _ => None,
    }
}

/// A holder as a bucket names it: its tier's code (1 L1, 2 L2, 3 L3),
/// then its node slot — in the order a bucket keeps them, fastest first.
type Named = (u64, usize);

/// Bits of one holder in a version 2 bucket's `words[2]`.
const HOLDER_BITS: usize = 12;

/// The holders word of `named` (its first [`HOLDERS_KEPT`], in order).
fn pack(named: &[Named]) -> u64 {
    named
        .iter()
        .take(HOLDERS_KEPT)
        .enumerate()
        .fold(0, |word, (i, &(code, slot))| word | (code | (slot as u64) << 2) << (HOLDER_BITS * i))
}

/// The holders a version 2 holders word names, fastest first.
fn unpack(word: u64) -> impl Iterator<Item = Named> {
    (0..HOLDERS_KEPT)
        .map(move |i| (word >> (HOLDER_BITS * i)) & 0xfff)
        .take_while(|holder| holder & 3 != 0)
        .map(|holder| (holder & 3, crate::usize_from(holder >> 2)))
}

/// The tiers `named` hold, a bit per tier.
fn tiers_held(named: &[Named]) -> u32 {
    named.iter().filter_map(|&(code, _)| tier_of_code(code)).fold(0, |bits, tier| bits | 1 << tier as u32)
}

/// The node's writer of its view: the node's `lake-cp`, applying what the
/// leader streams.
pub struct ViewWriter {
    table: MirrorWriter,
    own: NodeId,
    /// Each slot's node and how many blocks name it (in the table, or
    /// among those a bucket has no room for).
    slots: Vec<Option<(NodeId, u64)>>,
    /// Each node's slot.
    by_node: HashMap<NodeId, usize>,
    /// Of blocks more nodes hold than a bucket names, the slower ones.
    overflow: HashMap<BlockKey, Vec<Named>>,
    /// A block's holders while a change is made (reused).
    scratch: Vec<Named>,
}

impl core::fmt::Debug for ViewWriter {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ViewWriter").field("own", &self.own).field("live", &self.table.live()).finish_non_exhaustive()
    }
}

impl ViewWriter {
    /// Builds a new view for node `config.node` (published at its path
    /// when ready; a file there whose writer is gone is replaced).
    pub fn create(config: &MirrorConfig) -> Result<Self, MirrorError> {
        let table = MirrorWriter::create_as(config, VIEW)?;
        Ok(Self {
            table,
            own: config.node,
            slots: vec![None; VIEW_NODES_MAX],
            by_node: HashMap::new(),
            overflow: HashMap::new(),
            scratch: Vec::new(),
        })
    }

    /// [`ViewWriter::create`] for node `node`'s control plane: a view of
    /// up to `blocks` other nodes' blocks in shared memory at `path`
    /// (engines find it beside their mirror: [`ViewOpener::path_beside`]).
    pub fn create_at(path: std::path::PathBuf, node: NodeId, blocks: u64) -> Result<Self, MirrorError> {
        Self::create(&MirrorConfig { node, ..MirrorConfig::for_entries(super::MirrorBacking::Shm(path), blocks) })
    }

    fn bind(&mut self, node: NodeId) -> Result<usize, ViewError> {
        // A slot never used first; then one no entry names any more.
        let free = self.slots.iter().position(Option::is_none);
        let slot = free.or_else(|| self.slots.iter().position(|s| s.is_some_and(|(_, n)| n == 0)));
        let slot = slot.ok_or(ViewError::NodesFull)?;
        self.table.set_record_raw(slot, Snapshot { meta: 1, words: [u64::from(node.0), 0, 0] })?;
        if let Some((before, _)) = self.slots[slot].replace((node, 0)) {
            self.by_node.remove(&before);
        }
        self.by_node.insert(node, slot);
        Ok(slot)
    }

    /// Sets what `node` holds of `key`: its fastest tier, or `None`. The
    /// node's own holdings are not kept (its mirror has them): `Ok(false)`.
    pub fn set(
        &mut self,
        key: &BlockKey,
        node: NodeId,
        tier: Option<Tier>,
        kind: ObjectKind,
    ) -> Result<bool, ViewError> {
        if node == self.own {
            return Ok(false);
        }
        let code = match tier {
            Some(tier) => tier_code(tier).ok_or(ViewError::Tier)?,
            None => 0,
        };
        let slot = match self.by_node.get(&node) {
            Some(&slot) => slot,
            None if code == 0 => return Ok(true),
            None => self.bind(node)?,
        };
        let mut named = core::mem::take(&mut self.scratch);
        named.clear();
        if let Some(current) = self.table.get_raw(key).filter(|s| s.meta & 3 == STATE_LIVE) {
            named.extend(unpack(current.words[2]));
        }
        if let Some(slower) = self.overflow.get(key) {
            named.extend_from_slice(slower);
        }
        let at = named.iter().position(|&(_, s)| s == slot);
        let was = at.map_or(0, |i| named[i].0);
        let result = if was == code { Ok(()) } else { self.store(key, kind, &mut named, at, (code, slot)) };
        self.scratch = named;
        result?;
        if let Some((_, count)) = &mut self.slots[slot] {
            match (was, code) {
                (0, _) => *count += 1,
                (_, 0) => *count -= 1,
                _ => {}
            }
        }
        Ok(true)
    }

    /// Stores `key`'s holders, `named` (holder `at` of them, if any, the
    /// one changed) with `holder` in its place: the fastest in the bucket,
    /// the rest aside.
    fn store(
        &mut self,
        key: &BlockKey,
        kind: ObjectKind,
        named: &mut Vec<Named>,
        at: Option<usize>,
        holder: Named,
    ) -> Result<(), ViewError> {
        match at {
            Some(i) if holder.0 == 0 => {
                named.remove(i);
            }
            Some(i) => named[i] = holder,
            None => named.push(holder),
        }
        named.sort_unstable();
        if named.is_empty() {
            self.table.remove(key);
        } else {
            let (lo, hi) = super::key_words(key);
            let meta = STATE_LIVE | kind_bits(kind) << 2 | tiers_held(named) << 4;
            self.table.upsert_raw(key, Snapshot { meta, words: [lo, hi, pack(named)] })?;
        }
        if named.len() > HOLDERS_KEPT {
            self.overflow.insert(*key, named[HOLDERS_KEPT..].to_vec());
        } else if !self.overflow.is_empty() {
            self.overflow.remove(key);
        }
        Ok(())
    }

    /// Withdraws every entry and frees every slot (a snapshot of the
    /// leader's view follows). Readers see misses meanwhile.
    pub fn clear(&mut self) {
        self.table.clear();
        self.overflow.clear();
        self.by_node.clear();
        for slot in 0..VIEW_NODES_MAX {
            if self.slots[slot].take().is_some() {
                let _ = self.table.set_record_raw(slot, Snapshot { meta: 0, words: [0; 3] });
            }
        }
    }

    /// Blocks in the view.
    pub fn live(&self) -> u64 {
        self.table.live()
    }

    /// Nodes named now, with how many blocks each holds.
    pub fn nodes(&self) -> Vec<(NodeId, u64)> {
        self.slots.iter().flatten().copied().filter(|&(_, count)| count > 0).collect()
    }

    /// Bytes mapped.
    pub fn mapped_bytes(&self) -> usize {
        self.table.mapped_bytes()
    }

    /// The file's path (none for a memfd).
    pub fn path(&self) -> Option<&Path> {
        self.table.path()
    }

    /// Marks the view retired (readers detach) and lets go of it.
    pub fn retire(self) {
        self.table.retire();
    }
}

/// Each tier's holders in a version 1 holders word, as masks of slots (a
/// slot's low bit set in its tier's mask) with the tier's code: the low
/// and high bit of every slot's code side by side, fastest tier first.
fn tier_masks_v1(holders: u64) -> [(u64, u64); 3] {
    const LOW: u64 = 0x5555_5555_5555_5555;
    let (low, high) = (holders & LOW, (holders >> 1) & LOW);
    [(low & !high, 1), (high & !low, 2), (low & high, 3)]
}

/// The holders a version 1 holders word names, fastest first (by tier,
/// then slot).
fn unpack_v1(holders: u64) -> impl Iterator<Item = Named> {
    tier_masks_v1(holders).into_iter().flat_map(|(mut slots, code)| {
        core::iter::from_fn(move || {
            (slots != 0).then(|| {
                let slot = slots.trailing_zeros() as usize / 2;
                slots &= slots - 1;
                (code, slot)
            })
        })
    })
}

/// An engine's (or a router's) reader of a node's view; maps it read-only.
#[derive(Debug)]
pub struct ViewReader {
    table: MirrorReader,
    /// Version 1: two bits a node slot.
    v1: bool,
}

impl ViewReader {
    /// Maps the view at `path`.
    pub fn attach(path: &Path) -> Result<Self, MirrorError> {
        Ok(Self::of(MirrorReader::attach_as(path, VIEW)?))
    }

    /// Maps the view behind `fd` (passed over a socket at attach).
    pub fn attach_fd(fd: std::os::fd::OwnedFd) -> Result<Self, MirrorError> {
        Ok(Self::of(MirrorReader::attach_fd_as(fd, VIEW)?))
    }

    /// Maps the same view again, through a copy of its descriptor (for
    /// another thread's reads).
    pub fn reopen(&self) -> Result<Self, MirrorError> {
        Ok(Self::of(self.table.reopen_as(VIEW)?))
    }

    fn of(table: MirrorReader) -> Self {
        let v1 = table.header().version == 1;
        Self { table, v1 }
    }

    /// Whether the view is valid (its writer has not retired it).
    pub fn is_ready(&self) -> bool {
        self.table.is_ready()
    }

    /// Whether a writer holds the view now (a system call).
    pub fn writer_alive(&self) -> bool {
        self.table.writer_alive()
    }

    /// Blocks in the view (as the writer last counted).
    pub fn live(&self) -> u64 {
        self.table.live()
    }

    /// The node whose view it is.
    pub fn node(&self) -> NodeId {
        NodeId(self.table.header().node)
    }

    /// The fastest other node holding `key` (the lowest slot among equals);
    /// none where no other node holds it or it could not be told.
    #[inline]
    pub fn best(&self, key: &BlockKey) -> Option<Holder> {
        let word = self.table.get_raw(key).ok()??.words[2];
        let (code, slot) = if self.v1 { unpack_v1(word).next()? } else { unpack(word).next()? };
        Some(Holder { node: self.slot_node(slot)?, tier: tier_of_code(code)? })
    }

    /// Every other node holding `key` that its bucket names (the
    /// [`HOLDERS_KEPT`] fastest), with its fastest tier, fastest first.
    pub fn holders(&self, key: &BlockKey) -> Vec<Holder> {
        let mut out = Vec::new();
        self.holders_into(key, &mut out);
        out
    }

    /// [`ViewReader::holders`], appended to `out` (a router's scratch,
    /// reused from block to block).
    pub fn holders_into(&self, key: &BlockKey, out: &mut Vec<Holder>) {
        let Ok(Some(snapshot)) = self.table.get_raw(key) else { return };
        for (code, slot) in self.named(snapshot.words[2]) {
            if let Some(tier) = tier_of_code(code)
                && let Some(node) = self.slot_node(slot)
            {
                out.push(Holder { node, tier });
            }
        }
    }

    /// The holders a bucket's `words[2]` names, in this view's version.
    fn named(&self, word: u64) -> impl Iterator<Item = Named> {
        let (v1, v2) = if self.v1 { (Some(unpack_v1(word)), None) } else { (None, Some(unpack(word))) };
        v1.into_iter().flatten().chain(v2.into_iter().flatten())
    }

    fn slot_node(&self, slot: usize) -> Option<NodeId> {
        let record = self.table.record_raw(slot)?;
        #[allow(clippy::cast_possible_truncation)] // node ids are u32, stored in a u64 word
        (record.meta & 1 == 1).then_some(NodeId(record.words[0] as u32))
    }

    #[inline]
    fn prefetch(&self, key: &BlockKey) {
        self.table.prefetch(key);
    }
}

/// A node's cluster view for an engine: the one its data plane passed
/// at attach, or opened by its path when first asked for — and opened
/// again by that path when its writer retired it or is gone (a restarted
/// pool publishes a new one), tried at most once per
/// [`ViewOpener::RETRY`], so a pool without a view costs a lookup nothing
/// more. One with no path (a tenant's engine: its view comes only as
/// passed) never opens one itself.
#[derive(Debug)]
pub struct ViewOpener {
    path: Option<std::path::PathBuf>,
    reader: Option<ViewReader>,
    next_check: std::time::Instant,
}

impl ViewOpener {
    /// How often a missing or stale view is looked for again.
    pub const RETRY: std::time::Duration = std::time::Duration::from_secs(1);

    /// The view beside the mirror at `mirror` (`<mirror>.cluster`).
    pub fn beside(mirror: &Path) -> Self {
        Self::passed(None, Some(Self::path_beside(mirror)))
    }

    /// The view `passed` at attach, if any; then, where it is gone or
    /// none came, the one at `path` (none: no other).
    pub fn passed(passed: Option<ViewReader>, path: Option<std::path::PathBuf>) -> Self {
        let next_check = std::time::Instant::now() + if passed.is_some() { Self::RETRY } else { Default::default() };
        Self { path, reader: passed, next_check }
    }

    /// Where the view of the mirror at `mirror` is: `<mirror>.cluster`.
    pub fn path_beside(mirror: &Path) -> std::path::PathBuf {
        let mut path = mirror.as_os_str().to_owned();
        path.push(".cluster");
        path.into()
    }

    /// The same view, mapped again (for another thread's reads), and
    /// looked for at the same path.
    pub fn reopen(&self) -> Self {
        Self::passed(self.reader.as_ref().and_then(|r| r.reopen().ok()), self.path.clone())
    }

    /// The view, where there is one now.
    pub fn reader(&mut self) -> Option<&ViewReader> {
        let now = std::time::Instant::now();
        if now >= self.next_check {
            self.next_check = now + Self::RETRY;
            let stale = self.reader.as_ref().is_none_or(|r| !r.is_ready() || !r.writer_alive());
            if stale {
                self.reader = self.path.as_deref().and_then(|path| ViewReader::attach(path).ok());
            }
        }
        self.reader.as_ref()
    }
}

/// Runs `step(i, key)` over `keys` in order until it returns false, each
/// key's buckets in the mirror and the view fetched [`AHEAD`] keys before
/// it is read.
fn fetched_ahead(
    mirror: &MirrorReader,
    view: Option<&ViewReader>,
    keys: &[BlockKey],
    mut step: impl FnMut(usize, &BlockKey) -> bool,
) {
    let fetch = |key: &BlockKey| {
        mirror.prefetch(key);
        if let Some(view) = view {
            view.prefetch(key);
        }
    };
    keys.iter().take(AHEAD).for_each(fetch);
    for (i, key) in keys.iter().enumerate() {
        if let Some(next) = keys.get(i + AHEAD) {
            fetch(next);
        }
        if !step(i, key) {
            return;
        }
    }
}

/// Keys fetched ahead of the one read.
const AHEAD: usize = 16;

/// A prompt's longest prefix held anywhere in the pool, and where each
/// block of it is, into `out` (cleared first): this node's mirror first,
/// then its view of the other nodes; the first key neither has ends it.
/// Every entry is read (a linear pass, buckets fetched ahead), so the
/// answer is exact whatever the sets. Returns how many.
pub fn lookup(mirror: &MirrorReader, view: Option<&ViewReader>, keys: &[BlockKey], out: &mut Vec<Where>) -> usize {
    out.clear();
    fetched_ahead(mirror, view, keys, |_, key| {
        let place = match mirror.get(key) {
            super::Lookup::Hit(entry) => Some(Where::Local(entry)),
            super::Lookup::Miss | super::Lookup::Unreadable => view.and_then(|v| v.best(key)).map(Where::Remote),
        };
        place.map(|place| out.push(place)).is_some()
    });
    out.len()
}

/// Every holder of each block of a prompt in turn, as a router weighs
/// them: `visit(i, local, remote)` gets block `i`'s entry in this node's
/// mirror (if it holds it) and the other nodes holding it with their
/// fastest tiers, until it returns false or the keys end. Buckets are
/// fetched ahead, as [`lookup`] does.
pub fn walk(
    mirror: &MirrorReader,
    view: Option<&ViewReader>,
    keys: &[BlockKey],
    mut visit: impl FnMut(usize, Option<MirrorEntry>, &[Holder]) -> bool,
) {
    let mut remote = Vec::new();
    fetched_ahead(mirror, view, keys, |i, key| {
        let local = match mirror.get(key) {
            super::Lookup::Hit(entry) => Some(entry),
            super::Lookup::Miss | super::Lookup::Unreadable => None,
        };
        remote.clear();
        if let Some(view) = view {
            view.holders_into(key, &mut remote);
        }
        visit(i, local, &remote)
    });
}

/// The blocks of a cluster lookup's answer (`keys` and the `places`
/// [`lookup`] gave them) that only other nodes hold, each with its holder:
/// what an engine pulls.
pub fn remote(keys: &[BlockKey], places: &[Where]) -> Vec<(BlockKey, Holder)> {
    keys.iter()
        .zip(places)
        .filter_map(|(key, place)| match place {
            Where::Remote(holder) => Some((*key, *holder)),
            Where::Local(_) => None,
        })
        .collect()
}

/// How often a pull's wait reads the cluster view again.
const VIEW_AGAIN: std::time::Duration = std::time::Duration::from_millis(20);

/// How long a block of a pulled prefix is seen nowhere before it is taken
/// for gone from the pool (a block moving between nodes is unseen while
/// the view catches up).
const GONE_AFTER: std::time::Duration = std::time::Duration::from_millis(200);

/// An engine's wait for a pulled prefix to land in its node's mirror.
/// The view is read again every 20 ms while it waits: a block of the
/// node's own that went meanwhile (moved to another reader), or one whose
/// holder changed, is asked from where it is now; a block seen nowhere for
/// 200 ms — gone from the pool, not moving — ends the prefix before it.
#[derive(Debug)]
pub struct PullWait {
    /// The prefix waited for: held somewhere, as the view last said.
    found: usize,
    asked: std::collections::HashMap<BlockKey, Holder>,
    /// Since when a block of the prefix is seen nowhere.
    unseen_since: Option<std::time::Instant>,
    look_at: std::time::Instant,
    deadline: std::time::Instant,
    first: bool,
    /// When the first block was asked; the hit last seen, the asked
    /// blocks that landed in it, and when the last of them was seen.
    asked_at: Option<std::time::Instant>,
    hit: usize,
    landed: u32,
    landed_at: Option<std::time::Instant>,
}

impl PullWait {
    /// A wait of at most `within`, for a prefix of `keys` (the first
    /// [`PullWait::look`] finds it).
    pub fn new(keys: &[BlockKey], within: std::time::Duration) -> Self {
        let now = std::time::Instant::now();
        Self {
            found: keys.len(),
            asked: std::collections::HashMap::new(),
            unseen_since: None,
            look_at: now,
            deadline: now + within,
            first: true,
            asked_at: None,
            hit: 0,
            landed: 0,
            landed_at: None,
        }
    }

    /// The prefix waited for: look its blocks up in the mirror.
    pub fn found(&self) -> usize {
        self.found
    }

    /// Where it is time, reads where the prefix's blocks are — `lookup`
    /// ([`lookup`] over the keys given, into `places`, returning how many
    /// are held anywhere) — and returns those to pull: held only by
    /// another node, and not asked of that one yet. Tell the wait which
    /// were asked ([`PullWait::asked`]).
    pub fn look(
        &mut self,
        keys: &[BlockKey],
        lookup: impl FnOnce(&[BlockKey], &mut Vec<Where>) -> usize,
        places: &mut Vec<Where>,
    ) -> Vec<(BlockKey, Holder)> {
        let now = std::time::Instant::now();
        if now < self.look_at {
            return Vec::new();
        }
        self.look_at = now + VIEW_AGAIN;
        let seen = lookup(&keys[..self.found], places).min(self.found);
        if self.first {
            self.first = false;
            self.found = seen;
        }
        // A block seen nowhere may be on its way to another node, not in
        // this node's view yet: gone once it stays unseen.
        self.unseen_since = if seen < self.found { Some(self.unseen_since.unwrap_or(now)) } else { None };
        if self.unseen_since.is_some_and(|since| now.duration_since(since) >= GONE_AFTER) {
            self.found = seen;
        }
        let mut pulls = remote(&keys[..seen], places);
        pulls.retain(|(key, holder)| self.asked.get(key) != Some(holder));
        pulls
    }

    /// Sleeps until the node's `lake-cp` publishes in `mirror` past
    /// `writes` (its [`MirrorReader::writes`] taken before this round's
    /// lookups), at most 200 µs, so that the wait's deadline and its next
    /// reading of the view are not slept through.
    pub fn sleep(&self, mirror: &MirrorReader, writes: u32) {
        mirror.wait_for_writes(writes, std::time::Duration::from_micros(200));
    }

    /// `pulls` were asked.
    pub fn asked(&mut self, pulls: &[(BlockKey, Holder)]) {
        self.asked_at.get_or_insert_with(std::time::Instant::now);
        self.asked.extend(pulls.iter().copied());
    }

    /// The node's mirror holds `hit` blocks of `keys` now: the asked
    /// ones among those new to it landed (see [`PullWait::per_block`]).
    pub fn saw(&mut self, keys: &[BlockKey], hit: usize) {
        if hit <= self.hit {
            return;
        }
        let landed = keys[self.hit..hit].iter().filter(|key| self.asked.contains_key(key)).count();
        self.hit = hit;
        if landed > 0 {
            self.landed = self.landed.saturating_add(u32::try_from(landed).unwrap_or(u32::MAX));
            self.landed_at = Some(std::time::Instant::now());
        }
    }

    /// What one pulled block cost: the time from the first ask to the
    /// last asked block seen landed ([`PullWait::saw`]), over the asked
    /// blocks that landed (none landed: none).
    pub fn per_block(&self) -> Option<std::time::Duration> {
        let (asked_at, landed_at) = (self.asked_at?, self.landed_at?);
        (self.landed > 0).then(|| landed_at.duration_since(asked_at) / self.landed)
    }

    /// Whether the wait is over, the node's mirror holding `hit` blocks of
    /// the prefix: all of it, nothing asked and nothing moving, or the
    /// time is up.
    pub fn over(&self, hit: usize) -> bool {
        hit >= self.found
            || (self.asked.is_empty() && self.unseen_since.is_none())
            || std::time::Instant::now() >= self.deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mirror::MirrorBacking;

    struct Scratch(std::path::PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn scratch(name: &str) -> Scratch {
        Scratch(std::path::PathBuf::from(format!("/dev/shm/lake-view-test-{name}-{}", std::process::id())))
    }

    fn key(n: u32) -> BlockKey {
        let mut k = [0x5a; 16];
        k[..4].copy_from_slice(&n.to_le_bytes());
        BlockKey(k)
    }

    fn config(path: &Path, own: u32) -> MirrorConfig {
        MirrorConfig { node: NodeId(own), ..MirrorConfig::for_entries(MirrorBacking::Shm(path.to_path_buf()), 1000) }
    }

    #[test]
    fn a_view_names_each_other_node_with_its_fastest_tier_and_never_its_own() {
        let path = scratch("holders");
        let mut writer = ViewWriter::create(&config(&path.0, 1)).unwrap();
        let reader = ViewReader::attach(&path.0).unwrap();
        assert_eq!(reader.node(), NodeId(1));
        let kv = ObjectKind::KvBlock;
        assert_eq!(writer.set(&key(1), NodeId(1), Some(Tier::L1Dram), kv), Ok(false));
        assert_eq!(reader.best(&key(1)), None, "the own node's holdings are its mirror's");
        writer.set(&key(1), NodeId(7), Some(Tier::L2Nvme), kv).unwrap();
        writer.set(&key(1), NodeId(9), Some(Tier::L1Dram), kv).unwrap();
        assert_eq!(reader.best(&key(1)), Some(Holder { node: NodeId(9), tier: Tier::L1Dram }));
        assert_eq!(reader.holders(&key(1)).len(), 2);
        writer.set(&key(1), NodeId(9), None, kv).unwrap();
        assert_eq!(reader.best(&key(1)), Some(Holder { node: NodeId(7), tier: Tier::L2Nvme }));
        writer.set(&key(1), NodeId(7), None, kv).unwrap();
        assert_eq!(reader.best(&key(1)), None);
        assert_eq!(writer.live(), 0, "a block no node holds leaves the table");
        assert_eq!(writer.set(&key(2), NodeId(7), Some(Tier::L0Hbm), kv), Err(ViewError::Tier));
        // A MirrorReader refuses a view, and a view reader a mirror.
        assert_eq!(MirrorReader::attach(&path.0).err(), Some(MirrorError::Header("magic: not a Lake mirror")));
    }

    #[test]
    fn a_view_names_a_thousand_and_twenty_four_nodes_and_reuses_a_slot_no_entry_names() {
        let path = scratch("slots");
        let mut writer = ViewWriter::create(&MirrorConfig {
            node: NodeId(0),
            ..MirrorConfig::for_entries(MirrorBacking::Shm(path.0.clone()), 2000)
        })
        .unwrap();
        let kv = ObjectKind::KvBlock;
        let nodes = u32::try_from(VIEW_NODES_MAX).unwrap();
        assert_eq!(nodes, 1024);
        for node in 1..=nodes {
            writer.set(&key(node), NodeId(node), Some(Tier::L1Dram), kv).unwrap();
        }
        let reader = ViewReader::attach(&path.0).unwrap();
        for node in 1..=nodes {
            assert_eq!(reader.best(&key(node)), Some(Holder { node: NodeId(node), tier: Tier::L1Dram }));
        }
        let past = nodes + 100;
        assert_eq!(writer.set(&key(past), NodeId(past), Some(Tier::L1Dram), kv), Err(ViewError::NodesFull));
        writer.set(&key(3), NodeId(3), None, kv).unwrap();
        writer.set(&key(past), NodeId(past), Some(Tier::L3Object), kv).unwrap();
        assert_eq!(reader.best(&key(past)), Some(Holder { node: NodeId(past), tier: Tier::L3Object }));
        assert_eq!(writer.nodes().len(), VIEW_NODES_MAX);
        // Node 3's slot is node `past`'s now: node 3 comes back in another.
        writer.set(&key(3), NodeId(3), Some(Tier::L2Nvme), kv).unwrap_err();
        writer.set(&key(5), NodeId(5), None, kv).unwrap();
        writer.set(&key(3), NodeId(3), Some(Tier::L2Nvme), kv).unwrap();
        assert_eq!(reader.best(&key(3)), Some(Holder { node: NodeId(3), tier: Tier::L2Nvme }));
        assert_eq!(reader.best(&key(past)), Some(Holder { node: NodeId(past), tier: Tier::L3Object }));
        writer.clear();
        assert_eq!((writer.live(), writer.nodes().len()), (0, 0));
        assert_eq!(reader.best(&key(past)), None);
    }

    #[test]
    fn a_block_more_nodes_hold_than_a_bucket_names_shows_the_fastest_and_the_next_when_one_goes() {
        let path = scratch("overflow");
        let mut writer = ViewWriter::create(&config(&path.0, 0)).unwrap();
        let reader = ViewReader::attach(&path.0).unwrap();
        let kv = ObjectKind::KvBlock;
        // Nine holders: 1..=3 in L3, 4..=6 in L2, 7..=9 in L1, set slowest
        // first, so each faster one pushes a slower one out of the bucket.
        let tier = |node: u32| [Tier::L3Object, Tier::L2Nvme, Tier::L1Dram][(node as usize - 1) / 3];
        for node in 1..=9 {
            writer.set(&key(1), NodeId(node), Some(tier(node)), kv).unwrap();
        }
        let on = |node: u32| Holder { node: NodeId(node), tier: tier(node) };
        let shown = |nodes: &[u32]| nodes.iter().map(|&n| on(n)).collect::<Vec<_>>();
        assert_eq!(reader.holders(&key(1)), shown(&[7, 8, 9, 4, 5]));
        assert_eq!(reader.best(&key(1)), Some(on(7)));
        // The fastest go: the slower ones named again, in turn.
        for node in [7, 8, 9, 4] {
            writer.set(&key(1), NodeId(node), None, kv).unwrap();
        }
        assert_eq!(reader.holders(&key(1)), shown(&[5, 6, 1, 2, 3]));
        // One moves up a tier; one of those never in the bucket goes.
        writer.set(&key(1), NodeId(2), Some(Tier::L1Dram), kv).unwrap();
        writer.set(&key(1), NodeId(3), None, kv).unwrap();
        assert_eq!(reader.best(&key(1)), Some(Holder { node: NodeId(2), tier: Tier::L1Dram }));
        assert_eq!(reader.holders(&key(1)).len(), 4);
        for node in [1, 2, 5, 6] {
            writer.set(&key(1), NodeId(node), None, kv).unwrap();
        }
        assert_eq!((reader.best(&key(1)), writer.live(), writer.nodes().len()), (None, 0, 0));
    }

    #[test]
    fn a_version_one_view_is_read_as_it_was_written() {
        let path = scratch("v1");
        let v1 = TableKind { version: 1, ..VIEW };
        let mut table = MirrorWriter::create_as(&config(&path.0, 0), v1).unwrap();
        for (slot, node) in [(0, 7u64), (3, 9)] {
            table.set_record_raw(slot, Snapshot { meta: 1, words: [node, 0, 0] }).unwrap();
        }
        // Slot 0 in L2, slot 3 in L1: two bits a slot.
        let (lo, hi) = super::super::key_words(&key(1));
        let meta = STATE_LIVE | kind_bits(ObjectKind::KvBlock) << 2;
        table.upsert_raw(&key(1), Snapshot { meta, words: [lo, hi, 2 | 1 << 6] }).unwrap();
        let reader = ViewReader::attach(&path.0).unwrap();
        let (on_9, on_7) =
            (Holder { node: NodeId(9), tier: Tier::L1Dram }, Holder { node: NodeId(7), tier: Tier::L2Nvme });
        assert_eq!(reader.best(&key(1)), Some(on_9));
        assert_eq!(reader.holders(&key(1)), vec![on_9, on_7]);
        // A version this build does not know is refused, not misread.
        let path_3 = scratch("v3");
        let _table = MirrorWriter::create_as(&config(&path_3.0, 0), TableKind { version: 3, ..VIEW }).unwrap();
        assert_eq!(ViewReader::attach(&path_3.0).err(), Some(MirrorError::Version { found: 3, supported: 2 }));
    }

    #[test]
    fn a_cluster_lookup_takes_local_blocks_first_then_other_nodes_and_stops_at_the_first_held_nowhere() {
        let mirror_path = scratch("lookup-mirror");
        let view_path = scratch("lookup-view");
        let mut mirror = MirrorWriter::create(&config(&mirror_path.0, 1)).unwrap();
        let mut view = ViewWriter::create(&config(&view_path.0, 1)).unwrap();
        let entry = l1_entry();
        let keys: Vec<BlockKey> = (1..=6).map(key).collect();
        for key in &keys[..2] {
            mirror.upsert(key, &entry).unwrap();
        }
        for key in &keys[..4] {
            view.set(key, NodeId(2), Some(Tier::L2Nvme), ObjectKind::KvBlock).unwrap();
        }
        view.set(&keys[5], NodeId(2), Some(Tier::L1Dram), ObjectKind::KvBlock).unwrap();
        let reader = MirrorReader::attach(&mirror_path.0).unwrap();
        let view_reader = ViewReader::attach(&view_path.0).unwrap();
        let mut out = Vec::new();
        assert_eq!(lookup(&reader, Some(&view_reader), &keys, &mut out), 4, "key 5 is held nowhere");
        let remote = Where::Remote(Holder { node: NodeId(2), tier: Tier::L2Nvme });
        assert_eq!(out, vec![Where::Local(entry), Where::Local(entry), remote, remote]);
        assert_eq!(lookup(&reader, None, &keys, &mut out), 2, "without a view: this node's only");
    }

    #[test]
    fn a_pull_wait_asks_again_for_a_block_that_moved_and_ends_the_prefix_at_one_gone_a_while() {
        let entry = l1_entry();
        let on = |node| Where::Remote(Holder { node: NodeId(node), tier: Tier::L1Dram });
        let keys: Vec<BlockKey> = (1..=4).map(key).collect();
        let mut wait = PullWait::new(&keys, std::time::Duration::from_secs(10));
        let mut places = Vec::new();
        // The view, as the wait reads it in turn.
        let answer = |places: Vec<Where>| {
            move |keys: &[BlockKey], out: &mut Vec<Where>| {
                *out = places.into_iter().take(keys.len()).collect();
                out.len()
            }
        };
        // The front here, the rest on node 2: three held anywhere.
        let pulls = wait.look(&keys, answer(vec![Where::Local(entry), on(2), on(2)]), &mut places);
        assert_eq!(pulls, vec![(keys[1], on_holder(2)), (keys[2], on_holder(2))]);
        wait.asked(&pulls);
        assert_eq!(wait.found(), 3);
        assert!(!wait.over(1));
        // Read again only once the time comes.
        assert!(wait.look(&keys, answer(vec![]), &mut places).is_empty());
        std::thread::sleep(VIEW_AGAIN);
        // The front moved to node 3: asked there; the asked ones not again.
        let pulls = wait.look(&keys, answer(vec![on(3), on(2), on(2)]), &mut places);
        assert_eq!(pulls, vec![(keys[0], on_holder(3))]);
        wait.asked(&pulls);
        // The last block is seen nowhere: moving, for a while.
        std::thread::sleep(VIEW_AGAIN);
        assert!(wait.look(&keys, answer(vec![on(3), on(2)]), &mut places).is_empty());
        assert_eq!(wait.found(), 3);
        assert!(!wait.over(2));
        // Then gone: the prefix ends before it, and two landed are all.
        std::thread::sleep(GONE_AFTER);
        assert!(wait.look(&keys, answer(vec![on(3), on(2)]), &mut places).is_empty());
        assert_eq!(wait.found(), 2);
        assert!(wait.over(2));
    }

    /// A block's entry in this node's L1.
    fn l1_entry() -> MirrorEntry {
        MirrorEntry {
            kind: ObjectKind::KvBlock,
            tier: Tier::L1Dram,
            tiers: 1 << Tier::L1Dram as u8,
            region: crate::model::replica::RegionId(0),
            epoch_tag: 1,
            slot: 4,
            generation: 2,
        }
    }

    fn on_holder(node: u32) -> Holder {
        Holder { node: NodeId(node), tier: Tier::L1Dram }
    }
}
