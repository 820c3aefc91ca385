//! The control plane out of file descriptors: its listener cannot accept,
//! so it rests a moment and tries again — the loop goes on, and the
//! connections that waited are served once descriptors are free again.
//! Once, `Too many open files` from an accept ended the control plane's
//! thread. One test in its own process: it lowers the process's limit.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use lake_cp::node::Node;
use lake_cp::server::{Listener, Server};
use lake_dp::NodeId;

#[test]
fn an_accept_out_of_descriptors_rests_the_listener_and_the_waiting_are_served_after() {
    let limit = libc::rlimit { rlim_cur: 256, rlim_max: 256 };
    // SAFETY: a valid pointer; lowering this process's own limit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit) }, 0);
    let path = std::env::temp_dir().join(format!("lake-cp-fds-{}.sock", std::process::id()));
    let mut server = Server::bind(&path, Node::new(NodeId(3), 1, None), 1).unwrap();
    let metrics = server.serve_metrics("127.0.0.1:0".parse().unwrap()).unwrap();
    // Every descriptor taken, but the four the clients need.
    let mut held = Vec::new();
    while let Ok(file) = std::fs::File::open("/dev/null") {
        held.push(file);
    }
    held.truncate(held.len() - 4);
    let mut clients: Vec<std::net::TcpStream> =
        (0..4).map(|_| std::net::TcpStream::connect(metrics).expect("a client's descriptor")).collect();
    for client in &mut clients {
        client.write_all(b"GET /healthz HTTP/1.1\r\nHost: lake\r\n\r\n").unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.counters.shed[Listener::Metrics as usize].accept_failed == 0 {
        assert!(Instant::now() < deadline, "the accepts never failed");
        server.poll_once(Some(Duration::from_millis(5))).expect("the loop goes on out of descriptors");
    }
    for _ in 0..20 {
        server.poll_once(Some(Duration::from_millis(5))).expect("the loop goes on out of descriptors");
    }
    drop(held);
    let serving = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && server.counters.accepted == 0 && server.open_on(Listener::Metrics) < 4 {
            server.poll_once(Some(Duration::from_millis(5))).unwrap();
        }
        for _ in 0..200 {
            server.poll_once(Some(Duration::from_millis(5))).unwrap();
        }
        server
    });
    for client in &mut clients {
        client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = String::new();
        client.read_to_string(&mut answer).expect("an answer once descriptors are free");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let server = serving.join().unwrap();
    assert!(server.counters.shed[Listener::Metrics as usize].accept_failed >= 1);
}
