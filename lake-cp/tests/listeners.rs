//! The control plane's listeners against connections that hold on without
//! a word: each listener holds at most its cap (one past it is closed as
//! it comes), a metrics client that sends no request and a cp peer that
//! says no hello are closed at their deadlines, and the server counts what
//! it let go — while a real peer is served throughout.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use lake_cp::node::Node;
use lake_cp::server::{ConnectionCaps, HELLO_DEADLINE, HTTP_DEADLINE, Listener, Server};
use lake_dp::NodeId;
use lake_dp::wire::hello::{Identity, hello};
use lake_dp::wire::message::Role;
use lake_dp::wire::{FrameMeta, Message, encode_frame};

fn hello_frame() -> Vec<u8> {
    let identity = Identity { role: Role::DataPlane, node: 3, pid: 1, region_epoch: 5, features: 0, name: "dp-test" };
    let mut out = vec![0u8; 4096];
    let meta = FrameMeta { version: 1, flags: 0, request_id: 1, leader_term: 0 };
    let len = encode_frame(meta, &Message::Hello(hello(&identity).unwrap()), &mut out).unwrap();
    out.truncate(len);
    out
}

/// Whether `stream` was closed by the server (end of file, or reset)
/// within `within`; bytes it is sent first are skipped.
fn closed(stream: &mut impl Read, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut chunk = [0u8; 256];
    while Instant::now() < deadline {
        match stream.read(&mut chunk) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn silent_connections_are_capped_and_closed_at_their_deadlines_and_a_peer_is_served() {
    let path = std::env::temp_dir().join(format!("lake-cp-listeners-{}.sock", std::process::id()));
    let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
    let metrics = server.serve_metrics("127.0.0.1:0".parse().unwrap()).unwrap();
    server.set_caps(ConnectionCaps { cp: 3, metrics: 3, admin: 2 });
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let serving = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                server.poll_once(Some(Duration::from_millis(5))).expect("the loop goes on");
            }
            server
        })
    };
    let started = Instant::now();
    let mut http: Vec<std::net::TcpStream> = (0..8).map(|_| std::net::TcpStream::connect(metrics).unwrap()).collect();
    let mut peers: Vec<UnixStream> = (0..5).map(|_| UnixStream::connect(&path).unwrap()).collect();
    for stream in &http {
        stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    }
    for stream in &peers {
        stream.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    }
    // Past the caps: closed as they came.
    let shut_http = http.iter_mut().map(|s| closed(s, Duration::from_millis(300))).filter(|&c| c).count();
    let shut_peers = peers.iter_mut().map(|s| closed(s, Duration::from_millis(300))).filter(|&c| c).count();
    assert_eq!((shut_http, shut_peers), (5, 2), "only the caps held");
    // A real peer, in the place of a silent one let go at its deadline.
    std::thread::sleep(HELLO_DEADLINE.max(HTTP_DEADLINE) + Duration::from_millis(300));
    let mut peer = UnixStream::connect(&path).unwrap();
    peer.write_all(&hello_frame()).unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut ack = [0u8; 64];
    assert!(peer.read(&mut ack).unwrap() > 0, "the peer got no answer to its hello");
    for stream in &mut http {
        stream.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert!(closed(stream, Duration::from_secs(2)), "a silent metrics client outlived its deadline");
    }
    for stream in &mut peers {
        stream.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert!(closed(stream, Duration::from_secs(2)), "a peer with no hello outlived its deadline");
    }
    assert!(started.elapsed() < HELLO_DEADLINE + Duration::from_secs(5));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let server = serving.join().unwrap();
    let shed = server.counters.shed;
    assert_eq!(shed[Listener::Metrics as usize].over_cap, 5);
    assert_eq!(shed[Listener::Metrics as usize].timed_out, 3);
    assert_eq!(shed[Listener::Cp as usize].over_cap, 2);
    assert_eq!(shed[Listener::Cp as usize].timed_out, 3);
    assert_eq!(server.open_on(Listener::Cp), 1, "the real peer stays");
}
