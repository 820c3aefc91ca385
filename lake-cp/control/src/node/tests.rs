use super::*;
use lake_dp::Durability;
use lake_dp::mirror::{Lookup, MirrorBacking, MirrorConfig, MirrorReader};
use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::message::BlockEvicted;

fn key(i: u8) -> BlockKey {
    BlockKey([i; 16])
}

fn region(id: u16, tier: Tier, epoch: u64) -> RegisterRegion {
    RegisterRegion {
        region: id,
        tier: tier as u8,
        reserved_a: 0,
        node: 3,
        region_epoch: epoch,
        slot_bytes: 65536,
        slot_count: 64,
        reserved_b: 0,
        name: [0; 48],
    }
}

fn block(k: u8, parent: Option<u8>, tier: Tier, region: u16, epoch: u64, slot: u32) -> BlockRecord {
    BlockRecord {
        replica: ReplicaWire {
            tier: tier as u8,
            reserved: 0,
            region,
            node: 3,
            region_epoch: epoch,
            slot,
            generation: 7,
        },
        key: key(k),
        parent_key: parent.map_or(BlockKey::NONE, key),
        namespace: 1,
        layout_fingerprint: 2,
        payload_len: 4096,
        block_index: 0,
        kind: ObjectKind::KvBlock as u16,
        durability: Durability::Acked as u8,
        flags: 0,
    }
}

/// An engine's pull of node 2's L1 copy of `key` (of `namespace`) into
/// node 3's L1.
fn pull_into_node_3(key: BlockKey, namespace: u64) -> Transfer {
    Transfer {
        source: ReplicaWire { tier: Tier::L1Dram as u8, node: 2, region_epoch: namespace, ..ReplicaWire::default() },
        target: ReplicaWire {
            tier: Tier::L1Dram as u8,
            node: 3,
            slot: lake_dp::wire::message::SLOT_ANY,
            ..ReplicaWire::default()
        },
        key,
        deadline_unix_ns: 0,
        priority: Priority::CriticalLoad as u8,
        reserved: [0; 7],
    }
}

struct Scratch(std::path::PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn reports_reach_the_view_and_the_mirror() {
    let scratch = Scratch(format!("/dev/shm/lake-test-node-{}", std::process::id()).into());
    let mirror = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(scratch.0.clone()), 100)).unwrap();
    let reader = MirrorReader::attach(&scratch.0).unwrap();
    let mut node = Node::new(NodeId(3), 1, Some(mirror));
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    node.on_data_plane(0, &Message::RegisterRegion(region(2, Tier::L2Nvme, 5))).unwrap();
    assert_eq!(reader.region(RegionId(2)).map(|r| r.tier), Some(Tier::L2Nvme));
    // A child re-adopted before its parent waits, then follows it.
    node.on_data_plane(0, &Message::BlockReadopted(block(2, Some(1), Tier::L2Nvme, 2, 5, 11))).unwrap();
    assert_eq!(node.waiting(), 1);
    assert_eq!(reader.get(&key(2)), Lookup::Miss);
    node.on_data_plane(0, &Message::BlockReadopted(block(1, None, Tier::L2Nvme, 2, 5, 10))).unwrap();
    assert_eq!(node.waiting(), 0);
    let Lookup::Hit(entry) = reader.get(&key(2)) else { panic!("block 2 not published") };
    assert_eq!((entry.tier, entry.slot, entry.tiers), (Tier::L2Nvme, 11, 0b100));
    // Promoted to L1: the mirror names the faster copy, both tiers.
    node.on_data_plane(0, &Message::BlockCommitted(block(2, Some(1), Tier::L1Dram, 1, 5, 3))).unwrap();
    let Lookup::Hit(entry) = reader.get(&key(2)) else { panic!() };
    assert_eq!((entry.tier, entry.slot, entry.tiers), (Tier::L1Dram, 3, 0b110));
    // Evicted from L1: back to L2.
    let evicted = BlockEvicted {
        replica: block(2, Some(1), Tier::L1Dram, 1, 5, 3).replica,
        key: key(2),
        reason: 1,
        reserved: [0; 7],
    };
    node.on_data_plane(0, &Message::BlockEvicted(evicted)).unwrap();
    let Lookup::Hit(entry) = reader.get(&key(2)) else { panic!() };
    assert_eq!((entry.tier, entry.slot), (Tier::L2Nvme, 11));
    // A stale eviction (wrong slot) changes nothing.
    let stale = BlockEvicted { replica: block(2, Some(1), Tier::L2Nvme, 2, 5, 99).replica, ..evicted };
    assert!(node.on_data_plane(0, &Message::BlockEvicted(stale)).is_err());
    assert!(matches!(reader.get(&key(2)), Lookup::Hit(_)));
    // A restart: the region comes back under epoch 6; reports of epoch
    // 5 are refused.
    node.on_data_plane(0, &Message::RegisterRegion(region(2, Tier::L2Nvme, 6))).unwrap();
    assert_eq!(
        node.on_data_plane(0, &Message::BlockReadopted(block(3, Some(2), Tier::L2Nvme, 2, 5, 12))),
        Err(NodeError::Location(LocationError::StaleEpoch))
    );
    assert_eq!(node.counters.readopted, 2);
    assert_eq!(node.counters.committed, 1);
    assert_eq!(node.counters.evicted, 1);
    assert_eq!(node.counters.refused, 2);
    // Another node's reports are refused.
    let mut foreign = block(4, None, Tier::L2Nvme, 2, 6, 1);
    foreign.replica.node = 9;
    assert!(node.on_data_plane(0, &Message::BlockCommitted(foreign)).is_err());
}

#[test]
fn the_summary_is_told_each_blocks_namespace() {
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    node.on_data_plane(0, &Message::RegisterRegion(region(2, Tier::L2Nvme, 5))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(1, None, Tier::L1Dram, 1, 5, 3))).unwrap();
    let other = BlockRecord { namespace: 0x77, ..block(2, Some(1), Tier::L2Nvme, 2, 5, 4) };
    node.on_data_plane(0, &Message::BlockReadopted(other)).unwrap();
    let mut changes = Vec::new();
    node.take_changes(&mut changes);
    let sent: Vec<(BlockKey, u64)> = crate::summary::link::deltas(3, &node.locations, &changes)
        .into_iter()
        .flat_map(|(_, entries)| entries)
        .map(|e| (e.key, e.namespace))
        .collect();
    assert_eq!(sent, [(key(1), 1), (key(2), 0x77)]);
    let snapshot: Vec<u64> = crate::summary::link::snapshot(3, &node.locations)
        .into_iter()
        .flat_map(|(_, e)| e)
        .map(|e| e.namespace)
        .collect();
    assert_eq!(snapshot.len(), 2);
    assert!(snapshot.contains(&1) && snapshot.contains(&0x77), "{snapshot:?}");
}

#[test]
fn waiting_blocks_are_bounded() {
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(2, Tier::L2Nvme, 5))).unwrap();
    for i in 0..PENDING_MAX + 10 {
        let mut orphan = block(0, None, Tier::L2Nvme, 2, 5, 0);
        let bytes = (i as u64 + 1).to_le_bytes();
        orphan.key.0[..8].copy_from_slice(&bytes);
        orphan.parent_key.0[..8].copy_from_slice(&bytes);
        orphan.parent_key.0[8] = 0xff;
        node.on_data_plane(0, &Message::BlockReadopted(orphan)).unwrap();
    }
    assert_eq!(node.waiting(), PENDING_MAX);
    // The oldest stopped waiting: applied as roots, not dropped (their
    // slots are held by the data plane).
    assert_eq!(node.counters.rooted, 10);
    assert_eq!(node.locations.index.len(), 10);
    // Past the wait, the rest are too.
    let mut commands = Vec::new();
    node.plan(ORPHAN_WAIT_NS * 2, &mut commands);
    assert_eq!(node.waiting(), 0);
    assert_eq!(node.counters.rooted, PENDING_MAX as u64 + 10);
    assert_eq!(node.locations.index.len(), PENDING_MAX + 10);
}

#[test]
fn a_block_committed_after_its_parent_left_is_a_root() {
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(9, Some(8), Tier::L1Dram, 1, 5, 4))).unwrap();
    assert_eq!(node.waiting(), 0);
    assert_eq!(node.counters.rooted, 1);
    assert_eq!(node.locations.ready(&key(9)).count(), 1);
    // A second copy in the same region is a duplicate: the first stays,
    // the second is evicted at the next pass, and its report accepted.
    let second = block(9, Some(8), Tier::L1Dram, 1, 5, 6);
    node.on_data_plane(0, &Message::BlockCommitted(second)).unwrap();
    assert_eq!(node.locations.ready(&key(9)).map(|r| r.slot).collect::<Vec<_>>(), vec![4]);
    let mut commands = Vec::new();
    node.plan(1, &mut commands);
    assert_eq!(commands.len(), 1);
    let crate::tier::TierAction::Evict(evict) = commands[0].action else { panic!("{commands:?}") };
    assert_eq!(evict.replica.slot, 6);
    node.on_data_plane(0, &Message::BlockEvicted(evict)).unwrap();
    assert_eq!(node.locations.ready(&key(9)).map(|r| r.slot).collect::<Vec<_>>(), vec![4]);
    assert_eq!(node.counters.refused, 0);
}

/// A block the pool holds as a root (saved once after its parent left)
/// committed again under its parent — an engine saving a prefix again
/// after part of it was refused — joins the root it is held as; one held
/// under another parent joins it there (a key names one block, wherever
/// the index holds it). Either way the copy the data plane published is
/// never left in its slot unseen (where it was invisible to lookups and
/// held its tenant's L1 quota for good).
#[test]
fn a_copy_committed_under_another_parent_than_the_pools_joins_it_or_is_freed() {
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    node.on_data_plane(0, &Message::RegisterRegion(region(2, Tier::L2Nvme, 5))).unwrap();
    node.on_data_plane(0, &Message::BlockReadopted(block(9, None, Tier::L2Nvme, 2, 5, 10))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(8, None, Tier::L1Dram, 1, 5, 1))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(9, Some(8), Tier::L1Dram, 1, 5, 4))).unwrap();
    let mut held: Vec<u32> = node.locations.ready(&key(9)).map(|r| r.slot).collect();
    held.sort_unstable();
    assert_eq!(held, vec![4, 10], "the L1 copy joins the root");
    let mut commands = Vec::new();
    node.plan(1, &mut commands);
    assert!(commands.iter().all(|c| !matches!(c.action, crate::tier::TierAction::Evict(e) if e.key == key(9))));
    // Block 6, held under 5, committed in L2 under 7: it joins block 6
    // under 5.
    node.on_data_plane(0, &Message::BlockCommitted(block(5, None, Tier::L1Dram, 1, 5, 20))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(6, Some(5), Tier::L1Dram, 1, 5, 21))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(7, None, Tier::L1Dram, 1, 5, 22))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(6, Some(7), Tier::L2Nvme, 2, 5, 12))).unwrap();
    let mut held: Vec<u32> = node.locations.ready(&key(6)).map(|r| r.slot).collect();
    held.sort_unstable();
    assert_eq!(held, vec![12, 21]);
    assert_eq!(node.locations.parent_of(&key(6)), Some(Some(key(5))));
    let mut commands = Vec::new();
    node.plan(2, &mut commands);
    assert!(commands.iter().all(|c| !matches!(c.action, crate::tier::TierAction::Evict(e) if e.key == key(6))));
}

/// Found by the node's simulation with its object store: a new L3 copy
/// of a block in L1 and a leased L2 is not tracked, yet its data plane
/// holds it, and reports its eviction when it goes (a purge, the
/// store losing it); that report was refused as stale.
#[test]
fn the_eviction_of_an_untracked_l3_copy_is_accepted_and_a_stale_one_is_not() {
    let mut node = Node::new(NodeId(3), 1, None);
    for (id, tier) in [(1, Tier::L1Dram), (2, Tier::L2Nvme), (3, Tier::L3Object)] {
        node.on_data_plane(0, &Message::RegisterRegion(region(id, tier, 5))).unwrap();
    }
    node.on_data_plane(0, &Message::BlockCommitted(block(5, None, Tier::L2Nvme, 2, 5, 10))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(5, None, Tier::L1Dram, 1, 5, 3))).unwrap();
    let locations = &node.locations;
    node.leases.grant(1, 1, [key(5)], |k| locations.ready(k).find(|r| r.tier == Tier::L2Nvme), 1000, 0);
    let l3 = block(5, None, Tier::L3Object, 3, 5, 0);
    node.on_data_plane(0, &Message::BlockCommitted(l3)).unwrap();
    assert_eq!(node.counters.l3_untracked, 1);
    assert_eq!(node.locations.ready(&key(5)).count(), 2);
    let evicted =
        |block: BlockRecord| BlockEvicted { replica: block.replica, key: key(5), reason: 1, reserved: [0; 7] };
    node.on_data_plane(0, &Message::BlockEvicted(evicted(l3))).unwrap();
    assert_eq!((node.counters.l3_untracked_evicted, node.counters.refused), (1, 0));
    assert_eq!(node.locations.ready(&key(5)).count(), 2, "the tracked replicas stay");
    // An L2 replica the view does not hold is still refused.
    let stale = block(5, None, Tier::L2Nvme, 2, 5, 11);
    assert!(node.on_data_plane(0, &Message::BlockEvicted(evicted(stale))).is_err());
}

#[test]
fn another_replica_of_a_block_that_landed_before_its_parent_joins_it_where_the_index_holds_it() {
    // Pulled blocks land in any order: block 8 (its parent 7 not here
    // yet) is committed as a root, then 7 (its parent 6 never comes).
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    node.on_data_plane(0, &Message::RegisterRegion(region(9, Tier::L3Object, 5))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(8, Some(7), Tier::L1Dram, 1, 5, 1))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(7, Some(6), Tier::L1Dram, 1, 5, 2))).unwrap();
    // Their L3 copies (read from the store, adopted by the data plane's
    // catalog) are reported with the parents their headers name: each
    // joins its block, none is refused or left waiting.
    node.on_data_plane(0, &Message::BlockReadopted(block(8, Some(7), Tier::L3Object, 9, 5, 1))).unwrap();
    node.on_data_plane(0, &Message::BlockReadopted(block(7, Some(6), Tier::L3Object, 9, 5, 2))).unwrap();
    assert_eq!(node.waiting(), 0);
    for k in [7, 8] {
        let tiers: Vec<Tier> = node.locations.ready(&key(k)).map(|r| r.tier).collect();
        assert_eq!(tiers.len(), 2, "block {k}: {tiers:?}");
    }
}

#[test]
fn a_pull_goes_to_the_leader_naming_this_nodes_l1_and_one_held_only_in_l3_is_read_from_the_store() {
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    let any = |tier: Tier, node: u32, region_epoch| ReplicaWire {
        tier: tier as u8,
        node,
        region_epoch,
        slot: lake_dp::wire::message::SLOT_ANY,
        ..ReplicaWire::default()
    };
    let pull = |key, tier| Transfer {
        // The agent names the holder, its tier and the block's namespace.
        source: any(tier, 2, 77),
        target: any(Tier::L1Dram, 3, 0),
        key,
        deadline_unix_ns: 0,
        priority: Priority::CriticalLoad as u8,
        reserved: [0; 7],
    };
    node.on_agent(1, 1, &Message::CopyBlock(pull(key(1), Tier::L1Dram)), 0).unwrap();
    let pulls = node.take_pulls();
    assert_eq!(pulls.len(), 1);
    assert_eq!((pulls[0].target.region, pulls[0].target.region_epoch), (1, 5), "this node's L1");
    // No L3 here: a block held elsewhere only in L3 goes to the leader.
    node.on_agent(1, 2, &Message::CopyBlock(pull(key(2), Tier::L3Object)), 0).unwrap();
    assert_eq!(node.take_pulls().len(), 1);
    // With an L3 region, the data plane reads it by name: (namespace 77,
    // key) from the store, into any L1 slot; no pull goes to the leader.
    node.on_data_plane(0, &Message::RegisterRegion(region(9, Tier::L3Object, 5))).unwrap();
    node.on_agent(1, 3, &Message::CopyBlock(pull(key(3), Tier::L3Object)), 0).unwrap();
    assert!(node.take_pulls().is_empty());
    let mut commands = Vec::new();
    node.plan(1, &mut commands);
    let reads: Vec<(u64, Transfer)> = commands
        .iter()
        .filter_map(|c| match c.action {
            crate::tier::TierAction::Copy(t) if t.key == key(3) => Some((c.request, t)),
            _ => None,
        })
        .collect();
    assert_eq!(reads.len(), 1, "{commands:?}");
    let (request, read) = reads[0];
    assert_eq!((read.source.tier, read.source.region, read.source.region_epoch), (Tier::L3Object as u8, 9, 77));
    assert_eq!(read.source.slot, lake_dp::wire::message::SLOT_ANY);
    assert_eq!(
        (read.target.region, read.target.region_epoch, read.target.slot),
        (1, 5, lake_dp::wire::message::SLOT_ANY)
    );
    // The store lacks it: the pull goes to the leader after all.
    let done = lake_dp::wire::message::TransferDone {
        status: lake_dp::wire::message::ErrorCode::StaleGeneration as u32,
        reserved: 0,
        target: read.target,
        bytes: 0,
    };
    node.on_data_plane(request, &Message::TransferDone(done)).unwrap();
    let relayed = node.take_pulls();
    assert_eq!(relayed.len(), 1);
    assert_eq!((relayed[0].key, relayed[0].target.region), (key(3), 1));
    assert_eq!((node.store_reads_done, node.store_reads_failed), (0, 1));
}

/// Another node's L1 (region 1 there, epoch `region_epoch`), any slot:
/// where a copy or placement from here lands.
fn another_l1(node: u32, region_epoch: u64) -> ReplicaWire {
    ReplicaWire {
        tier: Tier::L1Dram as u8,
        node,
        region: 1,
        region_epoch,
        slot: lake_dp::wire::message::SLOT_ANY,
        ..ReplicaWire::default()
    }
}

#[test]
fn a_block_placed_in_its_home_becomes_a_copy_here_once_it_landed_there() {
    let mut node = Node::new(NodeId(3), 1, None);
    node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    node.on_data_plane(0, &Message::RegisterRegion(region(2, Tier::L2Nvme, 5))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(1, None, Tier::L1Dram, 1, 5, 0))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(2, None, Tier::L1Dram, 1, 5, 1))).unwrap();
    node.on_data_plane(0, &Message::BlockCommitted(block(4, None, Tier::L2Nvme, 2, 5, 0))).unwrap();
    let home = another_l1(4, 9);
    // Only a block in L1 here is placed: one demoted is not promoted for it.
    assert!(node.place_to(&key(4), home).is_err());
    let placed = node.place_to(&key(1), home).unwrap();
    let refused = node.place_to(&key(2), home).unwrap();
    let mut commands = Vec::new();
    node.plan(1, &mut commands);
    let copies: Vec<(u64, Transfer)> = commands
        .iter()
        .filter_map(|c| match c.action {
            crate::tier::TierAction::Copy(t) => Some((c.request, t)),
            _ => None,
        })
        .collect();
    assert_eq!(copies.len(), 2, "{commands:?}");
    for (_, copy) in &copies {
        assert_eq!(copy.priority, Priority::WriteBack as u8);
        assert_eq!((copy.source.tier, copy.source.region), (Tier::L1Dram as u8, 1));
        assert_eq!((copy.target.node, copy.target.region, copy.target.region_epoch), (4, 1, 9));
    }
    assert!(!node.tiers.is_pulled_in(&key(1)), "still the pool's copy until the home has it");
    let done = |status: u32| lake_dp::wire::message::TransferDone { status, reserved: 0, target: home, bytes: 0 };
    node.on_data_plane(placed, &Message::TransferDone(done(0))).unwrap();
    // The home refused the other (no room there): it stays the pool's here.
    node.on_data_plane(refused, &Message::TransferDone(done(lake_dp::wire::message::ErrorCode::NoSpace as u32)))
        .unwrap();
    assert!(node.tiers.is_pulled_in(&key(1)), "a copy now: dropped rather than written below");
    assert!(!node.tiers.is_pulled_in(&key(2)));
    assert_eq!((node.placed_away, node.copies_landed, node.copies_failed), (1, 1, 1));
    // Its room goes to the blocks this node keeps: dropped at once.
    assert_eq!(dropped_next(&mut node, 2), vec![key(1)]);
}

/// The blocks `node`'s next plan (at `now_ns`) drops.
fn dropped_next(node: &mut Node, now_ns: u64) -> Vec<BlockKey> {
    let mut commands = Vec::new();
    node.plan(now_ns, &mut commands);
    commands
        .iter()
        .filter_map(|c| match c.action {
            crate::tier::TierAction::Evict(e) => Some(e.key),
            _ => None,
        })
        .collect()
}

#[test]
fn where_pulls_move_blocks_the_readers_copy_is_the_pools_and_the_holders_goes_unless_chains_here_continue_it() {
    // Node 4's L1, where the reader pulls to.
    let reader = another_l1(4, 9);
    let done = |target| lake_dp::wire::message::TransferDone { status: 0, reserved: 0, target, bytes: 0 };
    // The holder: a pull's copy leaves its block a copy once it landed,
    // where the leader moves pulled blocks; else its block stays the pool's.
    let mut holder = Node::new(NodeId(3), 1, None);
    holder.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(1, None, Tier::L1Dram, 1, 5, 0))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(2, None, Tier::L1Dram, 1, 5, 1))).unwrap();
    holder.pulls_move = true;
    let moved = holder.copy_to(&key(1), reader, Priority::CriticalLoad).unwrap();
    holder.pulls_move = false;
    let copied = holder.copy_to(&key(2), reader, Priority::CriticalLoad).unwrap();
    let mut commands = Vec::new();
    holder.plan(1, &mut commands);
    assert_eq!(commands.iter().filter(|c| matches!(c.action, crate::tier::TierAction::Copy(_))).count(), 2);
    holder.on_data_plane(moved, &Message::TransferDone(done(reader))).unwrap();
    holder.on_data_plane(copied, &Message::TransferDone(done(reader))).unwrap();
    assert!(holder.tiers.is_pulled_in(&key(1)), "moved: a copy here now");
    assert!(!holder.tiers.is_pulled_in(&key(2)), "copied: still the pool's here");
    assert_eq!((holder.moved_to_readers, holder.placed_away, holder.copies_landed), (1, 0, 2));
    assert_eq!(dropped_next(&mut holder, 2), vec![key(1)]);

    // A shared prefix: block 3, which blocks 4 and 5 continue here, is
    // copied to its reader and stays the pool's here, where pulls move
    // blocks; block 4, continued by none, moves.
    holder.on_data_plane(0, &Message::BlockCommitted(block(3, None, Tier::L1Dram, 1, 5, 2))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(4, Some(3), Tier::L1Dram, 1, 5, 3))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(5, Some(3), Tier::L1Dram, 1, 5, 4))).unwrap();
    holder.pulls_move = true;
    let shared = holder.copy_to(&key(3), reader, Priority::CriticalLoad).unwrap();
    let tail = holder.copy_to(&key(4), reader, Priority::CriticalLoad).unwrap();
    holder.on_data_plane(shared, &Message::TransferDone(done(reader))).unwrap();
    holder.on_data_plane(tail, &Message::TransferDone(done(reader))).unwrap();
    assert!(!holder.tiers.is_pulled_in(&key(3)), "a shared prefix: still the pool's here");
    assert!(holder.tiers.is_pulled_in(&key(4)), "moved: a copy here now");
    assert_eq!((holder.moved_to_readers, holder.shared.kept, holder.copies_landed), (2, 1, 4));
    // A system prompt of two blocks, 6 then 7, which 8 and 9 continue:
    // block 6, continued by 7 alone, is shared too.
    holder.on_data_plane(0, &Message::BlockCommitted(block(6, None, Tier::L1Dram, 1, 5, 5))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(7, Some(6), Tier::L1Dram, 1, 5, 6))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(8, Some(7), Tier::L1Dram, 1, 5, 7))).unwrap();
    let before = holder.copy_to(&key(6), reader, Priority::CriticalLoad).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(9, Some(7), Tier::L1Dram, 1, 5, 8))).unwrap();
    let after = holder.copy_to(&key(6), reader, Priority::CriticalLoad).unwrap();
    holder.on_data_plane(after, &Message::TransferDone(done(reader))).unwrap();
    // Asked while one chain continued it, landed once two did: what holds
    // when it lands decides.
    holder.on_data_plane(before, &Message::TransferDone(done(reader))).unwrap();
    assert!(!holder.tiers.is_pulled_in(&key(6)), "above a shared block: still the pool's here");
    assert_eq!((holder.moved_to_readers, holder.shared.kept, holder.copies_landed), (2, 3, 6));

    // The reader: the block it pulled is its own where pulls move blocks,
    // a copy (first to go) where they do not.
    let mut reader = Node::new(NodeId(3), 1, None);
    reader.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 9))).unwrap();
    let pull = |key| Transfer {
        source: ReplicaWire { tier: Tier::L1Dram as u8, node: 2, ..ReplicaWire::default() },
        target: another_l1(3, 0),
        key,
        deadline_unix_ns: 0,
        priority: Priority::CriticalLoad as u8,
        reserved: [0; 7],
    };
    reader.pulls_move = true;
    reader.on_agent(1, 1, &Message::CopyBlock(pull(key(1))), 0).unwrap();
    reader.on_data_plane(0, &Message::BlockCommitted(block(1, None, Tier::L1Dram, 1, 9, 0))).unwrap();
    reader.pulls_move = false;
    reader.on_agent(1, 2, &Message::CopyBlock(pull(key(2))), 0).unwrap();
    reader.on_data_plane(0, &Message::BlockCommitted(block(2, None, Tier::L1Dram, 1, 9, 1))).unwrap();
    assert_eq!(reader.take_pulls().len(), 2);
    assert!(!reader.tiers.is_pulled_in(&key(1)), "moved here: the pool's copy");
    assert!(reader.tiers.is_pulled_in(&key(2)), "copied here: a copy");
}

#[test]
fn a_pulled_block_landing_before_its_pulled_parent_waits_for_it_so_the_chain_stays_one_chain() {
    let mut reader = Node::new(NodeId(3), 1, None);
    reader.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 9))).unwrap();
    reader.pulls_move = true;
    let pull = |key| pull_into_node_3(key, 0);
    // An engine pulls the chain 1 → 2 → 3 (and 5, whose parent 4 it does
    // not pull); the copies land last first.
    for k in [1, 2, 3, 5] {
        reader.on_agent(1, u64::from(k), &Message::CopyBlock(pull(key(k))), 0).unwrap();
    }
    reader.on_data_plane(0, &Message::BlockCommitted(block(3, Some(2), Tier::L1Dram, 1, 9, 2))).unwrap();
    reader.on_data_plane(0, &Message::BlockCommitted(block(2, Some(1), Tier::L1Dram, 1, 9, 1))).unwrap();
    assert_eq!(reader.waiting(), 2, "each waits for its parent, still being pulled");
    reader.on_data_plane(0, &Message::BlockCommitted(block(1, None, Tier::L1Dram, 1, 9, 0))).unwrap();
    assert_eq!(reader.waiting(), 0);
    let index = &reader.locations.index;
    let at = |k| index.get(&key(k)).unwrap();
    assert_eq!(index.parent(at(3)), Some(at(2)));
    assert_eq!(index.parent(at(2)), Some(at(1)));
    assert!(!index.is_leaf(at(1)) && !index.is_leaf(at(2)), "the chain's front is no leaf");
    // A block whose parent is pulled by none is a root at once.
    reader.on_data_plane(0, &Message::BlockCommitted(block(5, Some(4), Tier::L1Dram, 1, 9, 4))).unwrap();
    assert_eq!((reader.waiting(), reader.counters.rooted), (0, 1));
}

#[test]
fn a_copy_refused_for_want_of_a_slot_is_asked_again_within_a_quarter_millisecond_then_less_often() {
    use super::copy::{COPY_AGAIN_FIRST_NS, COPY_AGAIN_NS};
    let target = another_l1(4, 9);
    let full = lake_dp::wire::message::TransferDone {
        status: lake_dp::wire::message::ErrorCode::QueueFull as u32,
        reserved: 0,
        target,
        bytes: 0,
    };
    let mut holder = Node::new(NodeId(3), 1, None);
    holder.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
    holder.on_data_plane(0, &Message::BlockCommitted(block(1, None, Tier::L1Dram, 1, 5, 0))).unwrap();
    let request = holder.copy_to(&key(1), target, Priority::CriticalLoad).unwrap();
    let mut commands = Vec::new();
    holder.plan(1, &mut commands);
    assert_eq!(holder.copy_again_due(), None, "nothing refused yet");
    let mut waits = Vec::new();
    for _ in 0..6 {
        let before = super::unix_ns();
        holder.on_data_plane(request, &Message::TransferDone(full)).unwrap();
        let after = super::unix_ns();
        let due = holder.copy_again_due().expect("a refused copy waits to be asked again");
        assert!(due >= before, "due {due} before the refusal {before}");
        waits.push((due - before, due - after));
        // Not asked before it is due; asked once it is.
        commands.clear();
        holder.plan(1, &mut commands);
        let asked = commands.iter().filter(|c| c.request == request).count();
        if super::unix_ns() < due {
            assert_eq!(asked, 0, "asked again before its wait was over");
        }
        while super::unix_ns() < due {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        commands.clear();
        holder.plan(1, &mut commands);
        assert_eq!(commands.iter().filter(|c| c.request == request).count(), 1, "not asked again once due");
        assert_eq!(holder.copy_again_due(), None, "at the data plane again, it waits for nothing");
    }
    // The first wait a quarter millisecond, each next one twice the last,
    // up to 2 ms.
    let expected = [1, 2, 4, 8, 8, 8].map(|k| (COPY_AGAIN_FIRST_NS * k).min(COPY_AGAIN_NS));
    for ((at_most, at_least), expected) in waits.iter().zip(expected) {
        assert!((*at_least..=*at_most).contains(&expected), "waits {waits:?}, expected {expected} in each");
    }
    assert_eq!(holder.copies_asked_again, 6);
}

#[test]
fn in_a_pool_keeping_tenants_apart_an_engine_pulls_only_its_own_partitions_namespaces() {
    let scratch = Scratch(format!("/dev/shm/lake-test-node-tenant-pulls-{}", std::process::id()).into());
    let tenant = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(scratch.0.clone()), 100)).unwrap();
    // Tenant acme (namespace 0xa1) is uid 1001's; namespace 0xc1 is the
    // pool's.
    let partitions =
        lake_dp::runner::config::Partitions { each: vec![(vec![0xa1], vec![1001], Vec::new())], mirrors: Vec::new() };
    let serving = || {
        let mut node = Node::new(NodeId(3), 1, None);
        node.on_data_plane(0, &Message::RegisterRegion(region(1, Tier::L1Dram, 5))).unwrap();
        node
    };
    let mut node = serving().with_tenant_mirrors(vec![(vec![0xa1], tenant)]).with_tenant_engines(partitions);
    let pull = pull_into_node_3;
    // Connection 1 is acme's engine, connection 2 another user's.
    node.engine_came(1, 1001, 1001);
    node.engine_came(2, 1002, 1002);
    node.on_agent(1, 1, &Message::CopyBlock(pull(key(1), 0xa1)), 0).unwrap();
    node.on_agent(2, 2, &Message::CopyBlock(pull(key(2), 0xc1)), 0).unwrap();
    assert!(node.on_agent(1, 3, &Message::CopyBlock(pull(key(3), 0xc1)), 0).is_err(), "the pool's, asked by acme");
    assert!(node.on_agent(2, 4, &Message::CopyBlock(pull(key(4), 0xa1)), 0).is_err(), "acme's, asked by another");
    let pulled: Vec<BlockKey> = node.take_pulls().iter().map(|p| p.key).collect();
    assert_eq!(pulled, [key(1), key(2)]);
    assert_eq!(node.pulls_refused, 2);
    // Its connection gone, a tenant's engine's id is no one's.
    node.engine_gone(1);
    assert!(node.on_agent(1, 5, &Message::CopyBlock(pull(key(5), 0xa1)), 0).is_err());

    // A node keeping tenants apart but not told whose engines are whose
    // takes no pull; one keeping none apart takes every one.
    let scratch_two = Scratch(format!("/dev/shm/lake-test-node-tenant-pulls-2-{}", std::process::id()).into());
    let tenant =
        MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(scratch_two.0.clone()), 100)).unwrap();
    let mut untold = serving().with_tenant_mirrors(vec![(vec![0xa1], tenant)]);
    untold.engine_came(1, 1001, 1001);
    assert!(untold.on_agent(1, 1, &Message::CopyBlock(pull(key(1), 0xa1)), 0).is_err());
    let mut plain = serving();
    plain.engine_came(1, 1001, 1001);
    plain.on_agent(1, 1, &Message::CopyBlock(pull(key(1), 0xa1)), 0).unwrap();
    assert_eq!(plain.take_pulls().len(), 1);
}
