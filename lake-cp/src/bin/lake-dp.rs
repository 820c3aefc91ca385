//! `lake-dp`: one node's data plane (one per NUMA node). See
//! `lake_dp::runner` and `docs/dataplane.md`.
//!
//! ```text
//! lake-dp --config lake-dp.toml [--cores 2[,3]] [--numa-node 0] [--selftest-blocks N]
//! ```
//!
//! `lake-dp --help` says more.
//!
//! Exit status: 0 after a clean stop (SIGTERM/SIGINT drained, or the
//! self-test done), 1 on a runtime error, 2 on bad arguments or config.

use std::process::ExitCode;

use clap::Parser;
use lake_dp::runner::config::RunnerConfig;
use lake_dp::runner::{RunnerOptions, run};

/// One node's data plane (one per NUMA node): the L1 arena, L2 files, L3,
/// engines' attach socket, driven by its control plane (`lake cp`).
#[derive(Parser, Debug)]
#[command(name = "lake-dp", version)]
struct Cli {
    /// The TOML configuration (see docs/dataplane.md).
    #[arg(long, value_name = "FILE")]
    config: std::path::PathBuf,
    /// The poll thread's core(s), e.g. 2, 2,3 or 2-3 (the first is used).
    #[arg(long, value_name = "LIST", value_parser = parse_cores)]
    cores: Option<Cores>,
    /// Bind memory and the L1 arena to this NUMA node.
    #[arg(long, value_name = "N")]
    numa_node: Option<u32>,
    /// Run the built-in write-back/promotion workload of N blocks, then
    /// stop (no control plane needed).
    #[arg(long, value_name = "N", default_value_t = 0)]
    selftest_blocks: u64,
    /// Events at this level or above are logged (on stdout, with the
    /// serving and stopped lines).
    #[arg(long, value_enum, default_value_t = lake_dp::log::Level::Info)]
    log_level: lake_dp::log::Level,
    /// Events as JSON lines, or as text for a terminal.
    #[arg(long, value_enum, default_value_t = lake_dp::log::Format::Json)]
    log_format: lake_dp::log::Format,
}

/// `--cores`: a list of cores.
#[derive(Clone, Debug)]
struct Cores(Vec<usize>);

fn parse_cores(text: &str) -> Result<Cores, String> {
    let mut cores = Vec::new();
    for part in text.split(',') {
        let bad = || format!("{text:?}: numbers like 2 or 2,3 or 2-3");
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last): (usize, usize) =
                    (first.trim().parse().map_err(|_| bad())?, last.trim().parse().map_err(|_| bad())?);
                if first > last {
                    return Err(bad());
                }
                cores.extend(first..=last);
            }
            None => cores.push(part.trim().parse().map_err(|_| bad())?),
        }
    }
    Ok(Cores(cores))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let options =
        RunnerOptions { cores: cli.cores.map(|c| c.0), numa_node: cli.numa_node, selftest_blocks: cli.selftest_blocks };
    let path = cli.config.display().to_string();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("lake-dp: reading {path}: {e}");
            return ExitCode::from(2);
        }
    };
    let config = match RunnerConfig::parse(&text) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("lake-dp: {path}: {e}");
            return ExitCode::from(2);
        }
    };
    // The serving and stopped lines and the events, in one stream.
    let mut out = lake_dp::log::Sink::new(Box::new(std::io::stdout()));
    lake_dp::log::init_global(out.clone(), cli.log_level.filter(), cli.log_format);
    match run(&config, &options, &mut out) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lake-dp: {e}");
            ExitCode::from(1)
        }
    }
}
