//! The in-process agent: what an engine links to use the pool.
//!
//! It lives with the engine's surface (`ffi`), not with the data plane:
//! it depends on the vocabulary (`lake-core`) and on two client-side
//! pieces of `lake-dp` (the transport, for an engine's own pushes, and
//! the cp link), never on the data plane's runner; `lake-dp` cannot name
//! it at all.
//!
//! - **Lookup** reads the mirror in shared memory: the longest cached
//!   prefix of a prompt's keys and its block table, with no round trip.
//!   The keys and the hit count are then reported to `lake-cp`, batched
//!   and off the request's path, so eviction learns what is used.
//! - **Fetch** delivers the hit blocks' payloads in order. An L1 block is
//!   read through the agent's own pin (generation re-checked, CRCs
//!   verified). Lower-tier blocks are leased from `lake-cp` first (so they
//!   are not evicted under the read), then the data plane reads each into
//!   a fresh L1 slot — verified, and kept there: a hit promotes — and the
//!   agent reads it like any L1 block. A block that fails (gone, corrupt)
//!   ends the delivered prefix; the engine recomputes from there.
//! - **Save** is two-phase: reserve L1 slots, write each stored object
//!   (header naming its slot and generation, CRCs, payload) straight into
//!   shared memory, commit. The data plane checks and publishes it.
//!   Saves are best effort: with no slot free they are skipped and
//!   counted, never waited for.
//!
//! The C ABI (`ffi`) wraps this for engines; the port is a pair of rings
//! in shared memory ([`port`], [`shm`]). The calls here block their
//! caller until the data plane answers (bounded by a deadline), which is
//! what the engine's agent thread does around them.

#![cfg_attr(not(test), warn(missing_docs))]

mod client;
pub mod push;

pub use lake_core::agent::{port, shm};

pub use client::{
    Agent, AgentConfig, AgentStats, AttachError, FetchFailure, GatherFill, LEASE_TTL_MS, LOAD_RETRY_MAX, PreparedSave,
    PreparedTurn, SPANS_KEPT, SaveBlock, SavePayload, SaveStatus, SentCommits, TraceSpan, WAIT_MAX, fold_load_cost,
};
pub use port::{CrcOrigin, LOAD_BATCH};
