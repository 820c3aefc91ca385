//! RDMA offers, answers and endpoints: any bytes decode or give a named
//! error, never a panic; an accepted message or endpoint re-encodes to the
//! same bytes, and an accepted endpoint's slots stay inside its region.
//!
//! The first input byte picks a mode. Bit 0 set: the CRC is fixed up
//! before decoding, so mutations reach the field checks. Bit 1 set: the
//! rest is a 72-byte endpoint; clear: a 72-byte message (version 3).

#![no_main]

use lake_dp::transport::rdma::pull::{MESSAGE_BYTES, Message};
use lake_dp::transport::rdma::{ENDPOINT_BYTES, Endpoint};
use libfuzzer_sys::fuzz_target;

fn fix_crc(bytes: &mut [u8]) {
    let end = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..end]);
    bytes[end..].copy_from_slice(&crc.to_le_bytes());
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode & 2 == 0 {
        let Some(bytes) = rest.get(..MESSAGE_BYTES) else { return };
        let mut input = [0u8; MESSAGE_BYTES];
        input.copy_from_slice(bytes);
        if mode & 1 == 1 {
            fix_crc(&mut input);
        }
        let Ok(message) = Message::decode(&input) else { return };
        assert_eq!(message.encode(), input, "decode(encode(x)) must give back x");
    } else {
        let Some(bytes) = rest.get(..ENDPOINT_BYTES) else { return };
        let mut input = [0u8; ENDPOINT_BYTES];
        input.copy_from_slice(bytes);
        if mode & 1 == 1 {
            fix_crc(&mut input);
        }
        let Ok(endpoint) = Endpoint::decode(&input) else { return };
        assert_eq!(endpoint.encode(), input, "decode(encode(x)) must give back x");
        for slot in [0, 1, u32::MAX / 2, u32::MAX] {
            if let Some(address) = endpoint.slot_address(slot) {
                assert!(address >= endpoint.region_base);
                assert!(address + u64::from(endpoint.slot_bytes) <= endpoint.region_base + endpoint.region_len);
            }
        }
    }
});
