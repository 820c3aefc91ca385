//! The mirror's bytes. Little-endian, fixed offsets:
//!
//! ```text
//! 0        MirrorHeader (immutable once ready, CRC'd)
//! 2048     MirrorControl (state, writer pid, term, probe bound, counters,
//!          the futex word of writes)
//! 4096     region records: REGIONS_MAX buckets of 32 bytes (seqlocked)
//! buckets  the table: `buckets` buckets of 32 bytes (seqlocked)
//! ```
//!
//! A table bucket's words (see [`super::seqlock::Bucket`]):
//!
//! ```text
//! meta      bits 0-1 state (0 empty, 1 live, 2 void: left mid-update by a
//!           dead writer, until the next rebuilds its cluster), 2-3 kind,
//!           4-5 tier of the replica named, 6-9 tiers holding a ready
//!           replica (bit per tier), 10-17 region epoch tag, 18-27 region,
//!           28-31 zero
//! words[0]  key bytes 0..8      words[1]  key bytes 8..16
//! words[2]  slot (low 32 bits) | slot generation (high 32 bits)
//! ```
//!
//! A region record: meta bit 0 present, bits 1-2 tier, bits 8-15 the
//! epoch tag entries carry; `words[0]` the region epoch, `words[1]` the node.
//!
//! [`decode_header`] trusts nothing; every attacher goes through it.

use core::mem::{offset_of, size_of};
use core::sync::atomic::{AtomicU32, AtomicU64};

use bytemuck::{Pod, Zeroable};

use super::MirrorError;
use super::seqlock::Bucket;

/// The first eight bytes of every mirror.
pub const MIRROR_MAGIC: [u8; 8] = *b"LAKEMIR\0";

/// The layout version this build creates and reads.
pub const MIRROR_VERSION: u32 = 1;

/// What a table of this layout is: the magic its file starts with, the
/// version of it a build writes, and the oldest it still reads (what
/// changes between versions is what a bucket's words mean, never where
/// they lie).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableKind {
    /// The first eight bytes.
    pub magic: [u8; 8],
    /// The version written.
    pub version: u32,
    /// The oldest version read.
    pub oldest: u32,
}

/// A node's mirror.
pub const MIRROR: TableKind = TableKind { magic: MIRROR_MAGIC, version: MIRROR_VERSION, oldest: MIRROR_VERSION };

/// Bytes of page 0 (header and control).
pub const HEADER_BYTES: u32 = 4096;

/// Where [`MirrorControl`] lies in page 0.
pub const CONTROL_OFFSET: usize = 2048;

/// Region records (region ids `0..REGIONS_MAX`).
pub const REGIONS_MAX: u32 = crate::constants::MIRROR_REGIONS_MAX;

/// Bytes of a bucket (table entry or region record).
pub const BUCKET_BYTES: u32 = 32;

/// Where the region records start.
pub const REGIONS_OFFSET: u64 = HEADER_BYTES as u64;

/// Where the table starts.
pub const BUCKETS_OFFSET: u64 = REGIONS_OFFSET + REGIONS_MAX as u64 * BUCKET_BYTES as u64;

/// Most buckets a mirror may have (2^32: bucket numbers fit a `u32`).
pub const BUCKETS_MAX: u64 = 1 << 32;

/// [`MirrorControl::state`] while the writer builds the mirror.
pub const STATE_BUILDING: u32 = 0;
/// [`MirrorControl::state`] while the mirror is valid.
pub const STATE_READY: u32 = 0x5944_4552; // "REDY"
/// [`MirrorControl::state`] once its writer retired it; readers detach.
pub const STATE_RETIRED: u32 = 0x4552_5452; // "RTRE"

/// The header at offset 0: written once before the state turns ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct MirrorHeader {
    /// [`MIRROR_MAGIC`] (or another [`TableKind`]'s).
    pub magic: [u8; 8],
    /// [`MIRROR_VERSION`] (or another [`TableKind`]'s).
    pub version: u32,
    /// [`HEADER_BYTES`].
    pub header_bytes: u32,
    /// [`BUCKET_BYTES`].
    pub bucket_bytes: u32,
    /// [`REGIONS_MAX`].
    pub regions_max: u32,
    /// Buckets in the table.
    pub buckets: u64,
    /// [`REGIONS_OFFSET`].
    pub regions_offset: u64,
    /// [`BUCKETS_OFFSET`].
    pub buckets_offset: u64,
    /// Bytes of the whole mirror (the file's size).
    pub total_bytes: u64,
    /// The node whose replicas it shows.
    pub node: u32,
    /// Zero.
    pub reserved: u32,
    /// CRC32 of every byte above.
    pub crc: u32,
    /// Zero.
    pub reserved_b: u32,
}

const _: () = assert!(size_of::<MirrorHeader>() == 72);
const _: () = assert!(offset_of!(MirrorHeader, crc) == 64);

/// The words in page 0 that change while the mirror lives, on four cache
/// lines by how often the writer stores them: every probe reads the first
/// (which changes almost never), a miss the second (changed by every
/// removal), reports the third (changed by every write), a waiting reader
/// the fourth (changed once a batch of writes) — so a busy writer does not
/// pull the probe's line away from the readers.
#[derive(Debug)]
#[repr(C, align(64))]
pub struct MirrorControl {
    /// [`STATE_BUILDING`], [`STATE_READY`] or [`STATE_RETIRED`].
    pub state: AtomicU32,
    /// The writer's pid (for messages; liveness is the lock on byte 0).
    pub writer_pid: AtomicU32,
    /// The writer's term: a new `lake-cp` taking over writes a higher one.
    pub term: AtomicU64,
    /// The longest probe any live entry needs (readers stop there).
    pub max_probe: AtomicU32,
    _pad_a: [u8; 44],
    /// Odd while the writer moves entries back after a removal: a reader
    /// whose probe missed re-checks it, and looks again if it changed (a
    /// moving entry may have passed behind its probe).
    pub moves: AtomicU64,
    _pad_b: [u8; 56],
    /// Live entries.
    pub live: AtomicU64,
    /// Buckets found mid-update and repaired by a later writer, in all.
    pub repaired: AtomicU64,
    _pad_c: [u8; 48],
    /// Bumped after each batch of entries the writer published, a futex
    /// word its readers may wait on ([`super::MirrorReader::wait_for_writes`]).
    /// Zero forever where the writer is of a build before it: a waiting
    /// reader then wakes at its timeout, as it would have polled.
    pub writes: AtomicU32,
}

const _: () = assert!(offset_of!(MirrorControl, moves) == 64);
const _: () = assert!(offset_of!(MirrorControl, live) == 128);
const _: () = assert!(offset_of!(MirrorControl, writes) == 192);
const _: () = assert!(CONTROL_OFFSET + size_of::<MirrorControl>() <= HEADER_BYTES as usize);
const _: () = assert!(size_of::<Bucket>() == BUCKET_BYTES as usize);

/// The CRC a header must carry.
pub fn header_crc(header: &MirrorHeader) -> u32 {
    crc32fast::hash(&bytemuck::bytes_of(header)[..offset_of!(MirrorHeader, crc)])
}

/// The header of a mirror of `buckets` buckets for `node`.
pub fn plan(buckets: u64, node: u32) -> Result<MirrorHeader, MirrorError> {
    plan_as(MIRROR, buckets, node)
}

/// The header of a table of this layout of another kind (the cluster
/// view, [`super::view::VIEW`]).
pub fn plan_as(kind: TableKind, buckets: u64, node: u32) -> Result<MirrorHeader, MirrorError> {
    if buckets == 0 || buckets > BUCKETS_MAX {
        return Err(MirrorError::Config("buckets: between 1 and 2^32"));
    }
    let total_bytes = BUCKETS_OFFSET + buckets * u64::from(BUCKET_BYTES);
    let mut header = MirrorHeader {
        magic: kind.magic,
        version: kind.version,
        header_bytes: HEADER_BYTES,
        bucket_bytes: BUCKET_BYTES,
        regions_max: REGIONS_MAX,
        buckets,
        regions_offset: REGIONS_OFFSET,
        buckets_offset: BUCKETS_OFFSET,
        total_bytes,
        node,
        reserved: 0,
        crc: 0,
        reserved_b: 0,
    };
    header.crc = header_crc(&header);
    Ok(header)
}

/// Checks a mirror's page 0 against the file's size; names the first bad
/// field.
pub fn decode_header(page: &[u8], file_bytes: u64) -> Result<MirrorHeader, MirrorError> {
    decode_header_as(MIRROR, page, file_bytes)
}

/// [`decode_header`] of a table of another kind: any version of it from
/// its oldest read to the one written.
pub fn decode_header_as(kind: TableKind, page: &[u8], file_bytes: u64) -> Result<MirrorHeader, MirrorError> {
    let bad = MirrorError::Header;
    let bytes = page.get(..size_of::<MirrorHeader>()).ok_or(bad("too short to hold a mirror header"))?;
    let header: MirrorHeader = bytemuck::pod_read_unaligned(bytes);
    if header.magic != kind.magic {
        return Err(bad(if kind.magic == MIRROR_MAGIC {
            "magic: not a Lake mirror"
        } else {
            "magic: not a Lake cluster view"
        }));
    }
    if !(kind.oldest..=kind.version).contains(&header.version) {
        return Err(MirrorError::Version { found: header.version, supported: kind.version });
    }
    if header.crc != header_crc(&header) {
        return Err(bad("crc: the header is damaged"));
    }
    if header.header_bytes != HEADER_BYTES {
        return Err(bad("header_bytes"));
    }
    if header.bucket_bytes != BUCKET_BYTES {
        return Err(bad("bucket_bytes"));
    }
    if header.regions_max != REGIONS_MAX {
        return Err(bad("regions_max"));
    }
    if header.reserved != 0 || header.reserved_b != 0 {
        return Err(bad("reserved fields are not zero"));
    }
    if header.regions_offset != REGIONS_OFFSET {
        return Err(bad("regions_offset"));
    }
    if header.buckets_offset != BUCKETS_OFFSET {
        return Err(bad("buckets_offset"));
    }
    if header.buckets == 0 || header.buckets > BUCKETS_MAX {
        return Err(bad("buckets"));
    }
    let expected = header
        .buckets
        .checked_mul(u64::from(BUCKET_BYTES))
        .and_then(|b| b.checked_add(BUCKETS_OFFSET))
        .ok_or(bad("buckets: the table overflows"))?;
    if header.total_bytes != expected {
        return Err(bad("total_bytes does not match buckets"));
    }
    if header.total_bytes != file_bytes {
        return Err(bad("total_bytes differs from the file's size"));
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(header: &MirrorHeader) -> Vec<u8> {
        let mut page = vec![0u8; HEADER_BYTES as usize];
        page[..size_of::<MirrorHeader>()].copy_from_slice(bytemuck::bytes_of(header));
        page
    }

    #[test]
    fn a_planned_header_decodes_and_each_bad_field_is_named() {
        let header = plan(1000, 3).unwrap();
        assert_eq!(decode_header(&page(&header), header.total_bytes), Ok(header));
        assert_eq!(
            decode_header(&page(&header), header.total_bytes + 1),
            Err(MirrorError::Header("total_bytes differs from the file's size"))
        );
        assert_eq!(
            decode_header(&page(&header)[..10], 0),
            Err(MirrorError::Header("too short to hold a mirror header"))
        );
        type Damage = (fn(&mut MirrorHeader), &'static str);
        let cases: [Damage; 6] = [
            (|h| h.magic[0] = b'X', "magic: not a Lake mirror"),
            (|h| h.buckets = 0, "buckets"),
            (|h| h.bucket_bytes = 64, "bucket_bytes"),
            (|h| h.buckets_offset += 32, "buckets_offset"),
            (|h| h.total_bytes += 32, "total_bytes does not match buckets"),
            (|h| h.reserved = 1, "reserved fields are not zero"),
        ];
        for (damage, field) in cases {
            let mut bad = header;
            damage(&mut bad);
            bad.crc = header_crc(&bad);
            assert_eq!(decode_header(&page(&bad), bad.total_bytes), Err(MirrorError::Header(field)));
        }
        let mut bad = header;
        bad.version = 2;
        bad.crc = header_crc(&bad);
        assert_eq!(decode_header(&page(&bad), bad.total_bytes), Err(MirrorError::Version { found: 2, supported: 1 }));
        let mut bad = header;
        bad.node = 4; // not resealed
        assert_eq!(decode_header(&page(&bad), bad.total_bytes), Err(MirrorError::Header("crc: the header is damaged")));
    }
}
