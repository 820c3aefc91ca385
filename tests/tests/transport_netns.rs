//! Two nodes in two network namespaces joined by a veth pair — a sender in
//! one, a receiver in the other, each its own process — with the link's
//! rate limited (`tbf`), then cut (`ip link set … down`) and restored:
//! blocks sent across a cut that heals all land, checked, in their slots;
//! blocks sent into a cut that does not heal fail by their deadline, and
//! nothing unchecked is published. Needs root (CI is); elsewhere it prints
//! why it skipped.
//!
//! The test binary is its own sender and receiver: run again inside a
//! namespace (`ip netns exec`) with `LAKE_NETNS_ROLE` set.

#![allow(clippy::cast_possible_truncation)] // small test sizes and counts

use std::net::SocketAddr;
use std::process::Child;
use std::time::{Duration, Instant};

use lake_dp::Priority;
use lake_dp::stored::decode_object;
use lake_dp::transport::TransferError;
use lake_dp::transport::frame::{AckStatus, BlockAddr};
use lake_dp::transport::tcp::{Rail, TcpConfig, TcpTransport};
use lake_dp::transport::{Landing, check_and_adopt};
use lake_tests::netns::{Killed, Link, child_lines};
use lake_tests::transport::{EPOCH, REGION, SLOT_BYTES, now_ns, object, outgoing};

const BLOCKS: u32 = 48;
const PAYLOAD: usize = 1 << 20;

/// The receiver's landing: every slot below `BLOCKS` reserved until a
/// block checks in it (a block given back unfinished leaves it reserved).
struct Receiving {
    memory: Vec<u8>,
    filling: Vec<bool>,
    done: Vec<bool>,
}

impl Landing for Receiving {
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus> {
        let slot = target.slot as usize;
        let ours = target.region == REGION && target.epoch == EPOCH && target.generation == 1;
        if !ours || slot >= self.done.len() || self.done[slot] || self.filling[slot] || len > SLOT_BYTES as u64 {
            return Err(AckStatus::Refused);
        }
        self.filling[slot] = true;
        Ok(self.memory[slot * SLOT_BYTES..].as_mut_ptr())
    }

    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        let slot = target.slot as usize;
        self.filling[slot] = false;
        let bytes = &mut self.memory[slot * SLOT_BYTES..(slot + 1) * SLOT_BYTES];
        if check_and_adopt(bytes, len, target).is_err() {
            return AckStatus::Corrupt;
        }
        // And the bytes are the ones the sender made for this slot.
        let expected = object(target.slot, PAYLOAD, target.slot);
        let same = decode_object(&bytes[..expected.len()]).map(|(_, p)| p.to_vec())
            == decode_object(&expected).map(|(_, p)| p.to_vec());
        println!("PUBLISHED {} {}", target.slot, if same { "same" } else { "DIFFERENT" });
        self.done[slot] = true;
        AckStatus::Landed
    }

    fn abandoned(&mut self, target: &BlockAddr) {
        if let Some(f) = self.filling.get_mut(target.slot as usize) {
            *f = false;
        }
    }
}

fn receiver(port: u16) {
    let config = TcpConfig { transfer_timeout_ns: 20_000_000_000, ..TcpConfig::default() };
    let address = SocketAddr::from(([0, 0, 0, 0], port));
    let mut transport = TcpTransport::new(config, Some(address)).expect("the receiver listens");
    let mut node = Receiving {
        memory: vec![0; BLOCKS as usize * SLOT_BYTES],
        filling: vec![false; BLOCKS as usize],
        done: vec![false; BLOCKS as usize],
    };
    println!("LISTENING");
    let start = Instant::now();
    // Until the parent kills it.
    loop {
        transport.poll_wait(&mut node, now_ns(start), &mut Vec::new(), Duration::from_millis(5));
    }
}

/// Sends blocks `first..last` to slots of the same numbers over `rails`;
/// prints each ending and how long it took, then the bytes per rail.
fn sender(rails: &[Rail], first: u32, last: u32, deadline_ns: u64) {
    let mut config = TcpConfig { transfer_timeout_ns: deadline_ns, reconnect_ns: 20_000_000, ..TcpConfig::default() };
    if rails.len() > 1 {
        // Finer slices over fewer connections per rail: the spread shows
        // within the few megabytes a test sends.
        config.streams_per_peer = 2;
        config.slice_bytes = 256 * 1024;
    }
    let mut transport = TcpTransport::new(config, None).unwrap();
    let peer = transport.add_peer_rails(rails).unwrap();
    let start = Instant::now();
    let mut none = Receiving { memory: Vec::new(), filling: Vec::new(), done: Vec::new() };
    while transport.connected(peer) < config.streams_per_peer * rails.len() {
        assert!(start.elapsed() < Duration::from_secs(10), "no connection across the link");
        transport.poll_wait(&mut none, now_ns(start), &mut Vec::new(), Duration::from_millis(5));
    }
    println!("CONNECTED");
    let objects: Vec<Vec<u8>> = (first..last).map(|slot| object(slot, PAYLOAD, slot)).collect();
    let mut began = Vec::new();
    for (i, slot) in (first..last).enumerate() {
        let bytes = &objects[i];
        let target = BlockAddr { region: REGION, epoch: EPOCH, slot, generation: 1 };
        let block = outgoing(u64::from(slot), peer, bytes, target, Priority::WriteBack);
        // SAFETY: `objects` outlives every completion.
        unsafe { transport.write(&block, now_ns(start)) }.expect("a write is taken");
        began.push(now_ns(start));
    }
    let mut ended = 0;
    while ended < objects.len() {
        let mut done = Vec::new();
        transport.poll_wait(&mut none, now_ns(start), &mut done, Duration::from_millis(5));
        for completion in done {
            let took_ms = (now_ns(start) - began[(completion.transfer - u64::from(first)) as usize]) / 1_000_000;
            let how = match completion.result {
                Ok(()) => "landed".to_owned(),
                Err(TransferError::Timeout) => "timeout".to_owned(),
                Err(e) => format!("failed:{e}"),
            };
            println!("ENDED {} {took_ms} {how}", completion.transfer);
            ended += 1;
        }
    }
    let bytes: Vec<String> = transport.rail_bytes(peer).iter().map(u64::to_string).collect();
    println!("RAILS {}", bytes.join(" "));
    println!("DONE");
}

/// The child's own lines (the test harness's around them left out).
fn lines(child: &mut Child) -> impl Iterator<Item = String> + use<> {
    child_lines(child, &["LISTENING", "CONNECTED", "ENDED", "DONE", "PUBLISHED", "RAILS"])
}

/// Run as a child (`LAKE_NETNS_ROLE` set): plays its role and returns true.
fn child_role() -> bool {
    let Ok(role) = std::env::var("LAKE_NETNS_ROLE") else { return false };
    let rails = Rail::parse_list(&std::env::var("LAKE_NETNS_RAILS").unwrap()).unwrap();
    let span: Vec<u32> = role.split(':').skip(1).map(|n| n.parse().unwrap()).collect();
    match role.split(':').next() {
        Some("receiver") => receiver(rails[0].remote.port()),
        Some("sender") => sender(&rails, span[0], span[1], u64::from(span[2]) * 1_000_000),
        other => panic!("unknown role {other:?}"),
    }
    true
}

/// The receiver's lines, gathered as they come.
fn gather(mut receiver: Child) -> (Killed, std::sync::Arc<std::sync::Mutex<Vec<String>>>, std::thread::JoinHandle<()>) {
    let mut from_receiver = lines(&mut receiver);
    assert_eq!(from_receiver.next().as_deref(), Some("LISTENING"));
    let published = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let collecting = {
        let published = std::sync::Arc::clone(&published);
        std::thread::spawn(move || {
            for line in from_receiver {
                published.lock().unwrap().push(line);
            }
        })
    };
    (Killed(receiver), published, collecting)
}

/// A sender's run: its lines up to `DONE`.
fn send(link: &Link, role: &str, rails: &str, during: impl FnOnce()) -> Vec<String> {
    let mut sender = Killed(link.spawn(&link.a, role, rails));
    let mut from_sender = lines(&mut sender.0);
    assert_eq!(from_sender.next().as_deref(), Some("CONNECTED"));
    during();
    let out: Vec<String> = from_sender.by_ref().take_while(|l| l != "DONE").collect();
    sender.0.wait().unwrap();
    out
}

fn ended(lines: &[String]) -> Vec<(u32, String, u64)> {
    lines
        .iter()
        .filter(|l| l.starts_with("ENDED"))
        .map(|l| {
            // ENDED slot took_ms how (the reason may hold spaces).
            let p: Vec<&str> = l.splitn(4, ' ').collect();
            (p[1].parse().unwrap(), p[3].to_owned(), p[2].parse().unwrap())
        })
        .collect()
}

fn rail_bytes(lines: &[String]) -> Vec<u64> {
    let line = lines.iter().find(|l| l.starts_with("RAILS")).expect("the sender's rail figures");
    line.split(' ').skip(1).map(|n| n.parse().unwrap()).collect()
}

/// What the receiver published: slot → same bytes as sent.
fn published_slots(lines: &[String]) -> Vec<(u32, bool)> {
    lines
        .iter()
        .filter(|l| l.starts_with("PUBLISHED"))
        .map(|l| {
            let p: Vec<&str> = l.split(' ').collect();
            (p[1].parse().unwrap(), p[2] == "same")
        })
        .collect()
}

/// The test as its parent: the namespaces and `rails` links, or `None`
/// when this process is a child (it played its role) or namespaces cannot
/// be made here (it says so).
fn parent(rails: usize, tag: u32, test: &'static str) -> Option<Link> {
    if child_role() {
        return None;
    }
    match Link::new(rails, tag, test) {
        Ok(link) => Some(link),
        Err(why) => {
            println!("SKIPPED: network namespaces are not available here ({why})");
            None
        }
    }
}

#[test]
fn blocks_cross_namespaces_through_rate_limits_and_cuts() {
    let Some(link) = parent(1, 0, "blocks_cross_namespaces_through_rate_limits_and_cuts") else { return };
    let rails = link.rails(7411);
    link.rate(0, "400mbit").expect("a tbf rate limit on the link");
    let (receiver, published, collecting) = gather(link.spawn(&link.b, "receiver", &rails));

    // 1. A cut that heals: 32 blocks of 1 MiB at 400 Mbit/s (~0.7 s), the
    // link down for 1.5 s in the middle. TCP carries them across; all land.
    let cut_at = Instant::now();
    let first = send(&link, "sender:0:32:20000", &rails, || {
        std::thread::sleep(Duration::from_millis(300));
        link.up(0, false).unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        link.up(0, true).unwrap();
    });
    let first = ended(&first);
    assert_eq!(first.len(), 32, "{first:?}");
    assert!(first.iter().all(|(_, how, _)| how == "landed"), "{first:?}");
    assert!(cut_at.elapsed() < Duration::from_secs(20), "{:?}", cut_at.elapsed());

    // 2. A cut that does not heal: 16 more blocks, the link down right after
    // they start, deadline 3 s. Each ends by its deadline, none claims to
    // have landed unless the receiver published it.
    let second = send(&link, "sender:32:48:3000", &rails, || link.up(0, false).unwrap());
    let second = ended(&second);
    assert_eq!(second.len(), 16, "{second:?}");
    for (slot, how, took_ms) in &second {
        assert!(*took_ms <= 3_300, "block {slot} ended past its deadline: {took_ms} ms");
        assert!(how == "landed" || how == "timeout" || how.starts_with("failed:peer lost"), "{slot}: {how}");
    }

    drop(receiver);
    collecting.join().unwrap();
    let published = published_slots(&published.lock().unwrap());
    assert!(published.iter().all(|(_, same)| *same), "a published block holds other bytes: {published:?}");
    for slot in 0..32 {
        assert!(published.iter().any(|(s, _)| *s == slot), "block {slot} landed but was not published");
    }
    for (slot, how, _) in &second {
        if how == "landed" {
            assert!(published.iter().any(|(s, _)| s == slot), "{slot}: told landed, not published");
        }
    }
    let landed = second.iter().filter(|(_, how, _)| how == "landed").count();
    println!(
        "cut that heals: 32 of 32 landed; cut that does not: 16 of 16 ended by their deadline, {landed} landed \
         before the cut, {} failed by name",
        16 - landed
    );
}

#[test]
fn blocks_spread_over_two_rails_by_speed_and_move_off_a_cut_one() {
    let Some(link) = parent(2, 1, "blocks_spread_over_two_rails_by_speed_and_move_off_a_cut_one") else { return };
    let rails = link.rails(7412);
    // Slow enough that the rails, not the (debug-built) processes, set the
    // pace.
    link.rate(0, "80mbit").unwrap();
    link.rate(1, "20mbit").unwrap();
    let (receiver, published, collecting) = gather(link.spawn(&link.b, "receiver", &rails));

    // 1. Both rails up: the faster one carries most of the bytes.
    let first = send(&link, "sender:0:24:20000", &rails, || {});
    assert!(ended(&first).iter().all(|(_, how, _)| how == "landed"), "{first:?}");
    let bytes = rail_bytes(&first);
    assert!(bytes[0] > bytes[1] * 2, "80 vs 20 Mbit/s rails carried {bytes:?}");

    // 2. The fast rail cut for good right after the blocks start: its
    // transfers move to the slow rail, and every block lands.
    let second = send(&link, "sender:24:40:20000", &rails, || {
        std::thread::sleep(Duration::from_millis(50));
        link.up(0, false).unwrap();
    });
    let ended_second = ended(&second);
    assert_eq!(ended_second.len(), 16, "{second:?}");
    assert!(ended_second.iter().all(|(_, how, _)| how == "landed"), "{ended_second:?}");
    let moved = rail_bytes(&second);

    drop(receiver);
    collecting.join().unwrap();
    let published = published_slots(&published.lock().unwrap());
    assert!(published.iter().all(|(_, same)| *same), "{published:?}");
    assert_eq!(published.len(), 40, "{published:?}");
    println!("rails 80/20 Mbit/s carried {bytes:?} bytes; with the fast one cut: {moved:?}");
}
