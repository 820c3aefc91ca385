//! RDMA READs between two queue pairs of one device (built with the `rdma`
//! feature): a stored object exported by one "node" is read into the
//! other's slot, checked there and published; a slot reused since its
//! name was given is refused, never published. Where no RDMA device
//! exists — this machine and CI — it prints why it skipped.

#![cfg(feature = "rdma")]
#![allow(clippy::cast_possible_truncation)] // small test sizes

use lake_dp::model::replica::ObjectKind;
use lake_dp::stored::{ObjectMeta, decode_object, encode_object};
use lake_dp::transport::frame::{AckStatus, BlockAddr};
use lake_dp::transport::rdma::Endpoint;
use lake_dp::transport::rdma::verbs::{Device, QueuePair, RdmaReader};
use lake_dp::transport::{Landing, TransferError, check_and_adopt};
use lake_dp::{BlockKey, NamespaceId, RegionId};

const SLOT: usize = 1 << 20;

struct Slots {
    memory: Vec<u8>,
    published: Vec<u32>,
}

impl Landing for Slots {
    fn place(&mut self, target: &BlockAddr, _len: u64) -> Result<*mut u8, AckStatus> {
        Ok(self.memory[target.slot as usize * SLOT..].as_mut_ptr())
    }
    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        let slot = target.slot as usize;
        match check_and_adopt(&mut self.memory[slot * SLOT..(slot + 1) * SLOT], len, target) {
            Ok(_) => {
                self.published.push(target.slot);
                AckStatus::Landed
            }
            Err(status) => status,
        }
    }
    fn abandoned(&mut self, _target: &BlockAddr) {}
}

#[test]
fn a_block_is_read_from_a_peers_slot_and_checked_where_it_lands() {
    let device = match Device::open(None, 1, 0) {
        Ok(device) => device,
        Err(why) => {
            println!("SKIPPED: {why}");
            assert!(!why.0.is_empty());
            return;
        }
    };
    // The exporting node: slot 2 holds a block written for (region 1,
    // epoch 9, slot 2, generation 5).
    let mut exported = vec![0u8; 4 * SLOT];
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey([4; 16]),
        parent_key: BlockKey::NONE,
        block_index: 0,
        namespace: NamespaceId(1),
        layout_fingerprint: 1,
        region: RegionId(1),
        region_epoch: 9,
        slot: 2,
        generation: 5,
        committed_unix_ns: 1,
        payload_len: 300_000,
        segment_bytes: 65536,
    };
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let len = encode_object(&meta, &payload, &mut exported[2 * SLOT..3 * SLOT]).unwrap();
    let mut reading = Slots { memory: vec![0u8; 4 * SLOT], published: Vec::new() };
    // SAFETY: both buffers outlive the registrations (dropped first).
    let export = unsafe { device.register(exported.as_mut_ptr(), exported.len(), true) }.unwrap();
    // SAFETY: as above.
    let local = unsafe { device.register(reading.memory.as_mut_ptr(), reading.memory.len(), false) }.unwrap();
    let base = exported.as_ptr() as u64;
    let mut owner = QueuePair::new(&device, (&export, base, exported.len() as u64), SLOT as u32, 9, 16).unwrap();
    let mut reader_pair = QueuePair::new(&device, (&local, 0, SLOT as u64), SLOT as u32, 1, 16).unwrap();
    let (a, b) = (Endpoint::decode(&owner.endpoint().encode()).unwrap(), reader_pair.endpoint());
    owner.connect(&device, &Endpoint::decode(&b.encode()).unwrap()).unwrap();
    reader_pair.connect(&device, &a).unwrap();
    let mut reader = RdmaReader::new(reader_pair, a, local.lkey());
    let source = BlockAddr { region: 1, epoch: 9, slot: 2, generation: 5 };
    let target = BlockAddr { region: 3, epoch: 1, slot: 0, generation: 1 };
    reader.read(1, source, len as u64, target, &mut reading).unwrap();
    // A stale name: the slot's generation moved on.
    let stale = BlockAddr { generation: 4, ..source };
    reader.read(2, stale, len as u64, BlockAddr { slot: 1, ..target }, &mut reading).unwrap();
    let mut done = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while done.len() < 2 {
        assert!(std::time::Instant::now() < deadline, "{done:?}");
        reader.poll(&mut reading, &mut done);
    }
    done.sort_by_key(|c| c.transfer);
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(done[1].result, Err(TransferError::Refused));
    assert_eq!(reading.published, [0]);
    let (_, landed) = decode_object(&reading.memory[..len]).unwrap();
    assert_eq!(landed, &payload[..]);
    drop((reader, owner, export, local));
}
