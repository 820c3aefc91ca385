//! Engine memory on a GPU: an engine's paged KV cache in HBM, registered
//! through the same piece description as host memory, loaded and saved by
//! `lake-kernels` on the agent's thread.
//!
//! - The L1 arena's slots are registered with the device once (page-locked,
//!   device-mapped), so a load of L1 hits is one scatter kernel reading the
//!   pinned slots across the bus into the engine's blocks; the CPU reads
//!   each stored header (4 KiB) only, and the payload is checked by segment
//!   CRCs the GPU computes from the engine's blocks once they landed — a
//!   block that fails is reported (`LAKE_BAD_CRC`) and recomputed by the
//!   engine.
//! - Blocks below L1 go through the agent (lease, load into L1, CPU CRC
//!   check) into a registered staging buffer, then one scatter kernel.
//! - Saves: segment CRCs computed on the GPU, slots reserved with headers
//!   carrying them, one gather kernel writing every payload straight into
//!   its slot; committed once the stream has passed it.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;
use lake_agent::{Agent, PreparedSave};
use lake_dp::BlockKey;
use lake_dp::arena::{Pin, PinArray};
use lake_dp::constants::STORED_HEADER_BYTES;
use lake_dp::mirror::MirrorEntry;
use lake_dp::{Priority, Tier};
use lake_kernels::{DeviceKv, KvCopier, Piece, QueuedCrcs, RegisteredHost};

use crate::lanes::{Reader, stored};
use crate::status::LakeStatus;
use lake_dp::stored::ReadableObject;

/// Blocks the host staging buffer holds (lower-tier loads through the
/// agent go in turns of this many), and the blocks of a save's turn (each
/// reserves a slot through the agent's port).
const STAGING_BLOCKS: usize = 64;

/// L1 blocks a load pins and moves in one turn (one scatter, one CRC pass).
const LOAD_TURN: usize = 512;

/// A load of L1 hits at most this long runs layer by layer and completes
/// from the poller stage (pinned throughout, so it is bounded).
pub(crate) const LAYERED_BLOCKS_MAX: usize = 2048;

/// The layer groups a layered load goes in unless the memory says
/// otherwise: each one launch (or one copy a block) and one event (a launch
/// costs microseconds of the agent thread; a small load would pay more for
/// launches than for bytes).
pub(crate) const LAYER_GROUPS_DEFAULT: usize = 8;

/// One device of an attached pool: its kernels and the arena's slots as
/// the device sees them.
pub(crate) struct Gpu {
    copier: KvCopier,
    arena: RegisteredHost,
    arena_base: usize,
    arena_len: usize,
    pub ordinal: usize,
}

impl Gpu {
    /// An event recorded now on the engine's `stream`, for a save to wait
    /// for (see `KvCopier::record_on`).
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of this device's primary context (or 0).
    pub(crate) unsafe fn record_on(&self, stream: u64) -> Result<CudaEvent, lake_kernels::GpuError> {
        // SAFETY: the caller's contract.
        unsafe { self.copier.record_on(stream) }
    }
}

// SAFETY: the copier's CUDA objects are used from any thread (cudarc binds
// the context per call); the registration is plain addresses.
unsafe impl Send for Gpu {}
// SAFETY: as above; launches go through the copier's own lock.
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device `ordinal` and registers the arena slots at `base`
    /// (`len` bytes).
    pub(crate) fn open(ordinal: usize, base: *mut u8, len: usize) -> Result<Self, String> {
        lake_kernels::probe().map_err(|e| e.to_string())?;
        let copier = KvCopier::new(ordinal).map_err(|e| e.to_string())?;
        // SAFETY: the arena stays mapped while the pool is attached, and
        // this pool owns the one registration of this mapping.
        let arena = unsafe { RegisteredHost::register(&copier, base, len) }.map_err(|e| e.to_string())?;
        Ok(Self { copier, arena, arena_base: base as usize, arena_len: len, ordinal })
    }

    fn arena_address(&self, host: *const u8) -> Option<u64> {
        let offset = (host as usize).checked_sub(self.arena_base).filter(|&o| o < self.arena_len)?;
        self.arena.device_address(offset)
    }

    /// Describes an engine's KV cache on this device.
    pub(crate) fn describe(
        &self,
        pieces: &[Piece],
        tokens: u32,
        heads: u32,
        head_bytes: u32,
    ) -> Result<DeviceKv, String> {
        self.copier.describe(pieces, tokens, heads, head_bytes).map_err(|e| e.to_string())
    }
}

/// Page-aligned host memory registered with the device.
struct Staging {
    ptr: *mut u8,
    layout: std::alloc::Layout,
    registered: Option<RegisteredHost>,
}

impl Drop for Staging {
    fn drop(&mut self) {
        self.registered = None;
        // SAFETY: allocated with this layout, unregistered above.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// How bytes cross the bus between the engine's HBM and the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GpuPath {
    /// The copy engines move contiguous blocks between pinned slots and a
    /// staging buffer in HBM; a kernel changes the layout inside HBM. Keeps
    /// the bus when the GPU computes (docs/gpu.md).
    CopyEngine,
    /// One kernel reads or writes the pinned slots across the bus and
    /// changes the layout on the way. Fastest on an idle GPU.
    Direct,
}

/// An engine's KV cache on a GPU.
pub(crate) struct GpuMemory {
    pub gpu: Arc<Gpu>,
    pub kv: DeviceKv,
    pub blocks: u32,
    /// The model's layers (the pieces are `layers` runs, layer-major).
    pub layers: usize,
    pub path: GpuPath,
    /// The layer groups of a layered load (`LakeKvMemoryOptions::layer_groups`).
    groups: usize,
    staging: Mutex<Option<Staging>>,
}

// SAFETY: DeviceKv is a device allocation handle and plain numbers; the
// staging buffer is owned and used under its mutex.
unsafe impl Send for GpuMemory {}
// SAFETY: as above.
unsafe impl Sync for GpuMemory {}

impl GpuMemory {
    pub(crate) fn new(gpu: Arc<Gpu>, kv: DeviceKv, blocks: u32, layers: usize, path: GpuPath, groups: usize) -> Self {
        Self { gpu, kv, blocks, layers, path, groups, staging: Mutex::new(None) }
    }

    /// The pieces of layer `layer`.
    fn layer_pieces(&self, layer: usize) -> core::ops::Range<usize> {
        let per_layer = self.kv.pieces() / self.layers.max(1);
        layer * per_layer..(layer + 1) * per_layer
    }

    /// The pieces of each layer group of a layered load (at most
    /// `groups` groups of equal layer counts, the last shorter).
    fn layer_groups(&self) -> Vec<core::ops::Range<usize>> {
        let group = self.layers.div_ceil(self.groups.max(1)).max(1);
        (0..self.layers)
            .step_by(group)
            .map(|first| {
                let last = (first + group).min(self.layers);
                self.layer_pieces(first).start..self.layer_pieces(last - 1).end
            })
            .collect()
    }

    /// Whether a load can go layer by layer on this memory's path: always
    /// directly; through the copy engines when a layer group of a block
    /// fits a unit of the HBM staging region.
    fn layered_fits(&self) -> bool {
        match self.path {
            GpuPath::Direct => true,
            GpuPath::CopyEngine => {
                let piece_bytes = self.block_bytes() / self.kv.pieces().max(1);
                self.layer_groups().iter().all(|g| g.len() * piece_bytes <= lake_kernels::STAGING_UNIT_BYTES)
            }
        }
    }

    pub(crate) fn block_bytes(&self) -> usize {
        self.kv.block_bytes()
    }

    /// The staging buffer (made on first use), and the device address of
    /// each of its block slots.
    fn with_staging<T>(&self, f: impl FnOnce(*mut u8, &[u64]) -> T) -> Result<T, LakeStatus> {
        let mut staging = self.staging.lock().map_err(|_| LakeStatus::LakeInternal)?;
        if staging.is_none() {
            let len = STAGING_BLOCKS * self.block_bytes();
            let layout = std::alloc::Layout::from_size_align(len.next_multiple_of(4096), 4096)
                .map_err(|_| LakeStatus::LakeInternal)?;
            // SAFETY: a non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            if ptr.is_null() {
                return Err(LakeStatus::LakeNoSpace);
            }
            let mut made = Staging { ptr, layout, registered: None };
            // SAFETY: owned page-aligned memory, unregistered before freed.
            made.registered = Some(
                unsafe { RegisteredHost::register(&self.gpu.copier, ptr, layout.size()) }
                    .map_err(|_| LakeStatus::LakeIo)?,
            );
            *staging = Some(made);
        }
        let made = staging.as_ref().ok_or(LakeStatus::LakeInternal)?;
        let registered = made.registered.as_ref().ok_or(LakeStatus::LakeInternal)?;
        let addresses: Vec<u64> =
            (0..STAGING_BLOCKS).map(|i| registered.device_address(i * self.block_bytes()).unwrap_or(0)).collect();
        Ok(f(made.ptr, &addresses))
    }
}

/// A load into GPU memory; a status per block (the first failure says
/// why, the rest `LakePrefixBroken`), or the load still on the GPU. Layer
/// events of `request` are recorded in `layers` as the layers are queued
/// (all at the end, but for a layered direct load).
#[allow(clippy::too_many_arguments)] // one load's parts, as the agent thread holds them
pub(crate) fn load(
    agent: &mut Agent,
    pins: &Mutex<PinArray>,
    reader: Reader,
    arena_region: u16,
    memory: &Arc<GpuMemory>,
    (request, layers): (u64, &LayerEvents),
    keys: &[BlockKey],
    table: &[MirrorEntry],
    blocks: &[u32],
    priority: Priority,
) -> Loaded {
    let count = keys.len();
    let run = table.iter().take_while(|e| e.tier == Tier::L1Dram && e.region.0 == arena_region).count();
    if run == count && (1..=LAYERED_BLOCKS_MAX).contains(&count) && memory.layered_fits() {
        return match pins.lock() {
            Ok(mut pins) => load_layered(&mut pins, reader, memory, (request, layers), keys, table, blocks),
            Err(_) => Loaded::Done(vec![LakeStatus::LakeInternal; count]),
        };
    }
    let statuses = load_in_turns(agent, pins, reader, run, memory, keys, table, blocks, priority);
    // Everything landed (or failed): no layer needs a wait on the GPU.
    layers.finished(request);
    Loaded::Done(statuses)
}

/// A load in turns of bounded pins, each waited for.
#[allow(clippy::too_many_arguments)] // as `load`
fn load_in_turns(
    agent: &mut Agent,
    pins: &Mutex<PinArray>,
    reader: Reader,
    run: usize,
    memory: &GpuMemory,
    keys: &[BlockKey],
    table: &[MirrorEntry],
    blocks: &[u32],
    priority: Priority,
) -> Vec<LakeStatus> {
    let count = keys.len();
    let mut statuses = vec![LakeStatus::LakePrefixBroken; count];
    // In turns of a bounded number of pins (a pin array is finite).
    let mut from = 0;
    while from < run {
        let to = (from + LOAD_TURN).min(run);
        let direct = match pins.lock() {
            Ok(mut pins) => {
                load_pinned_run(&mut pins, reader, memory, &keys[from..to], &table[from..to], &blocks[from..to])
            }
            Err(_) => vec![LakeStatus::LakeInternal],
        };
        statuses[from..from + direct.len()].copy_from_slice(&direct);
        let landed = direct.iter().take_while(|&&s| s == LakeStatus::LakeOk).count();
        agent.stats.l1_reads += landed as u64;
        agent.stats.bytes_read += (landed * memory.block_bytes()) as u64;
        if landed < to - from {
            agent.stats.fetch_failures += (count - from - landed) as u64;
            return statuses;
        }
        from = to;
    }
    while from < count {
        let to = (from + STAGING_BLOCKS).min(count);
        let done = load_fetched(agent, memory, &keys[from..to], &table[from..to], &blocks[from..to], priority);
        let failed = done.iter().position(|&s| s != LakeStatus::LakeOk);
        statuses[from..from + done.len()].copy_from_slice(&done);
        if failed.is_some() {
            return statuses;
        }
        from = to;
    }
    statuses
}

/// L1 hits pinned and their stored headers checked, in order, up to the
/// first that fails.
struct Pinned {
    /// `LakeOk` per pinned block, then the failure that stopped the run.
    statuses: Vec<LakeStatus>,
    held: Vec<Pin>,
    /// Device addresses of the pinned payloads.
    addresses: Vec<u64>,
    /// Host addresses of the pinned payloads.
    hosts: Vec<*const u8>,
    stored_crcs: Vec<Vec<u32>>,
    segment_bytes: usize,
}

fn pin_checked(
    pins: &mut PinArray,
    reader: Reader,
    memory: &GpuMemory,
    keys: &[BlockKey],
    table: &[MirrorEntry],
) -> Pinned {
    let mut out = Pinned::with_capacity(keys.len());
    pin_checked_through(&mut out, pins, reader, memory, keys, table, keys.len());
    out
}

impl Pinned {
    fn with_capacity(n: usize) -> Self {
        Self {
            statuses: Vec::with_capacity(n),
            held: Vec::with_capacity(n),
            addresses: Vec::with_capacity(n),
            hosts: Vec::with_capacity(n),
            stored_crcs: Vec::with_capacity(n),
            segment_bytes: 0,
        }
    }

    /// Whether a block failed (the run ends there).
    fn stopped(&self) -> bool {
        self.statuses.len() > self.held.len()
    }
}

/// [`pin_checked`] continued through block `through` (from where `out`
/// stopped), unless a block already failed.
fn pin_checked_through(
    out: &mut Pinned,
    pins: &mut PinArray,
    reader: Reader,
    memory: &GpuMemory,
    keys: &[BlockKey],
    table: &[MirrorEntry],
    through: usize,
) {
    let from = out.held.len();
    if out.stopped() {
        return;
    }
    for (i, entry) in table.iter().enumerate().take(through).skip(from) {
        let Ok(pin) = pins.pin(entry.slot, entry.generation) else {
            out.statuses.push(LakeStatus::LakeEvicted);
            break;
        };
        let bytes = pins.bytes(&pin);
        let checked = (|| {
            let ReadableObject { header, payload, segment_bytes: segment } =
                stored(bytes, &keys[i], reader, memory.block_bytes())?;
            // The kernels move whole blocks; one segment size a load.
            if payload.len() != memory.block_bytes() {
                return Err(LakeStatus::LakeLayoutMismatch);
            }
            if out.segment_bytes != 0 && segment != out.segment_bytes {
                return Err(LakeStatus::LakeBadCrc);
            }
            let address = memory
                .gpu
                .arena_address(bytes.as_ptr().wrapping_add(STORED_HEADER_BYTES))
                .ok_or(LakeStatus::LakeInternal)?;
            Ok((segment, address, header.crcs().to_vec(), payload.as_ptr()))
        })();
        match checked {
            Ok((segment, address, crcs, host)) => {
                out.segment_bytes = segment;
                out.held.push(pin);
                out.addresses.push(address);
                out.hosts.push(host);
                out.stored_crcs.push(crcs);
                out.statuses.push(LakeStatus::LakeOk);
            }
            Err(status) => {
                pins.unpin(pin);
                out.statuses.push(status);
                break;
            }
        }
    }
}

/// A direct load of L1 hits, layer by layer: every block's layer 0, its
/// event, every block's layer 1, … then the GPU's segment CRCs of the
/// landed blocks, queued; the load completes from the poller stage.
fn load_layered(
    pins: &mut PinArray,
    reader: Reader,
    memory: &Arc<GpuMemory>,
    (request, layers): (u64, &LayerEvents),
    keys: &[BlockKey],
    table: &[MirrorEntry],
    blocks: &[u32],
) -> Loaded {
    let copier = &memory.gpu.copier;
    let groups = memory.layer_groups();
    // The layers through the end of group g, for its event.
    let per_layer = (memory.kv.pieces() / memory.layers.max(1)).max(1);
    let last_layer = |g: usize| groups[g].end / per_layer;
    // The first block sets the load's segment size. The kernel across the
    // bus takes every block at once, so all are checked first; the copy
    // engines take a unit at a time, so each unit is checked while the one
    // before is on the bus.
    let mut pinned = Pinned::with_capacity(keys.len());
    let first = if memory.path == GpuPath::Direct { keys.len() } else { 1 };
    pin_checked_through(&mut pinned, pins, reader, memory, keys, table, first);
    let queued = (|| {
        if pinned.held.is_empty() {
            return Ok(None);
        }
        let segment_bytes = pinned.segment_bytes;
        match memory.path {
            GpuPath::Direct => {
                let ok = pinned.held.len();
                for (g, pieces) in groups.iter().enumerate() {
                    // SAFETY: the blocks were checked against the memory's
                    // block count at submit; each payload address is a
                    // pinned slot's, unchanged until unpinned once the CRCs
                    // queued after it (same stream) have landed.
                    unsafe { copier.scatter_pieces(&memory.kv, &blocks[..ok], &pinned.addresses, pieces.clone()) }?;
                    layers.recorded(request, &Arc::new(copier.record()?), last_layer(g));
                }
                // SAFETY: as above.
                unsafe { copier.segment_crcs_queued(&memory.kv, &blocks[..ok], segment_bytes) }.map(Some)
            }
            GpuPath::CopyEngine => {
                let more = |through: usize, sources: &mut Vec<*const u8>| {
                    pin_checked_through(&mut pinned, pins, reader, memory, keys, table, through);
                    sources.extend_from_slice(&pinned.hosts[sources.len().min(pinned.hosts.len())..]);
                };
                // SAFETY: as above; each host address is a pinned slot's
                // payload in the registered arena, unchanged until the
                // returned CRCs have landed (after every copy and kernel).
                let (_, crcs) = unsafe {
                    copier.load_staged(&memory.kv, blocks, segment_bytes, &groups, more, |g| {
                        layers.recorded(request, &Arc::new(copier.record()?), last_layer(g));
                        Ok(())
                    })
                }?;
                Ok(crcs)
            }
        }
    })();
    let Pinned { mut statuses, held, stored_crcs, .. } = pinned;
    let ok = held.len();
    layers.finished(request);
    let crcs = match queued {
        Ok(crcs) => crcs,
        Err(_) => {
            // Whether anything landed is unknown: every block fails, once
            // the stream has let go of the slots.
            let _ = copier.synchronize();
            for pin in held {
                pins.unpin(pin);
            }
            let mut failed = vec![LakeStatus::LakePrefixBroken; keys.len()];
            failed[0] = LakeStatus::LakeIo;
            return Loaded::Done(failed);
        }
    };
    statuses.truncate(ok + 1);
    Loaded::InFlight(InFlight {
        request,
        count: keys.len(),
        memory: Arc::clone(memory),
        held,
        statuses,
        stored_crcs,
        crcs,
    })
}

/// L1 hits straight from their pinned slots: one scatter kernel, then the
/// GPU's segment CRCs of the landed blocks against the stored ones.
fn load_pinned_run(
    pins: &mut PinArray,
    reader: Reader,
    memory: &GpuMemory,
    keys: &[BlockKey],
    table: &[MirrorEntry],
    blocks: &[u32],
) -> Vec<LakeStatus> {
    let Pinned { mut statuses, held, addresses, hosts, stored_crcs, segment_bytes } =
        pin_checked(pins, reader, memory, keys, table);
    let ok = held.len();
    if ok > 0 {
        let copier = &memory.gpu.copier;
        let landed = if memory.path == GpuPath::CopyEngine && memory.layered_fits() {
            // The copy engines into the staging region; the CRCs of what
            // crossed the bus.
            let groups = memory.layer_groups();
            let all = |n: usize, s: &mut Vec<*const u8>| s.extend_from_slice(&hosts[s.len()..n]);
            // SAFETY: the blocks were checked against the memory's block
            // count at submit; each host address is a pinned slot's
            // payload in the registered arena, unpinned below only after
            // the streams are synchronized.
            unsafe { copier.load_staged(&memory.kv, &blocks[..ok], segment_bytes, &groups, all, |_| Ok(())) }.and_then(
                |(_, crcs)| {
                    copier.synchronize()?;
                    let mut crcs = crcs.ok_or_else(|| lake_kernels::GpuError("nothing loaded".into()))?;
                    crcs.take_ready()?.ok_or_else(|| lake_kernels::GpuError("CRCs not back".into()))
                },
            )
        } else {
            // SAFETY: as above, the payload addresses device-mapped; the
            // CRCs are computed on the same stream after the kernel.
            unsafe { copier.scatter(&memory.kv, &blocks[..ok], &addresses) }
                // SAFETY: as above.
                .and_then(|()| unsafe { copier.segment_crcs(&memory.kv, &blocks[..ok], segment_bytes) })
                .and_then(|crcs| copier.synchronize().map(|()| crcs))
        };
        match landed {
            Ok(crcs) => {
                let per_block = crcs.len() / ok;
                for (i, expected) in stored_crcs.iter().enumerate() {
                    if crcs[i * per_block..(i + 1) * per_block] != expected[..] {
                        statuses[i] = LakeStatus::LakeBadCrc;
                        statuses.truncate(i + 1);
                        break;
                    }
                }
            }
            Err(_) => {
                // Whether anything landed is unknown: every block fails.
                statuses.truncate(1);
                statuses[0] = LakeStatus::LakeIo;
            }
        }
        // Only after the stream is idle (or failed) may the slots go.
        let _ = copier.synchronize();
    }
    for pin in held {
        pins.unpin(pin);
    }
    statuses
}

/// Blocks through the agent (leases, lower-tier loads, CPU CRC checks)
/// into the staging buffer, then one scatter kernel.
fn load_fetched(
    agent: &mut Agent,
    memory: &GpuMemory,
    keys: &[BlockKey],
    table: &[MirrorEntry],
    blocks: &[u32],
    priority: Priority,
) -> Vec<LakeStatus> {
    let block_bytes = memory.block_bytes();
    let staged = memory.with_staging(|staging, addresses| {
        let mut misfit = false;
        let delivered = agent.fetch_segments_at(keys, table, priority, |i, offset, segment| {
            if offset + segment.len() > block_bytes {
                misfit = true;
                return;
            }
            // SAFETY: staging holds STAGING_BLOCKS blocks; i < keys.len()
            // <= STAGING_BLOCKS; the range is inside block i (checked).
            unsafe {
                core::ptr::copy_nonoverlapping(
                    segment.as_ptr(),
                    staging.wrapping_add(i * block_bytes + offset),
                    segment.len(),
                );
            }
        });
        let copier = &memory.gpu.copier;
        let landed = if delivered == 0 || misfit {
            Ok(())
        } else {
            // SAFETY: blocks checked at submit; the staging slots hold the
            // delivered payloads until the stream is synchronized below.
            unsafe { copier.scatter(&memory.kv, &blocks[..delivered], &addresses[..delivered]) }
                .and_then(|()| copier.synchronize())
        };
        (delivered, misfit, landed.is_ok(), agent.last_fetch_failure())
    });
    let mut statuses = vec![LakeStatus::LakeOk; keys.len()];
    let Ok((delivered, misfit, landed, failure)) = staged else {
        statuses.truncate(1);
        statuses[0] = LakeStatus::LakeIo;
        return statuses;
    };
    if misfit {
        statuses.truncate(1);
        statuses[0] = LakeStatus::LakeLayoutMismatch;
        return statuses;
    }
    if !landed {
        statuses.truncate(1);
        statuses[0] = LakeStatus::LakeIo;
        return statuses;
    }
    if delivered < keys.len() {
        statuses[delivered] = crate::status::status_of_fetch(failure);
        statuses.truncate(delivered + 1);
    }
    statuses
}

/// A save from GPU memory, in turns: a turn's slots reserved, its
/// payloads queued to cross the bus (gathered into HBM staging and copied
/// by the copy engines, or gathered straight into the slots by a kernel)
/// and its segment CRCs queued on the GPU from the engine's blocks; the
/// turn is committed, its headers written with those CRCs, once the GPU
/// has passed an event recorded after both. The next turn is reserved and
/// queued before the host waits for this one, so the bus stays busy while
/// the host reserves and commits. A status per block.
pub(crate) fn save(
    agent: &mut Agent,
    memory: &GpuMemory,
    keys: &[BlockKey],
    parents: &[BlockKey],
    blocks: &[u32],
    after: Option<&CudaEvent>,
) -> Vec<LakeStatus> {
    let len = memory.block_bytes();
    let copier = &memory.gpu.copier;
    // Ordered after the engine's writes to the blocks, on the GPU.
    if let Some(event) = after
        && copier.wait_for(event).is_err()
    {
        return vec![LakeStatus::LakeIo; keys.len()];
    }
    let segment = usize::try_from(agent.segment_bytes_for(len as u64)).unwrap_or(len);
    let mut statuses = vec![LakeStatus::LakeNoSpace; keys.len()];
    if keys.is_empty() {
        return statuses;
    }
    // The CRCs are the turns' own, known at their commits.
    let prepared: Vec<PreparedSave<'_>> = (0..keys.len())
        .map(|i| PreparedSave {
            key: keys[i],
            parent: parents[i],
            block_index: u32::try_from(i).unwrap_or(u32::MAX),
            len,
            crcs: &[],
            // Lake's kernel, from the registered engine memory the
            // copies below read, in their stream order.
            crcs_from: lake_agent::CrcOrigin::Kernel,
        })
        .collect();
    let mut saved = vec![lake_agent::SaveStatus::NotSent; keys.len()];
    agent.forget_unsaved_of(keys);
    // Turns of a bounded number of reservations (the port and the staging
    // region are finite), at least four to a save where it has the blocks
    // (so a small save overlaps too).
    let turn_blocks = keys.len().div_ceil(4).clamp(SAVE_TURN_MIN, STAGING_BLOCKS);
    let mut queued: Option<QueuedTurn> = None;
    for first in (0..keys.len()).step_by(turn_blocks) {
        let last = (first + turn_blocks).min(keys.len());
        let turn = agent.reserve_prepared(&prepared[first..last], &mut saved[first..last]);
        let landed = if turn.bodies.is_empty() {
            None
        } else {
            let ids: Vec<u32> = turn.bodies.iter().map(|&(i, _)| blocks[first + i]).collect();
            queue_save(memory, &turn.bodies, &ids)
                // SAFETY: the blocks were checked against the memory at
                // submit.
                .and_then(|()| unsafe { copier.segment_crcs_queued(&memory.kv, &ids, segment) })
                .and_then(|crcs| copier.record_all().map(|event| (event, crcs)))
                .ok()
        };
        if let Some(before) = queued.replace(QueuedTurn { first, last, turn, landed }) {
            commit_turn(agent, before, &prepared, &mut saved);
        }
    }
    if let Some(last) = queued {
        commit_turn(agent, last, &prepared, &mut saved);
    }
    for (status, saved) in statuses.iter_mut().zip(saved) {
        *status = crate::status::status_of_save(saved);
    }
    statuses
}

/// Blocks to a save's turn at least.
const SAVE_TURN_MIN: usize = 8;

/// A turn of a GPU save whose copies and CRCs are queued: the event that
/// passes once both are done, and the CRCs of the turn's blocks with a
/// slot, in `turn.bodies`' order (`None`: nothing was queued, or queueing
/// failed).
struct QueuedTurn {
    first: usize,
    last: usize,
    turn: lake_agent::PreparedTurn,
    landed: Option<(CudaEvent, lake_kernels::QueuedCrcs)>,
}

/// Queues a turn's payloads to cross the bus into its slots: `bodies` are
/// (index in the turn, payload area), `ids` their engine blocks.
fn queue_save(memory: &GpuMemory, bodies: &[(usize, *mut u8)], ids: &[u32]) -> Result<(), lake_kernels::GpuError> {
    let len = memory.block_bytes();
    let copier = &memory.gpu.copier;
    // Blocks larger than a staging unit cross the bus by the kernel.
    if memory.path == GpuPath::CopyEngine && len <= lake_kernels::STAGING_UNIT_BYTES {
        let destinations: Vec<*mut u8> = bodies.iter().map(|&(_, body)| body).collect();
        // SAFETY: the bodies are reserved slots of the registered arena,
        // `len` bytes each, written by these copies only; the turn is
        // committed only once an event recorded after them has passed.
        unsafe { copier.save_staged(&memory.kv, ids, &destinations) }
    } else {
        let addresses: Option<Vec<u64>> = bodies.iter().map(|&(_, body)| memory.gpu.arena_address(body)).collect();
        let addresses =
            addresses.ok_or_else(|| lake_kernels::GpuError("a slot outside the registered arena".into()))?;
        // SAFETY: as above; the kernel writes the bodies.
        unsafe { copier.gather(&memory.kv, ids, &addresses) }
    }
}

/// Waits for a queued turn's copies and CRCs, then commits its slots with
/// those CRCs (or aborts them, if either failed) and waits for the answers.
fn commit_turn(
    agent: &mut Agent,
    queued: QueuedTurn,
    prepared: &[PreparedSave<'_>],
    saved: &mut [lake_agent::SaveStatus],
) {
    let QueuedTurn { first, last, turn, landed } = queued;
    let crcs = landed.and_then(|(event, mut crcs)| {
        event.synchronize().ok()?;
        crcs.take_ready().ok().flatten()
    });
    let per_block = crcs.as_ref().map_or(0, |c| c.len() / turn.bodies.len().max(1));
    let mut blocks = prepared[first..last].to_vec();
    if let Some(crcs) = &crcs {
        for (k, &(i, _)) in turn.bodies.iter().enumerate() {
            blocks[i].crcs = crcs.get(k * per_block..(k + 1) * per_block).unwrap_or(&[]);
        }
    }
    let statuses = &mut saved[first..last];
    let sent = agent.commit_prepared(turn, &blocks, crcs.is_some(), statuses);
    agent.await_prepared(sent, &blocks, statuses);
}

/// The per-layer events of GPU loads, by request: the agent thread records
/// layer `l`'s event once every block's layer `l` is queued to land; an
/// engine's stream waits for it on the GPU ([`LayerEvents::wait`]).
#[derive(Default)]
pub(crate) struct LayerEvents {
    loads: Mutex<HashMap<u64, LoadEvents>>,
    changed: Condvar,
}

struct LoadEvents {
    gpu: Arc<Gpu>,
    layers: usize,
    /// Layer `i`'s event, for the layers recorded so far (layers launched
    /// together share one).
    events: Vec<Arc<CudaEvent>>,
    /// Nothing more will be recorded (done, failed or not on the GPU).
    finished: bool,
}

/// Finished loads whose events are kept for late waits, at most.
const FINISHED_KEPT: usize = 4096;

/// Why a layer wait did not put a wait on the engine's stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LayerWaitError {
    /// No such request, or not a GPU load.
    Unknown,
    /// The layer is not one of the model's.
    Layer(usize),
    /// The agent thread did not get that far in time.
    Timeout,
    /// The stream wait failed.
    Driver(String),
}

impl LayerEvents {
    /// A GPU load of `layers` layers was submitted as `request`.
    pub(crate) fn start(&self, request: u64, gpu: Arc<Gpu>, layers: usize) {
        let Ok(mut loads) = self.loads.lock() else { return };
        if loads.len() >= FINISHED_KEPT {
            let mut finished: Vec<u64> = loads.iter().filter(|(_, l)| l.finished).map(|(&r, _)| r).collect();
            finished.sort_unstable();
            for r in finished.iter().take(loads.len() + 1 - FINISHED_KEPT) {
                loads.remove(r);
            }
        }
        loads.insert(request, LoadEvents { gpu, layers, events: Vec::with_capacity(layers), finished: false });
    }

    /// `event` passes once the layers of `request` below `through` have
    /// landed (recorded in order).
    fn recorded(&self, request: u64, event: &Arc<CudaEvent>, through: usize) {
        if let Ok(mut loads) = self.loads.lock()
            && let Some(load) = loads.get_mut(&request)
        {
            while load.events.len() < through.min(load.layers) {
                load.events.push(Arc::clone(event));
            }
        }
        self.changed.notify_all();
    }

    /// Nothing more comes for `request`: its remaining layers need no wait
    /// (it completed, or failed and its completions say so).
    pub(crate) fn finished(&self, request: u64) {
        if let Ok(mut loads) = self.loads.lock()
            && let Some(load) = loads.get_mut(&request)
        {
            load.finished = true;
        }
        self.changed.notify_all();
    }

    /// Makes the engine's `stream` wait, on the GPU, until layer `layer` of
    /// load `request` has landed. The host waits only until the agent
    /// thread has queued that layer (microseconds after the load starts).
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the device's primary context, or 0.
    pub(crate) unsafe fn wait(&self, request: u64, layer: usize, stream: u64) -> Result<(), LayerWaitError> {
        let deadline = Instant::now() + lake_agent::WAIT_MAX;
        let mut loads = self.loads.lock().map_err(|_| LayerWaitError::Unknown)?;
        loop {
            let load = loads.get(&request).ok_or(LayerWaitError::Unknown)?;
            if layer >= load.layers {
                return Err(LayerWaitError::Layer(load.layers));
            }
            if let Some(event) = load.events.get(layer) {
                // SAFETY: the caller's contract.
                return unsafe { load.gpu.copier.stream_wait(stream, event) }
                    .map_err(|e| LayerWaitError::Driver(e.to_string()));
            }
            if load.finished {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LayerWaitError::Timeout);
            }
            loads = self
                .changed
                .wait_timeout(loads, left.min(Duration::from_millis(100)))
                .map_err(|_| LayerWaitError::Unknown)?
                .0;
        }
    }
}

/// A direct load of L1 hits on its way: pinned, launched layer by layer,
/// its CRCs queued; [`InFlight::poll`] completes it once the stream has
/// passed it — the agent thread never waits for the GPU.
pub(crate) struct InFlight {
    pub request: u64,
    pub count: usize,
    memory: Arc<GpuMemory>,
    held: Vec<Pin>,
    /// Per block so far: the pinned ones `LakeOk`, then the failure that
    /// ended the run, if one did.
    statuses: Vec<LakeStatus>,
    stored_crcs: Vec<Vec<u32>>,
    crcs: Option<QueuedCrcs>,
}

/// How a GPU load went on the agent thread.
pub(crate) enum Loaded {
    /// Done: a status per block.
    Done(Vec<LakeStatus>),
    /// On the GPU still: poll it.
    InFlight(InFlight),
}

impl InFlight {
    /// The statuses once the load has landed (the pins are released then),
    /// `None` while it is on its way.
    pub(crate) fn poll(&mut self, agent: &mut Agent, pins: &Mutex<PinArray>) -> Option<Vec<LakeStatus>> {
        let ok = self.held.len();
        let landed = match self.crcs.as_mut().map(QueuedCrcs::take_ready) {
            None => Ok(Some(Vec::new())),
            Some(Ok(None)) => return None,
            Some(ready) => ready,
        };
        match landed {
            Ok(Some(crcs)) if ok > 0 => {
                let per_block = crcs.len() / ok;
                for (i, expected) in self.stored_crcs.iter().enumerate() {
                    if crcs.get(i * per_block..(i + 1) * per_block) != Some(&expected[..]) {
                        self.statuses[i] = LakeStatus::LakeBadCrc;
                        self.statuses.truncate(i + 1);
                        break;
                    }
                }
            }
            Ok(_) => {}
            Err(_) => {
                // Whether anything landed is unknown: every block fails.
                // The stream is broken; its work is over.
                self.statuses.truncate(1);
                self.statuses[0] = LakeStatus::LakeIo;
            }
        }
        if let Ok(mut pins) = pins.lock() {
            for pin in self.held.drain(..) {
                pins.unpin(pin);
            }
        }
        let landed = self.statuses.iter().take_while(|&&s| s == LakeStatus::LakeOk).count();
        agent.stats.l1_reads += landed as u64;
        agent.stats.bytes_read += (landed * self.memory.block_bytes()) as u64;
        agent.stats.fetch_failures += (self.count - landed) as u64;
        let mut statuses = core::mem::take(&mut self.statuses);
        statuses.resize(self.count, LakeStatus::LakePrefixBroken);
        Some(statuses)
    }

    /// Slots it holds pinned.
    pub(crate) fn pinned(&self) -> usize {
        self.held.len()
    }

    /// Waits (stop, detach) until the GPU is done with the pinned slots.
    pub(crate) fn abandon(mut self, pins: &Mutex<PinArray>) {
        let _ = self.memory.gpu.copier.synchronize();
        self.crcs = None;
        if let Ok(mut pins) = pins.lock() {
            for pin in self.held.drain(..) {
                pins.unpin(pin);
            }
        }
    }
}
