//! The simulated node: the runner's own `Node` over the simulated disk,
//! the simulated store and a virtual clock.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use super::link::{PEER_NODE, SimLink, Wire};
use super::store::SimStore;
use super::{BUDGET, L1_SLOTS, L2_SLOTS, L3_OBJECTS, L3_QUEUE, L3_REGION, NODE, OPS, PASS_NS, SLOT_BYTES};
use crate::arena::Arena;
use crate::cplink::CpLink;
use crate::io::Clock;
use crate::l2::{L2Slots, Readoption};
use crate::l3::L3Client;
use crate::op::{Event, L2Slot};
use crate::poller::Poller;
use crate::runner::os::Wakeup;
use crate::runner::pool::{Pool, PoolShape};
use crate::runner::serve::Pass;
use crate::runner::{Node, RunnerConfig, RunnerOptions, RunnerPorts, RunnerStats};
use crate::sim::{CrashKind, SimDisk, SimFaults};
use crate::transport::PeerId;

/// The virtual clock the simulated node's passes read.
#[derive(Clone, Debug, Default)]
pub(super) struct VirtualClock(pub(super) Rc<Cell<u64>>);

impl Clock for VirtualClock {
    fn now_ns(&self) -> u64 {
        self.0.get()
    }
}

/// The node's config: the sizes below, and the poller's defaults; with
/// `l3`, an object store (never opened: the simulation gives the node its
/// own).
pub(super) fn config_text(seed: u64, epoch: u64, l3: bool) -> String {
    let mut text = format!(
        "[node]\nid = {NODE}\n\n[l1]\npath = \"/dev/shm/lake-sim-{}-{seed}-{epoch}\"\n\
         classes = [{{ payload_bytes = {}, slots = {L1_SLOTS} }}]\n\n\
         [l2]\npaths = [\"/nonexistent/lake-sim.lake\"]\nslots_per_file = {L2_SLOTS}\nslot_bytes = {SLOT_BYTES}\n\n\
         [poller]\nops_max = {OPS}\nbatch_max = {BUDGET}\n",
        std::process::id(),
        SLOT_BYTES - crate::constants::STORED_HEADER_BYTES as u64,
    );
    if l3 {
        text += &format!(
            "\n[l3]\ndir = \"/nonexistent/lake-sim-l3\"\nregion = {L3_REGION}\nobjects = {L3_OBJECTS}\n\
             queue_depth = {L3_QUEUE}\nattempts = 3\n"
        );
    }
    text
}

/// A node as the runner runs it -- the same [`Node`], its passes made by
/// [`Node::pass`] -- over the simulated disk, the simulated object store,
/// a simulated storage network to one peer and a virtual clock, with no
/// attach socket or signals: the agents' ports, the control plane's link
/// and the peer are its only ways in.
pub(super) struct SimNode {
    pub(super) node: Node<SimDisk, VirtualClock>,
    pub(super) config: RunnerConfig,
    pub(super) options: RunnerOptions,
    pub(super) ports: RunnerPorts,
    pub(super) stats: RunnerStats,
    pub(super) clock: VirtualClock,
    /// The wire to the peer the simulation plays.
    pub(super) wire: Rc<RefCell<Wire>>,
}

impl SimNode {
    /// A node of incarnation `found.epoch` over `disk` (and `store`, if
    /// any), serving what re-adoption `found` there (nothing on a new disk)
    /// and reporting it, as `Node::open` does; the store's catalog scan
    /// is taken as the node serves.
    pub(super) fn start(
        seed: u64,
        disk: SimDisk,
        store: Option<&SimStore>,
        found: &Readoption,
        agents: Vec<crate::agent::port::DpPort>,
        link: CpLink,
        wakeup: Arc<Wakeup>,
    ) -> Self {
        let epoch = found.epoch;
        let config =
            RunnerConfig::parse(&config_text(seed, epoch, store.is_some())).expect("the simulated node's config");
        let (arena, table) = Arena::create(&config.arena(epoch)).expect("the simulated node's arena");
        let region = arena.region().expect("its slots");
        let header = *arena.header();
        let geometry = config.l2().geometry();
        let poller =
            Poller::new(crate::runner::open::poller_config(&config, geometry, epoch), disk, Arc::clone(&region))
                .expect("the poller");
        let shape = PoolShape {
            node: NODE,
            epoch,
            l1_region: header.region,
            l1_slots: header.slots,
            geometry,
            ops: config.poller.ops_max,
        };
        let mut pool = Pool::new(&shape, agents, 0);
        for adopted in &found.adopted {
            pool.l2_written(L2Slot { file: adopted.file, slot: adopted.slot }, &adopted.meta);
        }
        let l3_scan = store.zip(config.l3.as_ref()).map(|(store, l3)| open_l3(store, l3, seed ^ epoch, &mut pool));
        let mut link = link;
        crate::runner::register_regions(&mut link, &config, &geometry, epoch, &header);
        crate::runner::link::report_readopted(&mut link, &geometry, NODE, found);
        let clock = VirtualClock::default();
        let wire = Wire::new(seed ^ epoch, (header.region, epoch));
        let storage_link = SimLink::new(Rc::clone(&wire)).expect("the simulated link's TCP transport");
        let node = Node {
            attach: None,
            peers_by_node: vec![(PEER_NODE, PeerId(0))],
            transport: Some(Box::new(storage_link)),
            extra_fds: vec![-1; crate::runner::os::PARK_FDS_MAX],
            park_fds: Vec::new(),
            l3_scan,
            pool,
            l2_slots: L2Slots::from_readoption(geometry, found),
            poller,
            wakeup,
            link: Some(link),
            region,
            table,
            arena,
            tier: None,
            geometry,
            signals: None,
            selftest: None,
            events: vec![Event::placeholder(); config.poller.batch_max as usize],
            transfers: crate::runner::Transfers::new(),
            reconnect: crate::runner::Reconnect::new(),
            epoch,
            header,
            node_id: NODE,
            clock: clock.clone(),
            pace: crate::runner::serve::Pace::default(),
        };
        let (options, ports, stats) = (RunnerOptions::default(), RunnerPorts::default(), RunnerStats::default());
        Self { node, config, options, ports, stats, clock, wire }
    }

    /// The process dies (`kind`): what was in flight lands as the disk
    /// lets it. The disk, to start the next incarnation on.
    pub(super) fn crash(&mut self, kind: CrashKind) -> SimDisk {
        let disk = self.node.poller.backend_mut();
        // SAFETY: the ops in flight write into this node's region, which
        // lives until the node is dropped, after this.
        unsafe { disk.crash(kind) };
        std::mem::replace(disk, SimDisk::new(0, SimFaults::none(0), 1, 1, 0))
    }

    /// One pass, as `Node::serve` makes them, then the virtual clock on.
    pub(super) fn pass(&mut self) {
        let now = self.clock.now_ns();
        let pass = self.node.pass(now, &self.config, &self.options, &self.ports, &mut self.stats);
        assert_ne!(pass, Pass::Done, "the simulated node is never asked to stop");
        self.node.pool.assert_invariants(&self.node.table, &self.node.l2_slots);
        self.stats.polls += 1;
        self.clock.0.set(now + PASS_NS);
    }

    /// The bytes of L1 slot `slot` as they are now.
    pub(super) fn slot_bytes(&self, slot: u32) -> &[u8] {
        // SAFETY: one thread runs the whole simulation, so nothing writes
        // the slot while this borrow lives (the poller's simulated disk
        // copies only inside `pass`, which takes `&mut self`).
        unsafe { self.node.region.slot(slot) }.expect("a slot of the arena")
    }
}

/// Gives `pool` an L3 tier over `store` (its calls made inside the node's
/// passes, as `seed` picks them), and scans the store as a starting node
/// does on its thread: the batches, taken by the node between passes as
/// from the thread.
fn open_l3(
    store: &SimStore,
    l3: &crate::runner::config::L3Section,
    seed: u64,
    pool: &mut Pool,
) -> std::sync::mpsc::Receiver<crate::runner::ScanMessage> {
    let client = L3Client::inline(l3.client(), &l3.prefix, Box::new(store.handle(seed)), seed)
        .expect("the simulated store's client");
    pool.set_l3(crate::runner::pool::L3Tier::new(client, l3.region, l3.objects, l3.queue_depth));
    let (sent, scanned) = std::sync::mpsc::channel();
    let mut scanning = store.handle(seed ^ 0x5ca9);
    crate::runner::scan_to(&mut scanning, &l3.prefix, l3.objects as usize, &mut |message| sent.send(message).is_ok());
    scanned
}
