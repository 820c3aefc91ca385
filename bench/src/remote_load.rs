//! `remote-load`: a block held only on another node, pulled into this
//! node's L1 through the pool — one at a time and as one batch — against
//! raw TCP between the same network namespaces, at each block size asked
//! (a real model's KV block is megabytes: 2 MiB for 16 tokens of an 8B
//! model in fp16). Three `lake serve` nodes in namespaces of their own on
//! one bridge, members of a cluster in a real etcd under a `lake summary`
//! leader, as `cluster-hits` deploys them; a fresh deployment per size.
//! Needs root and etcd.

use std::time::Duration;

use lake_tests::netns::Switch;

use crate::cluster_hits::{ArgsPaths, Binaries, Mode, Scratch, deploy, raw_tcp, remote_loads};
use crate::report::{Report, percentile};

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct RemoteLoadArgs {
    /// The `lake` and etcd binaries.
    #[command(flatten)]
    pub(crate) binaries: Binaries,
    /// Blocks pulled one at a time, and as one batch, at each size.
    #[arg(long, default_value_t = 64)]
    pub(crate) pulls: u32,
    /// The block sizes, in bytes.
    #[arg(long, value_delimiter = ',', default_value = "16384,262144,1048576,2097152")]
    pub(crate) block_bytes: Vec<usize>,
}

pub(crate) fn run(args: &RemoteLoadArgs) -> Result<Report, String> {
    let lake = args.binaries.lake()?;
    let switch = Switch::new(3, 1).map_err(|e| format!("network namespaces (root?): {e}"))?;
    let base = Scratch(std::env::temp_dir().join(format!("lake-bench-remote-{}", std::process::id())));
    std::fs::create_dir_all(&base.0).map_err(|e| e.to_string())?;
    let mut report = Report::new("remote-load");
    report.int("pulls", u64::from(args.pulls));
    let count = args.pulls as usize;
    for &block_bytes in &args.block_bytes {
        if block_bytes == 0 || block_bytes % 4096 != 0 {
            return Err(format!("--block-bytes {block_bytes}: a positive multiple of 4096"));
        }
        // Room for the blocks pulled (both rounds) on each node, and a few.
        let paths = ArgsPaths {
            lake: lake.clone(),
            etcd: args.binaries.etcd.clone(),
            l1_slots: 2 * args.pulls + 32,
            l2_slots: 8,
            block_bytes,
        };
        let (mut singles, batch_s) = {
            let deployment = deploy(&paths, &switch, Mode::Cluster, &base.0.join(block_bytes.to_string()))?;
            // Every node in the leader's view before the first pull.
            std::thread::sleep(Duration::from_secs(1));
            remote_loads(args.pulls, block_bytes, &deployment)?
        };
        let (mut raw_singles, raw_batch_s) = raw_tcp(&switch, count, count, block_bytes)?;
        let name = |what: &str| format!("b{block_bytes}_{what}");
        let (lake_p50, raw_p50) = (percentile(&mut singles, 500), percentile(&mut raw_singles, 500));
        report.float(&name("pull_p50_ns"), lake_p50);
        report.float(&name("pull_p99_ns"), percentile(&mut singles, 990));
        report.float(&name("raw_tcp_p50_ns"), raw_p50);
        report.float(&name("raw_tcp_p99_ns"), percentile(&mut raw_singles, 990));
        report.float(&name("pull_p50_vs_raw_tcp"), lake_p50 / raw_p50);
        let bytes = (count * block_bytes) as f64;
        let (lake_mbs, raw_mbs) = (bytes / batch_s / 1e6, bytes / raw_batch_s / 1e6);
        report.float(&name("batch_mb_per_s"), lake_mbs);
        report.float(&name("raw_tcp_batch_mb_per_s"), raw_mbs);
        report.float(&name("batch_vs_raw_tcp"), lake_mbs / raw_mbs);
    }
    Ok(report)
}
