use proptest::prelude::*;

use super::message::*;
use super::*;

fn limits() -> Limits {
    Limits::default()
}

#[test]
fn every_kind_round_trips_byte_for_byte() {
    let frames = samples::frames();
    assert_eq!(frames.len(), MessageKind::ALL.len(), "one sample per kind");
    let mut seen = Vec::new();
    for bytes in &frames {
        let frame = decode_frame(bytes, &limits()).unwrap();
        assert_eq!(frame.len(), bytes.len());
        seen.push(frame.message.kind());
        let mut again = vec![0u8; bytes.len()];
        let len = encode_frame(frame.meta(), &frame.message, &mut again).unwrap();
        assert_eq!(&again[..len], &bytes[..]);
    }
    for kind in MessageKind::ALL {
        assert!(seen.contains(kind), "{kind:?} has no sample");
    }
}

#[test]
fn streams_of_frames_decode_in_order_and_ask_for_more() {
    let frames = samples::frames();
    let stream: Vec<u8> = frames.concat();
    let mut offset = 0;
    let mut count = 0;
    while offset < stream.len() {
        let frame = decode_frame(&stream[offset..], &limits()).unwrap();
        offset += frame.len();
        count += 1;
    }
    assert_eq!(count, frames.len());
    let first = &frames[0];
    assert_eq!(decode_frame(&first[..10], &limits()), Err(WireError::Incomplete { needed: 40 }));
    assert_eq!(decode_frame(&first[..first.len() - 1], &limits()), Err(WireError::Incomplete { needed: first.len() }));
}

fn reseal_header(bytes: &mut [u8]) {
    let crc = crc32fast::hash(&bytes[..36]);
    bytes[36..40].copy_from_slice(&crc.to_le_bytes());
}

fn reseal_body(bytes: &mut [u8]) {
    let crc = crc32fast::hash(&bytes[40..]);
    bytes[32..36].copy_from_slice(&crc.to_le_bytes());
    reseal_header(bytes);
}

#[test]
fn damaged_headers_are_named() {
    let good = samples::frames().remove(0);
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(decode_frame(&bad, &limits()), Err(WireError::BadMagic(_))));

    let mut bad = good.clone();
    bad[12] ^= 1; // body_len bit, header CRC not resealed
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::HeaderCrc));

    let mut bad = good.clone();
    bad[4] = 9;
    reseal_header(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::UnsupportedVersion(9)));

    let mut bad = good.clone();
    bad[8] = 0x80;
    reseal_header(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::UnknownFlags(0x80)));

    let mut bad = good.clone();
    bad[6] = 99;
    reseal_header(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::UnknownKind(99)));

    let mut bad = good.clone();
    bad[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal_header(&mut bad);
    assert!(matches!(decode_frame(&bad, &limits()), Err(WireError::FrameTooLarge { .. })));

    let mut bad = good.clone();
    let last = bad.len() - 1;
    bad[last] ^= 0xff;
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::BodyCrc));
}

#[test]
fn negotiated_limits_bound_what_is_waited_for() {
    let big = samples::frames().into_iter().find(|f| f.len() > 100).unwrap();
    let tight = Limits { frame_bytes_max: 64, ..limits() };
    assert!(matches!(decode_header(&big, &tight), Err(WireError::FrameTooLarge { max: 64, .. })));
}

#[test]
fn sealed_but_invalid_bodies_are_refused() {
    // Kind 14 (PinDrop) with a non-zero reserved byte.
    let frames = samples::frames();
    let pin = frames.iter().find(|f| f[6] == MessageKind::PinDrop as u8).unwrap();
    let mut bad = pin.clone();
    let last = bad.len() - 1;
    bad[last] = 1;
    reseal_body(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::Reserved("pin_drop.reserved")));

    // A lookup whose count disagrees with its body.
    let lookup = frames.iter().find(|f| f[6] == MessageKind::Lookup as u8).unwrap();
    let mut bad = lookup.clone();
    bad[40 + 8] = 2;
    reseal_body(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::Count { kind: MessageKind::Lookup, count: 2 }));

    // A lookup with half a key.
    let mut bad = lookup.clone();
    bad.truncate(bad.len() - 8);
    let body_len = (bad.len() - 40) as u32;
    bad[12..16].copy_from_slice(&body_len.to_le_bytes());
    reseal_body(&mut bad);
    assert!(matches!(decode_frame(&bad, &limits()), Err(WireError::BodyLength { .. })));

    // A transfer with an unknown priority, then an unknown tier.
    let transfer = frames.iter().find(|f| f[6] == MessageKind::MoveBlock as u8).unwrap();
    let mut bad = transfer.clone();
    bad[40 + 72] = 5;
    reseal_body(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::Field { field: "transfer.priority", value: 5 }));
    let mut bad = transfer.clone();
    bad[40] = 4;
    reseal_body(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::Field { field: "transfer.source", value: 4 }));

    // Rail figures of an unknown network, then a rail neither up nor down.
    let rails = frames.iter().find(|f| f[6] == MessageKind::RailStats as u8).unwrap();
    let mut bad = rails.clone();
    bad[40 + 4] = 7;
    reseal_body(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::Field { field: "rail_stats.network", value: 7 }));
    let mut bad = rails.clone();
    bad[40 + 8 + 6] = 2;
    reseal_body(&mut bad);
    assert_eq!(decode_frame(&bad, &limits()), Err(WireError::Field { field: "rail_entry.up", value: 2 }));

    // A hello whose name is not UTF-8.
    let hello = &frames[0];
    let mut bad = hello.clone();
    bad[40 + 40] = 0xff;
    reseal_body(&mut bad);
    assert!(matches!(decode_frame(&bad, &limits()), Err(WireError::Field { field: "hello.name", .. })));
}

#[test]
fn encoder_refuses_what_the_decoder_would() {
    let mut out = [0u8; 256];
    let meta = FrameMeta { version: 1, ..FrameMeta::default() };
    let cancel = Message::Cancel(Cancel { request_id: 1 });
    assert!(encode_frame(meta, &cancel, &mut out).is_ok());
    assert_eq!(
        encode_frame(FrameMeta { version: 0, ..meta }, &cancel, &mut out),
        Err(WireError::UnsupportedVersion(0))
    );
    assert_eq!(encode_frame(FrameMeta { flags: 2, ..meta }, &cancel, &mut out), Err(WireError::UnknownFlags(2)));
    assert_eq!(encode_frame(meta, &cancel, &mut out[..41]), Err(WireError::BufferTooSmall { needed: 48 }));
    let keys = [crate::BlockKey([1; 16])];
    let wrong_count = Message::Lookup(Lookup { namespace: 1, count: 2, flags: 0 }, Records::from_slice(&keys));
    assert!(matches!(encode_frame(meta, &wrong_count, &mut out), Err(WireError::Count { .. })));
    let too_many = vec![crate::BlockKey([1; 16]); crate::constants::LOOKUP_KEYS_MAX + 1];
    let mut big = vec![0u8; 1 << 20];
    let over = Message::Lookup(
        Lookup { namespace: 1, count: too_many.len() as u32, flags: 0 },
        Records::from_slice(&too_many),
    );
    assert!(matches!(encode_frame(meta, &over, &mut big), Err(WireError::Count { .. })));
}

proptest! {
    #[test]
    fn random_deltas_round_trip(
        entries in proptest::collection::vec((1u8..=3, 0u8..=2, 1u16..=2, any::<u32>(), any::<[u8; 16]>(), 0u8..=3, any::<u32>()), 0..64),
        term in any::<u64>(),
        sequence in any::<u64>(),
        request_id in any::<u64>(),
    ) {
        let records: Vec<DeltaEntry> = entries
            .iter()
            .map(|&(op, durability, kind, block_index, key, tier, slot)| DeltaEntry {
                op,
                durability,
                kind,
                block_index,
                key: crate::BlockKey(key),
                parent_key: crate::BlockKey::NONE,
                namespace: 7,
                layout_fingerprint: 8,
                replica: crate::model::replica::ReplicaWire { tier, slot, ..Default::default() },
            })
            .collect();
        let message = Message::Delta(
            Delta { term, sequence, node: 1, count: records.len() as u32 },
            Records::from_slice(&records),
        );
        let meta = FrameMeta { version: 1, flags: 0, request_id, leader_term: term };
        let mut buf = vec![0u8; 64 * 1024];
        let len = encode_frame(meta, &message, &mut buf).unwrap();
        let frame = decode_frame(&buf[..len], &Limits::default()).unwrap();
        prop_assert_eq!(frame.message, message);
        prop_assert_eq!(frame.meta(), meta);
        if let Message::Delta(_, decoded) = frame.message {
            prop_assert_eq!(decoded.iter().collect::<Vec<_>>(), records);
        }
    }

    #[test]
    fn truncations_and_bit_flips_never_panic_and_never_pass(
        which in 0usize..18,
        cut in 0usize..200,
        flip in any::<(usize, u8)>(),
    ) {
        let frames = samples::frames();
        let good = &frames[which % frames.len()];
        let cut = cut.min(good.len());
        prop_assert!(decode_frame(&good[..good.len() - cut], &Limits::default()).is_err() || cut == 0);
        let mut bad = good.clone();
        let (at, mask) = flip;
        let at = at % bad.len();
        bad[at] ^= mask.max(1);
        // A single flipped byte is always caught: by a CRC or a field check.
        prop_assert!(decode_frame(&bad, &Limits::default()).is_err());
    }
}

#[test]
fn a_path_histogram_buckets_by_powers_of_two_and_reads_its_quantiles() {
    use super::message::{LATENCY_BUCKETS, Path, PathEntry};
    let mut entry = PathEntry::new(Path::L2Write);
    assert_eq!(entry.quantile_us(0.5), None, "nothing timed");
    // 1 µs and less, 3 µs, 100 µs (within 128), 2 s (past every bucket).
    for ns in [500, 1_000, 3_000, 100_000, 2_000_000_000] {
        entry.record(ns);
    }
    assert_eq!((entry.buckets[0], entry.buckets[2], entry.buckets[7]), (2, 1, 1));
    assert_eq!(entry.buckets.iter().sum::<u64>(), 4);
    assert_eq!((entry.count, entry.sum_us), (5, 2_000_104));
    assert_eq!(entry.quantile_us(0.4), Some(1));
    assert_eq!(entry.quantile_us(0.6), Some(4));
    assert_eq!(entry.quantile_us(0.8), Some(128));
    assert_eq!(entry.quantile_us(0.99), None, "the slowest is past the last bucket");
    assert_eq!(1u64 << (LATENCY_BUCKETS - 1), 1_048_576);
}
