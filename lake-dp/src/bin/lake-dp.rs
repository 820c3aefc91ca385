//! `lake-dp`: one node's data plane (one per NUMA node). See
//! `lake_dp::runner` and `docs/dataplane.md`.
//!
//! ```text
//! lake-dp --config lake-dp.toml [--cores 2[,3]] [--numa-node 0] [--selftest-blocks N]
//! ```
//!
//! Exit status: 0 after a clean stop (SIGTERM/SIGINT drained, or the
//! self-test done), 1 on a runtime error, 2 on bad arguments or config.

use std::process::ExitCode;

use lake_dp::runner::config::RunnerConfig;
use lake_dp::runner::{RunnerOptions, run};

const USAGE: &str = "usage: lake-dp --config FILE [--cores LIST] [--numa-node N] [--selftest-blocks N]

  --config FILE         TOML config (see docs/dataplane.md)
  --cores LIST          poll thread core(s), e.g. 2 or 2,3 or 2-3 (the first is used)
  --numa-node N         bind memory and the L1 arena to NUMA node N
  --selftest-blocks N   run the built-in write-back/promotion workload of N blocks,
                        then stop (until lake-cp's protocol feeds commands)";

fn parse_cores(text: &str) -> Result<Vec<usize>, String> {
    let mut cores = Vec::new();
    for part in text.split(',') {
        let bad = || format!("--cores {text}: expected numbers like 2 or 2,3 or 2-3");
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
    Ok(cores)
}

fn parse_args(args: &[String]) -> Result<(String, RunnerOptions), String> {
    let mut config = None;
    let mut options = RunnerOptions::default();
    let mut iter = args.iter();
    while let Some(flag) = iter.next() {
        let mut value = || iter.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--config" => config = Some(value()?.clone()),
            "--cores" => options.cores = Some(parse_cores(value()?)?),
            "--numa-node" => {
                let raw = value()?;
                options.numa_node = Some(raw.parse().map_err(|_| format!("--numa-node {raw}: not a node number"))?);
            }
            "--selftest-blocks" => {
                let raw = value()?;
                options.selftest_blocks = raw.parse().map_err(|_| format!("--selftest-blocks {raw}: not a count"))?;
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let config = config.ok_or("--config is required")?;
    Ok((config, options))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (path, options) = match parse_args(&args) {
        Ok(parsed) => parsed,
        Err(message) if message.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("lake-dp: {message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
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
    let mut out = std::io::stdout().lock();
    match run(&config, &options, &mut out) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lake-dp: {e}");
            ExitCode::from(1)
        }
    }
}
