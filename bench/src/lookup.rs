//! `lookup`: an engine's longest-prefix lookup, read from the shared-memory
//! mirror while its writer keeps changing it, with the table holding tens
//! of millions of other entries.
//!
//! Figures (medians over many lookups, each of a different prompt so the
//! prompt's buckets are not already in cache):
//! - `ns_hash`: the block keys of the prompt's tokens (the chain).
//! - `ns_hit_length`: the binary search for how many leading blocks are
//!   published (prefetching the probes two levels ahead).
//! - `ns_block_table`: reading and checking every one of those entries
//!   (which also makes the answer exact where the set has a hole).
//! - `ns_per_probe`: one lookup of a published key not recently touched,
//!   alone.
//! - `ns_raw_line`: loading one random 32-byte bucket of the same mapping
//!   (no lock, no key check), independent loads overlapping; and
//!   `ns_raw_miss`: the same loads chased (each address from the word
//!   before), the latency of one cold access — the physical floor of a
//!   probe that misses the cache, in the same run.

// Slot numbers and prompt indexes are cut to u32 on purpose (they only
// label entries); sizes are bounded by the bench's flags.
#![allow(clippy::cast_possible_truncation)]

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorEntry, MirrorReader, MirrorWriter};
use lake_dp::rng::SimRng;
use lake_dp::{BlockKey, KeyChain, ObjectKind, RegionId, Tier};

use crate::report::{Report, median, percentile};

const GOAL_NS_HIT_LENGTH: f64 = 2000.0;
const GOAL_NS_BLOCK_TABLE_PER_BLOCK: f64 = 20.0;
const GOAL_NS_PER_PROBE: f64 = 100.0;

fn random_key(rng: &mut SimRng) -> BlockKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
    k[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
    BlockKey(k)
}

fn entry(slot: u32) -> MirrorEntry {
    MirrorEntry {
        kind: ObjectKind::KvBlock,
        tier: Tier::L1Dram,
        tiers: 0b0110,
        region: RegionId(1),
        epoch_tag: 1,
        slot,
        generation: slot | 1,
    }
}

/// The mirror, on a hugetlb memfd where huge pages are reserved (or
/// `--backing shm`), else a /dev/shm file.
fn create(entries: u64, backing: &str) -> Result<(MirrorWriter, MirrorReader, &'static str), String> {
    let shm = std::path::PathBuf::from(format!("/dev/shm/lake-bench-mirror-{}", std::process::id()));
    if backing != "shm" {
        match MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::HugetlbMemfd, entries)) {
            Ok(writer) => {
                let fd = writer.file().try_clone().map_err(|e| e.to_string())?;
                let reader = MirrorReader::attach_fd(fd.into()).map_err(|e| e.to_string())?;
                return Ok((writer, reader, "hugetlb-memfd"));
            }
            Err(e) if backing == "memfd" => return Err(e.to_string()),
            Err(e) => eprintln!("lookup: no hugetlb memfd ({e}); using {}", shm.display()),
        }
    }
    let writer = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(shm.clone()), entries))
        .map_err(|e| e.to_string())?;
    let reader = MirrorReader::attach(&shm).map_err(|e| e.to_string());
    // The mapping stays; the name is not needed.
    let _ = std::fs::remove_file(&shm);
    Ok((writer, reader?, "shm"))
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct LookupArgs {
    /// Prompt tokens.
    #[arg(long, default_value_t = 32_768)]
    pub(crate) tokens: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_tokens: u32,
    /// Other entries in the index or mirror.
    #[arg(long, default_value_t = 20_000_000)]
    pub(crate) entries: u64,
    /// Distinct prompts.
    #[arg(long, default_value_t = 256)]
    pub(crate) prompts: usize,
    /// Lookups timed.
    #[arg(long, default_value_t = 4096)]
    pub(crate) lookups: usize,
    /// Single-bucket probes timed.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) probes: usize,
    /// Mirror backing: auto, memfd or shm.
    #[arg(long, default_value = "auto")]
    pub(crate) backing: String,
    /// Whether the mirror's writer churns during lookups.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub(crate) churn: bool,
}

pub(crate) fn run(args: &LookupArgs) -> Result<Report, String> {
    let tokens: u32 = args.tokens;
    let block_tokens: u32 = args.block_tokens;
    let others: u64 = args.entries;
    let prompts: usize = args.prompts;
    let lookups: usize = args.lookups;
    let probes: usize = args.probes;
    let backing: String = args.backing.clone();
    let churn_on: bool = args.churn;
    if !matches!(backing.as_str(), "auto" | "memfd" | "shm") {
        return Err("--backing auto, memfd or shm".into());
    }
    if prompts == 0 || lookups == 0 || probes == 0 {
        return Err("--prompts, --lookups and --probes must be positive".into());
    }
    let (namespace, blocks) = crate::keys::bench_namespace(tokens, block_tokens)?;

    // The prompts' keys; the first prompt's hashing is timed.
    let mut hash_ns = Vec::new();
    let mut prompt_keys: Vec<Vec<BlockKey>> = Vec::with_capacity(prompts);
    for p in 0..prompts {
        let ids: Vec<u32> =
            (0..tokens).map(|i| (i.wrapping_mul(2_654_435_761) ^ (p as u32).wrapping_mul(40_503)) % 151_936).collect();
        let start = Instant::now();
        let keys = KeyChain::keys(&namespace, &ids).map_err(|e| e.to_string())?;
        hash_ns.push(start.elapsed().as_nanos() as f64);
        prompt_keys.push(keys);
    }

    let total = others + (prompts * blocks) as u64;
    let (mut writer, reader, backing) = create(total, &backing)?;
    let mut rng = SimRng::new(11);
    let fill_start = Instant::now();
    for i in 0..others {
        writer.upsert(&random_key(&mut rng), &entry(i as u32)).map_err(|e| e.to_string())?;
    }
    let fill_s = fill_start.elapsed().as_secs_f64();
    for keys in &prompt_keys {
        for (i, key) in keys.iter().enumerate() {
            writer.upsert(key, &entry(i as u32)).map_err(|e| e.to_string())?;
        }
    }

    // The writer keeps inserting and removing other keys meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let churn = {
        let (stop, writes) = (stop.clone(), writes.clone());
        std::thread::spawn(move || -> Result<(), String> {
            let mut rng = SimRng::new(99);
            let mut recent: std::collections::VecDeque<BlockKey> = std::collections::VecDeque::new();
            while churn_on && !stop.load(Ordering::Relaxed) {
                let key = random_key(&mut rng);
                writer.upsert(&key, &entry(7)).map_err(|e| e.to_string())?;
                recent.push_back(key);
                if recent.len() > 4096
                    && let Some(old) = recent.pop_front()
                {
                    writer.remove(&old);
                }
                writes.fetch_add(2, Ordering::Relaxed);
            }
            Ok(())
        })
    };

    let mut table = Vec::with_capacity(blocks);
    let (mut hit_ns, mut table_ns) = (Vec::with_capacity(lookups), Vec::with_capacity(lookups));
    let churn_start = Instant::now();
    let writes_before = writes.load(Ordering::Relaxed);
    for l in 0..lookups {
        let keys = &prompt_keys[l % prompts];
        let start = Instant::now();
        let n = reader.longest_prefix(black_box(keys));
        let searched = Instant::now();
        let m = reader.block_table(&keys[..n], &mut table);
        let read = Instant::now();
        if n != blocks || m != blocks {
            stop.store(true, Ordering::Relaxed);
            let again = keys.get(m).map(|k| reader.get(k));
            return Err(format!(
                "lookup {l}: hit length {n}, block table {m}, expected {blocks}; key {m} again: {again:?}"
            ));
        }
        hit_ns.push((searched - start).as_nanos() as f64);
        table_ns.push((read - searched).as_nanos() as f64);
    }

    // One probe alone: published keys of the other entries (the same
    // random stream the fill used: spread over the whole table, not
    // recently touched), against one raw bucket load of the same mapping.
    let mut replay = SimRng::new(11);
    let picks: Vec<BlockKey> = (0..probes.min(others as usize).max(1)).map(|_| random_key(&mut replay)).collect();
    let probes = picks.len();
    let start = Instant::now();
    let mut found = 0usize;
    for key in &picks {
        found += usize::from(matches!(reader.get(black_box(key)), lake_dp::mirror::Lookup::Hit(_)));
    }
    let probe_ns = start.elapsed().as_nanos() as f64 / probes as f64;
    let buckets = reader.header().buckets;
    let lines: Vec<u64> = (0..probes).map(|_| rng.below(buckets)).collect();
    let start = Instant::now();
    let raw_sum = reader.raw_bucket_sum(black_box(&lines));
    let raw_ns = start.elapsed().as_nanos() as f64 / probes as f64;
    black_box(raw_sum);
    let start = Instant::now();
    black_box(reader.raw_bucket_chase(black_box(12_345), probes));
    let raw_miss_ns = start.elapsed().as_nanos() as f64 / probes as f64;
    let churn_s = churn_start.elapsed().as_secs_f64();
    let writes_during = writes.load(Ordering::Relaxed) - writes_before;
    stop.store(true, Ordering::Relaxed);
    churn.join().map_err(|_| "the writer thread panicked".to_owned())??;
    if others > 0 && found != probes {
        return Err(format!("{} of {probes} published keys were not found", probes - found));
    }

    let hit_length = median(&mut hit_ns);
    let block_table = median(&mut table_ns);
    let mut report = Report::new("lookup");
    report.int("tokens", u64::from(tokens));
    report.int("block_tokens", u64::from(block_tokens));
    report.int("blocks", blocks as u64);
    report.int("table_entries", reader.live());
    report.int("buckets", buckets);
    report.text("backing", backing);
    report.float("ns_hash", median(&mut hash_ns));
    report.float("ns_hit_length", hit_length);
    report.float("ns_hit_length_p99", percentile(&mut hit_ns, 990));
    report.float("ns_block_table", block_table);
    report.float("ns_block_table_p99", percentile(&mut table_ns, 990));
    report.float("ns_block_table_per_block", block_table / blocks as f64);
    report.float("ns_per_probe", probe_ns);
    report.float("ns_raw_line", raw_ns);
    report.float("ns_raw_miss", raw_miss_ns);
    report.float("probe_vs_raw_miss", probe_ns / raw_miss_ns);
    report.float("writer_ops_per_s_during", writes_during as f64 / churn_s);
    report.float("fill_upserts_per_s", others as f64 / fill_s);
    report.int("mirror_bytes_per_entry", 32);
    report.float("mirror_bytes_per_live_entry", (buckets * 32) as f64 / reader.live().max(1) as f64);
    let met = hit_length <= GOAL_NS_HIT_LENGTH
        && block_table / blocks as f64 <= GOAL_NS_BLOCK_TABLE_PER_BLOCK
        && probe_ns <= GOAL_NS_PER_PROBE;
    report.text("goal_met", if met { "yes" } else { "no" });
    Ok(report)
}
