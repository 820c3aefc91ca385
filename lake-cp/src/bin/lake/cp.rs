//! A cluster's parts: `lake cp` (one node's control plane) and `lake
//! summary` (the leader that holds the cluster's summary), and draining
//! a node through etcd.

use super::*;
use crate::health::{Answers, HealthServer};

#[derive(Args, Debug)]
pub(super) struct CpArgs {
    /// The socket data planes and agents connect to.
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// The shared-memory mirror engines read. Default: the one of the
    /// `--config` file's `dir`, which `lake-dp` gives its engines.
    #[arg(long, value_name = "PATH", required_unless_present = "config")]
    mirror: Option<PathBuf>,
    /// The node's settings, the file its `lake-dp` reads (`lake.toml`):
    /// the tier manager keeps its quotas, tenants and marks, and each
    /// tenant kept apart (`tenant-partition`) has its blocks published
    /// in a mirror of its own, `<mirror>.<tenant>`, the one `lake-dp`
    /// gives that tenant's engines, and in no other. While it leads it
    /// serves, as `lake serve` does, its socket to the users the file
    /// allows, `/metrics` at the file's `metrics` (unless `--metrics`)
    /// and the operator's socket `DIR/admin.sock`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where this process serves `/metrics`, `/healthz` and `/readyz`,
    /// from its start: a standby answers `/healthz` (ok) and `/readyz`
    /// (503, standing by) and `lake_cp_leading 0`; once it leads, what
    /// the pool serves. `off`: none. Default: the `--config` file's
    /// `metrics`, served once it leads (the candidates of one host share
    /// the file, and its port); without a file, none.
    #[arg(long, value_name = "IP:PORT|off", value_parser = lake_cp::config::parse_metrics)]
    metrics: Option<lake_cp::config::Metrics>,
    /// etcd endpoints, comma-separated.
    #[arg(long, value_name = "URL[,URL...]")]
    etcd: String,
    /// The cluster's name in etcd.
    #[arg(long, value_name = "NAME")]
    cluster: String,
    /// TLS to etcd.
    #[command(flatten)]
    etcd_tls: lake_cp::config::EtcdTlsArgs,
    /// This candidate's id.
    #[arg(long, value_name = "ID")]
    id: String,
    /// Seconds the leadership lease lasts without renewal.
    #[arg(long, value_name = "SECONDS", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    ttl: u32,
    /// The node it controls. Default: the `--config` file's `node`, else 0.
    #[arg(long, value_name = "N")]
    node: Option<u32>,
    /// Entries the mirror holds.
    #[arg(long, value_name = "N", default_value_t = 1 << 20)]
    entries: u64,
}

#[derive(Args, Debug)]
pub(super) struct SummaryArgs {
    /// Where nodes connect to report their replicas.
    #[arg(long, value_name = "IP:PORT")]
    listen: std::net::SocketAddr,
    /// etcd endpoints, comma-separated (leadership, members, drain marks).
    #[arg(long, value_name = "URL[,URL...]", requires = "cluster")]
    etcd: Option<String>,
    /// The cluster's name in etcd.
    #[arg(long, value_name = "NAME", requires = "etcd")]
    cluster: Option<String>,
    /// TLS to etcd.
    #[command(flatten)]
    etcd_tls: lake_cp::config::EtcdTlsArgs,
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
    /// A block K or more blocks continue is copied into the L1 of every
    /// member whose engines read its namespace (0: none).
    #[arg(long, value_name = "K", default_value_t = 0)]
    replicate_children: usize,
    /// Where the pool keeps a block: `read`, on the node that saved it
    /// until another node pulls it, then on that one (the holder's copy is
    /// dropped once the reader has it): a prefix gathers where it was
    /// last read; `saved`, on the node that saved it (a pulled copy is a
    /// copy, first to go); `home`, each in the member a rendezvous hash of
    /// its key picks, weighted by the members' room (the saving node's
    /// copy is dropped once the home has it). One copy a block either way,
    /// besides hot prefixes' replicas.
    #[arg(long, value_name = "WHERE", default_value = "read", value_parser = ["read", "saved", "home"])]
    placement: String,
    /// A full node drops the L1 victims it has no room below for, rather
    /// than spilling them into the member with the most room (which nodes
    /// do by default: the pool's capacity is every member's).
    #[arg(long)]
    no_spills: bool,
    /// The cluster link key: nodes' links are authenticated with it.
    #[arg(long, value_name = "FILE")]
    link_key: Option<PathBuf>,
    /// Node connections held at once; one past it is closed as it comes,
    /// and one that says no hello within 5 s is closed.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    connections_max: u32,
    /// Where this candidate serves `/metrics`, `/healthz` and `/readyz`:
    /// bound at start, answered while it stands by (`/readyz` 503
    /// `standing by`, `lake_summary_leading 0`) and once it leads (ready,
    /// the cluster's figures).
    #[arg(long, value_name = "IP:PORT")]
    metrics: Option<std::net::SocketAddr>,
}

/// `lake drain-node`: marks a node draining in etcd (or takes it back);
/// with `--wait`, follows the leader's count of the blocks only it holds
/// until none is left.
pub(super) fn drain_node(
    (etcd, tls): (&str, &lake_cp::etcd::EtcdTls),
    name: &str,
    wait_s: u64,
    undo: bool,
    node: u32,
) -> Result<(), String> {
    let endpoints: Vec<&str> = etcd.split(',').collect();
    let client = lake_cp::etcd::Etcd::with_tls(&endpoints, std::time::Duration::from_secs(2), tls)
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

/// `lake cp`: one control plane of a node, standing for leadership.
pub(super) fn control_plane(args: &CpArgs) -> Result<(), String> {
    use std::time::Duration;

    use lake_cp::etcd::Etcd;
    use lake_cp::ha::Cluster;
    use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorWriter};

    let NodeSettings { node, mirror, tiers, tenants, tenant_engines, cluster: joins, serving } = node_settings(args)?;
    // Its own metrics address: bound now, answered while it stands by,
    // and the pool's once it leads.
    let own_metrics = match args.metrics {
        Some(lake_cp::config::Metrics::At(at)) => {
            Some(std::net::TcpListener::bind(at).map_err(|e| format!("--metrics {at}: {e}"))?)
        }
        _ => None,
    };
    let signals = lake_dp::os::Signals::new().map_err(|e| format!("signals: {e}"))?;
    let (socket, mirror, etcd, cluster, id) = (&args.socket, &mirror, &args.etcd, &args.cluster, &args.id);
    let (ttl, entries) = (i64::from(args.ttl), args.entries);
    let endpoints: Vec<&str> = etcd.split(',').collect();
    let client = Etcd::with_tls(&endpoints, Duration::from_secs(2), &args.etcd_tls.tls()).map_err(|e| e.to_string())?;
    let cluster = Cluster::new(client, cluster).map_err(|e| e.to_string())?;
    let mut candidate = cluster.candidate(id, ttl).map_err(|e| e.to_string())?;
    let every = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 4).max(Duration::from_millis(50));
    let say = |line: String| say!("{line}");
    // A standby until it leads (or is told to stop), answering health
    // checks at its own address meanwhile.
    let standing_by = Answers {
        metrics: lake_cp::metrics::standby(),
        ready: Err("standing by: another control plane leads this node".to_owned()),
    };
    let health = own_metrics.map(|listener| HealthServer::start(listener, standing_by)).transpose()?;
    let elected = stand_by(&mut candidate, id, every, &signals, "lake cp");
    let own_metrics = health.map(HealthServer::stop).transpose()?;
    let Some(term) = elected else { return Ok(()) };
    // The mirrors engines already read are taken over (their mappings stay
    // good) and emptied: the view is rebuilt from what the data planes
    // re-adopt. One that is not there, or not a mirror, is made anew. One
    // whose writer lives belongs to a predecessor that is stopped, not
    // dead: it is deposed when it wakes (it renews before it acts) and
    // lets go; until then this leader waits, renewing its own lease.
    let mut said_waiting = false;
    let mut take_over = |path: &PathBuf, candidate: &mut lake_cp::ha::Candidate<'_>| loop {
        match MirrorWriter::take_over(path, term) {
            Ok((mut writer, _)) => {
                writer.clear();
                return Ok(Some(writer));
            }
            Err(lake_dp::mirror::MirrorError::InUse { pid }) => {
                if !said_waiting {
                    said_waiting = true;
                    say(serde_json::json!({"event": "waiting", "id": id, "term": term, "mirror_writer": pid})
                        .to_string());
                }
                std::thread::sleep(Duration::from_millis(100));
                if signals.take().is_some() {
                    return Ok(None);
                }
                if !candidate.keep_alive().unwrap_or(true) {
                    return Err(format!("deposed while waiting for the mirror (term {term})"));
                }
            }
            Err(_) => {
                let table = MirrorConfig {
                    node: lake_dp::NodeId(node),
                    ..MirrorConfig::for_entries(MirrorBacking::Shm(path.clone()), entries)
                };
                return MirrorWriter::create(&table).map(Some).map_err(|e| format!("mirror {}: {e}", path.display()));
            }
        }
    };
    // Told to stop while waiting for one: handing over now.
    let Some(writer) = take_over(mirror, &mut candidate)? else {
        let _ = candidate.resign();
        return Ok(());
    };
    let mut tenant_mirrors = Vec::with_capacity(tenants.len());
    for (namespaces, path) in &tenants {
        let Some(tenant) = take_over(path, &mut candidate)? else {
            let _ = candidate.resign();
            return Ok(());
        };
        tenant_mirrors.push((namespaces.clone(), tenant));
    }
    let state = lake_cp::node::Node::new(lake_dp::NodeId(node), term, Some(writer))
        .with_tiers(tiers)
        .with_tenant_mirrors(tenant_mirrors)
        .with_tenant_engines(tenant_engines);
    let bound = lake_cp::server::Server::bind(socket, state, term)
        .map_err(|e| format!("{}: {e}", socket.display()))
        .and_then(|mut server| {
            let at = match &serving {
                Some(beside) => server.serve_beside(beside).map_err(|(what, e)| format!("{what}: {e}"))?,
                None => None,
            };
            let at = match own_metrics {
                Some(listener) => Some(server.serve_metrics_on(listener).map_err(|e| format!("metrics: {e}"))?),
                None => at,
            };
            Ok((at, server))
        });
    let (metrics, mut server) = match bound {
        Ok(bound) => bound,
        Err(why) => {
            // The standby need not wait out the lease of one that cannot serve.
            let _ = candidate.resign();
            return Err(why);
        }
    };
    // A node of a cluster: its replicas to the leader's summary, the
    // other nodes' back into the view beside the mirror, and its
    // membership held while it leads (a standby's node is this one).
    let mut membership = None;
    if let Some(joins) = &joins {
        if !joins.summary_to.is_empty() {
            let views = match joins.view_blocks {
                0 => None,
                blocks => Some(
                    lake_cp::summary::link::NodeViews::create(lake_dp::NodeId(node), blocks, mirror, &tenants)
                        .map_err(|e| format!("cluster view beside {}: {e}", mirror.display()))?,
                ),
            };
            server.report_to(joins.summary_to.clone(), joins.link_key.clone(), views, &joins.kept_apart);
        }
        membership = join(joins, node)?;
    }
    let admin = serving.as_ref().and_then(|s| s.admin.as_ref());
    say(serde_json::json!({"event": "leading", "id": id, "term": term, "socket": socket, "mirror": mirror, "node": node,
        "metrics": metrics.map(|m| m.to_string()), "admin": admin})
    .to_string());
    let led = lead(&mut candidate, &mut server, membership.as_mut(), (id, term, ttl), &signals);
    if let Some(membership) = membership {
        let _ = membership.leave();
    }
    led?;
    // Handing over now: the standby need not wait out the lease.
    let _ = candidate.resign();
    say(serde_json::json!({"event": "resigned", "id": id, "term": term}).to_string());
    Ok(())
}

/// Serves as the leader of term `term` until a signal says stop (`Ok`:
/// the caller resigns) or the lease is lost (an error).
fn lead(
    candidate: &mut lake_cp::ha::Candidate<'_>,
    server: &mut lake_cp::server::Server,
    mut membership: Option<&mut lake_cp::ha::Membership>,
    (id, term, ttl): (&str, u64, i64),
    signals: &lake_dp::os::Signals,
) -> Result<(), String> {
    use std::time::{Duration, Instant};
    let say = |line: String| say!("{line}");
    let renew = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 3);
    let lease = Duration::from_secs(u64::try_from(ttl).unwrap_or(1));
    let (mut last_renewal, mut confirmed) = (Instant::now(), Instant::now());
    loop {
        if signals.take().is_some() {
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
        if let Some(membership) = membership.as_deref_mut() {
            let node = server.node();
            let l1 = node.locations.region_of(node.node(), lake_dp::Tier::L1Dram).map(|(r, info)| (r, info.epoch));
            if let Some(draining) = membership.tend(l1)
                && server.node().draining != draining
            {
                server.node_mut().set_draining(draining);
                say(format!("{{\"event\":\"draining\",\"node\":{},\"on\":{draining}}}", server.node().node().0));
            }
        }
        server.poll_once(Some(Duration::from_millis(5))).map_err(|e| format!("serving: {e}"))?;
    }
}

/// What `lake cp` serves with, from its arguments.
struct NodeSettings {
    /// The node it controls.
    node: u32,
    /// The pool's mirror.
    mirror: PathBuf,
    /// The tier manager's settings.
    tiers: lake_cp::tier::TierConfig,
    /// The mirror of each tenant kept apart, and its namespaces.
    tenants: Vec<(Vec<u64>, PathBuf)>,
    /// Who each of those tenants' engines are, as the data plane tells
    /// them apart.
    tenant_engines: lake_dp::runner::config::Partitions,
    /// The cluster the node is part of, where its file names one.
    cluster: Option<ClusterSettings>,
    /// What it serves beside its socket, as the file says (none without
    /// a file: its own user alone, no metrics but `--metrics`, no
    /// operator's socket; the
    /// operator's socket is `DIR/admin.sock` where the file names a
    /// `dir`, where `lake top --dir DIR` finds it).
    serving: Option<lake_cp::server::Beside>,
}

/// A node of a cluster, as its file (`lake.toml`) says, as `lake serve`
/// reads it: the leader's summary it reports to (and the view of other
/// nodes' blocks it keeps beside the mirror), and the membership it holds
/// in etcd while it leads.
struct ClusterSettings {
    /// The leader's summary aggregators (`summary-to`).
    summary_to: Vec<std::net::SocketAddr>,
    /// The cluster link key.
    link_key: Option<lake_dp::auth::LinkKey>,
    /// Blocks of other nodes the view holds (0: no view).
    view_blocks: u64,
    /// etcd endpoints and the cluster's name (`etcd`, `cluster`), the
    /// TLS to speak to them, and the membership lease in seconds.
    members: Option<(Vec<String>, String, lake_cp::etcd::EtcdTls, i64)>,
    /// What the membership names: the data plane's transport
    /// (`transport-listen`), where other nodes send blocks.
    address: Option<std::net::SocketAddr>,
    /// The node's room in bytes (L1 and L2), for the leader's placement.
    room: u64,
    /// Each tenant kept apart, with its namespaces, as said to the leader.
    kept_apart: Vec<(String, Vec<u64>)>,
}

/// The settings of `lake cp`'s arguments: without `--config`, the tier
/// manager's defaults, no tenant's mirror and no cluster.
fn node_settings(args: &CpArgs) -> Result<NodeSettings, String> {
    let Some(file) = &args.config else {
        let mirror = args.mirror.clone().ok_or("--mirror or --config is needed")?;
        let (tiers, node) = (lake_cp::tier::TierConfig::default(), args.node.unwrap_or(0));
        return Ok(NodeSettings {
            node,
            mirror,
            tiers,
            tenants: Vec::new(),
            tenant_engines: lake_dp::runner::config::Partitions::default(),
            cluster: None,
            serving: None,
        });
    };
    let argv = ["--config".to_owned(), file.display().to_string()];
    let settings = lake_cp::config::ServeArgs::parse(&argv).map_err(|e| e.to_string())?;
    // Made, as `lake-dp` makes it, before the mirror is named: the name
    // comes from the directory's canonical path.
    if let Some(dir) = &settings.dir {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: dir {}: {e}", file.display(), dir.display()))?;
    }
    let lake_cp::config::Serve { pool, cluster, etcd_tls, member_ttl, .. } = settings.resolve()?;
    // The node its `lake-dp` registers as: the file's.
    let node = match args.node {
        Some(node) if node != pool.node => {
            return Err(format!("--node {node}: the lake-dp of {} is node {}", file.display(), pool.node));
        }
        _ => pool.node,
    };
    // The mirror its `lake-dp` gives engines: the one of its directory.
    let theirs = settings.dir.is_some().then(|| pool.shared_memory().1);
    let mirror = match (&args.mirror, theirs) {
        (Some(ours), Some(theirs)) if !pool.partitions.is_empty() && *ours != theirs => {
            return Err(format!(
                "--mirror {}: the lake-dp of {} gives its engines {} (and its tenants' beside it)",
                ours.display(),
                file.display(),
                theirs.display()
            ));
        }
        (Some(ours), _) => ours.clone(),
        (None, Some(theirs)) => theirs,
        (None, None) => return Err(format!("{}: no dir, so no mirror: --mirror is needed", file.display())),
    };
    let tiers = pool.tier_config()?;
    let tenants = pool.tenant_mirrors(&mirror)?;
    let tenant_engines = pool.tenant_engines()?;
    let kept_apart = pool.kept_apart()?;
    let cluster = (!pool.summary_to.is_empty() || cluster.is_some()).then(|| ClusterSettings {
        summary_to: pool.summary_to.clone(),
        link_key: pool.link_key.clone(),
        view_blocks: if pool.cluster_view().is_some() { pool.cluster_view_blocks } else { 0 },
        members: cluster.map(|(endpoints, name)| (endpoints, name, etcd_tls, member_ttl)),
        address: pool.transport_listen,
        room: pool.room_bytes(),
        kept_apart,
    });
    let serving = lake_cp::server::Beside {
        access: pool.access.of_sockets().map_err(|e| format!("{}: {e}", file.display()))?,
        caps: pool.caps.server,
        admin: settings.dir.is_some().then(|| pool.dir.join("admin.sock")),
        // `--metrics` (an address or `off`) takes the file's place.
        metrics: pool.metrics.filter(|_| args.metrics.is_none()),
    };
    Ok(NodeSettings { node, mirror, tiers, tenants, tenant_engines, cluster, serving: Some(serving) })
}

/// Joins the cluster `settings` names, as `node` (none: the file names no
/// etcd).
fn join(settings: &ClusterSettings, node: u32) -> Result<Option<lake_cp::ha::Membership>, String> {
    let Some((endpoints, name, tls, ttl)) = &settings.members else { return Ok(None) };
    let Some(address) = settings.address else {
        return Err("a member of a cluster needs transport-listen: other nodes send its blocks there".into());
    };
    let list: Vec<&str> = endpoints.iter().map(String::as_str).collect();
    let client = lake_cp::etcd::Etcd::with_tls(&list, std::time::Duration::from_secs(2), tls)
        .map_err(|e| format!("etcd {}: {e}", endpoints.join(",")))?;
    let cluster = lake_cp::ha::Cluster::new(client, name).map_err(|e| format!("cluster {name}: {e}"))?;
    lake_cp::ha::Membership::join(cluster, node, address.to_string(), settings.room, *ttl)
        .map(Some)
        .map_err(|e| format!("joining cluster {name}: {e}"))
}

/// `lake summary`: the leader's cluster summary (see `lake_cp::summary`).
pub(super) fn summary_leader(args: &SummaryArgs) -> Result<(), String> {
    use std::time::{Duration, Instant};

    use lake_cp::ha::{Cluster, Role};
    use lake_cp::summary::Summary;
    use lake_cp::summary::link::Aggregator;
    use lake_dp::l3::ObjectStore;

    /// Placement copies asked in one pass of the leader's loop, at most
    /// (a pass is 2 ms or less).
    const PLACE_PER_PASS: usize = 256;
    // Its health checks: bound now, answered while it stands by and
    // once it leads.
    let health = match args.metrics {
        Some(at) => {
            let listener = std::net::TcpListener::bind(at).map_err(|e| format!("--metrics {at}: {e}"))?;
            let standing_by = Answers {
                metrics: lake_cp::summary::metrics::standby(),
                ready: Err("standing by: another candidate leads the summary".to_owned()),
            };
            Some(HealthServer::start(listener, standing_by)?)
        }
        None => None,
    };
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
            let client = lake_cp::etcd::Etcd::with_tls(&endpoints, Duration::from_secs(2), &args.etcd_tls.tls())
                .map_err(|e| e.to_string())?;
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
                        nodes_json(&summary.all_figures())
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
    let placing = args.placement == "home";
    if placing {
        aggregator.summary.track_placement();
    }
    if args.placement == "read" {
        aggregator.move_pulled_blocks();
    }
    if !args.no_spills {
        aggregator.place_spills_in_room();
    }
    aggregator.connections_max = args.connections_max as usize;
    if let Some(key) = key {
        aggregator.authenticate(key);
    }
    say(format!(
        "{{\"event\":\"leading\",\"listen\":\"{}\",\"term\":{term}}}",
        aggregator.local_addr().map_err(|e| e.to_string())?
    ));
    let leading = |aggregator: &Aggregator, figures: &[(u32, lake_cp::summary::NodeFigures)]| Answers {
        metrics: lake_cp::summary::metrics::render(aggregator, term, figures),
        ready: Ok(()),
    };
    if let Some(health) = &health {
        health.set(leading(&aggregator, &aggregator.summary.all_figures()));
    }
    let (mut last_report, mut last_checkpoint, mut last_renew) = (Instant::now(), Instant::now(), Instant::now());
    let mut last_answer = Instant::now();
    let mut written = 0u64;
    let mut previous: Option<String> = None;
    // Nodes an operator drains, with the revision of each mark.
    let mut drain_marks: Vec<(u32, i64)> = Vec::new();
    while signals.take().is_none() {
        aggregator.pump();
        if placing {
            // The blocks saved since the last pass, to their homes.
            aggregator.place(PLACE_PER_PASS, Duration::from_secs(3));
        }
        for what in aggregator.take_security_events() {
            say(serde_json::json!({"event": "link_refused", "what": what}).to_string());
        }
        // Blocks kept apart pass only between nodes keeping them apart
        // alike: said of each node that connects unlike others.
        for (node, unlike) in aggregator.take_unlike() {
            say(serde_json::json!({"event": "tenants_unlike", "node": node, "unlike": unlike}).to_string());
        }
        aggregator.wait(Duration::from_millis(2));
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
                        let rooms: Vec<(u32, u64)> = members
                            .iter()
                            .filter_map(|(node, value)| lake_cp::ha::member_room(value).map(|room| (*node, room)))
                            .collect();
                        aggregator.summary.rooms(&rooms);
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
            let figures = aggregator.summary.all_figures();
            if let Some(cluster) = &cluster {
                for &(node, mark) in &drain_marks {
                    // Not while the node's view waits for a snapshot (a
                    // gap, a leader just restored): it may be short of
                    // blocks, and "none left" must not be said early.
                    let of_node = figures.iter().find(|(n, f)| *n == node && !f.gap);
                    let Some(left) = of_node.map(|(_, f)| f.drain_left) else { continue };
                    if let Err(e) = cluster.drain_progress(node, mark, left) {
                        tracing::warn!(event = "drain_progress_unwritten", node, error = %e);
                    }
                }
            }
            let (c, (placing, placing_dropped)) = (aggregator.counters, aggregator.summary.placing());
            if let Some(health) = &health {
                health.set(leading(&aggregator, &figures));
            }
            say(format!(
                "{{\"event\":\"summary\",\"connected\":{:?},\"applied\":{},\"snapshot_frames\":{},\"gaps\":{},\"copies_asked\":{},\"drain_copies_asked\":{},\"placements_asked\":{},\"placing\":{},\"placing_dropped\":{},\"spills\":{{\"placed\":{},\"unplaced\":{}}},\"shed\":{{\"over_cap\":{},\"no_hello\":{},\"accept_failed\":{}}},\"nodes\":{}}}",
                aggregator.connected(),
                c.applied,
                c.snapshot_frames,
                c.gaps,
                c.copies_asked,
                c.drain_copies_asked,
                c.placements_asked,
                placing,
                placing_dropped,
                c.spills_placed,
                c.spills_unplaced,
                c.over_cap,
                c.no_hello,
                c.accept_failed,
                nodes_json(&figures)
            ));
        }
    }
    if let Some(candidate) = candidate {
        let _ = candidate.resign();
    }
    Ok(())
}

/// The nodes' `figures` ([`lake_cp::summary::Summary::all_figures`]) as
/// the `summary` and `restored` lines give them.
pub(super) fn nodes_json(figures: &[(u32, lake_cp::summary::NodeFigures)]) -> String {
    let nodes: Vec<String> = figures
        .iter()
        .map(|(node, f)| {
            format!(
                "{{\"node\":{node},\"term\":{},\"sequence\":{},\"member\":{},\"gap\":{},\"draining\":{},\"drain_left\":{},\"takes_placements\":{},\"replicas\":{:?},\"available\":{:?}}}",
                f.term,
                f.sequence,
                f.member,
                f.gap,
                f.draining,
                f.drain_left,
                f.takes_placements,
                f.replicas,
                f.available
            )
        })
        .collect();
    format!("[{}]", nodes.join(","))
}

/// Campaigns every `every` until `candidate` leads (printing `standby`
/// events, then `elected`): its term, or `None` when a signal says stop.
pub(super) fn stand_by(
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
