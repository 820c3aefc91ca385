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

#[derive(Args, Debug)]
struct DemoArgs {
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

#[derive(Args, Debug)]
struct CpArgs {
    /// The socket data planes and agents connect to.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The shared-memory mirror engines read.
    #[arg(long, value_name = "PATH")]
    mirror: PathBuf,
    /// etcd endpoints, comma-separated.
    #[arg(long, value_name = "URL[,URL...]")]
    etcd: String,
    /// The cluster's name in etcd.
    #[arg(long, value_name = "NAME")]
    cluster: String,
    /// This candidate's id.
    #[arg(long, value_name = "ID")]
    id: String,
    /// Seconds the leadership lease lasts without renewal.
    #[arg(long, value_name = "SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    ttl: u32,
    /// The node it controls.
    #[arg(long, value_name = "N", default_value_t = 0)]
    node: u32,
    /// Entries the mirror holds.
    #[arg(long, value_name = "N", default_value_t = 1 << 20)]
    entries: u64,
}

#[derive(Args, Debug)]
struct SummaryArgs {
    /// Where nodes connect to report their replicas.
    #[arg(long, value_name = "IP:PORT")]
    listen: std::net::SocketAddr,
    /// etcd endpoints, comma-separated (leadership, members, drain marks).
    #[arg(long, value_name = "URL[,URL...]", requires = "cluster")]
    etcd: Option<String>,
    /// The cluster's name in etcd.
    #[arg(long, value_name = "NAME", requires = "etcd")]
    cluster: Option<String>,
    /// This candidate's id (default: `summary-PID`).
    #[arg(long, value_name = "ID")]
    id: Option<String>,
    /// Seconds the leadership lease lasts without renewal.
    #[arg(long, value_name = "SECONDS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    ttl: u32,
    /// Where checkpoints go (their pointer in etcd).
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    /// Milliseconds between checkpoints (at least 10).
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    checkpoint_ms: u64,
    /// A block K or more blocks continue is copied into every member's L1
    /// (0: none).
    #[arg(long, value_name = "K", default_value_t = 0)]
    replicate_children: usize,
    /// The cluster link key: nodes' links are authenticated with it.
    #[arg(long, value_name = "FILE")]
    link_key: Option<PathBuf>,
}

fn main() -> ExitCode {
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
            Err(ServeError::Settings(why)) => {
                eprintln!("lake serve: {why}");
                return ExitCode::from(2);
            }
            Err(ServeError::Failed(why)) => ("serve", Err(why)),
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
        Command::DrainNode { etcd, cluster, wait, undo, node } => {
            ("drain-node", drain_node(&etcd, &cluster, wait, undo, node))
        }
        Command::Cp(args) => ("cp", control_plane(&args)),
        Command::Summary(args) => ("summary", summary_leader(&args)),
        Command::Keygen { file } => ("keygen", keygen(&file)),
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

/// `lake drain-node`: marks a node draining in etcd (or takes it back);
/// with `--wait`, follows the leader's count of the blocks only it holds
/// until none is left.
fn drain_node(etcd: &str, name: &str, wait_s: u64, undo: bool, node: u32) -> Result<(), String> {
    let endpoints: Vec<&str> = etcd.split(',').collect();
    let client = lake_cp::etcd::Etcd::new(&endpoints, std::time::Duration::from_secs(2))
        .map_err(|e| format!("--etcd {etcd}: {e}"))?;
    let cluster = lake_cp::ha::Cluster::new(client, name).map_err(|e| format!("--cluster {name}: {e}"))?;
    if undo {
        cluster.undrain(node).map_err(|e| e.to_string())?;
        say!("{{\"event\":\"undrained\",\"node\":{node}}}");
        return Ok(());
    }
    let members = cluster.members().map_err(|e| e.to_string())?;
    if !members.iter().any(|(n, _)| *n == node) {
        tracing::warn!(
            event = "drain_mark_of_non_member",
            node,
            "node {node} is not a member now (marked all the same)"
        );
    }
    cluster.drain(node).map_err(|e| e.to_string())?;
    say!("{{\"event\":\"draining\",\"node\":{node}}}");
    if wait_s == 0 {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
    loop {
        let left = cluster.drain_left(node).map_err(|e| e.to_string())?;
        if let Some((0, _)) = left {
            say!("{{\"event\":\"drained\",\"node\":{node}}}");
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            let left = left.map_or_else(|| "uncounted (no leader counted yet)".to_owned(), |(n, _)| n.to_string());
            return Err(format!("node {node}: blocks only it holds: {left} after {wait_s} s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn keygen(path: &std::path::Path) -> Result<(), String> {
    let key = lake_dp::auth::LinkKey::generate().map_err(|e| format!("random bytes: {e}"))?;
    key.write_new(path).map_err(|e| format!("{}: {e}", path.display()))?;
    say!("{}", serde_json::json!({"event": "keygen", "file": path, "key_id": format!("{:016x}", key.id())}));
    Ok(())
}

/// SIGHUP: the tenant keys read again; a new or changed file sets its
/// key, a file gone forgets its tenant (purged from every tier). A
/// directory that cannot be read changes nothing (said so).
fn reload_tenant_keys(
    dir: &std::path::Path,
    pool: &lake_cp::embedded::EmbeddedPool,
    known: &mut std::collections::HashMap<lake_dp::NamespaceId, u64>,
) {
    use lake_dp::auth::at_rest::KeyChange;
    let keys = match lake_cp::config::read_tenant_keys(dir) {
        Ok(keys) => keys,
        Err(e) => {
            say!("{}", serde_json::json!({"event": "tenant_keys_refused", "why": e}));
            return;
        }
    };
    let (mut set, mut forgotten) = (Vec::new(), Vec::new());
    let present: std::collections::HashSet<lake_dp::NamespaceId> = keys.iter().map(|(ns, _)| *ns).collect();
    for (namespace, key) in keys {
        if known.get(&namespace) != Some(&key.id()) {
            known.insert(namespace, key.id());
            set.push(format!("\"{:016x}\"", namespace.0));
            pool.tenant_keys.change(KeyChange::Set(namespace, key));
        }
    }
    known.retain(|namespace, _| {
        let keep = present.contains(namespace);
        if !keep {
            forgotten.push(format!("\"{:016x}\"", namespace.0));
            pool.tenant_keys.change(KeyChange::Forget(*namespace));
        }
        keep
    });
    say!("{{\"event\":\"tenant_keys\",\"set\":[{}],\"forgotten\":[{}]}}", set.join(","), forgotten.join(","));
}

fn demo(args: &DemoArgs) -> Result<(), String> {
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

fn serve(args: &ServeArgs) -> Result<(), ServeError> {
    use lake_cp::embedded::EmbeddedPool;
    // Before any thread starts: the pool's threads inherit the blocked
    // signals, and this one takes them.
    let signals = lake_dp::os::Signals::with_hangup().map_err(|e| format!("signals: {e}"))?;
    let lake_cp::config::Serve { pool: config, tenant_key_dir, cluster, member_ttl, .. } =
        args.resolve().map_err(ServeError::Settings)?;
    let (key_dir, mut tenant_files) = match tenant_key_dir {
        Some((dir, ids)) => (Some(dir), ids),
        None => (None, std::collections::HashMap::new()),
    };
    // Membership: this node's key in etcd under a lease it renews; a node
    // that stops (or is killed) leaves the summary's members when it runs
    // out.
    let cluster = match &cluster {
        Some((endpoints, name)) => {
            let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
            let client = lake_cp::etcd::Etcd::new(&endpoints, std::time::Duration::from_secs(2))
                .map_err(|e| format!("--etcd {}: {e}", endpoints.join(",")))?;
            Some(lake_cp::ha::Cluster::new(client, name).map_err(|e| format!("--cluster {name}: {e}"))?)
        }
        None => None,
    };
    let mut pool = EmbeddedPool::start(&config)?;
    let address = config.transport_listen.map_or_else(|| pool.cp_socket.display().to_string(), |a| a.to_string());
    let mut member = match &cluster {
        Some(cluster) => Some(cluster.join(config.node, &address, member_ttl).map_err(|e| format!("joining: {e}"))?),
        None => None,
    };
    let renew_every = std::time::Duration::from_millis(u64::try_from(member_ttl).unwrap_or(1) * 1000 / 3);
    let mut renewed = std::time::Instant::now();
    // The L1 (region, epoch) the membership value names.
    let mut announced: Option<(u16, u64)> = None;
    let serving = serde_json::json!({
        "event": "serving",
        "dp_socket": pool.dp_socket,
        "cp_socket": pool.cp_socket,
        "admin_socket": pool.admin_socket,
        "arena": pool.arena,
        "mirror": pool.mirror,
        "metrics": pool.metrics.map_or_else(String::new, |a| a.to_string()),
        "block_bytes": config.block_bytes,
        // Every L1 size class as [payload bytes, slots]: an engine checks
        // that its blocks fit one before it saves anything.
        "l1_classes": config.l1_size_classes().map(|(payload, slots)| serde_json::json!([payload, slots])).collect::<Vec<_>>(),
    });
    // The same record in DIR/pool.json, for engines configured with the
    // pool's directory alone: the mirror's and metrics' names change from
    // one start to the next, DIR does not. Written first: whoever reads
    // the serving line finds it.
    let record = config.dir.join(POOL_RECORD);
    write_atomically(&record, format!("{serving}\n").as_bytes()).map_err(|e| format!("{}: {e}", record.display()))?;
    say!("{serving}");
    notify_service_manager("READY=1");
    loop {
        // A plane that stopped on its own cannot serve: say why, exit non-zero.
        if let Some(why) = pool.failed() {
            let _ = std::fs::remove_file(&record);
            return Err(ServeError::Failed(why));
        }
        match signals.take() {
            Some(libc::SIGHUP) => {
                if let Some(dir) = &key_dir {
                    reload_tenant_keys(dir, &pool, &mut tenant_files);
                }
            }
            Some(_) => break,
            None => {}
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        if renewed.elapsed() >= renew_every
            && let (Some(cluster), Some(current)) = (&cluster, &member)
        {
            renewed = std::time::Instant::now();
            match current.keep_alive() {
                Ok(true) => {}
                // Lapsed (a long stall): join again; the summary gets this
                // node's replicas back from its next snapshot.
                Ok(false) => {
                    member = cluster.join(config.node, &address, member_ttl).ok();
                    announced = None;
                }
                Err(e) => tracing::warn!(event = "membership_renewal_failed", error = %e),
            }
            // Where other nodes' copies go (the leader's drains and
            // replication target it by this), once the L1 is registered.
            let space = pool.gauges.l1_space();
            if space.is_some()
                && space != announced
                && let (Some(current), Some(space)) = (&member, space)
            {
                match current.announce(config.node, &address, space) {
                    Ok(()) => announced = Some(space),
                    Err(e) => tracing::warn!(event = "l1_announce_failed", error = %e),
                }
            }
            // Drained by an operator (`lake drain-node`): not ready for new
            // requests; the leader moves its blocks away.
            match cluster.draining() {
                Ok(marks) => {
                    let draining = marks.iter().any(|&(node, _)| node == config.node);
                    if pool.draining.swap(draining, std::sync::atomic::Ordering::Relaxed) != draining {
                        say!("{{\"event\":\"draining\",\"node\":{},\"on\":{draining}}}", config.node);
                    }
                }
                Err(e) => tracing::warn!(event = "drain_marks_unread", error = %e),
            }
        }
    }
    notify_service_manager("STOPPING=1");
    if let Some(member) = member {
        let _ = member.leave();
    }
    let _ = std::fs::remove_file(&record);
    if config.durable {
        let (left, took) = pool.empty_l1();
        // Blocks still in L1 now (held by an engine, or no L2 room) are
        // lost with it; every other block is on L2 for the next start.
        say!("{{\"event\":\"l1_written_down\",\"blocks_left\":{left},\"ms\":{}}}", took.as_millis());
    }
    let (stats, _) = pool.stop()?;
    say!(
        "{{\"event\":\"stopped\",\"agents_attached\":{},\"saves\":{},\"promotions\":{},\"demotions\":{},\
         \"l3_writes\":{},\"l3_reads\":{},\"l3_deletes\":{}}}",
        stats.agents_attached,
        stats.pool.saves,
        stats.pool.promotions,
        stats.pool.demotions,
        stats.l3.writes,
        stats.l3.reads,
        stats.l3.deletes
    );
    Ok(())
}

/// Tells the service manager (systemd's `Type=notify`, through
/// `$NOTIFY_SOCKET`) how the service stands: `READY=1` once engines can
/// attach, `STOPPING=1` as a stop begins. Without the variable, nothing.
fn notify_service_manager(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let bytes = path.as_encoded_bytes();
    let address = match bytes.strip_prefix(b"@") {
        Some(abstract_name) => std::os::unix::net::SocketAddr::from_abstract_name(abstract_name),
        None => std::os::unix::net::SocketAddr::from_pathname(&path),
    };
    let sent = address.and_then(|address| {
        let socket = std::os::unix::net::UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), &address)
    });
    if let Err(e) = sent {
        tracing::warn!(event = "service_manager_unreachable", state, error = %e);
    }
}

/// Where `lake serve` records its endpoints, in its `--dir`.
const POOL_RECORD: &str = "pool.json";

/// Writes `path` whole or not at all: a reader sees the old file or the
/// new one, never a part.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}

/// `lake cp`: one control plane of a node, standing for leadership.
fn control_plane(args: &CpArgs) -> Result<(), String> {
    use std::time::{Duration, Instant};

    use lake_cp::etcd::Etcd;
    use lake_cp::ha::Cluster;
    use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorWriter};

    let signals = lake_dp::os::Signals::new().map_err(|e| format!("signals: {e}"))?;
    let (socket, mirror, etcd, cluster, id) = (&args.socket, &args.mirror, &args.etcd, &args.cluster, &args.id);
    let (ttl, node, entries) = (i64::from(args.ttl), args.node, args.entries);
    let endpoints: Vec<&str> = etcd.split(',').collect();
    let cluster = Cluster::new(Etcd::new(&endpoints, Duration::from_secs(2)).map_err(|e| e.to_string())?, cluster)
        .map_err(|e| e.to_string())?;
    let mut candidate = cluster.candidate(id, ttl).map_err(|e| e.to_string())?;
    let every = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 4).max(Duration::from_millis(50));
    let say = |line: String| say!("{line}");
    // A standby until it leads (or is told to stop).
    let Some(term) = stand_by(&mut candidate, id, every, &signals, "lake cp") else { return Ok(()) };
    // The mirror engines already read is taken over (their mappings stay
    // good) and emptied: the view is rebuilt from what the data planes
    // re-adopt. One that is not there, or not a mirror, is made anew. One
    // whose writer lives belongs to a predecessor that is stopped, not
    // dead: it is deposed when it wakes (it renews before it acts) and
    // lets go; until then this leader waits, renewing its own lease.
    let mut said_waiting = false;
    let writer = loop {
        match MirrorWriter::take_over(mirror, term) {
            Ok((mut writer, _)) => {
                writer.clear();
                break writer;
            }
            Err(lake_dp::mirror::MirrorError::InUse { pid }) => {
                if !said_waiting {
                    said_waiting = true;
                    say(serde_json::json!({"event": "waiting", "id": id, "term": term, "mirror_writer": pid})
                        .to_string());
                }
                std::thread::sleep(Duration::from_millis(100));
                if signals.take().is_some() {
                    let _ = candidate.resign();
                    return Ok(());
                }
                if !candidate.keep_alive().unwrap_or(true) {
                    return Err(format!("deposed while waiting for the mirror (term {term})"));
                }
            }
            Err(_) => {
                break MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(mirror.clone()), entries))
                    .map_err(|e| format!("mirror {}: {e}", mirror.display()))?;
            }
        }
    };
    let state = lake_cp::node::Node::new(lake_dp::NodeId(node), term, Some(writer));
    let mut server =
        lake_cp::server::Server::bind(socket, state, term).map_err(|e| format!("{}: {e}", socket.display()))?;
    say(serde_json::json!({"event": "leading", "id": id, "term": term, "socket": socket, "mirror": mirror}).to_string());
    let renew = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 3);
    let lease = Duration::from_secs(u64::try_from(ttl).unwrap_or(1));
    let (mut last_renewal, mut confirmed) = (Instant::now(), Instant::now());
    loop {
        if signals.take().is_some() {
            // Handing over now: the standby need not wait out the lease.
            let _ = candidate.resign();
            say(serde_json::json!({"event": "resigned", "id": id, "term": term}).to_string());
            return Ok(());
        }
        // Renewed before serving: a leader that was stopped (SIGSTOP, a
        // stalled host) past its lease finds out before it acts again.
        if last_renewal.elapsed() >= renew {
            last_renewal = Instant::now();
            let deposed = match candidate.keep_alive() {
                Ok(true) => {
                    confirmed = Instant::now();
                    None
                }
                Ok(false) => Some(format!("the lease of term {term} expired")),
                // etcd unreachable: lead on only while the lease may stand.
                Err(e) if confirmed.elapsed() < lease => {
                    tracing::warn!(event = "lease_renewal_failed", error = %e);
                    None
                }
                Err(e) => Some(format!("no renewal for a whole lease ({e})")),
            };
            if let Some(why) = deposed {
                say(serde_json::json!({"event": "deposed", "id": id, "term": term}).to_string());
                return Err(format!("deposed: {why}; stopping"));
            }
        }
        server.poll_once(Some(Duration::from_millis(5))).map_err(|e| format!("serving: {e}"))?;
    }
}

#[allow(clippy::cast_precision_loss)]
fn print_report(r: &DemoReport) {
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

/// `lake summary`: the leader's cluster summary (see `lake_cp::summary`).
fn summary_leader(args: &SummaryArgs) -> Result<(), String> {
    use std::time::{Duration, Instant};

    use lake_cp::ha::{Cluster, Role};
    use lake_cp::summary::Summary;
    use lake_cp::summary::link::Aggregator;
    use lake_dp::l3::ObjectStore;

    let signals = lake_dp::os::Signals::new().map_err(|e| format!("signals: {e}"))?;
    let (listen, etcd, cluster, id, dir) =
        (args.listen, &args.etcd, &args.cluster, args.id.clone(), &args.checkpoint_dir);
    let (ttl, checkpoint_ms, replicate_children) =
        (i64::from(args.ttl), args.checkpoint_ms.max(10), args.replicate_children);
    let key = match &args.link_key {
        Some(path) => {
            Some(lake_dp::auth::LinkKey::load(path).map_err(|e| format!("--link-key {}: {e}", path.display()))?)
        }
        None => None,
    };
    let say = |line: String| say!("{line}");
    let cluster = match (&etcd, &cluster) {
        (Some(etcd), Some(name)) => {
            let endpoints: Vec<&str> = etcd.split(',').collect();
            let client = lake_cp::etcd::Etcd::new(&endpoints, Duration::from_secs(2)).map_err(|e| e.to_string())?;
            Some(Cluster::new(client, name).map_err(|e| e.to_string())?)
        }
        (None, None) => None,
        _ => return Err("--etcd and --cluster go together".into()),
    };
    let mut store = match &dir {
        Some(dir) => Some(lake_dp::l3::dir::DirStore::open(dir).map_err(|e| e.to_string())?),
        None => None,
    };
    let id = id.unwrap_or_else(|| format!("summary-{}", std::process::id()));
    let mut candidate = match &cluster {
        Some(cluster) => Some(cluster.candidate(&id, ttl).map_err(|e| e.to_string())?),
        None => None,
    };
    // A standby until it leads.
    let every = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 4).max(Duration::from_millis(50));
    let mut term = 1;
    if let Some(candidate) = &mut candidate {
        let Some(elected) = stand_by(candidate, &id, every, &signals, "lake summary") else { return Ok(()) };
        term = elected;
    }
    // Where the last leader left the summary: its checkpoint, then the
    // nodes' snapshots (each node sends one as it connects).
    let mut summary = Summary::new();
    if let (Some(cluster), Some(store)) = (&cluster, &mut store)
        && let Some(pointer) = cluster.checkpoint().map_err(|e| e.to_string())?
    {
        match store.get(&pointer.location) {
            Ok(Some(bytes)) => match Summary::restore(&bytes) {
                Ok((restored, written_in)) => {
                    summary = restored;
                    say(format!(
                        "{{\"event\":\"restored\",\"location\":\"{}\",\"term\":{written_in},\"nodes\":{}}}",
                        pointer.location,
                        nodes_json(&summary)
                    ));
                }
                Err(e) => {
                    tracing::error!(event = "checkpoint_unreadable", location = %pointer.location, error = %e, "starting empty")
                }
            },
            Ok(None) => tracing::error!(event = "checkpoint_gone", location = %pointer.location, "starting empty"),
            Err(e) => {
                tracing::error!(event = "checkpoint_unreadable", location = %pointer.location, error = %e, "starting empty")
            }
        }
    }
    let mut aggregator = Aggregator::bind(listen, summary).map_err(|e| format!("--listen {listen}: {e}"))?;
    if let Some(key) = key {
        aggregator.authenticate(key);
    }
    say(format!(
        "{{\"event\":\"leading\",\"listen\":\"{}\",\"term\":{term}}}",
        aggregator.local_addr().map_err(|e| e.to_string())?
    ));
    let (mut last_report, mut last_checkpoint, mut last_renew) = (Instant::now(), Instant::now(), Instant::now());
    let mut last_answer = Instant::now();
    let mut written = 0u64;
    let mut previous: Option<String> = None;
    // Nodes an operator drains, with the revision of each mark.
    let mut drain_marks: Vec<(u32, i64)> = Vec::new();
    while signals.take().is_none() {
        aggregator.pump();
        for what in aggregator.take_security_events() {
            say(serde_json::json!({"event": "link_refused", "what": what}).to_string());
        }
        std::thread::sleep(Duration::from_millis(2));
        if last_renew.elapsed() >= every {
            last_renew = Instant::now();
            if let (Some(cluster), Some(candidate)) = (&cluster, &mut candidate) {
                // Lost: the lease expired, or another leads. etcd not
                // answering is not known to be lost — until a whole lease
                // has passed since the last renewal it answered.
                let renewed = match candidate.keep_alive() {
                    Ok(true) => match candidate.campaign() {
                        Ok(Role::Leader { .. }) => Some(true),
                        Ok(Role::Standby { .. }) => Some(false),
                        Err(_) => None,
                    },
                    Ok(false) => Some(false),
                    Err(_) => None,
                };
                match renewed {
                    Some(true) => last_answer = Instant::now(),
                    None if last_answer.elapsed() < Duration::from_secs(u64::try_from(ttl).unwrap_or(1)) => {}
                    _ => {
                        say(serde_json::json!({"event": "deposed", "id": id, "term": term}).to_string());
                        return Err("deposed: the lease is lost or another leads; stopping".into());
                    }
                }
                match cluster.members() {
                    Ok(members) => {
                        let nodes: Vec<u32> = members.iter().map(|(node, _)| *node).collect();
                        aggregator.summary.membership(&nodes);
                        let spaces: Vec<(u32, (u16, u64))> = members
                            .iter()
                            .filter_map(|(node, value)| lake_cp::ha::member_l1(value).map(|l1| (*node, l1)))
                            .collect();
                        aggregator.summary.l1_spaces(&spaces);
                    }
                    Err(e) => tracing::warn!(event = "members_unread", error = %e),
                }
                match cluster.draining() {
                    Ok(marks) => {
                        let nodes: Vec<u32> = marks.iter().map(|(node, _)| *node).collect();
                        aggregator.summary.draining(&nodes);
                        drain_marks = marks;
                    }
                    Err(e) => tracing::warn!(event = "drain_marks_unread", error = %e),
                }
            }
        }
        if let Some(store) = &mut store
            && last_checkpoint.elapsed() >= Duration::from_millis(checkpoint_ms)
        {
            last_checkpoint = Instant::now();
            written += 1;
            let name = format!("summary/{term:020}-{written:010}");
            let bytes = aggregator.summary.checkpoint(term);
            match store.put(&name, &bytes) {
                Ok(()) => {
                    let published = match &candidate {
                        Some(candidate) => candidate.publish_checkpoint(&name).unwrap_or(false),
                        None => true,
                    };
                    if published {
                        if let Some(old) = previous.replace(name.clone()) {
                            let _ = store.delete(&old);
                        }
                        say(serde_json::json!({"event": "checkpoint", "location": name, "bytes": bytes.len()})
                            .to_string());
                    } else {
                        let _ = store.delete(&name);
                    }
                }
                Err(e) => tracing::warn!(event = "checkpoint_write_failed", location = %name, error = %e),
            }
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            // Hot prefixes into every member's L1 (each copy asked at most
            // once per 10 s: it shows in the summary once it lands).
            aggregator.replicate(replicate_children, 64, Duration::from_secs(10));
            // Draining nodes: what only they hold, into other members' L1
            // (each copy asked again after 3 s until it shows), and how
            // much is left, for `lake drain-node --wait`.
            aggregator.drain(256, Duration::from_secs(3));
            if let Some(cluster) = &cluster {
                for &(node, mark) in &drain_marks {
                    // Not while the node's view waits for a snapshot (a
                    // gap, a leader just restored): it may be short of
                    // blocks, and "none left" must not be said early.
                    let figures = aggregator.summary.figures(node).filter(|f| !f.gap);
                    let Some(left) = figures.map(|f| f.drain_left) else { continue };
                    if let Err(e) = cluster.drain_progress(node, mark, left) {
                        tracing::warn!(event = "drain_progress_unwritten", node, error = %e);
                    }
                }
            }
            let c = aggregator.counters;
            say(format!(
                "{{\"event\":\"summary\",\"connected\":{:?},\"applied\":{},\"snapshot_frames\":{},\"gaps\":{},\"copies_asked\":{},\"drain_copies_asked\":{},\"nodes\":{}}}",
                aggregator.connected(),
                c.applied,
                c.snapshot_frames,
                c.gaps,
                c.copies_asked,
                c.drain_copies_asked,
                nodes_json(&aggregator.summary)
            ));
        }
    }
    if let Some(candidate) = candidate {
        let _ = candidate.resign();
    }
    Ok(())
}

fn nodes_json(summary: &lake_cp::summary::Summary) -> String {
    let nodes: Vec<String> = summary
        .nodes()
        .into_iter()
        .filter_map(|node| summary.figures(node).map(|f| (node, f)))
        .map(|(node, f)| {
            format!(
                "{{\"node\":{node},\"term\":{},\"sequence\":{},\"member\":{},\"gap\":{},\"draining\":{},\"drain_left\":{},\"replicas\":{:?},\"available\":{:?}}}",
                f.term, f.sequence, f.member, f.gap, f.draining, f.drain_left, f.replicas, f.available
            )
        })
        .collect();
    format!("[{}]", nodes.join(","))
}

/// Campaigns every `every` until `candidate` leads (printing `standby`
/// events, then `elected`): its term, or `None` when a signal says stop.
fn stand_by(
    candidate: &mut lake_cp::ha::Candidate<'_>,
    id: &str,
    every: std::time::Duration,
    signals: &lake_dp::os::Signals,
    who: &str,
) -> Option<u64> {
    use lake_cp::ha::Role;
    let say = |line: String| say!("{line}");
    let term = loop {
        match candidate.campaign() {
            Ok(Role::Leader { term }) => break term,
            Ok(Role::Standby { leader, term }) => {
                say(serde_json::json!({"event": "standby", "id": id, "leader": leader, "term": term}).to_string());
            }
            Err(e) => tracing::warn!(event = "campaign_failed", who, error = %e),
        }
        let woke = std::time::Instant::now();
        while woke.elapsed() < every {
            if signals.take().is_some() {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    say(serde_json::json!({"event": "elected", "id": id, "term": term}).to_string());
    Some(term)
}

/// One request to a running `lake-cp`'s operator socket, its answer.
fn ask_admin(path: &std::path::Path, request: &serde_json::Value) -> Result<serde_json::Value, String> {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("{}: {e} (is lake serve running there?)", path.display()))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).map_err(|e| e.to_string())?;
    writeln!(stream, "{request}").map_err(|e| format!("{}: {e}", path.display()))?;
    let mut line = String::new();
    std::io::BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("{}: {e}", path.display()))?;
    let answer: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("{}: an answer that is not JSON: {e}", path.display()))?;
    match answer.get("error").and_then(serde_json::Value::as_str) {
        Some(why) => Err(why.to_owned()),
        None => Ok(answer),
    }
}

#[allow(clippy::cast_precision_loss)] // bytes shown in MiB to an operator
fn mib(bytes: &serde_json::Value) -> String {
    format!("{:.1}", bytes.as_u64().unwrap_or(0) as f64 / f64::from(1 << 20))
}

/// `lake top`, `lake inspect`, `lake namespaces`, `lake purge`.
/// `lake persist`: every L1-only block written back to L2 (kept in L1);
/// with `--wait`, until none is left.
fn persist(admin: &std::path::Path, namespace: Option<String>, wait_s: u64) -> Result<(), String> {
    use serde_json::json;
    let mut request = json!({ "op": "persist" });
    if let Some(namespace) = &namespace {
        request["namespace"] = json!(namespace);
    }
    let answer = ask_admin(admin, &request)?;
    say!("{}", json!({ "event": "persisting", "queued": answer["queued"], "l1_only": answer["l1_only"] }));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
    let mut asked = std::time::Instant::now();
    loop {
        // The pool's count, of the namespace asked or of all; asked again
        // each second (blocks saved since, write-backs refused for want of
        // a free slot, are queued anew; the queue skips what is below).
        let again = asked.elapsed() >= std::time::Duration::from_secs(1);
        request["op"] = json!(if again { "persist" } else { "l1_only" });
        if again {
            asked = std::time::Instant::now();
        }
        let left = ask_admin(admin, &request)?["l1_only"].as_u64().unwrap_or(u64::MAX);
        if left == 0 {
            say!("{}", json!({ "event": "persisted", "l1_only": 0 }));
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            if wait_s == 0 {
                return Ok(());
            }
            return Err(format!(
                "{left} blocks still in L1 alone after {wait_s} s (L2 full, or no free L1 slot to stage them: `lake \
                 top` shows the tier commands refused)"
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// An operator command's arguments.
#[derive(Debug, Default)]
struct Operator {
    admin: PathBuf,
    arena: Option<PathBuf>,
    json_out: bool,
    once: bool,
    interval_ms: u64,
    wait_s: u64,
    undo: bool,
    positional: Vec<String>,
}

/// `lake top`, `inspect`, `namespaces`, `purge`, `regions`, `peers`, `drain`.
fn operator(op: &str, args: Operator) -> Result<(), String> {
    use serde_json::json;
    let Operator { admin, arena, json_out, once, interval_ms, wait_s, undo, positional } = args;
    let show = |value: &serde_json::Value, text: String| {
        if json_out { say!("{value}") } else { show!("{text}") }
    };
    match op {
        "top" => loop {
            let top = ask_admin(&admin, &json!({ "op": "top" }))?;
            if !once && !json_out {
                // Clear the terminal, as top does.
                show!("\x1b[H\x1b[2J");
            }
            show(&top, render_top(&top));
            if once {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(interval_ms));
        },
        "inspect" => {
            let [key] = positional.as_slice() else {
                return Err("inspect takes one KEY (32 hex digits)".to_string());
            };
            let mut block = ask_admin(&admin, &json!({ "op": "inspect", "key": key }))?;
            if let Some(path) = &arena {
                let attached =
                    lake_dp::arena::Arena::attach(path).map_err(|e| format!("--arena {}: {e}", path.display()))?;
                let region_of_l1 = block["replicas"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|r| r["tier"] == "l1")
                    .filter_map(|r| Some((r["slot"].as_u64()?, r["generation"].as_u64()?)))
                    .collect::<Vec<_>>();
                let mut pins = Vec::new();
                for (slot, generation) in region_of_l1 {
                    let slot = u32::try_from(slot).map_err(|e| e.to_string())?;
                    for (agent, pinned) in attached.pins_on(slot) {
                        pins.push(json!({ "slot": slot, "agent": agent, "generation": pinned, "current": u64::from(pinned) == generation }));
                    }
                }
                block["pins"] = json!(pins);
            }
            show(&block, render_block(&block));
            Ok(())
        }
        "namespaces" => {
            let list = ask_admin(&admin, &json!({ "op": "namespaces" }))?;
            let mut text = format!("{:<18} {:>10} {:>10} {:>10}  purging\n", "namespace", "L1 MiB", "L2 MiB", "L3 MiB");
            for n in list["namespaces"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{:<18} {:>10} {:>10} {:>10}  {}\n",
                    n["namespace"].as_str().unwrap_or("?"),
                    mib(&n["l1_bytes"]),
                    mib(&n["l2_bytes"]),
                    mib(&n["l3_bytes"]),
                    if n["purging"] == true { "yes" } else { "" }
                ));
            }
            show(&list, text);
            Ok(())
        }
        "purge" => {
            let [namespace] = positional.as_slice() else {
                return Err("purge takes one NAMESPACE (hex)".to_string());
            };
            let answer = ask_admin(&admin, &json!({ "op": "purge", "namespace": namespace }))?;
            let wanted =
                format!("{:016x}", u64::from_str_radix(namespace, 16).map_err(|e| format!("{namespace}: {e}"))?);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
            loop {
                let top = ask_admin(&admin, &json!({ "op": "top" }))?;
                let still = top["purging"].as_array().is_some_and(|p| p.iter().any(|n| n == wanted.as_str()));
                if !still {
                    say!("{{\"event\":\"purged\",\"namespace\":\"{wanted}\"}}");
                    return Ok(());
                }
                if std::time::Instant::now() >= deadline {
                    if wait_s > 0 {
                        return Err(format!(
                            "{wanted} still holds blocks after {wait_s} s (leased ones wait for their leases)"
                        ));
                    }
                    say!("{{\"event\":\"purging\",\"purging\":{}}}", answer["purging"]);
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        "regions" => {
            let list = ask_admin(&admin, &json!({ "op": "regions" }))?;
            let mut text = format!(
                "{:>6} {:<4} {:>5} {:>10} {:>10} {:>8}  {:<9} name\n",
                "region", "tier", "node", "MiB", "capacity", "blocks", "draining"
            );
            for r in list["regions"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{:>6} {:<4} {:>5} {:>10} {:>10} {:>8}  {:<9} {}\n",
                    r["region"].as_u64().unwrap_or(0),
                    r["tier"].as_str().unwrap_or("?"),
                    r["node"].as_u64().unwrap_or(0),
                    mib(&r["bytes"]),
                    mib(&r["capacity_bytes"]),
                    r["blocks"].as_u64().unwrap_or(0),
                    if r["draining"] == true { "yes" } else { "" },
                    r["name"].as_str().unwrap_or("")
                ));
            }
            show(&list, text);
            Ok(())
        }
        "peers" => {
            let list = ask_admin(&admin, &json!({ "op": "peers" }))?;
            let mut text =
                format!("{:<12} {:<24} {:>5} {:>8} {:>7}  features\n", "role", "name", "node", "pid", "version");
            for p in list["peers"].as_array().into_iter().flatten() {
                let features: Vec<&str> =
                    p["features"].as_array().into_iter().flatten().filter_map(serde_json::Value::as_str).collect();
                text.push_str(&format!(
                    "{:<12} {:<24} {:>5} {:>8} {:>7}  {}\n",
                    p["role"].as_str().unwrap_or("?"),
                    p["name"].as_str().unwrap_or(""),
                    p["node"].as_u64().unwrap_or(0),
                    p["pid"].as_u64().unwrap_or(0),
                    p["version"].as_u64().map_or_else(|| "-".to_owned(), |v| v.to_string()),
                    if features.is_empty() { "-".to_owned() } else { features.join(",") }
                ));
            }
            show(&list, text);
            Ok(())
        }
        "drain" => {
            let [which] = positional.as_slice() else {
                return Err("drain takes one REGION (its id) or FILE (its path)".to_string());
            };
            let mut request = match which.parse::<u64>() {
                Ok(region) => json!({ "op": "drain", "region": region }),
                Err(_) => json!({ "op": "drain", "name": which }),
            };
            request["undo"] = json!(undo);
            let answer = ask_admin(&admin, &request)?;
            // The region it named, by id (a file's path resolved there).
            let region = answer["region"].as_u64().ok_or_else(|| format!("unexpected answer: {answer}"))?;
            if undo {
                say!("{{\"event\":\"undrained\",\"region\":{region}}}");
                return Ok(());
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
            loop {
                let drains = ask_admin(&admin, &json!({ "op": "drains" }))?["drains"].clone();
                let this = drains.as_array().into_iter().flatten().find(|d| d["region"] == region).cloned();
                let Some(this) = this else { return Err(format!("region {region} is no longer being drained")) };
                if this["done"] == true {
                    say!(
                        "{{\"event\":\"drained\",\"region\":{region},\"moves_asked\":{},\"drops_asked\":{}}}",
                        this["moves_asked"],
                        this["drops_asked"]
                    );
                    return Ok(());
                }
                if std::time::Instant::now() >= deadline {
                    if wait_s > 0 {
                        let why = this["refused"].as_str().map_or_else(String::new, |r| format!(" (refused: {r})"));
                        return Err(format!(
                            "region {region} still holds {} blocks after {wait_s} s{why}",
                            this["blocks_left"]
                        ));
                    }
                    say!("{{\"event\":\"draining\",\"drain\":{this}}}");
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        _ => Err(format!("unknown operator command {op}")),
    }
}

#[allow(clippy::cast_precision_loss)] // percentages shown to an operator
fn render_top(top: &serde_json::Value) -> String {
    let mut text = format!(
        "lake-cp node {}  blocks {}  leases {}  sessions {}  waiting {}\n",
        top["node"], top["blocks"], top["leases"], top["sessions"], top["waiting_for_parent"]
    );
    let lookups = &top["lookups"];
    let ratio = lookups["hit_ratio"].as_f64().map_or_else(|| "-".to_owned(), |r| format!("{:.1}%", r * 100.0));
    text.push_str(&format!(
        "lookups: {} blocks asked, {} hit ({ratio})   committed {}  evicted {}\n\n",
        lookups["requested_blocks"], lookups["hit_blocks"], top["blocks_committed"], top["blocks_evicted"]
    ));
    text.push_str(&format!(
        "{:<5} {:>10} {:>12} {:>7} {:>9} {:>12}\n",
        "tier", "MiB", "capacity", "used", "blocks", "leaving MiB"
    ));
    for tier in top["tiers"].as_array().into_iter().flatten() {
        let (bytes, capacity) = (tier["bytes"].as_u64().unwrap_or(0), tier["capacity_bytes"].as_u64().unwrap_or(0));
        let used =
            if capacity == 0 { "-".to_owned() } else { format!("{:.0}%", bytes as f64 * 100.0 / capacity as f64) };
        text.push_str(&format!(
            "{:<5} {:>10} {:>12} {:>7} {:>9} {:>12}\n",
            tier["tier"].as_str().unwrap_or("?"),
            mib(&tier["bytes"]),
            mib(&tier["capacity_bytes"]),
            used,
            tier["blocks"].as_u64().unwrap_or(0),
            mib(&tier["pending_bytes"])
        ));
    }
    let t = &top["tier_commands"];
    text.push_str(&format!(
        "\ntier commands: {} in flight, {} demotions, {} written below ahead, {} to L3, {} copies to L3, {} failed, {} \
         purged, {} over tenant quotas\n",
        t["pending"],
        t["demotions"],
        t["cleanings"],
        t["to_l3"],
        t["copies_to_l3"],
        t["failed"],
        t["purged"],
        t["tenant_quota_evictions"]
    ));
    let v = &top["victims"];
    if !v.is_null() {
        text.push_str(&format!(
            "L1 victims: {} marked now; taken by saves and loads: {} with a copy below, {} dropped\n",
            v["marked_now"], v["taken_clean"], v["taken_dropped"]
        ));
    }
    let saves = &top["saves"];
    if !saves.is_null() {
        let by = &saves["refused_by"];
        let why = if by.is_null() {
            "no L1 slot free".to_owned()
        } else {
            format!(
                "{} L1 full, {} only the load reserve free, {} stopping",
                by["no_space"], by["load_reserve"], by["stopping"]
            )
        };
        text.push_str(&format!(
            "saves: {} saved, {} refused ({why}), {} corrupt at commit\n",
            saves["saved"], saves["refused"], saves["corrupt"]
        ));
    }
    let refused = &t["refused"];
    if refused.as_object().is_some_and(|r| !r.is_empty()) {
        text.push_str(&format!("tier commands refused by the data plane: {refused}\n"));
    }
    if top["purging"].as_array().is_some_and(|p| !p.is_empty()) {
        text.push_str(&format!("purging: {}\n", top["purging"]));
    }
    for d in top["drains"].as_array().into_iter().flatten() {
        let state = if d["done"] == true {
            "done".to_owned()
        } else if let Some(why) = d["refused"].as_str() {
            format!("refused: {why}")
        } else if d["announced"] == true {
            "moving".to_owned()
        } else {
            "telling its lake-dp".to_owned()
        };
        text.push_str(&format!(
            "draining region {}: {} blocks left, {} moves and {} drops asked ({state})\n",
            d["region"], d["blocks_left"], d["moves_asked"], d["drops_asked"]
        ));
    }
    let paths = top["paths"].as_array().into_iter().flatten().collect::<Vec<_>>();
    if !paths.is_empty() {
        text.push_str(&format!(
            "\n{:<20} {:>10} {:>10} {:>10} {:>10}\n",
            "path", "count", "mean µs", "p50 ≤ µs", "p99 ≤ µs"
        ));
        let number = |v: &serde_json::Value| v.as_u64().map_or_else(|| "-".to_owned(), |n| n.to_string());
        for path in paths {
            text.push_str(&format!(
                "{:<20} {:>10} {:>10} {:>10} {:>10}\n",
                path["path"].as_str().unwrap_or("?"),
                number(&path["count"]),
                number(&path["mean_us"]),
                number(&path["p50_us"]),
                number(&path["p99_us"])
            ));
        }
    }
    text
}

#[allow(clippy::cast_precision_loss)] // seconds shown to an operator
fn render_block(block: &serde_json::Value) -> String {
    let mut text = format!("block {}\n", block["key"].as_str().unwrap_or("?"));
    if block["known"] != true {
        text.push_str("  not in this node's index\n");
    } else {
        text.push_str(&format!(
            "  kind {}  namespace {}  parent {}  leaf {}\n",
            block["kind"].as_str().unwrap_or("?"),
            block["namespace"].as_str().unwrap_or("?"),
            block["parent"].as_str().unwrap_or("none (a root)"),
            block["leaf"]
        ));
        for t in block["tiers"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "  {}: {} hits counted by its policy\n",
                t["tier"].as_str().unwrap_or("?"),
                t["hits"]
            ));
        }
        text.push_str("  replicas:\n");
        for r in block["replicas"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "    {} region {} node {} epoch {} slot {} generation {} {}\n",
                r["tier"].as_str().unwrap_or("?"),
                r["region"],
                r["node"],
                r["epoch"],
                r["slot"],
                r["generation"],
                r["state"].as_str().unwrap_or("?")
            ));
        }
        let leases = block["leases"].as_array().map_or(0, Vec::len);
        text.push_str(&format!("  leases: {}\n", if leases == 0 { "none".to_owned() } else { leases.to_string() }));
        for l in block["leases"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "    lease {} on region {}, {} ms left\n",
                l["id"], l["region"], l["expires_in_ms"]
            ));
        }
    }
    match block["pins"].as_array() {
        Some(pins) if pins.is_empty() => text.push_str("  L1 pins: none\n"),
        Some(pins) => {
            for p in pins {
                text.push_str(&format!(
                    "  L1 pin: slot {} by agent {} (generation {}{})\n",
                    p["slot"],
                    p["agent"],
                    p["generation"],
                    if p["current"] == true { "" } else { ", an older one" }
                ));
            }
        }
        None => text.push_str("  L1 pins: give --arena PATH to read them\n"),
    }
    text.push_str("  history (oldest first):\n");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    for e in block["history"].as_array().into_iter().flatten() {
        let ago_ms = now.saturating_sub(e["unix_ns"].as_u64().unwrap_or(0)) / 1_000_000;
        text.push_str(&format!(
            "    {:>9.3} s ago  {} (region {} slot {})\n",
            ago_ms as f64 / 1000.0,
            e["what"].as_str().unwrap_or("?"),
            e["region"],
            e["slot"]
        ));
    }
    text
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
