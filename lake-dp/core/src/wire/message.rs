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
use crate::constants::{DELTA_ENTRIES_MAX, LOOKUP_KEYS_MAX};
use crate::model::key::BlockKey;
use crate::model::replica::{Durability, ObjectKind, Priority, ReplicaWire, Tier};

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

fn field_err(field: &'static str, value: impl Into<u64>) -> WireError {
    WireError::Field { field, value: value.into() }
}

fn reserved_zero(field: &'static str, bytes: &[u8]) -> Result<(), WireError> {
    if bytes.iter().all(|&b| b == 0) { Ok(()) } else { Err(WireError::Reserved(field)) }
}

fn check_replica(field: &'static str, replica: &ReplicaWire) -> Result<(), WireError> {
    if Tier::from_u8(replica.tier).is_none() {
        return Err(field_err(field, replica.tier));
    }
    reserved_zero(field, &[replica.reserved])
}

/// Fixed-size text fields are UTF-8, NUL-padded, with nothing after the
/// first NUL (so each string has one encoding).
fn check_text(field: &'static str, bytes: &[u8]) -> Result<(), WireError> {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    if core::str::from_utf8(&bytes[..end]).is_err() {
        return Err(field_err(field, 0u8));
    }
    reserved_zero(field, &bytes[end..])
}

fn text(bytes: &[u8]) -> &str {
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

/// A replica of a block exists: committed now, or re-adopted from disk
/// after a restart.
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

/// Which network a transport's rails belong to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Network {
    /// The storage network (SNIC): `lake-dp`'s tier traffic and copies.
    Storage = 0,
    /// The compute network (CNIC): an engine agent's P→D and D→P blocks.
    Compute = 1,
}

impl Network {
    /// The network of a wire byte.
    pub fn from_u8(value: u8) -> Option<Self> {
        match value {
            0 => Some(Self::Storage),
            1 => Some(Self::Compute),
            _ => None,
        }
    }

    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::Storage => "storage",
            Self::Compute => "compute",
        }
    }
}

/// The rails of one transport and what each carried: sent about once a
/// second with the stats, one entry per (peer node, rail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RailStats {
    /// Entries that follow.
    pub count: u32,
    /// A [`Network`].
    pub network: u8,
    /// Zero.
    pub reserved: [u8; 3],
}

impl Record for RailStats {
    fn validate(&self) -> Result<(), WireError> {
        if Network::from_u8(self.network).is_none() {
            return Err(field_err("rail_stats.network", self.network));
        }
        reserved_zero("rail_stats.reserved", &self.reserved)
    }
}

impl ListHead for RailStats {
    const RECORDS_MAX: usize = RAILS_REPORTED_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// Rails one [`RailStats`] reports at most.
pub const RAILS_REPORTED_MAX: usize = 4096;

/// Per tenant with bandwidth caps on a node, how often its work waited for
/// them: sent about once a second with the stats, to a control plane that
/// offered [`super::FEATURE_TENANT_THROTTLES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct TenantThrottles {
    /// Entries that follow.
    pub count: u32,
    /// Zero.
    pub reserved: u32,
}

impl Record for TenantThrottles {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("tenant_throttles.reserved", &self.reserved.to_le_bytes())
    }
}

impl ListHead for TenantThrottles {
    const RECORDS_MAX: usize = TENANTS_REPORTED_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// Tenants one [`TenantThrottles`] reports at most.
pub const TENANTS_REPORTED_MAX: usize = 256;

/// The caps on tenants' pushes over the compute network (an engine's P→D
/// and D→P sends), for an agent: sent by the data plane at attach, between
/// `HelloAck` and `Attached`, to an agent that offered
/// [`super::FEATURE_PUSH_CAPS`]; one entry per namespace of a capped
/// tenant (its namespaces share one bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PushCaps {
    /// Entries that follow.
    pub count: u32,
    /// Zero.
    pub reserved: u32,
}

impl Record for PushCaps {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("push_caps.reserved", &self.reserved.to_le_bytes())
    }
}

impl ListHead for PushCaps {
    const RECORDS_MAX: usize = PUSH_CAPS_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// Namespaces one [`PushCaps`] names at most.
pub const PUSH_CAPS_MAX: usize = 1024;

/// One namespace of a tenant whose pushes are capped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PushCap {
    /// The namespace.
    pub namespace: u64,
    /// Its tenant (an index: namespaces of one tenant share a bucket).
    pub tenant: u32,
    /// Zero.
    pub reserved: u32,
    /// The tenant's pushes, bytes per second at most (not 0).
    pub bytes_per_s: u64,
}

impl Record for PushCap {
    fn validate(&self) -> Result<(), WireError> {
        if self.bytes_per_s == 0 {
            return Err(field_err("push_cap.bytes_per_s", 0u8));
        }
        reserved_zero("push_cap.reserved", &self.reserved.to_le_bytes())
    }
}

/// Bytes of a tenant's name on the wire (and in a data plane's config).
pub const TENANT_NAME_BYTES: usize = 32;

/// One tenant's waits since the data plane started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct TenantThrottle {
    /// Its name (UTF-8, NUL-padded, not empty).
    pub name: [u8; TENANT_NAME_BYTES],
    /// Times its work waited for a bucket, by path: L2 reads, L2 writes,
    /// L3 reads, L3 writes, sends to other nodes.
    pub waits: [u64; 5],
}

impl TenantThrottle {
    /// Its name.
    pub fn name(&self) -> &str {
        text(&self.name)
    }
}

impl Record for TenantThrottle {
    fn validate(&self) -> Result<(), WireError> {
        if self.name[0] == 0 {
            return Err(field_err("tenant_throttle.name", 0u8));
        }
        check_text("tenant_throttle.name", &self.name)
    }
}

/// Paths a [`TenantWait`] has room for: the data plane's rate paths in
/// their code order, the rest 0 (the data plane asserts its paths fit).
pub const TENANT_WAIT_PATHS: usize = 8;

/// One tenant's waits since the data plane started, on every path it caps
/// (kind 31, [`Message::TenantWaits`], to a control plane that offered
/// [`super::FEATURE_TENANT_WAITS`]; one that did not is sent the first
/// five paths as [`TenantThrottle`]s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct TenantWait {
    /// Its name (UTF-8, NUL-padded, not empty).
    pub name: [u8; TENANT_NAME_BYTES],
    /// Times its work waited for a bucket, by path: L2 reads, L2 writes,
    /// L3 reads, L3 writes, sends to other nodes, blocks received from
    /// them; then 0.
    pub waits: [u64; TENANT_WAIT_PATHS],
}

impl TenantWait {
    /// Its name.
    pub fn name(&self) -> &str {
        text(&self.name)
    }

    /// What an older control plane is sent of it: the first five paths.
    pub fn throttle(&self) -> TenantThrottle {
        let mut waits = [0; 5];
        waits.copy_from_slice(&self.waits[..5]);
        TenantThrottle { name: self.name, waits }
    }
}

impl From<TenantThrottle> for TenantWait {
    /// An older data plane's record: no waits past the first five paths.
    fn from(old: TenantThrottle) -> Self {
        let mut waits = [0; TENANT_WAIT_PATHS];
        waits[..5].copy_from_slice(&old.waits);
        Self { name: old.name, waits }
    }
}

impl Record for TenantWait {
    fn validate(&self) -> Result<(), WireError> {
        if self.name[0] == 0 {
            return Err(field_err("tenant_wait.name", 0u8));
        }
        check_text("tenant_wait.name", &self.name)
    }
}

/// One rail to one peer: counters since the transport started.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RailEntry {
    /// The peer's node.
    pub node: u32,
    /// The rail's index among the peer's rails (in configured order).
    pub rail: u16,
    /// 1: in use now; 0: set aside after a break (cooling down).
    pub up: u8,
    /// Zero.
    pub reserved: u8,
    /// Bytes written on it.
    pub bytes: u64,
    /// Times a connection on it broke.
    pub breaks: u64,
}

impl Record for RailEntry {
    fn validate(&self) -> Result<(), WireError> {
        if self.up > 1 {
            return Err(field_err("rail_entry.up", self.up));
        }
        if self.reserved != 0 {
            return Err(field_err("rail_entry.reserved", self.reserved));
        }
        Ok(())
    }
}

/// The paths a data plane times ([`PathLatency`]): each an operation by
/// where its bytes went, so no slow path is silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Path {
    /// An L2 read a request waits on (critical load, P→D).
    L2ReadCritical = 1,
    /// An L2 read nobody waits on (a copy, a promotion in the background).
    L2ReadBackground = 2,
    /// An L2 write (write-back, demotion).
    L2Write = 3,
    /// A block sent to another node over the storage network, until it
    /// landed and checked there.
    TransferStorage = 4,
    /// An object read from the store into L1 (a load, a copy), checked.
    /// Sent only to a control plane that offered
    /// [`super::FEATURE_PATHS_L3`].
    L3Read = 5,
    /// An object written to the store (from L1, or from L2 through a
    /// staging read), until stored. As `L3Read`.
    L3Write = 6,
    /// An engine agent's read of an L1 hit (its pin, its copy out of the
    /// arena into the engine's memory, its checks): the agent's own side.
    /// Sent by agents only, to a control plane that offered
    /// [`super::FEATURE_PATHS_AGENT`].
    AgentReadL1 = 7,
    /// An L2 block as the engine waited for it: the data plane's load and
    /// the agent's copy (a batch's time shared by the blocks it
    /// delivered). As `AgentReadL1`.
    AgentLoadL2 = 8,
    /// As `AgentLoadL2`, from L3.
    AgentLoadL3 = 9,
}

impl Path {
    /// Every path, in code order.
    pub const ALL: [Self; 9] = [
        Self::L2ReadCritical,
        Self::L2ReadBackground,
        Self::L2Write,
        Self::TransferStorage,
        Self::L3Read,
        Self::L3Write,
        Self::AgentReadL1,
        Self::AgentLoadL2,
        Self::AgentLoadL3,
    ];

    /// The paths a build that takes [`super::FEATURE_PATHS_L3`] knows (the
    /// first six).
    pub const WITH_L3: usize = 6;

    /// The paths every build that takes [`super::FEATURE_PATH_LATENCY`]
    /// knows (the first four).
    pub const FIRST: usize = 4;

    /// Decodes a path code.
    pub fn from_u8(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|p| *p as u8 == code)
    }

    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::L2ReadCritical => "l2_read_critical",
            Self::L2ReadBackground => "l2_read_background",
            Self::L2Write => "l2_write",
            Self::TransferStorage => "transfer_storage",
            Self::L3Read => "l3_read",
            Self::L3Write => "l3_write",
            Self::AgentReadL1 => "agent_read_l1",
            Self::AgentLoadL2 => "agent_load_l2",
            Self::AgentLoadL3 => "agent_load_l3",
        }
    }
}

/// Buckets of a [`PathEntry`]: bucket `i` counts operations that took at
/// most `2^i` µs (and more than `2^(i-1)`); slower ones count in `count`
/// only.
pub const LATENCY_BUCKETS: usize = 21;

/// How long each path's operations took, since the data plane started:
/// sent with the stats, to a control plane that offered
/// [`super::FEATURE_PATH_LATENCY`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PathLatency {
    /// Entries that follow.
    pub count: u32,
    /// Zero.
    pub reserved: u32,
}

impl Record for PathLatency {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("path_latency.reserved", &self.reserved.to_le_bytes())
    }
}

impl ListHead for PathLatency {
    const RECORDS_MAX: usize = Path::ALL.len();
    fn count(&self) -> u32 {
        self.count
    }
}

/// One path's latency histogram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct PathEntry {
    /// A [`Path`].
    pub path: u8,
    /// Zero.
    pub reserved: [u8; 7],
    /// Operations timed.
    pub count: u64,
    /// Their microseconds, summed.
    pub sum_us: u64,
    /// Per bucket ([`LATENCY_BUCKETS`]; not cumulative).
    pub buckets: [u64; LATENCY_BUCKETS],
}

impl Default for PathEntry {
    fn default() -> Self {
        bytemuck::Zeroable::zeroed()
    }
}

impl PathEntry {
    /// An empty histogram of `path`.
    pub fn new(path: Path) -> Self {
        Self { path: path as u8, ..bytemuck::Zeroable::zeroed() }
    }

    /// Adds `other`'s operations (of the same path) to these.
    pub fn add(&mut self, other: &Self) {
        self.count = self.count.saturating_add(other.count);
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
        for (mine, theirs) in self.buckets.iter_mut().zip(other.buckets) {
            *mine = mine.saturating_add(theirs);
        }
    }

    /// Counts one operation that took `ns` nanoseconds.
    pub fn record(&mut self, ns: u64) {
        let us = ns / 1000;
        self.count += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        // The first bucket whose bound (2^i µs) it is within.
        let bucket = if us <= 1 { 0 } else { (64 - (us - 1).leading_zeros()) as usize };
        if let Some(b) = self.buckets.get_mut(bucket) {
            *b += 1;
        }
    }

    /// The bound (µs) of the bucket the `q` quantile (0 to 1) falls in: at
    /// most that long for a `q` share of its operations; none when nothing
    /// was timed or it falls past the last bucket (over 1.05 s).
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &count) in self.buckets.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return Some(1 << i);
            }
        }
        None
    }

    /// Its path (an entry this build made or decoded has a known one).
    pub fn path(&self) -> Option<Path> {
        Path::from_u8(self.path)
    }
}

impl Record for PathEntry {
    fn validate(&self) -> Result<(), WireError> {
        Path::from_u8(self.path).ok_or(field_err("path_entry.path", self.path))?;
        reserved_zero("path_entry.reserved", &self.reserved)?;
        let bucketed = self.buckets.iter().try_fold(0u64, |sum, &b| sum.checked_add(b));
        if bucketed.is_none_or(|b| b > self.count) {
            return Err(field_err("path_entry.buckets", self.count));
        }
        Ok(())
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

/// The leader asks a node's `lake-cp` for a snapshot of its replicas (it
/// saw a gap in the node's deltas, or it has just taken over).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct SnapshotRequest {
    /// The node.
    pub node: u32,
    /// Zero.
    pub reserved: u32,
    /// The node's term the leader last saw (0: none).
    pub term: u64,
}

impl Record for SnapshotRequest {
    fn validate(&self) -> Result<(), WireError> {
        if self.reserved != 0 {
            return Err(field_err("snapshot_request.reserved", self.reserved));
        }
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

/// A `lake-dp`'s running figures, sent to its `lake-cp` about once a
/// second for metrics: counters since the `lake-dp` started, gauges now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DataPlaneStats {
    /// Time in busy poll passes (ns).
    pub busy_ns: u64,
    /// Time spinning idle (ns).
    pub idle_ns: u64,
    /// Time parked (ns).
    pub parked_ns: u64,
    /// Bytes moved L1→L2 (demotions, write-back).
    pub bytes_l1_to_l2: u64,
    /// Bytes moved L2→L1 (promotions, loads).
    pub bytes_l2_to_l1: u64,
    /// Blocks saved by agents.
    pub saves: u64,
    /// Saves refused (no L1 slot).
    pub saves_refused: u64,
    /// Commits refused (the object failed its checks).
    pub commits_corrupt: u64,
    /// Blocks promoted L2→L1.
    pub promotions: u64,
    /// Blocks demoted L1→L2.
    pub demotions: u64,
    /// Replicas evicted on command.
    pub evictions: u64,
    /// Pins agents hold now.
    pub pins: u32,
    /// L1 slots retired and still pinned.
    pub draining: u32,
}

impl Record for DataPlaneStats {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

/// The saves a `lake-dp` refused, by reason, counted since it started:
/// sent beside [`DataPlaneStats`] to a control plane whose hello offered
/// [`super::FEATURE_SAVE_REFUSALS`]. The reasons add up to
/// [`DataPlaneStats::saves_refused`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct SaveRefusals {
    /// No free L1 slot and no victim to take in time: L1 full of blocks
    /// not yet written below, or held.
    pub no_space: u64,
    /// The only free L1 slots were the load reserve.
    pub load_reserve: u64,
    /// The pool was stopping.
    pub stopping: u64,
    /// Zero.
    pub reserved: u64,
}

impl Record for SaveRefusals {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("save_refusals.reserved", &self.reserved.to_le_bytes())
    }
}

/// `lake-dp`'s answer to an agent attaching on its attach socket (after
/// `HelloAck`): the agent's port in the shared port file. The same
/// message carries, as `SCM_RIGHTS`, the L1 arena, the port file and the
/// data plane's wake-up eventfd, in that order.
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
    /// Zero.
    pub reserved: [u8; 6],
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

/// The answer to a [`Lookup`]: the length of the hit run and the replicas
/// of its blocks.
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

/// A numbered batch of index changes from one node's `lake-cp`: its
/// entries carry `sequence`, `sequence + 1`, ... of `term`. A receiver that
/// sees a gap in the sequence within a term asks for a snapshot. In a
/// [`Message::Snapshot`] frame, `sequence` is the last change the snapshot
/// covers (its frames follow each other; the first starts it over) and the
/// entries are every ready replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Delta {
    /// The term the sequence belongs to.
    pub term: u64,
    /// Sequence number within the term.
    pub sequence: u64,
    /// The node whose replicas changed.
    pub node: u32,
    /// Entries that follow.
    pub count: u32,
}

impl Record for Delta {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

impl ListHead for Delta {
    const RECORDS_MAX: usize = DELTA_ENTRIES_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// One change in a [`Delta`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct DeltaEntry {
    /// [`DeltaOp`] code.
    pub op: u8,
    /// [`Durability`] code.
    pub durability: u8,
    /// [`ObjectKind`] code.
    pub kind: u16,
    /// Position in its prefix.
    pub block_index: u32,
    /// The block.
    pub key: BlockKey,
    /// Its parent.
    pub parent_key: BlockKey,
    /// Namespace id.
    pub namespace: u64,
    /// Layout fingerprint.
    pub layout_fingerprint: u64,
    /// The replica.
    pub replica: ReplicaWire,
}

impl Record for DeltaEntry {
    fn validate(&self) -> Result<(), WireError> {
        DeltaOp::from_u8(self.op).ok_or(field_err("delta_entry.op", self.op))?;
        Durability::from_u8(self.durability).ok_or(field_err("delta_entry.durability", self.durability))?;
        ObjectKind::from_u16(self.kind).ok_or(field_err("delta_entry.kind", self.kind))?;
        check_replica("delta_entry.replica", &self.replica)
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
const _: () = assert!(size_of::<DeltaEntry>() == 80);
const _: () = assert!(size_of::<SnapshotRequest>() == 16);
const _: () = assert!(size_of::<DrainRegion>() == 8);
const _: () = assert!(size_of::<ErrorBody>() == 64);
// Every fixed body fits the smallest frame limit a peer may announce.
const _: () = assert!(super::FRAME_HEADER_BYTES + 88 <= PEER_FRAME_BYTES_MIN as usize);
