//! One transport in front of another (RDMA degrading to TCP, here TCP in
//! front of TCP, the only wire this machine has): a primary whose peer is
//! unreachable fails every transfer, and each is carried by the secondary
//! under its own transfer id — the caller sees only landed blocks; the
//! peer is then written on the secondary alone while its primary cools
//! down. A healthy primary carries everything itself.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

use std::collections::HashMap;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use lake_dp::Priority;
use lake_dp::constants::STORED_HEADER_BYTES;
use lake_dp::transport::fallback::Fallback;
use lake_dp::transport::tcp::{TcpConfig, TcpTransport};
use lake_dp::transport::{Completion, Transport};
use lake_tests::transport::{Node, now_ns, object, outgoing};

fn config(timeout_ms: u64) -> TcpConfig {
    TcpConfig { streams_per_peer: 2, transfer_timeout_ns: timeout_ms * 1_000_000, ..TcpConfig::default() }
}

/// Writes blocks `range` through `sender`, drives both ends until each has
/// completed once; returns the completions.
fn send(
    sender: &mut Fallback<TcpTransport, TcpTransport>,
    receiver: &mut TcpTransport,
    node: &mut Node,
    objects: &[Vec<u8>],
    range: std::ops::Range<usize>,
    start: Instant,
) -> HashMap<u64, Completion> {
    let peer = lake_dp::transport::PeerId(0);
    for i in range.clone() {
        let target = node.reserve(i as u32, 7 + i as u32);
        let block = outgoing(i as u64, peer, &objects[i], target, Priority::PrefillToDecode);
        // SAFETY: `objects` outlives every completion (driven below).
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    let mut done = HashMap::new();
    let mut out = Vec::new();
    let mut none = Node::new(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.len() < range.len() {
        assert!(Instant::now() < deadline, "{} of {} completed", done.len(), range.len());
        sender.poll(&mut none, now_ns(start), &mut out);
        receiver.poll(node, now_ns(start), &mut Vec::new());
        for c in out.drain(..) {
            assert!(done.insert(c.transfer, c).is_none(), "a transfer completed twice");
        }
    }
    done
}

fn check_landed(node: &Node, objects: &[Vec<u8>], done: &HashMap<u64, Completion>) {
    for (&transfer, completion) in done {
        assert!(completion.result.is_ok(), "transfer {transfer}: {:?}", completion.result);
        let object = &objects[transfer as usize];
        let landed = node.landed_bytes(&completion.target, object.len());
        assert!(landed[STORED_HEADER_BYTES..] == object[STORED_HEADER_BYTES..], "transfer {transfer}'s bytes");
    }
}

#[test]
fn a_dead_primary_is_absorbed_by_the_secondary() {
    let start = Instant::now();
    let mut receiver = TcpTransport::new(config(5_000), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = receiver.local_addr().unwrap();
    // An address nothing listens on any more.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut primary = TcpTransport::new(config(300), None).unwrap();
    let primary_peer = primary.add_peer(dead).unwrap();
    let mut secondary = TcpTransport::new(config(5_000), None).unwrap();
    let secondary_peer = secondary.add_peer(address).unwrap();
    let mut sender = Fallback::new(primary, secondary, 10_000_000_000);
    let peer = sender.add_peer(Some(primary_peer), secondary_peer);
    assert!(sender.on_primary(peer, now_ns(start)));
    let mut node = Node::new(32);
    let objects: Vec<Vec<u8>> = (0..30).map(|i| object(i, 50_000 + 7_000 * i as usize, i)).collect();

    // All taken by the primary, all failed there, all carried by the
    // secondary: the caller sees 20 landed blocks.
    let done = send(&mut sender, &mut receiver, &mut node, &objects, 0..20, start);
    check_landed(&node, &objects, &done);
    assert_eq!((sender.stats.primary, sender.stats.moved, sender.stats.secondary), (20, 20, 0));
    // Cooling down: the next ones go straight to the secondary.
    assert!(!sender.on_primary(peer, now_ns(start)));
    let done = send(&mut sender, &mut receiver, &mut node, &objects, 20..30, start);
    check_landed(&node, &objects, &done);
    assert_eq!((sender.stats.primary, sender.stats.moved, sender.stats.secondary), (20, 20, 10));
    assert_eq!(node.published.len(), 30, "each block landed once");
    assert_eq!(sender.in_flight(), 0);
}

#[test]
fn a_healthy_primary_carries_everything() {
    let start = Instant::now();
    let mut receiver = TcpTransport::new(config(5_000), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = receiver.local_addr().unwrap();
    let mut primary = TcpTransport::new(config(5_000), None).unwrap();
    let primary_peer = primary.add_peer(address).unwrap();
    let mut secondary = TcpTransport::new(config(5_000), None).unwrap();
    let secondary_peer = secondary.add_peer(address).unwrap();
    let mut sender = Fallback::new(primary, secondary, 1_000_000_000);
    sender.add_peer(Some(primary_peer), secondary_peer);
    let mut node = Node::new(16);
    let objects: Vec<Vec<u8>> = (0..16).map(|i| object(i, 65_536, i)).collect();
    let done = send(&mut sender, &mut receiver, &mut node, &objects, 0..16, start);
    check_landed(&node, &objects, &done);
    assert_eq!((sender.stats.primary, sender.stats.moved, sender.stats.secondary), (16, 0, 0));
}
