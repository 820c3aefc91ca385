//! P→D from the engine: blocks this node's L1 holds, pushed by the agent's
//! thread to any slot of another node's L1 over the compute network's
//! transport, one completion per block.

use std::collections::HashMap;

use lake_agent::Agent;
use lake_agent::push::{PushError, Pusher};
use lake_dp::BlockKey;
use lake_dp::Priority;
use lake_dp::mirror::MirrorEntry;
use lake_dp::transport::tcp::{PeerId, Rail, TcpConfig, TcpTransport};
use lake_dp::transport::{Completion, Links};

use crate::status::{LakeStatus, status_of_transfer};

/// One rail of the compute network's transport to one peer: what pushes
/// carried on it (`lake_push_rails`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeRailStat {
    /// The peer, numbered in the order this pool first pushed to it.
    pub peer: u32,
    /// The rail's index among the peer's rails, as given to `lake_push`.
    pub rail: u32,
    /// 1 while the rail takes new slices; 0 while it cools down after a
    /// connection on it broke.
    pub up: u32,
    /// Zero.
    pub reserved: u32,
    /// Bytes written on it.
    pub bytes: u64,
    /// Times it was set aside after a connection on it broke.
    pub breaks: u64,
    /// The rail as given (`[LOCAL>]IP:PORT`), NUL-terminated.
    pub address: [core::ffi::c_char; 64],
}

/// A push asked of the agent's thread.
pub(crate) struct PushJob {
    pub request: u64,
    /// The peer's rails on the compute network, as the engine wrote them.
    pub peer: (String, Vec<Rail>),
    pub keys: Vec<BlockKey>,
    pub table: Vec<MirrorEntry>,
    pub to: (u16, u64),
    pub priority: Priority,
    /// The engine's trace id (`lake_set_trace` on the submitting thread).
    pub trace: u64,
}

/// The agent thread's pushes: made on the first, kept for the pool's life.
#[derive(Default)]
pub(crate) struct Pushes {
    pusher: Option<Pusher<Box<dyn Links>>>,
    /// Peers by their rails' text, in the order first pushed to.
    peers: Vec<(String, PeerId)>,
    /// Transfer → (request, block index).
    blocks: HashMap<u64, (u64, u32)>,
    ended: Vec<Completion>,
}

/// The environment variable naming the cluster's link key file: set, the
/// engine's pushes to other nodes' pools authenticate with it (as the
/// pools do with theirs: `lake serve --link-key`).
pub(crate) const LINK_KEY_ENV: &str = "LAKE_LINK_KEY_FILE";

/// The environment variable spreading an authenticated push's tags over
/// that many threads (`lake_dp::auth::spread_tags`).
pub(crate) const TAG_THREADS_ENV: &str = "LAKE_TAG_THREADS";

/// `transport`, authenticated with the key [`LINK_KEY_ENV`] names, if it
/// names one; `None` (the push fails, the reason said on stderr) if that
/// key cannot be read.
fn authenticated(mut transport: TcpTransport) -> Option<TcpTransport> {
    let Some(path) = std::env::var_os(LINK_KEY_ENV) else { return Some(transport) };
    let loaded = lake_dp::auth::LinkKey::load(std::path::Path::new(&path));
    let key = match loaded {
        Ok(key) => key,
        Err(e) => return unusable(LINK_KEY_ENV, &e),
    };
    // `LAKE_TAG_THREADS=N` spreads large slices' tags over N threads, as
    // `lake serve --tag-threads` does; a bad value is said and ignored.
    if let Some(threads) = std::env::var_os(TAG_THREADS_ENV) {
        let spread = threads.to_str().and_then(|t| t.parse::<usize>().ok()).ok_or("not a number".to_string());
        if let Err(e) = spread.and_then(lake_dp::auth::spread_tags) {
            eprintln!("lake: {TAG_THREADS_ENV}={threads:?}: {e}; tags stay on the pusher's thread");
        }
    }
    // The engine names itself by its process in handshakes.
    let node = 1 << 63 | u64::from(std::process::id());
    transport.authenticate(key, node).ok()?;
    Some(transport)
}

/// The environment variable naming the RDMA device the engine's pushes
/// offer to peers (`NAME[:PORT[:GID_INDEX]]`, `any`, or `loopback` for
/// pools in this process), as `lake serve --rdma-device` does for a pool:
/// each peer's link negotiates RDMA over its TCP connection — the peer
/// then READs each block from its pinned slot — and falls back to TCP.
pub(crate) const RDMA_DEVICE_ENV: &str = "LAKE_RDMA_DEVICE";

/// Says once on stderr that `variable` cannot be used (`why`) — on the
/// agent's thread, where no caller reads a last error — and every push
/// fails `LAKE_UNAVAILABLE`.
fn unusable<T>(variable: &str, why: &dyn core::fmt::Display) -> Option<T> {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!("lake: {variable}: {why}; pushes to other pools fail LAKE_UNAVAILABLE");
    }
    None
}

/// The compute network's transport for `agent`'s pushes: TCP (keyed where
/// [`LINK_KEY_ENV`] names a key), with RDMA in front where
/// [`RDMA_DEVICE_ENV`] names a device; `None` (said once) if either
/// cannot be had.
fn compute_links(agent: &Agent) -> Option<Box<dyn Links>> {
    let tcp = authenticated(TcpTransport::new(TcpConfig::default(), None).ok()?)?;
    let device = match std::env::var_os(RDMA_DEVICE_ENV) {
        None => None,
        Some(text) => {
            let parsed =
                text.to_str().ok_or("not UTF-8".to_string()).and_then(lake_dp::transport::rdma::RdmaDevice::parse);
            match parsed {
                Ok(device) => Some(device),
                Err(e) => return unusable(RDMA_DEVICE_ENV, &e),
            }
        }
    };
    let (base, len) = agent.slot_area();
    // SAFETY: the agent maps the arena for the pool's life, and the
    // pusher (this transport's owner) is dropped on the agent's thread
    // before the agent.
    let opened = unsafe { lake_dp::transport::rdma::open_links(tcp, device.as_ref(), base, len, agent.arena_epoch()) };
    match opened {
        Ok(links) => Some(links),
        Err(e) => unusable(RDMA_DEVICE_ENV, &e),
    }
}

impl Pushes {
    /// Starts `job`'s blocks; those that cannot start end at once, in
    /// `(request, index, status)`.
    pub(crate) fn start(&mut self, agent: &Agent, job: &PushJob, now_ns: u64, ended: &mut Vec<(u64, u32, LakeStatus)>) {
        let fail_all = |ended: &mut Vec<(u64, u32, LakeStatus)>, status| {
            for i in 0..job.keys.len() {
                ended.push((job.request, u32::try_from(i).unwrap_or(u32::MAX), status));
            }
        };
        if self.pusher.is_none() {
            let made = compute_links(agent).zip(agent.claim_pin_array().ok()).map(|(transport, pins)| {
                Pusher::new(transport, pins, agent.arena_region()).with_caps(agent.push_rates())
            });
            let Some(pusher) = made else { return fail_all(ended, LakeStatus::LakeUnavailable) };
            self.pusher = Some(pusher);
        }
        let Some(pusher) = self.pusher.as_mut() else { return };
        let peer = match self.peers.iter().find(|(a, _)| *a == job.peer.0) {
            Some(&(_, peer)) => peer,
            None => match pusher.transport().add_peer_rails(&job.peer.1) {
                Ok(peer) => {
                    self.peers.push((job.peer.0.clone(), peer));
                    peer
                }
                Err(_) => return fail_all(ended, LakeStatus::LakeUnavailable),
            },
        };
        for (i, (key, entry)) in job.keys.iter().zip(&job.table).enumerate() {
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            match pusher.push(key, entry, peer, job.to, job.priority, job.trace, now_ns) {
                Ok(transfer) => {
                    self.blocks.insert(transfer, (job.request, index));
                }
                Err(e) => {
                    let status = match e {
                        PushError::Evicted | PushError::Mismatch => LakeStatus::LakeEvicted,
                        PushError::NotInL1 => LakeStatus::LakeUnavailable,
                        PushError::Transport(e) => status_of_transfer(&e),
                    };
                    ended.push((job.request, index, status));
                }
            }
        }
    }

    /// What each rail to each peer carried (the compute network's own
    /// accounting), peers in the order first pushed to.
    pub(crate) fn rail_stats(&mut self) -> Vec<LakeRailStat> {
        let Some(pusher) = self.pusher.as_mut() else { return Vec::new() };
        let mut out = Vec::new();
        for (index, (_, peer)) in self.peers.iter().enumerate() {
            for (rail, report) in pusher.transport().rail_reports(*peer).iter().enumerate() {
                let mut address = [0 as core::ffi::c_char; 64];
                for (to, from) in address.iter_mut().zip(report.rail.to_string().bytes().take(63)) {
                    *to = from.cast_signed();
                }
                out.push(LakeRailStat {
                    peer: u32::try_from(index).unwrap_or(u32::MAX),
                    rail: u32::try_from(rail).unwrap_or(u32::MAX),
                    up: u32::from(report.up),
                    reserved: 0,
                    bytes: report.bytes,
                    breaks: report.breaks,
                    address,
                });
            }
        }
        out
    }

    /// Cancels the blocks of the pushes whose request ids are in
    /// `cancelled` that have not started out (the rest go on to their
    /// end), and takes those ids out of it: a cancel is spent once.
    pub(crate) fn cancel(&mut self, cancelled: &mut std::collections::HashSet<u64>) {
        let Some(pusher) = self.pusher.as_mut() else { return };
        let mut asked = Vec::new();
        for (&transfer, &(request, _)) in &self.blocks {
            if cancelled.contains(&request) {
                pusher.cancel(transfer);
                asked.push(request);
            }
        }
        for request in asked {
            cancelled.remove(&request);
        }
    }

    /// Hands over the traced pushes' blocks ended since the last call.
    pub(crate) fn take_spans(&mut self, each: impl FnMut(&lake_agent::push::PushSpan)) {
        if let Some(pusher) = self.pusher.as_mut() {
            pusher.take_spans(each);
        }
    }

    /// Blocks still on their way.
    pub(crate) fn in_flight(&self) -> usize {
        self.blocks.len()
    }

    /// Moves bytes; the blocks that ended go to `ended`.
    pub(crate) fn poll(&mut self, now_ns: u64, ended: &mut Vec<(u64, u32, LakeStatus)>) {
        let Some(pusher) = self.pusher.as_mut() else { return };
        pusher.poll(now_ns, &mut self.ended);
        for completion in self.ended.drain(..) {
            let Some((request, index)) = self.blocks.remove(&completion.transfer) else { continue };
            let status = match &completion.result {
                Ok(()) => LakeStatus::LakeOk,
                Err(e) => status_of_transfer(e),
            };
            ended.push((request, index, status));
        }
    }
}
