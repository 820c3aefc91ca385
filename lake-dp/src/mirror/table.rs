//! The mirror's table algorithms over its buckets: the reader's lookup
//! with its move check, and the writer's placement and backward-shift
//! removal. Plain slices of [`Bucket`]s and two control words, so the same
//! code runs over the shared mapping and, for the model check, over
//! `loom`'s atomics.

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

/// Where an insert of a key goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The key is live here already.
    Existing(u64),
    /// A free bucket (empty, or void if `void`) `distance` from home.
    Free {
        /// The bucket.
        position: u64,
        /// From the key's home.
        distance: u64,
        /// It is a void bucket (reused), not an empty one.
        void: bool,
    },
    /// No free bucket anywhere.
    Full,
}

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
        for _ in 0..=bound {
            let snapshot = self.bucket(position).read().ok_or(Untold)?;
            match snapshot.meta & 3 {
                STATE_EMPTY => return Ok(None),
                STATE_LIVE if snapshot.words[0] == lo && snapshot.words[1] == hi => return Ok(Some(snapshot)),
                _ => {}
            }
            position = self.next(position);
        }
        Ok(None)
    }

    /// Writer: the bucket holding the key (its own stores, no lock).
    pub fn position(&self, lo: u64, hi: u64) -> Option<u64> {
        let mut position = home(lo, self.len());
        for _ in 0..=self.max_probe.load(Ordering::Relaxed) {
            let seen = self.bucket(position).peek();
            match seen.meta & 3 {
                STATE_EMPTY => return None,
                STATE_LIVE if seen.words[0] == lo && seen.words[1] == hi => return Some(position),
                _ => {}
            }
            position = self.next(position);
        }
        None
    }

    /// Writer: where the key goes.
    pub fn place(&self, lo: u64, hi: u64) -> Place {
        let bound = u64::from(self.max_probe.load(Ordering::Relaxed));
        let mut position = home(lo, self.len());
        let mut void: Option<(u64, u64)> = None;
        for distance in 0..self.len() {
            let seen = self.bucket(position).peek();
            match seen.meta & 3 {
                STATE_LIVE if seen.words[0] == lo && seen.words[1] == hi => return Place::Existing(position),
                STATE_EMPTY => {
                    return match void {
                        Some((position, distance)) => Place::Free { position, distance, void: true },
                        None => Place::Free { position, distance, void: false },
                    };
                }
                STATE_VOID if void.is_none() => void = Some((position, distance)),
                _ => {}
            }
            // Past the bound no live entry lies: a void seen is the place.
            if distance > bound
                && let Some((position, distance)) = void
            {
                return Place::Free { position, distance, void: true };
            }
            position = self.next(position);
        }
        match void {
            Some((position, distance)) => Place::Free { position, distance, void: true },
            None => Place::Full,
        }
    }

    /// Writer: writes `snapshot` at a free place `distance` from its home,
    /// raising the probe bound first if needed. False (nothing written) if
    /// the distance does not fit the bound's 32 bits.
    pub fn fill(&self, position: u64, distance: u64, snapshot: Snapshot) -> bool {
        if distance > u64::from(self.max_probe.load(Ordering::Relaxed)) {
            let Ok(bound) = u32::try_from(distance) else { return false };
            // Release: a reader that loads the larger bound will find the
            // entry written below (or see it being written).
            self.max_probe.store(bound, Ordering::Release);
        }
        self.bucket(position).write(snapshot);
        true
    }

    /// Writer: removes the live entry at `position`, moving later entries
    /// of its cluster back (backward shift) under the odd move count.
    pub fn remove_at(&self, position: u64) {
        let count = self.moves.load(Ordering::Relaxed);
        // Odd while moving; the Release fence orders the odd count before
        // the bucket writes below for any reader whose Acquire fence saw
        // one of them.
        self.moves.store(count.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let mut hole = position;
        let mut next = self.next(hole);
        loop {
            let snapshot = self.bucket(next).peek();
            match snapshot.meta & 3 {
                STATE_EMPTY => break,
                STATE_LIVE => {
                    let home = home(snapshot.words[0], self.len());
                    // It may fill the hole if its home is not inside
                    // (hole, next]: it is then still found from its home.
                    if self.distance(home, next) >= self.distance(hole, next) {
                        // Copy first: the entry is in both buckets until
                        // the next step reuses this one.
                        self.bucket(hole).write(snapshot);
                        hole = next;
                    }
                }
                _ => {} // a void stays where it is
            }
            next = self.next(next);
        }
        self.bucket(hole).write(Snapshot { meta: STATE_EMPTY, words: [0; 3] });
        // Release: a reader that sees the even count sees the moves.
        self.moves.store(count.wrapping_add(2), Ordering::Release);
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
}
