//! Promotions: a block read from L2 (or L3) into a free L1 slot, checked
//! against its CRCs, its header rewritten to name the slot, and the one
//! answer for both tiers.

use super::{L1State, POOL_COOKIE, Pool, Purpose, Requester, code_of};
use crate::agent::port::AgentError;
use crate::constants::STORED_HEADER_BYTES;
use crate::cplink::CpLink;
use crate::io::IoBackend;
use crate::l2::L2Slots;
use crate::model::key::BlockKey;
use crate::model::replica::{Priority, ReplicaWire, Tier};
use crate::op::{Command, L2Slot, ReadBlock, Request};
use crate::poller::Poller;
use crate::region::SlotRegion;
use crate::runner::Parts;
use crate::stored::{ObjectMeta, decode_header, object_bytes};
use crate::wire::message::{BlockEvicted, EvictReason, TransferDone};

impl Pool {
    /// Starts reading `source` (an L2 replica of `key`) into a new L1 slot.
    pub(super) fn promote<B: IoBackend>(
        &mut self,
        to: Requester,
        key: BlockKey,
        source: &ReplicaWire,
        priority: Priority,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        if source.tier == Tier::L3Object as u8 {
            return self.promote_l3(to, key, source, parts);
        }
        if source.tier != Tier::L2Nvme as u8 || source.region_epoch != self.epoch || source.node != self.node {
            return Err(AgentError::Stale);
        }
        let slot = self.l2_slot_of(source).ok_or(AgentError::Invalid)?;
        self.l2_index(slot).ok_or(AgentError::Invalid)?;
        let (payload_len, namespace) = match self.l2_object(slot, source.generation) {
            Some(meta) if source.generation != 0 => (meta.payload_len, meta.namespace.0),
            _ => return Err(AgentError::Stale),
        };
        let partition = self.partition_for(to, namespace)?;
        let grant = self.slot_or_victim(partition, object_bytes(payload_len), 0, parts).ok_or(AgentError::NoSpace)?;
        let table = &mut *parts.table;
        let purpose = Purpose::Promote { to, l1_slot: grant.slot, l1_generation: grant.generation };
        let Some(cookie) = self.take_op(purpose) else {
            let _ = table.retire(grant.slot);
            return Err(AgentError::Busy);
        };
        let read = ReadBlock { source: slot, l1_slot: grant.slot, key, generation: source.generation, payload_len };
        if self.read_into(cookie, read, priority, parts.poller) {
            Ok(())
        } else {
            self.put_op(cookie);
            self.release_l1(grant.slot, parts.table);
            Err(AgentError::Busy)
        }
    }

    /// The partition a block of `namespace` is brought up into for `to`:
    /// its own, which an agent must map (another tenant's block is not
    /// brought into memory the agent cannot read, nor named to it).
    pub(super) fn partition_for(&self, to: Requester, namespace: u64) -> Result<usize, AgentError> {
        let partition = self.partition_of(namespace);
        match to {
            Requester::Agent { agent, .. } if self.agent_partition(agent) != partition => Err(AgentError::Invalid),
            _ => Ok(partition),
        }
    }

    /// Submits op `cookie`'s read of an L2 object into the L1 slot it was
    /// given (busy from now on; its ticket kept, so the read can be
    /// cancelled). False when the poller is full: the caller undoes.
    pub(super) fn read_into<B: IoBackend>(
        &mut self,
        cookie: u64,
        read: ReadBlock,
        priority: Priority,
        poller: &mut Poller<B>,
    ) -> bool {
        self.l1[read.l1_slot as usize] = L1State::Busy;
        match poller.submit(Request { command: Command::Read(read), priority, deadline_ns: 0, cookie }) {
            Ok(ticket) => {
                let index = usize::try_from(cookie & !POOL_COOKIE).unwrap_or(usize::MAX);
                if let Some(slot) = self.tickets.get_mut(index) {
                    *slot = Some(ticket);
                }
                true
            }
            Err(_) => false,
        }
    }

    /// A demotion whose payload could not be sealed ends failed: the L1
    /// copy goes (it drained for the move), the L2 slot is given back, and
    /// nothing is written in the clear.
    /// An L2 copy a read found bad goes, as a reader would drop it, and
    /// the control plane hears why — only while its slot still holds the
    /// generation that was read: the control plane may have evicted it
    /// while the read was in flight, and the slot may hold another block
    /// by now.
    pub(super) fn drop_bad_l2(
        &mut self,
        slot: L2Slot,
        generation: u32,
        key: BlockKey,
        l2: &mut L2Slots,
        link: &mut Option<CpLink>,
    ) {
        if self.l2_object(slot, generation).is_none() || l2.release(slot).is_err() {
            return;
        }
        self.l2_released(slot);
        if let Some(cp) = link {
            let replica = crate::runner::l2_replica(&self.geometry, self.node, self.epoch, slot, generation);
            cp.evicted(&BlockEvicted { replica, key, reason: EvictReason::Corrupt as u8, reserved: [0; 7] });
        }
    }

    /// Ends a promotion into `l1_slot`, from L2 or L3 alike: counted where
    /// it landed (`result`: its bytes), the slot given back where it did
    /// not, and its requester answered.
    pub(super) fn promotion_ended<B: IoBackend>(
        &mut self,
        to: Requester,
        l1_slot: u32,
        l1_generation: u32,
        result: Result<u64, AgentError>,
        parts: &mut Parts<'_, B>,
    ) {
        if let Ok(bytes) = result {
            self.stats.promotions += 1;
            self.stats.bytes_up += bytes;
        } else {
            self.release_l1(l1_slot, parts.table);
        }
        match to {
            Requester::Agent { agent, cookie } => {
                self.answer(agent, cookie, result.map(|_| (l1_slot, l1_generation)));
            }
            Requester::Cp { request } => {
                if let Some(cp) = parts.link.as_mut() {
                    let status = match result {
                        Ok(_) => 0,
                        Err(e) => code_of(e) as u32,
                    };
                    let target = self.l1_replica(l1_slot, l1_generation);
                    let bytes = result.unwrap_or(0);
                    cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes });
                }
            }
        }
    }

    /// A block read into `l1_slot`: its header is rewritten to name the L1
    /// slot, and the replica is reported. Returns the header as it was
    /// read (naming the object read).
    pub(super) fn promoted(
        &mut self,
        l1_slot: u32,
        l1_generation: u32,
        region: &SlotRegion,
        link: &mut Option<CpLink>,
    ) -> Result<ObjectMeta, AgentError> {
        // SAFETY: the slot was allocated for this read, which completed; no
        // agent can pin it before it is reported.
        let bytes = unsafe { region.slot_mut(l1_slot) }.ok_or(AgentError::Invalid)?;
        let slot_bytes = bytes.len() as u64;
        let decoded = decode_header(bytes).map_err(|_| AgentError::Corrupt)?;
        let read = *decoded.meta();
        let region = crate::model::replica::RegionId(self.l1_region);
        let meta = match decoded.seal() {
            None => {
                let header: &mut [u8; STORED_HEADER_BYTES] =
                    (&mut bytes[..STORED_HEADER_BYTES]).try_into().map_err(|_| AgentError::Invalid)?;
                decoded
                    .encode_moved(region, self.epoch, l1_slot, l1_generation, header)
                    .map_err(|_| AgentError::Corrupt)?
            }
            Some(_) => {
                // Opened in the slot (its CRCs, over the ciphertext, were
                // checked by the read), then headed anew with the
                // plaintext's CRCs, as L1 readers check them.
                let meta = ObjectMeta {
                    region,
                    region_epoch: self.epoch,
                    slot: l1_slot,
                    generation: l1_generation,
                    ..*decoded.meta()
                };
                let Some(key) = self.keys.get(meta.namespace) else {
                    self.stats.unreadable += 1;
                    return Err(AgentError::Corrupt);
                };
                match crate::auth::at_rest::open_object(key, &decoded, &meta, bytes) {
                    Ok(()) => {}
                    Err(crate::auth::at_rest::OpenError::Malformed) => return Err(AgentError::Invalid),
                    Err(_) => {
                        self.stats.unreadable += 1;
                        return Err(AgentError::Corrupt);
                    }
                }
                self.stats.opened += 1;
                meta
            }
        };
        self.l1[l1_slot as usize] = L1State::Ready;
        self.charge(l1_slot, l1_generation, meta.namespace.0, slot_bytes);
        if let Some(cp) = link {
            cp.committed(&self.l1_record(l1_slot, l1_generation, &meta));
        }
        Ok(read)
    }
}
