//! The router's settings: one TOML file (`lake route --config FILE`),
//! every field named where it is wrong.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use lake_dp::route::NodeLoad;
use lake_dp::{KeyScheme, Namespace, NodeId, TenantKey};
use serde::Deserialize;

/// `lake route`'s file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// Where the router answers (HTTP).
    pub listen: SocketAddr,
    /// The pool on this host (`lake serve --dir`): its `pool.json` names
    /// the mirror and the cluster view the router reads the hits from.
    pub pool_dir: PathBuf,
    /// Milliseconds between two reads of each node's signals.
    #[serde(default = "default_scrape_ms")]
    pub scrape_ms: u64,
    /// Connections held at once; one past it is closed as it comes.
    #[serde(default = "default_connections_max")]
    pub connections_max: usize,
    /// The key chain of requests that give tokens rather than keys.
    pub namespace: Option<NamespaceConfig>,
    /// Every node that may run requests.
    pub nodes: Vec<NodeConfig>,
}

fn default_scrape_ms() -> u64 {
    500
}

fn default_connections_max() -> usize {
    256
}

/// The namespace whose keys requests' tokens chain into: the engines'
/// (the vLLM connector logs its model fingerprint when it starts).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    /// The tenant key, 64 hex digits (the connector's `tenant_key`).
    pub tenant_key: String,
    /// Tokens a block (the engine's block size).
    pub block_tokens: u32,
    /// The model fingerprint, 64 hex digits.
    pub model_fingerprint: String,
    /// The extra keys' digest, 64 hex digits (none: zeros).
    pub extra_keys_digest: Option<String>,
}

/// A role a node's engine takes.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts.
    Prefill,
    /// Generates tokens.
    Decode,
}

/// One node as the router is told it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Its id in the cluster (`lake serve --node`).
    pub id: u32,
    /// What its engine runs.
    pub roles: Vec<Role>,
    /// Its pool's metrics address (`lake serve --metrics`): the node is
    /// routed to only while its `/readyz` answers ready.
    pub lake_metrics: Option<String>,
    /// Its engine's metrics address (vLLM's server): the queue is read
    /// from `vllm:num_requests_waiting` and the mean of
    /// `vllm:request_prefill_time_seconds`; the node is routed to only
    /// while it answers.
    pub engine_metrics: Option<String>,
    /// Computing one block there (ns).
    pub compute_ns_per_block: u64,
    /// Loading one block from its L0 (0), L1, L2, L3 into its engine (ns).
    pub load_ns_per_block: [u64; 4],
    /// Pulling one block from another node over the storage network (ns),
    /// until its pool has measured it (`lake_cluster_pull_ns_per_block`
    /// on its metrics).
    pub pull_ns_per_block: u64,
    /// Sending one block over the compute network (ns).
    pub cnic_ns_per_block: u64,
}

impl NodeConfig {
    /// Its load as the route function takes it, with what `signal` read
    /// of it: its queue, and what a pull costs there where its pool has
    /// measured it (else as configured).
    pub fn load_with(&self, signal: &super::signals::Signal) -> NodeLoad {
        NodeLoad {
            node: NodeId(self.id),
            prefill: self.roles.contains(&Role::Prefill),
            decode: self.roles.contains(&Role::Decode),
            queue_ns: signal.queue_ns(),
            compute_ns_per_block: self.compute_ns_per_block,
            load_ns_per_block: self.load_ns_per_block,
            cnic_ns_per_block: self.cnic_ns_per_block,
            pull_ns_per_block: self.pull_cost(signal).0,
        }
    }

    /// What a pull into it costs (ns a block): as its pool measured it
    /// (`true`), else as configured.
    pub fn pull_cost(&self, signal: &super::signals::Signal) -> (u64, bool) {
        if signal.pull_ns > 0 { (signal.pull_ns, true) } else { (self.pull_ns_per_block, false) }
    }
}

impl RouterConfig {
    /// Reads and checks `path`.
    pub fn read(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let config: Self = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        config.check().map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(config)
    }

    /// Every setting checked; the namespace built.
    pub fn check(&self) -> Result<Option<Namespace>, String> {
        if self.nodes.is_empty() {
            return Err("nodes: none; name every node that may run requests".into());
        }
        if self.connections_max == 0 {
            return Err("connections_max: 0 would refuse every request".into());
        }
        if self.scrape_ms == 0 {
            return Err("scrape_ms: 0; give the milliseconds between two reads of a node's signals".into());
        }
        for (i, node) in self.nodes.iter().enumerate() {
            if self.nodes[..i].iter().any(|n| n.id == node.id) {
                return Err(format!("nodes: node {} is named twice", node.id));
            }
            if node.roles.is_empty() {
                return Err(format!("nodes: node {} has no roles (prefill, decode or both)", node.id));
            }
            if node.compute_ns_per_block == 0 {
                return Err(format!("nodes: node {}: compute_ns_per_block 0", node.id));
            }
        }
        self.namespace.as_ref().map(NamespaceConfig::build).transpose()
    }
}

impl NamespaceConfig {
    fn build(&self) -> Result<Namespace, String> {
        let tenant = digest("namespace.tenant_key", &self.tenant_key)?;
        let model = digest("namespace.model_fingerprint", &self.model_fingerprint)?;
        let extra = match &self.extra_keys_digest {
            Some(text) => digest("namespace.extra_keys_digest", text)?,
            None => [0; 32],
        };
        Namespace::new(&TenantKey(tenant), KeyScheme::TokenIdsV1, self.block_tokens, model, extra)
            .map_err(|e| format!("namespace: {e}"))
    }
}

fn digest(what: &str, text: &str) -> Result<[u8; 32], String> {
    crate::admin::unhex::<32>(text).ok_or_else(|| format!("{what}: not 64 hex digits"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<Namespace>, String> {
        let config: RouterConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.check()
    }

    const NODE: &str = "[[nodes]]\nid = 1\nroles = [\"prefill\"]\ncompute_ns_per_block = 1\n\
                        load_ns_per_block = [0, 1, 2, 3]\npull_ns_per_block = 1\ncnic_ns_per_block = 1\n";

    #[test]
    fn the_example_is_read_whole() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/route.toml");
        let config = RouterConfig::read(&path).unwrap();
        assert_eq!(config.nodes.len(), 2);
        assert!(config.check().unwrap().is_some(), "its namespace");
    }

    #[test]
    fn a_bad_setting_is_named() {
        let head = "listen = \"127.0.0.1:0\"\npool_dir = \"/p\"\n";
        assert!(parse(&format!("{head}{NODE}")).is_ok());
        let cases = [
            (format!("{head}colour = 1\n{NODE}"), "colour"),
            (head.to_owned(), "nodes"),
            (format!("{head}{NODE}{NODE}"), "node 1 is named twice"),
            (format!("{head}{}", NODE.replace("[\"prefill\"]", "[]")), "no roles"),
            (format!("{head}{}", NODE.replace("[\"prefill\"]", "[\"train\"]")), "train"),
            (format!("{head}connections_max = 0\n{NODE}"), "connections_max"),
            (
                format!(
                    "{head}[namespace]\ntenant_key = \"ab\"\nblock_tokens = 16\nmodel_fingerprint = \"{}\"\n{NODE}",
                    "00".repeat(32)
                ),
                "tenant_key",
            ),
            (
                format!(
                    "{head}[namespace]\ntenant_key = \"{0}\"\nblock_tokens = 0\nmodel_fingerprint = \"{0}\"\n{NODE}",
                    "00".repeat(32)
                ),
                "namespace",
            ),
        ];
        for (text, named) in cases {
            let why = parse(&text).unwrap_err();
            assert!(why.contains(named), "{named}: {why}");
        }
        assert_eq!(crate::admin::unhex::<1>("+f"), None, "a sign is not a digit");
        assert_eq!(crate::admin::unhex::<2>("0aFf"), Some([0x0a, 0xff]));
    }
}
