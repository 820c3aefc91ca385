//! `lake-dp` is Lake's data plane, and the home of the vocabulary every
//! other crate speaks.
//!
//! It owns the core model of DESIGN §3 — [`Namespace`], the chained keyed
//! [`BlockKey`], the byte [`Layout`] of a block and its shard, object kinds,
//! [`Tier`] and [`Replica`] — plus the two formats that cross a process or a
//! power cut: the [`wire`] frames exchanged by `lake-cp`, `lake-dp` and the
//! engine's in-process agent, and the [`stored`] object format of L2 slots and
//! L3 objects. No other crate redefines any of these. The zero-allocation
//! polling engine (io_uring, RDMA completion queues, CUDA events) that moves
//! blocks between tiers grows here too; it is embedded, owns no thread and
//! uses no async runtime.

#![cfg_attr(not(test), warn(missing_docs))]
// Test fixtures are small numbers; the cast lints guard the library code.
#![cfg_attr(test, allow(clippy::cast_possible_truncation))]

// Every wire and stored format is little-endian and read by casting bytes to
// `#[repr(C)]` structs; a big-endian build would silently misread them.
#[cfg(target_endian = "big")]
compile_error!("lake-dp assumes a little-endian target (wire and stored formats)");

// Offsets and lengths are u64 on disk and usize in memory; on the 64-bit
// targets Lake runs on, widening one into the other is lossless.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("lake-dp assumes a 64-bit target");

/// A `u64` as a `usize`: lossless on the 64-bit targets Lake builds for
/// (asserted by the `compile_error!` above).
#[inline]
pub(crate) fn usize_from(value: u64) -> usize {
    #[allow(clippy::cast_possible_truncation)] // 64-bit targets only
    let widened = value as usize;
    widened
}

pub mod agent;
pub mod arena;
pub mod auth;
pub mod constants;
pub mod copy;
pub mod cplink;
pub mod fence;
pub mod io;
pub mod l2;
pub mod l3;
pub(crate) mod lock;
pub mod log;
#[cfg(not(loom))]
pub mod mirror;
/// Under `--cfg loom` only the mirror's sequence lock and table algorithms
/// are built, for their model checks; nothing else runs over loom's
/// atomics.
#[cfg(loom)]
pub mod mirror {
    #[path = "seqlock.rs"]
    pub mod seqlock;
    #[path = "table.rs"]
    pub mod table;
}
pub mod model;
pub mod numa;
pub mod op;
pub mod poller;
pub mod region;
pub mod ring;
pub mod rng;
pub mod route;
pub mod runner;
pub(crate) mod shm;
pub mod sim;
pub mod stored;
pub mod tag;
pub mod transport;
pub mod uring;
pub mod wire;

pub use model::key::{BlockKey, ChainValue, KeyChain, KeyError, ShardMask, engine_prefix_key};
pub use model::layout::{Dtype, KvPlanes, Layout, LayoutError, RecurrentLayout, Shard, shard_code};
pub use model::namespace::{
    Digest32, ExtraKeys, KeyScheme, ModelIdentity, Namespace, NamespaceError, NamespaceId, TenantKey,
};
pub use model::replica::{Durability, NodeId, ObjectKind, Priority, RegionId, Replica, Tier};
