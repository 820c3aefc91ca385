//! The transport through a bad network: a seeded fault proxy between two
//! nodes delays, stalls, flips bytes, drops and reorders chunks, and resets
//! connections. Whatever it does: every block the sender is told landed is
//! in its slot, byte for byte; no block that does not check is ever
//! published; every transfer ends — landed or failed with its reason —
//! within its deadline; and once the faults stop, blocks land again.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lake_dp::Priority;
use lake_dp::stored::decode_object;
use lake_dp::transport::TransferError;
use lake_dp::transport::tcp::{TcpConfig, TcpTransport};
use lake_tests::fault_proxy::{FaultProxy, Faults};
use lake_tests::transport::{Node, now_ns, object, outgoing};

const DEADLINE_NS: u64 = 3_000_000_000;

#[test]
fn through_a_faulty_network_blocks_land_whole_or_fail_by_name() {
    for seed in [1u64, 2, 3, 4, 5] {
        run(seed);
    }
}

fn run(seed: u64) {
    let start = Instant::now();
    let config = TcpConfig {
        streams_per_peer: 4,
        slice_bytes: 256 * 1024,
        transfer_timeout_ns: DEADLINE_NS,
        reconnect_ns: 5_000_000,
        ..TcpConfig::default()
    };
    let mut receiver = TcpTransport::new(config, Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let faults = Faults {
        seed,
        chunk_bytes: 64 * 1024,
        delay: 20_000,
        delay_max_us: 2_000,
        stall: 2_000,
        stall_ms: 50,
        flip: 3_000,
        drop: 1_000,
        swap: 1_000,
        reset: 1_000,
    };
    let proxy = FaultProxy::start(receiver.local_addr().unwrap(), faults).unwrap();
    let mut sender = TcpTransport::new(config, None).unwrap();
    let peer = sender.add_peer(proxy.address()).unwrap();
    let mut node = Node::new(96);
    let sizes = [4096usize, 100_000, 700_000, 2 << 20];
    let objects: Vec<Vec<u8>> = (0..96u32).map(|i| object(i + 1000 * seed as u32, sizes[i as usize % 4], i)).collect();

    // Phase 1, faults on: 64 blocks, 16 in flight at a time.
    let mut outcomes: HashMap<u64, Result<(), TransferError>> = HashMap::new();
    let mut ended_late = Vec::new();
    let mut next = 0u32;
    let mut started_at: HashMap<u64, u64> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while outcomes.len() < 64 {
        assert!(Instant::now() < deadline, "seed {seed}: {} of 64 ended in 60 s", outcomes.len());
        while next < 64 && sender.in_flight() < 16 {
            let target = node.reserve(next, 1);
            let bytes = &objects[next as usize];
            let block = outgoing(u64::from(next), peer, bytes, target, Priority::WriteBack);
            // SAFETY: `objects` outlives every completion.
            match unsafe { sender.write(&block, now_ns(start)) } {
                Ok(()) => {
                    started_at.insert(u64::from(next), now_ns(start));
                }
                Err(e) => {
                    outcomes.insert(u64::from(next), Err(e));
                }
            }
            next += 1;
        }
        let mut done = Vec::new();
        sender.poll(&mut Node::new(0), now_ns(start), &mut done);
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
        for completion in done {
            // Ended by its deadline, with the sweep's millisecond of slack.
            let took = now_ns(start) - started_at[&completion.transfer];
            if took > DEADLINE_NS + 200_000_000 {
                ended_late.push((completion.transfer, took));
            }
            assert!(outcomes.insert(completion.transfer, completion.result).is_none(), "a second completion");
        }
    }
    assert!(ended_late.is_empty(), "seed {seed}: ended past their deadline: {ended_late:?}");
    assert!(proxy.counts.total() > 0, "seed {seed}: the proxy injected nothing");

    // Every block told landed is in its slot as sent; nothing published is
    // wrong (a block may land after its sender gave up on it: then it is
    // right too).
    let published: HashMap<u32, usize> = node.published.iter().enumerate().map(|(i, (t, _))| (t.slot, i)).collect();
    for (&transfer, result) in &outcomes {
        if result.is_ok() {
            assert!(published.contains_key(&(transfer as u32)), "seed {seed}: {transfer} acked but not published");
        }
    }
    for (target, meta) in &node.published {
        let sent = &objects[target.slot as usize];
        let (_, payload) = decode_object(node.landed_bytes(target, sent.len())).expect("a published block decodes");
        assert_eq!(payload, decode_object(sent).unwrap().1, "seed {seed}: slot {} holds other bytes", target.slot);
        assert_eq!(meta.slot, target.slot);
    }
    let landed = outcomes.values().filter(|r| r.is_ok()).count();
    let reasons: Vec<&TransferError> = outcomes.values().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        reasons.iter().all(|e| matches!(
            e,
            TransferError::Corrupt | TransferError::PeerLost(_) | TransferError::Timeout | TransferError::Refused
        )),
        "seed {seed}: {reasons:?}"
    );
    eprintln!(
        "seed {seed}: {landed} of 64 landed, {} failed ({:?}); faults {:?}; sender {:?}",
        reasons.len(),
        reasons.iter().map(|e| format!("{e:?}")).collect::<Vec<_>>(),
        proxy.counts,
        sender.stats
    );

    // Phase 2, faults off: the rest land, over connections that recover.
    proxy.set_faults(false);
    let mut left = Vec::new();
    for slot in 64..96u32 {
        let target = node.reserve(slot, 1);
        let bytes = &objects[slot as usize];
        left.push(outgoing(u64::from(slot), peer, bytes, target, Priority::WriteBack));
    }
    let mut ok = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut pending: Vec<lake_dp::transport::tcp::Outgoing> = left;
    while ok < 32 {
        assert!(Instant::now() < deadline, "seed {seed}: {ok} of 32 landed after the faults stopped");
        pending.retain(|block| {
            // SAFETY: as above.
            unsafe { sender.write(block, now_ns(start)) }.is_err()
        });
        let mut done = Vec::new();
        sender.poll(&mut Node::new(0), now_ns(start), &mut done);
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
        for completion in done {
            match completion.result {
                Ok(()) => ok += 1,
                // A connection broken by a fault before they stopped: the
                // caller sends again (to the same reserved slot).
                Err(TransferError::PeerLost(_) | TransferError::Timeout) => {
                    let slot = completion.transfer as u32;
                    let target = node.reserve(slot, 1);
                    let bytes = &objects[slot as usize];
                    pending.push(outgoing(completion.transfer + 1000, peer, bytes, target, Priority::WriteBack));
                }
                Err(e) => panic!("seed {seed}: {e} with the faults off"),
            }
        }
    }
}
