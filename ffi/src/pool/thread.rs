//! The agent's own thread: the two queues the calls push jobs on, and
//! the loads, saves, leases, pushes and reports it runs off the engine's
//! threads, completing each request on the pool's completion queue.

use super::*;

pub(super) enum Job {
    Accessed {
        keys: Vec<BlockKey>,
        hits: usize,
    },
    Resident {
        keys: Vec<BlockKey>,
        resident: bool,
    },
    Push(Box<crate::push::PushJob>),
    Lease {
        keys: Vec<BlockKey>,
        ttl_ms: u32,
        reply: SyncSender<Option<Granted>>,
    },
    ReleaseLease {
        id: u64,
    },
    /// Blocks only other nodes hold, to be copied into this node's L1.
    Pull {
        pulls: Vec<(BlockKey, lake_dp::mirror::view::Holder)>,
    },
    Load {
        request: u64,
        /// The engine's trace id for it (`lake_set_trace`), 0 untraced.
        trace: u64,
        priority: Priority,
        memory: Memory,
        keys: Vec<BlockKey>,
        table: Vec<MirrorEntry>,
        blocks: Vec<u32>,
    },
    Save {
        request: u64,
        memory: Memory,
        keys: Vec<BlockKey>,
        parents: Vec<BlockKey>,
        blocks: Vec<u32>,
        /// GPU memory: an event on the engine's stream the save's reads
        /// wait for (`lake_submit_save_on_stream`).
        after: Option<Arc<cudarc::driver::CudaEvent>>,
    },
}

// SAFETY: a job carries engine memory addresses (plain integers here); the
// engine registered that memory and promises it stays valid until it
// detaches (the header says so), and only the agent thread touches it.
unsafe impl Send for Job {}

/// A registered engine memory: host memory the agent copies with the CPU,
/// or a GPU's, moved by kernels.
#[derive(Clone)]
pub(super) enum Memory {
    Host(Arc<EngineMemory>),
    Gpu(Arc<GpuMemory>),
}

impl Memory {
    pub(super) fn blocks(&self) -> u32 {
        match self {
            Self::Host(m) => m.blocks(),
            Self::Gpu(m) => m.blocks,
        }
    }
}

/// Jobs queued for the agent thread at most, per queue.
const JOBS_MAX: usize = 1024;

/// The agent thread's two queues — what a request waits for (critical and
/// prefill-to-decode loads, leases) ahead of the rest (saves, prefetches,
/// access reports) — and the thread to wake after a push (an `unpark` is
/// one atomic when it is not asleep).
#[derive(Clone)]
pub(super) struct Queues {
    pub(super) urgent: SyncSender<Job>,
    pub(super) background: SyncSender<Job>,
    pub(super) agent: std::thread::Thread,
}

impl Queues {
    pub(super) fn push(&self, urgent: bool, job: Job) -> Result<(), TrySendError<Job>> {
        let queue = if urgent { &self.urgent } else { &self.background };
        queue.try_send(job)?;
        self.agent.unpark();
        Ok(())
    }
}

/// How long the agent thread spins for the next job before it sleeps.
pub(super) const SPIN: Duration = Duration::from_micros(50);

/// How often, at most, the compute network's rails are reported to the
/// control plane while pushes go on.
const RAILS_REPORT_EVERY: Duration = Duration::from_millis(250);

/// How often the agent thread sends what it queued for `lake-cp` and
/// checks that its `lake-dp` is there (it sleeps at most this long).
const PUMP_EVERY: Duration = Duration::from_millis(5);

pub(super) fn start(
    agent: Agent,
    mirror: MirrorReader,
    pins: PinArray,
    reader: Reader,
    agent_core: Option<usize>,
    lane_pins: Vec<PinArray>,
) -> Result<LakePool, LakeStatus> {
    let arena_region = agent.arena_region();
    let arena_epoch = agent.arena_epoch();
    let has_control_plane = agent.has_control_plane();
    let save_pressure = agent.save_pressure_probe();
    let slot_area = {
        let (base, len) = agent.slot_area();
        (base as usize, len)
    };
    let pins = Arc::new(Mutex::new(pins));
    let lanes = Lanes::start(lane_pins, reader);
    let lane_stats = Arc::clone(&lanes.stats);
    let layers = Arc::new(gpu::LayerEvents::default());
    let shared = AgentShared { lanes, pins: Arc::clone(&pins), reader, arena_region, layers: Arc::clone(&layers) };
    let (urgent, urgent_rx) = sync_channel::<Job>(JOBS_MAX);
    let (background, background_rx) = sync_channel::<Job>(JOBS_MAX);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = sync_channel::<Result<(), String>>(1);
    let cancelled = Arc::new(Mutex::new(HashSet::new()));
    let stats = Arc::new(Mutex::new(AgentStats::default()));
    let alive = Arc::new(AtomicBool::new(true));
    let stop = Arc::new(AtomicBool::new(false));
    let push_rails = Arc::new(Mutex::new(Vec::new()));
    let spans = Arc::new(Mutex::new(VecDeque::with_capacity(lake_agent::SPANS_KEPT)));
    let thread = {
        let (cancelled, stats, alive) = (Arc::clone(&cancelled), Arc::clone(&stats), Arc::clone(&alive));
        let (stop, push_rails, spans) = (Arc::clone(&stop), Arc::clone(&push_rails), Arc::clone(&spans));
        std::thread::Builder::new()
            .name("lake-agent".into())
            .spawn(move || {
                if let Some(core) = agent_core
                    && let Err(e) = lake_dp::os::pin_to_core(core)
                {
                    let _ = ready_tx.send(Err(format!("agent_core {core}: {e}")));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                let queues = (urgent_rx, background_rx);
                let signals = Signals { cancelled, stats, alive, stop, push_rails, spans };
                agent_thread(agent, &queues, &shared, &signals, &done_tx);
            })
            .map_err(|e| fail(LakeStatus::LakeInternal, format!("starting the agent thread: {e}")))?
    };
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(message)) => {
            let _ = thread.join();
            return Err(fail(LakeStatus::LakeInvalidArgument, message));
        }
        Err(_) => return Err(fail(LakeStatus::LakeInternal, "the agent thread did not start")),
    }
    let queues = Queues { urgent, background, agent: thread.thread().clone() };
    Ok(LakePool {
        mirror,
        arena_region,
        arena_epoch,
        pins,
        lane_stats,
        jobs: Some(queues),
        completions: Mutex::new(done_rx),
        cancelled,
        stats,
        alive,
        memories: Mutex::new(Vec::new()),
        gpu: Mutex::new(None),
        slot_area,
        namespace: reader.namespace,
        layout_fingerprint: reader.layout_fingerprint,
        object_kind: reader.kind,
        shard_code: 0,
        shard: ShardMask::WHOLE,
        cluster: Mutex::new(None),
        has_control_plane,
        save_pressure,
        layers,
        next_request: AtomicU64::new(1),
        compute_ns_per_block: AtomicU64::new(0),
        pull_ns_per_block: AtomicU64::new(0),
        thread: Some(thread),
        stop,
        push_rails,
        spans,
    })
}

/// The agent's own thread: runs loads and saves, pumps `lake-cp`.
fn agent_thread(
    mut agent: Agent,
    (urgent, background): &(Receiver<Job>, Receiver<Job>),
    shared: &AgentShared,
    signals: &Signals,
    done: &std::sync::mpsc::Sender<LakeCompletion>,
) {
    let Signals { cancelled, stats, alive, stop, push_rails, spans } = signals;
    let mut last_job = std::time::Instant::now();
    let mut last_pump = last_job;
    // The poller stage: GPU loads on their way, completed when their
    // stream has passed them (oldest first: one stream keeps them in order).
    let mut in_flight: VecDeque<gpu::InFlight> = VecDeque::new();
    // Pushes to other nodes' pools (P→D), polled like loads in flight.
    let mut pushes = crate::push::Pushes::default();
    let epoch_start = std::time::Instant::now();
    // The compute network's rails go to the control plane's metrics too:
    // when pushes end, at most every quarter second while they go on.
    let mut rails_reported = epoch_start;
    loop {
        if stop.load(Ordering::Acquire) {
            for load in in_flight.drain(..) {
                load.abandon(&shared.pins);
            }
            return;
        }
        if !retire(&mut in_flight, &mut agent, shared, stats, done) {
            return;
        }
        if pushes.in_flight() > 0 {
            // Pushes of requests aborted since: what has not gone out stays.
            if let Ok(mut set) = cancelled.lock()
                && !set.is_empty()
            {
                pushes.cancel(&mut set);
            }
            let mut ended = Vec::new();
            pushes.poll(nanos_since(epoch_start), &mut ended);
            // Traced pushes' blocks: before their completions, so a caller
            // that saw its push end finds their spans.
            if !ended.is_empty()
                && let Ok(mut kept) = spans.lock()
            {
                pushes.take_spans(|span| {
                    if kept.len() >= lake_agent::SPANS_KEPT {
                        kept.pop_front();
                    }
                    kept.push_back(LakeTraceSpan::from(span));
                });
            }
            if !ended.is_empty()
                && let Ok(mut rails) = push_rails.lock()
            {
                // Before the completions: a caller that saw its push end
                // sees the bytes it moved.
                *rails = pushes.rail_stats();
                if pushes.in_flight() == 0 || rails_reported.elapsed() >= RAILS_REPORT_EVERY {
                    rails_reported = std::time::Instant::now();
                    let entries: Vec<lake_dp::wire::message::RailEntry> = rails
                        .iter()
                        .map(|r| lake_dp::wire::message::RailEntry {
                            node: r.peer,
                            rail: u16::try_from(r.rail).unwrap_or(u16::MAX),
                            up: u8::from(r.up != 0),
                            reserved: 0,
                            bytes: r.bytes,
                            breaks: r.breaks,
                        })
                        .collect();
                    agent.report_rails(lake_dp::wire::message::Network::Compute, &entries);
                    agent.pump();
                }
            }
            if !complete_each(done, &ended) {
                return;
            }
        }
        if last_pump.elapsed() >= PUMP_EVERY {
            agent.pump();
            if !agent.data_plane_alive() {
                alive.store(false, Ordering::Release);
            }
            last_pump = std::time::Instant::now();
        }
        let job = match urgent.try_recv() {
            Ok(job) => job,
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => match background.try_recv() {
                Ok(job) => job,
                Err(TryRecvError::Disconnected) => return,
                // Right after a job the next one often follows: spin a
                // little before sleeping, so a single block's round trip
                // does not pay a thread wake-up. Loads on the GPU are
                // polled, never slept on.
                Err(TryRecvError::Empty)
                    if last_job.elapsed() < SPIN || !in_flight.is_empty() || pushes.in_flight() > 0 =>
                {
                    std::hint::spin_loop();
                    continue;
                }
                Err(TryRecvError::Empty) => {
                    std::thread::park_timeout(PUMP_EVERY);
                    continue;
                }
            },
        };
        last_job = std::time::Instant::now();
        let (request, count) = match &job {
            Job::Accessed { keys, hits } => {
                agent.report_access(keys, *hits);
                continue;
            }
            Job::Pull { pulls } => {
                agent.pull(pulls);
                continue;
            }
            Job::Resident { keys, resident } => {
                agent.report_resident(keys, *resident);
                continue;
            }
            Job::Push(push) => {
                let mut ended = Vec::new();
                if alive.load(Ordering::Acquire) {
                    pushes.start(&agent, push, nanos_since(epoch_start), &mut ended);
                } else {
                    ended
                        .extend((0..push.keys.len()).map(|i| {
                            (push.request, u32::try_from(i).unwrap_or(u32::MAX), LakeStatus::LakeNotAttached)
                        }));
                }
                if !complete_each(done, &ended) {
                    return;
                }
                continue;
            }
            Job::Lease { keys, ttl_ms, reply } => {
                let _ = reply.try_send(agent.lease_for(keys, *ttl_ms));
                continue;
            }
            Job::ReleaseLease { id } => {
                agent.release_lease(*id);
                continue;
            }
            Job::Load { request, blocks, .. } | Job::Save { request, blocks, .. } => (*request, blocks.len()),
        };
        // A traced load's blocks are loaded under its trace id, and what
        // the agent saw of each kept for `lake_trace_spans`.
        let trace = if let Job::Load { trace, .. } = &job { *trace } else { 0 };
        agent.set_trace(trace);
        let was_cancelled = cancelled.lock().map(|mut c| c.remove(&request)).unwrap_or(false);
        let mut statuses = vec![LakeStatus::LakeOk; count];
        if was_cancelled {
            statuses.fill(LakeStatus::LakeCancelled);
            shared.layers.finished(request);
        } else if !alive.load(Ordering::Acquire) {
            statuses.fill(LakeStatus::LakeNotAttached);
            shared.layers.finished(request);
        } else {
            match job {
                Job::Accessed { .. }
                | Job::Resident { .. }
                | Job::Push(_)
                | Job::Lease { .. }
                | Job::Pull { .. }
                | Job::ReleaseLease { .. } => {}
                Job::Load { memory: Memory::Gpu(memory), keys, table, blocks, priority, .. } => {
                    // Pins are finite: loads in flight hold at most a
                    // layered load's worth; older ones complete first.
                    while !in_flight.is_empty()
                        && in_flight.iter().map(gpu::InFlight::pinned).sum::<usize>() + count > gpu::LAYERED_BLOCKS_MAX
                    {
                        if !retire(&mut in_flight, &mut agent, shared, stats, done) {
                            return;
                        }
                        std::hint::spin_loop();
                    }
                    let (pins, reader, region) = (&shared.pins, shared.reader, shared.arena_region);
                    let events = (request, &*shared.layers);
                    match gpu::load(&mut agent, pins, reader, region, &memory, events, &keys, &table, &blocks, priority)
                    {
                        gpu::Loaded::Done(done) => statuses = done,
                        gpu::Loaded::InFlight(load) => {
                            in_flight.push_back(load);
                            agent.set_trace(0);
                            keep_spans(&mut agent, spans);
                            continue;
                        }
                    }
                    statuses.resize(count, LakeStatus::LakePrefixBroken);
                }
                Job::Save { keys, .. } if agent.save_pressure() => {
                    // The pool refuses saves now: none of it is sent (a
                    // prefix saved in part is of use only up to the part),
                    // and a later save under it is not sent either.
                    statuses.fill(LakeStatus::LakeSavePressure);
                    agent.note_unsaved(&keys);
                    agent.stats.saves_skipped += keys.len() as u64;
                }
                Job::Save { memory: Memory::Gpu(memory), keys, parents, blocks, after, .. } => {
                    statuses = gpu::save(&mut agent, &memory, &keys, &parents, &blocks, after.as_deref());
                }
                Job::Load { memory: Memory::Host(memory), keys, table, blocks, priority, .. } => {
                    let load =
                        LoadJob { memory, keys, table, blocks, priority, request, cancelled: Arc::clone(cancelled) };
                    statuses = run_load(&mut agent, shared, load);
                    // A cancel that came while it ran is spent.
                    if let Ok(mut set) = cancelled.lock() {
                        set.remove(&request);
                    }
                }
                Job::Save { memory: Memory::Host(memory), keys, parents, blocks, .. } => {
                    statuses = run_save(&mut agent, shared, &memory, &keys, &parents, &blocks);
                }
            }
        }
        if let Ok(mut s) = stats.lock() {
            *s = agent.stats;
        }
        if trace != 0 {
            agent.set_trace(0);
            keep_spans(&mut agent, spans);
        }
        if !complete(done, request, statuses) {
            for load in in_flight.drain(..) {
                load.abandon(&shared.pins);
            }
            return;
        }
    }
}

/// Completes the GPU loads in flight that their stream has passed, oldest
/// first (one stream keeps them in order); false once no one takes
/// completions.
fn retire(
    in_flight: &mut VecDeque<gpu::InFlight>,
    agent: &mut Agent,
    shared: &AgentShared,
    stats: &Mutex<AgentStats>,
    done: &std::sync::mpsc::Sender<LakeCompletion>,
) -> bool {
    while let Some(load) = in_flight.front_mut() {
        let Some(statuses) = load.poll(agent, &shared.pins) else { break };
        let request = load.request;
        in_flight.pop_front();
        if let Ok(mut s) = stats.lock() {
            *s = agent.stats;
        }
        if !complete(done, request, statuses) {
            return false;
        }
    }
    true
}

/// Sends completions `(request, index, status)`; false once no one takes
/// them.
fn complete_each(done: &std::sync::mpsc::Sender<LakeCompletion>, ended: &[(u64, u32, LakeStatus)]) -> bool {
    ended.iter().all(|&(request_id, index, status)| done.send(LakeCompletion { request_id, index, status }).is_ok())
}

fn nanos_since(start: std::time::Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Sends a request's completions, one per block; false once no one takes
/// them (the pool is gone).
pub(super) fn complete(
    done: &std::sync::mpsc::Sender<LakeCompletion>,
    request: u64,
    statuses: Vec<LakeStatus>,
) -> bool {
    statuses.into_iter().enumerate().all(|(i, status)| {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        done.send(LakeCompletion { request_id: request, index, status }).is_ok()
    })
}

/// What the engine threads and the agent thread tell each other.
struct Signals {
    cancelled: Arc<Mutex<HashSet<u64>>>,
    stats: Arc<Mutex<AgentStats>>,
    alive: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    push_rails: Arc<Mutex<Vec<LakeRailStat>>>,
    spans: Arc<Mutex<VecDeque<LakeTraceSpan>>>,
}

/// Moves the agent's traced loads into what `lake_trace_spans` hands out
/// (the oldest go past [`lake_agent::SPANS_KEPT`]).
fn keep_spans(agent: &mut Agent, spans: &Mutex<VecDeque<LakeTraceSpan>>) {
    let Ok(mut kept) = spans.lock() else { return };
    agent.take_spans(|span| {
        if kept.len() >= lake_agent::SPANS_KEPT {
            kept.pop_front();
        }
        kept.push_back(LakeTraceSpan::from(span));
    });
}

/// What the agent thread shares with its lanes and the engine threads.
struct AgentShared {
    lanes: Lanes,
    /// The engine threads' pin array: the agent thread's share of a split
    /// load pins through it.
    pins: Arc<Mutex<PinArray>>,
    reader: Reader,
    arena_region: u16,
    /// Per-layer events of GPU loads.
    layers: Arc<gpu::LayerEvents>,
}

struct LoadJob {
    memory: Arc<EngineMemory>,
    keys: Vec<BlockKey>,
    table: Vec<MirrorEntry>,
    blocks: Vec<u32>,
    priority: Priority,
    /// Its request, and the requests `lake_cancel` named: checked between
    /// the blocks the agent loads, so a cancel reaches a load under way.
    request: u64,
    cancelled: Arc<Mutex<HashSet<u64>>>,
}

/// Runs one load; a status per block: the first failure says why, the
/// blocks after it `LakePrefixBroken`. A long leading run of L1 hits is
/// split across the lanes and this thread; the rest goes through the
/// agent (leases, lower-tier loads).
fn run_load(agent: &mut Agent, shared: &AgentShared, job: LoadJob) -> Vec<LakeStatus> {
    let count = job.keys.len();
    let run = job.table.iter().take_while(|e| e.tier == Tier::L1Dram && e.region.0 == shared.arena_region).count();
    let parts = (run / LANE_BLOCKS_MIN).min(shared.lanes.count() + 1);
    if parts < 2 {
        if run == 0 || shared.lanes.count() == 0 || job.memory.block_bytes() < SPLIT_BLOCK_BYTES_MIN {
            return fetch_through_agent(agent, &job, 0);
        }
        // Too few blocks to split by blocks: each is split by segments.
        let mut statuses = vec![LakeStatus::LakePrefixBroken; count];
        let Ok(mut pins) = shared.pins.lock() else { return fetch_through_agent(agent, &job, 0) };
        for i in 0..run {
            statuses[i] = load_split(
                &shared.lanes,
                &mut pins,
                &job.table[i],
                &job.keys[i],
                shared.reader,
                &job.memory,
                job.blocks[i],
            );
            if statuses[i] != LakeStatus::LakeOk {
                return statuses;
            }
        }
        drop(pins);
        if run < count {
            let rest = fetch_through_agent(agent, &job, run);
            statuses[run..].copy_from_slice(&rest);
        }
        return statuses;
    }
    let mut statuses = vec![LakeStatus::LakePrefixBroken; count];
    let keys: Arc<[BlockKey]> = job.keys[..run].into();
    let table: Arc<[MirrorEntry]> = job.table[..run].into();
    let blocks: Arc<[u32]> = job.blocks[..run].into();
    let (reply, replies) = sync_channel(parts);
    let share_of = |part: usize| {
        let range = run * part / parts..run * (part + 1) / parts;
        Share {
            keys: Arc::clone(&keys),
            table: Arc::clone(&table),
            blocks: Arc::clone(&blocks),
            memory: Arc::clone(&job.memory),
            range,
            reply: reply.clone(),
        }
    };
    let mut own = vec![share_of(0)];
    for part in 1..parts {
        if let Err(share) = shared.lanes.send(part - 1, share_of(part)) {
            own.push(share);
        }
    }
    let mut sent = parts - own.len();
    if let Ok(mut pins) = shared.pins.lock() {
        for share in &own {
            let done = load_run(&mut pins, share, shared.reader, &shared.lanes.stats);
            statuses[share.range.start..share.range.start + done.len()].copy_from_slice(&done);
        }
    }
    while sent > 0 {
        let Ok((range, done)) = replies.recv() else { break };
        statuses[range.start..range.start + done.len()].copy_from_slice(&done);
        sent -= 1;
    }
    // Every block of the run copied: the rest of the batch, if any, goes
    // through the agent.
    if statuses[..run].iter().all(|&s| s == LakeStatus::LakeOk) {
        if run < count {
            let rest = fetch_through_agent(agent, &job, run);
            statuses[run..].copy_from_slice(&rest);
        }
        return statuses;
    }
    if let Some(first) = statuses.iter().position(|&s| s != LakeStatus::LakeOk) {
        for status in &mut statuses[first + 1..] {
            *status = LakeStatus::LakePrefixBroken;
        }
    }
    statuses
}

/// Blocks to a host save's turn at most: the slots reserved at once.
const HOST_SAVE_TURN: usize = 64;

/// Runs one save from host memory; a status per block. The save goes in
/// turns: a turn's slots are reserved, its blocks copied into them (split
/// across the lanes and this thread where it has the blocks) with each
/// segment checksummed on the way, then its headers written and commits
/// sent; the next turn is reserved and copied while those commits are
/// answered.
fn run_save(
    agent: &mut Agent,
    shared: &AgentShared,
    memory: &Arc<EngineMemory>,
    keys: &[BlockKey],
    parents: &[BlockKey],
    blocks: &[u32],
) -> Vec<LakeStatus> {
    let len = memory.block_bytes();
    let segment_bytes = agent.segment_bytes_for(len as u64);
    let prepared: Vec<PreparedSave<'_>> = (0..keys.len())
        .map(|i| PreparedSave {
            key: keys[i],
            parent: parents[i],
            block_index: u32::try_from(i).unwrap_or(u32::MAX),
            len,
            crcs: &[],
            // Lake's own copy computes them, from the bytes it copies.
            crcs_from: lake_agent::CrcOrigin::Slot,
        })
        .collect();
    let mut saved = vec![lake_agent::SaveStatus::NotSent; keys.len()];
    agent.forget_unsaved_of(keys);
    let mut answering: Option<(std::ops::Range<usize>, lake_agent::SentCommits)> = None;
    for first in (0..keys.len()).step_by(HOST_SAVE_TURN) {
        let turn_range = first..(first + HOST_SAVE_TURN).min(keys.len());
        let turn = agent.reserve_prepared(&prepared[turn_range.clone()], &mut saved[turn_range.clone()]);
        let bodies: Vec<(u32, *mut u8)> = turn.bodies.iter().map(|&(i, body)| (blocks[first + i], body)).collect();
        // SAFETY: the bodies are payload areas of slots just reserved to
        // this agent, `len` bytes each (the reserve checked), one per
        // block, committed below only after this returns.
        let (crcs, filled) = unsafe { save_split(&shared.lanes, memory, &bodies, len, segment_bytes) };
        // A turn's blocks are committed once the turn before is answered:
        // a block under one refused there is not sent.
        if let Some((range, sent)) = answering.take() {
            agent.await_prepared(sent, &prepared[range.clone()], &mut saved[range]);
        }
        let per_block = crcs.len() / bodies.len().max(1);
        let mut turn_blocks = prepared[turn_range.clone()].to_vec();
        for (k, &(i, _)) in turn.bodies.iter().enumerate() {
            if filled[k] {
                turn_blocks[i].crcs = &crcs[k * per_block..(k + 1) * per_block];
            }
        }
        let sent = agent.commit_prepared(turn, &turn_blocks, true, &mut saved[turn_range.clone()]);
        answering = Some((turn_range, sent));
    }
    if let Some((range, sent)) = answering {
        agent.await_prepared(sent, &prepared[range.clone()], &mut saved[range]);
    }
    saved.into_iter().map(crate::status::status_of_save).collect()
}

/// Loads `job`'s blocks `from..` through the agent: its pin, its leases,
/// its lower-tier loads. A status per block loaded.
fn fetch_through_agent(agent: &mut Agent, job: &LoadJob, from: usize) -> Vec<LakeStatus> {
    let (keys, table, blocks) = (&job.keys[from..], &job.table[from..], &job.blocks[from..]);
    let mut statuses = vec![LakeStatus::LakeOk; keys.len()];
    let mut misfit = None;
    let cancelled = || job.cancelled.lock().is_ok_and(|set| set.contains(&job.request));
    let delivered = agent.fetch_segments_cancellable(keys, table, job.priority, &cancelled, |i, offset, segment| {
        if misfit.is_none() && !job.memory.scatter(blocks[i], offset, segment) {
            misfit = Some(i);
        }
    });
    let failure = crate::status::status_of_fetch(agent.last_fetch_failure());
    // A payload that does not fit the engine's block (raw memory
    // registered smaller than what was saved) is not this reader's:
    // nothing of it was copied.
    let good = misfit.map_or(delivered, |i| i.min(delivered));
    if let Some(status) = statuses.get_mut(good) {
        *status = if good < delivered { LakeStatus::LakeLayoutMismatch } else { failure };
    }
    // Cancelled: every block not delivered says so; otherwise the ones
    // after the first failure break the prefix.
    let after = if failure == LakeStatus::LakeCancelled { failure } else { LakeStatus::LakePrefixBroken };
    for status in statuses.iter_mut().skip(good + 1) {
        *status = after;
    }
    statuses
}
