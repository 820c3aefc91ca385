//! The poll loop: passes, each made of the same stages in the same order,
//! and the park between them when a pass found nothing to do.
//!
//! A pass ([`Node::pass`]) is generic over the I/O backend and the clock,
//! so the simulation runs the very passes a running node does, over the
//! simulated disk and a virtual clock. Its stages, in order:
//!
//! 1. **watch**: a stop asked (signal or flag), saves closed, the save
//!    pressure agents read;
//! 2. **catalog**: what L3's background scan found, into the catalog;
//! 3. **serve**: the agents' rings, the control plane's commands, the
//!    transport's sends and landings, the attach socket (or, stopping:
//!    agents refused while the rest drains);
//! 4. **complete**: the poller driven, its completions handed to the
//!    block service (or the self-test), drained slots freed;
//! 5. **report**: once a second, the running figures to `lake-cp`;
//! 6. **link**: the link pumped, or made again where it closed.

use super::*;

/// The node's parts the block service borrows together, field by field
/// (so the pool and the rest of the node stay free to borrow).
macro_rules! parts {
    ($node:expr, $now:expr) => {
        Parts {
            poller: &mut $node.poller,
            table: &mut $node.table,
            l2: &mut $node.l2_slots,
            region: &$node.region,
            link: &mut $node.link,
            now_ns: $now,
        }
    };
}

/// What a pass found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pass {
    /// It did work (or I/O is in flight): pass again at once.
    Busy,
    /// Nothing to do: spin a while, then park.
    Idle,
    /// Stopped and drained (or the drain's deadline passed).
    Done,
}

/// The loop's own state between passes.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Pace {
    /// Since when passes found nothing to do.
    pub idle_since: Option<u64>,
    /// The drain's deadline, once a stop was asked.
    pub stopping: Option<u64>,
    /// The save pressure last told to agents.
    pub save_pressure: bool,
    /// When the running figures go to `lake-cp` next.
    pub next_stats_ns: u64,
    /// Saves refused so far, as last logged (once a second at most).
    pub refused_logged: u64,
    /// Saves refused over a quota, as last logged with each quota's
    /// figures.
    pub quota_refused_logged: u64,
}

impl Node {
    /// The poll loop, until the node has drained after a stop (or its
    /// drain deadline passed, or the self-test ended); an error (a park
    /// that failed) ends it at once.
    pub(super) fn serve(
        &mut self,
        config: &RunnerConfig,
        options: &RunnerOptions,
        ports: &RunnerPorts,
        stats: &mut RunnerStats,
    ) -> Result<(), RunnerError> {
        let spin_ns = config.poller.spin_us * 1000;
        loop {
            let now = self.clock.now_ns();
            let pass = self.pass(now, config, options, ports, stats);
            if pass == Pass::Done {
                return Ok(());
            }
            let end = self.clock.now_ns();
            stats.polls += 1;
            if pass == Pass::Busy {
                stats.busy_polls += 1;
                stats.busy_ns += end - now;
                self.pace.idle_since = None;
                continue;
            }
            stats.idle_ns += end - now;
            let since = *self.pace.idle_since.get_or_insert(end);
            if end - since >= spin_ns {
                self.park(config, stats, end)?;
            }
        }
    }

    /// Idle past the spin budget: parks until a completion, a wake-up or a
    /// signal; briefly when timers (flush batching, deadlines) wait.
    fn park(&mut self, config: &RunnerConfig, stats: &mut RunnerStats, end: u64) -> Result<(), RunnerError> {
        let Self { attach, transport, extra_fds, park_fds, pool, poller, wakeup, link, table, signals, .. } = self;
        let timeout_ms = if poller.has_work() || table.stats().draining > 0 || pool.l3_in_flight() > 0 {
            1
        } else {
            config.poller.park_max_ms
        };
        set_parked(wakeup, attach.as_ref(), true);
        // Once more after saying so: work queued before the flag was seen
        // did not wake us.
        if pool.has_agent_work() || link.as_ref().is_some_and(CpLink::has_commands) {
            set_parked(wakeup, attach.as_ref(), false);
            self.pace.idle_since = None;
            return Ok(());
        }
        let mut extra = 0;
        if let Some(socket) = link.as_ref().filter(|l| !l.is_closed()).map(CpLink::raw_fd) {
            extra_fds[0] = socket;
            extra = 1;
        }
        if let Some(transport) = &transport {
            extra_fds[extra] = transport.tcp_ref().raw_fd();
            extra += 1;
        }
        if let Some(attach) = &attach {
            extra += attach.fds(&mut extra_fds[extra..]);
        }
        let parked = os::park(wakeup, signals.as_ref(), &extra_fds[..extra], park_fds, timeout_ms);
        set_parked(wakeup, attach.as_ref(), false);
        try_to!("parking", parked);
        if let Some(link) = link {
            // Commands that arrived while parked.
            let _ = link.pump();
        }
        let woke = self.clock.now_ns();
        stats.parks += 1;
        stats.parked_ns += woke - end;
        self.pace.idle_since = None;
        Ok(())
    }
}

impl<B: IoBackend, C: Clock> Node<B, C> {
    /// One pass of the loop at `now`: its stages in order (see the
    /// module's comment).
    pub(super) fn pass(
        &mut self,
        now: u64,
        config: &RunnerConfig,
        options: &RunnerOptions,
        ports: &RunnerPorts,
        stats: &mut RunnerStats,
    ) -> Pass {
        let budget = config.poller.batch_max;
        self.watch(now, config, options, ports, stats);
        let mut served = self.catalog();
        if let Some(deadline) = self.pace.stopping {
            let mut parts = parts!(self, now);
            served += self.pool.poll_l3(&mut parts);
            served += self.pool.serve_agents(&mut parts, now, budget);
            if !self.poller.has_work() && self.pool.l3_in_flight() == 0 {
                return Pass::Done;
            }
            if now > deadline {
                stats.abandoned = self.poller.stats().admitted.saturating_sub(stats.ops_ok + stats.ops_failed);
                return Pass::Done;
            }
        } else {
            served += self.serve_work(now, ports, budget, stats);
        }
        let (result, count) = self.complete(now, budget, stats);
        if now >= self.pace.next_stats_ns {
            self.pace.next_stats_ns = now + 1_000_000_000;
            self.report(stats);
        }
        self.keep_link(config, stats);
        if result == PollResult::Busy || count > 0 || served > 0 { Pass::Busy } else { Pass::Idle }
    }

    /// A stop asked, saves closed, and the save pressure agents read.
    fn watch(
        &mut self,
        now: u64,
        config: &RunnerConfig,
        options: &RunnerOptions,
        ports: &RunnerPorts,
        stats: &RunnerStats,
    ) {
        let drain_ns = config.poller.drain_timeout_ms * 1_000_000;
        let now_and_then = stats.polls.is_multiple_of(256) || self.pace.idle_since.is_some();
        if self.pace.stopping.is_none()
            && now_and_then
            && (self.signals.as_ref().is_some_and(|s| s.take().is_some())
                || ports.stop.as_ref().is_some_and(|s| s.load(Ordering::Acquire)))
        {
            self.pace.stopping = Some(now + drain_ns);
        }
        if now_and_then {
            if self.pace.stopping.is_some() {
                self.pool.close(pool::Closing::All);
            } else if ports.close_saves.as_ref().is_some_and(|c| c.load(Ordering::Acquire)) {
                self.pool.close(pool::Closing::Saves);
            }
            // Whether saves are refused now, where agents read it without
            // a request.
            let pressure = self.pool.save_pressure(now);
            if pressure != self.pace.save_pressure {
                self.pace.save_pressure = pressure;
                self.wakeup.set_save_pressure(pressure);
                if let Some(attach) = &self.attach {
                    attach.set_save_pressure(pressure);
                }
            }
        }
        let selftest_done = self.selftest.as_ref().is_none_or(|s| s.remaining == 0 && s.in_flight == 0);
        if options.selftest_blocks > 0 && selftest_done && self.pace.stopping.is_none() {
            self.pace.stopping = Some(now + drain_ns);
        }
    }

    /// The store's objects the background scan found: into the catalog
    /// and re-adopted, a few batches a pass.
    fn catalog(&mut self) -> u32 {
        let Some(scan) = &self.l3_scan else { return 0 };
        let (batches, ended) = take_scanned(scan, &mut self.pool, &mut self.link);
        if ended {
            self.l3_scan = None;
        }
        batches
    }

    /// Tenants' key changes, the self-test's blocks, the block service
    /// (agents, commands), the transport and the attach socket.
    fn serve_work(&mut self, now: u64, ports: &RunnerPorts, budget: u32, stats: &RunnerStats) -> u32 {
        let mut parts = parts!(self, now);
        if let Some(keys) = &ports.tenant_keys {
            for change in keys.take() {
                self.pool.key_change(change, &mut parts);
            }
        }
        if let Some(test) = &mut self.selftest {
            test.feed(&mut parts, self.epoch, &mut self.pool);
        }
        let mut served = self.pool.serve(&mut parts, now, budget);
        match self.transport.is_some() {
            true => served += self.serve_transport(now),
            // No transport: a copy to another node cannot go.
            false => self.pool.take_sends(now, |_| false),
        }
        self.pool.end_failed_sends(&mut parts!(self, now));
        // Traced loads answered: the operator's log, under the engine's
        // trace id.
        let node_id = self.node_id;
        self.pool.take_spans(|span| log_span(node_id, span));
        if let Some(attach) = &mut self.attach
            && (stats.polls.is_multiple_of(256) || self.pace.idle_since.is_some())
        {
            attach.poll(&mut self.pool, &mut self.table, self.arena.fd().as_raw_fd(), self.wakeup.fd(), now);
            if let Some(why) = attach.take_refusal() {
                tracing::warn!(event = "attach_refused", why = %why);
            }
        }
        served
    }

    /// Copies `lake-cp` asked of this node for other nodes, written to the
    /// transport; blocks peers sent here, landed; transfers that ended,
    /// answered.
    fn serve_transport(&mut self, now: u64) -> u32 {
        let Some(transport) = &mut self.transport else { return 0 };
        let Transfers { done, trace_events, started, latency } = &mut self.transfers;
        let (region, peers_by_node) = (&self.region, &self.peers_by_node);
        self.pool.take_sends(now, |send| {
            let Some(&(_, peer)) = peers_by_node.iter().find(|(n, _)| *n == send.target.node) else {
                return false;
            };
            let Some(source) = region.slot_ptr(send.slot) else { return false };
            let block = crate::transport::tcp::Outgoing {
                transfer: send.request,
                peer,
                source,
                len: send.len,
                target: crate::transport::frame::BlockAddr {
                    region: send.target.region,
                    epoch: send.target.region_epoch,
                    slot: crate::transport::ANY_SLOT,
                    generation: 0,
                },
                priority: send.priority,
                // Copies `lake-cp` asks serve no engine's request.
                trace: 0,
                namespace: send.namespace,
            };
            // SAFETY: the source slot is held (busy) by the pool until
            // `send_ended`, after this transfer's end.
            let written = unsafe { transport.write(&block, now) }.is_ok();
            if written && started.len() < started.capacity() {
                started.insert(send.request, now);
            }
            written
        });
        // Copies `lake-cp` took back: the transport drops those none of
        // whose bytes went out.
        self.pool.take_send_cancels(|request| {
            transport.cancel(request);
        });
        let mut served = 0;
        let mut parts = parts!(self, now);
        let mut landing = pool::PoolLanding { pool: &mut self.pool, parts: &mut parts };
        if transport.poll(&mut landing, now, done) {
            served += 1;
        }
        for transfer in done.drain(..) {
            if let Some(started) = started.remove(&transfer.transfer) {
                latency.record(now.saturating_sub(started));
            }
            let landed = transfer.result.map(|()| transfer.target).map_err(|e| transfer_code(&e));
            self.pool.send_ended(transfer.transfer, landed, &mut parts);
        }
        // What was refused on the links, RDMA links up or down, blocks
        // that landed under an engine's trace id: the operator's log.
        log_links(transport.as_mut());
        transport.take_trace_events(trace_events);
        for event in trace_events.drain(..) {
            log_trace_event(self.node_id, &event);
        }
        served
    }

    /// The poller driven; its completions handed to the block service
    /// (or the self-test); slots whose pins drained, freed.
    fn complete(&mut self, now: u64, budget: u32, stats: &mut RunnerStats) -> (PollResult, usize) {
        let result = self.poller.poll(now, budget);
        let count = self.poller.reap(&mut self.events);
        for event in &self.events[..count] {
            if event.outcome.is_ok() {
                stats.ops_ok += 1;
            } else {
                stats.ops_failed += 1;
            }
            let mut parts = parts!(self, now);
            if event.cookie & pool::POOL_COOKIE != 0 {
                self.pool.finished(event, &mut parts);
            } else if let Some(test) = &mut self.selftest {
                test.done(event, &mut parts, stats, &mut self.pool);
            }
        }
        if self.table.stats().draining > 0 {
            self.table.reclaim();
        }
        (result, count)
    }

    /// Refused saves are an engine's lost hits: said, at most once a
    /// second, with how many and why (and each quota that refused).
    fn log_refused_saves(&mut self) {
        if self.pool.stats.saves_refused <= self.pace.refused_logged {
            return;
        }
        let p = &self.pool.stats;
        tracing::warn!(
            event = "saves_refused",
            blocks = p.saves_refused - self.pace.refused_logged,
            total = p.saves_refused,
            no_space = p.saves_refused_no_space(),
            load_reserve = p.saves_refused_reserve,
            stopping = p.saves_refused_stopping,
            over_quota = p.saves_refused_quota,
            why = "no_space: no L1 slot free for a save and no victim marked to take in time (L1 full of blocks \
                   not yet written below or dropped); load_reserve: only the load reserve left; stopping: the pool \
                   is stopping; over_quota: the block's namespace or tenant is at its L1 quota"
        );
        self.pace.refused_logged = p.saves_refused;
        if p.saves_refused_quota > self.pace.quota_refused_logged {
            self.pace.quota_refused_logged = p.saves_refused_quota;
            for (quota, usage) in self.pool.quota_usage(&mut self.table) {
                if usage.refused > 0 {
                    tracing::warn!(
                        event = "quota_refused",
                        quota,
                        refused = usage.refused,
                        bytes = usage.bytes,
                        limit = usage.limit
                    );
                }
            }
        }
    }

    /// The running figures to `lake-cp`, and refused saves to the log.
    fn report(&mut self, stats: &mut RunnerStats) {
        self.log_refused_saves();
        // Pins of agents whose process died go with it (their record's
        // lock went with the process).
        stats.agents_released += u64::from(self.table.release_dead_agents());
        if let Some(link) = &mut self.link {
            link.stats(&DataPlaneStats {
                busy_ns: stats.busy_ns,
                idle_ns: stats.idle_ns,
                parked_ns: stats.parked_ns,
                bytes_l1_to_l2: self.pool.stats.bytes_down,
                bytes_l2_to_l1: self.pool.stats.bytes_up,
                saves: self.pool.stats.saves,
                saves_refused: self.pool.stats.saves_refused,
                // Refused at commit, or found out after it.
                commits_corrupt: self.pool.stats.commits_corrupt + self.pool.stats.commits_corrupt_late,
                promotions: self.pool.stats.promotions,
                demotions: self.pool.stats.demotions,
                evictions: self.pool.stats.evictions,
                pins: self.table.pins_held(),
                draining: self.table.stats().draining,
            });
            let p = &self.pool.stats;
            // A control plane that does not read quota refusals counts them
            // as no room: the reasons still add up.
            let quota = if link.takes(crate::wire::FEATURE_QUOTA_REFUSALS) { p.saves_refused_quota } else { 0 };
            link.save_refusals(&crate::wire::message::SaveRefusals {
                no_space: p.saves_refused_no_space() + (p.saves_refused_quota - quota),
                load_reserve: p.saves_refused_reserve,
                stopping: p.saves_refused_stopping,
                over_quota: quota,
            });
            link.connections_shed(&shed(self.attach.as_ref(), self.transport.as_deref()));
            if let Some(transport) = &self.transport {
                link.rails(
                    crate::wire::message::Network::Storage,
                    &rail_entries(transport.as_ref(), &self.peers_by_node),
                );
            }
            link.tenant_throttles(&self.pool.tenant_throttles());
            let l2 = self.poller.stats().latency;
            match self.pool.l3_latency() {
                Some([read, write]) => link.path_latency(&[l2[0], l2[1], l2[2], self.transfers.latency, read, write]),
                None => link.path_latency(&[l2[0], l2[1], l2[2], self.transfers.latency]),
            }
        }
    }

    /// The link pumped where it has reports to send (and now and then);
    /// made again where it closed.
    fn keep_link(&mut self, config: &RunnerConfig, stats: &RunnerStats) {
        if let Some(link) = &mut self.link
            && (!link.is_flushed() || stats.polls.is_multiple_of(1024))
            && link.pump().is_err()
        {
            // The control plane went away: serve on; reports are counted
            // as dropped until a control plane takes the link again.
        }
        if self.link.as_ref().is_some_and(CpLink::is_closed) {
            let (pool, region, table, l2_slots) = (&self.pool, &self.region, &self.table, &mut self.l2_slots);
            self.reconnect.poll(
                self.clock.now_ns(),
                &mut self.link,
                config,
                &self.geometry,
                self.epoch,
                &self.header,
                |new| {
                    pool.resident_records(region, table, &mut |record| {
                        new.readopted(&record);
                        let _ = new.pump();
                    });
                    // Drains are the control plane's: one that took over (or
                    // restarted) asks again for those it holds; until then
                    // every file is written to, as its capacity counts them.
                    l2_slots.undrain_all();
                },
            );
        }
    }
}

/// What the node's listeners let go: the attach socket's and the
/// transport's.
fn shed(
    attach: Option<&super::attach::AttachServer>,
    transport: Option<&dyn crate::transport::Links>,
) -> crate::wire::message::ConnectionsShed {
    let attach = attach.map(|a| a.counters).unwrap_or_default();
    let tcp = transport.map(|t| t.tcp_ref().stats).unwrap_or_default();
    crate::wire::message::ConnectionsShed {
        attach_strangers: attach.strangers,
        attach_hello_timeouts: attach.hello_timeouts,
        attach_crowded_out: attach.crowded_out,
        attach_user_ports_full: attach.user_ports_full,
        transport_over_cap: tcp.inbound_over_cap,
        transport_silent: tcp.inbound_silent,
        transport_accept_failed: tcp.accept_failed,
        reserved: 0,
    }
}
