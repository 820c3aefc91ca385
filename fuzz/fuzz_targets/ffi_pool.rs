//! The C ABI's entry points that take a pool handle, on one
//! embedded pool started and attached once per fuzzing process:
//! `lake::fuzzing::PoolHarness::exercise` runs lookups, leases, residency
//! reports, pinned lookups and their copies out (`lake_load_pinned`), host
//! and KV memory registration (`lake_register_kv_memory`: any options, and
//! pieces laid out right over memory it keeps), saves (also on a stream),
//! loads with any block tables, layer waits, pushes to good, refused and
//! malformed addresses and their rail figures, routing questions
//! (`lake_route`: any hits, loads, costs, policies and nodes to avoid),
//! and the bookkeeping calls, with the input's keys,
//! counts, capacities, indices, priorities and ids. Any values give a
//! status, never a panic (not even one the boundary catches), and what
//! succeeds is consistent. See ffi/src/fuzzing.rs.

#![no_main]

use std::cell::RefCell;

use lake::fuzzing::PoolHarness;
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use libfuzzer_sys::fuzz_target;

thread_local! {
    static POOL: RefCell<Option<(EmbeddedPool, PoolHarness)>> = const { RefCell::new(None) };
}

fn start() -> (EmbeddedPool, PoolHarness) {
    let dir = std::env::temp_dir().join(format!("lake-fuzz-ffi-pool-{}", std::process::id()));
    let config = EmbeddedConfig { l1_slots: 64, l2_slots_per_file: 256, remote_agents: 2, ..EmbeddedConfig::new(dir) };
    let pool = EmbeddedPool::start(&config).expect("the embedded pool starts");
    let harness = PoolHarness::attach(
        &pool.dp_socket.display().to_string(),
        &pool.mirror.display().to_string(),
        &pool.cp_socket.display().to_string(),
    )
    .expect("the harness attaches");
    (pool, harness)
}

fuzz_target!(|data: &[u8]| {
    POOL.with(|cell| {
        let mut slot = cell.borrow_mut();
        let (_, harness) = slot.get_or_insert_with(start);
        harness.exercise(data);
    });
});
