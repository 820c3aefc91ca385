//! `lake-cp` is Lake's control plane. Per node it is the authority on that
//! node's replicas: it holds the radix prefix index over [`lake_dp::BlockKey`]
//! chains and the location view (which [`lake_dp::Replica`]s hold each
//! block), grants leases and tracks pins, decides eviction and demotion, and
//! is the one writer of the shared-memory mirror that engines and `lake-dp`
//! read lock-free. One elected `lake-cp` is the leader: it aggregates
//! (term, sequence)-numbered deltas from every node into the global summary
//! and fences stale leaders by term. It speaks only the [`lake_dp::wire`]
//! format and keeps everything heavy (etcd, object-store clients) out of the
//! data plane. Today it holds the radix index ([`index`]), the location
//! view with its two-phase put ([`location`]) and the eviction policies
//! ([`evict`]); the mirror, leases and tier moves arrive with the rest of
//! issue \[3\], leadership with \[7\]. See `docs/controlplane.md`.

#![warn(missing_docs)]

pub mod evict;
mod huge;
pub mod index;
pub mod location;
mod table;
