//! The per-bucket sequence lock of the mirror: one writer (the node's
//! `lake-cp`), any number of readers in other processes that never block
//! the writer and never see a torn bucket.
//!
//! A bucket is a sequence word and four payload words. The protocol is the
//! one of DPDK's `rte_seqcount` and Linux's `seqcount_t`, with every
//! payload access an atomic word access (so a racing read is a defined,
//! possibly stale, value — never a data race):
//!
//! ```text
//! writer                                   reader
//! s = seq (its own, even)                  s1 = seq            (Acquire)
//! seq = s + 1           (Relaxed)          odd? retry
//! fence                 (Release)          words               (Relaxed)
//! words                 (Relaxed)          fence               (Acquire)
//! seq = s + 2           (Release)          s2 = seq            (Relaxed)
//!                                          s1 != s2? retry
//! ```
//!
//! Why each ordering: the reader's Acquire load of `s1` pairs with the
//! writer's Release store of `s + 2` — a reader that sees the finished
//! count sees every word written before it. The writer's Release fence
//! after storing the odd count pairs with the reader's Acquire fence: if
//! the reader's relaxed word loads saw any store of the next update, the
//! fence makes the odd count (stored before that update's words) visible
//! to the reader's `s2` load, so `s2 != s1` and the snapshot is discarded.
//!
//! A writer that dies mid-update leaves an odd count forever. Readers give
//! up after [`READ_ATTEMPTS`] and report the bucket unreadable (the caller
//! treats it as a miss); the next writer repairs it (see the mirror).
//!
//! The same code runs over `loom`'s atomics (`RUSTFLAGS="--cfg loom"`),
//! which check every interleaving the memory model allows.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// How often a reader retries a bucket that is being written before it
/// reports it unreadable.
#[cfg(not(loom))]
pub const READ_ATTEMPTS: u32 = 64;
/// Fewer under loom: each attempt multiplies the interleavings explored.
#[cfg(loom)]
pub const READ_ATTEMPTS: u32 = 3;

/// One bucket: the sequence count, a 32-bit word and three 64-bit words.
/// 32 bytes, aligned so it never straddles a cache line.
#[derive(Debug, Default)]
#[repr(C, align(32))]
pub struct Bucket {
    seq: AtomicU32,
    meta: AtomicU32,
    words: [AtomicU64; 3],
}

#[cfg(not(loom))]
const _: () = assert!(size_of::<Bucket>() == 32);

/// A consistent copy of a bucket's payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The 32-bit word.
    pub meta: u32,
    /// The 64-bit words.
    pub words: [u64; 3],
}

impl Bucket {
    /// Reads the payload consistently, or `None` if a write was in progress
    /// for [`READ_ATTEMPTS`] attempts (a writer that died mid-update).
    #[inline]
    pub fn read(&self) -> Option<Snapshot> {
        for _ in 0..READ_ATTEMPTS {
            let (s1, snapshot) = self.read_begin();
            if s1 & 1 == 1 {
                spin();
                continue;
            }
            // Acquire fence: pairs with the writer's Release fence after
            // the odd count, so a word from a later update implies the
            // re-check sees that update's odd (or a later) count.
            fence(Ordering::Acquire);
            if self.read_end(s1) {
                return Some(snapshot);
            }
            spin();
        }
        None
    }

    /// The first half of a read, for reading many buckets at once (their
    /// cache misses overlap): the count (Acquire: pairs with the writer's
    /// Release of the even count) and the words (Relaxed). Then one
    /// `fence(Acquire)` after every `read_begin` of the batch, then
    /// [`Bucket::read_end`] for each.
    #[inline]
    pub fn read_begin(&self) -> (u32, Snapshot) {
        let s1 = self.seq.load(Ordering::Acquire);
        let snapshot = Snapshot {
            meta: self.meta.load(Ordering::Relaxed),
            words: [
                self.words[0].load(Ordering::Relaxed),
                self.words[1].load(Ordering::Relaxed),
                self.words[2].load(Ordering::Relaxed),
            ],
        };
        (s1, snapshot)
    }

    /// The second half: whether the snapshot begun with count `s1` is
    /// whole. Only after an Acquire fence that follows the `read_begin`.
    #[inline]
    pub fn read_end(&self, s1: u32) -> bool {
        s1 & 1 == 0 && self.seq.load(Ordering::Relaxed) == s1
    }

    /// Writes the payload. Only the mirror's one writer may call this
    /// (its liveness lock makes sure of that).
    #[inline]
    pub fn write(&self, snapshot: Snapshot) {
        // Relaxed: the writer is the only one storing the count.
        let s = self.seq.load(Ordering::Relaxed);
        // Repair of a bucket a dead writer left odd is done by the caller
        // (the count is made even first), so `s` is even here.
        debug_assert_eq!(s & 1, 0, "bucket left mid-update; repair it first");
        self.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        // Release fence: the odd count is ordered before the word stores
        // below for any reader whose Acquire fence saw one of them.
        fence(Ordering::Release);
        self.meta.store(snapshot.meta, Ordering::Relaxed);
        self.words[0].store(snapshot.words[0], Ordering::Relaxed);
        self.words[1].store(snapshot.words[1], Ordering::Relaxed);
        self.words[2].store(snapshot.words[2], Ordering::Relaxed);
        // Release: a reader that loads this even count sees the words.
        self.seq.store(s.wrapping_add(2), Ordering::Release);
    }

    /// The payload as its writer sees it (no lock: the writer's own
    /// stores).
    #[inline]
    pub fn peek(&self) -> Snapshot {
        Snapshot {
            meta: self.meta.load(Ordering::Relaxed),
            words: [
                self.words[0].load(Ordering::Relaxed),
                self.words[1].load(Ordering::Relaxed),
                self.words[2].load(Ordering::Relaxed),
            ],
        }
    }

    /// Whether a write was left unfinished (the count is odd).
    pub fn is_mid_update(&self) -> bool {
        self.seq.load(Ordering::Relaxed) & 1 == 1
    }

    /// Finishes an update a dead writer left: writes `snapshot` and makes
    /// the count even again. Only the (new) writer calls this.
    pub fn repair(&self, snapshot: Snapshot) {
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 0 {
            self.write(snapshot);
            return;
        }
        // Still odd: readers keep discarding what they read while the
        // words are rewritten; the even count then publishes them.
        fence(Ordering::Release);
        self.meta.store(snapshot.meta, Ordering::Relaxed);
        self.words[0].store(snapshot.words[0], Ordering::Relaxed);
        self.words[1].store(snapshot.words[1], Ordering::Relaxed);
        self.words[2].store(snapshot.words[2], Ordering::Relaxed);
        self.seq.store(s.wrapping_add(1), Ordering::Release);
    }

    /// Leaves the bucket mid-update, as a writer killed inside
    /// [`Bucket::write`] would (for tests of the repair).
    #[doc(hidden)]
    pub fn abandon_update(&self) {
        let s = self.seq.load(Ordering::Relaxed);
        if s & 1 == 0 {
            self.seq.store(s.wrapping_add(1), Ordering::Relaxed);
        }
    }
}

#[inline]
fn spin() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    core::hint::spin_loop();
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn value(v: u64) -> Snapshot {
        Snapshot { meta: v as u32, words: [v, !v, v.rotate_left(17)] }
    }

    fn consistent(s: &Snapshot) -> bool {
        let v = s.words[0];
        *s == value(v)
    }

    #[test]
    fn readers_on_other_threads_never_see_a_torn_bucket() {
        let bucket = std::sync::Arc::new(Bucket::default());
        bucket.write(value(0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let total = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (bucket, stop, total) = (bucket.clone(), stop.clone(), total.clone());
                std::thread::spawn(move || {
                    let (mut reads, mut torn) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        if let Some(s) = bucket.read() {
                            reads += 1;
                            torn += u64::from(!consistent(&s));
                            total.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    (reads, torn)
                })
            })
            .collect();
        // At least 200,000 writes, and on until the readers (which a busy
        // machine may schedule late) have read a good many times.
        let started = std::time::Instant::now();
        let mut v = 1u64;
        while v < 200_000 || (total.load(Ordering::Relaxed) < 20_000 && started.elapsed().as_secs() < 20) {
            bucket.write(value(v));
            v += 1;
        }
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            let (reads, torn) = reader.join().unwrap();
            assert!(reads > 0);
            assert_eq!(torn, 0, "{torn} torn reads of {reads}");
        }
    }

    #[test]
    fn a_bucket_left_mid_update_is_unreadable_until_repaired() {
        let bucket = Bucket::default();
        bucket.write(value(5));
        bucket.abandon_update();
        assert!(bucket.is_mid_update());
        assert_eq!(bucket.read(), None);
        bucket.repair(value(6));
        assert!(!bucket.is_mid_update());
        assert_eq!(bucket.read(), Some(value(6)));
        bucket.write(value(7));
        assert_eq!(bucket.read(), Some(value(7)));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    fn value(v: u64) -> Snapshot {
        Snapshot { meta: v as u32, words: [v, v, v] }
    }

    /// Every interleaving (up to three preemptions, which is where such
    /// bugs live) of one writer's two updates against one reader: whatever
    /// the reader returns is one whole update.
    #[test]
    fn no_interleaving_yields_a_torn_read() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let bucket = Arc::new(Bucket::default());
            let writer = {
                let bucket = bucket.clone();
                loom::thread::spawn(move || {
                    bucket.write(value(1));
                    bucket.write(value(2));
                })
            };
            if let Some(s) = bucket.read() {
                assert!(s == value(0) || s == value(1) || s == value(2), "torn: {s:?}");
            }
            writer.join().unwrap();
            assert_eq!(bucket.read(), Some(value(2)));
        });
    }
}
