//! Transport frame headers: any 64 bytes decode or give a typed error,
//! never a panic; an accepted header re-encodes to the same bytes and
//! keeps its slice inside its object (a negotiation frame: its bytes
//! within their bound; a trace frame: none; a reservation's answer
//! "later": its wait within a second).
//!
//! The first input byte picks a mode. Odd: the header CRC is fixed up before
//! decoding, so mutations reach the field checks. Even: decoded as is.

#![no_main]

use lake_dp::transport::frame::{
    AckStatus, FRAME_HEADER_BYTES, FrameHeader, FrameKind, LATER_US_MAX, NEGOTIATE_BYTES_MAX, OBJECT_BYTES_MAX,
    SLICE_BYTES_MAX,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let Some(bytes) = rest.get(..FRAME_HEADER_BYTES) else { return };
    let mut input = [0u8; FRAME_HEADER_BYTES];
    input.copy_from_slice(bytes);
    if mode & 1 == 1 {
        let crc = crc32fast::hash(&input[..FRAME_HEADER_BYTES - 4]);
        input[FRAME_HEADER_BYTES - 4..].copy_from_slice(&crc.to_le_bytes());
    }
    let Ok(frame) = FrameHeader::decode(&input) else { return };
    assert_eq!(frame.encode(), input, "decode(encode(x)) must give back x");
    assert!(frame.total_len <= OBJECT_BYTES_MAX);
    let negotiation = matches!(frame.kind, FrameKind::Negotiate | FrameKind::Negotiated);
    assert!(frame.total_len > 0 || negotiation);
    match frame.kind {
        FrameKind::Data => {
            assert!(frame.slice_len > 0 && frame.slice_len <= SLICE_BYTES_MAX);
            assert!(frame.offset + u64::from(frame.slice_len) <= frame.total_len);
        }
        FrameKind::Ack => {
            assert_eq!((frame.slice_len, frame.offset), (0, 0));
            assert_ne!(frame.status, AckStatus::Later, "later answers reservations only");
        }
        // A reservation answered "later" carries its wait (at most a
        // second); any other answer nothing.
        FrameKind::Reserved if frame.status == AckStatus::Later => {
            assert!(frame.slice_len == 0 && frame.offset <= LATER_US_MAX);
        }
        FrameKind::Reserved => assert_eq!((frame.slice_len, frame.offset), (0, 0)),
        // `offset`: the block's namespace, or 0.
        FrameKind::Reserve => {
            assert_eq!((frame.slice_len, frame.target.slot, frame.target.generation), (0, 0, 0));
        }
        // An offer carries bytes; an answer carries them or none (declined).
        FrameKind::Negotiate | FrameKind::Negotiated => {
            assert!(frame.slice_len <= NEGOTIATE_BYTES_MAX);
            assert!(frame.slice_len > 0 || frame.kind == FrameKind::Negotiated);
            assert_eq!((frame.total_len, frame.offset), (u64::from(frame.slice_len), 0));
        }
        // A trace id (never 0) for the data frame that follows; a time in
        // µs before an ack. Neither carries bytes.
        FrameKind::Trace => assert!(frame.slice_len == 0 && frame.trace_id() != 0),
        FrameKind::Traced => {
            assert_eq!((frame.slice_len, frame.target.slot, frame.target.epoch), (0, 0, 0));
            assert_eq!(u64::from(frame.took_us()), frame.offset);
        }
    }
});
