//! `lake serve`'s configuration: one schema, given as flags, as a TOML
//! file, or both.
//!
//! The file is flat and its keys are the flags' long names: `block-bytes =
//! "2MiB"` is `--block-bytes 2MiB`. A list is a flag given once per item
//! (`l1-class = ["2MiB:4000", "64KiB:1024"]`). Flags on the command line
//! come after the file's: one that takes a single value overrides the
//! file's, one that takes a list adds to it. Both go through the same
//! parser, so a key the flags do not know, a size without a unit it knows,
//! a boolean that is not `true` or `false`, is refused with the key named
//! — never read as a default.
//!
//! Sizes take units (`64KiB`, `2MiB`, `64GiB`, `2MB`: binary with `i`,
//! decimal without) or plain bytes; durations are seconds.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, FromArgMatches};

use crate::embedded::{EmbeddedConfig, LocalAccess};
use crate::tier::{L2Admission, L3WriteBack};
use lake_dp::runner::pool::CommitCheck;

/// Where `lake serve` serves `/metrics` unless told otherwise.
pub const METRICS_DEFAULT: &str = "127.0.0.1:9477";

pub use lake_dp::runner::config::parse_bytes;

/// A namespace id in hex (`7e7e`, `0x7e7e`), as `lake` prints them.
pub fn namespace_hex(text: &str) -> Option<lake_dp::NamespaceId> {
    u64::from_str_radix(text.trim_start_matches("0x"), 16).ok().map(lake_dp::NamespaceId)
}

fn tier_named(name: &str) -> Result<lake_dp::Tier, String> {
    match name {
        "l1" => Ok(lake_dp::Tier::L1Dram),
        "l2" => Ok(lake_dp::Tier::L2Nvme),
        "l3" => Ok(lake_dp::Tier::L3Object),
        other => Err(format!("tier {other:?}: l1, l2 or l3")),
    }
}

/// `--l1-class SIZE:SLOTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct L1Class {
    /// Payload bytes of a block of the class.
    pub payload_bytes: u64,
    /// Its slots.
    pub slots: u32,
}

fn parse_l1_class(text: &str) -> Result<L1Class, String> {
    let (payload, slots) = text.split_once(':').ok_or("PAYLOAD_SIZE:SLOTS, as 2MiB:4000")?;
    Ok(L1Class { payload_bytes: parse_bytes(payload)?, slots: slots.parse().map_err(|e| format!("slots: {e}"))? })
}

/// `--transport-peer NODE=[LOCAL>]IP:PORT[,...]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportPeer {
    /// The peer's node id.
    pub node: u32,
    /// Its rails, one per NIC.
    pub rails: Vec<lake_dp::transport::tcp::Rail>,
}

fn parse_peer(text: &str) -> Result<TransportPeer, String> {
    let (node, rails) = text.split_once('=').ok_or("NODE=[LOCAL>]IP:PORT[,...]")?;
    Ok(TransportPeer {
        node: node.parse().map_err(|e| format!("node: {e}"))?,
        rails: lake_dp::transport::tcp::Rail::parse_list(rails)?,
    })
}

/// `--tenant-key NAMESPACE=FILE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantKeyFile {
    /// The namespace whose blocks the key seals.
    pub namespace: lake_dp::NamespaceId,
    /// The key file (`lake keygen`'s format, owner-only).
    pub file: PathBuf,
}

fn parse_tenant_key(text: &str) -> Result<TenantKeyFile, String> {
    let (namespace, file) = text.split_once('=').ok_or("NAMESPACE(hex)=FILE")?;
    let namespace = namespace_hex(namespace).ok_or_else(|| format!("namespace {namespace:?}: not hex"))?;
    Ok(TenantKeyFile { namespace, file: file.into() })
}

/// `--quota NAMESPACE:TIER=SIZE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceQuota {
    /// The namespace.
    pub namespace: u64,
    /// The tier.
    pub tier: lake_dp::Tier,
    /// Bytes it may hold there.
    pub bytes: u64,
}

fn parse_quota(text: &str) -> Result<NamespaceQuota, String> {
    let bad = "NAMESPACE(hex):l1|l2|l3=SIZE";
    let (place, bytes) = text.split_once('=').ok_or(bad)?;
    let (namespace, tier) = place.split_once(':').ok_or(bad)?;
    Ok(NamespaceQuota {
        namespace: namespace_hex(namespace).ok_or_else(|| format!("namespace {namespace:?}: not hex"))?.0,
        tier: tier_named(tier)?,
        bytes: parse_bytes(bytes)?,
    })
}

/// `--tenant NAME=NAMESPACE[,NAMESPACE...]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    /// Its name (quotas and rates name it).
    pub name: String,
    /// Its namespaces.
    pub namespaces: Vec<u64>,
}

fn parse_tenant(text: &str) -> Result<Tenant, String> {
    let (name, list) = text.split_once('=').ok_or("NAME=NAMESPACE(hex)[,NAMESPACE...]")?;
    if name.is_empty() {
        return Err("a tenant's name is not empty".into());
    }
    let namespaces = list
        .split(',')
        .map(|n| namespace_hex(n).map(|n| n.0).ok_or_else(|| format!("namespace {n:?}: not hex")))
        .collect::<Result<Vec<u64>, String>>()?;
    Ok(Tenant { name: name.to_owned(), namespaces })
}

/// `--tenant-quota NAME:TIER=SIZE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantQuota {
    /// The tenant.
    pub name: String,
    /// The tier.
    pub tier: lake_dp::Tier,
    /// Bytes its namespaces may hold there together.
    pub bytes: u64,
}

fn parse_tenant_quota(text: &str) -> Result<TenantQuota, String> {
    let bad = "NAME:l1|l2|l3=SIZE";
    let (place, bytes) = text.split_once('=').ok_or(bad)?;
    let (name, tier) = place.split_once(':').ok_or(bad)?;
    Ok(TenantQuota { name: name.to_owned(), tier: tier_named(tier)?, bytes: parse_bytes(bytes)? })
}

/// The paths a tenant's bandwidth is capped on, by flag name.
const RATE_PATHS: [&str; 7] = ["l2-read", "l2-write", "l3-read", "l3-write", "net-send", "push", "net-receive"];

/// `--tenant-rate NAME:PATH=SIZE` (bytes per second).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantRate {
    /// The tenant.
    pub name: String,
    /// Index into [`RATE_PATHS`].
    pub path: usize,
    /// Bytes per second, at least 1.
    pub bytes_per_s: u64,
}

fn parse_tenant_rate(text: &str) -> Result<TenantRate, String> {
    let bad = || format!("NAME:{}=SIZE (bytes per second)", RATE_PATHS.join("|"));
    let (place, rate) = text.split_once('=').ok_or_else(bad)?;
    let (name, path) = place.split_once(':').ok_or_else(bad)?;
    let path = RATE_PATHS.iter().position(|p| *p == path).ok_or_else(bad)?;
    let bytes_per_s = parse_bytes(rate)?;
    if bytes_per_s == 0 {
        return Err("a rate is at least 1 byte per second".into());
    }
    Ok(TenantRate { name: name.to_owned(), path, bytes_per_s })
}

/// `--metrics ADDR|off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metrics {
    /// No `/metrics`.
    Off,
    /// Served at this address.
    At(SocketAddr),
}

/// Parses `IP:PORT` or `off`.
pub fn parse_metrics(text: &str) -> Result<Metrics, String> {
    if text == "off" {
        return Ok(Metrics::Off);
    }
    text.parse().map(Metrics::At).map_err(|e| format!("{text:?}: IP:PORT or off ({e})"))
}

fn parse_socket_mode(text: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(text.trim_start_matches("0o"), 8).map_err(|e| format!("{text:?}: octal ({e})"))?;
    if mode & !0o777 != 0 {
        return Err(format!("{text}: permission bits only (600, 660)"));
    }
    Ok(mode)
}

fn parse_rdma(text: &str) -> Result<lake_dp::runner::RdmaDevice, String> {
    lake_dp::runner::RdmaDevice::parse(text)
}

fn parse_pool_dir(text: &str) -> Result<PathBuf, String> {
    if text.is_empty() {
        return Err("an empty path".into());
    }
    Ok(PathBuf::from(text))
}

/// `--cores`: a list of cores (`2`, `2,3`, `2-3`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cores(pub Vec<usize>);

fn parse_cores(text: &str) -> Result<Cores, String> {
    let bad = || format!("{text:?}: numbers like 2 or 2,3 or 2-3");
    let mut cores = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((first, last)) => {
                let first: usize = first.trim().parse().map_err(|_| bad())?;
                let last: usize = last.trim().parse().map_err(|_| bad())?;
                if first > last {
                    return Err(bad());
                }
                cores.extend(first..=last);
            }
            None => cores.push(part.trim().parse().map_err(|_| bad())?),
        }
    }
    Ok(Cores(cores))
}

/// `--l1-backing`: what L1's memory is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum L1Backing {
    /// A file in `/dev/shm`.
    #[default]
    Shm,
    /// A file in `/dev/hugepages`.
    Hugetlbfs,
    /// An anonymous hugetlb memfd.
    HugetlbMemfd,
}

/// The node's settings, `lake serve`'s and `lake-dp`'s alike: each a flag,
/// each a key of `--config`'s file.
#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// A TOML file of these settings, each key a flag's long name
    /// (`block-bytes = "2MiB"`); flags given here override it (lists add
    /// to it). `examples/lake.toml` has every key.
    #[arg(long, value_name = "FILE", help_heading = "Pool")]
    pub config: Option<PathBuf>,

    /// The pool's home: its lock, sockets, `pool.json` and L2 files; one
    /// pool at a time. Kept across restarts (L1 is written down to L2 at
    /// stop and re-adopted at start). Without it, a temporary directory
    /// that goes with the pool.
    #[arg(long, value_name = "DIR", value_parser = parse_pool_dir, help_heading = "Pool")]
    pub dir: Option<PathBuf>,

    /// Seconds a stop may spend writing L1 down to L2.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, help_heading = "Pool")]
    pub stop_timeout: u64,

    /// Payload size of a block (an engine's block must fit it, or an
    /// `--l1-class`).
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_bytes, help_heading = "Pool")]
    pub block_bytes: u64,

    /// Ports for engines in other processes (agents attached at once).
    #[arg(long, value_name = "N", default_value_t = 16, help_heading = "Pool")]
    pub agents: u32,

    /// How a saved block's bytes are checked against its CRCs: auto
    /// (those Lake computed: served at once, read on a thread beside the
    /// poller, a bad block evicted; any other: before it is served),
    /// inline, background or trust.
    #[arg(long, value_enum, default_value_t = CommitCheck::Auto, help_heading = "Pool")]
    pub commit_check: CommitCheck,

    /// Where `/metrics` (Prometheus) is served, or `off`. Use
    /// `0.0.0.0:9477` to let another host scrape it.
    #[arg(long, value_name = "IP:PORT|off", default_value = METRICS_DEFAULT, value_parser = parse_metrics, help_heading = "Pool")]
    pub metrics: Metrics,

    /// The cores the data plane's poll thread may run on (`2`, `2,3`,
    /// `2-3`): it is pinned to the first.
    #[arg(long, value_name = "LIST", value_parser = parse_cores, help_heading = "Pool")]
    pub cores: Option<Cores>,

    /// Bind the data plane's memory, and L1, to this NUMA node.
    #[arg(long, value_name = "N", help_heading = "Pool")]
    pub numa_node: Option<u32>,

    /// Connections the metrics port holds at once; one past it is closed
    /// as it comes. Cut at start, with the other caps, to what the limit on
    /// open files leaves beside the pool's own needs.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Limits")]
    pub metrics_connections_max: u32,

    /// Connections the cp socket holds at once (the data plane and one per
    /// attached engine).
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Limits")]
    pub cp_connections_max: u32,

    /// Inbound connections the transport holds at once (other nodes'
    /// streams, `--transport-listen`).
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Limits")]
    pub transport_connections_max: u32,

    /// Events at this level or above are logged, on stderr (the lines a
    /// supervisor reads, `serving` and `stopped`, go to stdout whatever
    /// this is).
    #[arg(long, value_enum, default_value_t = lake_dp::log::Level::Info, help_heading = "Logging")]
    pub log_level: lake_dp::log::Level,

    /// Events as JSON lines, or as text for a terminal.
    #[arg(long, value_enum, default_value_t = lake_dp::log::Format::Json, help_heading = "Logging")]
    pub log_format: lake_dp::log::Format,

    /// What L1's memory is: a file in `/dev/shm` (base pages), a file in
    /// the hugetlbfs mount `/dev/hugepages` (huge pages the operator
    /// reserved), or an anonymous hugetlb memfd.
    #[arg(long, value_enum, default_value_t = L1Backing::Shm, help_heading = "L1 (host memory)")]
    pub l1_backing: L1Backing,

    /// Lock L1 in memory (mlock): its pages are never swapped out. Needs
    /// the memlock limit to cover it (`LimitMEMLOCK=` under systemd).
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          value_parser = clap::value_parser!(bool), help_heading = "L1 (host memory)")]
    pub l1_lock: bool,

    /// L1 slots of `--block-bytes`.
    #[arg(long, value_name = "N", default_value_t = 1024, help_heading = "L1 (host memory)")]
    pub l1_slots: u32,

    /// Another L1 size class, for another block layout (another model):
    /// its payload size and slots. Repeat for more.
    #[arg(long, value_name = "SIZE:SLOTS", value_parser = parse_l1_class, help_heading = "L1 (host memory)")]
    pub l1_class: Vec<L1Class>,

    /// With several classes, they share L1 in chunks of this size (0:
    /// each class owns its slots). Default: four of the largest slots.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes, help_heading = "L1 (host memory)")]
    pub l1_chunk_bytes: Option<u64>,

    /// The last free L1 slots saves may not take, kept for loads.
    /// Default: one agent's batch of loads, or fewer in a small L1.
    #[arg(long, value_name = "N", help_heading = "L1 (host memory)")]
    pub l1_load_reserve: Option<u32>,

    /// L2 slots per L2 file.
    #[arg(long, value_name = "N", default_value_t = 4096, help_heading = "L2 (NVMe)")]
    pub l2_slots: u32,

    /// An L2 file (on an NVMe device's filesystem); repeat for one per
    /// device. Default: `DIR/l2-0.lake` and `DIR/l2-1.lake`. Made (and
    /// formatted) if missing, re-adopted if present.
    #[arg(long, value_name = "PATH", help_heading = "L2 (NVMe)")]
    pub l2_file: Vec<PathBuf>,

    /// Which L1 victims are written to L2.
    #[arg(long, value_enum, default_value_t = L2Admission::Always, help_heading = "L2 (NVMe)")]
    pub l2_admission: L2Admission,

    /// Background L2 I/O (write-back, demotion) in the device at once, at
    /// most (0: no cap); the rest of the queue stays for loads.
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = "L2 (NVMe)")]
    pub l2_background_depth: u32,

    /// L3 in a directory (a mounted filesystem).
    #[arg(long, value_name = "DIR", help_heading = "L3 (object store)")]
    pub l3_dir: Option<PathBuf>,

    /// L3 in an S3-compatible service (`http://host:port`, or `https://`:
    /// the certificate checked against the system's roots, or the CA file
    /// in `$SSL_CERT_FILE`); keys from `$LAKE_S3_ACCESS_KEY` and
    /// `$LAKE_S3_SECRET_KEY`.
    #[arg(
        long,
        value_name = "URL",
        conflicts_with = "l3_dir",
        requires = "l3_bucket",
        help_heading = "L3 (object store)"
    )]
    pub l3_endpoint: Option<String>,

    /// The S3 bucket.
    #[arg(long, value_name = "NAME", requires = "l3_endpoint", help_heading = "L3 (object store)")]
    pub l3_bucket: Option<String>,

    /// The region the S3 service signs for (AWS: the bucket's region, as in
    /// `https://s3.eu-west-1.amazonaws.com`).
    #[arg(
        long,
        value_name = "NAME",
        default_value = "us-east-1",
        requires = "l3_endpoint",
        help_heading = "L3 (object store)"
    )]
    pub l3_region: String,

    /// Create the bucket at start if it is missing.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          value_parser = clap::value_parser!(bool), help_heading = "L3 (object store)")]
    pub l3_create_bucket: bool,

    /// Object names start with this (`{prefix}/{namespace}/{key}`).
    #[arg(long, value_name = "PREFIX", default_value = "lake", help_heading = "L3 (object store)")]
    pub l3_prefix: String,

    /// Objects this node's L3 catalog tracks.
    #[arg(long, value_name = "N", default_value_t = 65536, help_heading = "L3 (object store)")]
    pub l3_objects: u32,

    /// When blocks are written to L3.
    #[arg(long, value_enum, default_value_t = L3WriteBack::OnEviction, help_heading = "L3 (object store)")]
    pub l3_write_back: L3WriteBack,

    /// This node's id (each node of a cluster has its own).
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = "Cluster")]
    pub node: u32,

    /// etcd endpoints (comma-separated): this node joins the cluster's
    /// members under a lease it renews.
    #[arg(long, value_name = "URL[,URL...]", requires = "cluster", help_heading = "Cluster")]
    pub etcd: Option<String>,

    /// The cluster's name in etcd.
    #[arg(long, value_name = "NAME", requires = "etcd", help_heading = "Cluster")]
    pub cluster: Option<String>,

    /// TLS to etcd (`--etcd https://...`).
    #[command(flatten)]
    pub etcd_tls: EtcdTlsArgs,

    /// Seconds the membership lease lasts without renewal.
    #[arg(long, value_name = "SECONDS", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Cluster")]
    pub member_ttl: u32,

    /// The leader's summary aggregators this node reports its replicas to
    /// (whichever accepts).
    #[arg(long, value_name = "IP:PORT", value_delimiter = ',', help_heading = "Cluster")]
    pub summary_to: Vec<SocketAddr>,

    /// Blocks of other nodes this node's cluster view can hold: with
    /// --summary-to, the leader streams what every other node holds, and
    /// the view is published beside the mirror (`<mirror>.cluster`) for
    /// the engines' cluster lookups; about 46 bytes of shared memory a
    /// block. 0: no view. Each tenant kept apart has a view of its own,
    /// as large (`<mirror>.<tenant>.cluster`).
    #[arg(long, value_name = "BLOCKS", default_value_t = 1 << 20, help_heading = "Cluster")]
    pub cluster_view_blocks: u64,

    /// Where the transport listens for blocks peers send into this node's
    /// L1 (P→D, replication).
    #[arg(long, value_name = "IP:PORT", help_heading = "Transport")]
    pub transport_listen: Option<SocketAddr>,

    /// A peer the transport sends to: its node id and its rails, one per
    /// NIC (`LOCAL>` picks the interface to leave from). Repeat per peer.
    #[arg(long, value_name = "NODE=[LOCAL>]IP:PORT[,...]", value_parser = parse_peer, help_heading = "Transport")]
    pub transport_peer: Vec<TransportPeer>,

    /// An RDMA device: each peer's link negotiates RDMA over its TCP
    /// connection, falling back to TCP.
    #[arg(long, value_name = "NAME|any[:PORT[:GID]]|loopback", value_parser = parse_rdma, help_heading = "Transport")]
    pub rdma_device: Option<lake_dp::runner::RdmaDevice>,

    /// Threads that tag large slices on authenticated links.
    #[arg(long, value_name = "N", help_heading = "Transport")]
    pub tag_threads: Option<usize>,

    /// The cluster link key (`lake keygen`): every transport and summary
    /// connection is authenticated with it.
    #[arg(long, value_name = "FILE", help_heading = "Security")]
    pub link_key: Option<PathBuf>,

    /// Users who may attach besides this one and root (comma-separated or
    /// repeated).
    #[arg(long, value_name = "UID", value_delimiter = ',', help_heading = "Security")]
    pub allow_uid: Vec<u32>,

    /// Groups who may attach (comma-separated or repeated).
    #[arg(long, value_name = "GID", value_delimiter = ',', help_heading = "Security")]
    pub allow_gid: Vec<u32>,

    /// The sockets' group (a name or a number); their mode becomes 660.
    #[arg(long, value_name = "GROUP", help_heading = "Security")]
    pub socket_group: Option<String>,

    /// The sockets' mode, in octal (default 600, 660 with a group).
    #[arg(long, value_name = "OCTAL", value_parser = parse_socket_mode, help_heading = "Security")]
    pub socket_mode: Option<u32>,

    /// Agent ports one user may hold at once (default: all of them): where
    /// engines of several users share the pool (`--allow-uid`), none can
    /// take every port.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), help_heading = "Security")]
    pub agent_ports_per_uid: Option<u32>,

    /// A tenant's data key: its namespace's blocks are sealed
    /// (AES-256-GCM) below L1. Repeat per namespace.
    #[arg(long, value_name = "NAMESPACE=FILE", value_parser = parse_tenant_key, help_heading = "Security")]
    pub tenant_key: Vec<TenantKeyFile>,

    /// A directory of `NAMESPACE.key` files, read again on SIGHUP (a file
    /// gone: its tenant's blocks purged).
    #[arg(long, value_name = "DIR", help_heading = "Security")]
    pub tenant_keys: Option<PathBuf>,

    /// Keep namespaces without a data key out of L2 and L3.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          value_parser = clap::value_parser!(bool), help_heading = "Security")]
    pub require_encryption: bool,

    /// A namespace's quota on a tier. In L1 a save past it is refused at
    /// its commit and the namespace's coldest blocks move down to make
    /// room; in L2 and L3 its coldest go down or away. Repeat for more.
    #[arg(long, value_name = "NAMESPACE:l1|l2|l3=SIZE", value_parser = parse_quota, help_heading = "Tenants")]
    pub quota: Vec<NamespaceQuota>,

    /// A tenant and its namespaces. Repeat per tenant.
    #[arg(long, value_name = "NAME=NAMESPACE[,...]", value_parser = parse_tenant, help_heading = "Tenants")]
    pub tenant: Vec<Tenant>,

    /// A tenant's quota on a tier, its namespaces together (held as
    /// `--quota` is).
    #[arg(long, value_name = "NAME:l1|l2|l3=SIZE", value_parser = parse_tenant_quota, help_heading = "Tenants")]
    pub tenant_quota: Vec<TenantQuota>,

    /// A tenant's bandwidth cap, bytes per second, on one path
    /// (l2-read, l2-write, l3-read, l3-write, net-send, push, net-receive).
    #[arg(long, value_name = "NAME:PATH=SIZE", value_parser = parse_tenant_rate, help_heading = "Tenants")]
    pub tenant_rate: Vec<TenantRate>,

    /// Keep a tenant's L1 blocks in a partition of the arena of its own,
    /// sized by its L1 quota, that only these users' and groups' engines
    /// map (let them attach with --allow-uid / --allow-gid).
    #[arg(long, value_name = "NAME:uid=N|gid=N[,...]", help_heading = "Tenants")]
    pub tenant_partition: Vec<crate::embedded::TenantPartition>,
}

/// What `lake serve` runs from its settings: the pool, and what the
/// command itself does around it.
#[derive(Debug)]
pub struct Serve {
    /// The pool.
    pub pool: EmbeddedConfig,
    /// `--tenant-keys DIR`, read again on SIGHUP, and the key ids read
    /// from it at start.
    pub tenant_key_dir: Option<(PathBuf, HashMap<lake_dp::NamespaceId, u64>)>,
    /// `--etcd` endpoints and `--cluster`, to join.
    pub cluster: Option<(Vec<String>, String)>,
    /// How to speak TLS to `https://` etcd endpoints.
    pub etcd_tls: crate::etcd::EtcdTls,
    /// The membership lease, seconds.
    pub member_ttl: i64,
}

/// TLS to etcd, for every command that speaks to it: whose certificates to
/// trust, and this node's client certificate for a cluster that asks for
/// one (`etcd --client-cert-auth`).
#[derive(Args, Clone, Debug, Default)]
pub struct EtcdTlsArgs {
    /// The CA certificates (PEM) etcd's certificate is checked against, for
    /// `https://` endpoints (default: the system's roots).
    #[arg(long, value_name = "FILE", help_heading = "Cluster")]
    pub etcd_ca: Option<PathBuf>,

    /// This node's client certificate (PEM), for an etcd that asks for one.
    #[arg(long, value_name = "FILE", requires = "etcd_key", help_heading = "Cluster")]
    pub etcd_cert: Option<PathBuf>,

    /// The client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "etcd_cert", help_heading = "Cluster")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdTlsArgs {
    /// The settings these flags make.
    pub fn tls(&self) -> crate::etcd::EtcdTls {
        crate::etcd::EtcdTls { ca: self.etcd_ca.clone(), cert: self.etcd_cert.clone(), key: self.etcd_key.clone() }
    }
}

/// The tenant keys in `dir`: every `NAMESPACE.key` file (the namespace
/// in hex), each readable by its owner only.
pub fn read_tenant_keys(dir: &Path) -> Result<Vec<(lake_dp::NamespaceId, lake_dp::auth::at_rest::DataKey)>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("--tenant-keys {}: {e}", dir.display()))?;
    let mut keys = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| format!("--tenant-keys {}: {e}", dir.display()))?.path();
        if path.extension().is_none_or(|x| x != "key") {
            continue;
        }
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let namespace =
            namespace_hex(stem).ok_or_else(|| format!("{}: the name is not a namespace in hex", path.display()))?;
        let key = lake_dp::auth::at_rest::DataKey::load(&path).map_err(|e| e.to_string())?;
        keys.push((namespace, key));
    }
    Ok(keys)
}

impl ServeArgs {
    /// The settings of `argv` (what follows `lake serve`), after those of
    /// the file `--config` names, if any.
    pub fn parse(argv: &[String]) -> Result<Self, clap::Error> {
        parse_with_file(command_alone, argv)
    }

    /// What `lake serve` runs: every setting checked, every file it names
    /// read (key files), the pool's configuration built. Starts nothing.
    pub fn resolve(&self) -> Result<Serve, String> {
        let mut pool = EmbeddedConfig::new(
            self.dir.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("lake-serve-{}", std::process::id()))),
        );
        pool.durable = self.dir.is_some();
        pool.events_to_stderr = true;
        pool.log_level = self.log_level.filter();
        pool.log_format = self.log_format;
        pool.stop_flush = Duration::from_secs(self.stop_timeout);
        pool.block_bytes = self.block_bytes;
        pool.l1_slots = self.l1_slots;
        pool.l1_backing = self.l1_backing;
        pool.l1_lock = self.l1_lock;
        pool.cores = self.cores.as_ref().map(|c| c.0.clone());
        pool.numa_node = self.numa_node;
        pool.l1_classes = self.l1_class.iter().map(|c| (c.payload_bytes, c.slots)).collect();
        pool.l2_slots_per_file = self.l2_slots;
        pool.l2_files.clone_from(&self.l2_file);
        pool.remote_agents = self.agents;
        pool.node = self.node;
        pool.metrics = match self.metrics {
            Metrics::Off => None,
            Metrics::At(address) => Some(address),
        };
        pool.commit_check = self.commit_check;
        pool.transport_listen = self.transport_listen;
        pool.caps.server.metrics = self.metrics_connections_max as usize;
        pool.caps.server.cp = self.cp_connections_max as usize;
        pool.caps.transport = self.transport_connections_max as usize;
        pool.transport_peers = self.transport_peer.iter().map(|p| (p.node, p.rails.clone())).collect();
        pool.l2_background_depth = self.l2_background_depth;
        pool.l1_load_reserve = self.l1_load_reserve;
        pool.rdma.clone_from(&self.rdma_device);
        pool.summary_to.clone_from(&self.summary_to);
        pool.cluster_view_blocks = self.cluster_view_blocks;
        pool.tiers.l2_admission = self.l2_admission;
        pool.tiers.l3_write_back = self.l3_write_back;
        if let Some(threads) = self.tag_threads {
            lake_dp::auth::spread_tags(threads).map_err(|e| format!("--tag-threads {threads}: {e}"))?;
        }
        if let Some(path) = &self.link_key {
            pool.link_key =
                Some(lake_dp::auth::LinkKey::load(path).map_err(|e| format!("--link-key {}: {e}", path.display()))?);
        }
        pool.access = LocalAccess {
            allow_uids: self.allow_uid.clone(),
            allow_gids: self.allow_gid.clone(),
            group: self.socket_group.clone(),
            socket_mode: self.socket_mode,
            ports_per_uid: self.agent_ports_per_uid,
        };
        for TenantKeyFile { namespace, file } in &self.tenant_key {
            let key = lake_dp::auth::at_rest::DataKey::load(file)
                .map_err(|e| format!("--tenant-key {:x}={}: {e}", namespace.0, file.display()))?;
            pool.tenant_keys.push((*namespace, key));
        }
        let tenant_key_dir = match &self.tenant_keys {
            Some(dir) => {
                let mut ids = HashMap::new();
                for (namespace, key) in read_tenant_keys(dir)? {
                    ids.insert(namespace, key.id());
                    pool.tenant_keys.push((namespace, key));
                }
                Some((dir.clone(), ids))
            }
            None => None,
        };
        pool.require_encryption = self.require_encryption;
        pool.tiers.quotas = self
            .quota
            .iter()
            .map(|q| crate::tier::Quota { namespace: q.namespace, tier: q.tier, bytes: q.bytes })
            .collect();
        self.tenants_into(&mut pool)?;
        if self.l3_dir.is_some() || self.l3_endpoint.is_some() {
            let mut l3 = lake_dp::runner::config::L3Section::none();
            l3.dir.clone_from(&self.l3_dir);
            l3.endpoint.clone_from(&self.l3_endpoint);
            l3.bucket.clone_from(&self.l3_bucket);
            l3.region_name.clone_from(&self.l3_region);
            l3.create_bucket = self.l3_create_bucket;
            l3.prefix.clone_from(&self.l3_prefix);
            l3.objects = self.l3_objects;
            pool.l3 = Some(l3);
        }
        // Several size classes share L1 unless told not to (`--l1-chunk-bytes
        // 0`): chunks of four of the largest slots. Fixed shares strand one
        // model's traffic while the other's slots sit empty, and lake-cp,
        // seeing L1 by bytes, would never make room.
        pool.l1_chunk_bytes = self.l1_chunk_bytes.unwrap_or_else(|| {
            let largest = pool.l1_size_classes().map(|(payload, _)| lake_dp::stored::object_bytes(payload)).max();
            if pool.l1_classes.is_empty() { 0 } else { 4 * largest.unwrap_or(0) }
        });
        pool.check()?;
        let cluster = match (&self.etcd, &self.cluster) {
            (Some(etcd), Some(name)) => Some((etcd.split(',').map(str::to_owned).collect(), name.clone())),
            _ => None,
        };
        let etcd_tls = self.etcd_tls.tls();
        Ok(Serve { pool, tenant_key_dir, cluster, etcd_tls, member_ttl: i64::from(self.member_ttl) })
    }

    /// `--tenant`, `--tenant-quota` and `--tenant-rate` joined by name.
    fn tenants_into(&self, pool: &mut EmbeddedConfig) -> Result<(), String> {
        for (at, tenant) in self.tenant.iter().enumerate() {
            if let Some(other) = self.tenant[..at].iter().find(|t| t.name == tenant.name) {
                return Err(format!("--tenant {}: named twice", other.name));
            }
            if let Some(other) =
                self.tenant[..at].iter().find(|t| t.namespaces.iter().any(|n| tenant.namespaces.contains(n)))
            {
                return Err(format!("--tenant {}: a namespace of it is tenant {}'s already", tenant.name, other.name));
            }
        }
        let namespaces_of = |name: &str, flag: &str| {
            self.tenant
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.namespaces.clone())
                .ok_or_else(|| format!("{flag} {name}: no --tenant {name}=NAMESPACE,... says its namespaces"))
        };
        for q in &self.tenant_quota {
            let namespaces = namespaces_of(&q.name, "--tenant-quota")?;
            pool.tiers.tenant_quotas.push(crate::tier::TenantQuota {
                tenant: q.name.clone(),
                namespaces,
                tier: q.tier,
                bytes: q.bytes,
            });
        }
        for partition in &self.tenant_partition {
            namespaces_of(&partition.tenant, "--tenant-partition")?;
        }
        pool.partitions.clone_from(&self.tenant_partition);
        for rate in &self.tenant_rate {
            let namespaces = namespaces_of(&rate.name, "--tenant-rate")?;
            let at = match pool.tenant_rates.iter().position(|t| t.name == rate.name) {
                Some(at) => at,
                None => {
                    pool.tenant_rates.push(lake_dp::runner::config::TenantSection {
                        name: rate.name.clone(),
                        namespaces: namespaces.iter().map(|n| format!("{n:016x}")).collect(),
                        l2_read_bytes_per_s: None,
                        l2_write_bytes_per_s: None,
                        l3_read_bytes_per_s: None,
                        l3_write_bytes_per_s: None,
                        net_send_bytes_per_s: None,
                        push_bytes_per_s: None,
                        net_receive_bytes_per_s: None,
                    });
                    pool.tenant_rates.len() - 1
                }
            };
            let entry = &mut pool.tenant_rates[at];
            let cap = match rate.path {
                0 => &mut entry.l2_read_bytes_per_s,
                1 => &mut entry.l2_write_bytes_per_s,
                2 => &mut entry.l3_read_bytes_per_s,
                3 => &mut entry.l3_write_bytes_per_s,
                4 => &mut entry.net_send_bytes_per_s,
                5 => &mut entry.push_bytes_per_s,
                _ => &mut entry.net_receive_bytes_per_s,
            };
            *cap = Some(rate.bytes_per_s);
        }
        Ok(())
    }
}

/// The settings of `argv` for a command that holds [`ServeArgs`] (it may
/// add flags of its own, which the file does not take), after those of
/// the file its `--config` names, if any.
pub fn parse_with_file<T: FromArgMatches>(command: fn() -> clap::Command, argv: &[String]) -> Result<T, clap::Error> {
    let mut matches = command().try_get_matches_from(argv)?;
    let Some(file) = matches.get_one::<PathBuf>("config").cloned() else {
        return T::from_arg_matches_mut(&mut matches);
    };
    let from_file = file_args(&file).map_err(|e| command().error(clap::error::ErrorKind::ValueValidation, e))?;
    let all: Vec<String> = from_file.into_iter().chain(argv.iter().cloned()).collect();
    let mut matches = command().args_override_self(true).try_get_matches_from(all)?;
    T::from_arg_matches_mut(&mut matches)
}

/// The file's settings as the flags they stand for, each key checked
/// alone so that an error names it: `FILE: key: why`.
pub fn file_args(path: &Path) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text_args(&text, &path.display().to_string())
}

/// [`file_args`] of a file's text; `name` names it in errors.
pub fn text_args(text: &str, name: &str) -> Result<Vec<String>, String> {
    let table: toml::Table = text.parse().map_err(|e| format!("{name}: {e}"))?;
    let known = command();
    let mut args = Vec::new();
    for (key, value) in &table {
        let at = |why: String| format!("{name}: {key}: {why}");
        if key == "config" {
            return Err(at("a configuration file does not name another".into()));
        }
        if value.is_table() {
            return Err(at(
                "a table: the file is flat, its keys the flags' long names (`l1-slots = 64`, not `[l1]`)".into()
            ));
        }
        let Some(arg) = known.get_arguments().find(|a| a.get_long() == Some(key.as_str())) else {
            return Err(at("no such setting (`lake serve --help` lists them; keys are the flags' long names)".into()));
        };
        let list = matches!(arg.get_action(), clap::ArgAction::Append);
        let items: Vec<&toml::Value> = match value {
            toml::Value::Array(items) if list => items.iter().collect(),
            toml::Value::Array(_) => return Err(at("one value, not a list".into())),
            other if list => return Err(at(format!("a list (`{key} = [...]`), not {}", other.type_str()))),
            other => vec![other],
        };
        let mut own = Vec::new();
        for item in items {
            let text = match item {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => return Err(at(format!("a string, number or boolean, not {}", other.type_str()))),
            };
            own.push(format!("--{key}={text}"));
        }
        // Alone, so the error is this key's (what it requires of others is
        // checked with them all, after).
        match command_alone().try_get_matches_from(&own) {
            Err(e) if e.kind() != clap::error::ErrorKind::MissingRequiredArgument => {
                let e = e.to_string();
                let why = e.lines().next().unwrap_or_default().trim_start_matches("error: ");
                return Err(at(why.to_owned()));
            }
            _ => {}
        }
        args.extend(own);
    }
    Ok(args)
}

fn command_alone() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("lake serve").no_binary_name(true))
}

/// Where the guide's copy of [`reference`] begins.
pub const REFERENCE_BEGIN: &str = "<!-- reference: generated by `lake config reference` -->";
/// And ends.
pub const REFERENCE_END: &str = "<!-- end of reference -->";

/// The configuration reference: every setting, its flag, its default and
/// what it does, as a Markdown table per group (`lake config reference`).
pub fn reference() -> String {
    let command = command();
    let mut out = String::new();
    let mut heading = None;
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let this = arg.get_help_heading().unwrap_or("Other");
        if heading != Some(this) {
            heading = Some(this);
            out.push_str(&format!(
                "\n### {this}\n\n| key / flag | value | default | what it does |\n|---|---|---|---|\n"
            ));
        }
        let value = arg.get_value_names().map(|v| v.iter().map(ToString::to_string).collect::<Vec<_>>().join(" "));
        let value = match arg.get_possible_values().as_slice() {
            [] => value.unwrap_or_default(),
            values => values.iter().map(|v| v.get_name().to_owned()).collect::<Vec<_>>().join(" \\| "),
        };
        let list = matches!(arg.get_action(), clap::ArgAction::Append);
        let help_prefix = if long == "config" { "(command line only) " } else { "" };
        let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let default = if defaults.is_empty() { "—".to_owned() } else { format!("`{}`", defaults.join(",")) };
        let help = arg.get_long_help().or_else(|| arg.get_help()).map(ToString::to_string).unwrap_or_default();
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ").replace('|', "\\|");
        out.push_str(&format!(
            "| `{long}` | {}{} | {default} | {help_prefix}{help} |\n",
            value.replace('|', "\\|").replace("\\\\|", "\\|"),
            if list { " (list)" } else { "" }
        ));
    }
    out
}

/// `clap`'s command for `lake serve`, for help and the reference.
pub fn command() -> clap::Command {
    ServeArgs::augment_args(clap::Command::new("lake serve"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn booleans_are_booleans() {
        let parsed = ServeArgs::parse(&args(&["--require-encryption"])).unwrap();
        assert!(parsed.require_encryption);
        let parsed = ServeArgs::parse(&args(&["--require-encryption=false"])).unwrap();
        assert!(!parsed.require_encryption);
        for bad in ["maybe", "yes", "on"] {
            let e = ServeArgs::parse(&args(&[&format!("--require-encryption={bad}")])).unwrap_err().to_string();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn a_file_is_the_flags_and_flags_override_it() {
        let dir = std::env::temp_dir().join(format!("lake-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("lake.toml");
        std::fs::write(
            &file,
            "block-bytes = \"2MiB\"\nl1-slots = 64\nl1-class = [\"64KiB:16\"]\nrequire-encryption = false\n\
             commit-check = \"background\"\n",
        )
        .unwrap();
        let config = file.display().to_string();
        let parsed =
            ServeArgs::parse(&args(&["--config", &config, "--l1-slots", "128", "--l1-class", "1MiB:8"])).unwrap();
        assert_eq!(parsed.block_bytes, 2 << 20);
        assert_eq!(parsed.l1_slots, 128, "the flag overrides the file");
        assert_eq!(parsed.commit_check, CommitCheck::Background);
        assert_eq!(
            parsed.l1_class,
            vec![L1Class { payload_bytes: 64 << 10, slots: 16 }, L1Class { payload_bytes: 1 << 20, slots: 8 }],
            "lists add up"
        );
        for (text, named) in [
            ("blok-bytes = 1\n", "blok-bytes: no such setting"),
            ("block-bytes = \"2XB\"\n", "block-bytes:"),
            ("require-encryption = \"maybe\"\n", "require-encryption:"),
            ("l1-class = \"1MiB:8\"\n", "l1-class: a list"),
            ("l1-slots = [1, 2]\n", "l1-slots: one value"),
            ("config = \"other.toml\"\n", "config: a configuration file does not name another"),
            ("[l1]\nslots = 3\n", "l1: a table: the file is flat"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = ServeArgs::parse(&args(&["--config", &config])).unwrap_err().to_string();
            assert!(e.contains(named) && e.contains("lake.toml"), "{text:?}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_example_and_the_guide_show_every_setting() {
        let example = include_str!("../../../examples/lake.toml");
        for arg in command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if long == "config" {
                continue;
            }
            let shown = example.lines().any(|l| l.trim_start_matches("# ").starts_with(&format!("{long} = ")));
            assert!(shown, "examples/lake.toml does not show `{long}`");
        }
        // The guide's reference is this schema's, as `lake config reference`
        // prints it (regenerate it with that command when a flag changes).
        let guide = include_str!("../../../docs/guide/configuration.md");
        let (_, rest) = guide.split_once(REFERENCE_BEGIN).expect("the guide's reference begins");
        let (shown, _) = rest.split_once(REFERENCE_END).expect("and ends");
        assert_eq!(shown.trim(), reference().trim(), "docs/guide/configuration.md: run `lake config reference`");
    }

    #[test]
    fn every_setting_is_in_the_reference() {
        let reference = reference();
        for arg in command().get_arguments() {
            if let Some(long) = arg.get_long() {
                assert!(reference.contains(&format!("| `{long}` |")), "{long}");
            }
        }
    }
}
