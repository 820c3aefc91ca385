//! Engines in a test's process against an embedded pool: a tenant's
//! namespace, an in-process agent attached to one of the pool's local
//! ports, and saves that wait until the mirror shows them.

use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload, SaveStatus};
use lake_cp::embedded::EmbeddedPool;
use lake_dp::{BlockKey, ExtraKeys, KeyScheme, ModelIdentity, Namespace, TenantKey};

/// Tenant `tenant`'s namespace (its key all `tenant` bytes) of one model.
pub(crate) fn namespace(tenant: u8) -> Namespace {
    let model =
        ModelIdentity { weights_revision: "r1", tokenizer: "tok", kv_dtype: "bfloat16", kv_scales: &[] }.fingerprint();
    Namespace::new(&TenantKey([tenant; 32]), KeyScheme::TokenIdsV1, 16, model, ExtraKeys::default().digest()).unwrap()
}

/// An engine of `ns` on the pool's next local port.
pub(crate) fn engine(pool: &mut EmbeddedPool, ns: &Namespace) -> Agent {
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "test-engine",
        namespace: ns.id(),
        layout_fingerprint: 0xabc,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).unwrap()
}

/// Saves `keys[from..]` as the rest of the prefix `keys` (32 KiB of
/// `fill` each) in one save; what became of each block.
pub(crate) fn save_from(agent: &mut Agent, keys: &[BlockKey], from: usize, fill: u8) -> Vec<SaveStatus> {
    let payload = vec![fill; 32 * 1024];
    let blocks: Vec<SaveBlock<'_>> = (from..keys.len())
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: SavePayload::Bytes(&payload),
        })
        .collect();
    let mut statuses = vec![SaveStatus::NotSent; blocks.len()];
    agent.save_with_statuses(&blocks, &mut statuses);
    statuses
}

/// Saves `keys` as one prefix, 32 KiB of `fill` each, and waits until a
/// lookup finds them all.
pub(crate) fn save(agent: &mut Agent, keys: &[BlockKey], fill: u8) {
    let statuses = save_from(agent, keys, 0, fill);
    assert_eq!(statuses.iter().filter(|s| **s == SaveStatus::Saved).count(), keys.len(), "{statuses:?}");
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(keys, &mut table) < keys.len() {
        assert!(Instant::now() < deadline, "the saves were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
}
