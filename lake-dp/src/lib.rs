//! `lake-dp` is Lake's data plane: the zero-allocation polling engine
//! (io_uring, RDMA completion queues, CUDA events) that moves blocks
//! between tiers, the L2 and L3 tiers, the transport between nodes, and
//! the runner that makes a daemon of them. The poller is embedded, owns no
//! thread and uses no async runtime.
//!
//! The vocabulary it speaks — the core model, the wire and stored formats,
//! the shared-memory arena, mirror and agent ports — is `lake-core`'s,
//! re-exported here under the same paths ([`model`], [`wire`], [`stored`],
//! [`arena`], [`mirror`], ...).

#![cfg_attr(not(test), warn(missing_docs))]
// Test fixtures are small numbers; the cast lints guard the library code.
#![cfg_attr(test, allow(clippy::cast_possible_truncation))]

pub(crate) use lake_core::lock;
pub(crate) use lake_core::usize_from;
pub use lake_core::{
    agent, arena, constants, copy, mirror, model, numa, os, quota, rates, region, ring, rng, route, stored, wire,
};

pub mod auth;
pub mod cplink;
pub mod fence;
pub mod io;
pub mod l2;
pub mod l3;
pub mod log;
pub mod op;
pub mod poller;
pub mod runner;
pub mod sim;
pub mod tag;
pub mod transport;
pub mod uring;

pub use lake_core::{
    BlockKey, ChainValue, Digest32, Dtype, Durability, ExtraKeys, KeyChain, KeyError, KeyScheme, KvPlanes, Layout,
    LayoutError, ModelIdentity, Namespace, NamespaceError, NamespaceId, NodeId, ObjectKind, Priority, RecurrentLayout,
    RegionId, Replica, Shard, ShardMask, TenantKey, Tier, engine_prefix_key, shard_code,
};
