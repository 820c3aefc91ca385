//! `lake`: the operator's command. `lake demo` runs the embedded
//! single-node pool — control plane, data plane and engine agents in one
//! process, nothing external — under a multi-turn agent workload, and
//! reports hit rate, bytes per tier, tier moves and latencies; `lake
//! serve` runs the pool as a service; the rest look at a running pool or
//! run a cluster's parts.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use lake_cp::config::ServeArgs;
use lake_cp::demo::{DemoConfig, DemoReport, Percentiles};
use lake_cp::embedded::ServeError;

/// A line on stdout, flushed; a closed stdout (a pipe whose reader went)
/// is no reason to stop serving, so its error is dropped.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
        let _ = out.flush();
    }};
}

/// Text on stdout with no newline (a screen of `lake top`).
macro_rules! show {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = write!(out, $($arg)*);
        let _ = out.flush();
    }};
}

mod cp;
mod demo;
mod health;
mod operator;
mod route;
mod serve;

use cp::{CpArgs, SummaryArgs, control_plane, drain_node, summary_leader};
use demo::{DemoArgs, demo};
use operator::{Operator, operator, persist};
use serve::serve;

#[derive(Parser, Debug)]
#[command(name = "lake", version, propagate_version = true, subcommand_required = true, arg_required_else_help = true)]
#[command(about = "Lake: one KV-cache pool for LLM inference engines, over host memory, NVMe and object storage")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a whole single-node pool in this process under a multi-turn
    /// agent workload, and report hit rate, tier moves and latencies.
    Demo(DemoArgs),
    /// Run the pool for engines in other processes, until SIGTERM or
    /// SIGINT (SIGHUP: --tenant-keys read again).
    #[command(args_override_self = true)]
    Serve(Box<ServeArgs>),
    /// Check a configuration file, or print the configuration reference.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// The pool at a glance, from a running pool's operator socket.
    Top {
        #[command(flatten)]
        admin: Admin,
        /// One screen, then exit.
        #[arg(long)]
        once: bool,
        /// Milliseconds between screens (at least 100).
        #[arg(long, value_name = "MS", default_value_t = 1000)]
        interval_ms: u64,
        /// JSON, one object per screen.
        #[arg(long)]
        json: bool,
    },
    /// One block: its replicas, leases, L1 pins and recent history.
    Inspect {
        #[command(flatten)]
        admin: Admin,
        /// The pool's L1 arena, to read the block's pins from.
        #[arg(long, value_name = "PATH")]
        arena: Option<PathBuf>,
        /// JSON.
        #[arg(long)]
        json: bool,
        /// The block key, 32 hex digits.
        key: String,
    },
    /// Every namespace holding bytes, by tier.
    Namespaces {
        #[command(flatten)]
        admin: Admin,
        /// JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drop every replica of a namespace from every tier (an old model, a
    /// rotated tenant key).
    Purge {
        #[command(flatten)]
        admin: Admin,
        /// Seconds to wait until it is gone (0: do not wait).
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        wait: u64,
        /// The namespace, in hex.
        namespace: String,
    },
    /// Write every block that is only in L1 (host memory) to L2, keeping
    /// it in L1: after this, it survives the host, not only a clean stop.
    Persist {
        #[command(flatten)]
        admin: Admin,
        /// Only this namespace's blocks (hex).
        #[arg(long, value_name = "NAMESPACE")]
        namespace: Option<String>,
        /// Seconds to wait until none is left in L1 alone (0: do not wait).
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        wait: u64,
    },
    /// Every region (L1 arena, each L2 file, L3): what each holds, which
    /// are draining.
    Regions {
        #[command(flatten)]
        admin: Admin,
        /// JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every data plane and agent connected: name, node, pid, wire
    /// version, features.
    Peers {
        #[command(flatten)]
        admin: Admin,
        /// JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stop writing to an L2 file and move its blocks to the node's other
    /// files.
    Drain {
        #[command(flatten)]
        admin: Admin,
        /// Seconds to wait until it is empty (then it may be taken away).
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        wait: u64,
        /// Use it again.
        #[arg(long)]
        undo: bool,
        /// The region (its id) or the file (its path).
        region: String,
    },
    /// Take a node out of a cluster: its blocks are copied to other
    /// members' L1 and nothing new is sent to it.
    DrainNode {
        /// etcd endpoints, comma-separated.
        #[arg(long, value_name = "URL[,URL...]")]
        etcd: String,
        /// The cluster's name in etcd.
        #[arg(long, value_name = "NAME")]
        cluster: String,
        /// TLS to etcd.
        #[command(flatten)]
        etcd_tls: lake_cp::config::EtcdTlsArgs,
        /// Seconds to wait until no block only it holds is left.
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        wait: u64,
        /// Take it back.
        #[arg(long)]
        undo: bool,
        /// The node's id.
        node: u32,
    },
    /// A control plane standing for leadership in etcd: a standby until it
    /// leads, then serving the socket and writing the mirror in its term.
    Cp(CpArgs),
    /// The leader's cluster summary: the nodes' deltas in order, lapsed
    /// members dropped, checkpoints, hot prefixes copied to every member.
    Summary(SummaryArgs),
    /// Where each request runs — mode, prefill and decode nodes, the pool
    /// blocks to reuse — answered over HTTP/JSON for a gateway, from this
    /// host's view of the pool and the nodes' load; until SIGTERM or
    /// SIGINT.
    Route {
        /// The router's settings (TOML; `examples/route.toml`).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Where to answer, over the file's `listen`.
        #[arg(long, value_name = "IP:PORT")]
        listen: Option<std::net::SocketAddr>,
    },
    /// Write a new cluster link key, readable by its owner only (an
    /// existing file is kept).
    Keygen {
        /// Where to write it.
        file: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum ConfigCommand {
    /// Check a node's configuration file (`lake serve`'s and `lake-dp`'s):
    /// every key known, every value valid, every file it names readable.
    /// Starts nothing.
    Check {
        /// The TOML file.
        file: PathBuf,
    },
    /// Print the configuration reference (Markdown): every key, its flag,
    /// its default.
    Reference,
}

/// Which running pool: its operator socket.
#[derive(Args, Debug)]
struct Admin {
    /// The pool's operator socket (`DIR/admin.sock`).
    #[arg(long, value_name = "PATH", required_unless_present = "dir", conflicts_with = "dir")]
    admin: Option<PathBuf>,
    /// The pool's directory (`lake serve --dir`), for its operator socket.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

impl Admin {
    fn socket(&self) -> PathBuf {
        match (&self.admin, &self.dir) {
            (Some(admin), _) => admin.clone(),
            (None, Some(dir)) => dir.join("admin.sock"),
            (None, None) => PathBuf::from("admin.sock"),
        }
    }
}

fn main() -> ExitCode {
    lake_dp::os::exit_on_panic("lake");
    // As many descriptors as the hard limit allows: a control plane, a
    // summary leader and a pool hold one per connection.
    lake_dp::os::raise_fd_limit();
    let mut cli = Cli::parse();
    if let Command::Serve(args) = &mut cli.command
        && args.config.is_some()
    {
        // With a file: its settings first, this command line's after.
        let argv: Vec<String> = std::env::args().skip(2).collect();
        **args = ServeArgs::parse(&argv).unwrap_or_else(|e| e.exit());
    }
    // Events on stderr; `lake serve` says at what level and how.
    let (level, format) = match &cli.command {
        Command::Serve(args) => (args.log_level.filter(), args.log_format),
        _ => (lake_dp::log::LevelFilter::INFO, lake_dp::log::Format::Json),
    };
    lake_dp::log::init_global(lake_dp::log::Sink::new(Box::new(std::io::stderr())), level, format);
    let (name, result) = match cli.command {
        Command::Demo(args) => ("demo", demo(&args)),
        Command::Serve(args) => match serve(&args) {
            // Settings that cannot run: a restart will not mend them.
            Err(why) if why.is_settings() => {
                eprintln!("lake serve: {why}");
                return ExitCode::from(2);
            }
            Err(why) => ("serve", Err(why.to_string())),
            Ok(()) => ("serve", Ok(())),
        },
        Command::Config(ConfigCommand::Check { file }) => ("config check", config_check(&file)),
        Command::Config(ConfigCommand::Reference) => {
            say!("{}", lake_cp::config::reference().trim_start());
            ("config reference", Ok(()))
        }
        Command::Top { admin, once, interval_ms, json } => {
            let op = Operator {
                admin: admin.socket(),
                json_out: json,
                once,
                interval_ms: interval_ms.max(100),
                ..Operator::default()
            };
            ("top", operator("top", op))
        }
        Command::Inspect { admin, arena, json, key } => {
            let op =
                Operator { admin: admin.socket(), arena, json_out: json, positional: vec![key], ..Operator::default() };
            ("inspect", operator("inspect", op))
        }
        Command::Namespaces { admin, json } => (
            "namespaces",
            operator("namespaces", Operator { admin: admin.socket(), json_out: json, ..Operator::default() }),
        ),
        Command::Purge { admin, wait, namespace } => {
            let op =
                Operator { admin: admin.socket(), wait_s: wait, positional: vec![namespace], ..Operator::default() };
            ("purge", operator("purge", op))
        }
        Command::Persist { admin, namespace, wait } => ("persist", persist(&admin.socket(), namespace, wait)),
        Command::Regions { admin, json } => {
            ("regions", operator("regions", Operator { admin: admin.socket(), json_out: json, ..Operator::default() }))
        }
        Command::Peers { admin, json } => {
            ("peers", operator("peers", Operator { admin: admin.socket(), json_out: json, ..Operator::default() }))
        }
        Command::Drain { admin, wait, undo, region } => {
            let op =
                Operator { admin: admin.socket(), wait_s: wait, undo, positional: vec![region], ..Operator::default() };
            ("drain", operator("drain", op))
        }
        Command::DrainNode { etcd, cluster, etcd_tls, wait, undo, node } => {
            ("drain-node", drain_node((&etcd, &etcd_tls.tls()), &cluster, wait, undo, node))
        }
        Command::Cp(args) => ("cp", control_plane(&args)),
        Command::Summary(args) => ("summary", summary_leader(&args)),
        Command::Keygen { file } => ("keygen", keygen(&file)),
        Command::Route { config, listen } => ("route", route::route(&config, listen)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lake {name}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `lake config check FILE`: the file read as `lake serve --config FILE`
/// would, every setting checked, nothing started.
fn config_check(file: &std::path::Path) -> Result<(), String> {
    let argv = vec!["--config".to_owned(), file.display().to_string()];
    let args = ServeArgs::parse(&argv).map_err(|e| {
        // The message, without the usage and hint after it.
        let e = e.to_string();
        let lines: Vec<&str> = e.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
        lines.join(" ").trim_start_matches("error: ").to_owned()
    })?;
    let serve = args.resolve()?;
    let pool = &serve.pool;
    say!(
        "{}",
        serde_json::json!({
            "event": "config_ok",
            "file": file,
            "dir": pool.dir,
            "block_bytes": pool.block_bytes,
            "l1_classes": pool.l1_size_classes().map(|(payload, slots)| serde_json::json!([payload, slots])).collect::<Vec<_>>(),
            "l2_files": pool.l2_paths(),
            "l2_slots_per_file": pool.l2_slots_per_file,
            "metrics": pool.metrics.map(|a| a.to_string()),
        })
    );
    Ok(())
}

fn keygen(path: &std::path::Path) -> Result<(), String> {
    let key = lake_dp::auth::LinkKey::generate().map_err(|e| format!("random bytes: {e}"))?;
    key.write_new(path).map_err(|e| format!("{}: {e}", path.display()))?;
    say!("{}", serde_json::json!({"event": "keygen", "file": path, "key_id": format!("{:016x}", key.id())}));
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        // clap's own checks: no two flags of a subcommand alike, every
        // default a valid value of its type, every `requires` a real flag.
        Cli::command().debug_assert();
    }
}
