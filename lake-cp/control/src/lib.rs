//! `lake-control` is Lake's control plane. Per node it is the authority on that
//! node's replicas: it holds the radix prefix index over [`lake_dp::BlockKey`]
//! chains and the location view (which [`lake_dp::Replica`]s hold each
//! block), grants leases and tracks pins, decides eviction and demotion, and
//! is the one writer of the shared-memory mirror that engines and `lake-dp`
//! read lock-free. One elected `lake-cp` is the leader: it aggregates
//! (term, sequence)-numbered deltas from every node into the global summary
//! and fences stale leaders by term. It speaks only the [`lake_dp::wire`]
//! format and keeps everything heavy (etcd, object-store clients) out of the
//! data plane. It holds the radix index ([`index`]), the location view
//! with its two-phase put ([`location`]), the eviction policies
//! ([`evict`]), the node authority over `lake-dp` reports ([`node`]),
//! leases ([`lease`]), the tier manager that turns capacities and quotas
//! into moves ([`tier`]), execution-mode routing ([`route`]), the cp↔dp
//! server ([`server`]), metrics ([`metrics`]), leadership, membership and
//! the checkpoint pointer in etcd ([`ha`] over [`etcd`]) and the embedded
//! single-node pool ([`embedded`]). It never names the engine's agent: the
//! `lake-cp` package, which builds the `lake` command on this crate, is the
//! one that drives engines (its demo). See `docs/controlplane.md`.

#![warn(missing_docs)]

pub mod admin;
pub mod config;
pub mod embedded;
pub mod etcd;
pub mod evict;
pub mod ha;
mod huge;
pub mod index;
pub mod l0;
pub mod lease;
pub mod location;
pub mod metrics;
pub mod node;
pub mod route;
pub mod router;
pub mod server;
pub mod summary;
mod table;
pub mod tier;
