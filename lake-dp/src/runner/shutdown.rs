//! Ending a node: L3's workers, every acked write made durable, the
//! control plane's link flushed, the parts dropped in the order their
//! memory allows, and the clean shutdown recorded.

use super::*;

impl Node {
    /// Ends the node: L3's workers, every acked write made durable, the
    /// control plane's link flushed, the parts dropped in order, the clean
    /// shutdown recorded; the stopped line written.
    pub(super) fn shut_down(
        self,
        config: &RunnerConfig,
        mut stats: RunnerStats,
        out: &mut dyn Write,
    ) -> Result<RunnerStats, RunnerError> {
        let Self {
            attach,
            transport,
            mut pool,
            mut poller,
            mut link,
            region,
            table,
            arena,
            tier,
            geometry,
            mut events,
            reconnect,
            ..
        } = self;
        // The object store's workers end (what they hold is done first): the
        // arena their requests name outlives them.
        let l3_stats = pool.l3_stats();
        pool.stop_l3();
        // Make every acked write durable, then mark the shutdown clean.
        let clean = flush_l2(&mut poller, &geometry, &mut events, &config.poller) && stats.abandoned == 0;
        if let Some(link) = &mut link {
            let deadline = MonotonicClock.now_ns() + config.poller.drain_timeout_ms * 1_000_000;
            while !link.is_flushed() && !link.is_closed() && MonotonicClock.now_ns() < deadline {
                if link.pump().is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            stats.cp_reconnects = reconnect.made;
            stats.cp_sent = link.counters.sent;
            stats.cp_dropped = link.counters.dropped;
            stats.cp_refused = link.counters.refused;
        }
        stats.pool = pool.stats;
        let slots = table.stats();
        (stats.l1_chunks_moved, stats.l1_chunks_evacuated) = (slots.chunks_moved, slots.chunks_evacuated);
        stats.l3 = l3_stats.unwrap_or_default();
        if let Some(rdma) = transport.as_ref().and_then(|t| t.rdma_stats()) {
            stats.rdma_landed = rdma.landed;
            stats.rdma_read_bytes = rdma.read_bytes;
        }
        if let Some(attach) = &attach {
            stats.agents_attached = attach.counters.attached;
        }
        drop(attach);
        drop(poller);
        // The transport before the arena: RDMA registrations name its memory.
        drop(transport);
        drop(region);
        if clean && let Some(tier) = tier {
            try_to!("recording the clean shutdown", tier.shut_down_clean());
        }
        drop(table);
        drop(arena);
        let _ = writeln!(out, "{}", stats.json(if clean { "stopped" } else { "stopped-unclean" }));
        let _ = out.flush();
        Ok(stats)
    }
}

/// Flushes every L2 file, waiting at most the drain timeout; whether the
/// poller finished all its work.
fn flush_l2(
    poller: &mut Poller<UringBackend>,
    geometry: &L2Geometry,
    events: &mut [Event],
    p: &self::config::PollerSection,
) -> bool {
    let clock = MonotonicClock;
    for file in 0..geometry.files {
        let flush =
            Request { command: Command::Flush { file }, priority: Priority::WriteBack, deadline_ns: 0, cookie: 0 };
        // Refused only when every op slot is busy, which a drained poller
        // never is; shut_down_clean flushes every file again anyway.
        let _ = poller.submit(flush);
    }
    let flush_deadline = clock.now_ns() + p.drain_timeout_ms * 1_000_000;
    while poller.has_work() && clock.now_ns() < flush_deadline {
        poller.poll(clock.now_ns(), p.batch_max);
        let _ = poller.reap(events);
    }
    !poller.has_work()
}
