use super::*;
use lake_dp::NodeId;

const SLOT: u64 = 1024;

fn key(i: u8) -> BlockKey {
    BlockKey([i; 16])
}

/// A node with L1 (region 0) and L2 (region 1), ten slots each.
struct World {
    locations: Locations,
    leases: Leases,
    tiers: Tiers,
    next_slot: u32,
}

impl World {
    fn new(config: TierConfig) -> Self {
        let mut world =
            Self { locations: Locations::new(1), leases: Leases::new(), tiers: Tiers::new(config), next_slot: 0 };
        for (region, tier) in [(0, Tier::L1Dram), (1, Tier::L2Nvme)] {
            world.locations.register_region(region, tier, NodeId(0), 5).unwrap();
            world.tiers.register(region, tier, 0, 5, SLOT, 10);
        }
        world
    }

    /// Block `k` (under `parent`) of `namespace` lands in `region`.
    fn add(&mut self, region: u16, namespace: u64, parent: Option<u8>, k: u8) {
        self.next_slot += 1;
        let parent = parent.map(key);
        self.locations.adopt(parent, key(k), ObjectKind::KvBlock, region, 5, self.next_slot, 1).unwrap();
        self.tiers.added(region, namespace, parent, key(k), ObjectKind::KvBlock, true, 0);
    }

    /// With an L3 region (9) too, and L2 holding blocks 1..=9 (over its
    /// mark of 80%, to come down to 50%; LRU).
    fn with_l3(config: TierConfig) -> Self {
        let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..config };
        let mut world = Self::new(config);
        world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
        world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
        for k in 1..=9 {
            world.add(1, 7, None, k);
        }
        world
    }

    /// L1 taking marks, L2 at its 80% mark (8 of 10 blocks): an L1
    /// victim would be dropped (LRU).
    fn l2_at_its_mark() -> Self {
        let config = TierConfig { high_percent: 80, low_percent: 60, policy: PolicyKind::Lru, ..TierConfig::default() };
        let mut world = Self::new(config);
        world.tiers.takes_marks(0);
        for k in 1..=8 {
            world.add(1, 7, None, 100 + k);
        }
        world
    }

    fn plan(&mut self) -> Vec<TierCommand> {
        let mut out = Vec::new();
        self.tiers.plan(&self.locations, &self.leases, 0, &mut out);
        self.tiers.assert_invariants();
        out
    }

    /// The parent the index has for `key`.
    fn parent_of(&self, key: &BlockKey) -> Option<BlockKey> {
        let index = &self.locations.index;
        index.get(key).and_then(|b| index.parent(b)).map(|p| index.key(p))
    }

    /// The data plane carried `command` out.
    fn carry_out(&mut self, command: &TierCommand) {
        match command.action {
            TierAction::Move(transfer) if transfer.source.tier == 2 && transfer.target.tier == 2 => {
                // A block moving off a drained region: the data plane
                // reports the copy, then frees the source.
                let source = Replica::from_wire(&transfer.source).unwrap();
                self.next_slot += 1;
                let target = transfer.target.region;
                self.locations.adopt(None, transfer.key, ObjectKind::KvBlock, target, 5, self.next_slot, 1).unwrap();
                self.tiers.added(target, 7, None, transfer.key, ObjectKind::KvBlock, true, 0);
                self.locations.remove(&transfer.key, source.region.0).unwrap();
                self.tiers.removed(source.region.0, &transfer.key);
            }
            TierAction::Move(transfer) => {
                let source = Replica::from_wire(&transfer.source).unwrap();
                let parent = self.parent_of(&transfer.key);
                self.next_slot += 1;
                self.locations.adopt(parent, transfer.key, ObjectKind::KvBlock, 1, 5, self.next_slot, 1).unwrap();
                self.tiers.added(1, 7, parent, transfer.key, ObjectKind::KvBlock, true, 0);
                self.locations.remove(&transfer.key, source.region.0).unwrap();
                self.tiers.removed(source.region.0, &transfer.key);
            }
            TierAction::Evict(evict) => {
                self.locations.remove(&evict.key, evict.replica.region).unwrap();
                self.tiers.removed(evict.replica.region, &evict.key);
            }
            // Write-backs, the block's copy in its source kept.
            TierAction::Copy(transfer) => {
                let parent = self.parent_of(&transfer.key);
                self.next_slot += 1;
                let target = transfer.target.region;
                self.locations.adopt(parent, transfer.key, ObjectKind::KvBlock, target, 5, self.next_slot, 1).unwrap();
                self.tiers.added(target, 7, parent, transfer.key, ObjectKind::KvBlock, true, 0);
            }
            TierAction::Drain(_)
            | TierAction::Cancel
            | TierAction::Mark(_)
            | TierAction::Unmark(_)
            | TierAction::VictimsLeft(_) => {}
        }
        self.tiers.done(command.request, true);
    }
}

fn keys_of(commands: &[TierCommand]) -> Vec<(u8, &'static str)> {
    commands
        .iter()
        .map(|c| match c.action {
            TierAction::Move(t) => (t.key.0[0], "move"),
            TierAction::Evict(e) => (e.key.0[0], "evict"),
            TierAction::Copy(t) => (t.key.0[0], "copy"),
            TierAction::Drain(d) => (u8::try_from(d.region).unwrap_or(u8::MAX), "drain"),
            TierAction::Cancel => (0, "cancel"),
            TierAction::Mark(m) => (m.key.0[0], "mark"),
            TierAction::Unmark(m) => (m.key.0[0], "unmark"),
            TierAction::VictimsLeft(v) => (v.left, "victims_left"),
        })
        .collect()
}

/// The blocks `out` marks evictable, in order.
fn marks(out: &[TierCommand]) -> Vec<u8> {
    out.iter()
        .filter_map(|c| match c.action {
            TierAction::Mark(m) => Some(m.key.0[0]),
            _ => None,
        })
        .collect()
}

/// Found by the eager write-back over a 16-slot L1 (a stall
/// about one run in 13): an L1 victim whose copy to L3 was in flight
/// was taken for one on its way out and dropped from L1's cache while
/// it stayed in L1; once every block there was so, nothing in L1 could
/// be evicted again and saves stopped.
#[test]
fn a_victim_being_copied_stays_in_its_tiers_cache_and_goes_once_copied() {
    let config = TierConfig {
        high_percent: 80,
        low_percent: 50,
        policy: PolicyKind::Lru,
        l3_write_back: L3WriteBack::Eager,
        ..TierConfig::default()
    };
    let mut world = World::new(config);
    world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
    world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
    for k in 1..=9 {
        world.add(0, 7, None, k);
    }
    // L1 is over its mark, but every block's copy to L3 is asked first:
    // none may go while it is read, and none is forgotten.
    let commands = world.plan();
    assert_eq!(commands.len(), 9, "{:?}", keys_of(&commands));
    assert!(commands.iter().all(|c| matches!(c.action, TierAction::Copy(_))));
    assert!(world.tiers.counters.copying_kept > 0);
    assert!(
        (1..=9).all(|k| world.tiers.tracked(&key(k)).iter().any(|&(t, _, _)| t == Tier::L1Dram)),
        "a block being copied left L1's cache"
    );
    for command in &commands {
        world.carry_out(command);
    }
    // Copied: the coldest now leave L1 down to its low mark (demoted:
    // L2 has room; the block passed over first counts as touched).
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(2, "move"), (3, "move"), (4, "move"), (5, "move")]);
}

#[test]
fn a_data_plane_is_told_when_no_more_l1_victims_can_come_and_when_they_can() {
    // L2 nearly full (no room to write a victim below, so victims are
    // dropped) and L1 90% full of blocks saved just now: nothing may be
    // marked (a save's own blocks are not its victims), nothing is on
    // its way out.
    let config = TierConfig { high_percent: 95, low_percent: 80, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    world.tiers.takes_marks(0);
    for k in 1..=9 {
        world.add(1, 7, None, 100 + k);
    }
    for k in 1..=9 {
        world.add(0, 7, (k > 1).then(|| k - 1), k);
    }
    let told = |commands: &[TierCommand]| -> Vec<u8> {
        commands
            .iter()
            .filter_map(|c| match c.action {
                TierAction::VictimsLeft(v) => {
                    assert_eq!((c.region, v.region), (0, 0));
                    Some(v.left)
                }
                _ => None,
            })
            .collect()
    };
    let mut out = Vec::new();
    world.tiers.plan(&world.locations, &world.leases, 1, &mut out);
    assert_eq!(told(&out), [0], "{:?}", keys_of(&out));
    assert!(!out.iter().any(|c| matches!(c.action, TierAction::Mark(_))));
    // Said once, not every pass.
    out.clear();
    world.tiers.plan(&world.locations, &world.leases, 2, &mut out);
    assert!(told(&out).is_empty(), "{:?}", keys_of(&out));
    // A while later the blocks are no longer new: the coldest leaf is
    // marked to be dropped, and the data plane told victims come again.
    out.clear();
    world.tiers.plan(&world.locations, &world.leases, 1 + MARK_AFTER_NS + 1, &mut out);
    assert!(out.iter().any(|c| matches!(c.action, TierAction::Mark(_))), "{:?}", keys_of(&out));
    assert_eq!(told(&out), [1], "{:?}", keys_of(&out));
}

#[test]
fn an_l1_over_its_mark_whose_victims_would_be_dropped_still_marks_them() {
    // L1 90% full (over its 80% mark) of blocks no longer new, L2 at
    // its mark (no room for one more): L1's evictions drop nothing
    // ahead of a save's need, so room comes only from victims marked
    // for saves to take. Without them L1 stood full and every save was
    // refused.
    let mut world = World::l2_at_its_mark();
    for k in 1..=9 {
        world.add(0, 7, (k > 1).then(|| k - 1), k);
    }
    let mut out = Vec::new();
    world.tiers.plan(&world.locations, &world.leases, 1 + MARK_AFTER_NS + 1, &mut out);
    let marked = marks(&out);
    assert!(!marked.is_empty(), "nothing marked: {:?}", keys_of(&out));
    assert_eq!(marked[0], 9, "the chain's leaf first: {:?}", keys_of(&out));
    assert!(!out.iter().any(|c| matches!(c.action, TierAction::Evict(_))), "nothing dropped ahead of need");
}

#[test]
fn failed_commands_are_counted_by_why() {
    let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    for k in 1..=9 {
        world.add(0, 7, None, k);
    }
    let commands = world.plan();
    assert_eq!(commands.len(), 4);
    let code = lake_dp::wire::message::ErrorCode::NoSpace as u32;
    world.tiers.refused(commands[0].request, code);
    world.tiers.refused(commands[1].request, 99);
    world.tiers.unrouted(commands[2].request);
    world.tiers.lost_regions(&[0]);
    // Answered twice: counted once.
    world.tiers.refused(commands[0].request, code);
    let c = world.tiers.counters;
    assert_eq!((c.refused[code as usize], c.refused[0], c.unrouted, c.link_lost), (1, 1, 1, 1), "{c:?}");
    assert_eq!(c.failed, 4);
    assert_eq!(c.failed, c.refused.iter().sum::<u64>() + c.unrouted + c.link_lost + c.timed_out);
}

/// L1 over its mark, its one victim (the leaf of a chain) among blocks
/// queued to be written to L2 while they stay in L1. Each such write
/// stages its block in a free L1 slot, of which there is none: asked, it
/// is refused for want of one and asked again, pass after pass — and a
/// block being written is no victim, so the eviction that would free a
/// slot never comes. None is asked while L1 is over its mark and its
/// evictions make room.
#[test]
fn l1s_evictions_go_ahead_of_write_backs_that_need_a_free_l1_slot() {
    let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    // L1 full (ten of ten), blocks 1 and 2 in L2 too: eight to write.
    for k in 1..=10 {
        world.add(0, 7, (k > 1).then(|| k - 1), k);
    }
    for k in 1..=2 {
        world.add(1, 7, (k > 1).then(|| k - 1), k);
    }
    assert_eq!(world.tiers.persist(&world.locations, None), 8);
    let no_slot = lake_dp::wire::message::ErrorCode::NoSpace as u32;
    for _ in 0..3 {
        for command in world.plan() {
            match command.action {
                TierAction::Copy(_) if world.tiers.usage(Tier::L1Dram).blocks == 10 => {
                    world.tiers.refused(command.request, no_slot);
                }
                _ => world.carry_out(&command),
            }
        }
    }
    // Down to its low mark, leaf first; then the three left in L1 only
    // written below, none asked while there was no slot to stage it in.
    let c = world.tiers.counters;
    assert_eq!((c.demotions, world.tiers.usage(Tier::L1Dram).blocks), (5, 5), "{c:?}");
    assert_eq!((c.l2_write_backs, c.write_backs_deferred), (3, 0), "{c:?}");
}

#[test]
fn a_drained_l2_region_is_announced_then_emptied_into_the_others() {
    let mut world = World::new(TierConfig { policy: PolicyKind::Lru, ..TierConfig::default() });
    // A second L2 file (region 2) and an object store (region 9).
    for (region, tier, slots) in [(2, Tier::L2Nvme, 10), (9, Tier::L3Object, 100)] {
        world.locations.register_region(region, tier, NodeId(0), 5).unwrap();
        world.tiers.register(region, tier, 0, 5, SLOT, slots);
    }
    world.tiers.name_region(1, "/disk/a/l2-0");
    for k in 1..=5 {
        world.add(1, 7, None, k);
    }
    // Block 5 is in L3 too.
    world.locations.adopt(None, key(5), ObjectKind::KvBlock, 9, 5, 99, 1).unwrap();
    world.tiers.added(9, 7, None, key(5), ObjectKind::KvBlock, true, 0);
    world.add(2, 7, None, 6);
    assert_eq!(world.tiers.capacity(Tier::L2Nvme), 20 * SLOT);

    assert!(world.tiers.drain(0).unwrap_err().contains("not an L2 file"));
    assert!(world.tiers.drain(42).unwrap_err().contains("no region 42"));
    world.tiers.drain(1).unwrap();
    // Its room is no longer the tier's.
    assert_eq!(world.tiers.capacity(Tier::L2Nvme), 10 * SLOT);
    // The data plane is told first; nothing moves before it took it.
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(1, "drain")]);
    let TierAction::Drain(told) = commands[0].action else { unreachable!() };
    assert_eq!((commands[0].region, told.draining), (1, 1));
    assert!(world.plan().is_empty(), "asked once while in flight");
    assert!(!world.tiers.drains()[0].announced);
    world.tiers.done(commands[0].request, true);

    // Blocks only there move to region 2; block 5, which L3 holds, is
    // dropped from it.
    let mut commands = world.plan();
    commands.sort_unstable_by_key(|c| keys_of(core::slice::from_ref(c))[0]);
    assert_eq!(keys_of(&commands), vec![(1, "move"), (2, "move"), (3, "move"), (4, "move"), (5, "evict")]);
    for command in &commands[..4] {
        let TierAction::Move(t) = command.action else { unreachable!() };
        assert_eq!((t.source.region, t.target.tier, t.target.region, t.target.slot), (1, 2, 2, SLOT_ANY));
    }
    assert!(world.plan().is_empty(), "each asked once");
    assert_eq!(world.tiers.drains()[0].blocks_left, 5);
    assert!(!world.tiers.drains()[0].done);
    for command in &commands {
        world.carry_out(command);
    }
    let drain = &world.tiers.drains()[0];
    assert_eq!((drain.blocks_left, drain.moved, drain.dropped, drain.done), (0, 4, 1, true), "{drain:?}");
    let regions = world.tiers.regions();
    let l2: Vec<(u16, u64, bool)> =
        regions.iter().filter(|r| r.tier == Tier::L2Nvme).map(|r| (r.region, r.blocks, r.draining)).collect();
    assert_eq!(l2, vec![(1, 0, true), (2, 5, false)]);
    assert_eq!(regions[1].name, "/disk/a/l2-0");
    // The moved blocks are still L2's, block 5 L3's alone.
    assert!(world.tiers.tracked(&key(3)).iter().any(|&(t, _, _)| t == Tier::L2Nvme));
    assert!(!world.tiers.tracked(&key(5)).iter().any(|&(t, _, _)| t == Tier::L2Nvme));
    assert_eq!(world.tiers.counters.drain_moves, 4);

    // Used again: its data plane is told, its room counted again.
    world.tiers.undrain(1).unwrap();
    assert!(world.tiers.undrain(1).is_err());
    assert_eq!(world.tiers.capacity(Tier::L2Nvme), 20 * SLOT);
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(1, "drain")]);
    let TierAction::Drain(told) = commands[0].action else { unreachable!() };
    assert_eq!(told.draining, 0);
}

#[test]
fn a_drain_the_data_plane_refused_is_asked_again_later_and_moves_nothing_meanwhile() {
    let mut world = World::new(TierConfig::default());
    world.locations.register_region(2, Tier::L2Nvme, NodeId(0), 5).unwrap();
    world.tiers.register(2, Tier::L2Nvme, 0, 5, SLOT, 10);
    world.add(1, 7, None, 1);
    world.tiers.drain(1).unwrap();
    let commands = world.plan();
    world.tiers.drain_refused(1, "its lake-dp does not drain (an older build)");
    world.tiers.done(commands[0].request, false);
    let drain = &world.tiers.drains()[0];
    assert_eq!(drain.refused.as_deref(), Some("its lake-dp does not drain (an older build)"));
    assert!(!drain.announced && !drain.done);
    assert!(world.plan().is_empty(), "not again within the retry wait, and no block moved");
    let mut out = Vec::new();
    world.tiers.plan(&world.locations, &world.leases, DRAIN_RETRY_NS, &mut out);
    assert_eq!(keys_of(&out), vec![(1, "drain")]);
    // A data plane that restarted forgets the drain: told again.
    world.tiers.done(out[0].request, true);
    assert!(world.tiers.drains()[0].announced);
    world.tiers.register(1, Tier::L2Nvme, 0, 6, SLOT, 10);
    assert!(!world.tiers.drains()[0].announced);
}

#[test]
fn above_high_water_the_coldest_leaves_are_demoted_then_dropped() {
    let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    // A chain 1..=9 in L1: 9 of 10 slots, above 80%.
    world.add(0, 7, None, 1);
    for k in 2..=9 {
        world.add(0, 7, Some(k - 1), k);
    }
    let commands = world.plan();
    // Down to 50% (5 blocks): the chain's tail goes, leaf first,
    // demoted because L2 holds none of it.
    assert_eq!(keys_of(&commands), vec![(9, "move"), (8, "move"), (7, "move"), (6, "move")]);
    for command in &commands {
        let TierAction::Move(t) = command.action else { unreachable!() };
        assert_eq!((t.target.tier, t.target.slot, t.priority), (2, SLOT_ANY, Priority::Demotion as u8));
    }
    // In flight, they count as gone: no second ask.
    assert!(world.plan().is_empty());
    assert_eq!(world.tiers.usage(Tier::L1Dram).pending_bytes, 4 * SLOT);
    for command in &commands {
        world.carry_out(command);
    }
    assert_eq!(world.tiers.usage(Tier::L1Dram).bytes, 5 * SLOT);
    assert_eq!(world.tiers.usage(Tier::L2Nvme).bytes, 4 * SLOT);
    // Promoted back (a hit), block 9 is in both tiers; the coldest when
    // L1 fills again, it is dropped from L1, not written again.
    world.add(0, 7, Some(8), 9);
    for k in 20..24 {
        world.add(0, 7, None, k);
    }
    world.tiers.accessed(7, &[key(1), key(2), key(3), key(4), key(5), key(20), key(21), key(22), key(23)]);
    let commands = world.plan();
    assert_eq!(keys_of(&commands)[0], (9, "evict"), "{:?}", keys_of(&commands));
    assert_eq!(world.tiers.counters.drops[Tier::L1Dram as usize], 1);
}

#[test]
fn l1_blocks_of_several_size_classes_count_at_their_own_bytes() {
    let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    // Four blocks of a class twice the smallest (say another model's
    // layout) in the 10-slot L1, and one smaller than a slot (it takes
    // one all the same): 9 slots' bytes, over the mark.
    for k in 1..=4 {
        world.next_slot += 1;
        world.locations.adopt(None, key(k), ObjectKind::KvBlock, 0, 5, world.next_slot, 1).unwrap();
        world.tiers.added(0, 7, None, key(k), ObjectKind::KvBlock, true, 2 * SLOT);
    }
    world.next_slot += 1;
    world.locations.adopt(None, key(5), ObjectKind::KvBlock, 0, 5, world.next_slot, 1).unwrap();
    world.tiers.added(0, 7, None, key(5), ObjectKind::KvBlock, true, SLOT / 2);
    let usage = world.tiers.usage(Tier::L1Dram);
    assert_eq!((usage.bytes, usage.blocks), (9 * SLOT, 5));
    let commands = world.plan();
    // What the victims free is their own bytes: down to 50% and no
    // further (two large blocks and at most the small one).
    let freed = world.tiers.usage(Tier::L1Dram).pending_bytes;
    let victims = commands.len() as u64;
    assert!((4 * SLOT..=5 * SLOT).contains(&freed), "{victims} victims free {freed}");
    for command in &commands {
        world.carry_out(command);
    }
    let usage = world.tiers.usage(Tier::L1Dram);
    assert_eq!(usage.bytes, 9 * SLOT - freed);
    assert_eq!(usage.blocks, 5 - victims);
    assert_eq!(world.tiers.regions()[0].blocks, 5 - victims);
}

#[test]
fn a_namespace_over_its_quota_gives_up_its_own_blocks() {
    let config = TierConfig {
        quotas: vec![Quota { namespace: 2, tier: Tier::L1Dram, bytes: 2 * SLOT }],
        policy: PolicyKind::Lru,
        ..TierConfig::default()
    };
    let mut world = World::new(config);
    world.add(0, 1, None, 1);
    world.add(0, 2, None, 2);
    world.add(0, 2, None, 3);
    world.add(0, 2, None, 4);
    // The tier is far from full; namespace 2 is one over its quota. In L1
    // it goes down to a slot below it, so its next save fits.
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(2, "move"), (3, "move")]);
    for command in &commands {
        world.carry_out(command);
    }
    // That save fits; then its coldest makes room for the next.
    world.add(0, 2, None, 5);
    assert_eq!(keys_of(&world.plan()), vec![(4, "move")]);
}

#[test]
fn a_tenant_over_its_quota_gives_up_blocks_of_its_largest_namespace() {
    let tenant = TenantQuota { tenant: "acme".into(), namespaces: vec![2, 3], tier: Tier::L1Dram, bytes: 3 * SLOT };
    let config = TierConfig { tenant_quotas: vec![tenant], policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    // Namespace 1 is another tenant's, far larger, and left alone.
    for k in 1..=5 {
        world.add(0, 1, None, k);
    }
    // Acme: namespace 2 holds three, namespace 3 two — five against a
    // quota of three, though neither namespace alone is over it.
    world.add(0, 2, None, 10);
    world.add(0, 2, None, 11);
    world.add(0, 2, None, 12);
    world.add(0, 3, None, 20);
    world.add(0, 3, None, 21);
    let commands = world.plan();
    // The largest first (namespace 2's coldest), then, even at two
    // each, namespace 3's (the larger id among equals), then namespace
    // 2's again: in L1 down to a slot below the quota, so the tenant's
    // next save fits.
    assert_eq!(keys_of(&commands), vec![(10, "move"), (20, "move"), (11, "move")]);
    assert_eq!(world.tiers.counters.tenant_quota_evictions, 3);
    // What is on its way out counts as gone.
    assert_eq!(world.tiers.tenant_usage(), vec![("acme", Tier::L1Dram, 2 * SLOT, 3 * SLOT)]);
    for command in &commands {
        world.carry_out(command);
    }
    assert!(world.plan().is_empty(), "under its quota: nothing more");
}

#[test]
fn a_purged_namespace_loses_every_replica_in_every_tier_and_the_purge_ends() {
    let config = TierConfig { policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
    world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
    // Namespace 7 in L1, L2 and L3; namespace 8 in L1.
    world.add(0, 7, None, 40);
    world.add(0, 7, Some(40), 41);
    world.add(1, 7, None, 42);
    world.add(9, 7, None, 43);
    world.add(9, 7, None, 40);
    world.add(0, 8, None, 50);
    let before = world.tiers.namespaces();
    let held = |n: u64| before.iter().find(|(ns, _)| *ns == n).map(|(_, b)| *b).unwrap_or_default();
    assert!(held(7).iter().sum::<u64>() > 0 && held(8)[Tier::L1Dram as usize] > 0);
    world.tiers.purge(7);
    world.tiers.purge(7);
    assert_eq!((world.tiers.purging(), world.tiers.counters.purges_started), (&[7][..], 1));
    let commands = world.plan();
    assert!(!commands.is_empty());
    for command in &commands {
        assert!(matches!(command.action, TierAction::Evict(_)), "{command:?}");
        world.carry_out(command);
    }
    // Nothing of namespace 7 anywhere; namespace 8 untouched.
    for tier in [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object] {
        assert_eq!(world.tiers.namespace_bytes(tier, 7), 0, "{tier:?}");
    }
    assert_eq!(world.tiers.namespace_bytes(Tier::L1Dram, 8), held(8)[Tier::L1Dram as usize]);
    assert_eq!(world.tiers.counters.purged, commands.len() as u64);
    assert!(world.plan().is_empty());
    assert_eq!((world.tiers.purging(), world.tiers.counters.purges_done), (&[][..], 1));
}

#[test]
fn the_second_access_filter_writes_only_blocks_seen_twice_to_l2() {
    let config = TierConfig {
        high_percent: 80,
        low_percent: 50,
        policy: PolicyKind::Lru,
        l2_admission: L2Admission::SecondAccess,
        ..TierConfig::default()
    };
    let mut world = World::new(config);
    for k in 1..=9 {
        world.add(0, 7, None, k);
    }
    // Blocks 2 and 4 were hit after their save; the others never.
    for k in [2, 4] {
        world.tiers.accessed(7, &[key(k)]);
        world.tiers.reused(&[key(k)]);
    }
    // 9 of 10 slots, down to 5: the four coldest (LRU: 1, 3, 5, 6) go,
    // each used once, so dropped rather than written to L2.
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(1, "evict"), (3, "evict"), (5, "evict"), (6, "evict")]);
    assert_eq!((world.tiers.counters.l2_filtered, world.tiers.counters.demotions), (4, 0));
    for command in &commands {
        world.carry_out(command);
    }
    // Block 1 saved again: its second life. Then 10..=12, and a
    // request touching all but 1 (only 2 and 4 of it hits).
    world.add(0, 7, None, 1);
    for k in 10..=12 {
        world.add(0, 7, None, k);
    }
    let touched: Vec<BlockKey> = [2, 4, 7, 8, 9, 10, 11, 12].map(key).to_vec();
    world.tiers.accessed(7, &touched);
    world.tiers.reused(&[key(2), key(4)]);
    // Four victims again: those seen twice (1, 2, 4) are written, the
    // others dropped.
    let commands = keys_of(&world.plan());
    assert_eq!(commands.len(), 4);
    assert_eq!(commands[0], (1, "move"), "{commands:?}");
    for &(k, action) in &commands {
        assert_eq!(action, if [1, 2, 4].contains(&k) { "move" } else { "evict" }, "{commands:?}");
    }
    let moves = commands.iter().filter(|(_, a)| *a == "move").count() as u64;
    assert_eq!((world.tiers.counters.l2_filtered, world.tiers.counters.demotions), (4 + 4 - moves, moves));
}

#[test]
fn a_leased_replica_is_passed_over_and_a_failed_command_puts_its_block_back() {
    let config = TierConfig { high_percent: 80, low_percent: 70, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    for k in 1..=9 {
        world.add(0, 7, None, k);
    }
    // A reader holds block 1 (the coldest) under a lease.
    let replica = |locations: &Locations, k: &BlockKey| locations.ready(k).next();
    world.leases.grant(1, 1, [key(1)], |k| replica(&world.locations, k), 1000, 0);
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(2, "move"), (3, "move")]);
    assert!(world.tiers.counters.leased_kept > 0);
    // The data plane could not do the first: the block is back (as the
    // most recent, so a refusal is not retried at once).
    world.tiers.done(commands[0].request, false);
    world.carry_out(&commands[1]);
    assert_eq!(world.tiers.counters.failed, 1);
    assert_eq!(world.tiers.usage(Tier::L1Dram).bytes, 8 * SLOT);
    world.add(0, 7, None, 10);
    let again = world.plan();
    assert_eq!(keys_of(&again), vec![(4, "move"), (5, "move")]);
    // Its data plane went away: everything in flight fails.
    world.tiers.lost_regions(&[0]);
    assert_eq!(world.tiers.pending(), 0);
    assert_eq!(world.tiers.counters.failed, 3);
}

#[test]
fn l2_victims_go_to_l3_and_eager_write_back_copies_every_saved_block() {
    // L2 over its mark: the coldest go to L3, not away.
    let mut world = World::with_l3(TierConfig::default());
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(1, "move"), (2, "move"), (3, "move"), (4, "move")]);
    for command in &commands {
        let TierAction::Move(t) = command.action else { unreachable!() };
        assert_eq!((t.source.tier, t.target.tier, t.target.region, t.target.slot), (2, 3, 9, SLOT_ANY));
    }
    assert_eq!(world.tiers.counters.l3_moves, 4);
    // A block L3 holds already is dropped from L2, not written again.
    let mut world = World::with_l3(TierConfig::default());
    world.locations.adopt(None, key(1), ObjectKind::KvBlock, 9, 5, 1, 1).unwrap();
    world.tiers.added(9, 7, None, key(1), ObjectKind::KvBlock, true, 0);
    let commands = world.plan();
    assert_eq!(keys_of(&commands)[..2], [(1, "evict"), (2, "move")], "{:?}", keys_of(&commands));

    // Eager: a block saved into L1 is copied to L3 (kept in L1), once.
    let config = TierConfig { l3_write_back: L3WriteBack::Eager, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    world.locations.register_region(9, Tier::L3Object, NodeId(0), 5).unwrap();
    world.tiers.register(9, Tier::L3Object, 0, 5, SLOT, 100);
    world.add(0, 7, None, 1);
    world.add(0, 7, Some(1), 2);
    let copies = world.plan();
    assert_eq!(keys_of(&copies), vec![(1, "copy"), (2, "copy")]);
    let TierAction::Copy(t) = copies[0].action else { unreachable!() };
    assert_eq!((t.source.tier, t.target.tier, t.priority), (1, 3, Priority::WriteBack as u8));
    // A copy frees nothing: L1's figures do not count it as leaving.
    assert_eq!(world.tiers.usage(Tier::L1Dram).pending_bytes, 0);
    assert!(world.plan().is_empty(), "asked once");
    // Refused, it is not asked again by itself (the next save of the
    // block, or its eviction, writes L3)...
    world.tiers.done(copies[0].request, false);
    assert!(world.plan().is_empty());
    assert_eq!(world.tiers.counters.l3_copies, 2);
    // ...but one the data plane could not take yet (its store's queue
    // full) is asked again.
    world.tiers.refused(copies[1].request, lake_dp::wire::message::ErrorCode::QueueFull as u32);
    let again = world.plan();
    assert_eq!(keys_of(&again), vec![(2, "copy")]);
    assert_eq!(world.tiers.counters.l3_copies_deferred, 1);
}

#[test]
fn a_full_l2_admits_a_demotion_only_where_its_policy_would() {
    let config = TierConfig { high_percent: 50, low_percent: 40, policy: PolicyKind::Lake, ..TierConfig::default() };
    let mut world = World::new(config);
    // L2 above its high-water mark with blocks read again and again.
    for k in 30..36 {
        world.add(1, 7, None, k);
    }
    for _ in 0..50 {
        world.tiers.accessed(7, &[key(30), key(31), key(32), key(33), key(34), key(35)]);
    }
    // L1 over its mark with one-off blocks: demoting them would push
    // the reused ones out of L2.
    for k in 1..=6 {
        world.add(0, 7, None, k);
    }
    let commands = world.plan();
    let l1: Vec<_> = commands.iter().filter(|c| c.region == 0).collect();
    assert!(!l1.is_empty());
    assert!(world.tiers.counters.admission_refused > 0, "{:?}", world.tiers.counters);
    assert!(l1.iter().any(|c| matches!(c.action, TierAction::Evict(_))));
}

/// Found by the node's simulation with its object store: a block whose
/// move was refused waits out of every cache before it is tried again;
/// evicted meanwhile (by another path: an operator's eviction, a purge,
/// the data plane finding it corrupt), it was counted in L1 for good, and
/// the wait's end put the gone block back in L1's cache to be commanded.
#[test]
fn a_block_evicted_while_it_waits_after_a_refused_move_is_gone_from_the_counts() {
    let config = TierConfig { high_percent: 80, low_percent: 70, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    for k in 1..=9 {
        world.add(0, 7, None, k);
    }
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(1, "move"), (2, "move")]);
    world.carry_out(&commands[1]);
    // The first is refused: block 1 waits before it is tried again.
    world.tiers.done(commands[0].request, false);
    // Evicted meanwhile.
    world.locations.remove(&key(1), 0).unwrap();
    world.tiers.removed(0, &key(1));
    assert_eq!(world.tiers.counters.unattributed, 0, "its namespace was found");
    assert_eq!(world.tiers.usage(Tier::L1Dram).blocks, 7);
    assert_eq!(world.tiers.usage(Tier::L1Dram).bytes, 7 * SLOT);
    // Past the wait, and over the mark again: block 1 is not commanded.
    for k in 10..=11 {
        world.add(0, 7, None, k);
    }
    let mut out = Vec::new();
    world.tiers.plan(&world.locations, &world.leases, RETRY_WAIT_NS + 1, &mut out);
    world.tiers.assert_invariants();
    assert!(!keys_of(&out).iter().any(|&(k, _)| k == 1), "a gone block commanded: {:?}", keys_of(&out));
    assert!(world.tiers.tracked(&key(1)).is_empty(), "a gone block tracked: {:?}", world.tiers.tracked(&key(1)));
}

#[test]
fn l1_partitions_keep_the_rest_of_l1_to_what_is_left_and_are_held_by_their_quota() {
    // Acme's L1 lies in a partition of 4 of the 10 slots, under a quota of
    // as much: the rest of L1 is 6 slots (its marks 80% and 50% of them).
    let tenant = TenantQuota { tenant: "acme".into(), namespaces: vec![2], tier: Tier::L1Dram, bytes: 4 * SLOT };
    let config = TierConfig {
        tenant_quotas: vec![tenant],
        l1_partitions: vec![(4 * SLOT, vec![2])],
        high_percent: 80,
        low_percent: 50,
        policy: PolicyKind::Lru,
        ..TierConfig::default()
    };
    let mut world = World::new(config);
    for k in 10..=12 {
        world.add(0, 2, None, k);
    }
    for k in 1..=5 {
        world.add(0, 1, None, k);
    }
    // 8 of 10 slots in all, not over 80% of L1; but namespace 1 holds 5 of
    // the 6 slots left to it: its coldest go, down to 3, and none of
    // acme's, a slot below its quota already.
    let commands = world.plan();
    assert_eq!(keys_of(&commands), vec![(1, "move"), (2, "move")]);
    for command in &commands {
        world.carry_out(command);
    }
    assert!(world.plan().is_empty());
    // Acme at its quota gives up its own, and only its own (down to its
    // low mark, half of its quota).
    world.add(0, 2, None, 13);
    assert_eq!(keys_of(&world.plan()), vec![(10, "move"), (11, "move")]);
}

#[test]
fn copies_pulled_in_from_other_nodes_go_first_and_are_dropped_not_written_below() {
    for policy in [PolicyKind::Lru, PolicyKind::Lake] {
        let config = TierConfig { high_percent: 80, low_percent: 50, policy, ..TierConfig::default() };
        let mut world = World::new(config);
        // This node's own chain 1..=4, then a prompt's blocks 10..=14
        // pulled in from another node (newer, and read by the engine
        // after they landed).
        world.add(0, 7, None, 1);
        for k in 2..=4 {
            world.add(0, 7, Some(k - 1), k);
        }
        world.add(0, 7, None, 10);
        world.tiers.pulled_in(7, key(10));
        for k in 11..=14 {
            world.add(0, 7, Some(k - 1), k);
            world.tiers.pulled_in(7, key(k));
        }
        world.tiers.accessed(7, &[key(10), key(11), key(12), key(13), key(14)]);
        assert!(world.tiers.is_pulled_in(&key(12)) && !world.tiers.is_pulled_in(&key(2)));
        // 9 of 10 slots, down to 5: four of the pulled copies go, dropped
        // (their holder keeps them), and none of this node's own.
        let commands = world.plan();
        assert_eq!(keys_of(&commands), vec![(14, "evict"), (13, "evict"), (12, "evict"), (11, "evict")], "{policy:?}");
        for command in &commands {
            let TierAction::Evict(evict) = command.action else { unreachable!() };
            assert_eq!(evict.reason, EvictReason::Capacity as u8);
            world.carry_out(command);
        }
        assert!(!world.tiers.is_pulled_in(&key(12)), "forgotten once gone");
        assert_eq!(world.tiers.usage(Tier::L2Nvme).bytes, 0, "nothing written below");
    }
}

#[test]
fn l1_is_cleaned_ahead_into_l2_but_never_a_copy_another_node_keeps() {
    let config = TierConfig { high_percent: 80, low_percent: 50, policy: PolicyKind::Lru, ..TierConfig::default() };
    let mut world = World::new(config);
    world.tiers.takes_marks(0);
    // Own blocks 1..=4; block 10 pulled in, block 11 placed in its home
    // on another node: 6 of 10 slots, 5 once block 11 goes, where
    // cleaning starts.
    for k in 1..=4 {
        world.add(0, 7, (k > 1).then(|| k - 1), k);
    }
    world.add(0, 7, None, 10);
    world.tiers.pulled_in(7, key(10));
    world.add(0, 7, None, 11);
    assert!(world.tiers.placed_away(&key(11)));
    let mut out = Vec::new();
    // A placed copy is dropped at once; the rest are cleaned once they
    // are 100 ms old.
    world.tiers.plan(&world.locations, &world.leases, 1_000_000_000, &mut out);
    let cleaned: Vec<(u8, &str)> = keys_of(&out).into_iter().filter(|(_, what)| *what == "copy").collect();
    assert_eq!(cleaned, vec![(1, "copy"), (2, "copy"), (3, "copy"), (4, "copy")], "{:?}", keys_of(&out));
    assert!(keys_of(&out).contains(&(11, "evict")), "{:?}", keys_of(&out));
    for command in &out {
        if let TierAction::Copy(copy) = command.action {
            assert_eq!((copy.source.tier, copy.target.tier), (Tier::L1Dram as u8, Tier::L2Nvme as u8));
        }
    }
}

#[test]
fn a_victim_with_no_room_below_is_offered_to_the_pool_and_dropped_only_where_no_member_takes_it() {
    // L1 at 9 of 10 slots (over its 80% mark) of blocks no longer new,
    // L2 at its mark: each victim would be dropped.
    let mut world = World::l2_at_its_mark();
    for k in 1..=9 {
        world.add(0, 7, None, k);
    }
    let mut now = 1 + MARK_AFTER_NS + 1;
    let mut plan = |world: &mut World, after: u64| {
        now += after;
        let mut out = Vec::new();
        world.tiers.plan(&world.locations, &world.leases, now, &mut out);
        world.tiers.assert_invariants();
        out
    };
    // A leader places spills: the two oldest are offered instead of
    // marked (L1's target of victims ahead: a quarter of its slots).
    world.tiers.set_spills(true);
    let out = plan(&mut world, 0);
    assert_eq!(marks(&out), Vec::<u8>::new(), "{:?}", keys_of(&out));
    assert_eq!(world.tiers.take_spills(), vec![key(1), key(2)]);
    assert!(!out.iter().any(|c| matches!(c.action, TierAction::VictimsLeft(v) if v.left == 0)), "more will come");
    // Waiting, they count against the target: nothing more.
    let out = plan(&mut world, 1_000_000);
    assert!(marks(&out).is_empty() && world.tiers.take_spills().is_empty(), "{:?}", keys_of(&out));

    // Block 1 landed in another member: this node's copy goes; block 3
    // is offered in its stead.
    assert!(world.tiers.spill_done(&key(1), true));
    assert!(world.tiers.placed_away(&key(1)));
    let out = plan(&mut world, 1_000_000);
    assert!(keys_of(&out).contains(&(1, "evict")), "{:?}", keys_of(&out));
    assert_eq!(world.tiers.take_spills(), vec![key(3)]);
    for command in &out {
        world.carry_out(command);
    }

    // No member had room for block 2: it goes first, marked to be
    // dropped, and for a while nothing is offered (block 4 is marked).
    assert!(world.tiers.spill_done(&key(2), false));
    assert!(!world.tiers.spill_done(&key(2), false), "once");
    let out = plan(&mut world, 1_000_000);
    assert_eq!(marks(&out), vec![2], "{:?}", keys_of(&out));
    assert!(world.tiers.take_spills().is_empty());
    // Block 3's answer never comes: once its wait runs out it is dropped
    // as it would have been.
    let out = plan(&mut world, spill::SPILL_WAIT_NS);
    assert!(marks(&out).contains(&3), "{:?}", keys_of(&out));
    let c = world.tiers.counters;
    assert_eq!((c.spills, c.spills_landed, c.spills_unplaced), (3, 1, 2));
}

#[test]
fn a_marked_victim_a_new_block_continues_goes_back_under_its_parent_and_the_new_leaf_goes_first() {
    // L1 taking marks, L2 at its mark: the chain 1..=9's victims are
    // marked to be dropped, leaf first.
    let mut world = World::l2_at_its_mark();
    for k in 1..=9 {
        world.add(0, 7, (k > 1).then(|| k - 1), k);
    }
    let later = 1 + MARK_AFTER_NS + 1;
    let mut out = Vec::new();
    world.tiers.plan(&world.locations, &world.leases, later, &mut out);
    world.tiers.assert_invariants();
    let first = marks(&out);
    assert_eq!(first.first(), Some(&9), "{:?}", keys_of(&out));
    // The engine saves block 10 after 9 (a slow save: its parent was old
    // enough to be a victim). 9 and the victims above it are no leaves
    // now: their marks are taken back, and 10 leaves first.
    world.add(0, 7, Some(9), 10);
    world.tiers.assert_invariants();
    out.clear();
    world.tiers.plan(&world.locations, &world.leases, later + MARK_AFTER_NS + 1, &mut out);
    world.tiers.assert_invariants();
    let commands = keys_of(&out);
    for k in &first {
        assert!(commands.contains(&(*k, "unmark")), "{k} stays marked: {commands:?}");
    }
    assert_eq!(marks(&out).first(), Some(&10), "the chain's new leaf first: {commands:?}");
    assert_eq!(world.tiers.counters.victims_continued, first.len() as u64);
}

#[test]
fn a_block_placed_in_its_home_after_its_l1_copy_here_went_leaves_no_pool_copy_in_l2() {
    let mut world = World::new(TierConfig::default());
    // Block 5 saved here, cleaned ahead into L2, then its L1 copy taken
    // as a victim before its copy to its home landed.
    world.add(0, 7, None, 5);
    world.add(1, 7, None, 5);
    world.locations.remove(&key(5), 0).unwrap();
    world.tiers.removed(0, &key(5));
    // The home has it now: the copy here is a copy, and the one in L2 goes.
    assert!(world.tiers.placed_away(&key(5)));
    let out = world.plan();
    assert_eq!(keys_of(&out), vec![(5, "evict")]);
    let TierAction::Evict(evict) = out[0].action else { unreachable!() };
    assert_eq!(evict.replica.region, 1);
    world.carry_out(&out[0]);
    assert_eq!(world.tiers.usage(Tier::L2Nvme).bytes, 0);
    // A block not held here at all is no copy of this node's.
    assert!(!world.tiers.placed_away(&key(6)));
}
