//! `lake summary`'s exposition (its `--metrics` address): whether this
//! candidate leads, and, where it does, the cluster as its summary holds
//! it — each node's standing and replicas, the links, and what the
//! leader asked of the nodes.

use crate::metrics::{borrowed, metric};

use super::link::Aggregator;
use super::{AggregatorCounters, NodeFigures};

/// A node's figure, as a sample's value (of the node and its figures).
type Figure<'a> = &'a dyn Fn(u32, &NodeFigures) -> u64;

/// A counter: its name, its help, its samples (labels, value).
type Counter<'a> = (&'a str, &'a str, &'a [(&'a str, u64)]);

/// Whether this candidate leads the summary: every candidate serves it,
/// a standby `0` and nothing else.
fn leading(out: &mut String, leads: bool) {
    let help = "Whether this candidate leads the cluster summary (0: a standby of lake summary).";
    metric(out, "lake_summary_leading", "gauge", help, &[("", u64::from(leads))]);
}

/// A standby's exposition: it leads nothing, and holds nothing.
pub fn standby() -> String {
    let mut out = String::new();
    leading(&mut out, false);
    out
}

/// The leader's exposition, of its `term`, with its nodes' `figures`
/// ([`super::Summary::all_figures`]).
pub fn render(aggregator: &Aggregator, term: u64, figures: &[(u32, NodeFigures)]) -> String {
    let mut out = String::new();
    leading(&mut out, true);
    metric(&mut out, "lake_summary_term", "gauge", "The term this leader leads in.", &[("", term)]);
    nodes(&mut out, aggregator, figures);
    counters(&mut out, &aggregator.counters);
    out
}

/// Each node as the summary holds it: its standing, and its replicas.
fn nodes(out: &mut String, aggregator: &Aggregator, figures: &[(u32, NodeFigures)]) {
    let connected = aggregator.connected();
    let help = "Nodes whose link to this leader is up.";
    metric(out, "lake_summary_nodes_connected", "gauge", help, &[("", connected.len() as u64)]);
    let per_node = |value: Figure<'_>| -> Vec<(String, u64)> {
        figures.iter().map(|(node, f)| (format!("node=\"{node}\""), value(*node, f))).collect()
    };
    let gauges: [(&str, &str, Figure<'_>); 5] = [
        ("lake_summary_node_member", "Whether the node's membership in etcd stands (1) or lapsed (0).", &|_, f| {
            u64::from(f.member)
        }),
        ("lake_summary_node_connected", "Whether the node's link to this leader is up.", &|node, _| {
            u64::from(connected.contains(&node))
        }),
        ("lake_summary_node_gap", "Whether the node's view waits for its snapshot (a gap in its deltas).", &|_, f| {
            u64::from(f.gap)
        }),
        ("lake_summary_node_draining", "Whether the node is being drained.", &|_, f| u64::from(f.draining)),
        ("lake_summary_node_drain_left_blocks", "Of a draining node's blocks, those only it holds.", &|_, f| {
            f.drain_left
        }),
    ];
    for (name, help, value) in gauges {
        metric(out, name, "gauge", help, &borrowed(&per_node(value)));
    }
    let tiers = [lake_dp::Tier::L1Dram, lake_dp::Tier::L2Nvme, lake_dp::Tier::L3Object];
    let by_tier = |value: &dyn Fn(&NodeFigures, usize) -> u64| -> Vec<(String, u64)> {
        figures
            .iter()
            .flat_map(|(node, f)| {
                tiers.iter().map(move |&tier| {
                    (format!("node=\"{node}\",tier=\"{}\"", crate::admin::tier_name(tier)), value(f, tier as usize))
                })
            })
            .collect()
    };
    let help = "Replicas the node holds, by tier, as the summary has them.";
    metric(out, "lake_summary_node_replicas", "gauge", help, &borrowed(&by_tier(&|f, t| f.replicas[t])));
    let help = "Of the node's replicas, those offered to other nodes' readers (a lapsed node's L2 is not).";
    metric(out, "lake_summary_node_available_replicas", "gauge", help, &borrowed(&by_tier(&|f, t| f.available[t])));
}

/// What the leader applied, and asked of the nodes.
fn counters(out: &mut String, c: &AggregatorCounters) {
    let counters: [Counter<'_>; 10] = [
        ("lake_summary_deltas_applied_total", "Nodes' deltas applied.", &[("", c.applied)]),
        ("lake_summary_snapshot_frames_total", "Nodes' snapshot frames applied.", &[("", c.snapshot_frames)]),
        ("lake_summary_gaps_total", "Gaps found in a node's deltas (a snapshot asked for).", &[("", c.gaps)]),
        ("lake_summary_deltas_stale_total", "Nodes' deltas dropped as older than the summary.", &[("", c.stale)]),
        (
            "lake_summary_copies_asked_total",
            "Copies asked of nodes, by why: hot prefixes replicated, drains, placements in homes, spills placed in a member with room.",
            &[
                ("why=\"replicate\"", c.copies_asked),
                ("why=\"drain\"", c.drain_copies_asked),
                ("why=\"place\"", c.placements_asked),
                ("why=\"spill\"", c.spills_placed),
            ],
        ),
        ("lake_summary_spills_unplaced_total", "Spills no member had room for.", &[("", c.spills_unplaced)]),
        (
            "lake_summary_copies_kept_apart_total",
            "Copies not asked: the block's holder keeps its namespace apart, and the target does not keep it apart for the same tenant.",
            &[("", c.copies_kept_apart)],
        ),
        (
            "lake_summary_pulls_total",
            "Engines' pulls: relayed to the block's holder, or held by no member that offers it.",
            &[("result=\"relayed\"", c.pulls_relayed), ("result=\"unheld\"", c.pulls_unheld)],
        ),
        (
            "lake_summary_connections_closed_total",
            "Node connections closed, by why: a bad frame, failed authentication, over --connections-max, no hello in time.",
            &[
                ("why=\"bad_frame\"", c.bad_frames),
                ("why=\"refused\"", c.refused),
                ("why=\"over_cap\"", c.over_cap),
                ("why=\"no_hello\"", c.no_hello),
            ],
        ),
        (
            "lake_summary_view_frames_total",
            "Cluster view frames sent to nodes: deltas, snapshots, and deltas skipped for a node too far behind.",
            &[
                ("kind=\"delta\"", c.view_deltas),
                ("kind=\"snapshot\"", c.view_snapshots),
                ("kind=\"skipped\"", c.view_skipped),
            ],
        ),
    ];
    for (name, help, samples) in counters {
        metric(out, name, "counter", help, samples);
    }
}
