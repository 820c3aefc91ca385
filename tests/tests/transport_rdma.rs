//! The RDMA transport's protocol over in-process verbs (no RDMA device on
//! this machine or in CI: `lake_dp::transport::rdma::loopback` stands in
//! for the device, a READ a copy made only inside what the peer exported):
//! offered blocks are read into the receiver's slots and checked there;
//! corrupt, stale and unregistered ones are never published; offers are
//! read most urgent first; a silent peer times out and is shut before its
//! transfers end, so nothing reads their sources after; a cut link ends
//! every transfer and gives back every slot; a peer sending garbage is
//! shut; and in front of TCP, a dead RDMA link is absorbed. Over TCP, the
//! endpoints are negotiated on the (authenticated) link, a receiver
//! without RDMA or an offer that is not an endpoint is declined, and a
//! link whose queue pair broke is negotiated again.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use lake_dp::Priority;
use lake_dp::constants::STORED_HEADER_BYTES;
use lake_dp::transport::fallback::Fallback;
use lake_dp::transport::frame::{AckStatus, BlockAddr};
use lake_dp::transport::rdma::loopback::{Fabric, LoopbackVerbs};
use lake_dp::transport::rdma::over_tcp::{OverTcpConfig, RdmaOverTcp};
use lake_dp::transport::rdma::pull::{MESSAGE_BYTES, Message, RdmaConfig, RdmaTransport, Verbs, VerbsEvent};
use lake_dp::transport::tcp::{Negotiation, Rail, TcpConfig, TcpTransport};
use lake_dp::transport::{ANY_SLOT, Completion, PeerId, TransferError, Transport};
use lake_tests::transport::{EPOCH, Node, REGION, drive, now_ns, object, outgoing};

type Rdma = RdmaTransport<LoopbackVerbs>;

/// A sender and a receiver joined by a fabric; the sender exports
/// `objects` to the receiver, the receiver's node memory is registered.
struct Pair {
    fabric: Fabric,
    sender: Rdma,
    receiver: Rdma,
    /// The receiver, as the sender knows it.
    peer: PeerId,
    receiver_node: usize,
    node: Node,
}

fn pair(config: RdmaConfig, slots: usize, objects: &[Vec<u8>]) -> Pair {
    pair_with_depth(config, slots, objects, 64)
}

/// As [`pair`], with the receiver's end `depth` deep (its answers in
/// flight and its READs posted).
fn pair_with_depth(config: RdmaConfig, slots: usize, objects: &[Vec<u8>], depth: usize) -> Pair {
    let fabric = Fabric::new();
    let mut a = fabric.end(64);
    let mut b = fabric.end(depth);
    let (to_b, _) = Fabric::connect(&mut a, &mut b);
    for o in objects {
        // SAFETY: the objects outlive the pair (each test holds them).
        unsafe { a.export(to_b, o.as_ptr(), o.len()) };
    }
    let mut node = Node::new(slots);
    // SAFETY: the node's memory is a heap buffer living as long as it, and
    // the node lives in the pair with the verbs.
    unsafe { b.register(node.memory.as_mut_ptr(), node.memory.len()) };
    let receiver_node = b.node();
    Pair {
        fabric,
        sender: RdmaTransport::new(a, config),
        receiver: RdmaTransport::new(b, config),
        peer: to_b,
        receiver_node,
        node,
    }
}

fn any_slot() -> BlockAddr {
    BlockAddr { region: REGION, epoch: EPOCH, slot: ANY_SLOT, generation: 0 }
}

fn write(sender: &mut Rdma, transfer: u64, peer: PeerId, bytes: &[u8], target: BlockAddr, priority: Priority) {
    let block = outgoing(transfer, peer, bytes, target, priority);
    // SAFETY: every test keeps its objects alive and unchanged past the
    // completions it drives.
    unsafe { sender.write(&block, now()) }.unwrap();
}

thread_local! {
    static START: Instant = Instant::now();
}

fn now() -> u64 {
    now_ns(START.with(|s| *s))
}

fn by_transfer(mut done: Vec<Completion>) -> Vec<Completion> {
    done.sort_by_key(|c| c.transfer);
    done
}

#[test]
fn offered_blocks_land_checked_in_the_receivers_slots() {
    let sizes = [1_000usize, 65_536, 300_000, 1 << 20, 3 << 20, 17, 250_000, 2 << 20];
    let objects: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| object(i as u32, n, i as u32)).collect();
    let mut p = pair(RdmaConfig::default(), 16, &objects);
    for (i, o) in objects.iter().enumerate() {
        // Half to named slots, half to slots the receiver picks.
        let target = if i % 2 == 0 { p.node.reserve(i as u32, 3 + i as u32) } else { any_slot() };
        write(&mut p.sender, i as u64, p.peer, o, target, Priority::PrefillToDecode);
    }
    assert_eq!(p.sender.in_flight(), objects.len());
    let start = START.with(|s| *s);
    let done = by_transfer(drive(&mut p.sender, &mut p.receiver, &mut p.node, start, objects.len()));
    for (c, o) in done.iter().zip(&objects) {
        assert_eq!(c.result, Ok(()), "transfer {}", c.transfer);
        assert_ne!(c.target.slot, ANY_SLOT, "the completion names the slot it landed in");
        let landed = p.node.landed_bytes(&c.target, o.len());
        assert!(landed[STORED_HEADER_BYTES..] == o[STORED_HEADER_BYTES..], "transfer {}'s bytes", c.transfer);
    }
    assert_eq!(p.node.published.len(), objects.len());
    // Each landed header names the slot it sits in.
    for (target, meta) in &p.node.published {
        assert_eq!((meta.slot, meta.generation, meta.region_epoch), (target.slot, target.generation, target.epoch));
    }
    let bytes: usize = objects.iter().map(Vec::len).sum();
    assert_eq!((p.receiver.stats.read, p.receiver.stats.read_bytes), (objects.len() as u64, bytes as u64));
    assert_eq!((p.sender.stats.offered, p.sender.in_flight()), (objects.len() as u64, 0));
    // A key lent per block, each taken back when its answer came.
    assert_eq!((p.sender.stats.keys_lent, p.sender.stats.keys_taken_back), (8, 8));
    assert_eq!(p.sender.verbs().keys_out(), 0, "no key outlives its transfer");
}

/// The next message `end` receives, decoded (fails after 5 s).
fn next_message(end: &mut LoopbackVerbs) -> Message {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        assert!(Instant::now() < deadline, "no message in 5 s");
        let mut events = Vec::new();
        end.poll(&mut events);
        for e in events {
            if let VerbsEvent::Received { message, .. } = e {
                return Message::decode(&message).unwrap();
            }
        }
    }
}

/// A READ by `end` through `key`, polled to its end: `Ok` or the
/// device's error.
fn read_through(
    end: &mut LoopbackVerbs,
    peer: PeerId,
    (source, key): (u64, u32),
    into: &mut [u8],
) -> Result<(), String> {
    // SAFETY: `into` is registered by the caller and outlives the poll
    // below, which ends the READ.
    unsafe { end.read_raw(peer, 77, (source, key), into.len() as u32, into.as_mut_ptr()) }.unwrap();
    let mut events = Vec::new();
    end.poll(&mut events);
    match events.as_slice() {
        [VerbsEvent::ReadDone { wr_id: 77, result }] => result.clone(),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_key_reads_its_block_alone_and_only_while_its_transfer_lasts() {
    // Two blocks side by side in one exported arena: a peer lent the key
    // for one can read neither the other nor the one after its answer —
    // the peer-wide, arena-wide key this replaced would have read both.
    let objects: Vec<Vec<u8>> = (0..2).map(|i| object(i, 50_000, i)).collect();
    let (arena, at) = sender_arena(&objects);
    let fabric = Fabric::new();
    let mut a = fabric.end(64);
    let mut evil = fabric.end(64);
    let (to_evil, to_a) = Fabric::connect(&mut a, &mut evil);
    // SAFETY: the arena outlives both ends (dropped after them, below).
    unsafe { a.export(to_evil, arena.as_ptr(), arena.len()) };
    let mut landing = vec![0u8; 2 * SENDER_SLOT];
    // SAFETY: as above, for the receiving end's memory.
    unsafe { evil.register(landing.as_mut_ptr(), landing.len()) };
    let mut sender = RdmaTransport::new(a, RdmaConfig::default());
    let first = &arena[at[0]..at[0] + objects[0].len()];
    let target = BlockAddr { region: REGION, epoch: EPOCH, slot: 0, generation: 1 };
    write(&mut sender, 1, to_evil, first, target, Priority::PrefillToDecode);
    let Message::Offer { source, key, len, .. } = next_message(&mut evil) else { panic!("not an offer") };
    assert_eq!((source, u64::from(len)), (first.as_ptr() as u64, first.len() as u64));
    assert_eq!(sender.verbs().keys_out(), 1);

    // The block offered: read byte for byte through its key.
    let (head, tail) = landing.split_at_mut(SENDER_SLOT);
    assert_eq!(read_through(&mut evil, to_a, (source, key), &mut head[..first.len()]), Ok(()));
    assert!(head[..first.len()] == *first);
    // The block beside it, with the same key: refused by the key's bounds.
    let second = arena[at[1]..].as_ptr() as u64;
    let refused = read_through(&mut evil, to_a, (second, key), &mut tail[..objects[1].len()]);
    assert!(refused.as_ref().is_err_and(|why| why.contains("outside the bytes the key")), "{refused:?}");
    // One byte past the block, and a guessed key: refused.
    let refused = read_through(&mut evil, to_a, (source, key), &mut tail[..first.len() + 1]);
    assert!(refused.is_err(), "a READ past the block's end");
    let refused = read_through(&mut evil, to_a, (source, key.wrapping_add(1)), &mut tail[..16]);
    assert!(refused.as_ref().is_err_and(|why| why.contains("no such key")), "{refused:?}");
    assert!(tail.iter().all(|&b| b == 0), "no byte of the other block left the sender");

    // Answered: the transfer completes and the key is taken back with it.
    let answer = Message::Answer { transfer: 1, status: AckStatus::Landed, target, took_us: 0 };
    evil.send(to_a, &answer.encode()).unwrap();
    let mut done = Vec::new();
    let mut none = Node::new(0);
    while done.is_empty() {
        sender.poll(&mut none, now(), &mut done);
    }
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(sender.verbs().keys_out(), 0);
    let refused = read_through(&mut evil, to_a, (source, key), &mut head[..first.len()]);
    assert!(refused.as_ref().is_err_and(|why| why.contains("taken back")), "{refused:?}");
    drop((sender, evil));
}

#[test]
fn full_queues_hold_answers_and_reads_back_without_losing_any() {
    // The receiver may have 2 answers in flight and 2 READs posted: the
    // rest of 12 blocks wait — answers owed, READs placed and kept — and
    // every one lands once.
    let objects: Vec<Vec<u8>> = (0..12).map(|i| object(i, 30_000 + 1_000 * i as usize, i)).collect();
    let mut p = pair_with_depth(RdmaConfig::default(), 16, &objects, 2);
    for (i, o) in objects.iter().enumerate() {
        let target = if i % 3 == 0 { any_slot() } else { p.node.reserve(i as u32, 1) };
        write(&mut p.sender, i as u64, p.peer, o, target, Priority::WriteBack);
    }
    // The receiver runs four times before the sender takes any answer:
    // from the third on, its answers find the sender's queue full.
    for _ in 0..4 {
        p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    }
    let start = START.with(|s| *s);
    let done = by_transfer(drive(&mut p.sender, &mut p.receiver, &mut p.node, start, objects.len()));
    for (c, o) in done.iter().zip(&objects) {
        assert_eq!(c.result, Ok(()), "transfer {}", c.transfer);
        assert!(p.node.landed_bytes(&c.target, o.len())[STORED_HEADER_BYTES..] == o[STORED_HEADER_BYTES..]);
    }
    assert_eq!(p.node.published.len(), objects.len());
    assert_eq!(p.node.abandoned, 0, "a READ that found its queue full kept its slot");
    assert_eq!(p.receiver.stats.landed, objects.len() as u64);
}

#[test]
fn corrupt_and_stale_blocks_are_never_published() {
    let good = object(1, 100_000, 1);
    let mut corrupt = object(2, 100_000, 2);
    corrupt[STORED_HEADER_BYTES + 5_000] ^= 0x40;
    let stale = object(3, 100_000, 3);
    let objects = [good, corrupt, stale];
    let mut p = pair(RdmaConfig::default(), 8, &objects);
    let targets = [p.node.reserve(0, 1), p.node.reserve(1, 1)];
    write(&mut p.sender, 0, p.peer, &objects[0], targets[0], Priority::WriteBack);
    write(&mut p.sender, 1, p.peer, &objects[1], targets[1], Priority::WriteBack);
    // Slot 2 was never reserved for this block (or its generation moved on).
    let never = BlockAddr { region: REGION, epoch: EPOCH, slot: 2, generation: 9 };
    write(&mut p.sender, 2, p.peer, &objects[2], never, Priority::WriteBack);
    let start = START.with(|s| *s);
    let done = by_transfer(drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 3));
    let results: Vec<_> = done.iter().map(|c| c.result.clone()).collect();
    assert_eq!(results, [Ok(()), Err(TransferError::Corrupt), Err(TransferError::Refused)]);
    assert_eq!(p.node.published.len(), 1);
    assert_eq!(p.node.published[0].0, targets[0]);
    assert_eq!(p.receiver.stats.refused, 2);
    // The stale one was refused before any READ.
    assert_eq!(p.receiver.stats.read, 2);
}

#[test]
fn memory_not_registered_for_the_peer_is_neither_offered_nor_read() {
    let exported = object(1, 50_000, 1);
    let mut p = pair(RdmaConfig::default(), 4, std::slice::from_ref(&exported));
    // The sender's own block outside its registration: not this transport's
    // to carry (a fallback sends it on TCP).
    let other = object(2, 50_000, 2);
    let target = p.node.reserve(0, 1);
    let block = outgoing(9, p.peer, &other, target, Priority::WriteBack);
    // SAFETY: `other` outlives the call; it is refused before anything is posted.
    let refused = unsafe { p.sender.write(&block, now()) };
    assert!(matches!(refused, Err(TransferError::Unreachable(_))), "{refused:?}");
    assert_eq!(p.sender.in_flight(), 0);

    // A forged offer from a third end naming memory it never exported.
    let secret = vec![0x5au8; 4096];
    let mut forger = p.fabric.end(64);
    let (to_receiver, _) = Fabric::connect(&mut forger, p.receiver.verbs());
    let offer = Message::Offer {
        transfer: 1,
        source: secret.as_ptr() as u64,
        key: 1,
        len: 4096,
        trace: 0,
        namespace: 0,
        target,
        priority: Priority::CriticalLoad,
    };
    forger.send(to_receiver, &offer.encode()).unwrap();
    let mut answer = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while answer.is_none() {
        assert!(Instant::now() < deadline, "no answer to the forged offer");
        p.receiver.poll(&mut p.node, now(), &mut Vec::new());
        let mut events = Vec::new();
        forger.poll(&mut events);
        for e in events {
            if let VerbsEvent::Received { message, .. } = e {
                answer = Some(Message::decode(&message).unwrap());
            }
        }
    }
    assert_eq!(answer, Some(Message::Answer { transfer: 1, status: AckStatus::Refused, target, took_us: 0 }));
    assert_eq!(p.receiver.stats.read, 0, "nothing was read");
    assert!(p.node.slot(0).iter().all(|&b| b == 0), "no byte of the forger's memory landed");
    assert!(p.node.published.is_empty());
}

#[test]
fn offers_are_read_most_urgent_first() {
    let objects: Vec<Vec<u8>> = (0..6).map(|i| object(i, 20_000, i)).collect();
    let config = RdmaConfig { reads_max: 1, ..RdmaConfig::default() };
    let mut p = pair(config, 8, &objects);
    // Three replication copies offered first, then three critical loads.
    for (i, o) in objects.iter().enumerate() {
        let target = p.node.reserve(i as u32, 1);
        let class = if i < 3 { Priority::Replication } else { Priority::CriticalLoad };
        write(&mut p.sender, i as u64, p.peer, o, target, class);
    }
    let start = START.with(|s| *s);
    let done = drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 6);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    let order: Vec<u32> = p.node.published.iter().map(|(t, _)| t.slot).collect();
    assert_eq!(order, [3, 4, 5, 0, 1, 2], "critical loads were read first");
}

/// The oldest transfer ended `Timeout`; the others, not yet at their own
/// deadlines when the peer was shut, ended lost for the same reason.
fn assert_silent(done: Vec<Completion>) {
    let done = by_transfer(done);
    assert_eq!(done[0].result, Err(TransferError::Timeout), "{done:?}");
    for c in &done[1..] {
        let silent = match &c.result {
            Err(TransferError::Timeout) => true,
            Err(TransferError::PeerLost(why)) => why.contains("deadline"),
            _ => false,
        };
        assert!(silent, "{c:?}");
    }
}

#[test]
fn a_silent_peer_times_out_and_is_shut_before_anything_reads_the_sources() {
    let objects: Vec<Vec<u8>> = (0..3).map(|i| object(i, 40_000, i)).collect();
    let config = RdmaConfig { transfer_timeout_ns: 200_000_000, ..RdmaConfig::default() };
    let mut p = pair(config, 4, &objects);
    for (i, o) in objects.iter().enumerate() {
        let target = p.node.reserve(i as u32, 1);
        write(&mut p.sender, i as u64, p.peer, o, target, Priority::PrefillToDecode);
    }
    // The receiver does not run until the sender gave up.
    let mut done = Vec::new();
    let mut none = Node::new(0);
    let deadline = Instant::now() + Duration::from_secs(5);
    while done.len() < 3 {
        assert!(Instant::now() < deadline, "{done:?}");
        p.sender.poll(&mut none, now(), &mut done);
    }
    assert_silent(done);
    assert!(p.sender.peer_down(p.peer).is_some_and(|why| why.contains("deadline")));
    assert_eq!(p.sender.verbs().keys_out(), 0, "the keys of the transfers that timed out are taken back");
    let again = outgoing(7, p.peer, &objects[0], p.node.reserve(3, 1), Priority::PrefillToDecode);
    // SAFETY: refused before anything is posted.
    assert!(matches!(unsafe { p.sender.write(&again, now()) }, Err(TransferError::PeerLost(_))));
    // Now the receiver runs: its link is shut, so the offers it holds are
    // not read — the sources are the caller's again.
    for _ in 0..10 {
        p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    }
    assert!(p.node.published.is_empty());
    assert_eq!(p.receiver.stats.read, 0);
    assert!(p.receiver.peer_down(PeerId(0)).is_some());
}

#[test]
fn a_muted_receiver_reads_but_its_answers_are_lost_and_the_sender_times_out() {
    let objects: Vec<Vec<u8>> = (0..2).map(|i| object(i, 40_000, i)).collect();
    let config = RdmaConfig { transfer_timeout_ns: 300_000_000, ..RdmaConfig::default() };
    let mut p = pair(config, 4, &objects);
    p.fabric.mute(p.receiver_node);
    for (i, o) in objects.iter().enumerate() {
        let target = p.node.reserve(i as u32, 1);
        write(&mut p.sender, i as u64, p.peer, o, target, Priority::WriteBack);
    }
    let start = START.with(|s| *s);
    let done = drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 2);
    assert_silent(done);
    // Landed though unanswered: a named slot sent again is refused as filled.
    assert_eq!(p.node.published.len(), 2);
}

#[test]
fn a_cut_link_ends_every_transfer_and_gives_back_every_slot() {
    let objects: Vec<Vec<u8>> = (0..4).map(|i| object(i, 200_000, i)).collect();
    let mut p = pair(RdmaConfig::default(), 8, &objects);
    for (i, o) in objects.iter().enumerate() {
        let target = if i < 2 { p.node.reserve(i as u32, 1) } else { any_slot() };
        write(&mut p.sender, i as u64, p.peer, o, target, Priority::WriteBack);
    }
    // The receiver takes the offers and posts its READs; then the link dies.
    p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    assert_eq!(p.node.reserved.len(), 4, "two named, two reserved, all placed");
    p.fabric.cut(p.receiver_node, "the NIC went away");
    let mut done = Vec::new();
    let mut none = Node::new(0);
    p.sender.poll(&mut none, now(), &mut done);
    let done = by_transfer(done);
    assert_eq!(done.len(), 4);
    for c in &done {
        assert!(matches!(&c.result, Err(TransferError::PeerLost(why)) if why.contains("NIC")), "{c:?}");
    }
    p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    assert!(p.node.published.is_empty());
    assert_eq!(p.node.abandoned, 4);
    assert!(p.node.reserved.is_empty(), "every slot is the node's again");
}

#[test]
fn a_peer_sending_garbage_is_shut_and_the_others_go_on() {
    let objects = [object(1, 30_000, 1)];
    let mut p = pair(RdmaConfig::default(), 4, &objects);
    let mut rogue = p.fabric.end(64);
    let (to_receiver, rogue_at_receiver) = Fabric::connect(&mut rogue, p.receiver.verbs());
    rogue.send(to_receiver, &[0xee; MESSAGE_BYTES]).unwrap();
    p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    assert_eq!(p.receiver.stats.bad_messages, 1);
    assert!(p.receiver.peer_down(rogue_at_receiver).is_some_and(|why| why.contains("magic")));
    let mut events = Vec::new();
    rogue.poll(&mut events);
    assert!(events.iter().any(|e| matches!(e, VerbsEvent::Broken { .. })), "the rogue is cut off: {events:?}");
    // The honest sender is unaffected.
    let target = p.node.reserve(0, 1);
    write(&mut p.sender, 0, p.peer, &objects[0], target, Priority::WriteBack);
    let start = START.with(|s| *s);
    let done = drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 1);
    assert_eq!(done[0].result, Ok(()));
}

fn tcp_config() -> TcpConfig {
    TcpConfig { streams_per_peer: 2, transfer_timeout_ns: 5_000_000_000, ..TcpConfig::default() }
}

#[test]
fn in_front_of_tcp_a_dead_rdma_link_is_absorbed() {
    let objects: Vec<Vec<u8>> = (0..20).map(|i| object(i, 30_000 + 9_000 * i as usize, i)).collect();
    let p = pair(RdmaConfig::default(), 32, &objects);
    let mut tcp_receiver = TcpTransport::new(tcp_config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address: SocketAddr = tcp_receiver.local_addr().unwrap();
    let mut secondary = TcpTransport::new(tcp_config(), None).unwrap();
    let tcp_peer = secondary.add_peer(address).unwrap();
    let Pair { fabric, sender, mut receiver, peer, receiver_node, mut node } = p;
    let mut sender = Fallback::new(sender, secondary, 10_000_000_000);
    let peer = sender.add_peer(Some(peer), tcp_peer);
    let targets: Vec<BlockAddr> = (0..20).map(|i| node.reserve(i, 1)).collect();
    let drive_all = |sender: &mut Fallback<Rdma, TcpTransport>,
                     receiver: &mut Rdma,
                     tcp_receiver: &mut TcpTransport,
                     node: &mut Node,
                     want: usize| {
        let mut done = Vec::new();
        let mut none = Node::new(0);
        let deadline = Instant::now() + Duration::from_secs(20);
        while done.len() < want {
            assert!(Instant::now() < deadline, "{} of {want}", done.len());
            sender.poll(&mut none, now(), &mut done);
            receiver.poll(node, now(), &mut Vec::new());
            tcp_receiver.poll(node, now(), &mut Vec::new());
        }
        by_transfer(done)
    };
    // Ten on a healthy RDMA link.
    for i in 0..10 {
        let block = outgoing(i as u64, peer, &objects[i], targets[i], Priority::PrefillToDecode);
        // SAFETY: the objects outlive every completion driven below.
        unsafe { sender.write(&block, now()) }.unwrap();
    }
    let done = drive_all(&mut sender, &mut receiver, &mut tcp_receiver, &mut node, 10);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!((sender.stats.primary, sender.stats.moved), (10, 0));
    // Ten more, then the RDMA link dies before the receiver reads them:
    // each is carried by TCP under its own transfer id, once.
    for i in 10..20 {
        let block = outgoing(i as u64, peer, &objects[i], targets[i], Priority::PrefillToDecode);
        // SAFETY: as above.
        unsafe { sender.write(&block, now()) }.unwrap();
    }
    fabric.cut(receiver_node, "port down");
    let done = drive_all(&mut sender, &mut receiver, &mut tcp_receiver, &mut node, 10);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(done.iter().map(|c| c.transfer).collect::<Vec<_>>(), (10..20).collect::<Vec<u64>>());
    assert_eq!((sender.stats.primary, sender.stats.moved), (20, 10));
    assert_eq!(node.published.len(), 20, "each block landed once");
    for (i, o) in objects.iter().enumerate() {
        assert!(node.landed_bytes(&targets[i], o.len())[STORED_HEADER_BYTES..] == o[STORED_HEADER_BYTES..]);
    }
    assert_eq!(sender.in_flight(), 0);
}

/// A sender's arena holding `objects`, one per `SENDER_SLOT` bytes, and
/// where each starts.
const SENDER_SLOT: usize = 1 << 20;

fn sender_arena(objects: &[Vec<u8>]) -> (Vec<u8>, Vec<usize>) {
    let mut arena = vec![0u8; objects.len() * SENDER_SLOT];
    for (i, o) in objects.iter().enumerate() {
        arena[i * SENDER_SLOT..][..o.len()].copy_from_slice(o);
    }
    (arena, (0..objects.len()).map(|i| i * SENDER_SLOT).collect())
}

type OverTcp = RdmaOverTcp<LoopbackVerbs>;

fn over_tcp(config: OverTcpConfig) -> OverTcpConfig {
    OverTcpConfig { retry_ns: 50_000_000, cooldown_ns: 50_000_000, ..config }
}

/// Polls both until `up(sender)` holds; fails after 10 s.
fn drive_until<R: Transport>(sender: &mut OverTcp, receiver: &mut R, node: &mut Node, up: impl Fn(&OverTcp) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut none = Node::new(0);
    while !up(sender) {
        if Instant::now() > deadline {
            let stats = sender.stats;
            panic!("not reached in 10 s: {stats:?} {:?}", sender.take_events());
        }
        sender.poll(&mut none, now(), &mut Vec::new());
        receiver.poll(node, now(), &mut Vec::new());
    }
}

/// Writes `objects[range]` (in `arena` at `at`) to `peer`'s named slots.
fn write_from_arena(
    sender: &mut OverTcp,
    peer: PeerId,
    arena: &[u8],
    at: &[usize],
    lens: &[usize],
    range: std::ops::Range<usize>,
    targets: &[BlockAddr],
) {
    for i in range {
        let block = outgoing(i as u64, peer, &arena[at[i]..at[i] + lens[i]], targets[i], Priority::PrefillToDecode);
        // SAFETY: the arena outlives every completion the test drives.
        unsafe { sender.write(&block, now()) }.unwrap();
    }
}

#[test]
fn rdma_is_negotiated_over_the_authenticated_tcp_link_and_renegotiated_after_it_breaks() {
    let objects: Vec<Vec<u8>> = (0..24).map(|i| object(i, 20_000 + 31_000 * i as usize, i)).collect();
    let lens: Vec<usize> = objects.iter().map(Vec::len).collect();
    let (mut arena, at) = sender_arena(&objects);
    let key = lake_dp::auth::LinkKey::from_bytes([7; 32]);
    let fabric = Fabric::new();
    let mut node = Node::new(32);
    let mut b = fabric.end(64);
    // SAFETY: the node's memory and the sender's arena outlive the ends.
    unsafe {
        b.register_arena(node.memory.as_mut_ptr(), node.memory.len(), lake_tests::transport::SLOT_BYTES as u32, EPOCH)
    };
    let receiver_node = b.node();
    let mut a = fabric.end(64);
    // SAFETY: as above.
    unsafe { a.register_arena(arena.as_mut_ptr(), arena.len(), SENDER_SLOT as u32, 1) };
    let mut tcp_b = TcpTransport::new(tcp_config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    tcp_b.authenticate(key.clone(), 2).unwrap();
    let address = tcp_b.local_addr().unwrap();
    let mut tcp_a = TcpTransport::new(tcp_config(), None).unwrap();
    tcp_a.authenticate(key, 1).unwrap();
    let mut receiver =
        RdmaOverTcp::new(RdmaTransport::new(b, RdmaConfig::default()), tcp_b, over_tcp(OverTcpConfig::default()));
    let mut sender =
        RdmaOverTcp::new(RdmaTransport::new(a, RdmaConfig::default()), tcp_a, over_tcp(OverTcpConfig::default()));
    let peer = sender.add_peer_rails(&[Rail::to(address)]).unwrap();
    let targets: Vec<BlockAddr> = (0..24).map(|i| node.reserve(i, 1)).collect();
    let start = START.with(|s| *s);

    // Up over TCP (after the handshake), then RDMA carries every block.
    drive_until(&mut sender, &mut receiver, &mut node, |s| s.rdma_up(peer));
    assert_eq!((sender.stats.offered, sender.stats.up, receiver.stats.accepted), (1, 1, 1));
    assert!(sender.tcp().stats.handshakes >= 1, "the endpoint went over an authenticated link");
    write_from_arena(&mut sender, peer, &arena, &at, &lens, 0..12, &targets);
    let done = by_transfer(drive(&mut sender, &mut receiver, &mut node, start, 12));
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(sender.fallback_stats().primary, 12);
    assert_eq!(sender.tcp().stats.sent, 0, "no block went over TCP");
    assert_eq!(receiver.rdma().stats.landed, 12);

    // The RDMA link dies with blocks offered: TCP carries them, each once.
    write_from_arena(&mut sender, peer, &arena, &at, &lens, 12..18, &targets);
    fabric.cut(receiver_node, "port down");
    let done = by_transfer(drive(&mut sender, &mut receiver, &mut node, start, 6));
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(sender.fallback_stats().moved + sender.fallback_stats().secondary, 6);
    assert!(sender.tcp().stats.sent >= 6);

    // After its wait the link offers again: a new queue pair, and RDMA
    // carries the rest.
    drive_until(&mut sender, &mut receiver, &mut node, |s| s.stats.up == 2 && s.rdma_up(peer));
    assert_eq!(sender.stats.downs, 1);
    let tcp_sent = sender.tcp().stats.sent;
    write_from_arena(&mut sender, peer, &arena, &at, &lens, 18..24, &targets);
    let done = by_transfer(drive(&mut sender, &mut receiver, &mut node, start, 6));
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(sender.tcp().stats.sent, tcp_sent, "the renegotiated link carries them");
    assert_eq!(node.published.len(), 24, "each block landed once");
    for (i, o) in objects.iter().enumerate() {
        assert!(node.landed_bytes(&targets[i], o.len())[STORED_HEADER_BYTES..] == o[STORED_HEADER_BYTES..]);
    }
    assert_eq!(sender.in_flight(), 0);
}

#[test]
fn a_receiver_without_rdma_declines_and_the_link_stays_on_tcp() {
    let objects: Vec<Vec<u8>> = (0..6).map(|i| object(i, 50_000, i)).collect();
    let lens: Vec<usize> = objects.iter().map(Vec::len).collect();
    let (mut arena, at) = sender_arena(&objects);
    let fabric = Fabric::new();
    let mut a = fabric.end(64);
    // SAFETY: the arena outlives the end.
    unsafe { a.register_arena(arena.as_mut_ptr(), arena.len(), SENDER_SLOT as u32, 1) };
    // A plain TCP receiver: it takes no offer.
    let mut receiver = TcpTransport::new(tcp_config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = receiver.local_addr().unwrap();
    let tcp_a = TcpTransport::new(tcp_config(), None).unwrap();
    let mut sender =
        RdmaOverTcp::new(RdmaTransport::new(a, RdmaConfig::default()), tcp_a, over_tcp(OverTcpConfig::default()));
    let peer = sender.add_peer_rails(&[Rail::to(address)]).unwrap();
    let mut node = Node::new(8);
    let targets: Vec<BlockAddr> = (0..6).map(|i| node.reserve(i, 1)).collect();
    drive_until(&mut sender, &mut receiver, &mut node, |s| s.stats.failed == 1);
    assert!(!sender.rdma_up(peer));
    assert!(sender.take_events().iter().any(|e| e.contains("declined")));
    write_from_arena(&mut sender, peer, &arena, &at, &lens, 0..6, &targets);
    let done = drive(&mut sender, &mut receiver, &mut node, START.with(|s| *s), 6);
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!((sender.fallback_stats().primary, sender.fallback_stats().secondary), (0, 6));
    assert_eq!(node.published.len(), 6);
}

#[test]
fn an_offer_that_is_not_an_endpoint_is_declined_and_the_link_carries_on() {
    let fabric = Fabric::new();
    let mut node = Node::new(4);
    let mut b = fabric.end(64);
    // SAFETY: the node's memory outlives the end.
    unsafe {
        b.register_arena(node.memory.as_mut_ptr(), node.memory.len(), lake_tests::transport::SLOT_BYTES as u32, EPOCH)
    };
    let tcp_b = TcpTransport::new(tcp_config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    let address = tcp_b.local_addr().unwrap();
    let mut receiver = RdmaOverTcp::new(RdmaTransport::new(b, RdmaConfig::default()), tcp_b, OverTcpConfig::default());
    // A sender that offers garbage where an endpoint goes.
    let mut sender = TcpTransport::new(tcp_config(), None).unwrap();
    let peer = sender.add_peer(address).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut none = Node::new(0);
    while sender.offer_transport(peer, &[0x5a; 72]).is_err() {
        assert!(Instant::now() < deadline, "no connection up");
        sender.poll(&mut none, now(), &mut Vec::new());
        receiver.poll(&mut node, now(), &mut Vec::new());
    }
    assert!(sender.offer_transport(peer, &[]).is_err(), "an empty offer is refused before the wire");
    assert!(sender.offer_transport(peer, &[0; 257]).is_err(), "so is one too long");
    let answers = loop {
        assert!(Instant::now() < deadline, "no answer");
        sender.poll(&mut none, now(), &mut Vec::new());
        receiver.poll(&mut node, now(), &mut Vec::new());
        let answers = sender.take_negotiations();
        if !answers.is_empty() {
            break answers;
        }
    };
    assert_eq!(answers, vec![Negotiation::Answered { peer, bytes: None }]);
    assert_eq!((receiver.stats.declined, receiver.stats.accepted), (1, 0));
    assert!(receiver.take_events().iter().any(|e| e.contains("declined") && e.contains("magic")));
    // The same link still lands blocks.
    let o = object(1, 40_000, 0);
    let target = node.reserve(0, 1);
    // SAFETY: `o` outlives the completion driven below.
    unsafe { sender.write(&outgoing(1, peer, &o, target, Priority::WriteBack), now()) }.unwrap();
    let done = drive(&mut sender, &mut receiver, &mut node, START.with(|s| *s), 1);
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(sender.stats.bad_frames + receiver.tcp().stats.bad_frames, 0);
}

#[test]
fn a_withdrawn_offer_not_yet_read_ends_cancelled_and_its_slot_goes_back() {
    // The receiver reads one block at a time: of four offers, the first is
    // being read when the sender withdraws the last three.
    let objects: Vec<Vec<u8>> = (0..4).map(|i| object(i, 60_000, i)).collect();
    let config = RdmaConfig { reads_max: 1, ..RdmaConfig::default() };
    let mut p = pair(config, 8, &objects);
    for (i, o) in objects.iter().enumerate() {
        let target = if i % 2 == 0 { p.node.reserve(i as u32, 1) } else { any_slot() };
        write(&mut p.sender, i as u64, p.peer, o, target, Priority::PrefillToDecode);
    }
    p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    assert_eq!(p.node.reserved.len(), 4, "two named, two reserved");
    assert!(p.sender.withdraw(1) && p.sender.withdraw(3), "offers in flight");
    assert!(!p.sender.withdraw(1), "withdrawn once");
    assert!(!p.sender.withdraw(99), "no such offer");
    let start = START.with(|s| *s);
    let done = by_transfer(drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 4));
    let results: Vec<_> = done.iter().map(|c| c.result.clone()).collect();
    assert_eq!(
        results,
        [Ok(()), Err(TransferError::Cancelled), Ok(()), Err(TransferError::Cancelled)],
        "the one being read lands; those withdrawn before their READ do not"
    );
    assert_eq!(p.node.published.len(), 2);
    assert_eq!((p.receiver.stats.withdrawn_dropped, p.receiver.stats.refused), (2, 0));
    assert_eq!(p.node.abandoned, 2, "the withdrawn blocks' slots went back");
    assert!(p.node.reserved.is_empty());
    assert_eq!(p.sender.verbs().keys_out(), 0, "their keys were taken back");
    // A withdrawal of one read already changes nothing.
    write(&mut p.sender, 9, p.peer, &objects[0], p.node.reserve(6, 1), Priority::WriteBack);
    p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    p.receiver.poll(&mut p.node, now(), &mut Vec::new());
    p.sender.withdraw(9);
    let done = drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 1);
    assert_eq!(done[0].result, Ok(()), "read before the withdrawal came: it landed");
}

#[test]
fn a_traced_offer_lands_under_its_trace_id_and_the_readers_time_comes_back() {
    use lake_dp::transport::tcp::TraceEvent;
    let objects: Vec<Vec<u8>> = (0..4).map(|i| object(i, 50_000 + 1000 * i as usize, i)).collect();
    let mut p = pair(RdmaConfig::default(), 8, &objects);
    for (i, o) in objects.iter().enumerate() {
        let target = if i % 2 == 0 { p.node.reserve(i as u32, 1) } else { any_slot() };
        let trace = if i < 2 { 0x9e5d_0000 + i as u64 } else { 0 };
        let block =
            lake_dp::transport::Outgoing { trace, ..outgoing(i as u64, p.peer, o, target, Priority::PrefillToDecode) };
        // SAFETY: `objects` outlives every completion driven below.
        unsafe { p.sender.write(&block, now()) }.unwrap();
    }
    let start = START.with(|s| *s);
    let done = by_transfer(drive(&mut p.sender, &mut p.receiver, &mut p.node, start, 4));
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    let (mut landed, mut answered) = (Vec::new(), Vec::new());
    p.receiver.take_trace_events(&mut landed);
    p.sender.take_trace_events(&mut answered);
    // The reader: a landing a traced block, under its id, where it landed.
    assert_eq!(landed.len(), 2, "{landed:?}");
    for event in &landed {
        let TraceEvent::Landed { trace, target, bytes, status, us, .. } = *event else { panic!("{event:?}") };
        let i = (trace - 0x9e5d_0000) as usize;
        assert_eq!((target, bytes, status), (done[i].target, objects[i].len() as u64, Some(AckStatus::Landed)));
        assert!(us >= 1, "{event:?}");
    }
    // The sender: the reader's time, as it logged it.
    assert_eq!(answered.len(), 2, "{answered:?}");
    for event in &answered {
        let TraceEvent::Answered { trace, transfer, peer_us } = *event else { panic!("{event:?}") };
        assert_eq!(trace, 0x9e5d_0000 + transfer);
        let logged = landed.iter().find_map(|e| match *e {
            TraceEvent::Landed { trace: t, us, .. } if t == trace => Some(us),
            _ => None,
        });
        assert_eq!(Some(peer_us), logged);
    }
}

/// What a node receives over RDMA is capped per tenant, as
/// over TCP: each offer names its block's namespace; the receiver answers
/// an offer over its tenant's cap *later* with the wait, reading nothing;
/// the sender takes its key back, holds the block and offers it again
/// then. The capped tenant's blocks arrive at its rate, the other
/// tenant's at once, none refused or lost, no key left out.
#[test]
fn a_tenant_capped_on_what_a_node_receives_is_held_at_its_sender() {
    use lake_tests::transport::Capped;
    // Tenant of namespace 3 capped at 1 MiB/s, that of 4 not.
    let (capped, other) = (3, 4);
    let objects: Vec<Vec<u8>> = (0..16).map(|i| object(i, 128 << 10, 40 + i)).collect();
    let mut p = pair(RdmaConfig::default(), 16, &objects);
    let mut landing = Capped::new(std::mem::replace(&mut p.node, Node::new(0)), capped, 1 << 20);
    let began = Instant::now();
    for (i, o) in objects.iter().enumerate() {
        let namespace = if i % 2 == 0 { capped } else { other };
        let block = lake_dp::transport::Outgoing {
            namespace,
            ..outgoing(i as u64, p.peer, o, any_slot(), Priority::PrefillToDecode)
        };
        // SAFETY: `objects` outlives the completions.
        unsafe { p.sender.write(&block, now()) }.unwrap();
    }
    let (mut took, mut done, mut none) = (vec![0.0f64; objects.len()], Vec::new(), Node::new(0));
    let deadline = Instant::now() + Duration::from_secs(20);
    while done.len() < objects.len() {
        assert!(Instant::now() < deadline, "{} of {} completions in 20 s", done.len(), objects.len());
        let before = done.len();
        p.sender.poll(&mut none, now(), &mut done);
        for completion in &done[before..] {
            took[completion.transfer as usize] = began.elapsed().as_secs_f64();
        }
        p.receiver.poll(&mut landing, now(), &mut Vec::new());
    }
    assert!(done.iter().all(|c| c.result.is_ok()), "every block lands: {done:?}");
    assert_eq!(landing.node.published.len(), objects.len());
    let slowest =
        |parity: usize| took.iter().enumerate().filter(|(i, _)| i % 2 == parity).map(|(_, &t)| t).fold(0.0, f64::max);
    // Eight blocks of 132 KiB at 1 MiB/s: the bucket's burst (a tenth of a
    // second) and the last block's debt taken off, 0.80 s at the least.
    let floor = (8.0 * 135_168.0 - 104_857.0 - 135_168.0) / 1_048_576.0;
    let (capped, other) = (slowest(0), slowest(1));
    let (put_off, held) = (p.receiver.stats.offers_put_off, p.sender.stats.offers_held);
    println!(
        "capped tenant {capped:.3} s (floor {floor:.3}), other {other:.3} s; {put_off} offers put off, {held} held"
    );
    assert!(capped >= floor * 0.95, "the capped tenant's blocks in {capped:.3} s, under its floor {floor:.3}");
    assert!(other < floor / 2.0, "the other tenant's blocks waited: {other:.3} s");
    assert!(put_off > 0 && held == put_off, "{put_off} offers put off, {held} held");
    assert_eq!(p.receiver.stats.refused, 0, "a put-off offer is not a refusal");
    assert_eq!(p.sender.stats.keys_lent, p.sender.stats.keys_taken_back);
    assert_eq!(p.sender.verbs().keys_out(), 0, "no key outlives its offer");
    // Only the offers made again were offered twice.
    assert_eq!(p.sender.stats.offered, objects.len() as u64);
    assert_eq!(p.sender.stats.keys_lent, objects.len() as u64 + held);
}
