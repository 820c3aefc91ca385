//! Layouts across the boundary: the engine describes its KV geometry, Lake
//! answers with the fingerprint blocks are saved under and their sizes;
//! the same for a hybrid model's recurrent-state checkpoints.

use lake_dp::model::layout::{Dtype, KvPlanes, Layout, LayoutParams, RecurrentLayout, Shard};

use crate::pool::{check_size, read_options};
use crate::status::{LakeStatus, fail, guard};

/// A block's geometry, as the engine knows it (see [`lake_layout_describe`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeLayoutOptions {
    /// `sizeof(LakeLayoutOptions)`.
    pub struct_size: usize,
    /// Attention layers whose KV a block holds.
    pub layers: u32,
    /// 2: separate K and V planes; 1: one latent per token (MLA).
    pub planes: u32,
    /// The model's KV heads, all ranks together.
    pub kv_heads: u32,
    /// First KV head this engine rank holds (tensor parallelism).
    pub shard_start: u32,
    /// One past the last head it holds; 0 with `shard_start` 0: every rank
    /// holds the whole cache (MLA latents, replicated).
    pub shard_end: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Element type: 1 f16, 2 bf16, 3 f32, 4 fp8 e4m3, 5 fp8 e5m2, 6 int8.
    pub dtype: u32,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Layers per CRC segment (1: one segment per layer).
    pub layers_per_segment: u32,
}

/// What Lake makes of a [`LakeLayoutOptions`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeLayoutInfo {
    /// `sizeof(LakeLayoutInfo)`, set by the caller.
    pub struct_size: usize,
    /// The stable fingerprint blocks of this layout are saved under (give
    /// it to `lake_attach`).
    pub fingerprint: u64,
    /// Payload bytes of one block.
    pub block_bytes: u64,
    /// Bytes of one CRC segment (give it to `lake_attach`).
    pub segment_bytes: u64,
    /// KV heads this rank holds.
    pub heads: u32,
    /// Bytes of one head of one token (`head_dim` × element size).
    pub head_bytes: u32,
    /// The shard's code (give it to `lake_attach`): 0 when a replica holds
    /// the whole block (every head, or MLA latents), else the code
    /// `lake_shard_code` gives for its heads.
    pub shard_code: u64,
}

/// A hybrid model's recurrent-state checkpoint as this engine rank holds
/// it (linear-attention, GDN or Mamba layers: conv and recurrent state, no
/// tokens): an object of its own, saved under a fingerprint apart from
/// every KV layout's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeStateLayoutOptions {
    /// `sizeof(LakeStateLayoutOptions)`.
    pub struct_size: usize,
    /// Layers that carry state.
    pub layers: u32,
    /// This rank's state bytes per layer (conv and recurrent state
    /// together, in the engine's own order).
    pub state_bytes_per_layer: u32,
    /// The state's element type (codes as `LakeLayoutOptions.dtype`); a
    /// state of several types names its widest.
    pub dtype: u32,
    /// First state head this rank holds (tensor parallelism).
    pub shard_start: u32,
    /// One past the last; 0 with `shard_start` 0: the whole state.
    pub shard_end: u32,
    /// Layers per CRC segment (1: one segment per layer).
    pub layers_per_segment: u32,
}

/// What Lake makes of a [`LakeStateLayoutOptions`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeStateLayoutInfo {
    /// `sizeof(LakeStateLayoutInfo)`, set by the caller.
    pub struct_size: usize,
    /// The fingerprint checkpoints are saved under (give it to
    /// `lake_attach`, with `object_kind` 2).
    pub fingerprint: u64,
    /// Payload bytes of one checkpoint.
    pub block_bytes: u64,
    /// Bytes of one CRC segment (give it to `lake_attach`).
    pub segment_bytes: u64,
}

/// Describes a recurrent-state checkpoint: its fingerprint and sizes into
/// `info` (whose `struct_size` must be set). Pure; thread-safe.
///
/// # Safety
///
/// `options` points at a `LakeStateLayoutOptions`; `info` at a writable
/// `LakeStateLayoutInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_state_layout_describe(
    options: *const LakeStateLayoutOptions,
    info: *mut LakeStateLayoutInfo,
) -> LakeStatus {
    guard(|| {
        let result = (|| {
            if info.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_state_layout_describe: info is required"));
            }
            // SAFETY: null or a LakeStateLayoutOptions (contract).
            let o = unsafe { read_options(options, "LakeStateLayoutOptions") }?;
            // SAFETY: non-null (checked), a LakeStateLayoutInfo (contract).
            let size = unsafe { (*info).struct_size };
            check_size(size, size_of::<LakeStateLayoutInfo>(), "LakeStateLayoutInfo")?;
            let layout = RecurrentLayout::new(
                field(o.layers, "layers")?,
                o.state_bytes_per_layer,
                dtype_of(o.dtype, "state layout")?,
                shard_of(o.shard_start, o.shard_end)?,
                field(o.layers_per_segment, "layers_per_segment")?,
            )
            .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("state layout: {e}")))?;
            let value = LakeStateLayoutInfo {
                struct_size: size,
                fingerprint: layout.fingerprint(),
                block_bytes: layout.block_bytes(),
                segment_bytes: layout.segment_bytes(),
            };
            // SAFETY: writable (contract), size checked.
            unsafe { info.write(value) };
            Ok(())
        })();
        match result {
            Ok(()) => LakeStatus::LakeOk,
            Err(status) => status,
        }
    })
}

fn field(value: u32, name: &str) -> Result<u16, LakeStatus> {
    u16::try_from(value)
        .map_err(|_| fail(LakeStatus::LakeInvalidArgument, format!("layout: {name} {value} is too large")))
}

/// An element type code (`LakeLayoutOptions.dtype`'s).
fn dtype_of(code: u32, what: &str) -> Result<Dtype, LakeStatus> {
    u8::try_from(code)
        .ok()
        .and_then(|code| Dtype::from_u8(code).ok())
        .ok_or_else(|| fail(LakeStatus::LakeInvalidArgument, format!("{what}: unknown dtype code {code}")))
}

/// The heads `start..end` a rank holds; `0..0`: all of them (replicated).
fn shard_of(start: u32, end: u32) -> Result<Shard, LakeStatus> {
    if start == 0 && end == 0 {
        return Ok(Shard::Replicated);
    }
    Ok(Shard::Heads { start: field(start, "shard_start")?, end: field(end, "shard_end")? })
}

/// Validates a layout description into Lake's layout.
pub(crate) fn layout_of(o: &LakeLayoutOptions) -> Result<Layout, LakeStatus> {
    let planes = match o.planes {
        1 => KvPlanes::Latent,
        2 => KvPlanes::KeyValue,
        other => return Err(fail(LakeStatus::LakeInvalidArgument, format!("layout: planes is 1 or 2, not {other}"))),
    };
    let dtype = dtype_of(o.dtype, "layout")?;
    let shard = shard_of(o.shard_start, o.shard_end)?;
    Layout::new(LayoutParams {
        layers: field(o.layers, "layers")?,
        planes,
        kv_heads: field(o.kv_heads, "kv_heads")?,
        shard,
        head_dim: field(o.head_dim, "head_dim")?,
        dtype,
        block_tokens: field(o.block_tokens, "block_tokens")?,
        layers_per_segment: field(o.layers_per_segment, "layers_per_segment")?,
    })
    .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("layout: {e}")))
}

/// Describes a block geometry: its fingerprint and sizes into `info`
/// (whose `struct_size` must be set). Pure; thread-safe.
///
/// # Safety
///
/// `options` points at a `LakeLayoutOptions`; `info` at a writable
/// `LakeLayoutInfo`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_layout_describe(
    options: *const LakeLayoutOptions,
    info: *mut LakeLayoutInfo,
) -> LakeStatus {
    guard(|| {
        let result = (|| {
            if info.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_layout_describe: info is required"));
            }
            // SAFETY: null or a LakeLayoutOptions (contract).
            let o = unsafe { read_options(options, "LakeLayoutOptions") }?;
            // SAFETY: non-null (checked), a LakeLayoutInfo (contract).
            let size = unsafe { (*info).struct_size };
            check_size(size, size_of::<LakeLayoutInfo>(), "LakeLayoutInfo")?;
            let layout = layout_of(&o)?;
            let value = LakeLayoutInfo {
                struct_size: size,
                fingerprint: layout.fingerprint(),
                block_bytes: layout.block_bytes(),
                segment_bytes: layout.segment_bytes(),
                heads: u32::from(layout.shard_heads()),
                head_bytes: u32::try_from(u64::from(layout.head_dim()) * layout.dtype().bytes()).unwrap_or(u32::MAX),
                shard_code: layout.shard_code(),
            };
            // SAFETY: writable (contract), size checked.
            unsafe { info.write(value) };
            Ok(())
        })();
        match result {
            Ok(()) => LakeStatus::LakeOk,
            Err(status) => status,
        }
    })
}

/// The shard code of KV heads `shard_start..shard_end` of a model's
/// `kv_heads` into `code`: what `lake_layout_describe` gives a rank holding
/// those heads, for a caller that holds no layout — a scheduler planning
/// for every rank of a tensor-parallel group (`lake_lookup_shards`). 0 for
/// the whole range. Pure; thread-safe.
///
/// # Safety
///
/// `code` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_shard_code(
    kv_heads: u32,
    shard_start: u32,
    shard_end: u32,
    code: *mut u64,
) -> LakeStatus {
    guard(|| {
        let result = (|| {
            if code.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_shard_code: code is required"));
            }
            let (heads, start, end) =
                (field(kv_heads, "kv_heads")?, field(shard_start, "shard_start")?, field(shard_end, "shard_end")?);
            let value = lake_dp::shard_code(heads, start, end)
                .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("lake_shard_code: {e}")))?;
            // SAFETY: non-null (checked), writable (contract).
            unsafe { code.write(value) };
            Ok(())
        })();
        match result {
            Ok(()) => LakeStatus::LakeOk,
            Err(status) => status,
        }
    })
}
