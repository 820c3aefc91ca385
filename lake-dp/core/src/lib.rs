//! `lake-core` is the vocabulary every Lake crate speaks, and nothing
//! else: no thread, socket or io_uring lives here, and it depends on no
//! other Lake crate, so the compiler keeps the formats apart from the
//! daemons that use them.
//!
//! It owns the core model of DESIGN §3 — [`Namespace`], the chained keyed
//! [`BlockKey`], the byte [`Layout`] of a block and its shard, object kinds,
//! [`Tier`] and [`Replica`] — the two formats that cross a process or a
//! power cut (the [`wire`] frames of `lake-cp`, `lake-dp` and the engines'
//! agents; the [`stored`] object format of L1 slots, L2 files and L3
//! objects), and what lives in shared memory between processes: the L1
//! [`arena`] and its [`region`], the lock-free [`mirror`] engines read,
//! and the [`agent`] ports over which engines talk to the data plane.
//! [`route`] places blocks on nodes; [`os`], [`numa`] and [`lock`] are the
//! few system calls these need.

#![cfg_attr(not(test), warn(missing_docs))]
// Test fixtures are small numbers; the cast lints guard the library code.
#![cfg_attr(test, allow(clippy::cast_possible_truncation))]

// Every wire and stored format is little-endian and read by casting bytes to
// `#[repr(C)]` structs; a big-endian build would silently misread them.
#[cfg(target_endian = "big")]
compile_error!("lake-core assumes a little-endian target (wire and stored formats)");

// Offsets and lengths are u64 on disk and usize in memory; on the 64-bit
// targets Lake runs on, widening one into the other is lossless.
#[cfg(not(target_pointer_width = "64"))]
compile_error!("lake-core assumes a 64-bit target");

/// A `u64` as a `usize`: lossless on the 64-bit targets Lake builds for
/// (asserted by the `compile_error!` above).
#[inline]
pub fn usize_from(value: u64) -> usize {
    #[allow(clippy::cast_possible_truncation)] // 64-bit targets only
    let widened = value as usize;
    widened
}

pub mod agent;
pub mod arena;
pub mod constants;
pub mod copy;
pub mod lock;
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
pub mod os;
pub mod quota;
pub mod rates;
pub mod region;
pub mod ring;
pub mod rng;
pub mod route;
pub mod shm;
pub mod stored;
pub mod wire;

pub use model::key::{BlockKey, ChainValue, KeyChain, KeyError, ShardMask, engine_prefix_key};
pub use model::layout::{Dtype, KvPlanes, Layout, LayoutError, RecurrentLayout, Shard, shard_code};
pub use model::namespace::{
    Digest32, ExtraKeys, KeyScheme, ModelIdentity, Namespace, NamespaceError, NamespaceId, TenantKey,
};
pub use model::replica::{Durability, NodeId, ObjectKind, Priority, RegionId, Replica, Tier};
