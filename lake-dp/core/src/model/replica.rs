//! Tiers, replicas and the small enums every message carries.

use core::fmt;

use bytemuck::{Pod, Zeroable};

/// A storage medium. A tier is a medium, not a place: which node holds a
/// block is the pool's placement decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    /// GPU HBM. Engine-owned pages are advisory; a pool staging region is
    /// pool-managed.
    L0Hbm = 0,
    /// Host DRAM (the shared-memory arena).
    L1Dram = 1,
    /// NVMe (O_DIRECT slot files): the recovery point.
    L2Nvme = 2,
    /// Object storage: the source of truth.
    L3Object = 3,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Self; 4] = [Self::L0Hbm, Self::L1Dram, Self::L2Nvme, Self::L3Object];

    /// Decodes a tier code.
    pub fn from_u8(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code)).copied()
    }

    /// Whether a replica here survives the loss of the process holding it.
    pub fn survives_process_loss(self) -> bool {
        matches!(self, Self::L2Nvme | Self::L3Object)
    }
}

/// A node of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
#[repr(transparent)]
pub struct NodeId(pub u32);

/// A registered region (arena or slot file set) on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
#[repr(transparent)]
pub struct RegionId(pub u16);

/// What a stored object holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ObjectKind {
    /// One KV block (one shard of it).
    KvBlock = 1,
    /// A recurrent-state checkpoint keyed by the prefix key at a boundary.
    RecurrentState = 2,
}

impl ObjectKind {
    /// Decodes an object-kind code.
    pub fn from_u16(code: u16) -> Option<Self> {
        match code {
            1 => Some(Self::KvBlock),
            2 => Some(Self::RecurrentState),
            _ => None,
        }
    }
}

/// Work classes, most urgent first (DESIGN §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Priority {
    /// A load on a request's critical path (TTFT).
    CriticalLoad = 0,
    /// Prefill output consumed by decode.
    PrefillToDecode = 1,
    /// Saving new blocks to the pool.
    WriteBack = 2,
    /// Moving a block down a tier under pressure.
    Demotion = 3,
    /// Extra copies for durability or locality.
    Replication = 4,
}

impl Priority {
    /// Number of classes.
    pub const COUNT: usize = 5;

    /// Decodes a priority code.
    pub fn from_u8(code: u8) -> Option<Self> {
        Some(match code {
            0 => Self::CriticalLoad,
            1 => Self::PrefillToDecode,
            2 => Self::WriteBack,
            3 => Self::Demotion,
            4 => Self::Replication,
            _ => return None,
        })
    }
}

/// How much of a failure a replica survives (DESIGN §3, durability words).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Durability {
    /// In memory only (L0, L1): lost with the process or the machine.
    Volatile = 0,
    /// The O_DIRECT write completed: survives a process crash.
    Acked = 1,
    /// Flushed (RWF_DSYNC or fdatasync): survives a reboot.
    Durable = 2,
}

impl Durability {
    /// Decodes a durability code.
    pub fn from_u8(code: u8) -> Option<Self> {
        Some(match code {
            0 => Self::Volatile,
            1 => Self::Acked,
            2 => Self::Durable,
            _ => return None,
        })
    }
}

/// One copy of one shard of a block: where it is and which incarnation of
/// that slot holds it. A reference whose epoch or generation no longer
/// matches the region's is stale and must not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Replica {
    /// The medium.
    pub tier: Tier,
    /// The node holding it.
    pub node: NodeId,
    /// The region on that node.
    pub region: RegionId,
    /// The region's epoch, bumped at every `lake-dp` start.
    pub region_epoch: u64,
    /// The slot inside the region.
    pub slot: u32,
    /// The slot's generation, bumped every time the slot is freed.
    pub generation: u32,
}

impl Replica {
    /// The fixed wire record.
    pub fn to_wire(&self) -> ReplicaWire {
        ReplicaWire {
            tier: self.tier as u8,
            reserved: 0,
            region: self.region.0,
            node: self.node.0,
            region_epoch: self.region_epoch,
            slot: self.slot,
            generation: self.generation,
        }
    }

    /// Decodes a wire record; `None` for an unknown tier.
    pub fn from_wire(wire: &ReplicaWire) -> Option<Self> {
        Some(Self {
            tier: Tier::from_u8(wire.tier)?,
            node: NodeId(wire.node),
            region: RegionId(wire.region),
            region_epoch: wire.region_epoch,
            slot: wire.slot,
            generation: wire.generation,
        })
    }
}

impl fmt::Display for Replica {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}@n{}/r{}e{}/s{}g{}",
            self.tier, self.node.0, self.region.0, self.region_epoch, self.slot, self.generation
        )
    }
}

/// A replica as a fixed 24-byte little-endian record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
#[repr(C)]
pub struct ReplicaWire {
    /// [`Tier`] code.
    pub tier: u8,
    /// Zero.
    pub reserved: u8,
    /// Region id.
    pub region: u16,
    /// Node id.
    pub node: u32,
    /// Region epoch.
    pub region_epoch: u64,
    /// Slot.
    pub slot: u32,
    /// Slot generation.
    pub generation: u32,
}

const _: () = assert!(core::mem::size_of::<ReplicaWire>() == 24);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_reject_unknowns() {
        for tier in Tier::ALL {
            assert_eq!(Tier::from_u8(tier as u8), Some(tier));
        }
        assert_eq!(Tier::from_u8(4), None);
        for code in 0..=u8::MAX {
            if let Some(p) = Priority::from_u8(code) {
                assert_eq!(p as u8, code);
            }
            if let Some(d) = Durability::from_u8(code) {
                assert_eq!(d as u8, code);
            }
        }
        assert_eq!(Priority::from_u8(5), None);
        assert_eq!(ObjectKind::from_u16(0), None);
        assert!(Priority::CriticalLoad < Priority::Replication);
    }

    #[test]
    fn replica_wire_round_trip() {
        let replica = Replica {
            tier: Tier::L2Nvme,
            node: NodeId(3),
            region: RegionId(2),
            region_epoch: 41,
            slot: 1000,
            generation: 7,
        };
        assert_eq!(Replica::from_wire(&replica.to_wire()), Some(replica));
        let mut bad = replica.to_wire();
        bad.tier = 9;
        assert_eq!(Replica::from_wire(&bad), None);
        assert_eq!(replica.to_string(), "L2Nvme@n3/r2e41/s1000g7");
    }
}
