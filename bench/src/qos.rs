//! `qos`: does a critical-path load stay fast while the pool is flooded
//! with write-back?
//!
//! One embedded pool (`lake-cp` and `lake-dp` in this process, L2 files in
//! `--dir`, on the disk unless told otherwise). A reader engine saves
//! `--set` one-block prompts; L1 holds far fewer (`--l1-slots`), so most
//! are demoted to L2. Then, one at a time, it looks up a random prompt of
//! the set that the mirror shows in L2 and fetches it — the load a request
//! waits for before its first token (lease, the L2 read into an L1 slot,
//! the pinned read) — and times it end to end: first with nothing else
//! running (`unloaded`), then while `--writers` engines save new blocks as
//! fast as the pool takes them, each save pushing an older block out of L1
//! and onto L2 (`loaded`: write-back and demotion saturating the disk
//! and the data plane). The goal: the loaded p99 within 2× the unloaded
//! p99, the same run. A refused save (the pool is full: saves are best
//! effort) is counted and the writer waits `--writer-pause-us` before its
//! next, as an engine goes on computing; 0 makes it spin.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss, clippy::cast_sign_loss)] // percentiles of small positive sample counts

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::rng::SimRng;
use lake_dp::{BlockKey, KeyChain, Namespace, Tier};

use crate::report::Report;

fn namespace() -> Result<Namespace, String> {
    let model =
        lake_dp::ModelIdentity { weights_revision: "qos", tokenizer: "tok", kv_dtype: "bfloat16", kv_scales: &[] }
            .fingerprint();
    let extra = lake_dp::ExtraKeys::default().digest();
    Namespace::new(&lake_dp::TenantKey([7; 32]), lake_dp::KeyScheme::TokenIdsV1, 16, model, extra)
        .map_err(|e| e.to_string())
}

/// The key of one-block prompt `n` (16 tokens of its own).
fn prompt_key(ns: &Namespace, n: u64) -> Result<BlockKey, String> {
    let tokens: Vec<u32> = (0..16).map(|t| (n * 16 + t) as u32).collect();
    KeyChain::keys(ns, &tokens).map_err(|e| e.to_string())?.first().copied().ok_or_else(|| "no key".into())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One timed load, and where its time went (from the agent's trace span
/// of each ask of the data plane).
struct Timed {
    /// Lookup to bytes in hand, µs.
    total_us: f64,
    /// The data plane's own time on the answered ask (its queue, the L2
    /// read), µs.
    data_plane_us: f64,
    /// Asks of the data plane it took (more than one: refused for want of
    /// an L1 slot, or the slot went stale, and asked again).
    asks: u32,
}

/// Loads of random L2-resident prompts of `set`, one at a time, until
/// `loads` are timed or `limit` passes. The loads run under a trace id, so
/// the agent keeps a span of each ask of the data plane.
fn time_loads(agent: &mut Agent, set: &[BlockKey], loads: usize, rng: &mut SimRng, limit: Duration) -> Vec<Timed> {
    let mut timed = Vec::with_capacity(loads);
    let mut table = Vec::new();
    let until = Instant::now() + limit;
    agent.set_trace(0x9_05);
    agent.take_spans(|_| {});
    while timed.len() < loads && Instant::now() < until {
        let key = set[rng.below(set.len() as u64) as usize];
        let started = Instant::now();
        if agent.lookup(&[key], &mut table) != 1 || table[0].tier != Tier::L2Nvme {
            continue;
        }
        let fetched = agent.fetch(&[key], &table, |_, bytes| {
            std::hint::black_box(bytes);
        });
        let total_us = started.elapsed().as_secs_f64() * 1e6;
        let (mut asks, mut data_plane_us) = (0u32, 0.0);
        agent.take_spans(|span| {
            asks += 1;
            if span.result.is_ok() {
                data_plane_us = f64::from(span.data_plane_us);
            }
        });
        if fetched == 1 {
            timed.push(Timed { total_us, data_plane_us, asks });
        }
    }
    agent.set_trace(0);
    timed
}

/// The `p` percentile of one column of `timed`.
fn column(timed: &[Timed], p: f64, of: impl Fn(&Timed) -> f64) -> f64 {
    let mut values: Vec<f64> = timed.iter().map(of).collect();
    values.sort_by(f64::total_cmp);
    percentile(&values, p)
}

/// The run's figures for one set of timed loads (`which`: `unloaded` or
/// `loaded`): the whole load, the data plane's part, the rest (lookup,
/// lease, pin, copy out, waits between asks), and loads asked again.
fn report_loads(report: &mut Report, which: &str, timed: &[Timed]) {
    for (p, name) in [(0.5, "p50"), (0.99, "p99")] {
        report.float(&format!("load_us_{name}_{which}"), column(timed, p, |t| t.total_us));
        report.float(&format!("data_plane_us_{name}_{which}"), column(timed, p, |t| t.data_plane_us));
        report.float(
            &format!("outside_data_plane_us_{name}_{which}"),
            column(timed, p, |t| t.total_us - t.data_plane_us),
        );
    }
    report.int(&format!("loads_asked_again_{which}"), timed.iter().filter(|t| t.asks > 1).count() as u64);
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct QosArgs {
    /// Directory for the files it makes (removed after).
    #[arg(long)]
    pub(crate) dir: Option<String>,
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 256 * 1024)]
    pub(crate) block_bytes: u64,
    /// L1 slots.
    #[arg(long, default_value_t = 64)]
    pub(crate) l1_slots: u32,
    /// Blocks in the working set.
    #[arg(long, default_value_t = 512)]
    pub(crate) set: u64,
    /// Critical-path loads timed.
    #[arg(long, default_value_t = 400)]
    pub(crate) loads: usize,
    /// Writer threads flooding the pool with saves.
    #[arg(long, default_value_t = 1)]
    pub(crate) writers: u32,
    /// Longest run, seconds.
    #[arg(long, default_value_t = 30)]
    pub(crate) seconds: u64,
    /// How long a writer waits after a refused save, µs (0: it spins).
    #[arg(long, default_value_t = 200)]
    pub(crate) writer_pause_us: u64,
    /// Background L2 I/O in the device at once (0: no cap).
    #[arg(long, default_value_t = 0)]
    pub(crate) background_depth: u32,
    /// The last N free L1 slots kept from saves for loads, as `lake serve
    /// --l1-load-reserve` (default: as many as it keeps).
    #[arg(long, value_name = "N")]
    pub(crate) load_reserve: Option<u32>,
}

pub(crate) fn run(args: &QosArgs) -> Result<Report, String> {
    let dir: String =
        args.dir.clone().unwrap_or_else(|| std::env::temp_dir().join("lake-bench-qos").display().to_string());
    let block_bytes: u64 = args.block_bytes;
    let l1_slots: u32 = args.l1_slots;
    let set_size: u64 = args.set;
    let loads: usize = args.loads;
    let writers: u32 = args.writers;
    let seconds: u64 = args.seconds;
    // How long a writer waits after a refused save (0: it spins, trying
    // new blocks at once — on a small machine that takes a core from the
    // pool's own threads).
    let pause_us: u64 = args.writer_pause_us;
    // `--background-depth N`: write-back and demotion I/O in the L2
    // device at once, at most (0: no cap), as `lake serve
    // --l2-background-depth`.
    let background_depth: u32 = args.background_depth;
    // `--load-reserve N`: the last N free L1 slots are kept from saves for
    // loads, as `lake serve --l1-load-reserve` (by default as many as it
    // keeps: 3 of 64 slots at its 95% high-water mark).
    let load_reserve: Option<u32> = args.load_reserve;
    if writers == 0 || set_size < u64::from(l1_slots) * 2 {
        return Err("--writers must be at least 1, --set at least twice --l1-slots".into());
    }
    let dir = std::path::PathBuf::from(dir).join(format!("run-{}", std::process::id()));
    let config = EmbeddedConfig {
        block_bytes,
        l1_slots,
        l2_slots_per_file: (set_size as u32).max(1024) * 4,
        local_agents: 1 + writers,
        l2_background_depth: background_depth,
        l1_load_reserve: load_reserve,
        ..EmbeddedConfig::new(dir.clone())
    };
    let mut pool = EmbeddedPool::start(&config)?;
    let load_reserve_slots = pool.load_reserve_slots;
    let ns = namespace()?;
    let payload = vec![0x5au8; block_bytes as usize];
    let payload = &payload[..];
    let attach = |pool: &mut EmbeddedPool, name: &'static str| {
        let agent_config = AgentConfig {
            arena: &pool.arena,
            mirror: &pool.mirror,
            cp_socket: Some(&pool.cp_socket),
            name,
            namespace: ns.id(),
            layout_fingerprint: 0x9005,
            segment_bytes: 64 * 1024,
            object_kind: lake_dp::ObjectKind::KvBlock,
        };
        Agent::attach(&agent_config, pool.local_ports.remove(0)).map_err(|e| e.to_string())
    };
    let mut reader = attach(&mut pool, "qos-reader")?;
    // The set, saved a window at a time as L1 makes room.
    let set: Vec<BlockKey> = (0..set_size).map(|n| prompt_key(&ns, n)).collect::<Result<_, _>>()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    for key in &set {
        let block =
            SaveBlock { key: *key, parent: BlockKey::NONE, block_index: 0, payload: SavePayload::Bytes(payload) };
        while reader.save(std::slice::from_ref(&block)) != 1 {
            if Instant::now() > deadline {
                return Err("the set could not be saved in 120 s".into());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    // Settled: L1 down to its marks, the rest in L2.
    std::thread::sleep(Duration::from_millis(500));
    let mut rng = SimRng::new(11);
    let limit = Duration::from_secs(seconds);
    let unloaded = time_loads(&mut reader, &set, loads, &mut rng, limit);

    let stop = Arc::new(AtomicBool::new(false));
    let saved = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for w in 0..writers {
        let mut writer = attach(&mut pool, "qos-writer")?;
        let (stop, saved, refused, ns) = (Arc::clone(&stop), Arc::clone(&saved), Arc::clone(&refused), ns);
        let payload = payload.to_vec();
        threads.push(std::thread::spawn(move || {
            let mut n = 1_000_000 * (u64::from(w) + 1);
            while !stop.load(Ordering::Acquire) {
                let Ok(key) = prompt_key(&ns, n) else { return };
                n += 1;
                let block =
                    SaveBlock { key, parent: BlockKey::NONE, block_index: 0, payload: SavePayload::Bytes(&payload) };
                if writer.save(std::slice::from_ref(&block)) == 1 {
                    saved.fetch_add(1, Ordering::Relaxed);
                } else {
                    // Best effort under pressure: skipped, counted; the
                    // engine goes on with its work (here: a short wait,
                    // as its next block takes to compute) rather than spin.
                    refused.fetch_add(1, Ordering::Relaxed);
                    if pause_us > 0 {
                        std::thread::sleep(Duration::from_micros(pause_us));
                    }
                }
            }
        }));
    }
    // Let the flood reach its steady state, then time the same loads.
    std::thread::sleep(Duration::from_millis(500));
    let demotions_before = pool.gauges.demotions.load(Ordering::Relaxed);
    let (saved_before, started) = (saved.load(Ordering::Relaxed), Instant::now());
    let loaded = time_loads(&mut reader, &set, loads, &mut rng, limit);
    let elapsed = started.elapsed().as_secs_f64();
    let demoted = pool.gauges.demotions.load(Ordering::Relaxed) - demotions_before;
    let saved_during = saved.load(Ordering::Relaxed) - saved_before;
    // Aborted requests, still under the flood: a fetch of 64 L2 blocks
    // cancelled 1 ms after it starts (by another thread, as an engine
    // aborting a request would); how long until it returns, and how many
    // of its loads the data plane dropped unread.
    let mut stop_us = Vec::new();
    let (mut delivered, mut asked) = (0usize, 0usize);
    let cancelled_before = reader.stats.loads_cancelled;
    let mut table = Vec::new();
    for trial in 0..30u64 {
        let mut keys: Vec<BlockKey> = Vec::with_capacity(64);
        let mut pick = SimRng::new(1000 + trial);
        while keys.len() < 64 {
            let key = set[pick.below(set.len() as u64) as usize];
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        let found = reader.lookup(&keys, &mut table);
        let in_l2 = table[..found].iter().take_while(|e| e.tier == Tier::L2Nvme).count();
        if in_l2 < 16 {
            continue;
        }
        let flag = Arc::new(AtomicBool::new(false));
        let at = Arc::new(std::sync::Mutex::new(None::<Instant>));
        let timer = {
            let (flag, at) = (Arc::clone(&flag), Arc::clone(&at));
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(1));
                *at.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now());
                flag.store(true, Ordering::Release);
            })
        };
        let cancelled = || flag.load(Ordering::Acquire);
        let got = reader.fetch_cancellable(&keys[..in_l2], &table[..in_l2], &cancelled, |_, bytes| {
            std::hint::black_box(bytes);
        });
        let returned = Instant::now();
        let _ = timer.join();
        if let Some(at) = *at.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            stop_us.push(returned.saturating_duration_since(at).as_secs_f64() * 1e6);
        }
        delivered += got;
        asked += in_l2;
    }
    stop_us.sort_by(f64::total_cmp);
    let loads_dropped = reader.stats.loads_cancelled - cancelled_before;
    stop.store(true, Ordering::Release);
    for thread in threads {
        let _ = thread.join();
    }
    drop(reader);
    pool.stop()?;
    let _ = std::fs::remove_dir_all(&dir);

    if unloaded.len() < 20 || loaded.len() < 20 {
        return Err(format!("too few L2 loads timed: {} unloaded, {} loaded", unloaded.len(), loaded.len()));
    }
    let mut report = Report::new("qos");
    report.int("block_bytes", block_bytes);
    report.int("l1_slots", u64::from(l1_slots));
    report.int("set_blocks", set_size);
    report.int("writers", u64::from(writers));
    report.int("loads_unloaded", unloaded.len() as u64);
    report.int("loads_loaded", loaded.len() as u64);
    report_loads(&mut report, "unloaded", &unloaded);
    report_loads(&mut report, "loaded", &loaded);
    let p99 = |timed: &[Timed]| column(timed, 0.99, |t| t.total_us);
    report.float("p99_ratio", p99(&loaded) / p99(&unloaded).max(1e-9));
    report.float("p99_ratio_goal", 2.0);
    report.float("writeback_saves_per_s", saved_during as f64 / elapsed);
    report.float("demotion_mb_per_s", (demoted * block_bytes) as f64 / elapsed / 1e6);
    report.int("saves_refused", refused.load(Ordering::Relaxed));
    report.int("writer_pause_us", pause_us);
    report.int("background_depth", u64::from(background_depth));
    report.int("load_reserve_slots", u64::from(load_reserve_slots));
    report.int("cancel_trials", stop_us.len() as u64);
    report.int("cancel_blocks_asked", asked as u64);
    report.int("cancel_blocks_delivered", delivered as u64);
    report.int("cancel_loads_dropped_unread", loads_dropped);
    report.float("cancel_to_return_us_p50", percentile(&stop_us, 0.5));
    report.float("cancel_to_return_us_max", stop_us.last().copied().unwrap_or(0.0));
    Ok(report)
}
