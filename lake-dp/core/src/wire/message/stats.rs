//! The figures a `lake-dp` and an engine's agent report for metrics: the
//! data plane's running counters, its refused saves and shed connections,
//! rails, tenants' throttles and waits, and per-path latencies.

use bytemuck::{Pod, Zeroable};

use super::{ListHead, Record, check_text, field_err, reserved_zero, text};
use crate::wire::WireError;

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
    /// The block would have taken its namespace or tenant past an L1
    /// quota (zero to a control plane without
    /// [`crate::wire::FEATURE_QUOTA_REFUSALS`]: counted under `no_space`).
    pub over_quota: u64,
}

impl Record for SaveRefusals {
    fn validate(&self) -> Result<(), WireError> {
        Ok(())
    }
}

/// The connections a `lake-dp`'s listeners let go, counted since it
/// started: sent beside [`DataPlaneStats`] to a control plane whose hello
/// offered [`crate::wire::FEATURE_CONNECTIONS_SHED`], for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct ConnectionsShed {
    /// Attach socket: connections refused for their credentials.
    pub attach_strangers: u64,
    /// Attach socket: connections closed for no hello in time.
    pub attach_hello_timeouts: u64,
    /// Attach socket: connections waiting for their hello crowded out by
    /// newer ones.
    pub attach_crowded_out: u64,
    /// Attach socket: hellos refused, their user holding its ports.
    pub attach_user_ports_full: u64,
    /// Transport: inbound connections closed as they came, at its cap.
    pub transport_over_cap: u64,
    /// Transport: inbound connections closed for bringing nothing in.
    pub transport_silent: u64,
    /// Transport: accepts that failed (out of descriptors, most often).
    pub transport_accept_failed: u64,
    /// Zero.
    pub reserved: u64,
}

impl Record for ConnectionsShed {
    fn validate(&self) -> Result<(), WireError> {
        reserved_zero("connections_shed.reserved", &self.reserved.to_le_bytes())
    }
}
