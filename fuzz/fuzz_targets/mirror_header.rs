//! Mirror headers, the page every engine's agent trusts nothing of before
//! it maps the table: any bytes decode or give a typed error, never a
//! panic; an accepted header describes a table that lies inside the file.
//!
//! The first input byte picks a mode. Bit 0: the header CRC is fixed up
//! before decoding, so mutations reach the field checks. Bit 1: the file
//! size is taken from the header's own `total_bytes` (else it is the input
//! length), so mutations get past the size check.

#![no_main]

use core::mem::{offset_of, size_of};

use lake_dp::mirror::layout::{BUCKET_BYTES, BUCKETS_OFFSET, MirrorHeader, decode_header};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = rest.to_vec();
    let size = size_of::<MirrorHeader>();
    let crc_at = offset_of!(MirrorHeader, crc);
    if mode & 1 == 1 && input.len() >= size {
        let crc = crc32fast::hash(&input[..crc_at]);
        input[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    }
    let total_at = offset_of!(MirrorHeader, total_bytes);
    let file_bytes = match input.get(total_at..total_at + 8) {
        Some(total) if mode & 2 == 2 => u64::from_le_bytes(total.try_into().expect("8 bytes")),
        _ => input.len() as u64,
    };
    let Ok(header) = decode_header(&input, file_bytes) else { return };
    assert_eq!(bytemuck::bytes_of(&header), &input[..size], "the checked header is the input");
    assert_eq!(header.total_bytes, file_bytes);
    assert!(header.buckets > 0);
    assert_eq!(BUCKETS_OFFSET + header.buckets * u64::from(BUCKET_BYTES), header.total_bytes);
});
