//! `lake demo`: the embedded pool under a multi-turn agent workload, and
//! its report.

use super::*;

#[derive(Args, Debug)]
pub(super) struct DemoArgs {
    /// Conversations.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().sessions)]
    sessions: u32,
    /// Turns per conversation.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().turns)]
    turns: u32,
    /// Engine threads, each with its agent.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().engines)]
    engines: u32,
    /// Blocks of the system prompt every conversation shares.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().system_blocks)]
    system_blocks: u32,
    /// Blocks of each new user message.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().message_blocks)]
    message_blocks: u32,
    /// Blocks of each reply.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().reply_blocks)]
    reply_blocks: u32,
    /// L1 slots (below the working set: L2 takes the rest).
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().l1_slots)]
    l1_slots: u32,
    /// L2 slots per file (two files).
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().l2_slots_per_file)]
    l2_slots: u32,
    /// The workload's seed.
    #[arg(long, value_name = "N", default_value_t = DemoConfig::default().seed)]
    seed: u64,
    /// Where the L2 files go (default: a temporary directory, removed).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Seconds to keep the pool up after the workload (to look at it with
    /// `lake top`).
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    hold: u64,
}

pub(super) fn demo(args: &DemoArgs) -> Result<(), String> {
    let mut config = DemoConfig {
        sessions: args.sessions,
        turns: args.turns,
        engines: args.engines,
        system_blocks: args.system_blocks,
        message_blocks: args.message_blocks,
        reply_blocks: args.reply_blocks,
        l1_slots: args.l1_slots,
        l2_slots_per_file: args.l2_slots,
        seed: args.seed,
        hold_s: args.hold,
        ..DemoConfig::default()
    };
    if let Some(dir) = &args.dir {
        config.dir.clone_from(dir);
    }
    say!(
        "lake demo: one process — lake-cp, lake-dp (L1 in /dev/shm, L2 files in {}), {} engine agents; \
         {} conversations x {} turns sharing a {}-block system prompt",
        config.dir.display(),
        config.engines,
        config.sessions,
        config.turns,
        config.system_blocks
    );
    let report = lake_cp::demo::run(&config, &mut std::io::stdout())?;
    print_report(&report);
    if report.mismatches > 0 {
        return Err(format!("{} payloads differed from the model's", report.mismatches));
    }
    Ok(())
}

#[allow(clippy::cast_precision_loss)]
pub(super) fn print_report(r: &DemoReport) {
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let p = |x: &Percentiles| format!("p50 {:.1} µs, p90 {:.1}, p99 {:.1}, max {:.1}", x.p50, x.p90, x.p99, x.max);
    let dp = &r.data_plane;
    say!("");
    say!("turns              {} in {:.1} s", r.turns, r.seconds);
    say!(
        "hit rate           {:.1}% of {} prompt blocks served from the pool ({} from L1, {} promoted from L2); \
         {} looked-up blocks recomputed",
        100.0 * r.hit_rate(),
        r.blocks_requested,
        r.served_l1,
        r.served_l2,
        r.fetch_failures
    );
    say!("integrity          {} payload mismatches (every served block compared)", r.mismatches);
    say!("saves              {} blocks saved, {} skipped ({} KiB each)", r.saves.0, r.saves.1, r.block_bytes / 1024);
    for (name, usage) in ["L1", "L2"].iter().zip(&r.tiers) {
        say!(
            "{name} now            {:.1} of {:.1} MiB ({} blocks)",
            mib(usage.bytes),
            mib(usage.capacity_bytes),
            usage.blocks
        );
    }
    say!(
        "tier moves         {} demoted L1->L2, {} dropped from L1, {} dropped from L2; {} promoted L2->L1",
        r.moves.0,
        r.moves.1,
        r.moves.2,
        dp.pool.promotions
    );
    say!("bytes moved        {:.1} MiB L1->L2, {:.1} MiB L2->L1", mib(dp.pool.bytes_down), mib(dp.pool.bytes_up));
    say!("lookup (mirror)    {}", p(&r.lookup_us));
    say!("fetch per request  {}", p(&r.fetch_us));
    say!("save per request   {}", p(&r.save_us));
    #[allow(clippy::cast_precision_loss)]
    let busy = dp.busy_ns as f64 / (dp.busy_ns + dp.idle_ns + dp.parked_ns).max(1) as f64;
    say!("lake-dp            {:.1}% of its loop busy, {} parks", 100.0 * busy, dp.parks);
    if let Some(address) = r.metrics {
        say!("metrics            http://{address}/metrics served {} lines while the pool ran", r.metrics_lines);
    }
    say!(
        "{{\"turns\":{},\"blocks_requested\":{},\"blocks_served\":{},\"hit_rate\":{:.4},\"mismatches\":{},\
         \"demotions\":{},\"promotions\":{},\"l1_bytes\":{},\"l2_bytes\":{},\"lookup_p50_us\":{:.2},\
         \"lookup_p99_us\":{:.2},\"fetch_p50_us\":{:.1},\"fetch_p99_us\":{:.1},\"save_p50_us\":{:.1},\
         \"save_p99_us\":{:.1},\"seconds\":{:.2}}}",
        r.turns,
        r.blocks_requested,
        r.blocks_served,
        r.hit_rate(),
        r.mismatches,
        r.moves.0,
        dp.pool.promotions,
        r.tiers[0].bytes,
        r.tiers[1].bytes,
        r.lookup_us.p50,
        r.lookup_us.p99,
        r.fetch_us.p50,
        r.fetch_us.p99,
        r.save_us.p50,
        r.save_us.p99,
        r.seconds
    );
}
