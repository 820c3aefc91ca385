//! Layouts: what a block's bytes are.
//!
//! A key names a logical block whatever the parallelism; a [`Layout`] says
//! how one replica's payload is laid out and which shard of the heads it
//! holds. Payloads are split into segments (one layer, or a group of
//! layers), each with its own CRC32, so layer-wise loads and streamed P→D
//! can start before the whole block lands.
//!
//! Memory order v1 inside a payload: segment after segment; inside a segment,
//! layer after layer; inside a layer, plane after plane (K then V, or the one
//! MLA latent); inside a plane `[block_tokens][shard heads][head_dim]` of
//! `dtype` (NHD). The order code is part of the fingerprint.

use core::fmt;

use bytemuck::{Pod, Zeroable};

use crate::constants::{BLOCK_TOKENS_MAX, SEGMENTS_MAX, STORED_PAYLOAD_BYTES_MAX};

const CONTEXT_KV_LAYOUT: &str = "lake 2026-11 kv layout fingerprint v1";
const CONTEXT_STATE_LAYOUT: &str = "lake 2026-11 recurrent layout fingerprint v1";

/// Memory order code of the v1 layout described in the module docs.
const ORDER_V1: u8 = 1;

/// Element type of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    /// IEEE half.
    F16 = 1,
    /// bfloat16.
    Bf16 = 2,
    /// IEEE single.
    F32 = 3,
    /// FP8 E4M3 (scales live in the model fingerprint).
    Fp8E4m3 = 4,
    /// FP8 E5M2.
    Fp8E5m2 = 5,
    /// 8-bit integer quantization.
    Int8 = 6,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Self::F16 | Self::Bf16 => 2,
            Self::F32 => 4,
            Self::Fp8E4m3 | Self::Fp8E5m2 | Self::Int8 => 1,
        }
    }

    /// Decodes a dtype code.
    pub fn from_u8(code: u8) -> Result<Self, LayoutError> {
        Ok(match code {
            1 => Self::F16,
            2 => Self::Bf16,
            3 => Self::F32,
            4 => Self::Fp8E4m3,
            5 => Self::Fp8E5m2,
            6 => Self::Int8,
            other => return Err(LayoutError::UnknownCode { field: "dtype", code: other }),
        })
    }
}

/// Planes per layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KvPlanes {
    /// A latent vector per token (MLA): one plane.
    Latent = 1,
    /// Separate K and V: two planes.
    KeyValue = 2,
}

impl KvPlanes {
    /// Number of planes.
    pub fn count(self) -> u64 {
        self as u64
    }

    /// Decodes a plane count.
    pub fn from_u8(code: u8) -> Result<Self, LayoutError> {
        match code {
            1 => Ok(Self::Latent),
            2 => Ok(Self::KeyValue),
            other => Err(LayoutError::UnknownCode { field: "planes", code: other }),
        }
    }
}

/// Which part of the heads a replica holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shard {
    /// KV heads `start..end` of the model's `kv_heads` (tensor parallelism).
    Heads {
        /// First head held.
        start: u16,
        /// One past the last head held.
        end: u16,
    },
    /// Every rank holds the same whole cache (MLA latents).
    Replicated,
}

/// Errors building or decoding a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutError {
    /// A dimension that must be positive is zero.
    Zero(&'static str),
    /// `block_tokens` above [`BLOCK_TOKENS_MAX`].
    BlockTokens(u16),
    /// A shard's head range is empty or outside the model's heads.
    HeadRange {
        /// First head.
        start: u16,
        /// One past the last head.
        end: u16,
        /// The model's KV heads.
        kv_heads: u16,
    },
    /// More segments than a stored header has CRC slots for.
    Segments(u64),
    /// The payload is larger than one stored object may be.
    PayloadTooLarge,
    /// A wire record that is valid only after adjustment (for example more
    /// layers per segment than layers): not the canonical encoding.
    NotCanonical(&'static str),
    /// An encoded enum field holds an unknown value.
    UnknownCode {
        /// The field.
        field: &'static str,
        /// The value found.
        code: u8,
    },
}

impl fmt::Display for LayoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Zero(field) => write!(f, "layout field `{field}` must be positive"),
            Self::BlockTokens(n) => write!(f, "block_tokens {n} exceeds {BLOCK_TOKENS_MAX}"),
            Self::HeadRange { start, end, kv_heads } => {
                write!(f, "shard heads {start}..{end} is not a non-empty range inside 0..{kv_heads}")
            }
            Self::Segments(n) => write!(f, "{n} segments exceed the limit of {SEGMENTS_MAX}"),
            Self::PayloadTooLarge => {
                write!(f, "block payload exceeds {STORED_PAYLOAD_BYTES_MAX} bytes")
            }
            Self::NotCanonical(field) => write!(f, "layout field `{field}` is not canonical"),
            Self::UnknownCode { field, code } => write!(f, "unknown {field} code {code}"),
        }
    }
}

impl std::error::Error for LayoutError {}

/// The byte layout of one KV block replica. Build with [`Layout::new`],
/// which validates every relation; fields are read through accessors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    layers: u16,
    planes: KvPlanes,
    kv_heads: u16,
    shard: Shard,
    head_dim: u16,
    dtype: Dtype,
    block_tokens: u16,
    layers_per_segment: u16,
}

/// A layout's parameters, as passed to [`Layout::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutParams {
    /// Attention layers.
    pub layers: u16,
    /// K and V, or one latent.
    pub planes: KvPlanes,
    /// The model's KV heads (all ranks together).
    pub kv_heads: u16,
    /// The heads this replica holds.
    pub shard: Shard,
    /// Elements per head.
    pub head_dim: u16,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per block.
    pub block_tokens: u16,
    /// Layers per segment (1 = one segment per layer).
    pub layers_per_segment: u16,
}

impl Layout {
    /// Validates `params` into a layout.
    pub fn new(params: LayoutParams) -> Result<Self, LayoutError> {
        let LayoutParams { layers, planes, kv_heads, shard, head_dim, dtype, block_tokens, layers_per_segment } =
            params;
        for (field, value) in [
            ("layers", layers),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("block_tokens", block_tokens),
            ("layers_per_segment", layers_per_segment),
        ] {
            if value == 0 {
                return Err(LayoutError::Zero(field));
            }
        }
        if u32::from(block_tokens) > BLOCK_TOKENS_MAX {
            return Err(LayoutError::BlockTokens(block_tokens));
        }
        if let Shard::Heads { start, end } = shard
            && (start >= end || end > kv_heads)
        {
            return Err(LayoutError::HeadRange { start, end, kv_heads });
        }
        let layout = Self {
            layers,
            planes,
            kv_heads,
            shard,
            head_dim,
            dtype,
            block_tokens,
            layers_per_segment: layers_per_segment.min(layers),
        };
        let segments = u64::from(layout.segment_count());
        if segments > SEGMENTS_MAX as u64 {
            return Err(LayoutError::Segments(segments));
        }
        // All factors are at most 16 bits, so the product of the first five
        // fits u64 without overflow; the limit check keeps it sane.
        if layout.block_bytes() > STORED_PAYLOAD_BYTES_MAX {
            return Err(LayoutError::PayloadTooLarge);
        }
        Ok(layout)
    }

    /// Attention layers.
    pub fn layers(&self) -> u16 {
        self.layers
    }

    /// Planes per layer.
    pub fn planes(&self) -> KvPlanes {
        self.planes
    }

    /// The model's KV heads.
    pub fn kv_heads(&self) -> u16 {
        self.kv_heads
    }

    /// The shard this replica holds.
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// Elements per head.
    pub fn head_dim(&self) -> u16 {
        self.head_dim
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u16 {
        self.block_tokens
    }

    /// Layers per segment (the last segment may hold fewer).
    pub fn layers_per_segment(&self) -> u16 {
        self.layers_per_segment
    }

    /// The code of this layout's shard for [`crate::ShardMask`]: 0 when a
    /// replica holds the whole block (every head, or replicated latents),
    /// else [`shard_code`] of its head range.
    pub fn shard_code(&self) -> u64 {
        match self.shard {
            Shard::Heads { start, end } => shard_code(self.kv_heads, start, end).unwrap_or(0),
            Shard::Replicated => 0,
        }
    }

    /// Heads this replica holds.
    pub fn shard_heads(&self) -> u16 {
        match self.shard {
            Shard::Heads { start, end } => end - start,
            Shard::Replicated => self.kv_heads,
        }
    }

    /// Bytes of one layer of one block.
    pub fn layer_bytes(&self) -> u64 {
        self.planes.count()
            * u64::from(self.shard_heads())
            * u64::from(self.head_dim)
            * u64::from(self.block_tokens)
            * self.dtype.bytes()
    }

    /// Bytes of one block replica's payload.
    pub fn block_bytes(&self) -> u64 {
        self.layer_bytes() * u64::from(self.layers)
    }

    /// Segments per block.
    pub fn segment_count(&self) -> u16 {
        self.layers.div_ceil(self.layers_per_segment)
    }

    /// Bytes of a full segment (all but possibly the last).
    pub fn segment_bytes(&self) -> u64 {
        self.layer_bytes() * u64::from(self.layers_per_segment)
    }

    /// Byte range `(offset, len)` of segment `index` in the payload, or
    /// `None` past the last segment.
    pub fn segment_range(&self, index: u16) -> Option<(u64, u64)> {
        segment_range(self.block_bytes(), self.segment_bytes(), index)
    }

    /// Byte offset of layer `layer` in the payload.
    pub fn layer_offset(&self, layer: u16) -> Option<u64> {
        (layer < self.layers).then(|| u64::from(layer) * self.layer_bytes())
    }

    /// The stable 64-bit fingerprint: equal layouts give equal fingerprints
    /// in every process and release; any difference gives a different one.
    pub fn fingerprint(&self) -> u64 {
        fingerprint(CONTEXT_KV_LAYOUT, bytemuck::bytes_of(&self.to_wire()))
    }

    /// The fixed little-endian record carried on the wire.
    pub fn to_wire(&self) -> LayoutWire {
        let (shard_kind, shard_start, shard_end) = match self.shard {
            Shard::Heads { start, end } => (SHARD_HEADS, start, end),
            Shard::Replicated => (SHARD_REPLICATED, 0, 0),
        };
        LayoutWire {
            order: ORDER_V1,
            planes: self.planes as u8,
            dtype: self.dtype as u8,
            shard_kind,
            layers: self.layers,
            kv_heads: self.kv_heads,
            shard_start,
            shard_end,
            head_dim: self.head_dim,
            block_tokens: self.block_tokens,
            layers_per_segment: self.layers_per_segment,
            reserved: 0,
        }
    }

    /// Validates a wire record into a layout.
    pub fn from_wire(wire: &LayoutWire) -> Result<Self, LayoutError> {
        if wire.order != ORDER_V1 {
            return Err(LayoutError::UnknownCode { field: "order", code: wire.order });
        }
        let shard = match wire.shard_kind {
            SHARD_HEADS => Shard::Heads { start: wire.shard_start, end: wire.shard_end },
            SHARD_REPLICATED => Shard::Replicated,
            other => return Err(LayoutError::UnknownCode { field: "shard", code: other }),
        };
        let layout = Self::new(LayoutParams {
            layers: wire.layers,
            planes: KvPlanes::from_u8(wire.planes)?,
            kv_heads: wire.kv_heads,
            shard,
            head_dim: wire.head_dim,
            dtype: Dtype::from_u8(wire.dtype)?,
            block_tokens: wire.block_tokens,
            layers_per_segment: wire.layers_per_segment,
        })?;
        // `new` clamps layers_per_segment; a record that needed clamping is
        // not canonical and would fingerprint differently.
        if layout.layers_per_segment != wire.layers_per_segment {
            return Err(LayoutError::NotCanonical("layers_per_segment"));
        }
        Ok(layout)
    }
}

const SHARD_HEADS: u8 = 1;
const SHARD_REPLICATED: u8 = 2;

/// A layout as a fixed 20-byte little-endian record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct LayoutWire {
    /// Memory order code (1).
    pub order: u8,
    /// [`KvPlanes`] code.
    pub planes: u8,
    /// [`Dtype`] code.
    pub dtype: u8,
    /// 1 = head range, 2 = replicated.
    pub shard_kind: u8,
    /// Layers.
    pub layers: u16,
    /// The model's KV heads.
    pub kv_heads: u16,
    /// First head of the shard (0 when replicated).
    pub shard_start: u16,
    /// One past the last head of the shard (0 when replicated).
    pub shard_end: u16,
    /// Elements per head.
    pub head_dim: u16,
    /// Tokens per block.
    pub block_tokens: u16,
    /// Layers per segment.
    pub layers_per_segment: u16,
    /// Zero.
    pub reserved: u16,
}

const _: () = assert!(core::mem::size_of::<LayoutWire>() == 20);

/// The layout of a recurrent-state checkpoint (linear attention, GDN, Mamba):
/// a fixed number of state bytes per layer, segmented like KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecurrentLayout {
    layers: u16,
    state_bytes_per_layer: u32,
    dtype: Dtype,
    shard: Shard,
    layers_per_segment: u16,
}

impl RecurrentLayout {
    /// Validates a recurrent-state layout. `state_bytes_per_layer` is the
    /// shard's own bytes (conv and SSM state together).
    pub fn new(
        layers: u16,
        state_bytes_per_layer: u32,
        dtype: Dtype,
        shard: Shard,
        layers_per_segment: u16,
    ) -> Result<Self, LayoutError> {
        if layers == 0 {
            return Err(LayoutError::Zero("layers"));
        }
        if state_bytes_per_layer == 0 {
            return Err(LayoutError::Zero("state_bytes_per_layer"));
        }
        if layers_per_segment == 0 {
            return Err(LayoutError::Zero("layers_per_segment"));
        }
        if let Shard::Heads { start, end } = shard
            && start >= end
        {
            return Err(LayoutError::HeadRange { start, end, kv_heads: end });
        }
        let layout =
            Self { layers, state_bytes_per_layer, dtype, shard, layers_per_segment: layers_per_segment.min(layers) };
        let segments = u64::from(layout.segment_count());
        if segments > SEGMENTS_MAX as u64 {
            return Err(LayoutError::Segments(segments));
        }
        if layout.block_bytes() > STORED_PAYLOAD_BYTES_MAX {
            return Err(LayoutError::PayloadTooLarge);
        }
        Ok(layout)
    }

    /// Bytes of one checkpoint.
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.state_bytes_per_layer) * u64::from(self.layers)
    }

    /// Segments per checkpoint.
    pub fn segment_count(&self) -> u16 {
        self.layers.div_ceil(self.layers_per_segment)
    }

    /// Bytes of a full segment.
    pub fn segment_bytes(&self) -> u64 {
        u64::from(self.state_bytes_per_layer) * u64::from(self.layers_per_segment)
    }

    /// Byte range `(offset, len)` of segment `index`.
    pub fn segment_range(&self, index: u16) -> Option<(u64, u64)> {
        segment_range(self.block_bytes(), self.segment_bytes(), index)
    }

    /// The stable 64-bit fingerprint, in a domain apart from KV layouts.
    pub fn fingerprint(&self) -> u64 {
        let (kind, start, end) = match self.shard {
            Shard::Heads { start, end } => (SHARD_HEADS, start, end),
            Shard::Replicated => (SHARD_REPLICATED, 0, 0),
        };
        let mut bytes = [0u8; 16];
        bytes[0] = ORDER_V1;
        bytes[1] = self.dtype as u8;
        bytes[2] = kind;
        bytes[4..6].copy_from_slice(&self.layers.to_le_bytes());
        bytes[6..8].copy_from_slice(&start.to_le_bytes());
        bytes[8..10].copy_from_slice(&end.to_le_bytes());
        bytes[10..12].copy_from_slice(&self.layers_per_segment.to_le_bytes());
        bytes[12..16].copy_from_slice(&self.state_bytes_per_layer.to_le_bytes());
        fingerprint(CONTEXT_STATE_LAYOUT, &bytes)
    }
}

/// Segment `index` of a payload cut into `segment_bytes` pieces.
pub(crate) fn segment_range(payload_bytes: u64, segment_bytes: u64, index: u16) -> Option<(u64, u64)> {
    if segment_bytes == 0 {
        return None;
    }
    let offset = u64::from(index).checked_mul(segment_bytes)?;
    (offset < payload_bytes).then(|| (offset, segment_bytes.min(payload_bytes - offset)))
}

/// The shard code of KV heads `start..end` of a model's `kv_heads`: 0 for
/// the whole range (such a replica is the block itself), else
/// `kv_heads << 32 | start << 16 | end`. A scheduler that holds no layout
/// (vLLM's) computes its ranks' codes from this alone.
pub fn shard_code(kv_heads: u16, start: u16, end: u16) -> Result<u64, LayoutError> {
    if start >= end || end > kv_heads {
        return Err(LayoutError::HeadRange { start, end, kv_heads });
    }
    if start == 0 && end == kv_heads {
        return Ok(0);
    }
    Ok(u64::from(kv_heads) << 32 | u64::from(start) << 16 | u64::from(end))
}

fn fingerprint(context: &str, canonical: &[u8]) -> u64 {
    let digest = blake3::derive_key(context, canonical);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn qwen3_8b(shard: Shard) -> Layout {
        Layout::new(LayoutParams {
            layers: 36,
            planes: KvPlanes::KeyValue,
            kv_heads: 8,
            shard,
            head_dim: 128,
            dtype: Dtype::Bf16,
            block_tokens: 16,
            layers_per_segment: 1,
        })
        .unwrap()
    }

    #[test]
    fn sizes_and_segments() {
        let full = qwen3_8b(Shard::Heads { start: 0, end: 8 });
        assert_eq!(full.layer_bytes(), 2 * 8 * 128 * 16 * 2);
        assert_eq!(full.block_bytes(), 36 * 65_536);
        assert_eq!(full.segment_count(), 36);
        assert_eq!(full.segment_range(35), Some((35 * 65_536, 65_536)));
        assert_eq!(full.segment_range(36), None);
        let half = qwen3_8b(Shard::Heads { start: 4, end: 8 });
        assert_eq!(half.block_bytes() * 2, full.block_bytes());
        assert_ne!(half.fingerprint(), full.fingerprint());
    }

    #[test]
    fn uneven_layer_groups_end_short() {
        let layout = Layout::new(LayoutParams {
            layers: 61,
            planes: KvPlanes::Latent,
            kv_heads: 1,
            shard: Shard::Replicated,
            head_dim: 576,
            dtype: Dtype::Bf16,
            block_tokens: 64,
            layers_per_segment: 4,
        })
        .unwrap();
        assert_eq!(layout.segment_count(), 16);
        let (offset, len) = layout.segment_range(15).unwrap();
        assert_eq!(len, layout.layer_bytes());
        assert_eq!(offset + len, layout.block_bytes());
    }

    #[test]
    fn invalid_layouts_are_rejected() {
        let mut params = qwen3_8b(Shard::Replicated).to_wire();
        params.shard_kind = SHARD_HEADS;
        params.shard_start = 4;
        params.shard_end = 9;
        assert_eq!(Layout::from_wire(&params), Err(LayoutError::HeadRange { start: 4, end: 9, kv_heads: 8 }));
        params.shard_end = 4;
        assert!(Layout::from_wire(&params).is_err());
        params.shard_kind = 3;
        assert!(matches!(Layout::from_wire(&params), Err(LayoutError::UnknownCode { field: "shard", .. })));
        let mut zero = qwen3_8b(Shard::Replicated).to_wire();
        zero.head_dim = 0;
        assert_eq!(Layout::from_wire(&zero), Err(LayoutError::Zero("head_dim")));
        let mut huge = qwen3_8b(Shard::Replicated).to_wire();
        huge.head_dim = u16::MAX;
        huge.layers = u16::MAX;
        huge.layers_per_segment = 256;
        assert_eq!(Layout::from_wire(&huge), Err(LayoutError::PayloadTooLarge));
        let mut many = qwen3_8b(Shard::Replicated).to_wire();
        many.layers = 2000;
        assert_eq!(Layout::from_wire(&many), Err(LayoutError::Segments(2000)));
    }

    #[test]
    fn wire_round_trip() {
        for shard in [Shard::Replicated, Shard::Heads { start: 2, end: 6 }] {
            let layout = qwen3_8b(shard);
            assert_eq!(Layout::from_wire(&layout.to_wire()), Ok(layout));
        }
    }

    #[test]
    fn recurrent_layouts_live_apart() {
        let state = RecurrentLayout::new(36, 65_536, Dtype::Bf16, Shard::Replicated, 1).unwrap();
        assert_eq!(state.block_bytes(), 36 * 65_536);
        assert_eq!(state.segment_range(0), Some((0, 65_536)));
        assert_ne!(state.fingerprint(), qwen3_8b(Shard::Replicated).fingerprint());
        assert!(RecurrentLayout::new(36, 0, Dtype::Bf16, Shard::Replicated, 1).is_err());
    }

    #[test]
    fn a_partial_shard_is_named_apart_and_the_whole_block_is_not() {
        use crate::{BlockKey, ShardMask};
        // The whole block, either way it can be said: keys as they are.
        assert_eq!(qwen3_8b(Shard::Replicated).shard_code(), 0);
        assert_eq!(qwen3_8b(Shard::Heads { start: 0, end: 8 }).shard_code(), 0);
        let rank0 = qwen3_8b(Shard::Heads { start: 0, end: 4 }).shard_code();
        let rank1 = qwen3_8b(Shard::Heads { start: 4, end: 8 }).shard_code();
        assert_eq!(rank0, shard_code(8, 0, 4).unwrap());
        assert_eq!(rank1, 8 << 32 | 4 << 16 | 8);
        assert_ne!(rank0, rank1);
        assert!(shard_code(8, 4, 4).is_err() && shard_code(8, 2, 9).is_err());
        let key = BlockKey([7; 16]);
        let (m0, m1) = (ShardMask::from_code(rank0), ShardMask::from_code(rank1));
        assert_eq!(ShardMask::from_code(0).apply(key), key);
        assert_ne!(m0.apply(key), key);
        assert_ne!(m0.apply(key), m1.apply(key));
        // Invertible, and "no parent" stays "no parent".
        assert_eq!(m0.apply(m0.apply(key)), key);
        assert_eq!(m1.apply(BlockKey::NONE), BlockKey::NONE);
    }
}
