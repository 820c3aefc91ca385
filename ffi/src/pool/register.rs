//! Engine memory a pool loads into and saves from: host memory, and a
//! GPU's KV pieces.

use super::*;

/// Registers `block_count` engine blocks of `block_bytes` each at `base`
/// (host memory) as target and source of loads and saves; its id goes to
/// `memory_id`. The memory must stay valid until detach. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `memory_id` writable; `base` valid for
/// `block_bytes * block_count` bytes for as long as the pool is attached.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_register_host_memory(
    pool: *const LakePool,
    base: *mut u8,
    block_bytes: usize,
    block_count: u32,
    memory_id: *mut u32,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if base.is_null() || memory_id.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_register_host_memory: base and memory_id"));
            }
            if block_bytes == 0 || block_count == 0 || block_bytes.checked_mul(block_count as usize).is_none() {
                return Err(fail(LakeStatus::LakeInvalidArgument, "lake_register_host_memory: empty or too large"));
            }
            let memory = EngineMemory::contiguous(base as usize, block_bytes, block_count)
                .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("lake_register_host_memory: {e}")))?;
            let id = add_memory(pool, Memory::Host(Arc::new(memory)))?;
            // SAFETY: writable (contract).
            unsafe { memory_id.write(id) };
            Ok(())
        })())
    })
}

/// Where one (layer, plane) of every engine block lies: block `b`, token
/// `t`, head `h` of it starts at `address + b*block_stride +
/// t*token_stride + h*head_stride` and holds `head_bytes` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeKvPiece {
    /// Address of block 0, token 0, head 0.
    pub address: usize,
    /// Bytes from one engine block to the next.
    pub block_stride: i64,
    /// Bytes from one token to the next within a block.
    pub token_stride: i64,
    /// Bytes from one head to the next within a token.
    pub head_stride: i64,
}

/// Options of [`lake_register_kv_memory`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeKvMemoryOptions {
    /// `sizeof(LakeKvMemoryOptions)`.
    pub struct_size: usize,
    /// The blocks' geometry; its fingerprint must be the one the pool was
    /// attached with.
    pub layout: *const crate::layout::LakeLayoutOptions,
    /// Engine blocks addressable (ids `0..block_count`).
    pub block_count: u32,
    /// One piece per (layer, plane), layer-major: layer 0's K, layer 0's
    /// V, layer 1's K, ... (MLA: one per layer).
    pub pieces: *const LakeKvPiece,
    /// `layers * planes`.
    pub piece_count: usize,
    /// 0: host memory (the agent copies with the CPU); 1: memory of CUDA
    /// device `device` (moved by kernels; the pool's L1 arena is
    /// registered with that device on first use).
    pub memory_kind: u32,
    /// The CUDA device ordinal, for `memory_kind` 1.
    pub device: u32,
    /// For GPU memory, how bytes cross the bus: 0 the copy engines between
    /// pinned slots and a staging buffer in HBM, the layout changed by a
    /// kernel in HBM (keeps the bus while the GPU computes); 1 one kernel
    /// reading or writing the pinned slots directly (fastest on an idle
    /// GPU). See docs/gpu.md.
    pub gpu_path: u32,
    /// For GPU memory, the layer groups a load of L1 hits goes in (each
    /// one copy a block over the copy engines, and one event
    /// `lake_wait_layer` waits on): 0 the default, 8; 1 every block whole
    /// — for an engine that waits for the whole load, not layer by layer
    /// (vLLM's connector): fewer, larger copies, 0.96 of the bus against
    /// 0.90 for 8 groups of 2 MiB blocks on the H200. At most 64.
    pub layer_groups: u32,
}

/// Registers the engine's paged KV cache in host memory — any order of
/// blocks, layers, planes, tokens and heads, described piece by piece — as
/// target and source of loads and saves; its id goes to `memory_id`. Loads
/// scatter each block's payload into the engine's order and saves gather it
/// straight into the pool, with no staging copy. The memory must stay
/// valid until detach. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `options` a `LakeKvMemoryOptions` whose
/// pointers hold what it says; every byte the pieces describe valid for as
/// long as the pool is attached; `memory_id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_register_kv_memory(
    pool: *const LakePool,
    options: *const LakeKvMemoryOptions,
    memory_id: *mut u32,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if memory_id.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_register_kv_memory: memory_id is required"));
            }
            // SAFETY: null or a LakeKvMemoryOptions (contract).
            let o = unsafe { read_options(options, "LakeKvMemoryOptions") }?;
            // SAFETY: null or a LakeLayoutOptions (contract).
            let layout = unsafe { read_options(o.layout, "LakeLayoutOptions") }?;
            let layout = crate::layout::layout_of(&layout)?;
            // The memory must be of the layout and the shard the pool saves
            // and reads under (both come from lake_layout_describe).
            for (what, field, memory, attached) in [
                ("fingerprint", "fingerprint", layout.fingerprint(), pool.layout_fingerprint),
                ("shard code", "shard_code", layout.shard_code(), pool.shard_code),
            ] {
                if memory != attached {
                    return Err(fail(
                        LakeStatus::LakeLayoutMismatch,
                        format!(
                            "lake_register_kv_memory: the layout's {what} {memory:#x} is not the pool's {attached:#x} \
                             (attach with the {field} lake_layout_describe gives)"
                        ),
                    ));
                }
            }
            if o.pieces.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_register_kv_memory: pieces is required"));
            }
            if o.piece_count > 1 << 16 {
                return Err(fail(LakeStatus::LakeInvalidArgument, "lake_register_kv_memory: too many pieces"));
            }
            // SAFETY: non-null, `piece_count` entries (contract; bounded).
            let given = unsafe { core::slice::from_raw_parts(o.pieces, o.piece_count) };
            let stride =
                |v: i64| isize::try_from(v).map_err(|_| fail(LakeStatus::LakeInvalidArgument, "a stride does not fit"));
            let pieces = given
                .iter()
                .map(|p| {
                    Ok(Piece {
                        base: p.address,
                        block_stride: stride(p.block_stride)?,
                        token_stride: stride(p.token_stride)?,
                        head_stride: stride(p.head_stride)?,
                    })
                })
                .collect::<Result<Vec<_>, LakeStatus>>()?;
            let head_bytes = usize::try_from(u64::from(layout.head_dim()) * layout.dtype().bytes())
                .map_err(|_| fail(LakeStatus::LakeInvalidArgument, "head bytes do not fit"))?;
            let expected = usize::from(layout.layers()) * usize::from(layout.planes() as u8);
            let memory = match o.memory_kind {
                0 => Memory::Host(Arc::new(
                    EngineMemory::new(
                        pieces,
                        expected,
                        usize::from(layout.block_tokens()),
                        usize::from(layout.shard_heads()),
                        head_bytes,
                        o.block_count,
                    )
                    .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("lake_register_kv_memory: {e}")))?,
                )),
                1 => Memory::Gpu(Arc::new(gpu_memory(pool, &o, &pieces, expected, &layout, head_bytes)?)),
                other => {
                    return Err(fail(
                        LakeStatus::LakeInvalidArgument,
                        format!("lake_register_kv_memory: memory_kind {other}: 0 host, 1 CUDA device"),
                    ));
                }
            };
            let id = add_memory(pool, memory)?;
            // SAFETY: writable (contract).
            unsafe { memory_id.write(id) };
            Ok(())
        })())
    })
}

/// Describes GPU memory: the pool's device opened (and its arena slots
/// registered) on first use; one device per attached pool.
fn gpu_memory(
    pool: &LakePool,
    o: &LakeKvMemoryOptions,
    pieces: &[Piece],
    expected: usize,
    layout: &lake_dp::Layout,
    head_bytes: usize,
) -> Result<GpuMemory, LakeStatus> {
    if pieces.len() != expected || o.block_count == 0 {
        return Err(fail(
            LakeStatus::LakeInvalidArgument,
            format!(
                "lake_register_kv_memory: {} pieces given, the layout has {expected}; block_count > 0",
                pieces.len()
            ),
        ));
    }
    let ordinal = o.device as usize;
    let gpu = {
        let mut slot = pool.gpu.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
        match &*slot {
            Some(gpu) if gpu.ordinal == ordinal => Arc::clone(gpu),
            Some(gpu) => {
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("this pool moves GPU memory of device {} already: attach once per device", gpu.ordinal),
                ));
            }
            None => {
                let (base, len) = pool.slot_area;
                let gpu = Arc::new(
                    Gpu::open(ordinal, base as *mut u8, len)
                        .map_err(|e| fail(LakeStatus::LakeUnavailable, format!("GPU memory: {e}")))?,
                );
                *slot = Some(Arc::clone(&gpu));
                gpu
            }
        }
    };
    let device_pieces: Vec<lake_kernels::Piece> = pieces
        .iter()
        .map(|p| lake_kernels::Piece {
            base: p.base as u64,
            block_stride: p.block_stride as i64,
            token_stride: p.token_stride as i64,
            head_stride: p.head_stride as i64,
        })
        .collect();
    let small =
        |what: &str| fail(LakeStatus::LakeInvalidArgument, format!("lake_register_kv_memory: {what} too large"));
    let kv = gpu
        .describe(
            &device_pieces,
            u32::from(layout.block_tokens()),
            u32::from(layout.shard_heads()),
            u32::try_from(head_bytes).map_err(|_| small("head bytes"))?,
        )
        .map_err(|e| fail(LakeStatus::LakeIo, format!("lake_register_kv_memory: {e}")))?;
    let path = match o.gpu_path {
        0 => GpuPath::CopyEngine,
        1 => GpuPath::Direct,
        other => {
            return Err(fail(
                LakeStatus::LakeInvalidArgument,
                format!("lake_register_kv_memory: gpu_path {other}: 0 copy engine, 1 direct"),
            ));
        }
    };
    let groups = match o.layer_groups {
        0 => gpu::LAYER_GROUPS_DEFAULT,
        n @ 1..=64 => n as usize,
        other => {
            return Err(fail(
                LakeStatus::LakeInvalidArgument,
                format!("lake_register_kv_memory: layer_groups {other}: 0 (the default) to 64"),
            ));
        }
    };
    Ok(GpuMemory::new(gpu, kv, o.block_count, usize::from(layout.layers()), path, groups))
}

fn add_memory(pool: &LakePool, memory: Memory) -> Result<u32, LakeStatus> {
    let mut memories = pool.memories.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
    let id = u32::try_from(memories.len()).map_err(|_| fail(LakeStatus::LakeInvalidArgument, "too many memories"))?;
    memories.push(memory);
    Ok(id)
}

pub(super) fn memory(pool: &LakePool, id: u32, blocks: &[u32]) -> Result<Memory, LakeStatus> {
    let memories = pool.memories.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
    let memory = memories
        .get(id as usize)
        .cloned()
        .ok_or_else(|| fail(LakeStatus::LakeInvalidArgument, format!("memory {id} was not registered")))?;
    if let Some(bad) = blocks.iter().find(|&&b| b >= memory.blocks()) {
        return Err(fail(LakeStatus::LakeInvalidArgument, format!("engine block {bad} is outside memory {id}")));
    }
    Ok(memory)
}
