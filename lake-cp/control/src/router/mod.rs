//! `lake route`: where each request runs, for a gateway to ask over
//! HTTP/JSON. Per request it reads the prompt's hits from the pool on its
//! host — the node's mirror and its cluster view, lock-free — and each
//! node's load from what it last read of the nodes' metrics, and answers
//! with the route function's plan ([`lake_dp::route`]): the mode
//! (colocated, PD, D-direct), the prefill and decode nodes, and the pool
//! blocks to reuse, with where each comes from. A failed execution is
//! asked again with its node in `avoid` (F4): the same function.
//!
//! The router holds no state of its own beyond its last readings: any
//! number of them, on any node with a pool, answer alike (up to how fresh
//! their view is), and one restarted loses nothing.
//!
//! | request | answer |
//! |---|---|
//! | `POST /route` `{"keys": ["<32 hex>", …]}` or `{"tokens": [u32, …]}`, with `"blocks"`, `"avoid"`, `"policy"` optional | the plan, or `{"error"}`: 400 bad request, 503 no node may run it |
//! | `GET /nodes` | every node: its roles, queue, whether it may be routed to (why not) |
//! | `GET /metrics` | the router's own figures, Prometheus text: answers by class, routing time, each node's signals, whether the pool is read |
//! | `GET /healthz` | `ok` while the router runs |

pub mod config;
mod hits;
pub mod server;
pub mod signals;

use std::time::{Duration, Instant};

use lake_dp::route::{Mode, Network, Policy, Request, RouteError, route};
use lake_dp::{BlockKey, KeyChain, Namespace, NodeId, Tier};
use serde::Deserialize;
use serde_json::{Value, json};

use self::config::RouterConfig;
use self::hits::PoolReader;
use self::signals::Signals;

/// Blocks a request may name.
pub const REQUEST_BLOCKS_MAX: usize = 1 << 16;

/// The router: its settings, the pool it reads, its nodes' signals.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    namespace: Option<Namespace>,
    pool: PoolReader,
    signals: Signals,
    /// Answers given, by status class (2xx, 4xx, 5xx).
    pub answered: [u64; 3],
    /// Routes planned (`POST /route` answered 200), and the time they
    /// took in all.
    routed: u64,
    /// See `routed`.
    routed_ns: u64,
}

/// An answer: HTTP status and JSON body.
pub type Answer = (u16, Value);

fn refuse(status: u16, why: impl Into<String>) -> Answer {
    (status, json!({ "error": why.into() }))
}

impl Router {
    /// A router over `config` (checked), its nodes' readers started.
    pub fn new(config: RouterConfig) -> Result<Self, String> {
        let namespace = config.check()?;
        let signals = Signals::start(&config.nodes, Duration::from_millis(config.scrape_ms));
        let pool = PoolReader::new(&config.pool_dir);
        Ok(Self { config, namespace, pool, signals, answered: [0; 3], routed: 0, routed_ns: 0 })
    }

    /// Its settings.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The answer to one request.
    pub fn answer(&mut self, method: &str, path: &str, body: &[u8]) -> Answer {
        let answer = match (method, path) {
            ("POST", "/route") => self.route(body),
            ("GET", "/nodes") => (200, self.nodes()),
            ("GET", "/metrics") => (200, Value::String(self.metrics())),
            ("GET", "/healthz") => (200, json!({ "ok": true })),
            (_, "/route" | "/nodes" | "/metrics" | "/healthz") => {
                refuse(405, format!("{method} {path}: not a method it takes"))
            }
            _ => refuse(404, format!("{path}: only POST /route, GET /nodes, GET /metrics and GET /healthz")),
        };
        let class = match answer.0 {
            200..=299 => 0,
            400..=499 => 1,
            _ => 2,
        };
        self.answered[class] += 1;
        answer
    }

    /// Which pool the hits come from, or why none.
    fn pool_state(&mut self) -> Value {
        match self.pool.state() {
            Ok((node, cluster, partitions)) => {
                json!({ "node": node.0, "cluster_view": cluster, "partitions": partitions })
            }
            Err(why) => json!({ "error": why }),
        }
    }

    fn nodes(&mut self) -> Value {
        let pool = self.pool_state();
        let nodes: Vec<Value> = (0..self.config.nodes.len())
            .map(|i| {
                let (node, signal) = (&self.config.nodes[i], self.signals.get(i));
                let (pull_ns, measured) = node.pull_cost(&signal);
                json!({
                    "node": node.id,
                    "prefill": node.roles.contains(&config::Role::Prefill),
                    "decode": node.roles.contains(&config::Role::Decode),
                    "waiting": signal.waiting,
                    "prefill_ns": signal.prefill_ns,
                    "queue_ns": signal.queue_ns(),
                    "pull_ns_per_block": pull_ns,
                    "pull_cost": if measured { "measured" } else { "configured" },
                    "down": signal.down,
                })
            })
            .collect();
        json!({ "pool": pool, "nodes": nodes })
    }

    fn route(&mut self, body: &[u8]) -> Answer {
        let started = Instant::now();
        if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return refuse(400, "the body is a JSON object with keys or tokens");
        }
        // Read plainly; only a body that fails is read again, its path
        // followed, to name the value that was wrong.
        let asked: Ask = match serde_json::from_slice(body) {
            Ok(asked) => asked,
            Err(plain) => return refuse(400, Self::why_not(body, &plain)),
        };
        let (keys, blocks) = match self.keys_of(&asked) {
            Ok(found) => found,
            Err(why) => return refuse(400, why),
        };
        let avoid: Vec<NodeId> = asked.avoid.iter().copied().map(NodeId).collect();
        let policy = match asked.policy {
            AskPolicy::Any => Policy::Any,
            AskPolicy::Pd => Policy::AlwaysPd,
            AskPolicy::Colocated => Policy::AlwaysColocated,
        };
        let (loads, down, down_ids) = self.loads();
        let hits = self.pool.hits(&keys, &down_ids);
        let pool = self.pool_state();
        let request = Request { blocks, avoid };
        let plan = match route(&request, &hits, &lake_dp::route::LoadView { nodes: loads }, policy) {
            Ok(plan) => plan,
            Err(RouteError::NoNode) => {
                let (status, mut body) = refuse(503, "no node may run the request");
                body["down"] = Value::Array(down);
                return (status, body);
            }
        };
        let mut body = plan_json(&plan, blocks);
        body["down"] = Value::Array(down);
        body["pool"] = pool;
        let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.routed += 1;
        self.routed_ns = self.routed_ns.saturating_add(took);
        body["answer_ns"] = json!(took);
        (200, body)
    }

    /// The router's figures in the Prometheus text format.
    fn metrics(&mut self) -> String {
        use crate::metrics::metric;
        let mut out = String::new();
        let [ok, refused, failed] = self.answered;
        let classes = [("class=\"2xx\"", ok), ("class=\"4xx\"", refused), ("class=\"5xx\"", failed)];
        metric(&mut out, "lake_router_answers_total", "counter", "Answers given, by status class.", &classes);
        let help = "Requests routed (a plan answered), and the time planning them took in all (hits, loads, route).";
        metric(&mut out, "lake_router_routed_total", "counter", help, &[("", self.routed)]);
        metric(&mut out, "lake_router_routed_ns_total", "counter", help, &[("", self.routed_ns)]);
        let (read, view, partitions) =
            self.pool.state().map_or((0, 0, 0), |(_, view, partitions)| (1, u64::from(view), partitions as u64));
        let help = "Whether the pool's mirror is read (1), its cluster view (every other node's blocks), \
                    and how many tenants' partitions (each a mirror and a view of its own).";
        let read = [("what=\"mirror\"", read), ("what=\"view\"", view), ("what=\"partitions\"", partitions)];
        metric(&mut out, "lake_router_pool_read", "gauge", help, &read);
        let nodes: Vec<(String, signals::Signal)> = (0..self.config.nodes.len())
            .map(|i| (format!("node=\"{}\"", self.config.nodes[i].id), self.signals.get(i)))
            .collect();
        let per_node = |f: &dyn Fn(&signals::Signal) -> u64| -> Vec<(&str, u64)> {
            nodes.iter().map(|(labels, signal)| (labels.as_str(), f(signal))).collect()
        };
        let help = "Whether the node is left out of routing (its pool not ready, its engine's metrics not read).";
        metric(&mut out, "lake_router_node_down", "gauge", help, &per_node(&|s| u64::from(s.down.is_some())));
        let help = "The node's engine's waiting requests, as last read.";
        metric(&mut out, "lake_router_node_waiting", "gauge", help, &per_node(&|s| s.waiting));
        let help = "The node's queue as the router prices it: waiting requests times the mean prefill.";
        metric(&mut out, "lake_router_node_queue_ns", "gauge", help, &per_node(&|s| s.queue_ns()));
        out
    }

    /// The nodes that may run requests now, with their loads; the others,
    /// with why (for the answer) and their ids (their blocks are not
    /// planned on).
    fn loads(&self) -> (Vec<lake_dp::route::NodeLoad>, Vec<Value>, Vec<NodeId>) {
        let (mut down, mut down_ids) = (Vec::new(), Vec::new());
        let mut loads = Vec::with_capacity(self.config.nodes.len());
        for (i, node) in self.config.nodes.iter().enumerate() {
            let signal = self.signals.get(i);
            match signal.down {
                Some(why) => {
                    down.push(json!({ "node": node.id, "why": why }));
                    down_ids.push(NodeId(node.id));
                }
                None => loads.push(node.load_with(&signal)),
            }
        }
        (loads, down, down_ids)
    }

    /// Why `body` is not a request, as `plain` (serde_json's error) says,
    /// with the path of the value that was wrong where it is known.
    fn why_not(body: &[u8], plain: &serde_json::Error) -> String {
        let mut reader = serde_json::Deserializer::from_slice(body);
        match serde_path_to_error::deserialize::<_, Ask>(&mut reader) {
            Err(e) => {
                let path = e.path().to_string();
                let path = if matches!(path.as_str(), "" | "." | "?") { "the body" } else { path.as_str() };
                format!("{path}: {}", e.inner())
            }
            Ok(_) => format!("the body: {plain}"),
        }
    }

    /// The prompt's keys (what the pool may hold of it) and its length in
    /// blocks.
    fn keys_of(&self, asked: &Ask) -> Result<(Vec<BlockKey>, u32), String> {
        let (keys, blocks) = match (&asked.keys, &asked.tokens) {
            (Some(_), Some(_)) => return Err("keys or tokens, not both".into()),
            (None, None) => return Err("no keys and no tokens: give the prompt's block keys or its tokens".into()),
            (Some(keys), None) => {
                if keys.len() > REQUEST_BLOCKS_MAX {
                    return Err(format!("keys: {} blocks, at most {REQUEST_BLOCKS_MAX}", keys.len()));
                }
                let keys: Vec<BlockKey> = keys.iter().map(|k| k.0).collect();
                let blocks = keys.len();
                (keys, blocks)
            }
            (None, Some(tokens)) => {
                let namespace = self.namespace.as_ref().ok_or(
                    "tokens: this router has no [namespace] to chain them into keys; give keys, or configure one",
                )?;
                let per_block = namespace.block_tokens() as usize;
                if tokens.len() > REQUEST_BLOCKS_MAX * per_block {
                    return Err(format!("tokens: {}, at most {}", tokens.len(), REQUEST_BLOCKS_MAX * per_block));
                }
                let mut keys = vec![BlockKey::NONE; tokens.len() / per_block];
                let hashed = KeyChain::new(namespace).extend_tokens(tokens, &mut keys).map_err(|e| e.to_string())?;
                keys.truncate(hashed);
                // A partial last block is computed like any other.
                (keys, tokens.len().div_ceil(per_block))
            }
        };
        let blocks = match asked.blocks.map(|n| (n, usize::try_from(n))) {
            None => blocks,
            Some((_, Ok(n))) if n >= keys.len() && u32::try_from(n).is_ok() => n,
            Some((n, _)) => return Err(format!("blocks: {n} is not a count at least the keys' {}", keys.len())),
        };
        if blocks == 0 {
            return Err("the prompt has no blocks".into());
        }
        Ok((keys, u32::try_from(blocks).map_err(|_| "blocks: too many")?))
    }
}

/// A request to `POST /route`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a JSON object with keys or tokens")]
struct Ask {
    /// The prompt's block keys (its full blocks).
    keys: Option<Vec<Key>>,
    /// Or its tokens, chained into keys in the router's namespace.
    tokens: Option<Vec<u32>>,
    /// The prompt's length in blocks, where keys name only its full ones.
    blocks: Option<u64>,
    /// Nodes not to use (F4).
    #[serde(default)]
    avoid: Vec<u32>,
    /// The modes it may take.
    #[serde(default)]
    policy: AskPolicy,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AskPolicy {
    #[default]
    Any,
    Pd,
    Colocated,
}

/// A block key as a request writes it: 32 hex digits, decoded as read.
#[derive(Debug)]
struct Key(BlockKey);

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Key;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a block key of 32 hex digits")
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Key, E> {
                match crate::admin::unhex::<16>(text) {
                    Some(key) => Ok(Key(BlockKey(key))),
                    None => Err(E::invalid_value(serde::de::Unexpected::Str(text), &self)),
                }
            }
        }
        deserializer.deserialize_str(Visitor)
    }
}

/// A plan as the answer gives it (before the router adds what it saw).
fn plan_json(plan: &lake_dp::route::Plan, blocks: u32) -> Value {
    let (mode, prefill, decode) = match plan.mode {
        Mode::Colocated { node } => ("colocated", node, node),
        Mode::PdDisaggregated { prefill, decode } => ("pd", prefill, decode),
        Mode::DDirect { node } => ("d_direct", node, node),
    };
    let moves: Vec<Value> = plan
        .moves
        .iter()
        .map(|m| {
            let network = match m.network {
                Network::Local => "local",
                Network::Storage => "storage",
                Network::Compute => "compute",
            };
            json!({
                "first": m.first,
                "last": m.last,
                "from_node": m.from.0.0,
                "from_tier": crate::admin::tier_name(m.from.1),
                "to": m.to.0,
                "network": network,
            })
        })
        .collect();
    json!({
        "mode": mode,
        "prefill": prefill.0,
        "decode": decode.0,
        "blocks": blocks,
        "hit_blocks": plan.hit_blocks,
        "recomputed_blocks": plan.recomputed_blocks,
        "pulled_blocks": plan.moves.iter().filter(|m| m.network == Network::Storage && m.from.1 != Tier::L3Object)
            .map(|m| m.last - m.first).sum::<u32>(),
        "ttft_ns": plan.ttft_ns,
        "moves": moves,
    })
}
