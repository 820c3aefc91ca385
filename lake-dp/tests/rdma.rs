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

/// A block of key byte `key` in the exporter's slot (region 1, epoch 9)
/// `slot` at `generation`, `payload_len` bytes.
fn block_meta(key: u8, (slot, generation): (u32, u32), payload_len: u64) -> ObjectMeta {
    ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey([key; 16]),
        parent_key: BlockKey::NONE,
        block_index: 0,
        namespace: NamespaceId(1),
        layout_fingerprint: 1,
        region: RegionId(1),
        region_epoch: 9,
        slot,
        generation,
        committed_unix_ns: 1,
        payload_len,
        segment_bytes: 65536,
    }
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
    let meta = block_meta(4, (2, 5), 300_000);
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

#[test]
fn the_rdma_transport_carries_an_offered_block_between_two_arenas() {
    use lake_dp::Priority;
    use lake_dp::transport::rdma::pull::{RdmaConfig, RdmaTransport, Verbs};
    use lake_dp::transport::rdma::verbs::IbVerbs;
    use lake_dp::transport::{Outgoing, Transport};

    let open = || Device::open(None, 1, 0);
    let (first, second) = match (open(), open()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(why), _) | (_, Err(why)) => {
            println!("SKIPPED: {why}");
            assert!(!why.0.is_empty());
            return;
        }
    };
    let meta = block_meta(6, (1, 2), 700_000);
    let payload: Vec<u8> = (0..700_000u32).map(|i| (i % 253) as u8).collect();
    let mut sender_arena = vec![0u8; 4 * SLOT];
    let len = encode_object(&meta, &payload, &mut sender_arena[SLOT..2 * SLOT]).unwrap();
    let mut receiving = Slots { memory: vec![0u8; 4 * SLOT], published: Vec::new() };
    // SAFETY: both arenas outlive the verbs (dropped first, below).
    let mut a = unsafe { IbVerbs::new(first, sender_arena.as_mut_ptr(), sender_arena.len(), SLOT as u32, 9) }.unwrap();
    // SAFETY: as above.
    let mut b =
        unsafe { IbVerbs::new(second, receiving.memory.as_mut_ptr(), receiving.memory.len(), SLOT as u32, 1) }.unwrap();
    let (to_b, a_end) = a.add_peer().unwrap();
    let (to_a, b_end) = b.add_peer().unwrap();
    a.connect(to_b, &Endpoint::decode(&b_end.encode()).unwrap()).unwrap();
    b.connect(to_a, &Endpoint::decode(&a_end.encode()).unwrap()).unwrap();
    let mut sender = RdmaTransport::new(a, RdmaConfig::default());
    let mut receiver = RdmaTransport::new(b, RdmaConfig::default());
    let target = BlockAddr { region: 3, epoch: 1, slot: 2, generation: 1 };
    let block = Outgoing {
        transfer: 5,
        peer: to_b,
        source: sender_arena[SLOT..].as_ptr(),
        len: len as u64,
        target,
        priority: Priority::PrefillToDecode,
        trace: 0,
        namespace: 0,
    };
    // SAFETY: the sender's arena is left alone until the completion.
    unsafe { sender.write(&block, 0) }.unwrap();
    let mut done = Vec::new();
    let mut none = Slots { memory: Vec::new(), published: Vec::new() };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while done.is_empty() {
        assert!(std::time::Instant::now() < deadline, "no completion in 10 s");
        sender.poll(&mut none, 1, &mut done);
        receiver.poll(&mut receiving, 1, &mut Vec::new());
    }
    assert_eq!(done[0].result, Ok(()));
    assert_eq!(receiving.published, [2]);
    let (_, landed) = decode_object(&receiving.memory[2 * SLOT..2 * SLOT + len]).unwrap();
    assert_eq!(landed, &payload[..]);
    drop((sender, receiver));
}
