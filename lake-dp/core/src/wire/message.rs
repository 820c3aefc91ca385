//! The v1 message set: one fixed `#[repr(C)]` record per kind, some followed
//! by a counted list of fixed records.
//!
//! Every record is plain old data with explicit reserved fields (so there is
//! no hidden padding), and every record has a `validate` that both the
//! encoder and the decoder run: invalid frames are neither accepted nor sent.

use core::fmt;
use core::marker::PhantomData;
use core::mem::size_of;

use bytemuck::{Pod, Zeroable};

use super::WireError;
use crate::constants::LOOKUP_KEYS_MAX;
use crate::model::key::BlockKey;
use crate::model::replica::{Durability, ObjectKind, Priority, ReplicaWire, Tier};

mod stats;
mod summary;

pub use stats::*;
pub use summary::*;

/// A fixed record that can check its own fields.
pub trait Record: Pod {
    /// Checks every field's domain and that reserved fields are zero.
    fn validate(&self) -> Result<(), WireError>;
}

/// A fixed record followed by a counted list.
pub trait ListHead: Record {
    /// Most records the list may hold.
    const RECORDS_MAX: usize;
    /// The count the head announces.
    fn count(&self) -> u32;
}

/// A borrowed list of fixed records inside a frame. Records are read by
/// copy, so the frame buffer needs no alignment.
#[derive(Clone, Copy)]
pub struct Records<'a, T> {
    bytes: &'a [u8],
    _record: PhantomData<T>,
}

impl<'a, T: Pod> Records<'a, T> {
    /// A list backed by a slice of records (for encoding).
    pub fn from_slice(records: &'a [T]) -> Self {
        Self { bytes: bytemuck::cast_slice(records), _record: PhantomData }
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.bytes.len() / size_of::<T>()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Record `index`, if present.
    pub fn get(&self, index: usize) -> Option<T> {
        let start = index.checked_mul(size_of::<T>())?;
        let bytes = self.bytes.get(start..start.checked_add(size_of::<T>())?)?;
        Some(bytemuck::pod_read_unaligned(bytes))
    }

    /// The records in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = T> + 'a {
        self.bytes.chunks_exact(size_of::<T>()).map(bytemuck::pod_read_unaligned)
    }

    fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

impl<T> PartialEq for Records<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl<T: Pod> fmt::Debug for Records<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Records(len={})", self.len())
    }
}

pub(super) fn field_err(field: &'static str, value: impl Into<u64>) -> WireError {
    WireError::Field { field, value: value.into() }
}

pub(super) fn reserved_zero(field: &'static str, bytes: &[u8]) -> Result<(), WireError> {
    if bytes.iter().all(|&b| b == 0) { Ok(()) } else { Err(WireError::Reserved(field)) }
}

pub(super) fn check_replica(field: &'static str, replica: &ReplicaWire) -> Result<(), WireError> {
    if Tier::from_u8(replica.tier).is_none() {
        return Err(field_err(field, replica.tier));
    }
    reserved_zero(field, &[replica.reserved])
}

/// Fixed-size text fields are UTF-8, NUL-padded, with nothing after the
/// first NUL (so each string has one encoding).
pub(super) fn check_text(field: &'static str, bytes: &[u8]) -> Result<(), WireError> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    if core::str::from_utf8(&bytes[..end]).is_err() {
        return Err(field_err(field, 0u8));
    }
    reserved_zero(field, &bytes[end..])
}

pub(super) fn text(bytes: &[u8]) -> &str {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    // Validated on decode; a record built by hand with bad UTF-8 reads as
    // the valid prefix.
    match core::str::from_utf8(&bytes[..end]) {
        Ok(text) => text,
        Err(e) => core::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default(),
    }
}

/// Encodes `text` into a fixed NUL-padded field; too long is an error.
pub fn text_field<const N: usize>(field: &'static str, text: &str) -> Result<[u8; N], WireError> {
    let bytes = text.as_bytes();
    if bytes.len() > N || bytes.contains(&0) {
        return Err(field_err(field, bytes.len() as u64));
    }
    let mut out = [0u8; N];
    out[..bytes.len()].copy_from_slice(bytes);
    Ok(out)
}

/// Which process speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// `lake-cp`.
    ControlPlane = 1,
    /// `lake-dp`.
    DataPlane = 2,
    /// An engine's in-process agent.
    Agent = 3,
}

impl Role {
    /// Decodes a role code.
    pub fn from_u8(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::ControlPlane),
            2 => Some(Self::DataPlane),
            3 => Some(Self::Agent),
            _ => None,
        }
    }
}

/// Error codes carried by [`ErrorBody`] and [`TransferDone`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    /// A malformed frame.
    BadFrame = 1,
    /// No common wire version.
    VersionMismatch = 2,
    /// The command's leader term is older than one already seen.
    StaleTerm = 3,
    /// The referenced region epoch is gone.
    StaleEpoch = 4,
    /// The referenced slot generation is gone.
    StaleGeneration = 5,
    /// No such block.
    NoSuchBlock = 6,
    /// No free slot or capacity.
    NoSpace = 7,
    /// A queue was full; retry later.
    QueueFull = 8,
    /// Cancelled by the requester.
    Cancelled = 9,
    /// The deadline passed.
    DeadlineExceeded = 10,
    /// An I/O error.
    Io = 11,
    /// A checksum did not match.
    Checksum = 12,
    /// Not permitted.
    Unauthorized = 13,
    /// A bug: the receiver's invariant failed.
    Internal = 14,
}

impl ErrorCode {
    /// Decodes an error code.
    pub fn from_u32(code: u32) -> Option<Self> {
        Some(match code {
            1 => Self::BadFrame,
            2 => Self::VersionMismatch,
            3 => Self::StaleTerm,
            4 => Self::StaleEpoch,
            5 => Self::StaleGeneration,
            6 => Self::NoSuchBlock,
            7 => Self::NoSpace,
            8 => Self::QueueFull,
            9 => Self::Cancelled,
            10 => Self::DeadlineExceeded,
            11 => Self::Io,
            12 => Self::Checksum,
            13 => Self::Unauthorized,
            14 => Self::Internal,
            _ => return None,
        })
    }

    /// Every code, in code order.
    pub const ALL: [Self; 14] = [
        Self::BadFrame,
        Self::VersionMismatch,
        Self::StaleTerm,
        Self::StaleEpoch,
        Self::StaleGeneration,
        Self::NoSuchBlock,
        Self::NoSpace,
        Self::QueueFull,
        Self::Cancelled,
        Self::DeadlineExceeded,
        Self::Io,
        Self::Checksum,
        Self::Unauthorized,
        Self::Internal,
    ];

    /// Its name in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::BadFrame => "bad_frame",
            Self::VersionMismatch => "version_mismatch",
            Self::StaleTerm => "stale_term",
            Self::StaleEpoch => "stale_epoch",
            Self::StaleGeneration => "stale_generation",
            Self::NoSuchBlock => "no_such_block",
            Self::NoSpace => "no_space",
            Self::QueueFull => "queue_full",
            Self::Cancelled => "cancelled",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Io => "io",
            Self::Checksum => "checksum",
            Self::Unauthorized => "unauthorized",
            Self::Internal => "internal",
        }
    }
}

/// Why a replica went away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum EvictReason {
    /// The tier's byte capacity.
    Capacity = 1,
    /// The tenant's quota.
    Quota = 2,
    /// Moved down a tier (a copy exists below).
    Demoted = 3,
    /// Failed a checksum.
    Corrupt = 4,
    /// Released by its owner.
    Released = 5,
    /// Moved to another slot of the same region (an L1 chunk emptied for
    /// another size class); the block's new replica is reported next. Sent
    /// only to a control plane that offered [`crate::wire::FEATURE_L1_MOVES`].
    Moved = 6,
}

impl EvictReason {
    /// Decodes a reason code.
    pub fn from_u8(code: u8) -> Option<Self> {
        Some(match code {
            1 => Self::Capacity,
            2 => Self::Quota,
            3 => Self::Demoted,
            4 => Self::Corrupt,
            5 => Self::Released,
            6 => Self::Moved,
            _ => return None,
        })
    }
}

/// What a delta entry does to the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum DeltaOp {
    /// A replica appeared.
    Add = 1,
    /// A replica went away.
    Remove = 2,
    /// A replica's durability changed.
    Update = 3,
}

impl DeltaOp {
    /// Decodes an op code.
    pub fn from_u8(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::Add),
            2 => Some(Self::Remove),
            3 => Some(Self::Update),
            _ => None,
        }
    }
}

/// Opens a connection: who speaks, and which versions it can use. Frozen
/// across wire versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Hello {
    /// [`Role`] code.
    pub role: u8,
    /// Zero.
    pub reserved_a: [u8; 3],
    /// Oldest version the sender speaks.
    pub version_min: u16,
    /// Newest version the sender speaks.
    pub version_max: u16,
    /// The sender's node.
    pub node: u32,
    /// The sender's process id.
    pub pid: u32,
    /// The sender's region epoch (`lake-dp`), else 0.
    pub region_epoch: u64,
    /// Feature bits the sender offers.
    pub features: u64,
    /// Largest frame the sender accepts.
    pub frame_bytes_max: u32,
    /// Zero.
    pub reserved_b: u32,
    /// A human name (UTF-8, NUL-padded).
    pub name: [u8; 32],
}

impl Hello {
    /// The sender's name.
    pub fn name(&self) -> &str {
        text(&self.name)
    }
}

/// Smallest frame limit a peer may announce: room for every fixed body.
pub const PEER_FRAME_BYTES_MIN: u32 = 4096;

impl Record for Hello {
    fn validate(&self) -> Result<(), WireError> {
        Role::from_u8(self.role).ok_or(field_err("hello.role", self.role))?;
        reserved_zero("hello.reserved_a", &self.reserved_a)?;
        reserved_zero("hello.reserved_b", &self.reserved_b.to_le_bytes())?;
        if self.version_min == 0 || self.version_min > self.version_max {
            return Err(field_err("hello.version_min", self.version_min));
        }
        if self.frame_bytes_max < PEER_FRAME_BYTES_MIN {
            return Err(field_err("hello.frame_bytes_max", self.frame_bytes_max));
        }
        check_text("hello.name", &self.name)
    }
}

/// Answers a [`Hello`] with the chosen version. Frozen across wire versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct HelloAck {
    /// The version both sides now use.
    pub version: u16,
    /// [`Role`] code of the answering side.
    pub role: u8,
    /// Zero.
    pub reserved_a: u8,
    /// The answering node.
    pub node: u32,
    /// The answering side's region epoch, else 0.
    pub region_epoch: u64,
    /// Features both sides offer.
    pub features: u64,
    /// Highest leader term the answering side has seen.
    pub leader_term_seen: u64,
    /// Largest frame either side accepts (the smaller of the two).
    pub frame_bytes_max: u32,
    /// Zero.
    pub reserved_b: u32,
}

impl Record for HelloAck {
    fn validate(&self) -> Result<(), WireError> {
        Role::from_u8(self.role).ok_or(field_err("hello_ack.role", self.role))?;
        if self.version == 0 {
            return Err(field_err("hello_ack.version", self.version));
        }
        if self.frame_bytes_max < PEER_FRAME_BYTES_MIN {
            return Err(field_err("hello_ack.frame_bytes_max", self.frame_bytes_max));
        }
        reserved_zero("hello_ack.reserved_a", &[self.reserved_a])?;
        reserved_zero("hello_ack.reserved_b", &self.reserved_b.to_le_bytes())
    }
}

/// A region (arena or slot file set) came into service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RegisterRegion {
    /// Region id on its node.
    pub region: u16,
    /// [`Tier`] code.
    pub tier: u8,
    /// Zero.
    pub reserved_a: u8,
    /// Node.
    pub node: u32,
    /// The region's epoch for this incarnation.
    pub region_epoch: u64,
    /// Bytes per slot (a multiple of 4096).
    pub slot_bytes: u64,
    /// Slots.
    pub slot_count: u32,
    /// Zero.
    pub reserved_b: u32,
    /// Where it lives (shm name or path; UTF-8, NUL-padded).
    pub name: [u8; 48],
}

impl RegisterRegion {
    /// Where the region lives.
    pub fn name(&self) -> &str {
        text(&self.name)
    }
}

impl Record for RegisterRegion {
    fn validate(&self) -> Result<(), WireError> {
        Tier::from_u8(self.tier).ok_or(field_err("register_region.tier", self.tier))?;
        if self.slot_bytes == 0 || !self.slot_bytes.is_multiple_of(4096) {
            return Err(field_err("register_region.slot_bytes", self.slot_bytes));
        }
        if self.slot_count == 0 {
            return Err(field_err("register_region.slot_count", self.slot_count));
        }
        reserved_zero("register_region.reserved_a", &[self.reserved_a])?;
        reserved_zero("register_region.reserved_b", &self.reserved_b.to_le_bytes())?;
        check_text("register_region.name", &self.name)
    }
}

/// [`BlockRecord::flags`]: a re-adopted block whose payload CRCs were
/// checked during re-adoption.
pub const BLOCK_FLAG_VERIFIED: u8 = 1;

/// A replica of a block exists: committed now, or re-adopted from disk after a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockRecord {
    /// Where.
    pub replica: ReplicaWire,
    /// The block's key.
    pub key: BlockKey,
    /// The previous block's key ([`BlockKey::NONE`] for the first).
    pub parent_key: BlockKey,
    /// Namespace id.
    pub namespace: u64,
    /// Layout fingerprint of the payload.
    pub layout_fingerprint: u64,
    /// Payload bytes.
    pub payload_len: u64,
    /// Position in its prefix (0-based).
    pub block_index: u32,
    /// [`ObjectKind`] code.
    pub kind: u16,
    /// [`Durability`] code.
    pub durability: u8,
    /// [`BLOCK_FLAG_VERIFIED`].
    pub flags: u8,
}

impl Record for BlockRecord {
    fn validate(&self) -> Result<(), WireError> {
        check_replica("block.replica", &self.replica)?;
        ObjectKind::from_u16(self.kind).ok_or(field_err("block.kind", self.kind))?;
        Durability::from_u8(self.durability).ok_or(field_err("block.durability", self.durability))?;
        if self.flags & !BLOCK_FLAG_VERIFIED != 0 {
            return Err(field_err("block.flags", self.flags));
        }
        if self.payload_len == 0 {
            return Err(field_err("block.payload_len", 0u8));
        }
        Ok(())
    }
}

/// A replica went away (`BlockEvicted`, from `lake-dp`), or is to go
/// (`EvictBlock`, from `lake-cp`: the data plane frees the slot and reports
/// `BlockEvicted`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct BlockEvicted {
    /// The replica (with the generation it had).
    pub replica: ReplicaWire,
    /// The block's key.
    pub key: BlockKey,
    /// [`EvictReason`] code.
    pub reason: u8,
    /// Zero.
    pub reserved: [u8; 7],
}

impl Record for BlockEvicted {
    fn validate(&self) -> Result<(), WireError> {
        check_replica("evicted.replica", &self.replica)?;
        EvictReason::from_u8(self.reason).ok_or(field_err("evicted.reason", self.reason))?;
        reserved_zero("evicted.reserved", &self.reserved)
    }
}

/// A request's keys as an agent looked them up, and how many of them were
/// a hit: the access stream the control plane's eviction policies learn
/// from. Agents read the mirror without a round trip; they send these
/// afterwards, batched and off the request's path, and a lost one costs
/// only some precision of eviction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Accessed {
    /// Namespace id.
    pub namespace: u64,
    /// The leading keys that were a hit (at most `count`).
    pub hit_blocks: u32,
    /// Keys that follow, in prefix order.
    pub count: u32,
}

impl Record for Accessed {
    fn validate(&self) -> Result<(), WireError> {
        if self.hit_blocks > self.count {
            return Err(field_err("accessed.hit_blocks", self.hit_blocks));
        }
        Ok(())
    }
}

impl ListHead for Accessed {
    const RECORDS_MAX: usize = LOOKUP_KEYS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// Blocks an engine holds in its own GPU memory (HBM, L0), or no longer
/// does: advisory replicas the control plane records for routing a request
/// to the engine that already has its prefix. Never leased, placed or
/// evicted by Lake (the engine owns that memory); they go when the agent
/// reports them gone or disconnects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Resident {
    /// Namespace id.
    pub namespace: u64,
    /// 1: the keys that follow are now resident; 0: they are gone.
    pub resident: u32,
    /// Keys that follow.
    pub count: u32,
}

impl Record for Resident {
    fn validate(&self) -> Result<(), WireError> {
        if self.resident > 1 {
            return Err(field_err("resident.resident", self.resident));
        }
        Ok(())
    }
}

impl ListHead for Resident {
    const RECORDS_MAX: usize = LOOKUP_KEYS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// [`Transfer::target`]'s slot when the target's owner picks the slot.
pub const SLOT_ANY: u32 = u32::MAX;

/// Move or copy one block between replicas (tiers or nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Transfer {
    /// The replica read.
    pub source: ReplicaWire,
    /// The replica written ([`SLOT_ANY`] to let its owner pick).
    pub target: ReplicaWire,
    /// The block's key.
    pub key: BlockKey,
    /// Give up after this wall-clock time (0 = no deadline).
    pub deadline_unix_ns: u64,
    /// [`Priority`] code.
    pub priority: u8,
    /// Zero.
    pub reserved: [u8; 7],
}

impl Record for Transfer {
    fn validate(&self) -> Result<(), WireError> {
        check_replica("transfer.source", &self.source)?;
        check_replica("transfer.target", &self.target)?;
        Priority::from_u8(self.priority).ok_or(field_err("transfer.priority", self.priority))?;
        reserved_zero("transfer.reserved", &self.reserved)
    }
}

/// A transfer finished (`status` 0) or failed (an [`ErrorCode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct TransferDone {
    /// 0 or an [`ErrorCode`].
    pub status: u32,
    /// Zero.
    pub reserved: u32,
    /// The replica written.
    pub target: ReplicaWire,
    /// Bytes moved.
    pub bytes: u64,
}

impl Record for TransferDone {
    fn validate(&self) -> Result<(), WireError> {
        if self.status != 0 && ErrorCode::from_u32(self.status).is_none() {
            return Err(field_err("transfer_done.status", self.status));
        }
        reserved_zero("transfer_done.reserved", &self.reserved.to_le_bytes())?;
        check_replica("transfer_done.target", &self.target)
    }
}

/// Cancel the request with this id (an aborted or preempted request).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Cancel {
    /// The request to cancel.
    pub request_id: u64,
}

impl Record for Cancel {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

/// Ask for leases on blocks, to read them from a remote or lower tier.
/// Idempotent per request id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LeaseRequest {
    /// Namespace id.
    pub namespace: u64,
    /// Lease length asked for.
    pub ttl_ms: u32,
    /// Keys that follow.
    pub count: u32,
}

impl Record for LeaseRequest {
    fn validate(&self) -> Result<(), WireError> {
        if self.ttl_ms == 0 {
            return Err(field_err("lease_request.ttl_ms", 0u8));
        }
        Ok(())
    }
}

impl ListHead for LeaseRequest {
    const RECORDS_MAX: usize = LOOKUP_KEYS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// Leases granted: until the deadline the listed replicas are not freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LeaseGrant {
    /// The lease.
    pub lease_id: u64,
    /// Wall-clock expiry.
    pub deadline_unix_ns: u64,
    /// Entries that follow.
    pub count: u32,
    /// Zero.
    pub reserved: u32,
}

impl Record for LeaseGrant {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("lease_grant.reserved", &self.reserved.to_le_bytes())
    }
}

impl ListHead for LeaseGrant {
    const RECORDS_MAX: usize = LOOKUP_KEYS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// One leased replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LeaseEntry {
    /// The block.
    pub key: BlockKey,
    /// The replica held for the reader.
    pub replica: ReplicaWire,
}

impl Record for LeaseEntry {
    fn validate(&self) -> Result<(), WireError> {
        check_replica("lease_entry.replica", &self.replica)
    }
}

/// Give a lease back before its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LeaseRelease {
    /// The lease.
    pub lease_id: u64,
}

impl Record for LeaseRelease {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

/// Drain an L2 region (one file of the tier, on its own device) or stop
/// draining it, cp→dp: while draining, the data plane writes nothing new
/// there (demotions and relocations take its other files) and the control
/// plane moves what it holds elsewhere (`MoveBlock` L2→L2). Answered with
/// `TransferDone` (its target the region, any slot). Sent only to a data
/// plane whose hello offered [`super::FEATURE_DRAIN`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DrainRegion {
    /// The region (an L2 file of the data plane's).
    pub region: u16,
    /// 1: drain it; 0: use it again.
    pub draining: u8,
    /// Zero.
    pub reserved: [u8; 5],
}

impl Record for DrainRegion {
    fn validate(&self) -> Result<(), WireError> {
        if self.draining > 1 {
            return Err(field_err("drain_region.draining", self.draining));
        }
        reserved_zero("drain_region.reserved", &self.reserved)
    }
}

/// Whether the control plane may still mark victims in an L1 region (or
/// free its slots): sent when that changes, to a data plane whose hello
/// offered [`super::FEATURE_VICTIMS_LEFT`]. With none left (every block
/// there new, held, or on its way nowhere) a save that finds no free slot
/// and no marked victim is refused at once instead of waiting for marks
/// that will not come. Not answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct VictimsLeft {
    /// The L1 region.
    pub region: u16,
    /// 1: more may come; 0: none will until something changes (a mark
    /// says it has).
    pub left: u8,
    /// Zero.
    pub reserved: [u8; 5],
}

impl Record for VictimsLeft {
    fn validate(&self) -> Result<(), WireError> {
        if self.left > 1 {
            return Err(field_err("victims_left.left", self.left));
        }
        reserved_zero("victims_left.reserved", &self.reserved)
    }
}

/// [`PinDrop::pin_index`] meaning every pin of the agent.
pub const PIN_INDEX_ALL: u32 = u32::MAX;

/// Drop an agent's pin (or all of them, when its attach socket closed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PinDrop {
    /// The agent.
    pub agent: u32,
    /// Index in its pin array, or [`PIN_INDEX_ALL`].
    pub pin_index: u32,
    /// Slot pinned.
    pub slot: u32,
    /// Generation pinned.
    pub generation: u32,
    /// Region of the slot.
    pub region: u16,
    /// Zero.
    pub reserved: [u8; 6],
}

impl Record for PinDrop {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("pin_drop.reserved", &self.reserved)
    }
}

/// `lake-dp`'s answer to an agent attaching (after `HelloAck`): its port
/// in the port file. It carries the descriptors (`SCM_RIGHTS`): the L1
/// arena, the port file, the wake-up eventfd, then as the features say
/// ([`crate::wire::FEATURE_OWN_FDS`], [`crate::wire::FEATURE_PARTITIONS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Attached {
    /// The agent's port.
    pub port: u32,
    /// Entries per ring.
    pub depth: u32,
    /// The data plane's region epoch.
    pub epoch: u64,
    /// The L1 arena's region.
    pub arena_region: u16,
    /// Partitioned arena (feature bit 16): the partition it maps, plus 1.
    pub partition: u8,
    /// Zero.
    pub reserved: [u8; 5],
}

impl Record for Attached {
    fn validate(&self) -> Result<(), WireError> {
        if self.depth == 0 || !self.depth.is_power_of_two() {
            return Err(field_err("attached.depth", self.depth));
        }
        reserved_zero("attached.reserved", &self.reserved)
    }
}

/// Which of these keys exist, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Lookup {
    /// Namespace id.
    pub namespace: u64,
    /// Keys that follow (a prefix, in order).
    pub count: u32,
    /// Zero in v1.
    pub flags: u32,
}

impl Record for Lookup {
    fn validate(&self) -> Result<(), WireError> {
        if self.flags != 0 {
            return Err(field_err("lookup.flags", self.flags));
        }
        Ok(())
    }
}

impl ListHead for Lookup {
    const RECORDS_MAX: usize = LOOKUP_KEYS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// The answer to a [`Lookup`]: the length of the hit run and the replicas of its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LookupReply {
    /// Entries that follow.
    pub count: u32,
    /// Leading keys of the request that hit.
    pub hit_blocks: u32,
}

impl Record for LookupReply {
    fn validate(&self) -> Result<(), WireError> {
        if self.hit_blocks as usize > LOOKUP_KEYS_MAX {
            return Err(field_err("lookup_reply.hit_blocks", self.hit_blocks));
        }
        Ok(())
    }
}

impl ListHead for LookupReply {
    const RECORDS_MAX: usize = LOOKUP_KEYS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// One replica of a hit block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LookupEntry {
    /// The block.
    pub key: BlockKey,
    /// One of its replicas.
    pub replica: ReplicaWire,
    /// The replica's layout fingerprint (its shard).
    pub layout_fingerprint: u64,
}

impl Record for LookupEntry {
    fn validate(&self) -> Result<(), WireError> {
        check_replica("lookup_entry.replica", &self.replica)
    }
}

impl Record for BlockKey {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

/// A request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ErrorBody {
    /// [`ErrorCode`].
    pub code: u32,
    /// Zero.
    pub reserved: u32,
    /// The request that failed (also in the header when replying).
    pub failed_request: u64,
    /// A short human explanation (UTF-8, NUL-padded).
    pub detail: [u8; 48],
}

impl ErrorBody {
    /// The explanation.
    pub fn detail(&self) -> &str {
        text(&self.detail)
    }
}

impl Record for ErrorBody {
    fn validate(&self) -> Result<(), WireError> {
        ErrorCode::from_u32(self.code).ok_or(field_err("error.code", self.code))?;
        reserved_zero("error.reserved", &self.reserved.to_le_bytes())?;
        check_text("error.detail", &self.detail)
    }
}

fn encode_fixed<T: Record>(kind: MessageKind, body: &T, out: &mut [u8]) -> Result<(), WireError> {
    body.validate()?;
    let actual = out.len();
    let out = out.get_mut(..size_of::<T>()).ok_or(WireError::BodyLength { kind, actual })?;
    out.copy_from_slice(bytemuck::bytes_of(body));
    Ok(())
}

fn decode_fixed<T: Record>(kind: MessageKind, body: &[u8]) -> Result<T, WireError> {
    if body.len() != size_of::<T>() {
        return Err(WireError::BodyLength { kind, actual: body.len() });
    }
    let record: T = bytemuck::pod_read_unaligned(body);
    record.validate()?;
    Ok(record)
}

fn check_list<H: ListHead, R: Record>(kind: MessageKind, head: &H, records: &Records<'_, R>) -> Result<(), WireError> {
    head.validate()?;
    if head.count() as usize != records.len() || records.len() > H::RECORDS_MAX {
        return Err(WireError::Count { kind, count: head.count() });
    }
    records.iter().try_for_each(|record| record.validate())
}

fn encode_listed<H: ListHead, R: Record>(
    kind: MessageKind,
    head: &H,
    records: &Records<'_, R>,
    out: &mut [u8],
) -> Result<(), WireError> {
    check_list(kind, head, records)?;
    let (head_out, rest) = out.split_at_mut(size_of::<H>().min(out.len()));
    if head_out.len() != size_of::<H>() || rest.len() != records.as_bytes().len() {
        return Err(WireError::BodyLength { kind, actual: out.len() });
    }
    head_out.copy_from_slice(bytemuck::bytes_of(head));
    rest.copy_from_slice(records.as_bytes());
    Ok(())
}

fn decode_listed<'a, H: ListHead, R: Record>(
    kind: MessageKind,
    body: &'a [u8],
) -> Result<(H, Records<'a, R>), WireError> {
    if body.len() < size_of::<H>() || !(body.len() - size_of::<H>()).is_multiple_of(size_of::<R>()) {
        return Err(WireError::BodyLength { kind, actual: body.len() });
    }
    let (head_bytes, rest) = body.split_at(size_of::<H>());
    let head: H = bytemuck::pod_read_unaligned(head_bytes);
    let records = Records { bytes: rest, _record: PhantomData };
    check_list(kind, &head, &records)?;
    Ok((head, records))
}

macro_rules! messages {
    (
        fixed { $($fixed:ident($fixed_body:ty) = $fixed_code:literal,)* }
        listed { $($listed:ident($head:ty, $record:ty) = $listed_code:literal,)* }
    ) => {
        /// Message kinds, as carried in the frame header.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum MessageKind {
            $(
                #[doc = concat!("Body: [`", stringify!($fixed_body), "`].")]
                $fixed = $fixed_code,
            )*
            $(
                #[doc = concat!("Body: [`", stringify!($head), "`] then [`", stringify!($record), "`]s.")]
                $listed = $listed_code,
            )*
        }

        impl MessageKind {
            /// Every kind, in code order.
            pub const ALL: &'static [Self] = &[$(Self::$fixed,)* $(Self::$listed,)*];

            /// Decodes a kind code.
            pub fn from_u16(code: u16) -> Option<Self> {
                match code {
                    $($fixed_code => Some(Self::$fixed),)*
                    $($listed_code => Some(Self::$listed),)*
                    _ => None,
                }
            }
        }

        /// A decoded (or to-be-encoded) message.
        #[derive(Clone, Copy, Debug, PartialEq)]
        pub enum Message<'a> {
            $(
                #[doc = concat!("See [`", stringify!($fixed_body), "`].")]
                $fixed($fixed_body),
            )*
            $(
                #[doc = concat!("See [`", stringify!($head), "`].")]
                $listed($head, Records<'a, $record>),
            )*
        }

        impl<'a> Message<'a> {
            /// The message's kind.
            pub fn kind(&self) -> MessageKind {
                match self {
                    $(Self::$fixed(_) => MessageKind::$fixed,)*
                    $(Self::$listed(..) => MessageKind::$listed,)*
                }
            }

            /// Bytes of its body once encoded (a frame's header not
            /// counted).
            pub fn body_len(&self) -> usize {
                match self {
                    $(Self::$fixed(_) => size_of::<$fixed_body>(),)*
                    $(Self::$listed(_, records) => size_of::<$head>() + records.as_bytes().len(),)*
                }
            }

            pub(crate) fn encode_body(&self, out: &mut [u8]) -> Result<(), WireError> {
                match self {
                    $(Self::$fixed(body) => encode_fixed(MessageKind::$fixed, body, out),)*
                    $(Self::$listed(head, records) => encode_listed(MessageKind::$listed, head, records, out),)*
                }
            }

            pub(crate) fn decode_body(kind: MessageKind, body: &'a [u8]) -> Result<Self, WireError> {
                match kind {
                    $(MessageKind::$fixed => decode_fixed(kind, body).map(Self::$fixed),)*
                    $(MessageKind::$listed => {
                        decode_listed(kind, body).map(|(head, records)| Self::$listed(head, records))
                    })*
                }
            }
        }
    };
}

messages! {
    fixed {
        Hello(Hello) = 1,
        HelloAck(HelloAck) = 2,
        RegisterRegion(RegisterRegion) = 3,
        BlockCommitted(BlockRecord) = 4,
        BlockReadopted(BlockRecord) = 5,
        BlockEvicted(BlockEvicted) = 6,
        MoveBlock(Transfer) = 7,
        CopyBlock(Transfer) = 8,
        TransferDone(TransferDone) = 9,
        Cancel(Cancel) = 10,
        LeaseRelease(LeaseRelease) = 12,
        PinDrop(PinDrop) = 14,
        Error(ErrorBody) = 18,
        EvictBlock(BlockEvicted) = 19,
        DataPlaneStats(DataPlaneStats) = 21,
        Attached(Attached) = 22,
        SnapshotRequest(SnapshotRequest) = 26,
        DrainRegion(DrainRegion) = 28,
        MarkEvictable(BlockEvicted) = 32,
        UnmarkEvictable(BlockEvicted) = 33,
        SaveRefusals(SaveRefusals) = 34,
        VictimsLeft(VictimsLeft) = 35,
        ConnectionsShed(ConnectionsShed) = 36,
    }
    listed {
        LeaseRequest(LeaseRequest, BlockKey) = 11,
        LeaseGrant(LeaseGrant, LeaseEntry) = 13,
        Lookup(Lookup, BlockKey) = 15,
        LookupReply(LookupReply, LookupEntry) = 16,
        Delta(Delta, DeltaEntry) = 17,
        Accessed(Accessed, BlockKey) = 20,
        Resident(Resident, BlockKey) = 23,
        RailStats(RailStats, RailEntry) = 24,
        Snapshot(Delta, DeltaEntry) = 25,
        PathLatency(PathLatency, PathEntry) = 27,
        TenantThrottles(TenantThrottles, TenantThrottle) = 29,
        PushCaps(PushCaps, PushCap) = 30,
        TenantWaits(TenantThrottles, TenantWait) = 31,
        ViewDelta(Delta, ViewEntry) = 37,
        ViewSnapshot(Delta, ViewEntry) = 38,
        ViewDeltaNamed(Delta, NamedViewEntry) = 39,
        ViewSnapshotNamed(Delta, NamedViewEntry) = 40,
        KeptApart(KeptApart, KeptApartEntry) = 41,
    }
}

const _: () = assert!(size_of::<Hello>() == 72);
const _: () = assert!(size_of::<HelloAck>() == 40);
const _: () = assert!(size_of::<RegisterRegion>() == 80);
const _: () = assert!(size_of::<BlockRecord>() == 88);
const _: () = assert!(size_of::<BlockEvicted>() == 48);
const _: () = assert!(size_of::<Transfer>() == 80);
const _: () = assert!(size_of::<TransferDone>() == 40);
const _: () = assert!(size_of::<LeaseEntry>() == 40);
const _: () = assert!(size_of::<PinDrop>() == 24);
const _: () = assert!(size_of::<Accessed>() == 16);
const _: () = assert!(size_of::<Resident>() == 16);
const _: () = assert!(size_of::<DataPlaneStats>() == 96);
const _: () = assert!(size_of::<SaveRefusals>() == 32);
const _: () = assert!(size_of::<VictimsLeft>() == 8);
const _: () = assert!(size_of::<ConnectionsShed>() == 64);
const _: () = assert!(size_of::<Attached>() == 24);
const _: () = assert!(size_of::<RailStats>() == 8);
const _: () = assert!(size_of::<RailEntry>() == 24);
const _: () = assert!(size_of::<PathLatency>() == 8);
const _: () = assert!(size_of::<TenantThrottles>() == 8);
const _: () = assert!(size_of::<TenantThrottle>() == 72);
const _: () = assert!(size_of::<TenantWait>() == 96);
const _: () = assert!(size_of::<PushCaps>() == 8);
const _: () = assert!(size_of::<PushCap>() == 24);
const _: () = assert!(size_of::<PathEntry>() == 24 + 8 * LATENCY_BUCKETS);
const _: () = assert!(size_of::<LookupEntry>() == 48);
const _: () = assert!(size_of::<DrainRegion>() == 8);
const _: () = assert!(size_of::<ErrorBody>() == 64);
// Every fixed body fits the smallest frame limit a peer may announce.
const _: () = assert!(super::FRAME_HEADER_BYTES + 88 <= PEER_FRAME_BYTES_MIN as usize);
