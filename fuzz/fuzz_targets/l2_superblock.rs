//! L2 file superblocks, read at every `lake-dp` start from disks that may
//! hold anything: any 4 KiB decode or give an error, never a panic; an
//! accepted superblock is exactly the input's bytes.
//!
//! The first input byte picks a mode. Odd: the CRC is fixed up before
//! decoding, so mutations reach the field checks. Even: decoded as is.

#![no_main]

use core::mem::{offset_of, size_of};

use lake_dp::l2::{Superblock, decode_superblock};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let mut input = rest.to_vec();
    let crc_at = offset_of!(Superblock, crc);
    if mode & 1 == 1 && input.len() >= size_of::<Superblock>() {
        let crc = crc32fast::hash(&input[..crc_at]);
        input[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    }
    let Ok(superblock) = decode_superblock(&input) else { return };
    assert_eq!(
        bytemuck::bytes_of(&superblock),
        &input[..size_of::<Superblock>()],
        "the accepted superblock is the input"
    );
    assert!(input[size_of::<Superblock>()..].iter().all(|&b| b == 0));
});
