//! Agents in other processes: an engine attaches to `lake-dp` over its
//! attach socket and gets the arena, a port in shared memory and the
//! wake-up eventfd; saves, lookups and fetches then cross shared memory
//! only. An agent process killed while it holds a pin loses it: the
//! data plane's metrics show the pin, then none. Blocks an engine reports
//! resident in its own GPU memory (advisory L0) show in `lake-cp`'s
//! metrics until it reports them gone or dies.
//!
//! The killed agent is this test binary run again as a child (`AGENT_CHILD`
//! in its environment), so it is a real second process.

use std::path::Path;
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, AttachError, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::wire::message::ErrorCode;
use lake_dp::{BlockKey, NamespaceId};

#[path = "common/metrics.rs"]
mod metrics;

use metrics::metric;

const PAYLOAD: usize = 40 * 1024;

fn key(block: u32) -> BlockKey {
    let mut bytes = [0xa7; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    BlockKey(bytes)
}

fn payload(key: &BlockKey) -> Vec<u8> {
    (0..PAYLOAD).map(|i| key.0[i % 4] ^ (i / 3).to_le_bytes()[0]).collect()
}

fn agent_config<'a>(mirror: &'a Path, cp: &'a Path) -> AgentConfig<'a> {
    AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror,
        cp_socket: Some(cp),
        name: "remote-engine",
        namespace: NamespaceId(11),
        layout_fingerprint: 0xabc,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    }
}

/// The child: attach, report blocks 0..4 resident in its GPU, pin block 0
/// through a fetch, and sleep in it until killed.
fn child(dp: &Path, mirror: &Path, cp: &Path) {
    let mut agent = Agent::connect(&agent_config(mirror, cp), dp).expect("the child attaches");
    assert!(agent.report_resident(&(0..4).map(key).collect::<Vec<_>>(), true));
    agent.pump();
    let keys = [key(0)];
    let mut table = Vec::new();
    assert_eq!(agent.lookup(&keys, &mut table), 1);
    agent.fetch(&keys, &table, |_, _| {
        println!("PINNED");
        std::thread::sleep(Duration::from_secs(60));
    });
}

#[test]
fn an_agent_in_another_process_saves_and_loads_and_its_pins_die_with_it() {
    if let Ok(paths) = std::env::var("AGENT_CHILD") {
        let parts: Vec<&str> = paths.split('|').collect();
        child(Path::new(parts[0]), Path::new(parts[1]), Path::new(parts[2]));
        return;
    }
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: 40960,
        l1_slots: 32,
        l2_slots_per_file: 32,
        remote_agents: 4,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-remote-{}", std::process::id())))
    })
    .unwrap();
    let metrics = pool.metrics.unwrap();
    let (dp_socket, cp_socket, mirror_path) = (pool.dp_socket.clone(), pool.cp_socket.clone(), pool.mirror.clone());

    // This process as an engine: attached over the socket, not in-process.
    let mut agent = Agent::connect(&agent_config(&mirror_path, &cp_socket), &dp_socket).unwrap();
    assert!(agent.data_plane_alive());
    let keys: Vec<BlockKey> = (0..6).map(key).collect();
    let payloads: Vec<Vec<u8>> = keys.iter().map(payload).collect();
    let blocks: Vec<SaveBlock<'_>> = (0..6)
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: SavePayload::Bytes(&payloads[i]),
        })
        .collect();
    assert_eq!(agent.save(&blocks), 6);
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < 6 {
        assert!(Instant::now() < deadline, "the saves were not published");
        std::thread::sleep(Duration::from_millis(5));
    }
    let delivered = agent.fetch(&keys, &table, |i, bytes| assert_eq!(bytes, &payloads[i][..], "block {i}"));
    assert_eq!(delivered, 6);

    // This engine keeps blocks 2..6 in its GPU, then frees block 5.
    let wait_for = |name: &str, value: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while metric(metrics, name) != Some(value) {
            assert!(Instant::now() < deadline, "{name} never became {value}: {:?}", metric(metrics, name));
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert!(agent.report_resident(&keys[2..6], true));
    agent.pump();
    wait_for("lake_l0_blocks", 4);
    assert!(agent.report_resident(&keys[5..6], false));
    agent.pump();
    wait_for("lake_l0_blocks", 3);

    // Another process pins block 0 and is killed holding it.
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe)
        .args(["--exact", "an_agent_in_another_process_saves_and_loads_and_its_pins_die_with_it", "--nocapture"])
        .env("AGENT_CHILD", format!("{}|{}|{}", dp_socket.display(), mirror_path.display(), cp_socket.display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(metrics, "lake_dp_pins") != Some(1) {
        assert!(Instant::now() < deadline, "the child's pin never showed: {:?}", metric(metrics, "lake_dp_pins"));
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its GPU holds 0..4, this one 2..5: five keys, two engines.
    wait_for("lake_l0_blocks", 5);
    wait_for("lake_l0_engines", 2);
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(metrics, "lake_dp_pins") != Some(0) {
        assert!(Instant::now() < deadline, "the dead child's pin stayed");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its L0 blocks went with it; this engine's stay.
    wait_for("lake_l0_blocks", 3);
    wait_for("lake_l0_engines", 1);
    // A peer speaking only a wire version this lake-dp does not is refused
    // by name at hello, and nothing else changes.
    {
        use lake_dp::wire::message::Role;
        use lake_dp::wire::{FrameMeta, Limits, Message, decode_frame, encode_frame};
        use std::io::{Read, Write};
        let identity = lake_dp::wire::hello::Identity {
            role: Role::Agent,
            node: 0,
            pid: 1,
            region_epoch: 0,
            features: 0,
            name: "future",
        };
        let mut hello = lake_dp::wire::hello::hello(&identity).unwrap();
        hello.version_min = 200;
        hello.version_max = 201;
        let mut frame = [0u8; 256];
        let meta =
            FrameMeta { version: lake_dp::wire::hello::HELLO_WIRE_VERSION, flags: 0, request_id: 1, leader_term: 0 };
        let len = encode_frame(meta, &Message::Hello(hello), &mut frame).unwrap();
        let mut stream = std::os::unix::net::UnixStream::connect(&dp_socket).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        stream.write_all(&frame[..len]).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        let frame = decode_frame(&answer, &Limits::default()).unwrap();
        let Message::Error(error) = frame.message else { panic!("{:?}", frame.message) };
        assert_eq!(error.code, ErrorCode::VersionMismatch as u32, "{}", error.detail());
    }
    // This agent is unaffected.
    assert_eq!(agent.lookup(&keys, &mut table), 6);
    assert_eq!(agent.fetch(&keys, &table, |i, bytes| assert_eq!(bytes, &payloads[i][..])), 6);

    // Engines that find every agent port taken are told so by name (try
    // again later), and attach once a port is given back.
    let mut others = Vec::new();
    let refused = loop {
        match Agent::connect(&agent_config(&mirror_path, &cp_socket), &dp_socket) {
            Ok(other) => others.push(other),
            Err(e) => break e,
        }
        assert!(others.len() < 4, "a pool of 4 agent ports took a fifth agent");
    };
    assert!(matches!(refused, AttachError::Refused { code: Some(ErrorCode::QueueFull), .. }), "{refused}");
    assert_eq!(others.len(), 3, "the dead child's port was not given back: {refused}");
    others.pop();
    let deadline = Instant::now() + Duration::from_secs(10);
    let again = loop {
        match Agent::connect(&agent_config(&mirror_path, &cp_socket), &dp_socket) {
            Ok(again) => break again,
            Err(AttachError::Refused { code: Some(ErrorCode::QueueFull), .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("a port given back was not taken again: {e}"),
        }
    };
    drop((others, again));

    let (stats, _server) = pool.stop().unwrap();
    assert!(!agent.data_plane_alive(), "the runner is gone and the agent can tell");
    drop(agent);
    assert_eq!(stats.agents_attached, 6);
    assert!(stats.agents_released >= 1, "{stats:?}");
    assert_eq!(stats.pool.saves, 6);
}

/// Held to one port a user: a second engine of the same user is refused
/// `QueueFull` (saying why) with ports free, and attaches once the first
/// has detached.
#[test]
fn a_user_held_to_one_port_gets_no_second_until_the_first_goes() {
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: 40960,
        l1_slots: 32,
        l2_slots_per_file: 32,
        remote_agents: 4,
        access: lake_cp::embedded::LocalAccess { ports_per_uid: Some(1), ..Default::default() },
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-per-uid-{}", std::process::id())))
    })
    .unwrap();
    let config = agent_config(&pool.mirror, &pool.cp_socket);
    let first = Agent::connect(&config, &pool.dp_socket).unwrap();
    let refused = Agent::connect(&config, &pool.dp_socket).map(|_| ()).unwrap_err();
    assert!(
        matches!(&refused, AttachError::Refused { code: Some(ErrorCode::QueueFull), detail, .. }
        if detail.contains("this user holds")),
        "{refused}"
    );
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Agent::connect(&config, &pool.dp_socket) {
            Ok(_) => break,
            Err(AttachError::Refused { code: Some(ErrorCode::QueueFull), .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("the user's port given back was not taken again: {e}"),
        }
    }
    pool.stop().unwrap();
}
