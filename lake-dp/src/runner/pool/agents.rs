//! What agents ask of the block service: their ports served in turn
//! (under their tenants' rates), each request started, and each answered
//! (with a load's trace when it asked for one); agents attached, detached
//! and taken as broken.

use super::{Closing, L1State, LoadSpan, POOL_COOKIE, Pool, Purpose, Requester, SAVE_WAIT_NS, TRACED_MAX, TracedLoad};
use crate::agent::port::{AgentCompletion, AgentError, AgentRequest, DpPort};
use crate::agent::shm::Popped;
use crate::arena::SlotTable;
use crate::io::IoBackend;
use crate::model::replica::{Priority, Tier};
use crate::op::{Command, Request};
use crate::runner::Parts;
use crate::stored::object_bytes;

impl Pool {
    /// Caps tenants' bandwidth on this node's tiers (`[[tenants]]`).
    pub fn set_rates(&mut self, rates: crate::rates::TenantRates) {
        self.rates = rates;
    }

    /// Each capped tenant's waits, for the control plane (none without
    /// caps).
    pub fn tenant_throttles(&self) -> Vec<crate::wire::message::TenantWait> {
        use crate::wire::message::{TENANT_WAIT_PATHS, TenantWait};
        self.rates
            .waits()
            .map(|(name, waits)| {
                let mut all = [0; TENANT_WAIT_PATHS];
                all[..waits.len()].copy_from_slice(&waits);
                TenantWait {
                    // Names are checked at config to fit.
                    name: crate::wire::message::text_field("tenant_throttle.name", name).unwrap_or_default(),
                    waits: all,
                }
            })
            .collect()
    }

    /// Whether `request` may start now under its tenant's caps (only loads
    /// are capped here; their bytes are taken from the bucket when so).
    pub(super) fn admitted(&mut self, request: &AgentRequest, now_ns: u64) -> bool {
        use crate::rates::RatePath;
        if self.rates.is_empty() {
            // Not even the object's header looked up.
            return true;
        }
        let AgentRequest::Load { source, .. } = request else { return true };
        let cost = if source.tier == Tier::L2Nvme as u8 {
            self.l2_slot_of(source)
                .and_then(|slot| self.l2_object(slot, source.generation))
                .map(|meta| (meta.namespace.0, RatePath::L2Read, object_bytes(meta.payload_len)))
        } else if source.tier == Tier::L3Object as u8 {
            self.l3_object_meta(source).map(|meta| (meta.namespace.0, RatePath::L3Read, object_bytes(meta.payload_len)))
        } else {
            None
        };
        // A load of nothing known is answered (stale) at once, uncapped.
        cost.is_none_or(|(namespace, path, bytes)| self.rates.admit(namespace, path, bytes, now_ns))
    }

    /// Whether an agent has requests waiting (checked before parking).
    pub fn has_agent_work(&mut self) -> bool {
        self.agents.iter_mut().flatten().any(DpPort::has_requests)
    }

    /// The place of shared port `port` among the agents.
    pub fn shared_place(&self, port: u32) -> usize {
        self.shared_base + port as usize
    }

    /// An agent attached at `place` (see [`Pool::shared_place`]), mapping
    /// partition `partition` of the arena.
    pub fn attach(&mut self, place: usize, port: DpPort, partition: u8) {
        if let Some(slot) = self.agents.get_mut(place) {
            *slot = Some(port);
            self.outstanding[place] = 0;
            self.agent_partition[place] = partition;
        }
    }

    /// The partition agent `agent` maps.
    pub(super) fn agent_partition(&self, agent: u16) -> usize {
        self.agent_partition.get(usize::from(agent)).map_or(0, |&p| usize::from(p))
    }

    /// The agent on `place` detached (or died): its port goes, its
    /// reservations are taken back (loads in flight finish; their copies
    /// stay in L1, reported).
    pub fn detach(&mut self, place: usize, table: &mut SlotTable) {
        if let Some(slot) = self.agents.get_mut(place) {
            *slot = None;
        }
        let agent = u16::try_from(place).unwrap_or(u16::MAX);
        for slot in 0..self.l1.len() {
            if matches!(self.l1[slot], L1State::Reserved { agent: owner, .. } if owner == agent) {
                self.release_l1(u32::try_from(slot).unwrap_or(u32::MAX), table);
            }
        }
    }

    /// Ports agents broke since the last call (places), to detach.
    pub fn take_broken(&mut self) -> Option<u16> {
        self.broken.pop()
    }

    /// Serves the agents' rings (while the data plane stops too: closed,
    /// the pool answers them at once). Bounded by `budget` requests.
    pub(crate) fn serve_agents<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>, now_ns: u64, budget: u32) -> u32 {
        let mut done = 0;
        for agent in 0..self.agents.len() {
            let place = u16::try_from(agent).unwrap_or(u16::MAX);
            // A load waiting for its tenant's bucket goes first, or the
            // port waits with it.
            if let Some(request) = self.held[agent].take() {
                if !self.admitted(&request, now_ns) {
                    self.held[agent] = Some(request);
                    continue;
                }
                done += 1;
                self.agent_request(place, request, parts, now_ns);
                if self.held[agent].is_some() {
                    // Still waiting (a save for a victim).
                    continue;
                }
            }
            while done < budget {
                let Some(port) = self.agents[agent].as_mut() else { break };
                // Never more answers owed than the completion ring holds.
                if self.outstanding[agent] as usize >= port.free() {
                    break;
                }
                let Some(popped) = port.pop() else { break };
                done += 1;
                match popped {
                    Popped::Request(request) => {
                        self.outstanding[agent] += 1;
                        if !self.admitted(&request, now_ns) {
                            self.stats.loads_throttled += 1;
                            self.held[agent] = Some(request);
                            break;
                        }
                        self.agent_request(place, request, parts, now_ns);
                        if self.held[agent].is_some() {
                            break;
                        }
                    }
                    Popped::Invalid(cookie) => {
                        self.outstanding[agent] += 1;
                        self.stats.requests_invalid += 1;
                        self.answer(place, cookie, Err(AgentError::Invalid));
                    }
                    Popped::Broken => {
                        self.agents[agent] = None;
                        if self.broken.len() < self.broken.capacity() {
                            self.broken.push(place);
                        }
                        break;
                    }
                }
            }
        }
        done
    }

    /// Starts the writes of demotions whose L1 slot has drained.
    pub(super) fn start_drained<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>, now_ns: u64) -> u32 {
        let mut started = 0;
        let mut at = 0;
        while at < self.draining.len() {
            let (slot, cookie) = self.draining[at];
            if !parts.table.is_drained(slot) {
                at += 1;
                continue;
            }
            let Some(Some(Purpose::Demote { write, .. })) = self.ops.get((cookie & !POOL_COOKIE) as usize) else {
                self.draining.swap_remove(at);
                continue;
            };
            let mut write = *write;
            let bytes = object_bytes(write.meta.payload_len);
            if !self.rates.admit(write.meta.namespace.0, crate::rates::RatePath::L2Write, bytes, now_ns) {
                // Its tenant is at its L2 write cap: it waits here.
                self.stats.writes_throttled += 1;
                at += 1;
                continue;
            }
            // Drained: nobody reads the slot, and it is freed after the
            // write, so its payload is sealed where it lies.
            if write.seal.is_none() {
                // SAFETY: the slot drained (no pins) and is Busy: this
                // thread alone touches it until the write's end frees it.
                let bytes = unsafe { parts.region.slot_mut(slot) };
                match self.seal_in_place(&write.meta, bytes) {
                    Ok(None) => {}
                    Ok(Some(seal)) => {
                        write.seal = Some(seal);
                        if let Some(Some(Purpose::Demote { write: kept, .. })) =
                            self.ops.get_mut((cookie & !POOL_COOKIE) as usize)
                        {
                            kept.seal = Some(seal);
                        }
                    }
                    Err(_) => {
                        self.draining.swap_remove(at);
                        self.seal_failed(cookie, parts);
                        continue;
                    }
                }
            }
            let request =
                Request { command: Command::Write(write), priority: Priority::Demotion, deadline_ns: 0, cookie };
            if parts.poller.submit(request).is_err() {
                // The poller is full: next pass.
                break;
            }
            self.draining.swap_remove(at);
            started += 1;
        }
        started
    }

    pub(super) fn answer(&mut self, agent: u16, cookie: u64, result: Result<(u32, u32), AgentError>) {
        let took_us = self.traced_answer(agent, cookie, result);
        let place = usize::from(agent);
        let Some(Some(port)) = self.agents.get_mut(place) else { return };
        assert!(self.outstanding[place] > 0, "agent {agent} answered for {cookie} with nothing owed");
        self.outstanding[place] -= 1;
        // Room was checked before the request was taken.
        assert!(port.free() > 0, "agent {agent}'s completion ring is full: an answer was not counted as owed");
        port.push(AgentCompletion { cookie, result, took_us });
    }

    /// A load of `agent`'s under an engine's trace id: timed from here to
    /// its answer (untraced, and counted, when [`TRACED_MAX`] are).
    pub(super) fn trace_load(&mut self, agent: u16, cookie: u64, trace: u64, tier: u8) {
        if self.traced.iter().any(|t| t.agent == agent && t.cookie == cookie) {
            // Asked again after waiting for a slot: timed from the first.
            return;
        }
        if self.traced.len() >= TRACED_MAX {
            self.stats.traces_dropped += 1;
            return;
        }
        let started_ns = self.clock_ns();
        self.traced.push(TracedLoad { agent, cookie, trace, tier, started_ns });
    }

    /// If `agent`'s request `cookie` is a traced load, its span (kept for
    /// the log) and its time in µs for the answer; else 0.
    pub(super) fn traced_answer(&mut self, agent: u16, cookie: u64, result: Result<(u32, u32), AgentError>) -> u32 {
        if self.traced.is_empty() {
            return 0;
        }
        let Some(at) = self.traced.iter().position(|t| t.agent == agent && t.cookie == cookie) else { return 0 };
        let traced = self.traced.swap_remove(at);
        let took_ns = self.clock_ns().saturating_sub(traced.started_ns);
        if self.spans.len() < TRACED_MAX {
            let result = result.map(|_| ());
            self.spans.push(LoadSpan { trace: traced.trace, agent, tier: traced.tier, result, took_ns });
        } else {
            self.stats.traces_dropped += 1;
        }
        u32::try_from(took_ns / 1000).unwrap_or(u32::MAX).max(1)
    }

    /// The traced loads answered since the last call, for the log.
    pub fn take_spans(&mut self, mut each: impl FnMut(&LoadSpan)) {
        for span in &self.spans {
            each(span);
        }
        self.spans.clear();
    }

    pub(super) fn agent_request<B: IoBackend>(
        &mut self,
        agent: u16,
        request: AgentRequest,
        parts: &mut Parts<'_, B>,
        now_ns: u64,
    ) {
        let table = &mut *parts.table;
        match request {
            AgentRequest::Reserve { cookie, .. } if self.closing != Closing::Open => {
                self.held_since[usize::from(agent)] = None;
                self.refuse_save(agent, cookie, AgentError::Stopping, now_ns);
            }
            AgentRequest::Commit { cookie, slot, generation, .. } if self.closing == Closing::All => {
                // Not published: acked now, it would be lost with the
                // data plane. Its slot is given back, as for an abort.
                let _ = self.abort(agent, slot, generation, table);
                self.answer(agent, cookie, Err(AgentError::Stopping));
            }
            AgentRequest::Load { cookie, .. } if self.closing == Closing::All => {
                self.answer(agent, cookie, Err(AgentError::Stopping));
            }
            AgentRequest::Reserve { cookie, object_bytes } => {
                let reserve = self.load_reserve_slots as usize;
                let partition = self.agent_partition(agent);
                match self.slot_or_victim(partition, object_bytes, reserve, parts) {
                    Some(grant) => {
                        self.held_since[usize::from(agent)] = None;
                        self.l1[grant.slot as usize] = L1State::Reserved { agent, since_ns: now_ns };
                        self.reserved += 1;
                        self.answer(agent, cookie, Ok((grant.slot, grant.generation)));
                    }
                    // Every marked victim spent: the control plane marks
                    // more at its next pass. The save waits for them (its
                    // port with it), a while at most.
                    None if self.victims_left && self.may_wait(agent, parts, now_ns) => {
                        self.held[usize::from(agent)] = Some(request);
                    }
                    // Waited long enough: refused, and so is every save of
                    // this agent after it until one finds a slot (the wait
                    // is not begun again for each).
                    None => {
                        // Free slots of its class left, all of them the
                        // load reserve's; or none at all.
                        let class = parts.table.class_in(partition, object_bytes);
                        let reserved = class.is_some_and(|c| parts.table.free_slots(c) > 0);
                        let why = if reserved { AgentError::Reserved } else { AgentError::NoSpace };
                        self.refuse_save(agent, cookie, why, now_ns);
                    }
                }
            }
            AgentRequest::Commit { cookie, slot, generation, crcs } => {
                let result = self.commit(agent, (slot, generation), crcs, parts);
                self.answer(agent, cookie, result.map(|()| (slot, generation)));
            }
            AgentRequest::Abort { cookie, slot, generation } => {
                let result = self.abort(agent, slot, generation, table);
                self.answer(agent, cookie, result);
            }
            AgentRequest::Load { cookie, key, source, priority, trace } => {
                if trace != 0 {
                    self.trace_load(agent, cookie, trace, source.tier);
                }
                let to = Requester::Agent { agent, cookie };
                match self.promote(to, key, &source, priority, parts) {
                    Ok(()) => self.held_since[usize::from(agent)] = None,
                    // No L1 slot and no marked victim: the load waits for
                    // the control plane's next marks, as a save does.
                    Err(AgentError::NoSpace) if self.may_wait(agent, parts, now_ns) => {
                        self.held[usize::from(agent)] = Some(request);
                    }
                    Err(e) => self.answer(agent, cookie, Err(e)),
                }
            }
            AgentRequest::Cancel { cookie, load } => {
                // The agent's own load, still with the poller.
                let op = self.ops.iter().position(|purpose| {
                    matches!(purpose, Some(Purpose::Promote { to: Requester::Agent { agent: a, cookie: c }, .. })
                        if *a == agent && *c == load)
                });
                let ticket = op.and_then(|i| self.tickets.get(i).copied().flatten());
                // Or an L3 read still queued for the store's workers.
                let stopped = ticket.is_some_and(|t| parts.poller.cancel(t)) || self.cancel_l3_load(agent, load);
                if stopped {
                    self.stats.loads_cancelled += 1;
                }
                self.answer(agent, cookie, if stopped { Ok((0, 0)) } else { Err(AgentError::Stale) });
            }
        }
    }

    /// Gives back the L1 `slot` (at `generation`) `agent` reserved and
    /// did not commit; `Stale` if it holds no such reservation.
    pub(super) fn abort(
        &mut self,
        agent: u16,
        slot: u32,
        generation: u32,
        table: &mut SlotTable,
    ) -> Result<(u32, u32), AgentError> {
        match self.l1.get(slot as usize) {
            Some(L1State::Reserved { agent: owner, .. })
                if *owner == agent && table.arena().generation(slot) == Some(generation) =>
            {
                self.release_l1(slot, table);
                Ok((slot, generation))
            }
            _ => Err(AgentError::Stale),
        }
    }

    /// Refuses `agent`'s save `cookie` for `why`, counted by reason.
    pub(super) fn refuse_save(&mut self, agent: u16, cookie: u64, why: AgentError, now_ns: u64) {
        self.stats.saves_refused += 1;
        match why {
            AgentError::Reserved => self.stats.saves_refused_reserve += 1,
            AgentError::Stopping => self.stats.saves_refused_stopping += 1,
            _ => {}
        }
        self.refused_at_ns = Some(now_ns);
        self.answer(agent, cookie, Err(why));
    }

    /// Whether a request of `agent` that found no L1 slot (nor a marked
    /// victim) may wait for the control plane to mark more: it marks
    /// victims, and this agent has not waited [`SAVE_WAIT_NS`] in vain
    /// since its last request that found a slot.
    pub(super) fn may_wait<B: IoBackend>(&mut self, agent: u16, parts: &Parts<'_, B>, now_ns: u64) -> bool {
        parts.link.as_ref().is_some_and(|l| l.takes(crate::wire::FEATURE_EVICTABLE))
            && now_ns.saturating_sub(*self.held_since[usize::from(agent)].get_or_insert(now_ns)) < SAVE_WAIT_NS
    }
}
