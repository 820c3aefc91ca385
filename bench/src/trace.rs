//! `trace` and `trace-gen`: replay request traces through the real index
//! and eviction code, and make such traces.
//!
//! A trace is JSON lines in the format of the public Mooncake traces: each
//! line an object whose `hash_ids` lists the request's prefix-chained
//! blocks in order (the same id in two requests means the same prefix up
//! to and including that block).

// Trace generation and capacity ratios do small positive float arithmetic
// and index small vectors; the values are bounded by the trace's size.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use std::io::{BufRead, Write};

use lake_cp::evict::{Cache, Credit, Lake, Lru, Policy, TinyLfu};
use lake_dp::BlockKey;
use lake_dp::rng::SimRng;

use crate::report::Report;

/// The block key a trace's hash id stands for (uniform bytes, as a real
/// chained key is).
fn key_of(id: u64) -> BlockKey {
    let mut rng = SimRng::new(id ^ 0x6c61_6b65_7472_6163);
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
    key[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    if key == [0; 16] {
        key[0] = 1;
    }
    BlockKey(key)
}

/// The `hash_ids` list of one JSON line, or an error naming the problem.
fn hash_ids(line: &str) -> Result<Vec<u64>, String> {
    let at = line.find("\"hash_ids\"").ok_or("no \"hash_ids\" field")?;
    let rest = &line[at + "\"hash_ids\"".len()..];
    let open = rest.find('[').ok_or("hash_ids is not a list")?;
    let close = rest.find(']').ok_or("hash_ids list is not closed")?;
    if close < open {
        return Err("hash_ids is not a list".into());
    }
    rest[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u64>().map_err(|_| format!("hash_ids holds {s:?}, not an integer")))
        .collect()
}

/// The trace's requests and its distinct blocks.
fn load_distinct(path: &str) -> Result<(Vec<Vec<BlockKey>>, Vec<BlockKey>), String> {
    let requests = load(path)?;
    let distinct = distinct(&requests);
    Ok((requests, distinct))
}

/// The distinct blocks of `requests`.
fn distinct(requests: &[Vec<BlockKey>]) -> Vec<BlockKey> {
    let mut distinct: Vec<BlockKey> = requests.iter().flatten().copied().collect();
    distinct.sort_unstable_by_key(|k| k.0);
    distinct.dedup();
    distinct
}

fn load(path: &str) -> Result<Vec<Vec<BlockKey>>, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("--file {path}: {e}"))?;
    let mut requests = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| format!("{path}: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let ids = hash_ids(&line).map_err(|e| format!("{path} line {}: {e}", number + 1))?;
        requests.push(ids.into_iter().map(key_of).collect());
    }
    Ok(requests)
}

/// Belady's MIN under the leaf-first rule: evict the evictable leaf whose
/// next use is furthest away. Needs the future, so it only exists here, to
/// show how much room any online policy has.
struct Belady {
    uses: std::collections::HashMap<BlockKey, Vec<u32>>,
    queue: std::collections::BinaryHeap<(u32, u32, u32)>,
}

impl Belady {
    fn new(requests: &[Vec<BlockKey>]) -> Self {
        let mut uses: std::collections::HashMap<BlockKey, Vec<u32>> = std::collections::HashMap::new();
        for (i, keys) in requests.iter().enumerate() {
            for key in keys {
                // Ticks start at 1 for the first request.
                uses.entry(*key).or_default().push(i as u32 + 1);
            }
        }
        Self { uses, queue: std::collections::BinaryHeap::new() }
    }

    fn push(&mut self, index: &lake_cp::index::Index, block: lake_cp::index::BlockRef) {
        let now = index.now();
        let next =
            self.uses.get(&index.key(block)).and_then(|u| u.iter().find(|&&t| t > now).copied()).unwrap_or(u32::MAX);
        self.queue.push((next, block.0, index.touched(block)));
    }
}

impl Policy for Belady {
    fn name(&self) -> &'static str {
        "belady"
    }
    fn inserted(&mut self, index: &mut lake_cp::index::Index, block: lake_cp::index::BlockRef) {
        self.push(index, block);
    }
    fn accessed(&mut self, index: &lake_cp::index::Index, block: lake_cp::index::BlockRef) {
        self.push(index, block);
    }
    fn became_leaf(&mut self, index: &lake_cp::index::Index, block: lake_cp::index::BlockRef) {
        self.push(index, block);
    }
    fn victim(&mut self, index: &lake_cp::index::Index) -> Option<lake_cp::index::BlockRef> {
        let now = index.now();
        let mut stash = Vec::new();
        let mut found = None;
        while let Some(entry) = self.queue.pop() {
            let (_, raw, touched) = entry;
            let block = lake_cp::index::BlockRef(raw);
            if !index.is_live(block) || index.touched(block) != touched || !index.is_leaf(block) {
                continue;
            }
            if touched == now {
                stash.push(entry);
                continue;
            }
            found = Some(block);
            break;
        }
        self.queue.extend(stash);
        found
    }
    fn admit(&mut self, index: &lake_cp::index::Index, victim: lake_cp::index::BlockRef, _key: &BlockKey) -> bool {
        // Keep the victim if it is needed sooner than the new block's
        // next use... the new block is unknown here; admit always (MIN
        // with bypass would do better still).
        let _ = (index, victim);
        true
    }
}

/// Replays the trace: (blocks requested, blocks hit, evictions, what the
/// policy learnt).
fn replay<P: Policy>(requests: &[Vec<BlockKey>], capacity: usize, policy: P) -> (u64, u64, u64, String) {
    let mut cache = Cache::new(capacity, policy);
    let (mut blocks, mut hits) = (0u64, 0u64);
    for keys in requests {
        blocks += keys.len() as u64;
        hits += cache.request(keys) as u64;
    }
    (blocks, hits, cache.evictions, cache.policy.summary())
}

/// `lake-bench trace`'s flags.
#[derive(clap::Args, Debug)]
pub(crate) struct TraceArgs {
    /// The trace: JSON lines with hash_ids (Mooncake format).
    #[arg(long)]
    pub(crate) file: Option<String>,
    /// Capacity in blocks.
    #[arg(long, default_value_t = 0)]
    pub(crate) capacity_blocks: usize,
    /// Capacity as a share of the trace's distinct blocks.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) capacity_ratio: f64,
    /// Eviction policy: lake or lru.
    #[arg(long, default_value = "lake")]
    pub(crate) policy: String,
    /// The credit policy's credit (default: the trace's turnover).
    #[arg(long)]
    pub(crate) credit: Option<u64>,
    /// The `lake` policy: a challenger must beat LRU by 1/margin of its
    /// score (default: the policy's own).
    #[arg(long)]
    pub(crate) margin: Option<u64>,
    /// The `lake` policy: scores decay by 1/memory per request (default:
    /// the policy's own).
    #[arg(long)]
    pub(crate) memory: Option<u64>,
    /// The `lake` policy: a challenger behind LRU by 1/guard of its score
    /// sends the tier back to LRU for `memory` requests (default: the
    /// policy's own).
    #[arg(long)]
    pub(crate) guard: Option<u64>,
    /// Replay the trace through a real pool too (lake-cp and lake-dp in
    /// this process, an engine's agent): L1 of the capacity, under the
    /// same policy (lake or lru), an L2 of `--pool-l2-slots`; the hit ratio
    /// it delivers beside the simulator's.
    #[arg(long)]
    pub(crate) pool: bool,
    /// The pool's L2 slots (one file): victims with no room there are
    /// dropped.
    #[arg(long, default_value_t = 4)]
    pub(crate) pool_l2_slots: u32,
    /// Payload bytes of a pool block.
    #[arg(long, default_value_t = 4096)]
    pub(crate) pool_block_bytes: u64,
    /// Time between the pool's requests, ms: the engine's compute between
    /// them (the pool protects blocks saved within the last 250 ms from
    /// being dropped, so a replay with no gap at all meets a pool whose
    /// every block is new).
    #[arg(long, default_value_t = 5.0)]
    pub(crate) pool_gap_ms: f64,
    /// Replay at most this many requests (0: all).
    #[arg(long, default_value_t = 0)]
    pub(crate) requests: usize,
    /// Directory for the pool's files (removed after).
    #[arg(long)]
    pub(crate) dir: Option<String>,
}

pub(crate) fn run_trace(args: &TraceArgs) -> Result<Report, String> {
    let path: String = args.file.clone().unwrap_or_default();
    if path.is_empty() {
        return Err("--file is required (JSON lines with hash_ids)".into());
    }
    let mut requests = load(&path)?;
    if args.requests > 0 {
        // The capacity ratio is of the blocks the replayed part holds.
        requests.truncate(args.requests);
    }
    let distinct = distinct(&requests);
    let ratio: f64 = args.capacity_ratio;
    let capacity: usize = args.capacity_blocks;
    let capacity = if capacity > 0 {
        capacity
    } else if ratio > 0.0 {
        ((distinct.len() as f64 * ratio).round() as usize).max(1)
    } else {
        return Err("--capacity-blocks N or --capacity-ratio R is required".into());
    };
    let policy: String = args.policy.clone();
    let turnover = turnover(capacity, &requests);
    let credit: u64 = args.credit.unwrap_or(turnover);
    let (blocks, hits, evictions, learnt) = match policy.as_str() {
        "lru" => replay(&requests, capacity, Lru::default()),
        "credit" => replay(&requests, capacity, Credit::new(capacity, credit)),
        "tinylfu" => replay(&requests, capacity, TinyLfu::new(capacity)),
        "lake" => {
            let mut lake = Lake::new(capacity);
            lake.margin = args.margin.unwrap_or(lake.margin);
            lake.memory = args.memory.unwrap_or(lake.memory);
            lake.guard = args.guard.unwrap_or(lake.guard);
            if lake.margin == 0 || lake.memory == 0 || lake.guard == 0 {
                return Err("--margin, --memory and --guard must be at least 1".into());
            }
            replay(&requests, capacity, lake)
        }
        "belady" => replay(&requests, capacity, Belady::new(&requests)),
        other => {
            return Err(format!("--policy {other}: lake (default), lru, credit, tinylfu, or belady (offline bound)"));
        }
    };
    let mut report = Report::new("trace");
    report.text("file", &path);
    report.text("policy", &policy);
    report.int("requests", requests.len() as u64);
    report.int("blocks", blocks);
    report.int("distinct_blocks", distinct.len() as u64);
    report.int("capacity_blocks", capacity as u64);
    report.int("hit_blocks", hits);
    report.int("evictions", evictions);
    report.float("prefix_hit_ratio", hits as f64 / blocks.max(1) as f64);
    if !learnt.is_empty() {
        report.text("policy_state", &learnt);
    }
    if args.pool {
        let kind = lake_cp::tier::PolicyKind::parse(&policy)
            .ok_or_else(|| format!("--pool replays through the tier manager's policies: lake or lru, not {policy}"))?;
        let pool = replay_pool(args, &requests, capacity, kind)?;
        let ratio = pool.hits as f64 / pool.blocks.max(1) as f64;
        report.int("pool_l1_slots", capacity as u64);
        report.int("pool_l2_slots", u64::from(args.pool_l2_slots));
        report.int("pool_hit_blocks", pool.hits);
        report.int("pool_blocks_saved", pool.saved);
        report.int("pool_blocks_not_saved", pool.not_saved);
        report.int("pool_saves_refused", pool.refused);
        report.int("pool_victims_taken", pool.victims_taken);
        if !pool.policy.is_empty() {
            report.text("pool_policy_state", &pool.policy);
        }
        report.float("pool_prefix_hit_ratio", ratio);
        report.float("pool_vs_simulator", ratio / (hits as f64 / blocks.max(1) as f64).max(f64::MIN_POSITIVE));
        report.float("pool_seconds", pool.seconds);
        report.float("pool_gap_ms", args.pool_gap_ms);
    }
    Ok(report)
}

/// What a replay through a real pool delivered.
struct PoolReplay {
    blocks: u64,
    hits: u64,
    saved: u64,
    not_saved: u64,
    /// Saves the data plane refused.
    refused: u64,
    /// Marked victims saves took.
    victims_taken: u64,
    /// What the pool's L1 policy learnt.
    policy: String,
    seconds: f64,
}

/// Replays `requests` through a real embedded pool as an engine would use
/// it: each request looked up (the pool's leading hits, in any tier, are
/// its hits; the lookup reports the access to the tier manager), then its
/// missing blocks saved as the prefix's continuation. Before the next
/// request the saved blocks are let reach the mirror (an engine computes
/// between requests; the wait reads the mirror directly and reports
/// nothing).
fn replay_pool(
    args: &TraceArgs,
    requests: &[Vec<BlockKey>],
    capacity: usize,
    policy: lake_cp::tier::PolicyKind,
) -> Result<PoolReplay, String> {
    use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
    use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
    let dir = args.dir.as_ref().map_or_else(
        || std::env::temp_dir().join(format!("lake-bench-trace-pool-{}", std::process::id())),
        std::path::PathBuf::from,
    );
    let config = EmbeddedConfig {
        block_bytes: args.pool_block_bytes,
        l1_slots: u32::try_from(capacity).map_err(|_| "--capacity too large for a pool's L1")?,
        l2_slots_per_file: args.pool_l2_slots,
        l2_files: vec![dir.join("l2.lake")],
        local_agents: 1,
        remote_agents: 1,
        tiers: lake_cp::tier::TierConfig { policy, ..lake_cp::tier::TierConfig::default() },
        ..EmbeddedConfig::new(dir.clone())
    };
    let mut pool = EmbeddedPool::start(&config)?;
    let agent_config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "trace-pool",
        namespace: lake_dp::NamespaceId(0x7ace),
        layout_fingerprint: 0x7ace,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = Agent::attach(&agent_config, pool.local_ports.remove(0)).map_err(|e| e.to_string())?;
    let payload = vec![0x5au8; args.pool_block_bytes as usize];
    let mut out = PoolReplay {
        blocks: 0,
        hits: 0,
        saved: 0,
        not_saved: 0,
        refused: 0,
        victims_taken: 0,
        policy: String::new(),
        seconds: 0.0,
    };
    let mut table = Vec::new();
    let started = std::time::Instant::now();
    for keys in requests {
        out.blocks += keys.len() as u64;
        let hits = agent.lookup(keys, &mut table);
        out.hits += hits as u64;
        let blocks: Vec<SaveBlock<'_>> = (hits..keys.len())
            .map(|i| SaveBlock {
                key: keys[i],
                parent: i.checked_sub(1).map_or(BlockKey::NONE, |p| keys[p]),
                block_index: i as u32,
                payload: SavePayload::Bytes(&payload),
            })
            .collect();
        let saved = agent.save(&blocks);
        out.saved += saved as u64;
        out.not_saved += (blocks.len() - saved) as u64;
        let next = std::time::Instant::now() + std::time::Duration::from_secs_f64(args.pool_gap_ms.max(0.0) / 1e3);
        let deadline = next.max(std::time::Instant::now() + std::time::Duration::from_millis(50));
        while agent.mirror().lookup(keys, &mut table) < hits + saved && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        if let Some(left) = next.checked_duration_since(std::time::Instant::now()) {
            std::thread::sleep(left);
        }
    }
    out.seconds = started.elapsed().as_secs_f64();
    drop(agent);
    let (stats, server) = pool.stop()?;
    out.policy = server
        .node()
        .tiers
        .policy_states()
        .into_iter()
        .find(|(tier, _, _)| *tier == lake_dp::Tier::L1Dram)
        .map(|(_, _, summary)| summary)
        .unwrap_or_default();
    out.refused = stats.pool.saves_refused;
    out.victims_taken = stats.pool.victims_clean + stats.pool.victims_dropped;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(out)
}

/// Requests a tier of `capacity` blocks takes to turn over once: its
/// capacity over the trace's mean blocks per request (the `credit`
/// policy's default credit).
fn turnover(capacity: usize, requests: &[Vec<BlockKey>]) -> u64 {
    let blocks: usize = requests.iter().map(Vec::len).sum();
    let mean = (blocks / requests.len().max(1)).max(1);
    (capacity / mean).max(1) as u64
}

/// Trace families for `trace-gen`.
struct Gen {
    rng: SimRng,
    next_id: u64,
}

impl Gen {
    fn fresh(&mut self, count: u64) -> Vec<u64> {
        let ids = (self.next_id..self.next_id + count).collect();
        self.next_id += count;
        ids
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rng.below(n)
    }

    /// Zipf-ish pick in 0..n: small indices far more often.
    fn skewed(&mut self, n: u64) -> u64 {
        let u = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((n as f64).powf(u) - 1.0).floor().min(n as f64 - 1.0) as u64
    }
}

fn line(out: &mut dyn Write, t: u64, ids: &[u64]) -> Result<(), String> {
    let list: Vec<String> = ids.iter().map(u64::to_string).collect();
    writeln!(
        out,
        "{{\"timestamp\": {t}, \"input_length\": {}, \"output_length\": 512, \"hash_ids\": [{}]}}",
        ids.len() * 512,
        list.join(", ")
    )
    .map_err(|e| e.to_string())
}

/// Tool-using agents: a few long system prompts shared by every session,
/// sessions whose histories grow turn by turn, many sessions interleaved.
fn agent(g: &mut Gen, requests: u64, out: &mut dyn Write) -> Result<(), String> {
    let prompts: Vec<Vec<u64>> = (0..4)
        .map(|_| {
            let n = 16 + g.below(24);
            g.fresh(n)
        })
        .collect();
    let mut active: Vec<(Vec<u64>, u64)> = Vec::new();
    for t in 0..requests {
        if active.len() < 48 || g.below(10) == 0 {
            let prompt = prompts[g.skewed(4) as usize].clone();
            let turns = 3 + g.below(25);
            active.push((prompt, turns));
        }
        turn(g, &mut active, 4, t, out)?;
    }
    Ok(())
}

/// Chat: a short system prompt everyone shares, short conversations.
fn chat(g: &mut Gen, requests: u64, out: &mut dyn Write) -> Result<(), String> {
    let system = g.fresh(2);
    let mut active: Vec<(Vec<u64>, u64)> = Vec::new();
    for t in 0..requests {
        if active.len() < 200 || g.below(4) == 0 {
            active.push((system.clone(), 1 + g.below(6)));
        }
        turn(g, &mut active, 2, t, out)?;
    }
    Ok(())
}

/// One turn of a conversation picked at random among `active`: 1 to
/// `most_added` new blocks join its history, the request is written, the
/// reply joins the history for the next turn; a conversation out of turns
/// ends. (The draws keep their order: a seed gives the same trace.)
fn turn(
    g: &mut Gen,
    active: &mut Vec<(Vec<u64>, u64)>,
    most_added: u64,
    t: u64,
    out: &mut dyn Write,
) -> Result<(), String> {
    let i = g.below(active.len() as u64) as usize;
    let added = 1 + g.below(most_added);
    let new = g.fresh(added);
    let (history, turns_left) = &mut active[i];
    history.extend(new);
    line(out, t, history)?;
    history.extend(g.fresh(1));
    *turns_left -= 1;
    if *turns_left == 0 {
        active.swap_remove(i);
    }
    Ok(())
}

/// Scan-heavy: half the requests are one-off long documents, half come
/// from a skewed set of hot prompts.
fn scan(g: &mut Gen, requests: u64, out: &mut dyn Write) -> Result<(), String> {
    let hot: Vec<Vec<u64>> = (0..40)
        .map(|_| {
            let n = 8 + g.below(24);
            g.fresh(n)
        })
        .collect();
    for t in 0..requests {
        if g.below(2) == 0 {
            let n = 20 + g.below(80);
            let doc = g.fresh(n);
            line(out, t, &doc)?;
        } else {
            let prompt = &hot[g.skewed(40) as usize];
            let mut ids = prompt.clone();
            let extra = 1 + g.below(3);
            ids.extend(g.fresh(extra));
            line(out, t, &ids)?;
        }
    }
    Ok(())
}

/// `lake-bench trace-gen`'s flags.
#[derive(clap::Args, Debug)]
pub(crate) struct TraceGenArgs {
    /// Workload: agent, chat or scan.
    #[arg(long, default_value = "agent")]
    pub(crate) kind: String,
    /// Requests.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) requests: u64,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Where the trace is written.
    #[arg(long)]
    pub(crate) out: Option<String>,
}

pub(crate) fn run_trace_gen(args: &TraceGenArgs) -> Result<Report, String> {
    let kind: String = args.kind.clone();
    let requests: u64 = args.requests;
    let seed: u64 = args.seed;
    let path: String = args.out.clone().unwrap_or_default();
    if path.is_empty() {
        return Err("--out FILE is required".into());
    }
    let file = std::fs::File::create(&path).map_err(|e| format!("--out {path}: {e}"))?;
    let mut out = std::io::BufWriter::new(file);
    let mut g = Gen { rng: SimRng::new(seed), next_id: 1 };
    match kind.as_str() {
        "agent" => agent(&mut g, requests, &mut out)?,
        "chat" => chat(&mut g, requests, &mut out)?,
        "scan" => scan(&mut g, requests, &mut out)?,
        other => return Err(format!("--kind {other}: agent, chat or scan")),
    }
    out.flush().map_err(|e| e.to_string())?;
    let mut report = Report::new("trace-gen");
    report.text("kind", &kind);
    report.int("requests", requests);
    report.int("ids", g.next_id - 1);
    report.text("out", &path);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_access_writes_fewer_one_off_blocks_to_l2_and_keeps_the_hot_ones() {
        use lake_cp::tier::{L2Admission, PolicyKind};
        // Half one-off documents of 30 blocks, half one of 4 hot prompts.
        let mut g = Gen { rng: SimRng::new(5), next_id: 1 };
        let hot: Vec<Vec<u64>> = (0..4).map(|_| g.fresh(12)).collect();
        let requests: Vec<Vec<BlockKey>> = (0..600)
            .map(|i| if i % 2 == 0 { g.fresh(30) } else { hot[g.below(4) as usize].clone() })
            .map(|ids| ids.into_iter().map(key_of).collect())
            .collect();
        let tiers = (40, 400);
        let always = replay_tiers(&requests, tiers, PolicyKind::Lru, L2Admission::Always).unwrap();
        let filtered = replay_tiers(&requests, tiers, PolicyKind::Lru, L2Admission::SecondAccess).unwrap();
        assert_eq!(always.blocks, filtered.blocks);
        assert!(filtered.l2_writes * 4 < always.l2_writes, "{filtered:?} vs {always:?}");
        assert!(filtered.filtered > 0);
        let hits = |r: &TierReplay| r.l1_hits + r.l2_hits;
        assert!(hits(&filtered) * 100 >= hits(&always) * 95, "{filtered:?} vs {always:?}");
    }

    #[test]
    fn hash_ids_are_read_or_named_as_bad() {
        assert_eq!(hash_ids(r#"{"timestamp": 1, "hash_ids": [3, 4, 5]}"#).unwrap(), vec![3, 4, 5]);
        assert_eq!(hash_ids(r#"{"hash_ids": []}"#).unwrap(), Vec::<u64>::new());
        assert!(hash_ids(r#"{"ids": [1]}"#).unwrap_err().contains("no \"hash_ids\""));
        assert!(hash_ids(r#"{"hash_ids": [1, x]}"#).unwrap_err().contains("\"x\""));
        assert!(hash_ids(r#"{"hash_ids": 5}"#).is_err());
    }
}

/// What one two-tier replay measured.
#[derive(Clone, Copy, Debug, Default)]
struct TierReplay {
    blocks: u64,
    l1_hits: u64,
    l2_hits: u64,
    l2_writes: u64,
    l1_drops: u64,
    filtered: u64,
}

/// Replays `requests` through the real location view and tier manager: an
/// L1 of `l1` blocks over an L2 of `l2`, every command carried out at once
/// as a data plane would. A request's leading blocks with a replica are
/// its hits (an L2-only one is promoted into L1, as a load is); the rest
/// are saved into L1; then the manager plans and its moves and drops are
/// applied. Block bytes are one unit: writes count blocks.
fn replay_tiers(
    requests: &[Vec<BlockKey>],
    (l1, l2): (u64, u64),
    policy: lake_cp::tier::PolicyKind,
    admission: lake_cp::tier::L2Admission,
) -> Result<TierReplay, String> {
    use lake_cp::lease::Leases;
    use lake_cp::location::Locations;
    use lake_cp::tier::{TierAction, TierConfig, Tiers};
    use lake_dp::{NodeId, ObjectKind, Replica, Tier};
    const NS: u64 = 1;
    let config = TierConfig { policy, l2_admission: admission, ..TierConfig::default() };
    let mut tiers = Tiers::new(config);
    let mut locations = Locations::new(1);
    let leases = Leases::new();
    for (region, tier, slots) in [(0u16, Tier::L1Dram, l1), (1, Tier::L2Nvme, l2)] {
        locations.register_region(region, tier, NodeId(0), 1).map_err(|e| format!("{e:?}"))?;
        tiers.register(region, tier, 0, 1, 1, slots);
    }
    let mut next_slot = 0u32;
    let mut put = |locations: &mut Locations, tiers: &mut Tiers, parent: Option<BlockKey>, key: BlockKey, region| {
        next_slot = next_slot.wrapping_add(1);
        let parent = parent.filter(|p| locations.index.contains(p));
        if locations.adopt(parent, key, ObjectKind::KvBlock, region, 1, next_slot, 1).is_ok() {
            tiers.added(region, NS, parent, key, ObjectKind::KvBlock, true, 0);
        }
    };
    let mut out = TierReplay::default();
    let mut commands = Vec::new();
    for (t, keys) in requests.iter().enumerate() {
        out.blocks += keys.len() as u64;
        let hits = keys.iter().take_while(|k| locations.ready(k).next().is_some()).count();
        for (i, key) in keys[..hits].iter().enumerate() {
            if locations.ready(key).any(|r| r.tier == Tier::L1Dram) {
                out.l1_hits += 1;
            } else {
                out.l2_hits += 1;
                put(&mut locations, &mut tiers, i.checked_sub(1).map(|p| keys[p]), *key, 0);
            }
        }
        tiers.accessed(NS, keys);
        tiers.reused(&keys[..hits]);
        for i in hits..keys.len() {
            put(&mut locations, &mut tiers, i.checked_sub(1).map(|p| keys[p]), keys[i], 0);
        }
        commands.clear();
        tiers.plan(&locations, &leases, t as u64, &mut commands);
        for command in &commands {
            match command.action {
                TierAction::Move(transfer) => {
                    let source = Replica::from_wire(&transfer.source).ok_or("a move from nowhere")?;
                    let parent = locations
                        .index
                        .get(&transfer.key)
                        .and_then(|b| locations.index.parent(b))
                        .map(|p| locations.index.key(p));
                    if transfer.target.tier == Tier::L2Nvme as u8 {
                        out.l2_writes += 1;
                    }
                    put(&mut locations, &mut tiers, parent, transfer.key, transfer.target.region);
                    let _ = locations.remove(&transfer.key, source.region.0);
                    tiers.removed(source.region.0, &transfer.key);
                }
                TierAction::Evict(evict) => {
                    if evict.replica.region == 0 && !locations.ready(&evict.key).any(|r| r.tier == Tier::L2Nvme) {
                        out.l1_drops += 1;
                    }
                    let _ = locations.remove(&evict.key, evict.replica.region);
                    tiers.removed(evict.replica.region, &evict.key);
                }
                TierAction::Copy(_)
                | TierAction::Drain(_)
                | TierAction::Cancel
                | TierAction::Mark(_)
                | TierAction::Unmark(_)
                | TierAction::VictimsLeft(_) => {}
            }
            tiers.done(command.request, true);
        }
    }
    out.filtered = tiers.counters.l2_filtered;
    Ok(out)
}

/// `trace-tiers`: the same trace through L1 over L2 with every L1 victim
/// written to L2, and with the second-access filter, in one run.
/// `lake-bench trace-tiers`'s flags.
#[derive(clap::Args, Debug)]
pub(crate) struct TraceTiersArgs {
    /// The trace: JSON lines with hash_ids (Mooncake format).
    #[arg(long)]
    pub(crate) file: Option<String>,
    /// L1 capacity as a share of the trace's distinct blocks.
    #[arg(long, default_value_t = 0.02)]
    pub(crate) l1_ratio: f64,
    /// L2 capacity as a share of the trace's distinct blocks.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) l2_ratio: f64,
    /// Eviction policy: lake or lru.
    #[arg(long, default_value = "lake")]
    pub(crate) policy: String,
}

pub(crate) fn run_trace_tiers(args: &TraceTiersArgs) -> Result<Report, String> {
    use lake_cp::tier::{L2Admission, PolicyKind};
    let path: String = args.file.clone().unwrap_or_default();
    if path.is_empty() {
        return Err("--file is required (JSON lines with hash_ids)".into());
    }
    let (requests, distinct) = load_distinct(&path)?;
    let (l1_ratio, l2_ratio): (f64, f64) = (args.l1_ratio, args.l2_ratio);
    if !(l1_ratio > 0.0 && l2_ratio > 0.0) {
        return Err("--l1-ratio and --l2-ratio must be above 0".into());
    }
    let blocks_for = |ratio: f64| ((distinct.len() as f64 * ratio).round() as u64).max(4);
    let (l1, l2) = (blocks_for(l1_ratio), blocks_for(l2_ratio));
    let policy_name: String = args.policy.clone();
    let policy = PolicyKind::parse(&policy_name).ok_or_else(|| format!("--policy {policy_name}: lake or lru"))?;
    let always = replay_tiers(&requests, (l1, l2), policy, L2Admission::Always)?;
    let filtered = replay_tiers(&requests, (l1, l2), policy, L2Admission::SecondAccess)?;
    let mut report = Report::new("trace-tiers");
    report.text("file", &path);
    report.text("policy", &policy_name);
    report.int("requests", requests.len() as u64);
    report.int("blocks", always.blocks);
    report.int("distinct_blocks", distinct.len() as u64);
    report.int("l1_blocks", l1);
    report.int("l2_blocks", l2);
    let ratio = |r: &TierReplay| (r.l1_hits + r.l2_hits) as f64 / r.blocks.max(1) as f64;
    for (name, r) in [("always", &always), ("second_access", &filtered)] {
        report.int(&format!("{name}_l2_blocks_written"), r.l2_writes);
        report.int(&format!("{name}_l1_hit_blocks"), r.l1_hits);
        report.int(&format!("{name}_l2_hit_blocks"), r.l2_hits);
        report.int(&format!("{name}_l1_drops"), r.l1_drops);
        report.float(&format!("{name}_hit_ratio"), ratio(r));
    }
    report.int("second_access_filtered", filtered.filtered);
    report.float("l2_writes_ratio", filtered.l2_writes as f64 / always.l2_writes.max(1) as f64);
    report.float("hit_ratio_change", ratio(&filtered) - ratio(&always));
    Ok(report)
}
