//! `lake route`: the router's process.

use std::net::SocketAddr;
use std::path::Path;

use lake_cp::router::Router;
use lake_cp::router::config::RouterConfig;
use lake_cp::router::server::Server;

/// Answers until SIGTERM or SIGINT; says where it listens first.
pub(super) fn route(file: &Path, listen: Option<SocketAddr>) -> Result<(), String> {
    // Before any thread starts: they inherit the blocked signals.
    let signals = lake_dp::os::Signals::new().map_err(|e| format!("signals: {e}"))?;
    let mut config = RouterConfig::read(file)?;
    if let Some(listen) = listen {
        config.listen = listen;
    }
    let listener =
        std::net::TcpListener::bind(config.listen).map_err(|e| format!("listening on {}: {e}", config.listen))?;
    let address = listener.local_addr().map_err(|e| format!("listening on {}: {e}", config.listen))?;
    let cap = config.connections_max;
    let mut router = Router::new(config)?;
    let mut server = Server::new(listener, cap).map_err(|e| format!("listening on {address}: {e}"))?;
    let routing = serde_json::json!({
        "event": "routing",
        "listen": address.to_string(),
        "pool_dir": router.config().pool_dir,
        "nodes": router.config().nodes.iter().map(|n| n.id).collect::<Vec<_>>(),
    });
    say!("{routing}");
    let mut signal = None;
    server
        .run(&mut router, || {
            signal = signal.or_else(|| signals.take());
            signal.is_some()
        })
        .map_err(|e| format!("serving {address}: {e}"))?;
    let c = server.counters;
    let stopped = serde_json::json!({
        "event": "stopped",
        "signal": signal,
        "answered": router.answered,
        "accepted": c.accepted,
        "over_cap": c.over_cap,
        "timed_out": c.timed_out,
        "too_large": c.too_large,
        "malformed": c.malformed,
    });
    say!("{stopped}");
    Ok(())
}
