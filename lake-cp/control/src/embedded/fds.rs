//! The pool's file descriptors: what it needs for itself, and what is
//! left for its listeners' connections. The soft limit is raised to the
//! hard one at start; the listeners' caps are cut to fit what remains, so
//! connections from outside can never take the descriptors the pool's
//! own work needs (an L2 file, an L3 socket, an engine's attach).

use super::EmbeddedConfig;
use crate::server::ConnectionCaps;

/// Descriptors the pool holds at rest besides its L2 files (its shared
/// memory, rings, event and signal fds, sockets, the standard streams:
/// 27 measured with two L2 files), with room to spare for what it opens
/// while it serves (a file being checked, an L3 catalog page).
const OWN_AT_REST: u64 = 64;

/// A listener's cap is not cut below this.
const CAP_FLOOR: usize = 4;

/// The listeners' caps for one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// The control plane's listeners.
    pub server: ConnectionCaps,
    /// Inbound transport connections.
    pub transport: usize,
}

impl Default for Caps {
    fn default() -> Self {
        Self { server: ConnectionCaps::default(), transport: 256 }
    }
}

impl Caps {
    fn total(&self, transport_listens: bool, metrics: bool) -> u64 {
        let mut total = self.server.cp + self.server.admin;
        if metrics {
            total += self.server.metrics;
        }
        if transport_listens {
            total += self.transport;
        }
        total as u64
    }
}

/// What the budget came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// The soft limit on open files, after raising it.
    pub limit: u64,
    /// What the pool keeps for itself.
    pub own: u64,
    /// The caps in force: as configured, or cut to fit.
    pub caps: Caps,
    /// Whether they were cut.
    pub cut: bool,
}

/// Descriptors `config`'s pool needs for its own work: at rest, its L2
/// files (the data plane's and the background writer's), one per engine
/// port (its attach connection, which the port count caps), its outbound
/// transport connections, and its L3 workers' sockets.
pub fn own_needs(config: &EmbeddedConfig) -> u64 {
    let l2 = 2 * config.l2_paths().len() as u64;
    let engines = u64::from(config.remote_agents) + u64::from(config.local_agents);
    let streams = lake_dp::transport::tcp::TcpConfig::default().streams_per_peer as u64;
    let outbound: u64 = config.transport_peers.iter().map(|(_, rails)| rails.len().max(1) as u64 * streams).sum();
    let l3 = config.l3.as_ref().map_or(0, |l3| 2 * u64::from(l3.workers));
    OWN_AT_REST + l2 + engines + outbound + l3
}

/// The caps that fit `limit` descriptors beside `config`'s own needs: as
/// configured where they fit, else each cut in the same proportion (to
/// [`CAP_FLOOR`] at least). Refused where even that does not fit: the
/// limit is named, and what it would take.
pub fn fit(config: &EmbeddedConfig, limit: u64) -> Result<Budget, String> {
    let own = own_needs(config);
    let listens = config.transport_listen.is_some();
    let metrics = config.metrics.is_some();
    let wanted = config.caps;
    let room = limit.saturating_sub(own);
    if wanted.total(listens, metrics) <= room {
        return Ok(Budget { limit, own, caps: wanted, cut: false });
    }
    let total = wanted.total(listens, metrics).max(1);
    let scale = |cap: usize| usize::try_from(cap as u64 * room / total).unwrap_or(usize::MAX).max(CAP_FLOOR).min(cap);
    let caps = Caps {
        server: ConnectionCaps {
            cp: scale(wanted.server.cp),
            metrics: scale(wanted.server.metrics),
            admin: scale(wanted.server.admin),
        },
        transport: scale(wanted.transport),
    };
    if caps.total(listens, metrics) > room {
        let needed = own + CAP_FLOOR as u64 * (2 + u64::from(listens) + u64::from(metrics));
        return Err(format!(
            "the limit on open files is {limit}: the pool needs {own} for its own work and at least {} for its \
             listeners ({needed} in all); raise it (LimitNOFILE= in its unit, ulimit -n) or give it fewer engine ports \
             and L2 files",
            needed - own
        ));
    }
    Ok(Budget { limit, own, caps, cut: true })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> EmbeddedConfig {
        EmbeddedConfig {
            metrics: Some(crate::embedded::METRICS_ANY_LOCAL_PORT),
            transport_listen: Some("127.0.0.1:0".parse().unwrap()),
            ..EmbeddedConfig::new(std::path::PathBuf::from("/nonexistent"))
        }
    }

    #[test]
    fn caps_stay_as_configured_where_they_fit() {
        let budget = fit(&config(), 65_536).unwrap();
        assert!(!budget.cut);
        assert_eq!(budget.caps, Caps::default());
    }

    #[test]
    fn caps_are_cut_to_what_the_limit_leaves_and_the_pool_keeps_its_own() {
        let config = config();
        let budget = fit(&config, 256).unwrap();
        assert!(budget.cut);
        assert_eq!(budget.own, own_needs(&config));
        let caps = budget.caps;
        let total = (caps.server.cp + caps.server.metrics + caps.server.admin + caps.transport) as u64;
        assert!(budget.own + total <= 256, "{budget:?}");
        assert!(caps.server.cp >= CAP_FLOOR && caps.transport >= CAP_FLOOR && caps.server.metrics >= CAP_FLOOR);
        assert!(caps.server.cp > caps.server.metrics, "cut in proportion: {caps:?}");
    }

    #[test]
    fn a_limit_below_the_pools_own_needs_is_refused_and_named() {
        let why = fit(&config(), 64).unwrap_err();
        assert!(why.contains("the limit on open files is 64"), "{why}");
    }
}
