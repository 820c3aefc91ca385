//! L1 arena headers, the page every agent process trusts nothing of: any
//! bytes decode or give a typed error, never a panic; an accepted header's
//! size classes lie inside the arena.
//!
//! The first input byte picks a mode. Bit 0: the header CRC is fixed up
//! before decoding, so mutations reach the field checks. Bit 1: the file
//! size is taken from the header's own `total_bytes` (else it is the input
//! length), so mutations get past the size check.

#![no_main]

use core::mem::{offset_of, size_of};

use lake_dp::arena::layout::{ArenaHeader, decode_header};
use lake_dp::region::check_spans;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = rest.to_vec();
    let size = size_of::<ArenaHeader>();
    let crc_at = offset_of!(ArenaHeader, crc);
    if mode & 1 == 1 && input.len() >= size {
        let crc = crc32fast::hash(&input[..crc_at]);
        input[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    }
    let file_bytes = match input.get(16..24) {
        Some(total) if mode & 2 == 2 => u64::from_le_bytes(total.try_into().expect("8 bytes")),
        _ => input.len() as u64,
    };
    let Ok(geometry) = decode_header(&input, file_bytes) else { return };
    let header = geometry.header;
    assert_eq!(bytemuck::bytes_of(&header), &input[..size], "the checked header is the input");
    assert_eq!(header.total_bytes, file_bytes);
    let chunk_bytes = u64::from(header.chunk_bytes);
    let slots = check_spans(&geometry.spans, header.slots_bytes, chunk_bytes).expect("accepted spans are valid");
    assert_eq!(slots, header.slots);
    for span in &geometry.spans {
        // Every slot of every class, shared or not, ends inside the slot area.
        let last = span.first_slot + span.slots - 1;
        assert!(span.offset_of(last) + span.slot_bytes <= header.slots_bytes);
    }
    assert!(header.slots_offset + header.slots_bytes <= header.total_bytes);
    assert!(header.agents_offset + header.agent_stride * u64::from(header.agents_max) <= header.slots_offset);
});
