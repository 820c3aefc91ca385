//! Wire frames: any bytes decode to a frame or a typed error, never a panic,
//! and an accepted frame re-encodes to exactly the bytes it came from.
//!
//! The first input byte picks a mode. Odd: the CRCs of the rest are fixed up
//! before decoding, so mutations reach the field checks behind them instead
//! of dying at the checksum. Even: the bytes are decoded as they are.

#![no_main]

use lake_dp::wire::{FRAME_HEADER_BYTES, Limits, decode_frame, encode_frame};
use libfuzzer_sys::fuzz_target;

/// Recomputes the body CRC over the bytes the header's length announces (as
/// far as they exist) and then the header CRC.
fn reseal(bytes: &mut [u8]) {
    if bytes.len() < FRAME_HEADER_BYTES {
        return;
    }
    let body_len = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]) as usize;
    let end = FRAME_HEADER_BYTES.saturating_add(body_len).min(bytes.len());
    let body_crc = crc32fast::hash(&bytes[FRAME_HEADER_BYTES..end]);
    bytes[32..36].copy_from_slice(&body_crc.to_le_bytes());
    let header_crc = crc32fast::hash(&bytes[..36]);
    bytes[36..40].copy_from_slice(&header_crc.to_le_bytes());
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = rest.to_vec();
    if mode & 1 == 1 {
        reseal(&mut input);
    }
    let limits = Limits::default();
    let Ok(frame) = decode_frame(&input, &limits) else { return };
    let mut again = vec![0u8; frame.len()];
    let len = encode_frame(frame.meta(), &frame.message, &mut again).expect("an accepted frame re-encodes");
    assert_eq!(&again[..len], &input[..frame.len()], "decode(encode(x)) must give back x");
    let twice = decode_frame(&again, &limits).expect("a re-encoded frame decodes");
    assert_eq!(twice, frame);
});
