//! Two tenants, the same tokens: their namespaces key the
//! prompt to unrelated blocks, so in one real pool tenant B finds none of
//! what tenant A saved, each finds and loads only its own bytes, and a
//! forged lookup with A's namespace id but B's keys finds nothing either.
//! That B cannot time A's cache is measured by `lake-bench tenants`.

use std::time::{Duration, Instant};

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::KeyChain;

#[path = "common/engines.rs"]
mod engines;
#[path = "common/metrics.rs"]
mod metrics;

use engines::{engine, namespace, save, save_from};
use metrics::metric;

#[test]
fn two_tenants_with_the_same_tokens_never_see_each_others_blocks() {
    let dir = std::env::temp_dir().join(format!("lake-cp-tenants-{}", std::process::id()));
    let mut pool = EmbeddedPool::start(&EmbeddedConfig { local_agents: 2, ..EmbeddedConfig::new(dir) }).unwrap();
    let (a, b) = (namespace(1), namespace(2));
    assert_ne!(a.id(), b.id());
    let tokens: Vec<u32> = (0..16 * 8).map(|t| t * 7 + 3).collect();
    let (a_keys, b_keys) = (KeyChain::keys(&a, &tokens).unwrap(), KeyChain::keys(&b, &tokens).unwrap());
    assert!(a_keys.iter().all(|k| !b_keys.contains(k)), "the same tokens gave a shared key");
    let mut engine_a = engine(&mut pool, &a);
    let mut engine_b = engine(&mut pool, &b);
    save(&mut engine_a, &a_keys, 0xaa);
    let mut table = Vec::new();
    // B, with the same tokens, finds none of A's prompt.
    assert_eq!(engine_b.lookup(&b_keys, &mut table), 0);
    save(&mut engine_b, &b_keys, 0xbb);
    // Each loads its own bytes only.
    for (agent, keys, fill) in [(&mut engine_a, &a_keys, 0xaa), (&mut engine_b, &b_keys, 0xbb)] {
        let hits = agent.lookup(keys, &mut table);
        assert_eq!(hits, keys.len());
        let got = agent.fetch(keys, &table, |i, bytes| assert!(bytes.iter().all(|&x| x == fill), "block {i}"));
        assert_eq!(got, keys.len());
    }
    // A's keys through B's engine: found in the mirror (keys are not
    // secret to whoever holds them), but B's reads refuse bytes saved in
    // another namespace.
    let hits = engine_b.lookup(&a_keys, &mut table);
    assert_eq!(hits, a_keys.len());
    let got = engine_b.fetch(&a_keys, &table, |_, _| panic!("tenant B read tenant A's bytes"));
    assert_eq!(got, 0);
    assert_eq!(engine_b.last_fetch_failure(), Some(lake_agent::FetchFailure::Foreign));
    drop((engine_a, engine_b));
    pool.stop().unwrap();
}

/// A tenant of two namespaces over its L1 quota gives up L1 blocks of
/// its own — demoted to L2, still found and loaded byte for byte — while
/// another tenant's blocks stay in L1, though the tier is far from full
/// and neither of the first tenant's namespaces alone is over the quota.
/// A tenant of two namespaces under an L1 quota of 6 slots: a save that
/// would take it past the quota is refused at its commit (`OverQuota`),
/// never published, and another tenant's saves go on meanwhile; the
/// tenant's own coldest blocks then go down to L2 and its saves find
/// room again. Nothing is lost, and its L1 never holds more than its
/// quota.
#[test]
fn a_save_over_a_tenants_quota_is_refused_at_admission_and_its_own_coldest_make_room() {
    use lake_agent::SaveStatus;
    use lake_agent::port::AgentError;
    use lake_cp::tier::TenantQuota;
    use lake_dp::Tier;
    let dir = std::env::temp_dir().join(format!("lake-cp-tenant-quota-{}", std::process::id()));
    let (a1, a2, b) = (namespace(1), namespace(3), namespace(2));
    // Model change inside tenant 1: a second namespace under the same
    // tenant (another fingerprint), as a rolled model would give.
    let slot = lake_dp::stored::object_bytes(64 * 1024);
    let quota = |tenant: &str, namespaces: Vec<u64>, bytes| TenantQuota {
        tenant: tenant.into(),
        namespaces,
        tier: Tier::L1Dram,
        bytes,
    };
    let mut config = EmbeddedConfig {
        local_agents: 3,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        l1_slots: 64,
        ..EmbeddedConfig::new(dir)
    };
    config.tiers.tenant_quotas =
        vec![quota("acme", vec![a1.id().0, a2.id().0], 6 * slot), quota("other", vec![b.id().0], 64 * slot)];
    let mut pool = EmbeddedPool::start(&config).unwrap();
    let address = pool.metrics.unwrap();
    let acme_l1 = || metric(address, "lake_tenant_bytes{tenant=\"acme\",tier=\"l1\"}").unwrap_or(0);
    let tokens = |seed: u32| (0..16 * 5).map(|t| t * 13 + seed).collect::<Vec<u32>>();
    let (a1_keys, a2_keys, b_keys) = (
        KeyChain::keys(&a1, &tokens(1)).unwrap(),
        KeyChain::keys(&a2, &tokens(2)).unwrap(),
        KeyChain::keys(&b, &tokens(3)).unwrap(),
    );
    let mut engines = [engine(&mut pool, &a1), engine(&mut pool, &a2), engine(&mut pool, &b)];
    // Five of six slots: every block saved.
    save(&mut engines[0], &a1_keys, 0xa1);
    // Five more in one save, against one slot left: refused at admission.
    let statuses = save_from(&mut engines[1], &a2_keys, 0, 0xa2);
    let refused = statuses.iter().filter(|s| **s == SaveStatus::Refused(AgentError::OverQuota)).count();
    let saved = statuses.iter().filter(|s| **s == SaveStatus::Saved).count();
    assert!(refused >= 1 && saved < a2_keys.len(), "{statuses:?}");
    assert!(acme_l1() <= 6 * slot, "acme holds {} bytes of L1 against a quota of {}", acme_l1(), 6 * slot);
    // The other tenant is not held: no save pressure for it.
    assert_eq!(save_from(&mut engines[2], &b_keys, 0, 0xbb), vec![SaveStatus::Saved; b_keys.len()]);
    // Acme's own coldest go down to L2, and its refused blocks go in.
    save_under_quota(&mut engines[1], &a2_keys, 0xa2, || {
        assert!(acme_l1() <= 6 * slot, "acme holds {} bytes of L1 against a quota of {}", acme_l1(), 6 * slot);
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    assert!(metric(address, "lake_tier_tenant_quota_evictions_total").unwrap_or(0) >= 4);
    // The data plane's figures come once a second.
    let refused_metric = "lake_dp_saves_refused_total{reason=\"over_quota\"}";
    while metric(address, refused_metric).unwrap_or(0) < 1 {
        assert!(Instant::now() < deadline, "over_quota refusals: {:?}", metric(address, refused_metric));
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(address, "lake_tenant_quota_bytes{tenant=\"acme\",tier=\"l1\"}"), Some(6 * slot));
    assert_eq!(
        metric(address, "lake_tenant_bytes{tenant=\"other\",tier=\"l1\"}"),
        Some(5 * slot),
        "the other tenant keeps its L1"
    );
    // Nothing lost: every block of every namespace is found and its bytes are its own.
    for (agent, (keys, fill)) in engines.iter_mut().zip([(&a1_keys, 0xa1), (&a2_keys, 0xa2), (&b_keys, 0xbb)]) {
        load_all(agent, keys, fill);
    }
    drop(engines);
    pool.stop().unwrap();
}

/// Saves the prefix `keys` (each 32 KiB of `fill`) under an L1 quota
/// that refuses some of it: again from its first block not found, until
/// every one is, calling `check` between rounds.
fn save_under_quota(agent: &mut lake_agent::Agent, keys: &[lake_dp::BlockKey], fill: u8, check: impl Fn()) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut table = Vec::new();
    loop {
        let found = agent.lookup(keys, &mut table);
        if found == keys.len() {
            return;
        }
        assert!(Instant::now() < deadline, "{found} of {} blocks saved in 30 s", keys.len());
        save_from(agent, keys, found, fill);
        check();
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Loads every block of `keys` (each `fill`), in as many fetches as it
/// takes; how long that took.
fn load_all(agent: &mut lake_agent::Agent, keys: &[lake_dp::BlockKey], fill: u8) -> Duration {
    let mut table = Vec::new();
    let started = Instant::now();
    let mut delivered = 0;
    while delivered < keys.len() {
        assert!(started.elapsed() < Duration::from_secs(60), "{delivered} of {} loaded in 60 s", keys.len());
        assert_eq!(agent.lookup(keys, &mut table), keys.len(), "every block is still found");
        delivered += agent.fetch(&keys[delivered..], &table[delivered..], |i, bytes| {
            assert!(bytes.iter().all(|&x| x == fill), "block {i}");
        });
    }
    started.elapsed()
}

/// A tenant capped at 512 KiB/s of L2 reads on this node loads its L2
/// blocks no faster than that, every one whole; another tenant loading
/// as much from the same L2 is not held back.
#[test]
fn a_tenant_capped_on_l2_reads_loads_no_faster_than_its_cap_and_the_other_is_not_held() {
    use lake_cp::tier::TenantQuota;
    use lake_dp::Tier;
    use lake_dp::runner::config::TenantSection;
    const RATE: u64 = 512 * 1024;
    let dir = std::env::temp_dir().join(format!("lake-cp-tenant-rate-{}", std::process::id()));
    let (capped, free) = (namespace(4), namespace(5));
    let slot = lake_dp::stored::object_bytes(64 * 1024);
    let mut config = EmbeddedConfig {
        local_agents: 2,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..EmbeddedConfig::new(dir)
    };
    // An L1 quota of two blocks each: what they save goes down to L2.
    for ns in [&capped, &free] {
        let tenant = format!("{:x}", ns.id().0);
        config.tiers.tenant_quotas.push(TenantQuota {
            tenant,
            namespaces: vec![ns.id().0],
            tier: Tier::L1Dram,
            bytes: 2 * slot,
        });
    }
    config.tenant_rates = vec![TenantSection {
        name: "capped".into(),
        namespaces: vec![format!("{:016x}", capped.id().0)],
        l2_read_bytes_per_s: Some(RATE),
        l2_write_bytes_per_s: None,
        l3_read_bytes_per_s: None,
        l3_write_bytes_per_s: None,
        net_send_bytes_per_s: None,
        push_bytes_per_s: None,
        net_receive_bytes_per_s: None,
    }];
    let mut pool = EmbeddedPool::start(&config).unwrap();
    let tokens = |seed: u32| (0..16 * 40).map(|t| t * 11 + seed).collect::<Vec<u32>>();
    let (capped_keys, free_keys) =
        (KeyChain::keys(&capped, &tokens(1)).unwrap(), KeyChain::keys(&free, &tokens(2)).unwrap());
    let mut engines = [engine(&mut pool, &capped), engine(&mut pool, &free)];
    // Saves past the quota are refused until the tenant's coldest go down.
    save_under_quota(&mut engines[0], &capped_keys, 0xc1, || {});
    save_under_quota(&mut engines[1], &free_keys, 0xf1, || {});
    // Both down to L2 but for their two L1 blocks.
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let in_l2 = |agent: &mut lake_agent::Agent, keys: &[lake_dp::BlockKey], table: &mut Vec<_>| {
        agent.lookup(keys, table);
        table.iter().filter(|e: &&lake_dp::mirror::MirrorEntry| e.tier == Tier::L2Nvme).count() as u64
    };
    while in_l2(&mut engines[0], &capped_keys, &mut table) < 38 || in_l2(&mut engines[1], &free_keys, &mut table) < 38 {
        assert!(Instant::now() < deadline, "not demoted");
        std::thread::sleep(Duration::from_millis(20));
    }
    let capped_l2 = in_l2(&mut engines[0], &capped_keys, &mut table);
    let free_time = load_all(&mut engines[1], &free_keys, 0xf1);
    let capped_time = load_all(&mut engines[0], &capped_keys, 0xc1);
    // At least its L2 bytes past the bucket's burst (a tenth of a second's
    // worth), at the rate; a little slack for the clock's granularity.
    // (A 32 KiB block is read as its 36 KiB object.)
    let object = lake_dp::stored::object_bytes(32 * 1024);
    let at_rate = Duration::from_nanos((capped_l2 * object - RATE / 10) * 1_000_000_000 / RATE);
    println!(
        "capped: {capped_l2} L2 blocks in {capped_time:?} (the cap allows {at_rate:?} at the least); free: {free_time:?}"
    );
    assert!(capped_time >= at_rate.mul_f64(0.9), "{capped_time:?} for {capped_l2} blocks at {RATE} B/s");
    assert!(free_time < capped_time / 2, "the uncapped tenant was held: {free_time:?} vs {capped_time:?}");
    // The operator sees who waited, on which path (sent with the data
    // plane's stats, once a second).
    let address = pool.metrics.unwrap();
    let waited =
        |path: &str| metric(address, &format!("lake_tenant_throttled_total{{tenant=\"capped\",path=\"{path}\"}}"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while waited("l2_read").unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "no throttled L2 reads in /metrics");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(waited("l2_write"), Some(0));
    assert_eq!(waited("net_send"), Some(0));
    drop(engines);
    let (stats, _) = pool.stop().unwrap();
    assert!(stats.pool.loads_throttled > 0, "{:?}", stats.pool);
}
