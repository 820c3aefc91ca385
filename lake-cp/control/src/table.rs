//! The index's hash table: open addressing with linear probing from a
//! block key to its node index, written for the index's access pattern.
//!
//! Each bucket is a one-byte control (empty, or seven bits of the hash as
//! a tag) and a `u32` node index, in two arrays: 5 bytes a bucket. The
//! bucket count is not rounded to a power of two (the home bucket is the
//! hash scaled to the count), so at a load of at most 0.7 the table costs
//! about 7 bytes an entry. A lookup reads the control bytes from the home
//! bucket on and touches a node only where the tag matches (1 in 128
//! otherwise).
//! What a general-purpose map cannot offer is [`KeyTable::prefetch`]:
//! inserting a prompt's chain, the index asks for the buckets of keys a
//! few places ahead, so the cache misses of consecutive keys overlap
//! instead of queueing. Removal shifts the cluster back (no tombstones),
//! so probe lengths do not decay under churn.
//!
//! The hash is the index's fold of the key's two words (a BLAKE3 output
//! is uniform; the fold spreads keys that are not); the table asks the
//! index for a node's hash when it moves an entry.

const EMPTY: u8 = 0x80;

/// Seven low bits of the hash (the home bucket comes from the high ones,
/// so a cluster's tags stay independent).
#[inline]
fn tag(hash: u64) -> u8 {
    (hash & 0x7f) as u8
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct KeyTable {
    ctrl: Vec<u8>,
    slots: Vec<u32>,
    len: usize,
}

/// Where a probe ended.
pub(crate) enum Probe {
    /// The key is present: the node index.
    Found(u32),
    /// Absent; the bucket an insert takes.
    Vacant(usize),
}

impl KeyTable {
    /// Room for `entries` before growing.
    pub(crate) fn with_capacity(entries: usize) -> Self {
        let buckets = (entries.saturating_mul(10) / 7 + 1).max(16);
        let mut ctrl = Vec::with_capacity(buckets);
        let mut slots = Vec::with_capacity(buckets);
        crate::huge::advise(&ctrl);
        crate::huge::advise(&slots);
        ctrl.resize(buckets, EMPTY);
        slots.resize(buckets, 0);
        Self { ctrl, slots, len: 0 }
    }

    /// The hash scaled to the bucket count: below it, so the cast is exact.
    #[inline]
    #[allow(clippy::cast_possible_truncation)]
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.ctrl.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, pos: usize) -> usize {
        if pos + 1 == self.ctrl.len() { 0 } else { pos + 1 }
    }

    /// Buckets from `from` forward to `to`, wrapping.
    #[inline]
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from { to - from } else { to + self.ctrl.len() - from }
    }

    /// Entries held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The longest distance an entry lies from its home (`hash_of`
    /// names each entry's hash).
    #[cfg(test)]
    pub(crate) fn longest_probe(&self, hash_of: impl Fn(u32) -> u64) -> usize {
        (0..self.ctrl.len())
            .filter(|&pos| self.ctrl[pos] != EMPTY)
            .map(|pos| self.distance(self.home(hash_of(self.slots[pos])), pos))
            .max()
            .unwrap_or(0)
    }

    /// Heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.ctrl.capacity() + self.slots.capacity() * size_of::<u32>()
    }

    /// Asks the CPU to bring the home bucket of `hash` into cache.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        if self.ctrl.is_empty() {
            return;
        }
        let home = self.home(hash);
        prefetch(self.ctrl.as_ptr().wrapping_add(home));
        prefetch(self.slots.as_ptr().wrapping_add(home).cast());
    }

    /// Finds the entry for which `eq(node)` holds.
    #[inline]
    pub(crate) fn find(&self, hash: u64, eq: impl FnMut(u32) -> bool) -> Option<u32> {
        self.position(hash, eq).map(|pos| self.slots[pos])
    }

    /// Finds the entry, or the bucket where it would go. Call
    /// [`KeyTable::reserve_one`] first, so the vacant bucket stays valid.
    #[inline]
    pub(crate) fn probe(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Probe {
        let tag = tag(hash);
        let mut pos = self.home(hash);
        loop {
            let c = self.ctrl[pos];
            if c == EMPTY {
                return Probe::Vacant(pos);
            }
            if c == tag && eq(self.slots[pos]) {
                return Probe::Found(self.slots[pos]);
            }
            pos = self.next(pos);
        }
    }

    /// Fills a bucket [`KeyTable::probe`] found vacant.
    #[inline]
    pub(crate) fn fill(&mut self, pos: usize, hash: u64, node: u32) {
        debug_assert_eq!(self.ctrl[pos], EMPTY);
        self.ctrl[pos] = tag(hash);
        self.slots[pos] = node;
        self.len += 1;
    }

    /// Makes room for one more entry, growing (and rehashing with
    /// `hash_of(node)`) at a load of 0.7.
    #[inline]
    pub(crate) fn reserve_one(&mut self, hash_of: impl Fn(u32) -> u64) {
        let buckets = self.ctrl.len();
        if (self.len + 1) * 10 <= buckets * 7 {
            return;
        }
        self.grow(hash_of);
    }

    #[cold]
    fn grow(&mut self, hash_of: impl Fn(u32) -> u64) {
        let mut bigger = Self::with_capacity((self.len + 1).max(8) * 2);
        for (pos, &c) in self.ctrl.iter().enumerate() {
            if c != EMPTY {
                let node = self.slots[pos];
                let hash = hash_of(node);
                if let Probe::Vacant(at) = bigger.probe(hash, |_| false) {
                    bigger.fill(at, hash, node);
                }
            }
        }
        *self = bigger;
    }

    /// Removes the entry for which `eq(node)` holds; entries after it in
    /// its cluster shift back (their hashes from `hash_of`). Returns
    /// whether it was there.
    pub(crate) fn remove(&mut self, hash: u64, eq: impl FnMut(u32) -> bool, hash_of: impl Fn(u32) -> u64) -> bool {
        let Some(mut hole) = self.position(hash, eq) else { return false };
        let mut next = self.next(hole);
        while self.ctrl[next] != EMPTY {
            let home = self.home(hash_of(self.slots[next]));
            // The entry at `next` may fill the hole if its home is not
            // inside (hole, next] (cyclically): it would then still be
            // found from its home.
            if self.distance(home, next) >= self.distance(hole, next) {
                self.ctrl[hole] = self.ctrl[next];
                self.slots[hole] = self.slots[next];
                hole = next;
            }
            next = self.next(next);
        }
        self.ctrl[hole] = EMPTY;
        self.len -= 1;
        true
    }

    #[inline]
    fn position(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<usize> {
        if self.ctrl.is_empty() {
            return None;
        }
        let tag = tag(hash);
        let mut pos = self.home(hash);
        loop {
            let c = self.ctrl[pos];
            if c == EMPTY {
                return None;
            }
            if c == tag && eq(self.slots[pos]) {
                return Some(pos);
            }
            pos = self.next(pos);
        }
    }
}

#[inline]
fn prefetch(ptr: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults, whatever the address;
    // SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(ptr.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = ptr;
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test values are small
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Values stand for node indexes; their "keys" hash to `hashes[value]`.
    fn check_against_a_map(hashes: &[u64], ops: &[(bool, u32)]) {
        let mut table = KeyTable::with_capacity(4);
        let mut model: HashMap<u32, ()> = HashMap::new();
        let hash_of = |v: u32| hashes[v as usize];
        for &(insert, v) in ops {
            let h = hash_of(v);
            if insert {
                table.reserve_one(hash_of);
                match table.probe(h, |n| n == v) {
                    Probe::Found(n) => assert!(model.contains_key(&n)),
                    Probe::Vacant(pos) => {
                        assert!(!model.contains_key(&v));
                        table.fill(pos, h, v);
                        model.insert(v, ());
                    }
                }
            } else {
                assert_eq!(table.remove(h, |n| n == v, hash_of), model.remove(&v).is_some());
            }
            assert_eq!(table.len(), model.len());
            for &present in model.keys() {
                assert_eq!(table.find(hash_of(present), |n| n == present), Some(present));
            }
        }
    }

    #[test]
    fn matches_a_map_under_churn_and_collisions() {
        let mut rng = lake_dp::rng::SimRng::new(11);
        // Few distinct hashes: long clusters, wrap-around, equal tags.
        for distinct in [3u64, 17, 1 << 20] {
            let hashes: Vec<u64> =
                (0..400).map(|_| (rng.next_u64() % distinct).wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
            let ops: Vec<(bool, u32)> = (0..3000).map(|_| (rng.below(3) != 0, rng.below(400) as u32)).collect();
            check_against_a_map(&hashes, &ops);
        }
    }
}
