//! `lake-bench`: Lake's benchmarks. Each subcommand measures a Lake path and
//! the raw operation beneath it in the same run and prints, as its last
//! line, one JSON object with both figures and their ratio.
//!
//! Run with `cargo run --release -p lake-bench -- SUBCOMMAND [--flag value]`;
//! `--help` lists the subcommands, `SUBCOMMAND --help` its flags and defaults.

// Benchmarks report durations and byte counts as floating-point figures;
// the precision lost above 2^52 ns or bytes does not matter to a ratio.
#![allow(clippy::cast_precision_loss)]

mod arena;
mod classes;
mod cluster_hits;
mod cluster_view;
mod cp_scale;
mod ffi;
mod full_pool;
mod gpu;
mod keys;
mod l2;
mod l3;
mod lookup;
mod qos;
mod remote_load;
mod report;
mod route_sim;
mod router;
mod store_pull;
mod tcp;
mod tenants;
mod trace;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Lake's benchmarks: each measures a Lake path and the raw operation
/// beneath it in the same run, and prints as its last line one JSON object
/// with both figures and their ratio.
#[derive(Parser, Debug)]
#[command(
    name = "lake-bench",
    version,
    propagate_version = true,
    subcommand_required = true,
    arg_required_else_help = true
)]
struct Cli {
    #[command(subcommand)]
    command: Bench,
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// Block-key chain cost vs one raw BLAKE3 keyed hash per block.
    Keys(keys::KeysArgs),
    /// L1 arena pin+unpin vs raw store/fence/load; the reclaim scan vs a
    /// raw load loop over as many pin entries.
    Pin(arena::PinArgs),
    /// L2 write and read throughput through Lake vs a raw O_DIRECT io_uring
    /// loop over the same file, queue depth and bytes.
    L2(l2::L2Args),
    /// Blocks through Lake's L3 client into an S3-compatible store (its own
    /// moto_server unless --endpoint) vs a raw loop of the same S3 client on
    /// as many threads.
    L3(l3::L3Args),
    /// Per-block submit-to-complete latency, Lake vs one raw io_uring read;
    /// the CRC's cost and the poller's own (no-op backend) apart.
    BlockLatency(l2::BlockLatencyArgs),
    /// The radix index at scale: inserts/s, matches/s, heap bytes per block,
    /// RSS; a std HashMap insert beside it.
    CpScale(cp_scale::CpScaleArgs),
    /// The cluster view at scale: the leader's memory per replica, the
    /// snapshot's bytes, a node's view bytes per block and sets/s, an
    /// engine's lookup through mirror and view vs a mirror's block table.
    ClusterView(cluster_view::ClusterViewArgs),
    /// (root, etcd) Three nodes in network namespaces replaying
    /// conversations on random nodes: the hit ratio as one pool across
    /// them, as three islands and as one pool of their capacity; remote
    /// loads against raw TCP between the namespaces.
    ClusterHits(cluster_hits::ClusterHitsArgs),
    /// (etcd) Blocks another node holds only in L3 pulled from the object
    /// store two nodes share (by name, checked, into L1), one at a time and
    /// as a batch, against reading the same objects' files straight.
    StorePull(store_pull::StorePullArgs),
    /// (etcd) Blocks only another node holds pulled into this node's L1,
    /// one at a time and as a batch, at several block sizes, against raw
    /// TCP between the same network namespaces.
    RemoteLoad(remote_load::RemoteLoadArgs),
    /// Two tenants, the same prompts: B's lookups of prompts A cached
    /// against prompts nobody cached (no hit; the timing ratio), and A's hits.
    Tenants(tenants::TenantsArgs),
    /// Longest-prefix lookup and block table of a prompt read from the
    /// shared-memory mirror while its writer changes it; one probe vs one
    /// raw bucket load.
    Lookup(lookup::LookupArgs),
    /// The engine's path through the C ABI against an embedded pool:
    /// lookups per block, L1 loads into engine memory vs memcpy, one block's
    /// submit-to-complete vs memcpy + CRC.
    Ffi(ffi::FfiArgs),
    /// (GPU machine) the kernels moving KV between a vLLM paged cache on the
    /// GPU and pool blocks in pinned host memory vs plain pinned copies.
    Gpu(gpu::GpuArgs),
    /// Blocks between two nodes' slots over loopback TCP through Lake's
    /// transport (striped, checked at the target) vs one plain TCP stream.
    Tcp(tcp::TcpArgs),
    /// Simulated agent conversations over several nodes routed by
    /// lake_dp::route vs always-PD and always-colocated.
    Route(route_sim::RouteArgs),
    /// `lake route`'s answer time, in process and over HTTP, against the
    /// lookup and route function beneath it and a loopback TCP round trip.
    Router(router::RouterArgs),
    /// Replay a hash_ids trace through the real index and eviction code.
    Trace(trace::TraceArgs),
    /// Write a trace in the Mooncake format.
    TraceGen(trace::TraceGenArgs),
    /// Replay a trace through the real tier manager, L1 over L2: L2 blocks
    /// written and hit ratio, with and without the second-access filter.
    TraceTiers(trace::TraceTiersArgs),
    /// A critical-path load from L2, unloaded and while writers flood the
    /// pool with saves: p50/p99 of each.
    Qos(qos::QosArgs),
    /// A new prefix saved into an L1 full of older blocks, with room in L2
    /// and without: the share published and the throughput against an
    /// empty pool's.
    FullPool(full_pool::FullPoolArgs),
    /// Two models of different block sizes over one L1, split between their
    /// size classes and shared in chunks: requests served from L1, from L2,
    /// computed again.
    Classes(classes::ClassesArgs),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Bench::Keys(args) => keys::run(&args),
        Bench::Pin(args) => arena::run(&args),
        Bench::L2(args) => l2::run_l2(&args),
        Bench::L3(args) => l3::run(&args),
        Bench::BlockLatency(args) => l2::run_block_latency(&args),
        Bench::CpScale(args) => cp_scale::run(&args),
        Bench::ClusterView(args) => cluster_view::run(&args),
        Bench::ClusterHits(args) => cluster_hits::run(&args),
        Bench::StorePull(args) => store_pull::run(&args),
        Bench::RemoteLoad(args) => remote_load::run(&args),
        Bench::Tenants(args) => tenants::run(&args),
        Bench::Lookup(args) => lookup::run(&args),
        Bench::Ffi(args) => ffi::run(&args),
        Bench::Gpu(args) => gpu::run(&args),
        Bench::Tcp(args) => tcp::run(&args),
        Bench::Route(args) => route_sim::run(&args),
        Bench::Router(args) => router::run(&args),
        Bench::Trace(args) => trace::run_trace(&args),
        Bench::TraceGen(args) => trace::run_trace_gen(&args),
        Bench::TraceTiers(args) => trace::run_trace_tiers(&args),
        Bench::Qos(args) => qos::run(&args),
        Bench::FullPool(args) => full_pool::run(&args),
        Bench::Classes(args) => classes::run(&args),
    };
    match result {
        Ok(report) => {
            println!("{}", report.line());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("lake-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_well_formed_and_typed() {
        // clap's own checks: no two flags of a subcommand alike, every
        // default a valid value of its type.
        Cli::command().debug_assert();
        let parsed = Cli::try_parse_from(["lake-bench", "keys", "--tokens", "64"]).unwrap();
        assert!(matches!(parsed.command, Bench::Keys(keys::KeysArgs { tokens: 64, block_tokens: 16, .. })));
        for bad in [
            &["lake-bench", "keys", "--tokens", "x"][..],
            &["lake-bench", "keys", "--nope", "1"],
            &["lake-bench", "trace", "--window", "3"],
        ] {
            let e = Cli::try_parse_from(bad).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad:?}");
        }
        // A flag a benchmark reads is one it takes.
        assert!(Cli::try_parse_from(["lake-bench", "trace", "--file", "f", "--guard", "8"]).is_ok());
    }
}
