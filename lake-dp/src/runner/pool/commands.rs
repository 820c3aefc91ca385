//! The control plane's commands: tier moves (demotions to L2, copies to
//! L3), evictions, and drains that relocate a region's blocks; each
//! answered with its `TransferDone`.

use super::{L1State, Pool, Purpose, Requester, code_of, is_write_back, op_code};
use crate::cplink::CpCommand;
use crate::io::IoBackend;
use crate::model::key::BlockKey;
use crate::model::replica::{Durability, Priority, ReplicaWire, Tier};
use crate::op::{Command, Event, OpError, ReadBlock, Request, WriteBlock};
use crate::runner::Parts;
use crate::stored::{ObjectMeta, decode_header, object_bytes};
use crate::wire::message::{BlockEvicted, DrainRegion, ErrorCode, EvictReason, SLOT_ANY, Transfer, TransferDone};

impl Pool {
    pub(super) fn command<B: IoBackend>(&mut self, command: CpCommand, parts: &mut Parts<'_, B>) {
        let (request, target, outcome) = match command {
            CpCommand::Evict { request, replica } => (request, replica.replica, self.evict(&replica, parts)),
            CpCommand::Mark { replica, evictable } => {
                self.mark(&replica, evictable, parts);
                return;
            }
            CpCommand::VictimsLeft { region, left } => {
                if region == self.l1_region {
                    self.victims_left = left;
                }
                return;
            }
            CpCommand::Move { request, transfer } | CpCommand::Copy { request, transfer }
                if transfer.target.tier == Tier::L3Object as u8 =>
            {
                let evict = matches!(command, CpCommand::Move { .. });
                match self.write_l3(request, &transfer, evict, parts) {
                    // Answered when the object is stored.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L3Object as u8 && transfer.target.tier == Tier::L1Dram as u8 =>
            {
                let to = Requester::Cp { request };
                match self.promote_l3(to, transfer.key, &transfer.source, parts) {
                    Ok(()) => return,
                    Err(e) => (request, transfer.target, Err(code_of(e))),
                }
            }
            CpCommand::Move { request, transfer }
                if transfer.source.tier == Tier::L1Dram as u8 && transfer.target.tier == Tier::L2Nvme as u8 =>
            {
                let outcome = self.demote(request, &transfer.source, &transfer.key, parts);
                match outcome {
                    // Answered when the write completes.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L2Nvme as u8 && transfer.target.tier == Tier::L1Dram as u8 =>
            {
                let priority = Priority::from_u8(transfer.priority).unwrap_or(Priority::Replication);
                let to = Requester::Cp { request };
                match self.promote(to, transfer.key, &transfer.source, priority, parts) {
                    Ok(()) => return,
                    Err(e) => (request, transfer.target, Err(code_of(e))),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L1Dram as u8
                    && transfer.target.tier == Tier::L2Nvme as u8
                    && transfer.target.node == self.node =>
            {
                match self.write_back(request, &transfer, parts) {
                    // Answered when the write completes.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Copy { request, transfer }
                if transfer.source.tier == Tier::L1Dram as u8
                    && transfer.target.tier == Tier::L1Dram as u8
                    && transfer.target.node != self.node =>
            {
                match self.send_remote(request, &transfer, parts) {
                    // Answered when the peer says it landed, or why not.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Move { request, transfer }
                if transfer.source.tier == Tier::L2Nvme as u8 && transfer.target.tier == Tier::L2Nvme as u8 =>
            {
                match self.relocate(request, &transfer, parts) {
                    // Answered when the copy is written.
                    Ok(()) => return,
                    Err(code) => (request, transfer.target, Err(code)),
                }
            }
            CpCommand::Drain { request, drain } => {
                let (_, target) = command.request_and_target();
                let target = ReplicaWire { node: self.node, region_epoch: self.epoch, ..target };
                (request, target, self.drain(&drain, parts))
            }
            CpCommand::Move { request, transfer } | CpCommand::Copy { request, transfer } => {
                (request, transfer.target, Err(ErrorCode::BadFrame))
            }
        };
        let status = match outcome {
            Ok(()) => 0,
            // A write-back ahead of demand that found no free L1 slot to
            // stage in waits for a later pass: not a failure.
            Err(ErrorCode::NoSpace) if matches!(command, CpCommand::Copy { transfer, .. } if is_write_back(&transfer)) =>
            {
                self.stats.write_backs_deferred += 1;
                ErrorCode::NoSpace as u32
            }
            // The block left that slot before the command came (a save or
            // a load took it as a marked victim, say): the control plane
            // hears so from its eviction report too. Not a failure.
            Err(ErrorCode::StaleGeneration) => {
                self.stats.commands_stale += 1;
                ErrorCode::StaleGeneration as u32
            }
            Err(code) => {
                self.stats.commands_failed += 1;
                code as u32
            }
        };
        if let Some(cp) = parts.link {
            cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes: 0 });
        }
    }

    /// Drains one of this node's L2 files (no new object goes there) or
    /// uses it again.
    pub(super) fn drain<B: IoBackend>(
        &mut self,
        drain: &DrainRegion,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let file = drain
            .region
            .checked_sub(self.geometry.region_first)
            .filter(|&f| f < self.geometry.files)
            .ok_or(ErrorCode::NoSuchBlock)?;
        parts.l2.set_draining(file, drain.draining == 1).map_err(|_| ErrorCode::NoSuchBlock)
    }

    /// Starts moving an L2 object to a slot of another L2 file (not one
    /// being drained): read into a staging L1 slot first.
    pub(super) fn relocate<B: IoBackend>(
        &mut self,
        request: u64,
        transfer: &Transfer,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let source = &transfer.source;
        if source.region_epoch != self.epoch || source.node != self.node {
            return Err(ErrorCode::StaleEpoch);
        }
        if transfer.target.node != self.node {
            return Err(ErrorCode::BadFrame);
        }
        let slot = self.l2_slot_of(source).ok_or(ErrorCode::NoSuchBlock)?;
        let meta = match self.l2_object(slot, source.generation) {
            Some(meta) if source.generation != 0 => *meta,
            _ => return Err(ErrorCode::StaleGeneration),
        };
        if meta.key != transfer.key {
            return Err(ErrorCode::NoSuchBlock);
        }
        let partition = self.partition_of(meta.namespace.0);
        let (table, l2) = (&mut *parts.table, &mut *parts.l2);
        let class = table.class_in(partition, object_bytes(meta.payload_len)).ok_or(ErrorCode::NoSpace)?;
        let target = l2.allocate_avoiding(Some(slot.file)).ok_or(ErrorCode::NoSpace)?;
        let Some(stage) = table.allocate(class) else {
            let _ = l2.release(target.slot);
            return Err(ErrorCode::NoSpace);
        };
        let priority = Priority::from_u8(transfer.priority).unwrap_or(Priority::Demotion);
        let purpose = Purpose::Relocate {
            request,
            stage: stage.slot,
            source: slot,
            source_generation: source.generation,
            target,
            priority,
        };
        let Some(cookie) = self.take_op(purpose) else {
            let _ = l2.release(target.slot);
            let _ = table.retire(stage.slot);
            return Err(ErrorCode::QueueFull);
        };
        let read = ReadBlock {
            source: slot,
            l1_slot: stage.slot,
            key: meta.key,
            generation: source.generation,
            payload_len: meta.payload_len,
        };
        if !self.read_into(cookie, read, priority, parts.poller) {
            self.put_op(cookie);
            self.release_l1(stage.slot, parts.table);
            let _ = parts.l2.release(target.slot);
            return Err(ErrorCode::QueueFull);
        }
        Ok(())
    }

    /// A relocation's read or write ended: after the read, the staged
    /// object (sealed or not, as it lay) is written to its new slot with
    /// a header naming it; after the write, the new replica is reported,
    /// the source freed and reported, and the command answered.
    pub(super) fn relocation_step<B: IoBackend>(&mut self, purpose: Purpose, event: &Event, parts: &mut Parts<'_, B>) {
        let Purpose::Relocate { request, stage, source, source_generation, target, priority } = purpose else {
            return;
        };
        let (node, epoch) = (self.node, self.epoch);
        let fail = |pool: &mut Self, code: ErrorCode, parts: &mut Parts<'_, B>| {
            pool.release_l1(stage, parts.table);
            let _ = parts.l2.release(target.slot);
            pool.stats.commands_failed += 1;
            let target = ReplicaWire {
                slot: SLOT_ANY,
                ..crate::runner::l2_replica(&pool.geometry, node, epoch, target.slot, 0)
            };
            if let Some(cp) = parts.link.as_mut() {
                cp.transfer_done(request, &TransferDone { status: code as u32, reserved: 0, target, bytes: 0 });
            }
        };
        match (event.command, event.outcome) {
            (Command::Read(read), Err(e)) => {
                if matches!(e, OpError::Corrupt(_)) {
                    self.drop_bad_l2(source, source_generation, read.key, parts.l2, parts.link);
                }
                fail(self, op_code(e), parts);
            }
            (Command::Read(_), Ok(_)) => {
                // SAFETY: the staging slot was allocated for this read,
                // which completed; it is never reported, so nobody pins it.
                let Some(decoded) = unsafe { parts.region.slot(stage) }.and_then(|b| decode_header(b).ok()) else {
                    return fail(self, ErrorCode::Checksum, parts);
                };
                let meta = ObjectMeta {
                    region: self.geometry.region(target.slot.file),
                    region_epoch: epoch,
                    slot: target.slot.slot,
                    generation: target.generation,
                    ..*decoded.meta()
                };
                let write = WriteBlock {
                    l1_slot: stage,
                    target: target.slot,
                    meta,
                    durability: Durability::Acked,
                    seal: decoded.seal().copied(),
                };
                let Some(cookie) = self.take_op(purpose) else { return fail(self, ErrorCode::QueueFull, parts) };
                let request = Request { command: Command::Write(write), priority, deadline_ns: 0, cookie };
                if parts.poller.submit(request).is_err() {
                    self.put_op(cookie);
                    fail(self, ErrorCode::QueueFull, parts);
                }
            }
            (Command::Write(_), Err(e)) => fail(self, op_code(e), parts),
            (Command::Write(write), Ok(done)) => {
                self.release_l1(stage, parts.table);
                self.l2_written(target.slot, &write.meta);
                let record = crate::runner::l2_record(&self.geometry, node, epoch, target.slot, &write.meta);
                // The source goes if it still holds what was moved (a purge
                // may have freed it meanwhile).
                let freed = self.l2_object(source, source_generation).is_some() && parts.l2.release(source).is_ok();
                if freed {
                    self.l2_released(source);
                }
                self.stats.relocations += 1;
                if let Some(cp) = parts.link.as_mut() {
                    cp.committed(&record);
                    if freed {
                        let replica = crate::runner::l2_replica(&self.geometry, node, epoch, source, source_generation);
                        let reason = EvictReason::Demoted as u8;
                        cp.evicted(&BlockEvicted { replica, key: write.meta.key, reason, reserved: [0; 7] });
                    }
                    let done = TransferDone { status: 0, reserved: 0, target: record.replica, bytes: done.bytes };
                    cp.transfer_done(request, &done);
                }
            }
            _ => {}
        }
    }

    pub(super) fn evict<B: IoBackend>(
        &mut self,
        evict: &BlockEvicted,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let (table, l2) = (&mut *parts.table, &mut *parts.l2);
        let replica = &evict.replica;
        if replica.region_epoch != self.epoch || replica.node != self.node {
            return Err(ErrorCode::StaleEpoch);
        }
        if replica.tier == Tier::L1Dram as u8 && replica.region == self.l1_region {
            let slot = replica.slot;
            if self.l1.get(slot as usize) != Some(&L1State::Ready)
                || table.arena().generation(slot) != Some(replica.generation)
            {
                return Err(ErrorCode::StaleGeneration);
            }
            self.release_l1(slot, table);
        } else if replica.tier == Tier::L2Nvme as u8 {
            let slot = self.l2_slot_of(replica).ok_or(ErrorCode::NoSuchBlock)?;
            self.l2_index(slot).ok_or(ErrorCode::NoSuchBlock)?;
            if replica.generation == 0 || self.l2_object(slot, replica.generation).is_none() {
                return Err(ErrorCode::StaleGeneration);
            }
            l2.release(slot).map_err(|_| ErrorCode::StaleGeneration)?;
            self.l2_released(slot);
        } else if replica.tier == Tier::L3Object as u8 {
            self.evict_l3(replica, &evict.key)?;
        } else {
            return Err(ErrorCode::NoSuchBlock);
        }
        self.stats.evictions += 1;
        let reason = EvictReason::from_u8(evict.reason).unwrap_or(EvictReason::Capacity);
        let Some(cp) = parts.link else { return Ok(()) };
        cp.evicted(&BlockEvicted { replica: *replica, key: evict.key, reason: reason as u8, reserved: [0; 7] });
        Ok(())
    }

    /// A write-back: the committed L1 block `transfer.source` written to
    /// an L2 slot while it stays in L1. The object is first copied into a
    /// staging slot: the write rewrites its header to name the L2 slot
    /// (and seals the payload, for a namespace with a data key) where it
    /// lies, and readers go on pinning the L1 copy meanwhile.
    pub(super) fn write_back<B: IoBackend>(
        &mut self,
        request: u64,
        transfer: &Transfer,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let slot = transfer.source.slot;
        let mut meta = self.committed_l1(&transfer.source, &transfer.key, true, parts)?;
        let region = parts.region;
        // SAFETY: a ready (or sending) slot is not written until it is
        // retired, which this thread alone does, and not in this call (its
        // mark is dropped first: the staging slot is not taken from it).
        let bytes = unsafe { region.slot(slot) }.ok_or(ErrorCode::NoSuchBlock)?;
        if !self.keys.may_store(meta.namespace) {
            // Encryption at rest is required and its tenant gave no key.
            return Err(ErrorCode::Unauthorized);
        }
        let object = object_bytes(meta.payload_len);
        let len = usize::try_from(object).map_err(|_| ErrorCode::NoSuchBlock)?;
        let grant = parts.l2.allocate().ok_or(ErrorCode::NoSpace)?;
        if let Some(mark) = self.marked.get_mut(slot as usize) {
            *mark = None;
        }
        // Staged in the block's own partition (where it lies already).
        let partition = self.partition_of(meta.namespace.0);
        let Some(stage) = self.slot_or_victim(partition, object, 0, parts) else {
            let _ = parts.l2.release(grant.slot);
            return Err(ErrorCode::NoSpace);
        };
        // Written to L2 from here; freed when the write ends.
        self.l1[stage.slot as usize] = L1State::Busy;
        // Both slots go back where the write cannot start.
        let undo = |pool: &mut Self, parts: &mut Parts<'_, B>, code| {
            pool.release_l1(stage.slot, parts.table);
            let _ = parts.l2.release(grant.slot);
            Err(code)
        };
        // SAFETY: the staging slot was just allocated: this thread alone
        // owns it until the write's end frees it.
        let staged = unsafe { parts.region.slot_mut(stage.slot) }.and_then(|b| b.get_mut(..len));
        let (Some(staged), Some(from)) = (staged, bytes.get(..len)) else {
            return undo(self, parts, ErrorCode::NoSuchBlock);
        };
        staged.copy_from_slice(from);
        meta.region = self.geometry.region(grant.slot.file);
        meta.region_epoch = self.epoch;
        meta.slot = grant.slot.slot;
        meta.generation = grant.generation;
        let seal = match self.seal_in_place(&meta, Some(staged)) {
            Ok(seal) => seal,
            Err(code) => return undo(self, parts, code),
        };
        let write = WriteBlock { l1_slot: stage.slot, target: grant.slot, meta, durability: Durability::Acked, seal };
        let Some(cookie) = self.take_op(Purpose::WriteBack { request, stage: stage.slot }) else {
            return undo(self, parts, ErrorCode::QueueFull);
        };
        let submitted =
            Request { command: Command::Write(write), priority: Priority::WriteBack, deadline_ns: 0, cookie };
        if parts.poller.submit(submitted).is_err() {
            self.put_op(cookie);
            return undo(self, parts, ErrorCode::QueueFull);
        }
        Ok(())
    }

    pub(super) fn demote<B: IoBackend>(
        &mut self,
        request: u64,
        source: &ReplicaWire,
        key: &BlockKey,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let slot = source.slot;
        let mut meta = self.committed_l1(source, key, false, parts)?;
        let (table, l2) = (&mut *parts.table, &mut *parts.l2);
        if self.draining.len() == self.draining.capacity() {
            return Err(ErrorCode::QueueFull);
        }
        if !self.keys.may_store(meta.namespace) {
            // Encryption at rest is required and its tenant gave no key.
            return Err(ErrorCode::Unauthorized);
        }
        let grant = l2.allocate().ok_or(ErrorCode::NoSpace)?;
        meta.region = self.geometry.region(grant.slot.file);
        meta.region_epoch = self.epoch;
        meta.slot = grant.slot.slot;
        meta.generation = grant.generation;
        // Sealed (if its namespace has a data key) once the slot drains.
        let write = WriteBlock { l1_slot: slot, target: grant.slot, meta, durability: Durability::Acked, seal: None };
        let purpose = Purpose::Demote { request, l1_generation: source.generation, write };
        let Some(cookie) = self.take_op(purpose) else {
            let _ = l2.release(grant.slot);
            return Err(ErrorCode::QueueFull);
        };
        if table.retire_kept(slot).is_err() {
            self.put_op(cookie);
            let _ = l2.release(grant.slot);
            return Err(ErrorCode::StaleGeneration);
        }
        self.l1[slot as usize] = L1State::Busy;
        self.draining.push((slot, cookie));
        Ok(())
    }
}
