//! The cp↔dp protocol over a real Unix socket: `lake-dp` stand-ins speak
//! the v1 wire format to the server; reports reach the node, refused
//! reports get an error and keep the connection, and a malformed frame
//! closes that one connection only.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use lake_cp::node::Node;
use lake_cp::server::Server;
use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::hello::{Identity, hello};
use lake_dp::wire::message::{BlockRecord, ErrorCode, RegisterRegion, Role};
use lake_dp::wire::{FrameMeta, Limits, Message, decode_frame, encode_frame};
use lake_dp::{BlockKey, Durability, NodeId, ObjectKind, Tier};

fn socket(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lake-cp-{name}-{}.sock", std::process::id()))
}

fn frame(request: u64, message: &Message<'_>) -> Vec<u8> {
    let mut out = vec![0u8; 4096];
    let meta = FrameMeta { version: 1, flags: 0, request_id: request, leader_term: 0 };
    let len = encode_frame(meta, message, &mut out).unwrap();
    out.truncate(len);
    out
}

fn dp_hello() -> Vec<u8> {
    let identity = Identity { role: Role::DataPlane, node: 3, pid: 1, region_epoch: 5, features: 0, name: "dp-test" };
    frame(1, &Message::Hello(hello(&identity).unwrap()))
}

fn region(id: u16, tier: Tier, epoch: u64) -> Message<'static> {
    Message::RegisterRegion(RegisterRegion {
        region: id,
        tier: tier as u8,
        reserved_a: 0,
        node: 3,
        region_epoch: epoch,
        slot_bytes: 65536,
        slot_count: 64,
        reserved_b: 0,
        name: [0; 48],
    })
}

fn committed(k: u8, parent: Option<u8>, epoch: u64, slot: u32) -> Message<'static> {
    Message::BlockCommitted(BlockRecord {
        replica: ReplicaWire {
            tier: Tier::L2Nvme as u8,
            reserved: 0,
            region: 2,
            node: 3,
            region_epoch: epoch,
            slot,
            generation: 1,
        },
        key: BlockKey([k; 16]),
        parent_key: parent.map_or(BlockKey::NONE, |p| BlockKey([p; 16])),
        namespace: 1,
        layout_fingerprint: 2,
        payload_len: 4096,
        block_index: 0,
        kind: ObjectKind::KvBlock as u16,
        durability: Durability::Acked as u8,
        flags: 0,
    })
}

/// Runs the server until `done` holds (or a second passes).
fn pump(server: &mut Server, done: impl Fn(&Server) -> bool) {
    for _ in 0..200 {
        server.poll_once(Some(Duration::from_millis(5))).unwrap();
        if done(server) {
            return;
        }
    }
    panic!("the server did not get there: {:?}", server.counters);
}

/// Reads frames from `stream` until it has `count` of them.
fn replies(stream: &mut UnixStream, count: usize) -> Vec<(u16, Option<u32>)> {
    stream.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buffer = Vec::new();
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    while out.len() < count {
        let n = stream.read(&mut chunk).unwrap();
        assert!(n > 0, "closed after {} replies", out.len());
        buffer.extend_from_slice(&chunk[..n]);
        while let Ok(frame) = decode_frame(&buffer, &Limits::default()) {
            let code = match frame.message {
                Message::Error(body) => Some(body.code),
                _ => None,
            };
            out.push((frame.header.kind, code));
            let used = frame.len();
            buffer.drain(..used);
        }
    }
    out
}

#[test]
fn reports_are_applied_and_refusals_answered() {
    let path = socket("reports");
    let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
    let mut dp = UnixStream::connect(&path).unwrap();
    dp.write_all(&dp_hello()).unwrap();
    dp.write_all(&frame(2, &region(2, Tier::L2Nvme, 5))).unwrap();
    dp.write_all(&frame(3, &committed(1, None, 5, 10))).unwrap();
    dp.write_all(&frame(4, &committed(2, Some(1), 5, 11))).unwrap();
    pump(&mut server, |s| s.node().counters.committed == 2);
    assert_eq!(server.node().locations.ready(&BlockKey([2; 16])).count(), 1);
    // A stale epoch is refused with an error; the connection stays.
    dp.write_all(&frame(5, &committed(3, Some(2), 4, 12))).unwrap();
    pump(&mut server, |s| s.counters.refused == 1);
    let got = replies(&mut dp, 2);
    assert_eq!(got[0], (lake_dp::wire::MessageKind::HelloAck as u16, None));
    assert_eq!(got[1], (lake_dp::wire::MessageKind::Error as u16, Some(ErrorCode::StaleEpoch as u32)));
    dp.write_all(&frame(6, &committed(3, Some(2), 5, 12))).unwrap();
    pump(&mut server, |s| s.node().counters.committed == 3);
    assert_eq!(server.peers(), 1);
}

#[test]
fn a_malformed_frame_closes_that_connection_only() {
    let path = socket("bad");
    let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
    let mut good = UnixStream::connect(&path).unwrap();
    let mut bad = UnixStream::connect(&path).unwrap();
    good.write_all(&dp_hello()).unwrap();
    good.write_all(&frame(2, &region(2, Tier::L2Nvme, 5))).unwrap();
    bad.write_all(&dp_hello()).unwrap();
    pump(&mut server, |s| s.node().counters.regions == 1 && s.counters.frames >= 3);
    // A frame with one body byte flipped: its CRC no longer holds.
    let mut broken = frame(3, &committed(1, None, 5, 10));
    let last = broken.len() - 1;
    broken[last] ^= 0x40;
    bad.write_all(&broken).unwrap();
    pump(&mut server, |s| s.counters.bad_frames == 1 && s.peers() == 1);
    let got = replies(&mut bad, 2);
    assert_eq!(got[1], (lake_dp::wire::MessageKind::Error as u16, Some(ErrorCode::BadFrame as u32)));
    let mut rest = [0u8; 16];
    assert_eq!(bad.read(&mut rest).unwrap(), 0, "the bad connection is closed");
    // The good one is untouched, and nothing was applied from the bad.
    good.write_all(&frame(3, &committed(1, None, 5, 10))).unwrap();
    pump(&mut server, |s| s.node().counters.committed == 1);
    // Garbage before any hello, and a first frame that is no hello.
    let mut noise = UnixStream::connect(&path).unwrap();
    noise.write_all(&[0xde; 100]).unwrap();
    let mut rude = UnixStream::connect(&path).unwrap();
    rude.write_all(&frame(1, &region(2, Tier::L2Nvme, 5))).unwrap();
    pump(&mut server, |s| s.counters.bad_frames == 3);
    assert_eq!(replies(&mut rude, 1)[0].1, Some(ErrorCode::BadFrame as u32));
    assert_eq!(server.node().counters.regions, 1);
}

#[test]
fn metrics_are_served_from_the_same_loop() {
    let path = socket("metrics");
    let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
    let address = server.serve_metrics("127.0.0.1:0".parse().unwrap()).unwrap();
    let mut dp = UnixStream::connect(&path).unwrap();
    dp.write_all(&dp_hello()).unwrap();
    dp.write_all(&frame(2, &region(2, Tier::L2Nvme, 5))).unwrap();
    dp.write_all(&frame(3, &committed(1, None, 5, 10))).unwrap();
    pump(&mut server, |s| s.node().counters.committed == 1);
    let get = |path: &str, server: &mut Server| -> String {
        let mut client = std::net::TcpStream::connect(address).unwrap();
        client.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
        for _ in 0..20 {
            server.poll_once(Some(Duration::from_millis(5))).unwrap();
        }
        client.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut response = String::new();
        client.read_to_string(&mut response).unwrap();
        response
    };
    let metrics = get("/metrics", &mut server);
    assert!(metrics.starts_with("HTTP/1.1 200 OK"), "{metrics}");
    assert!(metrics.contains("lake_cp_replica_reports_total{kind=\"committed\"} 1\n"), "{metrics}");
    assert!(metrics.contains("lake_cp_blocks 1\n"));
    assert!(metrics.contains("lake_cp_connections_accepted_total 1\n"));
    assert!(get("/healthz", &mut server).ends_with("\r\n\r\nok\n"));
    assert!(get("/other", &mut server).starts_with("HTTP/1.1 404"));
    // Only an L2 registered so far: not ready for engines.
    let not_ready = get("/readyz", &mut server);
    assert!(not_ready.starts_with("HTTP/1.1 503") && not_ready.contains("registered its L1"), "{not_ready}");
    dp.write_all(&frame(4, &region(1, Tier::L1Dram, 5))).unwrap();
    pump(&mut server, |s| s.node().counters.regions == 2);
    assert!(get("/readyz", &mut server).ends_with("\r\n\r\nready\n"));
    // The data plane gone: not ready again.
    drop(dp);
    pump(&mut server, |s| s.peers() == 0);
    assert!(get("/readyz", &mut server).starts_with("HTTP/1.1 503"));
}

#[test]
fn agents_get_leases_idempotent_per_request_and_lose_them_when_they_go() {
    use lake_dp::wire::Records;
    use lake_dp::wire::message::{LeaseRelease, LeaseRequest};

    let path = socket("leases");
    let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
    let mut dp = UnixStream::connect(&path).unwrap();
    dp.write_all(&dp_hello()).unwrap();
    dp.write_all(&frame(2, &region(2, Tier::L2Nvme, 5))).unwrap();
    dp.write_all(&frame(3, &committed(1, None, 5, 10))).unwrap();
    dp.write_all(&frame(4, &committed(2, Some(1), 5, 11))).unwrap();
    pump(&mut server, |s| s.node().counters.committed == 2);

    let identity = Identity { role: Role::Agent, node: 3, pid: 2, region_epoch: 0, features: 0, name: "engine" };
    let mut agent = UnixStream::connect(&path).unwrap();
    agent.write_all(&frame(1, &Message::Hello(hello(&identity).unwrap()))).unwrap();
    let keys = [BlockKey([1; 16]), BlockKey([2; 16]), BlockKey([9; 16])];
    let ask = LeaseRequest { namespace: 1, ttl_ms: 30_000, count: 3 };
    let request = frame(7, &Message::LeaseRequest(ask, Records::from_slice(&keys)));
    agent.write_all(&request).unwrap();
    agent.write_all(&request).unwrap(); // a retry of the same request
    pump(&mut server, |s| s.node().leases.granted == 1 && s.counters.frames >= 7);
    assert_eq!(server.node().leases.len(), 1, "the retry got the same lease");
    // The grant: the two leading keys that have a replica, with their slots.
    agent.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buffer = Vec::new();
    let mut grants = Vec::new();
    while grants.len() < 2 {
        let mut chunk = [0u8; 4096];
        let n = agent.read(&mut chunk).unwrap();
        assert!(n > 0);
        buffer.extend_from_slice(&chunk[..n]);
        while let Ok(frame) = decode_frame(&buffer, &Limits::default()) {
            if let Message::LeaseGrant(head, entries) = frame.message {
                grants.push((head.lease_id, entries.iter().map(|e| (e.key, e.replica.slot)).collect::<Vec<_>>()));
            }
            let used = frame.len();
            buffer.drain(..used);
        }
    }
    assert_eq!(grants[0], grants[1]);
    assert_eq!(grants[0].1, vec![(BlockKey([1; 16]), 10), (BlockKey([2; 16]), 11)]);
    assert!(server.node().leases.is_held(&BlockKey([2; 16]), 2));
    // Released explicitly; then a new lease, which ends with the connection.
    agent.write_all(&frame(8, &Message::LeaseRelease(LeaseRelease { lease_id: grants[0].0 }))).unwrap();
    pump(&mut server, |s| s.node().leases.is_empty());
    agent.write_all(&frame(9, &Message::LeaseRequest(ask, Records::from_slice(&keys)))).unwrap();
    pump(&mut server, |s| s.node().leases.len() == 1);
    drop(agent);
    pump(&mut server, |s| s.node().leases.is_empty());
    // A data plane may not take leases (refused, connection kept).
    let refused = server.counters.refused;
    dp.write_all(&frame(10, &Message::LeaseRequest(ask, Records::from_slice(&keys)))).unwrap();
    pump(&mut server, |s| s.counters.refused == refused + 1);
    assert!(server.node().leases.is_empty());
    assert_eq!(server.peers(), 1);
}

/// A drain goes only to a data plane that offered `FEATURE_DRAIN` at
/// hello (one built before kind 28 would close the link on it): an older
/// one is sent nothing and the drain says why; this build's is told,
/// answers, and the drain is taken.
#[test]
fn a_drain_is_told_only_to_a_data_plane_that_takes_it() {
    use lake_dp::wire::message::TransferDone;
    for (name, features) in [("old", 0), ("new", lake_dp::wire::FEATURE_DRAIN)] {
        let path = socket(&format!("drain-{name}"));
        let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
        let mut dp = UnixStream::connect(&path).unwrap();
        let identity = Identity { role: Role::DataPlane, node: 3, pid: 1, region_epoch: 5, features, name: "dp-test" };
        dp.write_all(&frame(1, &Message::Hello(hello(&identity).unwrap()))).unwrap();
        dp.write_all(&frame(2, &region(2, Tier::L2Nvme, 5))).unwrap();
        dp.write_all(&frame(3, &region(4, Tier::L2Nvme, 5))).unwrap();
        pump(&mut server, |s| s.node().tiers.regions().len() == 2);
        server.node_mut().tiers.drain(2).unwrap();
        if features == 0 {
            pump(&mut server, |s| s.node().tiers.drains()[0].refused.is_some());
            let drain = &server.node().tiers.drains()[0];
            assert_eq!(drain.refused.as_deref(), Some("its lake-dp does not drain (an older build)"));
            assert!(!drain.announced);
            // Only the hello's answer came: no frame it cannot read.
            assert_eq!(replies(&mut dp, 1), vec![(lake_dp::wire::MessageKind::HelloAck as u16, None)]);
            dp.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
            let mut byte = [0u8; 1];
            assert!(dp.read(&mut byte).is_err(), "nothing more was sent");
            assert_eq!(server.peers(), 1, "the link stays");
            continue;
        }
        // Told: read the command, answer it.
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        dp.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let (request, drain) = 'found: loop {
            pump(&mut server, |_| true);
            let n = dp.read(&mut chunk).unwrap();
            buffer.extend_from_slice(&chunk[..n]);
            while let Ok(frame) = decode_frame(&buffer, &Limits::default()) {
                if let Message::DrainRegion(drain) = frame.message {
                    break 'found (frame.header.request_id, drain);
                }
                let used = frame.len();
                buffer.drain(..used);
            }
        };
        assert_eq!((drain.region, drain.draining), (2, 1));
        let target = ReplicaWire {
            tier: Tier::L2Nvme as u8,
            reserved: 0,
            region: 2,
            node: 3,
            region_epoch: 5,
            slot: u32::MAX,
            generation: 0,
        };
        dp.write_all(&frame(
            request,
            &Message::TransferDone(TransferDone { status: 0, reserved: 0, target, bytes: 0 }),
        ))
        .unwrap();
        pump(&mut server, |s| s.node().tiers.drains()[0].announced);
        // Nothing there: done at once; its room is out of the tier's.
        assert!(server.node().tiers.drains()[0].done);
        assert_eq!(server.node().tiers.capacity(Tier::L2Nvme), 64 * 65536);
    }
}
