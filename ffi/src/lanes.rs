//! Copy lanes: helper threads that share a large load of L1 hits, or the
//! copies of a save, with the agent's thread, so one batch is checked and
//! copied by several cores at once (`LakeAttachOptions.copy_threads`).
//!
//! Each lane owns a pin array of its own (a pin array has one writer) and
//! does for its share of a load exactly what a pinned load does: pin the
//! slot at its generation, check the stored header (CRC, key, namespace,
//! layout), check each segment's CRC as it is copied into the engine's
//! memory, unpin. Lower-tier blocks stay with the agent's thread, which
//! leases and loads them. For its share of a save, a lane copies engine
//! blocks into the slots the agent reserved, checksumming each segment as
//! it goes; the agent writes the headers and commits once every share is
//! back.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use lake_dp::BlockKey;
use lake_dp::arena::PinArray;
use lake_dp::mirror::MirrorEntry;
use lake_dp::stored::{ReadableObject, Refusal};

use crate::memory::EngineMemory;
use crate::status::LakeStatus;

/// Blocks a lane takes at least (a smaller batch is split by segments).
pub(crate) const LANE_BLOCKS_MIN: usize = 4;

/// A block at least this large is split by segments across the lanes
/// when its batch is too small to split by blocks. Measured on the H200
/// host: for 64 KiB blocks the hand-offs cost what the split saves (one
/// block's p50 18-31 µs unsplit, 19-43 µs split over 2-8 lanes).
pub(crate) const SPLIT_BLOCK_BYTES_MIN: usize = 512 * 1024;

/// How long a lane spins for its next task before it sleeps (tasks come
/// in bursts; a sleeping lane costs a thread wake-up).
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

pub(crate) use lake_dp::stored::Reader;

/// One share of a load.
pub(crate) struct Share {
    pub keys: Arc<[BlockKey]>,
    pub table: Arc<[MirrorEntry]>,
    pub blocks: Arc<[u32]>,
    pub memory: Arc<EngineMemory>,
    pub range: Range<usize>,
    pub reply: SyncSender<(Range<usize>, Vec<LakeStatus>)>,
}

/// Segments of one pinned block: checked and copied by a lane while the
/// sender holds the block's pin.
pub(crate) struct SegmentShare {
    /// The pinned slot's payload.
    payload: *const u8,
    payload_len: usize,
    segment_bytes: usize,
    crcs: Arc<[u32]>,
    segments: Range<usize>,
    memory: Arc<EngineMemory>,
    block: u32,
    reply: SyncSender<bool>,
}

// SAFETY: `payload` points into a slot of the shared arena that the
// sender keeps pinned (so unchanged and mapped) until every share it
// handed out has replied; the lane only reads it.
unsafe impl Send for SegmentShare {}

impl SegmentShare {
    /// Checks and copies its segments; whether all matched their CRCs.
    fn run(&self) -> bool {
        // SAFETY: see the Send impl: pinned, mapped, `payload_len` bytes.
        let payload = unsafe { core::slice::from_raw_parts(self.payload, self.payload_len) };
        for index in self.segments.clone() {
            let start = index * self.segment_bytes;
            let Some(segment) = payload.get(start..(start + self.segment_bytes).min(payload.len())) else {
                return false;
            };
            if crc32fast::hash(segment) != self.crcs[index] || !self.memory.scatter(self.block, start, segment) {
                return false;
            }
        }
        true
    }
}

/// Blocks of a save: copied from the engine's memory into the slots the
/// agent reserved for them, each segment checksummed on the way.
pub(crate) struct SaveShare {
    /// (engine block, its slot's payload area) of each block of the share.
    bodies: Vec<(u32, *mut u8)>,
    /// The share's first block in its batch.
    first: usize,
    /// Payload bytes of a block.
    len: usize,
    segment_bytes: u64,
    memory: Arc<EngineMemory>,
    reply: SyncSender<Saved>,
}

// SAFETY: every `bodies` pointer is the payload area of a slot the
// sender's agent reserved for this save: nobody else writes it, and nobody
// reads it before the agent commits it, which it does only once every
// share it handed out has replied. Each area is in one share only.
unsafe impl Send for SaveShare {}

/// What a save share did: the segment CRCs of its blocks, block after
/// block, and whether each block was copied.
pub(crate) struct Saved {
    first: usize,
    crcs: Vec<u32>,
    filled: Vec<bool>,
}

impl SaveShare {
    fn run(&self) -> Saved {
        let per_block = segments_of(self.len, self.segment_bytes);
        let mut crcs = vec![0u32; per_block * self.bodies.len()];
        let filled = self
            .bodies
            .iter()
            .zip(crcs.chunks_mut(per_block.max(1)))
            .map(|(&(block, body), crcs)| {
                // SAFETY: see the Send impl: a reserved payload area of
                // `len` bytes that only this share writes.
                let out = unsafe { core::slice::from_raw_parts_mut(body, self.len) };
                self.memory.gather_with_crcs(block, out, self.segment_bytes, crcs)
            })
            .collect();
        Saved { first: self.first, crcs, filled }
    }
}

fn segments_of(len: usize, segment_bytes: u64) -> usize {
    len.div_ceil(usize::try_from(segment_bytes).unwrap_or(usize::MAX).max(1))
}

enum Task {
    Blocks(Share),
    Segments(SegmentShare),
    Saves(SaveShare),
}

/// What the lanes have done (added to the agent's figures).
#[derive(Debug, Default)]
pub(crate) struct LaneStats {
    pub l1_reads: AtomicU64,
    pub bytes_read: AtomicU64,
    pub failures: AtomicU64,
    /// What one L1 block's copy into engine memory took, ns (a moving
    /// average over the lanes' copies; 0 before the first).
    pub l1_ns_per_block: AtomicU64,
}

impl LaneStats {
    /// Folds one block's copy time into the moving average (weight 1/8;
    /// lanes racing may drop a sample: it is an estimate).
    fn took(&self, started: std::time::Instant) {
        let average = self.l1_ns_per_block.load(Ordering::Relaxed);
        let next = lake_agent::fold_load_cost(average, started.elapsed());
        self.l1_ns_per_block.store(next, Ordering::Relaxed);
    }
}

/// The lanes of one attached pool.
pub(crate) struct Lanes {
    senders: Vec<SyncSender<Task>>,
    threads: Vec<JoinHandle<()>>,
    pub stats: Arc<LaneStats>,
}

impl Lanes {
    /// Starts one lane per pin array.
    pub(crate) fn start(arrays: Vec<PinArray>, reader: Reader) -> Self {
        let stats = Arc::new(LaneStats::default());
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        for (i, mut pins) in arrays.into_iter().enumerate() {
            let (tx, rx) = sync_channel::<Task>(4);
            let stats = Arc::clone(&stats);
            let spawned = std::thread::Builder::new()
                .name(format!("lake-lane-{i}"))
                .spawn(move || lane(&mut pins, &rx, reader, &stats));
            if let Ok(thread) = spawned {
                senders.push(tx);
                threads.push(thread);
            }
        }
        Self { senders, threads, stats }
    }

    /// Lanes running.
    pub(crate) fn count(&self) -> usize {
        self.senders.len()
    }

    /// Hands `share` to lane `i`; gives it back if the lane is gone.
    pub(crate) fn send(&self, i: usize, share: Share) -> Result<(), Share> {
        self.senders[i].send(Task::Blocks(share)).map_err(|e| match e.0 {
            Task::Blocks(share) => share,
            Task::Segments(_) | Task::Saves(_) => unreachable!("a block share was sent"),
        })
    }
}

impl Drop for Lanes {
    fn drop(&mut self) {
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn lane(pins: &mut PinArray, tasks: &Receiver<Task>, reader: Reader, stats: &LaneStats) {
    let mut last = std::time::Instant::now();
    loop {
        let task = match tasks.try_recv() {
            Ok(task) => task,
            Err(std::sync::mpsc::TryRecvError::Empty) if last.elapsed() < SPIN => {
                std::hint::spin_loop();
                continue;
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => match tasks.recv() {
                Ok(task) => task,
                Err(_) => return,
            },
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
        };
        match task {
            Task::Blocks(share) => {
                let statuses = load_run(pins, &share, reader, stats);
                let _ = share.reply.send((share.range.clone(), statuses));
            }
            Task::Segments(share) => {
                let _ = share.reply.send(share.run());
            }
            Task::Saves(share) => {
                let _ = share.reply.send(share.run());
            }
        }
        last = std::time::Instant::now();
    }
}

/// Loads one L1 block with its segments split across `lanes` and this
/// thread, pinned through `pins` for the whole copy.
pub(crate) fn load_split(
    lanes: &Lanes,
    pins: &mut PinArray,
    entry: &MirrorEntry,
    key: &BlockKey,
    reader: Reader,
    memory: &Arc<EngineMemory>,
    block: u32,
) -> LakeStatus {
    let started = std::time::Instant::now();
    let Ok(pin) = pins.pin(entry.slot, entry.generation) else { return LakeStatus::LakeEvicted };
    let status = split_pinned(lanes, pins.bytes(&pin), key, reader, memory, block);
    pins.unpin(pin);
    let stats = &lanes.stats;
    if status == LakeStatus::LakeOk {
        stats.took(started);
        stats.l1_reads.fetch_add(1, Ordering::Relaxed);
        stats.bytes_read.fetch_add(memory.block_bytes() as u64, Ordering::Relaxed);
    } else {
        stats.failures.fetch_add(1, Ordering::Relaxed);
    }
    status
}

fn split_pinned(
    lanes: &Lanes,
    bytes: &[u8],
    key: &BlockKey,
    reader: Reader,
    memory: &Arc<EngineMemory>,
    block: u32,
) -> LakeStatus {
    let ReadableObject { header, payload, segment_bytes } = match stored(bytes, key, reader, memory.block_bytes()) {
        Ok(stored) => stored,
        Err(status) => return status,
    };
    let crcs: Arc<[u32]> = header.crcs().into();
    let count = crcs.len();
    let parts = count.min(lanes.count() + 1);
    let (reply, replies) = sync_channel(parts);
    let share = |part: usize| SegmentShare {
        payload: payload.as_ptr(),
        payload_len: payload.len(),
        segment_bytes,
        crcs: Arc::clone(&crcs),
        segments: count * part / parts..count * (part + 1) / parts,
        memory: Arc::clone(memory),
        block,
        reply: reply.clone(),
    };
    let mut sent = 0;
    let mut ok = true;
    for part in 1..parts {
        match lanes.senders[part - 1].send(Task::Segments(share(part))) {
            Ok(()) => sent += 1,
            Err(e) => {
                if let Task::Segments(own) = e.0 {
                    ok &= own.run();
                }
            }
        }
    }
    ok &= share(0).run();
    // The pin is released by the caller after this returns: every lane
    // that took a share must have replied first.
    for _ in 0..sent {
        ok &= replies.recv().unwrap_or(false);
    }
    if ok { LakeStatus::LakeOk } else { LakeStatus::LakeBadCrc }
}

/// Copies a save's blocks into their slots, split across `lanes` and this
/// thread (by blocks, at least [`LANE_BLOCKS_MIN`] to a share): `bodies`
/// are (engine block, reserved payload area of `len` bytes). Returns the
/// segment CRCs of each block, block after block, and whether each was
/// copied.
///
/// # Safety
///
/// Each `bodies` area is `len` writable bytes of a slot reserved to the
/// caller's agent, not committed before this returns, and in `bodies`
/// once.
pub(crate) unsafe fn save_split(
    lanes: &Lanes,
    memory: &Arc<EngineMemory>,
    bodies: &[(u32, *mut u8)],
    len: usize,
    segment_bytes: u64,
) -> (Vec<u32>, Vec<bool>) {
    let count = bodies.len();
    let per_block = segments_of(len, segment_bytes);
    let parts = (count / LANE_BLOCKS_MIN).clamp(1, lanes.count() + 1);
    let (reply, replies) = sync_channel(parts);
    let share = |part: usize| {
        let range = count * part / parts..count * (part + 1) / parts;
        SaveShare {
            bodies: bodies[range.clone()].to_vec(),
            first: range.start,
            len,
            segment_bytes,
            memory: Arc::clone(memory),
            reply: reply.clone(),
        }
    };
    let mut crcs = vec![0u32; per_block * count];
    let mut filled = vec![false; count];
    let mut keep = |saved: Saved| {
        crcs[saved.first * per_block..saved.first * per_block + saved.crcs.len()].copy_from_slice(&saved.crcs);
        filled[saved.first..saved.first + saved.filled.len()].copy_from_slice(&saved.filled);
    };
    let mut sent = 0;
    for part in 1..parts {
        match lanes.senders[part - 1].send(Task::Saves(share(part))) {
            Ok(()) => sent += 1,
            Err(e) => {
                if let Task::Saves(own) = e.0 {
                    keep(own.run());
                }
            }
        }
    }
    keep(share(0).run());
    // Only the lanes hold senders now: a lane that dies with its share
    // ends the wait below instead of holding it for good.
    drop(reply);
    // The slots are committed by the caller after this returns: every lane
    // that took a share must have replied first (a lane that died with its
    // share leaves its blocks not filled).
    for _ in 0..sent {
        match replies.recv() {
            Ok(saved) => keep(saved),
            Err(_) => break,
        }
    }
    (crcs, filled)
}

/// Loads `share.range` of a batch of L1 hits through `pins`; one status
/// per block. Stops at the first failure (the rest would be recomputed).
pub(crate) fn load_run(pins: &mut PinArray, share: &Share, reader: Reader, stats: &LaneStats) -> Vec<LakeStatus> {
    let mut statuses = Vec::with_capacity(share.range.len());
    for i in share.range.clone() {
        let entry = &share.table[i];
        let started = std::time::Instant::now();
        let status = match pins.pin(entry.slot, entry.generation) {
            Err(_) => LakeStatus::LakeEvicted,
            Ok(pin) => {
                let status = copy_checked(pins.bytes(&pin), &share.keys[i], reader, &share.memory, share.blocks[i]);
                pins.unpin(pin);
                status
            }
        };
        statuses.push(status);
        if status == LakeStatus::LakeOk {
            stats.took(started);
            stats.l1_reads.fetch_add(1, Ordering::Relaxed);
            stats.bytes_read.fetch_add(share.memory.block_bytes() as u64, Ordering::Relaxed);
        } else {
            stats.failures.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
    statuses
}

/// Checks the stored object in a pinned slot before any of its payload is
/// used ([`ReadableObject::check`]), and that its payload fits an engine
/// block of `capacity` bytes. The status to report otherwise.
pub(crate) fn stored<'a>(
    bytes: &'a [u8],
    key: &BlockKey,
    reader: Reader,
    capacity: usize,
) -> Result<ReadableObject<'a>, LakeStatus> {
    let object = ReadableObject::check(bytes, key, &reader).map_err(|refusal| match refusal {
        Refusal::Damaged => LakeStatus::LakeBadCrc,
        Refusal::AnotherBlock => LakeStatus::LakeEvicted,
        Refusal::NotTheReaders => LakeStatus::LakeLayoutMismatch,
    })?;
    if object.payload.len() > capacity {
        return Err(LakeStatus::LakeLayoutMismatch);
    }
    Ok(object)
}

/// Checks a pinned stored object segment by segment and copies it into
/// engine block `block`: the header (CRC, key, namespace, layout), then
/// each segment's CRC just before its copy, so the copy reads the bytes
/// the check brought into cache.
pub(crate) fn copy_checked(
    bytes: &[u8],
    key: &BlockKey,
    reader: Reader,
    memory: &EngineMemory,
    block: u32,
) -> LakeStatus {
    let object = match stored(bytes, key, reader, memory.block_bytes()) {
        Ok(object) => object,
        Err(status) => return status,
    };
    for segment in object.segments() {
        let Ok((offset, segment)) = segment else { return LakeStatus::LakeBadCrc };
        if !memory.scatter(block, offset, segment) {
            return LakeStatus::LakeInvalidArgument;
        }
    }
    LakeStatus::LakeOk
}
