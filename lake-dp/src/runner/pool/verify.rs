//! The background commit check on a thread of its own: published L1
//! blocks whose payloads were not read at commit are read here, off the
//! poller's core, against the CRCs in their headers.
//!
//! The poller hands over `(slot, generation)` jobs and takes verdicts back
//! through two bounded channels of the same depth; it never has more jobs
//! out than that depth, so neither side blocks the other: the poller only
//! tries, and a verdict always has room. The thread reads a slot through a
//! pin of its own agent record, as any reader does, so the slot cannot be
//! reused under it; a slot whose generation moved on (evicted, demoted)
//! is not read at all.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::thread::JoinHandle;

use super::{L1State, Unverified, VERIFY_BYTES_PER_PASS};
use crate::arena::{Arena, ArenaError, PinArray, SlotTable};
use crate::constants::STORED_HEADER_BYTES;
use crate::io::IoBackend;
use crate::model::key::BlockKey;
use crate::runner::Parts;
use crate::runner::os::Wakeup;
use crate::stored::decode_header;
use crate::wire::message::{BlockEvicted, EvictReason};

/// A committed block to read: its L1 slot and the generation committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Job {
    pub slot: u32,
    pub generation: u32,
}

/// What the read of a job found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Every segment matches its CRC.
    Sound,
    /// A segment (or the header) does not: the block's key, if its header
    /// still decodes.
    Corrupt(Option<BlockKey>),
    /// The slot moved on before it was read: nothing to say.
    Gone,
}

/// A job's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    pub job: Job,
    pub outcome: Outcome,
}

/// The poller's end of the check thread.
pub(crate) struct Verifier {
    jobs: Option<SyncSender<Job>>,
    verdicts: Receiver<Verdict>,
    thread: Option<JoinHandle<()>>,
    depth: usize,
    out: usize,
}

impl core::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Verifier").field("depth", &self.depth).field("out", &self.out).finish_non_exhaustive()
    }
}

impl Verifier {
    /// Starts the thread over `arena` (one agent record of it is taken for
    /// its pins), with `depth` jobs out at most; `wakeup` is rung after
    /// each verdict so a parked poller takes it.
    pub(crate) fn start(arena: &Arena, depth: usize, wakeup: Arc<Wakeup>) -> Result<Self, ArenaError> {
        assert!(depth > 0);
        let pins = arena.claim_agent()?;
        let (jobs, job_rx) = sync_channel(depth);
        let (verdict_tx, verdicts) = sync_channel(depth);
        let thread = std::thread::Builder::new()
            .name("lake-dp-verify".into())
            .spawn(move || check_loop(pins, &job_rx, &verdict_tx, &wakeup))
            .map_err(|e| ArenaError::Io { what: "starting the commit check thread", path: None, source: e })?;
        Ok(Self { jobs: Some(jobs), verdicts, thread: Some(thread), depth, out: 0 })
    }

    /// Hands `job` over; false when `depth` jobs are out (or the thread is
    /// gone): the caller keeps it for a later pass.
    pub(crate) fn offer(&mut self, job: Job) -> bool {
        if self.out >= self.depth {
            return false;
        }
        match self.jobs.as_ref().map(|jobs| jobs.try_send(job)) {
            Some(Ok(())) => {
                self.out += 1;
                true
            }
            Some(Err(TrySendError::Full(_) | TrySendError::Disconnected(_))) | None => false,
        }
    }

    /// A verdict, if one is back.
    pub(crate) fn verdict(&mut self) -> Option<Verdict> {
        match self.verdicts.try_recv() {
            Ok(verdict) => {
                self.out -= 1;
                Some(verdict)
            }
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => None,
        }
    }

    /// Jobs handed over whose verdicts are not taken yet.
    pub(crate) fn out(&self) -> usize {
        self.out
    }
}

impl Drop for Verifier {
    fn drop(&mut self) {
        // Closing the job channel ends the thread once it has answered what
        // it holds (its verdicts always have room).
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn check_loop(mut pins: PinArray, jobs: &Receiver<Job>, verdicts: &SyncSender<Verdict>, wakeup: &Wakeup) {
    while let Ok(job) = jobs.recv() {
        let outcome = check(&mut pins, job);
        if verdicts.send(Verdict { job, outcome }).is_err() {
            return;
        }
        wakeup.wake_if_parked();
    }
}

/// Reads one committed block under a pin, with the check a commit gets
/// inline.
fn check(pins: &mut PinArray, job: Job) -> Outcome {
    let Ok(pin) = pins.pin(job.slot, job.generation) else { return Outcome::Gone };
    let bytes = pins.bytes(&pin);
    let outcome = match super::check_object(bytes, true) {
        Ok(_) => Outcome::Sound,
        // Its header was checked at commit: one that no longer decodes
        // changed under the pin, which only a broken agent does.
        Err(_) => Outcome::Corrupt(decode_header(bytes).ok().map(|decoded| decoded.meta().key)),
    };
    pins.unpin(pin);
    outcome
}

/// The poller's side of the check: commits handed to the thread and its
/// verdicts taken back, or (without the thread) a share read each pass.
impl super::Pool {
    /// The background commit check: reads up to [`VERIFY_BYTES_PER_PASS`]
    /// of the oldest unchecked commits' payloads (at least one segment); a
    /// block that fails is evicted as corrupt and reported. Returns the
    /// segments read (work done, so the runner does not park meanwhile).
    pub(super) fn verify_backlog<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>) -> u32 {
        if self.verifier.is_some() {
            return self.verify_on_thread(parts);
        }
        let mut read = 0u64;
        let mut segments = 0;
        while read < VERIFY_BYTES_PER_PASS {
            let Some(&Unverified { slot, generation, next_segment }) = self.unverified.front() else { break };
            // Evicted, demoted or freed since: nothing left to check.
            if !self.still_committed(slot, generation, parts.table) {
                self.unverified.pop_front();
                continue;
            }
            // SAFETY: a ready slot is not written again until it is
            // retired, which this thread alone does.
            let Some(bytes) = (unsafe { parts.region.slot(slot) }) else {
                self.unverified.pop_front();
                continue;
            };
            let Ok(decoded) = decode_header(bytes) else {
                // Its header was checked at commit: the slot changed under
                // us, which only a broken agent does. Treat it as corrupt.
                self.unverified.pop_front();
                self.evict_corrupt(slot, generation, None, parts);
                continue;
            };
            let meta = *decoded.meta();
            let Some((offset, len)) = meta.segment_range(next_segment) else {
                self.unverified.pop_front();
                self.stats.commits_verified += 1;
                continue;
            };
            let start = STORED_HEADER_BYTES as u64 + offset;
            let segment = usize::try_from(start)
                .ok()
                .zip(usize::try_from(start + len).ok())
                .and_then(|(from, to)| bytes.get(from..to));
            segments += 1;
            read += len;
            match segment.map(|s| decoded.verify_segment(next_segment, s)) {
                Some(Ok(())) => {
                    if let Some(front) = self.unverified.front_mut() {
                        front.next_segment += 1;
                    }
                }
                _ => {
                    self.unverified.pop_front();
                    self.evict_corrupt(slot, generation, Some(meta.key), parts);
                }
            }
        }
        segments
    }

    /// The background check by its thread: its verdicts taken (a block
    /// found corrupt evicted, if it is still the one committed), the
    /// oldest commits handed over while it has room. Returns the items
    /// moved.
    fn verify_on_thread<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>) -> u32 {
        let mut done = 0;
        while let Some(Verdict { job, outcome }) = self.verifier.as_mut().and_then(Verifier::verdict) {
            done += 1;
            match outcome {
                Outcome::Sound => self.stats.commits_verified += 1,
                // Still the block the thread read: it goes.
                Outcome::Corrupt(key) if self.still_committed(job.slot, job.generation, parts.table) => {
                    self.evict_corrupt(job.slot, job.generation, key, parts);
                }
                Outcome::Corrupt(_) | Outcome::Gone => {}
            }
        }
        while let Some(&Unverified { slot, generation, .. }) = self.unverified.front()
            && self.verifier.as_mut().is_some_and(|verifier| verifier.offer(Job { slot, generation }))
        {
            self.unverified.pop_front();
            done += 1;
        }
        done
    }

    /// Whether L1 `slot` still holds the block committed at `generation`
    /// (not evicted, demoted or freed since).
    fn still_committed(&self, slot: u32, generation: u32, table: &SlotTable) -> bool {
        self.l1.get(slot as usize) == Some(&L1State::Ready) && table.arena().generation(slot) == Some(generation)
    }

    /// A published L1 block failed the background check: freed (once no
    /// reader pins it) and reported evicted as corrupt.
    pub(super) fn evict_corrupt<B: IoBackend>(
        &mut self,
        slot: u32,
        generation: u32,
        key: Option<BlockKey>,
        parts: &mut Parts<'_, B>,
    ) {
        self.stats.commits_corrupt_late += 1;
        self.release_l1(slot, parts.table);
        self.stats.evictions += 1;
        if let (Some(cp), Some(key)) = (parts.link.as_mut(), key) {
            let replica = self.l1_replica(slot, generation);
            cp.evicted(&BlockEvicted { replica, key, reason: EvictReason::Corrupt as u8, reserved: [0; 7] });
        }
    }
}
