use super::link::{Aggregator, Uplink, deltas, snapshot};
use super::*;
use crate::location::Locations;
use lake_dp::NodeId;
use lake_dp::wire::message::{NamedViewEntry, ViewEntry};
use std::time::Duration;

pub(super) fn key(i: u8) -> BlockKey {
    BlockKey([i; 16])
}

/// Node `node`'s location view with an L1 (region 0), an L2 (1) and an L3
/// (9) region, under control-plane term `term`.
pub(super) fn view(node: u32, term: u64) -> Locations {
    let mut locations = Locations::new(term);
    for (region, tier) in [(0, Tier::L1Dram), (1, Tier::L2Nvme), (9, Tier::L3Object)] {
        locations.register_region(region, tier, NodeId(node), 5).unwrap();
    }
    locations
}

fn apply_all(summary: &mut Summary, frames: Vec<(Delta, Vec<DeltaEntry>)>) -> Vec<Outcome> {
    frames.into_iter().map(|(head, entries)| summary.delta(&head, entries)).collect()
}

#[test]
fn deltas_in_order_build_the_view_a_gap_waits_for_a_snapshot() {
    let mut node = view(3, 7);
    let mut summary = Summary::new();
    node.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 10, 1).unwrap();
    node.adopt(Some(key(1)), key(2), lake_dp::ObjectKind::KvBlock, 1, 5, 11, 1).unwrap();
    let changes: Vec<_> = node.drain_changes().collect();
    let outcomes = apply_all(&mut summary, deltas(3, &node, &changes));
    assert_eq!(outcomes, [Outcome::Applied { sequence: 2 }]);
    let figures = summary.figures(3).unwrap();
    assert_eq!((figures.term, figures.sequence, figures.replicas), (7, 2, [0, 1, 1, 0]));
    // The same delta again changes nothing.
    assert_eq!(apply_all(&mut summary, deltas(3, &node, &changes)), [Outcome::Stale]);

    // Change 3 is lost on the way; 4 arrives: a gap.
    node.adopt(None, key(3), lake_dp::ObjectKind::KvBlock, 0, 5, 12, 1).unwrap();
    let _lost: Vec<_> = node.drain_changes().collect();
    node.remove(&key(1), 0).unwrap();
    let after: Vec<_> = node.drain_changes().collect();
    let outcome = apply_all(&mut summary, deltas(3, &node, &after));
    assert_eq!(outcome, [Outcome::NeedSnapshot { node: 3, term: 7 }]);
    assert!(summary.figures(3).unwrap().gap);
    // Nothing of the node is applied until the snapshot comes.
    node.adopt(None, key(4), lake_dp::ObjectKind::KvBlock, 0, 5, 13, 1).unwrap();
    let more: Vec<_> = node.drain_changes().collect();
    assert_eq!(apply_all(&mut summary, deltas(3, &node, &more)), [Outcome::NeedSnapshot { node: 3, term: 7 }]);
    for (head, entries) in snapshot(3, &node) {
        assert_eq!(summary.snapshot(&head, entries), Outcome::Applied { sequence: 5 });
    }
    let figures = summary.figures(3).unwrap();
    assert_eq!((figures.sequence, figures.gap, figures.replicas), (5, false, [0, 2, 1, 0]));
    assert!(summary.replicas(&key(1)).is_empty(), "the removal the gap hid is in the snapshot");
    // Deltas continue after the snapshot's sequence.
    node.remove(&key(3), 0).unwrap();
    let next: Vec<_> = node.drain_changes().collect();
    assert_eq!(apply_all(&mut summary, deltas(3, &node, &next)), [Outcome::Applied { sequence: 6 }]);
    assert_eq!(summary.figures(3).unwrap().replicas, [0, 1, 1, 0]);

    // The node's control plane restarts (term 8): its view starts over
    // from that term's first delta.
    let mut again = view(3, 8);
    again.adopt(None, key(9), lake_dp::ObjectKind::KvBlock, 1, 5, 20, 1).unwrap();
    let first: Vec<_> = again.drain_changes().collect();
    assert_eq!(apply_all(&mut summary, deltas(3, &again, &first)), [Outcome::Applied { sequence: 1 }]);
    assert_eq!(summary.figures(3).unwrap().replicas, [0, 0, 1, 0]);
    // A delta of the old term now is stale.
    assert_eq!(apply_all(&mut summary, deltas(3, &node, &next)), [Outcome::Stale]);
}

#[test]
fn a_lapsed_node_loses_its_l1_replicas_and_its_l2_ones_are_not_offered_until_it_returns() {
    let mut summary = Summary::new();
    for node in [1, 2] {
        let mut locations = view(node, 1);
        for (i, region) in [(1u8, 0u16), (2, 1), (3, 9)] {
            locations.adopt(None, key(i), lake_dp::ObjectKind::KvBlock, region, 5, u32::from(i), 1).unwrap();
        }
        let changes: Vec<_> = locations.drain_changes().collect();
        apply_all(&mut summary, deltas(node, &locations, &changes));
    }
    let chain = [key(1)];
    assert_eq!(summary.hits(&chain).len(), 2);
    summary.membership(&[2]);
    let lapsed = summary.figures(1).unwrap();
    assert_eq!((lapsed.member, lapsed.replicas, lapsed.available), (false, [0, 0, 1, 1], [0, 0, 0, 1]));
    assert_eq!(summary.hits(&chain), [NodeHits { node: 2, through: [1, 1, 1] }]);
    // Key 2 lives in both nodes' L2: only node 2's is offered now.
    let offered: Vec<u32> = summary.replicas(&key(2)).iter().map(|r| r.node.0).collect();
    assert_eq!(offered, [2]);
    summary.membership(&[1, 2]);
    assert_eq!(summary.figures(1).unwrap().available, [0, 0, 1, 1], "its L2 is back, its L1 is not");
}

#[test]
fn a_checkpoint_reads_back_whole_and_a_damaged_one_is_refused() {
    let mut summary = Summary::new();
    let mut locations = view(4, 3);
    for i in 1..=50u8 {
        let region = [0u16, 1, 9][usize::from(i % 3)];
        let parent = (i > 1).then(|| key(i - 1));
        locations.adopt(parent, key(i), lake_dp::ObjectKind::KvBlock, region, 5, u32::from(i), 1).unwrap();
    }
    let changes: Vec<_> = locations.drain_changes().collect();
    apply_all(&mut summary, deltas(4, &locations, &changes));
    summary.membership(&[]);
    let bytes = summary.checkpoint(12);
    let (back, term) = Summary::restore(&bytes).unwrap();
    assert_eq!(term, 12);
    assert_eq!(back.figures(4), summary.figures(4));
    assert_eq!(back.replicas(&key(3)), summary.replicas(&key(3)));
    assert_eq!(back.checkpoint(12), bytes, "the same summary writes the same bytes");
    // A flipped byte anywhere, a cut, another file: refused by name.
    let mut flipped = bytes.clone();
    flipped[40] ^= 1;
    assert_eq!(Summary::restore(&flipped).unwrap_err(), CheckpointError::Crc);
    assert_eq!(Summary::restore(&bytes[..bytes.len() - 7]).unwrap_err(), CheckpointError::Crc);
    assert_eq!(Summary::restore(&bytes[..10]).unwrap_err(), CheckpointError::Truncated);
    assert!(matches!(Summary::restore(b"not a checkpoint at all, just text"), Err(CheckpointError::Format(_))));
}

#[test]
fn an_uplink_feeds_the_aggregator_over_tcp_and_reconnects_with_a_snapshot() {
    let mut aggregator = Aggregator::bind("127.0.0.1:0".parse().unwrap(), Summary::new()).unwrap();
    let address = aggregator.local_addr().unwrap();
    let mut locations = view(6, 2);
    let mut uplink = Uplink::new(6, vec![address]);
    let step = |locations: &mut Locations, uplink: &mut Uplink, aggregator: &mut Aggregator| {
        for _ in 0..50 {
            let changes: Vec<_> = locations.drain_changes().collect();
            uplink.pump(locations, &changes);
            aggregator.pump();
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    for i in 1..=10u8 {
        locations.adopt(None, key(i), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(i), 1).unwrap();
    }
    step(&mut locations, &mut uplink, &mut aggregator);
    assert_eq!(aggregator.summary.figures(6).unwrap().replicas, [0, 10, 0, 0]);
    assert_eq!(aggregator.connected(), [6]);
    locations.remove(&key(1), 0).unwrap();
    step(&mut locations, &mut uplink, &mut aggregator);
    assert_eq!(aggregator.summary.figures(6).unwrap().replicas, [0, 9, 0, 0]);
    assert!(aggregator.counters.applied >= 2, "{:?}", aggregator.counters);

    // The leader goes; a new one starts from nothing: the node reconnects
    // and its snapshot brings the new summary up to date.
    drop(aggregator);
    let mut second = Aggregator::bind(address, Summary::new()).unwrap();
    locations.remove(&key(2), 0).unwrap();
    for _ in 0..100 {
        let changes: Vec<_> = locations.drain_changes().collect();
        uplink.pump(&locations, &changes);
        second.pump();
        if second.summary.figures(6).is_some_and(|f| f.replicas == [0, 8, 0, 0]) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(second.summary.figures(6).map(|f| f.replicas), Some([0, 8, 0, 0]));
    assert!(uplink.counters.connects >= 2 && uplink.counters.snapshots >= 2, "{:?}", uplink.counters);
}

#[test]
fn an_authenticated_uplink_feeds_the_leader_and_one_with_another_key_is_refused() {
    use lake_dp::auth::LinkKey;
    let key_of = |b: u8| LinkKey::from_bytes([b; 32]);
    let mut aggregator = Aggregator::bind("127.0.0.1:0".parse().unwrap(), Summary::new()).unwrap();
    aggregator.authenticate(key_of(1));
    let address = aggregator.local_addr().unwrap();
    let mut locations = view(6, 2);
    for i in 1..=4u8 {
        locations.adopt(None, key(i), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(i), 1).unwrap();
    }
    let mut strange = view(7, 2);
    strange.adopt(None, key(9), lake_dp::ObjectKind::KvBlock, 0, 5, 9, 1).unwrap();
    let mut member = Uplink::new(6, vec![address]).authenticated(key_of(1));
    let mut stranger = Uplink::new(7, vec![address]).authenticated(key_of(2));
    let mut plain = Uplink::new(8, vec![address]);
    let empty = view(8, 2);
    for _ in 0..100 {
        let changes: Vec<_> = locations.drain_changes().collect();
        member.pump(&locations, &changes);
        let changes: Vec<_> = strange.drain_changes().collect();
        stranger.pump(&strange, &changes);
        plain.pump(&empty, &[]);
        aggregator.pump();
        if aggregator.summary.figures(6).is_some() && aggregator.counters.refused >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(aggregator.summary.figures(6).map(|f| f.replicas), Some([0, 4, 0, 0]));
    assert!(aggregator.summary.figures(7).is_none() && aggregator.summary.figures(8).is_none());
    assert!(aggregator.counters.refused >= 2, "{:?}", aggregator.counters);
    let events = aggregator.take_security_events();
    assert!(events.iter().any(|e| e.contains("another link key")), "{events:?}");
    assert!(events.iter().any(|e| e.contains("not a Lake handshake")), "{events:?}");
    assert!(
        stranger.last_refusal().is_some_and(|why| why.contains("another link key")),
        "{:?}",
        stranger.last_refusal()
    );
}

#[test]
fn a_prefix_many_blocks_continue_is_planned_into_every_other_members_l1() {
    let mut summary = Summary::new();
    // Node 1: a root continued by three blocks, and a chain of two.
    let mut one = view(1, 1);
    one.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
    for child in 2..=4 {
        one.adopt(Some(key(1)), key(child), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(child), 1).unwrap();
    }
    one.adopt(None, key(10), lake_dp::ObjectKind::KvBlock, 0, 5, 10, 1).unwrap();
    one.adopt(Some(key(10)), key(11), lake_dp::ObjectKind::KvBlock, 0, 5, 11, 1).unwrap();
    // Node 2 holds an L1 block of its own (its L1 region is known); node 3
    // holds the root already, in L1.
    let mut two = view(2, 1);
    two.adopt(None, key(20), lake_dp::ObjectKind::KvBlock, 0, 5, 3, 1).unwrap();
    let mut three = view(3, 1);
    three.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 7, 1).unwrap();
    for (node, locations) in [(1, &mut one), (2, &mut two), (3, &mut three)] {
        let changes: Vec<_> = locations.drain_changes().collect();
        apply_all(&mut summary, deltas(node, locations, &changes));
    }
    let plan = summary.replication_plan(3, 10, |_, _| false);
    assert_eq!(plan.len(), 1, "{plan:?}");
    let copy = plan[0];
    assert_eq!((copy.key, copy.to.node, copy.to.tier, copy.to.slot), (key(1), 2, 1, lake_dp::wire::message::SLOT_ANY));
    assert_eq!(copy.from.tier, Tier::L1Dram);
    // Asked already: not again; a lapsed target is not planned for.
    assert!(summary.replication_plan(3, 10, |k, n| *k == key(1) && n == 2).is_empty());
    summary.membership(&[1, 3]);
    assert!(summary.replication_plan(3, 10, |_, _| false).is_empty());
    // Fewer children than asked for: nothing.
    summary.membership(&[1, 2, 3]);
    assert!(summary.replication_plan(4, 10, |_, _| false).is_empty());
}

#[test]
fn a_hot_prefixs_copies_are_shared_out_among_the_members_holding_it_in_l1() {
    let mut summary = Summary::new();
    // Nodes 1 and 2 hold the root in L1, with its three children; nodes 3
    // to 8 hold a block of their own in L1 (their L1 regions are known).
    for node in 1..=8u32 {
        let mut locations = view(node, 1);
        if node <= 2 {
            locations.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
            for child in 2..=4 {
                locations
                    .adopt(Some(key(1)), key(child), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(child), 1)
                    .unwrap();
            }
        } else {
            locations.adopt(None, numbered(node), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
        }
        let changes: Vec<_> = locations.drain_changes().collect();
        apply_all(&mut summary, deltas(node, &locations, &changes));
    }
    let plan = summary.replication_plan(3, 100, |_, _| false);
    let mut targets: Vec<u32> = plan.iter().map(|c| c.to.node).collect();
    targets.sort_unstable();
    assert_eq!(targets, [3, 4, 5, 6, 7, 8], "{plan:?}");
    assert!(plan.iter().all(|c| c.key == key(1) && c.from.tier == Tier::L1Dram));
    let from = |node: u32| plan.iter().filter(|c| c.from.node.0 == node).count();
    assert_eq!((from(1), from(2)), (3, 3), "each holder sends half: {plan:?}");
}

#[test]
fn a_hot_prefix_is_copied_only_to_the_members_whose_engines_read_its_namespace() {
    const MODEL_A: u64 = 0xa1;
    const MODEL_B: u64 = 0xb2;
    fn adopt(locations: &mut Locations, parent: Option<BlockKey>, key: BlockKey, slot: u32, namespace: u64) {
        let at = locations.adopt(parent, key, lake_dp::ObjectKind::KvBlock, 0, 5, slot, 1).unwrap();
        locations.index.set_namespace(at, namespace);
    }
    fn send(summary: &mut Summary, node: u32, locations: &mut Locations) {
        let changes: Vec<_> = locations.drain_changes().collect();
        apply_all(summary, deltas(node, locations, &changes));
    }
    let targets = |summary: &Summary| {
        let mut targets: Vec<u32> = summary.replication_plan(3, 100, |_, _| false).iter().map(|c| c.to.node).collect();
        targets.sort_unstable();
        targets
    };
    let mut summary = Summary::new();
    // Node 1 holds model A's system prompt, continued by three blocks;
    // nodes 2 and 3 serve model A too (one block each), nodes 4 and 5
    // model B only, node 6 says no namespace (an older node).
    let mut nodes: Vec<Locations> = (1..=6).map(|node| view(node, 1)).collect();
    adopt(&mut nodes[0], None, key(1), 1, MODEL_A);
    for child in 2..=4u8 {
        adopt(&mut nodes[0], Some(key(1)), key(child), u32::from(child), MODEL_A);
    }
    for (node, namespace) in [(2, MODEL_A), (3, MODEL_A), (4, MODEL_B), (5, MODEL_B), (6, 0)] {
        adopt(&mut nodes[node as usize - 1], None, numbered(node), 1, namespace);
    }
    for (node, locations) in (1..).zip(&mut nodes) {
        send(&mut summary, node, locations);
    }
    let plan = summary.replication_plan(3, 100, |_, _| false);
    assert!(plan.iter().all(|c| c.key == key(1) && c.from.node.0 == 1), "{plan:?}");
    assert_eq!(targets(&summary), [2, 3], "model B's nodes, and one of no known namespace, read none of it");
    // An engine on node 4 saves a block of model A: node 4 reads model A
    // now, and is sent the prompt too.
    adopt(&mut nodes[3], None, numbered(40), 2, MODEL_A);
    send(&mut summary, 4, &mut nodes[3]);
    assert_eq!(targets(&summary), [2, 3, 4]);

    // A hot prefix of no known namespace (its holder does not say) goes
    // to every member, as before nodes said.
    let mut summary = Summary::new();
    let mut nodes: Vec<Locations> = (1..=3).map(|node| view(node, 1)).collect();
    adopt(&mut nodes[0], None, key(1), 1, 0);
    for child in 2..=4u8 {
        adopt(&mut nodes[0], Some(key(1)), key(child), u32::from(child), 0);
    }
    for node in [2, 3] {
        adopt(&mut nodes[node as usize - 1], None, numbered(node), 1, MODEL_B);
    }
    for (node, locations) in (1..).zip(&mut nodes) {
        send(&mut summary, node, locations);
    }
    assert_eq!(targets(&summary), [2, 3]);
}

#[test]
fn a_draining_nodes_blocks_no_one_else_keeps_are_planned_into_other_members_l1() {
    let mut summary = Summary::new();
    // Node 1 (drained): key 1 in L1, key 2 only in L2, key 3 also in L3,
    // key 4 also on node 2, key 5 also on node 3 (drained too).
    let mut one = view(1, 1);
    one.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
    one.adopt(None, key(2), lake_dp::ObjectKind::KvBlock, 1, 5, 2, 1).unwrap();
    one.adopt(None, key(3), lake_dp::ObjectKind::KvBlock, 0, 5, 3, 1).unwrap();
    one.adopt(None, key(3), lake_dp::ObjectKind::KvBlock, 9, 5, 4, 1).unwrap();
    one.adopt(None, key(4), lake_dp::ObjectKind::KvBlock, 1, 5, 5, 1).unwrap();
    one.adopt(None, key(5), lake_dp::ObjectKind::KvBlock, 1, 5, 6, 1).unwrap();
    // Node 2 holds no L1 replica at all: its L1 is known from its
    // membership's announcement alone.
    let mut two = view(2, 1);
    two.adopt(None, key(4), lake_dp::ObjectKind::KvBlock, 1, 5, 1, 1).unwrap();
    let mut three = view(3, 1);
    three.adopt(None, key(5), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
    for (node, locations) in [(1, &mut one), (2, &mut two), (3, &mut three)] {
        let changes: Vec<_> = locations.drain_changes().collect();
        apply_all(&mut summary, deltas(node, locations, &changes));
    }
    assert!(summary.drain_plan(10, |_, _| false).is_empty(), "nothing is drained yet");
    summary.draining(&[1, 3]);
    assert!(summary.drain_plan(10, |_, _| false).is_empty(), "node 2's L1 is not known yet");
    summary.l1_spaces(&[(2, (0, 77))]);
    let plan = summary.drain_plan(10, |_, _| false);
    let planned: Vec<(BlockKey, u32, Tier)> = plan.iter().map(|c| (c.key, c.from.node.0, c.from.tier)).collect();
    // Keys 1 and 2 from node 1 (from L1, and from L2 where only there); key
    // 5 is held by two drained nodes only, so it goes too, once; key 3 is
    // in L3 and key 4 on node 2: kept.
    assert_eq!(planned.len(), 3, "{planned:?}");
    assert!(
        planned.contains(&(key(1), 1, Tier::L1Dram)) && planned.contains(&(key(2), 1, Tier::L2Nvme)),
        "{planned:?}"
    );
    assert_eq!(planned.iter().filter(|p| p.0 == key(5)).count(), 1, "{planned:?}");
    for copy in &plan {
        let to = copy.to;
        assert_eq!((to.node, to.tier, to.region, to.region_epoch), (2, 1, 0, 77), "only to node 2's announced L1");
        assert_eq!(to.slot, lake_dp::wire::message::SLOT_ANY);
    }
    let figures = summary.figures(1).unwrap();
    assert_eq!((figures.draining, figures.drain_left), (true, 3));
    // Asked lately: not again; at most `max`.
    assert!(summary.drain_plan(10, |_, node| node == 2).is_empty());
    assert_eq!(summary.drain_plan(1, |_, _| false).len(), 1);
    // Nothing is replicated into a drained node, and a lapsed one drains
    // nothing (its L1 is gone from the summary).
    summary.draining(&[]);
    assert_eq!(summary.figures(1).unwrap().drain_left, 0);
    summary.draining(&[1]);
    summary.membership(&[2, 3]);
    assert!(summary.drain_plan(10, |_, _| false).is_empty());
}

/// A cluster view of node `node` at a scratch path in /dev/shm, removed
/// when dropped.
struct ScratchView(std::path::PathBuf);

impl Drop for ScratchView {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn scratch_view(name: &str, node: u32) -> (ScratchView, lake_dp::mirror::view::ViewWriter) {
    use lake_dp::mirror::{MirrorBacking, MirrorConfig};
    let path = std::path::PathBuf::from(format!("/dev/shm/lake-summary-view-{name}-{}", std::process::id()));
    let config =
        MirrorConfig { node: NodeId(node), ..MirrorConfig::for_entries(MirrorBacking::Shm(path.clone()), 1000) };
    let writer = lake_dp::mirror::view::ViewWriter::create(&config).unwrap();
    (ScratchView(path), writer)
}

fn view_tiers(changes: &[(u32, Vec<NamedViewEntry>)]) -> Vec<(u32, u8, u8)> {
    changes.iter().flat_map(|(node, entries)| entries.iter().map(move |e| (*node, e.key.0[0], e.tier))).collect()
}

#[test]
fn the_view_changes_name_each_nodes_fastest_offered_tier_and_only_what_changed() {
    use lake_dp::wire::message::VIEW_TIER_NONE as NONE;
    let (l1, l2, l3) = (Tier::L1Dram as u8, Tier::L2Nvme as u8, Tier::L3Object as u8);
    let mut summary = Summary::new();
    summary.track_view();
    let mut one = view(1, 1);
    one.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
    one.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 1, 5, 2, 1).unwrap();
    one.adopt(None, key(2), lake_dp::ObjectKind::KvBlock, 1, 5, 3, 1).unwrap();
    one.adopt(None, key(3), lake_dp::ObjectKind::KvBlock, 9, 5, 4, 1).unwrap();
    let changes: Vec<_> = one.drain_changes().collect();
    apply_all(&mut summary, deltas(1, &one, &changes));
    assert_eq!(view_tiers(&summary.take_view_changes()), [(1, 1, l1), (1, 2, l2), (1, 3, l3)]);
    assert!(summary.take_view_changes().is_empty(), "taken once");
    // Its L1 replica goes: L2 is its fastest now.
    one.remove(&key(1), 0).unwrap();
    let changes: Vec<_> = one.drain_changes().collect();
    apply_all(&mut summary, deltas(1, &one, &changes));
    assert_eq!(view_tiers(&summary.take_view_changes()), [(1, 1, l2)]);
    // Removed and added back between two takes: nothing to send.
    one.remove(&key(2), 1).unwrap();
    one.adopt(None, key(2), lake_dp::ObjectKind::KvBlock, 1, 5, 3, 1).unwrap();
    let changes: Vec<_> = one.drain_changes().collect();
    apply_all(&mut summary, deltas(1, &one, &changes));
    assert!(summary.take_view_changes().is_empty());
    // Its lease lapses: its L2 is withheld, its L3 is the store's.
    summary.membership(&[]);
    assert_eq!(view_tiers(&summary.take_view_changes()), [(1, 1, NONE), (1, 2, NONE)]);
    summary.membership(&[1]);
    assert_eq!(view_tiers(&summary.take_view_changes()), [(1, 1, l2), (1, 2, l2)]);
    // A snapshot that replaces its view sends only what differs.
    one.remove(&key(3), 9).unwrap();
    let _ = one.drain_changes().count();
    for (head, entries) in snapshot(1, &one) {
        summary.snapshot(&head, entries);
    }
    assert_eq!(view_tiers(&summary.take_view_changes()), [(1, 3, NONE)]);
    let whole = summary.view_entries(&super::apart::Apart::new());
    assert_eq!(view_tiers(&whole), [(1, 1, l2), (1, 2, l2)]);
}

#[test]
fn the_leader_streams_each_node_the_other_nodes_blocks_and_a_new_leader_starts_the_view_over() {
    use lake_dp::mirror::view::{Holder, ViewReader};
    let mut aggregator = Aggregator::bind("127.0.0.1:0".parse().unwrap(), Summary::new()).unwrap();
    let address = aggregator.local_addr().unwrap();
    let (path_one, writer_one) = scratch_view("stream-1", 1);
    let (path_two, writer_two) = scratch_view("stream-2", 2);
    let mut one = view(1, 1);
    let mut two = view(2, 1);
    let mut up_one = Uplink::new(1, vec![address]).with_view(writer_one);
    let mut up_two = Uplink::new(2, vec![address]).with_view(writer_two);
    let reader_one = ViewReader::attach(&path_one.0).unwrap();
    let reader_two = ViewReader::attach(&path_two.0).unwrap();
    let pump = |one: &mut Locations, two: &mut Locations, a: &mut Uplink, b: &mut Uplink, leader: &mut Aggregator| {
        for _ in 0..30 {
            let changes: Vec<_> = one.drain_changes().collect();
            a.pump(one, &changes);
            let changes: Vec<_> = two.drain_changes().collect();
            b.pump(two, &changes);
            leader.pump();
            std::thread::sleep(Duration::from_millis(3));
        }
    };
    for i in 1..=5u8 {
        let parent = (i > 1).then(|| key(i - 1));
        one.adopt(parent, key(i), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(i), 1).unwrap();
    }
    two.adopt(None, key(40), lake_dp::ObjectKind::KvBlock, 1, 5, 1, 1).unwrap();
    // Node 2's L1 is known to the leader from a block it holds there.
    two.adopt(None, key(41), lake_dp::ObjectKind::KvBlock, 0, 5, 2, 1).unwrap();
    pump(&mut one, &mut two, &mut up_one, &mut up_two, &mut aggregator);
    let on_one = Some(Holder { node: NodeId(1), tier: Tier::L1Dram });
    for i in 1..=5 {
        assert_eq!(reader_two.best(&key(i)), on_one, "node 2 sees node 1's block {i}");
        assert_eq!(reader_one.best(&key(i)), None, "a node's own blocks are its mirror's");
    }
    assert_eq!(reader_one.best(&key(40)), Some(Holder { node: NodeId(2), tier: Tier::L2Nvme }));
    // Node 2's engine pulls node 1's block 3: the leader asks node 1 for a
    // copy into node 2's L1, at the priority of a load waited on. A pull of
    // a block no member offers is counted, and asks nothing.
    let pull = |key: BlockKey| lake_dp::wire::message::Transfer {
        source: lake_dp::model::replica::ReplicaWire { tier: Tier::L1Dram as u8, node: 1, ..Default::default() },
        target: lake_dp::model::replica::ReplicaWire { tier: Tier::L1Dram as u8, node: 2, ..Default::default() },
        key,
        deadline_unix_ns: 0,
        priority: lake_dp::Priority::CriticalLoad as u8,
        reserved: [0; 7],
    };
    assert!(up_two.pull(&pull(key(3))) && up_two.pull(&pull(key(99))));
    pump(&mut one, &mut two, &mut up_one, &mut up_two, &mut aggregator);
    let copies = up_one.take_copies();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let (copy, l1_of_two) = (copies[0], (0, 5));
    assert_eq!((copy.key, copy.source.node, copy.target.node), (key(3), 1, 2));
    assert_eq!((copy.target.region, copy.target.region_epoch), l1_of_two, "node 2's L1");
    assert_eq!(copy.priority, lake_dp::Priority::CriticalLoad as u8);
    assert_eq!((aggregator.counters.pulls_relayed, aggregator.counters.pulls_unheld), (1, 1));
    // A pull naming the puller's L1 region and epoch (its `lake-cp` does:
    // the leader learns them only a moment after a node starts) is copied
    // there.
    let named = lake_dp::wire::message::Transfer {
        target: lake_dp::model::replica::ReplicaWire { region: 7, region_epoch: 9, ..pull(key(3)).target },
        ..pull(key(3))
    };
    assert!(up_two.pull(&named));
    pump(&mut one, &mut two, &mut up_one, &mut up_two, &mut aggregator);
    let copies = up_one.take_copies();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!((copies[0].target.node, copies[0].target.region, copies[0].target.region_epoch), (2, 7, 9));
    // Removals flow down too.
    one.remove(&key(5), 0).unwrap();
    pump(&mut one, &mut two, &mut up_one, &mut up_two, &mut aggregator);
    assert_eq!(reader_two.best(&key(5)), None);
    assert_eq!(reader_two.live(), 4);
    let (term, sequence, blocks, nodes) = up_two.view_figures().unwrap();
    assert_eq!((term, blocks, nodes), (aggregator.view_position().0, 4, 1));
    assert_eq!(sequence, aggregator.view_position().1, "node 2 applied every frame made");
    assert!(aggregator.counters.view_snapshots >= 2, "{:?}", aggregator.counters);

    // The leader goes; a new one starts from nothing. Each node's snapshot
    // rebuilds its summary, and its view stream (a later term) rebuilds
    // the views — with what changed meanwhile.
    drop(aggregator);
    std::thread::sleep(Duration::from_millis(5));
    let mut second = Aggregator::bind(address, Summary::new()).unwrap();
    one.remove(&key(4), 0).unwrap();
    for _ in 0..5 {
        pump(&mut one, &mut two, &mut up_one, &mut up_two, &mut second);
        if reader_two.live() == 3 && up_two.view_figures().is_some_and(|f| f.0 == second.view_position().0) {
            break;
        }
    }
    assert_eq!(up_two.view_figures().map(|f| f.0), Some(second.view_position().0), "the new leader's term");
    for i in 1..=3 {
        assert_eq!(reader_two.best(&key(i)), on_one);
    }
    assert_eq!(reader_two.best(&key(4)), None, "removed while no leader was there");
    assert_eq!(reader_one.best(&key(40)), Some(Holder { node: NodeId(2), tier: Tier::L2Nvme }));
    assert_eq!(up_two.counters.view_gaps, 0, "{:?}", up_two.counters);
}

#[test]
fn a_node_keeping_tenants_apart_shows_each_tenant_only_its_namespaces_blocks_of_other_nodes() {
    use lake_dp::mirror::view::{Holder, ViewReader};
    const TENANT: u64 = 0x7e;
    const OTHER: u64 = 0x0b;
    let mut aggregator = Aggregator::bind("127.0.0.1:0".parse().unwrap(), Summary::new()).unwrap();
    let address = aggregator.local_addr().unwrap();
    // Node 1 holds a block of the tenant's namespace, one of another, and
    // one of no known namespace. Node 2 keeps the tenant apart: its own
    // view for the tenant's engines, the pool's for the others. Node 3
    // keeps no tenant apart.
    let mut one = (view(1, 1), Uplink::new(1, vec![address]));
    for (i, namespace) in [(1u8, TENANT), (2, OTHER), (3, 0)] {
        let at = one.0.adopt(None, key(i), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(i), 1).unwrap();
        one.0.index.set_namespace(at, namespace);
    }
    let (pool_path, pool_view) = scratch_view("tenants-pool", 2);
    let (tenant_path, tenant_view) = scratch_view("tenants-tenant", 2);
    let (plain_path, plain_view) = scratch_view("tenants-plain", 3);
    let tenants = vec![(vec![TENANT], tenant_view)];
    let mut two = (view(2, 1), Uplink::new(2, vec![address]).with_view(pool_view).with_tenant_views(tenants));
    let mut three = (view(3, 1), Uplink::new(3, vec![address]).with_view(plain_view));
    let (pool, tenant, plain) = (
        ViewReader::attach(&pool_path.0).unwrap(),
        ViewReader::attach(&tenant_path.0).unwrap(),
        ViewReader::attach(&plain_path.0).unwrap(),
    );
    let mut pump = |one: &mut (Locations, Uplink), done: &dyn Fn() -> bool| {
        for _ in 0..500 {
            for (locations, uplink) in [&mut *one, &mut two, &mut three] {
                let changes: Vec<_> = locations.drain_changes().collect();
                uplink.pump(locations, &changes);
            }
            aggregator.pump();
            if done() {
                return (two.1.counters, three.1.counters);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("views: tenant {}, pool {}, plain {}", tenant.live(), pool.live(), plain.live());
    };
    let (counters, plain_counters) = pump(&mut one, &|| plain.live() == 3 && pool.live() == 1 && tenant.live() == 1);
    let on_one = Some(Holder { node: NodeId(1), tier: Tier::L1Dram });
    let seen = |reader: &ViewReader| [1, 2, 3].map(|i| reader.best(&key(i)) == on_one);
    assert_eq!(seen(&tenant), [true, false, false], "the tenant's view: its namespace's block alone");
    assert_eq!(seen(&pool), [false, true, false], "the pool's: neither the tenant's nor one of no known namespace");
    assert_eq!(seen(&plain), [true, true, true], "a node keeping no tenant apart shows them all");
    assert_eq!((counters.view_unnamed, plain_counters.view_unnamed), (1, 0));
    // A removal reaches the tenant's view.
    one.0.remove(&key(1), 0).unwrap();
    pump(&mut one, &|| tenant.live() == 0 && plain.live() == 2);
    assert_eq!(seen(&pool), [false, true, false]);
}

#[test]
fn a_node_sees_the_blocks_of_forty_other_nodes_and_the_fastest_holders_of_one_they_all_hold() {
    use lake_dp::ObjectKind::KvBlock;
    use lake_dp::mirror::view::{HOLDERS_KEPT, Holder, ViewReader};
    const OTHERS: u32 = 40;
    let mut aggregator = Aggregator::bind("127.0.0.1:0".parse().unwrap(), Summary::new()).unwrap();
    let address = aggregator.local_addr().unwrap();
    let (path, writer) = scratch_view("forty", 100);
    let mut watcher = (view(100, 1), Uplink::new(100, vec![address]).with_view(writer));
    let mut others: Vec<(Locations, Uplink)> =
        (1..=OTHERS).map(|n| (view(n, 1), Uplink::new(n, vec![address]))).collect();
    let shared = numbered(0);
    for (n, (locations, _)) in (1..=OTHERS).zip(&mut others) {
        // Its own block in its L1; the shared one in L1 on nodes 1 to 3,
        // in L2 on the others.
        locations.adopt(None, numbered(n), KvBlock, 0, 5, 1, 1).unwrap();
        locations.adopt(None, shared, KvBlock, if n <= 3 { 0 } else { 1 }, 5, 2, 1).unwrap();
    }
    let reader = ViewReader::attach(&path.0).unwrap();
    for _ in 0..500 {
        for (locations, uplink) in others.iter_mut().chain(std::iter::once(&mut watcher)) {
            let changes: Vec<_> = locations.drain_changes().collect();
            uplink.pump(locations, &changes);
        }
        aggregator.pump();
        if reader.live() == u64::from(OTHERS) + 1 && reader.holders(&shared).len() == HOLDERS_KEPT {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    for n in 1..=OTHERS {
        let on_n = Some(Holder { node: NodeId(n), tier: Tier::L1Dram });
        assert_eq!(reader.best(&numbered(n)), on_n, "node {n}'s block");
    }
    let holders = reader.holders(&shared);
    assert_eq!(holders.len(), HOLDERS_KEPT, "{holders:?}");
    let in_l1: Vec<u32> = holders.iter().filter(|h| h.tier == Tier::L1Dram).map(|h| h.node.0).collect();
    assert_eq!(in_l1.len(), 3, "the three L1 holders first: {holders:?}");
    assert_eq!(watcher.1.counters.view_refused, 0, "{:?}", watcher.1.counters);
}

#[test]
fn a_node_that_sees_a_gap_in_the_view_asks_for_a_snapshot_and_applies_nothing_until_it_comes() {
    use lake_dp::mirror::view::{Holder, ViewReader};
    use lake_dp::wire::{Limits, Message, append_frame, decode_frame};
    use std::io::{Read, Write};
    // The leader's end by hand: the aggregator never skips a frame.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (path, writer) = scratch_view("gap", 1);
    let mut uplink = Uplink::new(1, vec![listener.local_addr().unwrap()]).with_view(writer);
    let locations = view(1, 1);
    uplink.pump(&locations, &[]);
    let (mut leader, _) = listener.accept().unwrap();
    leader.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let frame = |kind_snapshot: bool, sequence: u64, keys: &[u8]| {
        let entries: Vec<ViewEntry> = keys
            .iter()
            .map(|&k| ViewEntry { key: key(k), tier: Tier::L1Dram as u8, kind: 1, reserved: [0; 6] })
            .collect();
        let head = Delta { term: 5, sequence, node: 3, count: u32::try_from(entries.len()).unwrap() };
        let records = lake_dp::wire::message::Records::from_slice(&entries);
        let message =
            if kind_snapshot { Message::ViewSnapshot(head, records) } else { Message::ViewDelta(head, records) };
        let mut out = Vec::new();
        append_frame(&mut out, super::link::meta(0), &message).unwrap();
        out
    };
    let settle = |uplink: &mut Uplink| {
        for _ in 0..20 {
            uplink.pump(&locations, &[]);
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    leader
        .write_all(
            &[frame(true, 1, &[1]), frame(false, 2, &[2]), frame(false, 4, &[3]), frame(false, 5, &[4])].concat(),
        )
        .unwrap();
    settle(&mut uplink);
    let reader = ViewReader::attach(&path.0).unwrap();
    let held = |k: u8| reader.best(&key(k)) == Some(Holder { node: NodeId(3), tier: Tier::L1Dram });
    assert_eq!([held(1), held(2), held(3), held(4)], [true, true, false, false], "nothing past the gap");
    assert_eq!(uplink.counters.view_gaps, 1);
    // The node asked for a snapshot, naming itself and the view's term.
    let mut input = Vec::new();
    let request = loop {
        let mut buf = [0u8; 4096];
        let n = leader.read(&mut buf).unwrap();
        assert!(n > 0, "the node closed its link");
        input.extend_from_slice(&buf[..n]);
        let mut at = 0;
        let mut found = None;
        while let Ok(frame) = decode_frame(&input[at..], &Limits::default()) {
            at += frame.len();
            if let Message::SnapshotRequest(request) = frame.message {
                found = Some(request);
            }
        }
        if let Some(request) = found {
            break request;
        }
    };
    assert_eq!((request.node, request.term), (1, 5));
    leader.write_all(&[frame(true, 5, &[1]), frame(false, 6, &[4])].concat()).unwrap();
    settle(&mut uplink);
    assert_eq!([held(1), held(2), held(3), held(4)], [true, false, false, true], "the snapshot replaced the view");
    assert_eq!(uplink.view_figures().map(|f| (f.0, f.1)), Some((5, 6)));
}

fn numbered(i: u32) -> BlockKey {
    let mut bytes = [0x5c; 16];
    bytes[..4].copy_from_slice(&i.to_le_bytes());
    BlockKey(bytes)
}

#[test]
fn blocks_a_node_saves_are_planned_into_their_homes_in_proportion_to_the_members_room() {
    let mut summary = Summary::new();
    summary.track_placement();
    // Node 1 saves 400 blocks; node 3 holds block 7 already (in L2);
    // nodes 2 and 3 hold an L1 block of their own (so their L1 is known).
    let mut one = view(1, 1);
    for i in 0..400 {
        one.adopt(None, numbered(i), lake_dp::ObjectKind::KvBlock, 0, 5, i, 1).unwrap();
    }
    let mut two = view(2, 1);
    two.adopt(None, key(1), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
    let mut three = view(3, 1);
    three.adopt(None, numbered(7), lake_dp::ObjectKind::KvBlock, 1, 5, 1, 1).unwrap();
    three.adopt(None, key(2), lake_dp::ObjectKind::KvBlock, 0, 5, 1, 1).unwrap();
    for (node, locations) in [(2, &mut two), (3, &mut three), (1, &mut one)] {
        let changes: Vec<_> = locations.drain_changes().collect();
        apply_all(&mut summary, deltas(node, locations, &changes));
    }
    // Rooms are read with the membership, after the nodes first report.
    summary.rooms(&[(1, 1 << 30), (2, 1 << 30), (3, 2 << 30)]);
    assert_eq!(summary.placing(), (402, 0), "every new L1 replica waits to be placed");
    // At most `max` a call; the rest wait.
    let first = summary.placement_plan(10, |_, _| false);
    assert_eq!(first.len(), 10);
    let mut plan = first;
    plan.extend(summary.placement_plan(1000, |_, _| false));
    assert_eq!(summary.placing().0, 0);
    let homes: Vec<Option<u32>> = (0..400).map(|i| summary.home(&numbered(i))).collect();
    for copy in &plan {
        assert_eq!(Some(copy.to.node), summary.home(&copy.key), "{copy:?}");
        let saver = match copy.key {
            k if k == key(1) => 2,
            k if k == key(2) => 3,
            _ => 1,
        };
        assert_eq!((copy.from.node.0, copy.from.tier), (saver, Tier::L1Dram));
        assert_eq!((copy.to.tier, copy.to.slot), (Tier::L1Dram as u8, lake_dp::wire::message::SLOT_ANY));
    }
    // Nodes 2 and 3 saved one block each: placed too where not home.
    plan.retain(|c| c.from.node.0 == 1);
    let away = homes.iter().filter(|h| **h != Some(1)).count();
    let at_three_already = usize::from(homes[7] == Some(3));
    assert_eq!(plan.len(), away - at_three_already, "each block not at home once, none held there already");
    assert!(!plan.iter().any(|c| c.key == numbered(7) && c.to.node == 3));
    // In proportion to room (1:1:2): a quarter stays, half goes to node 3.
    let counts = [1, 2, 3].map(|n| homes.iter().filter(|h| **h == Some(n)).count());
    assert!((70..=130).contains(&counts[0]) && (170..=230).contains(&counts[2]), "{counts:?}");
    // Taken: nothing again until a node saves more.
    assert!(summary.placement_plan(1000, |_, _| false).is_empty());

    // Node 3 drained: only the blocks whose home it was find another
    // (the rendezvous hash moves nothing else).
    summary.draining(&[3]);
    for i in 0..400 {
        let now = summary.home(&numbered(i));
        if homes[i as usize] == Some(3) {
            assert!(matches!(now, Some(1 | 2)));
        } else {
            assert_eq!(now, homes[i as usize]);
        }
    }
    // A block saved, asked lately (`skip`), or gone before the plan, is
    // not planned; one saved by a lapsed node neither.
    summary.draining(&[]);
    let saved: Vec<u32> = (400..440).filter(|&i| summary.home(&numbered(i)) == Some(2)).collect();
    for &i in &saved {
        one.adopt(None, numbered(i), lake_dp::ObjectKind::KvBlock, 0, 5, i, 1).unwrap();
    }
    one.remove(&numbered(saved[0]), 0).unwrap();
    let changes: Vec<_> = one.drain_changes().collect();
    apply_all(&mut summary, deltas(1, &one, &changes));
    let plan = summary.placement_plan(1000, |k, _| *k == numbered(saved[1]));
    let keys: Vec<BlockKey> = plan.iter().map(|c| c.key).collect();
    let want: Vec<BlockKey> = saved[2..].iter().map(|&i| numbered(i)).collect();
    assert_eq!(keys, want);
    one.adopt(None, numbered(1000), lake_dp::ObjectKind::KvBlock, 0, 5, 1000, 1).unwrap();
    let changes: Vec<_> = one.drain_changes().collect();
    apply_all(&mut summary, deltas(1, &one, &changes));
    summary.membership(&[2, 3]);
    assert!(summary.placement_plan(1000, |_, _| false).is_empty());
}

/// Sends what `locations` changed since the last call to `summary`.
pub(super) fn report(summary: &mut Summary, node: u32, locations: &mut Locations) {
    let changes: Vec<_> = locations.drain_changes().collect();
    apply_all(summary, deltas(node, locations, &changes));
}

#[test]
fn a_full_nodes_spill_goes_to_the_member_that_fills_the_least_of_its_room() {
    let mut summary = Summary::new();
    let kind = lake_dp::ObjectKind::KvBlock;
    // Node 1: 100 blocks in L1. Node 2: 60, each in L1 and in L2 (a block
    // counts once). Node 3: 80 in L1, with twice the room.
    let (mut one, mut two, mut three) = (view(1, 1), view(2, 1), view(3, 1));
    for i in 0..100 {
        one.adopt(None, numbered(i), kind, 0, 5, i, 1).unwrap();
    }
    for i in 0..60 {
        two.adopt(None, numbered(1000 + i), kind, 0, 5, i, 1).unwrap();
        two.adopt(None, numbered(1000 + i), kind, 1, 5, i, 1).unwrap();
    }
    for i in 0..80 {
        three.adopt(None, numbered(2000 + i), kind, 0, 5, i, 1).unwrap();
    }
    report(&mut summary, 1, &mut one);
    report(&mut summary, 2, &mut two);
    report(&mut summary, 3, &mut three);
    let none = std::collections::HashMap::new();
    assert_eq!(summary.spill_target(&key(9), 1, &none), None, "no member said its room");
    summary.rooms(&[(1, 1 << 30), (2, 1 << 30), (3, 2 << 30)]);

    // Node 3 fills 40 of node 1's 100 for the same room: the target, in
    // its L1, any slot.
    let (node, to) = summary.spill_target(&key(9), 1, &none).unwrap();
    assert_eq!((node, to.node, to.tier, to.slot), (3, 3, Tier::L1Dram as u8, lake_dp::wire::message::SLOT_ANY));
    // Spills promised count: node 3 at 62.5 is past node 2's 60.
    let promised = |two: u64, three: u64| [(2, two), (3, three)].into_iter().collect();
    assert_eq!(summary.spill_target(&key(9), 1, &promised(0, 45)).map(|t| t.0), Some(2));
    assert_eq!(summary.spill_target(&key(9), 1, &promised(40, 45)).map(|t| t.0), Some(3));
    // Both about as full as node 1 (96 of its 100): none.
    assert_eq!(summary.spill_target(&key(9), 1, &promised(36, 112)), None);
    // Never the node itself; from node 2 the roomiest is node 3.
    assert_eq!(summary.spill_target(&key(9), 2, &none).map(|t| t.0), Some(3));

    // A checkpoint restored counts the same.
    let (restored, _) = Summary::restore(&summary.checkpoint(1)).unwrap();
    let mut restored = restored;
    restored.rooms(&[(1, 1 << 30), (2, 1 << 30), (3, 2 << 30)]);
    assert_eq!(restored.spill_target(&key(9), 1, &promised(0, 45)).map(|t| t.0), Some(2));

    // Node 2 gives up its L2 copies: still 60 (in L1). All but one of
    // its L1 ones too (its L1 stays known): the roomiest.
    for i in 0..60 {
        two.remove(&numbered(1000 + i), 1).unwrap();
    }
    report(&mut summary, 2, &mut two);
    assert_eq!(summary.spill_target(&key(9), 1, &promised(0, 45)).map(|t| t.0), Some(2));
    assert_eq!(summary.spill_target(&key(9), 1, &promised(0, 5)).map(|t| t.0), Some(3));
    for i in 1..60 {
        two.remove(&numbered(1000 + i), 0).unwrap();
    }
    report(&mut summary, 2, &mut two);
    assert_eq!(summary.spill_target(&key(9), 1, &promised(0, 5)).map(|t| t.0), Some(2));

    // Draining or lapsed members take none; node 1 is left alone.
    summary.draining(&[2]);
    summary.membership(&[1, 2]);
    assert_eq!(summary.spill_target(&key(9), 1, &none), None);
}

#[test]
fn blocks_a_node_keeps_apart_go_only_to_nodes_keeping_them_apart_alike() {
    use lake_dp::mirror::view::{Holder, ViewReader};
    const ACME: u64 = 0xa1;
    const OTHER: u64 = 0x0b;
    let mut aggregator = Aggregator::bind("127.0.0.1:0".parse().unwrap(), Summary::new()).unwrap();
    let address = aggregator.local_addr().unwrap();
    // Node 1 keeps acme apart and holds a block of acme's, one of the
    // pool's, and one of no known namespace. Node 2 keeps acme apart
    // too; node 3 keeps nothing apart; node 4 keeps acme's namespace
    // apart for another tenant.
    let acme = [("acme".to_owned(), vec![ACME])];
    let mut one = (view(1, 1), Uplink::new(1, vec![address]).with_kept_apart(&acme));
    for (i, namespace) in [(1u8, ACME), (2, OTHER), (3, 0)] {
        let at = one.0.adopt(None, key(i), lake_dp::ObjectKind::KvBlock, 0, 5, u32::from(i), 1).unwrap();
        one.0.index.set_namespace(at, namespace);
    }
    let (pool_path, pool_view) = scratch_view("apart-pool", 2);
    let (acme_path, acme_view) = scratch_view("apart-acme", 2);
    let (plain_path, plain_view) = scratch_view("apart-plain", 3);
    let (bolt_path, bolt_view) = scratch_view("apart-bolt", 4);
    let (bolt_pool_path, bolt_pool_view) = scratch_view("apart-bolt-pool", 4);
    let two = Uplink::new(2, vec![address]).with_view(pool_view).with_tenant_views(vec![(vec![ACME], acme_view)]);
    let three = Uplink::new(3, vec![address]).with_view(plain_view);
    let four = Uplink::new(4, vec![address]).with_view(bolt_pool_view).with_tenant_views(vec![(vec![ACME], bolt_view)]);
    let mut others = [
        (view(2, 1), two.with_kept_apart(&acme)),
        (view(3, 1), three),
        (view(4, 1), four.with_kept_apart(&[("bolt".to_owned(), vec![ACME])])),
    ];
    let readers = [&acme_path, &pool_path, &plain_path, &bolt_path, &bolt_pool_path]
        .map(|path| ViewReader::attach(&path.0).unwrap());
    let [acme_two, pool_two, plain, bolt, bolt_pool] = &readers;
    let on_one = Some(Holder { node: NodeId(1), tier: Tier::L1Dram });
    let seen = |reader: &ViewReader| [1, 2, 3].map(|i| reader.best(&key(i)) == on_one);
    let mut done = false;
    for _ in 0..500 {
        for (locations, uplink) in std::iter::once(&mut one).chain(others.iter_mut()) {
            let changes: Vec<_> = locations.drain_changes().collect();
            uplink.pump(locations, &changes);
        }
        aggregator.pump();
        done = [acme_two, pool_two, plain, bolt_pool].iter().all(|r| r.live() == 1);
        if done {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let live = readers.each_ref().map(ViewReader::live);
    assert!(done, "views: {live:?}");
    assert_eq!(seen(acme_two), [true, false, false], "acme's view on a node keeping acme apart alike");
    assert_eq!(seen(pool_two), [false, true, false]);
    assert_eq!(seen(plain), [false, true, false], "a node keeping nothing apart: the pool's block alone");
    assert_eq!((seen(bolt), seen(bolt_pool)), ([false; 3], [false, true, false]), "kept apart for another tenant");
    let summary = &aggregator.summary;
    let moves = |i: u8| [2, 3, 4].map(|to| summary.may_move(&key(i), 1, to));
    assert_eq!(moves(1), [true, false, false], "acme's block to node 2 alone");
    assert_eq!(moves(2), [true; 3], "the pool's anywhere");
    assert_eq!(moves(3), [true, false, false], "one of no known namespace where all is kept apart alike");
    assert_eq!(summary.unlike(3), vec![1, 2, 4]);
    assert_eq!(summary.unlike(2), vec![3, 4]);
    // Said for the leader's log, of whichever of the two spoke last.
    let said = aggregator.take_unlike();
    assert!(said.iter().any(|(node, unlike)| *node == 3 || unlike.contains(&3)), "{said:?}");

    // Node 3 comes to keep acme apart alike (restarted so): acme's block
    // is sent to it again, and shown in its tenant's view.
    let (acme_three_path, acme_three_view) = scratch_view("apart-acme-3", 3);
    let (pool_three_path, pool_three_view) = scratch_view("apart-pool-3", 3);
    let three = Uplink::new(3, vec![address]).with_view(pool_three_view);
    others[1] = (view(3, 2), three.with_tenant_views(vec![(vec![ACME], acme_three_view)]).with_kept_apart(&acme));
    let acme_three = ViewReader::attach(&acme_three_path.0).unwrap();
    for _ in 0..500 {
        for (locations, uplink) in std::iter::once(&mut one).chain(others.iter_mut()) {
            let changes: Vec<_> = locations.drain_changes().collect();
            uplink.pump(locations, &changes);
        }
        aggregator.pump();
        if acme_three.live() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(seen(&acme_three), [true, false, false]);
    assert_eq!(seen(&ViewReader::attach(&pool_three_path.0).unwrap()), [false, true, false]);
    assert!(aggregator.summary.may_move(&key(1), 1, 3));
}
