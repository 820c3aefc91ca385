//! Tenants kept apart in L1: each one's partition of the arena and its
//! mirror, from the pool's settings.

use std::path::{Path, PathBuf};

use super::EmbeddedConfig;
use crate::tier::TierConfig;

/// A tenant whose L1 blocks lie in a partition of the arena of their own
/// (memory at no path, sealed at its size), sized by the tenant's L1
/// quota and passed only to the engines of its users and groups, with a
/// mirror of its own; every other engine maps the rest of the arena,
/// where no block of the tenant's namespaces ever lies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantPartition {
    /// The tenant: the name of its L1 quota (`TierConfig::tenant_quotas`).
    pub tenant: String,
    /// Users whose engines map it.
    pub uids: Vec<u32>,
    /// Groups whose engines map it.
    pub gids: Vec<u32>,
}

impl std::str::FromStr for TenantPartition {
    type Err = String;

    /// `NAME:uid=N|gid=N[,...]`.
    fn from_str(text: &str) -> Result<Self, String> {
        let bad = || "NAME:uid=N|gid=N[,...]".to_owned();
        let (name, list) = text.split_once(':').ok_or_else(bad)?;
        let mut partition = Self { tenant: name.to_owned(), ..Self::default() };
        for item in list.split(',') {
            let (kind, id) = item.split_once('=').ok_or_else(bad)?;
            let id: u32 = id.parse().map_err(|_| format!("{item:?}: not a user or group id"))?;
            match kind {
                "uid" => partition.uids.push(id),
                "gid" => partition.gids.push(id),
                _ => return Err(bad()),
            }
        }
        Ok(partition)
    }
}

impl EmbeddedConfig {
    /// The data plane's partitions of the L1 arena: one per tenant kept
    /// apart, its namespaces and size those of its L1 quota (slots of
    /// every size class, as many as its bytes fill).
    pub fn l1_partitions(&self) -> Result<Vec<lake_dp::runner::config::PartitionSection>, String> {
        let slot_bytes: u64 = self.l1_size_classes().map(|(payload, _)| lake_dp::stored::object_bytes(payload)).sum();
        self.partitions
            .iter()
            .map(|partition| {
                let quota = self
                    .tiers
                    .tenant_quotas
                    .iter()
                    .find(|q| q.tier == lake_dp::Tier::L1Dram && q.tenant == partition.tenant)
                    .ok_or_else(|| {
                        format!("partition {}: its size is its tenant's L1 quota, and it has none", partition.tenant)
                    })?;
                let slots = u32::try_from(quota.bytes / slot_bytes.max(1)).unwrap_or(u32::MAX);
                if slots == 0 {
                    return Err(format!("partition {}: its L1 quota holds not one block", partition.tenant));
                }
                Ok(lake_dp::runner::config::PartitionSection {
                    name: partition.tenant.clone(),
                    namespaces: quota.namespaces.iter().map(|n| format!("{n:016x}")).collect(),
                    uids: partition.uids.clone(),
                    gids: partition.gids.clone(),
                    slots,
                    mirror: Some(self.tenant_mirror(&partition.tenant)),
                })
            })
            .collect()
    }

    /// The mirror of each tenant kept apart, beside the pool's `mirror`
    /// (`<mirror>.<tenant>`, which `lake-dp` gives that tenant's engines),
    /// and the namespaces whose blocks it alone publishes.
    pub fn tenant_mirrors(&self, mirror: &Path) -> Result<Vec<(Vec<u64>, PathBuf)>, String> {
        let partitions = self.l1_partitions()?;
        let mirrors = partitions.into_iter().map(|partition| {
            let namespaces = namespaces_of(&partition);
            (namespaces, beside(mirror, &partition.name))
        });
        Ok(mirrors.collect())
    }

    /// Each tenant kept apart, by name, with its namespaces: what the node
    /// says to its leader, which moves a block kept apart only between
    /// nodes keeping it apart alike. More namespaces than one list holds
    /// are refused.
    pub fn kept_apart(&self) -> Result<Vec<(String, Vec<u64>)>, String> {
        let kept: Vec<(String, Vec<u64>)> =
            self.l1_partitions()?.into_iter().map(|p| (p.name.clone(), namespaces_of(&p))).collect();
        let count: usize = kept.iter().map(|(_, namespaces)| namespaces.len()).sum();
        let most = lake_dp::wire::message::KEPT_APART_MAX;
        if count > most {
            return Err(format!("tenant partitions keep {count} namespaces apart; a node keeps at most {most}"));
        }
        Ok(kept)
    }

    /// The tenants kept apart as the data plane tells their engines
    /// apart: each one's namespaces, users and groups, in the order of
    /// [`EmbeddedConfig::tenant_mirrors`].
    pub fn tenant_engines(&self) -> Result<lake_dp::runner::config::Partitions, String> {
        let each = self.l1_partitions()?.into_iter().map(|partition| {
            let namespaces = namespaces_of(&partition);
            (namespaces, partition.uids, partition.gids)
        });
        Ok(lake_dp::runner::config::Partitions { each: each.collect(), mirrors: Vec::new() })
    }

    /// The tier manager's settings: the tenants' partitions of L1 (each
    /// one's bytes and namespaces) added to those given.
    pub fn tier_config(&self) -> Result<TierConfig, String> {
        let slot_bytes: u64 = self.l1_size_classes().map(|(payload, _)| lake_dp::stored::object_bytes(payload)).sum();
        let mut tiers = self.tiers.clone();
        for partition in self.l1_partitions()? {
            let namespaces = namespaces_of(&partition);
            tiers.l1_partitions.push((u64::from(partition.slots) * slot_bytes, namespaces));
        }
        Ok(tiers)
    }

    /// The node's cluster view, beside the pool's mirror
    /// (`<mirror>.cluster`), where it keeps one: it reports to a summary,
    /// with room for blocks. Each tenant kept apart has one of its own
    /// beside its mirror ([`EmbeddedConfig::cluster_views`]).
    pub fn cluster_view(&self) -> Option<PathBuf> {
        let kept = !self.summary_to.is_empty() && self.cluster_view_blocks > 0;
        kept.then(|| lake_dp::mirror::view::ViewOpener::path_beside(&self.shared_memory().1))
    }

    /// Every cluster view the node keeps: the pool's, then each tenant's
    /// kept apart (`<mirror>.<tenant>.cluster`), which its data plane
    /// gives that tenant's engines alone.
    pub fn cluster_views(&self) -> Vec<PathBuf> {
        let tenants = self.partition_files().into_iter().filter_map(|(_, _, view)| view);
        self.cluster_view().into_iter().chain(tenants).collect()
    }

    /// Each tenant kept apart: its name, its mirror and its cluster view
    /// (where the node keeps views), as `pool.json` lists them for
    /// readers of the pool's shared memory other than its engines.
    pub fn partition_files(&self) -> Vec<(String, PathBuf, Option<PathBuf>)> {
        let kept = self.cluster_view().is_some();
        let each = self.partitions.iter().map(|p| {
            let mirror = self.tenant_mirror(&p.tenant);
            let view = kept.then(|| lake_dp::mirror::view::ViewOpener::path_beside(&mirror));
            (p.tenant.clone(), mirror, view)
        });
        each.collect()
    }

    /// Tenant `tenant`'s own mirror: the pool's, named with `.<tenant>`.
    pub fn tenant_mirror(&self, tenant: &str) -> PathBuf {
        beside(&self.shared_memory().1, tenant)
    }
}

/// A partition's namespaces (as its section names them, in hex).
fn namespaces_of(partition: &lake_dp::runner::config::PartitionSection) -> Vec<u64> {
    partition.namespaces.iter().filter_map(|n| u64::from_str_radix(n, 16).ok()).collect()
}

/// `path` with `.<name>` added: a tenant's file beside the pool's.
fn beside(path: &Path, name: &str) -> PathBuf {
    let mut path = path.as_os_str().to_owned();
    path.push(format!(".{name}"));
    PathBuf::from(path)
}
