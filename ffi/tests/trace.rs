//! Trace ids through the C ABI: the engine thread names the request it
//! serves (`lake_set_trace`), the loads it submits carry it to the data
//! plane and back, and `lake_trace_spans` hands over each traced block as
//! the agent saw it — with the data plane's own time from its answer.
//! Untraced loads leave no span; bad arguments are refused.

#![allow(clippy::cast_possible_truncation)] // small test numbers

mod common;

use common::pools::{BLOCK, attach, keys, lookup, namespace};
use common::{ok, spans, statuses};

use std::time::{Duration, Instant};

use lake::pool::{LakeBlockKey, lake_detach, lake_register_host_memory, lake_submit_load, lake_submit_save};
use lake::status::LakeStatus;
use lake::trace::{lake_set_trace, lake_trace_spans};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};

const BLOCKS: usize = 16;

#[test]
fn a_traced_load_through_the_c_abi_comes_back_with_the_data_planes_time() {
    let dir = std::env::temp_dir().join(format!("lake-ffi-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: BLOCK as u64,
        l1_slots: 8,
        l2_slots_per_file: 32,
        remote_agents: 2,
        ..EmbeddedConfig::new(dir.clone())
    })
    .unwrap();
    let mut strings = Vec::new();
    let ns = namespace(9);
    let handle = attach(&pool, ns, &mut strings);
    let keys = keys(ns, BLOCKS, |t| t * 3 + 1);
    let mut kv: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i as u8).wrapping_mul(31) ^ (i / BLOCK) as u8).collect();
    let mut memory = 0;
    // SAFETY: `kv` lives until detach, below.
    ok(unsafe { lake_register_host_memory(handle, kv.as_mut_ptr(), BLOCK, BLOCKS as u32, &raw mut memory) }, "reg");
    // One block at a time, each under the one before: L1 holds 8, so the
    // control plane demotes the oldest to L2 as they come.
    for i in 0..BLOCKS {
        let block = i as u32;
        let parent = if i == 0 { core::ptr::null() } else { &raw const keys[i - 1] };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut request = 0;
            // SAFETY: one key and one block index; the memory is registered.
            let submitted = unsafe {
                lake_submit_save(handle, memory, parent, &raw const keys[i], &raw const block, 1, 2, &raw mut request)
            };
            ok(submitted, "save");
            if statuses(handle, request, 1)[0] == LakeStatus::LakeOk {
                break;
            }
            assert!(Instant::now() < deadline, "block {i} not saved in 20 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while lookup(handle, &keys).iter().filter(|l| l.tier == 2).count() < 4 {
        assert!(Instant::now() < deadline, "nothing demoted to L2");
        std::thread::sleep(Duration::from_millis(10));
    }

    let mut into = vec![0u8; BLOCKS * BLOCK];
    let mut target = 0;
    // SAFETY: `into` lives until detach.
    ok(unsafe { lake_register_host_memory(handle, into.as_mut_ptr(), BLOCK, BLOCKS as u32, &raw mut target) }, "reg");
    let load = |i: usize| -> (u8, LakeStatus) {
        let found = lookup(handle, &keys[i..=i]);
        let block = i as u32;
        let mut request = 0;
        // SAFETY: one key, location and block index.
        let submitted = unsafe {
            lake_submit_load(
                handle,
                target,
                &raw const keys[i],
                found.as_ptr(),
                &raw const block,
                1,
                0,
                &raw mut request,
            )
        };
        ok(submitted, "load");
        (found[0].tier, statuses(handle, request, 1)[0])
    };
    // Untraced: no span.
    let first_in_l2 = lookup(handle, &keys).iter().position(|l| l.tier == 2).unwrap();
    assert_eq!(load(first_in_l2), (2, LakeStatus::LakeOk));
    assert!(spans(handle).is_empty());

    // Traced: each block loaded from L2 comes back as a span.
    let trace = 0x5eed_0000_0000_7ace_u64;
    lake_set_trace(trace);
    let mut from_l2 = Vec::new();
    // (Not the block just loaded: it is in L1 now, whatever a lookup made
    // before its promotion is published says.)
    for i in (0..BLOCKS).filter(|&i| i != first_in_l2) {
        if load(i) == (2, LakeStatus::LakeOk) {
            from_l2.push(i);
        }
    }
    lake_set_trace(0);
    assert!(!from_l2.is_empty(), "nothing loaded from L2");
    let from_l2: Vec<LakeBlockKey> = from_l2.into_iter().map(|i| keys[i]).collect();
    let got = spans(handle);
    for key in &from_l2 {
        let span = got.iter().find(|s| s.key == *key && s.status == LakeStatus::LakeOk);
        let span = span.unwrap_or_else(|| panic!("no span for {key:?}: {got:?}"));
        assert_eq!((span.trace, span.tier), (trace, 2), "{span:?}");
        assert!(span.data_plane_us >= 1, "the data plane's time did not come back: {span:?}");
        assert!(span.took_ns + 1000 >= u64::from(span.data_plane_us) * 1000, "{span:?}");
    }
    assert!(got.iter().all(|s| s.trace == trace && s.tier == 2), "{got:?}");
    let ok = got.iter().filter(|s| s.status == LakeStatus::LakeOk).count();
    assert!(ok >= from_l2.len(), "a span a block loaded (and one a try retried): {got:?}");
    // Handed over once.
    assert!(spans(handle).is_empty());
    // Bad arguments are refused by name.
    let mut n = 0;
    // SAFETY: null output with room claimed: refused before any write.
    let refused = unsafe { lake_trace_spans(handle, core::ptr::null_mut(), 4, &raw mut n) };
    assert_eq!(refused, LakeStatus::LakeNullArgument);
    // SAFETY: a null pool is refused.
    let refused = unsafe { lake_trace_spans(core::ptr::null(), core::ptr::null_mut(), 0, &raw mut n) };
    assert_ne!(refused, LakeStatus::LakeOk);

    // SAFETY: attached above, detached once.
    unsafe { lake_detach(handle) };
    drop((kv, into, strings));
    pool.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_traced_push_is_logged_at_the_peer_pool_and_its_time_comes_back() {
    use common::pools::{free_address, push, save, slot_space};
    let dir = std::env::temp_dir().join(format!("lake-ffi-trace-push-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decode-dp.log");
    let config = |name: &str| EmbeddedConfig {
        block_bytes: BLOCK as u64,
        l1_slots: 32,
        l2_slots_per_file: 32,
        remote_agents: 2,
        ..EmbeddedConfig::new(dir.join(name))
    };
    let prefill = EmbeddedPool::start(&config("prefill")).unwrap();
    let decode_address = free_address();
    let decode = EmbeddedPool::start(&EmbeddedConfig {
        transport_listen: Some(decode_address),
        event_log: Some(log.clone()),
        ..config("decode")
    })
    .unwrap();
    let mut strings = Vec::new();
    let ns = namespace(4);
    let (p, d) = (attach(&prefill, ns, &mut strings), attach(&decode, ns, &mut strings));
    let keys = keys(ns, BLOCKS, |t| t * 7 + 2);
    let mut kv: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i as u8).wrapping_mul(13) ^ (i / BLOCK) as u8).collect();
    let table = save(p, &keys, &mut kv);
    let to = slot_space(d);
    let rails = decode_address.to_string();

    // The first block untraced: the links come up and settle what they
    // speak; it leaves no span and no line.
    assert_eq!(push(p, &rails, &keys[..1], &table[..1], to), [LakeStatus::LakeOk]);
    let trace = 0x9e5d_0000_0000_0042_u64;
    lake_set_trace(trace);
    let pushed = push(p, &rails, &keys[1..], &table[1..], to);
    lake_set_trace(0);
    assert!(pushed.iter().all(|&s| s == LakeStatus::LakeOk), "{pushed:?}");

    // The engine's spans: a push span per traced block, each with the
    // decode pool's own time on it.
    let got = spans(p);
    assert_eq!(got.len(), BLOCKS - 1, "{got:?}");
    for key in &keys[1..] {
        let span = got.iter().find(|s| s.key == *key).unwrap_or_else(|| panic!("no span for {key:?}: {got:?}"));
        assert_eq!((span.trace, span.op, span.tier, span.status), (trace, 1, 1, LakeStatus::LakeOk), "{span:?}");
        assert!(span.data_plane_us >= 1, "the peer pool's time did not come back: {span:?}");
        assert!(span.took_ns + 1000 >= u64::from(span.data_plane_us) * 1000, "{span:?}");
    }
    // The decode pool's log: a landing line per traced block under the id,
    // with the same time; none for the untraced one.
    let id = format!("\"trace\":\"{trace:016x}\"");
    let deadline = Instant::now() + Duration::from_secs(10);
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        // Whole lines only: the pool may be writing the last one.
        let whole = &text[..text.rfind('\n').map_or(0, |end| end + 1)];
        let lines: Vec<String> = whole
            .lines()
            .filter(|l| l.contains("\"event\":\"trace\"") && l.contains("\"op\":\"land\""))
            .map(String::from)
            .collect();
        if lines.len() >= BLOCKS - 1 || Instant::now() > deadline {
            break lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(lines.len(), BLOCKS - 1, "{lines:#?}");
    for line in &lines {
        assert!(line.contains(&id) && line.contains("\"result\":\"ok\""), "{line}");
        let event: serde_json::Value = serde_json::from_str(line).unwrap();
        let us = u32::try_from(event["us"].as_u64().unwrap()).unwrap();
        assert!(got.iter().any(|s| s.data_plane_us == us), "{line}: no span with that time");
    }

    for handle in [p, d] {
        // SAFETY: attached above, each detached once.
        unsafe { lake_detach(handle) };
    }
    drop((kv, strings));
    prefill.stop().unwrap();
    decode.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
