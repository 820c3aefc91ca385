//! `cluster-view`: what the cluster view costs at scale. `--blocks` blocks
//! held by the other nodes of a `--nodes`-node cluster (each block on one
//! node's L1, every other one in another node's L2 too) are:
//!
//! - applied to the leader's summary as the nodes' deltas, then taken as
//!   the view's changes (the leader's memory: its RSS growth per replica);
//! - encoded as the view snapshot a node receives when it connects (its
//!   bytes on the wire);
//! - applied to one node's view (`ViewWriter::set`, as the node's uplink
//!   does): its shared memory per block, and sets per second;
//! - looked up by an engine as prompts of `--chain` blocks through the
//!   node's mirror and view (`view::lookup`, every block another node's),
//!   against the raw: the same prompts' block tables from a mirror that
//!   holds them (`MirrorReader::block_table`), in the same run.

use std::hint::black_box;
use std::time::Instant;

use lake_cp::summary::Summary;
use lake_dp::mirror::view::{self, ViewWriter};
use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorEntry, MirrorReader, MirrorWriter};
use lake_dp::rng::SimRng;
use lake_dp::wire::message::{Delta, DeltaEntry, DeltaOp, Records, ViewEntry};
use lake_dp::wire::{FrameMeta, Message, append_frame};
use lake_dp::{BlockKey, NodeId, ObjectKind, RegionId, Replica, Tier};

use crate::cp_scale::{key, rss_bytes};
use crate::report::Report;

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct ClusterViewArgs {
    /// Blocks the other nodes hold.
    #[arg(long, default_value_t = 10_000_000)]
    pub(crate) blocks: usize,
    /// Nodes in the cluster (the view is node 0's; the others hold the
    /// blocks).
    #[arg(long, default_value_t = 3)]
    pub(crate) nodes: u32,
    /// Blocks per prompt.
    #[arg(long, default_value_t = 64)]
    pub(crate) chain: usize,
    /// Prompts looked up.
    #[arg(long, default_value_t = 200_000)]
    pub(crate) lookups: usize,
}

/// Who holds block `i`: one node in L1 and, every other block, the next
/// node in L2 (nodes 1.. of `nodes`).
fn holders(i: usize, nodes: u32) -> Vec<(u32, Tier)> {
    let others = (nodes - 1) as usize;
    let first = 1 + u32::try_from(i % others).unwrap_or(0);
    let mut out = vec![(first, Tier::L1Dram)];
    if i.is_multiple_of(2) && others > 1 {
        out.push((1 + first % u32::try_from(others).unwrap_or(1), Tier::L2Nvme));
    }
    out
}

fn entry(key: BlockKey, node: u32, tier: Tier, slot: u32) -> DeltaEntry {
    let region = if tier == Tier::L1Dram { 0 } else { 1 };
    let replica = Replica { tier, node: NodeId(node), region: RegionId(region), region_epoch: 1, slot, generation: 1 };
    DeltaEntry {
        op: DeltaOp::Add as u8,
        durability: 0,
        kind: ObjectKind::KvBlock as u16,
        block_index: 0,
        key,
        parent_key: BlockKey::NONE,
        namespace: 0,
        layout_fingerprint: 0,
        replica: replica.to_wire(),
    }
}

/// What the leader's side measured.
struct Leader {
    /// RSS growth: the summary alone, the changes taken.
    rss: u64,
    /// RSS growth with the changes noted, not taken yet.
    rss_noted: u64,
    replicas: u64,
    apply_s: f64,
    take_s: f64,
    /// The snapshot's entries and bytes.
    entries: u64,
    bytes: u64,
}

/// The leader's side: the summary built from the nodes' deltas, the view's
/// changes taken, the snapshot encoded.
fn leader(keys: &[BlockKey], nodes: u32) -> Result<Leader, String> {
    let rss_before = rss_bytes();
    let mut summary = Summary::new();
    summary.track_view();
    let mut replicas = 0u64;
    let start = Instant::now();
    // Each node's deltas, made a frame at a time (nothing else grows).
    let mut chunk = Vec::with_capacity(lake_dp::constants::DELTA_ENTRIES_MAX);
    for node in 1..nodes {
        let mut sequence = 1;
        let mut flush = |chunk: &mut Vec<DeltaEntry>, summary: &mut Summary| {
            let count = u32::try_from(chunk.len()).unwrap_or(0);
            summary.delta(&Delta { term: 1, sequence, node, count }, chunk.drain(..));
            sequence += u64::from(count);
        };
        for (i, k) in keys.iter().enumerate() {
            for (holder, tier) in holders(i, nodes) {
                if holder == node {
                    chunk.push(entry(*k, node, tier, u32::try_from(i).unwrap_or(0)));
                    replicas += 1;
                }
            }
            if chunk.len() == lake_dp::constants::DELTA_ENTRIES_MAX {
                flush(&mut chunk, &mut summary);
            }
        }
        if !chunk.is_empty() {
            flush(&mut chunk, &mut summary);
        }
    }
    let apply_s = start.elapsed().as_secs_f64();
    let rss_applied = rss_bytes();
    let start = Instant::now();
    let changes = summary.take_view_changes();
    let take_s = start.elapsed().as_secs_f64();
    drop(changes);
    // What the leader keeps between passes: the summary alone.
    let rss_after = rss_bytes();
    // The snapshot a node is sent when it connects: its frames' bytes.
    let whole = summary.view_entries(&lake_cp::summary::apart::Apart::new());
    let entries: u64 = whole.iter().map(|(_, e)| e.len() as u64).sum();
    let mut bytes = 0u64;
    let mut frame = Vec::new();
    for (node, list) in &whole {
        for chunk in list.chunks(lake_dp::constants::DELTA_ENTRIES_MAX) {
            frame.clear();
            let head = Delta { term: 1, sequence: 1, node: *node, count: u32::try_from(chunk.len()).unwrap_or(0) };
            let meta = FrameMeta { version: 1, flags: 0, request_id: 0, leader_term: 0 };
            let plain: Vec<ViewEntry> = chunk.iter().map(|e| e.plain()).collect();
            append_frame(&mut frame, meta, &Message::ViewSnapshot(head, Records::from_slice(&plain)))
                .map_err(|e| e.to_string())?;
            bytes += frame.len() as u64;
        }
    }
    Ok(Leader {
        rss: rss_after.saturating_sub(rss_before),
        rss_noted: rss_applied.saturating_sub(rss_before),
        replicas,
        apply_s,
        take_s,
        entries,
        bytes,
    })
}

struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    Scratch(std::path::PathBuf::from(format!("/dev/shm/lake-bench-view-{name}-{}", std::process::id())))
}

pub(crate) fn run(args: &ClusterViewArgs) -> Result<Report, String> {
    if args.blocks == 0 || args.nodes < 2 || args.chain == 0 || args.chain > args.blocks {
        return Err("--blocks and --chain positive, --chain at most --blocks, --nodes at least 2".into());
    }
    let mut rng = SimRng::new(11);
    let keys: Vec<BlockKey> = (0..args.blocks).map(|_| key(&mut rng)).collect();
    let mut report = Report::new("cluster-view");
    report.int("blocks", keys.len() as u64);
    report.int("nodes", u64::from(args.nodes));

    let leader = leader(&keys, args.nodes)?;
    let replicas = leader.replicas as f64;
    report.int("leader_replicas", leader.replicas);
    report.float("leader_rss_bytes_per_replica", leader.rss as f64 / replicas);
    report.float("leader_rss_bytes_per_replica_changes_noted", leader.rss_noted as f64 / replicas);
    report.float("leader_replicas_applied_per_s", replicas / leader.apply_s);
    report.float("leader_view_changes_taken_per_s", replicas / leader.take_s);
    report.int("snapshot_entries", leader.entries);
    report.int("snapshot_bytes", leader.bytes);

    let view_path = scratch("view");
    node_view(&keys, args.nodes, &view_path, &mut report)?;
    let (view_s, raw_s) = lookups(&keys, args, &view_path)?;
    let blocks_looked = (args.lookups * args.chain) as f64;
    report.float("lookup_ns_per_block", view_s * 1e9 / blocks_looked);
    report.float("raw_block_table_ns_per_block", raw_s * 1e9 / blocks_looked);
    report.float("lookup_vs_raw", view_s / raw_s);
    Ok(report)
}

/// The node's view at `path`: every (block, holder) set as its uplink sets
/// them; its bytes and sets per second reported.
fn node_view(keys: &[BlockKey], nodes: u32, path: &Scratch, report: &mut Report) -> Result<(), String> {
    let n = keys.len() as f64;
    let config = MirrorConfig {
        node: NodeId(0),
        ..MirrorConfig::for_entries(MirrorBacking::Shm(path.0.clone()), keys.len() as u64)
    };
    let mut writer = ViewWriter::create(&config).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut sets = 0u64;
    for (i, k) in keys.iter().enumerate() {
        for (node, tier) in holders(i, nodes) {
            writer.set(k, NodeId(node), Some(tier), ObjectKind::KvBlock).map_err(|e| e.to_string())?;
            sets += 1;
        }
    }
    let set_s = start.elapsed().as_secs_f64();
    report.float("view_bytes_per_block", writer.mapped_bytes() as f64 / n);
    report.float("view_sets_per_s", sets as f64 / set_s);
    report.float("view_mb_10m_blocks", writer.mapped_bytes() as f64 / n * 1e7 / 1e6);
    // The file stays (the scratch removes it); the writer holds its lock
    // only while it lives, which readers do not need.
    Ok(())
}

/// The engine's lookups of whole prompts through an empty mirror and the
/// view at `view_path` (every block another node's), and the raw: the same
/// prompts' block tables from a mirror holding them. Seconds of each.
fn lookups(keys: &[BlockKey], args: &ClusterViewArgs, view_path: &Scratch) -> Result<(f64, f64), String> {
    let mirror_path = scratch("mirror");
    let _empty = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(mirror_path.0.clone()), 64))
        .map_err(|e| e.to_string())?;
    let raw_path = scratch("raw");
    let mut raw =
        MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(raw_path.0.clone()), keys.len() as u64))
            .map_err(|e| e.to_string())?;
    let located = MirrorEntry {
        kind: ObjectKind::KvBlock,
        tier: Tier::L1Dram,
        tiers: 0b10,
        region: RegionId(0),
        epoch_tag: 0,
        slot: 0,
        generation: 1,
    };
    for k in keys {
        raw.upsert(k, &located).map_err(|e| e.to_string())?;
    }
    let mirror = MirrorReader::attach(&mirror_path.0).map_err(|e| e.to_string())?;
    let view = view::ViewReader::attach(&view_path.0).map_err(|e| e.to_string())?;
    let raw_reader = MirrorReader::attach(&raw_path.0).map_err(|e| e.to_string())?;
    let prompts = keys.len() / args.chain;
    let prompt = |m: usize| {
        let p = (m.wrapping_mul(2_654_435_761)) % prompts;
        &keys[p * args.chain..(p + 1) * args.chain]
    };
    let (mut places, mut table) = (Vec::new(), Vec::new());
    let start = Instant::now();
    let found: usize =
        (0..args.lookups).map(|m| view::lookup(&mirror, Some(&view), black_box(prompt(m)), &mut places)).sum();
    let view_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let raw_found: usize = (0..args.lookups).map(|m| raw_reader.block_table(black_box(prompt(m)), &mut table)).sum();
    let raw_s = start.elapsed().as_secs_f64();
    if found != args.lookups * args.chain || raw_found != found {
        return Err(format!("lookups found {found} and {raw_found} blocks of {}", args.lookups * args.chain));
    }
    Ok((view_s, raw_s))
}
