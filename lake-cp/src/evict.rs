//! Eviction: which cached block goes when a tier is full. Only leaves of
//! the radix index are candidates (so the cached set stays prefix-closed
//! and shared prefixes outlive their tails), and never a block the current
//! request has touched.
//!
//! Policies keep their own bookkeeping beside the index and learn of every
//! insert, access and removal. [`Lru`] is the baseline; [`Lake`] is the
//! default (see its docs).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use crate::index::{BlockRef, Index};

/// An eviction policy over one index.
pub trait Policy {
    /// A short name for reports.
    fn name(&self) -> &'static str;
    /// A block was inserted (it is a leaf, touched once).
    fn inserted(&mut self, index: &mut Index, block: BlockRef);
    /// A cached block was accessed (the index already counted it).
    fn accessed(&mut self, index: &Index, block: BlockRef);
    /// A block became a leaf again (its last child was removed).
    fn became_leaf(&mut self, index: &Index, block: BlockRef);
    /// The next leaf to evict, not touched at `index.now()`; `None` if
    /// nothing may go.
    fn victim(&mut self, index: &Index) -> Option<BlockRef>;
    /// A request arrived for these blocks (hits and misses alike), before
    /// any of them is touched or inserted.
    fn requested(&mut self, _keys: &[lake_dp::BlockKey]) {}
    /// Whether the new block `key` may replace `victim` (admission).
    /// Refusing keeps the victim cached (the policy re-queues it) and the
    /// new block out. The default admits everything.
    fn admit(&mut self, _index: &Index, _victim: BlockRef, _key: &lake_dp::BlockKey) -> bool {
        true
    }
    /// `block` is about to be evicted.
    fn evicting(&mut self, _index: &Index, _block: BlockRef) {}
    /// A request finished: `hits` of its `blocks` were a cached prefix.
    fn finished(&mut self, _hits: usize, _blocks: usize) {}
    /// What the policy has learnt, for reports (empty if nothing).
    fn summary(&self) -> String {
        String::new()
    }
}

/// Entries of a lazy priority queue: (priority, block, the block's access
/// time when pushed). Stale entries (the block was touched since, or is
/// gone) are skipped when popped.
type Queue = BinaryHeap<Reverse<(u64, u32, u32)>>;

/// Pops the lowest-priority live, evictable leaf whose entry is current.
fn pop_victim(queue: &mut Queue, index: &Index, stash: &mut Vec<Reverse<(u64, u32, u32)>>) -> Option<BlockRef> {
    let now = index.now();
    let mut found = None;
    while let Some(entry) = queue.pop() {
        let Reverse((_, raw, touched)) = entry;
        let block = BlockRef(raw);
        if !index.is_live(block) || index.touched(block) != touched {
            continue; // stale: a newer entry exists, or the block is gone
        }
        if !index.is_leaf(block) {
            continue; // re-queued by became_leaf when its children go
        }
        if touched == now {
            stash.push(entry); // the current request's: keep, not now
            continue;
        }
        found = Some(block);
        break;
    }
    queue.extend(stash.drain(..));
    found
}

/// Least recently used leaf first.
#[derive(Debug, Default)]
pub struct Lru {
    queue: Queue,
    stash: Vec<Reverse<(u64, u32, u32)>>,
}

impl Lru {
    fn push(&mut self, index: &Index, block: BlockRef) {
        let touched = index.touched(block);
        self.queue.push(Reverse((u64::from(touched), block.0, touched)));
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        self.push(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        self.push(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        self.push(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        pop_victim(&mut self.queue, index, &mut self.stash)
    }
}

/// The default: recency weighted by proven reuse, with admission and a
/// memory of evicted blocks.
///
/// - A block's priority is its last access time plus a credit that grows
///   with the log of its reuses: `credit_per_doubling` requests of extra
///   life per doubling. A shared system prompt or a session that keeps
///   coming back outlives one-off tails; a block never reused carries no
///   credit.
/// - Admission: a new block (no credit yet) does not replace a block whose
///   priority is still ahead of now — it is not cached, and the tail of a
///   one-off scan stops there instead of flushing the tier.
/// - Ghosts: the reuse counts of recently evicted blocks are remembered (as
///   many as the tier holds blocks); a block that comes back gets its count
///   back, so reuse at a distance longer than the tier's reach is learnt.
#[derive(Debug)]
pub struct Lake {
    queue: Queue,
    stash: Vec<Reverse<(u64, u32, u32)>>,
    /// Extra life (in requests) per doubling of a block's reuses.
    pub credit_per_doubling: u64,
    /// Life (in requests) every block is held before a new block may
    /// replace it.
    pub hold: u64,
    /// Whether a block that extends a leaf inherits its reuse count.
    pub inherit: bool,
    ghosts: HashMap<u64, u32>,
    ghost_order: VecDeque<u64>,
    ghosts_max: usize,
    /// Hill climbing on the credit: hits and blocks of the current epoch,
    /// the previous epoch's hit ratio, the direction of the last step.
    adapt: Option<Climb>,
}

/// Hill-climbing state (see [`Lake::adaptive`]).
#[derive(Debug, Clone, Copy)]
struct Climb {
    epoch_blocks: usize,
    hits: usize,
    blocks: usize,
    previous: i64,
    up: bool,
    min: u64,
    max: u64,
}

fn ghost_id(key: &lake_dp::BlockKey) -> u64 {
    u64::from_le_bytes([key.0[0], key.0[1], key.0[2], key.0[3], key.0[4], key.0[5], key.0[6], key.0[7]])
}

impl Lake {
    /// The default policy for a tier of `capacity` blocks.
    pub fn new(capacity: usize, credit_per_doubling: u64) -> Self {
        Self {
            queue: Queue::new(),
            stash: Vec::new(),
            credit_per_doubling,
            hold: 0,
            inherit: false,
            ghosts: HashMap::with_capacity(capacity),
            ghost_order: VecDeque::with_capacity(capacity),
            ghosts_max: capacity.max(1),
            adapt: None,
        }
    }

    /// The default policy whose credit adapts: every epoch of `capacity`
    /// × 8 requested blocks the credit moves by a factor of two in the
    /// direction that last raised the hit ratio (and turns when it fell),
    /// within [`start / 16`, `start × 64`].
    pub fn adaptive(capacity: usize, start: u64) -> Self {
        let mut lake = Self::new(capacity, start);
        lake.adapt = Some(Climb {
            epoch_blocks: capacity.max(64) * 8,
            hits: 0,
            blocks: 0,
            previous: -1,
            up: true,
            min: (start / 16).max(1),
            max: start.saturating_mul(64),
        });
        lake
    }

    fn priority(&self, index: &Index, block: BlockRef) -> u64 {
        let reuse = index.hits(block).saturating_sub(1);
        let credit = u64::from(u32::BITS - reuse.leading_zeros()) * self.credit_per_doubling;
        u64::from(index.touched(block)) + credit + self.hold
    }

    fn push(&mut self, index: &Index, block: BlockRef) {
        let priority = self.priority(index, block);
        self.queue.push(Reverse((priority, block.0, index.touched(block))));
    }
}

impl Policy for Lake {
    fn name(&self) -> &'static str {
        "lake"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        if let Some(hits) = self.ghosts.remove(&ghost_id(&index.key(block))) {
            // Its earlier accesses, plus this one.
            index.set_hits(block, hits.saturating_add(1));
        }
        if self.inherit
            && let Some(parent) = index.parent(block)
            && index.children(parent) == 1
            && index.touched(parent) == index.now()
        {
            // A continuation of a path (the next turn of a conversation):
            // its new blocks are worth what the path has proven.
            let inherited = index.hits(parent).max(index.hits(block));
            index.set_hits(block, inherited);
        }
        self.push(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        self.push(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        self.push(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        pop_victim(&mut self.queue, index, &mut self.stash)
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, _key: &lake_dp::BlockKey) -> bool {
        // A new block's priority is now (no credit): it may replace only
        // a block whose credit has run out.
        if self.priority(index, victim) <= u64::from(index.now()) {
            return true;
        }
        self.push(index, victim);
        false
    }
    fn finished(&mut self, hits: usize, blocks: usize) {
        let Some(climb) = &mut self.adapt else { return };
        climb.hits += hits;
        climb.blocks += blocks;
        if climb.blocks < climb.epoch_blocks {
            return;
        }
        // Parts per million: integer arithmetic, no float casts.
        let ratio = i64::try_from(climb.hits as u64 * 1_000_000 / climb.blocks as u64).unwrap_or(i64::MAX);
        if ratio < climb.previous {
            climb.up = !climb.up;
        }
        climb.previous = ratio;
        climb.hits = 0;
        climb.blocks = 0;
        self.credit_per_doubling = if climb.up {
            self.credit_per_doubling.saturating_mul(2).min(climb.max)
        } else {
            (self.credit_per_doubling / 2).max(climb.min)
        };
    }
    fn evicting(&mut self, index: &Index, block: BlockRef) {
        let id = ghost_id(&index.key(block));
        if self.ghost_order.len() >= self.ghosts_max
            && let Some(old) = self.ghost_order.pop_front()
        {
            self.ghosts.remove(&old);
        }
        self.ghosts.insert(id, index.hits(block));
        self.ghost_order.push_back(id);
    }
}

/// A count-min sketch of access frequencies with 4-bit counters, halved
/// every `sample` increments so old popularity fades (TinyLFU).
#[derive(Debug)]
pub struct Sketch {
    counters: Vec<u8>,
    mask: usize,
    added: usize,
    sample: usize,
}

impl Sketch {
    /// A sketch for a cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        let width = (capacity.max(16) * 4).next_power_of_two();
        Self { counters: vec![0; width], mask: width - 1, added: 0, sample: capacity.max(16) * 10 }
    }

    fn slots(&self, key: &lake_dp::BlockKey) -> [usize; 4] {
        let mut out = [0; 4];
        for (row, slot) in out.iter_mut().enumerate() {
            let bytes = &key.0[row * 4..row * 4 + 4];
            *slot = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize & self.mask;
        }
        out
    }

    /// Counts one access.
    pub fn add(&mut self, key: &lake_dp::BlockKey) {
        let slots = self.slots(key);
        let least = slots.iter().map(|&s| self.counters[s]).min().unwrap_or(0);
        if least < 15 {
            for s in slots {
                if self.counters[s] == least {
                    self.counters[s] += 1;
                }
            }
        }
        self.added += 1;
        if self.added >= self.sample {
            for c in &mut self.counters {
                *c /= 2;
            }
            self.added /= 2;
        }
    }

    /// The estimated access count.
    pub fn estimate(&self, key: &lake_dp::BlockKey) -> u8 {
        self.slots(key).iter().map(|&s| self.counters[s]).min().unwrap_or(0)
    }
}

/// LRU eviction with TinyLFU admission: a new block replaces the LRU leaf
/// only if it has been requested more often (by the sketch) than that
/// leaf.
#[derive(Debug)]
pub struct TinyLfu {
    lru: Lru,
    sketch: Sketch,
}

impl TinyLfu {
    /// For a tier of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self { lru: Lru::default(), sketch: Sketch::new(capacity) }
    }
}

impl Policy for TinyLfu {
    fn name(&self) -> &'static str {
        "tinylfu"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        self.lru.inserted(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        self.lru.accessed(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        self.lru.became_leaf(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        self.lru.victim(index)
    }
    fn requested(&mut self, keys: &[lake_dp::BlockKey]) {
        for key in keys {
            self.sketch.add(key);
        }
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &lake_dp::BlockKey) -> bool {
        if self.sketch.estimate(key) > self.sketch.estimate(&index.key(victim)) {
            return true;
        }
        self.lru.became_leaf(index, victim);
        false
    }
}

/// W-TinyLFU under the leaf-first rule, with a window that adapts.
///
/// New blocks enter a window (recency gets its chance); when the window
/// is over its share, its least recent block leaves it: a block that is a
/// prefix of others simply joins the main area (it cannot go), a leaf
/// competes with the main area's least recent leaf and the one requested
/// more often (by the sketch) stays. The window's share is hill-climbed
/// on the hit ratio (as Caffeine does): it grows while growing helps, so a
/// recency-friendly load ends near LRU and a frequency-friendly one near
/// TinyLFU.
#[derive(Debug)]
pub struct WTinyLfu {
    /// Every window block by recency (not only leaves).
    window: Queue,
    main: Lru,
    stash: Vec<Reverse<(u64, u32, u32)>>,
    in_window: Vec<bool>,
    window_len: usize,
    window_max: usize,
    capacity: usize,
    sketch: Sketch,
    climb: Option<WindowClimb>,
}

/// Hill-climbing state of the window share.
#[derive(Debug, Clone, Copy)]
struct WindowClimb {
    sample: usize,
    hits: usize,
    blocks: usize,
    /// Hit ratio of the previous sample, parts per million (-1: none yet).
    previous: i64,
    /// Blocks the next step moves the window by (the sign is the direction).
    step: i64,
    initial_step: i64,
}

impl WTinyLfu {
    /// For a tier of `capacity` blocks, `window_percent` of it the window
    /// (fixed).
    pub fn new(capacity: usize, window_percent: usize) -> Self {
        Self {
            window: Queue::new(),
            main: Lru::default(),
            stash: Vec::new(),
            in_window: Vec::new(),
            window_len: 0,
            window_max: (capacity * window_percent / 100).max(1),
            capacity,
            sketch: Sketch::new(capacity),
            climb: None,
        }
    }

    /// The window starts at `window_percent` and climbs: every `sample`
    /// requested blocks ×`capacity`, the share moves by a step (first
    /// 1/16 of the tier, decaying) in the direction that last helped.
    pub fn adaptive(capacity: usize, window_percent: usize, sample: usize) -> Self {
        let mut policy = Self::new(capacity, window_percent);
        let initial_step = (capacity as i64 / 16).max(1);
        policy.climb = Some(WindowClimb {
            sample: capacity.max(64) * sample,
            hits: 0,
            blocks: 0,
            previous: -1,
            step: initial_step,
            initial_step,
        });
        policy
    }

    /// The window's share now, in blocks.
    pub fn window_max(&self) -> usize {
        self.window_max
    }

    fn is_window(&self, block: BlockRef) -> bool {
        self.in_window.get(block.0 as usize).copied().unwrap_or(false)
    }

    fn set_window(&mut self, block: BlockRef, window: bool) {
        let i = block.0 as usize;
        if self.in_window.len() <= i {
            self.in_window.resize(i + 1, false);
        }
        if self.in_window[i] != window {
            self.in_window[i] = window;
            if window {
                self.window_len += 1;
            } else {
                self.window_len -= 1;
            }
        }
    }

    fn push_window(&mut self, index: &Index, block: BlockRef) {
        let touched = index.touched(block);
        self.window.push(Reverse((u64::from(touched), block.0, touched)));
    }

    /// The window's least recent block (leaf or not), with a current entry.
    fn pop_window(&mut self, index: &Index) -> Option<BlockRef> {
        while let Some(Reverse((_, raw, touched))) = self.window.pop() {
            let block = BlockRef(raw);
            if index.is_live(block) && self.is_window(block) && index.touched(block) == touched {
                return Some(block);
            }
        }
        None
    }
}

impl Policy for WTinyLfu {
    fn name(&self) -> &'static str {
        "w-tinylfu"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        self.set_window(block, true);
        self.push_window(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        if self.is_window(block) {
            self.push_window(index, block);
        } else {
            self.main.accessed(index, block);
        }
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        if self.is_window(block) {
            self.push_window(index, block);
        } else {
            self.main.became_leaf(index, block);
        }
    }
    fn requested(&mut self, keys: &[lake_dp::BlockKey]) {
        for key in keys {
            self.sketch.add(key);
        }
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        let now = index.now();
        while self.window_len > self.window_max {
            let Some(candidate) = self.pop_window(index) else { break };
            if index.touched(candidate) == now {
                // The window holds only the current request: it overflows
                // into the main area's room this time.
                self.push_window(index, candidate);
                break;
            }
            if !index.is_leaf(candidate) {
                // A prefix of other blocks cannot go: it joins the main area.
                self.set_window(candidate, false);
                continue;
            }
            let Some(incumbent) = self.main.victim(index) else { return Some(candidate) };
            if self.sketch.estimate(&index.key(candidate)) > self.sketch.estimate(&index.key(incumbent)) {
                self.set_window(candidate, false);
                self.main.became_leaf(index, candidate);
                return Some(incumbent);
            }
            self.main.became_leaf(index, incumbent);
            return Some(candidate);
        }
        if let Some(block) = self.main.victim(index) {
            return Some(block);
        }
        // Nothing in the main area may go: the window's least recent leaf.
        loop {
            let candidate = self.pop_window(index)?;
            if index.is_leaf(candidate) && index.touched(candidate) != now {
                self.stash.clear();
                return Some(candidate);
            }
            if index.touched(candidate) == now {
                self.push_window(index, candidate);
                return None;
            }
            // An internal window block: re-queued when it becomes a leaf.
        }
    }
    fn evicting(&mut self, _index: &Index, block: BlockRef) {
        self.set_window(block, false);
    }
    fn finished(&mut self, hits: usize, blocks: usize) {
        let Some(climb) = &mut self.climb else { return };
        climb.hits += hits;
        climb.blocks += blocks;
        if climb.blocks < climb.sample {
            return;
        }
        let ratio = i64::try_from(climb.hits as u64 * 1_000_000 / climb.blocks as u64).unwrap_or(i64::MAX);
        climb.hits = 0;
        climb.blocks = 0;
        if climb.previous < 0 {
            climb.previous = ratio;
            return;
        }
        let delta = ratio - climb.previous;
        climb.previous = ratio;
        let amount = if delta >= 0 { climb.step } else { -climb.step };
        // A big change of load restarts the search with a full step.
        climb.step = if delta.abs() >= 50_000 { climb.initial_step * amount.signum() } else { amount * 98 / 100 };
        if climb.step == 0 {
            climb.step = amount.signum();
        }
        let capacity = self.capacity as i64;
        let next = (self.window_max as i64 + amount).clamp(1, capacity - 1);
        self.window_max = usize::try_from(next).unwrap_or(1);
    }
    fn summary(&self) -> String {
        format!("window {} of {} blocks", self.window_max, self.capacity)
    }
}

/// A block cache over the real index and a policy: what the trace replay
/// drives, and the shape the tier manager grows into.
#[derive(Debug)]
pub struct Cache<P: Policy> {
    /// The index.
    pub index: Index,
    /// The policy.
    pub policy: P,
    capacity: usize,
    chain: Vec<BlockRef>,
    /// Blocks evicted so far.
    pub evictions: u64,
    /// New blocks not cached (admission refused or nothing evictable).
    pub refused: u64,
    /// Keys evicted by the latest request, kept when `log_evictions`.
    pub evicted: Vec<lake_dp::BlockKey>,
    /// Whether to keep `evicted`.
    pub log_evictions: bool,
}

impl<P: Policy> Cache<P> {
    /// A cache of `capacity` blocks.
    pub fn new(capacity: usize, policy: P) -> Self {
        Self {
            index: Index::with_capacity(capacity),
            policy,
            capacity,
            chain: Vec::new(),
            evictions: 0,
            refused: 0,
            evicted: Vec::new(),
            log_evictions: false,
        }
    }

    fn evict_one(&mut self, key: &lake_dp::BlockKey) -> bool {
        let Some(victim) = self.policy.victim(&self.index) else { return false };
        if !self.policy.admit(&self.index, victim, key) {
            return false;
        }
        self.policy.evicting(&self.index, victim);
        if self.log_evictions {
            self.evicted.push(self.index.key(victim));
        }
        let parent = self.index.parent(victim);
        if self.index.remove(victim).is_err() {
            return false;
        }
        self.evictions += 1;
        if let Some(parent) = parent
            && self.index.is_leaf(parent)
        {
            self.policy.became_leaf(&self.index, parent);
        }
        true
    }

    /// One request: how many leading blocks of `keys` were cached (and are
    /// now touched); the rest are inserted as far as room allows.
    pub fn request(&mut self, keys: &[lake_dp::BlockKey]) -> usize {
        self.index.tick();
        self.evicted.clear();
        self.policy.requested(keys);
        let hit = self.index.longest_prefix(keys);
        for key in &keys[..hit] {
            if let Some(block) = self.index.get(key) {
                self.index.touch(block);
                self.policy.accessed(&self.index, block);
            }
        }
        let mut parent = hit.checked_sub(1).map(|i| keys[i]);
        for (depth, key) in keys.iter().enumerate().skip(hit) {
            if self.index.len() >= self.capacity && !self.evict_one(key) {
                self.refused += (keys.len() - depth) as u64;
                break;
            }
            match self.index.insert(parent, *key, lake_dp::ObjectKind::KvBlock) {
                Ok(block) => {
                    self.index.touch(block);
                    self.policy.inserted(&mut self.index, block);
                }
                Err(_) => {
                    self.refused += (keys.len() - depth) as u64;
                    break;
                }
            }
            parent = Some(*key);
        }
        self.chain.clear();
        self.policy.finished(hit, keys.len());
        hit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> lake_dp::BlockKey {
        let mut k = [0u8; 16];
        k[..8].copy_from_slice(&lake_dp::rng::SimRng::new(i).next_u64().to_le_bytes());
        k[8..].copy_from_slice(&i.to_le_bytes());
        lake_dp::BlockKey(k)
    }

    fn keys(ids: &[u64]) -> Vec<lake_dp::BlockKey> {
        ids.iter().map(|&i| key(i)).collect()
    }

    #[test]
    fn lru_evicts_the_oldest_leaf_and_never_a_prefix() {
        let mut cache = Cache::new(4, Lru::default());
        assert_eq!(cache.request(&keys(&[1, 2, 3])), 0);
        assert_eq!(cache.request(&keys(&[1, 2, 3])), 3);
        // [1, 9, 10]: needs 2 blocks, 1 free: evicts the oldest leaf (3),
        // never 1 or 2's prefix 1 (touched now) .
        assert_eq!(cache.request(&keys(&[1, 9, 10])), 1);
        assert_eq!(cache.index.len(), 4);
        assert!(!cache.index.contains(&key(3)));
        assert!(cache.index.contains(&key(2)));
        assert_eq!(cache.request(&keys(&[1, 2])), 2);
        assert_eq!(cache.evictions, 1);
    }

    #[test]
    fn a_request_larger_than_the_cache_keeps_its_prefix() {
        let mut cache = Cache::new(3, Lru::default());
        assert_eq!(cache.request(&keys(&[1, 2, 3, 4, 5])), 0);
        assert_eq!(cache.index.len(), 3, "only what fits");
        assert_eq!(cache.refused, 2);
        assert_eq!(cache.request(&keys(&[1, 2, 3, 4, 5])), 3);
    }

    #[test]
    fn lake_keeps_reused_blocks_through_a_scan() {
        let mut lru = Cache::new(10, Lru::default());
        let mut lake = Cache::new(10, Lake::new(10, 50));
        let hot: Vec<u64> = (1..=5).collect();
        let mut next = 100;
        let (mut lru_hits, mut lake_hits) = (0, 0);
        for round in 0..50 {
            if round % 2 == 0 {
                lru_hits += lru.request(&keys(&hot));
                lake_hits += lake.request(&keys(&hot));
            } else {
                // A one-off scan of 8 blocks.
                let scan: Vec<u64> = (next..next + 8).collect();
                next += 8;
                lru_hits += lru.request(&keys(&scan));
                lake_hits += lake.request(&keys(&scan));
            }
        }
        assert!(lake_hits > 2 * lru_hits, "lake {lake_hits} vs lru {lru_hits}");
        // The first scan costs the hot prompt its uncredited tail (3
        // blocks); from then on every hot request hits fully.
        assert_eq!(lake_hits, 5 * 24 - 3);
    }
}

/// Chooses between LRU and TinyLFU admission by running both, on the same
/// request stream, as shadow caches (index only, no data) and following
/// whichever served more hits recently. The main tier evicts LRU leaves and
/// admits by frequency only while the frequency shadow is ahead.
#[derive(Debug)]
pub struct Switching {
    lru: Lru,
    sketch: Sketch,
    by_frequency: bool,
    shadow_lru: Box<Cache<Lru>>,
    shadow_lfu: Box<Cache<TinyLfu>>,
    /// Exponentially decayed hits of each shadow.
    score_lru: u64,
    score_lfu: u64,
}

impl Switching {
    /// For a tier of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            lru: Lru::default(),
            sketch: Sketch::new(capacity),
            by_frequency: false,
            shadow_lru: Box::new(Cache::new(capacity, Lru::default())),
            shadow_lfu: Box::new(Cache::new(capacity, TinyLfu::new(capacity))),
            score_lru: 0,
            score_lfu: 0,
        }
    }

    /// Whether admission currently follows frequency.
    pub fn by_frequency(&self) -> bool {
        self.by_frequency
    }
}

impl Policy for Switching {
    fn name(&self) -> &'static str {
        "switching"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        self.lru.inserted(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        self.lru.accessed(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        self.lru.became_leaf(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        self.lru.victim(index)
    }
    fn requested(&mut self, keys: &[lake_dp::BlockKey]) {
        for key in keys {
            self.sketch.add(key);
        }
        let a = self.shadow_lru.request(keys) as u64;
        let b = self.shadow_lfu.request(keys) as u64;
        // Decay by 1/1024 per request: a memory of about a thousand requests.
        self.score_lru = self.score_lru - self.score_lru / 1024 + a * 1024;
        self.score_lfu = self.score_lfu - self.score_lfu / 1024 + b * 1024;
        // Follow frequency only while it is clearly ahead (by a quarter):
        // a near tie keeps plain LRU, which never refuses a new block.
        self.by_frequency = self.score_lfu > self.score_lru + self.score_lru / 4;
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &lake_dp::BlockKey) -> bool {
        if !self.by_frequency || self.sketch.estimate(key) > self.sketch.estimate(&index.key(victim)) {
            return true;
        }
        self.lru.became_leaf(index, victim);
        false
    }
}

/// Which expert the [`Experts`] policy follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expert {
    /// Plain LRU over leaves.
    Recency,
    /// Recency plus credit for proven reuse, with the credit's admission.
    Credit,
    /// LRU eviction, admission by frequency (TinyLFU).
    Frequency,
}

/// Follows whichever of three experts — LRU, reuse credit, frequency
/// admission — served the most hits recently, judged by shadow caches
/// that see the same requests.
#[derive(Debug)]
pub struct Experts {
    main: Lake,
    sketch: Sketch,
    expert: Expert,
    credit: u64,
    shadow_lru: Box<Cache<Lru>>,
    shadow_credit: Box<Cache<Lake>>,
    shadow_lfu: Box<Cache<TinyLfu>>,
    scores: [u64; 3],
    /// A challenger must beat LRU by `1 / margin` of LRU's score.
    pub margin: u64,
    /// Requests each expert was followed for.
    pub followed: [u64; 3],
    /// Scores decay by `1 / memory` per request.
    pub memory: u64,
    totals: [u64; 3],
    /// Keys the followed shadow evicted: the tier evicts them first.
    doomed: VecDeque<lake_dp::BlockKey>,
}

impl Experts {
    /// For a tier of `capacity` blocks; `credit` as [`Lake::new`].
    pub fn new(capacity: usize, credit: u64, margin: u64) -> Self {
        let mut shadow_lru = Box::new(Cache::new(capacity, Lru::default()));
        let mut shadow_credit = Box::new(Cache::new(capacity, Lake::new(capacity, credit)));
        let mut shadow_lfu = Box::new(Cache::new(capacity, TinyLfu::new(capacity)));
        shadow_lru.log_evictions = true;
        shadow_credit.log_evictions = true;
        shadow_lfu.log_evictions = true;
        Self {
            main: Lake::new(capacity, 0),
            sketch: Sketch::new(capacity),
            expert: Expert::Recency,
            credit,
            shadow_lru,
            shadow_credit,
            shadow_lfu,
            scores: [0; 3],
            margin,
            followed: [0; 3],
            memory: 1024,
            totals: [0; 3],
            doomed: VecDeque::new(),
        }
    }

    /// The expert followed now.
    pub fn expert(&self) -> Expert {
        self.expert
    }

    fn followed_holds(&self, key: &lake_dp::BlockKey) -> bool {
        match self.expert {
            Expert::Recency => self.shadow_lru.index.contains(key),
            Expert::Credit => self.shadow_credit.index.contains(key),
            Expert::Frequency => self.shadow_lfu.index.contains(key),
        }
    }
}

impl Policy for Experts {
    fn name(&self) -> &'static str {
        "experts"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        self.main.inserted(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        self.main.accessed(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        self.main.became_leaf(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        // First what the followed shadow has let go of (while it is still
        // let go of, is a leaf and is not the current request's).
        while let Some(key) = self.doomed.pop_front() {
            if let Some(block) = index.get(&key)
                && index.is_leaf(block)
                && index.touched(block) != index.now()
                && !self.followed_holds(&key)
            {
                return Some(block);
            }
        }
        self.main.victim(index)
    }
    fn requested(&mut self, keys: &[lake_dp::BlockKey]) {
        for key in keys {
            self.sketch.add(key);
        }
        let hits = [
            self.shadow_lru.request(keys) as u64,
            self.shadow_credit.request(keys) as u64,
            self.shadow_lfu.request(keys) as u64,
        ];
        let log = match self.expert {
            Expert::Recency => &mut self.shadow_lru.evicted,
            Expert::Credit => &mut self.shadow_credit.evicted,
            Expert::Frequency => &mut self.shadow_lfu.evicted,
        };
        self.doomed.extend(log.drain(..));
        for (total, hit) in self.totals.iter_mut().zip(hits) {
            *total += hit;
        }
        for (score, hit) in self.scores.iter_mut().zip(hits) {
            *score = *score - *score / self.memory + hit * 1024;
        }
        // LRU unless a challenger is clearly ahead of it, so noise does not
        // flip the tier between behaviours.
        let bar = self.scores[0] + self.scores[0] / self.margin;
        let best = if self.scores[1] >= self.scores[2] { 1 } else { 2 };
        self.expert = if self.scores[best] > bar {
            [Expert::Recency, Expert::Credit, Expert::Frequency][best]
        } else {
            Expert::Recency
        };
        self.followed[self.expert as usize] += 1;
        self.main.credit_per_doubling = if self.expert == Expert::Credit { self.credit } else { 0 };
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &lake_dp::BlockKey) -> bool {
        // The tier keeps a new block only if the followed shadow kept it.
        if self.followed_holds(key) {
            return true;
        }
        self.main.became_leaf(index, victim);
        false
    }
    fn evicting(&mut self, index: &Index, block: BlockRef) {
        self.main.evicting(index, block);
    }
    fn summary(&self) -> String {
        let totals = [self.totals[0], self.totals[1], self.totals[2]];
        format!("followed recency/credit/frequency {:?}, shadow hits {totals:?}", self.followed)
    }
}

/// Recency with a hold time that adapts: every block is held at least
/// `hold` requests before a new block may replace it (0: plain LRU; long:
/// the tier keeps what it has and admits new blocks only as old ones
/// expire, which bridges reuse gaps longer than the tier's reach). Shadow
/// caches run a ladder of hold times on the same requests; the tier moves
/// one rung at a time toward the rung that served the most hits lately.
#[derive(Debug)]
pub struct Ladder {
    main: Lake,
    rungs: Vec<u64>,
    shadows: Vec<Cache<Lake>>,
    scores: Vec<u64>,
    at: usize,
    /// Scores decay by `1 / memory` per request.
    pub memory: u64,
    /// Requests spent on each rung.
    pub followed: Vec<u64>,
    /// Requests since the last move.
    dwell: u64,
    /// Requests to stay on a rung before the next move.
    pub min_dwell: u64,
    oracle: u64,
}

impl Ladder {
    /// For a tier of `capacity` blocks turning over every `turnover`
    /// requests: rungs of 0, ½, 1, 2, 4, 8 turnovers; `credit` as [`Lake::new`].
    pub fn new(capacity: usize, turnover: u64, credit: u64) -> Self {
        let rungs: Vec<u64> = [0, turnover / 2, turnover, turnover * 2, turnover * 4, turnover * 8].into();
        let shadows = rungs
            .iter()
            .map(|&hold| {
                let mut lake = Lake::new(capacity, credit);
                lake.hold = hold;
                Cache::new(capacity, lake)
            })
            .collect();
        Self {
            main: Lake::new(capacity, credit),
            scores: vec![0; rungs.len()],
            followed: vec![0; rungs.len()],
            rungs,
            shadows,
            at: 0,
            memory: 1024,
            dwell: 0,
            min_dwell: turnover,
            oracle: 0,
        }
    }
}

impl Policy for Ladder {
    fn name(&self) -> &'static str {
        "ladder"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        self.main.inserted(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        self.main.accessed(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        self.main.became_leaf(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        self.main.victim(index)
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &lake_dp::BlockKey) -> bool {
        self.main.admit(index, victim, key)
    }
    fn evicting(&mut self, index: &Index, block: BlockRef) {
        self.main.evicting(index, block);
    }
    fn requested(&mut self, keys: &[lake_dp::BlockKey]) {
        for (i, (shadow, score)) in self.shadows.iter_mut().zip(&mut self.scores).enumerate() {
            let hit = shadow.request(keys) as u64;
            if i == self.at {
                self.oracle += hit;
            }
            *score = *score - *score / self.memory + hit * 1024;
        }
        self.dwell += 1;
        let best = (0..self.rungs.len()).max_by_key(|&i| (self.scores[i], std::cmp::Reverse(i))).unwrap_or(0);
        if self.dwell >= self.min_dwell && best != self.at {
            self.at = if best > self.at { self.at + 1 } else { self.at - 1 };
            self.main.hold = self.rungs[self.at];
            self.dwell = 0;
        }
        self.followed[self.at] += 1;
    }
    fn summary(&self) -> String {
        format!("rungs {:?}, requests per rung {:?}, followed shadow's hits {}", self.rungs, self.followed, self.oracle)
    }
}
