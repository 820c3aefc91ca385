//! `lake-dp`: one node's data plane in a process of its own (one per NUMA
//! node), under a control plane in another (`lake cp`). It reads the same
//! configuration as `lake serve` (`lake.toml`, `docs/guide/configuration.md`)
//! and runs the data plane `lake serve` would: the L1 arena, the L2 files,
//! L3, the transport and the engines' socket in `--dir`. Keys that are the
//! control plane's (quotas, etcd, metrics) are read and checked, and left to
//! it.
//!
//! ```text
//! lake-dp --config lake.toml [--dir DIR] [--cp-socket PATH] [--cores 2] [--selftest-blocks N]
//! ```
//!
//! The lines a supervisor reads (`serving`, `stopped`) and the events go
//! to stdout. Exit status: 0 after a clean stop (SIGTERM/SIGINT drained, or
//! the self-test done), 1 on a runtime error, 2 on bad arguments or
//! configuration.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use lake_cp::config::{ServeArgs, parse_with_file};
use lake_cp::embedded::DataPlane;
use lake_dp::runner::{RunnerError, run_with};

/// One node's data plane (one per NUMA node), under its control plane
/// (`lake cp`): the L1 arena, L2 files, L3, the transport, engines'
/// attach socket. Its settings are `lake serve`'s (`--config lake.toml`
/// or flags).
#[derive(Parser, Debug)]
#[command(name = "lake-dp", version)]
struct Cli {
    /// The control plane's socket to register with. Default:
    /// `DIR/cp.sock`.
    #[arg(long, value_name = "PATH", help_heading = "Data plane alone")]
    cp_socket: Option<PathBuf>,
    /// Run the built-in write-back/promotion workload of N blocks, then
    /// stop (no control plane needed).
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = "Data plane alone")]
    selftest_blocks: u64,
    #[command(flatten)]
    settings: ServeArgs,
}

fn command() -> clap::Command {
    Cli::command().no_binary_name(true)
}

fn main() -> ExitCode {
    lake_dp::os::exit_on_panic("lake-dp");
    lake_dp::os::raise_fd_limit();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let cli = match parse_with_file::<Cli>(command, &argv) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let DataPlane { runner, options, ports, tenant_keys: _ } = match data_plane(&cli) {
        Ok(plane) => plane,
        Err(e) => {
            eprintln!("lake-dp: {e}");
            return ExitCode::from(2);
        }
    };
    // The serving and stopped lines and the events, in one stream.
    let mut out = lake_dp::log::Sink::new(Box::new(std::io::stdout()));
    lake_dp::log::init_global(out.clone(), cli.settings.log_level.filter(), cli.settings.log_format);
    match run_with(&runner, &options, ports, &mut out) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lake-dp: {e}");
            // As for a bad file: settings this machine cannot serve fail
            // the same way on every start.
            ExitCode::from(if matches!(e, RunnerError::Config(_)) { 2 } else { 1 })
        }
    }
}

/// The data plane the settings describe, after every check.
fn data_plane(cli: &Cli) -> Result<DataPlane, String> {
    let Some(dir) = &cli.settings.dir else {
        return Err("--dir (or `dir` in the file) is needed: the data plane's home (its L2 files, socket)".into());
    };
    // Made before its shared memory is named: the names come from the
    // directory's canonical path.
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let pool = cli.settings.resolve()?.pool;
    let cp_socket = cli.cp_socket.clone().unwrap_or_else(|| dir.join("cp.sock"));
    let self_test = cli.selftest_blocks > 0;
    let mut plane = pool.data_plane((!self_test).then_some(cp_socket.as_path()))?;
    plane.options.selftest_blocks = cli.selftest_blocks;
    Ok(plane)
}
