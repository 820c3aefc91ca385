//! Tries to use a pool's local sockets and shared memory as whoever runs
//! it (the local access test runs it as another user): opens the arena's
//! and the mirror's files by their paths, attaches as an agent to
//! `lake-dp`'s socket and, attached, saves two blocks and loads them back,
//! then says hello to `lake-cp`'s socket. Prints one line for each —
//! `arena open: ok|denied`, `mirror open: ok|denied`, `dp attached`,
//! `round trip: exact|failed: WHY`, `dp refused: WHY`, `cp answered`, `cp
//! closed` — then exits 0.
//!
//! Usage: lake-attach-probe DP_SOCKET CP_SOCKET MIRROR ARENA

use std::io::{Read, Write};
use std::path::Path;

use lake_agent::{Agent, AgentConfig};
use lake_dp::model::replica::ObjectKind;
use lake_dp::wire::hello::{HELLO_WIRE_VERSION, Identity};
use lake_dp::wire::message::{Message, Role};
use lake_dp::wire::{FrameMeta, encode_frame};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dp, cp, mirror, arena] = &args[..] else {
        eprintln!("usage: lake-attach-probe DP_SOCKET CP_SOCKET MIRROR ARENA");
        std::process::exit(2);
    };
    for (name, path) in [("arena", arena), ("mirror", mirror)] {
        match std::fs::OpenOptions::new().read(true).open(path) {
            Ok(_) => println!("{name} open: ok"),
            Err(e) => println!("{name} open: denied ({e})"),
        }
    }
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
        Ok(mut agent) => {
            println!("dp attached");
            match round_trip(&mut agent) {
                Ok(()) => println!("round trip: exact"),
                Err(why) => println!("round trip: failed: {why}"),
            }
        }
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

/// Saves two blocks of 4 KiB through `agent` and loads them back.
fn round_trip(agent: &mut Agent) -> Result<(), String> {
    use lake_agent::{SaveBlock, SavePayload};
    let keys = [lake_dp::BlockKey([0x5a; 16]), lake_dp::BlockKey([0x5b; 16])];
    let payloads = [vec![0x11u8; 4096], vec![0x22u8; 4096]];
    let blocks: Vec<SaveBlock<'_>> = (0..2u32)
        .map(|i| SaveBlock {
            key: keys[i as usize],
            parent: if i == 0 { lake_dp::BlockKey::NONE } else { keys[0] },
            block_index: i,
            payload: SavePayload::Bytes(&payloads[i as usize]),
        })
        .collect();
    if agent.save(&blocks) != 2 {
        return Err("not saved".into());
    }
    let mut table = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < 2 {
        if std::time::Instant::now() > deadline {
            return Err("not published".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let mut exact = true;
    let loaded = agent.fetch(&keys, &table, |i, bytes| exact &= bytes == &payloads[i][..]);
    if loaded == 2 && exact { Ok(()) } else { Err(format!("{loaded} of 2 loaded, exact: {exact}")) }
}
