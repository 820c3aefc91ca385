//! The node under the deterministic simulator, with its real control
//! plane: `lake-dp`'s runner (its own `Node`, over the simulated disk; see
//! `lake_dp::runner::simulation`) commanded by `lake-cp`'s node authority
//! and tier manager (`lake_cp::node::Node`, as `lake serve` runs it) over
//! the real cp link. Every frame the data plane sends goes to the control
//! plane, which must accept every report; every command it plans goes to
//! the data plane. The agents save far more than L1 holds, so the tier
//! manager demotes, marks victims and drops as it does under load; with
//! the node's simulated object store (most seeds), it moves L2's victims
//! to L3 and the agents load them back. Now and then the data plane's
//! process dies and starts again, as under a supervisor, while `lake-cp`
//! runs on: it sees the link close (its commands in flight given up), then
//! the new incarnation register its regions and re-adopt what L2 and L3
//! hold.
//!
//! Every seed: the data plane's properties (bytes served exact, no slot
//! leaked, no report out of step with the commands) and the control
//! plane's (every report accepted, nothing left in its view once the
//! blocks are gone); and after every step, saved blocks looked up in the
//! mirror `lake-cp` publishes, as an engine looks them up, and read where
//! it says L1 holds them, as an agent reads a hit: only bytes whose checks
//! pass are used, and those are the saved ones. A failing seed replays alone:
//! `LAKE_SIM_SEED=N LAKE_SIM_SEEDS=1 cargo test -p lake-cp --test simulation`.

use lake_cp::node::Node;
use lake_cp::tier::{TierCommand, TierConfig};
use lake_dp::mirror::{Lookup, MirrorBacking, MirrorConfig, MirrorReader, MirrorWriter};
use lake_dp::rng::SimRng;
use lake_dp::runner::simulation::{Control, Simulation, Tally};
use lake_dp::wire::Message;
use lake_dp::{NodeId, Tier};

/// Steps a seed runs.
const STEPS: u32 = 400;
/// Saved blocks looked up in the mirror after each step.
const LOOKUPS_PER_STEP: u32 = 4;

/// A seed's mirror file, removed when the seed ends.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `lake-cp`'s node, as the simulation's control plane.
struct TierManager {
    node: Node,
    planned: Vec<TierCommand>,
    commands: u64,
    /// What crossed the link, for a failing seed's message.
    log: Vec<String>,
    /// Whether L1's victims are marked evictable in the data plane, as
    /// `lake serve` does for a data plane that takes marks (this build's
    /// runner does); otherwise the manager evicts them itself.
    marks: bool,
    /// The regions the data plane registered: what its link carried.
    regions: Vec<u16>,
}

impl Control for TierManager {
    fn received(&mut self, request: u64, message: &Message<'_>) {
        self.log.push(format!("dp -> cp {request}: {message:?}"));
        if let Err(e) = self.node.on_data_plane(request, message) {
            let history = match message {
                Message::BlockEvicted(evicted) => format!("{:?}", self.node.history_of(&evicted.key)),
                Message::BlockCommitted(block) => format!("{:?}", self.node.history_of(&block.key)),
                _ => String::new(),
            };
            let shown = if std::env::var_os("LAKE_SIM_LOG").is_some() { self.log.len() } else { 40 };
            let log = &self.log[self.log.len().saturating_sub(shown)..];
            panic!(
                "lake-cp refused the data plane's {message:?} (request {request}): {e}; the block's history: {history}\n{log:#?}"
            );
        }
        if let Message::RegisterRegion(region) = message {
            if !self.regions.contains(&region.region) {
                self.regions.push(region.region);
            }
            if self.marks && region.tier == Tier::L1Dram as u8 {
                self.node.tiers.takes_marks(region.region);
            }
        }
    }

    fn link_lost(&mut self) {
        // As `lake serve`'s server does when a data plane's connection
        // closes: its commands in flight are given up.
        self.log.push("the data plane's link closed".into());
        self.node.tiers.lost_regions(&self.regions);
    }

    fn commands(&mut self, now_ns: u64, out: &mut Vec<(u64, Message<'static>)>) {
        self.node.plan(now_ns, &mut self.planned);
        self.node.tiers.assert_invariants();
        for command in self.planned.drain(..) {
            self.commands += 1;
            self.log.push(format!("cp -> dp {}: {:?}", command.request, command.action));
            out.push((command.request, command.action.message(command.request)));
        }
    }
}

fn run(seed: u64) -> (Tally, TierManager) {
    // One seed in three with marks: the manager then plans victims every
    // pass, which makes a seed ten times as long.
    let marks = seed.is_multiple_of(3);
    // High-water marks low enough that the tier manager acts often.
    let config = TierConfig { high_percent: 75, low_percent: 50, ..TierConfig::default() };
    let scratch = Scratch(format!("/dev/shm/lake-cp-sim-{}-{seed}", std::process::id()).into());
    let mirror = MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(scratch.0.clone()), 4096))
        .expect("a mirror in /dev/shm");
    let published = MirrorReader::attach(&scratch.0).expect("the mirror, as an engine maps it");
    let node = Node::new(NodeId(1), 1, Some(mirror)).with_tiers(config);
    let manager = TierManager { node, planned: Vec::new(), commands: 0, log: Vec::new(), marks, regions: Vec::new() };
    let mut simulation = Simulation::new(seed, manager, false).with_restarts(true);
    let mut rng = SimRng::new(seed ^ 0x6d69_7272);
    for _ in 0..STEPS {
        simulation.run(1);
        for _ in 0..LOOKUPS_PER_STEP {
            let n = rng.below(simulation.blocks().max(1));
            simulation.read_published(n, |key| match published.get(key) {
                Lookup::Hit(entry) if entry.tier == Tier::L1Dram => Some((entry.slot, entry.generation)),
                _ => None,
            });
        }
    }
    simulation.finish()
}

#[test]
fn the_node_holds_over_many_seeds_with_its_real_tier_manager() {
    let var = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    let (first, seeds) = (var("LAKE_SIM_SEED").unwrap_or(1), var("LAKE_SIM_SEEDS").unwrap_or(300));
    let mut totals = (Tally::default(), 0, 0, 0, 0, 0);
    for seed in first..first + seeds {
        let outcome = std::panic::catch_unwind(|| run(seed));
        let (tally, manager) = outcome.unwrap_or_else(|_| {
            panic!("seed {seed} failed; alone: LAKE_SIM_SEED={seed} LAKE_SIM_SEEDS=1 cargo test -p lake-cp --test simulation")
        });
        // Everything was evicted: the control plane holds nothing either.
        for tier in [Tier::L1Dram, Tier::L2Nvme] {
            let usage = manager.node.tiers.usage(tier);
            assert_eq!(
                (usage.blocks, usage.bytes),
                (0, 0),
                "seed {seed}: lake-cp still counts {tier:?}: {usage:?}\n{}",
                if std::env::var_os("LAKE_SIM_LOG").is_some() {
                    format!("{:?}\n{}", manager.node.tiers.counters, manager.log.join("\n"))
                } else {
                    String::new()
                }
            );
        }
        totals.0.add(&tally);
        totals.1 += manager.commands;
        totals.2 += manager.node.tiers.counters.demotions;
        totals.3 += manager.node.tiers.counters.drops[Tier::L1Dram as usize];
        totals.4 += manager.node.tiers.counters.marked_clean + manager.node.tiers.counters.marked_drop;
        totals.5 += manager.node.tiers.counters.l3_moves;
    }
    let (tally, commands, demotions, drops, marks, l3_moves) = totals;
    println!(
        "{seeds} seeds from {first}: {tally:?}; lake-cp planned {commands} commands, {demotions} demotions, \
         {drops} L1 drops, {marks} marks, {l3_moves} moves to L3"
    );
    assert!(seeds < 3 || marks > 0, "no L1 victim was ever marked evictable");
    // The tier manager did its work, and loads found what it demoted.
    assert!(tally.saves > 20 * seeds && tally.controlled > 5 * seeds, "{tally:?}");
    assert!(demotions > seeds && drops > seeds && tally.loads_ok > seeds, "{tally:?}, {demotions} demotions");
    assert!(tally.refused_damaged > 0 && tally.corrupt_late > 0 && tally.loads_failed > 0, "{tally:?}");
    assert!(seeds < 5 || (l3_moves > seeds && tally.l3_loads_ok > seeds), "{tally:?}, {l3_moves} moves to L3");
    assert!(seeds < 5 || (tally.restarts > seeds / 2 && tally.readopted > seeds), "{tally:?}");
    assert!(seeds < 5 || tally.published_hits > 10 * seeds, "{tally:?}");
}
