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

use crate::arena::{Arena, ArenaError, PinArray};
use crate::model::key::BlockKey;
use crate::runner::os::Wakeup;
use crate::stored::decode_header;

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
