//! `cp-scale`: the radix index at scale. Inserts `--blocks` blocks as
//! prompts of `--chain` blocks (each prompt sharing a first block with its
//! group, as real prompts share system prompts), with two replicas each,
//! then matches prompts against it, then publishes them all into a
//! shared-memory mirror. Reports inserts per second, matches per second,
//! heap bytes per block, the process's RSS, and the mirror's bytes per
//! entry and per block. The raw figure
//! beside inserts is a plain `std::collections::HashMap<BlockKey, u32>`
//! insert of the same keys, in the same run.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use lake_cp::index::{Index, Loc, LocState};
use lake_dp::BlockKey;
use lake_dp::rng::SimRng;

use crate::report::Report;

const GOAL_BYTES_PER_BLOCK: f64 = 64.0;
const GOAL_INSERTS_PER_S: f64 = 5e6;

/// A random key (as a keyed hash's output is).
pub(crate) fn key(rng: &mut SimRng) -> BlockKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
    k[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    BlockKey(k)
}

/// Publishes every key into a mirror (a /dev/shm file, removed after);
/// returns its mapped bytes and the seconds the upserts took.
fn mirror_of(keys: &[BlockKey]) -> Result<(usize, f64), String> {
    use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorEntry, MirrorWriter};
    let path = std::path::PathBuf::from(format!("/dev/shm/lake-bench-cp-scale-{}", std::process::id()));
    let config = MirrorConfig::for_entries(MirrorBacking::Shm(path.clone()), keys.len() as u64);
    let mut writer = MirrorWriter::create(&config).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_file(&path);
    let entry = MirrorEntry {
        kind: lake_dp::ObjectKind::KvBlock,
        tier: lake_dp::Tier::L1Dram,
        tiers: 0b0110,
        region: lake_dp::RegionId(1),
        epoch_tag: 0,
        slot: 0,
        generation: 1,
    };
    let start = Instant::now();
    for key in keys {
        writer.upsert(key, &entry).map_err(|e| e.to_string())?;
    }
    Ok((writer.mapped_bytes(), start.elapsed().as_secs_f64()))
}

/// This process's resident memory, in bytes (0 where unreadable).
pub(crate) fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct CpScaleArgs {
    /// Blocks.
    #[arg(long, default_value_t = 20_000_000)]
    pub(crate) blocks: usize,
    /// Blocks per prompt chain.
    #[arg(long, default_value_t = 64)]
    pub(crate) chain: usize,
    /// Longest-prefix matches timed.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) matches: usize,
}

pub(crate) fn run(args: &CpScaleArgs) -> Result<Report, String> {
    let blocks: usize = args.blocks;
    let chain: usize = args.chain;
    let matches: usize = args.matches;
    if blocks == 0 || chain == 0 || chain > blocks {
        return Err("--blocks and --chain positive, --chain at most --blocks".into());
    }
    let prompts = blocks / chain;
    // Keys are made first so the timed loop measures the index alone.
    let mut rng = SimRng::new(7);
    let keys: Vec<BlockKey> = (0..prompts * chain).map(|_| key(&mut rng)).collect();
    let rss_before = rss_bytes();

    let mut index = Index::with_capacity(keys.len());
    let start = Instant::now();
    let mut refs = Vec::with_capacity(chain);
    for prompt in keys.chunks_exact(chain) {
        // A prompt's blocks arrive together (one put of a request's
        // chain), then their replicas.
        refs.clear();
        index.insert_chain(None, prompt, &mut refs).map_err(|e| e.to_string())?;
        for (i, &block) in refs.iter().enumerate() {
            let slot = u32::try_from(i).unwrap_or(0);
            let loc = Loc { region: 1, state: LocState::Ready, epoch_tag: 0, slot, generation: 1 };
            index.add_replica(block, loc).map_err(|e| e.to_string())?;
            index.add_replica(block, Loc { region: 2, ..loc }).map_err(|e| e.to_string())?;
        }
    }
    let insert_s = start.elapsed().as_secs_f64();
    let rss_after = rss_bytes();

    // Longest-prefix matches of whole prompts and of prompts with a new
    // tail (half hit their full length, half stop midway).
    let mut probe = keys[..chain].to_vec();
    let start = Instant::now();
    let mut matched = 0usize;
    for m in 0..matches {
        let p = (m.wrapping_mul(2_654_435_761)) % prompts;
        probe.copy_from_slice(&keys[p * chain..(p + 1) * chain]);
        if m % 2 == 1 {
            probe[chain / 2] = BlockKey([0xee; 16]);
        }
        matched += index.longest_prefix(black_box(&probe));
    }
    let match_s = start.elapsed().as_secs_f64();
    black_box(matched);

    // Raw: a std HashMap insert of the same keys.
    let start = Instant::now();
    let mut raw: HashMap<BlockKey, u32> = HashMap::with_capacity(keys.len());
    for (i, k) in keys.iter().enumerate() {
        raw.insert(*k, u32::try_from(i).unwrap_or(0));
    }
    let raw_s = start.elapsed().as_secs_f64();
    black_box(raw.len());

    let n = keys.len() as f64;
    let bytes_per_block = index.heap_bytes() as f64 / n;
    let inserts_per_s = n / insert_s;
    let mut report = Report::new("cp-scale");
    report.int("blocks", keys.len() as u64);
    report.int("chain", chain as u64);
    report.float("bytes_per_block", bytes_per_block);
    report.float("inserts_per_s", inserts_per_s);
    report.float("raw_hashmap_inserts_per_s", n / raw_s);
    report.float("match_per_s", matches as f64 / match_s);
    report.float("ns_per_match", match_s * 1e9 / matches as f64);
    report.int("rss_bytes", rss_after);
    report.int("rss_index_bytes", rss_after.saturating_sub(rss_before));
    // The shared-memory mirror of the same blocks: one 32-byte bucket an
    // entry, at the load the writer keeps (0.7).
    let (mirror_bytes, mirror_s) = mirror_of(&keys)?;
    report.int("mirror_bytes_per_entry", u64::from(lake_dp::mirror::layout::BUCKET_BYTES));
    report.float("mirror_bytes_per_block", mirror_bytes as f64 / n);
    report.float("mirror_upserts_per_s", n / mirror_s);
    report.float("goal_bytes_per_block", GOAL_BYTES_PER_BLOCK);
    report.float("goal_inserts_per_s", GOAL_INSERTS_PER_S);
    let met = bytes_per_block <= GOAL_BYTES_PER_BLOCK && inserts_per_s >= GOAL_INSERTS_PER_S;
    report.text("goal_met", if met { "yes" } else { "no" });
    Ok(report)
}
