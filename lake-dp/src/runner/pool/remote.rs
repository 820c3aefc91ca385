//! Blocks that cross to and from other nodes: copies `lake-cp` asks of
//! this node for a peer (sent from a held L1 slot, answered when the peer
//! says it landed), and blocks peers send here (P→D, replication),
//! reserved, landed, checked and published like commits.

use super::{L1State, Pool, RemoteSend};
use crate::constants::STORED_HEADER_BYTES;
use crate::io::IoBackend;
use crate::model::replica::{Priority, ReplicaWire};
use crate::runner::Parts;
use crate::stored::object_bytes;
use crate::transport::Landing;
use crate::transport::frame::{AckStatus, BlockAddr};
use crate::wire::message::{ErrorCode, Transfer, TransferDone};

/// The slot bytes a stored object of `len` bytes (its header and payload,
/// as it travels) needs: the payload padded as a slot pads it.
fn stored_object_room(len: u64) -> u64 {
    object_bytes(len.saturating_sub(STORED_HEADER_BYTES as u64))
}

/// The owner of an L1 reservation made for a peer's block arriving over
/// the transport (no local agent's port).
const REMOTE_AGENT: u16 = u16::MAX;

/// The pool as the transport's [`Landing`]: blocks that peers send to this
/// node's L1 (P→D, replication) are reserved, landed, checked and
/// published like commits.
pub(crate) struct PoolLanding<'p, 'a, B: IoBackend> {
    /// The pool.
    pub pool: &'p mut Pool,
    /// The runner's parts.
    pub parts: &'p mut Parts<'a, B>,
}

impl<B: IoBackend> Landing for PoolLanding<'_, '_, B> {
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus> {
        self.pool.remote_place(target, len, self.parts)
    }

    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        self.pool.remote_landed(target, len, self.parts)
    }

    fn abandoned(&mut self, target: &BlockAddr) {
        self.pool.remote_abandoned(target, self.parts);
    }

    fn reserve(&mut self, region: u16, epoch: u64, len: u64, namespace: Option<u64>) -> Result<BlockAddr, AckStatus> {
        self.pool.remote_reserve(region, epoch, len, namespace, self.parts)
    }

    fn admit(&mut self, namespace: u64, len: u64, now_ns: u64) -> Result<(), u64> {
        self.pool.rates.admit_or_wait(namespace, crate::rates::RatePath::NetReceive, len, now_ns)
    }
}

impl Pool {
    pub(super) fn send_remote<B: IoBackend>(
        &mut self,
        request: u64,
        transfer: &Transfer,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let source = &transfer.source;
        let slot = source.slot;
        let meta = self.committed_l1(source, &transfer.key, true, parts)?;
        let readers = match self.l1.get(slot as usize) {
            Some(&L1State::Sending { readers }) if readers == u16::MAX => return Err(ErrorCode::StaleGeneration),
            Some(&L1State::Sending { readers }) => readers,
            _ => 0,
        };
        if self.sends.len() >= self.sends.capacity() {
            return Err(ErrorCode::QueueFull);
        }
        self.l1[slot as usize] = L1State::Sending { readers: readers + 1 };
        self.sends.push(RemoteSend {
            request,
            slot,
            generation: source.generation,
            len: STORED_HEADER_BYTES as u64 + meta.payload_len,
            target: transfer.target,
            priority: Priority::from_u8(transfer.priority).unwrap_or(Priority::Replication),
            namespace: meta.namespace.0,
            deadline_unix_ns: transfer.deadline_unix_ns,
            handed: false,
        });
        Ok(())
    }

    /// Sends not yet handed to the transport: marked handed as they are
    /// taken.
    /// A send of a tenant over its cap on the network waits in the queue
    /// (its slot held) until its bucket refills.
    pub(crate) fn take_sends(&mut self, now_ns: u64, mut hand: impl FnMut(&RemoteSend) -> bool) {
        // The wall clock, only where a waiting send has a deadline.
        let waiting_with_deadline = self.sends.iter().any(|s| !s.handed && s.deadline_unix_ns != 0);
        let unix_now = if waiting_with_deadline {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        } else {
            0
        };
        for send in self.sends.iter_mut().filter(|s| !s.handed) {
            if send.deadline_unix_ns != 0 && unix_now > send.deadline_unix_ns {
                // Waited past its deadline: ended, its slot released.
                send.handed = true;
                self.stats.sends_expired += 1;
                self.failed_sends.push((send.request, ErrorCode::DeadlineExceeded));
                continue;
            }
            if !self.rates.admit(send.namespace, crate::rates::RatePath::NetSend, send.len, now_ns) {
                self.stats.sends_throttled += 1;
                continue;
            }
            send.handed = true;
            if !hand(send) {
                self.failed_sends.push((send.request, ErrorCode::Io));
            }
        }
    }

    /// A send ended (`landed`: the slot it landed in, or why not): the
    /// slot goes back to ready once no other send reads it, and `lake-cp`
    /// is answered.
    pub(crate) fn send_ended<B: IoBackend>(
        &mut self,
        request: u64,
        landed: Result<BlockAddr, ErrorCode>,
        parts: &mut Parts<'_, B>,
    ) {
        let Some(at) = self.sends.iter().position(|s| s.request == request) else { return };
        let send = self.sends.swap_remove(at);
        if let Some(&L1State::Sending { readers }) = self.l1.get(send.slot as usize)
            && parts.table.arena().generation(send.slot) == Some(send.generation)
        {
            self.l1[send.slot as usize] =
                if readers > 1 { L1State::Sending { readers: readers - 1 } } else { L1State::Ready };
        }
        let (status, target, bytes) = match landed {
            Ok(at) => {
                self.stats.remote_sent += 1;
                let target = ReplicaWire { slot: at.slot, generation: at.generation, ..send.target };
                (0, target, send.len)
            }
            Err(code) => {
                self.stats.commands_failed += 1;
                (code as u32, send.target, 0)
            }
        };
        if let Some(cp) = parts.link {
            cp.transfer_done(send.request, &TransferDone { status, reserved: 0, target, bytes });
        }
    }

    /// `lake-cp` took copy `request` back: one not yet handed to the
    /// transport ends `Cancelled` now, its slot released; one handed to it
    /// is cancelled there ([`Pool::take_send_cancels`]) if none of its
    /// bytes went out (else it goes on to its end). Another request is
    /// not a send of this node's: nothing to do.
    pub(super) fn cancel_send<B: IoBackend>(&mut self, request: u64, parts: &mut Parts<'_, B>) {
        let Some(send) = self.sends.iter().find(|s| s.request == request) else { return };
        self.stats.sends_cancelled += 1;
        if send.handed {
            if self.send_cancels.len() < self.send_cancels.capacity() {
                self.send_cancels.push(request);
            }
            return;
        }
        self.send_ended(request, Err(ErrorCode::Cancelled), parts);
    }

    /// Copies handed to the transport that `lake-cp` took back: each for
    /// the transport to cancel (its end comes as any transfer's).
    pub(crate) fn take_send_cancels(&mut self, mut cancel: impl FnMut(u64)) {
        for request in self.send_cancels.drain(..) {
            cancel(request);
        }
    }

    /// Sends the transport would not take: ended as failed.
    pub(crate) fn end_failed_sends<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>) {
        while let Some((request, code)) = self.failed_sends.pop() {
            self.send_ended(request, Err(code), parts);
        }
    }

    /// A peer's block (of `namespace`, where the sender names it) is
    /// coming over the transport for this node's L1: a slot of its size is
    /// reserved for it in its namespace's partition (by no local agent;
    /// the reservation's timeout applies), its address given. A
    /// partitioned node takes no block whose sender does not name its
    /// namespace: it could not tell whose memory it may land in.
    fn remote_reserve<B: IoBackend>(
        &mut self,
        region: u16,
        epoch: u64,
        len: u64,
        namespace: Option<u64>,
        parts: &mut Parts<'_, B>,
    ) -> Result<BlockAddr, AckStatus> {
        if region != self.l1_region || epoch != self.epoch {
            return Err(AckStatus::Refused);
        }
        let partition = match namespace {
            Some(namespace) => self.partition_of(namespace),
            None if self.partitions.each.is_empty() => 0,
            None => return Err(AckStatus::Refused),
        };
        let grant = self.slot_or_victim(partition, stored_object_room(len), 0, parts).ok_or(AckStatus::Busy)?;
        self.l1[grant.slot as usize] = L1State::Reserved { agent: REMOTE_AGENT, since_ns: parts.now_ns };
        self.reserved += 1;
        Ok(BlockAddr { region, epoch, slot: grant.slot, generation: grant.generation })
    }

    /// Where a block reserved by [`Pool::remote_reserve`] lands.
    fn remote_place<B: IoBackend>(
        &mut self,
        target: &BlockAddr,
        len: u64,
        parts: &mut Parts<'_, B>,
    ) -> Result<*mut u8, AckStatus> {
        let fits = parts.region.slot_len(target.slot).is_some_and(|room| stored_object_room(len) <= room as u64);
        if !self.remote_owns(target, parts) || !fits {
            return Err(AckStatus::Refused);
        }
        parts.region.slot_ptr(target.slot).ok_or(AckStatus::Refused)
    }

    fn remote_owns<B: IoBackend>(&self, target: &BlockAddr, parts: &Parts<'_, B>) -> bool {
        target.region == self.l1_region
            && target.epoch == self.epoch
            && matches!(self.l1.get(target.slot as usize), Some(L1State::Reserved { agent: REMOTE_AGENT, .. }))
            && parts.table.arena().generation(target.slot) == Some(target.generation)
    }

    /// A peer's block arrived whole: checked (header, every CRC), its
    /// header rewritten to name its slot, published like a commit.
    fn remote_landed<B: IoBackend>(&mut self, target: &BlockAddr, len: u64, parts: &mut Parts<'_, B>) -> AckStatus {
        if !self.remote_owns(target, parts) {
            return AckStatus::Refused;
        }
        // SAFETY: as in `remote_place`: the slot is this transfer's.
        let Some(bytes) = (unsafe { parts.region.slot_mut(target.slot) }) else { return AckStatus::Refused };
        let slot_bytes = bytes.len() as u64;
        match crate::transport::check_and_adopt(bytes, len, target) {
            // Another partition's block (its sender named another
            // namespace, or placed it in a slot it named): never published.
            Ok(meta) if !self.in_its_partition(meta.namespace.0, target.slot, parts.table) => {
                self.stats.commits_foreign += 1;
                self.release_l1(target.slot, parts.table);
                AckStatus::Refused
            }
            // Past its namespace's or tenant's L1 quota: refused like an
            // engine's save here, never published.
            Ok(meta) if !self.admits(meta.namespace.0, slot_bytes, parts.table) => {
                self.stats.saves_refused += 1;
                self.stats.saves_refused_quota += 1;
                self.release_l1(target.slot, parts.table);
                AckStatus::Refused
            }
            Ok(meta) => {
                self.reserved = self.reserved.saturating_sub(1);
                self.l1[target.slot as usize] = L1State::Ready;
                self.charge(target.slot, target.generation, meta.namespace.0, slot_bytes);
                self.stats.saves += 1;
                self.stats.remote_landed += 1;
                if let Some(cp) = parts.link {
                    cp.committed(&self.l1_record(target.slot, target.generation, &meta));
                }
                AckStatus::Landed
            }
            Err(status) => {
                self.stats.commits_corrupt += 1;
                self.release_l1(target.slot, parts.table);
                status
            }
        }
    }

    /// A peer's block will not come: its slot goes back.
    fn remote_abandoned<B: IoBackend>(&mut self, target: &BlockAddr, parts: &mut Parts<'_, B>) {
        if self.remote_owns(target, parts) {
            self.release_l1(target.slot, parts.table);
        }
    }
}
