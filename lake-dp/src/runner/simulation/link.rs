//! The simulated node's storage network: its transport's far end, a peer
//! node the simulation plays, as it plays the control plane's end. The
//! node's copies to the peer and the peer's blocks to the node go through
//! the node's real block service (`send_remote`, the pool as the
//! transport's `Landing`); only the wire is simulated, with the seed's
//! faults: a send lost, refused or timing out at the peer; a block
//! arriving damaged, or its connection breaking halfway.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use crate::model::key::BlockKey;
use crate::rng::SimRng;
use crate::transport::frame::{AckStatus, BlockAddr};
use crate::transport::tcp::{Rail, RailReport, TcpConfig, TcpError, TcpTransport};
use crate::transport::{ANY_SLOT, Completion, Landing, Links, Outgoing, PeerId, TransferError, Transport};

/// The peer node's id.
pub(super) const PEER_NODE: u32 = 2;
/// Transfers the node may have in flight to the peer.
const IN_FLIGHT_MAX: usize = 8;
/// How long a block takes on the wire, at most.
const WIRE_NS_MAX: u64 = 60_000;
/// Where a copy to the peer goes: a slot the peer picks.
const AT_PEER: BlockAddr = BlockAddr { region: 0, epoch: 1, slot: ANY_SLOT, generation: 0 };

/// What goes wrong with a block the peer sends the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arrival {
    /// Nothing.
    Whole,
    /// A byte changed on the way: it must not check.
    Damaged,
    /// Its connection breaks halfway: its slot goes back.
    Broken,
    /// Sent to a past incarnation of the node's L1: refused.
    Stale,
}

/// A block the peer sends the node's L1.
#[derive(Debug)]
pub(super) struct Arriving {
    pub(super) key: BlockKey,
    /// The stored object as the peer sends it.
    pub(super) bytes: Vec<u8>,
    pub(super) arrival: Arrival,
    pub(super) namespace: u64,
    pub(super) due_ns: u64,
}

/// What became of a block the peer sent: `Some(verdict)` when the node
/// answered (`None`: its connection broke before the end).
pub(super) type Landed = (BlockKey, Arrival, Option<AckStatus>);

/// A copy of the node's in flight to the peer.
#[derive(Debug)]
struct Sent {
    transfer: u64,
    bytes: Vec<u8>,
    due_ns: u64,
}

/// The wire's state, shared by the node's transport and the simulation.
#[derive(Debug)]
pub(super) struct Wire {
    sent: Vec<Sent>,
    cancelled: Vec<u64>,
    pub(super) arriving: VecDeque<Arriving>,
    /// The node's copies the peer took: the bytes it got.
    pub(super) received: Vec<Vec<u8>>,
    /// The peer's blocks, as the node answered them.
    pub(super) landed: Vec<Landed>,
    rng: SimRng,
    /// The node's L1 region and epoch, as the peer addresses it.
    pub(super) l1: (u16, u64),
}

impl Wire {
    pub(super) fn new(seed: u64, l1: (u16, u64)) -> Rc<RefCell<Self>> {
        Rc::new(RefCell::new(Self {
            sent: Vec::new(),
            cancelled: Vec::new(),
            arriving: VecDeque::new(),
            received: Vec::new(),
            landed: Vec::new(),
            rng: SimRng::new(seed ^ 0x11_4e),
            l1,
        }))
    }

    /// Nothing on the wire either way.
    pub(super) fn idle(&self) -> bool {
        self.sent.is_empty() && self.cancelled.is_empty() && self.arriving.is_empty()
    }

    /// When a block put on the wire at `now_ns` arrives.
    pub(super) fn due(&mut self, now_ns: u64) -> u64 {
        now_ns + 1 + self.rng.below(WIRE_NS_MAX)
    }

    /// The peer's answer to the node's copy `sent`, now due.
    fn answer(&mut self, sent: Sent) -> Completion {
        let result = match self.rng.below(100) {
            0..6 => Err(TransferError::Timeout),
            6..9 => Err(TransferError::PeerLost("simulated: the connection broke".into())),
            9..11 => Err(TransferError::Busy),
            _ => {
                self.received.push(sent.bytes);
                Ok(())
            }
        };
        let target = if result.is_ok() { BlockAddr { slot: 3, generation: 1, ..AT_PEER } } else { AT_PEER };
        Completion { transfer: sent.transfer, result, target }
    }

    /// The peer's block `arriving`, now due, handed to the node's
    /// `landing` as a transport hands one: a slot reserved, the bytes
    /// placed, then landed (or abandoned).
    fn deliver(&mut self, mut arriving: Arriving, landing: &mut dyn Landing, now_ns: u64) {
        let len = arriving.bytes.len() as u64;
        if let Err(wait_us) = landing.admit(arriving.namespace, len, now_ns) {
            arriving.due_ns = now_ns + wait_us * 1_000;
            self.arriving.push_back(arriving);
            return;
        }
        let (region, epoch) = self.l1;
        let epoch = if arriving.arrival == Arrival::Stale { epoch.wrapping_sub(1) } else { epoch };
        let (key, kind) = (arriving.key, arriving.arrival);
        let target = match landing.reserve(region, epoch, len, Some(arriving.namespace)) {
            Ok(target) => target,
            Err(status) => return self.landed.push((key, kind, Some(status))),
        };
        let at = match landing.place(&target, len) {
            Ok(at) => at,
            Err(status) => return self.landed.push((key, kind, Some(status))),
        };
        let bytes = &mut arriving.bytes;
        if kind == Arrival::Damaged {
            let byte = usize::try_from(self.rng.below(len)).unwrap_or(0);
            bytes[byte] ^= 0x08;
        }
        let whole = if kind == Arrival::Broken { bytes.len() / 2 } else { bytes.len() };
        // SAFETY: `place` gave `len` bytes at `at`, this transfer's alone
        // until it is landed or abandoned (the `Landing` contract).
        unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), at, whole) };
        if kind == Arrival::Broken {
            landing.abandoned(&target);
            return self.landed.push((key, kind, None));
        }
        let status = landing.landed(&target, len);
        self.landed.push((key, kind, Some(status)));
    }
}

/// The node's transport: a real TCP transport with no peer beneath (for
/// what the runner asks of the links: security events, rails), and the
/// simulated wire.
pub(super) struct SimLink {
    wire: Rc<RefCell<Wire>>,
    tcp: TcpTransport,
}

impl core::fmt::Debug for SimLink {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SimLink").field("wire", &self.wire).finish_non_exhaustive()
    }
}

impl SimLink {
    pub(super) fn new(wire: Rc<RefCell<Wire>>) -> Result<Self, TcpError> {
        Ok(Self { wire, tcp: TcpTransport::new(TcpConfig::default(), None)? })
    }
}

impl Transport for SimLink {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        let mut wire = self.wire.borrow_mut();
        if wire.sent.len() >= IN_FLIGHT_MAX {
            return Err(TransferError::Busy);
        }
        let len = usize::try_from(block.len).map_err(|_| TransferError::Invalid("length"))?;
        // SAFETY: `block.source` is valid for `block.len` bytes, unchanged
        // until the transfer completes (the caller's contract); copied now.
        let bytes = unsafe { core::slice::from_raw_parts(block.source, len) }.to_vec();
        let due_ns = wire.due(now_ns);
        wire.sent.push(Sent { transfer: block.transfer, bytes, due_ns });
        Ok(())
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        let mut wire = self.wire.borrow_mut();
        let mut moved = false;
        for transfer in core::mem::take(&mut wire.cancelled) {
            out.push(Completion { transfer, result: Err(TransferError::Cancelled), target: AT_PEER });
            moved = true;
        }
        while let Some(at) = wire.sent.iter().position(|s| s.due_ns <= now_ns) {
            let sent = wire.sent.swap_remove(at);
            let answer = wire.answer(sent);
            out.push(answer);
            moved = true;
        }
        // One block from the peer a pass at most, as it comes due.
        if wire.arriving.front().is_some_and(|a| a.due_ns <= now_ns)
            && let Some(arriving) = wire.arriving.pop_front()
        {
            wire.deliver(arriving, landing, now_ns);
            moved = true;
        }
        moved
    }

    fn in_flight(&self) -> usize {
        self.wire.borrow().sent.len()
    }
}

impl Links for SimLink {
    fn tcp(&mut self) -> &mut TcpTransport {
        &mut self.tcp
    }

    fn tcp_ref(&self) -> &TcpTransport {
        &self.tcp
    }

    fn add_peer_rails(&mut self, _rails: &[Rail]) -> Result<PeerId, TcpError> {
        Ok(PeerId(0))
    }

    fn rail_reports(&self, _peer: PeerId) -> Vec<RailReport> {
        Vec::new()
    }

    fn cancel(&mut self, transfer: u64) -> bool {
        let mut wire = self.wire.borrow_mut();
        let Some(at) = wire.sent.iter().position(|s| s.transfer == transfer) else { return false };
        wire.sent.swap_remove(at);
        wire.cancelled.push(transfer);
        true
    }
}
