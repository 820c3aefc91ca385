//! Authenticated transport links: two nodes holding the
//! cluster's link key move blocks as before; a peer without it, with
//! another key, or replaying a recorded handshake gets nothing through;
//! a frame tampered with, replayed or truncated on an authenticated
//! connection is refused (its block never published from those bytes),
//! counted and logged, its connection closed — and the node goes on
//! taking good blocks as if nothing happened.
//!
//! The hostile peer here is a raw client built from `lake_dp::auth` and
//! the frame codec: it does a real handshake with the key, then sends the
//! frames a tamperer, a replayer or a dying sender would.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use lake_dp::Priority;
use lake_dp::auth::handshake::SERVER_HELLO_BYTES;
use lake_dp::auth::{ClientHandshake, LinkKey, Session};
use lake_dp::transport::frame::{BlockAddr, FrameHeader};
use lake_dp::transport::tcp::{PeerId, TcpConfig, TcpError, TcpTransport};
use lake_tests::fault_proxy::{FaultProxy, Faults};
use lake_tests::transport::{Node, drive, now_ns, object, outgoing};

thread_local! {
    /// This test's transports make and check large slices' tags on the
    /// tag threads (set by the `_tags_later` twins).
    static LATER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `test` with large slices' tags made and checked on two tag
/// threads while the links go on, as `lake serve --tag-threads 2` does.
fn tags_later(test: fn()) {
    lake_dp::auth::spread_tags(2).unwrap();
    LATER.with(|l| l.set(true));
    test();
}

fn config() -> TcpConfig {
    let tags_later = LATER.with(std::cell::Cell::get);
    TcpConfig { streams_per_peer: 2, transfer_timeout_ns: 3_000_000_000, tags_later, ..TcpConfig::default() }
}

fn key() -> LinkKey {
    LinkKey::from_bytes([0x4c; 32])
}

fn receiver() -> (TcpTransport, SocketAddr) {
    let mut receiver = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    receiver.authenticate(key(), 2).unwrap();
    let address = receiver.local_addr().unwrap();
    (receiver, address)
}

fn sender(key: Option<LinkKey>, to: SocketAddr) -> (TcpTransport, PeerId) {
    let mut sender = TcpTransport::new(config(), None).unwrap();
    if let Some(key) = key {
        sender.authenticate(key, 1).unwrap();
    }
    let peer = sender.add_peer(to).unwrap();
    (sender, peer)
}

/// Sends one good block from a fresh authenticated sender and checks it
/// landed whole: the node is unaffected by whatever came before.
fn a_good_block_still_lands(receiver: &mut TcpTransport, node: &mut Node, address: SocketAddr, slot: u32) {
    let start = Instant::now();
    let (mut good, peer) = sender(Some(key()), address);
    let bytes = object(slot + 500, 700_000, slot);
    let target = node.reserve(slot, 7);
    let before = node.published.len();
    // SAFETY: `bytes` outlives the completion, driven below.
    unsafe { good.write(&outgoing(1, peer, &bytes, target, Priority::WriteBack), now_ns(start)) }.unwrap();
    let done = drive(&mut good, receiver, node, start, 1);
    assert!(done[0].result.is_ok(), "{done:?}");
    assert_eq!(node.published.len(), before + 1);
    let landed = node.landed_bytes(&target, bytes.len());
    assert_eq!(landed[4096..], bytes[4096..], "the payload landed as sent");
}

/// Polls the receiver until `done` says so (5 s at most).
fn poll_until(receiver: &mut TcpTransport, node: &mut Node, what: &str, done: impl Fn(&TcpTransport) -> bool) {
    let start = Instant::now();
    while !done(receiver) {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}: not seen in 5 s ({:?})", receiver.stats);
        receiver.poll(node, now_ns(start), &mut Vec::new());
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// A hostile client that holds the key: it handshakes for real, then
/// writes whatever frames it likes.
struct RawClient {
    stream: TcpStream,
    session: Session,
}

impl RawClient {
    fn connect(address: SocketAddr, receiver: &mut TcpTransport, node: &mut Node) -> Self {
        let mut stream = TcpStream::connect(address).unwrap();
        let (handshake, hello) = ClientHandshake::start(&key(), 9, lake_dp::auth::nonce().unwrap());
        stream.write_all(&hello).unwrap();
        let answer = read_exact_polling(&mut stream, SERVER_HELLO_BYTES, receiver, node);
        let mut fixed = [0u8; SERVER_HELLO_BYTES];
        fixed.copy_from_slice(&answer);
        let (finish, session, _) = handshake.finish(&fixed).unwrap();
        stream.write_all(&finish).unwrap();
        Self { stream, session }
    }

    /// The bytes of a sealed data frame carrying all of `object` to `target`.
    fn frame(&mut self, transfer: u64, target: BlockAddr, object: &[u8]) -> Vec<u8> {
        let len = object.len() as u32;
        let header = FrameHeader::data((transfer, 0), target, u64::from(len), 0, len).encode();
        let tags = self.session.seal(&header, object);
        [&header[..], &tags[..], object].concat()
    }
}

/// Reads `n` bytes from `stream` while polling the receiver that sends
/// them.
fn read_exact_polling(stream: &mut TcpStream, n: usize, receiver: &mut TcpTransport, node: &mut Node) -> Vec<u8> {
    stream.set_nonblocking(true).unwrap();
    let start = Instant::now();
    let mut out = vec![0u8; n];
    let mut have = 0;
    while have < n {
        assert!(start.elapsed() < Duration::from_secs(5), "{have} of {n} bytes in 5 s");
        receiver.poll(node, now_ns(start), &mut Vec::new());
        match stream.read(&mut out[have..]) {
            Ok(0) => panic!("closed after {have} of {n} bytes"),
            Ok(k) => have += k,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_micros(200)),
            Err(e) => panic!("{e}"),
        }
    }
    stream.set_nonblocking(false).unwrap();
    out
}

fn events_mention(events: &[String], what: &str) -> bool {
    events.iter().any(|e| e.contains(what))
}

#[test]
fn holders_of_the_key_move_blocks_and_the_log_is_quiet() {
    let start = Instant::now();
    let (mut receiver, address) = receiver();
    let (mut sender, peer) = sender(Some(key()), address);
    let mut node = Node::new(16);
    let objects: Vec<Vec<u8>> = (0..12).map(|i| object(i, [1, 65_536, 1 << 20, 3 << 20][i as usize % 4], i)).collect();
    for (i, bytes) in objects.iter().enumerate() {
        let target = node.reserve(i as u32, 3);
        // SAFETY: `objects` outlives every completion (driven below).
        unsafe { sender.write(&outgoing(i as u64, peer, bytes, target, Priority::WriteBack), now_ns(start)) }.unwrap();
    }
    let done = drive(&mut sender, &mut receiver, &mut node, start, objects.len());
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    assert_eq!(node.published.len(), objects.len());
    assert!(receiver.stats.handshakes >= 1 && sender.stats.handshakes >= 1);
    assert_eq!((receiver.stats.bad_tags, receiver.stats.handshakes_refused), (0, 0));
    assert!(receiver.take_security_events().is_empty());
    // With tags made later, the large slices' tags were made and checked
    // on the tag threads (the small ones here).
    let later = LATER.with(std::cell::Cell::get);
    assert_eq!(sender.stats.sealed_later > 0 && receiver.stats.checked_later > 0, later);
}

#[test]
fn a_peer_with_another_key_or_none_gets_nothing_through() {
    let start = Instant::now();
    let (mut receiver, address) = receiver();
    let mut node = Node::new(4);
    // Another key: refused at the handshake, on both ends, naming both ids.
    let other = LinkKey::from_bytes([0x11; 32]);
    let (mut stranger, peer) = sender(Some(other.clone()), address);
    let bytes = object(1, 4096, 0);
    let target = node.reserve(0, 1);
    // SAFETY: `bytes` outlives the completion.
    unsafe { stranger.write(&outgoing(1, peer, &bytes, target, Priority::WriteBack), now_ns(start)) }.unwrap();
    let done = drive(&mut stranger, &mut receiver, &mut node, start, 1);
    let error = format!("{:?}", done[0].result);
    assert!(done[0].result.is_err(), "{error}");
    assert!(error.contains("another link key"), "the sender is told why: {error}");
    assert!(node.published.is_empty());
    let events = receiver.take_security_events();
    assert!(events_mention(&events, &format!("{:016x}", other.id())), "{events:?}");
    assert!(receiver.stats.handshakes_refused >= 1);

    // No key at all: its frames are not a handshake.
    let (mut plain, peer) = sender(None, address);
    // SAFETY: `bytes` outlives the completion.
    unsafe { plain.write(&outgoing(2, peer, &bytes, target, Priority::WriteBack), now_ns(start)) }.unwrap();
    let done = drive(&mut plain, &mut receiver, &mut node, start, 1);
    assert!(done[0].result.is_err());
    assert!(node.published.is_empty());
    assert!(events_mention(&receiver.take_security_events(), "not a Lake handshake"));

    // A handshake recorded from an earlier connection and played again:
    // the server's nonce is fresh, so the old finish proves nothing.
    let mut first = TcpStream::connect(address).unwrap();
    let (handshake, hello) = ClientHandshake::start(&key(), 9, [7; 32]);
    first.write_all(&hello).unwrap();
    let answer = read_exact_polling(&mut first, SERVER_HELLO_BYTES, &mut receiver, &mut node);
    let (finish, _, _) = handshake.finish(&<[u8; SERVER_HELLO_BYTES]>::try_from(answer).unwrap()).unwrap();
    drop(first);
    let refused_before = receiver.stats.handshakes_refused;
    let mut replay = TcpStream::connect(address).unwrap();
    replay.write_all(&hello).unwrap();
    replay.write_all(&finish).unwrap();
    poll_until(&mut receiver, &mut node, "the replayed handshake refused", |r| {
        r.stats.handshakes_refused > refused_before
    });
    assert!(events_mention(&receiver.take_security_events(), "proof of the link key does not check"));
    a_good_block_still_lands(&mut receiver, &mut node, address, 1);
}

#[test]
fn a_tampered_frame_is_refused_logged_and_nothing_else_is_affected() {
    let (mut receiver, address) = receiver();
    let mut node = Node::new(8);
    let good = object(3, 200_000, 0);

    // One payload byte flipped after sealing: the bytes land in the slot
    // but never count; the block is not published.
    let target = node.reserve(0, 1);
    let mut client = RawClient::connect(address, &mut receiver, &mut node);
    let mut frame = client.frame(1, target, &good);
    let at = frame.len() - 1000;
    frame[at] ^= 0x01;
    client.stream.write_all(&frame).unwrap();
    poll_until(&mut receiver, &mut node, "the tampered slice refused", |r| r.stats.bad_tags == 1);
    assert!(node.published.is_empty(), "a tampered block was published");
    let events = receiver.take_security_events();
    assert!(events_mention(&events, "slice for slot 0 refused"), "{events:?}");

    // A header byte flipped (its CRC fixed up would not help: the tag
    // covers it): refused before anything is written anywhere.
    let target = node.reserve(1, 1);
    let mut client = RawClient::connect(address, &mut receiver, &mut node);
    let mut frame = client.frame(2, target, &good);
    frame[40] ^= 0x10;
    client.stream.write_all(&frame).unwrap();
    poll_until(&mut receiver, &mut node, "the tampered header refused", |r| r.stats.bad_tags == 2);
    assert!(events_mention(&receiver.take_security_events(), "frame refused"));
    assert!(node.published.is_empty());
    // The untouched slot took none of the frame's bytes.
    assert!(node.slot(1)[..4096].iter().all(|&b| b == 0), "a refused header's bytes were written");

    a_good_block_still_lands(&mut receiver, &mut node, address, 2);
}

#[test]
fn a_replayed_or_truncated_frame_is_refused() {
    let (mut receiver, address) = receiver();
    let mut node = Node::new(8);
    let first = object(4, 50_000, 0);

    // The same sealed frame twice: the first lands, the copy fails its
    // tag (the receiver counts frames), and its connection is closed.
    let target = node.reserve(0, 1);
    let mut client = RawClient::connect(address, &mut receiver, &mut node);
    let frame = client.frame(1, target, &first);
    client.stream.write_all(&frame).unwrap();
    poll_until(&mut receiver, &mut node, "the first sending landed", |r| r.stats.landed == 1);
    client.stream.write_all(&frame).unwrap();
    poll_until(&mut receiver, &mut node, "the replay refused", |r| r.stats.bad_tags == 1);
    assert_eq!(node.published.len(), 1, "the replay was published");
    assert!(events_mention(&receiver.take_security_events(), "frame refused"));

    // A frame cut short and its connection closed: nothing published, the
    // slot given back by its deadline or taken by the next good sender.
    let target = node.reserve(2, 1);
    let mut client = RawClient::connect(address, &mut receiver, &mut node);
    let frame = client.frame(2, target, &first);
    client.stream.write_all(&frame[..frame.len() / 2]).unwrap();
    drop(client);
    let lost = receiver.stats.streams_lost;
    poll_until(&mut receiver, &mut node, "the truncated connection closed", |r| r.stats.streams_lost > lost);
    assert_eq!(node.published.len(), 1, "a truncated block was published");

    a_good_block_still_lands(&mut receiver, &mut node, address, 3);
}

#[test]
fn bytes_flipped_on_the_path_are_caught_and_the_block_sent_again() {
    // Between two real transports, a proxy flips a byte in some chunks,
    // either way: every flip closes its connection (by a tag, or the frame
    // header's own check) and the sender sends what it carried again.
    // Batches go until a few flips were made; every block that lands is
    // exact, and every block its sender was told landed is there.
    let start = Instant::now();
    let (mut receiver, address) = receiver();
    let faults = Faults { seed: 91, chunk_bytes: 64 * 1024, flip: 15_000, ..Faults::default() };
    let proxy = FaultProxy::start(address, faults).unwrap();
    let mut sender =
        TcpTransport::new(TcpConfig { streams_per_peer: 4, transfer_timeout_ns: 8_000_000_000, ..config() }, None)
            .unwrap();
    sender.authenticate(key(), 1).unwrap();
    let peer = sender.add_peer(proxy.address()).unwrap();
    let mut node = Node::new(8);
    let flips = || proxy.counts.flips.load(std::sync::atomic::Ordering::Relaxed);
    let (mut sent, mut landed) = (0, 0);
    for batch in 0..12u32 {
        if flips() >= 3 {
            break;
        }
        let objects: Vec<Vec<u8>> = (0..8).map(|i| object(batch * 8 + i, 300_000 + 7 * i as usize, i)).collect();
        node.published.clear();
        for (i, bytes) in objects.iter().enumerate() {
            let target = node.reserve(i as u32, batch + 2);
            let transfer = u64::from(batch) * 8 + i as u64;
            // SAFETY: `objects` outlives every completion (driven below).
            unsafe { sender.write(&outgoing(transfer, peer, bytes, target, Priority::WriteBack), now_ns(start)) }
                .unwrap();
        }
        let done = drive(&mut sender, &mut receiver, &mut node, start, objects.len());
        for (target, meta) in &node.published {
            let i = target.slot as usize;
            assert_eq!((meta.slot, meta.generation), (target.slot, target.generation));
            assert_eq!(node.landed_bytes(target, objects[i].len())[4096..], objects[i][4096..], "block {i} differs");
        }
        // One whose ack was lost to a flip may have landed untold
        // (published, its sender told of a failure) — never the other way.
        for completion in done.iter().filter(|c| c.result.is_ok()) {
            assert!(node.published.iter().any(|(t, _)| *t == completion.target), "{completion:?} is not published");
            landed += 1;
        }
        sent += objects.len();
    }
    assert!(flips() > 0, "the proxy flipped nothing in {sent} blocks: the test proves nothing");
    assert!(
        receiver.stats.bad_tags + receiver.stats.bad_frames + receiver.stats.handshakes_refused > 0
            || sender.stats.bad_tags + sender.stats.bad_frames + sender.stats.handshakes_refused > 0
    );
    assert!(landed * 2 > sent, "only {landed} of {sent} landed");
}

#[test]
fn holders_of_the_key_move_blocks_and_the_log_is_quiet_tags_later() {
    tags_later(holders_of_the_key_move_blocks_and_the_log_is_quiet);
}

#[test]
fn a_tampered_frame_is_refused_logged_and_nothing_else_is_affected_tags_later() {
    tags_later(a_tampered_frame_is_refused_logged_and_nothing_else_is_affected);
}

#[test]
fn a_replayed_or_truncated_frame_is_refused_tags_later() {
    tags_later(a_replayed_or_truncated_frame_is_refused);
}

#[test]
fn bytes_flipped_on_the_path_are_caught_and_the_block_sent_again_tags_later() {
    tags_later(bytes_flipped_on_the_path_are_caught_and_the_block_sent_again);
}

/// Polls `sender` and `receiver` until `want` completions; each must land.
fn send_and_land(sender: &mut TcpTransport, peer: PeerId, receiver: &mut TcpTransport, node: &mut Node, first: u32) {
    let start = Instant::now();
    let objects: Vec<Vec<u8>> = (0..4).map(|i| object(first + i, 150_000 + 1000 * i as usize, first + i)).collect();
    for (i, bytes) in objects.iter().enumerate() {
        let target = node.reserve(first + i as u32, 1);
        // SAFETY: `objects` outlives every completion, driven below.
        unsafe {
            sender
                .write(&outgoing(u64::from(first) + i as u64, peer, bytes, target, Priority::WriteBack), now_ns(start))
        }
        .unwrap();
    }
    let done = drive(sender, receiver, node, start, objects.len());
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
}

#[test]
fn nodes_one_link_version_apart_move_blocks_and_speak_the_latest_once_both_do() {
    // A rolling upgrade: this build (link version 2) beside one a release
    // behind (version 1: it offers 1, and refuses a later offer naming 1,
    // as version 1 code does) — held there with speak_link_versions_up_to.
    let mut node = Node::new(16);
    let mut old = TcpTransport::new(config(), Some("127.0.0.1:0".parse().unwrap())).unwrap();
    old.authenticate(key(), 2).unwrap();
    old.speak_link_versions_up_to(1).unwrap();
    let address = old.local_addr().unwrap();
    // New → old: its first offer is refused, it offers 1 and blocks land.
    let (mut new, peer) = sender(Some(key()), address);
    send_and_land(&mut new, peer, &mut old, &mut node, 0);
    assert_eq!(new.link_version(peer), Some(1));
    assert!(old.stats.handshakes_refused >= 1, "the old node refused version 2 first");
    assert!(events_mention(&new.take_security_events(), "speaking link version 1"));
    // Old → new: it offers 1, the new node answers in 1, nothing refused.
    let (mut receiver, new_address) = receiver();
    let mut behind = TcpTransport::new(config(), None).unwrap();
    behind.authenticate(key(), 3).unwrap();
    behind.speak_link_versions_up_to(1).unwrap();
    let to_new = behind.add_peer(new_address).unwrap();
    send_and_land(&mut behind, to_new, &mut receiver, &mut node, 4);
    assert_eq!(receiver.stats.handshakes_refused, 0);
    // The old node is upgraded in place (same address): the new sender's
    // links break, and its next handshakes offer 2 again — and get it.
    drop(old);
    let mut upgraded = TcpTransport::new(config(), Some(address)).unwrap();
    upgraded.authenticate(key(), 2).unwrap();
    send_and_land(&mut new, peer, &mut upgraded, &mut node, 8);
    assert_eq!(new.link_version(peer), Some(2));
    assert_eq!(upgraded.stats.handshakes_refused, 0);
    assert_eq!(node.published.len(), 12);
    // A version this build does not speak is refused by name.
    let mut odd = TcpTransport::new(config(), None).unwrap();
    let refused = odd.speak_link_versions_up_to(3).unwrap_err();
    assert!(matches!(&refused, TcpError::Setting(what) if what.contains("speaks 1 to 2")), "{refused}");
}
