//! One pass of the tier manager: victims over the marks and the quotas
//! taken leaf first, each demoted, dropped or marked evictable in its data
//! plane, and L1 victims written below ahead of need.

use super::*;

impl Tiers {
    /// One planning pass: gives up commands past their deadline, then
    /// takes victims wherever a quota or a tier's high-water mark is
    /// exceeded, appending the commands to `out`.
    pub fn plan(&mut self, locations: &Locations, leases: &Leases, now_ns: u64, out: &mut Vec<TierCommand>) {
        self.now_ns = now_ns;
        self.expire_spills(locations);
        let mut at = 0;
        while at < self.cooling.len() {
            if self.cooling[at].0 <= now_ns {
                let (_, pending) = self.cooling.swap_remove(at);
                self.put_back(&pending);
            } else {
                at += 1;
            }
        }
        let late: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.deadline_ns < now_ns).map(|(&request, _)| request).collect();
        for request in late {
            self.counters.failed += 1;
            self.counters.timed_out += 1;
            self.forget(request);
        }
        let start = out.len();
        for (key, replica) in self.duplicates.drain(..) {
            let request = self.next_request;
            self.next_request += 1;
            if self.duplicates_sent.len() < COMMANDS_PER_PASS * 64 {
                self.duplicates_sent.insert((key, replica.region.0, replica.slot, replica.generation));
            }
            let action = TierAction::Evict(evict_body(&replica, &key, EvictReason::Released));
            out.push(TierCommand { request, region: replica.region.0, action });
        }
        self.plan_write_backs(locations, now_ns, out);
        self.plan_persist(locations, now_ns, out);
        self.plan_purges(locations, leases, now_ns, start, out);
        self.plan_drains(locations, leases, now_ns, start, out);
        self.plan_placed_away(locations, leases, now_ns, out);
        for tier in [Tier::L1Dram, Tier::L2Nvme, Tier::L3Object] {
            if !self.regions.values().any(|r| r.tier == tier) {
                continue;
            }
            // Quotas first. A tenant over its quota gives up blocks of its
            // namespace holding the most there, until it is under. In L1,
            // where the data plane refuses a save past a quota, it gives
            // them up from the tier's high-water share of its quota down
            // to the low one, so its saves find room again.
            let tenants: Vec<(Vec<u64>, u64)> = self
                .config
                .tenant_quotas
                .iter()
                .filter(|q| q.tier == tier)
                .map(|q| (q.namespaces.clone(), q.bytes))
                .collect();
            for (namespaces, quota) in tenants {
                let live = |tiers: &Self, namespace: u64| {
                    tiers.used_by(tier, Some(namespace)).saturating_sub(tiers.pending_by(tier, Some(namespace)))
                };
                let (high, low) = self.quota_marks(tier, quota);
                let held = |tiers: &Self| namespaces.iter().map(|&n| live(tiers, n)).sum::<u64>();
                if held(self) <= high {
                    continue;
                }
                while out.len() - start < COMMANDS_PER_PASS && held(self) > low {
                    let mut largest: Vec<(u64, u64)> = namespaces.iter().map(|&n| (live(self, n), n)).collect();
                    largest.sort_unstable_by(|a, b| b.cmp(a));
                    let evicted = largest.iter().any(|&(_, namespace)| {
                        (tier == Tier::L1Dram
                            && self.evict_marked(Some(namespace), false, locations, leases, now_ns, out))
                            || self.evict_one(tier, namespace, locations, leases, now_ns, out)
                    });
                    if !evicted {
                        break;
                    }
                    self.counters.tenant_quota_evictions += 1;
                }
            }
            // A namespace over its own quota gives up its own.
            let quotas: Vec<(u64, u64)> =
                self.config.quotas.iter().filter(|q| q.tier == tier).map(|q| (q.namespace, q.bytes)).collect();
            for (namespace, quota) in quotas {
                let (high, low) = self.quota_marks(tier, quota);
                let held = |tiers: &Self| {
                    tiers.used_by(tier, Some(namespace)).saturating_sub(tiers.pending_by(tier, Some(namespace)))
                };
                if held(self) <= high {
                    continue;
                }
                while out.len() - start < COMMANDS_PER_PASS && held(self) > low {
                    let marked = tier == Tier::L1Dram
                        && self.evict_marked(Some(namespace), false, locations, leases, now_ns, out);
                    if !marked && !self.evict_one(tier, namespace, locations, leases, now_ns, out) {
                        break;
                    }
                }
            }
            let capacity = self.shared_capacity(tier);
            let (mut high_percent, mut low_percent) = (self.config.high_percent, self.config.low_percent);
            if tier == Tier::L1Dram && self.draining_node {
                // Its L1 is where its L2 blocks are promoted to be copied
                // away: half of it is kept free for them.
                (high_percent, low_percent) = (high_percent.min(DRAINING_L1_HIGH), low_percent.min(DRAINING_L1_LOW));
            }
            let high = percent_of(capacity, high_percent);
            let low = percent_of(capacity, low_percent);
            let live = |tiers: &Self| tiers.shared_live(tier);
            if live(self) <= high {
                continue;
            }
            while out.len() - start < COMMANDS_PER_PASS && live(self) > low {
                // The victims already chosen that have a copy below go
                // first, in their order: dropping them loses nothing. (The
                // others, marked to be dropped, go only when a save or a
                // load needs their slot.)
                if tier == Tier::L1Dram && self.evict_marked(None, true, locations, leases, now_ns, out) {
                    continue;
                }
                // Where an L1 victim would be dropped (no room below) and
                // the data plane takes marked victims when a save needs a
                // slot, nothing is dropped ahead of that need (while no L2
                // file is drained: then none are marked).
                if tier == Tier::L1Dram
                    && !self.emptying_l1
                    && !self.draining_node
                    && self.drains.is_empty()
                    && !self.marks_taken.is_empty()
                    && self.l1_victims_dropped()
                {
                    break;
                }
                // The space furthest over its share: bytes over its quota
                // (or over the whole tier, for namespaces without one).
                let mut candidates: Vec<(u64, u64)> = self
                    .spaces
                    .iter()
                    .filter(|((t, namespace), space)| {
                        *t == tier && !space.cache.index.is_empty() && !self.partitioned(tier, *namespace)
                    })
                    .map(|((_, namespace), space)| {
                        let live = self
                            .used_by(tier, Some(*namespace))
                            .saturating_sub(self.pending_by(tier, Some(*namespace)));
                        let share = space.quota.unwrap_or(capacity).max(1);
                        (live.saturating_mul(1024) / share, *namespace)
                    })
                    .collect();
                candidates.sort_unstable_by(|a, b| b.cmp(a));
                let evicted = candidates
                    .iter()
                    .any(|&(_, namespace)| self.evict_one(tier, namespace, locations, leases, now_ns, out));
                if !evicted {
                    break;
                }
            }
        }
        // Last: what the evictions above took from the victims chosen
        // ahead is chosen again, so the data planes hold their reserve.
        self.plan_cleaning(locations, now_ns, out);
        self.plan_marks(locations, leases, now_ns, out);
    }

    /// Where a quota of `bytes` in `tier` starts giving up blocks, and
    /// where it stops: in L1, the tier's high- and low-water shares of it
    /// (at least one slot below it, so a save always finds room once the
    /// marks are met); elsewhere the quota itself.
    fn quota_marks(&self, tier: Tier, bytes: u64) -> (u64, u64) {
        if tier != Tier::L1Dram {
            return (bytes, bytes);
        }
        let slot = self.regions.values().filter(|r| r.tier == tier).map(|r| r.slot_bytes).max().unwrap_or(0);
        let high = percent_of(bytes, self.config.high_percent).min(bytes.saturating_sub(slot));
        let low = percent_of(bytes, self.config.low_percent).min(high);
        (high, low)
    }

    /// The pending entry of a command that frees `key`'s replica in
    /// `region` (a move down or a drop): its parent and kind from the
    /// index, its bytes from the region.
    pub(super) fn leaving(
        &self,
        locations: &Locations,
        key: BlockKey,
        (namespace, tier): (u64, Tier),
        region: u16,
        now_ns: u64,
    ) -> Pending {
        let (parent, kind) = parent_and_kind(locations, &key);
        Pending {
            key,
            parent,
            kind,
            namespace,
            tier,
            region,
            bytes: self.block_bytes(region, &key),
            deadline_ns: now_ns.saturating_add(PENDING_TIMEOUT_NS),
            frees: true,
            to: None,
            cleans: false,
        }
    }

    /// Drops the copies placed in their homes on other nodes
    /// ([`Tiers::placed_away`]), a few a pass — the L1 copy, and the L2
    /// one cleaning may have written ahead: the home keeps the block —
    /// each once it is a leaf here and no engine holds it (until then it
    /// waits, first in line).
    fn plan_placed_away(&mut self, locations: &Locations, leases: &Leases, now_ns: u64, out: &mut Vec<TierCommand>) {
        for _ in 0..self.placed_away.len().min(COMMANDS_PER_PASS) {
            let Some(key) = self.placed_away.pop_front() else { break };
            let mut waits = false;
            for tier in [Tier::L1Dram, Tier::L2Nvme] {
                let Some(source) = locations.ready(&key).find(|r| r.tier == tier) else { continue };
                let region = source.region.0;
                if self.pending_of.contains_key(&(key, region))
                    || (tier == Tier::L1Dram && self.marked.contains_key(&key))
                {
                    // On its way out, or down (its copy below is dropped
                    // once there).
                    waits = true;
                    continue;
                }
                let space = self.spaces.iter_mut().find(|((t, _), s)| *t == tier && s.cache.index.contains(&key));
                let Some(((_, namespace), space)) = space else { continue };
                let namespace = *namespace;
                // A parent here (the node saved more after it) goes after
                // its children; one an engine reads, after its read.
                if leases.is_held(&key, region) || !space.cache.remove(&key) {
                    waits = true;
                    continue;
                }
                let pending = self.leaving(locations, key, (namespace, tier), region, now_ns);
                self.counters.drops[tier as usize] += 1;
                self.ask(pending, TierAction::Evict(evict_body(&source, &key, EvictReason::Capacity)), out);
            }
            if waits {
                self.placed_away.push_back(key);
            }
        }
    }

    /// Takes one victim from the space (tier, namespace) and appends its
    /// command; false when nothing there may go.
    fn evict_one(
        &mut self,
        tier: Tier,
        namespace: u64,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        out: &mut Vec<TierCommand>,
    ) -> bool {
        let (pending_of, pending) = (&self.pending_of, &self.pending);
        let (mut kept, mut copying) = (0, 0);
        let Some(space) = self.spaces.get_mut(&(tier, namespace)) else { return false };
        let verdict = |key: &BlockKey| {
            let Some(replica) = locations.ready(key).find(|r| r.tier == tier) else { return Verdict::Gone };
            match pending_of.get(&(*key, replica.region.0)).and_then(|request| pending.get(request)) {
                // Already on its way out (moved or dropped).
                Some(command) if command.frees => return Verdict::Gone,
                // Being copied (to L3, to another node): it stays in this
                // tier, so it stays in its cache; another victim this time.
                Some(_) => {
                    copying += 1;
                    return Verdict::Keep;
                }
                None => {}
            }
            if leases.is_held(key, replica.region.0) {
                kept += 1;
                return Verdict::Keep;
            }
            Verdict::Evict
        };
        let victim = space.cache.take_victim(64, verdict);
        self.counters.leased_kept += kept;
        self.counters.copying_kept += copying;
        let Some(key) = victim else { return false };
        let Some(source) = locations.ready(&key).find(|r| r.tier == tier) else { return false };
        let pending = self.leaving(locations, key, (namespace, tier), source.region.0, now_ns);
        let parent = pending.parent;
        let held_in = |t: Tier| locations.ready(&key).any(|r| r.tier == t);
        let move_to = |target| TierAction::Move(transfer(&source, target, key, Priority::Demotion));
        let node = source.node.0;
        // For an L1 victim: L2's pressure for one more of its blocks.
        let l2 = (tier == Tier::L1Dram)
            .then(|| self.region_on(Tier::L2Nvme, node))
            .flatten()
            .map(|(region, info)| (region, info, self.l2_pressure(info.slot_bytes)));
        // An L1 victim L3 holds is only worth writing to L2 while L2 has
        // room: otherwise the write pushes another block out of L2.
        let l2_full = l2.is_some_and(|(_, _, (over_high, no_room))| over_high || no_room);
        let action = if tier == Tier::L1Dram && self.pulled_in.contains(&key) {
            // Pulled in from another node, which keeps it: not written
            // below.
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Capacity))
        } else if tier == Tier::L1Dram && (held_in(Tier::L2Nvme) || (held_in(Tier::L3Object) && l2_full)) {
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Demoted))
        } else if tier == Tier::L1Dram
            && l2.is_some()
            && self.config.l2_admission == L2Admission::SecondAccess
            && !self.emptying_l1
            && !self.seen_twice.contains(&key)
            && !parent.is_some_and(|p| self.seen_twice.contains(&p))
            && !held_in(Tier::L3Object)
        {
            // Used once: not worth an L2 write. Remembered, so a block
            // saved again after this is written next time.
            self.counters.l2_filtered += 1;
            self.counters.drops[tier as usize] += 1;
            self.dropped_once.note(key);
            TierAction::Evict(evict_body(&source, &key, EvictReason::Capacity))
        } else if let Some(target) =
            l2.and_then(|(region, info, pressure)| self.demotion_target(namespace, &key, region, &info, pressure))
        {
            self.counters.demotions += 1;
            move_to(target)
        } else if tier != Tier::L3Object && held_in(Tier::L3Object) {
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Demoted))
        } else if let Some(target) = (tier != Tier::L3Object).then(|| self.l3_target(node)).flatten() {
            self.counters.l3_moves += 1;
            move_to(target)
        } else {
            self.counters.drops[tier as usize] += 1;
            TierAction::Evict(evict_body(&source, &key, EvictReason::Capacity))
        };
        self.ask(pending, action, out);
        true
    }

    /// Marks `key` (its L1 `replica`) evictable in its data plane.
    pub(super) fn mark(&mut self, key: BlockKey, marked: Marked, out: &mut Vec<TierCommand>) {
        if marked.reason == EvictReason::Demoted {
            self.counters.marked_clean += 1;
        } else {
            self.counters.marked_drop += 1;
        }
        self.marked.insert(key, marked);
        self.mark_order.push_back(key);
        if self.mark_order.len() > 2 * self.marked.len() + 1024 {
            let live = &self.marked;
            self.mark_order.retain(|k| live.contains_key(k));
        }
        let body = evict_body(&marked.replica, &key, marked.reason);
        out.push(TierCommand { request: 0, region: marked.replica.region.0, action: TierAction::Mark(body) });
    }

    /// Takes the mark of `key` back (in its data plane too), and puts the
    /// block back in its cache.
    pub(super) fn unmark(&mut self, key: BlockKey) {
        if let Some(marked) = self.marked.remove(&key) {
            self.unmarks.push((key, marked));
            self.space(Tier::L1Dram, marked.namespace).cache.add(marked.parent, key, marked.kind);
        }
    }

    /// A new block in L1 `region` continues `parent`: a parent taken out
    /// of its cache as a victim — marked evictable, being written below
    /// to be marked, or written and waiting for its mark — is no leaf now
    /// and no victim. It goes back in its cache, and so do its ancestors
    /// taken with it (victims go leaf first), top down, so each is under
    /// its parent again and the new block under it: left out, the new
    /// block would start a subtree of its own and leave L1 before the
    /// chain it continues.
    pub(super) fn continued_in_l1(&mut self, parent: Option<BlockKey>, region: u16) {
        // Taken with their marks (`None`: put back by `unmark`), or to put
        // back as they are, leaf first.
        let mut line: Vec<(BlockKey, Option<Pending>)> = Vec::new();
        let mut at = parent;
        while let Some(key) = at {
            if let Some(marked) = self.marked.get(&key) {
                at = marked.parent;
                line.push((key, None));
            } else if let Some(pending) = self
                .pending_of
                .get(&(key, region))
                .and_then(|request| self.pending.get_mut(request))
                .filter(|p| p.cleans)
            {
                // Its write below goes on (a copy kept there), but it is
                // not marked once done.
                pending.cleans = false;
                at = pending.parent;
                line.push((key, Some(*pending)));
            } else if let Some(i) = self.cleaned.iter().position(|p| p.key == key && p.region == region) {
                let pending = self.cleaned.swap_remove(i);
                at = pending.parent;
                line.push((key, Some(pending)));
            } else {
                break;
            }
        }
        for (key, taken) in line.into_iter().rev() {
            self.counters.victims_continued += 1;
            match taken {
                None => self.unmark(key),
                Some(p) => {
                    self.space(Tier::L1Dram, p.namespace).cache.add(p.parent, p.key, p.kind);
                }
            }
        }
    }

    /// L1 blocks being written below with their L1 copy kept (of `region`,
    /// if given).
    fn l1_copies_below(&self, region: Option<u16>) -> usize {
        self.pending
            .values()
            .filter(|p| p.tier == Tier::L1Dram && !p.frees && p.to.is_some() && region.is_none_or(|r| r == p.region))
            .count()
    }

    /// Writes L1 blocks below ahead of demand (their L1 copy kept, in
    /// their cache as before), oldest first, once they are
    /// [`CLEAN_AFTER_NS`] old and L1 is [`CLEAN_FROM_PERCENT`] full, where
    /// the node's L2 has room and admits them: a victim chosen later then
    /// has a copy below, and a save takes its slot at once.
    fn plan_cleaning(&mut self, locations: &Locations, now_ns: u64, out: &mut Vec<TierCommand>) {
        if self.emptying_l1 {
            return;
        }
        // Each write stages its block in a free L1 slot: none while L1 is
        // over its mark (its evictions make room first). None while an L2
        // file is drained either: its blocks need the others' room.
        let capacity = self.capacity(Tier::L1Dram);
        let used = self.used_by(Tier::L1Dram, None);
        if used < percent_of(capacity, CLEAN_FROM_PERCENT) || self.l1_over_high() || !self.drains.is_empty() {
            return;
        }
        let mut in_flight = self.l1_copies_below(None);
        while in_flight < CLEANING_IN_FLIGHT {
            let Some(&(at, key, region, namespace)) = self.to_clean.front() else { break };
            if at.saturating_add(CLEAN_AFTER_NS) > now_ns {
                break;
            }
            let Some(info) = self.regions.get(&region).copied() else {
                self.to_clean.pop_front();
                continue;
            };
            let Some((l2_region, l2_info)) = self.l2_written_to(info.node) else { break };
            if self.l2_pressure(l2_info.slot_bytes) != (false, false) {
                // L2 over its mark: a block written there now would push
                // out another (or this one, soon after its L1 copy goes).
                break;
            }
            self.to_clean.pop_front();
            let Some(source) = locations.ready(&key).find(|r| r.region.0 == region) else { continue };
            let (parent, kind) = parent_and_kind(locations, &key);
            // A copy pulled in, or placed in its home elsewhere, is
            // another node's to keep: never written below here.
            if held_below(locations, &key)
                || !self.worth_l2(&key, parent)
                || self.pending_of.contains_key(&(key, region))
                || self.marked.contains_key(&key)
                || self.pulled_in.contains(&key)
            {
                continue;
            }
            let pending = self.l1_copy(key, (parent, kind), namespace, region, now_ns, false);
            let target = l2_target(l2_region, &l2_info);
            self.ask(pending, TierAction::Copy(transfer(&source, target, key, Priority::WriteBack)), out);
            self.counters.cleanings += 1;
            in_flight += 1;
        }
    }

    /// Chooses L1 victims ahead of demand, for every L1 region whose data
    /// plane takes marks: in each cache's policy order, a victim with a
    /// copy below is marked evictable at once; one without is first
    /// written below (its L1 copy kept) where a lower tier has room, and
    /// marked when that is done; where none has, it is marked to be
    /// dropped. A save into a full L1 then takes a marked victim's slot on
    /// the spot, with no command on its way.
    fn plan_marks(&mut self, locations: &Locations, leases: &Leases, now_ns: u64, out: &mut Vec<TierCommand>) {
        while let Some(&(at, key)) = self.recent.front() {
            if at.saturating_add(MARK_AFTER_NS) > now_ns {
                break;
            }
            self.recent.pop_front();
            if self.recent_keys.get(&key) == Some(&at) {
                self.recent_keys.remove(&key);
                if let Some(namespace) = self.unwanted.remove(&key)
                    && let Some(space) = self.spaces.get_mut(&(Tier::L1Dram, namespace))
                {
                    space.cache.make_cold(&key);
                }
            }
        }
        if self.emptying_l1 {
            // Stopping: what has no copy below is demoted, not dropped.
            let dirty: Vec<BlockKey> =
                self.marked.iter().filter(|(_, m)| m.reason != EvictReason::Demoted).map(|(k, _)| *k).collect();
            for key in dirty {
                self.unmark(key);
            }
        }
        for key in std::mem::take(&mut self.recheck) {
            if self.marked.contains_key(&key) && !held_below(locations, &key) {
                self.unmark(key);
            }
        }
        for (key, marked) in self.unmarks.drain(..) {
            self.counters.unmarked += 1;
            let body = evict_body(&marked.replica, &key, marked.reason);
            out.push(TierCommand { request: 0, region: marked.replica.region.0, action: TierAction::Unmark(body) });
        }
        for pending in std::mem::take(&mut self.cleaned) {
            let key = pending.key;
            let source = locations.ready(&key).find(|r| r.region.0 == pending.region);
            let below = held_below(locations, &key);
            match source {
                Some(replica) if below && !self.pending_of.contains_key(&(key, pending.region)) => {
                    let marked = Marked {
                        namespace: pending.namespace,
                        parent: pending.parent,
                        kind: pending.kind,
                        replica,
                        reason: EvictReason::Demoted,
                    };
                    self.mark(key, marked, out);
                }
                Some(_) => self.put_back(&pending),
                None => {}
            }
        }
        let used = self.used_by(Tier::L1Dram, None);
        if self.emptying_l1
            || (self.l1_over_high() && !self.l1_victims_dropped())
            || used < percent_of(self.capacity(Tier::L1Dram), CLEAN_FROM_PERCENT)
            || !self.drains.is_empty()
        {
            // Over its mark, L1's evictions make room first (and a victim
            // written below would find no slot to stage in) — unless its
            // victims would be dropped: then nothing is dropped ahead of a
            // save's need, and marks are what makes room. Under half full,
            // no save needs a victim; while an L2 file is drained, L1's
            // victims are demoted as they go (its blocks need the other
            // files' room). Room is made (or not needed) either way.
            let regions: Vec<u16> = self.marks_taken.iter().copied().collect();
            for region in regions {
                self.say_victims_left(region, true, out);
            }
            return;
        }
        let regions: Vec<(u16, RegionUse)> = self
            .regions
            .iter()
            .filter(|(region, info)| info.tier == Tier::L1Dram && self.marks_taken.contains(region))
            .map(|(&region, &info)| (region, info))
            .collect();
        for (region, info) in regions {
            // Victims on their way below, or to another member.
            let mut cleaning = self.l1_copies_below(Some(region)) + self.spills_from(region, locations);
            let l2 = self.l2_written_to(info.node);
            let l3 = self.l3_target(info.node);
            let mut namespaces: Vec<(u64, u64)> = self
                .spaces
                .iter()
                .filter(|((tier, _), space)| *tier == Tier::L1Dram && !space.cache.index.is_empty())
                .map(|((_, namespace), _)| (self.used.get(&(region, *namespace)).copied().unwrap_or(0), *namespace))
                .collect();
            namespaces.sort_unstable_by(|a, b| b.cmp(a));
            let target = (info.slots / 4).max(1);
            let held = self.marked.values().filter(|m| m.replica.region.0 == region).count() as u64;
            let wanted = target.saturating_sub(held + cleaning as u64);
            let mut budget = MARKS_PER_PASS.min(usize::try_from(wanted).unwrap_or(usize::MAX));
            let mut capped = false;
            for (_, namespace) in namespaces {
                while budget > 0 {
                    // Room below: L2 under its mark (a block written
                    // there past it would push out another, or soon itself).
                    let room_below = l2.is_some_and(|(_, info)| self.l2_pressure(info.slot_bytes) == (false, false));
                    let drops = !room_below && l3.is_none();
                    if (room_below || l3.is_some()) && cleaning >= CLEANING_IN_FLIGHT {
                        // Its victims would wait to be written below.
                        capped = true;
                        break;
                    }
                    // Blocks saved lately are not victims while older
                    // ones are (a save's own blocks are not the victims of
                    // the rest of it); where nothing has room below (the
                    // victim would be dropped), not at all.
                    let key = self.take_l1_victim(region, namespace, false, locations, leases).or_else(|| {
                        if drops { None } else { self.take_l1_victim(region, namespace, true, locations, leases) }
                    });
                    let Some(key) = key else { break };
                    budget -= 1;
                    let Some(replica) = locations.ready(&key).find(|r| r.region.0 == region) else { continue };
                    let (parent, kind) = parent_and_kind(locations, &key);
                    let below = held_below(locations, &key);
                    let worth_l2 = self.worth_l2(&key, parent);
                    // A copy pulled in from another node is dropped: its
                    // holder keeps the block.
                    let pulled = self.pulled_in.contains(&key);
                    let marked = |reason| Marked { namespace, parent, kind, replica, reason };
                    let target = match (below, l2) {
                        (true, _) => None,
                        (false, _) if pulled => None,
                        (false, Some((l2_region, l2_info))) if room_below && worth_l2 => {
                            Some(l2_target(l2_region, &l2_info))
                        }
                        (false, _) => l3,
                    };
                    match (below, target) {
                        (true, _) => self.mark(key, marked(EvictReason::Demoted), out),
                        (false, Some(target)) => {
                            let pending = self.l1_copy(key, (parent, kind), namespace, region, now_ns, true);
                            let copy = TierAction::Copy(transfer(&replica, target, key, Priority::WriteBack));
                            self.ask(pending, copy, out);
                            if target.tier == Tier::L3Object as u8 {
                                self.counters.l3_copies += 1;
                            } else {
                                self.counters.cleanings += 1;
                            }
                            cleaning += 1;
                        }
                        (false, None) if self.recent_keys.contains_key(&key) && !pulled => {
                            // Not worth an L2 write, and new: not dropped yet.
                            self.space(Tier::L1Dram, namespace).cache.add(parent, key, kind);
                        }
                        // No room for it here: another member may have.
                        (false, None) if drops && !pulled && self.spills_instead(&key) => {
                            self.spill(key, (parent, kind), namespace);
                        }
                        (false, None) => self.mark(key, marked(EvictReason::Capacity), out),
                    }
                }
            }
            // No victim left to mark, none marked, and nothing on its way
            // out or below: a save that finds no slot here would wait for
            // nothing.
            let held = self.marked.values().any(|m| m.replica.region.0 == region);
            let moving = self.pending.values().any(|p| p.region == region && p.tier == Tier::L1Dram)
                || self.spills_from(region, locations) > 0;
            let exhausted = budget > 0 && !capped && !held && !moving;
            self.say_victims_left(region, !exhausted, out);
        }
    }

    /// Tells the data plane of L1 `region` whether more victims may come,
    /// where that changed since it was last told.
    fn say_victims_left(&mut self, region: u16, left: bool, out: &mut Vec<TierCommand>) {
        if self.victims_left.get(&region).copied().unwrap_or(true) == left {
            return;
        }
        self.victims_left.insert(region, left);
        let body = lake_dp::wire::message::VictimsLeft { region, left: u8::from(left), reserved: [0; 5] };
        out.push(TierCommand { request: 0, region, action: TierAction::VictimsLeft(body) });
    }

    /// The next victim of `namespace`'s L1 cache that may be marked: its
    /// replica in `region` ready, no command on it, no lease, and (unless
    /// `recent_too`) not added lately. Taken out of the cache.
    fn take_l1_victim(
        &mut self,
        region: u16,
        namespace: u64,
        recent_too: bool,
        locations: &Locations,
        leases: &Leases,
    ) -> Option<BlockKey> {
        let (pending_of, recent, pulled) = (&self.pending_of, &self.recent_keys, &self.pulled_in);
        let spilling = &self.spills.waiting;
        let space = self.spaces.get_mut(&(Tier::L1Dram, namespace))?;
        space.cache.take_victim(64, |key| {
            let Some(replica) = locations.ready(key).find(|r| r.tier == Tier::L1Dram) else { return Verdict::Gone };
            if replica.region.0 != region
                || pending_of.contains_key(&(*key, replica.region.0))
                || spilling.contains_key(key)
                || leases.is_held(key, replica.region.0)
                || (!recent_too && recent.contains_key(key) && !pulled.contains(key))
            {
                return Verdict::Keep;
            }
            Verdict::Evict
        })
    }

    /// Whether an L1 block is worth an L2 write: always, or (under
    /// [`L2Admission::SecondAccess`]) once it or its parent was seen twice.
    fn worth_l2(&self, key: &BlockKey, parent: Option<BlockKey>) -> bool {
        self.config.l2_admission == L2Admission::Always
            || self.seen_twice.contains(key)
            || parent.is_some_and(|p| self.seen_twice.contains(&p))
    }

    /// The pending entry of a copy of `key`'s L1 replica in `region`
    /// below, its L1 copy kept (`cleans`: marked once it lands).
    fn l1_copy(
        &self,
        key: BlockKey,
        (parent, kind): (Option<BlockKey>, ObjectKind),
        namespace: u64,
        region: u16,
        now_ns: u64,
        cleans: bool,
    ) -> Pending {
        Pending {
            key,
            parent,
            kind,
            namespace,
            tier: Tier::L1Dram,
            region,
            bytes: self.block_bytes(region, &key),
            deadline_ns: now_ns.saturating_add(PENDING_TIMEOUT_NS),
            frees: false,
            to: None,
            cleans,
        }
    }

    /// Whether an L1 victim would now be dropped: no L3, and L2 missing
    /// or over its mark.
    pub(super) fn l1_victims_dropped(&self) -> bool {
        !self.regions.values().any(|r| r.tier == Tier::L3Object)
            && self.regions.values().find(|r| r.tier == Tier::L2Nvme).is_none_or(|r| self.l2_pressure(r.slot_bytes).0)
    }

    /// Whether L1 holds more than its high-water mark (counting what is on
    /// its way out as gone).
    pub(super) fn l1_over_high(&self) -> bool {
        self.shared_live(Tier::L1Dram) > percent_of(self.shared_capacity(Tier::L1Dram), self.config.high_percent)
    }

    /// Whether `namespace`'s blocks in `tier` lie in an L1 partition of
    /// their own (held by their tenant's quota, not by the tier's marks).
    fn partitioned(&self, tier: Tier, namespace: u64) -> bool {
        tier == Tier::L1Dram && self.config.l1_partitions.iter().any(|(_, namespaces)| namespaces.contains(&namespace))
    }

    /// What `tier` holds for the namespaces without a partition of their
    /// own, less what is on its way out.
    fn shared_live(&self, tier: Tier) -> u64 {
        let live = |namespace| self.used_by(tier, namespace).saturating_sub(self.pending_by(tier, namespace));
        let all = live(None);
        if tier != Tier::L1Dram {
            return all;
        }
        let partitioned: u64 =
            self.config.l1_partitions.iter().flat_map(|(_, namespaces)| namespaces).map(|&n| live(Some(n))).sum();
        all.saturating_sub(partitioned)
    }

    /// What `tier` may hold for the namespaces without a partition of
    /// their own.
    fn shared_capacity(&self, tier: Tier) -> u64 {
        let capacity = self.capacity(tier);
        if tier != Tier::L1Dram {
            return capacity;
        }
        capacity.saturating_sub(self.config.l1_partitions.iter().map(|(bytes, _)| bytes).sum())
    }

    /// Evicts the first marked victim (of `namespace`, if given; with a
    /// copy below, if `clean_only`) whose replica is as marked, nothing on
    /// it: the victims chosen ahead go before any other. False when there
    /// is none.
    fn evict_marked(
        &mut self,
        namespace: Option<u64>,
        clean_only: bool,
        locations: &Locations,
        leases: &Leases,
        now_ns: u64,
        out: &mut Vec<TierCommand>,
    ) -> bool {
        let mut looked = 0;
        let queued = self.mark_order.len();
        while looked < queued {
            looked += 1;
            let Some(key) = self.mark_order.pop_front() else { return false };
            let Some(marked) = self.marked.get(&key).copied() else { continue };
            let region = marked.replica.region.0;
            let same = locations.ready(&key).any(|r| {
                r.region.0 == region && (r.slot, r.generation) == (marked.replica.slot, marked.replica.generation)
            });
            if !same {
                self.unmark(key);
                continue;
            }
            if namespace.is_some_and(|n| n != marked.namespace)
                || (clean_only && marked.reason != EvictReason::Demoted)
                || self.pending_of.contains_key(&(key, region))
                || leases.is_held(&key, region)
            {
                self.mark_order.push_back(key);
                continue;
            }
            self.marked.remove(&key);
            let pending = self.leaving(locations, key, (marked.namespace, Tier::L1Dram), region, now_ns);
            self.counters.drops[Tier::L1Dram as usize] += 1;
            self.ask(pending, TierAction::Evict(evict_body(&marked.replica, &key, marked.reason)), out);
            return true;
        }
        false
    }

    /// Where an L1 victim of `namespace` is demoted to — `region` of its
    /// node's L2, under `pressure` ([`Tiers::l2_pressure`]) — or `None`
    /// when it is not: L2 is full, or over its mark and its policy would
    /// not admit the block.
    fn demotion_target(
        &mut self,
        namespace: u64,
        key: &BlockKey,
        region: u16,
        info: &RegionUse,
        (over_high, no_room): (bool, bool),
    ) -> Option<ReplicaWire> {
        if no_room {
            // Every slot is taken or promised (moves out of L2 still in
            // flight hold theirs): the write would fail.
            return None;
        }
        if over_high && !self.space(Tier::L2Nvme, namespace).cache.admits(key) {
            self.counters.admission_refused += 1;
            return None;
        }
        Some(l2_target(region, info))
    }
    /// L2's pressure for one more block of `bytes`: above the high-water
    /// mark (counting moves out in flight as gone, writes in flight into
    /// it as landed), and with no slot left
    /// at all (counting them as still there, and writes in flight into L2
    /// as landed).
    pub(super) fn l2_pressure(&self, bytes: u64) -> (bool, bool) {
        let capacity = self.capacity(Tier::L2Nvme);
        let used = self.used_by(Tier::L2Nvme, None);
        let live = used.saturating_sub(self.pending_by(Tier::L2Nvme, None));
        let inbound: u64 = self.pending.values().filter(|p| p.to == Some(Tier::L2Nvme)).map(|p| p.bytes).sum();
        let over_high = live + inbound + bytes > percent_of(capacity, self.config.high_percent);
        // Room is in the regions written to: not those being drained.
        let drained: u64 = self.drains.keys().map(|&region| self.region_bytes(region)).sum();
        (over_high, used.saturating_sub(drained) + inbound + bytes > capacity)
    }
}
