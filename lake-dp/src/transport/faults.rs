//! Faults on purpose, replayable by seed: a [`Transport`] decorator and a
//! [`Landing`] decorator that tests put around the real ones (Mooncake's
//! fault-injecting transport, made deterministic). The network's own
//! faults — delay, loss, reordering, resets — come from the fault proxy
//! between nodes; these are the ones a proxy cannot make:
//!
//! - a write refused as if the transport were full (`Busy`), which the
//!   caller must take back and retry;
//! - an acknowledgement lost after the block landed: the sender sees
//!   `Timeout` for a block the target has (a retry must be harmless);
//! - completions held back for a few polls, so they arrive out of order;
//! - bytes that change in the target slot between landing and the check
//!   (memory or DMA corruption), which the check must catch: the block is
//!   reported `Corrupt` and never published.
//!
//! Every decision is a pure function of the seed and what it is about
//! (the transfer id and its attempt, the target slot and generation), not
//! of the order things happen in, so a failing seed replays the same
//! faults whatever the timing of the run.

use std::collections::HashMap;

use super::frame::{AckStatus, BlockAddr};
use super::{Completion, Landing, Outgoing, TransferError, Transport};
use crate::constants::STORED_HEADER_BYTES;

/// How often each fault happens, per mille, and the seed that picks where.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Picks which transfers and slots the faults hit.
    pub seed: u64,
    /// Writes refused as `Busy` (each attempt of a transfer drawn anew).
    pub busy_per_mille: u32,
    /// Acknowledgements lost after landing: the sender sees `Timeout`.
    pub lost_ack_per_mille: u32,
    /// Completions held back for up to this many polls.
    pub delay_polls_max: u32,
    /// Landed blocks with one byte changed before the check.
    pub corrupt_per_mille: u32,
}

/// What a decorator did, for the test to hold against what it saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultLog {
    /// (transfer, attempt) of every write refused as `Busy`.
    pub busy: Vec<(u64, u32)>,
    /// Transfers whose acknowledgement was dropped.
    pub lost_acks: Vec<u64>,
    /// Completions held back.
    pub delayed: u64,
    /// Targets whose bytes were changed before the check.
    pub corrupted: Vec<BlockAddr>,
}

/// A draw in `0..1000` for `what` under `seed` (SplitMix64's finaliser
/// over the two: well mixed, and the same on every run).
fn draw(seed: u64, what: u64) -> u32 {
    let mut z = seed ^ what.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    u32::try_from(z % 1000).unwrap_or(0)
}

/// Distinct streams of draws from one seed.
const BUSY: u64 = 1 << 56;
const LOST_ACK: u64 = 2 << 56;
const DELAY: u64 = 3 << 56;
const CORRUPT: u64 = 4 << 56;
const WHERE: u64 = 5 << 56;

/// A transport whose writes and completions suffer the plan's faults.
#[derive(Debug)]
pub struct FaultyTransport<T> {
    inner: T,
    plan: FaultPlan,
    /// Writes tried per transfer still in flight (the attempt number).
    attempts: HashMap<u64, u32>,
    /// Completions held back: (the poll that releases it, it).
    held: Vec<(u64, Completion)>,
    polls: u64,
    /// What it did.
    pub log: FaultLog,
}

impl<T: Transport> FaultyTransport<T> {
    /// `inner` under `plan`.
    pub fn new(inner: T, plan: FaultPlan) -> Self {
        Self { inner, plan, attempts: HashMap::new(), held: Vec::new(), polls: 0, log: FaultLog::default() }
    }

    /// The transport inside.
    pub fn inner(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<T: Transport> Transport for FaultyTransport<T> {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        let attempt = self.attempts.entry(block.transfer).or_insert(0);
        let this = *attempt;
        *attempt += 1;
        if draw(self.plan.seed, BUSY | block.transfer << 8 | u64::from(this & 0xff)) < self.plan.busy_per_mille {
            self.log.busy.push((block.transfer, this));
            return Err(TransferError::Busy);
        }
        // SAFETY: the caller's contract is this method's.
        let written = unsafe { self.inner.write(block, now_ns) };
        if written.is_err() {
            self.attempts.remove(&block.transfer);
        }
        written
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        self.polls += 1;
        let before = out.len();
        let moved = self.inner.poll(landing, now_ns, out);
        for mut completion in out.drain(before..).collect::<Vec<_>>() {
            let transfer = completion.transfer;
            self.attempts.remove(&transfer);
            if completion.result.is_ok() && draw(self.plan.seed, LOST_ACK | transfer) < self.plan.lost_ack_per_mille {
                self.log.lost_acks.push(transfer);
                completion.result = Err(TransferError::Timeout);
            }
            let delay = if self.plan.delay_polls_max == 0 {
                0
            } else {
                u64::from(draw(self.plan.seed, DELAY | transfer) % (self.plan.delay_polls_max + 1))
            };
            if delay > 0 {
                self.log.delayed += 1;
            }
            self.held.push((self.polls + delay, completion));
        }
        let polls = self.polls;
        let mut released = false;
        self.held.retain(|(due, completion)| {
            if *due <= polls {
                out.push(completion.clone());
                released = true;
                false
            } else {
                true
            }
        });
        moved || released
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }
}

/// A landing whose slots sometimes change between landing and the check.
#[derive(Debug)]
pub struct FaultyLanding<L> {
    inner: L,
    plan: FaultPlan,
    /// Where each target placed so far lies.
    placed: HashMap<BlockAddr, usize>,
    /// What it did.
    pub log: FaultLog,
}

impl<L: Landing> FaultyLanding<L> {
    /// `inner` under `plan` (its `corrupt_per_mille`).
    pub fn new(inner: L, plan: FaultPlan) -> Self {
        Self { inner, plan, placed: HashMap::new(), log: FaultLog::default() }
    }

    /// The landing inside.
    pub fn inner(&mut self) -> &mut L {
        &mut self.inner
    }
}

fn target_word(target: &BlockAddr) -> u64 {
    u64::from(target.slot) << 32 | u64::from(target.generation)
}

impl<L: Landing> Landing for FaultyLanding<L> {
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus> {
        let at = self.inner.place(target, len)?;
        self.placed.insert(*target, at as usize);
        Ok(at)
    }

    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        let placed = self.placed.remove(target);
        if let Some(at) = placed
            && draw(self.plan.seed, CORRUPT | target_word(target)) < self.plan.corrupt_per_mille
        {
            // One byte of what the check covers: the header, or the payload
            // the header says there is (never the slot's padding).
            let header = STORED_HEADER_BYTES as u64;
            let covered = if len > header {
                // SAFETY: `at` is the slot `place` gave for these `len`
                // bytes, all landed; the header's length field is read as
                // bytes, whatever it holds.
                let bytes = unsafe { core::slice::from_raw_parts(at as *const u8, STORED_HEADER_BYTES) };
                let payload = crate::stored::decode_header(bytes).map_or(0, |h| h.meta().payload_len);
                header + payload.min(len - header)
            } else {
                len
            };
            let offset = u64::from(draw(self.plan.seed, WHERE | target_word(target))) * covered / 1000;
            // SAFETY: offset < covered <= len bytes of the placed slot,
            // which the transport no longer writes (all of it landed).
            let byte = unsafe { (at as *mut u8).add(crate::usize_from(offset)) };
            // SAFETY: as above: a byte of the landed block, no one else's.
            unsafe { *byte ^= 0x5a };
            self.log.corrupted.push(*target);
        }
        self.inner.landed(target, len)
    }

    fn abandoned(&mut self, target: &BlockAddr) {
        self.placed.remove(target);
        self.inner.abandoned(target);
    }

    fn reserve(&mut self, region: u16, epoch: u64, len: u64, namespace: Option<u64>) -> Result<BlockAddr, AckStatus> {
        self.inner.reserve(region, epoch, len, namespace)
    }

    fn admit(&mut self, namespace: u64, len: u64, now_ns: u64) -> Result<(), u64> {
        self.inner.admit(namespace, len, now_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_a_function_of_the_seed_and_what_they_are_about() {
        assert_eq!(draw(7, BUSY | 5), draw(7, BUSY | 5));
        let hits = (0..10_000).filter(|&i| draw(7, LOST_ACK | i) < 100).count();
        // About a tenth, as asked.
        assert!((800..1200).contains(&hits), "{hits}");
        let other = (0..10_000).filter(|&i| draw(8, LOST_ACK | i) < 100).count();
        assert!((800..1200).contains(&other), "{other}");
        assert!((0..64).any(|i| draw(7, LOST_ACK | i) != draw(8, LOST_ACK | i)), "seeds pick differently");
    }
}
