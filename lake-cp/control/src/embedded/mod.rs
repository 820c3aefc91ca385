//! The embedded single-node pool: `lake-cp` (server, tier manager, mirror,
//! metrics) and a `lake-dp` runner (L1 arena in /dev/shm, L2 files in a
//! directory, the attach socket for engines in other processes, and
//! in-process agent ports if asked), each on its own thread of this
//! process, with nothing external. `lake demo` drives one; `lake serve`
//! runs one until stopped.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lake_dp::NodeId;
use lake_dp::Tier;
use lake_dp::agent::port::{AgentPort, port};
use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorWriter};
use lake_dp::os::Wakeup;
use lake_dp::runner::config::RunnerConfig;
use lake_dp::runner::{RunnerError, RunnerOptions, RunnerPorts, RunnerStats, run_with};

use crate::node::Node;
use crate::server::Server;
use crate::tier::TierConfig;

mod created;
mod error;
pub mod fds;
mod partitions;

use created::Created;
pub use error::{Plane, ServeError};
pub use partitions::TenantPartition;

/// What the embedded pool is made of.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// The pool's home: its lock, sockets and L2 files (created if
    /// missing). One pool at a time: a second is refused.
    pub dir: PathBuf,
    /// Whether the pool's L2 outlives it (`lake serve`): a stop first
    /// writes L1 down to L2 (within `stop_flush`) and leaves the L2 files
    /// for the next start to re-adopt. Otherwise (the demo, tests) a stop
    /// removes the L2 files it created too. Either way a stop removes only
    /// what the pool created — its lock, sockets and shared memory, and
    /// its directory if it made it and nothing else is left there.
    pub durable: bool,
    /// How long a durable pool's stop may spend writing L1 down to L2.
    pub stop_flush: Duration,
    /// Payload bytes of a block (the L1 slot and L2 slot add their header).
    pub block_bytes: u64,
    /// L1 slots.
    pub l1_slots: u32,
    /// More L1 size classes beside `block_bytes`'s, one per other block
    /// layout served (another model): (payload bytes, slots). L2 slots are
    /// made to hold the largest.
    pub l1_classes: Vec<(u64, u32)>,
    /// Let the L1 classes share the arena in chunks of this many bytes
    /// (`[l1] chunk_bytes`; 0: each class owns its slots): a class short
    /// of slots takes memory another does not use, a chunk emptied by
    /// moving its blocks if need be.
    pub l1_chunk_bytes: u64,
    /// L2 slots per file.
    pub l2_slots_per_file: u32,
    /// The L2 files, one per device (made and formatted if missing,
    /// re-adopted if present); empty: `DIR/l2-0.lake` and `DIR/l2-1.lake`.
    pub l2_files: Vec<PathBuf>,
    /// In-process agent ports to make (for engines in this process).
    pub local_agents: u32,
    /// Ports for engines in other processes (on the attach socket).
    pub remote_agents: u32,
    /// The tier manager's settings.
    pub tiers: TierConfig,
    /// Serve `/metrics` at this address (port 0: any free one).
    pub metrics: Option<std::net::SocketAddr>,
    /// How the data plane checks a commit's payload against the CRCs the
    /// agent wrote (readers check every segment whatever this is).
    pub commit_check: lake_dp::runner::pool::CommitCheck,
    /// Where the data plane's transport listens for blocks peers send into
    /// its L1 (P→D, replication); none: it takes none.
    pub transport_listen: Option<std::net::SocketAddr>,
    /// The nodes its transport sends to over the storage network (copies
    /// `lake-cp` asks for): node id and its rails, one per NIC.
    pub transport_peers: Vec<(u32, Vec<lake_dp::transport::tcp::Rail>)>,
    /// How many connections each listener holds at most (cut at start to
    /// what the limit on open files leaves: [`fds::fit`]).
    pub caps: fds::Caps,
    /// Write-back, demotion and replication reads and writes in the L2
    /// device at once, at most (0: no cap; below 32, the queue's depth):
    /// the rest stays for loads requests wait on.
    pub l2_background_depth: u32,
    /// The last free L1 slots engines' saves may not take, kept for loads
    /// (`[l1] load_reserve_slots`; 0: none). It must leave the tier
    /// manager's high-water mark below what saves can fill. `None`: one
    /// agent's batch of loads ([`lake_dp::agent::port::LOAD_BATCH`]), or fewer
    /// where the high-water mark leaves fewer (none in a small L1).
    pub l1_load_reserve: Option<u32>,
    /// An RDMA device: each peer's link negotiates RDMA over its TCP
    /// connection (a `lake-dp` built with the `rdma` feature).
    pub rdma: Option<lake_dp::runner::RdmaDevice>,
    /// This node's id (a pool of several nodes gives each its own).
    pub node: u32,
    /// The object store tier, if any (its directory or bucket outlives
    /// the pool: it is not under `dir`, and not removed at stop).
    pub l3: Option<lake_dp::runner::config::L3Section>,
    /// The leader's summary aggregators this node reports its replicas to
    /// (whichever accepts; none: it reports to none).
    pub summary_to: Vec<std::net::SocketAddr>,
    /// Blocks of other nodes each cluster view holds (0: none; kept only
    /// where the node reports to a summary).
    pub cluster_view_blocks: u64,
    /// The cluster's link key: the transport's connections and the summary
    /// link are authenticated with it (every peer must hold it).
    pub link_key: Option<lake_dp::auth::LinkKey>,
    /// Who may connect to the pool's sockets (`lake-dp`'s attach socket,
    /// `lake-cp`'s), and their files' group and mode: the `[agents]`
    /// fields of the same names (by default this process's user and root;
    /// mode 0o600).
    pub access: LocalAccess,
    /// Tenants' data keys at start: blocks of these namespaces are sealed
    /// (AES-256-GCM) below L1; change them while the pool runs through
    /// [`EmbeddedPool::tenant_keys`].
    pub tenant_keys: Vec<(lake_dp::NamespaceId, lake_dp::auth::at_rest::DataKey)>,
    /// Namespaces without a data key are kept out of L2 and L3.
    pub require_encryption: bool,
    /// Tenants' bandwidth caps on the node's tiers (the data plane's
    /// `[[tenants]]`).
    pub tenant_rates: Vec<lake_dp::runner::config::TenantSection>,
    /// The data plane's event lines (JSON: refused links and agents, L3
    /// scans, traced loads, its final figures) go to stderr (`lake serve`),
    /// not nowhere.
    pub events_to_stderr: bool,
    /// Or they are appended to this file (created if missing), whatever
    /// `events_to_stderr` says.
    pub event_log: Option<PathBuf>,
    /// The data plane's events at this level or above are written.
    pub log_level: lake_dp::log::LevelFilter,
    /// As JSON lines or text.
    pub log_format: lake_dp::log::Format,
    /// What L1's memory is.
    pub l1_backing: crate::config::L1Backing,
    /// L1 locked in memory (mlock).
    pub l1_lock: bool,
    /// The cores the data plane's poll thread may run on (pinned to the
    /// first); none: wherever the scheduler puts it.
    pub cores: Option<Vec<usize>>,
    /// The NUMA node the data plane's memory and L1 are bound to.
    pub numa_node: Option<u32>,
    /// Tenants kept apart in L1 (see [`TenantPartition`]).
    pub partitions: Vec<TenantPartition>,
}

/// The L1 arena's agent records (pin arrays) kept for each agent port: an
/// engine attached over the C ABI claims one for its agent, one for its
/// agent thread, one for its pushes and one per copy lane, so a port's
/// engine with one copy lane never finds them all taken by the others
/// (lanes beyond take what is free).
pub const RECORDS_PER_ENGINE: u32 = 4;

/// `/metrics` on the loopback interface, on any free port (tests, the
/// demo: several pools at once).
pub const METRICS_ANY_LOCAL_PORT: std::net::SocketAddr =
    std::net::SocketAddr::V4(std::net::SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 0));

/// Who may use a pool's local sockets. See [`EmbeddedConfig::access`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalAccess {
    /// Users allowed (with `allow_gids` empty too: this user and root).
    pub allow_uids: Vec<u32>,
    /// Groups allowed.
    pub allow_gids: Vec<u32>,
    /// The sockets' group (a name or a number).
    pub group: Option<String>,
    /// The sockets' mode (default 0o600; 0o660 with a group).
    pub socket_mode: Option<u32>,
    /// Agent ports one user may hold at once (none: all of them).
    pub ports_per_uid: Option<u32>,
}

impl LocalAccess {
    /// The control plane's socket as the data plane's agents section makes
    /// its own: the file's group, its mode, and who may connect.
    pub fn of_sockets(&self) -> Result<(Option<u32>, u32, lake_dp::auth::PeerPolicy), String> {
        let agents = lake_dp::runner::config::AgentsSection {
            allow_uids: self.allow_uids.clone(),
            allow_gids: self.allow_gids.clone(),
            group: self.group.clone(),
            socket_mode: self.socket_mode,
            ..lake_dp::runner::config::AgentsSection::default()
        };
        agents.access().map_err(|e| e.0)
    }
}

/// The load reserve the data plane is given (see
/// [`EmbeddedConfig::l1_load_reserve`]): saves stop that many slots short
/// of a full L1, and the tier manager must see L1 over its high-water mark
/// before then, or it would never demote and the pool would refuse every
/// save from then on — a reserve asked for past that is refused.
fn load_reserve(config: &EmbeddedConfig) -> Result<u32, String> {
    let slot_bytes = lake_dp::region::SlotClass::for_payload(config.block_bytes, config.l1_slots).slot_bytes;
    let physical = slot_bytes * u64::from(config.l1_slots);
    let capacity = config.tiers.capacity_bytes[Tier::L1Dram as usize].map_or(physical, |c| c.min(physical));
    let high_slots = u128::from(capacity) * u128::from(config.tiers.high_percent) / 100 / u128::from(slot_bytes);
    // Saves fill `l1_slots - reserve` slots: more than `high_slots`.
    let max = u32::try_from(u128::from(config.l1_slots).saturating_sub(high_slots + 1)).unwrap_or(0);
    let batch = u32::try_from(lake_dp::agent::port::LOAD_BATCH).unwrap_or(u32::MAX);
    let reserve = config.l1_load_reserve.unwrap_or_else(|| max.min(batch));
    if reserve > max {
        return Err(format!(
            "l1 load reserve: {reserve} of {} slots kept for loads leaves saves below the {}% high-water mark, so L1 \
             would never be demoted (at most {max} here)",
            config.l1_slots, config.tiers.high_percent
        ));
    }
    Ok(reserve)
}

/// The lock file in a pool's directory; it holds the serving pid.
pub const LOCK_FILE: &str = "lake.lock";

/// A running embedded pool.
#[derive(Debug)]
pub struct EmbeddedPool {
    /// Its directory.
    pub dir: PathBuf,
    /// The L1 arena's path.
    pub arena: PathBuf,
    /// The mirror's path.
    pub mirror: PathBuf,
    /// `lake-cp`'s socket (leases, access reports).
    pub cp_socket: PathBuf,
    /// `lake-dp`'s attach socket (engines in other processes).
    pub dp_socket: PathBuf,
    /// The operator's socket (`lake inspect`, `lake top`, `lake purge`;
    /// [`crate::admin`]).
    pub admin_socket: PathBuf,
    /// `/metrics`, if served.
    pub metrics: Option<std::net::SocketAddr>,
    /// The agents' ends of the in-process ports, to take.
    pub local_ports: Vec<AgentPort>,
    /// Live gauges.
    pub gauges: Arc<Gauges>,
    /// The data plane's key ring, to change while it runs (a key set, a
    /// tenant forgotten and purged).
    pub tenant_keys: Arc<lake_dp::auth::at_rest::TenantKeys>,
    stop_cp: Arc<AtomicBool>,
    stop_dp: Arc<AtomicBool>,
    /// Set to close the data plane to saves (before L1 is written down).
    close_saves: Arc<AtomicBool>,
    /// Requests for the control plane's thread (copies to other nodes).
    requests: std::sync::mpsc::Sender<CpRequest>,
    /// Set: the node is being drained (`lake drain-node`): its control
    /// plane answers `/readyz` not ready.
    pub draining: Arc<AtomicBool>,
    /// The last free L1 slots kept from saves for loads (what
    /// [`EmbeddedConfig::l1_load_reserve`] came to).
    pub load_reserve_slots: u32,
    cp: Option<JoinHandle<std::io::Result<Server>>>,
    dp: Option<JoinHandle<Result<RunnerStats, RunnerError>>>,
    /// Whether L1 is written down to L2 at stop, and for how long at most.
    durable: bool,
    stop_flush: Duration,
    emptied: bool,
    /// What to remove when the pool goes.
    created: Created,
}

impl EmbeddedConfig {
    /// Every L1 size class as (payload bytes, slots): `block_bytes`'s, then
    /// `l1_classes`.
    pub fn l1_size_classes(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        std::iter::once((self.block_bytes, self.l1_slots)).chain(self.l1_classes.iter().copied())
    }

    /// A pool in `dir` with `lake serve`'s defaults: 64 KiB blocks, 1,024
    /// L1 slots, 2 × 4,096 L2 slots, 16 ports for engines in other
    /// processes and none in this one, the default tiers, commits checked
    /// inline, no metrics, no transport, node 0. Set what differs with
    /// `EmbeddedConfig { l1_slots: 64, ..EmbeddedConfig::new(dir) }`.
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            durable: false,
            stop_flush: Duration::from_secs(30),
            block_bytes: 64 * 1024,
            l1_slots: 1024,
            l1_classes: Vec::new(),
            l1_chunk_bytes: 0,
            l2_slots_per_file: 4096,
            l2_files: Vec::new(),
            local_agents: 0,
            remote_agents: 16,
            tiers: TierConfig::default(),
            metrics: None,
            commit_check: lake_dp::runner::pool::CommitCheck::Auto,
            transport_listen: None,
            transport_peers: Vec::new(),
            caps: fds::Caps::default(),
            rdma: None,
            l2_background_depth: 0,
            l1_load_reserve: None,
            node: 0,
            l3: None,
            summary_to: Vec::new(),
            cluster_view_blocks: 1 << 20,
            link_key: None,
            access: LocalAccess::default(),
            tenant_keys: Vec::new(),
            require_encryption: false,
            tenant_rates: Vec::new(),
            events_to_stderr: false,
            event_log: None,
            log_level: lake_dp::log::LevelFilter::INFO,
            log_format: lake_dp::log::Format::Json,
            l1_backing: crate::config::L1Backing::Shm,
            l1_lock: false,
            cores: None,
            numa_node: None,
            partitions: Vec::new(),
        }
    }
}

/// Gauges the control plane thread updates after every pass.
#[derive(Debug, Default)]
pub struct Gauges {
    /// L1 bytes held.
    pub l1_bytes: AtomicU64,
    /// L1 blocks held.
    pub l1_blocks: AtomicU64,
    /// L2 bytes held.
    pub l2_bytes: AtomicU64,
    /// L1 blocks written to L2 so far (demoted, or written ahead of demand).
    pub demotions: AtomicU64,
    /// Copies to other nodes that landed there.
    pub copies_landed: AtomicU64,
    /// This node's L1 region (`u32::MAX` until its data plane registered
    /// it) and epoch: where other nodes' copies go.
    pub l1_region: std::sync::atomic::AtomicU32,
    /// See `l1_region`.
    pub l1_epoch: AtomicU64,
}

impl Gauges {
    /// This node's L1 `(region, epoch)`, once registered.
    pub fn l1_space(&self) -> Option<(u16, u64)> {
        let region = u16::try_from(self.l1_region.load(Ordering::Acquire)).ok()?;
        Some((region, self.l1_epoch.load(Ordering::Acquire)))
    }
}

/// What the control plane's thread is asked from outside it.
#[derive(Debug)]
enum CpRequest {
    /// A copy to another node, and where its request id (or why not)
    /// goes.
    Copy(
        lake_dp::BlockKey,
        lake_dp::model::replica::ReplicaWire,
        lake_dp::Priority,
        std::sync::mpsc::SyncSender<Result<u64, crate::node::NodeError>>,
    ),
    /// A copy taken back, and whether it was still out.
    Cancel(u64, std::sync::mpsc::SyncSender<bool>),
    /// Stopping: empty L1 into L2 ([`crate::tier::Tiers::empty_l1`]).
    EmptyL1,
}

impl EmbeddedConfig {
    /// The L1 quotas of the tier manager's settings, for the data plane to
    /// hold at each save's commit: each tenant's over its namespaces, each
    /// namespace's own.
    pub fn l1_quotas(&self) -> Vec<lake_dp::runner::config::QuotaSection> {
        let tenants = self.tiers.tenant_quotas.iter().filter(|q| q.tier == lake_dp::Tier::L1Dram).map(|q| {
            lake_dp::runner::config::QuotaSection {
                name: q.tenant.clone(),
                namespaces: q.namespaces.iter().map(|n| format!("{n:016x}")).collect(),
                l1_bytes: q.bytes,
            }
        });
        let namespaces = self.tiers.quotas.iter().filter(|q| q.tier == lake_dp::Tier::L1Dram).map(|q| {
            lake_dp::runner::config::QuotaSection {
                name: format!("namespace {:016x}", q.namespace),
                namespaces: vec![format!("{:016x}", q.namespace)],
                l1_bytes: q.bytes,
            }
        });
        tenants.chain(namespaces).collect()
    }

    /// The payload bytes its L1 and L2 hold together: what it announces to
    /// the cluster as its room (its weight in placement).
    pub fn room_bytes(&self) -> u64 {
        let l1: u64 = self.l1_size_classes().map(|(payload, slots)| payload.saturating_mul(u64::from(slots))).sum();
        let largest = self.l1_size_classes().map(|(payload, _)| payload).max().unwrap_or(0);
        let l2 = (self.l2_paths().len() as u64).saturating_mul(u64::from(self.l2_slots_per_file));
        l1.saturating_add(l2.saturating_mul(largest))
    }

    /// The pool's L2 files: those configured, else two in its directory.
    pub fn l2_paths(&self) -> Vec<PathBuf> {
        if self.l2_files.is_empty() {
            vec![self.dir.join("l2-0.lake"), self.dir.join("l2-1.lake")]
        } else {
            self.l2_files.clone()
        }
    }

    /// The names of the pool's shared memory, its L1 arena (in
    /// `/dev/hugepages` on hugetlbfs) and its mirror:
    /// the same at every start on the same directory (an engine's config
    /// and an operator's scripts may name them), and no other directory's.
    pub fn shared_memory(&self) -> (PathBuf, PathBuf) {
        let dir = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let hash = blake3::hash(dir.as_os_str().as_encoded_bytes());
        let id: String = hash.as_bytes()[..8].iter().map(|b| format!("{b:02x}")).collect();
        let l1_in = match self.l1_backing {
            crate::config::L1Backing::Hugetlbfs => "/dev/hugepages",
            crate::config::L1Backing::Shm | crate::config::L1Backing::HugetlbMemfd => "/dev/shm",
        };
        (PathBuf::from(format!("{l1_in}/lake-l1-{id}")), PathBuf::from(format!("/dev/shm/lake-mirror-{id}")))
    }

    /// Checks what can be checked before anything starts: the tiers'
    /// settings, the L1 load reserve, the L2 files.
    pub fn check(&self) -> Result<(), ServeError> {
        self.tiers.validate().map_err(ServeError::Settings)?;
        self.l1_partitions().map_err(ServeError::Settings)?;
        load_reserve(self).map_err(ServeError::Settings)?;
        let paths = self.l2_paths();
        if paths.len() > 64 {
            return Err(ServeError::Settings(format!("{} L2 files: at most 64", paths.len())));
        }
        for (at, path) in paths.iter().enumerate() {
            if paths[..at].contains(path) {
                return Err(ServeError::Settings(format!("L2 file {} named twice", path.display())));
            }
        }
        Ok(())
    }
}

/// A node's data plane as its configuration describes it: what `lake
/// serve` runs on its data-plane thread, and `lake-dp` on its own.
#[derive(Debug)]
pub struct DataPlane {
    /// Its settings.
    pub runner: RunnerConfig,
    /// Its cores and NUMA node.
    pub options: RunnerOptions,
    /// What it is connected to besides its settings (no in-process agents,
    /// wake-up or stop flag yet: an embedder adds its own).
    pub ports: RunnerPorts,
    /// The tenants' data keys it seals with, changed while it runs.
    pub tenant_keys: Arc<lake_dp::auth::at_rest::TenantKeys>,
}

impl EmbeddedConfig {
    /// The pool's data plane, registering with the control plane at
    /// `cp_socket` (none: it runs alone), serving engines at `DIR/dp.sock`.
    pub fn data_plane(&self, cp_socket: Option<&Path>) -> Result<DataPlane, ServeError> {
        let load_reserve = load_reserve(self).map_err(ServeError::Settings)?;
        let (arena, _) = self.shared_memory();
        let dp = self.dir.join("dp.sock");
        let classes: Vec<String> = self
            .l1_size_classes()
            .map(|(payload, slots)| format!("{{ payload_bytes = {payload}, slots = {slots} }}"))
            .collect();
        let slot_bytes =
            self.l1_size_classes().map(|(payload, _)| lake_dp::stored::object_bytes(payload)).max().unwrap_or(0);
        let backing = match self.l1_backing {
            crate::config::L1Backing::Shm => "shm",
            crate::config::L1Backing::Hugetlbfs => "hugetlbfs",
            crate::config::L1Backing::HugetlbMemfd => "hugetlb-memfd",
        };
        let cp = cp_socket.map_or(String::new(), |cp| format!("[cp]\nsocket = {:?}\n", cp.display().to_string()));
        let mut runner = RunnerConfig::parse(&format!(
            r#"
[node]
id = {node}

[l1]
path = {arena:?}
backing = "{backing}"
classes = [{classes}]
chunk_bytes = {chunk_bytes}
lock = {lock}
agents_max = {agents}
load_reserve_slots = {load_reserve}

[l2]
paths = [{l2_paths}]
slots_per_file = {l2}
slot_bytes = {slot_bytes}
format_if_missing = true
queue_depth = 32
background_depth = {background}

[poller]
ops_max = 64
batch_max = 32
park_max_ms = 20

{cp}
[agents]
socket = {dp:?}
ports = {remote}
"#,
            arena = arena.display().to_string(),
            l2_paths =
                self.l2_paths().iter().map(|p| format!("{:?}", p.display().to_string())).collect::<Vec<_>>().join(", "),
            dp = dp.display().to_string(),
            node = self.node,
            classes = classes.join(", "),
            chunk_bytes = self.l1_chunk_bytes,
            lock = self.l1_lock,
            l2 = self.l2_slots_per_file,
            background = self.l2_background_depth,
            // Records for every port's engine, two of slack, and one for
            // the commit check's thread.
            agents = (self.local_agents + self.remote_agents.saturating_mul(RECORDS_PER_ENGINE) + 3).min(1024),
            remote = self.remote_agents.clamp(1, 1024),
        ))
        .map_err(|e| ServeError::Settings(e.to_string()))?;
        runner.l3.clone_from(&self.l3);
        runner.tenants.clone_from(&self.tenant_rates);
        runner.quotas = self.l1_quotas();
        runner.partitions = self.l1_partitions().map_err(ServeError::Settings)?;
        runner.agents.allow_uids.clone_from(&self.access.allow_uids);
        runner.agents.allow_gids.clone_from(&self.access.allow_gids);
        runner.agents.group.clone_from(&self.access.group);
        runner.agents.socket_mode = self.access.socket_mode;
        runner.agents.ports_per_uid = self.access.ports_per_uid;
        runner.agents.mirror = Some(self.shared_memory().1);
        // Checked as a whole, the settings added after the text too.
        runner.check().map_err(|e| ServeError::Settings(e.to_string()))?;
        let tenant_keys = Arc::new(lake_dp::auth::at_rest::TenantKeys::default());
        tenant_keys.change(lake_dp::auth::at_rest::KeyChange::Require(self.require_encryption));
        for (namespace, key) in &self.tenant_keys {
            tenant_keys.change(lake_dp::auth::at_rest::KeyChange::Set(*namespace, key.clone()));
        }
        let ports = RunnerPorts {
            commit_check: self.commit_check,
            transport_listen: self.transport_listen,
            transport_peers: self.transport_peers.clone(),
            transport_inbound_max: Some(self.caps.transport),
            link_key: self.link_key.clone(),
            tenant_keys: Some(Arc::clone(&tenant_keys)),
            rdma: self.rdma.clone(),
            ..RunnerPorts::default()
        };
        let options = RunnerOptions { cores: self.cores.clone(), numa_node: self.numa_node, selftest_blocks: 0 };
        Ok(DataPlane { runner, options, ports, tenant_keys })
    }
}

impl EmbeddedPool {
    /// Starts the pool; returns once engines can attach.
    pub fn start(config: &EmbeddedConfig) -> Result<Self, ServeError> {
        config.check()?;
        // Descriptors: as many as the hard limit allows, the pool's own
        // needs kept apart from its listeners'.
        let budget = fds::fit(config, lake_dp::os::raise_fd_limit()).map_err(ServeError::Settings)?;
        if budget.cut {
            tracing::warn!(
                event = "connection_caps_cut",
                fd_limit = budget.limit,
                own = budget.own,
                cp = budget.caps.server.cp,
                metrics = budget.caps.server.metrics,
                admin = budget.caps.server.admin,
                transport = budget.caps.transport,
            );
        }
        // First the directory's lock: nothing of a pool serving it is
        // touched by a second one.
        let mut created = Created::take(&config.dir)?;
        let (arena, mirror) = config.shared_memory();
        // A partitioned arena is memory no one opens by a path (no file);
        // each tenant kept apart has a mirror file of its own.
        let partitioned = !config.partitions.is_empty();
        let mut files: Vec<PathBuf> =
            [(!partitioned).then(|| arena.clone()), Some(mirror.clone())].into_iter().flatten().collect();
        files.extend(config.partitions.iter().map(|p| config.tenant_mirror(&p.tenant)));
        files.extend(config.cluster_views());
        created.record(&files.iter().map(PathBuf::as_path).collect::<Vec<_>>())?;
        let cp_socket = config.dir.join("cp.sock");
        let dp_socket = config.dir.join("dp.sock");
        let admin_socket = config.dir.join("admin.sock");
        // A killed pool of this directory left its sockets (no one serves
        // them: the lock is ours): gone before anything waits for them to
        // appear, or an engine would be sent to a dead one.
        for stale in [&cp_socket, &dp_socket, &admin_socket] {
            if std::fs::symlink_metadata(stale).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                let _ = std::fs::remove_file(stale);
            }
        }
        created.files.extend(files);
        created.files.extend([&cp_socket, &dp_socket, &admin_socket].map(|p| p.to_path_buf()));
        // L2 files this start formats (and the data plane's fence beside
        // them) go with a pool that is not durable, and with a durable one
        // whose start fails; ones it adopts stay.
        let l2 = config.l2_paths();
        let fence = l2.first().and_then(|p| p.parent()).unwrap_or(&config.dir).join(lake_dp::fence::FILE_NAME);
        let fresh: Vec<PathBuf> = l2.into_iter().chain([fence]).filter(|path| !path.exists()).collect();
        created.files.extend(fresh.iter().cloned());
        // L1 holds at most its bytes in its smallest slots, shared or not.
        let slot = |(payload, _): (u64, u32)| lake_dp::stored::object_bytes(payload);
        let l1_bytes: u64 = config.l1_size_classes().map(|c| slot(c) * u64::from(c.1)).sum();
        let smallest = config.l1_size_classes().map(slot).min().unwrap_or(1);
        let entries = (l1_bytes / smallest.max(1)).max(u64::from(config.l1_slots))
            + config.l2_paths().len() as u64 * u64::from(config.l2_slots_per_file)
            + config.l3.as_ref().map_or(0, |l3| u64::from(l3.objects));
        // The node's id in its header: an engine's cluster lookup names
        // this node for its own blocks, a router takes them for this node's.
        let table = |path| MirrorConfig { node: NodeId(config.node), ..MirrorConfig::for_entries(path, entries) };
        let writer = MirrorWriter::create(&table(MirrorBacking::Shm(mirror.clone()))).map_err(ServeError::Mirror)?;
        // Each tenant kept apart has a mirror of its own, as large (it may
        // hold as much in L2 and L3).
        let tenants = config.tenant_mirrors(&mirror).map_err(ServeError::Settings)?;
        let mut tenant_mirrors = Vec::with_capacity(tenants.len());
        for (namespaces, path) in &tenants {
            tenant_mirrors.push((
                namespaces.clone(),
                MirrorWriter::create(&table(MirrorBacking::Shm(path.clone()))).map_err(ServeError::Mirror)?,
            ));
        }
        // Checked at the start (`check`): here only its value.
        let load_reserve_slots = load_reserve(config).map_err(ServeError::Settings)?;
        // The view's changes are numbered in a term of this incarnation's own
        // (its start in ms): a restarted pool's changes are never taken
        // for the old one's by the leader's summary.
        let incarnation = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let tiers = config.tier_config().map_err(ServeError::Settings)?;
        let node = Node::new(NodeId(config.node), incarnation, Some(writer))
            .with_tiers(tiers)
            .with_tenant_mirrors(tenant_mirrors)
            .with_tenant_engines(config.tenant_engines().map_err(ServeError::Settings)?);
        let mut server = Server::bind(&cp_socket, node, 1).map_err(ServeError::io(cp_socket.display()))?;
        let beside = crate::server::Beside {
            access: config.access.of_sockets().map_err(ServeError::Settings)?,
            caps: budget.caps.server,
            admin: Some(admin_socket.clone()),
            metrics: config.metrics,
        };
        let metrics = server.serve_beside(&beside).map_err(|(what, error)| ServeError::Io { what, error })?;
        if !config.summary_to.is_empty() {
            let blocks = config.cluster_view_blocks;
            let views = config
                .cluster_view()
                .map(|_| crate::summary::link::NodeViews::create(NodeId(config.node), blocks, &mirror, &tenants))
                .transpose()
                .map_err(ServeError::Mirror)?;
            let kept_apart = config.kept_apart().map_err(ServeError::Settings)?;
            server.report_to(config.summary_to.clone(), config.link_key.clone(), views, &kept_apart);
        }
        let gauges = Arc::new(Gauges { l1_region: std::sync::atomic::AtomicU32::new(u32::MAX), ..Gauges::default() });
        let stop_cp = Arc::new(AtomicBool::new(false));
        let (requests, asked) = std::sync::mpsc::channel::<CpRequest>();
        let draining = Arc::new(AtomicBool::new(false));
        let cp = {
            let (gauges, stop, drain) = (Arc::clone(&gauges), Arc::clone(&stop_cp), Arc::clone(&draining));
            std::thread::Builder::new()
                .name("lake-cp".into())
                .spawn(move || -> std::io::Result<Server> {
                    // Failed tier commands so far, as last logged (once a
                    // second at most).
                    let (mut failed_logged, mut next_log) = (0, std::time::Instant::now());
                    while !stop.load(Ordering::Acquire) {
                        while let Ok(request) = asked.try_recv() {
                            match request {
                                CpRequest::Copy(key, to, priority, reply) => {
                                    let copied = server.node_mut().copy_to(&key, to, priority);
                                    let _ = reply.send(copied);
                                }
                                CpRequest::Cancel(request, reply) => {
                                    let _ = reply.send(server.node_mut().cancel_copy(request));
                                }
                                CpRequest::EmptyL1 => server.node_mut().tiers.empty_l1(),
                            }
                        }
                        let draining = drain.load(Ordering::Relaxed);
                        if server.node().draining != draining {
                            server.node_mut().set_draining(draining);
                        }
                        server.poll_once(Some(Duration::from_millis(2)))?;
                        for why in server.take_refusals() {
                            tracing::warn!(event = "cp_refused", why = %why);
                        }
                        let counters = server.node().tiers.counters;
                        if counters.failed > failed_logged && std::time::Instant::now() >= next_log {
                            next_log = std::time::Instant::now() + Duration::from_secs(1);
                            let refused: serde_json::Map<String, serde_json::Value> =
                                lake_dp::wire::message::ErrorCode::ALL
                                    .iter()
                                    .filter(|&&code| counters.refused[code as usize] > 0)
                                    .map(|&code| (code.name().to_owned(), counters.refused[code as usize].into()))
                                    .collect();
                            tracing::warn!(
                                event = "tier_commands_failed",
                                commands = counters.failed - failed_logged,
                                total = counters.failed,
                                refused = %serde_json::Value::Object(refused)
                            );
                            failed_logged = counters.failed;
                        }
                        let node = server.node();
                        let l1 = node.tiers.usage(Tier::L1Dram);
                        gauges.l1_bytes.store(l1.bytes, Ordering::Relaxed);
                        gauges.l1_blocks.store(l1.blocks, Ordering::Relaxed);
                        gauges.l2_bytes.store(node.tiers.usage(Tier::L2Nvme).bytes, Ordering::Relaxed);
                        gauges
                            .demotions
                            .store(node.tiers.counters.demotions + node.tiers.counters.cleanings, Ordering::Relaxed);
                        gauges.copies_landed.store(node.copies_landed, Ordering::Relaxed);
                        if let Some((region, info)) = node.locations.region_of(node.node(), Tier::L1Dram) {
                            // The epoch first: a reader that sees the region
                            // (Acquire) sees the epoch that goes with it.
                            gauges.l1_epoch.store(info.epoch, Ordering::Relaxed);
                            gauges.l1_region.store(u32::from(region), Ordering::Release);
                        }
                    }
                    Ok(server)
                })
                .map_err(ServeError::io("the control plane's thread"))?
        };
        let wakeup = Arc::new(Wakeup::new().map_err(ServeError::io("eventfd"))?);
        let mut local_ports = Vec::new();
        let mut dp_ports = Vec::new();
        for _ in 0..config.local_agents {
            let (agent_port, dp_port) = port(256, Arc::clone(&wakeup));
            local_ports.push(agent_port);
            dp_ports.push(dp_port);
        }
        let stop_dp = Arc::new(AtomicBool::new(false));
        let DataPlane { runner, options, mut ports, tenant_keys } = config.data_plane(Some(&cp_socket))?;
        ports.agents = dp_ports;
        ports.transport_inbound_max = Some(budget.caps.transport);
        ports.wakeup = Some(wakeup);
        ports.stop = Some(Arc::clone(&stop_dp));
        let close_saves = Arc::new(AtomicBool::new(false));
        ports.close_saves = Some(Arc::clone(&close_saves));
        // The data plane's events (refused links and agents, L3 scans,
        // traced loads) and final figures go to the log file, or stderr,
        // where asked: its thread's own subscriber writes them there.
        let out: Box<dyn std::io::Write + Send> = match &config.event_log {
            Some(path) => Box::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(ServeError::io(format!("event log {}", path.display())))?,
            ),
            None if config.events_to_stderr => Box::new(std::io::stderr()),
            None => Box::new(std::io::sink()),
        };
        let (log_level, log_format) = (config.log_level, config.log_format);
        let dp = std::thread::Builder::new()
            .name("lake-dp".into())
            .spawn(move || {
                let mut sink = lake_dp::log::Sink::new(out);
                let events = lake_dp::log::subscriber(sink.clone(), log_level, log_format);
                tracing::subscriber::with_default(events, || run_with(&runner, &options, ports, &mut sink))
            })
            .map_err(ServeError::io("the data plane's thread"))?;
        let mut pool = Self {
            dir: config.dir.clone(),
            arena,
            mirror,
            cp_socket,
            dp_socket,
            admin_socket,
            metrics,
            local_ports,
            gauges,
            tenant_keys,
            stop_cp,
            stop_dp,
            close_saves,
            requests,
            draining,
            load_reserve_slots,
            cp: Some(cp),
            dp: Some(dp),
            durable: config.durable,
            stop_flush: config.stop_flush,
            emptied: false,
            created,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        // Ready once engines can attach and the data plane has registered
        // its L1 with the control plane (its files opened).
        while std::fs::metadata(&pool.dp_socket).is_err() || pool.gauges.l1_space().is_none() {
            if pool.dp.as_ref().is_some_and(JoinHandle::is_finished) || Instant::now() > deadline {
                return Err(match pool.dp.take().map(JoinHandle::join) {
                    Some(Ok(Err(e))) => ServeError::DataPlane(e),
                    Some(Err(_)) => ServeError::Panicked(Plane::Data),
                    _ => ServeError::Stopped(Plane::Data),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if config.durable {
            // Serving: the L2 files it formatted are the pool's, for every
            // start after this one.
            pool.created.files.retain(|file| !fresh.contains(file));
        }
        Ok(pool)
    }

    /// Asks this node to copy block `key` (its L1 replica) into any slot of
    /// another node's L1 `to` (node, region, epoch; see
    /// [`Node::copy_to`]); returns the request id.
    pub fn copy_to(
        &self,
        key: &lake_dp::BlockKey,
        to: lake_dp::model::replica::ReplicaWire,
        priority: lake_dp::Priority,
    ) -> Result<u64, ServeError> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        let request = CpRequest::Copy(*key, to, priority, reply);
        self.requests.send(request).map_err(|_| ServeError::Stopped(Plane::Control))?;
        answer.recv_timeout(Duration::from_secs(10)).map_err(|_| ServeError::NoAnswer)?.map_err(ServeError::Refused)
    }

    /// Takes back copy `request` ([`EmbeddedPool::copy_to`]; see
    /// [`Node::cancel_copy`]): whether it was still out.
    pub fn cancel_copy(&self, request: u64) -> Result<bool, ServeError> {
        let (reply, answer) = std::sync::mpsc::sync_channel(1);
        self.requests.send(CpRequest::Cancel(request, reply)).map_err(|_| ServeError::Stopped(Plane::Control))?;
        answer.recv_timeout(Duration::from_secs(10)).map_err(|_| ServeError::NoAnswer)
    }

    /// Why the pool can no longer serve, if a plane of it stopped on its
    /// own (an error after the start: a file gone bad, its socket taken).
    pub fn failed(&mut self) -> Option<ServeError> {
        if self.dp.as_ref().is_some_and(JoinHandle::is_finished) {
            return Some(match self.dp.take().map(JoinHandle::join) {
                Some(Ok(Err(e))) => ServeError::DataPlane(e),
                Some(Ok(Ok(_))) | None => ServeError::Stopped(Plane::Data),
                Some(Err(_)) => ServeError::Panicked(Plane::Data),
            });
        }
        if self.cp.as_ref().is_some_and(JoinHandle::is_finished) {
            return Some(match self.cp.take().map(JoinHandle::join) {
                Some(Ok(Err(e))) => ServeError::ControlPlane(e),
                Some(Ok(Ok(_))) | None => ServeError::Stopped(Plane::Control),
                Some(Err(_)) => ServeError::Panicked(Plane::Control),
            });
        }
        None
    }

    /// A durable pool's L1 written down to L2 before it stops, within
    /// `stop_flush`: (blocks left in L1 — volatile, lost at stop — and
    /// the time it took).
    pub fn empty_l1(&mut self) -> (u64, Duration) {
        self.emptied = true;
        // A save taken from here would be acked and then lost with L1:
        // engines are told the pool is stopping instead.
        self.close_saves.store(true, Ordering::Release);
        let started = Instant::now();
        if self.requests.send(CpRequest::EmptyL1).is_err() {
            return (self.gauges.l1_blocks.load(Ordering::Relaxed), started.elapsed());
        }
        // The control plane plans the moves in passes; a pass with nothing
        // left to move may still see its last moves land.
        let mut left = self.gauges.l1_blocks.load(Ordering::Relaxed);
        let mut progress = Instant::now();
        while started.elapsed() < self.stop_flush {
            std::thread::sleep(Duration::from_millis(20));
            let now = self.gauges.l1_blocks.load(Ordering::Relaxed);
            if now == 0 {
                return (0, started.elapsed());
            }
            if now < left {
                progress = Instant::now();
            }
            left = now;
            // Nothing moved for a while: what is left cannot go (no L2
            // room, blocks held by engines).
            if progress.elapsed() > Duration::from_secs(5) {
                break;
            }
        }
        (left, started.elapsed())
    }

    /// Stops the pool: a durable one first writes L1 down to L2
    /// ([`EmbeddedPool::empty_l1`], unless that was called); then the data
    /// plane (drained, flushed, clean) and the control plane. Returns their
    /// final state. What the pool created and does not keep is removed.
    pub fn stop(mut self) -> Result<(RunnerStats, Server), ServeError> {
        if self.durable && !self.emptied && self.gauges.l1_space().is_some() {
            self.empty_l1();
        }
        self.stop_dp.store(true, Ordering::Release);
        let stats = match self.dp.take().map(JoinHandle::join) {
            Some(Ok(result)) => result.map_err(ServeError::DataPlane)?,
            Some(Err(_)) => return Err(ServeError::Panicked(Plane::Data)),
            None => return Err(ServeError::Stopped(Plane::Data)),
        };
        self.stop_cp.store(true, Ordering::Release);
        let server = match self.cp.take().map(JoinHandle::join) {
            Some(Ok(result)) => result.map_err(ServeError::ControlPlane)?,
            Some(Err(_)) => return Err(ServeError::Panicked(Plane::Control)),
            None => return Err(ServeError::Stopped(Plane::Control)),
        };
        Ok((stats, server))
    }
}

impl Drop for EmbeddedPool {
    fn drop(&mut self) {
        self.stop_dp.store(true, Ordering::Release);
        if let Some(dp) = self.dp.take() {
            let _ = dp.join();
        }
        self.stop_cp.store(true, Ordering::Release);
        if let Some(cp) = self.cp.take() {
            let _ = cp.join();
        }
        // Then `created` goes: what the pool made and does not keep.
    }
}
