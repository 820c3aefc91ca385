//! Trace ids through the pool: an engine's agent names the
//! request it serves (`Agent::set_trace`), its loads carry the id to the
//! data plane — in-process, and over the shared-memory port of an agent in
//! another process's place — which logs each load under it with its time
//! (`{"event":"trace",...}` in its event log) and answers with that time;
//! the agent keeps each as a span. Untraced loads leave neither.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

#[path = "common/chain.rs"]
mod chain;
#[path = "common/scratch.rs"]
mod scratch;

use std::time::{Duration, Instant};

use lake_agent::port::AgentError;
use lake_agent::{Agent, AgentConfig, TraceSpan};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::{BlockKey, NamespaceId, Tier};

use chain::save_chain;
use scratch::Scratch;

const PAYLOAD: usize = 60 * 1024;
const BLOCKS: u32 = 24;
const NS: NamespaceId = NamespaceId(0x7ace);

fn key(block: u32) -> BlockKey {
    let mut bytes = [0x3c; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    BlockKey(bytes)
}

fn payload(block: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|i| (i as u8).wrapping_mul(7) ^ (block as u8)).collect()
}

fn config<'a>(pool: &'a EmbeddedPool, name: &'static str) -> AgentConfig<'a> {
    AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name,
        namespace: NS,
        layout_fingerprint: 0x7a,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    }
}

/// Loads up to 6 blocks now in L2, one at a time (L1 is small), each
/// checked against its bytes; the keys loaded from L2 (a block that moved
/// between its lookup and its load is passed over).
fn fetch_from_l2(agent: &mut Agent, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut table = Vec::new();
    let mut loaded = Vec::new();
    for i in 0..keys.len() {
        if loaded.len() == 6 {
            break;
        }
        if agent.lookup(&keys[i..=i], &mut table) != 1 || table[0].tier != Tier::L2Nvme {
            continue;
        }
        let loads = agent.stats.l2_loads;
        let delivered = agent.fetch(&keys[i..=i], &table, |_, bytes| {
            assert_eq!(bytes, &payload(i as u32)[..], "block {i}");
        });
        // Only what the data plane loaded: a block promoted since the
        // lookup (the mirror not yet told) is read from L1, with no load.
        if delivered == 1 && agent.stats.l2_loads > loads {
            loaded.push(keys[i]);
        }
    }
    loaded
}

fn spans(agent: &mut Agent) -> Vec<TraceSpan> {
    let mut spans = Vec::new();
    agent.take_spans(|span| spans.push(*span));
    spans
}

#[test]
fn a_traced_load_is_logged_by_the_data_plane_under_its_id_and_timed_back_to_the_agent() {
    let dir = std::env::temp_dir().join(format!("lake-cp-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let _scratch = Scratch(dir.clone(), Vec::new());
    let log = dir.join("events.log");
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 16,
        l2_slots_per_file: 64,
        local_agents: 1,
        remote_agents: 1,
        event_log: Some(log.clone()),
        ..EmbeddedConfig::new(dir.join("pool"))
    })
    .unwrap();
    let port = pool.local_ports.remove(0);
    let mut local = Agent::attach(&config(&pool, "traced-local"), port).unwrap();
    let mut remote = Agent::connect(&config(&pool, "traced-remote"), &pool.dp_socket).unwrap();
    assert!(local.traces_taken() && remote.traces_taken(), "this build's data plane offers trace ids at attach");
    let keys: Vec<BlockKey> = (0..BLOCKS).map(key).collect();
    save_chain(&mut local, &keys, |i| payload(i as u32));
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while local.lookup(&keys, &mut table) < keys.len() || table.iter().filter(|e| e.tier == Tier::L2Nvme).count() < 6 {
        assert!(Instant::now() < deadline, "the blocks were not demoted to L2");
        std::thread::sleep(Duration::from_millis(10));
    }

    // Untraced: no span, no line.
    assert!(!fetch_from_l2(&mut local, &keys).is_empty());
    assert!(spans(&mut local).is_empty());
    let traces = [(0x1111_2222_3333_4444_u64, "in-process"), (0xaaaa_bbbb_cccc_dddd, "shared memory")];
    let mut seen = Vec::new();
    for (agent, (trace, how)) in [&mut local, &mut remote].into_iter().zip(traces) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut loaded = Vec::new();
        // Loads promote: wait for more of them in L2 where needed.
        while loaded.is_empty() {
            assert!(Instant::now() < deadline, "{how}: nothing left in L2 to load");
            agent.set_trace(trace);
            loaded = fetch_from_l2(agent, &keys);
            agent.set_trace(0);
        }
        // A span per load the data plane answered: each block loaded, and
        // each try retried (refused for want of an L1 slot, or its new copy
        // taken away before the agent pinned it).
        let got = spans(agent);
        let ok: Vec<BlockKey> = got.iter().filter(|span| span.result.is_ok()).map(|span| span.key).collect();
        for key in &loaded {
            assert!(ok.contains(key), "{how}: no span for block {key:?} loaded from L2: {got:?}");
        }
        for span in &got {
            assert_eq!(span.trace, trace, "{how}: {span:?}");
            assert_eq!(span.tier, Tier::L2Nvme as u8, "{how}: {span:?}");
            let retried = matches!(span.result, Err(AgentError::NoSpace | AgentError::Busy | AgentError::Stale));
            assert!(span.result.is_ok() || retried, "{how}: {span:?}");
            // The data plane answered with its time, and the agent, which
            // waited for it, saw at least that.
            assert!(span.data_plane_us >= 1, "{how}: the data plane's time did not come back: {span:?}");
            assert!(span.took_ns + 1000 >= u64::from(span.data_plane_us) * 1000, "{how}: {span:?}");
        }
        seen.push((trace, got.len(), got.iter().filter(|span| span.result.is_ok()).count()));
    }
    // Set back to 0: untraced again.
    assert!(!fetch_from_l2(&mut remote, &keys).is_empty() || !fetch_from_l2(&mut local, &keys).is_empty());
    assert!(spans(&mut local).is_empty() && spans(&mut remote).is_empty());
    drop((local, remote));
    pool.stop().unwrap();

    // The data plane's log: one line per traced block, under its id.
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .filter(|l| l.contains("\"event\":\"trace\""))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let traced: usize = seen.iter().map(|&(_, answered, _)| answered).sum();
    assert_eq!(lines.len(), traced, "only traced loads are logged: {text}");
    for (trace, answered, answered_ok) in seen {
        let id = format!("{trace:016x}");
        let mine: Vec<&serde_json::Value> = lines.iter().filter(|l| l["trace"] == id.as_str()).collect();
        assert_eq!(mine.len(), answered, "trace {id}: {text}");
        assert_eq!(mine.iter().filter(|l| l["result"] == "ok").count(), answered_ok, "trace {id}: {text}");
        for line in mine {
            assert_eq!((&line["op"], &line["tier"]), (&"load".into(), &"l2".into()), "{line}");
            assert!(line["us"].as_u64().is_some(), "{line}");
        }
    }
}
