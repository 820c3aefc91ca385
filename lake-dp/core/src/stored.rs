//! Stored-object format v1: how a block or a state checkpoint lies in an L2
//! slot or an L3 object.
//!
//! ```text
//! 0      4096                                   4096 + round_up(payload, 4096)
//! | header | payload (segments back to back) | zero padding |
//! ```
//!
//! The 4 KiB header names the object completely (key, parent key, block
//! index, namespace, layout fingerprint, region, epoch, slot, generation) and
//! carries one CRC32 per payload segment plus its own CRC32 in its last four
//! bytes, so the index can be rebuilt from disk alone and every byte read is
//! checked. Everything is 4 KiB-aligned for O_DIRECT. All integers are
//! little-endian.

use core::fmt;
use core::mem::{offset_of, size_of};

use bytemuck::{Pod, Zeroable};

use crate::constants::{DIRECT_IO_ALIGN_BYTES, SEGMENTS_MAX, STORED_HEADER_BYTES, STORED_PAYLOAD_BYTES_MAX};
use crate::model::key::BlockKey;
use crate::model::layout::segment_range;
use crate::model::namespace::NamespaceId;
use crate::model::replica::{ObjectKind, RegionId};

/// The first eight bytes of every stored object.
pub const STORED_MAGIC: [u8; 8] = *b"LAKEOBJ\0";

/// The format version this build writes and reads.
pub const STORED_VERSION: u16 = 1;

/// Bytes covered by the header CRC: everything before it.
const HEADER_CRC_OFFSET: usize = STORED_HEADER_BYTES - 4;

/// Header flag: the payload is sealed (encrypted at rest); the
/// [`Seal`] is in the header, the segment CRCs are over the ciphertext.
pub const FLAG_SEALED: u16 = 1;

/// Bytes of a seal in the header (its reserved tail's start).
const SEAL_BYTES: usize = 40;

/// How a sealed payload was encrypted: the data key's id, the object's
/// salt, the AEAD tag (see [`crate::auth::at_rest`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seal {
    /// The id of the tenant's data key.
    pub key_id: u64,
    /// The salt the object's own key was derived with.
    pub salt: [u8; 16],
    /// The AES-256-GCM tag.
    pub tag: [u8; 16],
}

impl Seal {
    fn to_bytes(self) -> [u8; SEAL_BYTES] {
        let mut out = [0u8; SEAL_BYTES];
        out[..8].copy_from_slice(&self.key_id.to_le_bytes());
        out[8..24].copy_from_slice(&self.salt);
        out[24..40].copy_from_slice(&self.tag);
        out
    }

    fn from_bytes(bytes: &[u8]) -> Self {
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[..8]);
        let (mut salt, mut tag) = ([0u8; 16], [0u8; 16]);
        salt.copy_from_slice(&bytes[8..24]);
        tag.copy_from_slice(&bytes[24..40]);
        Self { key_id: u64::from_le_bytes(id), salt, tag }
    }
}

/// The header exactly as it lies on disk.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C)]
struct RawHeader {
    magic: [u8; 8],
    version: u16,
    kind: u16,
    segment_count: u16,
    flags: u16,
    key: BlockKey,
    parent_key: BlockKey,
    namespace: u64,
    layout_fingerprint: u64,
    region_epoch: u64,
    payload_len: u64,
    segment_bytes: u64,
    block_index: u32,
    generation: u32,
    slot: u32,
    region: u16,
    reserved_a: u16,
    committed_unix_ns: u64,
    reserved_b: [u8; 16],
    segment_crcs: [u32; SEGMENTS_MAX],
    reserved_c: [u8; HEADER_CRC_OFFSET - 128 - SEGMENTS_MAX * 4],
    header_crc: u32,
}

const _: () = assert!(size_of::<RawHeader>() == STORED_HEADER_BYTES);
const _: () = assert!(offset_of!(RawHeader, key) == 16);
const _: () = assert!(offset_of!(RawHeader, namespace) == 48);
const _: () = assert!(offset_of!(RawHeader, block_index) == 88);
const _: () = assert!(offset_of!(RawHeader, committed_unix_ns) == 104);
const _: () = assert!(offset_of!(RawHeader, segment_crcs) == 128);
const _: () = assert!(offset_of!(RawHeader, header_crc) == HEADER_CRC_OFFSET);

/// Everything a stored header says about its object, CRCs aside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Block or state checkpoint.
    pub kind: ObjectKind,
    /// The object's key.
    pub key: BlockKey,
    /// The key of the previous block of the prefix ([`BlockKey::NONE`] for
    /// the first block), so the radix can be rebuilt from headers alone.
    pub parent_key: BlockKey,
    /// Position of the block in its prefix (0-based).
    pub block_index: u32,
    /// The namespace's id.
    pub namespace: NamespaceId,
    /// Fingerprint of the payload's layout.
    pub layout_fingerprint: u64,
    /// The region the object was written to.
    pub region: RegionId,
    /// The region epoch at write time.
    pub region_epoch: u64,
    /// The slot it was written to: a header found in another slot reveals a
    /// misdirected write.
    pub slot: u32,
    /// The slot generation at write time.
    pub generation: u32,
    /// Wall-clock commit time, for recency after a restart.
    pub committed_unix_ns: u64,
    /// Payload bytes (without padding).
    pub payload_len: u64,
    /// Bytes per segment; the last segment may be shorter.
    pub segment_bytes: u64,
}

impl ObjectMeta {
    /// Segments the payload is cut into.
    pub fn segment_count(&self) -> Result<u16, StoredError> {
        check_geometry(self.payload_len, self.segment_bytes)
    }

    /// Byte range `(offset, len)` of a segment inside the payload.
    pub fn segment_range(&self, index: u16) -> Option<(u64, u64)> {
        segment_range(self.payload_len, self.segment_bytes, index)
    }

    /// Bytes the whole object occupies: header plus padded payload.
    pub fn object_bytes(&self) -> u64 {
        object_bytes(self.payload_len)
    }
}

/// Bytes a stored object with `payload_len` payload bytes occupies.
pub fn object_bytes(payload_len: u64) -> u64 {
    STORED_HEADER_BYTES as u64 + payload_len.next_multiple_of(DIRECT_IO_ALIGN_BYTES as u64)
}

/// Why a stored object was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredError {
    /// Fewer bytes than a header (or header plus payload).
    TooShort {
        /// Bytes needed.
        needed: u64,
        /// Bytes given.
        actual: u64,
    },
    /// The header is all zeros: a slot that was formatted and never written.
    Empty,
    /// Not a Lake object.
    BadMagic,
    /// A version this build cannot read.
    UnsupportedVersion(u16),
    /// An unknown object kind.
    UnknownKind(u16),
    /// Flag bits this version does not define.
    UnsupportedFlags(u16),
    /// Reserved bytes are not zero.
    ReservedNotZero,
    /// The header's own CRC does not match: the header is damaged.
    HeaderCrc {
        /// CRC stored in the header.
        stored: u32,
        /// CRC computed over the header.
        computed: u32,
    },
    /// `payload_len`, `segment_bytes` and `segment_count` disagree, or are
    /// outside the format's limits.
    Geometry {
        /// Payload bytes claimed.
        payload_len: u64,
        /// Segment bytes claimed.
        segment_bytes: u64,
        /// Segment count claimed (or computed, when encoding).
        segment_count: u64,
    },
    /// A segment's bytes do not match its CRC.
    SegmentCrc {
        /// The segment.
        segment: u16,
        /// CRC stored in the header.
        stored: u32,
        /// CRC computed over the segment.
        computed: u32,
    },
    /// A segment CRC slot past the last segment is not zero.
    SpareCrcNotZero,
    /// The payload handed to the encoder has the wrong length.
    PayloadLength {
        /// Length the metadata says.
        expected: u64,
        /// Length given.
        actual: u64,
    },
}

impl fmt::Display for StoredError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooShort { needed, actual } => {
                write!(f, "stored object truncated: need {needed} bytes, have {actual}")
            }
            Self::Empty => f.write_str("slot is empty (never written)"),
            Self::BadMagic => f.write_str("not a Lake stored object (bad magic)"),
            Self::UnsupportedVersion(v) => write!(f, "stored object version {v} is not supported"),
            Self::UnknownKind(k) => write!(f, "unknown stored object kind {k}"),
            Self::UnsupportedFlags(flags) => write!(f, "unsupported stored object flags {flags:#x}"),
            Self::ReservedNotZero => f.write_str("reserved header bytes are not zero"),
            Self::HeaderCrc { stored, computed } => {
                write!(f, "header CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")
            }
            Self::Geometry { payload_len, segment_bytes, segment_count } => write!(
                f,
                "inconsistent geometry: payload {payload_len} B, segments of {segment_bytes} B, count {segment_count}"
            ),
            Self::SegmentCrc { segment, stored, computed } => {
                write!(f, "segment {segment} CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")
            }
            Self::SpareCrcNotZero => f.write_str("CRC slot past the last segment is not zero"),
            Self::PayloadLength { expected, actual } => {
                write!(f, "payload of {actual} B where the header says {expected} B")
            }
        }
    }
}

impl std::error::Error for StoredError {}

fn check_geometry(payload_len: u64, segment_bytes: u64) -> Result<u16, StoredError> {
    let bad = |count| StoredError::Geometry { payload_len, segment_bytes, segment_count: count };
    if payload_len == 0 || segment_bytes == 0 || payload_len > STORED_PAYLOAD_BYTES_MAX {
        return Err(bad(0));
    }
    let count = payload_len.div_ceil(segment_bytes);
    if count > SEGMENTS_MAX as u64 {
        return Err(bad(count));
    }
    u16::try_from(count).map_err(|_| bad(count))
}

/// Computes the CRC32 of every segment of `payload` into `out` and returns
/// how many were written.
pub fn segment_crcs(payload: &[u8], segment_bytes: u64, out: &mut [u32]) -> Result<u16, StoredError> {
    let count = check_geometry(payload.len() as u64, segment_bytes)?;
    let segment_len = usize::try_from(segment_bytes).unwrap_or(usize::MAX);
    if usize::from(count) > out.len() {
        return Err(StoredError::Geometry {
            payload_len: payload.len() as u64,
            segment_bytes,
            segment_count: u64::from(count),
        });
    }
    for (segment, crc) in payload.chunks(segment_len).zip(out.iter_mut()) {
        *crc = crc32fast::hash(segment);
    }
    Ok(count)
}

/// Writes the header for `meta` with the given segment CRCs into `out`.
pub fn encode_header(meta: &ObjectMeta, crcs: &[u32], out: &mut [u8; STORED_HEADER_BYTES]) -> Result<(), StoredError> {
    encode_header_sealed(meta, crcs, None, out)
}

/// [`encode_header`] of a payload sealed with `seal` (CRCs over its
/// ciphertext), or of one in the clear (`None`).
pub fn encode_header_sealed(
    meta: &ObjectMeta,
    crcs: &[u32],
    seal: Option<&Seal>,
    out: &mut [u8; STORED_HEADER_BYTES],
) -> Result<(), StoredError> {
    let count = meta.segment_count()?;
    if crcs.len() != usize::from(count) {
        return Err(StoredError::Geometry {
            payload_len: meta.payload_len,
            segment_bytes: meta.segment_bytes,
            segment_count: crcs.len() as u64,
        });
    }
    // Built on the stack and copied out: `out` need not be 8-byte aligned,
    // and 4 KiB is nothing next to the I/O that follows.
    let mut raw = RawHeader::zeroed();
    raw.magic = STORED_MAGIC;
    raw.version = STORED_VERSION;
    raw.kind = meta.kind as u16;
    raw.segment_count = count;
    raw.key = meta.key;
    raw.parent_key = meta.parent_key;
    raw.namespace = meta.namespace.0;
    raw.layout_fingerprint = meta.layout_fingerprint;
    raw.region_epoch = meta.region_epoch;
    raw.payload_len = meta.payload_len;
    raw.segment_bytes = meta.segment_bytes;
    raw.block_index = meta.block_index;
    raw.generation = meta.generation;
    raw.slot = meta.slot;
    raw.region = meta.region.0;
    raw.committed_unix_ns = meta.committed_unix_ns;
    raw.segment_crcs[..crcs.len()].copy_from_slice(crcs);
    if let Some(seal) = seal {
        raw.flags = FLAG_SEALED;
        raw.reserved_c[..SEAL_BYTES].copy_from_slice(&seal.to_bytes());
    }
    raw.header_crc = crc32fast::hash(&bytemuck::bytes_of(&raw)[..HEADER_CRC_OFFSET]);
    out.copy_from_slice(bytemuck::bytes_of(&raw));
    Ok(())
}

/// Whether every byte is zero: an OR over the whole slice, which the
/// compiler vectorizes (a short-circuiting scan does not, and the spare CRC
/// slots of a header are most of its 4 KiB).
fn all_zero(bytes: &[u8]) -> bool {
    bytes.iter().fold(0u8, |acc, &b| acc | b) == 0
}

/// A header that passed every check: its metadata and its segment CRCs.
#[derive(Clone, Copy)]
pub struct DecodedHeader {
    meta: ObjectMeta,
    segment_count: u16,
    segment_crcs: [u32; SEGMENTS_MAX],
    seal: Option<Seal>,
}

impl fmt::Debug for DecodedHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DecodedHeader").field("meta", &self.meta).field("segment_crcs", &self.crcs()).finish()
    }
}

impl DecodedHeader {
    /// The object's metadata.
    pub fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    /// The CRC32 of each segment, in order.
    pub fn crcs(&self) -> &[u32] {
        &self.segment_crcs[..usize::from(self.segment_count)]
    }

    /// How the payload is sealed, if it is (its CRCs are then over the
    /// ciphertext).
    pub fn seal(&self) -> Option<&Seal> {
        self.seal.as_ref()
    }

    /// Encodes this header again into `out`, naming the replica it is to
    /// describe — `region`, `region_epoch`, `slot`, `generation` — the block
    /// and its CRCs unchanged (an object copied into another slot, or
    /// stored as an object, describes where it sits). Returns the metadata
    /// written.
    pub fn encode_moved(
        &self,
        region: RegionId,
        region_epoch: u64,
        slot: u32,
        generation: u32,
        out: &mut [u8; STORED_HEADER_BYTES],
    ) -> Result<ObjectMeta, StoredError> {
        let meta = ObjectMeta { region, region_epoch, slot, generation, ..self.meta };
        encode_header_sealed(&meta, self.crcs(), self.seal.as_ref(), out)?;
        Ok(meta)
    }

    /// Checks one segment's bytes against its CRC (layer-wise loads verify
    /// each segment as it lands).
    pub fn verify_segment(&self, index: u16, bytes: &[u8]) -> Result<(), StoredError> {
        let Some((_, len)) = self.meta.segment_range(index) else {
            return Err(StoredError::Geometry {
                payload_len: self.meta.payload_len,
                segment_bytes: self.meta.segment_bytes,
                segment_count: u64::from(index) + 1,
            });
        };
        if bytes.len() as u64 != len {
            return Err(StoredError::PayloadLength { expected: len, actual: bytes.len() as u64 });
        }
        let stored = self.segment_crcs[usize::from(index)];
        let computed = crc32fast::hash(bytes);
        if stored != computed {
            return Err(StoredError::SegmentCrc { segment: index, stored, computed });
        }
        Ok(())
    }

    /// Checks a whole payload (without padding) against every segment CRC.
    pub fn verify_payload(&self, payload: &[u8]) -> Result<(), StoredError> {
        if payload.len() as u64 != self.meta.payload_len {
            return Err(StoredError::PayloadLength { expected: self.meta.payload_len, actual: payload.len() as u64 });
        }
        let segment_len = usize::try_from(self.meta.segment_bytes).unwrap_or(usize::MAX);
        for (index, segment) in (0u16..).zip(payload.chunks(segment_len)) {
            self.verify_segment(index, segment)?;
        }
        Ok(())
    }
}

/// Decodes and checks a header from the first 4 KiB of `bytes`. Payload
/// CRCs are not checked here (re-adoption reads headers only); use
/// [`DecodedHeader::verify_payload`] or [`decode_object`].
pub fn decode_header(bytes: &[u8]) -> Result<DecodedHeader, StoredError> {
    let Some(header_bytes) = bytes.get(..STORED_HEADER_BYTES) else {
        return Err(StoredError::TooShort { needed: STORED_HEADER_BYTES as u64, actual: bytes.len() as u64 });
    };
    // Slots are page-aligned, so the header is read where it lies; only a
    // misaligned buffer (a test's, a fuzzer's) is copied first.
    let copy: RawHeader;
    let raw: &RawHeader = match bytemuck::try_from_bytes(header_bytes) {
        Ok(raw) => raw,
        Err(_) => {
            copy = bytemuck::pod_read_unaligned(header_bytes);
            &copy
        }
    };
    if raw.magic != STORED_MAGIC {
        if header_bytes.iter().all(|&b| b == 0) {
            return Err(StoredError::Empty);
        }
        return Err(StoredError::BadMagic);
    }
    // The CRC first: a damaged header reports as damaged, not as whatever
    // field the damage happened to hit.
    let computed = crc32fast::hash(&header_bytes[..HEADER_CRC_OFFSET]);
    if raw.header_crc != computed {
        return Err(StoredError::HeaderCrc { stored: raw.header_crc, computed });
    }
    if raw.version != STORED_VERSION {
        return Err(StoredError::UnsupportedVersion(raw.version));
    }
    let kind = ObjectKind::from_u16(raw.kind).ok_or(StoredError::UnknownKind(raw.kind))?;
    let seal = match raw.flags {
        0 => None,
        FLAG_SEALED => Some(Seal::from_bytes(&raw.reserved_c[..SEAL_BYTES])),
        other => return Err(StoredError::UnsupportedFlags(other)),
    };
    let unused = if seal.is_some() { &raw.reserved_c[SEAL_BYTES..] } else { &raw.reserved_c[..] };
    if raw.reserved_a != 0 || !all_zero(&raw.reserved_b) || !all_zero(unused) {
        return Err(StoredError::ReservedNotZero);
    }
    let count = check_geometry(raw.payload_len, raw.segment_bytes)?;
    if count != raw.segment_count {
        return Err(StoredError::Geometry {
            payload_len: raw.payload_len,
            segment_bytes: raw.segment_bytes,
            segment_count: u64::from(raw.segment_count),
        });
    }
    if !all_zero(bytemuck::cast_slice(&raw.segment_crcs[usize::from(count)..])) {
        return Err(StoredError::SpareCrcNotZero);
    }
    let meta = ObjectMeta {
        kind,
        key: raw.key,
        parent_key: raw.parent_key,
        block_index: raw.block_index,
        namespace: NamespaceId(raw.namespace),
        layout_fingerprint: raw.layout_fingerprint,
        region: RegionId(raw.region),
        region_epoch: raw.region_epoch,
        slot: raw.slot,
        generation: raw.generation,
        committed_unix_ns: raw.committed_unix_ns,
        payload_len: raw.payload_len,
        segment_bytes: raw.segment_bytes,
    };
    Ok(DecodedHeader { meta, segment_count: count, segment_crcs: raw.segment_crcs, seal })
}

/// Writes a whole object (header, payload, zero padding) into `out`, which
/// must hold at least [`object_bytes`]; returns the bytes written.
pub fn encode_object(meta: &ObjectMeta, payload: &[u8], out: &mut [u8]) -> Result<usize, StoredError> {
    if payload.len() as u64 != meta.payload_len {
        return Err(StoredError::PayloadLength { expected: meta.payload_len, actual: payload.len() as u64 });
    }
    let total = meta.object_bytes();
    let Some(out) = usize::try_from(total).ok().and_then(|total| out.get_mut(..total)) else {
        return Err(StoredError::TooShort { needed: total, actual: out.len() as u64 });
    };
    let mut crcs = [0u32; SEGMENTS_MAX];
    let count = usize::from(segment_crcs(payload, meta.segment_bytes, &mut crcs)?);
    let (header, body) = out.split_at_mut(STORED_HEADER_BYTES);
    let header: &mut [u8; STORED_HEADER_BYTES] =
        header.try_into().map_err(|_| StoredError::TooShort { needed: STORED_HEADER_BYTES as u64, actual: 0 })?;
    encode_header(meta, &crcs[..count], header)?;
    let (data, padding) = body.split_at_mut(payload.len());
    data.copy_from_slice(payload);
    padding.fill(0);
    Ok(out.len())
}

/// Decodes a whole object and verifies every segment CRC. Returns the
/// header and the payload (padding excluded).
pub fn decode_object(bytes: &[u8]) -> Result<(DecodedHeader, &[u8]), StoredError> {
    let header = decode_header(bytes)?;
    let end = STORED_HEADER_BYTES as u64 + header.meta.payload_len;
    let Some(payload) = usize::try_from(end).ok().and_then(|end| bytes.get(STORED_HEADER_BYTES..end)) else {
        return Err(StoredError::TooShort { needed: end, actual: bytes.len() as u64 });
    };
    header.verify_payload(payload)?;
    Ok((header, payload))
}

/// Whose stored objects a reader may use: its namespace and layout, and
/// the kind of object it reads (KV blocks or recurrent-state checkpoints,
/// never one for the other).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reader {
    /// The reader's namespace.
    pub namespace: NamespaceId,
    /// The fingerprint of the reader's layout.
    pub layout_fingerprint: u64,
    /// What it reads.
    pub kind: ObjectKind,
}

/// Why a reader may not use the stored object where it looked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Its header or a segment fails its checks.
    Damaged,
    /// It holds another block (the slot was taken since the lookup).
    AnotherBlock,
    /// Another namespace's, layout's or kind's.
    NotTheReaders,
}

/// A stored object whose header passed every check a reader makes before
/// using any of its payload: the one checked read of a pinned slot, an
/// L2 or L3 object. The payload's segments are checked as they are read
/// ([`ReadableObject::segments`]).
#[derive(Debug)]
pub struct ReadableObject<'a> {
    /// Its header.
    pub header: DecodedHeader,
    /// Its payload (padding excluded), unchecked.
    pub payload: &'a [u8],
    /// Bytes of a segment (not 0).
    pub segment_bytes: usize,
}

impl<'a> ReadableObject<'a> {
    /// Checks the object in `bytes` (header first) for `reader`, who
    /// looked for `key`: the header's own CRC and geometry, that it holds
    /// `key`, saved in the reader's namespace and layout as the reader's
    /// kind, with its whole payload inside `bytes` and one CRC for each
    /// segment.
    pub fn check(bytes: &'a [u8], key: &BlockKey, reader: &Reader) -> Result<Self, Refusal> {
        let header = decode_header(bytes).map_err(|_| Refusal::Damaged)?;
        let meta = header.meta();
        if meta.key != *key {
            return Err(Refusal::AnotherBlock);
        }
        if meta.namespace != reader.namespace
            || meta.layout_fingerprint != reader.layout_fingerprint
            || meta.kind != reader.kind
        {
            return Err(Refusal::NotTheReaders);
        }
        let (Ok(len), Ok(segment_bytes)) = (usize::try_from(meta.payload_len), usize::try_from(meta.segment_bytes))
        else {
            return Err(Refusal::Damaged);
        };
        let payload = bytes.get(STORED_HEADER_BYTES..STORED_HEADER_BYTES + len).ok_or(Refusal::Damaged)?;
        if segment_bytes == 0 || header.crcs().len() != len.div_ceil(segment_bytes) {
            return Err(Refusal::Damaged);
        }
        Ok(Self { header, payload, segment_bytes })
    }

    /// Its segments in order, each `(offset, bytes)` once it matched its
    /// CRC; `Err(Damaged)` for the first that does not (the bytes before
    /// it were good: a caller copying as it goes has copied them).
    pub fn segments(&self) -> impl Iterator<Item = Result<(usize, &'a [u8]), Refusal>> + '_ {
        (0u16..).zip(self.payload.chunks(self.segment_bytes)).map(|(index, segment)| {
            self.header.verify_segment(index, segment).map_err(|_| Refusal::Damaged)?;
            Ok((usize::from(index) * self.segment_bytes, segment))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta(payload_len: u64, segment_bytes: u64) -> ObjectMeta {
        ObjectMeta {
            kind: ObjectKind::KvBlock,
            key: BlockKey([0xab; 16]),
            parent_key: BlockKey([0xcd; 16]),
            block_index: 7,
            namespace: NamespaceId(0x1122_3344_5566_7788),
            layout_fingerprint: 0x99aa_bbcc_ddee_ff00,
            region: RegionId(3),
            region_epoch: 12,
            slot: 4321,
            generation: 9,
            committed_unix_ns: 1_764_000_000_000_000_000,
            payload_len,
            segment_bytes,
        }
    }

    fn object(meta: &ObjectMeta) -> Vec<u8> {
        let payload: Vec<u8> = (0..meta.payload_len).map(|i| (i * 31 % 251) as u8).collect();
        let mut out = vec![0xee; usize::try_from(meta.object_bytes()).unwrap()];
        let written = encode_object(meta, &payload, &mut out).unwrap();
        assert_eq!(written, out.len());
        out
    }

    #[test]
    fn a_reader_gets_only_its_own_block_and_each_segment_only_once_it_checks() {
        let meta = meta(10_000, 4096);
        let reader = Reader { namespace: meta.namespace, layout_fingerprint: meta.layout_fingerprint, kind: meta.kind };
        let mut bytes = object(&meta);
        let object = ReadableObject::check(&bytes, &meta.key, &reader).unwrap();
        let segments: Vec<(usize, usize)> =
            object.segments().map(|s| s.map(|(at, b)| (at, b.len())).unwrap()).collect();
        assert_eq!(segments, [(0, 4096), (4096, 4096), (8192, 1808)]);
        assert_eq!(object.payload, &bytes[4096..4096 + 10_000]);

        let refused = |bytes: &[u8], key: &BlockKey, reader: &Reader| ReadableObject::check(bytes, key, reader).err();
        assert_eq!(refused(&bytes, &BlockKey([1; 16]), &reader), Some(Refusal::AnotherBlock));
        for other in [
            Reader { namespace: NamespaceId(1), ..reader },
            Reader { layout_fingerprint: 1, ..reader },
            Reader { kind: ObjectKind::RecurrentState, ..reader },
        ] {
            assert_eq!(refused(&bytes, &meta.key, &other), Some(Refusal::NotTheReaders), "{other:?}");
        }
        assert_eq!(refused(&bytes[..4096 + 9_999], &meta.key, &reader), Some(Refusal::Damaged), "payload cut short");
        let mut header_hit = bytes.clone();
        header_hit[100] ^= 1;
        assert_eq!(refused(&header_hit, &meta.key, &reader), Some(Refusal::Damaged), "header damaged");

        // A byte flipped in the second segment: the first is handed over,
        // the second is refused.
        bytes[4096 + 5000] ^= 0x10;
        let object = ReadableObject::check(&bytes, &meta.key, &reader).unwrap();
        let seen: Vec<Result<usize, Refusal>> = object.segments().map(|s| s.map(|(at, _)| at)).collect();
        assert_eq!(seen[..2], [Ok(0), Err(Refusal::Damaged)]);
    }

    #[test]
    fn round_trip_and_padding() {
        let m = meta(10_000, 4_000);
        let bytes = object(&m);
        assert_eq!(bytes.len(), 4096 + 12_288);
        let (header, payload) = decode_object(&bytes).unwrap();
        assert_eq!(*header.meta(), m);
        assert_eq!(header.crcs().len(), 3);
        assert_eq!(payload.len(), 10_000);
        assert!(bytes[4096 + 10_000..].iter().all(|&b| b == 0), "padding is zeroed");
        // Read where it lies when aligned, copied first when not: the same
        // answer, and the same refusals.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        let misaligned = decode_header(&shifted[1..]).unwrap();
        assert_eq!(*misaligned.meta(), m);
        assert_eq!(misaligned.crcs(), header.crcs());
        shifted[1 + 128 + 3 * 4] = 1;
        assert!(decode_header(&shifted[1..]).is_err(), "a spare CRC slot set, misaligned");
    }

    #[test]
    fn every_damage_is_named() {
        let m = meta(8192, 4096);
        let good = object(&m);
        assert_eq!(decode_header(&[0u8; 4096]).unwrap_err(), StoredError::Empty);
        assert_eq!(decode_header(&good[..100]).unwrap_err(), StoredError::TooShort { needed: 4096, actual: 100 });

        let mut bad = good.clone();
        bad[0] = b'X';
        assert_eq!(decode_header(&bad).unwrap_err(), StoredError::BadMagic);

        let mut bad = good.clone();
        bad[20] ^= 1; // a key bit
        assert!(matches!(decode_header(&bad), Err(StoredError::HeaderCrc { .. })));

        let mut bad = good.clone();
        bad[4096 + 5000] ^= 0x10; // payload, second segment
        assert!(matches!(decode_object(&bad), Err(StoredError::SegmentCrc { segment: 1, .. })));

        assert!(matches!(decode_object(&good[..4096 + 100]), Err(StoredError::TooShort { .. })));
    }

    /// Re-seals a header after a deliberate edit, so checks past the CRC run.
    fn reseal(bytes: &mut [u8]) {
        let crc = crc32fast::hash(&bytes[..HEADER_CRC_OFFSET]);
        bytes[HEADER_CRC_OFFSET..STORED_HEADER_BYTES].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn well_sealed_nonsense_is_refused() {
        let good = object(&meta(8192, 4096));
        let cases: [(usize, u8, StoredError); 5] = [
            (8, 2, StoredError::UnsupportedVersion(2)),
            (10, 9, StoredError::UnknownKind(9)),
            (14, 2, StoredError::UnsupportedFlags(2)),
            (120, 1, StoredError::ReservedNotZero),
            (128 + 4 * 5, 1, StoredError::SpareCrcNotZero),
        ];
        for (offset, value, expected) in cases {
            let mut bad = good.clone();
            bad[offset] = value;
            reseal(&mut bad);
            assert_eq!(decode_header(&bad).unwrap_err(), expected, "offset {offset}");
        }
        let mut bad = good.clone();
        bad[12] = 3; // segment_count disagrees with payload/segment bytes
        reseal(&mut bad);
        assert!(matches!(decode_header(&bad), Err(StoredError::Geometry { .. })));
    }

    #[test]
    fn a_seal_round_trips_and_its_unused_bytes_must_stay_zero() {
        let m = meta(8192, 4096);
        let seal = Seal { key_id: 0x1122_3344_5566_7788, salt: [7; 16], tag: [9; 16] };
        let mut header = [0u8; STORED_HEADER_BYTES];
        encode_header_sealed(&m, &[1, 2], Some(&seal), &mut header).unwrap();
        let decoded = decode_header(&header).unwrap();
        assert_eq!(decoded.seal(), Some(&seal));
        let mut moved = [0u8; STORED_HEADER_BYTES];
        decoded.encode_moved(RegionId(3), 4, 5, 6, &mut moved).unwrap();
        assert_eq!(decode_header(&moved).unwrap().seal(), Some(&seal), "a move keeps the seal");
        // Flag 1 with nothing past the seal: the byte after it must be 0.
        header[3968 + 40] = 1;
        reseal(&mut header);
        assert_eq!(decode_header(&header).unwrap_err(), StoredError::ReservedNotZero);
        // Clear headers keep the whole tail zero.
        let mut clear = [0u8; STORED_HEADER_BYTES];
        encode_header(&m, &[1, 2], &mut clear).unwrap();
        assert_eq!(decode_header(&clear).unwrap().seal(), None);
        clear[3968] = 1;
        reseal(&mut clear);
        assert_eq!(decode_header(&clear).unwrap_err(), StoredError::ReservedNotZero);
    }

    #[test]
    fn encoder_refuses_inconsistent_input() {
        let m = meta(8192, 4096);
        let mut out = vec![0; 4096 * 3];
        assert!(matches!(encode_object(&m, &[0; 10], &mut out), Err(StoredError::PayloadLength { .. })));
        assert!(matches!(encode_object(&m, &[0; 8192], &mut out[..100]), Err(StoredError::TooShort { .. })));
        let too_many = meta(4096 * 961, 4096);
        assert!(matches!(too_many.segment_count(), Err(StoredError::Geometry { .. })));
        let mut header = [0u8; 4096];
        assert!(encode_header(&m, &[1], &mut header).is_err());
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(
            payload_len in 1u64..20_000,
            segment_bytes in 1u64..25_000,
            key in any::<[u8; 16]>(),
            slot in any::<u32>(),
            epoch in any::<u64>(),
        ) {
            prop_assume!(payload_len.div_ceil(segment_bytes) <= SEGMENTS_MAX as u64);
            let mut m = meta(payload_len, segment_bytes);
            m.key = BlockKey(key);
            m.slot = slot;
            m.region_epoch = epoch;
            let bytes = object(&m);
            let (header, _) = decode_object(&bytes).unwrap();
            prop_assert_eq!(*header.meta(), m);
            // And the header re-encodes to the same bytes.
            let mut again = [0u8; STORED_HEADER_BYTES];
            encode_header(header.meta(), header.crcs(), &mut again).unwrap();
            prop_assert_eq!(&again[..], &bytes[..STORED_HEADER_BYTES]);
        }

        #[test]
        fn arbitrary_headers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4200)) {
            let _ = decode_object(&bytes);
        }
    }
}
