//! Eviction: which cached block goes when a tier is full. Only leaves of
//! the radix index are candidates (so the cached set stays prefix-closed
//! and shared prefixes outlive their tails), and never a block the current
//! request has touched.
//!
//! Policies keep their own bookkeeping beside the index and learn of every
//! insert, access and removal. [`Lru`] is the baseline. [`Lake`], the
//! default, runs three simple policies as shadow caches on the same
//! requests — [`Lru`], [`Credit`] (recency plus credit for proven reuse)
//! and [`TinyLfu`] (frequency admission) — and the tier follows whichever
//! is clearly ahead. Measured against LRU on public and generated traces
//! in `docs/controlplane.md`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use lake_dp::BlockKey;

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
    fn requested(&mut self, _keys: &[BlockKey]) {}
    /// Whether the new block `key` may replace `victim` (admission).
    /// Refusing keeps the victim cached (the policy re-queues it) and the
    /// new block out. The default admits everything.
    fn admit(&mut self, _index: &Index, _victim: BlockRef, _key: &BlockKey) -> bool {
        true
    }
    /// A request ended: `hits` of its blocks were a cached prefix.
    fn finished(&mut self, _hits: usize) {}
    /// `block` is about to be evicted.
    fn evicting(&mut self, _index: &Index, _block: BlockRef) {}
    /// What the policy has learnt, for reports (empty if nothing).
    fn summary(&self) -> String {
        String::new()
    }
    /// Whether the policy would have let the new block `key` in (a tier
    /// that takes every block asks, to put those it would not have first
    /// in line). The default keeps everything.
    fn keeps(&self, _key: &BlockKey) -> bool {
        true
    }
}

impl<P: Policy + ?Sized> Policy for Box<P> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        (**self).inserted(index, block);
    }
    fn accessed(&mut self, index: &Index, block: BlockRef) {
        (**self).accessed(index, block);
    }
    fn became_leaf(&mut self, index: &Index, block: BlockRef) {
        (**self).became_leaf(index, block);
    }
    fn victim(&mut self, index: &Index) -> Option<BlockRef> {
        (**self).victim(index)
    }
    fn requested(&mut self, keys: &[BlockKey]) {
        (**self).requested(keys);
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &BlockKey) -> bool {
        (**self).admit(index, victim, key)
    }
    fn finished(&mut self, hits: usize) {
        (**self).finished(hits);
    }
    fn evicting(&mut self, index: &Index, block: BlockRef) {
        (**self).evicting(index, block);
    }
    fn summary(&self) -> String {
        (**self).summary()
    }
    fn keeps(&self, key: &BlockKey) -> bool {
        (**self).keeps(key)
    }
}

/// Entries of a lazy priority queue: (priority, block, the block's access
/// time when pushed). Stale entries (the block was touched since, or is
/// gone) are skipped when popped.
type Queue = BinaryHeap<Reverse<(u64, u32, u32)>>;

/// Drops the stale entries of `queue` once they far outnumber the live
/// blocks. Every access pushes an entry and only a victim search pops the
/// stale ones, so a tier that seldom evicts (an L3 larger than what is
/// stored, a shadow cache of that size) grew its queue with every access,
/// for ever. Amortized: a rebuild at most every `len + 1024` pushes.
fn compact(queue: &mut Queue, index: &Index) {
    if queue.len() > 2 * index.len() + 1024 {
        queue.retain(|&Reverse((_, raw, touched))| {
            let block = BlockRef(raw);
            index.is_live(block) && index.touched(block) == touched
        });
    }
}

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
    /// Entries in its queue (live and stale).
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    fn push(&mut self, index: &Index, block: BlockRef) {
        let touched = index.touched(block);
        self.queue.push(Reverse((u64::from(touched), block.0, touched)));
        compact(&mut self.queue, index);
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

/// Recency weighted by proven reuse, with admission and a memory of
/// evicted blocks.
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
pub struct Credit {
    queue: Queue,
    stash: Vec<Reverse<(u64, u32, u32)>>,
    /// Extra life (in requests) per doubling of a block's reuses.
    pub credit_per_doubling: u64,
    ghosts: HashMap<u64, u32>,
    ghost_order: VecDeque<u64>,
    ghosts_max: usize,
}

fn ghost_id(key: &BlockKey) -> u64 {
    u64::from_le_bytes([key.0[0], key.0[1], key.0[2], key.0[3], key.0[4], key.0[5], key.0[6], key.0[7]])
}

impl Credit {
    /// For a tier of `capacity` blocks.
    pub fn new(capacity: usize, credit_per_doubling: u64) -> Self {
        Self {
            queue: Queue::new(),
            stash: Vec::new(),
            credit_per_doubling,
            ghosts: HashMap::with_capacity(capacity),
            ghost_order: VecDeque::with_capacity(capacity),
            ghosts_max: capacity.max(1),
        }
    }

    /// Entries in its queue (live and stale).
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    fn priority(&self, index: &Index, block: BlockRef) -> u64 {
        let reuse = index.hits(block).saturating_sub(1);
        let credit = u64::from(u32::BITS - reuse.leading_zeros()) * self.credit_per_doubling;
        u64::from(index.touched(block)) + credit
    }

    fn push(&mut self, index: &Index, block: BlockRef) {
        let priority = self.priority(index, block);
        self.queue.push(Reverse((priority, block.0, index.touched(block))));
        compact(&mut self.queue, index);
    }
}

impl Policy for Credit {
    fn name(&self) -> &'static str {
        "credit"
    }
    fn inserted(&mut self, index: &mut Index, block: BlockRef) {
        if let Some(hits) = self.ghosts.remove(&ghost_id(&index.key(block))) {
            // Its earlier accesses, plus this one.
            index.set_hits(block, hits.saturating_add(1));
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
    fn admit(&mut self, index: &Index, victim: BlockRef, _key: &BlockKey) -> bool {
        // A new block's priority is now (no credit): it may replace only
        // a block whose credit has run out.
        if self.priority(index, victim) <= u64::from(index.now()) {
            return true;
        }
        self.push(index, victim);
        false
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

    fn slots(&self, key: &BlockKey) -> [usize; 4] {
        let mut out = [0; 4];
        for (row, slot) in out.iter_mut().enumerate() {
            let bytes = &key.0[row * 4..row * 4 + 4];
            *slot = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize & self.mask;
        }
        out
    }

    /// Counts one access.
    pub fn add(&mut self, key: &BlockKey) {
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
    pub fn estimate(&self, key: &BlockKey) -> u8 {
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
    fn requested(&mut self, keys: &[BlockKey]) {
        for key in keys {
            self.sketch.add(key);
        }
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &BlockKey) -> bool {
        if self.sketch.estimate(key) > self.sketch.estimate(&index.key(victim)) {
            return true;
        }
        self.lru.became_leaf(index, victim);
        false
    }
}

/// The expert a [`Lake`] tier follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expert {
    /// [`Lru`].
    Recency,
    /// [`Credit`].
    Credit,
    /// [`TinyLfu`].
    Frequency,
}

impl Expert {
    const ALL: [Expert; 3] = [Expert::Recency, Expert::Credit, Expert::Frequency];
}

/// The default: LRU unless another simple policy is clearly doing better
/// on this load.
///
/// Three shadow caches of the tier's size (index only, no data) see every
/// request: [`Lru`], [`Credit`] and [`TinyLfu`]. Each scores its hits,
/// decayed by `1 / memory` per request. The tier follows LRU unless the
/// best challenger's score beats LRU's by `1 / margin`; a near tie keeps
/// LRU. Following an expert means the tier orders its leaves as that
/// expert does, keeps a new block only if that expert's shadow kept it,
/// and evicts first what that shadow has evicted — so the tier converges
/// on the followed shadow's contents instead of mixing behaviours. A
/// shadow's lead comes from contents the tier may not have, so the tier
/// also scores its own hits: following a challenger that leaves the tier
/// behind the LRU shadow (by `1 / guard`) sends it back to LRU for a while.
///
/// Why these three: LRU is right when reuse comes soon; credit keeps what
/// is reused again and again (turns of long sessions) when the tier is a
/// few percent of the working set; frequency admission holds a fixed set
/// long enough to be reused when reuse gaps are far longer than the tier's
/// reach (at 1% of a chat trace). No one of them wins everywhere.
///
/// Cost: three shadow indexes of the tier's size (about 3 × 80 bytes per
/// tier block here); sampling the shadows is future work.
#[derive(Debug)]
pub struct Lake {
    main: Credit,
    expert: Expert,
    capacity: u64,
    recency: Box<Cache<Lru>>,
    credit: Box<Cache<Credit>>,
    frequency: Box<Cache<TinyLfu>>,
    scores: [u64; 3],
    /// A challenger must beat LRU by `1 / margin` of LRU's score.
    pub margin: u64,
    /// Scores decay by `1 / memory` per request.
    pub memory: u64,
    /// While following a challenger, falling behind the LRU shadow by
    /// `1 / guard` of its score sends the tier back to LRU for `memory`
    /// requests.
    pub guard: u64,
    /// Requests each expert was followed for.
    pub followed: [u64; 3],
    /// Hits of each shadow so far.
    pub shadow_hits: [u64; 3],
    requests: u64,
    blocks: u64,
    /// Keys the followed shadow evicted: the tier evicts them first.
    doomed: VecDeque<BlockKey>,
    /// The tier's own hits, decayed as the scores.
    own: u64,
    /// Requests left in which the tier follows LRU whatever the scores.
    cooldown: u64,
    /// Times the tier fell behind the LRU shadow and went back to LRU.
    pub backoffs: u64,
}

impl Lake {
    /// For a tier of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        let mut recency = Box::new(Cache::new(capacity, Lru::default()));
        let mut credit = Box::new(Cache::new(capacity, Credit::new(capacity, 0)));
        let mut frequency = Box::new(Cache::new(capacity, TinyLfu::new(capacity)));
        recency.log_evictions = true;
        credit.log_evictions = true;
        frequency.log_evictions = true;
        Self {
            main: Credit::new(capacity, 0),
            expert: Expert::Recency,
            capacity: capacity as u64,
            recency,
            credit,
            frequency,
            scores: [0; 3],
            margin: 10,
            memory: 1024,
            guard: 50,
            followed: [0; 3],
            shadow_hits: [0; 3],
            requests: 0,
            blocks: 0,
            doomed: VecDeque::new(),
            own: 0,
            cooldown: 0,
            backoffs: 0,
        }
    }

    /// Entries in its queues and its shadows' (live and stale).
    pub fn queued(&self) -> usize {
        self.main.queued() + self.recency.policy.queued() + self.credit.policy.queued()
    }

    /// The expert followed now.
    pub fn expert(&self) -> Expert {
        self.expert
    }

    fn followed_holds(&self, key: &BlockKey) -> bool {
        match self.expert {
            Expert::Recency => self.recency.index.contains(key),
            Expert::Credit => self.credit.index.contains(key),
            Expert::Frequency => self.frequency.index.contains(key),
        }
    }
}

impl Policy for Lake {
    fn name(&self) -> &'static str {
        "lake"
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
        // First what the followed shadow has let go of (while it still
        // has, the block is a leaf and not the current request's).
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
    fn requested(&mut self, keys: &[BlockKey]) {
        // Credit is one turnover of the tier per doubling of reuse: the
        // requests it takes to fill the tier, from the mean request seen.
        self.requests += 1;
        self.blocks += keys.len() as u64;
        let turnover = (self.capacity * self.requests / self.blocks.max(1)).max(1);
        self.credit.policy.credit_per_doubling = turnover;
        let hits =
            [self.recency.request(keys) as u64, self.credit.request(keys) as u64, self.frequency.request(keys) as u64];
        for ((score, total), hit) in self.scores.iter_mut().zip(&mut self.shadow_hits).zip(hits) {
            *score = *score - *score / self.memory + hit * 1024;
            *total += hit;
        }
        let bar = self.scores[0] + self.scores[0] / self.margin;
        let best = if self.scores[1] >= self.scores[2] { 1 } else { 2 };
        self.cooldown = self.cooldown.saturating_sub(1);
        self.expert = if self.scores[best] > bar && self.cooldown == 0 { Expert::ALL[best] } else { Expert::Recency };
        self.followed[self.expert as usize] += 1;
        self.main.credit_per_doubling = if self.expert == Expert::Credit { turnover } else { 0 };
        let log = match self.expert {
            Expert::Recency => &mut self.recency.evicted,
            Expert::Credit => &mut self.credit.evicted,
            Expert::Frequency => &mut self.frequency.evicted,
        };
        self.doomed.extend(log.drain(..));
        // Doomed keys the tier no longer holds are dropped as they are
        // met; bound the list so a long run of them cannot grow it.
        while self.doomed.len() as u64 > self.capacity {
            self.doomed.pop_front();
        }
    }
    fn admit(&mut self, index: &Index, victim: BlockRef, key: &BlockKey) -> bool {
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
    fn keeps(&self, key: &BlockKey) -> bool {
        // What the followed shadow let in.
        self.followed_holds(key)
    }
    fn finished(&mut self, hits: usize) {
        self.own = self.own - self.own / self.memory + hits as u64 * 1024;
        if self.expert != Expert::Recency && self.own < self.scores[0] - self.scores[0] / self.guard {
            // Following a challenger has not paid here: back to LRU for a
            // while (the tier converges on the LRU shadow meanwhile).
            self.backoffs += 1;
            self.cooldown = self.memory;
        }
    }
    fn summary(&self) -> String {
        format!("requests following recency/credit/frequency {:?}; shadow hits {:?}", self.followed, self.shadow_hits)
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
    /// Blocks evicted so far.
    pub evictions: u64,
    /// New blocks not cached (admission refused or nothing evictable).
    pub refused: u64,
    /// Keys evicted by the latest request, kept when `log_evictions`.
    pub evicted: Vec<BlockKey>,
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
            evictions: 0,
            refused: 0,
            evicted: Vec::new(),
            log_evictions: false,
        }
    }

    /// A cache for a live tier: it grows as blocks arrive (no capacity
    /// reserved up front) and holds what it is told; the tier manager
    /// decides when to take victims.
    pub fn live(policy: P) -> Self {
        Self {
            index: Index::default(),
            policy,
            capacity: usize::MAX,
            evictions: 0,
            refused: 0,
            evicted: Vec::new(),
            log_evictions: false,
        }
    }

    fn evict_one(&mut self, key: &BlockKey) -> bool {
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
    pub fn request(&mut self, keys: &[BlockKey]) -> usize {
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
        self.policy.finished(hit);
        hit
    }
}

/// What the live tier manager asks of a candidate victim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// It goes: removed from the cache and handed to the caller.
    Evict,
    /// It is already gone from the tier (a replica lost or evicted while it
    /// still had children here): removed from the cache, not handed out.
    Gone,
    /// It may not go now (a reader holds a lease): it counts as accessed
    /// and another is looked for.
    Keep,
}

/// The live side of a cache: the tier manager learns of blocks as
/// `lake-dp` commits and evicts them, of accesses as agents report their
/// lookups, and asks for victims when the tier is over its capacity.
impl<P: Policy> Cache<P> {
    /// An agent's request: its keys in prefix order. Every key this cache
    /// holds counts as accessed; the policy sees the whole request.
    pub fn accessed(&mut self, keys: &[BlockKey]) {
        self.index.tick();
        self.policy.requested(keys);
        let mut leading = 0;
        let mut leading_run = true;
        for key in keys {
            match self.index.get(key) {
                Some(block) => {
                    self.index.touch(block);
                    self.policy.accessed(&self.index, block);
                    leading += usize::from(leading_run);
                }
                None => leading_run = false,
            }
        }
        self.policy.finished(leading);
    }

    /// A block arrived in the tier, under `parent` if the parent is here
    /// too (otherwise it starts a subtree of its own). Returns whether it
    /// is new to the cache; a block already here counts as accessed.
    pub fn add(&mut self, parent: Option<BlockKey>, key: BlockKey, kind: lake_dp::ObjectKind) -> bool {
        self.index.tick();
        if let Some(block) = self.index.get(&key) {
            self.index.touch(block);
            self.policy.accessed(&self.index, block);
            return false;
        }
        let parent = parent.filter(|p| self.index.contains(p));
        match self.index.insert(parent, key, kind) {
            Ok(block) => {
                self.index.touch(block);
                self.policy.inserted(&mut self.index, block);
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the policy would have let the new block `key` in (see
    /// [`Policy::keeps`]).
    pub fn keeps(&self, key: &BlockKey) -> bool {
        self.policy.keeps(key)
    }

    /// A block to go first (one the policy would not have let in, or a
    /// copy pulled in from another node): to the head of the line, as if
    /// long unused and never reused, before the blocks the policy wants.
    pub fn make_cold(&mut self, key: &BlockKey) {
        let Some(block) = self.index.get(key) else { return };
        self.index.set_touched(block, 0);
        self.index.set_hits(block, 0);
        if self.index.is_leaf(block) {
            self.policy.became_leaf(&self.index, block);
        }
    }

    /// A block left the tier. A leaf leaves the cache; a block with
    /// children here stays as their parent until they go (a victim then,
    /// which `take_victim`'s verdict finds gone). Returns whether it left.
    pub fn remove(&mut self, key: &BlockKey) -> bool {
        let Some(block) = self.index.get(key) else { return false };
        if !self.index.is_leaf(block) {
            return false;
        }
        self.remove_block(block)
    }

    fn remove_block(&mut self, block: BlockRef) -> bool {
        self.policy.evicting(&self.index, block);
        let parent = self.index.parent(block);
        if self.index.remove(block).is_err() {
            return false;
        }
        if let Some(parent) = parent
            && self.index.is_leaf(parent)
        {
            self.policy.became_leaf(&self.index, parent);
        }
        true
    }

    /// The policy's next victim that `verdict` lets go, removed from the
    /// cache; at most `tries` candidates are looked at.
    pub fn take_victim(&mut self, tries: usize, mut verdict: impl FnMut(&BlockKey) -> Verdict) -> Option<BlockKey> {
        for _ in 0..tries {
            // A fresh tick: blocks touched by the last request are
            // candidates too (the live tier has no request in progress).
            self.index.tick();
            let block = self.policy.victim(&self.index)?;
            let key = self.index.key(block);
            match verdict(&key) {
                Verdict::Evict => {
                    self.remove_block(block);
                    self.evictions += 1;
                    return Some(key);
                }
                Verdict::Gone => {
                    self.remove_block(block);
                }
                Verdict::Keep => {
                    self.index.touch(block);
                    self.policy.accessed(&self.index, block);
                }
            }
        }
        None
    }

    /// Whether the policy would let `key` in over its current victim
    /// (admission for a tier that is full). The victim stays.
    pub fn admits(&mut self, key: &BlockKey) -> bool {
        self.index.tick();
        let Some(victim) = self.policy.victim(&self.index) else { return true };
        let admitted = self.policy.admit(&self.index, victim, key);
        if admitted {
            // Not evicted after all: back in the policy's queue.
            self.policy.became_leaf(&self.index, victim);
        }
        admitted
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test sizes and seeds are small
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

    /// LRU over leaves, kept naively: the reference the real code must
    /// match request for request.
    struct Reference {
        capacity: usize,
        /// key -> (parent, last touch)
        blocks: HashMap<u64, (Option<u64>, u64)>,
        now: u64,
    }

    impl Reference {
        fn request(&mut self, ids: &[u64]) -> usize {
            self.now += 1;
            let hit = ids.iter().take_while(|id| self.blocks.contains_key(id)).count();
            for id in &ids[..hit] {
                self.blocks.get_mut(id).unwrap().1 = self.now;
            }
            for depth in hit..ids.len() {
                if self.blocks.len() >= self.capacity {
                    // The least recently touched leaf not touched now.
                    let victim = self
                        .blocks
                        .iter()
                        .filter(|(id, (_, t))| *t != self.now && !self.blocks.values().any(|(p, _)| p == &Some(**id)))
                        .min_by_key(|(_, (_, t))| *t)
                        .map(|(id, _)| *id);
                    let Some(victim) = victim else { break };
                    self.blocks.remove(&victim);
                }
                let parent = depth.checked_sub(1).map(|d| ids[d]);
                self.blocks.insert(ids[depth], (parent, self.now));
            }
            hit
        }
    }

    /// Requests over a random forest: paths that share prefixes, grow
    /// (turns), and come back.
    fn random_requests(seed: u64, count: usize) -> Vec<Vec<u64>> {
        let mut rng = lake_dp::rng::SimRng::new(seed);
        let mut paths: Vec<Vec<u64>> = Vec::new();
        let mut next = 1u64;
        let mut out = Vec::new();
        for _ in 0..count {
            let path = if paths.is_empty() || rng.below(3) == 0 {
                // A new path, branching off an old one's prefix or not.
                let mut path = match paths.len() {
                    0 => Vec::new(),
                    n => {
                        let base = &paths[rng.below(n as u64) as usize];
                        base[..rng.below(base.len() as u64 + 1) as usize].to_vec()
                    }
                };
                for _ in 0..1 + rng.below(6) {
                    path.push(next);
                    next += 1;
                }
                paths.push(path.clone());
                path
            } else {
                // An old path again, maybe one turn longer.
                let i = rng.below(paths.len() as u64) as usize;
                if rng.below(2) == 0 {
                    for _ in 0..1 + rng.below(3) {
                        paths[i].push(next);
                        next += 1;
                    }
                }
                paths[i].clone()
            };
            out.push(path);
        }
        out
    }

    #[test]
    fn lru_matches_a_naive_reference_request_for_request() {
        for seed in 0..20 {
            let capacity = 8 + seed as usize * 3;
            let mut cache = Cache::new(capacity, Lru::default());
            let mut reference = Reference { capacity, blocks: HashMap::new(), now: 0 };
            for (n, ids) in random_requests(seed, 400).iter().enumerate() {
                let expected = reference.request(ids);
                assert_eq!(cache.request(&keys(ids)), expected, "seed {seed} request {n}: {ids:?}");
                assert_eq!(cache.index.len(), reference.blocks.len(), "seed {seed} request {n}");
            }
        }
    }

    /// Every policy: the tier never holds more than its capacity, a hit is
    /// the longest cached prefix, and every cached block's prefix is cached.
    fn check_invariants<P: Policy>(make: impl Fn(usize) -> P) {
        for seed in 0..10 {
            let capacity = 10 + seed as usize * 5;
            let mut cache = Cache::new(capacity, make(capacity));
            let mut cached: HashMap<u64, Option<u64>> = HashMap::new();
            for ids in random_requests(seed + 100, 300) {
                let keyed = keys(&ids);
                let expected = cache.index.longest_prefix(&keyed);
                assert_eq!(cache.request(&keyed), expected);
                assert!(cache.index.len() <= capacity, "{} over capacity", cache.policy.name());
                for (depth, id) in ids.iter().enumerate() {
                    cached.insert(*id, depth.checked_sub(1).map(|d| ids[d]));
                }
                for (id, parent) in &cached {
                    if cache.index.contains(&key(*id))
                        && let Some(parent) = parent
                    {
                        assert!(
                            cache.index.contains(&key(*parent)),
                            "{}: {id} cached without its prefix",
                            cache.policy.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_policy_keeps_capacity_and_prefix_closure() {
        check_invariants(|_| Lru::default());
        check_invariants(|c| Credit::new(c, 5));
        check_invariants(TinyLfu::new);
        check_invariants(Lake::new);
    }

    #[test]
    fn credit_keeps_reused_blocks_through_a_scan() {
        let mut lru = Cache::new(10, Lru::default());
        let mut credit = Cache::new(10, Credit::new(10, 50));
        let hot: Vec<u64> = (1..=5).collect();
        let mut next = 100;
        let (mut lru_hits, mut credit_hits) = (0, 0);
        for round in 0..50 {
            if round % 2 == 0 {
                lru_hits += lru.request(&keys(&hot));
                credit_hits += credit.request(&keys(&hot));
            } else {
                // A one-off scan of 8 blocks.
                let scan: Vec<u64> = (next..next + 8).collect();
                next += 8;
                lru_hits += lru.request(&keys(&scan));
                credit_hits += credit.request(&keys(&scan));
            }
        }
        assert!(credit_hits > 2 * lru_hits, "credit {credit_hits} vs lru {lru_hits}");
        // The first scan costs the hot prompt its uncredited tail (3
        // blocks); from then on every hot request hits fully.
        assert_eq!(credit_hits, 5 * 24 - 3);
    }

    /// Sessions of a shared prompt and a few turns, each turn coming back
    /// `gap` requests later (other sessions in between).
    fn sessions(seed: u64, count: usize, gap: usize) -> Vec<Vec<u64>> {
        let mut rng = lake_dp::rng::SimRng::new(seed);
        let mut next = 1000u64;
        let mut out: Vec<Vec<u64>> = Vec::new();
        let mut pending: Vec<(usize, Vec<u64>)> = Vec::new();
        for n in 0..count {
            let path = if let Some(at) = pending.iter().position(|(due, _)| *due <= n) {
                let (_, mut path) = pending.swap_remove(at);
                path.extend([next, next + 1]);
                next += 2;
                path
            } else {
                let path = vec![1, next, next + 1, next + 2];
                next += 3;
                path
            };
            out.push(path.clone());
            if rng.below(2) == 0 {
                pending.push((n + gap, path));
            }
        }
        out
    }

    fn replay<P: Policy>(requests: &[Vec<u64>], cache: &mut Cache<P>) -> usize {
        requests.iter().map(|ids| cache.request(&keys(ids))).sum()
    }

    #[test]
    fn lake_follows_lru_where_recency_wins_and_frequency_where_reuse_is_far() {
        // Turns come back soon: LRU keeps them and so does Lake.
        let near = sessions(7, 4000, 5);
        let lru = replay(&near, &mut Cache::new(100, Lru::default()));
        let mut lake = Cache::new(100, Lake::new(100));
        let lake_hits = replay(&near, &mut lake);
        assert!(lake_hits * 100 >= lru * 99, "near: lake {lake_hits} vs lru {lru}");
        let followed = lake.policy.followed;
        assert!(followed[0] > followed[1] + followed[2], "{}", lake.policy.summary());
        // Ten regular sessions come back every 20 requests, one-offs in
        // between: more blocks pass between two visits than the tier
        // holds, so LRU keeps no regular; frequency admission keeps them.
        let mut far = Vec::new();
        for n in 0..4000u64 {
            let (first, len) = if n % 2 == 0 { (10 + (n / 2 % 10) * 10, 5) } else { (1000 + n * 10, 10) };
            far.push([1].into_iter().chain(first..first + len).collect::<Vec<u64>>());
        }
        let lru = replay(&far, &mut Cache::new(100, Lru::default()));
        let mut lake = Cache::new(100, Lake::new(100));
        let lake_hits = replay(&far, &mut lake);
        assert!(lake_hits >= 2 * lru, "far: lake {lake_hits} vs lru {lru}: {}", lake.policy.summary());
        assert_ne!(lake.policy.expert(), Expert::Recency, "{}", lake.policy.summary());
    }

    #[test]
    fn a_cache_that_never_evicts_keeps_its_queue_bounded() {
        // Room for everything: no victim search ever pops the queue; the
        // same 64 blocks accessed 20,000 times.
        let blocks: Vec<BlockKey> = (1..=64u64).map(key).collect();
        let mut lru = Cache::live(Lru::default());
        let mut lake = Cache::live(Lake::new(4096));
        for k in &blocks {
            lru.add(None, *k, lake_dp::ObjectKind::KvBlock);
            lake.add(None, *k, lake_dp::ObjectKind::KvBlock);
        }
        for _ in 0..20_000 {
            lru.accessed(&blocks);
            lake.accessed(&blocks);
        }
        // Without compaction: 1.28M entries each.
        assert!(lru.policy.queued() <= 2 * 64 + 1024 + 1, "lru: {} entries for 64 blocks", lru.policy.queued());
        assert!(lake.policy.queued() <= 3 * (2 * 64 + 1025), "lake: {} entries for 64 blocks", lake.policy.queued());
    }

    #[test]
    fn a_block_made_cold_is_the_next_victim_and_its_prefix_stays() {
        let kind = lake_dp::ObjectKind::KvBlock;
        let mut cache = Cache::live(Lru::default());
        // A chain 1 -> 2, then 3 and 4 on their own, oldest first.
        cache.add(None, key(1), kind);
        cache.add(Some(key(1)), key(2), kind);
        cache.add(None, key(3), kind);
        cache.add(None, key(4), kind);
        cache.make_cold(&key(4));
        cache.make_cold(&key(1));
        let evict = |_: &BlockKey| Verdict::Evict;
        // 4 first, though the newest; 1 is no leaf while 2 is there.
        assert_eq!(cache.take_victim(8, evict), Some(key(4)));
        assert_eq!(cache.take_victim(8, evict), Some(key(2)));
        assert_eq!(cache.take_victim(8, evict), Some(key(1)));
        assert_eq!(cache.take_victim(8, evict), Some(key(3)));
    }
}
