//! `l2` and `block-latency`: Lake's L2 path against the raw io_uring
//! operation beneath it, on the same file, in the same run.
//!
//! `l2`: throughput. Lake writes every slot of a freshly formatted tier
//! through the poller (header sealed, segment CRCs computed) and reads them
//! back (every CRC verified); raw is a plain O_DIRECT io_uring loop over
//! the same file — same registered file and fixed buffers, same queue
//! depth, same offsets and bytes — with no Lake in between. Rounds
//! interleave raw write, Lake write, Lake read, raw read; medians.
//!
//! `block-latency`: one block at a time (queue depth 1), submit to
//! completion: a Lake L2→L1 read (CRCs verified) against a single raw
//! io_uring read of the same bytes into the same L1 slot, interleaved per
//! sample. The CRC check is timed on its own on bytes fresh from the
//! device (as Lake's read meets them), and a no-op backend that completes
//! at once isolates the poller's own cost (less a CRC of cached bytes).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use lake_dp::io::{IoBackend, IoCompletion, IoKind, IoOp};
use lake_dp::l2::{L2Config, L2Tier, format};
use lake_dp::op::{Command, Event, L2Slot, ReadBlock, Request, WriteBlock};
use lake_dp::poller::{L2Geometry, Poller, PollerConfig};
use lake_dp::region::SlotRegion;
use lake_dp::stored::{ObjectMeta, decode_object, object_bytes};
use lake_dp::tag::Tag;
use lake_dp::uring::UringBackend;
use lake_dp::{BlockKey, Durability, NamespaceId, ObjectKind, Priority};

use crate::report::{Report, median, percentile};

/// The L2 goals on this machine's virtual disk.
const GOAL_RATIO: f64 = 0.9;
const GOAL_OVERHEAD_P50_US: f64 = 1.0;

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn meta(geometry: &L2Geometry, epoch: u64, slot: u32, payload_len: u64) -> ObjectMeta {
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&slot.to_le_bytes());
    key[4..].fill(0xb1);
    ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey(key),
        parent_key: BlockKey::NONE,
        block_index: slot,
        namespace: NamespaceId(1),
        layout_fingerprint: 1,
        region: geometry.region(0),
        region_epoch: epoch,
        slot,
        generation: 1,
        committed_unix_ns: 0,
        payload_len,
        // Per-layer segments of a 32-layer model.
        segment_bytes: payload_len.div_ceil(32).next_multiple_of(4096).min(payload_len),
    }
}

struct Setup {
    _file: Scratch,
    tier: L2Tier,
    l1: Arc<SlotRegion>,
    slots: u32,
    slot_bytes: u64,
    payload: u64,
}

fn setup(dir: &str, payload: u64, slots: u32, l1_slots: u32) -> Result<Setup, String> {
    let slot_bytes = object_bytes(payload);
    let path = PathBuf::from(dir).join(format!("lake-bench-l2-{}.lake", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let file = Scratch(path.clone());
    let config = L2Config { paths: vec![path], slots_per_file: slots, slot_bytes, region_first: 0 };
    format(&config).map_err(|e| e.to_string())?;
    let tier = L2Tier::open(&config).map_err(|e| e.to_string())?;
    let l1 = Arc::new(SlotRegion::heap(slot_bytes, l1_slots).map_err(|e| e.to_string())?);
    for slot in 0..l1_slots {
        // SAFETY: a fresh region nothing else uses yet.
        let bytes = unsafe { l1.slot_mut(slot) }.ok_or("L1 slot")?;
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = (i as u64).wrapping_mul(0x9e37_79b9).to_le_bytes()[3];
        }
    }
    Ok(Setup { _file: file, tier, l1, slots, slot_bytes, payload })
}

fn backend(setup: &Setup, depth: u32) -> Result<UringBackend, String> {
    let mut backend =
        UringBackend::new(setup.tier.backend_files().map_err(|e| e.to_string())?, depth).map_err(|e| e.to_string())?;
    // SAFETY: `setup.l1` outlives every backend made from it (the benches
    // drop their pollers and backends before the setup).
    unsafe { backend.register_region(&setup.l1) }.map_err(|e| e.to_string())?;
    Ok(backend)
}

fn poller<B: IoBackend>(setup: &Setup, backend: B, ops: u32) -> Result<Poller<B>, String> {
    let config = PollerConfig {
        epoch: setup.tier.epoch(),
        ops_max: ops,
        batch_max: ops,
        io_retries_max: 2,
        flush_delay_ns: 0,
        flush_batch: 1,
        l2: setup.tier.geometry(),
        background_in_flight_max: 0,
    };
    let mut poller = Poller::new(config, backend, setup.l1.clone()).map_err(|e| e.to_string())?;
    poller.seal();
    Ok(poller)
}

/// Lake: every slot written (or read) through the poller, `depth` at once.
/// Returns seconds.
/// The L1 slot's payload bytes, to seal or open in place.
///
/// # Safety
///
/// The slot is the caller's alone (not in flight) while the slice lives.
unsafe fn payload_of<'slot>(setup: &Setup, l1_slot: u32) -> Result<&'slot mut [u8], String> {
    let base = setup.l1.slot_ptr(l1_slot).ok_or("L1 slot")?;
    let len = usize::try_from(setup.payload).map_err(|_| "payload")?;
    // SAFETY: a slot holds its header and at least `payload` bytes; the
    // caller owns it.
    Ok(unsafe { core::slice::from_raw_parts_mut(base.wrapping_add(lake_dp::constants::STORED_HEADER_BYTES), len) })
}

/// What the pool does to a sealed block read into L1: the payload opened
/// in place, its CRCs made anew over the plaintext, the header rewritten.
fn open_in_slot(setup: &Setup, l1_slot: u32, key: &lake_dp::auth::at_rest::DataKey) -> Result<(), String> {
    let base = setup.l1.slot_ptr(l1_slot).ok_or("L1 slot")?;
    let len = usize::try_from(setup.slot_bytes).map_err(|_| "slot")?;
    // SAFETY: the read completed; the slot is this loop's until it is
    // pushed back on the free list.
    let slot = unsafe { core::slice::from_raw_parts_mut(base, len) };
    let decoded = lake_dp::stored::decode_header(slot).map_err(|e| e.to_string())?;
    let meta = *decoded.meta();
    lake_dp::auth::at_rest::open_object(key, &decoded, &meta, slot).map_err(|e| e.to_string())
}

fn lake_pass(
    setup: &Setup,
    poller: &mut Poller<UringBackend>,
    write: bool,
    key: Option<&lake_dp::auth::at_rest::DataKey>,
) -> Result<f64, String> {
    let geometry = setup.tier.geometry();
    let epoch = setup.tier.epoch();
    let l1_slots = setup.l1.slots();
    let mut free: Vec<u32> = (0..l1_slots).collect();
    let mut events = vec![Event::placeholder(); l1_slots as usize];
    let (mut next, mut done) = (0u32, 0u32);
    let clock = lake_dp::io::MonotonicClock;
    let start = Instant::now();
    while done < setup.slots {
        while next < setup.slots {
            let Some(l1_slot) = free.pop() else { break };
            let target = L2Slot { file: 0, slot: next };
            let command = if write {
                let meta = meta(&geometry, epoch, next, setup.payload);
                // Sealed where it lies, as the pool seals a drained slot.
                let seal = match key {
                    None => None,
                    // SAFETY: the slot is off the free list, not in flight.
                    Some(key) => Some(
                        lake_dp::auth::at_rest::seal(key, &meta, unsafe { payload_of(setup, l1_slot)? })
                            .map_err(|e| e.to_string())?,
                    ),
                };
                Command::Write(WriteBlock { l1_slot, target, meta, durability: Durability::Acked, seal })
            } else {
                let key = meta(&geometry, epoch, next, setup.payload).key;
                Command::Read(ReadBlock { source: target, l1_slot, key, generation: 1, payload_len: setup.payload })
            };
            let request = Request { command, priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
            poller.submit(request).map_err(|r| format!("submit: {}", r.reason))?;
            next += 1;
        }
        poller.poll(lake_dp::io::Clock::now_ns(&clock), l1_slots);
        let count = poller.reap(&mut events);
        for event in &events[..count] {
            event.outcome.map_err(|e| format!("Lake {}: {e}", if write { "write" } else { "read" }))?;
            match event.command {
                Command::Write(w) => free.push(w.l1_slot),
                Command::Read(r) => {
                    if let Some(key) = key {
                        open_in_slot(setup, r.l1_slot, key)?;
                    }
                    free.push(r.l1_slot);
                }
                Command::Flush { .. } => {}
            }
            done += 1;
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Raw: the same transfers straight through io_uring. Returns seconds.
fn raw_pass(setup: &Setup, backend: &mut UringBackend, write: bool) -> Result<f64, String> {
    let l1_slots = setup.l1.slots();
    let mut free: Vec<u32> = (0..l1_slots).collect();
    let mut completions = vec![IoCompletion::default(); l1_slots as usize];
    let len = u32::try_from(setup.slot_bytes).map_err(|_| "slot too large")?;
    let (mut next, mut done) = (0u32, 0u32);
    let start = Instant::now();
    while done < setup.slots {
        while next < setup.slots {
            let Some(l1_slot) = free.pop() else { break };
            let op = IoOp {
                kind: if write { IoKind::Write } else { IoKind::Read },
                file: 0,
                offset: u64::from(next) * setup.slot_bytes,
                buf: setup.l1.slot_ptr(l1_slot).ok_or("L1 slot")?,
                len,
                tag: Tag::new(0, l1_slot, 0),
            };
            // SAFETY: this L1 slot is this loop's alone until its
            // completion comes back.
            unsafe { backend.push(op) }.map_err(|_| "raw push refused")?;
            next += 1;
        }
        backend.submit(0).map_err(|e| e.to_string())?;
        let count = backend.complete(0, &mut completions);
        for completion in &completions[..count] {
            if u32::try_from(completion.result).ok() != Some(len) {
                return Err(format!("raw I/O returned {}", completion.result));
            }
            free.push(completion.tag.slot());
            done += 1;
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// `lake-bench l2`'s flags.
#[derive(clap::Args, Debug)]
pub(crate) struct L2Args {
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 262_144)]
    pub(crate) block_bytes: u64,
    /// Bytes moved per round.
    #[arg(long, default_value_t = 1 << 30)]
    pub(crate) total_bytes: u64,
    /// Directory for the files it makes (removed after).
    #[arg(long)]
    pub(crate) dir: Option<String>,
    /// io_uring queue depth.
    #[arg(long, default_value_t = 32)]
    pub(crate) queue_depth: u32,
    /// Rounds measured.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Seal L2 blocks with a tenant key (AES-256-GCM), as `lake serve --tenant-key`.
    #[arg(long, value_name = "on|off", default_value = "off")]
    pub(crate) encrypt: String,
}

pub(crate) fn run_l2(args: &L2Args) -> Result<Report, String> {
    // `--encrypt on`: every round also writes and reads every block sealed
    // (AES-256-GCM in the slot before the write, opened and its CRCs made
    // anew after the read, as the pool does), for the ratio to plain.
    let encrypt = match args.encrypt.as_str() {
        "on" => Some(lake_dp::auth::at_rest::DataKey::from_bytes([0x24; 32])),
        "off" => None,
        other => return Err(format!("--encrypt is on or off, not {other}")),
    };
    let payload: u64 = args.block_bytes;
    let total: u64 = args.total_bytes;
    let dir: String = args.dir.clone().unwrap_or_default();
    let depth: u32 = args.queue_depth;
    let rounds: usize = args.rounds;
    if dir.is_empty() {
        return Err("--dir is required: a directory on the disk to measure".into());
    }
    if payload == 0 || total < payload || rounds == 0 || depth == 0 || !depth.is_power_of_two() {
        return Err(
            "--block-bytes and --rounds positive, --total-bytes at least one block, --queue-depth a power of two"
                .into(),
        );
    }
    let slots = u32::try_from(total / payload).map_err(|_| "--total-bytes / --block-bytes too large")?;
    let setup = setup(&dir, payload, slots, depth)?;
    let mut lake = poller(&setup, backend(&setup, depth)?, depth)?;
    let mut raw_backend = backend(&setup, depth)?;
    let bytes = setup.slot_bytes as f64 * f64::from(slots);
    let gbps = |seconds: f64| bytes / seconds / 1e9;
    let (mut lw, mut lr, mut rw, mut rr) = (vec![], vec![], vec![], vec![]);
    let (mut ew, mut er) = (vec![], vec![]);
    for _ in 0..rounds {
        // Raw write first: Lake's write then puts back valid objects for
        // Lake's read; the raw read reads whatever is there.
        rw.push(gbps(raw_pass(&setup, &mut raw_backend, true)?));
        lw.push(gbps(lake_pass(&setup, &mut lake, true, None)?));
        lr.push(gbps(lake_pass(&setup, &mut lake, false, None)?));
        rr.push(gbps(raw_pass(&setup, &mut raw_backend, false)?));
        if let Some(key) = &encrypt {
            ew.push(gbps(lake_pass(&setup, &mut lake, true, Some(key))?));
            er.push(gbps(lake_pass(&setup, &mut lake, false, Some(key))?));
        }
    }
    let stats = lake.backend_mut().stats();
    let (lw, lr, rw, rr) = (median(&mut lw), median(&mut lr), median(&mut rw), median(&mut rr));
    let mut report = Report::new("l2");
    report.int("block_bytes", payload);
    report.int("object_bytes", setup.slot_bytes);
    report.int("blocks", u64::from(slots));
    report.int("queue_depth", u64::from(depth));
    report.int("rounds", rounds as u64);
    report.int("lake_unfixed_ops", stats.unfixed);
    report.float("lake_read_gbps", lr);
    report.float("raw_read_gbps", rr);
    report.float("read_ratio", lr / rr);
    report.float("lake_write_gbps", lw);
    report.float("raw_write_gbps", rw);
    report.float("write_ratio", lw / rw);
    report.float("goal_ratio", GOAL_RATIO);
    let met = lr / rr >= GOAL_RATIO && lw / rw >= GOAL_RATIO;
    report.text("goal_met", if met { "yes" } else { "no" });
    if encrypt.is_some() {
        let (ew, er) = (median(&mut ew), median(&mut er));
        report.float("sealed_write_gbps", ew);
        report.float("sealed_read_gbps", er);
        report.float("sealed_write_ratio", ew / lw);
        report.float("sealed_read_ratio", er / lr);
        report.float("sealed_ratio_goal", 0.9);
        // Time added to each block, from the throughput (queue depth
        // blocks in flight hide part of it).
        let per_block_us = |gbps: f64| setup.slot_bytes as f64 / (gbps * 1e9) * 1e6;
        report.float("sealed_write_added_us_per_block", per_block_us(ew) - per_block_us(lw));
        report.float("sealed_read_added_us_per_block", per_block_us(er) - per_block_us(lr));
    }
    drop(lake);
    drop(raw_backend);
    Ok(report)
}

/// A backend that completes every op at once with its full length: what is
/// left of a Lake read is the poller's own work and the CRC check.
#[derive(Debug, Default)]
struct NoopBackend {
    queued: Vec<IoOp>,
}

impl IoBackend for NoopBackend {
    fn queue_depth(&self) -> usize {
        64
    }

    fn in_flight(&self) -> usize {
        self.queued.len()
    }

    unsafe fn push(&mut self, op: IoOp) -> Result<(), IoOp> {
        if self.queued.len() >= 64 {
            return Err(op);
        }
        self.queued.push(op);
        Ok(())
    }

    fn submit(&mut self, _now_ns: u64) -> std::io::Result<usize> {
        Ok(self.queued.len())
    }

    fn complete(&mut self, _now_ns: u64, out: &mut [IoCompletion]) -> usize {
        let count = self.queued.len().min(out.len());
        for (slot, op) in out.iter_mut().zip(self.queued.drain(..count)) {
            let result = if op.kind == IoKind::Fsync { 0 } else { i32::try_from(op.len).unwrap_or(i32::MAX) };
            *slot = IoCompletion { tag: op.tag, result };
        }
        count
    }
}

/// One Lake read at queue depth 1, submit to event. Returns microseconds.
fn lake_read_once<B: IoBackend>(poller: &mut Poller<B>, setup: &Setup, slot: u32) -> Result<f64, String> {
    let key = meta(&setup.tier.geometry(), setup.tier.epoch(), slot, setup.payload).key;
    let read =
        ReadBlock { source: L2Slot { file: 0, slot }, l1_slot: 0, key, generation: 1, payload_len: setup.payload };
    let request = Request { command: Command::Read(read), priority: Priority::CriticalLoad, deadline_ns: 0, cookie: 0 };
    let mut events = [Event::placeholder()];
    let clock = lake_dp::io::MonotonicClock;
    let start = Instant::now();
    poller.submit(request).map_err(|r| format!("submit: {}", r.reason))?;
    loop {
        poller.poll(lake_dp::io::Clock::now_ns(&clock), 8);
        if poller.reap(&mut events) == 1 {
            let elapsed = start.elapsed().as_secs_f64() * 1e6;
            events[0].outcome.map_err(|e| format!("Lake read: {e}"))?;
            return Ok(elapsed);
        }
    }
}

/// One raw io_uring read of the same bytes. Returns microseconds.
fn raw_read_once(backend: &mut UringBackend, setup: &Setup, slot: u32) -> Result<f64, String> {
    let len = u32::try_from(setup.slot_bytes).map_err(|_| "slot too large")?;
    let op = IoOp {
        kind: IoKind::Read,
        file: 0,
        offset: u64::from(slot) * setup.slot_bytes,
        // The same L1 slot as Lake's read: the same memory, equally warm.
        buf: setup.l1.slot_ptr(0).ok_or("L1 slot")?,
        len,
        tag: Tag::new(0, 0, 0),
    };
    let mut completion = [IoCompletion::default()];
    let start = Instant::now();
    // SAFETY: no Lake op holds L1 slot 0 between samples; one op at a time.
    unsafe { backend.push(op) }.map_err(|_| "raw push refused")?;
    backend.submit(0).map_err(|e| e.to_string())?;
    while backend.complete(0, &mut completion) == 0 {
        std::hint::spin_loop();
    }
    let elapsed = start.elapsed().as_secs_f64() * 1e6;
    if u32::try_from(completion[0].result).ok() != Some(len) {
        return Err(format!("raw read returned {}", completion[0].result));
    }
    Ok(elapsed)
}

/// `lake-bench block-latency`'s flags.
#[derive(clap::Args, Debug)]
pub(crate) struct BlockLatencyArgs {
    /// The path timed: l2-to-l1.
    #[arg(long, default_value = "l2-to-l1")]
    pub(crate) path: String,
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 65_536)]
    pub(crate) block_bytes: u64,
    /// Single-block samples timed.
    #[arg(long, default_value_t = 2000)]
    pub(crate) samples: usize,
    /// Directory for the files it makes (removed after).
    #[arg(long)]
    pub(crate) dir: Option<String>,
    /// Blocks.
    #[arg(long, default_value_t = 256)]
    pub(crate) blocks: u32,
}

pub(crate) fn run_block_latency(args: &BlockLatencyArgs) -> Result<Report, String> {
    let path: String = args.path.clone();
    let payload: u64 = args.block_bytes;
    let samples: usize = args.samples;
    let dir: String = args.dir.clone().unwrap_or_else(|| std::env::temp_dir().display().to_string());
    let blocks: u32 = args.blocks;
    if path != "l2-to-l1" {
        return Err(format!("--path {path}: only l2-to-l1 exists so far (the GPU paths are `lake-bench gpu`)"));
    }
    if payload == 0 || samples == 0 || blocks == 0 {
        return Err("--block-bytes, --samples and --blocks must be positive".into());
    }
    let setup = setup(&dir, payload, blocks, 2)?;
    let mut lake = poller(&setup, backend(&setup, 8)?, 2)?;
    // Fill every block through Lake so that reads verify real objects.
    for slot in 0..blocks {
        let meta = meta(&setup.tier.geometry(), setup.tier.epoch(), slot, payload);
        let write = WriteBlock {
            l1_slot: 0,
            target: L2Slot { file: 0, slot },
            meta,
            durability: Durability::Durable,
            seal: None,
        };
        let request =
            Request { command: Command::Write(write), priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
        lake.submit(request).map_err(|r| format!("submit: {}", r.reason))?;
        let mut events = [Event::placeholder()];
        let clock = lake_dp::io::MonotonicClock;
        while lake.reap(&mut events) == 0 {
            lake.poll(lake_dp::io::Clock::now_ns(&clock), 8);
        }
        events[0].outcome.map_err(|e| format!("fill: {e}"))?;
    }
    let mut raw_backend = backend(&setup, 8)?;
    let mut noop = poller(&setup, NoopBackend::default(), 2)?;
    let (mut lake_us, mut raw_us, mut noop_us, mut crc_us, mut crc_hot_us) = (vec![], vec![], vec![], vec![], vec![]);
    let time_crc = |out: &mut Vec<f64>| -> Result<(), String> {
        // SAFETY: no op holds L1 slot 0 between reads.
        let bytes = unsafe { setup.l1.slot(0) }.ok_or("L1 slot")?;
        let start = Instant::now();
        let checked = decode_object(bytes).map_err(|e| e.to_string())?;
        out.push(start.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(checked);
        Ok(())
    };
    let mut rng = 0x1a7e_u64;
    for sample in 0..samples {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let slot = u32::try_from((rng >> 33) % u64::from(blocks)).unwrap_or(0);
        // Alternate which goes first: on a virtual disk the second read of
        // a block in a row is served differently from the first. The CRC
        // is timed right after the raw read, on bytes fresh from the
        // device, as Lake's read meets them (not yet in the CPU's caches).
        if sample % 2 == 0 {
            raw_us.push(raw_read_once(&mut raw_backend, &setup, slot)?);
            time_crc(&mut crc_us)?;
            lake_us.push(lake_read_once(&mut lake, &setup, slot)?);
        } else {
            lake_us.push(lake_read_once(&mut lake, &setup, slot)?);
            raw_us.push(raw_read_once(&mut raw_backend, &setup, slot)?);
            time_crc(&mut crc_us)?;
        }
        // L1 slot 0 holds this block, now in cache: a no-op backend
        // "reads" it in place, leaving the poller's own work and a CRC of
        // cached bytes, which is timed right after.
        noop_us.push(lake_read_once(&mut noop, &setup, slot)?);
        time_crc(&mut crc_hot_us)?;
    }
    let (p50, p99) = (percentile(&mut lake_us.clone(), 500), percentile(&mut lake_us, 990));
    let (raw_p50, raw_p99) = (percentile(&mut raw_us.clone(), 500), percentile(&mut raw_us, 990));
    let noop_p50 = percentile(&mut noop_us, 500);
    let crc = percentile(&mut crc_us, 500);
    let crc_hot = percentile(&mut crc_hot_us, 500);
    let overhead = p50 - raw_p50 - crc;
    let mut report = Report::new("block-latency");
    report.text("path", &path);
    report.int("block_bytes", payload);
    report.int("object_bytes", setup.slot_bytes);
    report.int("samples", samples as u64);
    report.float("p50_us", p50);
    report.float("p99_us", p99);
    report.float("raw_p50_us", raw_p50);
    report.float("raw_p99_us", raw_p99);
    report.float("overhead_p50_us", overhead);
    report.float("crc_us", crc);
    report.float("crc_cached_us", crc_hot);
    report.float("noop_p50_us", noop_p50);
    report.float("poller_p50_us", noop_p50 - crc_hot);
    report.float("goal_overhead_p50_us", GOAL_OVERHEAD_P50_US);
    report.text("goal_met", if overhead <= GOAL_OVERHEAD_P50_US { "yes" } else { "no" });
    drop(lake);
    drop(raw_backend);
    drop(noop);
    Ok(report)
}
