//! The CUDA side: probing for a driver and a device, compiling the kernels,
//! registering host memory, and launching gathers and scatters on a stream.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PinnedHostSlice,
    PushKernelArg,
};

use crate::crc::{Shift, chunk_bytes};
use crate::source::{CRC_CHUNKS, CRC_FOLD, CRC_RUNS, GATHER, SCATTER, SOURCE};

/// Why the GPU path is not available, or failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuError(pub String);

impl core::fmt::Display for GpuError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GpuError {}

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> GpuError + '_ {
    move |e| GpuError(format!("{what}: {e:?}"))
}

/// Whether this machine can run the kernels: the driver library, NVRTC and
/// at least one device. Checked before any context is made (a context
/// made without the driver library panics inside cudarc).
pub fn probe() -> Result<usize, GpuError> {
    // SAFETY: only tries to load the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(GpuError("no CUDA driver library (libcuda.so) on this machine".into()));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError("no NVRTC library (libnvrtc.so) on this machine".into()));
    }
    let count = CudaContext::device_count().map_err(driver("counting CUDA devices"))?;
    match usize::try_from(count) {
        Ok(0) | Err(_) => Err(GpuError("the CUDA driver sees no device".into())),
        Ok(n) => Ok(n),
    }
}

/// One (layer, plane) of an engine's paged KV cache in device memory: the
/// address of block 0, token 0, head 0, and the byte strides (layout of
/// the kernels' `struct Piece`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Piece {
    /// Device address of block 0, token 0, head 0.
    pub base: u64,
    /// Bytes from one engine block to the next.
    pub block_stride: i64,
    /// Bytes from one token to the next.
    pub token_stride: i64,
    /// Bytes from one head to the next.
    pub head_stride: i64,
}

// SAFETY: plain old data of the layout the kernel reads.
unsafe impl cudarc::driver::DeviceRepr for Piece {}

/// An engine's paged KV cache on one device, as the kernels see it.
#[derive(Debug)]
pub struct DeviceKv {
    pieces: CudaSlice<Piece>,
    count: usize,
    tokens: u32,
    heads: u32,
    head_bytes: u32,
}

impl DeviceKv {
    /// Pieces of a block ((layer, plane) pairs, layer-major).
    pub fn pieces(&self) -> usize {
        self.count
    }

    /// Payload bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.count * self.tokens as usize * self.heads as usize * self.head_bytes as usize
    }
}

/// Gathers and scatters between engine KV in device memory and payloads at
/// device-accessible addresses, on one stream of one device.
#[derive(Debug)]
pub struct KvCopier {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    gather: CudaFunction,
    scatter: CudaFunction,
    crc_chunks: CudaFunction,
    crc_fold: CudaFunction,
    crc_runs: CudaFunction,
    /// The stream the copy engines' work of a staged load goes on.
    copy_stream: Arc<CudaStream>,
    /// The HBM staging region of staged loads (made on first use).
    staging: Mutex<Option<Staging>>,
    /// Whether batched copies are tried (`cuMemcpyBatchAsync_v2`: drivers of
    /// CUDA 13 and later); cleared the first time the driver refuses one,
    /// then copies go one by one.
    batch_copies: std::sync::atomic::AtomicBool,
    descriptors: Mutex<Descriptors>,
    /// The CRC fold's shift tables on the device, per chunk size.
    shifts: Mutex<Vec<(usize, Arc<CudaSlice<u32>>)>>,
    /// Spare page-locked buffers segment CRCs are copied into.
    crc_hosts: Arc<Mutex<Vec<PinnedHostSlice<u32>>>>,
    /// Thread blocks of a [`Width::BesideCopies`] launch:
    /// [`BESIDE_COPIES_CTAS`], or every work item where the host link is
    /// a coherent one (NVLink-C2C, hundreds of GB/s) that a throttled
    /// kernel would hold back.
    beside_copies: u32,
}

/// Threads per block of a launch.
const THREADS: u32 = 256;

/// Bytes one thread block copies at most: a piece is split into chunks so
/// that a launch of a few blocks still runs on many SMs.
const CHUNK_BYTES: usize = 4096;

/// Bytes one GPU thread checksums at most: the CRC is a serial chain per
/// thread, so the GPU needs many short chunks in flight to keep up with
/// the bus (the fold joins them into segment CRCs).
const CRC_CHUNK_MAX: usize = 1024;

/// The chunk size the GPU checksums in: the largest power of two, at most
/// [`CRC_CHUNK_MAX`], dividing every one of `lengths` (so chunks never
/// straddle a segment, block or piece boundary).
fn crc_chunk(lengths: &[usize]) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    chunk_bytes(lengths.iter().fold(0, |g, &l| gcd(g, l)), CRC_CHUNK_MAX)
}

/// Thread blocks of a staged load's scatter while the copy engines carry
/// the next unit across the bus. A full-width scatter of a 32 MiB staging
/// unit moves ~1.7 TB/s of HBM traffic for ~0.1 ms, and while it runs the
/// copy engines' PCIe transfers drop from 55 to 51 GB/s (H200, per-unit
/// events): the bus loses more than the kernel gains. 16 thread blocks
/// move the unit in ~0.3 ms, under the 0.56 ms the next unit spends on
/// the bus, and leave the transfers at the bus's rate. (A staged save's
/// gather stays full width: its unit's copies wait for it.)
const BESIDE_COPIES_CTAS: u32 = 16;

/// How many thread blocks a gather or scatter runs on.
#[derive(Clone, Copy, Debug)]
enum Width {
    /// One per work item: done as soon as HBM allows.
    Full,
    /// The copier's `beside_copies`: slower, leaving the HBM to the copy
    /// engines' transfers beside it.
    BesideCopies,
}

/// Blocks one launch takes at most (a larger batch is several launches).
const SLOT_BLOCKS: usize = 4096;

/// Launches whose descriptors can be in flight at once.
const SLOTS: usize = 64;

/// Bytes of one unit of the HBM staging region, and units in it: a staged
/// load moves a unit's worth of blocks' layer group across the bus with
/// the copy engines while the kernels change the layout of the unit
/// before it, so the region bounds the HBM a load borrows from the engine.
pub const STAGING_UNIT_BYTES: usize = 32 << 20;
/// See [`STAGING_UNIT_BYTES`].
pub const STAGING_UNITS: usize = 4;

/// The HBM staging region: `STAGING_UNITS` units, each with the event its
/// copies were queued before (the kernels wait for it) and the event its
/// kernels were queued before (the next copies into it wait for that).
#[derive(Debug)]
struct Staging {
    /// The region's memory (held for `base`).
    _memory: CudaSlice<u8>,
    base: u64,
    copied: Vec<CudaEvent>,
    freed: Vec<CudaEvent>,
    used: Vec<bool>,
    next: usize,
}

/// Launch descriptors — payload addresses and engine block ids — live in
/// page-locked, device-mapped host memory: a launch writes them with plain
/// stores and the kernel reads them across the bus, so a launch costs no
/// copy call and no allocation. A slot is reused only once the event
/// recorded after its launch has passed.
#[derive(Debug)]
struct Descriptors {
    memory: *mut u8,
    layout: std::alloc::Layout,
    registered: Option<RegisteredHost>,
    /// One event per slot, recorded after the slot's launch.
    events: Vec<CudaEvent>,
    used: Vec<bool>,
    next: usize,
}

// SAFETY: the memory is owned by this value and only touched under the
// copier's mutex (and by kernels of launches whose events are waited for
// before the slot is written again).
unsafe impl Send for Descriptors {}

/// Bytes of one slot: `SLOT_BLOCKS` payload addresses, then as many ids.
const SLOT_BYTES: usize = SLOT_BLOCKS * 8 + SLOT_BLOCKS * 4;

impl Descriptors {
    fn new(ctx: &Arc<CudaContext>) -> Result<Self, GpuError> {
        let layout = std::alloc::Layout::from_size_align(SLOTS * SLOT_BYTES, 4096)
            .map_err(|e| GpuError(format!("descriptor memory: {e}")))?;
        // SAFETY: a non-zero size.
        let memory = unsafe { std::alloc::alloc_zeroed(layout) };
        if memory.is_null() {
            return Err(GpuError("allocating descriptor memory".into()));
        }
        let mut descriptors =
            Self { memory, layout, registered: None, events: Vec::new(), used: vec![false; SLOTS], next: 0 };
        // SAFETY: owned page-aligned memory, unregistered before it is
        // freed (Drop below).
        descriptors.registered = Some(unsafe { RegisteredHost::register_in(ctx, memory, layout.size()) }?);
        for _ in 0..SLOTS {
            descriptors.events.push(ctx.new_event(None).map_err(driver("creating an event"))?);
        }
        Ok(descriptors)
    }

    /// Writes one launch's descriptors into the next free slot; their
    /// device addresses (payload addresses, block ids).
    fn write(&mut self, engine_blocks: &[u32], payloads: &[u64]) -> Result<(usize, u64, u64), GpuError> {
        let slot = self.next;
        self.next = (self.next + 1) % SLOTS;
        if self.used[slot] {
            self.events[slot].synchronize().map_err(driver("waiting for a descriptor slot"))?;
        }
        let base = slot * SLOT_BYTES;
        let ids = base + SLOT_BLOCKS * 8;
        if engine_blocks.len() > SLOT_BLOCKS || payloads.len() > engine_blocks.len() {
            return Err(GpuError("a launch's descriptors overflow their slot".into()));
        }
        for (i, &id) in engine_blocks.iter().enumerate() {
            let id_at = self.memory.wrapping_add(ids + i * 4).cast::<u32>();
            // SAFETY: inside this slot (at most SLOT_BLOCKS entries, checked
            // above), 4-aligned (slot bases are 4 KiB-aligned).
            unsafe { id_at.write_volatile(id) };
        }
        for (i, &payload) in payloads.iter().enumerate() {
            let address_at = self.memory.wrapping_add(base + i * 8).cast::<u64>();
            // SAFETY: as above, 8-aligned.
            unsafe { address_at.write_volatile(payload) };
        }
        // The stores above must be visible before the launch's doorbell.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let registered = self.registered.as_ref().ok_or_else(|| GpuError("descriptors not registered".into()))?;
        let at = |offset| registered.device_address(offset).ok_or_else(|| GpuError("descriptor offset".into()));
        Ok((slot, at(base)?, at(ids)?))
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        for (event, &used) in self.events.iter().zip(&self.used) {
            if used {
                let _ = event.synchronize();
            }
        }
        self.registered = None;
        // SAFETY: allocated with this layout, no longer registered.
        unsafe { std::alloc::dealloc(self.memory, self.layout) };
    }
}

impl KvCopier {
    /// A context on device `ordinal`, a stream of its own, the kernels
    /// compiled for that device. Call [`probe`] first.
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        let ctx = CudaContext::new(ordinal).map_err(driver("creating a CUDA context"))?;
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE).map_err(|e| GpuError(format!("compiling the kernels: {e:?}")))?;
        let module = ctx.load_module(ptx).map_err(driver("loading the kernels"))?;
        let gather = module.load_function(GATHER).map_err(driver("finding the gather kernel"))?;
        let scatter = module.load_function(SCATTER).map_err(driver("finding the scatter kernel"))?;
        let crc_chunks = module.load_function(CRC_CHUNKS).map_err(driver("finding the CRC kernel"))?;
        let crc_fold = module.load_function(CRC_FOLD).map_err(driver("finding the CRC fold kernel"))?;
        let crc_runs = module.load_function(CRC_RUNS).map_err(driver("finding the CRC kernel of runs"))?;
        let copy_stream = ctx.new_stream().map_err(driver("creating a copy stream"))?;
        // Entry points newer drivers have (cudarc panics on a missing one:
        // asked for only where the driver's version has them).
        let mut version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&raw mut version) }.result().map_err(driver("the driver's version"))?;
        if version >= 12_040 {
            // Loaded now, not at each kernel's first launch (the driver
            // loads modules lazily): a first request pays no JIT.
            for function in [&gather, &scatter, &crc_chunks, &crc_fold, &crc_runs] {
                // SAFETY: a function of a module loaded in this context.
                unsafe { sys::cuFuncLoad(function.cu_function()) }.result().map_err(driver("loading a kernel"))?;
            }
        }
        let descriptors = Mutex::new(Descriptors::new(&ctx)?);
        let coherent_link = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES)
            .map_err(driver("reading the device's host link"))?;
        let mut copier = Self {
            ctx,
            stream,
            gather,
            scatter,
            crc_chunks,
            crc_fold,
            crc_runs,
            copy_stream,
            staging: Mutex::new(None),
            batch_copies: std::sync::atomic::AtomicBool::new(version >= 13_000),
            descriptors,
            shifts: Mutex::new(Vec::new()),
            crc_hosts: Arc::new(Mutex::new(Vec::new())),
            beside_copies: if coherent_link == 1 { u32::MAX } else { BESIDE_COPIES_CTAS },
        };
        // The staging region is the pool's from the start: a first load
        // does not pay for making it, and an engine that fills HBM later
        // cannot leave Lake without one.
        let staging = copier.new_staging()?;
        copier.staging = Mutex::new(Some(staging));
        Ok(copier)
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch goes on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Describes an engine's KV cache: `pieces` (layer-major, then plane),
    /// each `tokens × heads × head_bytes` per block.
    pub fn describe(&self, pieces: &[Piece], tokens: u32, heads: u32, head_bytes: u32) -> Result<DeviceKv, GpuError> {
        if pieces.is_empty() || tokens == 0 || heads == 0 || head_bytes == 0 {
            return Err(GpuError("a KV description needs pieces, tokens, heads and head bytes".into()));
        }
        let on_device = self.stream.clone_htod(pieces).map_err(driver("copying the pieces"))?;
        Ok(DeviceKv { pieces: on_device, count: pieces.len(), tokens, heads, head_bytes })
    }

    fn launch(
        &self,
        function: &CudaFunction,
        kv: &DeviceKv,
        engine_blocks: &[u32],
        payloads: &[u64],
        pieces: core::ops::Range<usize>,
        width: Width,
    ) -> Result<(), GpuError> {
        if engine_blocks.len() != payloads.len() {
            return Err(GpuError("one payload address per engine block".into()));
        }
        if pieces.is_empty() || pieces.end > kv.count {
            return Err(GpuError(format!("pieces {pieces:?} of {}", kv.count)));
        }
        let too_many = |_| GpuError("too many pieces".into());
        let piece_count = u32::try_from(pieces.len()).map_err(too_many)?;
        let first_piece = u32::try_from(pieces.start).map_err(too_many)?;
        let piece_bytes = kv.tokens as usize * kv.heads as usize * kv.head_bytes as usize;
        let parts = u32::try_from(piece_bytes.div_ceil(CHUNK_BYTES).clamp(1, 65_535)).unwrap_or(1);
        let mut descriptors = self.descriptors.lock().map_err(|_| GpuError("descriptor lock poisoned".into()))?;
        for (ids, addresses) in engine_blocks.chunks(SLOT_BLOCKS).zip(payloads.chunks(SLOT_BLOCKS)) {
            let (slot, payloads_at, ids_at) = descriptors.write(ids, addresses)?;
            let block_count = u32::try_from(ids.len()).map_err(|_| GpuError("too many blocks".into()))?;
            // At most SLOT_BLOCKS × 65,535 pieces × 65,535 parts work items.
            let work = u64::from(piece_count) * u64::from(block_count) * u64::from(parts);
            let grid = match width {
                Width::Full => u32::try_from(work.min(i32::MAX as u64)).unwrap_or(1),
                Width::BesideCopies => self.beside_copies.min(u32::try_from(work).unwrap_or(u32::MAX)),
            };
            let config = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            let mut args = self.stream.launch_builder(function);
            args.arg(&kv.pieces).arg(&ids_at).arg(&payloads_at).arg(&kv.tokens).arg(&kv.heads).arg(&kv.head_bytes);
            args.arg(&first_piece).arg(&piece_count).arg(&block_count).arg(&parts);
            // SAFETY: the kernel's parameters are these ten, in this order
            // and of these sizes (the two descriptor arrays as device
            // addresses of mapped host memory, written above and not
            // rewritten until this launch's event passes); every address
            // it touches lies in the engine KV `kv` describes (the caller's
            // blocks) or in the caller's payloads (each `kv.block_bytes()`
            // long and device-accessible until the stream passes this).
            unsafe { args.launch(config) }.map_err(driver("launching"))?;
            descriptors.events[slot].record(&self.stream).map_err(driver("recording an event"))?;
            descriptors.used[slot] = true;
        }
        Ok(())
    }

    /// Queues the gather of engine blocks `engine_blocks[i]` into the
    /// payload at `payloads[i]` (each [`DeviceKv::block_bytes`] long and
    /// device-accessible: registered host memory or device memory).
    ///
    /// # Safety
    ///
    /// Every engine block id is below the engine's block count; every
    /// payload address is valid and writable for a block's bytes until the
    /// stream has passed this work (synchronize or an event).
    pub unsafe fn gather(&self, kv: &DeviceKv, engine_blocks: &[u32], payloads: &[u64]) -> Result<(), GpuError> {
        self.launch(&self.gather, kv, engine_blocks, payloads, 0..kv.count, Width::Full)
    }

    /// Queues the scatter of payloads into engine blocks (see
    /// [`KvCopier::gather`]).
    ///
    /// # Safety
    ///
    /// As [`KvCopier::gather`], the payloads readable.
    pub unsafe fn scatter(&self, kv: &DeviceKv, engine_blocks: &[u32], payloads: &[u64]) -> Result<(), GpuError> {
        self.launch(&self.scatter, kv, engine_blocks, payloads, 0..kv.count, Width::Full)
    }

    /// Queues the scatter of pieces `pieces` only (a layer's, for a
    /// layer-wise load) of each payload into its engine block; the payload
    /// addresses are still the blocks' starts.
    ///
    /// # Safety
    ///
    /// As [`KvCopier::scatter`].
    pub unsafe fn scatter_pieces(
        &self,
        kv: &DeviceKv,
        engine_blocks: &[u32],
        payloads: &[u64],
        pieces: core::ops::Range<usize>,
    ) -> Result<(), GpuError> {
        self.launch(&self.scatter, kv, engine_blocks, payloads, pieces, Width::Full)
    }

    /// An event recorded on the stream now: it passes once everything
    /// queued so far has run.
    pub fn record(&self) -> Result<CudaEvent, GpuError> {
        let event = self.ctx.new_event(None).map_err(driver("creating an event"))?;
        event.record(&self.stream).map_err(driver("recording an event"))?;
        Ok(event)
    }

    /// An event that passes once everything queued so far on both of the
    /// copier's streams has run: the kernels, and the copies of staged
    /// saves and loads. (The copy stream is made to wait for the kernels
    /// queued so far; copies queued after them wait for those anyway.)
    pub fn record_all(&self) -> Result<CudaEvent, GpuError> {
        let kernels = self.record()?;
        self.copy_stream.wait(&kernels).map_err(driver("ordering the copy stream after the kernels"))?;
        let event = self.ctx.new_event(None).map_err(driver("creating an event"))?;
        event.record(&self.copy_stream).map_err(driver("recording an event"))?;
        Ok(event)
    }

    /// An event recorded now on another stream of this device's primary
    /// context (an engine's: `stream` is its raw `CUstream`, 0 for the
    /// legacy default stream): it passes once everything the engine queued
    /// there so far has run. With [`KvCopier::wait_for`], work of this
    /// copier is ordered after the engine's, with no host wait.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this device's primary context (or 0).
    pub unsafe fn record_on(&self, stream: u64) -> Result<CudaEvent, GpuError> {
        let event = self.ctx.new_event(None).map_err(driver("creating an event"))?;
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // SAFETY: a live stream (contract) and a live event of this context.
        unsafe { sys::cuEventRecord(event.cu_event(), stream as sys::CUstream) }
            .result()
            .map_err(driver("recording an event on the engine's stream"))?;
        Ok(event)
    }

    /// Makes this copier's stream wait, on the GPU, for `event` (recorded
    /// by [`KvCopier::record_on`]): what it queues next runs after it.
    pub fn wait_for(&self, event: &CudaEvent) -> Result<(), GpuError> {
        self.stream.wait(event).map_err(driver("waiting for the engine's event"))
    }

    /// Makes another stream of this device's primary context (an engine's:
    /// `stream` is its raw `CUstream`, 0 for the legacy default stream)
    /// wait, on the GPU, for `event`; the host does not wait.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this device's primary context (or 0).
    pub unsafe fn stream_wait(&self, stream: u64, event: &CudaEvent) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // SAFETY: a live stream (contract) and a live event of this context.
        unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, event.cu_event(), 0) }
            .result()
            .map_err(driver("making a stream wait for an event"))
    }

    /// The segment CRCs (`segment_bytes` each, the last one shorter where
    /// it falls so) of the payloads of `engine_blocks`, computed on the GPU
    /// from the engine's own memory: block after block, segment after
    /// segment. The CPU never reads the payload. Waits for the result.
    ///
    /// # Safety
    ///
    /// Every engine block id is below the engine's block count.
    pub unsafe fn segment_crcs(
        &self,
        kv: &DeviceKv,
        engine_blocks: &[u32],
        segment_bytes: usize,
    ) -> Result<Vec<u32>, GpuError> {
        let mut crcs = Vec::new();
        for group in engine_blocks.chunks(SLOT_BLOCKS) {
            // SAFETY: the caller's contract.
            let mut queued = unsafe { self.segment_crcs_queued(kv, group, segment_bytes) }?;
            queued.done.synchronize().map_err(driver("waiting for segment CRCs"))?;
            crcs.extend(queued.take_ready()?.unwrap_or_default());
        }
        Ok(crcs)
    }

    /// [`KvCopier::segment_crcs`] queued behind what the stream has: the
    /// CRCs land in page-locked host memory, read once
    /// [`QueuedCrcs::take_ready`] says the stream has passed them — the
    /// host never waits.
    ///
    /// # Safety
    ///
    /// As [`KvCopier::segment_crcs`].
    pub unsafe fn segment_crcs_queued(
        &self,
        kv: &DeviceKv,
        engine_blocks: &[u32],
        segment_bytes: usize,
    ) -> Result<QueuedCrcs, GpuError> {
        let block_bytes = kv.block_bytes();
        if segment_bytes == 0 || engine_blocks.is_empty() || engine_blocks.len() > SLOT_BLOCKS {
            return Err(GpuError(format!("segment CRCs need a segment size and 1..={SLOT_BLOCKS} blocks")));
        }
        let chunk = crc_chunk(&[segment_bytes, block_bytes]);
        let too_many = |_| GpuError("too many chunks".into());
        let chunks_per_block = u32::try_from(block_bytes / chunk).map_err(too_many)?;
        let chunks_per_segment = u32::try_from(segment_bytes.min(block_bytes) / chunk).map_err(too_many)?;
        let segments = u32::try_from(block_bytes.div_ceil(segment_bytes)).map_err(too_many)?;
        let blocks = u32::try_from(engine_blocks.len()).map_err(too_many)?;
        let chunk_u32 = u32::try_from(chunk).map_err(too_many)?;
        // Nothing below copies from pageable memory (that would wait for
        // the stream): block ids go through the mapped descriptor ring,
        // the shift table is made once per chunk size.
        let shift = self.shift(chunk)?;
        let mut descriptors = self.descriptors.lock().map_err(|_| GpuError("descriptor lock poisoned".into()))?;
        let (slot, _, ids_at) = descriptors.write(engine_blocks, &[])?;
        let mut chunk_crcs = self
            .stream
            .alloc_zeros::<u32>(chunks_per_block as usize * engine_blocks.len())
            .map_err(driver("allocating chunk CRCs"))?;
        let config = LaunchConfig {
            grid_dim: (chunks_per_block.div_ceil(THREADS), blocks, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = self.stream.launch_builder(&self.crc_chunks);
        args.arg(&kv.pieces).arg(&ids_at).arg(&mut chunk_crcs).arg(&kv.tokens).arg(&kv.heads).arg(&kv.head_bytes);
        args.arg(&chunk_u32).arg(&chunks_per_block);
        // SAFETY: the kernel's eight parameters in order and type; reads
        // the engine blocks `kv` describes (ids valid: contract; in the
        // mapped ring slot written above, kept until this slot's event),
        // writes `chunks_per_block` CRCs per block into an allocation that
        // size.
        unsafe { args.launch(config) }.map_err(driver("launching the CRC kernel"))?;
        descriptors.events[slot].record(&self.stream).map_err(driver("recording an event"))?;
        descriptors.used[slot] = true;
        drop(descriptors);
        self.fold_queued(chunk_crcs, &shift, chunks_per_block, chunks_per_segment, segments, blocks)
    }

    /// Folds chunk CRCs (`chunks_per_block` a block) into segment CRCs
    /// on the stream and queues their copy to page-locked host memory.
    fn fold_queued(
        &self,
        chunk_crcs: CudaSlice<u32>,
        shift: &CudaSlice<u32>,
        chunks_per_block: u32,
        chunks_per_segment: u32,
        segments: u32,
        blocks: u32,
    ) -> Result<QueuedCrcs, GpuError> {
        let count = segments as usize * blocks as usize;
        let mut segment_crcs = self.stream.alloc_zeros::<u32>(count).map_err(driver("allocating"))?;
        let config =
            LaunchConfig { grid_dim: (segments.div_ceil(64), blocks, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
        let mut args = self.stream.launch_builder(&self.crc_fold);
        args.arg(&chunk_crcs).arg(&mut segment_crcs).arg(shift).arg(&chunks_per_block).arg(&chunks_per_segment);
        args.arg(&segments);
        // SAFETY: the kernel's six parameters in order and type; reads the
        // chunk CRCs just computed, writes `segments` per block.
        unsafe { args.launch(config) }.map_err(driver("launching the CRC fold"))?;
        let mut host = self.crc_host(count)?;
        // Exactly `count` CRCs (cudarc's copy would take the whole spare).
        let to = host.as_mut_ptr().map_err(driver("page-locked CRC memory"))?;
        {
            let (from, _record) = segment_crcs.device_ptr(&self.stream);
            // SAFETY: `count` u32 on both sides (the spare holds at least
            // that many); the host side is page-locked and read only after
            // `done`.
            unsafe { sys::cuMemcpyDtoHAsync_v2(to.cast(), from, count * 4, self.stream.cu_stream()) }
                .result()
                .map_err(driver("copying segment CRCs"))?;
        }
        let done = self.record()?;
        // The device buffers are stream-ordered: freed after the copy.
        drop((chunk_crcs, segment_crcs));
        Ok(QueuedCrcs { host: Some(host), count, done, spare: Arc::clone(&self.crc_hosts) })
    }

    /// Queues a load of whole blocks from registered host memory into
    /// engine blocks `engine_blocks` through the HBM staging region, layer
    /// group after layer group (`groups`: piece ranges in order, covering
    /// the block): a unit of blocks' bytes of a group crosses the bus by the
    /// copy engines (one batched copy, on a stream of their own) while the
    /// kernels scatter the unit before it into the engine's layout and
    /// compute its chunk CRCs from the staged bytes — exactly what crossed
    /// the bus.
    ///
    /// The sources come as the first group goes: `sources_through(n, s)`
    /// appends to `s` the payload addresses (`kv.block_bytes()` each) of
    /// blocks `s.len()..n` — fewer where a block cannot be read, which ends
    /// the load there — so the caller checks a unit of blocks while the
    /// one before is on the bus. `group_queued(g)` runs once group `g`'s
    /// scatters are on the stream (a caller records its layer event there).
    /// Returns how many blocks were loaded and, if any, their segment CRCs
    /// (`segment_bytes` each, as [`KvCopier::segment_crcs`]) queued.
    /// Nothing is queued unless the load is valid: blocks `1..=4096`,
    /// groups covering the pieces, each group of a block at most
    /// [`STAGING_UNIT_BYTES`].
    ///
    /// # Safety
    ///
    /// Every engine block id is below the engine's block count; every
    /// source appended is registered host memory of a block's bytes,
    /// unchanged until the returned CRCs are ready (or
    /// [`KvCopier::synchronize`]).
    pub unsafe fn load_staged(
        &self,
        kv: &DeviceKv,
        engine_blocks: &[u32],
        segment_bytes: usize,
        groups: &[core::ops::Range<usize>],
        mut sources_through: impl FnMut(usize, &mut Vec<*const u8>),
        mut group_queued: impl FnMut(usize) -> Result<(), GpuError>,
    ) -> Result<(usize, Option<QueuedCrcs>), GpuError> {
        let mut count = engine_blocks.len();
        let piece_bytes = kv.tokens as usize * kv.heads as usize * kv.head_bytes as usize;
        let block_bytes = kv.block_bytes();
        if count == 0 || count > SLOT_BLOCKS || segment_bytes == 0 {
            return Err(GpuError(format!("a staged load takes 1..={SLOT_BLOCKS} blocks and a segment size")));
        }
        let mut covered = 0;
        for range in groups {
            if range.start != covered || range.is_empty() || range.len() * piece_bytes > STAGING_UNIT_BYTES {
                return Err(GpuError(format!("layer groups {groups:?} of {} pieces", kv.count)));
            }
            covered = range.end;
        }
        if covered != kv.count {
            return Err(GpuError(format!("layer groups {groups:?} of {} pieces", kv.count)));
        }
        // Group boundaries fall on pieces, segments on their size.
        let chunk = crc_chunk(&[segment_bytes, block_bytes, piece_bytes]);
        let too_many = |_| GpuError("too many chunks".into());
        let chunks_per_block = u32::try_from(block_bytes / chunk).map_err(too_many)?;
        let chunks_per_segment = u32::try_from(segment_bytes.min(block_bytes) / chunk).map_err(too_many)?;
        let segments = u32::try_from(block_bytes.div_ceil(segment_bytes)).map_err(too_many)?;
        let chunk_u32 = u32::try_from(chunk).map_err(too_many)?;
        let shift = self.shift(chunk)?;
        let mut staging = self.staging.lock().map_err(|_| GpuError("staging lock poisoned".into()))?;
        if staging.is_none() {
            *staging = Some(self.new_staging()?);
        }
        let ring = staging.as_mut().ok_or_else(|| GpuError("no staging region".into()))?;
        let mut chunk_crcs = self
            .stream
            .alloc_zeros::<u32>(chunks_per_block as usize * count)
            .map_err(driver("allocating chunk CRCs"))?;
        let mut sources: Vec<*const u8> = Vec::with_capacity(count);
        // A whole load (one group) lays a unit's blocks out in staging at
        // their slots' own stride, so blocks in adjacent slots cross the
        // bus in one copy (the slot headers between them with them).
        let whole = groups.len() == 1;
        for (g, range) in groups.iter().enumerate() {
            let offset = range.start * piece_bytes;
            let run = range.len() * piece_bytes;
            let per_unit =
                if whole { (STAGING_UNIT_BYTES / (run + SLOT_GAP_MAX)).max(1) } else { STAGING_UNIT_BYTES / run };
            let first_chunk = u32::try_from(offset / chunk).map_err(too_many)?;
            let chunks = u32::try_from(run / chunk).map_err(too_many)?;
            for first in (0..count).step_by(per_unit) {
                let mut last = (first + per_unit).min(count);
                if g == 0 {
                    sources_through(last, &mut sources);
                    if sources.len() < last {
                        // A block that cannot be read ends the load.
                        count = sources.len().min(count);
                        last = count;
                    }
                }
                if last <= first {
                    break;
                }
                let unit = ring.next;
                ring.next = (unit + 1) % STAGING_UNITS;
                let base = ring.base + (unit * STAGING_UNIT_BYTES) as u64;
                if ring.used[unit] {
                    // The unit's last kernels must have read it.
                    self.copy_stream.wait(&ring.freed[unit]).map_err(driver("ordering a staging unit"))?;
                }
                let from: Vec<u64> = sources[first..last].iter().map(|s| s.wrapping_add(offset) as u64).collect();
                let stride = if whole { slot_stride(&from, run as u64) } else { run as u64 };
                let copies = coalesce(&from, stride, run as u64);
                let mut destinations: Vec<u64> = copies.iter().map(|c| base + c.first as u64 * stride).collect();
                let mut starts: Vec<u64> = copies.iter().map(|c| c.source).collect();
                let mut sizes: Vec<usize> = copies
                    .iter()
                    .map(|c| usize::try_from(c.len))
                    .collect::<Result<_, _>>()
                    .map_err(|_| GpuError("a copy longer than the address space".into()))?;
                // SAFETY: block j of the unit lands at `base + j * stride`,
                // `run` bytes, inside this unit ((per_unit - 1) * stride +
                // run <= STAGING_UNIT_BYTES: stride <= run + SLOT_GAP_MAX);
                // a copy of several blocks reads their sources and the
                // gaps between them, adjacent slots of one registered
                // arena (contract; offset + run <= block_bytes).
                unsafe { self.copy_batch(&mut destinations, &mut starts, &mut sizes) }?;
                ring.copied[unit].record(&self.copy_stream).map_err(driver("recording a copy"))?;
                self.stream.wait(&ring.copied[unit]).map_err(driver("ordering the kernels after a copy"))?;
                // The scatter addresses a payload by its start: the run
                // sits where piece `range.start` would.
                let payloads: Vec<u64> =
                    (0..last - first).map(|j| (base + j as u64 * stride).wrapping_sub(offset as u64)).collect();
                // The group's last unit has no copy beside it to spare.
                let width = if last == count { Width::Full } else { Width::BesideCopies };
                self.launch(&self.scatter, kv, &engine_blocks[first..last], &payloads, range.clone(), width)?;
                let runs = u32::try_from(last - first).map_err(too_many)?;
                let first_block = u32::try_from(first).map_err(too_many)?;
                let config = LaunchConfig {
                    grid_dim: (chunks.div_ceil(THREADS), runs, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let run_stride = stride;
                let mut args = self.stream.launch_builder(&self.crc_runs);
                args.arg(&base).arg(&run_stride).arg(&mut chunk_crcs).arg(&chunk_u32).arg(&chunks);
                args.arg(&chunks_per_block).arg(&first_chunk).arg(&first_block);
                // SAFETY: the kernel's eight parameters in order and type;
                // reads `runs` runs of `chunks` chunks `stride` apart inside
                // this staging unit, writes rows `first..last` (each
                // `chunks_per_block`, columns from `first_chunk`, inside it:
                // offset + run <= block_bytes) of an allocation of `count`
                // rows.
                unsafe { args.launch(config) }.map_err(driver("launching the CRC kernel of runs"))?;
                ring.freed[unit].record(&self.stream).map_err(driver("recording a staging unit's kernels"))?;
                ring.used[unit] = true;
            }
            if count == 0 {
                return Ok((0, None));
            }
            group_queued(g)?;
        }
        drop(staging);
        let blocks = u32::try_from(count).map_err(too_many)?;
        let crcs = self.fold_queued(chunk_crcs, &shift, chunks_per_block, chunks_per_segment, segments, blocks)?;
        Ok((count, Some(crcs)))
    }

    /// Queues a save of whole engine blocks into registered host memory
    /// (`destinations[i]`, `kv.block_bytes()` each, for engine block
    /// `engine_blocks[i]`) through the HBM staging region: a unit of blocks
    /// is gathered into Lake's order in HBM by the kernel while the copy
    /// engines carry the unit before it across the bus (one batched copy
    /// on their own stream). Done once [`KvCopier::synchronize`] returns.
    /// Nothing is queued unless every block fits a staging unit.
    ///
    /// # Safety
    ///
    /// Every engine block id is below the engine's block count; every
    /// destination is registered host memory of a block's bytes, not read
    /// or written by anyone else until the synchronize.
    pub unsafe fn save_staged(
        &self,
        kv: &DeviceKv,
        engine_blocks: &[u32],
        destinations: &[*mut u8],
    ) -> Result<(), GpuError> {
        let block_bytes = kv.block_bytes();
        if engine_blocks.len() != destinations.len() || block_bytes > STAGING_UNIT_BYTES || block_bytes == 0 {
            return Err(GpuError(format!(
                "a staged save takes a destination a block and blocks of at most {STAGING_UNIT_BYTES} bytes"
            )));
        }
        let per_unit = STAGING_UNIT_BYTES / block_bytes;
        let mut staging = self.staging.lock().map_err(|_| GpuError("staging lock poisoned".into()))?;
        let ring = staging.as_mut().ok_or_else(|| GpuError("no staging region".into()))?;
        for first in (0..engine_blocks.len()).step_by(per_unit) {
            let last = (first + per_unit).min(engine_blocks.len());
            let unit = ring.next;
            ring.next = (unit + 1) % STAGING_UNITS;
            let base = ring.base + (unit * STAGING_UNIT_BYTES) as u64;
            if ring.used[unit] {
                // The unit's last copies (or a load's kernels) must be done.
                self.stream.wait(&ring.freed[unit]).map_err(driver("ordering a staging unit"))?;
            }
            let mut staged: Vec<u64> = (0..last - first).map(|j| base + (j * block_bytes) as u64).collect();
            // Full width: the unit's copies wait for this gather (a
            // slower one leaves the bus idle between turns of a save).
            self.launch(&self.gather, kv, &engine_blocks[first..last], &staged, 0..kv.count, Width::Full)?;
            ring.copied[unit].record(&self.stream).map_err(driver("recording a gather"))?;
            self.copy_stream.wait(&ring.copied[unit]).map_err(driver("ordering copies after a gather"))?;
            let mut to: Vec<u64> = destinations[first..last].iter().map(|&d| d as u64).collect();
            let mut sizes = vec![block_bytes; to.len()];
            // SAFETY: each source is a block inside this unit; each
            // destination a registered block (contract).
            unsafe { self.copy_batch(&mut to, &mut staged, &mut sizes) }?;
            ring.freed[unit].record(&self.copy_stream).map_err(driver("recording a staging unit's copies"))?;
            ring.used[unit] = true;
        }
        Ok(())
    }

    /// The HBM staging region, ready for the copy stream.
    fn new_staging(&self) -> Result<Staging, GpuError> {
        let buffer = self
            .stream
            .alloc_zeros::<u8>(STAGING_UNITS * STAGING_UNIT_BYTES)
            .map_err(driver("allocating the HBM staging region"))?;
        let base = self.address(&buffer);
        // Made on the kernels' stream; the copy stream writes it next.
        self.stream.synchronize().map_err(driver("making the staging region"))?;
        let event = || self.ctx.new_event(None).map_err(driver("creating an event"));
        let copied = (0..STAGING_UNITS).map(|_| event()).collect::<Result<Vec<_>, _>>()?;
        let freed = (0..STAGING_UNITS).map(|_| event()).collect::<Result<Vec<_>, _>>()?;
        Ok(Staging { _memory: buffer, base, copied, freed, used: vec![false; STAGING_UNITS], next: 0 })
    }

    /// Queues copies of `len` bytes each between the staging region and
    /// registered host memory, either way, on the copy stream: one batched
    /// call where the driver takes it, else one call a copy.
    ///
    /// # Safety
    ///
    /// Every range is device memory or registered host memory, valid for
    /// `len` bytes until the copy stream passes them.
    unsafe fn copy_batch(
        &self,
        destinations: &mut [u64],
        sources: &mut [u64],
        sizes: &mut [usize],
    ) -> Result<(), GpuError> {
        use std::sync::atomic::Ordering::Relaxed;
        assert!(destinations.len() == sources.len() && sources.len() == sizes.len());
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        let stream = self.copy_stream.cu_stream();
        if self.batch_copies.load(Relaxed) {
            let nowhere = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
            let mut attributes = sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: nowhere,
                dstLocHint: nowhere,
                flags: 0,
            };
            let mut applies_from = 0usize;
            // SAFETY: three arrays of `destinations.len()` entries, one
            // attribute set applying from copy 0, a live stream; the
            // ranges are valid (contract).
            let batched = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    destinations.as_mut_ptr(),
                    sources.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    destinations.len(),
                    &raw mut attributes,
                    &raw mut applies_from,
                    1,
                    stream,
                )
            };
            if batched.result().is_ok() {
                return Ok(());
            }
            // An older driver: copy one by one from now on (a copy the
            // refused batch did queue is queued again, the same bytes).
            self.batch_copies.store(false, Relaxed);
        }
        for ((&destination, &source), &len) in destinations.iter().zip(sources.iter()).zip(sizes.iter()) {
            // SAFETY: valid ranges (contract), a live stream; the driver
            // tells host from device memory by address (unified).
            unsafe { sys::cuMemcpyAsync(destination, source, len, stream) }
                .result()
                .map_err(driver("copying through the staging region"))?;
        }
        Ok(())
    }

    /// The fold's shift table for `chunk`-byte chunks, on the device.
    fn shift(&self, chunk: usize) -> Result<Arc<CudaSlice<u32>>, GpuError> {
        let mut shifts = self.shifts.lock().map_err(|_| GpuError("shift lock poisoned".into()))?;
        if let Some((_, table)) = shifts.iter().find(|(c, _)| *c == chunk) {
            return Ok(Arc::clone(table));
        }
        let table = self.stream.clone_htod(&Shift::new(chunk as u64).columns).map_err(driver("copying the shift"))?;
        let table = Arc::new(table);
        shifts.push((chunk, Arc::clone(&table)));
        Ok(table)
    }

    /// Page-locked host memory for `count` CRCs: a spare one, or a new
    /// one (allocating page-locked memory is slow: they are kept).
    fn crc_host(&self, count: usize) -> Result<PinnedHostSlice<u32>, GpuError> {
        let mut spare = self.crc_hosts.lock().map_err(|_| GpuError("CRC buffer lock poisoned".into()))?;
        if let Some(at) = spare.iter().position(|h| h.len() >= count) {
            return Ok(spare.swap_remove(at));
        }
        drop(spare);
        // SAFETY: written by the copy queued next, read only after it.
        unsafe { self.ctx.alloc_pinned_with_flags::<u32>(count.max(CRC_HOST_MIN), 0) }
            .map_err(driver("allocating page-locked memory for CRCs"))
    }

    /// Waits for everything queued on the stream (tests and benchmarks;
    /// the data plane polls events instead).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.copy_stream.synchronize().map_err(driver("synchronizing the copy stream"))?;
        self.stream.synchronize().map_err(driver("synchronizing"))
    }

    /// Queues a plain copy of `len` bytes from host memory at `source` to
    /// the device at `destination` (the raw operation benches compare the
    /// kernels with).
    ///
    /// # Safety
    ///
    /// Both ranges valid for `len` bytes until the stream passes this copy;
    /// the host range page-locked (registered) for it to be asynchronous.
    pub unsafe fn copy_to_device(&self, destination: u64, source: *const u8, len: usize) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // SAFETY: valid ranges (contract); the stream is this context's.
        unsafe { sys::cuMemcpyHtoDAsync_v2(destination, source.cast(), len, self.stream.cu_stream()) }
            .result()
            .map_err(driver("copying to the device"))
    }

    /// Queues a plain copy of `len` bytes from the device at `source` to
    /// host memory at `destination` (see [`KvCopier::copy_to_device`]).
    ///
    /// # Safety
    ///
    /// As [`KvCopier::copy_to_device`].
    pub unsafe fn copy_to_host(&self, destination: *mut u8, source: u64, len: usize) -> Result<(), GpuError> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        // SAFETY: valid ranges (contract); the stream is this context's.
        unsafe { sys::cuMemcpyDtoHAsync_v2(destination.cast(), source, len, self.stream.cu_stream()) }
            .result()
            .map_err(driver("copying to the host"))
    }

    /// The device address of a device allocation.
    pub fn address<T>(&self, slice: &CudaSlice<T>) -> u64 {
        let (address, _record) = slice.device_ptr(&self.stream);
        address
    }
}

/// Segment CRCs on their way to the host (see
/// [`KvCopier::segment_crcs_queued`]).
#[derive(Debug)]
pub struct QueuedCrcs {
    host: Option<PinnedHostSlice<u32>>,
    count: usize,
    done: CudaEvent,
    spare: Arc<Mutex<Vec<PinnedHostSlice<u32>>>>,
}

impl QueuedCrcs {
    /// The CRCs once the stream has passed them (taken once; `None` while
    /// they are on their way). An error of the stream is returned as such.
    pub fn take_ready(&mut self) -> Result<Option<Vec<u32>>, GpuError> {
        if !self.done.try_is_complete().map_err(driver("querying an event"))? {
            return Ok(None);
        }
        let Some(host) = self.host.take() else { return Ok(None) };
        let crcs = host.as_slice().map_err(driver("reading segment CRCs"))?[..self.count].to_vec();
        if let Ok(mut spare) = self.spare.lock()
            && spare.len() < CRC_HOSTS_KEPT
        {
            spare.push(host);
        }
        Ok(Some(crcs))
    }
}

impl Drop for QueuedCrcs {
    fn drop(&mut self) {
        // Never read: the copy into it may still be queued; freeing it
        // waits for that (cudarc synchronizes its event).
        drop(self.host.take());
    }
}

/// CRCs a spare page-locked buffer holds at least, and spares kept.
const CRC_HOST_MIN: usize = 1 << 16;
const CRC_HOSTS_KEPT: usize = 8;

/// Host memory registered with the driver (page-locked, mapped for the
/// device): the kernels read and write it across the bus directly.
#[derive(Debug)]
pub struct RegisteredHost {
    address: usize,
    len: usize,
    device_address: u64,
}

impl RegisteredHost {
    /// Registers `len` bytes at `address` (portable, device-mapped).
    ///
    /// # Safety
    ///
    /// The range is valid host memory that outlives this value, and is
    /// not registered twice.
    pub unsafe fn register(copier: &KvCopier, address: *mut u8, len: usize) -> Result<Self, GpuError> {
        // SAFETY: the caller's contract.
        unsafe { Self::register_in(&copier.ctx, address, len) }
    }

    /// [`RegisteredHost::register`] in a context.
    ///
    /// # Safety
    ///
    /// As [`RegisteredHost::register`].
    unsafe fn register_in(ctx: &Arc<CudaContext>, address: *mut u8, len: usize) -> Result<Self, GpuError> {
        ctx.bind_to_thread().map_err(driver("binding the context"))?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: valid memory of `len` bytes (contract).
        unsafe { sys::cuMemHostRegister_v2(address.cast(), len, flags) }.result().map_err(driver("registering"))?;
        let mut device_address: sys::CUdeviceptr = 0;
        // SAFETY: the range was just registered as device-mapped.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&raw mut device_address, address.cast(), 0) };
        if let Err(e) = mapped.result() {
            // SAFETY: registered above.
            let _ = unsafe { sys::cuMemHostUnregister(address.cast()) };
            return Err(driver("mapping registered memory")(e));
        }
        Ok(Self { address: address as usize, len, device_address })
    }

    /// The device address of host byte `offset`.
    pub fn device_address(&self, offset: usize) -> Option<u64> {
        (offset <= self.len).then(|| self.device_address + offset as u64)
    }
}

impl Drop for RegisteredHost {
    fn drop(&mut self) {
        // SAFETY: registered by `register`, once.
        let _ = unsafe { sys::cuMemHostUnregister(self.address as *mut core::ffi::c_void) };
    }
}

/// The most bytes between two blocks' payloads in adjacent L1 slots (the
/// next slot's stored header, and the slot's rounding) that a whole load
/// copies across the bus with them rather than copy each block alone.
pub(crate) const SLOT_GAP_MAX: usize = 64 << 10;

/// One copy of a unit of a whole load: blocks `first..` of the unit, read
/// from `source` on, `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UnitCopy {
    /// The unit's first block it carries.
    pub(crate) first: usize,
    /// Where it reads from.
    pub(crate) source: u64,
    /// Bytes: `(blocks - 1) * stride + run`.
    pub(crate) len: u64,
}

/// The distance between the payloads of two of `sources` that sit in
/// adjacent slots — the first pair `run..=run + SLOT_GAP_MAX` apart — or
/// `run` where no two do.
pub(crate) fn slot_stride(sources: &[u64], run: u64) -> u64 {
    sources
        .windows(2)
        .map(|pair| pair[1].wrapping_sub(pair[0]))
        .find(|&delta| (run..=run + SLOT_GAP_MAX as u64).contains(&delta))
        .unwrap_or(run)
}

/// The copies that carry blocks of `run` bytes read from `sources`, in
/// order, into a unit where block `j` lands `j * stride` from its start:
/// one copy for each stretch of blocks whose sources are `stride` apart
/// too (adjacent slots), the gaps between them carried along.
pub(crate) fn coalesce(sources: &[u64], stride: u64, run: u64) -> Vec<UnitCopy> {
    let mut copies: Vec<UnitCopy> = Vec::with_capacity(sources.len());
    for (j, &source) in sources.iter().enumerate() {
        if let Some(last) = copies.last_mut()
            && stride >= run
            && source == last.source.wrapping_add((j - last.first) as u64 * stride)
        {
            last.len += stride;
            continue;
        }
        copies.push(UnitCopy { first: j, source, len: run });
    }
    copies
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_in_adjacent_slots_cross_in_one_copy_and_the_rest_alone() {
        let (run, stride) = (1000u64, 1100u64);
        // Slots 0, 1, 2 adjacent; then 7; then 3, 4 adjacent; then 4 again.
        let at = |slot: u64| 50_000 + slot * stride;
        let sources = [at(0), at(1), at(2), at(7), at(3), at(4), at(4)];
        assert_eq!(slot_stride(&sources, run), stride);
        let copies = coalesce(&sources, stride, run);
        assert_eq!(
            copies,
            [
                UnitCopy { first: 0, source: at(0), len: 2 * stride + run },
                UnitCopy { first: 3, source: at(7), len: run },
                UnitCopy { first: 4, source: at(3), len: stride + run },
                UnitCopy { first: 6, source: at(4), len: run },
            ]
        );
        // Every block's bytes land where the unit's layout puts it: block
        // j at j * stride, read from its own source.
        for (j, &source) in sources.iter().enumerate() {
            let copy = copies.iter().rev().find(|c| c.first <= j).unwrap();
            let within = (j - copy.first) as u64 * stride;
            assert!(within + run <= copy.len);
            assert_eq!(copy.source + within, source);
        }
    }

    #[test]
    fn with_no_adjacent_slots_every_block_is_a_copy_of_its_own() {
        let sources = [0u64, 10_000_000, 5_000_000];
        let stride = slot_stride(&sources, 1000);
        assert_eq!(stride, 1000);
        let copies = coalesce(&sources, stride, 1000);
        assert_eq!(copies.len(), 3);
        assert!(copies.iter().all(|c| c.len == 1000));
        // A gap wider than a slot's header is not carried.
        let far = [0u64, 1000 + SLOT_GAP_MAX as u64 + 1];
        assert_eq!(slot_stride(&far, 1000), 1000);
        assert_eq!(coalesce(&far, 1000, 1000).len(), 2);
    }
}
