//! Tries to use a pool's local sockets as whoever runs it (the local
//! access test runs it as another user): attaches as an agent to
//! `lake-dp`'s socket, then says hello to `lake-cp`'s, and prints one
//! line for each — `dp attached`, `dp refused: WHY`, `cp answered`, `cp
//! closed` — then exits 0.
//!
//! Usage: lake-attach-probe DP_SOCKET CP_SOCKET MIRROR

use std::io::{Read, Write};
use std::path::Path;

use lake_agent::{Agent, AgentConfig};
use lake_dp::model::replica::ObjectKind;
use lake_dp::wire::hello::{HELLO_WIRE_VERSION, Identity};
use lake_dp::wire::message::{Message, Role};
use lake_dp::wire::{FrameMeta, encode_frame};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dp, cp, mirror] = &args[..] else {
        eprintln!("usage: lake-attach-probe DP_SOCKET CP_SOCKET MIRROR");
        std::process::exit(2);
    };
    let config = AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(mirror),
        cp_socket: None,
        name: "probe",
        namespace: lake_dp::NamespaceId(1),
        layout_fingerprint: 1,
        segment_bytes: 4096,
        object_kind: ObjectKind::KvBlock,
    };
    match Agent::connect(&config, Path::new(dp)) {
        Ok(_) => println!("dp attached"),
        Err(e) => println!("dp refused: {e}"),
    }
    let identity =
        Identity { role: Role::Agent, node: 0, pid: std::process::id(), region_epoch: 0, features: 0, name: "probe" };
    let mut frame = [0u8; 256];
    let meta = FrameMeta { version: HELLO_WIRE_VERSION, flags: 0, request_id: 1, leader_term: 0 };
    let hello = lake_dp::wire::hello::hello(&identity).expect("a hello");
    let len = encode_frame(meta, &Message::Hello(hello), &mut frame).expect("a frame");
    match std::os::unix::net::UnixStream::connect(cp) {
        Err(e) => println!("cp closed: {e}"),
        Ok(mut stream) => {
            let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
            let _ = stream.write_all(&frame[..len]);
            let mut answer = [0u8; 256];
            match stream.read(&mut answer) {
                Ok(n) if n > 0 => println!("cp answered"),
                Ok(_) => println!("cp closed"),
                Err(e) => println!("cp closed: {e}"),
            }
        }
    }
}
