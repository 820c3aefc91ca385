//! The data plane's link to its node's `lake-cp`: made at start (hellos,
//! the term fence, the regions, what re-adoption found), and made again
//! after it closed, with everything this node holds reported anew.

use super::*;

/// Connects to `lake-cp` and reports the regions and what re-adoption
/// found.
pub(super) fn link_to_cp(
    config: &RunnerConfig,
    tier: &L2Tier,
    found: &crate::l2::Readoption,
    arena: &Arena,
) -> Result<Option<CpLink>, RunnerError> {
    let Some(socket) = &config.cp.socket else { return Ok(None) };
    let deadline = Duration::from_millis(config.cp.connect_timeout_ms);
    let geometry = tier.geometry();
    let mut link = open_link(config, socket, &geometry, tier.epoch(), arena.header(), deadline)?;
    report_readopted(&mut link, &geometry, config.node.id, found);
    Ok(Some(link))
}

/// Reports every object re-adoption `found` in L2 (as of its epoch).
pub(super) fn report_readopted(link: &mut CpLink, geometry: &L2Geometry, node: u32, found: &crate::l2::Readoption) {
    for adopted in &found.adopted {
        let slot = L2Slot { file: adopted.file, slot: adopted.slot };
        let mut record = l2_record(geometry, node, found.epoch, slot, &adopted.meta);
        if adopted.verified {
            record.flags = BLOCK_FLAG_VERIFIED;
        }
        link.readopted(&record);
        // Re-adoption can report more than the buffer holds: write as we go.
        if link.pump().is_err() {
            break;
        }
    }
}

/// A link to the `lake-cp` at `socket`: connected (versions and identity
/// checked), fenced by the persisted leader term, and told this node's
/// regions.
fn open_link(
    config: &RunnerConfig,
    socket: &Path,
    geometry: &L2Geometry,
    epoch: u64,
    header: &crate::arena::layout::ArenaHeader,
    deadline: Duration,
) -> Result<CpLink, RunnerError> {
    let identity = Identity {
        role: Role::DataPlane,
        node: config.node.id,
        pid: std::process::id(),
        region_epoch: epoch,
        features: crate::wire::FEATURES,
        name: "lake-dp",
    };
    let mut link = CpLink::connect(socket, &identity, deadline).map_err(|e| RunnerError::Failed {
        what: format!("the control plane at {}", socket.display()),
        error: e.to_string(),
    })?;
    // The leader-term fence lives beside the L2 tier, the recovery point.
    let fence_dir = config.l2.paths.first().and_then(|p| p.parent()).filter(|d| !d.as_os_str().is_empty());
    let fence_dir = fence_dir.unwrap_or_else(|| Path::new("."));
    let fence = crate::fence::TermFence::open(fence_dir).map_err(|e| super::fail("term fence")(&e))?;
    link.fence_with(fence);
    register_regions(&mut link, config, geometry, epoch, header);
    Ok(link)
}

/// Tells the control plane this node's regions: its L2 files, its L1
/// arena (at the capacity `lake-cp` counts, see [`l1_capacity`]), its L3
/// store.
pub(super) fn register_regions(
    link: &mut CpLink,
    config: &RunnerConfig,
    geometry: &L2Geometry,
    epoch: u64,
    header: &crate::arena::layout::ArenaHeader,
) {
    let name = |path: &Path| text_field::<48>("region.name", &path.to_string_lossy()).unwrap_or([0; 48]);
    for file in 0..geometry.files {
        link.register_region(&RegisterRegion {
            region: geometry.region(file).0,
            tier: Tier::L2Nvme as u8,
            reserved_a: 0,
            node: config.node.id,
            region_epoch: epoch,
            slot_bytes: geometry.slot_bytes,
            slot_count: geometry.slots_per_file,
            reserved_b: 0,
            name: config.l2.paths.get(usize::from(file)).map_or([0; 48], |p| name(p)),
        });
    }
    let (l1_slot_bytes, l1_slots) = l1_capacity(header, config.l1.load_reserve_slots);
    link.register_region(&RegisterRegion {
        region: header.region,
        tier: Tier::L1Dram as u8,
        reserved_a: 0,
        node: config.node.id,
        region_epoch: epoch,
        slot_bytes: l1_slot_bytes,
        slot_count: l1_slots,
        reserved_b: 0,
        name: name(&config.l1.path),
    });
    if let Some(l3) = &config.l3 {
        let where_ =
            l3.dir.as_ref().map_or_else(|| l3.endpoint.clone().unwrap_or_default(), |d| d.display().to_string());
        link.register_region(&RegisterRegion {
            region: l3.region,
            tier: Tier::L3Object as u8,
            reserved_a: 0,
            node: config.node.id,
            region_epoch: epoch,
            // Objects up to the largest L1 slot: they are read back into one.
            slot_bytes: header.classes[..usize::from(header.class_count)]
                .iter()
                .map(|c| c.slot_bytes)
                .max()
                .unwrap_or(0),
            slot_count: l3.objects,
            reserved_b: 0,
            name: text_field::<48>("region.name", &where_).unwrap_or([0; 48]),
        });
    }
}

/// When the control plane's link closed (it died, or gave up its
/// leadership), tries now and then to connect again — to a standby that
/// took over, or the same one restarted — and re-adopts everything this
/// node holds, so the new control plane's view is rebuilt from it. A try
/// costs a connect on a Unix socket (refused at once while nobody
/// listens); the waits double from 50 ms to 250 ms.
pub(super) struct Reconnect {
    next_ns: u64,
    wait_ns: u64,
    /// Links made again.
    pub(super) made: u64,
}

impl Reconnect {
    const FIRST_NS: u64 = 50_000_000;
    const MAX_NS: u64 = 250_000_000;

    pub(super) fn new() -> Self {
        Self { next_ns: 0, wait_ns: Self::FIRST_NS, made: 0 }
    }

    /// A new link in place of the closed one in `link`, once the wait is
    /// over.
    #[allow(clippy::too_many_arguments)] // the runner's parts a link is made from
    pub(super) fn poll(
        &mut self,
        now_ns: u64,
        link: &mut Option<CpLink>,
        config: &RunnerConfig,
        geometry: &L2Geometry,
        epoch: u64,
        header: &crate::arena::layout::ArenaHeader,
        report: impl FnOnce(&mut CpLink),
    ) {
        let Some(socket) = &config.cp.socket else { return };
        if now_ns < self.next_ns {
            return;
        }
        match open_link(config, socket, geometry, epoch, header, Duration::from_millis(200)) {
            Ok(mut new) => {
                report(&mut new);
                let _ = new.pump();
                *link = Some(new);
                self.made += 1;
                self.wait_ns = Self::FIRST_NS;
            }
            Err(_) => {
                self.next_ns = now_ns + self.wait_ns;
                self.wait_ns = (self.wait_ns * 2).min(Self::MAX_NS);
            }
        }
    }
}
