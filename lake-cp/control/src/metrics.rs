//! The Prometheus text endpoint: `GET /metrics` on a TCP port, served from
//! the same event loop as the protocol (no thread of its own). One request
//! per connection; `GET /healthz` says the loop runs, `GET /readyz`
//! whether a data plane has registered its L1 with this node (503 and
//! why, until then); anything else gets 404, a request larger
//! than 8 KiB or slower than the loop's patience is dropped.

use std::fmt::Write as _;

use crate::node::Node;
use crate::server::{ConnectionCaps, Listener, ServerCounters};

/// The server's listeners as they stand, beside its counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServerGauges {
    /// Each listener's cap.
    pub caps: ConnectionCaps,
    /// Connections open on each, in [`Listener::ALL`]'s order.
    pub open: [usize; 3],
    /// The cluster view, where the node keeps one.
    pub view: Option<ViewGauges>,
}

/// The node's cluster view, for metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct ViewGauges {
    /// Other nodes' blocks in it.
    pub blocks: u64,
    /// Other nodes it names.
    pub nodes: u64,
    /// Delta frames and snapshots applied, gaps seen, entries it could
    /// not take.
    pub deltas: u64,
    /// See `deltas`.
    pub snapshots: u64,
    /// See `deltas`.
    pub gaps: u64,
    /// See `deltas`.
    pub refused: u64,
    /// Entries of no known namespace, shown in no view of a node keeping
    /// tenants apart.
    pub unnamed: u64,
    /// Engines' pulls sent to the summary's leader, and dropped (no
    /// leader streaming the view connected).
    pub pulls_sent: u64,
    /// See `pulls_sent`.
    pub pulls_dropped: u64,
    /// Pulls of blocks other nodes hold only in L3 read from this node's
    /// own object store, and those it did not have (then sent to the
    /// leader).
    pub pulls_from_store: u64,
    /// See `pulls_from_store`.
    pub pulls_from_store_failed: u64,
    /// Pulls refused: of a namespace not the asking engine's tenant's.
    pub pulls_refused: u64,
    /// What a pulled block costs this node, as measured (0: not yet).
    pub pull_ns_per_block: u64,
}

/// Bytes of request a client may send before it is dropped.
pub const REQUEST_BYTES_MAX: usize = 8 << 10;

/// What a request gets: the whole response. `ready` answers `GET
/// /readyz`: whether the node can serve engines now (why not, if not).
pub fn respond(
    request: &[u8],
    body: impl FnOnce() -> String,
    ready: impl FnOnce() -> Result<(), String>,
) -> Option<Vec<u8>> {
    let end = request.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&request[..end]).ok();
    let line = head.and_then(|h| h.lines().next()).unwrap_or("");
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let (status, content_type, body) = if method == "GET" && (path == "/metrics" || path.starts_with("/metrics?")) {
        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body())
    } else if method == "GET" && path == "/healthz" {
        ("200 OK", "text/plain; charset=utf-8", "ok\n".to_owned())
    } else if method == "GET" && path == "/readyz" {
        match ready() {
            Ok(()) => ("200 OK", "text/plain; charset=utf-8", "ready\n".to_owned()),
            Err(why) => ("503 Service Unavailable", "text/plain; charset=utf-8", format!("not ready: {why}\n")),
        }
    } else {
        ("404 Not Found", "text/plain; charset=utf-8", "only GET /metrics, /healthz and /readyz\n".to_owned())
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    out.push_str(&body);
    Some(out.into_bytes())
}

/// One metric in the Prometheus text format: its help, type and samples
/// (labels, value).
pub(crate) fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}

/// Samples with labels made at run time, as `metric` takes them.
pub(crate) fn borrowed(samples: &[(String, u64)]) -> Vec<(&str, u64)> {
    samples.iter().map(|(labels, value)| (labels.as_str(), *value)).collect()
}

/// Whether this control plane leads its node: `lake cp`'s candidates
/// serve one each, a standby's `0` (and nothing else).
fn leading(out: &mut String, leads: bool) {
    let help = "Whether this control plane leads its node (0: a standby of lake cp).";
    metric(out, "lake_cp_leading", "gauge", help, &[("", u64::from(leads))]);
}

/// A standby's exposition: it leads nothing, and holds nothing.
pub fn standby() -> String {
    let mut out = String::new();
    leading(&mut out, false);
    out
}

/// The exposition of the node and the server.
pub fn render(node: &Node, server: &ServerCounters, gauges: &ServerGauges) -> String {
    let mut out = String::new();
    leading(&mut out, true);
    connection_metrics(&mut out, server, gauges);
    if let Some(view) = &gauges.view {
        view_metrics(&mut out, view);
    }
    let c = node.counters;
    metric(
        &mut out,
        "lake_cp_blocks",
        "gauge",
        "Blocks in the radix index.",
        &[("", node.locations.index.len() as u64)],
    );
    metric(
        &mut out,
        "lake_cp_replica_reports_total",
        "counter",
        "Replica reports from lake-dp, by kind.",
        &[("kind=\"committed\"", c.committed), ("kind=\"readopted\"", c.readopted), ("kind=\"evicted\"", c.evicted)],
    );
    metric(
        &mut out,
        "lake_cp_reports_refused_total",
        "counter",
        "Reports refused (stale epoch, unknown region, ...).",
        &[("", c.refused)],
    );
    metric(&mut out, "lake_cp_regions_registered_total", "counter", "Region registrations.", &[("", c.regions)]);
    metric(
        &mut out,
        "lake_node_draining",
        "gauge",
        "1 while an operator drains this node (lake drain-node): /readyz answers not ready.",
        &[("", u64::from(node.draining))],
    );
    metric(
        &mut out,
        "lake_copies_to_nodes_total",
        "counter",
        "Copies of this node's blocks into other nodes' L1 (replication, drains), by how they ended.",
        &[
            ("result=\"landed\"", node.copies_landed),
            ("result=\"failed\"", node.copies_failed),
            ("result=\"cancelled\"", node.copies_cancelled),
        ],
    );
    metric(
        &mut out,
        "lake_copies_asked_again_total",
        "counter",
        "Copies into other nodes asked of the data plane again: every send it has was taken.",
        &[("", node.copies_asked_again)],
    );
    metric(
        &mut out,
        "lake_blocks_placed_away_total",
        "counter",
        "Blocks saved here that the pool placed in their home node: this node's copy became a copy, first to go.",
        &[("", node.placed_away)],
    );
    metric(
        &mut out,
        "lake_blocks_moved_to_readers_total",
        "counter",
        "Blocks another node pulled, where pulls move blocks: the reader's copy became the pool's, this node's a copy, first to go.",
        &[("", node.moved_to_readers)],
    );
    metric(
        &mut out,
        "lake_pulled_blocks_kept_total",
        "counter",
        "Blocks another node pulled that two or more chains here continue (a shared prefix, every block of it), where pulls move blocks: copied to the reader, this node's kept.",
        &[("", node.shared.kept)],
    );
    metric(
        &mut out,
        "lake_copy_promotions_total",
        "counter",
        "Blocks held here only in L2 promoted into L1 to be copied to another node (a drain).",
        &[("", node.copy_promotions)],
    );
    metric(
        &mut out,
        "lake_cp_blocks_waiting",
        "gauge",
        "Reported blocks waiting for their parent.",
        &[("", node.waiting() as u64)],
    );
    metric(
        &mut out,
        "lake_cp_mirror_skipped_total",
        "counter",
        "Mirror updates not written.",
        &[("", c.mirror_skipped)],
    );
    if let Some(mirror) = node.mirror() {
        metric(
            &mut out,
            "lake_cp_mirror_entries",
            "gauge",
            "Live entries in the shared-memory mirror.",
            &[("", mirror.live())],
        );
        metric(
            &mut out,
            "lake_cp_mirror_max_probe",
            "gauge",
            "Longest probe a mirror entry needs.",
            &[("", u64::from(mirror.max_probe()))],
        );
    }
    tier_metrics(&mut out, node);
    metric(&mut out, "lake_cp_lookups_total", "counter", "Lookups agents reported.", &[("", c.accesses)]);
    metric(
        &mut out,
        "lake_cp_lookup_blocks_total",
        "counter",
        "Blocks looked up, by outcome.",
        &[("result=\"hit\"", c.hit_blocks), ("result=\"miss\"", c.requested_blocks.saturating_sub(c.hit_blocks))],
    );
    metric(&mut out, "lake_cp_leases", "gauge", "Leases held now.", &[("", node.leases.len() as u64)]);
    metric(
        &mut out,
        "lake_l0_blocks",
        "gauge",
        "Blocks engines report holding in their own GPU memory (advisory L0).",
        &[("", node.l0.blocks() as u64)],
    );
    metric(&mut out, "lake_l0_engines", "gauge", "Engines reporting L0 blocks.", &[("", node.l0.engines() as u64)]);
    metric(&mut out, "lake_l0_reports_total", "counter", "L0 reports applied.", &[("", node.l0.reports)]);
    metric(
        &mut out,
        "lake_l0_refused_keys_total",
        "counter",
        "L0 keys refused: an engine reported more than its bound.",
        &[("", node.l0.refused)],
    );
    metric(
        &mut out,
        "lake_cp_leases_total",
        "counter",
        "Leases granted, and ended at their deadline.",
        &[("event=\"granted\"", node.leases.granted), ("event=\"expired\"", node.leases.expired)],
    );
    if let Some(dp) = &node.data_plane {
        data_plane_metrics(&mut out, dp);
    }
    if let Some(shed) = &node.connections_shed {
        let samples = [
            ("listener=\"attach\",why=\"stranger\"", shed.attach_strangers),
            ("listener=\"attach\",why=\"timed_out\"", shed.attach_hello_timeouts),
            ("listener=\"attach\",why=\"crowded_out\"", shed.attach_crowded_out),
            ("listener=\"attach\",why=\"user_ports_full\"", shed.attach_user_ports_full),
            ("listener=\"transport\",why=\"over_cap\"", shed.transport_over_cap),
            ("listener=\"transport\",why=\"timed_out\"", shed.transport_silent),
            ("listener=\"transport\",why=\"accept_failed\"", shed.transport_accept_failed),
        ];
        metric(
            &mut out,
            "lake_dp_connections_shed_total",
            "counter",
            "Connections the data plane's listeners let go: on the attach socket, strangers, no hello in time, \
             crowded out while waiting for their hello, their user holding its ports; on the transport, over its \
             cap, silent, not accepted for want of descriptors.",
            &samples,
        );
    }
    if let Some(r) = &node.save_refusals {
        metric(
            &mut out,
            "lake_dp_saves_refused_total",
            "counter",
            "Saves the data plane refused, by reason: no_space (L1 full of blocks it could not let go of in time), \
             load_reserve (only the load reserve free), stopping, over_quota (its namespace or tenant at its L1 \
             quota).",
            &[
                ("reason=\"no_space\"", r.no_space),
                ("reason=\"load_reserve\"", r.load_reserve),
                ("reason=\"stopping\"", r.stopping),
                ("reason=\"over_quota\"", r.over_quota),
            ],
        );
    }
    rail_metrics(&mut out, &node.rails, &node.engine_rails);
    tenant_throttle_metrics(&mut out, &node.tenant_throttles);
    path_metrics(&mut out, &node.all_paths());
    metric(
        &mut out,
        "lake_cp_connections_accepted_total",
        "counter",
        "lake-dp connections accepted.",
        &[("", server.accepted)],
    );
    metric(
        &mut out,
        "lake_cp_connections_closed_total",
        "counter",
        "lake-dp connections closed.",
        &[("", server.closed)],
    );
    metric(&mut out, "lake_cp_frames_total", "counter", "Frames applied.", &[("", server.frames)]);
    metric(
        &mut out,
        "lake_cp_bad_frames_total",
        "counter",
        "Connections closed for a malformed frame.",
        &[("", server.bad_frames)],
    );
    build_and_process(&mut out);
    out
}

/// The cluster view this node keeps, and its engines' pulls.
fn view_metrics(out: &mut String, view: &ViewGauges) {
    metric(
        out,
        "lake_cluster_view_blocks",
        "gauge",
        "Other nodes' blocks in this node's cluster view.",
        &[("", view.blocks)],
    );
    metric(
        out,
        "lake_cluster_view_nodes",
        "gauge",
        "Other nodes holding blocks in the cluster view.",
        &[("", view.nodes)],
    );
    metric(
        out,
        "lake_cluster_view_frames_total",
        "counter",
        "Cluster view frames from the summary's leader applied: deltas, and snapshots (each whole).",
        &[("kind=\"delta\"", view.deltas), ("kind=\"snapshot\"", view.snapshots)],
    );
    metric(
        out,
        "lake_cluster_view_gaps_total",
        "counter",
        "Gaps seen in the view stream (a snapshot asked for).",
        &[("", view.gaps)],
    );
    metric(
        out,
        "lake_cluster_view_refused_total",
        "counter",
        "View entries not taken (the view full, or naming 1,024 other nodes already): those blocks read as misses.",
        &[("", view.refused)],
    );
    metric(
        out,
        "lake_cluster_view_unnamed_total",
        "counter",
        "View entries of no known namespace (from a node or leader built before namespaces reached the view): a node \
         keeping tenants apart shows them in no view, so those blocks read as misses.",
        &[("", view.unnamed)],
    );
    metric(
        out,
        "lake_cluster_pulls_total",
        "counter",
        "Engines' pulls of other nodes' blocks into this node's L1: sent to the summary's leader, or dropped (none \
         streaming the view connected); of blocks held only in L3, read from the object store the nodes share \
         (store), or not found there and sent to the leader (store_failed); refused, of a namespace not the asking \
         engine's tenant's (refused).",
        &[
            ("result=\"sent\"", view.pulls_sent),
            ("result=\"dropped\"", view.pulls_dropped),
            ("result=\"store\"", view.pulls_from_store),
            ("result=\"store_failed\"", view.pulls_from_store_failed),
            ("result=\"refused\"", view.pulls_refused),
        ],
    );
    metric(
        out,
        "lake_cluster_pull_ns_per_block",
        "gauge",
        "What a block pulled here costs, as measured: a batch's time from its ask to its last block landing, over \
         its blocks (a moving average; 0: none measured yet). `lake route` weighs pulls to this node by it.",
        &[("", view.pull_ns_per_block)],
    );
}

/// Each listener's connections: open, its cap, and those let go by why.
fn connection_metrics(out: &mut String, server: &ServerCounters, gauges: &ServerGauges) {
    let label = |listener: Listener| format!("listener=\"{}\"", listener.name());
    let open: Vec<(String, u64)> = Listener::ALL.iter().map(|&l| (label(l), gauges.open[l as usize] as u64)).collect();
    metric(out, "lake_connections_open", "gauge", "Connections open, by listener.", &as_refs(&open));
    let caps: Vec<(String, u64)> = Listener::ALL.iter().map(|&l| (label(l), gauges.caps.of(l) as u64)).collect();
    metric(out, "lake_connections_max", "gauge", "Connections a listener holds at most.", &as_refs(&caps));
    let mut shed = Vec::new();
    for listener in Listener::ALL {
        let counts = server.shed[listener as usize];
        let why =
            [("over_cap", counts.over_cap), ("timed_out", counts.timed_out), ("accept_failed", counts.accept_failed)];
        for (why, count) in why {
            shed.push((format!("{},why=\"{why}\"", label(listener)), count));
        }
    }
    metric(
        out,
        "lake_connections_shed_total",
        "counter",
        "Connections let go: accepted past the cap, timed out (no hello, no request, idle), or not accepted for \
         want of file descriptors (the listener rests a moment).",
        &as_refs(&shed),
    );
}

/// `lake_build_info` and the standard `process_*` metrics (from
/// `/proc/self`), which dashboards and alerts expect of every exporter.
fn build_and_process(out: &mut String) {
    let _ = writeln!(out, "# HELP lake_build_info The build serving: its version. Always 1.");
    let _ = writeln!(out, "# TYPE lake_build_info gauge");
    let _ = writeln!(out, "lake_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    // SAFETY: as above.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let (page, ticks) = (u64::try_from(page).unwrap_or(4096), u64::try_from(ticks).unwrap_or(100).max(1));
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let mut pages = statm.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
    let (virtual_pages, resident_pages) = (pages.next().unwrap_or(0), pages.next().unwrap_or(0));
    // /proc/self/stat: the fields after the command's closing parenthesis,
    // from the third (state): utime is the 14th, stime the 15th, starttime
    // the 22nd.
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<u64> =
        stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().map(|v| v.parse().unwrap_or(0)).collect();
    let field = |n: usize| fields.get(n - 3).copied().unwrap_or(0);
    let boot = std::fs::read_to_string("/proc/stat")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("btime ").and_then(|v| v.trim().parse::<u64>().ok()))
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a valid out-pointer.
    let max_fds = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } == 0 { limit.rlim_cur } else { 0 };
    #[allow(clippy::cast_precision_loss)] // seconds of CPU and since the epoch, as Prometheus takes them
    let (cpu, start) = ((field(14) + field(15)) as f64 / ticks as f64, boot as f64 + field(22) as f64 / ticks as f64);
    let gauges = [
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            (resident_pages * page).to_string(),
        ),
        ("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", (virtual_pages * page).to_string()),
        ("process_cpu_seconds_total", "counter", "User and system CPU time spent in seconds.", format!("{cpu:.2}")),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since the Unix epoch in seconds.",
            format!("{start:.2}"),
        ),
        ("process_open_fds", "gauge", "Open file descriptors.", fds.to_string()),
        ("process_max_fds", "gauge", "Maximum open file descriptors.", max_fds.to_string()),
    ];
    for (name, kind, help, value) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
}

fn as_refs(samples: &[(String, u64)]) -> Vec<(&str, u64)> {
    samples.iter().map(|(label, value)| (label.as_str(), *value)).collect()
}

fn tier_metrics(out: &mut String, node: &Node) {
    use lake_dp::Tier;
    let tiers = [("L1", Tier::L1Dram), ("L2", Tier::L2Nvme), ("L3", Tier::L3Object)];
    let usage: Vec<(String, crate::tier::TierUsage)> =
        tiers.iter().map(|(name, tier)| (format!("tier=\"{name}\""), node.tiers.usage(*tier))).collect();
    let samples = |f: fn(&crate::tier::TierUsage) -> u64| -> Vec<(String, u64)> {
        usage.iter().map(|(label, u)| (label.clone(), f(u))).collect()
    };
    let bytes = samples(|u| u.bytes);
    metric(out, "lake_tier_bytes", "gauge", "Bytes held per tier (slots in use).", &as_refs(&bytes));
    let blocks = samples(|u| u.blocks);
    metric(out, "lake_tier_blocks", "gauge", "Blocks held per tier.", &as_refs(&blocks));
    let capacity = samples(|u| u.capacity_bytes);
    metric(out, "lake_tier_capacity_bytes", "gauge", "Bytes each tier is kept under.", &as_refs(&capacity));
    let t = node.tiers.counters;
    metric(
        out,
        "lake_tier_moves_total",
        "counter",
        "Tier moves asked of the data plane.",
        &[
            ("move=\"demote_l1_l2\"", t.demotions),
            ("move=\"clean_l1_l2\"", t.cleanings),
            ("move=\"drop_l1\"", t.drops[Tier::L1Dram as usize]),
            ("move=\"drop_l2\"", t.drops[Tier::L2Nvme as usize]),
            ("move=\"move_to_l3\"", t.l3_moves),
            ("move=\"copy_to_l3\"", t.l3_copies),
            ("move=\"delete_l3\"", t.drops[Tier::L3Object as usize]),
            ("move=\"drain_move_l2\"", t.drain_moves),
            ("move=\"drain_drop_l2\"", t.drain_drops),
        ],
    );
    metric(
        out,
        "lake_l1_victims_total",
        "counter",
        "L1 victims chosen ahead of demand: marked evictable (with a copy below, or to be dropped), marks taken back, \
         victims taken back because a new block continued them, and those a save or load took on the spot.",
        &[
            ("event=\"marked_clean\"", t.marked_clean),
            ("event=\"marked_drop\"", t.marked_drop),
            ("event=\"unmarked\"", t.unmarked),
            ("event=\"continued\"", t.victims_continued),
            ("event=\"taken_clean\"", t.taken_clean),
            ("event=\"taken_dropped\"", t.taken_dropped),
        ],
    );
    metric(
        out,
        "lake_l1_spills_total",
        "counter",
        "L1 victims with no room below offered to the pool rather than dropped: offered, placed in another member \
         (this node's copy then goes), and not placed (dropped).",
        &[
            ("event=\"offered\"", t.spills),
            ("event=\"landed\"", t.spills_landed),
            ("event=\"unplaced\"", t.spills_unplaced),
        ],
    );
    metric(
        out,
        "lake_tier_placed_away_waiting",
        "gauge",
        "Copies of blocks the pool keeps on another node, still held here: each goes once it is a leaf here and no \
         engine reads it.",
        &[("", node.tiers.placed_away_waiting() as u64)],
    );
    let drains = node.tiers.drains();
    let left: Vec<(String, u64)> = drains.iter().map(|d| (format!("region=\"{}\"", d.region), d.blocks_left)).collect();
    metric(
        out,
        "lake_drain_blocks_left",
        "gauge",
        "Blocks an L2 region being drained still holds (0 and done: it may be taken away).",
        &borrowed(&left),
    );
    metric(
        out,
        "lake_tier_admission_refused_total",
        "counter",
        "L1 victims dropped because L2's policy would not admit them.",
        &[("", t.admission_refused)],
    );
    metric(
        out,
        "lake_tier_l2_filtered_total",
        "counter",
        "L1 victims dropped, not written to L2, because the second-access filter had not seen them twice.",
        &[("", t.l2_filtered)],
    );
    metric(
        out,
        "lake_tier_tenant_quota_evictions_total",
        "counter",
        "Blocks asked out of a tier because their tenant was over its quota there.",
        &[("", t.tenant_quota_evictions)],
    );
    metric(
        out,
        "lake_tier_leased_kept_total",
        "counter",
        "Eviction candidates passed over because a lease held them.",
        &[("", t.leased_kept)],
    );
    metric(
        out,
        "lake_tier_commands_failed_total",
        "counter",
        "Tier commands that failed or timed out.",
        &[("", t.failed)],
    );
    let mut why: Vec<(String, u64)> = lake_dp::wire::message::ErrorCode::ALL
        .iter()
        .map(|&code| (format!("why=\"refused_{}\"", code.name()), t.refused[code as usize]))
        .filter(|&(_, n)| n > 0)
        .collect();
    if t.refused[0] > 0 {
        why.push(("why=\"refused_unknown\"".to_owned(), t.refused[0]));
    }
    why.extend([
        ("why=\"timed_out\"".to_owned(), t.timed_out),
        ("why=\"link_lost\"".to_owned(), t.link_lost),
        ("why=\"unrouted\"".to_owned(), t.unrouted),
    ]);
    metric(
        out,
        "lake_tier_commands_failures_total",
        "counter",
        "Tier commands that failed, by why: refused by the data plane (by error code), timed out, in flight when its link closed, never sent.",
        &borrowed(&why),
    );
    let tenants = node.tiers.tenant_usage();
    let tier_name = |t: Tier| match t {
        Tier::L0Hbm => "l0",
        Tier::L1Dram => "l1",
        Tier::L2Nvme => "l2",
        Tier::L3Object => "l3",
    };
    let used: Vec<(String, u64)> = tenants
        .iter()
        .map(|&(name, tier, used, _)| (format!("tenant=\"{}\",tier=\"{}\"", label(name), tier_name(tier)), used))
        .collect();
    let quota: Vec<(String, u64)> = tenants
        .iter()
        .map(|&(name, tier, _, q)| (format!("tenant=\"{}\",tier=\"{}\"", label(name), tier_name(tier)), q))
        .collect();
    metric(out, "lake_tenant_bytes", "gauge", "Bytes a tenant's namespaces hold in a tier.", &borrowed(&used));
    metric(out, "lake_tenant_quota_bytes", "gauge", "A tenant's quota in a tier.", &borrowed(&quota));
    metric(
        out,
        "lake_tier_commands_pending",
        "gauge",
        "Tier commands in flight.",
        &[("", node.tiers.pending() as u64)],
    );
}

/// `text` as a Prometheus label value (backslash, quote and newline
/// escaped).
fn label(text: &str) -> String {
    text.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// How often each capped tenant's work waited for its caps, by path (the
/// data plane's counts since it started).
fn tenant_throttle_metrics(out: &mut String, tenants: &[lake_dp::wire::message::TenantWait]) {
    if tenants.is_empty() {
        return;
    }
    let name = "lake_tenant_throttled_total";
    let _ = writeln!(
        out,
        "# HELP {name} Times a capped tenant's work waited for its bandwidth cap, by path (L2 and L3 reads and writes, sends to other nodes, blocks received from them)."
    );
    let _ = writeln!(out, "# TYPE {name} counter");
    for tenant in tenants {
        for (path, waits) in lake_dp::rates::RATE_PATH_NAMES.iter().zip(tenant.waits) {
            let _ = writeln!(out, "{name}{{tenant=\"{}\",path=\"{path}\"}} {waits}", label(tenant.name()));
        }
    }
}

/// Per-path (the data plane's, then the engines') latency histograms, as Prometheus histograms
/// in seconds (`le` the bucket bounds, cumulative; `_count` is how often
/// the path was taken).
#[allow(clippy::cast_precision_loss)] // bounds below 2^21 µs; a sum past 2^52 µs (142 years) may round
fn path_metrics(out: &mut String, paths: &[lake_dp::wire::message::PathEntry]) {
    if paths.is_empty() {
        return;
    }
    let name = "lake_path_latency_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} How long operations took, by the path their bytes took (the data plane's L2 reads a request waits on, other L2 reads, L2 writes, transfers to other nodes, L3 reads and writes; the engines' own reads of L1 hits and loads from L2 and L3, as their agents saw them)."
    );
    let _ = writeln!(out, "# TYPE {name} histogram");
    for entry in paths {
        let Some(path) = entry.path() else { continue };
        let path = path.name();
        let mut cumulative = 0;
        for (i, count) in entry.buckets.iter().enumerate() {
            cumulative += count;
            let le = (1u64 << i) as f64 / 1e6;
            let _ = writeln!(out, "{name}_bucket{{path=\"{path}\",le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{path=\"{path}\",le=\"+Inf\"}} {}", entry.count);
        let _ = writeln!(out, "{name}_sum{{path=\"{path}\"}} {}", entry.sum_us as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{{path=\"{path}\"}} {}", entry.count);
    }
}

/// Each rail's bytes, breaks and state, labelled by network (storage:
/// `lake-dp`'s transport; compute: an engine agent's), sender (`dp`, or
/// the engine's connection number), peer and rail. A data plane's peers
/// are nodes; an engine's are numbered in the order it first pushed to
/// them.
fn rail_metrics(
    out: &mut String,
    rails: &[(lake_dp::wire::message::Network, Vec<lake_dp::wire::message::RailEntry>)],
    engines: &[(u64, Vec<lake_dp::wire::message::RailEntry>)],
) {
    use lake_dp::wire::message::Network;
    if rails.is_empty() && engines.is_empty() {
        return;
    }
    let senders: Vec<(Network, String, &Vec<lake_dp::wire::message::RailEntry>)> = rails
        .iter()
        .map(|(network, entries)| (*network, "dp".to_owned(), entries))
        .chain(engines.iter().map(|(peer, entries)| (Network::Compute, format!("engine-{peer}"), entries)))
        .collect();
    let labelled = |value: fn(&lake_dp::wire::message::RailEntry) -> u64| -> Vec<(String, u64)> {
        senders
            .iter()
            .flat_map(|(network, sender, entries)| {
                entries.iter().map(move |e| {
                    let labels = format!(
                        "network=\"{}\",sender=\"{sender}\",node=\"{}\",rail=\"{}\"",
                        network.name(),
                        e.node,
                        e.rail
                    );
                    (labels, value(e))
                })
            })
            .collect()
    };
    let emit = |out: &mut String, name: &str, kind: &str, help: &str, samples: Vec<(String, u64)>| {
        let borrowed: Vec<(&str, u64)> = samples.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        metric(out, name, kind, help, &borrowed);
    };
    emit(out, "lake_rail_bytes_total", "counter", "Bytes written on each rail to each peer.", labelled(|e| e.bytes));
    emit(
        out,
        "lake_rail_breaks_total",
        "counter",
        "Times a rail was set aside after a connection on it broke.",
        labelled(|e| e.breaks),
    );
    emit(
        out,
        "lake_rail_up",
        "gauge",
        "1 while a rail takes new slices, 0 while it cools down.",
        labelled(|e| u64::from(e.up)),
    );
}

fn data_plane_metrics(out: &mut String, dp: &lake_dp::wire::message::DataPlaneStats) {
    let _ = writeln!(out, "# HELP lake_dp_poller_seconds_total Poll-loop time by state.");
    let _ = writeln!(out, "# TYPE lake_dp_poller_seconds_total counter");
    for (state, ns) in [("busy", dp.busy_ns), ("idle", dp.idle_ns), ("parked", dp.parked_ns)] {
        #[allow(clippy::cast_precision_loss)] // seconds to the microsecond, as Prometheus takes them
        let seconds = ns as f64 / 1e9;
        let _ = writeln!(out, "lake_dp_poller_seconds_total{{state=\"{state}\"}} {seconds:.6}");
    }
    metric(
        out,
        "lake_dp_path_bytes_total",
        "counter",
        "Bytes moved per path.",
        &[("path=\"l1_to_l2\"", dp.bytes_l1_to_l2), ("path=\"l2_to_l1\"", dp.bytes_l2_to_l1)],
    );
    metric(
        out,
        "lake_dp_blocks_total",
        "counter",
        "Blocks handled by the data plane, by event.",
        &[
            ("event=\"saved\"", dp.saves),
            ("event=\"save_refused\"", dp.saves_refused),
            ("event=\"commit_corrupt\"", dp.commits_corrupt),
            ("event=\"promoted\"", dp.promotions),
            ("event=\"demoted\"", dp.demotions),
            ("event=\"evicted\"", dp.evictions),
        ],
    );
    metric(out, "lake_dp_pins", "gauge", "Pins agents hold on L1 slots.", &[("", u64::from(dp.pins))]);
    metric(out, "lake_dp_slots_draining", "gauge", "Retired L1 slots still pinned.", &[("", u64::from(dp.draining))]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_get_requests_for_known_paths_are_answered() {
        let ready = || Ok(());
        assert_eq!(respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n", String::new, ready), None, "not whole yet");
        let ok = String::from_utf8(respond(b"GET /metrics HTTP/1.1\r\n\r\n", || "a 1\n".to_owned(), ready).unwrap())
            .unwrap();
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\na 1\n"), "{ok}");
        assert!(ok.contains("Content-Length: 4\r\n"));
        let missing =
            String::from_utf8(respond(b"POST /metrics HTTP/1.1\r\n\r\n", String::new, ready).unwrap()).unwrap();
        assert!(missing.starts_with("HTTP/1.1 404"));
        let junk = String::from_utf8(respond(b"\xff\xfe\r\n\r\n", String::new, ready).unwrap()).unwrap();
        assert!(junk.starts_with("HTTP/1.1 404"));
        let waiting = || Err("no L1 yet".to_owned());
        let not = String::from_utf8(respond(b"GET /readyz HTTP/1.1\r\n\r\n", String::new, waiting).unwrap()).unwrap();
        assert!(not.starts_with("HTTP/1.1 503") && not.ends_with("not ready: no L1 yet\n"), "{not}");
    }

    #[test]
    fn the_exposition_is_prometheus_text() {
        let node = Node::new(lake_dp::NodeId(0), 1, None);
        let text = render(&node, &ServerCounters::default(), &ServerGauges::default());
        for line in text.lines() {
            let name = line.trim_start_matches("# HELP ").trim_start_matches("# TYPE ");
            assert!(name.starts_with("lake_") || name.starts_with("process_"), "{line}");
        }
        assert!(text.contains(&format!("lake_build_info{{version=\"{}\"}} 1\n", env!("CARGO_PKG_VERSION"))));
        assert!(!text.contains("process_resident_memory_bytes 0\n"), "read from /proc/self");
        assert!(text.contains("lake_cp_replica_reports_total{kind=\"committed\"} 0\n"));
        assert!(!text.contains("lake_rail_"), "no rails reported, none shown");
    }

    #[test]
    fn each_path_is_a_histogram_counting_how_often_it_was_taken() {
        use lake_dp::wire::message::{Path, PathEntry};
        let mut node = Node::new(lake_dp::NodeId(0), 1, None);
        let mut critical = PathEntry::new(Path::L2ReadCritical);
        for ns in [800, 3_000, 3_500, 900_000, 5_000_000_000] {
            critical.record(ns);
        }
        node.paths = vec![critical, PathEntry::new(Path::L2Write)];
        let text = render(&node, &ServerCounters::default(), &ServerGauges::default());
        for line in [
            "# TYPE lake_path_latency_seconds histogram",
            // 800 ns is within 1 µs; 3 and 3.5 µs within 4 µs; 900 µs
            // within 1.024 ms; 5 s past every bound.
            "lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"0.000001\"} 1",
            "lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"0.000002\"} 1",
            "lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"0.000004\"} 3",
            "lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"0.001024\"} 4",
            "lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"1.048576\"} 4",
            "lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"+Inf\"} 5",
            "lake_path_latency_seconds_count{path=\"l2_read_critical\"} 5",
            "lake_path_latency_seconds_count{path=\"l2_write\"} 0",
        ] {
            assert!(text.contains(&format!("{line}\n")), "{line} not in:\n{text}");
        }
    }

    #[test]
    fn each_rail_of_each_network_is_its_own_series() {
        use lake_dp::wire::message::{Network, RailEntry};
        let mut node = Node::new(lake_dp::NodeId(0), 1, None);
        let rail = |node, rail, up, bytes, breaks| RailEntry { node, rail, up, reserved: 0, bytes, breaks };
        node.rails.push((Network::Storage, vec![rail(2, 0, 1, 1000, 0), rail(2, 1, 0, 500, 3)]));
        node.rails.push((Network::Compute, vec![rail(3, 0, 1, 7, 0)]));
        // Two engines' compute rails: each its own series.
        node.engine_rails.push((5, vec![rail(0, 0, 1, 64, 0), rail(0, 1, 1, 32, 1)]));
        node.engine_rails.push((6, vec![rail(0, 0, 0, 9, 2)]));
        let text = render(&node, &ServerCounters::default(), &ServerGauges::default());
        for line in [
            "lake_rail_bytes_total{network=\"storage\",sender=\"dp\",node=\"2\",rail=\"0\"} 1000",
            "lake_rail_bytes_total{network=\"storage\",sender=\"dp\",node=\"2\",rail=\"1\"} 500",
            "lake_rail_bytes_total{network=\"compute\",sender=\"dp\",node=\"3\",rail=\"0\"} 7",
            "lake_rail_breaks_total{network=\"storage\",sender=\"dp\",node=\"2\",rail=\"1\"} 3",
            "lake_rail_up{network=\"storage\",sender=\"dp\",node=\"2\",rail=\"1\"} 0",
            "lake_rail_bytes_total{network=\"compute\",sender=\"engine-5\",node=\"0\",rail=\"1\"} 32",
            "lake_rail_breaks_total{network=\"compute\",sender=\"engine-5\",node=\"0\",rail=\"1\"} 1",
            "lake_rail_up{network=\"compute\",sender=\"engine-6\",node=\"0\",rail=\"0\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
    }
}
