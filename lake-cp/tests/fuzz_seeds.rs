//! The `cp_session` fuzz target's seeds (`fuzz/seeds/cp_session/`) are
//! real streams a `lake-dp` sends, made by this build: this test fails
//! when they go stale; `LAKE_UPDATE_SEEDS=1 cargo test -p lake-cp --test
//! fuzz_seeds` rewrites them. Each seed starts with the read size.

use std::path::PathBuf;

use lake_cp::node::Node;
use lake_cp::server::{Context, Flow, ServerCounters, Session};
use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::hello::{Identity, hello};
use lake_dp::wire::message::{BlockEvicted, BlockRecord, RegisterRegion, Role};
use lake_dp::wire::{FrameMeta, Message, encode_frame};
use lake_dp::{BlockKey, Durability, NodeId, ObjectKind, Tier};

fn frame(out: &mut Vec<u8>, request: u64, message: &Message<'_>) {
    let mut buf = vec![0u8; 4096];
    let len = encode_frame(FrameMeta { version: 1, flags: 0, request_id: request, leader_term: 0 }, message, &mut buf)
        .unwrap();
    out.extend_from_slice(&buf[..len]);
}

fn block(k: u8, parent: Option<u8>, tier: Tier, region: u16, slot: u32) -> BlockRecord {
    BlockRecord {
        replica: ReplicaWire { tier: tier as u8, reserved: 0, region, node: 3, region_epoch: 5, slot, generation: 1 },
        key: BlockKey([k; 16]),
        parent_key: parent.map_or(BlockKey::NONE, |p| BlockKey([p; 16])),
        namespace: 1,
        layout_fingerprint: 2,
        payload_len: 4096,
        block_index: u32::from(k),
        kind: ObjectKind::KvBlock as u16,
        durability: Durability::Acked as u8,
        flags: 0,
    }
}

fn streams() -> Vec<Vec<u8>> {
    let identity = Identity { role: Role::DataPlane, node: 3, pid: 1, region_epoch: 5, features: 0, name: "dp" };
    let mut stream = Vec::new();
    frame(&mut stream, 1, &Message::Hello(hello(&identity).unwrap()));
    for (id, tier) in [(1u16, Tier::L1Dram), (2, Tier::L2Nvme)] {
        let region = RegisterRegion {
            region: id,
            tier: tier as u8,
            reserved_a: 0,
            node: 3,
            region_epoch: 5,
            slot_bytes: 65536,
            slot_count: 64,
            reserved_b: 0,
            name: [0; 48],
        };
        frame(&mut stream, 2, &Message::RegisterRegion(region));
    }
    frame(&mut stream, 3, &Message::BlockReadopted(block(2, Some(1), Tier::L2Nvme, 2, 11)));
    frame(&mut stream, 4, &Message::BlockReadopted(block(1, None, Tier::L2Nvme, 2, 10)));
    frame(&mut stream, 5, &Message::BlockCommitted(block(2, Some(1), Tier::L1Dram, 1, 3)));
    let evicted = BlockEvicted {
        replica: block(2, Some(1), Tier::L1Dram, 1, 3).replica,
        key: BlockKey([2; 16]),
        reason: 1,
        reserved: [0; 7],
    };
    frame(&mut stream, 6, &Message::BlockEvicted(evicted));
    vec![stream]
}

#[test]
fn cp_session_seeds_are_current() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/cp_session");
    let seeds = streams();
    if std::env::var_os("LAKE_UPDATE_SEEDS").is_some() {
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in seeds.iter().enumerate() {
            let mut bytes = vec![37u8]; // reads of 37 bytes: frames split across reads
            bytes.extend_from_slice(seed);
            std::fs::write(dir.join(format!("seed-{i:02}")), bytes).unwrap();
        }
    }
    let identity = Identity { role: Role::ControlPlane, node: 3, pid: 1, region_epoch: 0, features: 0, name: "cp" };
    let local = hello(&identity).unwrap();
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        let mut node = Node::new(NodeId(3), 1, None);
        let mut counters = ServerCounters::default();
        let mut session = Session::new(1);
        let mut out = Vec::new();
        for piece in bytes[1..].chunks(usize::from(bytes[0]).max(1)) {
            let mut ctx = Context { node: &mut node, local_hello: &local, term: 1, now_ns: 0, counters: &mut counters };
            assert_eq!(session.feed(piece, &mut ctx, &mut out), Flow::Open, "stale seed in {}", dir.display());
        }
        assert_eq!(node.counters.readopted, 2, "the seed's blocks all apply");
        assert_eq!((node.counters.committed, node.counters.evicted), (1, 1));
        count += 1;
    }
    assert_eq!(count, seeds.len());
}

/// The `summary_checkpoint` target's seeds: a checkpoint of two nodes, one
/// a lapsed member, written by this build (`seed-00`); the same with node
/// 1 keeping a tenant's namespace apart (`seed-01`).
#[test]
fn summary_checkpoint_seeds_are_current() {
    use lake_cp::summary::Summary;
    use lake_dp::wire::message::{Delta, DeltaEntry, DeltaOp};

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/summary_checkpoint");
    let mut summary = Summary::new();
    for node in [1u32, 2] {
        let entries: Vec<DeltaEntry> = [(Tier::L1Dram, 1u16), (Tier::L2Nvme, 2), (Tier::L3Object, 9)]
            .iter()
            .enumerate()
            .map(|(i, &(tier, region))| DeltaEntry {
                op: DeltaOp::Add as u8,
                durability: Durability::Acked as u8,
                kind: ObjectKind::KvBlock as u16,
                block_index: 0,
                key: BlockKey([u8::try_from(i).unwrap() + 1; 16]),
                parent_key: BlockKey::NONE,
                namespace: 0,
                layout_fingerprint: 0,
                replica: ReplicaWire {
                    tier: tier as u8,
                    reserved: 0,
                    region,
                    node,
                    region_epoch: 5,
                    slot: 7,
                    generation: 1,
                },
            })
            .collect();
        let head = Delta { term: 4, sequence: 1, node, count: 3 };
        summary.delta(&head, entries);
    }
    summary.membership(&[2]);
    let plain = summary.checkpoint(11);
    let acme = lake_dp::wire::message::KeptApartEntry { namespace: 0xa1, tenant: 0xac };
    summary.kept_apart(1, [acme]);
    for (name, seed) in [("seed-00", plain), ("seed-01", summary.checkpoint(11))] {
        if std::env::var_os("LAKE_UPDATE_SEEDS").is_some() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(name), &seed).unwrap();
        }
        let committed = std::fs::read(dir.join(name)).unwrap();
        assert_eq!(committed, seed, "stale seed {name} in {}", dir.display());
        let (back, term) = Summary::restore(&committed).unwrap();
        assert_eq!((term, back.nodes()), (11, vec![1, 2]));
    }
}

/// The `config_toml` seeds are files this build takes (`lake serve`'s, or
/// `lake-dp`'s own); the `admin_json` seeds are requests the operator's
/// socket knows.
#[test]
fn config_and_admin_seeds_are_taken() {
    let seeds = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds");
    let mut taken = 0;
    for entry in std::fs::read_dir(seeds.join("config_toml")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if text.contains("[node]") {
            let config = lake_dp::runner::config::RunnerConfig::parse(&text).unwrap();
            config.check().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        } else {
            let mut argv = Vec::new();
            argv.extend(lake_cp::config::text_args(&text, "seed").unwrap_or_else(|e| panic!("{e}")));
            lake_cp::config::ServeArgs::parse(&argv).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        taken += 1;
    }
    assert!(taken >= 3);
    let requests = std::fs::read_to_string(seeds.join("admin_json/requests")).unwrap();
    let mut node = Node::new(NodeId(3), 1, None);
    for line in requests.lines() {
        let answer = lake_cp::admin::respond(&mut node, &ServerCounters::default(), &[], line.as_bytes());
        let error = answer.get("error").and_then(serde_json::Value::as_str).unwrap_or_default();
        assert!(!error.contains("unknown") && !error.contains("not a JSON"), "{line}: {answer}");
    }
}
