//! `lake serve`: the pool as a service, its record in the pool
//! directory, and what it tells the service manager.

use super::*;
use crate::operator::reload_tenant_keys;

pub(super) fn serve(args: &ServeArgs) -> Result<(), ServeError> {
    use lake_cp::embedded::EmbeddedPool;
    // Before any thread starts: the pool's threads inherit the blocked
    // signals, and this one takes them.
    let signals =
        lake_dp::os::Signals::with_hangup().map_err(|error| ServeError::Io { what: "signals".into(), error })?;
    let lake_cp::config::Serve { pool: config, tenant_key_dir, cluster, etcd_tls, member_ttl, .. } =
        args.resolve().map_err(ServeError::Settings)?;
    let (key_dir, mut tenant_files) = match tenant_key_dir {
        Some((dir, ids)) => (Some(dir), ids),
        None => (None, std::collections::HashMap::new()),
    };
    // Membership: this node's key in etcd under a lease it renews; a node
    // that stops (or is killed) leaves the summary's members when it runs
    // out.
    let cluster = match &cluster {
        Some((endpoints, name)) => {
            let endpoints: Vec<&str> = endpoints.iter().map(String::as_str).collect();
            let client = lake_cp::etcd::Etcd::with_tls(&endpoints, std::time::Duration::from_secs(2), &etcd_tls)
                .map_err(|error| ServeError::Cluster { what: format!("--etcd {}", endpoints.join(",")), error })?;
            Some(
                lake_cp::ha::Cluster::new(client, name)
                    .map_err(|error| ServeError::Cluster { what: format!("--cluster {name}"), error })?,
            )
        }
        None => None,
    };
    let mut pool = EmbeddedPool::start(&config)?;
    let address = config.transport_listen.map_or_else(|| pool.cp_socket.display().to_string(), |a| a.to_string());
    let mut member = match cluster {
        Some(cluster) => Some(
            lake_cp::ha::Membership::join(cluster, config.node, address, config.room_bytes(), member_ttl)
                .map_err(|error| ServeError::Cluster { what: "joining".into(), error })?,
        ),
        None => None,
    };
    let serving = serde_json::json!({
        "event": "serving",
        // Which process: a record left by a killed one is told apart.
        "pid": std::process::id(),
        "dp_socket": pool.dp_socket,
        "cp_socket": pool.cp_socket,
        "admin_socket": pool.admin_socket,
        "arena": pool.arena,
        "mirror": pool.mirror,
        // The other nodes' blocks, where this node keeps the cluster view
        // (the mirror's path with `.cluster`; null: none).
        "cluster_view": config.cluster_view(),
        // Each tenant kept apart: its mirror and view, which its engines
        // are handed at attach; a router reads them by these names.
        "partitions": config.partition_files().into_iter().map(|(tenant, mirror, view)| {
            serde_json::json!({ "tenant": tenant, "mirror": mirror, "cluster_view": view })
        }).collect::<Vec<_>>(),
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
    write_atomically(&record, format!("{serving}\n").as_bytes())
        .map_err(|error| ServeError::Io { what: record.display().to_string(), error })?;
    say!("{serving}");
    notify_service_manager("READY=1");
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
        // Where other nodes' copies go (the leader's drains and
        // replication target it by this), once the L1 is registered; an
        // operator's drain (`lake drain-node`): not ready for new
        // requests, the leader moves its blocks away.
        if let Some(draining) = member.as_mut().and_then(|m| m.tend(pool.gauges.l1_space()))
            && pool.draining.swap(draining, std::sync::atomic::Ordering::Relaxed) != draining
        {
            say!("{{\"event\":\"draining\",\"node\":{},\"on\":{draining}}}", config.node);
        }
    }
    notify_service_manager("STOPPING=1");
    if let Some(member) = member {
        let _ = member.leave();
    }
    let _ = std::fs::remove_file(&record);
    if config.durable {
        let (left, took) = pool.empty_l1();
        // Blocks still in L1 now (held by an engine, or no L2 room) are
        // lost with it; every other block is on L2 for the next start.
        say!("{{\"event\":\"l1_written_down\",\"blocks_left\":{left},\"ms\":{}}}", took.as_millis());
    }
    let (stats, _) = pool.stop()?;
    say!(
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

/// Tells the service manager (systemd's `Type=notify`, through
/// `$NOTIFY_SOCKET`) how the service stands: `READY=1` once engines can
/// attach, `STOPPING=1` as a stop begins. Without the variable, nothing.
pub(super) fn notify_service_manager(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let bytes = path.as_encoded_bytes();
    let address = match bytes.strip_prefix(b"@") {
        Some(abstract_name) => std::os::unix::net::SocketAddr::from_abstract_name(abstract_name),
        None => std::os::unix::net::SocketAddr::from_pathname(&path),
    };
    let sent = address.and_then(|address| {
        let socket = std::os::unix::net::UnixDatagram::unbound()?;
        socket.send_to_addr(state.as_bytes(), &address)
    });
    if let Err(e) = sent {
        tracing::warn!(event = "service_manager_unreachable", state, error = %e);
    }
}

/// Where `lake serve` records its endpoints, in its `--dir`.
pub(super) const POOL_RECORD: &str = "pool.json";

/// Writes `path` whole or not at all: a reader sees the old file or the
/// new one, never a part.
pub(super) fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let partial = path.with_extension("json.partial");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, path)
}
