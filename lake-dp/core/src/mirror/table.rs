//! The mirror's table algorithms over its buckets: the reader's lookup
//! with its move check, and the writer's Robin Hood insertion and
//! backward-shift removal. Plain slices of [`Bucket`]s and two control
//! words, so the same code runs over the shared mapping and, for the model
//! check, over `loom`'s atomics.
//!
//! Robin Hood: an insert walking from its home takes the bucket of any
//! entry nearer its own home than the insert is to its, and carries that
//! entry on. Entries of a cluster then lie in the order of their homes, so
//! no entry sits far from home because it came late (with plain linear
//! probing the newest — the blocks just computed, the ones engines look up
//! — sit furthest), and a probe may stop as soon as it meets an entry
//! nearer home than the probe has come: the key is not further on.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use super::seqlock::{Bucket, Snapshot};

/// An empty bucket: probes end here.
pub const STATE_EMPTY: u32 = 0;
/// A live entry.
pub const STATE_LIVE: u32 = 1;
/// A bucket a dead writer left mid-update, repaired: skipped by probes,
/// reused by inserts.
pub const STATE_VOID: u32 = 2;

/// How often a reader looks again after a miss that raced entries moving.
#[cfg(not(loom))]
pub const MISS_ATTEMPTS: u32 = 32;
/// Fewer under loom (each attempt multiplies the interleavings).
#[cfg(loom)]
pub const MISS_ATTEMPTS: u32 = 2;

/// The home bucket of a key: its first eight bytes (a keyed BLAKE3
/// output, uniform) scaled to the bucket count.
#[inline]
pub fn home(key_lo: u64, buckets: u64) -> u64 {
    #[allow(clippy::cast_possible_truncation)] // below `buckets`, a u64
    let home = ((u128::from(key_lo) * u128::from(buckets)) >> 64) as u64;
    home
}

/// The buckets and the two control words the algorithms need.
#[derive(Clone, Copy, Debug)]
pub struct Table<'a> {
    /// The buckets.
    pub buckets: &'a [Bucket],
    /// The table-wide move count (odd while moving).
    pub moves: &'a AtomicU64,
    /// The longest probe a live entry needs.
    pub max_probe: &'a AtomicU32,
}

/// A lookup that could not tell whether the key is there: a bucket on its
/// path was left mid-update by a dead writer, or entries kept moving
/// under every attempt. Callers treat it as a miss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Untold;

impl Table<'_> {
    /// Buckets.
    #[inline]
    pub fn len(&self) -> u64 {
        self.buckets.len() as u64
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// A bucket.
    #[inline]
    pub fn bucket(&self, position: u64) -> &Bucket {
        &self.buckets[crate::usize_from(position)]
    }

    /// The bucket after `position`, wrapping.
    #[inline]
    pub fn next(&self, position: u64) -> u64 {
        if position + 1 == self.len() { 0 } else { position + 1 }
    }

    /// Buckets from `from` forward to `to`, wrapping.
    #[inline]
    pub fn distance(&self, from: u64, to: u64) -> u64 {
        if to >= from { to - from } else { to + self.len() - from }
    }

    /// Reader: the live bucket of the key whose words are `(lo, hi)`.
    /// `Ok(None)`: absent.
    #[inline]
    pub fn find(&self, lo: u64, hi: u64) -> Result<Option<Snapshot>, Untold> {
        // A hit needs no check: its bucket read was consistent and named
        // the key (a copy being moved is the same entry). So the common
        // case never touches the move count, a line the writer dirties.
        if let Some(found) = self.probe(lo, hi)? {
            return Ok(Some(found));
        }
        for _ in 0..MISS_ATTEMPTS {
            // Acquire: pairs with the writer's Release of the even count
            // after moving, as a bucket's count does.
            let m1 = self.moves.load(Ordering::Acquire);
            if let Some(found) = self.probe(lo, hi)? {
                return Ok(Some(found));
            }
            // A miss is only trusted if nothing moved meanwhile: the
            // Acquire fence pairs with the writer's Release fence after
            // the odd count (the bucket protocol, table-wide).
            fence(Ordering::Acquire);
            if m1 & 1 == 0 && self.moves.load(Ordering::Relaxed) == m1 {
                return Ok(None);
            }
            spin();
        }
        Err(Untold)
    }

    #[inline]
    fn probe(&self, lo: u64, hi: u64) -> Result<Option<Snapshot>, Untold> {
        let mut position = home(lo, self.len());
        // Acquire: pairs with the writer's Release store of a larger bound
        // before it writes an entry that far from home.
        let bound = self.max_probe.load(Ordering::Acquire);
        for distance in 0..=u64::from(bound) {
            let snapshot = self.bucket(position).read().ok_or(Untold)?;
            match snapshot.meta & 3 {
                STATE_EMPTY => return Ok(None),
                STATE_LIVE if snapshot.words[0] == lo && snapshot.words[1] == hi => return Ok(Some(snapshot)),
                // Robin Hood order: an entry nearer its home than this probe
                // is to the key's means the key is not further on.
                STATE_LIVE if self.displacement(&snapshot, position) < distance => return Ok(None),
                _ => {}
            }
            position = self.next(position);
        }
        Ok(None)
    }

    /// How far the entry in `snapshot`, lying at `position`, is from its
    /// home.
    #[inline]
    pub fn displacement(&self, snapshot: &Snapshot, position: u64) -> u64 {
        self.distance(home(snapshot.words[0], self.len()), position)
    }

    /// Writer: the bucket holding the key (its own stores, no lock).
    pub fn position(&self, lo: u64, hi: u64) -> Option<u64> {
        let mut position = home(lo, self.len());
        for distance in 0..=u64::from(self.max_probe.load(Ordering::Relaxed)) {
            let seen = self.bucket(position).peek();
            match seen.meta & 3 {
                STATE_EMPTY => return None,
                STATE_LIVE if seen.words[0] == lo && seen.words[1] == hi => return Some(position),
                STATE_LIVE if self.displacement(&seen, position) < distance => return None,
                _ => {}
            }
            position = self.next(position);
        }
        None
    }

    /// Writer: inserts `snapshot`, whose key is absent (see
    /// [`Table::position`]), the Robin Hood way. The table must have an
    /// empty bucket. False, with nothing changed, only if a displacement
    /// would not fit the probe bound's 32 bits.
    pub fn insert(&self, snapshot: Snapshot) -> bool {
        self.insert_inner(snapshot, true)
    }

    /// [`Table::insert`]; `guard`: raise the move count around carrying
    /// (not when the caller already holds it odd).
    fn insert_inner(&self, snapshot: Snapshot, guard: bool) -> bool {
        let count = self.moves.load(Ordering::Relaxed);
        let mut moving = !guard;
        let mut carry = snapshot;
        let mut position = home(carry.words[0], self.len());
        let mut distance = 0u64;
        loop {
            let seen = self.bucket(position).peek();
            let free = seen.meta & 3 != STATE_LIVE;
            let richer = !free && self.displacement(&seen, position) < distance;
            if free || richer {
                if distance > u64::from(self.max_probe.load(Ordering::Relaxed)) {
                    let Ok(bound) = u32::try_from(distance) else { return false };
                    // Release: a reader that loads the larger bound finds
                    // the entry written below (or sees it being written).
                    self.max_probe.store(bound, Ordering::Release);
                }
                if richer && !moving {
                    // An entry is about to be carried (absent until it is
                    // written again further on): odd count, as a removal.
                    self.moves.store(count.wrapping_add(1), Ordering::Relaxed);
                    fence(Ordering::Release);
                    moving = true;
                }
                self.bucket(position).write(carry);
                if free {
                    break;
                }
                distance = self.displacement(&seen, position);
                carry = seen;
            }
            position = self.next(position);
            distance += 1;
        }
        if moving && guard {
            // Release: a reader that sees the even count sees the moves.
            self.moves.store(count.wrapping_add(2), Ordering::Release);
        }
        true
    }

    /// Writer: removes the live entry at `position`, moving the entries
    /// after it that are away from home back by one (backward shift)
    /// under the odd move count. Each is copied before its old bucket is
    /// reused, so it is never absent.
    pub fn remove_at(&self, position: u64) {
        let count = self.moves.load(Ordering::Relaxed);
        // Odd while moving; the Release fence orders the odd count before
        // the bucket writes below for any reader whose Acquire fence saw
        // one of them.
        self.moves.store(count.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.shift_into(position);
        // Release: a reader that sees the even count sees the moves.
        self.moves.store(count.wrapping_add(2), Ordering::Release);
    }

    /// Fills the hole at `hole` from the entries after it that are away
    /// from home, and empties the last bucket moved from.
    fn shift_into(&self, mut hole: u64) {
        loop {
            let next = self.next(hole);
            let snapshot = self.bucket(next).peek();
            if snapshot.meta & 3 != STATE_LIVE || self.displacement(&snapshot, next) == 0 {
                break;
            }
            self.bucket(hole).write(snapshot);
            hole = next;
        }
        self.bucket(hole).write(Snapshot { meta: STATE_EMPTY, words: [0; 3] });
    }

    /// Writer, taking over from a dead one: rebuilds every cluster that
    /// holds a void (a bucket it left mid-update), and every cluster at all
    /// if it died moving entries (one may be carried nowhere, or be in two
    /// buckets, and the order may be broken). Entries are re-inserted once
    /// each. Returns (live entries, duplicates dropped, longest
    /// displacement).
    pub fn rebuild(&self, everything: bool) -> (u64, u64, u64) {
        let count = self.moves.load(Ordering::Relaxed);
        let odd = count | 1;
        self.moves.store(odd, Ordering::Relaxed);
        fence(Ordering::Release);
        let n = self.len();
        let mut dropped = 0;
        // Start right after an empty bucket, so no cluster wraps unseen.
        let Some(start) = (0..n).find(|&p| self.bucket(p).peek().meta & 3 == STATE_EMPTY) else {
            return (0, 0, 0);
        };
        let mut cluster: Vec<Snapshot> = Vec::new();
        let mut at = self.next(start);
        let mut walked = 0;
        while walked < n {
            if self.bucket(at).peek().meta & 3 == STATE_EMPTY {
                at = self.next(at);
                walked += 1;
                continue;
            }
            // A cluster: [first, at).
            let first = at;
            let mut void = false;
            cluster.clear();
            while self.bucket(at).peek().meta & 3 != STATE_EMPTY {
                let seen = self.bucket(at).peek();
                if seen.meta & 3 == STATE_LIVE {
                    cluster.push(seen);
                } else {
                    void = true;
                }
                at = self.next(at);
                walked += 1;
            }
            if !(void || everything) {
                continue;
            }
            let before = cluster.len();
            cluster.sort_unstable_by_key(|s| (s.words[0], s.words[1]));
            cluster.dedup_by_key(|s| (s.words[0], s.words[1]));
            dropped += (before - cluster.len()) as u64;
            let mut p = first;
            while p != at {
                self.bucket(p).write(Snapshot { meta: STATE_EMPTY, words: [0; 3] });
                p = self.next(p);
            }
            for snapshot in &cluster {
                // Fits: the cluster held at least these entries.
                self.insert_inner(*snapshot, false);
            }
        }
        let (mut live, mut longest) = (0, 0);
        for p in 0..n {
            let seen = self.bucket(p).peek();
            if seen.meta & 3 == STATE_LIVE {
                live += 1;
                longest = longest.max(self.displacement(&seen, p));
            }
        }
        self.max_probe.store(u32::try_from(longest).unwrap_or(u32::MAX), Ordering::Release);
        self.moves.store(odd.wrapping_add(1), Ordering::Release);
        (live, dropped, longest)
    }
}

#[inline]
fn spin() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    core::hint::spin_loop();
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    struct Owned {
        buckets: Vec<Bucket>,
        moves: AtomicU64,
        max_probe: AtomicU32,
    }

    impl Owned {
        fn table(&self) -> Table<'_> {
            Table { buckets: &self.buckets, moves: &self.moves, max_probe: &self.max_probe }
        }
    }

    fn live(lo: u64) -> Snapshot {
        Snapshot { meta: STATE_LIVE, words: [lo, 7, lo] }
    }

    /// Keys A and B share home bucket 0 of four (A at 0, B displaced to
    /// 1). The writer removes A, which moves B back to 0. In no
    /// interleaving may a reader looking for B report it absent.
    #[test]
    fn a_key_moved_back_by_a_removal_is_never_reported_absent() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(2);
        model.check(|| {
            let owned = Arc::new(Owned {
                buckets: (0..4).map(|_| Bucket::default()).collect(),
                moves: AtomicU64::new(0),
                max_probe: AtomicU32::new(1),
            });
            let (a, b) = (1u64, 2u64);
            assert_eq!((home(a, 4), home(b, 4)), (0, 0));
            owned.table().bucket(0).write(live(a));
            owned.table().bucket(1).write(live(b));
            let writer = {
                let owned = owned.clone();
                loom::thread::spawn(move || owned.table().remove_at(0))
            };
            let found = owned.table().find(b, 7);
            assert_ne!(found, Ok(None), "B reported absent while it moved");
            if let Ok(Some(snapshot)) = found {
                assert_eq!(snapshot, live(b));
            }
            writer.join().unwrap();
            assert_eq!(owned.table().find(b, 7), Ok(Some(live(b))));
            assert_eq!(owned.table().find(a, 7), Ok(None));
        });
    }

    /// A (home 0) at 0, B (home 1) at 1. Inserting C (home 0) takes B's
    /// bucket and carries B on to 2 (Robin Hood). In no interleaving may a
    /// reader looking for B report it absent.
    #[test]
    fn a_key_carried_by_an_insert_is_never_reported_absent() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(2);
        model.check(|| {
            let owned = Arc::new(Owned {
                buckets: (0..4).map(|_| Bucket::default()).collect(),
                moves: AtomicU64::new(0),
                max_probe: AtomicU32::new(0),
            });
            let (a, b, c) = (1u64, 1u64 << 62 | 5, 3u64);
            assert_eq!((home(a, 4), home(b, 4), home(c, 4)), (0, 1, 0));
            owned.table().bucket(0).write(live(a));
            owned.table().bucket(1).write(live(b));
            let reader = {
                let owned = owned.clone();
                loom::thread::spawn(move || owned.table().find(b, 7))
            };
            assert!(owned.table().insert(live(c)));
            let found = reader.join().unwrap();
            assert_ne!(found, Ok(None), "B reported absent while it was carried");
            assert_eq!(owned.table().find(b, 7), Ok(Some(live(b))));
            assert_eq!(owned.table().find(c, 7), Ok(Some(live(c))));
            assert_eq!(owned.table().bucket(2).peek(), live(b));
        });
    }
}
