//! Stored-object headers (and whole objects): any bytes decode or give a
//! typed error, never a panic; an accepted header re-encodes to the same
//! 4 KiB (its seal too, for a sealed object); an accepted object's payload
//! passes its segment CRCs.
//!
//! The first input byte picks a mode. Odd: the header CRC is fixed up before
//! decoding, so mutations reach the field checks. Even: decoded as is.

#![no_main]

use lake_dp::constants::STORED_HEADER_BYTES;
use lake_dp::stored::{decode_header, decode_object, encode_header_sealed};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = rest.to_vec();
    if mode & 1 == 1 && input.len() >= STORED_HEADER_BYTES {
        let crc = crc32fast::hash(&input[..STORED_HEADER_BYTES - 4]);
        input[STORED_HEADER_BYTES - 4..STORED_HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
    }
    let Ok(header) = decode_header(&input) else { return };
    let mut again = [0u8; STORED_HEADER_BYTES];
    encode_header_sealed(header.meta(), header.crcs(), header.seal(), &mut again)
        .expect("an accepted header re-encodes");
    assert_eq!(&again[..], &input[..STORED_HEADER_BYTES], "decode(encode(x)) must give back x");
    let back = decode_header(&again).expect("re-encoded header decodes");
    assert_eq!((back.meta(), back.seal()), (header.meta(), header.seal()));
    if let Ok((whole, payload)) = decode_object(&input) {
        assert_eq!(payload.len() as u64, whole.meta().payload_len);
        whole.verify_payload(payload).expect("decode_object verified the payload");
    }
});
