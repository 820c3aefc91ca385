//! `lake-bench`: Lake's benchmarks. Each subcommand measures a Lake path and
//! the raw operation beneath it in the same run and prints, as its last
//! line, one JSON object with both figures and their ratio.
//!
//! Run with `cargo run --release -p lake-bench -- SUBCOMMAND [--flag value]`.

// Benchmarks report durations and byte counts as floating-point figures;
// the precision lost above 2^52 ns or bytes does not matter to a ratio.
#![allow(clippy::cast_precision_loss)]

mod arena;
mod args;
mod classes;
mod cp_scale;
mod ffi;
mod gpu;
mod keys;
mod l2;
mod l3;
mod lookup;
mod qos;
mod report;
mod route_sim;
mod tcp;
mod tenants;
mod trace;

use std::process::ExitCode;

const USAGE: &str = "usage: lake-bench SUBCOMMAND [--flag value ...]

subcommands:
  keys   --tokens N --block-tokens N [--rounds N]
         block-key chain cost vs one raw BLAKE3 keyed hash per block
  pin    [--agents N] [--pins N] [--pairs N] [--rounds N]
         L1 arena pin+unpin vs raw store/fence/load; reclaim scan vs a raw
         load loop over the same number of pin entries
  l2     --dir DIR [--block-bytes N] [--total-bytes N] [--queue-depth N] [--rounds N]
         L2 write and read throughput through Lake vs a raw O_DIRECT
         io_uring loop over the same file, queue depth and bytes
  l3     [--block-bytes N] [--blocks N] [--workers N] [--endpoint URL]
         blocks through Lake's L3 client into an S3-compatible store (its
         own moto_server unless --endpoint) vs a raw loop of the same S3
         client on as many threads
  block-latency [--path l2-to-l1] [--block-bytes N] [--samples N] [--dir DIR]
         per-block submit-to-complete latency, Lake vs one raw io_uring
         read; CRC cost and the poller's own cost (no-op backend) apart
  cp-scale [--blocks N] [--chain N] [--matches N]
         the radix index at scale: inserts/s, matches/s, heap bytes per
         block (two replicas each), RSS; a std HashMap insert beside it
  tenants [--entries N] [--prompts N] [--blocks N] [--lookups N]
         two tenants, the same prompts: tenant B's lookups of prompts tenant A
         cached against prompts nobody cached (no hit; the timing ratio), and A's hits
  lookup [--tokens N] [--block-tokens N] [--entries N] [--prompts N] [--lookups N] [--backing auto|memfd|shm]
         longest-prefix lookup and block table of a prompt read from the
         shared-memory mirror while its writer changes it, among N other
         entries; one probe vs one raw bucket load
  ffi    [--block-bytes N] [--blocks N] [--rounds N] [--samples N] [--copy-threads N]
         the engine's path through the C ABI against an embedded pool:
         lookups per block, L1 loads into engine memory vs memcpy, one
         block's submit-to-complete vs memcpy + CRC
  gpu    [--block-bytes N] [--total-bytes N] [--rounds N] [--samples N]
         (GPU machine) the kernels moving KV between a vLLM paged cache on
         the GPU and pool blocks in pinned host memory vs plain pinned
         copies; one block (64 KiB, and the block size) vs a raw copy
  tcp    [--block-bytes N] [--total-bytes N] [--streams N] [--slice-bytes N] [--window-bytes N] [--rounds N]
         blocks between two nodes' slots over loopback TCP through Lake's
         transport (striped, checked at the target) vs one plain TCP stream
  route  [--nodes N] [--conversations N] [--turns N] [--seed S] [--utilization U]
         simulated agent conversations over several nodes routed by
         lake_dp::route vs always-PD and always-colocated: hit rate, bytes
         between nodes, modelled TTFT, modes chosen
  trace  --file F.jsonl (--capacity-blocks N | --capacity-ratio R) [--policy lake|lru]
         replay a hash_ids trace through the real index and eviction code
  trace-gen --kind agent|chat|scan --out F.jsonl [--requests N] [--seed S]
         write a trace in the Mooncake format
  qos    [--dir DIR] [--block-bytes N] [--l1-slots N] [--set N] [--loads N] [--writers N]
         a critical-path load from L2, one block at a time, unloaded and while
         writers flood the pool with saves (demotions to L2): p50/p99 of each
  trace-tiers --file F.jsonl [--l1-ratio R] [--l2-ratio R] [--policy lake|lru]
         replay a trace through the real tier manager, L1 over L2, with every
         L1 victim written to L2 and with the second-access filter: L2 blocks
         written and hit ratio of each
  classes [--dir DIR] [--l1-mib N] [--a-bytes N] [--b-bytes N] [--set-percent P]
         [--requests N] [--chunk-slots N]
         two models of different block sizes, A's traffic then B's, over one L1
         split between their size classes and over one the classes share in
         chunks: requests served from L1, from L2, computed again";

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = argv.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let result = match command.as_str() {
        "keys" => keys::run(rest),
        "pin" => arena::run(rest),
        "l2" => l2::run_l2(rest),
        "l3" => l3::run(rest),
        "block-latency" => l2::run_block_latency(rest),
        "trace" => trace::run_trace(rest),
        "cp-scale" => cp_scale::run(rest),
        "lookup" => lookup::run(rest),
        "tenants" => tenants::run(rest),
        "ffi" => ffi::run(rest),
        "gpu" => gpu::run(rest),
        "tcp" => tcp::run(rest),
        "route" => route_sim::run(rest),
        "trace-gen" => trace::run_trace_gen(rest),
        "trace-tiers" => trace::run_trace_tiers(rest),
        "qos" => qos::run(rest),
        "classes" => classes::run(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        other => Err(format!("unknown subcommand `{other}`\n{USAGE}")),
    };
    match result {
        Ok(report) => {
            println!("{}", report.line());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("lake-bench: {message}");
            ExitCode::from(2)
        }
    }
}
