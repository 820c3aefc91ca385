//! The summary link's records: a node's numbered index changes and
//! snapshots to the leader, the leader's asks for a snapshot, and the
//! cluster view the leader streams back down.

use bytemuck::{Pod, Zeroable};

use super::{DeltaOp, ListHead, Record, check_replica, field_err, reserved_zero};
use crate::constants::DELTA_ENTRIES_MAX;
use crate::model::key::BlockKey;
use crate::model::replica::{Durability, ObjectKind, ReplicaWire, Tier};
use crate::wire::WireError;

/// The leader asks a node's `lake-cp` for a snapshot of its replicas (it
/// saw a gap in the node's deltas, or it has just taken over); a node
/// asks the leader for a snapshot of its cluster view the same way
/// (naming itself and the view's term: it saw a gap in the view stream).
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

/// A numbered batch of index changes from one node's `lake-cp`: its
/// entries carry `sequence`, `sequence + 1`, ... of `term`. A receiver that
/// sees a gap in the sequence within a term asks for a snapshot. In a
/// [`Message::Snapshot`] frame, `sequence` is the last change the snapshot
/// covers (its frames follow each other; the first starts it over) and the
/// entries are every ready replica.
///
/// The same head leads the leader's cluster view
/// ([`Message::ViewDelta`], [`Message::ViewSnapshot`]): there `term` is the
/// leader's, `sequence` numbers the frames of its view stream (one each;
/// a view snapshot's frames all carry the last sequence it covers), and
/// `node` is the node whose holdings the entries give.
///
/// [`Message::Snapshot`]: super::Message::Snapshot
/// [`Message::ViewDelta`]: super::Message::ViewDelta
/// [`Message::ViewSnapshot`]: super::Message::ViewSnapshot
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

/// One node's holding of one block in the leader's cluster view, in a
/// [`Message::ViewDelta`] or [`Message::ViewSnapshot`] whose head's `node`
/// is the holder: the fastest tier of its replicas offered to readers
/// ([`VIEW_TIER_NONE`]: it holds none now). L0 (an engine's HBM) is never
/// named: no other node can read it.
///
/// [`Message::ViewDelta`]: super::Message::ViewDelta
/// [`Message::ViewSnapshot`]: super::Message::ViewSnapshot
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ViewEntry {
    /// The block.
    pub key: BlockKey,
    /// [`Tier`] code (L1, L2 or L3), or [`VIEW_TIER_NONE`].
    pub tier: u8,
    /// [`ObjectKind`] code (its low byte).
    pub kind: u8,
    /// Zero.
    pub reserved: [u8; 6],
}

/// [`ViewEntry::tier`] of a block the node no longer holds.
pub const VIEW_TIER_NONE: u8 = 0xff;

impl Record for ViewEntry {
    fn validate(&self) -> Result<(), WireError> {
        check_view_entry(self.tier, self.kind, self.reserved)
    }
}

/// A [`ViewEntry`] with the block's namespace, in a
/// [`Message::ViewDeltaNamed`] or [`Message::ViewSnapshotNamed`]: what a
/// leader sends, in place of those, a node whose hello offered
/// [`FEATURE_VIEW_NAMESPACES`] (one keeping tenants apart, which shows
/// each tenant's engines only its own namespaces' blocks).
///
/// [`Message::ViewDeltaNamed`]: super::Message::ViewDeltaNamed
/// [`Message::ViewSnapshotNamed`]: super::Message::ViewSnapshotNamed
/// [`FEATURE_VIEW_NAMESPACES`]: crate::wire::FEATURE_VIEW_NAMESPACES
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct NamedViewEntry {
    /// The block.
    pub key: BlockKey,
    /// Its namespace (0: its holder did not say).
    pub namespace: u64,
    /// [`Tier`] code (L1, L2 or L3), or [`VIEW_TIER_NONE`].
    pub tier: u8,
    /// [`ObjectKind`] code (its low byte).
    pub kind: u8,
    /// Zero.
    pub reserved: [u8; 6],
}

impl NamedViewEntry {
    /// The entry without its namespace.
    pub fn plain(&self) -> ViewEntry {
        ViewEntry { key: self.key, tier: self.tier, kind: self.kind, reserved: self.reserved }
    }
}

impl Record for NamedViewEntry {
    fn validate(&self) -> Result<(), WireError> {
        check_view_entry(self.tier, self.kind, self.reserved)
    }
}

fn check_view_entry(tier: u8, kind: u8, reserved: [u8; 6]) -> Result<(), WireError> {
    match Tier::from_u8(tier) {
        Some(Tier::L1Dram | Tier::L2Nvme | Tier::L3Object) => {}
        _ if tier == VIEW_TIER_NONE => {}
        _ => return Err(field_err("view_entry.tier", tier)),
    }
    ObjectKind::from_u16(u16::from(kind)).ok_or(field_err("view_entry.kind", kind))?;
    if reserved != [0; 6] {
        return Err(field_err("view_entry.reserved", 1u8));
    }
    Ok(())
}

/// The tenants a node keeps apart, said to its leader once, right after
/// the leader's ack and before the node's first report, on a link where
/// both offered [`FEATURE_KEPT_APART`]: one [`KeptApartEntry`] for each
/// namespace the node keeps apart, with its tenant.
///
/// [`FEATURE_KEPT_APART`]: crate::wire::FEATURE_KEPT_APART
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct KeptApart {
    /// Entries that follow.
    pub count: u32,
    /// Zero.
    pub reserved: u32,
}

impl Record for KeptApart {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("kept_apart.reserved", &self.reserved.to_le_bytes())
    }
}

impl ListHead for KeptApart {
    const RECORDS_MAX: usize = KEPT_APART_MAX;
    fn count(&self) -> u32 {
        self.count
    }
}

/// Namespaces one [`KeptApart`] names at most (a node keeping more apart
/// is refused at its start).
pub const KEPT_APART_MAX: usize = 16_384;

/// A namespace a node keeps apart, and the tenant it keeps it for (its
/// name's [`KeptApartEntry::tenant_of`]): two nodes keep a namespace apart
/// alike when they name the same tenant for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct KeptApartEntry {
    /// The namespace (never 0).
    pub namespace: u64,
    /// Its tenant (never 0).
    pub tenant: u64,
}

impl KeptApartEntry {
    /// The 64 bits that stand for tenant `name` on the wire: the first
    /// eight bytes of its BLAKE3 hash (never 0).
    pub fn tenant_of(name: &str) -> u64 {
        let hash = blake3::hash(name.as_bytes());
        let mut head = [0u8; 8];
        head.copy_from_slice(&hash.as_bytes()[..8]);
        u64::from_le_bytes(head).max(1)
    }
}

impl Record for KeptApartEntry {
    fn validate(&self) -> Result<(), WireError> {
        if self.namespace == 0 {
            return Err(field_err("kept_apart.namespace", 0u8));
        }
        if self.tenant == 0 {
            return Err(field_err("kept_apart.tenant", 0u8));
        }
        Ok(())
    }
}

const _: () = assert!(size_of::<KeptApart>() == 8);
const _: () = assert!(size_of::<KeptApartEntry>() == 16);
const _: () = assert!(size_of::<SnapshotRequest>() == 16);
const _: () = assert!(size_of::<DeltaEntry>() == 80);
const _: () = assert!(size_of::<ViewEntry>() == 24);
const _: () = assert!(size_of::<NamedViewEntry>() == 32);
