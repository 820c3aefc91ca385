//! One valid frame of every message kind: the seed corpus of the wire fuzz
//! target and the fixtures of the round-trip tests.

use super::message::*;
use super::{FLAG_REPLY, FrameMeta, WIRE_VERSION_MAX, encode_frame};
use crate::model::key::BlockKey;
use crate::model::replica::{NodeId, RegionId, Replica, ReplicaWire, Tier};

fn replica(tier: Tier, slot: u32) -> ReplicaWire {
    Replica { tier, node: NodeId(2), region: RegionId(1), region_epoch: 9, slot, generation: 3 }.to_wire()
}

fn key(n: u8) -> BlockKey {
    BlockKey([n; 16])
}

/// Every kind once, with its frame meta, handed to `visit`.
pub fn each_message(mut visit: impl FnMut(FrameMeta, Message<'_>)) {
    let meta = |request_id| FrameMeta { version: WIRE_VERSION_MAX, flags: 0, request_id, leader_term: 4 };
    let reply = |request_id| FrameMeta { flags: FLAG_REPLY, ..meta(request_id) };
    let name = |s: &str| text_field::<32>("sample", s).unwrap_or([0; 32]);
    let hello = Hello {
        role: Role::Agent as u8,
        reserved_a: [0; 3],
        version_min: 1,
        version_max: 1,
        node: 2,
        pid: 1234,
        region_epoch: 0,
        features: 1,
        frame_bytes_max: 1 << 20,
        reserved_b: 0,
        name: name("vllm-worker-0"),
    };
    visit(meta(1), Message::Hello(hello));
    visit(
        reply(1),
        Message::HelloAck(HelloAck {
            version: 1,
            role: Role::DataPlane as u8,
            reserved_a: 0,
            node: 2,
            region_epoch: 9,
            features: 1,
            leader_term_seen: 4,
            frame_bytes_max: 1 << 20,
            reserved_b: 0,
        }),
    );
    visit(
        meta(2),
        Message::RegisterRegion(RegisterRegion {
            region: 1,
            tier: Tier::L1Dram as u8,
            reserved_a: 0,
            node: 2,
            region_epoch: 9,
            slot_bytes: 2 << 20,
            slot_count: 512,
            reserved_b: 0,
            name: text_field::<48>("sample", "/dev/shm/lake-l1").unwrap_or([0; 48]),
        }),
    );
    let record = BlockRecord {
        replica: replica(Tier::L2Nvme, 77),
        key: key(1),
        parent_key: key(0),
        namespace: 0xabc,
        layout_fingerprint: 0xdef,
        payload_len: 2 << 20,
        block_index: 1,
        kind: 1,
        durability: 1,
        flags: 0,
    };
    visit(meta(3), Message::BlockCommitted(record));
    visit(meta(4), Message::BlockReadopted(BlockRecord { flags: BLOCK_FLAG_VERIFIED, ..record }));
    visit(
        meta(5),
        Message::BlockEvicted(BlockEvicted {
            replica: replica(Tier::L1Dram, 5),
            key: key(1),
            reason: EvictReason::Demoted as u8,
            reserved: [0; 7],
        }),
    );
    let transfer = Transfer {
        source: replica(Tier::L2Nvme, 77),
        target: ReplicaWire { slot: SLOT_ANY, ..replica(Tier::L1Dram, 0) },
        key: key(1),
        deadline_unix_ns: 1_764_000_000_000_000_000,
        priority: 0,
        reserved: [0; 7],
    };
    visit(meta(6), Message::MoveBlock(transfer));
    visit(meta(7), Message::CopyBlock(Transfer { priority: 4, ..transfer }));
    visit(
        reply(7),
        Message::TransferDone(TransferDone {
            status: 0,
            reserved: 0,
            target: replica(Tier::L1Dram, 8),
            bytes: 2 << 20,
        }),
    );
    visit(meta(8), Message::Cancel(Cancel { request_id: 7 }));
    let keys = [key(1), key(2), key(3)];
    visit(
        meta(9),
        Message::LeaseRequest(LeaseRequest { namespace: 0xabc, ttl_ms: 5000, count: 3 }, Records::from_slice(&keys)),
    );
    let leased = [LeaseEntry { key: key(1), replica: replica(Tier::L2Nvme, 77) }];
    visit(
        reply(9),
        Message::LeaseGrant(
            LeaseGrant { lease_id: 55, deadline_unix_ns: 1_764_000_005_000_000_000, count: 1, reserved: 0 },
            Records::from_slice(&leased),
        ),
    );
    visit(meta(10), Message::LeaseRelease(LeaseRelease { lease_id: 55 }));
    visit(
        meta(11),
        Message::PinDrop(PinDrop {
            agent: 3,
            pin_index: PIN_INDEX_ALL,
            slot: 0,
            generation: 0,
            region: 0,
            reserved: [0; 6],
        }),
    );
    visit(meta(12), Message::Lookup(Lookup { namespace: 0xabc, count: 3, flags: 0 }, Records::from_slice(&keys)));
    let hits = [
        LookupEntry { key: key(1), replica: replica(Tier::L1Dram, 8), layout_fingerprint: 0xdef },
        LookupEntry { key: key(2), replica: replica(Tier::L2Nvme, 78), layout_fingerprint: 0xdef },
    ];
    visit(reply(12), Message::LookupReply(LookupReply { count: 2, hit_blocks: 2 }, Records::from_slice(&hits)));
    let changes = [DeltaEntry {
        op: DeltaOp::Add as u8,
        durability: 2,
        kind: 1,
        block_index: 0,
        key: key(1),
        parent_key: BlockKey::NONE,
        namespace: 0xabc,
        layout_fingerprint: 0xdef,
        replica: replica(Tier::L2Nvme, 77),
    }];
    visit(meta(13), Message::Delta(Delta { term: 4, sequence: 100, node: 2, count: 1 }, Records::from_slice(&changes)));
    visit(
        meta(14),
        Message::EvictBlock(BlockEvicted {
            replica: replica(Tier::L2Nvme, 77),
            key: key(1),
            reason: EvictReason::Capacity as u8,
            reserved: [0; 7],
        }),
    );
    visit(
        meta(15),
        Message::Accessed(Accessed { namespace: 0xabc, hit_blocks: 2, count: 3 }, Records::from_slice(&keys)),
    );
    visit(
        meta(16),
        Message::DataPlaneStats(DataPlaneStats {
            busy_ns: 1_000_000,
            idle_ns: 2_000_000,
            parked_ns: 97_000_000,
            bytes_l1_to_l2: 1 << 30,
            bytes_l2_to_l1: 1 << 29,
            saves: 4096,
            saves_refused: 3,
            commits_corrupt: 0,
            promotions: 2048,
            demotions: 4000,
            evictions: 100,
            pins: 12,
            draining: 2,
        }),
    );
    visit(
        reply(1),
        Message::Attached(Attached { port: 3, depth: 256, epoch: 9, arena_region: 0, partition: 0, reserved: [0; 5] }),
    );
    visit(
        reply(6),
        Message::Error(ErrorBody {
            code: ErrorCode::StaleGeneration as u32,
            reserved: 0,
            failed_request: 6,
            detail: text_field::<48>("sample", "slot 77 generation 3 is gone").unwrap_or([0; 48]),
        }),
    );
    visit(
        meta(15),
        Message::Resident(Resident { namespace: 0xabc, resident: 1, count: 3 }, Records::from_slice(&keys)),
    );
    let rails = [
        RailEntry { node: 2, rail: 0, up: 1, reserved: 0, bytes: 1 << 30, breaks: 0 },
        RailEntry { node: 2, rail: 1, up: 0, reserved: 0, bytes: 1 << 20, breaks: 3 },
    ];
    visit(
        meta(17),
        Message::RailStats(
            RailStats { count: 2, network: Network::Storage as u8, reserved: [0; 3] },
            Records::from_slice(&rails),
        ),
    );
    let snapshot = [DeltaEntry {
        op: DeltaOp::Add as u8,
        durability: 1,
        kind: 1,
        block_index: 3,
        key: key(5),
        parent_key: key(4),
        namespace: 0xabc,
        layout_fingerprint: 0xdef,
        replica: replica(Tier::L1Dram, 12),
    }];
    visit(
        meta(30),
        Message::Snapshot(Delta { term: 4, sequence: 100, node: 2, count: 1 }, Records::from_slice(&snapshot)),
    );
    visit(reply(30), Message::SnapshotRequest(SnapshotRequest { node: 2, reserved: 0, term: 4 }));
    let mut critical = PathEntry::new(Path::L2ReadCritical);
    for ns in [800, 120_000, 450_000, 2_000_000] {
        critical.record(ns);
    }
    let paths = [critical, PathEntry::new(Path::TransferStorage)];
    visit(meta(18), Message::PathLatency(PathLatency { count: 2, reserved: 0 }, Records::from_slice(&paths)));
    visit(meta(31), Message::DrainRegion(DrainRegion { region: 3, draining: 1, reserved: [0; 5] }));
    visit(meta(32), Message::SaveRefusals(SaveRefusals { no_space: 40, load_reserve: 2, stopping: 1, over_quota: 0 }));
    visit(meta(0), Message::VictimsLeft(VictimsLeft { region: 1, left: 0, reserved: [0; 5] }));
    let mut batch = TenantThrottle { name: [0; TENANT_NAME_BYTES], waits: [3, 0, 1, 0, 7] };
    batch.name[..5].copy_from_slice(b"batch");
    visit(meta(18), Message::TenantThrottles(TenantThrottles { count: 1, reserved: 0 }, Records::from_slice(&[batch])));
    let caps = [
        PushCap { namespace: 0xab, tenant: 0, reserved: 0, bytes_per_s: 1 << 20 },
        PushCap { namespace: 0xcd, tenant: 0, reserved: 0, bytes_per_s: 1 << 20 },
    ];
    visit(reply(1), Message::PushCaps(PushCaps { count: 2, reserved: 0 }, Records::from_slice(&caps)));
    let mut waits = TenantWait { name: batch.name, waits: [3, 0, 1, 0, 7, 12, 0, 0] };
    waits.name[5] = b'2';
    visit(meta(18), Message::TenantWaits(TenantThrottles { count: 1, reserved: 0 }, Records::from_slice(&[waits])));
    let victim = BlockEvicted {
        replica: replica(Tier::L1Dram, 12),
        key: key(2),
        reason: EvictReason::Demoted as u8,
        reserved: [0; 7],
    };
    visit(meta(14), Message::MarkEvictable(victim));
    visit(meta(14), Message::UnmarkEvictable(victim));
    let shed = ConnectionsShed { attach_crowded_out: 37, transport_over_cap: 844, ..ConnectionsShed::default() };
    visit(meta(0), Message::ConnectionsShed(shed));
    let view = [
        ViewEntry { key: key(5), tier: Tier::L1Dram as u8, kind: 1, reserved: [0; 6] },
        ViewEntry { key: key(6), tier: VIEW_TIER_NONE, kind: 1, reserved: [0; 6] },
    ];
    visit(meta(40), Message::ViewDelta(Delta { term: 7, sequence: 12, node: 2, count: 2 }, Records::from_slice(&view)));
    visit(
        meta(41),
        Message::ViewSnapshot(Delta { term: 7, sequence: 13, node: 2, count: 1 }, Records::from_slice(&view[..1])),
    );
    let named = [
        NamedViewEntry { key: key(5), namespace: 0x5eed, tier: Tier::L2Nvme as u8, kind: 1, reserved: [0; 6] },
        NamedViewEntry { key: key(6), namespace: 31, tier: VIEW_TIER_NONE, kind: 1, reserved: [0; 6] },
    ];
    let head = Delta { term: 7, sequence: 14, node: 3, count: 2 };
    visit(meta(42), Message::ViewDeltaNamed(head, Records::from_slice(&named)));
    let head = Delta { sequence: 15, count: 1, ..head };
    visit(meta(43), Message::ViewSnapshotNamed(head, Records::from_slice(&named[1..])));
    let apart = [
        KeptApartEntry { namespace: 0xa1, tenant: KeptApartEntry::tenant_of("acme") },
        KeptApartEntry { namespace: 0xa2, tenant: KeptApartEntry::tenant_of("acme") },
    ];
    visit(meta(0), Message::KeptApart(KeptApart { count: 2, reserved: 0 }, Records::from_slice(&apart)));
}

/// [`each_message`] encoded: one frame per kind.
pub fn frames() -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    each_message(|meta, message| {
        let mut buf = vec![0u8; 4096];
        // Samples are small and valid by construction; an error here is a
        // bug in this file and shows as a missing frame in the tests.
        if let Ok(len) = encode_frame(meta, &message, &mut buf) {
            buf.truncate(len);
            frames.push(buf);
        }
    });
    frames
}
