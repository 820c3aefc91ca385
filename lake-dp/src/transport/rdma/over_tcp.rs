//! RDMA brought up over the TCP link it falls back to: the transport a
//! node runs when it has a device.
//!
//! Every peer is first a TCP peer (rails, reconnects, the link key). Once
//! one of its connections carries frames — authenticated, where a key is
//! set — this end makes a queue pair for it and offers its
//! [`Endpoint`] in a negotiation frame ([`TcpTransport::offer_transport`]);
//! the receiver, if it has RDMA, makes its own, connects it to the offer
//! and answers with its endpoint; this end connects and from then on the
//! peer's writes go over RDMA ([`RdmaTransport`], in front of TCP in a
//! [`Fallback`]). A receiver without RDMA (or an offer it cannot use)
//! declines and the link stays on TCP, as it does when no answer comes.
//!
//! When the queue pair breaks, the peer's transfers move to TCP (the
//! fallback does that, unseen by the caller) and the offer is made again
//! after a wait that doubles while it keeps failing. The endpoint never
//! travels unauthenticated where links are keyed: it is a frame like any.

use std::collections::HashMap;

use super::pull::{RdmaTransport, Verbs};
use super::{ENDPOINT_BYTES, Endpoint, RdmaError};
use crate::transport::fallback::Fallback;
use crate::transport::tcp::{InboundLink, Negotiation, Rail, RailReport, TcpError, TcpTransport};
use crate::transport::{Completion, Landing, Links, Outgoing, PeerId, TransferError, Transport};

/// How the negotiation runs.
#[derive(Clone, Copy, Debug)]
pub struct OverTcpConfig {
    /// An offer unanswered this long is given up (the link stays on TCP).
    pub answer_timeout_ns: u64,
    /// The first wait before offering again after a failure (doubling, to
    /// 64 times this, while offers keep failing).
    pub retry_ns: u64,
    /// A peer whose RDMA transfer failed is sent to over TCP alone this
    /// long (the fallback's cooldown).
    pub cooldown_ns: u64,
}

impl Default for OverTcpConfig {
    fn default() -> Self {
        Self { answer_timeout_ns: 2_000_000_000, retry_ns: 1_000_000_000, cooldown_ns: 1_000_000_000 }
    }
}

/// What the negotiation did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverTcpStats {
    /// Offers this end made.
    pub offered: u64,
    /// Of them, answered with an endpoint and connected: RDMA came up.
    pub up: u64,
    /// Of them, declined, unanswered, or answered with an endpoint that
    /// would not do.
    pub failed: u64,
    /// Peers' offers this end took (a queue pair made and answered).
    pub accepted: u64,
    /// Peers' offers this end declined (not an endpoint, no queue pair).
    pub declined: u64,
    /// Times a link's RDMA broke and its writes went back to TCP.
    pub downs: u64,
}

#[derive(Clone, Copy, Debug)]
enum State {
    /// Offer once a connection carries frames.
    Idle,
    /// Offered `verbs` (its queue pair) at `since`.
    Offered { verbs: PeerId, since: u64 },
    /// Writes go over RDMA through `verbs`.
    Up { verbs: PeerId },
    /// On TCP until `until`.
    Waiting { until: u64 },
}

#[derive(Clone, Copy, Debug)]
struct Link {
    tcp: PeerId,
    state: State,
    /// The next wait after a failure.
    retry_ns: u64,
}

/// Log lines kept for the owner, at most (older ones dropped).
const EVENTS_MAX: usize = 64;

/// See the module docs.
#[derive(Debug)]
pub struct RdmaOverTcp<V> {
    inner: Fallback<RdmaTransport<V>, TcpTransport>,
    links: Vec<Link>,
    /// The queue pair made for each inbound link's offer.
    accepted: HashMap<InboundLink, PeerId>,
    config: OverTcpConfig,
    events: std::collections::VecDeque<String>,
    /// What the negotiation did.
    pub stats: OverTcpStats,
}

impl<V: Verbs> RdmaOverTcp<V> {
    /// RDMA over `verbs` in front of `tcp`, negotiated per link.
    pub fn new(rdma: RdmaTransport<V>, mut tcp: TcpTransport, config: OverTcpConfig) -> Self {
        tcp.negotiate(true);
        Self {
            inner: Fallback::new(rdma, tcp, config.cooldown_ns),
            links: Vec::new(),
            accepted: HashMap::new(),
            config,
            events: std::collections::VecDeque::new(),
            stats: OverTcpStats::default(),
        }
    }

    /// A peer over `rails`: TCP now, RDMA once negotiated.
    pub fn add_peer_rails(&mut self, rails: &[Rail]) -> Result<PeerId, TcpError> {
        let tcp = self.inner.secondary().add_peer_rails(rails)?;
        self.links.push(Link { tcp, state: State::Idle, retry_ns: self.config.retry_ns });
        Ok(self.inner.add_peer(None, tcp))
    }

    /// The TCP transport (its rails, stats and security events).
    pub fn tcp(&mut self) -> &mut TcpTransport {
        self.inner.secondary()
    }

    /// The TCP transport, to read.
    pub fn tcp_ref(&self) -> &TcpTransport {
        self.inner.secondary_ref()
    }

    /// The RDMA transport.
    pub fn rdma(&mut self) -> &mut RdmaTransport<V> {
        self.inner.primary()
    }

    /// What the fallback did (writes on RDMA, on TCP, moved between).
    pub fn fallback_stats(&self) -> crate::transport::fallback::FallbackStats {
        self.inner.stats
    }

    /// Whether `peer`'s writes go over RDMA now.
    pub fn rdma_up(&self, peer: PeerId) -> bool {
        self.links.get(peer.0 as usize).is_some_and(|l| matches!(l.state, State::Up { .. }))
    }

    /// What happened to links since the last call, one line each.
    pub fn take_events(&mut self) -> Vec<String> {
        self.events.drain(..).collect()
    }

    fn note(&mut self, line: String) {
        if self.events.len() >= EVENTS_MAX {
            self.events.pop_front();
        }
        self.events.push_back(line);
    }

    /// Link `index` failed to come up (why): on TCP for a while, the wait
    /// doubling.
    fn back_off(&mut self, index: usize, why: &str, now_ns: u64) {
        let link = &mut self.links[index];
        if let State::Offered { verbs, .. } = link.state {
            self.inner.primary().close_peer(verbs, why);
        }
        link.state = State::Waiting { until: now_ns.saturating_add(link.retry_ns) };
        link.retry_ns = link.retry_ns.saturating_mul(2).min(self.config.retry_ns.saturating_mul(64));
        self.stats.failed += 1;
        self.note(format!("peer {index}: RDMA not up, TCP carries its blocks: {why}"));
    }

    /// A peer writing here offers its endpoint on `from`: a queue pair
    /// for it, connected and answered — or declined.
    fn on_offer(&mut self, from: InboundLink, address: Option<std::net::SocketAddr>, bytes: &[u8]) {
        let made = (|| -> Result<(PeerId, Endpoint), RdmaError> {
            let bytes: &[u8; ENDPOINT_BYTES] =
                bytes.try_into().map_err(|_| RdmaError(format!("an offer of {} bytes", bytes.len())))?;
            let remote = Endpoint::decode(bytes)?;
            let verbs = self.inner.primary().verbs();
            let (peer, mine) = verbs.add_peer()?;
            if let Err(e) = verbs.connect(peer, &remote) {
                self.inner.primary().close_peer(peer, "its connect failed");
                return Err(e);
            }
            Ok((peer, mine))
        })();
        let from_text = address.map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
        match made {
            Ok((peer, mine)) => {
                if self.inner.secondary().answer_transport(from, Some(&mine.encode())).is_err() {
                    self.inner.primary().close_peer(peer, "the link closed before the answer");
                    return;
                }
                if let Some(old) = self.accepted.insert(from, peer) {
                    self.inner.primary().close_peer(old, "the peer offered a new queue pair");
                }
                self.stats.accepted += 1;
            }
            Err(e) => {
                let _ = self.inner.secondary().answer_transport(from, None);
                self.stats.declined += 1;
                self.note(format!("RDMA offer from {from_text} declined: {e}"));
            }
        }
    }

    /// The peer answered this end's offer.
    fn on_answer(&mut self, tcp: PeerId, bytes: Option<&[u8]>, now_ns: u64) {
        let Some(index) = self.links.iter().position(|l| l.tcp == tcp) else { return };
        let State::Offered { verbs, .. } = self.links[index].state else {
            // Not asked (any more): a late answer to an offer given up.
            return;
        };
        let Some(bytes) = bytes else {
            self.back_off(index, "the peer declined (no RDMA there, or it could not use the offer)", now_ns);
            return;
        };
        let connected = <&[u8; ENDPOINT_BYTES]>::try_from(bytes)
            .map_err(|_| RdmaError(format!("an answer of {} bytes", bytes.len())))
            .and_then(Endpoint::decode)
            .and_then(|remote| self.inner.primary().verbs().connect(verbs, &remote));
        match connected {
            Ok(()) => {
                let link = &mut self.links[index];
                link.state = State::Up { verbs };
                link.retry_ns = self.config.retry_ns;
                self.inner.set_primary(PeerId(u32::try_from(index).unwrap_or(u32::MAX)), Some(verbs));
                self.stats.up += 1;
            }
            Err(e) => self.back_off(index, &format!("its answer: {e}"), now_ns),
        }
    }

    /// Offers where a link is idle and a connection carries frames; gives
    /// up offers unanswered; notices queue pairs that broke.
    fn step(&mut self, now_ns: u64) {
        for index in 0..self.links.len() {
            let link = self.links[index];
            match link.state {
                State::Idle if self.inner.secondary().connected(link.tcp) > 0 => {
                    let (verbs, mine) = match self.inner.primary().verbs().add_peer() {
                        Ok(made) => made,
                        Err(e) => {
                            self.back_off(index, &format!("no queue pair: {e}"), now_ns);
                            continue;
                        }
                    };
                    self.links[index].state = State::Offered { verbs, since: now_ns };
                    self.stats.offered += 1;
                    if let Err(e) = self.inner.secondary().offer_transport(link.tcp, &mine.encode()) {
                        self.back_off(index, &format!("the offer: {e}"), now_ns);
                    }
                }
                State::Offered { since, .. } if now_ns.saturating_sub(since) > self.config.answer_timeout_ns => {
                    self.back_off(index, "no answer to the offer", now_ns);
                }
                State::Up { verbs } => {
                    let Some(why) = self.inner.primary().peer_down(verbs).map(str::to_owned) else { continue };
                    self.inner.set_primary(PeerId(u32::try_from(index).unwrap_or(u32::MAX)), None);
                    self.links[index].state = State::Waiting { until: now_ns.saturating_add(link.retry_ns) };
                    self.stats.downs += 1;
                    self.note(format!("peer {index}: RDMA queue pair down ({why}); TCP carries its blocks"));
                }
                State::Waiting { until } if now_ns >= until => self.links[index].state = State::Idle,
                _ => {}
            }
        }
        // Queue pairs of inbound links that broke: forgotten (the writer
        // offers again).
        let rdma = self.inner.primary();
        self.accepted.retain(|_, &mut peer| rdma.peer_down(peer).is_none());
    }
}

impl<V: Verbs> Transport for RdmaOverTcp<V> {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        // SAFETY: the caller's contract is this method's.
        unsafe { self.inner.write(block, now_ns) }
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        let mut busy = self.inner.poll(landing, now_ns, out);
        for negotiation in self.inner.secondary().take_negotiations() {
            busy = true;
            match negotiation {
                Negotiation::Offered { from, address, bytes } => self.on_offer(from, address, &bytes),
                Negotiation::Answered { peer, bytes } => self.on_answer(peer, bytes.as_deref(), now_ns),
            }
        }
        self.step(now_ns);
        busy
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
}

impl<V: Verbs> Links for RdmaOverTcp<V> {
    fn tcp(&mut self) -> &mut TcpTransport {
        RdmaOverTcp::tcp(self)
    }

    fn tcp_ref(&self) -> &TcpTransport {
        RdmaOverTcp::tcp_ref(self)
    }

    fn add_peer_rails(&mut self, rails: &[Rail]) -> Result<PeerId, TcpError> {
        RdmaOverTcp::add_peer_rails(self, rails)
    }

    fn rail_reports(&self, peer: PeerId) -> Vec<RailReport> {
        self.links.get(peer.0 as usize).map(|l| self.tcp_ref().rail_reports(l.tcp)).unwrap_or_default()
    }

    fn cancel(&mut self, transfer: u64) -> bool {
        if self.inner.on_primary_now(transfer) {
            // Offered over RDMA: withdrawn, it ends `Cancelled` if the peer
            // had not started reading it (it cannot be promised here).
            self.inner.primary().withdraw(transfer);
            return false;
        }
        self.inner.secondary().cancel(transfer)
    }

    fn take_rdma_events(&mut self) -> Vec<String> {
        self.take_events()
    }

    fn rdma_stats(&self) -> Option<super::pull::RdmaStats> {
        Some(self.inner.primary_ref().stats)
    }

    fn take_trace_events(&mut self, out: &mut Vec<crate::transport::tcp::TraceEvent>) {
        self.tcp().take_trace_events(out);
        self.inner.primary().take_trace_events(out);
    }
}
