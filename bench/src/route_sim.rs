//! `lake-bench route`: a trace-driven simulation of execution-mode routing
//! over several nodes — agent multi-turn conversations (each turn the
//! previous context, the reply and a new message) — through the real
//! `lake_dp::route::route`, against "always PD" and "always colocated".
//!
//! Each node has an HBM (L0), DRAM (L1) and NVMe (L2) share of KV, LRU per
//! tier: a turn's context lands in the HBM of the node that decoded it and
//! is written back to that node's L1 (and, when L1 overflows, demoted to
//! L2; L2's overflow is dropped); everything written back also goes to L3.
//! Per turn the router sees each node's hits and queue; the chosen node's
//! prefill queue grows by the turn's modelled prefill time. Costs are the
//! Qwen3-8B shape's on the H200 machine (blocks of 16 tokens, 2.25 MiB):
//! 0.545 ms to compute a block, 0.043 / 0.39 / 2.4 ms to load one from
//! L1 / L2 / L3, 0.094 ms to send one over a 200 Gbit/s compute network.

// A model: node indices, block counts and times far below the limits.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

use lake_dp::NodeId;
use lake_dp::route::{HitView, LoadView, Mode, NodeHits, NodeLoad, Plan, Policy, Request, route};

use crate::report::Report;

const NS_PER_MS: f64 = 1e6;
const BLOCK_TOKENS: u64 = 16;
const BLOCK_BYTES: u64 = 2_359_296;

/// A node's share of KV in one tier: conversation → prefix blocks held,
/// with an LRU tick.
#[derive(Clone, Default)]
struct TierCache {
    capacity: u64,
    used: u64,
    held: std::collections::HashMap<u32, (u32, u64)>,
}

impl TierCache {
    fn new(capacity: u64) -> Self {
        Self { capacity, ..Self::default() }
    }

    fn get(&self, conversation: u32) -> u32 {
        self.held.get(&conversation).map_or(0, |&(blocks, _)| blocks)
    }

    /// Holds `blocks` of `conversation` (replacing what it held); returns
    /// what was pushed out, oldest first.
    fn put(&mut self, conversation: u32, blocks: u32, tick: u64) -> Vec<(u32, u32)> {
        if let Some((old, _)) = self.held.remove(&conversation) {
            self.used -= u64::from(old);
        }
        let mut out = Vec::new();
        while self.used + u64::from(blocks) > self.capacity && !self.held.is_empty() {
            let (&victim, &(held, _)) = self.held.iter().min_by_key(|(_, (_, t))| *t).expect("not empty");
            self.held.remove(&victim);
            self.used -= u64::from(held);
            out.push((victim, held));
        }
        if u64::from(blocks) <= self.capacity {
            self.held.insert(conversation, (blocks, tick));
            self.used += u64::from(blocks);
        }
        out
    }
}

struct Node {
    prefill: bool,
    decode: bool,
    busy_until_ns: u64,
    tiers: [TierCache; 3],
}

impl Node {
    /// Writes `blocks` of `conversation` into L1, demoting L1's victims to L2.
    fn write_back(&mut self, conversation: u32, blocks: u32, tick: u64) {
        let [_, l1, l2] = &mut self.tiers;
        for (victim, held) in l1.put(conversation, blocks, tick) {
            l2.put(victim, held, tick);
        }
    }
}

#[derive(Default)]
struct Outcome {
    turns: u64,
    prompt_blocks: u64,
    hit_blocks: u64,
    blocks_between_nodes: u64,
    ttft_ms: Vec<f64>,
    modes: [u64; 3],
    recomputed_blocks: u64,
}

struct Workload {
    nodes: usize,
    conversations: u32,
    turns: u32,
    seed: u64,
    utilization: f64,
}

fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn simulate(w: &Workload, policy: Policy) -> Outcome {
    let compute = 545_000u64;
    let base = NodeLoad {
        node: NodeId(0),
        prefill: true,
        decode: true,
        queue_ns: 0,
        compute_ns_per_block: compute,
        load_ns_per_block: [0, 43_000, 390_000, 2_400_000],
        cnic_ns_per_block: 94_000,
        // Each node's own tiers only: the simulation has no pool runs.
        pull_ns_per_block: u64::MAX,
    };
    let mut nodes: Vec<Node> = (0..w.nodes)
        .map(|i| {
            // Always PD: the first half prefills, the rest decodes.
            let (prefill, decode) = match policy {
                Policy::AlwaysPd => (i < w.nodes / 2, i >= w.nodes / 2),
                _ => (true, true),
            };
            Node {
                prefill,
                decode,
                busy_until_ns: 0,
                tiers: [TierCache::new(20_000), TierCache::new(40_000), TierCache::new(200_000)],
            }
        })
        .collect();
    let mut state = w.seed | 1;
    let system_blocks = 64u32; // a 1,024-token system prompt
    let mut context: Vec<u32> = vec![system_blocks; w.conversations as usize];
    let mut in_l3: Vec<u32> = vec![0; w.conversations as usize];
    // A turn arrives every `gap`: its new message's prefill (~25 blocks,
    // what a perfect cache leaves to compute) spread over the nodes at the
    // asked utilization — what more a policy recomputes shows as queueing.
    let gap_ns = (25.0 * compute as f64 / (w.nodes as f64 * w.utilization)) as u64;
    let mut out = Outcome::default();
    let mut now = 0u64;
    let mut tick = 0u64;
    for _turn in 0..w.turns {
        for c in 0..w.conversations {
            now += gap_ns;
            tick += 1;
            let message = (200 + rng(&mut state) % 400) / BLOCK_TOKENS;
            let reply = (200 + rng(&mut state) % 200) / BLOCK_TOKENS;
            let cached = context[c as usize];
            let blocks = cached + message as u32;
            let hits = HitView {
                nodes: nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let l0 = n.tiers[0].get(c).min(blocks);
                        let l1 = n.tiers[1].get(c).min(blocks).max(l0);
                        let l2 = n.tiers[2].get(c).min(blocks).max(l1);
                        NodeHits { node: NodeId(i as u32), through: [l0, l1, l2, l2] }
                    })
                    .collect(),
                l3_through: in_l3[c as usize].min(blocks),
                pool: Vec::new(),
            };
            let all: Vec<NodeLoad> = nodes
                .iter()
                .enumerate()
                .map(|(i, n)| NodeLoad {
                    node: NodeId(i as u32),
                    prefill: n.prefill,
                    decode: n.decode,
                    queue_ns: n.busy_until_ns.saturating_sub(now),
                    ..base
                })
                .collect();
            // The baselines place by load alone, as a load balancer does:
            // the least-queued node that prefills (and, for PD, the decode
            // nodes in turn); Lake's router sees every node.
            let least = |ok: &dyn Fn(&NodeLoad) -> bool| {
                all.iter().filter(|n| ok(n)).min_by_key(|n| (n.queue_ns, (n.node.0 + tick as u32) % 64)).copied()
            };
            let loads = match policy {
                Policy::Any => LoadView { nodes: all.clone() },
                Policy::AlwaysColocated => LoadView { nodes: least(&|n| n.prefill && n.decode).into_iter().collect() },
                Policy::AlwaysPd => {
                    let decoders: Vec<NodeLoad> = all.iter().filter(|n| n.decode).copied().collect();
                    let decode = decoders[(tick as usize) % decoders.len().max(1)];
                    LoadView { nodes: least(&|n| n.prefill).into_iter().chain([decode]).collect() }
                }
            };
            let Ok(plan) = route(&Request { blocks, avoid: Vec::new() }, &hits, &loads, policy) else { continue };
            let (prefill, decode, mode) = match plan.mode {
                Mode::Colocated { node } => (node, node, 0),
                Mode::PdDisaggregated { prefill, decode } => (prefill, decode, 1),
                Mode::DDirect { node } => (node, node, 2),
            };
            account(&mut out, &plan, blocks, mode);
            // The prefill node's GPU is busy computing what was not a hit
            // (loads run on the copy engines, the P→D transfer on the
            // network).
            let work = u64::from(plan.recomputed_blocks) * compute;
            let p = &mut nodes[prefill.0 as usize];
            p.busy_until_ns = p.busy_until_ns.max(now) + work;
            // After the turn: the context (prompt and reply) is in the
            // decode node's HBM and written back there; in PD the prefill
            // node wrote its prompt back too.
            let after = blocks + reply as u32;
            context[c as usize] = after;
            in_l3[c as usize] = after;
            let d = &mut nodes[decode.0 as usize];
            d.tiers[0].put(c, after, tick);
            d.write_back(c, after, tick);
            if prefill != decode {
                nodes[prefill.0 as usize].write_back(c, blocks, tick);
            }
        }
    }
    out
}

fn account(out: &mut Outcome, plan: &Plan, blocks: u32, mode: usize) {
    out.turns += 1;
    out.prompt_blocks += u64::from(blocks);
    out.hit_blocks += u64::from(plan.hit_blocks);
    out.recomputed_blocks += u64::from(plan.recomputed_blocks);
    out.blocks_between_nodes += plan.blocks_moved_between_nodes();
    out.ttft_ms.push(plan.ttft_ns as f64 / NS_PER_MS);
    out.modes[mode] += 1;
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct RouteArgs {
    /// Nodes (at least 2).
    #[arg(long, default_value_t = 4)]
    pub(crate) nodes: usize,
    /// Conversations.
    #[arg(long, default_value_t = 400)]
    pub(crate) conversations: u32,
    /// Turns per conversation.
    #[arg(long, default_value_t = 10)]
    pub(crate) turns: u32,
    /// The workload's seed.
    #[arg(long, default_value_t = 2026)]
    pub(crate) seed: u64,
    /// The load a perfect cache would leave (only each new message
    /// computed), 0.05 to 0.95; a policy that recomputes more queues more.
    #[arg(long, default_value_t = 0.25)]
    pub(crate) utilization: f64,
}

pub(crate) fn run(args: &RouteArgs) -> Result<Report, String> {
    // `--utilization`: the load a perfect cache would leave (only each new
    // message computed); a policy that recomputes more queues more.
    let w = Workload {
        nodes: args.nodes,
        conversations: args.conversations,
        turns: args.turns,
        seed: args.seed,
        utilization: args.utilization,
    };
    if w.nodes < 2 || w.conversations == 0 || w.turns == 0 || !(0.05..=0.95).contains(&w.utilization) {
        return Err("--nodes ≥ 2, --conversations and --turns ≥ 1, --utilization 0.05–0.95".into());
    }
    let mut report = Report::new("route");
    report.int("nodes", w.nodes as u64);
    report.int("conversations", u64::from(w.conversations));
    report.int("turns", u64::from(w.turns));
    println!(
        "| policy | hit rate | prefill compute ms / turn | GB between nodes | TTFT mean ms | p50 | p99 | colocated / PD / D-direct |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, policy) in
        [("lake", Policy::Any), ("always_pd", Policy::AlwaysPd), ("always_colocated", Policy::AlwaysColocated)]
    {
        let mut o = simulate(&w, policy);
        let hit_rate = o.hit_blocks as f64 / o.prompt_blocks.max(1) as f64;
        let gb = (o.blocks_between_nodes * BLOCK_BYTES) as f64 / 1e9;
        let compute_ms = o.recomputed_blocks as f64 * 0.545 / o.turns.max(1) as f64;
        let mean = o.ttft_ms.iter().sum::<f64>() / o.ttft_ms.len().max(1) as f64;
        let p50 = crate::report::percentile(&mut o.ttft_ms, 500);
        let p99 = crate::report::percentile(&mut o.ttft_ms, 990);
        println!(
            "| {name} | {hit_rate:.3} | {compute_ms:.1} | {gb:.1} | {mean:.1} | {p50:.1} | {p99:.1} | {} / {} / {} |",
            o.modes[0], o.modes[1], o.modes[2]
        );
        report.float(&format!("{name}_hit_rate"), hit_rate);
        report.float(&format!("{name}_gb_between_nodes"), gb);
        report.float(&format!("{name}_compute_ms_per_turn"), compute_ms);
        report.float(&format!("{name}_ttft_ms_mean"), mean);
        report.float(&format!("{name}_ttft_ms_p99"), p99);
        report.int(&format!("{name}_pd"), o.modes[1]);
        report.int(&format!("{name}_ddirect"), o.modes[2]);
    }
    Ok(report)
}
