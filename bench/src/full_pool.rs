//! `full-pool`: does a full pool still take what is new, at the speed an
//! empty one does?
//!
//! Each case starts its own embedded pool (`lake-cp` and `lake-dp` in this
//! process, L2 files in `--dir`) with an L1 of `--l1-slots` and an engine
//! attached in process. `empty`: one prefix of as many blocks as L1 has
//! slots is saved in one call into the empty pool. `full-l2-room`: an older
//! prefix fills L1 first, `--settle-ms` pass (the control plane writes it
//! below and marks victims meanwhile), then the new prefix is saved in one
//! call; L2 has four times L1's room. `full-no-l2`: the same with 8 L2
//! slots a file, so the old blocks must be dropped. For each: the share of
//! the new prefix acked and published (found by a lookup right after, as a
//! prefix), and its save throughput as a ratio of the empty pool's in the
//! same run. Goal: at least 95% published, at least 0.8 of the empty
//! pool's throughput.

#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)] // byte counts as floats for rates; block counts below L1's slots (u32)

use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::{BlockKey, KeyChain, Namespace};

use crate::report::Report;

/// `lake-bench full-pool`'s flags.
#[derive(clap::Args, Debug)]
pub(crate) struct FullPoolArgs {
    /// Directory for the files it makes (removed after).
    #[arg(long)]
    pub(crate) dir: Option<String>,
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 64 * 1024)]
    pub(crate) block_bytes: u64,
    /// L1 slots (and blocks of each prefix).
    #[arg(long, default_value_t = 256)]
    pub(crate) l1_slots: u32,
    /// How long the old prefix sits in L1 before the new one is saved, ms.
    #[arg(long, default_value_t = 1000)]
    pub(crate) settle_ms: u64,
    /// Runs of each case (the median throughput is reported).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
}

fn namespace() -> Result<Namespace, String> {
    let model = lake_dp::ModelIdentity {
        weights_revision: "full-pool",
        tokenizer: "tok",
        kv_dtype: "bfloat16",
        kv_scales: &[],
    }
    .fingerprint();
    let extra = lake_dp::ExtraKeys::default().digest();
    Namespace::new(&lake_dp::TenantKey([5; 32]), lake_dp::KeyScheme::TokenIdsV1, 16, model, extra)
        .map_err(|e| e.to_string())
}

/// One case's run: blocks acked and published, seconds the save took.
struct Saved {
    acked: usize,
    published: usize,
    seconds: f64,
}

/// Starts a pool, fills L1 with an old prefix first (`full`), saves the
/// new one in one call, and looks it up.
fn one_case(args: &FullPoolArgs, dir: &std::path::Path, full: bool, l2_slots: u32) -> Result<Saved, String> {
    let config = EmbeddedConfig {
        block_bytes: args.block_bytes,
        l1_slots: args.l1_slots,
        l2_slots_per_file: l2_slots,
        local_agents: 1,
        remote_agents: 1,
        ..EmbeddedConfig::new(dir.to_path_buf())
    };
    let mut pool = EmbeddedPool::start(&config)?;
    let ns = namespace()?;
    let agent_config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "full-pool",
        namespace: ns.id(),
        layout_fingerprint: 0xf0,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    let mut agent = Agent::attach(&agent_config, pool.local_ports.remove(0)).map_err(|e| e.to_string())?;
    let blocks = args.l1_slots as usize;
    let payload = vec![0xa5u8; args.block_bytes as usize];
    let prefix = |seed: u32| -> Result<Vec<BlockKey>, String> {
        let tokens: Vec<u32> = (0..blocks as u32 * 16).map(|t| t.wrapping_mul(7).wrapping_add(seed)).collect();
        KeyChain::keys(&ns, &tokens).map_err(|e| e.to_string())
    };
    let save = |agent: &mut Agent, keys: &[BlockKey]| {
        let chain: Vec<SaveBlock<'_>> = (0..keys.len())
            .map(|i| SaveBlock {
                key: keys[i],
                parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
                block_index: i as u32,
                payload: SavePayload::Bytes(&payload),
            })
            .collect();
        agent.save(&chain)
    };
    if full {
        save(&mut agent, &prefix(1)?);
        std::thread::sleep(Duration::from_millis(args.settle_ms));
    }
    let new = prefix(2)?;
    let started = Instant::now();
    let acked = save(&mut agent, &new);
    let seconds = started.elapsed().as_secs_f64();
    // Published: found as a prefix once the commits have reached the
    // mirror (the wait is not timed).
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut published = agent.lookup(&new, &mut table);
    while published < acked && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
        published = agent.lookup(&new, &mut table);
    }
    drop(agent);
    pool.stop()?;
    Ok(Saved { acked, published, seconds })
}

/// `lake-bench full-pool`.
pub(crate) fn run(args: &FullPoolArgs) -> Result<Report, String> {
    if args.l1_slots < 16 || args.rounds == 0 {
        return Err("--l1-slots at least 16, --rounds at least 1".into());
    }
    let base = args.dir.as_ref().map_or_else(
        || std::env::temp_dir().join(format!("lake-bench-full-pool-{}", std::process::id())),
        std::path::PathBuf::from,
    );
    let bytes = args.block_bytes as f64 * f64::from(args.l1_slots);
    let mut report = Report::new("full-pool");
    report.int("block_bytes", args.block_bytes);
    report.int("l1_slots", u64::from(args.l1_slots));
    let mut empty_gbps = 0.0;
    for (name, full, l2_slots) in
        [("empty", false, 4 * args.l1_slots), ("full_l2_room", true, 4 * args.l1_slots), ("full_no_l2", true, 8)]
    {
        let mut runs = Vec::with_capacity(args.rounds);
        for round in 0..args.rounds {
            let dir = base.join(format!("{name}-{round}"));
            let saved = one_case(args, &dir, full, l2_slots);
            let _ = std::fs::remove_dir_all(&dir);
            runs.push(saved?);
        }
        let mut rates: Vec<f64> =
            runs.iter().map(|r| r.acked as f64 * args.block_bytes as f64 / r.seconds / 1e9).collect();
        let gbps = crate::report::median(&mut rates);
        let published = runs.iter().map(|r| r.published).min().unwrap_or(0);
        let acked = runs.iter().map(|r| r.acked).min().unwrap_or(0);
        if !full {
            empty_gbps = gbps;
        }
        let blocks = f64::from(args.l1_slots);
        report.float(&format!("{name}_published"), published as f64 / blocks);
        report.float(&format!("{name}_acked"), acked as f64 / blocks);
        report.float(&format!("{name}_gbps"), gbps);
        if full && empty_gbps > 0.0 {
            report.float(&format!("{name}_vs_empty"), gbps / empty_gbps);
        }
        eprintln!(
            "{name}: {acked} of {} acked, {published} published (worst of {} rounds); {gbps:.2} GB/s median of {:.1} MB",
            args.l1_slots,
            args.rounds,
            bytes / 1e6
        );
    }
    let _ = std::fs::remove_dir_all(&base);
    Ok(report)
}
