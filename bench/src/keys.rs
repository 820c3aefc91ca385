//! `keys`: the cost of naming blocks. Lake's chain (a fresh chain over the
//! whole prompt, as a new request does) against the raw operation beneath
//! it: one BLAKE3 keyed hash of each block's bytes with no chaining, over
//! the same tokens, interleaved round by round.

use std::hint::black_box;
use std::time::{Duration, Instant};

use lake_dp::{BlockKey, ExtraKeys, KeyChain, KeyScheme, ModelIdentity, Namespace, TenantKey};

use crate::report::{Report, median};

/// The goal: the key chain's cost per block.
const GOAL_NS_PER_BLOCK: f64 = 100.0;

/// The namespace the key benches hash in, and how many whole blocks
/// `tokens` make.
pub(crate) fn bench_namespace(tokens: u32, block_tokens: u32) -> Result<(Namespace, usize), String> {
    let model = ModelIdentity { weights_revision: "bench", tokenizer: "bench", kv_dtype: "bfloat16", kv_scales: &[] }
        .fingerprint();
    let namespace = Namespace::new(
        &TenantKey([0x5a; 32]),
        KeyScheme::TokenIdsV1,
        block_tokens,
        model,
        ExtraKeys::default().digest(),
    )
    .map_err(|e| e.to_string())?;
    let blocks = (tokens / block_tokens) as usize;
    if blocks == 0 {
        return Err(format!("--tokens {tokens} is less than one block of {block_tokens}"));
    }
    Ok((namespace, blocks))
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct KeysArgs {
    /// Prompt tokens.
    #[arg(long, default_value_t = 32_768)]
    pub(crate) tokens: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_tokens: u32,
    /// Rounds measured.
    #[arg(long, default_value_t = 31)]
    pub(crate) rounds: usize,
}

pub(crate) fn run(args: &KeysArgs) -> Result<Report, String> {
    let tokens: u32 = args.tokens;
    let block_tokens: u32 = args.block_tokens;
    let rounds: usize = args.rounds;
    if rounds == 0 {
        return Err("--rounds must be positive".into());
    }
    let (namespace, blocks) = bench_namespace(tokens, block_tokens)?;
    // A deterministic spread of realistic token ids (vocabulary ~152k).
    let ids: Vec<u32> = (0..tokens).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect();
    let mut keys = vec![BlockKey::NONE; blocks];
    let raw_key = *namespace.root();

    let lake_pass = |keys: &mut [BlockKey]| {
        let mut chain = KeyChain::new(&namespace);
        let hashed = chain.extend_tokens(black_box(&ids), keys).unwrap_or(0);
        black_box(keys);
        hashed
    };
    let raw_pass = || {
        let mut sink = 0u8;
        for block in ids.chunks_exact(block_tokens as usize) {
            let bytes: &[u8] = bytemuck_cast(block);
            sink ^= blake3::keyed_hash(&raw_key, black_box(bytes)).as_bytes()[0];
        }
        black_box(sink)
    };
    if lake_pass(&mut keys) != blocks {
        return Err("key chain hashed fewer blocks than expected".into());
    }

    // Passes per round so that a round lasts ~10 ms: long enough to swamp
    // timer noise, short enough that 31 interleaved rounds finish quickly.
    let probe = Instant::now();
    lake_pass(&mut keys);
    let one = probe.elapsed().max(Duration::from_nanos(1));
    let passes = (Duration::from_millis(10).as_nanos() / one.as_nanos()).clamp(1, 100_000) as u32;

    let mut lake_ns = Vec::with_capacity(rounds);
    let mut raw_ns = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let start = Instant::now();
        for _ in 0..passes {
            lake_pass(&mut keys);
        }
        lake_ns.push(start.elapsed().as_nanos() as f64 / f64::from(passes));
        let start = Instant::now();
        for _ in 0..passes {
            raw_pass();
        }
        raw_ns.push(start.elapsed().as_nanos() as f64 / f64::from(passes));
    }
    let lake_total = median(&mut lake_ns);
    let raw_total = median(&mut raw_ns);
    let blocks_f = blocks as f64;
    let ns_per_block = lake_total / blocks_f;

    let mut report = Report::new("keys");
    report.int("tokens", u64::from(tokens));
    report.int("block_tokens", u64::from(block_tokens));
    report.int("blocks", blocks as u64);
    report.int("rounds", rounds as u64);
    report.float("ns_total", lake_total);
    report.float("ns_per_block", ns_per_block);
    report.float("raw_ns_per_block", raw_total / blocks_f);
    report.float("ratio", lake_total / raw_total);
    report.float("goal_ns_per_block", GOAL_NS_PER_BLOCK);
    report.text("goal_met", if ns_per_block <= GOAL_NS_PER_BLOCK { "yes" } else { "no" });
    Ok(report)
}

fn bytemuck_cast(block: &[u32]) -> &[u8] {
    // Same little-endian view the key chain hashes.
    lake_dp::model::key::token_bytes(block)
}
