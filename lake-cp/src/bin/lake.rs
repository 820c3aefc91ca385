//! `lake`: the operator's command. `lake demo` runs the embedded
//! single-node pool — control plane, data plane and engine agents in one
//! process, nothing external — under a multi-turn agent workload, and
//! reports hit rate, bytes per tier, tier moves and latencies.

use std::process::ExitCode;

use lake_cp::demo::{DemoConfig, DemoReport, Percentiles};

const USAGE: &str = "usage: lake demo [--sessions N] [--turns N] [--engines N] [--system-blocks N]
                 [--message-blocks N] [--reply-blocks N] [--l1-slots N] [--l2-slots N]
                 [--seed N] [--dir DIR] [--hold SECONDS]
       lake serve [--dir DIR] [--stop-timeout SECONDS] [--block-bytes N] [--l1-slots N] [--l2-slots N] [--agents N]
                  [--commit-check inline|background|trust] [--transport-listen IP:PORT]
                  [--node N] [--transport-peer NODE=[LOCAL>]IP:PORT[,...] ...]
                  [--rdma-device NAME|any[:PORT[:GID_INDEX]]|loopback]
                  [--l3-dir DIR | --l3-endpoint URL --l3-bucket NAME [--l3-create-bucket yes]]
                  [--l3-prefix P] [--l3-objects N] [--l3-write-back evict|eager]
                  [--l2-admission always|second-access] [--l2-background-depth N]
                  [--l1-load-reserve N] [--l1-class PAYLOAD_BYTES:SLOTS ...] [--l1-chunk-bytes N]
                  [--summary-to IP:PORT[,...]] [--etcd URL --cluster NAME [--member-ttl SECONDS]]
                  [--link-key FILE] [--tag-threads N] [--allow-uid N[,N...]] [--allow-gid N[,N...]]
                  [--socket-group NAME] [--socket-mode OCTAL]
                  [--tenant-key NAMESPACE=FILE ...] [--tenant-keys DIR] [--require-encryption yes]
                  [--quota NAMESPACE:l1|l2|l3=BYTES ...]
                  [--tenant NAME=NAMESPACE[,NAMESPACE...] ...] [--tenant-quota NAME:l1|l2|l3=BYTES ...]
                  [--tenant-rate NAME:l2-read|l2-write|l3-read|l3-write|net-send|net-receive|push=BYTES_PER_S ...]
                  (the embedded pool for engines in other processes, until SIGTERM/SIGINT;
                   DIR is its home, one pool at a time (DIR/lake.lock): its L2 files stay there and
                   are re-adopted at the next start, L1 written down to them at stop within
                   --stop-timeout (30 s); without --dir a temporary directory that goes with it;
                   with a link key every transport and summary connection is authenticated;
                   with an RDMA device each peer's link negotiates RDMA over TCP, falling back to it;
                   --tag-threads spreading the tags of large slices over N threads;
                   --l1-class adding an L1 size class for another block layout (another model),
                   the classes sharing L1 in chunks of four of the largest slots, or of
                   --l1-chunk-bytes N (0: each class owning its slots);
                   SIGHUP reads --tenant-keys DIR's NAMESPACE.key files again: one gone is purged)
       lake cp --socket PATH --mirror PATH --etcd http://HOST:PORT[,...] --cluster NAME --id ID
               [--ttl SECONDS] [--node N] [--entries N]
               (a control plane standing for leadership in etcd: a standby until it leads,
                then serving the socket and writing the mirror under its term)
       lake summary --listen IP:PORT [--etcd URL --cluster NAME --id ID [--ttl SECONDS]]
                    [--checkpoint-dir DIR] [--checkpoint-ms N] [--replicate-children K]
                    [--link-key FILE]
               (the leader's cluster summary: the nodes' deltas applied in order, a gap resynced
                by snapshot, lapsed members' L1 dropped, checkpoints on DIR with the pointer in etcd;
                a block K or more blocks continue is copied into every member's L1)
       lake keygen FILE
               (a new cluster link key, readable by its owner only; an existing file is kept)
       lake top --admin PATH [--once] [--interval-ms N] [--json]
               (the pool at a glance from a running lake-cp's operator socket, DIR/admin.sock)
       lake inspect --admin PATH [--arena PATH] [--json] KEY
               (one block: its replicas, leases, L1 pins (with --arena) and recent history)
       lake namespaces --admin PATH [--json]
               (every namespace holding bytes, by tier)
       lake purge --admin PATH [--wait SECONDS] NAMESPACE
               (drop every replica of a namespace from every tier: an old model, a rotated tenant key)
       lake regions --admin PATH [--json]
               (every region: L1 arena, each L2 file, L3; what each holds, which are draining)
       lake peers --admin PATH [--json]
               (every data plane and agent connected: name, node, pid, wire version, the features
                both sides took; during a rolling upgrade, which are still an older build)
       lake drain --admin PATH [--wait SECONDS] [--undo] REGION|FILE
               (stop writing to an L2 file and move its blocks to the node's other files;
                --wait: until it is empty, then it may be taken away; --undo: use it again)
       lake drain-node --etcd URL --cluster NAME [--wait SECONDS] [--undo] NODE
               (take a node out: it answers /readyz not ready, the leader's summary copies
                every block only it holds into other members' L1 and copies nothing to it;
                --wait: until none is left, then it may be stopped; --undo: take it back)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("demo") => match demo(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lake demo: {e}");
                ExitCode::FAILURE
            }
        },
        Some("serve") => match serve(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lake serve: {e}");
                ExitCode::FAILURE
            }
        },
        Some("cp") => match control_plane(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lake cp: {e}");
                ExitCode::FAILURE
            }
        },
        Some(op @ ("top" | "inspect" | "namespaces" | "purge" | "regions" | "peers" | "drain")) => {
            match operator(op, &args[1..]) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("lake {op}: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some("keygen") => match keygen(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lake keygen: {e}");
                ExitCode::FAILURE
            }
        },
        Some("drain-node") => match drain_node(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lake drain-node: {e}");
                ExitCode::FAILURE
            }
        },
        Some("summary") => match summary_leader(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("lake summary: {e}");
                ExitCode::FAILURE
            }
        },
        Some("help" | "--help" | "-h") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// `lake drain-node`: marks a node draining in etcd (or takes it back);
/// with `--wait`, follows the leader's count of the blocks only it holds
/// until none is left.
fn drain_node(args: &[String]) -> Result<(), String> {
    let (mut etcd, mut cluster, mut wait_s, mut undo, mut node) = (None, None, 0u64, false, None);
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let mut value = || iter.next().ok_or_else(|| format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--etcd" => etcd = Some(value()?.clone()),
            "--cluster" => cluster = Some(value()?.clone()),
            "--wait" => {
                let text = value()?;
                wait_s = text.parse().map_err(|e| format!("--wait {text}: {e}"))?;
            }
            "--undo" => undo = true,
            text if node.is_none() && !text.starts_with("--") => {
                node = Some(text.parse::<u32>().map_err(|e| format!("node {text:?}: {e}"))?);
            }
            _ => return Err(format!("unexpected {arg:?}\n{USAGE}")),
        }
    }
    let (Some(etcd), Some(name), Some(node)) = (etcd, cluster, node) else {
        return Err(format!("--etcd, --cluster and a NODE are required\n{USAGE}"));
    };
    let endpoints: Vec<&str> = etcd.split(',').collect();
    let client = lake_cp::etcd::Etcd::new(&endpoints, std::time::Duration::from_secs(2))
        .map_err(|e| format!("--etcd {etcd}: {e}"))?;
    let cluster = lake_cp::ha::Cluster::new(client, &name).map_err(|e| format!("--cluster {name}: {e}"))?;
    if undo {
        cluster.undrain(node).map_err(|e| e.to_string())?;
        println!("{{\"event\":\"undrained\",\"node\":{node}}}");
        return Ok(());
    }
    let members = cluster.members().map_err(|e| e.to_string())?;
    if !members.iter().any(|(n, _)| *n == node) {
        eprintln!("lake drain-node: node {node} is not a member now (marked all the same)");
    }
    cluster.drain(node).map_err(|e| e.to_string())?;
    println!("{{\"event\":\"draining\",\"node\":{node}}}");
    if wait_s == 0 {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
    loop {
        let left = cluster.drain_left(node).map_err(|e| e.to_string())?;
        if let Some((0, _)) = left {
            println!("{{\"event\":\"drained\",\"node\":{node}}}");
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            let left = left.map_or_else(|| "uncounted (no leader counted yet)".to_owned(), |(n, _)| n.to_string());
            return Err(format!("node {node}: blocks only it holds: {left} after {wait_s} s"));
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn keygen(args: &[String]) -> Result<(), String> {
    let [path] = args else { return Err(format!("one FILE, no more\n{USAGE}")) };
    let path = std::path::Path::new(path);
    let key = lake_dp::auth::LinkKey::generate().map_err(|e| format!("random bytes: {e}"))?;
    key.write_new(path).map_err(|e| format!("{}: {e}", path.display()))?;
    println!("{{\"event\":\"keygen\",\"file\":{:?},\"key_id\":\"{:016x}\"}}", path.display().to_string(), key.id());
    Ok(())
}

/// A namespace id in hex (`7e7e`, `0x7e7e`), as `lake` prints them.
fn namespace_hex(text: &str) -> Option<lake_dp::NamespaceId> {
    u64::from_str_radix(text.trim_start_matches("0x"), 16).ok().map(lake_dp::NamespaceId)
}

/// The tenant keys in `dir`: every `NAMESPACE.key` file (the namespace
/// in hex), each readable by its owner only.
fn read_tenant_keys(
    dir: &std::path::Path,
) -> Result<Vec<(lake_dp::NamespaceId, lake_dp::auth::at_rest::DataKey)>, String> {
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

/// SIGHUP: the tenant keys read again; a new or changed file sets its
/// key, a file gone forgets its tenant (purged from every tier). A
/// directory that cannot be read changes nothing (said so).
fn reload_tenant_keys(
    dir: &std::path::Path,
    pool: &lake_cp::embedded::EmbeddedPool,
    known: &mut std::collections::HashMap<lake_dp::NamespaceId, u64>,
) {
    use lake_dp::auth::at_rest::KeyChange;
    let keys = match read_tenant_keys(dir) {
        Ok(keys) => keys,
        Err(e) => {
            println!("{{\"event\":\"tenant_keys_refused\",\"why\":{e:?}}}");
            return;
        }
    };
    let (mut set, mut forgotten) = (Vec::new(), Vec::new());
    let present: std::collections::HashSet<lake_dp::NamespaceId> = keys.iter().map(|(ns, _)| *ns).collect();
    for (namespace, key) in keys {
        if known.get(&namespace) != Some(&key.id()) {
            known.insert(namespace, key.id());
            set.push(format!("\"{:016x}\"", namespace.0));
            pool.tenant_keys.change(KeyChange::Set(namespace, key));
        }
    }
    known.retain(|namespace, _| {
        let keep = present.contains(namespace);
        if !keep {
            forgotten.push(format!("\"{:016x}\"", namespace.0));
            pool.tenant_keys.change(KeyChange::Forget(*namespace));
        }
        keep
    });
    println!("{{\"event\":\"tenant_keys\",\"set\":[{}],\"forgotten\":[{}]}}", set.join(","), forgotten.join(","));
    let _ = std::io::Write::flush(&mut std::io::stdout());
}

/// A tier by its flag name: `l1`, `l2` or `l3`.
fn tier_named(name: &str) -> Option<lake_dp::Tier> {
    match name {
        "l1" => Some(lake_dp::Tier::L1Dram),
        "l2" => Some(lake_dp::Tier::L2Nvme),
        "l3" => Some(lake_dp::Tier::L3Object),
        _ => None,
    }
}

/// The link key in `path` (`--link-key`).
fn link_key(path: &str) -> Result<lake_dp::auth::LinkKey, String> {
    lake_dp::auth::LinkKey::load(std::path::Path::new(path)).map_err(|e| e.to_string())
}

fn demo(args: &[String]) -> Result<(), String> {
    let mut config = DemoConfig::default();
    let mut iter = args.iter();
    while let Some(flag) = iter.next() {
        let value = iter.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = || value.parse::<u32>().map_err(|e| format!("{flag} {value}: {e}"));
        match flag.as_str() {
            "--sessions" => config.sessions = number()?,
            "--turns" => config.turns = number()?,
            "--engines" => config.engines = number()?,
            "--system-blocks" => config.system_blocks = number()?,
            "--message-blocks" => config.message_blocks = number()?,
            "--reply-blocks" => config.reply_blocks = number()?,
            "--l1-slots" => config.l1_slots = number()?,
            "--l2-slots" => config.l2_slots_per_file = number()?,
            "--seed" => config.seed = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?,
            "--dir" => config.dir = value.into(),
            "--hold" => config.hold_s = u64::from(number()?),
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    println!(
        "lake demo: one process — lake-cp, lake-dp (L1 in /dev/shm, L2 files in {}), {} engine agents; \
         {} conversations x {} turns sharing a {}-block system prompt",
        config.dir.display(),
        config.engines,
        config.sessions,
        config.turns,
        config.system_blocks
    );
    let report = lake_cp::demo::run(&config, &mut std::io::stdout())?;
    print_report(&report);
    if report.mismatches > 0 {
        return Err(format!("{} payloads differed from the model's", report.mismatches));
    }
    Ok(())
}

fn serve(args: &[String]) -> Result<(), String> {
    use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
    use lake_dp::runner::config::L3Section;
    // Before any thread starts: the pool's threads inherit the blocked
    // signals, and this one takes them.
    let signals = lake_dp::runner::os::Signals::with_hangup().map_err(|e| format!("signals: {e}"))?;
    let mut key_dir: Option<std::path::PathBuf> = None;
    // Tenants' namespaces and quotas, joined once every flag is read.
    let mut tenants: Vec<(String, Vec<u64>)> = Vec::new();
    let mut tenant_quotas: Vec<(String, lake_dp::Tier, u64)> = Vec::new();
    let mut tenant_rates: Vec<(String, usize, u64)> = Vec::new();
    let mut config = EmbeddedConfig {
        metrics: true,
        events_to_stderr: true,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-serve-{}", std::process::id())))
    };
    let mut l3 = L3Section::none();
    let mut chunk_bytes: Option<u64> = None;
    let (mut etcd, mut cluster, mut member_ttl) = (None::<String>, None::<String>, 3i64);
    let mut iter = args.iter();
    while let Some(flag) = iter.next() {
        let value = iter.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = || value.parse::<u64>().map_err(|e| format!("{flag} {value}: {e}"));
        let small = || u32::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"));
        match flag.as_str() {
            "--dir" => {
                // A directory of the operator's: the pool's L2 outlives
                // each run of it (without one, the pool's own temporary
                // directory goes with it).
                config.dir = value.into();
                config.durable = true;
            }
            "--stop-timeout" => config.stop_flush = std::time::Duration::from_secs(number()?),
            "--block-bytes" => config.block_bytes = number()?,
            "--l1-slots" => config.l1_slots = small()?,
            "--l2-slots" => config.l2_slots_per_file = small()?,
            "--agents" => config.remote_agents = small()?,
            "--node" => config.node = small()?,
            "--transport-peer" => {
                let (node, rails) =
                    value.split_once('=').ok_or_else(|| format!("{flag} {value}: NODE=[LOCAL>]IP:PORT[,...]"))?;
                let node = node.parse().map_err(|e| format!("{flag} {value}: node: {e}"))?;
                let rails =
                    lake_dp::transport::tcp::Rail::parse_list(rails).map_err(|e| format!("{flag} {value}: {e}"))?;
                config.transport_peers.push((node, rails));
            }
            "--transport-listen" => {
                config.transport_listen = Some(value.parse().map_err(|e| format!("{flag} {value}: {e}"))?);
            }
            "--l2-background-depth" => config.l2_background_depth = small()?,
            "--l1-load-reserve" => config.l1_load_reserve = Some(small()?),
            "--l1-class" => {
                let bad = || format!("{flag} {value}: PAYLOAD_BYTES:SLOTS");
                let (payload, slots) = value.split_once(':').ok_or_else(bad)?;
                config.l1_classes.push((payload.parse().map_err(|_| bad())?, slots.parse().map_err(|_| bad())?));
            }
            "--l1-chunk-bytes" => chunk_bytes = Some(number()?),
            "--rdma-device" => {
                config.rdma = Some(lake_dp::runner::RdmaDevice::parse(value).map_err(|e| format!("{flag}: {e}"))?);
            }
            "--link-key" => config.link_key = Some(link_key(value)?),
            "--tag-threads" => {
                let threads = usize::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"))?;
                lake_dp::auth::spread_tags(threads).map_err(|e| format!("{flag} {value}: {e}"))?;
            }
            "--allow-uid" | "--allow-gid" => {
                let ids = value
                    .split(',')
                    .map(|id| id.parse::<u32>().map_err(|e| format!("{flag} {id}: {e}")))
                    .collect::<Result<Vec<u32>, String>>()?;
                let list =
                    if flag == "--allow-uid" { &mut config.access.allow_uids } else { &mut config.access.allow_gids };
                list.extend(ids);
            }
            "--socket-group" => config.access.group = Some(value.clone()),
            "--tenant-key" => {
                let (namespace, file) =
                    value.split_once('=').ok_or_else(|| format!("{flag} {value}: NAMESPACE(hex)=FILE"))?;
                let namespace =
                    namespace_hex(namespace).ok_or_else(|| format!("{flag} {value}: the namespace is not hex"))?;
                let key = lake_dp::auth::at_rest::DataKey::load(std::path::Path::new(file))
                    .map_err(|e| format!("{flag} {value}: {e}"))?;
                config.tenant_keys.push((namespace, key));
            }
            "--require-encryption" => config.require_encryption = value == "yes",
            "--tenant-keys" => key_dir = Some(value.into()),
            "--quota" => {
                let bad = || format!("{flag} {value}: NAMESPACE(hex):l1|l2|l3=BYTES");
                let (place, bytes) = value.split_once('=').ok_or_else(bad)?;
                let (namespace, tier) = place.split_once(':').ok_or_else(bad)?;
                let namespace = namespace_hex(namespace).ok_or_else(bad)?.0;
                let tier = tier_named(tier).ok_or_else(bad)?;
                let bytes = bytes.parse().map_err(|_| bad())?;
                config.tiers.quotas.push(lake_cp::tier::Quota { namespace, tier, bytes });
            }
            "--tenant" => {
                let bad = || format!("{flag} {value}: NAME=NAMESPACE(hex)[,NAMESPACE...]");
                let (name, list) = value.split_once('=').ok_or_else(bad)?;
                let namespaces = list
                    .split(',')
                    .map(|n| namespace_hex(n).map(|n| n.0))
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(bad)?;
                if name.is_empty() || tenants.iter().any(|(n, _)| n == name) {
                    return Err(format!("{flag} {value}: a tenant is named once, and not empty"));
                }
                if let Some((other, _)) = tenants.iter().find(|(_, ns)| ns.iter().any(|n| namespaces.contains(n))) {
                    return Err(format!("{flag} {value}: a namespace of it is tenant {other}'s already"));
                }
                tenants.push((name.to_owned(), namespaces));
            }
            "--tenant-quota" => {
                let bad = || format!("{flag} {value}: NAME:l1|l2|l3=BYTES");
                let (place, bytes) = value.split_once('=').ok_or_else(bad)?;
                let (name, tier) = place.split_once(':').ok_or_else(bad)?;
                let tier = tier_named(tier).ok_or_else(bad)?;
                tenant_quotas.push((name.to_owned(), tier, bytes.parse().map_err(|_| bad())?));
            }
            "--tenant-rate" => {
                let bad = || {
                    format!(
                        "{flag} {value}: NAME:l2-read|l2-write|l3-read|l3-write|net-send|net-receive|push=BYTES_PER_S \
                         (at least 1)"
                    )
                };
                let (place, rate) = value.split_once('=').ok_or_else(bad)?;
                let (name, path) = place.split_once(':').ok_or_else(bad)?;
                let path = ["l2-read", "l2-write", "l3-read", "l3-write", "net-send", "push", "net-receive"]
                    .iter()
                    .position(|p| *p == path)
                    .ok_or_else(bad)?;
                let rate: u64 = rate.parse().map_err(|_| bad())?;
                if rate == 0 {
                    return Err(bad());
                }
                tenant_rates.push((name.to_owned(), path, rate));
            }
            "--socket-mode" => {
                config.access.socket_mode = Some(
                    u32::from_str_radix(value.trim_start_matches("0o"), 8)
                        .map_err(|e| format!("{flag} {value}: {e}"))?,
                );
            }
            "--l3-dir" => l3.dir = Some(value.into()),
            "--l3-endpoint" => l3.endpoint = Some(value.clone()),
            "--l3-bucket" => l3.bucket = Some(value.clone()),
            "--l3-create-bucket" => l3.create_bucket = value == "yes",
            "--l3-prefix" => l3.prefix = value.clone(),
            "--l3-objects" => l3.objects = small()?,
            "--summary-to" => {
                for address in value.split(',') {
                    config.summary_to.push(address.parse().map_err(|e| format!("{flag} {address}: {e}"))?);
                }
            }
            "--etcd" => etcd = Some(value.clone()),
            "--cluster" => cluster = Some(value.clone()),
            "--member-ttl" => member_ttl = i64::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"))?.max(1),
            "--l2-admission" => {
                config.tiers.l2_admission = lake_cp::tier::L2Admission::parse(value)
                    .ok_or_else(|| format!("--l2-admission is always or second-access, not {value}"))?;
            }
            "--l3-write-back" => {
                config.tiers.l3_write_back = lake_cp::tier::L3WriteBack::parse(value)
                    .ok_or_else(|| format!("--l3-write-back is evict or eager, not {value}"))?;
            }
            "--commit-check" => {
                use lake_dp::runner::pool::CommitCheck;
                config.commit_check = match value.as_str() {
                    "inline" => CommitCheck::Inline,
                    "background" => CommitCheck::Background,
                    "trust" => CommitCheck::Trust,
                    other => return Err(format!("--commit-check is inline, background or trust, not {other}")),
                }
            }
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    for (name, tier, bytes) in tenant_quotas {
        let namespaces =
            tenants.iter().find(|(n, _)| *n == name).map(|(_, ns)| ns.clone()).ok_or_else(|| {
                format!("--tenant-quota {name}: no --tenant {name}=NAMESPACE,... says its namespaces")
            })?;
        config.tiers.tenant_quotas.push(lake_cp::tier::TenantQuota { tenant: name, namespaces, tier, bytes });
    }
    for (name, path, rate) in tenant_rates {
        let namespaces = tenants
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, ns)| ns.clone())
            .ok_or_else(|| format!("--tenant-rate {name}: no --tenant {name}=NAMESPACE,... says its namespaces"))?;
        let entry = match config.tenant_rates.iter_mut().position(|t| t.name == name) {
            Some(at) => &mut config.tenant_rates[at],
            None => {
                config.tenant_rates.push(lake_dp::runner::config::TenantSection {
                    name: name.clone(),
                    namespaces: namespaces.iter().map(|n| format!("{n:016x}")).collect(),
                    l2_read_bytes_per_s: None,
                    l2_write_bytes_per_s: None,
                    l3_read_bytes_per_s: None,
                    l3_write_bytes_per_s: None,
                    net_send_bytes_per_s: None,
                    push_bytes_per_s: None,
                    net_receive_bytes_per_s: None,
                });
                config.tenant_rates.last_mut().ok_or("a tenant just added")?
            }
        };
        let cap = match path {
            0 => &mut entry.l2_read_bytes_per_s,
            1 => &mut entry.l2_write_bytes_per_s,
            2 => &mut entry.l3_read_bytes_per_s,
            3 => &mut entry.l3_write_bytes_per_s,
            4 => &mut entry.net_send_bytes_per_s,
            5 => &mut entry.push_bytes_per_s,
            _ => &mut entry.net_receive_bytes_per_s,
        };
        *cap = Some(rate);
    }
    if l3 != L3Section::none() {
        if l3.dir.is_none() && l3.endpoint.is_none() {
            return Err("--l3-* options need --l3-dir or --l3-endpoint".into());
        }
        config.l3 = Some(l3);
    }
    // Membership: this node's key in etcd under a lease it renews; a node
    // that stops (or is killed) leaves the summary's members when it runs
    // out.
    let cluster = match (&etcd, &cluster) {
        (Some(etcd), Some(name)) => {
            let endpoints: Vec<&str> = etcd.split(',').collect();
            let client = lake_cp::etcd::Etcd::new(&endpoints, std::time::Duration::from_secs(2))
                .map_err(|e| format!("--etcd {etcd}: {e}"))?;
            Some(lake_cp::ha::Cluster::new(client, name).map_err(|e| format!("--cluster {name}: {e}"))?)
        }
        (None, None) => None,
        _ => return Err("--etcd and --cluster go together".into()),
    };
    // Tenant keys from a directory (NAMESPACE.key files), read again on
    // SIGHUP: a file gone is a tenant forgotten (its blocks purged).
    let mut tenant_files = std::collections::HashMap::new();
    if let Some(dir) = &key_dir {
        for (namespace, key) in read_tenant_keys(dir)? {
            tenant_files.insert(namespace, key.id());
            config.tenant_keys.push((namespace, key));
        }
    }
    // Several size classes share L1 unless told not to (`--l1-chunk-bytes
    // 0`): chunks of four of the largest slots. Fixed shares strand one
    // model's traffic while the other's slots sit empty, and lake-cp,
    // seeing L1 by bytes, would never make room.
    config.l1_chunk_bytes = chunk_bytes.unwrap_or_else(|| {
        let largest = config.l1_size_classes().map(|(payload, _)| lake_dp::stored::object_bytes(payload)).max();
        if config.l1_classes.is_empty() { 0 } else { 4 * largest.unwrap_or(0) }
    });
    let mut pool = EmbeddedPool::start(&config)?;
    let address = config.transport_listen.map_or_else(|| pool.cp_socket.display().to_string(), |a| a.to_string());
    let mut member = match &cluster {
        Some(cluster) => Some(cluster.join(config.node, &address, member_ttl).map_err(|e| format!("joining: {e}"))?),
        None => None,
    };
    let renew_every = std::time::Duration::from_millis(u64::try_from(member_ttl).unwrap_or(1) * 1000 / 3);
    let mut renewed = std::time::Instant::now();
    // The L1 (region, epoch) the membership value names.
    let mut announced: Option<(u16, u64)> = None;
    let serving = serde_json::json!({
        "event": "serving",
        "dp_socket": pool.dp_socket,
        "cp_socket": pool.cp_socket,
        "admin_socket": pool.admin_socket,
        "arena": pool.arena,
        "mirror": pool.mirror,
        "metrics": pool.metrics.map_or_else(String::new, |a| a.to_string()),
        "block_bytes": config.block_bytes,
        // Every L1 size class as [payload bytes, slots]: an engine checks
        // that its blocks fit one before it saves anything.
        "l1_classes": config.l1_size_classes().map(|(payload, slots)| serde_json::json!([payload, slots])).collect::<Vec<_>>(),
    });
    // The same record in DIR/pool.json, for engines configured with the
    // pool's directory alone: the mirror's and metrics' names change from
    // one start to the next, DIR does not. Written first: whoever reads
    // the serving line finds it.
    let record = config.dir.join(POOL_RECORD);
    write_atomically(&record, format!("{serving}\n").as_bytes()).map_err(|e| format!("{}: {e}", record.display()))?;
    println!("{serving}");
    let _ = std::io::Write::flush(&mut std::io::stdout());
    loop {
        // A plane that stopped on its own cannot serve: say why, exit non-zero.
        if let Some(why) = pool.failed() {
            let _ = std::fs::remove_file(&record);
            return Err(why);
        }
        match signals.take() {
            Some(libc::SIGHUP) => {
                if let Some(dir) = &key_dir {
                    reload_tenant_keys(dir, &pool, &mut tenant_files);
                }
            }
            Some(_) => break,
            None => {}
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        if renewed.elapsed() >= renew_every
            && let (Some(cluster), Some(current)) = (&cluster, &member)
        {
            renewed = std::time::Instant::now();
            match current.keep_alive() {
                Ok(true) => {}
                // Lapsed (a long stall): join again; the summary gets this
                // node's replicas back from its next snapshot.
                Ok(false) => {
                    member = cluster.join(config.node, &address, member_ttl).ok();
                    announced = None;
                }
                Err(e) => eprintln!("lake serve: renewing membership: {e}"),
            }
            // Where other nodes' copies go (the leader's drains and
            // replication target it by this), once the L1 is registered.
            let space = pool.gauges.l1_space();
            if space.is_some()
                && space != announced
                && let (Some(current), Some(space)) = (&member, space)
            {
                match current.announce(config.node, &address, space) {
                    Ok(()) => announced = Some(space),
                    Err(e) => eprintln!("lake serve: announcing the L1: {e}"),
                }
            }
            // Drained by an operator (`lake drain-node`): not ready for new
            // requests; the leader moves its blocks away.
            match cluster.draining() {
                Ok(marks) => {
                    let draining = marks.iter().any(|&(node, _)| node == config.node);
                    if pool.draining.swap(draining, std::sync::atomic::Ordering::Relaxed) != draining {
                        println!("{{\"event\":\"draining\",\"node\":{},\"on\":{draining}}}", config.node);
                        let _ = std::io::Write::flush(&mut std::io::stdout());
                    }
                }
                Err(e) => eprintln!("lake serve: reading drain marks: {e}"),
            }
        }
    }
    if let Some(member) = member {
        let _ = member.leave();
    }
    let _ = std::fs::remove_file(&record);
    if config.durable {
        let (left, took) = pool.empty_l1();
        // Blocks still in L1 now (held by an engine, or no L2 room) are
        // lost with it; every other block is on L2 for the next start.
        println!("{{\"event\":\"l1_written_down\",\"blocks_left\":{left},\"ms\":{}}}", took.as_millis());
    }
    let (stats, _) = pool.stop()?;
    println!(
        "{{\"event\":\"stopped\",\"agents_attached\":{},\"saves\":{},\"promotions\":{},\"demotions\":{},\
         \"l3_writes\":{},\"l3_reads\":{},\"l3_deletes\":{}}}",
        stats.agents_attached,
        stats.pool.saves,
        stats.pool.promotions,
        stats.pool.demotions,
        stats.l3.writes,
        stats.l3.reads,
        stats.l3.deletes
    );
    Ok(())
}

/// Where `lake serve` records its endpoints, in its `--dir`.
const POOL_RECORD: &str = "pool.json";

/// Writes `path` whole or not at all: a reader sees the old file or the
/// new one, never a part.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}

/// `lake cp`: one control plane of a node, standing for leadership.
fn control_plane(args: &[String]) -> Result<(), String> {
    use std::time::{Duration, Instant};

    use lake_cp::etcd::Etcd;
    use lake_cp::ha::Cluster;
    use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorWriter};

    let signals = lake_dp::runner::os::Signals::new().map_err(|e| format!("signals: {e}"))?;
    let (mut socket, mut mirror, mut etcd, mut cluster, mut id) = (None, None, None, None, None);
    let (mut ttl, mut node, mut entries) = (5i64, 0u32, 1u64 << 20);
    let mut iter = args.iter();
    while let Some(flag) = iter.next() {
        let value = iter.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = || value.parse::<u64>().map_err(|e| format!("{flag} {value}: {e}"));
        match flag.as_str() {
            "--socket" => socket = Some(std::path::PathBuf::from(value)),
            "--mirror" => mirror = Some(std::path::PathBuf::from(value)),
            "--etcd" => etcd = Some(value.clone()),
            "--cluster" => cluster = Some(value.clone()),
            "--id" => id = Some(value.clone()),
            "--ttl" => ttl = i64::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"))?.max(1),
            "--node" => node = u32::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"))?,
            "--entries" => entries = number()?,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    fn need<T>(what: Option<T>, flag: &str) -> Result<T, String> {
        what.ok_or_else(|| format!("{flag} is required\n{USAGE}"))
    }
    let (socket, mirror) = (need(socket, "--socket")?, need(mirror, "--mirror")?);
    let (etcd, cluster, id) = (need(etcd, "--etcd")?, need(cluster, "--cluster")?, need(id, "--id")?);
    let endpoints: Vec<&str> = etcd.split(',').collect();
    let cluster = Cluster::new(Etcd::new(&endpoints, Duration::from_secs(2)).map_err(|e| e.to_string())?, &cluster)
        .map_err(|e| e.to_string())?;
    let mut candidate = cluster.candidate(&id, ttl).map_err(|e| e.to_string())?;
    let every = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 4).max(Duration::from_millis(50));
    let say = |line: String| {
        println!("{line}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    // A standby until it leads (or is told to stop).
    let Some(term) = stand_by(&mut candidate, &id, every, &signals, "lake cp") else { return Ok(()) };
    // The mirror engines already read is taken over (their mappings stay
    // good) and emptied: the view is rebuilt from what the data planes
    // re-adopt. One that is not there, or not a mirror, is made anew. One
    // whose writer lives belongs to a predecessor that is stopped, not
    // dead: it is deposed when it wakes (it renews before it acts) and
    // lets go; until then this leader waits, renewing its own lease.
    let mut said_waiting = false;
    let writer = loop {
        match MirrorWriter::take_over(&mirror, term) {
            Ok((mut writer, _)) => {
                writer.clear();
                break writer;
            }
            Err(lake_dp::mirror::MirrorError::InUse { pid }) => {
                if !said_waiting {
                    said_waiting = true;
                    say(format!("{{\"event\":\"waiting\",\"id\":\"{id}\",\"term\":{term},\"mirror_writer\":{pid}}}"));
                }
                std::thread::sleep(Duration::from_millis(100));
                if signals.take().is_some() {
                    let _ = candidate.resign();
                    return Ok(());
                }
                if !candidate.keep_alive().unwrap_or(true) {
                    return Err(format!("deposed while waiting for the mirror (term {term})"));
                }
            }
            Err(_) => {
                break MirrorWriter::create(&MirrorConfig::for_entries(MirrorBacking::Shm(mirror.clone()), entries))
                    .map_err(|e| format!("mirror {}: {e}", mirror.display()))?;
            }
        }
    };
    let state = lake_cp::node::Node::new(lake_dp::NodeId(node), term, Some(writer));
    let mut server =
        lake_cp::server::Server::bind(&socket, state, term).map_err(|e| format!("{}: {e}", socket.display()))?;
    say(format!(
        "{{\"event\":\"leading\",\"id\":\"{id}\",\"term\":{term},\"socket\":\"{}\",\"mirror\":\"{}\"}}",
        socket.display(),
        mirror.display()
    ));
    let renew = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 3);
    let lease = Duration::from_secs(u64::try_from(ttl).unwrap_or(1));
    let (mut last_renewal, mut confirmed) = (Instant::now(), Instant::now());
    loop {
        if signals.take().is_some() {
            // Handing over now: the standby need not wait out the lease.
            let _ = candidate.resign();
            say(format!("{{\"event\":\"resigned\",\"id\":\"{id}\",\"term\":{term}}}"));
            return Ok(());
        }
        // Renewed before serving: a leader that was stopped (SIGSTOP, a
        // stalled host) past its lease finds out before it acts again.
        if last_renewal.elapsed() >= renew {
            last_renewal = Instant::now();
            let deposed = match candidate.keep_alive() {
                Ok(true) => {
                    confirmed = Instant::now();
                    None
                }
                Ok(false) => Some(format!("the lease of term {term} expired")),
                // etcd unreachable: lead on only while the lease may stand.
                Err(e) if confirmed.elapsed() < lease => {
                    eprintln!("lake cp: renewing the lease: {e}");
                    None
                }
                Err(e) => Some(format!("no renewal for a whole lease ({e})")),
            };
            if let Some(why) = deposed {
                say(format!("{{\"event\":\"deposed\",\"id\":\"{id}\",\"term\":{term}}}"));
                return Err(format!("deposed: {why}; stopping"));
            }
        }
        server.poll_once(Some(Duration::from_millis(5))).map_err(|e| format!("serving: {e}"))?;
    }
}

#[allow(clippy::cast_precision_loss)]
fn print_report(r: &DemoReport) {
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let p = |x: &Percentiles| format!("p50 {:.1} µs, p90 {:.1}, p99 {:.1}, max {:.1}", x.p50, x.p90, x.p99, x.max);
    let dp = &r.data_plane;
    println!();
    println!("turns              {} in {:.1} s", r.turns, r.seconds);
    println!(
        "hit rate           {:.1}% of {} prompt blocks served from the pool ({} from L1, {} promoted from L2); \
         {} looked-up blocks recomputed",
        100.0 * r.hit_rate(),
        r.blocks_requested,
        r.served_l1,
        r.served_l2,
        r.fetch_failures
    );
    println!("integrity          {} payload mismatches (every served block compared)", r.mismatches);
    println!(
        "saves              {} blocks saved, {} skipped ({} KiB each)",
        r.saves.0,
        r.saves.1,
        r.block_bytes / 1024
    );
    for (name, usage) in ["L1", "L2"].iter().zip(&r.tiers) {
        println!(
            "{name} now            {:.1} of {:.1} MiB ({} blocks)",
            mib(usage.bytes),
            mib(usage.capacity_bytes),
            usage.blocks
        );
    }
    println!(
        "tier moves         {} demoted L1->L2, {} dropped from L1, {} dropped from L2; {} promoted L2->L1",
        r.moves.0, r.moves.1, r.moves.2, dp.pool.promotions
    );
    println!("bytes moved        {:.1} MiB L1->L2, {:.1} MiB L2->L1", mib(dp.pool.bytes_down), mib(dp.pool.bytes_up));
    println!("lookup (mirror)    {}", p(&r.lookup_us));
    println!("fetch per request  {}", p(&r.fetch_us));
    println!("save per request   {}", p(&r.save_us));
    #[allow(clippy::cast_precision_loss)]
    let busy = dp.busy_ns as f64 / (dp.busy_ns + dp.idle_ns + dp.parked_ns).max(1) as f64;
    println!("lake-dp            {:.1}% of its loop busy, {} parks", 100.0 * busy, dp.parks);
    if let Some(address) = r.metrics {
        println!("metrics            http://{address}/metrics served {} lines while the pool ran", r.metrics_lines);
    }
    println!(
        "{{\"turns\":{},\"blocks_requested\":{},\"blocks_served\":{},\"hit_rate\":{:.4},\"mismatches\":{},\
         \"demotions\":{},\"promotions\":{},\"l1_bytes\":{},\"l2_bytes\":{},\"lookup_p50_us\":{:.2},\
         \"lookup_p99_us\":{:.2},\"fetch_p50_us\":{:.1},\"fetch_p99_us\":{:.1},\"save_p50_us\":{:.1},\
         \"save_p99_us\":{:.1},\"seconds\":{:.2}}}",
        r.turns,
        r.blocks_requested,
        r.blocks_served,
        r.hit_rate(),
        r.mismatches,
        r.moves.0,
        dp.pool.promotions,
        r.tiers[0].bytes,
        r.tiers[1].bytes,
        r.lookup_us.p50,
        r.lookup_us.p99,
        r.fetch_us.p50,
        r.fetch_us.p99,
        r.save_us.p50,
        r.save_us.p99,
        r.seconds
    );
}

/// `lake summary`: the leader's cluster summary (see `lake_cp::summary`).
fn summary_leader(args: &[String]) -> Result<(), String> {
    use std::time::{Duration, Instant};

    use lake_cp::ha::{Cluster, Role};
    use lake_cp::summary::Summary;
    use lake_cp::summary::link::Aggregator;
    use lake_dp::l3::ObjectStore;

    let signals = lake_dp::runner::os::Signals::new().map_err(|e| format!("signals: {e}"))?;
    let (mut listen, mut etcd, mut cluster, mut id, mut dir) = (None, None, None, None, None);
    let (mut ttl, mut checkpoint_ms, mut replicate_children) = (3i64, 1000u64, 0usize);
    let mut key = None;
    let mut iter = args.iter();
    while let Some(flag) = iter.next() {
        let value = iter.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let number = || value.parse::<u64>().map_err(|e| format!("{flag} {value}: {e}"));
        match flag.as_str() {
            "--listen" => {
                listen = Some(value.parse::<std::net::SocketAddr>().map_err(|e| format!("{flag} {value}: {e}"))?)
            }
            "--etcd" => etcd = Some(value.clone()),
            "--cluster" => cluster = Some(value.clone()),
            "--id" => id = Some(value.clone()),
            "--ttl" => ttl = i64::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"))?.max(1),
            "--checkpoint-dir" => dir = Some(std::path::PathBuf::from(value)),
            "--checkpoint-ms" => checkpoint_ms = number()?.max(10),
            "--link-key" => key = Some(link_key(value)?),
            "--replicate-children" => {
                replicate_children = usize::try_from(number()?).map_err(|e| format!("{flag} {value}: {e}"))?;
            }
            _ => return Err(format!("unknown flag {flag}\n{USAGE}")),
        }
    }
    let listen = listen.ok_or_else(|| format!("--listen is required\n{USAGE}"))?;
    let say = |line: String| {
        println!("{line}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    let cluster = match (&etcd, &cluster) {
        (Some(etcd), Some(name)) => {
            let endpoints: Vec<&str> = etcd.split(',').collect();
            let client = lake_cp::etcd::Etcd::new(&endpoints, Duration::from_secs(2)).map_err(|e| e.to_string())?;
            Some(Cluster::new(client, name).map_err(|e| e.to_string())?)
        }
        (None, None) => None,
        _ => return Err("--etcd and --cluster go together".into()),
    };
    let mut store = match &dir {
        Some(dir) => Some(lake_dp::l3::dir::DirStore::open(dir).map_err(|e| e.to_string())?),
        None => None,
    };
    let id = id.unwrap_or_else(|| format!("summary-{}", std::process::id()));
    let mut candidate = match &cluster {
        Some(cluster) => Some(cluster.candidate(&id, ttl).map_err(|e| e.to_string())?),
        None => None,
    };
    // A standby until it leads.
    let every = Duration::from_millis(u64::try_from(ttl).unwrap_or(1) * 1000 / 4).max(Duration::from_millis(50));
    let mut term = 1;
    if let Some(candidate) = &mut candidate {
        let Some(elected) = stand_by(candidate, &id, every, &signals, "lake summary") else { return Ok(()) };
        term = elected;
    }
    // Where the last leader left the summary: its checkpoint, then the
    // nodes' snapshots (each node sends one as it connects).
    let mut summary = Summary::new();
    if let (Some(cluster), Some(store)) = (&cluster, &mut store)
        && let Some(pointer) = cluster.checkpoint().map_err(|e| e.to_string())?
    {
        match store.get(&pointer.location) {
            Ok(Some(bytes)) => match Summary::restore(&bytes) {
                Ok((restored, written_in)) => {
                    summary = restored;
                    say(format!(
                        "{{\"event\":\"restored\",\"location\":\"{}\",\"term\":{written_in},\"nodes\":{}}}",
                        pointer.location,
                        nodes_json(&summary)
                    ));
                }
                Err(e) => eprintln!("lake summary: checkpoint {}: {e} (starting empty)", pointer.location),
            },
            Ok(None) => eprintln!("lake summary: checkpoint {} is gone (starting empty)", pointer.location),
            Err(e) => eprintln!("lake summary: checkpoint {}: {e} (starting empty)", pointer.location),
        }
    }
    let mut aggregator = Aggregator::bind(listen, summary).map_err(|e| format!("--listen {listen}: {e}"))?;
    if let Some(key) = key {
        aggregator.authenticate(key);
    }
    say(format!(
        "{{\"event\":\"leading\",\"listen\":\"{}\",\"term\":{term}}}",
        aggregator.local_addr().map_err(|e| e.to_string())?
    ));
    let (mut last_report, mut last_checkpoint, mut last_renew) = (Instant::now(), Instant::now(), Instant::now());
    let mut last_answer = Instant::now();
    let mut written = 0u64;
    let mut previous: Option<String> = None;
    // Nodes an operator drains, with the revision of each mark.
    let mut drain_marks: Vec<(u32, i64)> = Vec::new();
    while signals.take().is_none() {
        aggregator.pump();
        for what in aggregator.take_security_events() {
            say(format!("{{\"event\":\"link_refused\",\"what\":{what:?}}}"));
        }
        std::thread::sleep(Duration::from_millis(2));
        if last_renew.elapsed() >= every {
            last_renew = Instant::now();
            if let (Some(cluster), Some(candidate)) = (&cluster, &mut candidate) {
                // Lost: the lease expired, or another leads. etcd not
                // answering is not known to be lost — until a whole lease
                // has passed since the last renewal it answered.
                let renewed = match candidate.keep_alive() {
                    Ok(true) => match candidate.campaign() {
                        Ok(Role::Leader { .. }) => Some(true),
                        Ok(Role::Standby { .. }) => Some(false),
                        Err(_) => None,
                    },
                    Ok(false) => Some(false),
                    Err(_) => None,
                };
                match renewed {
                    Some(true) => last_answer = Instant::now(),
                    None if last_answer.elapsed() < Duration::from_secs(u64::try_from(ttl).unwrap_or(1)) => {}
                    _ => {
                        say(format!("{{\"event\":\"deposed\",\"id\":\"{id}\",\"term\":{term}}}"));
                        return Err("deposed: the lease is lost or another leads; stopping".into());
                    }
                }
                match cluster.members() {
                    Ok(members) => {
                        let nodes: Vec<u32> = members.iter().map(|(node, _)| *node).collect();
                        aggregator.summary.membership(&nodes);
                        let spaces: Vec<(u32, (u16, u64))> = members
                            .iter()
                            .filter_map(|(node, value)| lake_cp::ha::member_l1(value).map(|l1| (*node, l1)))
                            .collect();
                        aggregator.summary.l1_spaces(&spaces);
                    }
                    Err(e) => eprintln!("lake summary: members: {e}"),
                }
                match cluster.draining() {
                    Ok(marks) => {
                        let nodes: Vec<u32> = marks.iter().map(|(node, _)| *node).collect();
                        aggregator.summary.draining(&nodes);
                        drain_marks = marks;
                    }
                    Err(e) => eprintln!("lake summary: drain marks: {e}"),
                }
            }
        }
        if let Some(store) = &mut store
            && last_checkpoint.elapsed() >= Duration::from_millis(checkpoint_ms)
        {
            last_checkpoint = Instant::now();
            written += 1;
            let name = format!("summary/{term:020}-{written:010}");
            let bytes = aggregator.summary.checkpoint(term);
            match store.put(&name, &bytes) {
                Ok(()) => {
                    let published = match &candidate {
                        Some(candidate) => candidate.publish_checkpoint(&name).unwrap_or(false),
                        None => true,
                    };
                    if published {
                        if let Some(old) = previous.replace(name.clone()) {
                            let _ = store.delete(&old);
                        }
                        say(format!("{{\"event\":\"checkpoint\",\"location\":\"{name}\",\"bytes\":{}}}", bytes.len()));
                    } else {
                        let _ = store.delete(&name);
                    }
                }
                Err(e) => eprintln!("lake summary: writing {name}: {e}"),
            }
        }
        if last_report.elapsed() >= Duration::from_secs(1) {
            last_report = Instant::now();
            // Hot prefixes into every member's L1 (each copy asked at most
            // once per 10 s: it shows in the summary once it lands).
            aggregator.replicate(replicate_children, 64, Duration::from_secs(10));
            // Draining nodes: what only they hold, into other members' L1
            // (each copy asked again after 3 s until it shows), and how
            // much is left, for `lake drain-node --wait`.
            aggregator.drain(256, Duration::from_secs(3));
            if let Some(cluster) = &cluster {
                for &(node, mark) in &drain_marks {
                    // Not while the node's view waits for a snapshot (a
                    // gap, a leader just restored): it may be short of
                    // blocks, and "none left" must not be said early.
                    let figures = aggregator.summary.figures(node).filter(|f| !f.gap);
                    let Some(left) = figures.map(|f| f.drain_left) else { continue };
                    if let Err(e) = cluster.drain_progress(node, mark, left) {
                        eprintln!("lake summary: drain progress of node {node}: {e}");
                    }
                }
            }
            let c = aggregator.counters;
            say(format!(
                "{{\"event\":\"summary\",\"connected\":{:?},\"applied\":{},\"snapshot_frames\":{},\"gaps\":{},\"copies_asked\":{},\"drain_copies_asked\":{},\"nodes\":{}}}",
                aggregator.connected(),
                c.applied,
                c.snapshot_frames,
                c.gaps,
                c.copies_asked,
                c.drain_copies_asked,
                nodes_json(&aggregator.summary)
            ));
        }
    }
    if let Some(candidate) = candidate {
        let _ = candidate.resign();
    }
    Ok(())
}

fn nodes_json(summary: &lake_cp::summary::Summary) -> String {
    let nodes: Vec<String> = summary
        .nodes()
        .into_iter()
        .filter_map(|node| summary.figures(node).map(|f| (node, f)))
        .map(|(node, f)| {
            format!(
                "{{\"node\":{node},\"term\":{},\"sequence\":{},\"member\":{},\"gap\":{},\"draining\":{},\"drain_left\":{},\"replicas\":{:?},\"available\":{:?}}}",
                f.term, f.sequence, f.member, f.gap, f.draining, f.drain_left, f.replicas, f.available
            )
        })
        .collect();
    format!("[{}]", nodes.join(","))
}

/// Campaigns every `every` until `candidate` leads (printing `standby`
/// events, then `elected`): its term, or `None` when a signal says stop.
fn stand_by(
    candidate: &mut lake_cp::ha::Candidate<'_>,
    id: &str,
    every: std::time::Duration,
    signals: &lake_dp::runner::os::Signals,
    who: &str,
) -> Option<u64> {
    use lake_cp::ha::Role;
    let say = |line: String| {
        println!("{line}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
    };
    let term = loop {
        match candidate.campaign() {
            Ok(Role::Leader { term }) => break term,
            Ok(Role::Standby { leader, term }) => {
                say(format!("{{\"event\":\"standby\",\"id\":\"{id}\",\"leader\":\"{leader}\",\"term\":{term}}}"));
            }
            Err(e) => eprintln!("{who}: campaigning: {e}"),
        }
        let woke = std::time::Instant::now();
        while woke.elapsed() < every {
            if signals.take().is_some() {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    say(format!("{{\"event\":\"elected\",\"id\":\"{id}\",\"term\":{term}}}"));
    Some(term)
}

/// One request to a running `lake-cp`'s operator socket, its answer.
fn ask_admin(path: &std::path::Path, request: &serde_json::Value) -> Result<serde_json::Value, String> {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(path)
        .map_err(|e| format!("{}: {e} (is lake serve running there?)", path.display()))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).map_err(|e| e.to_string())?;
    writeln!(stream, "{request}").map_err(|e| format!("{}: {e}", path.display()))?;
    let mut line = String::new();
    std::io::BufReader::new(&stream).read_line(&mut line).map_err(|e| format!("{}: {e}", path.display()))?;
    let answer: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("{}: an answer that is not JSON: {e}", path.display()))?;
    match answer.get("error").and_then(serde_json::Value::as_str) {
        Some(why) => Err(why.to_owned()),
        None => Ok(answer),
    }
}

#[allow(clippy::cast_precision_loss)] // bytes shown in MiB to an operator
fn mib(bytes: &serde_json::Value) -> String {
    format!("{:.1}", bytes.as_u64().unwrap_or(0) as f64 / f64::from(1 << 20))
}

/// `lake top`, `lake inspect`, `lake namespaces`, `lake purge`.
fn operator(op: &str, args: &[String]) -> Result<(), String> {
    use serde_json::json;
    let (mut admin, mut arena, mut json_out, mut once, mut interval_ms, mut wait_s) =
        (None, None, false, false, 1000, 0);
    let mut undo = false;
    let mut positional = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let mut value = || iter.next().ok_or_else(|| format!("{arg} needs a value\n{USAGE}"));
        match arg.as_str() {
            "--admin" => admin = Some(std::path::PathBuf::from(value()?)),
            "--arena" => arena = Some(std::path::PathBuf::from(value()?)),
            "--json" => json_out = true,
            "--once" => once = true,
            "--undo" => undo = true,
            "--interval-ms" => {
                let v = value()?;
                interval_ms = v.parse::<u64>().map_err(|e| format!("--interval-ms {v}: {e}"))?.max(100);
            }
            "--wait" => {
                let v = value()?;
                wait_s = v.parse::<u64>().map_err(|e| format!("--wait {v}: {e}"))?;
            }
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}\n{USAGE}")),
            other => positional.push(other.to_owned()),
        }
    }
    let admin = admin.ok_or_else(|| format!("--admin PATH (lake serve's DIR/admin.sock) is required\n{USAGE}"))?;
    let show = |value: &serde_json::Value, text: String| {
        if json_out { println!("{value}") } else { print!("{text}") }
    };
    match op {
        "top" => loop {
            let top = ask_admin(&admin, &json!({ "op": "top" }))?;
            if !once && !json_out {
                // Clear the terminal, as top does.
                print!("\x1b[H\x1b[2J");
            }
            show(&top, render_top(&top));
            let _ = std::io::Write::flush(&mut std::io::stdout());
            if once {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(interval_ms));
        },
        "inspect" => {
            let [key] = positional.as_slice() else {
                return Err(format!("inspect takes one KEY (32 hex digits)\n{USAGE}"));
            };
            let mut block = ask_admin(&admin, &json!({ "op": "inspect", "key": key }))?;
            if let Some(path) = &arena {
                let attached =
                    lake_dp::arena::Arena::attach(path).map_err(|e| format!("--arena {}: {e}", path.display()))?;
                let region_of_l1 = block["replicas"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|r| r["tier"] == "l1")
                    .filter_map(|r| Some((r["slot"].as_u64()?, r["generation"].as_u64()?)))
                    .collect::<Vec<_>>();
                let mut pins = Vec::new();
                for (slot, generation) in region_of_l1 {
                    let slot = u32::try_from(slot).map_err(|e| e.to_string())?;
                    for (agent, pinned) in attached.pins_on(slot) {
                        pins.push(json!({ "slot": slot, "agent": agent, "generation": pinned, "current": u64::from(pinned) == generation }));
                    }
                }
                block["pins"] = json!(pins);
            }
            show(&block, render_block(&block));
            Ok(())
        }
        "namespaces" => {
            let list = ask_admin(&admin, &json!({ "op": "namespaces" }))?;
            let mut text = format!("{:<18} {:>10} {:>10} {:>10}  purging\n", "namespace", "L1 MiB", "L2 MiB", "L3 MiB");
            for n in list["namespaces"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{:<18} {:>10} {:>10} {:>10}  {}\n",
                    n["namespace"].as_str().unwrap_or("?"),
                    mib(&n["l1_bytes"]),
                    mib(&n["l2_bytes"]),
                    mib(&n["l3_bytes"]),
                    if n["purging"] == true { "yes" } else { "" }
                ));
            }
            show(&list, text);
            Ok(())
        }
        "purge" => {
            let [namespace] = positional.as_slice() else {
                return Err(format!("purge takes one NAMESPACE (hex)\n{USAGE}"));
            };
            let answer = ask_admin(&admin, &json!({ "op": "purge", "namespace": namespace }))?;
            let wanted =
                format!("{:016x}", u64::from_str_radix(namespace, 16).map_err(|e| format!("{namespace}: {e}"))?);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
            loop {
                let top = ask_admin(&admin, &json!({ "op": "top" }))?;
                let still = top["purging"].as_array().is_some_and(|p| p.iter().any(|n| n == wanted.as_str()));
                if !still {
                    println!("{{\"event\":\"purged\",\"namespace\":\"{wanted}\"}}");
                    return Ok(());
                }
                if std::time::Instant::now() >= deadline {
                    if wait_s > 0 {
                        return Err(format!(
                            "{wanted} still holds blocks after {wait_s} s (leased ones wait for their leases)"
                        ));
                    }
                    println!("{{\"event\":\"purging\",\"purging\":{}}}", answer["purging"]);
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        "regions" => {
            let list = ask_admin(&admin, &json!({ "op": "regions" }))?;
            let mut text = format!(
                "{:>6} {:<4} {:>5} {:>10} {:>10} {:>8}  {:<9} name\n",
                "region", "tier", "node", "MiB", "capacity", "blocks", "draining"
            );
            for r in list["regions"].as_array().into_iter().flatten() {
                text.push_str(&format!(
                    "{:>6} {:<4} {:>5} {:>10} {:>10} {:>8}  {:<9} {}\n",
                    r["region"].as_u64().unwrap_or(0),
                    r["tier"].as_str().unwrap_or("?"),
                    r["node"].as_u64().unwrap_or(0),
                    mib(&r["bytes"]),
                    mib(&r["capacity_bytes"]),
                    r["blocks"].as_u64().unwrap_or(0),
                    if r["draining"] == true { "yes" } else { "" },
                    r["name"].as_str().unwrap_or("")
                ));
            }
            show(&list, text);
            Ok(())
        }
        "peers" => {
            let list = ask_admin(&admin, &json!({ "op": "peers" }))?;
            let mut text =
                format!("{:<12} {:<24} {:>5} {:>8} {:>7}  features\n", "role", "name", "node", "pid", "version");
            for p in list["peers"].as_array().into_iter().flatten() {
                let features: Vec<&str> =
                    p["features"].as_array().into_iter().flatten().filter_map(serde_json::Value::as_str).collect();
                text.push_str(&format!(
                    "{:<12} {:<24} {:>5} {:>8} {:>7}  {}\n",
                    p["role"].as_str().unwrap_or("?"),
                    p["name"].as_str().unwrap_or(""),
                    p["node"].as_u64().unwrap_or(0),
                    p["pid"].as_u64().unwrap_or(0),
                    p["version"].as_u64().map_or_else(|| "-".to_owned(), |v| v.to_string()),
                    if features.is_empty() { "-".to_owned() } else { features.join(",") }
                ));
            }
            show(&list, text);
            Ok(())
        }
        "drain" => {
            let [which] = positional.as_slice() else {
                return Err(format!("drain takes one REGION (its id) or FILE (its path)\n{USAGE}"));
            };
            let mut request = match which.parse::<u64>() {
                Ok(region) => json!({ "op": "drain", "region": region }),
                Err(_) => json!({ "op": "drain", "name": which }),
            };
            request["undo"] = json!(undo);
            let answer = ask_admin(&admin, &request)?;
            // The region it named, by id (a file's path resolved there).
            let region = answer["region"].as_u64().ok_or_else(|| format!("unexpected answer: {answer}"))?;
            if undo {
                println!("{{\"event\":\"undrained\",\"region\":{region}}}");
                return Ok(());
            }
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_s);
            loop {
                let drains = ask_admin(&admin, &json!({ "op": "drains" }))?["drains"].clone();
                let this = drains.as_array().into_iter().flatten().find(|d| d["region"] == region).cloned();
                let Some(this) = this else { return Err(format!("region {region} is no longer being drained")) };
                if this["done"] == true {
                    println!(
                        "{{\"event\":\"drained\",\"region\":{region},\"moves_asked\":{},\"drops_asked\":{}}}",
                        this["moves_asked"], this["drops_asked"]
                    );
                    return Ok(());
                }
                if std::time::Instant::now() >= deadline {
                    if wait_s > 0 {
                        let why = this["refused"].as_str().map_or_else(String::new, |r| format!(" (refused: {r})"));
                        return Err(format!(
                            "region {region} still holds {} blocks after {wait_s} s{why}",
                            this["blocks_left"]
                        ));
                    }
                    println!("{{\"event\":\"draining\",\"drain\":{this}}}");
                    return Ok(());
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        _ => Err(format!("unknown operator command {op}")),
    }
}

#[allow(clippy::cast_precision_loss)] // percentages shown to an operator
fn render_top(top: &serde_json::Value) -> String {
    let mut text = format!(
        "lake-cp node {}  blocks {}  leases {}  sessions {}  waiting {}\n",
        top["node"], top["blocks"], top["leases"], top["sessions"], top["waiting_for_parent"]
    );
    let lookups = &top["lookups"];
    let ratio = lookups["hit_ratio"].as_f64().map_or_else(|| "-".to_owned(), |r| format!("{:.1}%", r * 100.0));
    text.push_str(&format!(
        "lookups: {} blocks asked, {} hit ({ratio})   committed {}  evicted {}\n\n",
        lookups["requested_blocks"], lookups["hit_blocks"], top["blocks_committed"], top["blocks_evicted"]
    ));
    text.push_str(&format!(
        "{:<5} {:>10} {:>12} {:>7} {:>9} {:>12}\n",
        "tier", "MiB", "capacity", "used", "blocks", "leaving MiB"
    ));
    for tier in top["tiers"].as_array().into_iter().flatten() {
        let (bytes, capacity) = (tier["bytes"].as_u64().unwrap_or(0), tier["capacity_bytes"].as_u64().unwrap_or(0));
        let used =
            if capacity == 0 { "-".to_owned() } else { format!("{:.0}%", bytes as f64 * 100.0 / capacity as f64) };
        text.push_str(&format!(
            "{:<5} {:>10} {:>12} {:>7} {:>9} {:>12}\n",
            tier["tier"].as_str().unwrap_or("?"),
            mib(&tier["bytes"]),
            mib(&tier["capacity_bytes"]),
            used,
            tier["blocks"].as_u64().unwrap_or(0),
            mib(&tier["pending_bytes"])
        ));
    }
    let t = &top["tier_commands"];
    text.push_str(&format!(
        "\ntier commands: {} in flight, {} demotions, {} to L3, {} copies to L3, {} failed, {} purged, {} over tenant quotas\n",
        t["pending"], t["demotions"], t["to_l3"], t["copies_to_l3"], t["failed"], t["purged"], t["tenant_quota_evictions"]
    ));
    if top["purging"].as_array().is_some_and(|p| !p.is_empty()) {
        text.push_str(&format!("purging: {}\n", top["purging"]));
    }
    for d in top["drains"].as_array().into_iter().flatten() {
        let state = if d["done"] == true {
            "done".to_owned()
        } else if let Some(why) = d["refused"].as_str() {
            format!("refused: {why}")
        } else if d["announced"] == true {
            "moving".to_owned()
        } else {
            "telling its lake-dp".to_owned()
        };
        text.push_str(&format!(
            "draining region {}: {} blocks left, {} moves and {} drops asked ({state})\n",
            d["region"], d["blocks_left"], d["moves_asked"], d["drops_asked"]
        ));
    }
    let paths = top["paths"].as_array().into_iter().flatten().collect::<Vec<_>>();
    if !paths.is_empty() {
        text.push_str(&format!(
            "\n{:<20} {:>10} {:>10} {:>10} {:>10}\n",
            "path", "count", "mean µs", "p50 ≤ µs", "p99 ≤ µs"
        ));
        let number = |v: &serde_json::Value| v.as_u64().map_or_else(|| "-".to_owned(), |n| n.to_string());
        for path in paths {
            text.push_str(&format!(
                "{:<20} {:>10} {:>10} {:>10} {:>10}\n",
                path["path"].as_str().unwrap_or("?"),
                number(&path["count"]),
                number(&path["mean_us"]),
                number(&path["p50_us"]),
                number(&path["p99_us"])
            ));
        }
    }
    text
}

#[allow(clippy::cast_precision_loss)] // seconds shown to an operator
fn render_block(block: &serde_json::Value) -> String {
    let mut text = format!("block {}\n", block["key"].as_str().unwrap_or("?"));
    if block["known"] != true {
        text.push_str("  not in this node's index\n");
    } else {
        text.push_str(&format!(
            "  kind {}  namespace {}  parent {}  leaf {}\n",
            block["kind"].as_str().unwrap_or("?"),
            block["namespace"].as_str().unwrap_or("?"),
            block["parent"].as_str().unwrap_or("none (a root)"),
            block["leaf"]
        ));
        for t in block["tiers"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "  {}: {} hits counted by its policy\n",
                t["tier"].as_str().unwrap_or("?"),
                t["hits"]
            ));
        }
        text.push_str("  replicas:\n");
        for r in block["replicas"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "    {} region {} node {} epoch {} slot {} generation {} {}\n",
                r["tier"].as_str().unwrap_or("?"),
                r["region"],
                r["node"],
                r["epoch"],
                r["slot"],
                r["generation"],
                r["state"].as_str().unwrap_or("?")
            ));
        }
        let leases = block["leases"].as_array().map_or(0, Vec::len);
        text.push_str(&format!("  leases: {}\n", if leases == 0 { "none".to_owned() } else { leases.to_string() }));
        for l in block["leases"].as_array().into_iter().flatten() {
            text.push_str(&format!(
                "    lease {} on region {}, {} ms left\n",
                l["id"], l["region"], l["expires_in_ms"]
            ));
        }
    }
    match block["pins"].as_array() {
        Some(pins) if pins.is_empty() => text.push_str("  L1 pins: none\n"),
        Some(pins) => {
            for p in pins {
                text.push_str(&format!(
                    "  L1 pin: slot {} by agent {} (generation {}{})\n",
                    p["slot"],
                    p["agent"],
                    p["generation"],
                    if p["current"] == true { "" } else { ", an older one" }
                ));
            }
        }
        None => text.push_str("  L1 pins: give --arena PATH to read them\n"),
    }
    text.push_str("  history (oldest first):\n");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    for e in block["history"].as_array().into_iter().flatten() {
        let ago_ms = now.saturating_sub(e["unix_ns"].as_u64().unwrap_or(0)) / 1_000_000;
        text.push_str(&format!(
            "    {:>9.3} s ago  {} (region {} slot {})\n",
            ago_ms as f64 / 1000.0,
            e["what"].as_str().unwrap_or("?"),
            e["region"],
            e["slot"]
        ));
    }
    text
}
