//! `lake-bench gpu`: the kernels that move KV between an engine's paged
//! cache on the GPU and pool blocks in pinned host memory, against plain
//! pinned copies of the same bytes in the same run.
//!
//! The engine: a vLLM flash-attention cache, one `(2, blocks, 16, 8, 128)`
//! bf16 tensor per layer (64 KiB per layer per block), as many layers as a
//! block of `--block-bytes` holds. Saves gather scattered engine blocks
//! into contiguous payloads in registered host memory; loads scatter them
//! back into another engine cache; a sample of blocks is compared. The raw
//! operation is one `cuMemcpyAsync` of all the bytes each way between the
//! same host memory and a device buffer.

// Block counts, strides and sizes here are a few GiB at most: they fit
// every integer type they are cast to.
#![allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]

use std::time::Instant;

use lake_kernels::{KvCopier, Piece, RegisteredHost, probe};

use crate::report::{Report, median, percentile};

const TOKENS: usize = 16;
const HEADS: usize = 8;
const HEAD_BYTES: usize = 128 * 2;
const LAYER_BYTES: usize = 2 * TOKENS * HEADS * HEAD_BYTES;

/// Blocks gathered or scattered per launch.
const BATCH: usize = 256;

/// Blocks one staged load takes (as the data plane's layered loads).
const STREAMED_BLOCKS: usize = 2048;

/// The GPU path's goals.
const GOAL_RATIO: f64 = 0.95;

struct Host {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Host {
    fn new(len: usize) -> Result<Self, String> {
        let layout =
            std::alloc::Layout::from_size_align(len.next_multiple_of(4096), 4096).map_err(|e| e.to_string())?;
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(format!("allocating {len} host bytes"));
        }
        Ok(Self { ptr, layout })
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

fn gpu(e: lake_kernels::GpuError) -> String {
    e.to_string()
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct GpuArgs {
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 2 << 20)]
    pub(crate) block_bytes: usize,
    /// Bytes moved per round.
    #[arg(long, default_value_t = 1 << 30)]
    pub(crate) total_bytes: usize,
    /// Rounds measured.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Single-block samples timed.
    #[arg(long, default_value_t = 500)]
    pub(crate) samples: usize,
    /// Layer groups of a layered load.
    #[arg(long, default_value_t = 8)]
    pub(crate) groups: usize,
}

pub(crate) fn run(args: &GpuArgs) -> Result<Report, String> {
    let block_bytes: usize = args.block_bytes;
    let total_bytes: usize = args.total_bytes;
    let rounds: usize = args.rounds;
    let samples: usize = args.samples;
    // Layer groups of a staged load (the data plane's layered loads use 8).
    let group_count: usize = args.groups;
    if block_bytes == 0 || !block_bytes.is_multiple_of(LAYER_BYTES) {
        return Err(format!("--block-bytes must be a multiple of {LAYER_BYTES} (one layer of one block)"));
    }
    let blocks = total_bytes / block_bytes;
    if blocks < 2 {
        return Err("--total-bytes must hold at least two blocks".into());
    }
    let total = blocks * block_bytes;
    probe().map_err(|e| format!("gpu: {e}"))?;
    let copier = KvCopier::new(0).map_err(gpu)?;
    let stream = copier.stream().clone();
    let layers = block_bytes / LAYER_BYTES;
    let per_layer = blocks * LAYER_BYTES;

    // Two engine caches (save from one, load into the other), random-ish.
    let mut fill = vec![0u8; per_layer];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut source_layers = Vec::new();
    let mut target_layers = Vec::new();
    for _ in 0..layers {
        for byte in fill.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *byte = state.to_le_bytes()[3];
        }
        source_layers.push(stream.clone_htod(&fill).map_err(|e| format!("{e:?}"))?);
        target_layers.push(stream.alloc_zeros::<u8>(per_layer).map_err(|e| format!("{e:?}"))?);
    }
    let pieces = |tensors: &[cudarc::driver::CudaSlice<u8>]| -> Vec<Piece> {
        let mut out = Vec::new();
        for tensor in tensors {
            let base = copier.address(tensor);
            for plane in 0..2u64 {
                out.push(Piece {
                    base: base + plane * (blocks * LAYER_BYTES / 2) as u64,
                    block_stride: (LAYER_BYTES / 2) as i64,
                    token_stride: (HEADS * HEAD_BYTES) as i64,
                    head_stride: HEAD_BYTES as i64,
                });
            }
        }
        out
    };
    let source =
        copier.describe(&pieces(&source_layers), TOKENS as u32, HEADS as u32, HEAD_BYTES as u32).map_err(gpu)?;
    let target =
        copier.describe(&pieces(&target_layers), TOKENS as u32, HEADS as u32, HEAD_BYTES as u32).map_err(gpu)?;

    // The pool side: pinned host memory, one payload per block.
    let host = Host::new(total)?;
    let started = Instant::now();
    // SAFETY: page-aligned memory that outlives the registration.
    let registered = unsafe { RegisteredHost::register(&copier, host.ptr, host.layout.size()) }.map_err(gpu)?;
    let register_ms = started.elapsed().as_secs_f64() * 1e3;
    let payloads: Vec<u64> = (0..blocks).map(|i| registered.device_address(i * block_bytes).unwrap_or(0)).collect();
    // Engine blocks in a scattered order, as a running engine's are.
    let mut order: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..order.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    let device_scratch = stream.alloc_zeros::<u8>(total).map_err(|e| format!("{e:?}"))?;
    let scratch = copier.address(&device_scratch);

    // The other way to move a batch: copy-then-scatter (load) and
    // gather-then-copy (save) through a staging buffer in device memory,
    // the bus crossed by the copy engine in one contiguous copy per batch.
    let staging_slice = stream.alloc_zeros::<u8>(BATCH * block_bytes).map_err(|e| format!("{e:?}"))?;
    let staging = copier.address(&staging_slice);
    let staged: Vec<u64> = (0..BATCH).map(|i| staging + (i * block_bytes) as u64).collect();
    let (mut save, mut load, mut h2d, mut d2h) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // The raw copy cut into staging units: what a pipeline of units can
    // reach before any scatter, gather or CRC (the copies' own gaps).
    let mut unit_h2d = Vec::new();
    let (mut staged_save, mut staged_load) = (Vec::new(), Vec::new());
    // The data plane's load: the copy engines into the HBM staging region,
    // layer group by layer group, the scatter and the CRCs of what crossed
    // the bus in HBM behind them (`KvCopier::load_staged`).
    let mut streamed_load = Vec::new();
    let group_layers = layers.div_ceil(group_count.clamp(1, layers));
    let groups: Vec<core::ops::Range<usize>> =
        (0..layers).step_by(group_layers).map(|l| 2 * l..2 * (l + group_layers).min(layers)).collect();
    let sources: Vec<*const u8> = (0..blocks).map(|i| host.ptr.wrapping_add(i * block_bytes).cast_const()).collect();
    let mut streamed_crcs: Vec<u32> = Vec::new();
    // Bytes: after the first round's load each way, the target cache holds
    // every source block where it was (then it is zeroed again).
    let source_host: Vec<Vec<u8>> =
        source_layers.iter().map(|t| stream.clone_dtoh(t)).collect::<Result<_, _>>().map_err(|e| format!("{e:?}"))?;
    let mut check_and_clear = |what: &str| -> Result<(), String> {
        for (layer, (tensor, expected)) in target_layers.iter_mut().zip(&source_host).enumerate() {
            if stream.clone_dtoh(tensor).map_err(|e| format!("{e:?}"))? != *expected {
                return Err(format!("{what}: layer {layer} of the loaded cache differs from the saved one"));
            }
            stream.memset_zeros(tensor).map_err(|e| format!("{e:?}"))?;
        }
        Ok(())
    };
    for round in 0..rounds {
        let started = Instant::now();
        for (batch, ids) in order.chunks(BATCH).enumerate() {
            // SAFETY: ids are engine blocks; staging holds BATCH blocks.
            unsafe { copier.gather(&source, ids, &staged[..ids.len()]) }.map_err(gpu)?;
            let at = host.ptr.wrapping_add(batch * BATCH * block_bytes);
            // SAFETY: the batch's payloads, registered host memory.
            unsafe { copier.copy_to_host(at, staging, ids.len() * block_bytes) }.map_err(gpu)?;
        }
        copier.synchronize().map_err(gpu)?;
        staged_save.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        let started = Instant::now();
        for (batch, ids) in order.chunks(BATCH).enumerate() {
            let at = host.ptr.wrapping_add(batch * BATCH * block_bytes);
            // SAFETY: as above.
            unsafe { copier.copy_to_device(staging, at, ids.len() * block_bytes) }.map_err(gpu)?;
            // SAFETY: as above.
            unsafe { copier.scatter(&target, ids, &staged[..ids.len()]) }.map_err(gpu)?;
        }
        copier.synchronize().map_err(gpu)?;
        staged_load.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        if round == 0 {
            check_and_clear("copy then scatter")?;
        }
        let started = Instant::now();
        for (ids, addresses) in order.chunks(BATCH).zip(payloads.chunks(BATCH)) {
            // SAFETY: ids are engine blocks; payloads registered, block-sized.
            unsafe { copier.gather(&source, ids, addresses) }.map_err(gpu)?;
        }
        copier.synchronize().map_err(gpu)?;
        save.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        let started = Instant::now();
        for (ids, addresses) in order.chunks(BATCH).zip(payloads.chunks(BATCH)) {
            // SAFETY: as above.
            unsafe { copier.scatter(&target, ids, addresses) }.map_err(gpu)?;
        }
        copier.synchronize().map_err(gpu)?;
        load.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        if round == 0 {
            check_and_clear("scatter from host")?;
        }
        let started = Instant::now();
        let mut queued = Vec::new();
        for (ids, from) in order.chunks(STREAMED_BLOCKS).zip(sources.chunks(STREAMED_BLOCKS)) {
            let sources_through = |n: usize, s: &mut Vec<*const u8>| s.extend_from_slice(&from[s.len()..n]);
            // SAFETY: ids are engine blocks; each source is a block's
            // payload in registered host memory, untouched until the
            // synchronize below.
            let (_, crcs) =
                unsafe { copier.load_staged(&target, ids, LAYER_BYTES, &groups, sources_through, |_| Ok(())) }
                    .map_err(gpu)?;
            queued.push(crcs.ok_or("a staged load loaded nothing")?);
        }
        copier.synchronize().map_err(gpu)?;
        streamed_load.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        if round == 0 {
            check_and_clear("staged load")?;
            for mut crcs in queued {
                streamed_crcs.extend(crcs.take_ready().map_err(gpu)?.ok_or("staged CRCs not ready")?);
            }
        }
        let started = Instant::now();
        // SAFETY: both ranges `total` bytes; host registered.
        unsafe { copier.copy_to_device(scratch, host.ptr, total) }.map_err(gpu)?;
        copier.synchronize().map_err(gpu)?;
        h2d.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        let started = Instant::now();
        for at in (0..total).step_by(lake_kernels::STAGING_UNIT_BYTES) {
            let len = lake_kernels::STAGING_UNIT_BYTES.min(total - at);
            // SAFETY: both ranges inside the `total` bytes; host registered.
            unsafe { copier.copy_to_device(scratch + at as u64, host.ptr.wrapping_add(at), len) }.map_err(gpu)?;
        }
        copier.synchronize().map_err(gpu)?;
        unit_h2d.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        let started = Instant::now();
        // SAFETY: as above.
        unsafe { copier.copy_to_host(host.ptr, scratch, total) }.map_err(gpu)?;
        copier.synchronize().map_err(gpu)?;
        d2h.push(total as f64 / started.elapsed().as_secs_f64() / 1e9);
        // The raw copy back wrote the same bytes the gather left there.
    }
    // Segment CRCs (one layer a segment) of every block, on the GPU from
    // the engine's memory; the first blocks' compared with the CPU's CRCs
    // of the payloads the last save left in host memory.
    let started = Instant::now();
    // SAFETY: every id is a block of the cache.
    let crcs = unsafe { copier.segment_crcs(&source, &order, LAYER_BYTES) }.map_err(gpu)?;
    let crc_gbps = total as f64 / started.elapsed().as_secs_f64() / 1e9;
    // SAFETY: the host payloads, `total` bytes, no copy in flight.
    let saved = unsafe { std::slice::from_raw_parts(host.ptr, total) };
    for (i, expected) in saved[..64.min(blocks) * block_bytes].chunks(LAYER_BYTES).map(crc32fast::hash).enumerate() {
        if crcs[i] != expected {
            return Err(format!("segment CRC {i}: GPU {:#x}, CPU {expected:#x}", crcs[i]));
        }
        if streamed_crcs.get(i) != Some(&expected) {
            return Err(format!("staged load's CRC {i}: {:?}, CPU {expected:#x}", streamed_crcs.get(i)));
        }
    }

    // One block at a time: gather + synchronize vs a raw copy + synchronize.
    let one = |bytes: usize| -> Result<(f64, f64, f64, f64, f64), String> {
        let layers_in = bytes / LAYER_BYTES;
        let kv = copier
            .describe(&pieces(&source_layers)[..2 * layers_in], TOKENS as u32, HEADS as u32, HEAD_BYTES as u32)
            .map_err(gpu)?;
        let (mut lake_us, mut raw_us, mut staged_us) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..samples {
            let b = order[i % blocks];
            let started = Instant::now();
            // SAFETY: a block id of the cache; staging holds a block.
            unsafe { copier.gather(&kv, &[b], &staged[..1]) }.map_err(gpu)?;
            // SAFETY: `bytes` of registered host memory and of staging.
            unsafe { copier.copy_to_host(host.ptr.wrapping_add((i % blocks) * block_bytes), staging, bytes) }
                .map_err(gpu)?;
            copier.synchronize().map_err(gpu)?;
            staged_us.push(started.elapsed().as_nanos() as f64 / 1e3);
            let started = Instant::now();
            // SAFETY: a block id of the cache; the payload slot is `bytes`.
            unsafe { copier.gather(&kv, &[b], &payloads[i % blocks..=i % blocks]) }.map_err(gpu)?;
            copier.synchronize().map_err(gpu)?;
            lake_us.push(started.elapsed().as_nanos() as f64 / 1e3);
            let started = Instant::now();
            // SAFETY: `bytes` of the registered host memory and the scratch.
            unsafe { copier.copy_to_host(host.ptr.wrapping_add((i % blocks) * block_bytes), scratch, bytes) }
                .map_err(gpu)?;
            copier.synchronize().map_err(gpu)?;
            raw_us.push(started.elapsed().as_nanos() as f64 / 1e3);
        }
        Ok((
            percentile(&mut lake_us, 500),
            percentile(&mut lake_us, 990),
            percentile(&mut raw_us, 500),
            percentile(&mut raw_us, 990),
            percentile(&mut staged_us, 500),
        ))
    };
    let small = one(LAYER_BYTES)?;
    let large = one(block_bytes.clamp(LAYER_BYTES, 2 << 20) / LAYER_BYTES * LAYER_BYTES)?;
    drop(registered);

    let (save_gbps, load_gbps) = (median(&mut save), median(&mut load));
    let (raw_h2d, raw_d2h) = (median(&mut h2d), median(&mut d2h));
    let mut report = Report::new("gpu");
    report.int("block_bytes", block_bytes as u64);
    report.int("total_bytes", total as u64);
    report.int("layers", layers as u64);
    report.float("register_ms", register_ms);
    report.float("load_gbps", load_gbps);
    report.float("save_gbps", save_gbps);
    report.float("raw_h2d_gbps", raw_h2d);
    let unit_h2d = median(&mut unit_h2d);
    report.float("raw_unit_h2d_gbps", unit_h2d);
    report.float("raw_unit_h2d_ratio", unit_h2d / raw_h2d);
    report.float("raw_d2h_gbps", raw_d2h);
    report.float("load_ratio", load_gbps / raw_h2d);
    report.float("save_ratio", save_gbps / raw_d2h);
    report.float("ratio_goal", GOAL_RATIO);
    report.float("gpu_crc_gbps", crc_gbps);
    let (staged_load, staged_save) = (median(&mut staged_load), median(&mut staged_save));
    report.float("staged_load_gbps", staged_load);
    report.float("staged_save_gbps", staged_save);
    report.float("staged_load_ratio", staged_load / raw_h2d);
    let streamed_load = median(&mut streamed_load);
    report.int("streamed_groups", groups.len() as u64);
    report.float("streamed_load_gbps", streamed_load);
    report.float("streamed_load_ratio", streamed_load / raw_h2d);
    report.float("staged_save_ratio", staged_save / raw_d2h);
    report.float("p50_us_64k", small.0);
    report.float("p99_us_64k", small.1);
    report.float("raw_p50_us_64k", small.2);
    report.float("raw_p99_us_64k", small.3);
    report.float("staged_p50_us_64k", small.4);
    report.float("p50_us_large", large.0);
    report.float("p99_us_large", large.1);
    report.float("raw_p50_us_large", large.2);
    report.float("raw_p99_us_large", large.3);
    report.float("staged_p50_us_large", large.4);
    Ok(report)
}
