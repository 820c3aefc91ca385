//! The radix prefix index: every cached block of this node, as a tree of
//! chained block keys. A key names a whole prefix (DESIGN §3), so a block's
//! parent is the block before it in the prompt, and the tree is the radix
//! tree of all cached prompts with one node per block.
//!
//! Nodes live in one `Vec` with a free list, addressed by `u32` index; a
//! hash table maps a key to its node index, hashing with the key's own
//! bytes (a BLAKE3 output is already uniform). Removal is leaf-only, so
//! the cached set is always prefix-closed: a node's presence implies its
//! whole prefix is present. That is what lets [`Index::longest_prefix`]
//! binary-search a prompt's keys with a logarithmic number of probes.

use lake_dp::{BlockKey, ObjectKind};

use crate::table::{KeyTable, Probe};

/// A node's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockRef(pub u32);

const NONE: u32 = u32::MAX;

/// A replica as the index keeps it: 12 bytes. The region names tier,
/// node and region epoch (a region table holds those once per region).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loc {
    /// The region.
    pub region: u16,
    /// [`LocState`].
    pub state: LocState,
    /// The region epoch it was written under, as the location view's
    /// one-byte tag for that epoch.
    pub epoch_tag: u8,
    /// The slot in the region.
    pub slot: u32,
    /// The slot's generation when this replica was written.
    pub generation: u32,
}

/// Where a replica is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum LocState {
    /// Reserved; bytes being written. Not served.
    Writing = 1,
    /// Committed; served.
    Ready = 2,
    /// Being evicted; not served to new readers.
    Evicting = 3,
}

const LOC_EMPTY_REGION: u16 = u16::MAX;

impl Loc {
    const EMPTY: Self =
        Self { region: LOC_EMPTY_REGION, state: LocState::Writing, epoch_tag: 0, slot: 0, generation: 0 };

    fn is_empty(&self) -> bool {
        self.region == LOC_EMPTY_REGION
    }
}

/// Replicas held inline per block; more than this is refused (the compact
/// layout is the point; a third replica of a KV block on one node is not).
pub const REPLICAS_INLINE: usize = 2;

/// One cached block.
#[derive(Clone, Copy, Debug)]
struct Node {
    key: BlockKey,
    parent: u32,
    /// Children present (a leaf has none: only leaves may be removed).
    children: u32,
    locs: [Loc; REPLICAS_INLINE],
    /// Logical time of the last access (eviction policies read it).
    touched: u32,
    /// Bit 0-1: object kind; bit 2: a recurrent-state checkpoint hangs
    /// under this block; bits 3..16: its namespace's mark (0: not known);
    /// bits 16..32: accesses (saturating).
    meta: u32,
}

const _: () = assert!(size_of::<Node>() <= 56);

const META_KIND_MASK: u32 = 0b11;
const META_HAS_STATE: u32 = 0b100;
const META_NAMESPACE_SHIFT: u32 = 3;
const META_NAMESPACE_MASK: u32 = ((1 << 13) - 1) << META_NAMESPACE_SHIFT;
const META_HITS_SHIFT: u32 = 16;
const META_HITS_MAX: u32 = (1 << 16) - 1;

/// Namespaces an index tells its blocks' of: a block of one more reads
/// as of none known.
pub const NAMESPACES_MAX: usize = (1 << 13) - 1;

fn kind_bits(kind: ObjectKind) -> u32 {
    match kind {
        ObjectKind::KvBlock => 1,
        ObjectKind::RecurrentState => 2,
    }
}

/// Why an index operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexError {
    /// The parent key is not in the index (insert prefixes first).
    NoParent,
    /// The key is already present under another parent.
    ParentMismatch,
    /// Only leaves can be removed (the set stays prefix-closed).
    HasChildren,
    /// No such block.
    Unknown,
    /// Every inline replica is in use.
    ReplicasFull,
    /// No such replica.
    NoReplica,
    /// The index holds `u32::MAX - 1` blocks.
    Full,
    /// The all-zero key is reserved ("no parent").
    NoneKey,
}

impl core::fmt::Display for IndexError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::NoParent => "index: the parent block is not cached",
            Self::ParentMismatch => "index: the block is cached under another parent",
            Self::HasChildren => "index: only a leaf block can be removed",
            Self::Unknown => "index: no such block",
            Self::ReplicasFull => "index: every replica slot of the block is in use",
            Self::NoReplica => "index: no such replica",
            Self::Full => "index: full",
            Self::NoneKey => "index: the all-zero key is reserved",
        })
    }
}

impl std::error::Error for IndexError {}

#[inline]
fn hash(key: &BlockKey) -> u64 {
    // The key is a BLAKE3 output, so its bytes are nearly the hash; the
    // multiplies spread keys that are not — counters, keys alike in their
    // first bytes — so an engine handing in low-entropy keys cannot pile
    // them into one cluster.
    let (lo, hi) = key.0.split_at(8);
    let word = |bytes: &[u8]| u64::from_le_bytes(bytes.try_into().unwrap_or([0; 8]));
    (word(lo) ^ word(hi).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// The index. See the module docs.
#[derive(Debug, Default)]
pub struct Index {
    nodes: Vec<Node>,
    free: Vec<u32>,
    table: KeyTable,
    len: usize,
    clock: u32,
    /// The namespaces blocks were said to be of ([`Index::set_namespace`]):
    /// a block's mark is its position here, plus one.
    namespaces: Vec<u64>,
    marks: std::collections::HashMap<u64, u32>,
}

impl Index {
    /// An empty index with room for `blocks` before growing.
    pub fn with_capacity(blocks: usize) -> Self {
        let nodes = Vec::with_capacity(blocks);
        crate::huge::advise(&nodes);
        Self { nodes, table: KeyTable::with_capacity(blocks), ..Self::default() }
    }

    /// Blocks cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no block is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Heap bytes held (nodes, free list, hash table), for the
    /// bytes-per-block figure.
    pub fn heap_bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>() + self.free.capacity() * 4 + self.table.heap_bytes()
    }

    /// Advances and returns the logical clock (one tick per request).
    pub fn tick(&mut self) -> u32 {
        self.clock = self.clock.wrapping_add(1);
        self.clock
    }

    /// The current logical time.
    pub fn now(&self) -> u32 {
        self.clock
    }

    /// The node holding `key`.
    #[inline]
    pub fn get(&self, key: &BlockKey) -> Option<BlockRef> {
        let nodes = &self.nodes;
        self.table.find(hash(key), |i| nodes[i as usize].key == *key).map(BlockRef)
    }

    /// Whether `key` is cached.
    #[inline]
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.get(key).is_some()
    }

    /// Inserts `key` under `parent` (`None`: the first block of a prompt).
    /// Inserting a present key returns it (idempotent) if its parent
    /// matches.
    pub fn insert(
        &mut self,
        parent: Option<BlockKey>,
        key: BlockKey,
        kind: ObjectKind,
    ) -> Result<BlockRef, IndexError> {
        let parent = match parent {
            None => None,
            Some(p) => Some(self.get(&p).ok_or(IndexError::NoParent)?),
        };
        self.insert_child(parent, key, kind)
    }

    /// Inserts `key` under the node `parent` (`None`: a prompt's first
    /// block); one hash probe, no lookup of the parent's key. Idempotent
    /// like [`Index::insert`].
    pub fn insert_child(
        &mut self,
        parent: Option<BlockRef>,
        key: BlockKey,
        kind: ObjectKind,
    ) -> Result<BlockRef, IndexError> {
        if key.is_none() {
            return Err(IndexError::NoneKey);
        }
        let parent_index = match parent {
            None => NONE,
            Some(p) if self.is_live(p) => p.0,
            Some(_) => return Err(IndexError::NoParent),
        };
        let index = match self.free.last() {
            Some(&free) => free,
            None => u32::try_from(self.nodes.len()).ok().filter(|&i| i != NONE).ok_or(IndexError::Full)?,
        };
        let nodes = &self.nodes;
        self.table.reserve_one(|i| hash(&nodes[i as usize].key));
        let nodes = &self.nodes;
        let vacant = match self.table.probe(hash(&key), |i| nodes[i as usize].key == key) {
            Probe::Found(existing) => {
                return if self.nodes[existing as usize].parent == parent_index {
                    Ok(BlockRef(existing))
                } else {
                    Err(IndexError::ParentMismatch)
                };
            }
            Probe::Vacant(at) => at,
        };
        self.table.fill(vacant, hash(&key), index);
        let node = Node {
            key,
            parent: parent_index,
            children: 0,
            locs: [Loc::EMPTY; REPLICAS_INLINE],
            touched: self.clock,
            meta: kind_bits(kind),
        };
        if self.free.pop().is_some() {
            self.nodes[index as usize] = node;
        } else {
            let capacity = self.nodes.capacity();
            self.nodes.push(node);
            if self.nodes.capacity() != capacity {
                crate::huge::advise(&self.nodes);
            }
        }
        if parent_index != NONE {
            let parent = &mut self.nodes[parent_index as usize];
            parent.children += 1;
            if kind == ObjectKind::RecurrentState {
                parent.meta |= META_HAS_STATE;
            }
        }
        self.len += 1;
        Ok(BlockRef(index))
    }

    /// Inserts a prompt's chain of keys (each the parent of the next), the
    /// first under `parent`. Returns the refs of every key, present or new.
    pub fn insert_chain(
        &mut self,
        parent: Option<BlockKey>,
        keys: &[BlockKey],
        out: &mut Vec<BlockRef>,
    ) -> Result<(), IndexError> {
        let mut parent = match parent {
            None => None,
            Some(p) => Some(self.get(&p).ok_or(IndexError::NoParent)?),
        };
        // The buckets of keys a few places ahead are fetched while this
        // one is inserted: their cache misses overlap.
        const AHEAD: usize = 4;
        for key in keys.iter().take(AHEAD) {
            self.table.prefetch(hash(key));
        }
        for (i, key) in keys.iter().enumerate() {
            if let Some(ahead) = keys.get(i + AHEAD) {
                self.table.prefetch(hash(ahead));
            }
            let block = self.insert_child(parent, *key, ObjectKind::KvBlock)?;
            out.push(block);
            parent = Some(block);
        }
        Ok(())
    }

    /// How many leading keys of `keys` (a prompt's chain, `keys[0]` its
    /// first block) are cached, with O(log n) probes: the cached set is
    /// prefix-closed (removal is leaf-only), so presence is monotone along
    /// a chain. The boundary's link to its parent is checked; should it not
    /// hold (keys not one chain), a linear scan that checks every link
    /// answers instead.
    pub fn longest_prefix(&self, keys: &[BlockKey]) -> usize {
        // Invariant: keys[..lo] cached, keys[hi..] not.
        let (mut lo, mut hi) = (0usize, keys.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            // Either half may come next: fetch both next probes' buckets
            // while this one is answered.
            if let Some(next) = keys.get(mid + 1 + (hi - mid - 1) / 2) {
                self.table.prefetch(hash(next));
            }
            self.table.prefetch(hash(&keys[lo + (mid - lo) / 2]));
            if self.contains(&keys[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo == 0 || self.linked(keys, lo - 1) {
            return lo;
        }
        (0..keys.len()).take_while(|&i| self.linked(keys, i)).count()
    }

    /// Inserts the recurrent-state checkpoint taken after `block` (keyed
    /// [`BlockKey::state_key`]) as a leaf under it: the block, and so its
    /// whole prefix, stays cached while the checkpoint is.
    pub fn insert_state(&mut self, block: BlockRef) -> Result<BlockRef, IndexError> {
        if !self.is_live(block) {
            return Err(IndexError::NoParent);
        }
        if self.kind(block) == ObjectKind::RecurrentState {
            return Err(IndexError::ParentMismatch);
        }
        let key = self.nodes[block.0 as usize].key.state_key();
        self.insert_child(Some(block), key, ObjectKind::RecurrentState)
    }

    /// The longest prefix a hybrid model can resume from: `(kv, state)`,
    /// where `kv` is [`Index::longest_prefix`] and `state` the deepest
    /// position at most `kv` whose block has a recurrent-state checkpoint
    /// (0: none). Walks parent links up from the hit, so it costs the
    /// distance back to that checkpoint.
    pub fn longest_prefix_with_state(&self, keys: &[BlockKey]) -> (usize, usize) {
        let kv = self.longest_prefix(keys);
        let Some(mut node) = kv.checked_sub(1).and_then(|last| self.get(&keys[last])) else { return (kv, 0) };
        let mut position = kv;
        loop {
            if self.nodes[node.0 as usize].meta & META_HAS_STATE != 0 {
                return (kv, position);
            }
            match self.parent(node) {
                Some(parent) if position > 1 => {
                    node = parent;
                    position -= 1;
                }
                _ => return (kv, 0),
            }
        }
    }

    /// Whether `keys[position]` is cached with `keys[position - 1]` (or no
    /// parent, at position 0) as its parent.
    fn linked(&self, keys: &[BlockKey], position: usize) -> bool {
        let Some(node) = self.get(&keys[position]) else { return false };
        let parent = self.nodes[node.0 as usize].parent;
        match position.checked_sub(1) {
            None => parent == NONE,
            Some(before) => parent != NONE && self.nodes[parent as usize].key == keys[before],
        }
    }

    /// Records an access: the node's time becomes now, its count grows.
    #[inline]
    pub fn touch(&mut self, block: BlockRef) {
        let now = self.clock;
        let node = &mut self.nodes[block.0 as usize];
        node.touched = now;
        let hits = (node.meta >> META_HITS_SHIFT).saturating_add(1).min(META_HITS_MAX);
        node.meta = (node.meta & ((1 << META_HITS_SHIFT) - 1)) | hits << META_HITS_SHIFT;
    }

    /// The key of a node.
    pub fn key(&self, block: BlockRef) -> BlockKey {
        self.nodes[block.0 as usize].key
    }

    /// The parent of a node.
    pub fn parent(&self, block: BlockRef) -> Option<BlockRef> {
        let parent = self.nodes[block.0 as usize].parent;
        (parent != NONE).then_some(BlockRef(parent))
    }

    /// Notes that `block` is of `namespace` (0, or one past
    /// [`NAMESPACES_MAX`] others: not known).
    pub fn set_namespace(&mut self, block: BlockRef, namespace: u64) {
        let mark = match self.marks.get(&namespace) {
            Some(&mark) => mark,
            None if namespace != 0 && self.namespaces.len() < NAMESPACES_MAX => {
                self.namespaces.push(namespace);
                let mark = u32::try_from(self.namespaces.len()).unwrap_or(0);
                self.marks.insert(namespace, mark);
                mark
            }
            None => 0,
        };
        let node = &mut self.nodes[block.0 as usize];
        node.meta = (node.meta & !META_NAMESPACE_MASK) | mark << META_NAMESPACE_SHIFT;
    }

    /// The namespace `block` was said to be of (0: not known).
    pub fn namespace(&self, block: BlockRef) -> u64 {
        let mark = (self.nodes[block.0 as usize].meta & META_NAMESPACE_MASK) >> META_NAMESPACE_SHIFT;
        mark.checked_sub(1).map_or(0, |at| self.namespaces[at as usize])
    }

    /// Whether a node has no cached children (only leaves are evictable).
    pub fn is_leaf(&self, block: BlockRef) -> bool {
        self.nodes[block.0 as usize].children == 0
    }

    /// How many cached blocks continue this one.
    pub fn children(&self, block: BlockRef) -> u32 {
        self.nodes[block.0 as usize].children
    }

    /// Sets a block's last access time back to `at` (a block the policy
    /// would not have let in goes in as if long unused).
    pub fn set_touched(&mut self, block: BlockRef, at: u32) {
        self.nodes[block.0 as usize].touched = at;
    }

    /// Sets a block's access count (a policy restoring what it remembered
    /// of an evicted block).
    pub fn set_hits(&mut self, block: BlockRef, hits: u32) {
        let node = &mut self.nodes[block.0 as usize];
        node.meta = (node.meta & ((1 << META_HITS_SHIFT) - 1)) | hits.min(META_HITS_MAX) << META_HITS_SHIFT;
    }

    /// Last access time.
    pub fn touched(&self, block: BlockRef) -> u32 {
        self.nodes[block.0 as usize].touched
    }

    /// Accesses so far (saturating).
    pub fn hits(&self, block: BlockRef) -> u32 {
        self.nodes[block.0 as usize].meta >> META_HITS_SHIFT
    }

    /// The object kind.
    pub fn kind(&self, block: BlockRef) -> ObjectKind {
        if self.nodes[block.0 as usize].meta & META_KIND_MASK == 2 {
            ObjectKind::RecurrentState
        } else {
            ObjectKind::KvBlock
        }
    }

    /// Every live block.
    pub fn blocks(&self) -> impl Iterator<Item = BlockRef> + '_ {
        (0u32..).zip(&self.nodes).filter(|(_, n)| !n.key.is_none()).map(|(i, _)| BlockRef(i))
    }

    /// Whether `block` names a live node (not freed).
    pub fn is_live(&self, block: BlockRef) -> bool {
        self.nodes.get(block.0 as usize).is_some_and(|n| !n.key.is_none())
    }

    /// Removes a leaf. Its parent may become a leaf.
    pub fn remove(&mut self, block: BlockRef) -> Result<BlockKey, IndexError> {
        let node = *self.nodes.get(block.0 as usize).filter(|n| !n.key.is_none()).ok_or(IndexError::Unknown)?;
        if node.children != 0 {
            return Err(IndexError::HasChildren);
        }
        let nodes = &self.nodes;
        let key = node.key;
        if !self.table.remove(hash(&key), |i| nodes[i as usize].key == key, |i| hash(&nodes[i as usize].key)) {
            return Err(IndexError::Unknown);
        }
        if node.parent != NONE {
            let parent = &mut self.nodes[node.parent as usize];
            parent.children -= 1;
            if node.meta & META_KIND_MASK == kind_bits(ObjectKind::RecurrentState) {
                parent.meta &= !META_HAS_STATE;
            }
        }
        self.nodes[block.0 as usize].key = BlockKey::NONE;
        self.free.push(block.0);
        self.len -= 1;
        Ok(node.key)
    }

    /// Adds a replica; at most [`REPLICAS_INLINE`].
    pub fn add_replica(&mut self, block: BlockRef, loc: Loc) -> Result<(), IndexError> {
        let node = self.nodes.get_mut(block.0 as usize).ok_or(IndexError::Unknown)?;
        let free = node.locs.iter_mut().find(|l| l.is_empty()).ok_or(IndexError::ReplicasFull)?;
        *free = loc;
        Ok(())
    }

    /// Changes the state of the replica in `region`.
    pub fn set_replica_state(&mut self, block: BlockRef, region: u16, state: LocState) -> Result<(), IndexError> {
        let node = self.nodes.get_mut(block.0 as usize).ok_or(IndexError::Unknown)?;
        let loc = node.locs.iter_mut().find(|l| !l.is_empty() && l.region == region).ok_or(IndexError::NoReplica)?;
        loc.state = state;
        Ok(())
    }

    /// Removes the replica in `region`.
    pub fn remove_replica(&mut self, block: BlockRef, region: u16) -> Result<Loc, IndexError> {
        let node = self.nodes.get_mut(block.0 as usize).ok_or(IndexError::Unknown)?;
        let loc = node.locs.iter_mut().find(|l| !l.is_empty() && l.region == region).ok_or(IndexError::NoReplica)?;
        let old = *loc;
        *loc = Loc::EMPTY;
        Ok(old)
    }

    /// The replicas of a block.
    pub fn replicas(&self, block: BlockRef) -> impl Iterator<Item = Loc> + '_ {
        self.nodes[block.0 as usize].locs.iter().copied().filter(|l| !l.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BlockKey {
        let mut k = [0u8; 16];
        let h = lake_dp::rng::SimRng::new(u64::from(i) + 1).next_u64();
        k[..8].copy_from_slice(&h.to_le_bytes());
        k[8..12].copy_from_slice(&i.to_le_bytes());
        k[12] = 1;
        BlockKey(k)
    }

    fn chain(from: u32, len: u32) -> Vec<BlockKey> {
        (from..from + len).map(key).collect()
    }

    #[test]
    fn chains_insert_and_match() {
        let mut index = Index::default();
        let a = chain(0, 10);
        let mut refs = Vec::new();
        index.insert_chain(None, &a, &mut refs).unwrap();
        assert_eq!(index.len(), 10);
        assert_eq!(index.longest_prefix(&a), 10);
        // A branch sharing 4 blocks.
        let mut b = a[..4].to_vec();
        b.extend(chain(100, 3));
        assert_eq!(index.longest_prefix(&b), 4);
        refs.clear();
        index.insert_chain(None, &b, &mut refs).unwrap();
        assert_eq!(index.len(), 13);
        assert_eq!(index.longest_prefix(&b), 7);
        assert!(!index.is_leaf(index.get(&a[3]).unwrap()));
        assert_eq!(index.longest_prefix(&[]), 0);
        assert_eq!(index.longest_prefix(&chain(500, 5)), 0);
        // Idempotent; a mismatched parent is refused.
        assert_eq!(index.insert(Some(a[0]), a[1], ObjectKind::KvBlock).unwrap(), index.get(&a[1]).unwrap());
        assert_eq!(index.insert(Some(a[2]), a[1], ObjectKind::KvBlock), Err(IndexError::ParentMismatch));
        assert_eq!(index.insert(Some(key(999)), key(1000), ObjectKind::KvBlock), Err(IndexError::NoParent));
        assert_eq!(index.insert(None, BlockKey::NONE, ObjectKind::KvBlock), Err(IndexError::NoneKey));
    }

    #[test]
    fn keys_alike_in_their_first_bytes_still_spread_over_the_table() {
        // Keys an engine made itself: one prompt of 4,000 blocks whose
        // keys differ only in their last eight bytes.
        let keys: Vec<BlockKey> = (0..4000u64)
            .map(|i| {
                let mut k = [0x48u8; 16];
                k[8..].copy_from_slice(&i.to_le_bytes());
                BlockKey(k)
            })
            .collect();
        let mut index = Index::default();
        index.insert_chain(None, &keys, &mut Vec::new()).unwrap();
        assert_eq!(index.longest_prefix(&keys), keys.len());
        let nodes = &index.nodes;
        let longest = index.table.longest_probe(|i| hash(&nodes[i as usize].key));
        assert!(longest < 128, "an entry {longest} buckets from its home");
    }

    #[test]
    fn removal_is_leaf_only_and_keeps_the_set_prefix_closed() {
        let mut index = Index::default();
        let a = chain(0, 6);
        let mut refs = Vec::new();
        index.insert_chain(None, &a, &mut refs).unwrap();
        assert_eq!(index.remove(refs[2]), Err(IndexError::HasChildren));
        for r in refs[3..].iter().rev() {
            index.remove(*r).unwrap();
        }
        assert_eq!(index.longest_prefix(&a), 3);
        assert!(index.is_leaf(refs[2]));
        assert_eq!(index.remove(refs[5]), Err(IndexError::Unknown));
        // Freed nodes are reused.
        let before = index.heap_bytes();
        refs.clear();
        index.insert_chain(Some(a[2]), &chain(50, 3), &mut refs).unwrap();
        assert_eq!(index.heap_bytes(), before);
    }

    #[test]
    fn a_key_cached_under_another_parent_ends_the_match() {
        let mut index = Index::default();
        let mut refs = Vec::new();
        index.insert_chain(None, &chain(0, 3), &mut refs).unwrap();
        // keys 10, 11 cached as their own chain; a prompt [0, 1, 11]
        // (never produced by a real chain) must match 2, not 3.
        index.insert_chain(None, &[key(10), key(11)], &mut refs).unwrap();
        assert_eq!(index.longest_prefix(&[key(0), key(1), key(11)]), 2);
        assert_eq!(index.longest_prefix(&[key(0), key(11)]), 1);
        assert_eq!(index.longest_prefix(&[key(11), key(1)]), 0);
    }

    #[test]
    fn recurrent_state_checkpoints_are_leaves_under_their_block() {
        let mut index = Index::default();
        let prompt = chain(0, 8);
        let mut refs = Vec::new();
        index.insert_chain(None, &prompt, &mut refs).unwrap();
        assert_eq!(index.longest_prefix_with_state(&prompt), (8, 0));
        let at3 = index.insert_state(refs[2]).unwrap();
        let at6 = index.insert_state(refs[5]).unwrap();
        assert_eq!(index.kind(at6), ObjectKind::RecurrentState);
        assert!(index.contains(&prompt[5].state_key()));
        assert_eq!(index.longest_prefix_with_state(&prompt), (8, 6));
        assert_eq!(index.longest_prefix_with_state(&prompt[..5]), (5, 3));
        // A checkpoint holds its block: the block is no leaf now.
        assert_eq!(index.remove(refs[7]).unwrap(), prompt[7]);
        assert_eq!(index.remove(refs[6]).unwrap(), prompt[6]);
        assert_eq!(index.remove(refs[5]), Err(IndexError::HasChildren));
        index.remove(at6).unwrap();
        assert_eq!(index.longest_prefix_with_state(&prompt), (6, 3));
        index.remove(refs[5]).unwrap();
        index.remove(refs[4]).unwrap();
        index.remove(refs[3]).unwrap();
        index.remove(at3).unwrap();
        assert_eq!(index.longest_prefix_with_state(&prompt), (3, 0));
        // No checkpoint of a checkpoint, none under a freed block.
        let state = index.insert_state(refs[1]).unwrap();
        assert_eq!(index.insert_state(state), Err(IndexError::ParentMismatch));
        assert_eq!(index.insert_state(refs[5]), Err(IndexError::NoParent));
    }

    #[test]
    fn replicas_and_counters() {
        let mut index = Index::default();
        let r = index.insert(None, key(1), ObjectKind::RecurrentState).unwrap();
        assert_eq!(index.kind(r), ObjectKind::RecurrentState);
        let loc = Loc { region: 3, state: LocState::Writing, epoch_tag: 0, slot: 9, generation: 2 };
        index.add_replica(r, loc).unwrap();
        index.add_replica(r, Loc { region: 4, ..loc }).unwrap();
        assert_eq!(index.add_replica(r, Loc { region: 5, ..loc }), Err(IndexError::ReplicasFull));
        index.set_replica_state(r, 3, LocState::Ready).unwrap();
        assert_eq!(
            index.replicas(r).map(|l| (l.region, l.state)).collect::<Vec<_>>(),
            vec![(3, LocState::Ready), (4, LocState::Writing)]
        );
        assert_eq!(index.remove_replica(r, 4).unwrap().slot, 9);
        assert_eq!(index.remove_replica(r, 4), Err(IndexError::NoReplica));
        index.tick();
        index.touch(r);
        index.touch(r);
        assert_eq!((index.touched(r), index.hits(r)), (1, 2));
    }

    #[test]
    fn a_blocks_namespace_is_kept_beside_its_kind_and_hits() {
        let mut index = Index::default();
        let a = index.insert(None, key(1), ObjectKind::KvBlock).unwrap();
        let b = index.insert(Some(key(1)), key(2), ObjectKind::RecurrentState).unwrap();
        assert_eq!(index.namespace(a), 0, "not said: not known");
        index.set_namespace(a, 0x00de_adbe_ef00_0001);
        index.set_namespace(b, 0x00de_adbe_ef00_0001);
        index.set_hits(b, u32::MAX);
        index.touch(a);
        assert_eq!((index.namespace(a), index.namespace(b)), (0x00de_adbe_ef00_0001, 0x00de_adbe_ef00_0001));
        assert_eq!((index.kind(b), index.hits(b), index.hits(a)), (ObjectKind::RecurrentState, META_HITS_MAX, 1));
        index.set_namespace(b, 7);
        assert_eq!((index.namespace(a), index.namespace(b)), (0x00de_adbe_ef00_0001, 7));
        // A block in a freed node's place starts with none.
        index.remove(b).unwrap();
        let c = index.insert(Some(key(1)), key(3), ObjectKind::KvBlock).unwrap();
        assert_eq!((c, index.namespace(c)), (b, 0));
        // Past the namespaces it can tell, a block's is not known.
        for namespace in 8..=NAMESPACES_MAX as u64 + 5 {
            index.set_namespace(c, namespace);
        }
        assert_eq!(index.namespace(c), NAMESPACES_MAX as u64 + 5, "the last it can tell");
        index.set_namespace(c, u64::MAX);
        assert_eq!((index.namespace(c), index.namespace(a)), (0, 0x00de_adbe_ef00_0001));
    }
}
