//! The data plane's settings, resolved: what [`crate::runner::run`] runs
//! from. Operators do not write these: the node's `lake.toml` (`lake serve`'s
//! and the `lake-dp` binary's one schema, `lake_cp::config`) is turned into
//! them. They read from TOML too, sectioned as below, for embedders and
//! tests that build a data plane by hand. Unknown fields are errors, and
//! every error names the field.
//!
//! ```toml
//! [node]
//! id = 0
//! numa_node = 0            # optional: bind memory and the arena here
//! cores = [2]              # optional: the poll thread's core (--cores)
//!
//! [l1]
//! path = "/dev/shm/lake-l1-node0"
//! backing = "shm"          # "shm" | "hugetlbfs" | "hugetlb-memfd"
//! classes = [{ payload_bytes = "2304KiB", slots = 1024 }]  # sizes: bytes or units
//! agents_max = 64
//! pins_per_agent = 4096
//! lock = true
//! # chunk_bytes = 9453568  # optional: classes share the arena in chunks
//!
//! [l2]
//! paths = ["/nvme0/lake/l2-0.lake", "/nvme1/lake/l2-1.lake"]
//! slots_per_file = 4096
//! slot_bytes = "2308KiB"
//! region_first = 1
//! format_if_missing = true
//! queue_depth = 64
//!
//! [l3]                     # optional: the object store tier
//! dir = "/var/lib/lake/l3" # a directory, or an S3-compatible service:
//! # endpoint = "http://10.0.0.5:9000"
//! # bucket = "lake"
//! # region_name = "us-east-1"
//! # access_key, secret_key  # else $LAKE_S3_ACCESS_KEY, $LAKE_S3_SECRET_KEY
//! # create_bucket = false
//! prefix = "lake"          # object names: {prefix}/{namespace}/{key}
//! region = 1023            # the L3 region's id
//! objects = 65536          # the catalog: objects this node tracks
//! workers = 4              # store calls in flight (threads, off the poll core)
//! queue_depth = 64
//! attempts = 4             # tries of a call that fails transiently
//! backoff_ms = 20          # the first retry's wait (doubling)
//!
//! [agents]
//! socket = "/run/lake/dp0.sock"  # optional: engines in other processes
//! ports = 16               # agents attached at once
//! depth = 256              # requests in flight per agent
//!
//! [poller]
//! ops_max = 256
//! batch_max = 32
//! io_retries_max = 2
//! flush_delay_us = 200
//! flush_batch = 16
//! spin_us = 50             # idle spin before parking
//! park_max_ms = 100        # longest park with nothing in flight
//! drain_timeout_ms = 30000 # SIGTERM: longest wait for in-flight work
//!
//! [[tenants]]              # optional, any number: bandwidth caps
//! name = "batch"
//! namespaces = ["e6c40168c202f6d1"]
//! l2_read_bytes_per_s = "200MB"     # each cap optional
//! l2_write_bytes_per_s = "100MB"
//! l3_read_bytes_per_s = 50000000
//! l3_write_bytes_per_s = 50000000
//! ```

use std::path::PathBuf;

use serde::Deserialize;

use crate::arena::ArenaConfig;
use crate::l2::L2Config;
use crate::model::replica::{NodeId, RegionId};
use crate::region::SlotClass;

mod partitions;
pub use self::partitions::{PartitionSection, Partitions};

/// Why a configuration was refused.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl core::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "config: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}

fn bad(field: &str, why: &str) -> ConfigError {
    ConfigError(format!("{field}: {why}"))
}

/// A count of bytes: `65536`, `64KiB`, `2MiB`, `1GB`. Units with `i` are
/// powers of 1024, without powers of 1000; no fractions. The one reading
/// of sizes for this file and `lake serve`'s.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 =
        number.parse().map_err(|_| format!("{text:?}: a whole number of bytes, with an optional unit (2MiB)"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        "TiB" | "T" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => return Err(format!("{text:?}: unit {other:?} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
    };
    number.checked_mul(scale).ok_or_else(|| format!("{text:?}: more bytes than 64 bits hold"))
}

/// A size in the file: a number of bytes, or a string with a unit.
#[derive(Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

impl Size {
    fn bytes<E: serde::de::Error>(self) -> Result<u64, E> {
        match self {
            Self::Bytes(bytes) => Ok(bytes),
            Self::Text(text) => parse_bytes(&text).map_err(E::custom),
        }
    }
}

fn size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    Size::deserialize(d)?.bytes()
}

fn optional_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<Size>::deserialize(d)?.map(Size::bytes).transpose()
}

/// `[node]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Node id in the pool.
    pub id: u32,
    /// NUMA node to bind to.
    pub numa_node: Option<u32>,
    /// Cores the poll thread may run on (the first is used).
    #[serde(default)]
    pub cores: Vec<usize>,
}

/// One size class of `[l1]`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ClassEntry {
    /// Payload bytes of a block of this class (the slot adds its 4 KiB
    /// header and rounds up to 4 KiB); a size (`2MiB`).
    #[serde(deserialize_with = "size")]
    pub payload_bytes: u64,
    /// Slots of this class.
    pub slots: u32,
}

/// `[l1]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct L1Section {
    /// The arena file (unused for `hugetlb-memfd`).
    pub path: PathBuf,
    /// `shm`, `hugetlbfs` or `hugetlb-memfd`.
    #[serde(default = "default_backing")]
    pub backing: String,
    /// Size classes.
    pub classes: Vec<ClassEntry>,
    /// Agent records.
    #[serde(default = "default_agents")]
    pub agents_max: u32,
    /// Pins per agent.
    #[serde(default = "default_pins")]
    pub pins_per_agent: u32,
    /// mlock the arena.
    #[serde(default = "default_true")]
    pub lock: bool,
    /// The last free slots of each class that engines' saves may not
    /// take, kept for loads (0: none). Keep `lake-cp`'s high-water mark
    /// below what saves can then fill, or it never demotes.
    #[serde(default)]
    pub load_reserve_slots: u32,
    /// Let the classes share the arena in chunks of this many bytes (a
    /// multiple of 4096, at least the largest slot; several slots of it
    /// waste less of each chunk): a class short of slots takes a chunk no
    /// other class holds a block in. The classes' `slots` then size the
    /// arena (their bytes summed), not each class. 0 (the default): each
    /// class owns its slots, an arena every earlier agent attaches to.
    #[serde(default, deserialize_with = "size")]
    pub chunk_bytes: u64,
}

/// `[l2]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct L2Section {
    /// One file per path.
    pub paths: Vec<PathBuf>,
    /// Slots per file.
    pub slots_per_file: u32,
    /// Bytes per slot; a size.
    #[serde(deserialize_with = "size")]
    pub slot_bytes: u64,
    /// Region id of the first file.
    #[serde(default = "default_region_first")]
    pub region_first: u16,
    /// Format the files when none exists yet.
    #[serde(default)]
    pub format_if_missing: bool,
    /// io_uring entries.
    #[serde(default = "default_queue_depth")]
    pub queue_depth: u32,
    /// Write-back, demotion and replication I/O in the device at once, at
    /// most (0: no cap, up to `queue_depth`): the rest of the queue stays
    /// for loads a request waits on.
    #[serde(default)]
    pub background_depth: u32,
}

/// `[l3]`: the object store tier.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct L3Section {
    /// A directory as the store.
    pub dir: Option<PathBuf>,
    /// Or an S3-compatible service (`http://host:port`)...
    pub endpoint: Option<String>,
    /// ...and its bucket.
    pub bucket: Option<String>,
    /// The region name the service expects.
    #[serde(default = "default_s3_region")]
    pub region_name: String,
    /// Access key id (else `$LAKE_S3_ACCESS_KEY`).
    pub access_key: Option<String>,
    /// Secret key (else `$LAKE_S3_SECRET_KEY`).
    pub secret_key: Option<String>,
    /// Create the bucket at start if it is missing.
    #[serde(default)]
    pub create_bucket: bool,
    /// Object names start with this.
    #[serde(default = "default_l3_prefix")]
    pub prefix: String,
    /// The L3 region's id.
    #[serde(default = "default_l3_region")]
    pub region: u16,
    /// Objects the catalog holds.
    #[serde(default = "default_l3_objects")]
    pub objects: u32,
    /// Store calls in flight at once (worker threads).
    #[serde(default = "default_l3_workers")]
    pub workers: u32,
    /// Requests queued or in flight at most.
    #[serde(default = "default_l3_queue")]
    pub queue_depth: u32,
    /// Tries of a call that fails transiently.
    #[serde(default = "default_l3_attempts")]
    pub attempts: u32,
    /// The first retry's wait (each next one doubles it).
    #[serde(default = "default_l3_backoff")]
    pub backoff_ms: u64,
}

impl L3Section {
    /// A directory store with the defaults.
    pub fn dir(dir: PathBuf) -> Self {
        Self { dir: Some(dir), ..Self::none() }
    }

    /// The defaults, naming no store yet (set `dir`, or `endpoint` and
    /// `bucket`).
    pub fn none() -> Self {
        Self {
            dir: None,
            endpoint: None,
            bucket: None,
            region_name: default_s3_region(),
            access_key: None,
            secret_key: None,
            create_bucket: false,
            prefix: default_l3_prefix(),
            region: default_l3_region(),
            objects: default_l3_objects(),
            workers: default_l3_workers(),
            queue_depth: default_l3_queue(),
            attempts: default_l3_attempts(),
            backoff_ms: default_l3_backoff(),
        }
    }

    /// The S3 service this names, if it names one (credentials from the
    /// file, else from the environment).
    pub fn s3(&self) -> Result<Option<crate::l3::s3::S3Config>, ConfigError> {
        let Some(endpoint) = &self.endpoint else { return Ok(None) };
        let bucket = self.bucket.clone().ok_or_else(|| bad("l3.bucket", "needed with l3.endpoint"))?;
        let from_env = |field: &Option<String>, var: &str, name: &str| {
            field.clone().or_else(|| std::env::var(var).ok()).ok_or_else(|| bad(name, &format!("not set, nor ${var}")))
        };
        Ok(Some(crate::l3::s3::S3Config {
            endpoint: endpoint.clone(),
            region: self.region_name.clone(),
            bucket,
            access_key: from_env(&self.access_key, "LAKE_S3_ACCESS_KEY", "l3.access_key")?,
            secret_key: from_env(&self.secret_key, "LAKE_S3_SECRET_KEY", "l3.secret_key")?,
        }))
    }

    /// The client's settings.
    pub fn client(&self) -> crate::l3::L3Config {
        crate::l3::L3Config {
            workers: self.workers as usize,
            queue_depth: self.queue_depth as usize,
            attempts: self.attempts,
            backoff: std::time::Duration::from_millis(self.backoff_ms),
        }
    }

    fn check(&self, l2: &L2Section) -> Result<(), ConfigError> {
        match (&self.dir, &self.endpoint) {
            (Some(_), None) => {}
            (None, Some(_)) => {
                self.s3()?;
            }
            _ => return Err(bad("l3", "one of l3.dir or l3.endpoint")),
        }
        if self.prefix.is_empty() || self.prefix.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
            return Err(bad("l3.prefix", "a plain name (parts separated by /)"));
        }
        let first = usize::from(l2.region_first);
        let l2_regions = first..first + l2.paths.len();
        if self.region == 0 || l2_regions.contains(&usize::from(self.region)) {
            return Err(bad("l3.region", "taken by L1 (0) or an L2 file"));
        }
        if u32::from(self.region) >= crate::constants::MIRROR_REGIONS_MAX {
            return Err(bad("l3.region", "below the mirror's region count (1024)"));
        }
        if self.objects == 0 || self.objects > 1 << 24 {
            return Err(bad("l3.objects", "1 to 16777216"));
        }
        if !(1..=64).contains(&self.workers) {
            return Err(bad("l3.workers", "1 to 64"));
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return Err(bad("l3.queue_depth", "1 to 4096"));
        }
        if self.attempts == 0 {
            return Err(bad("l3.attempts", "at least 1"));
        }
        Ok(())
    }
}

fn default_s3_region() -> String {
    "us-east-1".into()
}
fn default_l3_prefix() -> String {
    "lake".into()
}
fn default_l3_region() -> u16 {
    1023
}
fn default_l3_objects() -> u32 {
    65_536
}
fn default_l3_workers() -> u32 {
    4
}
fn default_l3_queue() -> u32 {
    64
}
fn default_l3_attempts() -> u32 {
    4
}
fn default_l3_backoff() -> u64 {
    20
}

/// `[poller]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PollerSection {
    /// Operation slots.
    #[serde(default = "default_ops")]
    pub ops_max: u32,
    /// Items per stage per pass.
    #[serde(default = "default_batch")]
    pub batch_max: u32,
    /// Resubmissions after a short transfer or EAGAIN.
    #[serde(default = "default_retries")]
    pub io_retries_max: u8,
    /// Longest a durable write waits for a batched fdatasync.
    #[serde(default = "default_flush_delay")]
    pub flush_delay_us: u64,
    /// Durable writes that trigger an fdatasync at once.
    #[serde(default = "default_flush_batch")]
    pub flush_batch: u32,
    /// Idle spin before parking.
    #[serde(default = "default_spin")]
    pub spin_us: u64,
    /// Longest park with nothing in flight.
    #[serde(default = "default_park")]
    pub park_max_ms: u64,
    /// On SIGTERM, the longest wait for in-flight work.
    #[serde(default = "default_drain")]
    pub drain_timeout_ms: u64,
}

impl Default for PollerSection {
    fn default() -> Self {
        Self {
            ops_max: default_ops(),
            batch_max: default_batch(),
            io_retries_max: default_retries(),
            flush_delay_us: default_flush_delay(),
            flush_batch: default_flush_batch(),
            spin_us: default_spin(),
            park_max_ms: default_park(),
            drain_timeout_ms: default_drain(),
        }
    }
}

fn default_backing() -> String {
    "shm".into()
}
fn default_agents() -> u32 {
    64
}
fn default_pins() -> u32 {
    4096
}
fn default_true() -> bool {
    true
}
fn default_region_first() -> u16 {
    1
}
fn default_queue_depth() -> u32 {
    64
}
fn default_ops() -> u32 {
    256
}
fn default_batch() -> u32 {
    32
}
fn default_retries() -> u8 {
    2
}
fn default_flush_delay() -> u64 {
    200
}
fn default_flush_batch() -> u32 {
    16
}
fn default_spin() -> u64 {
    50
}
fn default_park() -> u64 {
    100
}
fn default_drain() -> u64 {
    30_000
}

/// The whole file.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RunnerConfig {
    /// `[node]`.
    pub node: NodeSection,
    /// `[l1]`.
    pub l1: L1Section,
    /// `[l2]`.
    pub l2: L2Section,
    /// `[poller]`.
    #[serde(default)]
    pub poller: PollerSection,
    /// `[cp]`: the node's `lake-cp` (none: run alone).
    #[serde(default)]
    pub cp: CpSection,
    /// `[agents]`: engines in other processes attach here.
    #[serde(default)]
    pub agents: AgentsSection,
    /// `[l3]`: the object store tier (none: no L3).
    #[serde(default)]
    pub l3: Option<L3Section>,
    /// `[[tenants]]`: per-tenant bandwidth caps on this node's tiers.
    #[serde(default)]
    pub tenants: Vec<TenantSection>,
    /// `[[quotas]]`: L1 byte ceilings held at admission.
    #[serde(default)]
    pub quotas: Vec<QuotaSection>,
    /// `[[partitions]]`: tenants whose L1 blocks lie in memory only their
    /// own users' engines map.
    #[serde(default)]
    pub partitions: Vec<PartitionSection>,
}

/// One `[[quotas]]` entry: the L1 bytes some namespaces (16 hex digits
/// each: one namespace's own quota, or a tenant's over all of its) may
/// hold together. A save that would take them past it is refused at its
/// commit (`OverQuota`); the control plane keeps them under it by
/// demoting their own coldest blocks (give it the same quota).
///
/// ```toml
/// [[quotas]]
/// name = "acme"
/// namespaces = ["e6c40168c202f6d1", "0b5b0c6e5f0c7a11"]
/// l1_bytes = "8GiB"
/// ```
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QuotaSection {
    /// Its name (logs, metrics).
    pub name: String,
    /// Its namespace ids, in hex.
    pub namespaces: Vec<String>,
    /// L1 bytes they may hold together.
    #[serde(deserialize_with = "size")]
    pub l1_bytes: u64,
}

/// Namespace ids written in hex; errors name `field`.
fn hex_namespaces(texts: &[String], field: &str) -> Result<Vec<u64>, ConfigError> {
    texts
        .iter()
        .map(|text| {
            u64::from_str_radix(text, 16)
                .map_err(|_| ConfigError(format!("{field}: {text:?} is not a namespace id in hex")))
        })
        .collect()
}

impl QuotaSection {
    /// The quota as the data plane keeps it; errors name the field.
    pub fn quota(&self, index: usize) -> Result<crate::quota::L1Quota, ConfigError> {
        let field = |what: &str| format!("quotas[{index}].{what}");
        if self.name.is_empty() {
            return Err(ConfigError(format!("{}: must not be empty", field("name"))));
        }
        if self.namespaces.is_empty() {
            return Err(ConfigError(format!("{}: at least one", field("namespaces"))));
        }
        if self.l1_bytes == 0 {
            return Err(ConfigError(format!("{}: at least 1", field("l1_bytes"))));
        }
        let namespaces = hex_namespaces(&self.namespaces, &field("namespaces"))?;
        Ok(crate::quota::L1Quota { name: self.name.clone(), namespaces, bytes: self.l1_bytes })
    }
}

/// One `[[tenants]]` entry: a tenant's bandwidth caps, over its
/// namespaces (16 hex digits each), in bytes per second; a cap left out
/// is none.
///
/// ```toml
/// [[tenants]]
/// name = "batch"
/// namespaces = ["e6c40168c202f6d1"]
/// l2_read_bytes_per_s = 200000000
/// l2_write_bytes_per_s = 100000000
/// ```
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TenantSection {
    /// Its name.
    pub name: String,
    /// Its namespace ids, in hex.
    pub namespaces: Vec<String>,
    /// Bytes read from L2 per second at most.
    #[serde(default, deserialize_with = "optional_size")]
    pub l2_read_bytes_per_s: Option<u64>,
    /// Bytes written to L2 per second at most.
    #[serde(default, deserialize_with = "optional_size")]
    pub l2_write_bytes_per_s: Option<u64>,
    /// Bytes read from L3 per second at most.
    #[serde(default, deserialize_with = "optional_size")]
    pub l3_read_bytes_per_s: Option<u64>,
    /// Bytes written to L3 per second at most.
    #[serde(default, deserialize_with = "optional_size")]
    pub l3_write_bytes_per_s: Option<u64>,
    /// Bytes sent to other nodes per second at most (copies over the
    /// storage network).
    #[serde(default, deserialize_with = "optional_size")]
    pub net_send_bytes_per_s: Option<u64>,
    /// Bytes its engines push to other nodes per second at most (P→D and
    /// D→P over the compute network): each agent attached here is told
    /// and holds its pushes to it.
    #[serde(default, deserialize_with = "optional_size")]
    pub push_bytes_per_s: Option<u64>,
    /// Bytes other nodes and engines may send into this node per second
    /// at most (copies, P→D and D→P pushes over TCP): a sender that names
    /// the block's namespace in its reservation (this build's) is told to
    /// ask again later and holds the block meanwhile.
    #[serde(default, deserialize_with = "optional_size")]
    pub net_receive_bytes_per_s: Option<u64>,
}

impl TenantSection {
    /// The caps as the data plane keeps them; errors name the field.
    pub fn rate(&self, index: usize) -> Result<crate::rates::TenantRate, ConfigError> {
        let field = |what: &str| format!("tenants[{index}].{what}");
        if self.name.is_empty() {
            return Err(ConfigError(format!("{}: must not be empty", field("name"))));
        }
        if self.name.len() > crate::wire::message::TENANT_NAME_BYTES || self.name.contains('\0') {
            return Err(ConfigError(format!(
                "{}: at most {} bytes, no NUL",
                field("name"),
                crate::wire::message::TENANT_NAME_BYTES
            )));
        }
        if self.namespaces.is_empty() {
            return Err(ConfigError(format!("{}: at least one", field("namespaces"))));
        }
        let namespaces = hex_namespaces(&self.namespaces, &field("namespaces"))?;
        let caps = [
            ("l2_read_bytes_per_s", self.l2_read_bytes_per_s),
            ("l2_write_bytes_per_s", self.l2_write_bytes_per_s),
            ("l3_read_bytes_per_s", self.l3_read_bytes_per_s),
            ("l3_write_bytes_per_s", self.l3_write_bytes_per_s),
            ("net_send_bytes_per_s", self.net_send_bytes_per_s),
            ("net_receive_bytes_per_s", self.net_receive_bytes_per_s),
        ];
        for (name, cap) in caps.iter().copied().chain([("push_bytes_per_s", self.push_bytes_per_s)]) {
            if cap == Some(0) {
                return Err(ConfigError(format!("{}: at least 1 (leave it out for no cap)", field(name))));
            }
        }
        Ok(crate::rates::TenantRate { name: self.name.clone(), namespaces, bytes_per_s: caps.map(|(_, cap)| cap) })
    }
}

/// `[agents]`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AgentsSection {
    /// The Unix socket agents attach on (none: in-process agents only).
    pub socket: Option<PathBuf>,
    /// Agents attached at once, at most.
    #[serde(default = "default_ports")]
    pub ports: u32,
    /// Requests in flight per agent (a power of two).
    #[serde(default = "default_port_depth")]
    pub depth: u32,
    /// Users who may attach, by the credentials the kernel gives for the
    /// connection (`SO_PEERCRED`), besides this process's own user and
    /// root, who always may.
    #[serde(default)]
    pub allow_uids: Vec<u32>,
    /// Groups who may attach (the peer's effective group).
    #[serde(default)]
    pub allow_gids: Vec<u32>,
    /// The group the socket file is given (a name or a number), if any.
    #[serde(default)]
    pub group: Option<String>,
    /// The socket file's mode (default `0o600`; `0o660` with a group).
    #[serde(default)]
    pub socket_mode: Option<u32>,
    /// Ports one user may hold at once (none: all of them). Where engines
    /// of several users share a pool, each kept from taking every port.
    #[serde(default)]
    pub ports_per_uid: Option<u32>,
    /// The mirror file its control plane writes: opened here and passed
    /// to each agent as it attaches, so the file can stay this user's
    /// alone (none: agents open the mirror by the path they are given).
    #[serde(default)]
    pub mirror: Option<PathBuf>,
}

impl Default for AgentsSection {
    fn default() -> Self {
        Self {
            socket: None,
            ports: default_ports(),
            depth: default_port_depth(),
            allow_uids: Vec::new(),
            allow_gids: Vec::new(),
            group: None,
            socket_mode: None,
            ports_per_uid: None,
            mirror: None,
        }
    }
}

impl AgentsSection {
    /// The socket file's group id, its mode, and who may attach.
    pub fn access(&self) -> Result<(Option<u32>, u32, crate::auth::PeerPolicy), ConfigError> {
        let gid = match &self.group {
            Some(name) => {
                Some(crate::auth::peer::group_id(name).map_err(|e| ConfigError(format!("agents.group: {e}")))?)
            }
            None => None,
        };
        let mode = self.socket_mode.unwrap_or(if gid.is_some() { 0o660 } else { 0o600 });
        if mode & !0o777 != 0 {
            return Err(ConfigError(format!("agents.socket_mode {mode:o}: permission bits only (0o600, 0o660)")));
        }
        Ok((gid, mode, crate::auth::PeerPolicy::of(&self.allow_uids, &self.allow_gids)))
    }
}

fn default_ports() -> u32 {
    16
}

fn default_port_depth() -> u32 {
    256
}

/// `[cp]`.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CpSection {
    /// The Unix socket `lake-cp` listens on for its `lake-dp`s.
    pub socket: Option<PathBuf>,
    /// How long to wait for its hello answer at start (ms).
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
}

fn default_connect_timeout_ms() -> u64 {
    5000
}

impl RunnerConfig {
    /// Parses and checks a config; errors name the field (and, for syntax,
    /// the line).
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError(e.to_string().trim_end().to_owned()))?;
        config.check()?;
        Ok(config)
    }

    /// Checks the values (what [`RunnerConfig::parse`] does after
    /// parsing); the error names the field.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.agents.ports == 0 || self.agents.ports > 1024 {
            return Err(bad("agents.ports", "must be 1 to 1024"));
        }
        if !self.agents.depth.is_power_of_two() || self.agents.depth > crate::agent::shm::DEPTH_MAX {
            return Err(bad("agents.depth", "must be a power of two up to 65536"));
        }
        let backings = ["shm", "hugetlbfs", "hugetlb-memfd"];
        if !backings.contains(&self.l1.backing.as_str()) {
            return Err(bad("l1.backing", "one of \"shm\", \"hugetlbfs\", \"hugetlb-memfd\""));
        }
        if !self.l1.chunk_bytes.is_multiple_of(4096) || self.l1.chunk_bytes > u64::from(u32::MAX) {
            return Err(bad("l1.chunk_bytes", "0, or a multiple of 4096 below 4 GiB"));
        }
        if self.l1.classes.is_empty() || self.l1.classes.len() > crate::constants::SLOT_CLASSES_MAX {
            return Err(bad("l1.classes", "between 1 and 8 size classes"));
        }
        for (i, class) in self.l1.classes.iter().enumerate() {
            if class.payload_bytes == 0 || class.payload_bytes > crate::constants::STORED_PAYLOAD_BYTES_MAX {
                return Err(ConfigError(format!("l1.classes[{i}].payload_bytes: between 1 and 4 GiB")));
            }
            if class.slots == 0 {
                return Err(ConfigError(format!("l1.classes[{i}].slots: at least 1")));
            }
            let slot_bytes = crate::stored::object_bytes(class.payload_bytes);
            if self.l1.chunk_bytes != 0 && slot_bytes > self.l1.chunk_bytes {
                return Err(ConfigError(format!(
                    "l1.chunk_bytes: {} is smaller than l1.classes[{i}]'s {slot_bytes}-byte slots",
                    self.l1.chunk_bytes
                )));
            }
            if self.l1.load_reserve_slots >= class.slots {
                return Err(ConfigError(format!(
                    "l1.load_reserve_slots: {} leaves l1.classes[{i}]'s {} slots none for saves",
                    self.l1.load_reserve_slots, class.slots
                )));
            }
        }
        if self.l2.paths.is_empty() {
            return Err(bad("l2.paths", "at least one file"));
        }
        if self.l2.slot_bytes < 8192 || !self.l2.slot_bytes.is_multiple_of(4096) {
            return Err(bad("l2.slot_bytes", "a multiple of 4096, at least 8192"));
        }
        if self.l2.slots_per_file == 0 {
            return Err(bad("l2.slots_per_file", "at least 1"));
        }
        if !self.l2.queue_depth.is_power_of_two() || self.l2.queue_depth > 32_768 {
            return Err(bad("l2.queue_depth", "a power of two up to 32768"));
        }
        if self.l2.background_depth >= self.l2.queue_depth {
            return Err(bad("l2.background_depth", "0 (no cap) or below l2.queue_depth"));
        }
        if self.poller.ops_max == 0 {
            return Err(bad("poller.ops_max", "at least 1"));
        }
        if self.poller.batch_max == 0 {
            return Err(bad("poller.batch_max", "at least 1"));
        }
        if self.poller.flush_batch == 0 {
            return Err(bad("poller.flush_batch", "at least 1"));
        }
        if let Some(l3) = &self.l3 {
            l3.check(&self.l2)?;
        }
        let mut seen = std::collections::HashSet::new();
        for (index, tenant) in self.tenants.iter().enumerate() {
            for namespace in tenant.rate(index)?.namespaces {
                if !seen.insert(namespace) {
                    return Err(ConfigError(format!(
                        "tenants[{index}].namespaces: {namespace:016x} is another tenant's already"
                    )));
                }
            }
        }
        for (index, quota) in self.quotas.iter().enumerate() {
            quota.quota(index)?;
        }
        self.partitions()?;
        if let Some(node) = self.node.numa_node
            && !crate::numa::node_exists(node)
        {
            return Err(bad("node.numa_node", "no such NUMA node on this machine"));
        }
        Ok(())
    }

    /// The arena this config describes, for region epoch `epoch`.
    pub fn arena(&self, epoch: u64) -> ArenaConfig {
        let classes: Vec<SlotClass> =
            self.l1.classes.iter().map(|c| SlotClass::for_payload(c.payload_bytes, c.slots)).collect();
        ArenaConfig {
            partitions: self.arena_partitions(classes.len()),
            backing: self.l1_backing(self.l1.path.clone()),
            agents_max: self.l1.agents_max,
            pins_per_agent: self.l1.pins_per_agent,
            node: NodeId(self.node.id),
            region: RegionId(0),
            epoch,
            lock: self.l1.lock,
            numa_node: self.node.numa_node,
            chunk_bytes: self.l1.chunk_bytes,
            ..ArenaConfig::shm(&self.l1.path, &classes)
        }
    }

    /// The L2 tier this config describes.
    pub fn l2(&self) -> L2Config {
        L2Config {
            paths: self.l2.paths.clone(),
            slots_per_file: self.l2.slots_per_file,
            slot_bytes: self.l2.slot_bytes,
            region_first: self.l2.region_first,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const GOOD: &str = r#"
[node]
id = 3
cores = [0]

[l1]
path = "/dev/shm/x"
classes = [{ payload_bytes = 65536, slots = 16 }]

[l2]
paths = ["/tmp/a.lake"]
slots_per_file = 64
slot_bytes = 69632
"#;

    #[test]
    fn a_good_config_parses_with_defaults() {
        let config = RunnerConfig::parse(GOOD).unwrap();
        assert_eq!(config.node.id, 3);
        assert_eq!(config.poller, PollerSection::default());
        assert_eq!(config.l1.backing, "shm");
        assert_eq!(config.arena(7).epoch, 7);
        assert_eq!(config.arena(7).classes[0].slot_bytes, 69632);
        assert_eq!(config.l2().geometry().region_first, 1);
    }

    #[test]
    fn errors_name_the_field() {
        let check = |text: &str, expect: &str| {
            let err = RunnerConfig::parse(text).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: got {err}");
        };
        check(&GOOD.replace("slots_per_file = 64", "slots_per_fil = 64"), "slots_per_fil");
        check(&GOOD.replace("slots_per_file = 64", "slots_per_file = -1"), "slots_per_file");
        check(&GOOD.replace("slot_bytes = 69632", "slot_bytes = 5000"), "l2.slot_bytes");
        check(&GOOD.replace("id = 3", "id = \"three\""), "id");
        check(&GOOD.replace("[node]\nid = 3", "[node]"), "missing field `id`");
        check(&GOOD.replace("slots = 16", "slots = 0"), "l1.classes[0].slots");
        check(&GOOD.replace("[l1]", "[l1]\nload_reserve_slots = 16"), "l1.load_reserve_slots");
        check(&GOOD.replace("[l1]", "[l1]\nchunk_bytes = 5000"), "l1.chunk_bytes");
        check(&GOOD.replace("[l1]", "[l1]\nchunk_bytes = 65536"), "smaller than l1.classes[0]'s 69632-byte slots");
        check(&format!("{GOOD}\n[poller]\nops_max = 0\n"), "poller.ops_max");
        check(&format!("{GOOD}\n[poller]\nspin = 3\n"), "spin");
        check(&GOOD.replace("[l1]", "[l1]\nbacking = \"disk\""), "l1.backing");
        check(&GOOD.replace("cores = [0]", "cores = [0]\nnuma_node = 999"), "node.numa_node");
        check("[node", "line 1");
        check(&format!("{GOOD}\n[l3]\nprefix = \"x\"\n"), "one of l3.dir or l3.endpoint");
        check(&format!("{GOOD}\n[l3]\ndir = \"/tmp/l3\"\nregion = 1\n"), "l3.region");
        check(&format!("{GOOD}\n[l3]\ndir = \"/tmp/l3\"\nregion = 5000\n"), "l3.region");
        check(&format!("{GOOD}\n[l3]\ndir = \"/tmp/l3\"\nprefix = \"a/../b\"\n"), "l3.prefix");
        check(&format!("{GOOD}\n[l3]\nendpoint = \"http://127.0.0.1:1\"\n"), "l3.bucket");
        check(&format!("{GOOD}\n[l3]\ndir = \"/tmp/l3\"\nworkers = 0\n"), "l3.workers");
        let l3 = RunnerConfig::parse(&format!("{GOOD}\n[l3]\ndir = \"/tmp/l3\"\n")).unwrap().l3.unwrap();
        assert_eq!((l3.region, l3.objects, l3.prefix.as_str()), (1023, 65_536, "lake"));
    }

    #[test]
    fn sizes_take_units_as_lake_serve_s_do() {
        let units = GOOD
            .replace("payload_bytes = 65536", "payload_bytes = \"64KiB\"")
            .replace("slot_bytes = 69632", "slot_bytes = \"68KiB\"");
        let config = RunnerConfig::parse(&format!(
            "{units}\n[[tenants]]\nname = \"b\"\nnamespaces = [\"ab\"]\nl2_read_bytes_per_s = \"200MB\"\n"
        ))
        .unwrap();
        assert_eq!(
            config,
            RunnerConfig::parse(&format!(
                "{GOOD}\n[[tenants]]\nname = \"b\"\nnamespaces = [\"ab\"]\nl2_read_bytes_per_s = 200000000\n"
            ))
            .unwrap()
        );
        let err = RunnerConfig::parse(&GOOD.replace("slot_bytes = 69632", "slot_bytes = \"68XiB\"")).unwrap_err();
        assert!(err.to_string().contains("slot_bytes") && err.to_string().contains("unit \"XiB\""), "{err}");
        assert_eq!(parse_bytes("2MiB"), Ok(2 << 20));
        assert_eq!(parse_bytes("2 MB"), Ok(2_000_000));
        assert!(parse_bytes("1.5GiB").is_err());
        assert!(parse_bytes("99999999TiB").unwrap_err().contains("64 bits"));
    }

    #[test]
    fn tenants_caps_parse_and_bad_ones_are_named() {
        let tenant = |body: &str| format!("{GOOD}\n[[tenants]]\nname = \"batch\"\n{body}\n");
        let config = RunnerConfig::parse(&tenant(
            "namespaces = [\"00000000000000ab\"]\nl2_read_bytes_per_s = 1000\nnet_send_bytes_per_s = 7\n\
             net_receive_bytes_per_s = 9",
        ))
        .unwrap();
        let rate = config.tenants[0].rate(0).unwrap();
        assert_eq!((rate.namespaces, rate.bytes_per_s), (vec![0xab], [Some(1000), None, None, None, Some(7), Some(9)]));
        let check = |text: &str, expect: &str| {
            let err = RunnerConfig::parse(text).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: got {err}");
        };
        check(&tenant("namespaces = [\"xyz\"]"), "tenants[0].namespaces: \"xyz\" is not a namespace id in hex");
        check(&tenant("namespaces = []"), "tenants[0].namespaces: at least one");
        check(&tenant("namespaces = [\"ab\"]\nl3_write_bytes_per_s = 0"), "tenants[0].l3_write_bytes_per_s");
        check(&tenant("namespaces = [\"ab\"]\nnet_send_bytes_per_s = 0"), "tenants[0].net_send_bytes_per_s");
        check(&tenant("namespaces = [\"ab\"]\nl2_reads = 5"), "l2_reads");
        let twice =
            format!("{}[[tenants]]\nname = \"other\"\nnamespaces = [\"AB\"]\n", tenant("namespaces = [\"ab\"]"));
        check(&twice, "tenants[1].namespaces: 00000000000000ab is another tenant's already");
    }

    #[test]
    fn quotas_parse_and_bad_ones_are_named() {
        let quota = |body: &str| format!("{GOOD}\n[[quotas]]\nname = \"acme\"\n{body}\n");
        let config = RunnerConfig::parse(&quota("namespaces = [\"ab\", \"cd\"]\nl1_bytes = \"2MiB\"")).unwrap();
        let parsed = config.quotas[0].quota(0).unwrap();
        assert_eq!((parsed.name.as_str(), parsed.namespaces, parsed.bytes), ("acme", vec![0xab, 0xcd], 2 << 20));
        let check = |text: &str, expect: &str| {
            let err = RunnerConfig::parse(text).unwrap_err().to_string();
            assert!(err.contains(expect), "{expect}: got {err}");
        };
        check(&quota("namespaces = [\"xyz\"]\nl1_bytes = 1"), "quotas[0].namespaces: \"xyz\" is not a namespace id");
        check(&quota("namespaces = []\nl1_bytes = 1"), "quotas[0].namespaces: at least one");
        check(&quota("namespaces = [\"ab\"]\nl1_bytes = 0"), "quotas[0].l1_bytes: at least 1");
        check(&quota("namespaces = [\"ab\"]"), "l1_bytes");
    }
}
