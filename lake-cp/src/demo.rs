//! The embedded single-node pool, and a multi-turn agent workload against
//! it: what `lake demo` runs.
//!
//! One process, no external service: `lake-cp` (server, tier manager,
//! mirror in /dev/shm, metrics on a local port) on one thread, a `lake-dp`
//! runner (L1 arena in /dev/shm, L2 files in a directory, io_uring) on
//! another, and engine threads that each attach an agent — the same API
//! an engine uses. Each engine drives several conversations that share a
//! long system prompt; every turn is the previous context plus the reply
//! plus a new message. Per turn the engine computes the prompt's block
//! keys in its namespace, looks the prefix up in the mirror, fetches the
//! hit blocks (L1 through pins, L2 through leases and promotions, every
//! payload compared with what the model would have computed), "prefills"
//! the rest (the stand-in KV is a function of the block key, which names
//! the whole prefix), saves it, "decodes" a reply and saves that too.
//!
//! L1 is sized below the working set, so the control plane demotes cold
//! leaves to L2 and the conversations come back to find their history
//! there.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_dp::model::layout::LayoutParams;
use lake_dp::rng::SimRng;
use lake_dp::runner::RunnerStats;
use lake_dp::{
    BlockKey, Dtype, ExtraKeys, KeyChain, KeyScheme, KvPlanes, Layout, ModelIdentity, Namespace, Shard, TenantKey, Tier,
};

use crate::embedded::{EmbeddedConfig, EmbeddedPool, Gauges};
use crate::tier::{TierConfig, TierUsage};

/// The shared system prompt: the same tokens in every conversation.
fn system_prompt(config: &DemoConfig, block_tokens: usize) -> Vec<u32> {
    let mut system = SimRng::new(config.seed ^ 0x5157_5e70);
    (0..config.system_blocks as usize * block_tokens)
        .map(|_| u32::try_from(system.below(151_936)).unwrap_or(0))
        .collect()
}

/// What the demo runs.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Where the L2 files and the socket go (created; removed after).
    pub dir: PathBuf,
    /// Engine threads, one agent each.
    pub engines: u32,
    /// Conversations, spread over the engines.
    pub sessions: u32,
    /// Turns per conversation.
    pub turns: u32,
    /// Blocks of the shared system prompt.
    pub system_blocks: u32,
    /// Blocks of each new user message (at most; at least one).
    pub message_blocks: u32,
    /// Blocks of each reply (at most; at least one).
    pub reply_blocks: u32,
    /// L1 slots (one block each).
    pub l1_slots: u32,
    /// L2 slots per file (two files).
    pub l2_slots_per_file: u32,
    /// Seed of the token streams.
    pub seed: u64,
    /// Seconds to keep the pool up after the conversations, for the
    /// operator's commands (`lake top`, `lake inspect`; 0: none).
    pub hold_s: u64,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            dir: std::env::temp_dir().join(format!("lake-demo-{}", std::process::id())),
            engines: 2,
            sessions: 64,
            turns: 16,
            system_blocks: 64,
            message_blocks: 4,
            reply_blocks: 4,
            l1_slots: 384,
            l2_slots_per_file: 4096,
            seed: 1,
            hold_s: 0,
        }
    }
}

/// Percentiles of a sample, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th.
    pub p90: f64,
    /// 99th.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

#[allow(clippy::cast_precision_loss)] // latencies in ns: far below 2^52
fn percentiles(samples: &mut [u64]) -> Percentiles {
    if samples.is_empty() {
        return Percentiles::default();
    }
    samples.sort_unstable();
    let at = |q: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // an index in range
        let i = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[i] as f64 / 1000.0
    };
    Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99), max: at(1.0) }
}

/// What the demo measured.
#[derive(Clone, Debug, Default)]
pub struct DemoReport {
    /// Turns run.
    pub turns: u64,
    /// Prompt blocks asked for.
    pub blocks_requested: u64,
    /// Blocks served from the pool (a cached prefix, delivered and checked).
    pub blocks_served: u64,
    /// Blocks looked up as hits but not delivered (evicted in between).
    pub fetch_failures: u64,
    /// Payloads that differed from what the model computes (must be 0).
    pub mismatches: u64,
    /// Blocks saved, and skipped.
    pub saves: (u64, u64),
    /// Blocks served from L1 and from L2 (promoted).
    pub served_l1: u64,
    /// Blocks loaded from L2.
    pub served_l2: u64,
    /// Tier usage at the end: L1, L2.
    pub tiers: [TierUsage; 2],
    /// Moves the control plane asked: demotions L1→L2, drops from L1, L2.
    pub moves: (u64, u64, u64),
    /// The data plane's figures.
    pub data_plane: RunnerStats,
    /// Lookup latency (mirror, per request).
    pub lookup_us: Percentiles,
    /// Fetch latency per request with a hit (all its blocks).
    pub fetch_us: Percentiles,
    /// Save latency per request (all its new blocks).
    pub save_us: Percentiles,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// The metrics endpoint's address while it ran.
    pub metrics: Option<std::net::SocketAddr>,
    /// Lines of the metrics exposition read at the end.
    pub metrics_lines: usize,
}

impl DemoReport {
    /// Blocks served from the pool / blocks asked for.
    pub fn hit_rate(&self) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let rate = self.blocks_served as f64 / self.blocks_requested.max(1) as f64;
        rate
    }
}

#[derive(Default)]
struct Live {
    turns: AtomicU64,
    requested: AtomicU64,
    served: AtomicU64,
    mismatches: AtomicU64,
}

/// The model the demo's engine "runs": small, so the demo moves many
/// blocks quickly.
fn layout() -> Result<Layout, String> {
    Layout::new(LayoutParams {
        layers: 4,
        planes: KvPlanes::KeyValue,
        kv_heads: 2,
        shard: Shard::Heads { start: 0, end: 2 },
        head_dim: 64,
        dtype: Dtype::Bf16,
        block_tokens: 16,
        layers_per_segment: 1,
    })
    .map_err(|e| format!("layout: {e}"))
}

/// The stand-in for the model's KV of the block named `key` (a key names
/// its whole prefix, so this is a function of the prefix, as real KV is).
fn kv_bytes(key: &BlockKey, out: &mut [u8]) {
    let mut rng = SimRng::new(u64::from_le_bytes(key.0[..8].try_into().unwrap_or([0; 8])));
    for chunk in out.chunks_mut(8) {
        let word = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// Runs the pool and the workload; writes a progress line about once a
/// second to `progress`.
pub fn run(config: &DemoConfig, progress: &mut dyn Write) -> Result<DemoReport, String> {
    if config.engines == 0 || config.sessions == 0 || config.turns == 0 {
        return Err("engines, sessions and turns must be above 0".into());
    }
    let started = Instant::now();
    let layout = layout()?;
    let block_bytes = layout.block_bytes();
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes,
        l1_slots: config.l1_slots,
        l2_slots_per_file: config.l2_slots_per_file,
        local_agents: config.engines,
        remote_agents: 1,
        // Headroom in L1 for bursts of saves and promotions between passes.
        tiers: TierConfig { high_percent: 80, low_percent: 60, ..TierConfig::default() },
        metrics: Some(crate::embedded::METRICS_ANY_LOCAL_PORT),
        ..EmbeddedConfig::new(config.dir.clone())
    })?;
    let live = Arc::new(Live::default());
    let metrics = pool.metrics;
    let agent_ports = std::mem::take(&mut pool.local_ports);
    let (shm, mirror_path, socket) = (pool.arena.clone(), pool.mirror.clone(), pool.cp_socket.clone());

    // The engines.
    let model = ModelIdentity {
        weights_revision: "lake-demo/tiny-4L@1",
        tokenizer: "demo-tokenizer",
        kv_dtype: "bfloat16",
        kv_scales: &[],
    };
    let namespace = Namespace::new(
        &TenantKey([0x42; 32]),
        KeyScheme::TokenIdsV1,
        u32::from(layout.block_tokens()),
        model.fingerprint(),
        ExtraKeys::default().digest(),
    )
    .map_err(|e| format!("namespace: {e}"))?;
    let mut engines = Vec::new();
    for (e, agent_port) in agent_ports.into_iter().enumerate() {
        let agent_config = AgentConfig {
            arena: &shm,
            mirror: &mirror_path,
            cp_socket: Some(&socket),
            name: "demo-engine",
            namespace: namespace.id(),
            layout_fingerprint: layout.fingerprint(),
            segment_bytes: layout.segment_bytes(),
            object_kind: lake_dp::ObjectKind::KvBlock,
        };
        let agent = Agent::attach(&agent_config, agent_port).map_err(|e| e.to_string())?;
        let (config, live) = (config.clone(), Arc::clone(&live));
        let engine = u32::try_from(e).unwrap_or(0);
        engines.push(
            std::thread::Builder::new()
                .name(format!("engine-{e}"))
                .spawn(move || Engine::new(agent, namespace, engine, &config, block_bytes).run(&config, &live))
                .map_err(|e| e.to_string())?,
        );
    }

    // Progress until the engines finish.
    let total_turns = u64::from(config.sessions) * u64::from(config.turns);
    let mut next = Instant::now() + Duration::from_secs(1);
    while !engines.iter().all(std::thread::JoinHandle::is_finished) {
        std::thread::sleep(Duration::from_millis(20));
        if Instant::now() >= next {
            next += Duration::from_secs(1);
            let _ =
                writeln!(progress, "{}", progress_line(&live, &pool.gauges, total_turns, started, config, block_bytes));
        }
    }
    let mut report = DemoReport { block_bytes, metrics, ..DemoReport::default() };
    let mut lookups = Vec::new();
    let mut fetches = Vec::new();
    let mut saves = Vec::new();
    for engine in engines {
        let done = engine.join().map_err(|_| "an engine thread panicked")?;
        report.turns += done.turns;
        report.blocks_requested += done.requested;
        report.blocks_served += done.served;
        report.mismatches += done.mismatches;
        report.fetch_failures += done.stats.fetch_failures;
        report.saves.0 += done.stats.saves;
        report.saves.1 += done.stats.saves_skipped;
        report.served_l1 += done.stats.l1_reads;
        report.served_l2 += done.stats.l2_loads;
        lookups.extend(done.lookup_ns);
        fetches.extend(done.fetch_ns);
        saves.extend(done.save_ns);
    }
    report.lookup_us = percentiles(&mut lookups);
    report.fetch_us = percentiles(&mut fetches);
    report.save_us = percentiles(&mut saves);
    if let Some(address) = metrics {
        report.metrics_lines = http_get(address, "/metrics").map_or(0, |text| text.lines().count());
    }
    let _ = writeln!(progress, "{}", progress_line(&live, &pool.gauges, total_turns, started, config, block_bytes));

    if config.hold_s > 0 {
        // A block every conversation shares, for `lake inspect`.
        let first = system_prompt(config, namespace.block_tokens() as usize);
        let block = first.get(..namespace.block_tokens() as usize).unwrap_or_default();
        let key = KeyChain::keys(&namespace, block).unwrap_or_default();
        let key: String = key.first().map(|k| k.0.iter().map(|b| format!("{b:02x}")).collect()).unwrap_or_default();
        let _ = writeln!(
            progress,
            "{{\"event\":\"holding\",\"seconds\":{},\"admin_socket\":\"{}\",\"arena\":\"{}\",\"metrics\":\"{}\",\
             \"namespace\":\"{:016x}\",\"system_prompt_first_key\":\"{key}\"}}",
            config.hold_s,
            pool.admin_socket.display(),
            pool.arena.display(),
            metrics.map_or_else(String::new, |a| a.to_string()),
            namespace.id().0,
        );
        let _ = progress.flush();
        std::thread::sleep(Duration::from_secs(config.hold_s));
    }
    let (data_plane, server) = pool.stop()?;
    report.data_plane = data_plane;
    let tiers = &server.node().tiers;
    report.tiers = [tiers.usage(Tier::L1Dram), tiers.usage(Tier::L2Nvme)];
    let c = tiers.counters;
    report.moves = (c.demotions + c.cleanings, c.drops[Tier::L1Dram as usize], c.drops[Tier::L2Nvme as usize]);
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

#[allow(clippy::cast_precision_loss)]
fn progress_line(
    live: &Live,
    gauges: &Gauges,
    total: u64,
    started: Instant,
    config: &DemoConfig,
    block_bytes: u64,
) -> String {
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let slot = lake_dp::stored::object_bytes(block_bytes);
    let requested = live.requested.load(Ordering::Relaxed);
    let served = live.served.load(Ordering::Relaxed);
    format!(
        "[{:5.1}s] turns {}/{} | hit {:.1}% | L1 {:.1}/{:.1} MiB | L2 {:.1}/{:.1} MiB | demoted {} | mismatches {}",
        started.elapsed().as_secs_f64(),
        live.turns.load(Ordering::Relaxed),
        total,
        100.0 * served as f64 / requested.max(1) as f64,
        mib(gauges.l1_bytes.load(Ordering::Relaxed)),
        mib(u64::from(config.l1_slots) * slot),
        mib(gauges.l2_bytes.load(Ordering::Relaxed)),
        mib(2 * u64::from(config.l2_slots_per_file) * slot),
        gauges.demotions.load(Ordering::Relaxed),
        live.mismatches.load(Ordering::Relaxed),
    )
}

/// One conversation: its token history.
struct Session {
    tokens: Vec<u32>,
    rng: SimRng,
}

struct Engine {
    agent: Agent,
    namespace: Namespace,
    sessions: Vec<Session>,
    block_tokens: usize,
    block_bytes: usize,
}

struct EngineDone {
    turns: u64,
    requested: u64,
    served: u64,
    mismatches: u64,
    stats: lake_agent::AgentStats,
    lookup_ns: Vec<u64>,
    fetch_ns: Vec<u64>,
    save_ns: Vec<u64>,
}

impl Engine {
    fn new(agent: Agent, namespace: Namespace, engine: u32, config: &DemoConfig, block_bytes: u64) -> Self {
        let block_tokens = namespace.block_tokens() as usize;
        let system = system_prompt(config, block_tokens);
        let sessions = (0..config.sessions)
            .filter(|s| s % config.engines == engine)
            .map(|s| Session {
                tokens: system.clone(),
                rng: SimRng::new(config.seed.wrapping_mul(1000) + u64::from(s)),
            })
            .collect();
        Self {
            agent,
            namespace,
            sessions,
            block_tokens,
            block_bytes: usize::try_from(block_bytes).unwrap_or(usize::MAX),
        }
    }

    fn run(mut self, config: &DemoConfig, live: &Live) -> EngineDone {
        let mut done = EngineDone {
            turns: 0,
            requested: 0,
            served: 0,
            mismatches: 0,
            stats: lake_agent::AgentStats::default(),
            lookup_ns: Vec::new(),
            fetch_ns: Vec::new(),
            save_ns: Vec::new(),
        };
        let mut table = Vec::new();
        let mut expected = vec![0u8; self.block_bytes];
        for _ in 0..config.turns {
            for s in 0..self.sessions.len() {
                self.turn(s, config, &mut table, &mut expected, &mut done, live);
            }
        }
        done.stats = self.agent.stats;
        done
    }

    fn turn(
        &mut self,
        s: usize,
        config: &DemoConfig,
        table: &mut Vec<lake_dp::mirror::MirrorEntry>,
        expected: &mut [u8],
        done: &mut EngineDone,
        live: &Live,
    ) {
        let block_tokens = self.block_tokens;
        // A new user message, then the prompt is the whole conversation.
        let session = &mut self.sessions[s];
        let message = 1 + session.rng.below(u64::from(config.message_blocks.max(1)));
        for _ in 0..message * block_tokens as u64 {
            session.tokens.push(u32::try_from(session.rng.below(151_936)).unwrap_or(0));
        }
        let keys = KeyChain::keys(&self.namespace, &session.tokens).unwrap_or_default();
        let started = Instant::now();
        let hit = self.agent.lookup(&keys, table);
        done.lookup_ns.push(elapsed_ns(started));
        let started = Instant::now();
        let mut mismatches = 0;
        let served = self.agent.fetch(&keys[..hit], table, |i, bytes| {
            kv_bytes(&keys[i], expected);
            if bytes != expected {
                mismatches += 1;
            }
        });
        if hit > 0 {
            done.fetch_ns.push(elapsed_ns(started));
        }
        // Prefill what was not served, then decode a reply: both saved.
        let session = &mut self.sessions[s];
        let reply = 1 + session.rng.below(u64::from(config.reply_blocks.max(1)));
        for _ in 0..reply * block_tokens as u64 {
            session.tokens.push(u32::try_from(session.rng.below(151_936)).unwrap_or(0));
        }
        let all = KeyChain::keys(&self.namespace, &session.tokens).unwrap_or_default();
        let new = &all[served.min(all.len())..];
        let payloads: Vec<Vec<u8>> = new
            .iter()
            .map(|key| {
                let mut bytes = vec![0u8; self.block_bytes];
                kv_bytes(key, &mut bytes);
                bytes
            })
            .collect();
        let blocks: Vec<SaveBlock<'_>> = (served..all.len())
            .map(|i| SaveBlock {
                key: all[i],
                parent: if i == 0 { BlockKey::NONE } else { all[i - 1] },
                block_index: u32::try_from(i).unwrap_or(u32::MAX),
                payload: SavePayload::Bytes(&payloads[i - served]),
            })
            .collect();
        let started = Instant::now();
        for chunk in blocks.chunks(16) {
            self.agent.save(chunk);
        }
        done.save_ns.push(elapsed_ns(started));
        self.agent.pump();
        done.turns += 1;
        done.requested += keys.len() as u64;
        done.served += served as u64;
        done.mismatches += mismatches;
        live.turns.fetch_add(1, Ordering::Relaxed);
        live.requested.fetch_add(keys.len() as u64, Ordering::Relaxed);
        live.served.fetch_add(served as u64, Ordering::Relaxed);
        live.mismatches.fetch_add(mismatches, Ordering::Relaxed);
    }
}

fn elapsed_ns(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

fn http_get(address: std::net::SocketAddr, path: &str) -> Option<String> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: lake\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned())
}
