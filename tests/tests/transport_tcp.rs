//! Blocks between two nodes over real TCP on loopback: a sender's stored
//! objects land in the receiver's reserved slots, striped over several
//! connections, checked there and their headers rewritten to name the slot
//! they landed in. A slot not reserved is refused, a block whose bytes lie
//! is reported corrupt and never published, a peer that dies fails what
//! was in flight within a bounded time and is reconnected when it is back,
//! and garbage on a connection closes that connection only.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lake_dp::Priority;
use lake_dp::stored::decode_object;
use lake_dp::transport::TransferError;
use lake_dp::transport::frame::{BlockAddr, FEATURE_TRACE, FEATURES_SPOKEN};
use lake_dp::transport::tcp::{Outgoing, PeerId, TcpConfig, TcpTransport, TraceEvent};
use lake_tests::transport::{Capped, EPOCH, Node, REGION, SLOT_BYTES, drive, now_ns, object, outgoing};

fn config() -> TcpConfig {
    TcpConfig { streams_per_peer: 4, slice_bytes: 1 << 20, transfer_timeout_ns: 2_000_000_000, ..TcpConfig::default() }
}

fn connected(sender: &mut TcpTransport, receiver: &mut TcpTransport, node: &mut Node, peer: PeerId, start: Instant) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut none = Node::new(0);
    while sender.connected(peer) < 4 {
        assert!(Instant::now() < deadline, "only {} connections up", sender.connected(peer));
        sender.poll(&mut none, now_ns(start), &mut Vec::new());
        receiver.poll(node, now_ns(start), &mut Vec::new());
    }
}

fn pair() -> (TcpTransport, TcpTransport, PeerId, SocketAddr) {
    let receiver = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = receiver.local_addr().unwrap();
    let mut sender = TcpTransport::new(config(), None).unwrap();
    let peer = sender.add_peer(address).unwrap();
    (sender, receiver, peer, address)
}

#[test]
fn blocks_of_every_size_land_checked_in_their_slots() {
    let start = Instant::now();
    let (mut sender, mut receiver, peer, _) = pair();
    let mut node = Node::new(64);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    let sizes = [1usize, 4096, 65_536, 1 << 20, (1 << 20) + 1, 3 << 20, 333_333];
    let objects: Vec<Vec<u8>> = (0..48).map(|i| object(i, sizes[i as usize % sizes.len()], i)).collect();
    for (i, bytes) in objects.iter().enumerate() {
        let target = node.reserve(i as u32, 100 + i as u32);
        let block = outgoing(i as u64, peer, bytes, target, Priority::WriteBack);
        // SAFETY: `objects` outlives every completion (driven below).
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    let done = drive(&mut sender, &mut receiver, &mut node, start, objects.len());
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(node.published.len(), objects.len());
    for (target, meta) in &node.published {
        let sent = &objects[target.slot as usize];
        let landed = &node.memory[target.slot as usize * SLOT_BYTES..][..sent.len()];
        let (header, payload) = decode_object(landed).unwrap();
        // The header now names the slot it sits in; the payload is as sent.
        assert_eq!(
            (meta.slot, meta.generation, meta.region.0, meta.region_epoch),
            (target.slot, target.generation, REGION, EPOCH)
        );
        assert_eq!(header.meta(), meta);
        assert_eq!(payload, decode_object(sent).unwrap().1, "slot {}", target.slot);
    }
    // The large ones went in slices over more than one connection.
    assert!(receiver.stats.read_calls > 0 && sender.stats.write_calls > 0);
    assert_eq!(sender.stats.sent, objects.len() as u64);
    assert_eq!(receiver.stats.landed, objects.len() as u64);
}

#[test]
fn unreserved_slots_are_refused_lies_are_corrupt_and_the_connection_goes_on() {
    let start = Instant::now();
    let (mut sender, mut receiver, peer, _) = pair();
    let mut node = Node::new(8);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    let good = object(1, 200_000, 0);
    let mut lying = object(2, 2 << 20, 1);
    // A payload byte in the second segment changed after its CRC was set.
    let at = lying.len() - 100_000;
    lying[at] ^= 0x20;
    let unreserved = BlockAddr { region: REGION, epoch: EPOCH, slot: 3, generation: 1 };
    let stale = {
        let target = node.reserve(4, 7);
        BlockAddr { generation: 6, ..target }
    };
    let lying_target = node.reserve(1, 1);
    let good_target = node.reserve(0, 1);
    let writes = [(10, &good, unreserved), (11, &good, stale), (12, &lying, lying_target), (13, &good, good_target)];
    for (transfer, bytes, target) in writes {
        let block = outgoing(transfer, peer, bytes, target, Priority::WriteBack);
        // SAFETY: the objects outlive the completions.
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    let mut done = drive(&mut sender, &mut receiver, &mut node, start, 4);
    done.sort_by_key(|c| c.transfer);
    let results: Vec<_> = done.iter().map(|c| c.result.clone()).collect();
    assert_eq!(
        results,
        [Err(TransferError::Refused), Err(TransferError::Refused), Err(TransferError::Corrupt), Ok(())],
        "{done:?}"
    );
    assert_eq!(node.published.len(), 1, "only the sound block is published");
    assert_eq!(node.published[0].0, good_target);
    // A bad request is refused before anything is sent.
    let block = outgoing(14, PeerId(9), &good, good_target, Priority::WriteBack);
    // SAFETY: as above.
    assert_eq!(unsafe { sender.write(&block, now_ns(start)) }, Err(TransferError::Invalid("peer")));
}

#[test]
fn a_dead_peer_fails_what_was_in_flight_and_a_returning_one_is_reconnected() {
    let start = Instant::now();
    let (mut sender, mut receiver, peer, address) = pair();
    let mut node = Node::new(16);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    let big = object(5, 3 << 20, 0);
    for i in 0..8u32 {
        let target = node.reserve(i, 1);
        let block = outgoing(u64::from(i), peer, &big, target, Priority::WriteBack);
        // SAFETY: `big` outlives the completions.
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    // The sender puts the blocks on the wire; the receiver dies before it
    // reads them (its sockets close under unread bytes).
    for _ in 0..3 {
        sender.poll(&mut Node::new(0), now_ns(start), &mut Vec::new());
    }
    drop(receiver);
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sender.in_flight() > 0 {
        assert!(Instant::now() < deadline, "{} transfers still in flight", sender.in_flight());
        sender.poll(&mut Node::new(0), now_ns(start), &mut done);
    }
    // Each failed, said why, within its deadline; none claims to have
    // landed.
    assert_eq!(done.len(), 8, "{done:?}");
    assert_eq!(sender.stats.sent, 0);
    assert!(done.iter().all(|c| matches!(&c.result, Err(TransferError::PeerLost(_)))), "{done:?}");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    // Back on the same address: the sender reconnects on its own and the
    // next block lands.
    let mut receiver = TcpTransport::new(config(), Some(address)).unwrap();
    let mut node = Node::new(4);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    let target = node.reserve(2, 3);
    let block = outgoing(99, peer, &big, target, Priority::WriteBack);
    // SAFETY: as above.
    unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    let done = drive(&mut sender, &mut receiver, &mut node, start, 1);
    assert_eq!(done.iter().map(|c| (c.transfer, c.result.clone())).collect::<Vec<_>>(), [(99, Ok(()))]);
}

#[test]
fn garbage_closes_its_connection_and_nothing_else() {
    let start = Instant::now();
    let (mut sender, mut receiver, peer, address) = pair();
    let mut node = Node::new(4);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    let mut rogue = std::net::TcpStream::connect(address).unwrap();
    rogue.write_all(&[0x5a; 64]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while receiver.stats.bad_frames == 0 {
        assert!(Instant::now() < deadline, "the garbage was never read");
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
    }
    let good = object(8, 100_000, 0);
    let target = node.reserve(0, 1);
    let block = outgoing(1, peer, &good, target, Priority::WriteBack);
    // SAFETY: `good` outlives the completion.
    unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    let done = drive(&mut sender, &mut receiver, &mut node, start, 1);
    assert_eq!(done.iter().map(|c| (c.transfer, c.result.clone())).collect::<Vec<_>>(), [(1, Ok(()))]);
}

/// Connections that never send a byte — a neighbour holding the port —
/// are held up to the transport's cap (one past it closed as it comes) and
/// closed once silent past `silent_ns`; a real peer then connects and its
/// block lands.
#[test]
fn silent_connections_are_capped_and_let_go_and_a_peer_still_lands_its_blocks() {
    let start = Instant::now();
    let capped = TcpConfig { inbound_max: 8, silent_ns: 300_000_000, ..config() };
    let mut receiver = TcpTransport::new(capped, Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = receiver.local_addr().unwrap();
    let mut node = Node::new(4);
    let mut silent: Vec<std::net::TcpStream> =
        (0..20).map(|_| std::net::TcpStream::connect(address).unwrap()).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while receiver.stats.inbound_over_cap < 12 {
        assert!(Instant::now() < deadline, "{:?}", receiver.stats);
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
    }
    assert_eq!(receiver.stats.inbound_over_cap, 12, "8 held, the rest closed as they came");
    while receiver.stats.inbound_silent < 8 {
        assert!(Instant::now() < deadline, "the silent ones were kept: {:?}", receiver.stats);
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every one of the 20 sees its connection end.
    for stream in &mut silent {
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(std::io::Read::read(stream, &mut [0; 8]).unwrap_or(0), 0, "still open");
    }
    let mut sender = TcpTransport::new(config(), None).unwrap();
    let peer = sender.add_peer(address).unwrap();
    let good = object(9, 100_000, 0);
    let target = node.reserve(0, 1);
    let block = outgoing(1, peer, &good, target, Priority::WriteBack);
    // SAFETY: `good` outlives the completion.
    unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    let done = drive(&mut sender, &mut receiver, &mut node, start, 1);
    assert_eq!(done.iter().map(|c| (c.transfer, c.result.clone())).collect::<Vec<_>>(), [(1, Ok(()))]);
    assert_eq!(receiver.stats.inbound_silent, 8, "the peer's connections are not silent ones");
}

#[test]
fn a_sender_that_dies_mid_block_leaves_nothing_published_and_the_slot_given_back() {
    use lake_dp::transport::frame::FrameHeader;
    let start = Instant::now();
    let mut receiver = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let mut node = Node::new(2);
    let target = node.reserve(1, 4);
    let block = object(3, 1 << 20, 0);
    let mut rogue = std::net::TcpStream::connect(receiver.local_addr().unwrap()).unwrap();
    let header = FrameHeader::data((7, 0), target, block.len() as u64, 0, block.len() as u32).encode();
    rogue.write_all(&header).unwrap();
    rogue.write_all(&block[..block.len() / 2]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while receiver.stats.read_calls < 2 || node.reserved.get(&target) != Some(&false) {
        assert!(Instant::now() < deadline, "the half block never started landing");
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
    }
    drop(rogue);
    // Past the transfer deadline the slot is given back, unpublished.
    while node.abandoned == 0 {
        assert!(Instant::now() < deadline, "the half block was never given back");
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
    }
    assert!(node.published.is_empty());
    assert!(!node.reserved.contains_key(&target));
    assert_eq!(receiver.stats.landed, 0);
}

#[test]
fn urgent_blocks_overtake_queued_write_back() {
    let start = Instant::now();
    let (mut sender, mut receiver, peer, _) = pair();
    let mut node = Node::new(48);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    // 40 blocks of write-back queued first, then 4 critical loads.
    let objects: Vec<Vec<u8>> = (0..44).map(|i| object(i, 1 << 20, i)).collect();
    for (i, bytes) in objects.iter().enumerate() {
        let priority = if i < 40 { Priority::WriteBack } else { Priority::CriticalLoad };
        let target = node.reserve(i as u32, 1);
        let block = outgoing(i as u64, peer, bytes, target, priority);
        // SAFETY: `objects` outlives the completions.
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    let done = drive(&mut sender, &mut receiver, &mut node, start, objects.len());
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    // Only what the connections already held (two slices each) goes
    // before them.
    let order: Vec<u64> = done.iter().map(|c| c.transfer).collect();
    let last_critical = order.iter().rposition(|&t| t >= 40).unwrap();
    assert!(last_critical < 4 * 2 + 4 + 4, "critical loads finished at position {last_critical}: {order:?}");
}

#[test]
fn blocks_sent_to_any_slot_land_where_the_receiver_reserves_them() {
    use lake_dp::transport::ANY_SLOT;
    let start = Instant::now();
    let (mut sender, mut receiver, peer, _) = pair();
    let mut node = Node::new(6);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    let objects: Vec<Vec<u8>> = (0..8).map(|i| object(i, 300_000 + i as usize * 1000, 40 + i)).collect();
    for (i, bytes) in objects.iter().enumerate() {
        let any = BlockAddr { region: REGION, epoch: EPOCH, slot: ANY_SLOT, generation: 0 };
        let block = outgoing(i as u64, peer, bytes, any, Priority::PrefillToDecode);
        // SAFETY: `objects` outlives the completions.
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    let mut done = drive(&mut sender, &mut receiver, &mut node, start, objects.len());
    done.sort_by_key(|c| c.transfer);
    // Six slots: six land, each where the receiver put it; two find none.
    let landed: Vec<_> = done.iter().filter(|c| c.result.is_ok()).collect();
    assert_eq!(landed.len(), 6, "{done:?}");
    assert!(done.iter().filter(|c| c.result.is_err()).all(|c| c.result == Err(TransferError::Busy)), "{done:?}");
    for completion in &landed {
        let target = completion.target;
        assert!(target.slot < 6 && target.generation == 1, "{target:?}");
        let sent = &objects[completion.transfer as usize];
        let (header, payload) = decode_object(node.landed_bytes(&target, sent.len())).unwrap();
        assert_eq!(payload, decode_object(sent).unwrap().1);
        assert_eq!(header.meta().slot, target.slot, "the header names the slot it landed in");
    }
    let mut slots: Vec<u32> = landed.iter().map(|c| c.target.slot).collect();
    slots.dedup();
    assert_eq!(slots.len(), 6, "each in a slot of its own");
    // A region the receiver does not have is refused.
    let elsewhere = BlockAddr { region: REGION + 1, epoch: EPOCH, slot: ANY_SLOT, generation: 0 };
    let block = outgoing(50, peer, &objects[0], elsewhere, Priority::WriteBack);
    // SAFETY: as above.
    unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    let done = drive(&mut sender, &mut receiver, &mut node, start, 1);
    assert_eq!(done[0].result, Err(TransferError::Refused));
}

#[test]
fn a_transfer_not_yet_out_is_cancelled_and_one_on_the_wire_goes_on() {
    let start = Instant::now();
    let (mut sender, mut receiver, peer, _) = pair();
    let mut node = Node::new(24);
    connected(&mut sender, &mut receiver, &mut node, peer, start);
    // 24 blocks of 3 MiB: the first slices go out at once, the rest wait
    // for the connections' kernel queues (the receiver is not polled
    // meanwhile, so those fill).
    let objects: Vec<Vec<u8>> = (0..24).map(|i| object(i, 3 << 20, i)).collect();
    for (i, bytes) in objects.iter().enumerate() {
        let target = node.reserve(i as u32, 1);
        // SAFETY: `objects` outlives every completion driven below.
        unsafe { sender.write(&outgoing(i as u64, peer, bytes, target, Priority::WriteBack), now_ns(start)) }.unwrap();
    }
    let mut none = Node::new(0);
    let mut done = Vec::new();
    for _ in 0..50 {
        sender.poll(&mut none, now_ns(start), &mut done);
    }
    assert!(!sender.cancel(0), "the first block's bytes are on the wire: it goes on");
    assert!(sender.cancel(23), "the last block has not started out");
    assert!(!sender.cancel(23), "cancelled once");
    assert!(!sender.cancel(99), "not in flight");
    let done = drive(&mut sender, &mut receiver, &mut node, start, 24);
    let cancelled: Vec<u64> =
        done.iter().filter(|c| c.result == Err(TransferError::Cancelled)).map(|c| c.transfer).collect();
    assert_eq!(cancelled, [23]);
    assert!(done.iter().filter(|c| c.transfer != 23).all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(node.published.len(), 23, "the cancelled block never landed");
    assert_eq!(sender.in_flight(), 0);
}

/// Polls both ends until every connection to `peer` agreed on features
/// (or 10 s pass: then what they agreed is what it is).
fn features_agreed(
    sender: &mut TcpTransport,
    receiver: &mut TcpTransport,
    node: &mut Node,
    peer: PeerId,
    start: Instant,
) -> u64 {
    // A declined offer never ends the wait: kept well short of the
    // transport's own timers (10 s of silence closes a connection), which a
    // loaded machine would otherwise race.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut none = Node::new(0);
    while sender.peer_features(peer) == 0 && Instant::now() < deadline {
        sender.poll(&mut none, now_ns(start), &mut Vec::new());
        receiver.poll(node, now_ns(start), &mut Vec::new());
    }
    // A declined offer leaves 0: a few more rounds settle every connection.
    for _ in 0..20 {
        sender.poll(&mut none, now_ns(start), &mut Vec::new());
        receiver.poll(node, now_ns(start), &mut Vec::new());
    }
    sender.peer_features(peer)
}

/// Sends `objects` — the odd ones under trace ids `0x7ace_0000 + i`,
/// half to named slots, half to slots the receiver picks — and returns
/// the completions and what both ends reported of the traced ones.
fn traced_run(
    sender: &mut TcpTransport,
    receiver: &mut TcpTransport,
    node: &mut Node,
    peer: PeerId,
    objects: &[Vec<u8>],
    start: Instant,
) -> (Vec<lake_dp::transport::Completion>, Vec<TraceEvent>, Vec<TraceEvent>) {
    for (i, bytes) in objects.iter().enumerate() {
        let target = if i % 4 < 2 {
            node.reserve(i as u32, 7)
        } else {
            BlockAddr { region: REGION, epoch: EPOCH, slot: lake_dp::transport::ANY_SLOT, generation: 0 }
        };
        let trace = if i % 2 == 1 { 0x7ace_0000 + i as u64 } else { 0 };
        let block = Outgoing { trace, ..outgoing(i as u64, peer, bytes, target, Priority::PrefillToDecode) };
        // SAFETY: `objects` outlives every completion (driven below).
        unsafe { sender.write(&block, now_ns(start)) }.unwrap();
    }
    let mut done = drive(sender, receiver, node, start, objects.len());
    done.sort_by_key(|c| c.transfer);
    let (mut landed, mut answered) = (Vec::new(), Vec::new());
    receiver.take_trace_events(&mut landed);
    sender.take_trace_events(&mut answered);
    (done, landed, answered)
}

#[test]
fn a_traced_block_lands_under_its_trace_id_and_the_peers_time_comes_back() {
    // Plain and keyed links alike: the trace frames are frames like any.
    for keyed in [false, true] {
        let start = Instant::now();
        let (mut sender, mut receiver, peer, _) = if keyed {
            let key = lake_dp::auth::LinkKey::from_bytes([9; 32]);
            let mut receiver = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
            receiver.authenticate(key.clone(), 2).unwrap();
            let address = receiver.local_addr().unwrap();
            let mut sender = TcpTransport::new(config(), None).unwrap();
            sender.authenticate(key, 1).unwrap();
            let peer = sender.add_peer(address).unwrap();
            (sender, receiver, peer, address)
        } else {
            pair()
        };
        let mut node = Node::new(16);
        connected(&mut sender, &mut receiver, &mut node, peer, start);
        assert_eq!(features_agreed(&mut sender, &mut receiver, &mut node, peer, start), FEATURES_SPOKEN);
        // Blocks of several slices, so their trace ids go on several
        // connections, ahead of whichever slice comes first.
        let objects: Vec<Vec<u8>> = (0..8).map(|i| object(i, (3 << 20) + 1000 * i as usize, i)).collect();
        let (done, landed, answered) = traced_run(&mut sender, &mut receiver, &mut node, peer, &objects, start);
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        // The receiver: one event per traced block, under its id, where it
        // landed, with its time; none for the untraced ones.
        assert_eq!(landed.len(), 4, "keyed {keyed}: {landed:?}");
        for event in &landed {
            let TraceEvent::Landed { trace, target, bytes, status, us, from } = *event else { panic!("{event:?}") };
            let i = (trace - 0x7ace_0000) as usize;
            assert_eq!(i % 2, 1, "{event:?}");
            assert_eq!((target, bytes), (done[i].target, objects[i].len() as u64), "{event:?}");
            assert_eq!(status, Some(lake_dp::transport::frame::AckStatus::Landed));
            assert!(us >= 1 && from.is_some(), "{event:?}");
        }
        // The sender: the peer's time on each traced block came back.
        assert_eq!(answered.len(), 4, "{answered:?}");
        for event in &answered {
            let TraceEvent::Answered { trace, transfer, peer_us } = *event else { panic!("{event:?}") };
            assert_eq!(trace, 0x7ace_0000 + transfer);
            let landed_us = landed.iter().find_map(|e| match *e {
                TraceEvent::Landed { trace: t, us, .. } if t == trace => Some(us),
                _ => None,
            });
            assert_eq!(Some(peer_us), landed_us, "the receiver's own time, as it logged it");
        }
        assert_eq!(node.published.len(), objects.len());
    }
}

#[test]
fn a_peer_that_speaks_no_features_gets_no_trace_frames_and_every_block_lands() {
    // A receiver as built before features (it declines the offer), then a
    // sender as built before them (it makes none): blocks land, nothing is
    // traced, no connection is cut.
    for (sender_features, receiver_features) in [(FEATURE_TRACE, 0), (0, FEATURE_TRACE)] {
        let start = Instant::now();
        let mut receiver = TcpTransport::new(
            TcpConfig { features: receiver_features, ..config() },
            Some("127.0.0.1:0".parse().unwrap()),
        )
        .unwrap();
        let mut sender = TcpTransport::new(TcpConfig { features: sender_features, ..config() }, None).unwrap();
        let peer = sender.add_peer(receiver.local_addr().unwrap()).unwrap();
        let mut node = Node::new(16);
        connected(&mut sender, &mut receiver, &mut node, peer, start);
        assert_eq!(features_agreed(&mut sender, &mut receiver, &mut node, peer, start), 0);
        let objects: Vec<Vec<u8>> = (0..8).map(|i| object(i, 100_000 + 1000 * i as usize, i)).collect();
        let (done, landed, answered) = traced_run(&mut sender, &mut receiver, &mut node, peer, &objects, start);
        assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
        assert!(landed.is_empty(), "{landed:?}");
        // The sender still hears each traced block answered, with no time.
        assert_eq!(answered.len(), 4);
        assert!(answered.iter().all(|e| matches!(e, TraceEvent::Answered { peer_us: 0, .. })), "{answered:?}");
        assert_eq!((sender.stats.bad_frames, receiver.stats.bad_frames, sender.stats.streams_lost), (0, 0, 0));
    }
}

#[test]
fn two_senders_numbering_their_transfers_alike_land_every_block_apart() {
    // Two senders (two engines' pushers, two nodes' copies) both number
    // their transfers from 0 and send blocks of one size to slots the
    // receiver picks: each block lands once, in a slot of its own, byte
    // for byte — the receiver tells them apart though their ids meet.
    use lake_dp::transport::ANY_SLOT;
    let start = Instant::now();
    let mut receiver = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = receiver.local_addr().unwrap();
    let mut senders: Vec<(TcpTransport, PeerId)> = (0..2)
        .map(|_| {
            let mut sender = TcpTransport::new(config(), None).unwrap();
            let peer = sender.add_peer(address).unwrap();
            (sender, peer)
        })
        .collect();
    let mut node = Node::new(24);
    let objects: Vec<Vec<Vec<u8>>> =
        (0..2u32).map(|s| (0..8u32).map(|i| object(100 * s + i, 200_000, 100 * s + i)).collect()).collect();
    for (s, (sender, peer)) in senders.iter_mut().enumerate() {
        for (i, bytes) in objects[s].iter().enumerate() {
            let any = BlockAddr { region: REGION, epoch: EPOCH, slot: ANY_SLOT, generation: 0 };
            // SAFETY: `objects` outlives every completion (driven below).
            unsafe { sender.write(&outgoing(i as u64, *peer, bytes, any, Priority::PrefillToDecode), now_ns(start)) }
                .unwrap();
        }
    }
    let mut done: Vec<Vec<lake_dp::transport::Completion>> = vec![Vec::new(), Vec::new()];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut none = Node::new(0);
    while done.iter().any(|d| d.len() < 8) {
        assert!(Instant::now() < deadline, "{:?} of 8 each in 10 s", done.iter().map(Vec::len).collect::<Vec<_>>());
        for (s, (sender, _)) in senders.iter_mut().enumerate() {
            sender.poll(&mut none, now_ns(start), &mut done[s]);
        }
        receiver.poll(&mut node, now_ns(start), &mut Vec::new());
    }
    let mut slots = Vec::new();
    for (s, completions) in done.iter().enumerate() {
        for c in completions {
            assert_eq!(c.result, Ok(()), "sender {s} transfer {}", c.transfer);
            let sent = &objects[s][c.transfer as usize];
            let (_, payload) = decode_object(node.landed_bytes(&c.target, sent.len())).unwrap();
            assert_eq!(payload, decode_object(sent).unwrap().1, "sender {s} transfer {}", c.transfer);
            slots.push(c.target.slot);
        }
    }
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), 16, "each block in a slot of its own");
    assert_eq!(node.published.len(), 16);
}

/// What a node receives is capped per tenant: a sender of this
/// build names each block's namespace in its reservation, the receiver
/// answers "later" while the block's tenant is over its cap, and the sender
/// asks again after the wait it was told — nothing refused or lost: the
/// capped tenant's blocks arrive at its rate, another tenant's at once. A
/// sender that names no namespace (a build before features: it offers
/// none) is not held.
#[test]
fn a_tenant_capped_on_what_a_node_receives_is_held_at_its_sender() {
    use lake_dp::transport::ANY_SLOT;
    const CAP: u64 = 1 << 20;
    const CAPPED: u64 = 3;
    const OTHER: u64 = 4;
    let objects: Vec<Vec<u8>> = (0..16).map(|i| object(i, 128 << 10, 40 + i)).collect();
    // Per sender's features: each block's time to land (s) by transfer id,
    // and what each end counted.
    let run = |features: u64| {
        let start = Instant::now();
        let receiver = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
        let mut receiver = receiver;
        let mut sender = TcpTransport::new(TcpConfig { features, ..config() }, None).unwrap();
        let peer = sender.add_peer(receiver.local_addr().unwrap()).unwrap();
        let mut landing = Capped::new(Node::new(16), CAPPED, CAP);
        connected(&mut sender, &mut receiver, &mut landing.node, peer, start);
        // Features settle right after the connections come up.
        let settle = Instant::now() + Duration::from_millis(200);
        let mut none = Node::new(0);
        while Instant::now() < settle {
            sender.poll(&mut none, now_ns(start), &mut Vec::new());
            receiver.poll(&mut landing, now_ns(start), &mut Vec::new());
        }
        let began = Instant::now();
        for (i, bytes) in objects.iter().enumerate() {
            let any = BlockAddr { region: REGION, epoch: EPOCH, slot: ANY_SLOT, generation: 0 };
            let namespace = if i % 2 == 0 { CAPPED } else { OTHER };
            let block = Outgoing { namespace, ..outgoing(i as u64, peer, bytes, any, Priority::PrefillToDecode) };
            // SAFETY: `objects` outlives the completions.
            unsafe { sender.write(&block, now_ns(start)) }.unwrap();
        }
        let (mut took, mut done) = (vec![0.0f64; objects.len()], Vec::new());
        let deadline = Instant::now() + Duration::from_secs(20);
        while done.len() < objects.len() {
            assert!(Instant::now() < deadline, "{} of {} completions in 20 s", done.len(), objects.len());
            let before = done.len();
            sender.poll(&mut none, now_ns(start), &mut done);
            for completion in &done[before..] {
                took[completion.transfer as usize] = began.elapsed().as_secs_f64();
            }
            receiver.poll(&mut landing, now_ns(start), &mut Vec::new());
        }
        assert!(done.iter().all(|c| c.result.is_ok()), "every block lands: {done:?}");
        assert_eq!(landing.node.published.len(), objects.len());
        (took, sender.stats.reservations_later, receiver.stats.reservations_held)
    };
    let slowest = |took: &[f64], parity: usize| {
        took.iter().enumerate().filter(|(i, _)| i % 2 == parity).map(|(_, &t)| t).fold(0.0, f64::max)
    };

    let (took, later, held) = run(FEATURES_SPOKEN);
    // Eight blocks of 132 KiB at 1 MiB/s: the bucket's burst (a tenth of a
    // second) and the last block's debt taken off, 0.80 s at the least.
    let floor = (8.0 * 135_168.0 - 104_857.0 - 135_168.0) / 1_048_576.0;
    let (capped, other) = (slowest(&took, 0), slowest(&took, 1));
    println!("capped tenant {capped:.3} s (floor {floor:.3}), other {other:.3} s; {later} asked later, {held} held");
    assert!(capped >= floor * 0.95, "the capped tenant's blocks in {capped:.3} s, under its floor {floor:.3}");
    assert!(other < floor / 2.0, "the other tenant's blocks waited: {other:.3} s");
    assert!(later > 0 && held == later, "{later} reservations asked again, {held} held");

    // A sender that offers no features names no namespace: not held.
    let (took, later, held) = run(0);
    let capped = slowest(&took, 0);
    assert!(capped < floor / 2.0, "a sender naming no namespace was held: {capped:.3} s");
    assert_eq!((later, held), (0, 0));
}
