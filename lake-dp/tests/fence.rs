//! A stale-term command replayed to a data plane: a stand-in control plane
//! (a real Unix socket, real frames) sends an eviction of term 5, then one
//! of term 3, as a deposed leader's late command would arrive. The data
//! plane's link runs the first, answers the second `StaleTerm` without
//! running it, and the term it keeps survives a restart of its fence.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

use lake_dp::BlockKey;
use lake_dp::cplink::{CpCommand, CpLink};
use lake_dp::fence::TermFence;
use lake_dp::model::replica::{NodeId, RegionId, Replica, Tier};
use lake_dp::wire::hello::{self, HELLO_WIRE_VERSION, Identity};
use lake_dp::wire::message::{BlockEvicted, ErrorCode, Message, Role};
use lake_dp::wire::{FLAG_REPLY, FrameMeta, Limits, decode_frame, encode_frame};

fn send(stream: &mut UnixStream, meta: FrameMeta, message: &Message<'_>) {
    let mut frame = vec![0u8; 4096];
    let len = encode_frame(meta, message, &mut frame).unwrap();
    stream.write_all(&frame[..len]).unwrap();
}

/// Reads frames until one satisfies `want`; returns it decoded by `want`.
fn read_until<T>(stream: &mut UnixStream, mut want: impl FnMut(&lake_dp::wire::Frame<'_>) -> Option<T>) -> T {
    let mut input = vec![0u8; 1 << 16];
    let mut have = 0;
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    loop {
        while let Ok(frame) = decode_frame(&input[..have], &Limits::default()) {
            let used = frame.len();
            if let Some(found) = want(&frame) {
                return found;
            }
            input.copy_within(used..have, 0);
            have -= used;
        }
        let n = stream.read(&mut input[have..]).expect("the data plane answers");
        assert!(n > 0, "the data plane closed the link");
        have += n;
    }
}

fn evict(slot: u32) -> Message<'static> {
    let replica =
        Replica { tier: Tier::L1Dram, node: NodeId(1), region: RegionId(0), region_epoch: 1, slot, generation: 1 };
    Message::EvictBlock(BlockEvicted {
        replica: replica.to_wire(),
        key: BlockKey([u8::try_from(slot).unwrap_or(0); 16]),
        reason: 1,
        reserved: [0; 7],
    })
}

#[test]
fn a_command_of_an_older_term_is_refused_and_the_term_outlives_a_restart() {
    let dir = std::env::temp_dir().join(format!("lake-fence-link-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("cp.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let leader = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let remote = read_until(&mut stream, |f| match f.message {
            Message::Hello(h) => Some(h),
            _ => None,
        });
        let identity = Identity { role: Role::ControlPlane, node: 1, pid: 1, region_epoch: 0, features: 0, name: "cp" };
        let ack = hello::accept(&hello::hello(&identity).unwrap(), &remote, 5).unwrap();
        let reply = FrameMeta { version: HELLO_WIRE_VERSION, flags: FLAG_REPLY, request_id: 1, leader_term: 5 };
        send(&mut stream, reply, &Message::HelloAck(ack));
        let command = |request_id, leader_term| FrameMeta { version: 1, flags: 0, request_id, leader_term };
        send(&mut stream, command(10, 5), &evict(7));
        // A deposed leader's command, replayed late.
        send(&mut stream, command(11, 3), &evict(8));
        read_until(&mut stream, |f| match f.message {
            Message::TransferDone(done) if f.header.request_id == 11 => Some(done.status),
            _ => None,
        })
    });

    let identity = Identity { role: Role::DataPlane, node: 1, pid: 2, region_epoch: 1, features: 0, name: "dp" };
    let mut link = CpLink::connect(&socket, &identity, Duration::from_secs(10)).unwrap();
    link.fence_with(TermFence::open(&dir).unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut commands = Vec::new();
    while link.counters.stale_terms == 0 || commands.is_empty() {
        assert!(Instant::now() < deadline, "the commands never arrived");
        link.pump().unwrap();
        while let Some(command) = link.next_command() {
            commands.push(command);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // Flush the refusal to the leader.
    let status = loop {
        if leader.is_finished() {
            break leader.join().unwrap();
        }
        // Once the leader has its answer it hangs up: a closed link then.
        let _ = link.pump();
        assert!(Instant::now() < deadline, "the refusal never reached the leader");
        std::thread::sleep(Duration::from_millis(2));
    };
    assert_eq!(status, ErrorCode::StaleTerm as u32, "the older term's command is answered StaleTerm");
    assert_eq!(commands.len(), 1, "only the current term's command runs");
    assert!(matches!(commands[0], CpCommand::Evict { request: 10, .. }), "{:?}", commands[0]);
    assert_eq!(link.term_floor(), 5);
    drop(link);
    // The data plane restarts: term 5 is still the floor.
    let mut fence = TermFence::open(&dir).unwrap();
    assert_eq!(fence.floor(), 5);
    assert!(!fence.admit(4).unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stand-in control plane offering `features`: it answers the hello,
/// then reads frames until a `DataPlaneStats` (sent after any rail report)
/// and says whether a `RailStats` came first, and which paths a
/// `PathLatency` named.
fn control_plane(socket: &std::path::Path, features: u64) -> std::thread::JoinHandle<(bool, Vec<u8>)> {
    let listener = UnixListener::bind(socket).unwrap();
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let remote = read_until(&mut stream, |f| match f.message {
            Message::Hello(h) => Some(h),
            _ => None,
        });
        let identity = Identity { role: Role::ControlPlane, node: 1, pid: 1, region_epoch: 0, features, name: "cp" };
        let ack = hello::accept(&hello::hello(&identity).unwrap(), &remote, 1).unwrap();
        let reply = FrameMeta { version: HELLO_WIRE_VERSION, flags: FLAG_REPLY, request_id: 1, leader_term: 1 };
        send(&mut stream, reply, &Message::HelloAck(ack));
        let (mut rails, mut paths) = (false, Vec::new());
        read_until(&mut stream, |f| match f.message {
            Message::RailStats(..) => {
                rails = true;
                None
            }
            Message::PathLatency(_, entries) => {
                paths = entries.iter().map(|e| e.path).collect();
                None
            }
            Message::DataPlaneStats(_) => Some(()),
            _ => None,
        });
        (rails, paths)
    })
}

#[test]
fn rail_reports_and_path_latencies_go_only_to_a_control_plane_that_takes_them() {
    use lake_dp::wire::message::{Network, Path, PathEntry, RailEntry};
    let dir = std::env::temp_dir().join(format!("lake-rails-feature-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A control plane built before kinds 24 and 27 offers no features (it
    // would close the link on one); one built before the L3 paths offers
    // the first two bits (it refuses path codes 5 and 6); this build's
    // offers them all.
    let first_paths = vec![3, 4];
    let cases = [
        ("old", 0, false, vec![]),
        ("l2-paths", lake_dp::wire::FEATURE_RAIL_STATS | lake_dp::wire::FEATURE_PATH_LATENCY, true, first_paths),
        ("new", lake_dp::wire::FEATURES, true, vec![3, 4, 5, 6]),
    ];
    for (name, features, sent, paths) in cases {
        let socket = dir.join(format!("{name}.sock"));
        let cp = control_plane(&socket, features);
        let identity = Identity {
            role: Role::DataPlane,
            node: 1,
            pid: 2,
            region_epoch: 1,
            features: lake_dp::wire::FEATURES,
            name: "dp",
        };
        let mut link = CpLink::connect(&socket, &identity, Duration::from_secs(10)).unwrap();
        let entry = RailEntry { node: 2, rail: 0, up: 1, reserved: 0, bytes: 4096, breaks: 0 };
        link.rails(Network::Storage, &[entry]);
        let mut timed = PathEntry::new(Path::L2Write);
        timed.record(250_000);
        let mut l3 = PathEntry::new(Path::L3Read);
        l3.record(9_000_000);
        link.path_latency(&[timed, PathEntry::new(Path::TransferStorage), l3, PathEntry::new(Path::L3Write)]);
        link.stats(&bytemuck::Zeroable::zeroed());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cp.is_finished() {
            assert!(Instant::now() < deadline, "the stand-in never got the stats");
            let _ = link.pump();
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(cp.join().unwrap(), (sent, paths), "{name} control plane");
        assert_eq!(link.counters.rails_withheld, u64::from(!sent), "{name} control plane");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
