//! `tenants`: can one tenant tell, by timing its own lookups, whether
//! another tenant has cached the same prompt? Two namespaces of different
//! tenants key the same tokens to unrelated block keys (DESIGN §3: the
//! chain is keyed by the tenant's secret), so tenant B's lookup of a
//! prompt A cached touches none of A's entries.
//!
//! The mirror holds `--entries` other blocks and tenant A's copies of
//! `--prompts` prompts. Interleaved, many times, on prompts chosen at
//! random: B looks up a prompt A cached (`ns_b_on_a_cached`), B looks up
//! a prompt nobody cached (`ns_b_on_uncached`), and A looks up its own
//! (`ns_a_hit`, the hit, to show the clock can tell a hit from a miss at
//! all). `leak_ratio` = the first over the second (1 is no signal);
//! `hit_ratio` = the hit over B's miss. Each figure is a median of
//! lookups, each of a prompt whose buckets were not touched lately.

#![allow(clippy::cast_possible_truncation)]

use std::hint::black_box;
use std::time::Instant;

use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorEntry, MirrorReader, MirrorWriter};
use lake_dp::rng::SimRng;
use lake_dp::{BlockKey, KeyChain, ObjectKind, RegionId, Tier};

use crate::report::{Report, median};

fn entry(slot: u32) -> MirrorEntry {
    MirrorEntry {
        kind: ObjectKind::KvBlock,
        tier: Tier::L1Dram,
        tiers: 0b0010,
        region: RegionId(1),
        epoch_tag: 1,
        slot,
        generation: slot | 1,
    }
}

fn namespace(tenant: u8) -> Result<lake_dp::Namespace, String> {
    let model =
        lake_dp::ModelIdentity { weights_revision: "r1", tokenizer: "tok", kv_dtype: "bfloat16", kv_scales: &[] }
            .fingerprint();
    let extra = lake_dp::ExtraKeys::default().digest();
    lake_dp::Namespace::new(&lake_dp::TenantKey([tenant; 32]), lake_dp::KeyScheme::TokenIdsV1, 16, model, extra)
        .map_err(|e| e.to_string())
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct TenantsArgs {
    /// Other entries in the index or mirror.
    #[arg(long, default_value_t = 2_000_000)]
    pub(crate) entries: u64,
    /// Distinct prompts.
    #[arg(long, default_value_t = 2000)]
    pub(crate) prompts: usize,
    /// Blocks.
    #[arg(long, default_value_t = 16)]
    pub(crate) blocks: usize,
    /// Lookups timed.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) lookups: usize,
}

pub(crate) fn run(args: &TenantsArgs) -> Result<Report, String> {
    let entries: u64 = args.entries;
    let prompts: usize = args.prompts;
    let blocks: usize = args.blocks;
    let lookups: usize = args.lookups;
    let (a, b) = (namespace(1)?, namespace(2)?);
    let shm = std::path::PathBuf::from(format!("/dev/shm/lake-bench-tenants-{}", std::process::id()));
    let total = entries + (prompts * blocks) as u64;
    let mut writer = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(shm.clone()), total))
        .map_err(|e| e.to_string())?;
    let reader = MirrorReader::attach(&shm).map_err(|e| e.to_string());
    let _ = std::fs::remove_file(&shm);
    let reader = reader?;
    let mut rng = SimRng::new(7);
    for i in 0..entries {
        let mut k = [0u8; 16];
        k[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
        k[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
        writer.upsert(&BlockKey(k), &entry(i as u32)).map_err(|e| e.to_string())?;
    }
    // Prompts 0..prompts are cached by A; prompts..2*prompts by nobody.
    let tokens = |p: usize| -> Vec<u32> {
        (0..(blocks * 16) as u32).map(|t| (p as u32).wrapping_mul(7919) ^ t.wrapping_mul(31)).collect()
    };
    let keys_of = |ns: &lake_dp::Namespace, p: usize| KeyChain::keys(ns, &tokens(p)).map_err(|e| e.to_string());
    let (mut a_keys, mut b_cached, mut b_uncached) = (Vec::new(), Vec::new(), Vec::new());
    for p in 0..prompts {
        let keys = keys_of(&a, p)?;
        for (i, key) in keys.iter().enumerate() {
            writer.upsert(key, &entry((p * blocks + i) as u32)).map_err(|e| e.to_string())?;
        }
        a_keys.push(keys);
        b_cached.push(keys_of(&b, p)?);
        b_uncached.push(keys_of(&b, prompts + p)?);
    }
    // No hit across tenants, whatever the timing says.
    for p in 0..prompts {
        if reader.longest_prefix(&b_cached[p]) != 0 {
            return Err(format!("tenant B hit tenant A's prompt {p}"));
        }
        if reader.longest_prefix(&a_keys[p]) != blocks {
            return Err(format!("tenant A's own prompt {p} is not a whole hit"));
        }
    }
    let (mut on_cached, mut on_uncached, mut hit) = (Vec::new(), Vec::new(), Vec::new());
    let time = |keys: &[BlockKey]| {
        let start = Instant::now();
        black_box(reader.longest_prefix(black_box(keys)));
        start.elapsed().as_nanos() as f64
    };
    for _ in 0..lookups {
        // Random prompts, random order of the three: neither cache state
        // nor position favours one.
        let p = rng.below(prompts as u64) as usize;
        let q = rng.below(prompts as u64) as usize;
        let r = rng.below(prompts as u64) as usize;
        match rng.below(3) {
            0 => {
                on_cached.push(time(&b_cached[p]));
                on_uncached.push(time(&b_uncached[q]));
                hit.push(time(&a_keys[r]));
            }
            1 => {
                on_uncached.push(time(&b_uncached[q]));
                hit.push(time(&a_keys[r]));
                on_cached.push(time(&b_cached[p]));
            }
            _ => {
                hit.push(time(&a_keys[r]));
                on_cached.push(time(&b_cached[p]));
                on_uncached.push(time(&b_uncached[q]));
            }
        }
    }
    let (cached, uncached, hit) = (median(&mut on_cached), median(&mut on_uncached), median(&mut hit));
    let mut report = Report::new("tenants");
    report.int("entries", entries);
    report.int("prompts", prompts as u64);
    report.int("blocks", blocks as u64);
    report.int("lookups", lookups as u64);
    report.int("cross_tenant_hits", 0);
    report.float("ns_b_on_a_cached", cached);
    report.float("ns_b_on_uncached", uncached);
    report.float("ns_a_hit", hit);
    report.float("leak_ratio", cached / uncached);
    report.float("hit_ratio", hit / uncached);
    drop(writer);
    Ok(report)
}
