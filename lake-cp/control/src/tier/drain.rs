//! Draining an L2 region: announced to its data plane, then its blocks
//! moved to the node's other regions (or dropped where another copy is
//! kept), a bounded number per pass, for the operator's `lake drain`.

use super::*;

/// An L2 region being drained ([`Tiers::drain`]).
#[derive(Debug, Default)]
pub(super) struct Drain {
    /// The data plane took it: it writes nothing new there.
    pub(super) announced: bool,
    /// The announcement in flight.
    pub(super) asking: Option<u64>,
    /// Not announced again before this time (after a refusal).
    pub(super) retry_ns: u64,
    /// Why the last announcement was refused.
    pub(super) refused: Option<String>,
    /// Blocks to move off, from the last scan, taken from the end.
    queue: Vec<BlockKey>,
    /// When the region's blocks were last scanned for (never: `None`).
    scanned_ns: Option<u64>,
    /// Blocks moved off and replicas dropped (another copy kept).
    moved: u64,
    dropped: u64,
}

/// A drained region's blocks are looked for again at most this often
/// (a block saved there before the data plane took the drain, one whose
/// move failed, one a lease held).
const DRAIN_SCAN_NS: u64 = 200_000_000;

/// Moves off drained regions one pass may ask at most.
const DRAINS_PER_PASS: usize = 16;

/// Commands in flight from one drained region at most: a drain is
/// background work, and each move holds a staging L1 slot and a device
/// read then write.
const DRAIN_IN_FLIGHT_MAX: usize = 16;

/// A drained announcement refused is sent again after this.
pub(super) const DRAIN_RETRY_NS: u64 = 1_000_000_000;

/// A drain, for the operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrainStatus {
    /// The L2 region (one file).
    pub region: u16,
    /// Its node.
    pub node: u32,
    /// Whether its data plane took the drain (it writes nothing new there).
    pub announced: bool,
    /// Why its data plane refused it, if it did (retried each second).
    pub refused: Option<String>,
    /// Blocks it still holds.
    pub blocks_left: u64,
    /// Blocks moved off to another region, and replicas dropped because
    /// another L2 region or L3 holds the block.
    pub moved: u64,
    /// See `moved`.
    pub dropped: u64,
    /// Announced, nothing left there, nothing in flight from it: the
    /// file may be taken away.
    pub done: bool,
}

/// A region, for the operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionStatus {
    /// Its id.
    pub region: u16,
    /// Its tier.
    pub tier: Tier,
    /// Its node.
    pub node: u32,
    /// Where it lives (an L2 file's path, the arena's), as registered.
    pub name: String,
    /// Bytes and blocks it holds.
    pub bytes: u64,
    /// See `bytes`.
    pub blocks: u64,
    /// Bytes its slots hold in all.
    pub capacity_bytes: u64,
    /// Whether it is being drained.
    pub draining: bool,
}

impl Tiers {
    /// Drains the L2 region `region` (one file of a node's L2, on its own
    /// device): its data plane is told to write nothing new there, then
    /// every block it holds is moved to another L2 region of the node
    /// (`MoveBlock` L2→L2), or dropped where another L2 region or L3
    /// holds it; the tier's capacity leaves the region out meanwhile, so
    /// if the rest cannot hold everything the usual eviction makes room
    /// (the coldest go to L3, or away). [`Tiers::drains`] says when the
    /// region is empty. Errors if no L2 region has that id.
    pub fn drain(&mut self, region: u16) -> Result<(), String> {
        match self.regions.get(&region) {
            Some(r) if r.tier == Tier::L2Nvme => {}
            Some(r) => return Err(format!("region {region} is not an L2 file (it is {:?})", r.tier)),
            None => return Err(format!("no region {region} is registered")),
        }
        self.undrained.retain(|&r| r != region);
        self.drains.entry(region).or_default();
        Ok(())
    }

    /// Uses a drained region again (its data plane is told). Errors if it
    /// was not being drained.
    pub fn undrain(&mut self, region: u16) -> Result<(), String> {
        if self.drains.remove(&region).is_none() {
            return Err(format!("region {region} is not being drained"));
        }
        self.undrained.push(region);
        Ok(())
    }

    /// The data plane holding `region` cannot take a drain (`why`).
    pub fn drain_refused(&mut self, region: u16, why: &str) {
        if let Some(drain) = self.drains.get_mut(&region) {
            drain.refused = Some(why.to_owned());
        }
    }

    /// Every drain and how far it is.
    pub fn drains(&self) -> Vec<DrainStatus> {
        self.drains
            .iter()
            .map(|(&region, d)| {
                let info = self.regions.get(&region);
                let blocks_left = self.blocks.get(&region).copied().unwrap_or(0);
                let in_flight = self.pending.values().any(|p| p.region == region);
                DrainStatus {
                    region,
                    node: info.map_or(0, |r| r.node),
                    announced: d.announced,
                    refused: d.refused.clone(),
                    blocks_left,
                    moved: d.moved,
                    dropped: d.dropped,
                    done: d.announced && blocks_left == 0 && !in_flight,
                }
            })
            .collect()
    }

    /// Names a region as its data plane registered it (an L2 file's path).
    pub fn name_region(&mut self, region: u16, name: &str) {
        self.names.insert(region, name.to_owned());
    }

    /// Every registered region: what it is, what it holds, whether it is
    /// being drained, by id.
    pub fn regions(&self) -> Vec<RegionStatus> {
        let mut out: Vec<RegionStatus> = self
            .regions
            .iter()
            .map(|(&region, r)| {
                let bytes = self.region_bytes(region);
                RegionStatus {
                    region,
                    tier: r.tier,
                    node: r.node,
                    name: self.names.get(&region).cloned().unwrap_or_default(),
                    bytes,
                    blocks: self.blocks.get(&region).copied().unwrap_or(0),
                    capacity_bytes: r.slot_bytes * r.slots,
                    draining: self.drains.contains_key(&region),
                }
            })
            .collect();
        out.sort_unstable_by_key(|r| r.region);
        out
    }

    /// Bytes `region` holds, all namespaces.
    pub(super) fn region_bytes(&self, region: u16) -> u64 {
        self.used.iter().filter(|((r, _), _)| *r == region).map(|(_, b)| b).sum()
    }

    /// Tells data planes of drains begun and ended, then moves blocks off
    /// the drained regions, within this pass's budget.
    pub(super) fn plan_drains(
        &mut self,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        start: usize,
        out: &mut Vec<TierCommand>,
    ) {
        for region in core::mem::take(&mut self.undrained) {
            let request = self.next_request;
            self.next_request += 1;
            let action = TierAction::Drain(DrainRegion { region, draining: 0, reserved: [0; 5] });
            out.push(TierCommand { request, region, action });
        }
        let regions: Vec<u16> = self.drains.keys().copied().collect();
        let mut asked = 0;
        for region in regions {
            let Some(info) = self.regions.get(&region).copied() else { continue };
            let Some(drain) = self.drains.get_mut(&region) else { continue };
            if !drain.announced {
                if drain.asking.is_none() && now_ns >= drain.retry_ns {
                    let request = self.next_request;
                    self.next_request += 1;
                    drain.asking = Some(request);
                    let action = TierAction::Drain(DrainRegion { region, draining: 1, reserved: [0; 5] });
                    out.push(TierCommand { request, region, action });
                }
                continue;
            }
            let mut queue = core::mem::take(&mut drain.queue);
            if queue.is_empty() && drain.scanned_ns.is_none_or(|t| now_ns >= t.saturating_add(DRAIN_SCAN_NS)) {
                drain.scanned_ns = Some(now_ns);
                if self.region_bytes(region) > 0 {
                    queue = self
                        .spaces
                        .iter()
                        .filter(|((tier, _), _)| *tier == Tier::L2Nvme)
                        .flat_map(|(_, space)| space.cache.index.blocks().map(|b| space.cache.index.key(b)))
                        .filter(|key| locations.ready(key).any(|r| r.region.0 == region))
                        .collect();
                }
            }
            let mut in_flight = self.pending.values().filter(|p| p.region == region).count();
            while asked < DRAINS_PER_PASS && in_flight < DRAIN_IN_FLIGHT_MAX && out.len() - start < COMMANDS_PER_PASS {
                let Some(key) = queue.pop() else { break };
                let Some(source) = locations.ready(&key).find(|r| r.region.0 == region) else { continue };
                if self.pending_of.contains_key(&(key, region)) {
                    continue;
                }
                if leases.is_held(&key, region) {
                    // Found again by a later scan.
                    self.counters.leased_kept += 1;
                    continue;
                }
                let Some(namespace) = self
                    .spaces
                    .iter()
                    .find(|((tier, _), space)| *tier == Tier::L2Nvme && space.cache.index.contains(&key))
                    .map(|((_, namespace), _)| *namespace)
                else {
                    continue;
                };
                let drains = &self.drains;
                let other_l2 = locations
                    .ready(&key)
                    .any(|r| r.tier == Tier::L2Nvme && r.region.0 != region && !drains.contains_key(&r.region.0));
                let in_l3 = locations.ready(&key).any(|r| r.tier == Tier::L3Object);
                let pending = self.leaving(locations, key, (namespace, Tier::L2Nvme), region, now_ns);
                let action = if other_l2 || in_l3 {
                    if !other_l2 && let Some(space) = self.spaces.get_mut(&(Tier::L2Nvme, namespace)) {
                        // L3 alone holds it after this: it leaves L2.
                        space.cache.remove(&key);
                    }
                    TierAction::Evict(evict_body(&source, &key, EvictReason::Demoted))
                } else {
                    let Some((target_region, target_info)) = self.l2_written_to(info.node) else {
                        // Nowhere to go on this node: the tier's capacity
                        // (zero now) has its eviction take them.
                        break;
                    };
                    if self.l2_pressure(info.slot_bytes).1 {
                        // No room yet: eviction makes some first.
                        queue.push(key);
                        break;
                    }
                    let target = l2_target(target_region, &target_info);
                    TierAction::Move(transfer(&source, target, key, Priority::Demotion))
                };
                if let Some(drain) = self.drains.get_mut(&region) {
                    let (total, this) = if matches!(action, TierAction::Move(_)) {
                        (&mut self.counters.drain_moves, &mut drain.moved)
                    } else {
                        (&mut self.counters.drain_drops, &mut drain.dropped)
                    };
                    *total += 1;
                    *this += 1;
                }
                self.ask(pending, action, out);
                asked += 1;
                in_flight += 1;
            }
            if let Some(drain) = self.drains.get_mut(&region) {
                drain.queue = queue;
            }
        }
    }
}
