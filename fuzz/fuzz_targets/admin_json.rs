//! The operator's socket: arbitrary lines as requests to a control plane
//! holding a few blocks in L1 and L2. Never a panic; every answer is one
//! JSON object; the tier manager's counts stay consistent whatever
//! purges, persists and drains the lines ask for.

#![no_main]

use lake_cp::admin::respond;
use lake_cp::node::Node;
use lake_cp::server::ServerCounters;
use lake_dp::model::replica::ReplicaWire;
use lake_dp::wire::Message;
use lake_dp::wire::message::{BlockRecord, RegisterRegion};
use lake_dp::{BlockKey, Durability, NodeId, ObjectKind, Tier};
use libfuzzer_sys::fuzz_target;

fn node() -> Node {
    let mut node = Node::new(NodeId(3), 1, None);
    for (id, tier) in [(1u16, Tier::L1Dram), (2, Tier::L2Nvme)] {
        let mut name = [0u8; 48];
        name[..4].copy_from_slice(b"disk");
        let region = RegisterRegion {
            region: id,
            tier: tier as u8,
            reserved_a: 0,
            node: 3,
            region_epoch: 5,
            slot_bytes: 65536,
            slot_count: 64,
            reserved_b: 0,
            name,
        };
        let _ = node.on_data_plane(0, &Message::RegisterRegion(region));
    }
    for k in 0..6u8 {
        let (tier, region) = if k % 2 == 0 { (Tier::L1Dram, 1) } else { (Tier::L2Nvme, 2) };
        let block = BlockRecord {
            replica: ReplicaWire {
                tier: tier as u8,
                reserved: 0,
                region,
                node: 3,
                region_epoch: 5,
                slot: u32::from(k),
                generation: 1,
            },
            key: BlockKey([k + 1; 16]),
            parent_key: if k == 0 { BlockKey::NONE } else { BlockKey([k; 16]) },
            namespace: 0x7e7e,
            layout_fingerprint: 2,
            payload_len: 4096,
            block_index: u32::from(k),
            kind: ObjectKind::KvBlock as u16,
            durability: Durability::Acked as u8,
            flags: 0,
        };
        let _ = node.on_data_plane(0, &Message::BlockCommitted(block));
    }
    node
}

fuzz_target!(|data: &[u8]| {
    let mut node = node();
    let counters = ServerCounters::default();
    for line in data.split(|&b| b == b'\n').take(64) {
        let answer = respond(&mut node, &counters, &[], line);
        assert!(answer.is_object(), "{answer}");
        node.tiers.assert_invariants();
    }
});
