//! One transport in front of another: writes go on the primary (RDMA where
//! a device is) while it carries them, and a write the primary cannot
//! carry — refused, or ended by a lost connection or its deadline — is
//! sent again on the secondary (TCP) under the same transfer id, so the
//! caller sees one completion per transfer and never the primary's failure
//! (the seed's "RDMA degradation absorbed inside the transfer engine").
//! A peer whose primary failed is sent to on the secondary alone for a
//! cooldown, then the primary is tried again.
//!
//! A block the primary did deliver but whose acknowledgement was lost is
//! sent again too: a named slot then answers `Refused` (it is filled) and
//! that is what the caller sees; a block sent to [`super::ANY_SLOT`] may
//! land twice, and the receiving node's control plane drops the second
//! copy (one replica per region). Corrupt and refused blocks are the
//! caller's to hear: sending them again elsewhere would not change them.

use std::collections::HashMap;

use super::{Completion, Landing, Outgoing, PeerId, TransferError, Transport};

/// What the fallback did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FallbackStats {
    /// Writes the primary took.
    pub primary: u64,
    /// Writes that went straight to the secondary (no primary for the
    /// peer, or it is cooling down, or it refused the write).
    pub secondary: u64,
    /// Transfers the primary failed and the secondary was given.
    pub moved: u64,
}

/// A peer's two ways: the primary's peer (none: the secondary only), the
/// secondary's, and until when the primary is not used for it.
#[derive(Clone, Copy, Debug)]
struct Ways {
    primary: Option<PeerId>,
    secondary: PeerId,
    primary_down_until_ns: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Fallback<P, S> {
    primary: P,
    secondary: S,
    peers: Vec<Ways>,
    /// Transfers on the primary, as the caller wrote them (to send again).
    on_primary: HashMap<u64, Outgoing>,
    cooldown_ns: u64,
    /// What it did.
    pub stats: FallbackStats,
}

impl<P: Transport, S: Transport> Fallback<P, S> {
    /// `primary` in front of `secondary`; a peer whose primary failed uses
    /// the secondary alone for `cooldown_ns`.
    pub fn new(primary: P, secondary: S, cooldown_ns: u64) -> Self {
        Self {
            primary,
            secondary,
            peers: Vec::new(),
            on_primary: HashMap::new(),
            cooldown_ns,
            stats: FallbackStats::default(),
        }
    }

    /// A peer reached as `primary` on the primary transport (none: not at
    /// all) and as `secondary` on the secondary; the id to write to it by.
    pub fn add_peer(&mut self, primary: Option<PeerId>, secondary: PeerId) -> PeerId {
        self.peers.push(Ways { primary, secondary, primary_down_until_ns: 0 });
        PeerId(u32::try_from(self.peers.len() - 1).unwrap_or(u32::MAX))
    }

    /// Sets how `peer` is reached on the primary (none: the secondary
    /// only), as a link's primary comes up or goes; an unknown peer is
    /// left alone.
    pub fn set_primary(&mut self, peer: PeerId, primary: Option<PeerId>) {
        if let Some(ways) = self.peers.get_mut(peer.0 as usize) {
            ways.primary = primary;
            ways.primary_down_until_ns = 0;
        }
    }

    /// The primary transport (to add its peers).
    pub fn primary(&mut self) -> &mut P {
        &mut self.primary
    }

    /// The primary transport, to read.
    pub fn primary_ref(&self) -> &P {
        &self.primary
    }

    /// The secondary transport (to add its peers).
    pub fn secondary(&mut self) -> &mut S {
        &mut self.secondary
    }

    /// The secondary transport, to read.
    pub fn secondary_ref(&self) -> &S {
        &self.secondary
    }

    /// Whether `peer`'s writes go on the primary now.
    pub fn on_primary(&self, peer: PeerId, now_ns: u64) -> bool {
        self.peers.get(peer.0 as usize).is_some_and(|w| w.primary.is_some() && now_ns >= w.primary_down_until_ns)
    }

    /// Whether `transfer` is on the primary now (not yet ended there).
    pub fn on_primary_now(&self, transfer: u64) -> bool {
        self.on_primary.contains_key(&transfer)
    }

    /// Sends `block` (its peer already the caller's) on the secondary.
    ///
    /// # Safety
    ///
    /// As [`Transport::write`].
    unsafe fn on_secondary(&mut self, block: &Outgoing, ways: Ways, now_ns: u64) -> Result<(), TransferError> {
        let mut second = *block;
        second.peer = ways.secondary;
        // SAFETY: the caller's contract, for the same bytes.
        unsafe { self.secondary.write(&second, now_ns) }
    }
}

impl<P: Transport, S: Transport> Transport for Fallback<P, S> {
    unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        let ways = *self.peers.get(block.peer.0 as usize).ok_or(TransferError::Invalid("peer"))?;
        if let Some(primary) = ways.primary.filter(|_| now_ns >= ways.primary_down_until_ns) {
            let mut first = *block;
            first.peer = primary;
            // SAFETY: the caller's contract is this method's.
            match unsafe { self.primary.write(&first, now_ns) } {
                Ok(()) => {
                    self.on_primary.insert(block.transfer, *block);
                    self.stats.primary += 1;
                    return Ok(());
                }
                // Malformed is malformed on any wire: the caller's to hear.
                Err(TransferError::Invalid(what)) => return Err(TransferError::Invalid(what)),
                Err(_) => {}
            }
        }
        // SAFETY: the caller's contract is this method's.
        let sent = unsafe { self.on_secondary(block, ways, now_ns) };
        if sent.is_ok() {
            self.stats.secondary += 1;
        }
        sent
    }

    fn poll(&mut self, landing: &mut dyn Landing, now_ns: u64, out: &mut Vec<Completion>) -> bool {
        let mut ended = Vec::new();
        let mut moved_any = self.primary.poll(landing, now_ns, &mut ended);
        for completion in ended {
            let Some(block) = self.on_primary.remove(&completion.transfer) else {
                out.push(completion);
                continue;
            };
            match completion.result {
                Err(TransferError::PeerLost(_) | TransferError::Timeout) => {
                    let Some(ways) = self.peers.get_mut(block.peer.0 as usize) else {
                        // Checked at write: cannot happen; the transfer still ends once.
                        out.push(completion);
                        continue;
                    };
                    ways.primary_down_until_ns = now_ns.saturating_add(self.cooldown_ns);
                    let ways = *ways;
                    // SAFETY: the caller's bytes stay valid until this
                    // transfer's completion, which has not been returned.
                    match unsafe { self.on_secondary(&block, ways, now_ns) } {
                        Ok(()) => self.stats.moved += 1,
                        Err(e) => {
                            out.push(Completion { transfer: block.transfer, result: Err(e), target: block.target })
                        }
                    }
                }
                _ => out.push(completion),
            }
        }
        moved_any |= self.secondary.poll(landing, now_ns, out);
        moved_any
    }

    fn in_flight(&self) -> usize {
        self.primary.in_flight() + self.secondary.in_flight()
    }
}
