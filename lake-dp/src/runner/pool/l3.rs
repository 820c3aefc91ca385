//! The pool's L3 tier: blocks written to the object store, read back
//! through a miss, and deleted on `lake-cp`'s commands. The store's calls
//! run on [`L3Client`]'s worker threads; this side only hands requests
//! over and takes completions, never waiting.
//!
//! - **Catalog**: what this node knows to be in the store — one entry per
//!   object (its header), the slot of the L3 replica `lake-cp` is told of
//!   (`slot` = catalog entry, `generation` moves on at every reuse, the
//!   region epoch is the data plane's). Filled at start by scanning the
//!   store's headers ([`crate::l3::scan`]), so a restart (or a new control
//!   plane) finds every object again. Sized at start.
//! - **Writes** (`MoveBlock`/`CopyBlock` with an L3 target): from L1, the
//!   slot's payload goes with a header rewritten to name the L3 object (the
//!   slot keeps its own for its readers); from L2, the block is read into
//!   a staging L1 slot first (verified by the poller), its header rewritten
//!   there. A move frees the source once the object is stored; the L3
//!   replica is reported `Durable` only then.
//! - **Reads** (an agent's `Load` or `CopyBlock` L3→L1): the object is read
//!   into a free L1 slot, checked (header, key, namespace, every CRC) on
//!   the worker, its header rewritten to name the slot, and reported like
//!   any promotion. An object gone from the store or failing its check
//!   leaves the catalog (reported evicted) and the reader recomputes.
//! - **Reads by name** (the control plane's `CopyBlock` L3→L1 with any
//!   slot): an object the catalog does not hold — another node sharing the
//!   store wrote it — read by its name, checked as any read, and adopted
//!   into the catalog.
//! - **Deletes** (`EvictBlock` of an L3 replica): the entry goes at once;
//!   the object joins a batch, sent as one multi-object delete
//!   ([`L3Request::DeleteMany`]) at the next pass or when the batch is full
//!   ([`DELETE_BATCH_MAX`]); a write of the same block waits until the
//!   delete is done, so the two never race in the store.

use std::collections::HashMap;

use super::{L1State, Pool, Requester};
use crate::agent::port::AgentError;
use crate::constants::STORED_HEADER_BYTES;
use crate::io::{Clock, IoBackend, MonotonicClock};
use crate::l3::{L3Client, L3Completion, L3Error, L3Request};
use crate::model::key::BlockKey;
use crate::model::namespace::NamespaceId;
use crate::model::replica::{Durability, Priority, RegionId, ReplicaWire, Tier};
use crate::op::{L2Slot, ReadBlock};
use crate::runner::Parts;
use crate::stored::{ObjectMeta, decode_header, object_bytes};
use crate::wire::message::{
    BlockEvicted, BlockRecord, ErrorCode, EvictReason, Path, PathEntry, SLOT_ANY, Transfer, TransferDone,
};

/// Objects one batched delete removes at most.
pub const DELETE_BATCH_MAX: usize = 256;

/// Batched deletes in flight at most.
const DELETE_BATCHES: u32 = 4;

/// Where a write's bytes come from.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// An L1 block's slot (held while it is read).
    L1 { slot: u32, generation: u32 },
    /// An L2 block, staged in L1 slot `stage`.
    L2 { slot: L2Slot, generation: u32, stage: u32 },
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Put {
        request: u64,
        entry: u32,
        meta: ObjectMeta,
        source: Source,
        /// A move: the source goes once the object is stored.
        evict: bool,
    },
    Get {
        to: Requester,
        /// What is read.
        read: Read,
        l1_slot: u32,
        l1_generation: u32,
    },
    /// A batch of deletes: the blocks in `delete_buffers[buffer]`.
    DeleteMany { buffer: u32 },
}

/// What a read of the store names.
#[derive(Clone, Copy, Debug)]
enum Read {
    /// A catalog entry, and its generation then: the entry may be evicted
    /// and reused by another object before the read ends.
    Entry { entry: u32, generation: u32 },
    /// An object the catalog does not hold, by its name (another node
    /// wrote it): adopted into the catalog once it is read and checked.
    Named { namespace: u64, key: BlockKey },
}

/// What the L3 tier has done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct L3Stats {
    /// Objects written.
    pub writes: u64,
    /// Objects read back into L1 (checked).
    pub reads: u64,
    /// Objects deleted.
    pub deletes: u64,
    /// Batched deletes sent (each up to [`DELETE_BATCH_MAX`] objects).
    pub delete_batches: u64,
    /// Requests that failed (the store, or a check).
    pub failed: u64,
    /// Objects read that did not check, or were gone (left the catalog).
    pub lost: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Reads cancelled before a worker took them (their reader went).
    pub cancelled: u64,
}

/// The L3 tier of a pool. See the module docs.
pub(crate) struct L3Tier {
    client: L3Client,
    region: u16,
    catalog: Vec<Option<ObjectMeta>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    /// The entry of each (namespace, key) in the catalog.
    by_key: HashMap<(u64, BlockKey), u32>,
    /// The largest payload of each namespace's objects met (written, or
    /// found in the store): what a read by name makes room for.
    payload_max: HashMap<u64, u64>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<u32>,
    /// One header per op: what a write from L1 stores in the slot's
    /// header's place.
    headers: Vec<[u8; STORED_HEADER_BYTES]>,
    /// Per op: the data key a put from L1 is sealed with (held until it
    /// completes).
    seal_keys: Vec<Option<crate::auth::at_rest::DataKey>>,
    completions: Vec<L3Completion>,
    /// Deletes not sent yet (the next batch).
    pending_deletes: Vec<(NamespaceId, BlockKey)>,
    /// The batches in flight (each an op's), and which are free.
    delete_buffers: Vec<Vec<(NamespaceId, BlockKey)>>,
    free_buffers: Vec<u32>,
    /// When each op began (monotonic ns): a write's staging read, if it
    /// has one, is part of its time.
    started_ns: Vec<u64>,
    /// How long reads and writes took ([`Path::L3Read`], [`Path::L3Write`];
    /// failed ones too: a slow failure is a slow path).
    pub(crate) latency: [PathEntry; 2],
    /// What it has done.
    pub stats: L3Stats,
}

impl core::fmt::Debug for L3Tier {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("L3Tier").field("region", &self.region).field("stats", &self.stats).finish_non_exhaustive()
    }
}

impl L3Tier {
    /// The tier over `client`, as region `region`, with room for
    /// `entries` objects (the catalog starts empty: the store's scan fills
    /// it, [`Pool::l3_adopt`]) and `ops` requests in flight (at most the
    /// client's queue).
    pub(crate) fn new(client: L3Client, region: u16, entries: u32, ops: u32) -> Self {
        let entries = entries as usize;
        Self {
            client,
            region,
            catalog: vec![None; entries],
            generations: vec![1; entries],
            free: (0..u32::try_from(entries).unwrap_or(u32::MAX)).rev().collect(),
            by_key: HashMap::with_capacity(entries),
            payload_max: HashMap::new(),
            ops: vec![None; ops as usize],
            free_ops: (0..ops).rev().collect(),
            headers: vec![[0; STORED_HEADER_BYTES]; ops as usize],
            seal_keys: vec![None; ops as usize],
            completions: Vec::with_capacity(ops as usize),
            pending_deletes: Vec::with_capacity(DELETE_BATCH_MAX),
            delete_buffers: (0..DELETE_BATCHES).map(|_| Vec::with_capacity(DELETE_BATCH_MAX)).collect(),
            free_buffers: (0..DELETE_BATCHES).rev().collect(),
            started_ns: vec![0; ops as usize],
            latency: [PathEntry::new(Path::L3Read), PathEntry::new(Path::L3Write)],
            stats: L3Stats::default(),
        }
    }

    /// The region of its replicas.
    pub(crate) fn region(&self) -> u16 {
        self.region
    }

    /// Objects in the catalog.
    pub(crate) fn objects(&self) -> usize {
        self.by_key.len()
    }

    /// Requests in flight.
    pub(crate) fn in_flight(&self) -> usize {
        // Deletes waiting for their batch count as one.
        self.ops.len() - self.free_ops.len() + usize::from(!self.pending_deletes.is_empty())
    }

    fn take_op(&mut self, op: Op) -> Option<u32> {
        let index = self.free_ops.pop()?;
        self.ops[index as usize] = Some(op);
        self.started_ns[index as usize] = MonotonicClock.now_ns();
        Some(index)
    }

    /// Times op `index`, which just ended, on its path.
    fn timed(&mut self, index: u32, op: &Op) {
        let path = match op {
            Op::Get { .. } => 0,
            Op::Put { .. } => 1,
            Op::DeleteMany { .. } => return,
        };
        let started = self.started_ns.get(index as usize).copied().unwrap_or(0);
        self.latency[path].record(MonotonicClock.now_ns().saturating_sub(started));
    }

    fn put_op(&mut self, index: u32) -> Option<Op> {
        let op = self.ops.get_mut(index as usize)?.take()?;
        if let Some(key) = self.seal_keys.get_mut(index as usize) {
            *key = None;
        }
        self.free_ops.push(index);
        Some(op)
    }

    /// Whether object (`namespace`, `key`) is being written, or read by
    /// name: the catalog takes it when that ends, so another write or
    /// read by name waits (it would take a second entry for it).
    fn busy_with(&self, namespace: u64, key: &BlockKey) -> bool {
        self.ops.iter().flatten().any(|op| match op {
            Op::Put { meta, .. } => meta.namespace.0 == namespace && meta.key == *key,
            Op::Get { read: Read::Named { namespace: ns, key: k }, .. } => *ns == namespace && k == key,
            _ => false,
        })
    }

    fn deleting(&self, namespace: u64, key: &BlockKey) -> bool {
        let is = |(ns, k): &(NamespaceId, BlockKey)| ns.0 == namespace && k == key;
        self.pending_deletes.iter().any(is)
            || self.ops.iter().flatten().any(|op| match op {
                Op::DeleteMany { buffer } => self.delete_buffers[*buffer as usize].iter().any(is),
                _ => false,
            })
    }

    /// Sends the pending deletes as one batch, if a batch and an op are
    /// free; false when they stay pending.
    fn flush_deletes(&mut self) -> bool {
        if self.pending_deletes.is_empty() {
            return true;
        }
        let Some(buffer) = self.free_buffers.pop() else { return false };
        let Some(index) = self.take_op(Op::DeleteMany { buffer }) else {
            self.free_buffers.push(buffer);
            return false;
        };
        let batch = &mut self.delete_buffers[buffer as usize];
        batch.clear();
        batch.append(&mut self.pending_deletes);
        let request = L3Request::DeleteMany { blocks: batch.as_ptr(), count: batch.len() };
        // SAFETY: the batch's buffer is this op's alone (not touched, not
        // grown) until its completion frees it.
        if unsafe { self.client.submit(u64::from(index), request) }.is_err() {
            let batch = &mut self.delete_buffers[buffer as usize];
            self.pending_deletes.append(batch);
            self.put_op(index);
            self.free_buffers.push(buffer);
            return false;
        }
        true
    }

    /// A free catalog entry, its generation moved on.
    fn take_entry(&mut self) -> Option<(u32, u32)> {
        let entry = self.free.pop()?;
        let generation = &mut self.generations[entry as usize];
        *generation = generation.wrapping_add(1).max(1);
        Some((entry, *generation))
    }

    /// Puts `meta` (an object stored) in catalog entry `entry`.
    fn hold(&mut self, entry: u32, meta: ObjectMeta) {
        self.catalog[entry as usize] = Some(meta);
        self.by_key.insert((meta.namespace.0, meta.key), entry);
        let max = self.payload_max.entry(meta.namespace.0).or_default();
        *max = (*max).max(meta.payload_len);
    }

    fn forget(&mut self, entry: u32) {
        if let Some(meta) = self.catalog.get_mut(entry as usize).and_then(Option::take) {
            self.by_key.remove(&(meta.namespace.0, meta.key));
            self.free.push(entry);
        }
    }

    fn replica(&self, node: u32, epoch: u64, entry: u32, generation: u32) -> ReplicaWire {
        ReplicaWire {
            tier: Tier::L3Object as u8,
            reserved: 0,
            region: self.region,
            node,
            region_epoch: epoch,
            slot: entry,
            generation,
        }
    }

    /// The catalog's header of `entry` if it is still the object of
    /// `generation`.
    fn object(&self, entry: u32, generation: u32) -> Option<&ObjectMeta> {
        self.catalog.get(entry as usize)?.as_ref().filter(|m| m.generation == generation)
    }
}

impl Pool {
    /// Gives the pool an L3 tier.
    pub(crate) fn set_l3(&mut self, tier: L3Tier) {
        self.l3 = Some(tier);
    }

    /// The L3 tier's figures, if it has one.
    pub fn l3_stats(&self) -> Option<L3Stats> {
        self.l3.as_ref().map(|t| t.stats)
    }

    /// The catalog's header of the L3 replica `source`, if it is current.
    pub(super) fn l3_object_meta(&self, source: &ReplicaWire) -> Option<ObjectMeta> {
        let tier = self.l3.as_ref()?;
        (source.region == tier.region && source.region_epoch == self.epoch)
            .then(|| tier.object(source.slot, source.generation).copied())
            .flatten()
    }

    /// Cancels agent `agent`'s load `load` if it is an L3 read no worker
    /// has taken yet (it then ends `Cancelled`, its slot freed); whether
    /// it was.
    pub(super) fn cancel_l3_load(&mut self, agent: u16, load: u64) -> bool {
        let Some(tier) = self.l3.as_mut() else { return false };
        let op = tier.ops.iter().position(|op| {
            matches!(op, Some(Op::Get { to: Requester::Agent { agent: a, cookie: c }, .. }) if *a == agent && *c == load)
        });
        op.is_some_and(|index| tier.client.cancel(index as u64))
    }

    /// How long the L3 tier's reads and writes took, if it has one.
    pub fn l3_latency(&self) -> Option<[PathEntry; 2]> {
        self.l3.as_ref().map(|t| t.latency)
    }

    /// Objects in the L3 catalog.
    pub fn l3_objects(&self) -> usize {
        self.l3.as_ref().map_or(0, L3Tier::objects)
    }

    /// L3 requests in flight (the runner waits for them before it stops).
    pub fn l3_in_flight(&self) -> usize {
        self.l3.as_ref().map_or(0, L3Tier::in_flight)
    }

    /// Stops the L3 tier: waits for the requests its workers hold (their
    /// memory is the arena's), then ends them. Call before the arena goes.
    pub(crate) fn stop_l3(&mut self) {
        self.l3 = None;
    }

    /// An object the background scan found: into the catalog (unless it
    /// is there already — written since the pool started — or the
    /// catalog is full) and re-adopted to the control plane. Returns
    /// whether it went in.
    pub(crate) fn l3_adopt(&mut self, found: &ObjectMeta, link: &mut Option<crate::cplink::CpLink>) -> bool {
        let (node, epoch) = (self.node, self.epoch);
        let Some(tier) = self.l3.as_mut() else { return false };
        if tier.by_key.contains_key(&(found.namespace.0, found.key)) || tier.deleting(found.namespace.0, &found.key) {
            return false;
        }
        let Some((entry, generation)) = tier.take_entry() else { return false };
        let meta = ObjectMeta { slot: entry, generation, ..*found };
        tier.hold(entry, meta);
        if let Some(cp) = link.as_mut() {
            let replica = tier.replica(node, epoch, entry, generation);
            cp.readopted(&crate::runner::block_record(replica, &meta, Durability::Durable));
        }
        true
    }

    /// The record of every L3 object in the catalog (re-adoption).
    pub(crate) fn l3_records(&self, out: &mut dyn FnMut(BlockRecord)) {
        let Some(tier) = &self.l3 else { return };
        for (entry, meta) in (0u32..).zip(&tier.catalog) {
            let Some(meta) = meta else { continue };
            let replica = tier.replica(self.node, self.epoch, entry, meta.generation);
            out(crate::runner::block_record(replica, meta, Durability::Durable));
        }
    }

    /// A write of `transfer.source` (L1 or L2, this node) to L3; `evict`:
    /// a move. Answered when the object is stored, or at once with why not.
    pub(super) fn write_l3<B: IoBackend>(
        &mut self,
        request: u64,
        transfer: &Transfer,
        evict: bool,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), ErrorCode> {
        let (node, epoch, l1_region) = (self.node, self.epoch, self.l1_region);
        let source = transfer.source;
        let target = transfer.target;
        let Some(tier) = self.l3.as_mut() else { return Err(ErrorCode::NoSuchBlock) };
        if target.region != tier.region || target.region_epoch != epoch || target.node != node {
            return Err(ErrorCode::StaleEpoch);
        }
        if source.region_epoch != epoch || source.node != node {
            return Err(ErrorCode::StaleEpoch);
        }
        let priority = Priority::from_u8(transfer.priority).unwrap_or(Priority::WriteBack);
        // The block as its source describes it (from L1, the slot's own
        // header, which the stored object's is made from).
        let (meta, l1_header, l2_slot) = if source.tier == Tier::L1Dram as u8 && source.region == l1_region {
            let slot = source.slot;
            match self.l1.get(slot as usize) {
                Some(L1State::Ready) => {}
                Some(L1State::Sending { .. }) if !evict => {}
                _ => return Err(ErrorCode::StaleGeneration),
            }
            if parts.table.arena().generation(slot) != Some(source.generation) {
                return Err(ErrorCode::StaleGeneration);
            }
            // SAFETY: a ready slot is not written until it is retired,
            // which this thread alone does.
            let bytes = unsafe { parts.region.slot(slot) }.ok_or(ErrorCode::NoSuchBlock)?;
            let decoded = decode_header(bytes).map_err(|_| ErrorCode::Checksum)?;
            (*decoded.meta(), Some(decoded), None)
        } else if source.tier == Tier::L2Nvme as u8 {
            let slot = self.l2_slot_of(&source).ok_or(ErrorCode::NoSuchBlock)?;
            let meta = *self.l2_object(slot, source.generation).ok_or(ErrorCode::StaleGeneration)?;
            (meta, None, Some(slot))
        } else {
            return Err(ErrorCode::BadFrame);
        };
        if meta.key != transfer.key {
            return Err(ErrorCode::NoSuchBlock);
        }
        if !self.keys.may_store(meta.namespace) {
            // Encryption at rest is required and its tenant gave no key.
            return Err(ErrorCode::Unauthorized);
        }
        let path = crate::rates::RatePath::L3Write;
        if !self.rates.admit(meta.namespace.0, path, object_bytes(meta.payload_len), parts.now_ns) {
            // Its tenant is at its L3 write cap: not now (lake-cp asks
            // again after its retry wait).
            self.stats.writes_throttled += 1;
            return Err(ErrorCode::QueueFull);
        }
        let seal_key = if l1_header.is_some() { self.keys.get(meta.namespace).cloned() } else { None };
        // Staged (from L2) in its own partition: no other tenant's engine
        // maps the bytes on their way.
        let partition = self.partition_of(meta.namespace.0);
        let Some(tier) = self.l3.as_mut() else { return Err(ErrorCode::NoSuchBlock) };
        if tier.deleting(meta.namespace.0, &meta.key) || tier.busy_with(meta.namespace.0, &meta.key) {
            return Err(ErrorCode::QueueFull);
        }
        if let Some(&entry) = tier.by_key.get(&(meta.namespace.0, meta.key)) {
            // Stored already (a write-back raced a demotion): the object
            // there is this block; report it, and free the source if asked.
            let Some(stored) = tier.catalog[entry as usize] else { return Err(ErrorCode::NoSuchBlock) };
            let replica = tier.replica(node, epoch, entry, stored.generation);
            let record = crate::runner::block_record(replica, &stored, Durability::Durable);
            if let Some(cp) = parts.link.as_mut() {
                cp.committed(&record);
            }
            if evict {
                self.free_source(&source, &meta.key, parts);
            }
            self.l3_done(request, Ok((replica, 0)), parts);
            return Ok(());
        }
        if tier.free_ops.is_empty() {
            return Err(ErrorCode::QueueFull);
        }
        let (entry, generation) = tier.take_entry().ok_or(ErrorCode::NoSpace)?;
        let stored = ObjectMeta { region: RegionId(tier.region), region_epoch: epoch, slot: entry, generation, ..meta };
        if let Some(decoded) = l1_header {
            let slot = source.slot;
            let op = Op::Put {
                request,
                entry,
                meta: stored,
                source: Source::L1 { slot, generation: source.generation },
                evict,
            };
            let Some(index) = tier.take_op(op) else {
                tier.free.push(entry);
                return Err(ErrorCode::QueueFull);
            };
            let header = &mut tier.headers[index as usize];
            if decoded.encode_moved(stored.region, epoch, entry, generation, header).is_err() {
                tier.put_op(index);
                tier.free.push(entry);
                return Err(ErrorCode::Checksum);
            }
            let payload = parts.region.slot_ptr(slot).map(|p| p.wrapping_add(STORED_HEADER_BYTES));
            let Some(payload) = payload else {
                tier.put_op(index);
                tier.free.push(entry);
                return Err(ErrorCode::NoSuchBlock);
            };
            // A block from L1 is in the clear there: sealed by the worker
            // on its way out, where its tenant has a key (one from L2 is
            // sealed already).
            tier.seal_keys[index as usize] = seal_key;
            let seal_with = tier.seal_keys[index as usize].as_ref().map_or(core::ptr::null(), core::ptr::from_ref);
            let put = L3Request::PutWithHeader {
                key: meta.key,
                namespace: meta.namespace,
                header: header.as_ptr(),
                payload,
                payload_len: meta.payload_len,
                seal_with,
            };
            // SAFETY: the header buffer is this op's until its completion;
            // the slot is held below (no eviction, demotion or rewrite)
            // until then, and a ready slot's bytes do not change.
            if unsafe { tier.client.submit(u64::from(index), put) }.is_err() {
                tier.put_op(index);
                tier.free.push(entry);
                return Err(ErrorCode::QueueFull);
            }
            self.l1[slot as usize] = match self.l1[slot as usize] {
                L1State::Sending { readers } => L1State::Sending { readers: readers + 1 },
                _ if evict => L1State::Busy,
                _ => L1State::Sending { readers: 1 },
            };
            return Ok(());
        }
        // From L2: read into a staging slot first.
        let Some(l2_slot) = l2_slot else { return Err(ErrorCode::BadFrame) };
        let table = &mut *parts.table;
        let Some(grant) =
            table.class_in(partition, object_bytes(meta.payload_len)).and_then(|class| table.allocate(class))
        else {
            tier.free.push(entry);
            return Err(ErrorCode::NoSpace);
        };
        let staged = Source::L2 { slot: l2_slot, generation: source.generation, stage: grant.slot };
        let Some(index) = tier.take_op(Op::Put { request, entry, meta: stored, source: staged, evict }) else {
            tier.free.push(entry);
            let _ = table.retire(grant.slot);
            return Err(ErrorCode::QueueFull);
        };
        let Some(cookie) = self.take_op(super::Purpose::StageL3 { op: index }) else {
            self.abandon_put(index, table);
            return Err(ErrorCode::QueueFull);
        };
        let read = ReadBlock {
            source: l2_slot,
            l1_slot: grant.slot,
            key: meta.key,
            generation: source.generation,
            payload_len: meta.payload_len,
        };
        if !self.read_into(cookie, read, priority, parts.poller) {
            self.put_op(cookie);
            self.abandon_put(index, parts.table);
            return Err(ErrorCode::QueueFull);
        }
        Ok(())
    }

    /// A put that never went: its op, entry and staging slot go back.
    fn abandon_put(&mut self, index: u32, table: &mut crate::arena::SlotTable) {
        let Some(tier) = self.l3.as_mut() else { return };
        if let Some(Op::Put { entry, source, .. }) = tier.put_op(index) {
            tier.free.push(entry);
            if let Source::L2 { stage, .. } = source {
                self.release_l1(stage, table);
            }
        }
    }

    /// The staging read of an L2 block for L3 finished: on success the
    /// staged copy's header is rewritten to name the object, and the put
    /// goes to the store.
    pub(super) fn l3_staged<B: IoBackend>(&mut self, index: u32, read_ok: bool, parts: &mut Parts<'_, B>) {
        let Some(tier) = self.l3.as_mut() else { return };
        let Some(Some(Op::Put { request, meta, source: Source::L2 { stage, .. }, .. })) =
            tier.ops.get(index as usize).copied()
        else {
            return;
        };
        let fail = |pool: &mut Self, code: ErrorCode, parts: &mut Parts<'_, B>| {
            pool.abandon_put(index, parts.table);
            pool.stats.commands_failed += 1;
            if let Some(tier) = pool.l3.as_mut() {
                tier.stats.failed += 1;
            }
            let target = ReplicaWire { slot: SLOT_ANY, ..pool.l3_target() };
            if let Some(cp) = parts.link.as_mut() {
                cp.transfer_done(request, &TransferDone { status: code as u32, reserved: 0, target, bytes: 0 });
            }
        };
        if !read_ok {
            return fail(self, ErrorCode::Io, parts);
        }
        // SAFETY: the staging slot was allocated for this read, which
        // completed; it was never reported, so no reader can pin it.
        let Some(bytes) = (unsafe { parts.region.slot_mut(stage) }) else {
            return fail(self, ErrorCode::NoSuchBlock, parts);
        };
        let rewritten = decode_header(bytes).ok().and_then(|decoded| {
            let header: &mut [u8; STORED_HEADER_BYTES] = (&mut bytes[..STORED_HEADER_BYTES]).try_into().ok()?;
            decoded.encode_moved(meta.region, meta.region_epoch, meta.slot, meta.generation, header).ok()
        });
        if rewritten.is_none() {
            return fail(self, ErrorCode::Checksum, parts);
        }
        let Some(tier) = self.l3.as_mut() else { return };
        let put = L3Request::Put {
            key: meta.key,
            namespace: meta.namespace,
            source: bytes.as_ptr(),
            len: STORED_HEADER_BYTES as u64 + meta.payload_len,
        };
        // SAFETY: the staging slot is this op's (Busy, unreported) until
        // the put's completion frees it.
        if unsafe { tier.client.submit(u64::from(index), put) }.is_err() {
            fail(self, ErrorCode::QueueFull, parts);
        }
    }

    /// The L3 region as a target (any slot).
    fn l3_target(&self) -> ReplicaWire {
        let region = self.l3.as_ref().map_or(0, L3Tier::region);
        ReplicaWire {
            tier: Tier::L3Object as u8,
            reserved: 0,
            region,
            node: self.node,
            region_epoch: self.epoch,
            slot: SLOT_ANY,
            generation: 0,
        }
    }

    /// Frees the source of a move that is stored in L3, and reports it.
    fn free_source<B: IoBackend>(&mut self, source: &ReplicaWire, key: &BlockKey, parts: &mut Parts<'_, B>) {
        let reason = EvictReason::Demoted as u8;
        if source.tier == Tier::L1Dram as u8 {
            let slot = source.slot;
            if parts.table.arena().generation(slot) != Some(source.generation) {
                return;
            }
            self.release_l1(slot, parts.table);
        } else {
            let Some(slot) = self.l2_slot_of(source) else { return };
            if self.l2_object(slot, source.generation).is_none() || parts.l2.release(slot).is_err() {
                return;
            }
            self.l2_released(slot);
        }
        self.stats.evictions += 1;
        if let Some(cp) = parts.link.as_mut() {
            cp.evicted(&BlockEvicted { replica: *source, key: *key, reason, reserved: [0; 7] });
        }
    }

    fn l3_done<B: IoBackend>(
        &mut self,
        request: u64,
        result: Result<(ReplicaWire, u64), ErrorCode>,
        parts: &mut Parts<'_, B>,
    ) {
        let (status, target, bytes) = match result {
            Ok((target, bytes)) => (0, target, bytes),
            Err(code) => {
                self.stats.commands_failed += 1;
                (code as u32, self.l3_target(), 0)
            }
        };
        if let Some(cp) = parts.link.as_mut() {
            cp.transfer_done(request, &TransferDone { status, reserved: 0, target, bytes });
        }
    }

    /// Starts reading the L3 object `source` names (block `key`) into a
    /// new L1 slot, for an agent's load or a control-plane copy. A source
    /// of slot [`SLOT_ANY`] names the object by its name in the store
    /// alone — (namespace, key), the namespace in `region_epoch` — for a
    /// block another node sharing the store wrote (a control-plane copy
    /// only): read by its catalog entry if this node knows it, else by
    /// name ([`Pool::read_named_l3`]).
    pub(super) fn promote_l3<B: IoBackend>(
        &mut self,
        to: Requester,
        key: BlockKey,
        source: &ReplicaWire,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        let (node, epoch) = (self.node, self.epoch);
        let Some(tier) = self.l3.as_ref() else { return Err(AgentError::Stale) };
        if source.region != tier.region || source.node != node {
            return Err(AgentError::Stale);
        }
        if source.slot == SLOT_ANY {
            // The control plane's alone: an agent loads what the mirror
            // names.
            return match to {
                Requester::Cp { .. } => self.read_named_l3(to, key, source.region_epoch, parts),
                Requester::Agent { .. } => Err(AgentError::Stale),
            };
        }
        if source.region_epoch != epoch {
            return Err(AgentError::Stale);
        }
        let meta = *tier.object(source.slot, source.generation).ok_or(AgentError::Stale)?;
        if meta.key != key {
            return Err(AgentError::Stale);
        }
        let read = Read::Entry { entry: source.slot, generation: source.generation };
        self.read_l3(to, key, meta.namespace.0, object_bytes(meta.payload_len), read, parts)
    }

    /// Starts reading the object the store names (`namespace`, `key`)
    /// into a new L1 slot: another node sharing the store wrote it, and
    /// the catalog holds it once it is read and checked. Its slot has room
    /// for the largest object of the namespace met here, or else for the
    /// largest this node's L1 holds; one larger is refused by the read
    /// (it never lands).
    fn read_named_l3<B: IoBackend>(
        &mut self,
        to: Requester,
        key: BlockKey,
        namespace: u64,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        let (node, epoch) = (self.node, self.epoch);
        let Some(tier) = self.l3.as_ref() else { return Err(AgentError::Stale) };
        if let Some(&entry) = tier.by_key.get(&(namespace, key)) {
            let generation = tier.catalog[entry as usize].map_or(0, |m| m.generation);
            return self.promote_l3(to, key, &tier.replica(node, epoch, entry, generation), parts);
        }
        if tier.deleting(namespace, &key) || tier.busy_with(namespace, &key) {
            return Err(AgentError::Stale);
        }
        let bytes = match tier.payload_max.get(&namespace) {
            Some(&payload) => object_bytes(payload),
            None => {
                let partition = self.partition_for(to, namespace)?;
                parts.table.slot_bytes_max(partition).ok_or(AgentError::Invalid)?
            }
        };
        self.read_l3(to, key, namespace, bytes, Read::Named { namespace, key }, parts)
    }

    /// Starts the store's read of (`namespace`, `key`) into a new L1 slot
    /// with room for `bytes`.
    fn read_l3<B: IoBackend>(
        &mut self,
        to: Requester,
        key: BlockKey,
        namespace: u64,
        bytes: u64,
        read: Read,
        parts: &mut Parts<'_, B>,
    ) -> Result<(), AgentError> {
        if self.l3.as_ref().is_none_or(|tier| tier.free_ops.is_empty()) {
            return Err(AgentError::Busy);
        }
        let partition = self.partition_for(to, namespace)?;
        let grant = self.slot_or_victim(partition, bytes, 0, parts).ok_or(AgentError::NoSpace)?;
        let table = &mut *parts.table;
        let Some(tier) = self.l3.as_mut() else {
            let _ = table.retire(grant.slot);
            return Err(AgentError::Stale);
        };
        let (Some(target), Some(capacity)) = (parts.region.slot_ptr(grant.slot), parts.region.slot_len(grant.slot))
        else {
            let _ = table.retire(grant.slot);
            return Err(AgentError::Invalid);
        };
        let op = Op::Get { to, read, l1_slot: grant.slot, l1_generation: grant.generation };
        let Some(index) = tier.take_op(op) else {
            let _ = table.retire(grant.slot);
            return Err(AgentError::Busy);
        };
        let get = L3Request::Get { key, namespace: NamespaceId(namespace), target, capacity: capacity as u64 };
        // SAFETY: the slot was just allocated and stays Busy (unreported,
        // unpinnable) until the completion is taken.
        if unsafe { tier.client.submit(u64::from(index), get) }.is_err() {
            tier.put_op(index);
            let _ = table.retire(grant.slot);
            return Err(AgentError::Busy);
        }
        self.l1[grant.slot as usize] = L1State::Busy;
        Ok(())
    }

    /// Evicts an L3 replica: the catalog entry goes now, the object with
    /// the next batch of deletes.
    pub(super) fn evict_l3(&mut self, replica: &ReplicaWire, key: &BlockKey) -> Result<(), ErrorCode> {
        let Some(tier) = self.l3.as_mut() else { return Err(ErrorCode::NoSuchBlock) };
        if replica.region != tier.region {
            return Err(ErrorCode::NoSuchBlock);
        }
        let meta = *tier.object(replica.slot, replica.generation).ok_or(ErrorCode::StaleGeneration)?;
        if meta.key != *key {
            return Err(ErrorCode::StaleGeneration);
        }
        if tier.pending_deletes.len() >= DELETE_BATCH_MAX && !tier.flush_deletes() {
            return Err(ErrorCode::QueueFull);
        }
        tier.pending_deletes.push((meta.namespace, meta.key));
        tier.forget(replica.slot);
        Ok(())
    }

    /// Takes the L3 tier's completions and finishes their operations.
    /// Returns how many.
    pub(crate) fn poll_l3<B: IoBackend>(&mut self, parts: &mut Parts<'_, B>) -> u32 {
        let Some(tier) = self.l3.as_mut() else { return 0 };
        tier.flush_deletes();
        let mut completions = core::mem::take(&mut tier.completions);
        let max = completions.capacity().max(1);
        tier.client.poll(&mut completions, max);
        let taken = completions.len();
        for completion in completions.drain(..) {
            self.l3_completed(&completion, parts);
        }
        if let Some(tier) = self.l3.as_mut() {
            tier.completions = completions;
        }
        u32::try_from(taken).unwrap_or(u32::MAX)
    }

    fn l3_completed<B: IoBackend>(&mut self, completion: &L3Completion, parts: &mut Parts<'_, B>) {
        let (node, epoch) = (self.node, self.epoch);
        let Some(tier) = self.l3.as_mut() else { return };
        let Some(index) = u32::try_from(completion.id).ok() else { return };
        let Some(op) = tier.put_op(index) else { return };
        tier.timed(index, &op);
        match op {
            Op::Put { request, entry, meta, source, evict } => {
                let source_wire = match source {
                    Source::L1 { slot, generation } => {
                        // The hold on the slot ends.
                        match self.l1.get(slot as usize).copied() {
                            Some(L1State::Sending { readers }) if readers > 1 => {
                                self.l1[slot as usize] = L1State::Sending { readers: readers - 1 };
                            }
                            Some(L1State::Sending { .. } | L1State::Busy) => self.l1[slot as usize] = L1State::Ready,
                            _ => {}
                        }
                        self.l1_replica(slot, generation)
                    }
                    Source::L2 { slot, generation, stage, .. } => {
                        self.release_l1(stage, parts.table);
                        crate::runner::l2_replica(&self.geometry, node, epoch, slot, generation)
                    }
                };
                let Some(tier) = self.l3.as_mut() else { return };
                match &completion.result {
                    Ok(bytes) => {
                        tier.stats.writes += 1;
                        tier.stats.bytes_written += bytes;
                        tier.hold(entry, meta);
                        let replica = tier.replica(node, epoch, entry, meta.generation);
                        if let Some(cp) = parts.link.as_mut() {
                            cp.committed(&crate::runner::block_record(replica, &meta, Durability::Durable));
                        }
                        if evict {
                            self.free_source(&source_wire, &meta.key, parts);
                        }
                        self.l3_done(request, Ok((replica, *bytes)), parts);
                    }
                    Err(error) => {
                        tier.stats.failed += 1;
                        tier.free.push(entry);
                        let code = match error {
                            L3Error::Corrupt(_) => ErrorCode::Checksum,
                            L3Error::TooLarge(_) => ErrorCode::BadFrame,
                            L3Error::NotFound | L3Error::Store(_) => ErrorCode::Io,
                            L3Error::Cancelled => ErrorCode::Cancelled,
                        };
                        self.l3_done(request, Err(code), parts);
                    }
                }
            }
            Op::Get { to, read, l1_slot, l1_generation } => {
                let named = matches!(read, Read::Named { .. });
                let result = match &completion.result {
                    Ok(bytes) => {
                        tier.stats.reads += 1;
                        tier.stats.bytes_read += bytes;
                        let link = &mut *parts.link;
                        let stored = self.promoted(l1_slot, l1_generation, parts.region, link);
                        if let (true, Ok(stored)) = (named, &stored) {
                            // Read by name and checked: the catalog holds
                            // it from now on, as a scan would have found it.
                            self.l3_adopt(stored, parts.link);
                        }
                        stored.map(|_| *bytes)
                    }
                    Err(L3Error::Store(_)) => {
                        tier.stats.failed += 1;
                        Err(AgentError::Io)
                    }
                    // Its reader went: nothing was read, the object stays.
                    Err(L3Error::Cancelled) => {
                        tier.stats.cancelled += 1;
                        Err(AgentError::Cancelled)
                    }
                    // Not in the store (it shares none with the writer, or
                    // the object went), or past the room made for it.
                    Err(L3Error::NotFound | L3Error::TooLarge(_)) if named => Err(AgentError::Stale),
                    Err(_) => Err(AgentError::Corrupt),
                };
                let result = match (result, read) {
                    (Err(AgentError::Corrupt), Read::Entry { entry, generation }) => {
                        let Some(tier) = self.l3.as_mut() else { return };
                        // Gone from the store, or not what it should be: it
                        // leaves the catalog (reported), the reader
                        // recomputes.
                        tier.stats.failed += 1;
                        tier.stats.lost += 1;
                        // Only the object read: one evicted meanwhile is
                        // out already, and its entry may name another.
                        let lost =
                            tier.catalog.get(entry as usize).copied().flatten().filter(|m| m.generation == generation);
                        if let Some(meta) = lost {
                            let replica = tier.replica(node, epoch, entry, meta.generation);
                            tier.forget(entry);
                            self.stats.evictions += 1;
                            if let Some(cp) = parts.link.as_mut() {
                                let reason = EvictReason::Corrupt as u8;
                                cp.evicted(&BlockEvicted { replica, key: meta.key, reason, reserved: [0; 7] });
                            }
                        }
                        Err(AgentError::Corrupt)
                    }
                    (Err(AgentError::Corrupt), Read::Named { .. }) => {
                        // Damaged in the store: never served, left alone
                        // (the catalog never held it).
                        if let Some(tier) = self.l3.as_mut() {
                            tier.stats.failed += 1;
                        }
                        Err(AgentError::Corrupt)
                    }
                    (other, _) => other,
                };
                self.promotion_ended(to, l1_slot, l1_generation, result, parts);
            }
            Op::DeleteMany { buffer } => {
                match completion.result {
                    Ok(count) => {
                        tier.stats.deletes += count;
                        tier.stats.delete_batches += 1;
                    }
                    // The objects stay in the store (out of the catalog):
                    // a scan at the next start finds them again.
                    Err(_) => tier.stats.failed += 1,
                }
                tier.delete_buffers[buffer as usize].clear();
                tier.free_buffers.push(buffer);
            }
        }
    }
}
