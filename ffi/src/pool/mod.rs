//! The engine's calls on a pool: attaching and detaching, stats and costs
//! (here); namespaces and block keys ([`keys`]); registering engine memory
//! ([`register`]); lookups in the mirror ([`lookup`]); leases, loads,
//! saves, pushes, cancel and completions ([`requests`]), run by the agent's
//! own thread ([`thread`]).

pub use crate::push::LakeRailStat;
use crate::trace::LakeTraceSpan;
use std::collections::{HashSet, VecDeque};
use std::ffi::{CStr, c_char};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use lake_agent::{Agent, AgentConfig, AgentStats, PreparedSave};
use lake_dp::arena::{Pin, PinArray};
use lake_dp::cplink::Granted;
use lake_dp::mirror::{MirrorEntry, MirrorReader};
use lake_dp::{BlockKey, KeyChain, KeyScheme, Namespace, ObjectKind, Priority, RegionId, ShardMask, TenantKey, Tier};

use crate::gpu::{self, Gpu, GpuMemory, GpuPath};
use crate::lanes::{
    LANE_BLOCKS_MIN, Lanes, Reader, SPLIT_BLOCK_BYTES_MIN, Share, copy_checked, load_run, load_split, save_split,
};
use crate::memory::{EngineMemory, Piece};
use crate::status::{LakeStatus, fail, guard};

mod keys;
mod lookup;
mod register;
mod requests;
mod thread;

pub use keys::*;
pub use lookup::*;
pub use register::*;
pub use requests::*;
use thread::*;

/// A 128-bit block key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LakeBlockKey {
    /// Its bytes.
    pub bytes: [u8; 16],
}

/// Where a looked-up block is: one entry of the block table.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LakeLocation {
    /// Tier of the replica named: 1 host DRAM (L1), 2 NVMe (L2).
    pub tier: u8,
    /// Bit `t` set: a ready replica in tier `t`.
    pub tiers: u8,
    /// 1 KV block, 2 recurrent state.
    pub kind: u8,
    /// The region epoch's tag.
    pub epoch_tag: u8,
    /// The replica's region.
    pub region: u16,
    /// Zero.
    pub reserved: u16,
    /// Slot in the region.
    pub slot: u32,
    /// The slot's generation.
    pub generation: u32,
}

/// Where a block of a cluster lookup is (`lake_lookup_cluster`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LakeBlockWhere {
    /// The node holding it (this node's id for a block of its own).
    pub node: u32,
    /// The fastest tier it is held in there: 1 host DRAM (L1), 2 NVMe
    /// (L2), 3 the object store (L3).
    pub tier: u8,
    /// 1: on this node (`location` is its block-table entry, loaded as
    /// `lake_lookup`'s are); 0: only on another node.
    pub local: u8,
    /// Zero.
    pub reserved: u16,
    /// This node's block-table entry (zeroed for another node's block).
    pub location: LakeLocation,
}

const _: () = assert!(size_of::<LakeBlockWhere>() == 24);

/// One block's outcome.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LakeCompletion {
    /// The request it belongs to.
    pub request_id: u64,
    /// The block's index in the request.
    pub index: u32,
    /// `LakeOk`, or why not (`LakeEvicted`, `LakeBadCrc`, `LakeNoSpace`,
    /// `LakeCancelled`, ...): the engine recomputes that block.
    pub status: LakeStatus,
}

/// Options of [`lake_attach`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeAttachOptions {
    /// `sizeof(LakeAttachOptions)`.
    pub struct_size: usize,
    /// The local `lake-dp`'s attach socket (its `[agents] socket`).
    pub dp_socket: *const c_char,
    /// The mirror `lake-cp` publishes.
    pub mirror_path: *const c_char,
    /// `lake-cp`'s socket (leases, access reports); null: L1 hits only.
    pub cp_socket: *const c_char,
    /// A name for logs.
    pub name: *const c_char,
    /// The namespace blocks are saved in.
    pub namespace: *const LakeNamespace,
    /// Fingerprint of the payload layout.
    pub layout_fingerprint: u64,
    /// Bytes per CRC segment of a saved block (a layer's share).
    pub segment_bytes: u64,
    /// 1: pin the agent's thread to `agent_core`; 0: leave it unpinned
    /// (zeroed options pin nothing).
    pub pin_agent: u32,
    /// The core to pin it to; one this process may not run on is refused
    /// (`LAKE_INVALID_ARGUMENT`).
    pub agent_core: u32,
    /// Helper threads ("copy lanes") that share a large load of L1 hits,
    /// and the copies of a large save, with the agent's thread (0: none;
    /// at most 64). Each takes a pin
    /// array of the arena's; fewer start if the arena has fewer free.
    pub copy_threads: u32,
    /// The shard this engine rank holds: `LakeLayoutInfo.shard_code` of
    /// its layout (0: the whole block — one rank, or MLA). Every key this
    /// pool is given names that shard's replica of the block, so a rank
    /// finds only blocks saved by a rank holding the same heads.
    pub shard_code: u64,
    /// What this attachment saves and reads: 0 or 1 KV blocks; 2 a hybrid
    /// model's recurrent-state checkpoints, under the fingerprint and
    /// segment bytes `lake_state_layout_describe` gives and the rank's KV
    /// `shard_code` (so `lake_lookup_state` reads the rank's own KV chain).
    /// A reader of one kind never gets bytes of the other
    /// (`LAKE_LAYOUT_MISMATCH`).
    pub object_kind: u32,
    /// The payload bytes of a block this attachment saves
    /// (`LakeLayoutInfo.block_bytes`, or the state layout's; 0: not
    /// checked). A block larger than every L1 size class of the pool could
    /// never be saved: the attach is refused (`LAKE_INVALID_ARGUMENT`),
    /// naming both sizes and the `lake serve` flag that fits it.
    pub block_bytes: u64,
}

/// The pool's figures as this agent sees them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeStats {
    /// `sizeof(LakeStats)`.
    pub struct_size: usize,
    /// Lookups.
    pub lookups: u64,
    /// Blocks they found.
    pub hit_blocks: u64,
    /// Blocks loaded from L1, and from L2.
    pub l1_loads: u64,
    /// Blocks loaded from L2 (promoted into L1 on the way).
    pub l2_loads: u64,
    /// Blocks that could not be loaded (the engine recomputed them).
    pub load_failures: u64,
    /// Blocks saved, and skipped.
    pub saves: u64,
    /// Saves skipped (no room).
    pub saves_skipped: u64,
    /// Bytes loaded into engine memory, and saved from it.
    pub bytes_loaded: u64,
    /// Bytes saved.
    pub bytes_saved: u64,
}

/// An attached pool: the engine's side of Lake.
pub struct LakePool {
    pub(crate) mirror: MirrorReader,
    /// The cluster view beside the mirror (`lake_lookup_cluster`), opened
    /// when first asked for.
    cluster: Mutex<Option<lake_dp::mirror::view::ViewOpener>>,
    arena_region: u16,
    /// The L1 arena's epoch (with its region: where peers push blocks).
    arena_epoch: u64,
    /// The engine threads' pin array (the agent thread has its own).
    pins: Arc<Mutex<PinArray>>,
    /// What the copy lanes did.
    lane_stats: Arc<crate::lanes::LaneStats>,
    jobs: Option<Queues>,
    completions: Mutex<Receiver<LakeCompletion>>,
    cancelled: Arc<Mutex<HashSet<u64>>>,
    stats: Arc<Mutex<AgentStats>>,
    alive: Arc<AtomicBool>,
    memories: Mutex<Vec<Memory>>,
    /// The device GPU memories of this pool live on, opened on first use.
    gpu: Mutex<Option<Arc<Gpu>>>,
    /// Where this process maps the arena's slots (registered with a device
    /// when GPU memory is registered).
    slot_area: (usize, usize),
    /// The namespace and layout this engine saves under and may read.
    namespace: lake_dp::model::namespace::NamespaceId,
    layout_fingerprint: u64,
    /// What it saves and reads ([`LakeAttachOptions::object_kind`]).
    object_kind: ObjectKind,
    /// The shard this engine holds ([`LakeAttachOptions::shard_code`]) and
    /// the mask its keys are indexed under: applied where keys come in.
    shard_code: u64,
    shard: ShardMask,
    /// Whether the agent talks to a `lake-cp`.
    has_control_plane: bool,
    /// Whether its data plane refuses saves now.
    save_pressure: lake_agent::port::SavePressure,
    /// Per-layer events of GPU loads, for `lake_wait_layer`.
    layers: Arc<gpu::LayerEvents>,
    next_request: AtomicU64,
    thread: Option<JoinHandle<()>>,
    /// Set by detach: the agent thread ends at its next turn.
    stop: Arc<AtomicBool>,
    /// The compute network's rails as the agent thread last saw them.
    push_rails: Arc<Mutex<Vec<LakeRailStat>>>,
    /// Traced loads' blocks not yet handed over (`lake_trace_spans`).
    pub(crate) spans: Arc<Mutex<VecDeque<LakeTraceSpan>>>,
    /// What computing one block of a prompt costs this engine, as it
    /// reported its prefills ([`lake_report_prefill`]; ns, a moving
    /// average; 0 not reported yet).
    pub(crate) compute_ns_per_block: AtomicU64,
    /// What a block pulled into this node has cost, as this pool measured
    /// its pulls ([`lake_pull`]; ns, a moving average; 0 none measured
    /// yet).
    pub(crate) pull_ns_per_block: AtomicU64,
}

impl LakePool {
    fn reader(&self) -> Reader {
        Reader { namespace: self.namespace, layout_fingerprint: self.layout_fingerprint, kind: self.object_kind }
    }
}

impl core::fmt::Debug for LakePool {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LakePool").finish_non_exhaustive()
    }
}

/// Copy lanes an attach may ask for at most.
const COPY_THREADS_MAX: u32 = 64;

fn c_path(ptr: *const c_char, what: &str) -> Result<Option<PathBuf>, LakeStatus> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string (header contract).
    let text = unsafe { CStr::from_ptr(ptr) };
    let text = text.to_str().map_err(|_| fail(LakeStatus::LakeInvalidArgument, format!("{what}: not UTF-8")))?;
    Ok(Some(PathBuf::from(text)))
}

pub(crate) fn check_size(size: usize, expected: usize, what: &str) -> Result<(), LakeStatus> {
    if size == expected {
        Ok(())
    } else {
        Err(fail(LakeStatus::LakeBadStructSize, format!("{what}.struct_size is {size}, this library knows {expected}")))
    }
}

/// Reads an option struct, all of which start with `struct_size`: a null
/// pointer or another size is refused by name.
///
/// # Safety
///
/// `options` is null or points at a `T` (or at least its `struct_size`).
pub(crate) unsafe fn read_options<T: Copy>(options: *const T, what: &str) -> Result<T, LakeStatus> {
    if options.is_null() {
        return Err(fail(LakeStatus::LakeNullArgument, format!("{what}: options are required")));
    }
    // SAFETY: non-null and starts with a usize (contract); read first, so a
    // smaller struct of another version is refused before it is read whole.
    let size = unsafe { options.cast::<usize>().read() };
    check_size(size, size_of::<T>(), what)?;
    // SAFETY: non-null, and the caller says it is a whole T (size checked).
    Ok(unsafe { options.read() })
}

pub(crate) fn status_of(result: Result<(), LakeStatus>) -> LakeStatus {
    match result {
        Ok(()) => LakeStatus::LakeOk,
        Err(status) => status,
    }
}

/// Attaches to the pool: the local `lake-dp` (versions checked both ways;
/// its attach socket is this process's liveness), the mirror, and
/// `lake-cp` if given. Starts the agent's thread. Thread-safe.
/// `LAKE_VERSION_MISMATCH`: no wire version in common; `LAKE_BUSY`: every
/// agent port (or agent record) is taken by the engines attached, try
/// again once one detaches; `LAKE_NOT_ATTACHED`: no pool there, or it
/// refused this process.
///
/// # Safety
///
/// `options` points at a `LakeAttachOptions` whose strings are
/// NUL-terminated; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_attach(options: *const LakeAttachOptions, out: *mut *mut LakePool) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if out.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_attach: out is required"));
            }
            // SAFETY: null or a LakeAttachOptions (contract).
            let o = unsafe { read_options(options, "LakeAttachOptions") }?;
            let dp = c_path(o.dp_socket, "dp_socket")?
                .ok_or_else(|| fail(LakeStatus::LakeNullArgument, "lake_attach: dp_socket is required"))?;
            let mirror_path = c_path(o.mirror_path, "mirror_path")?
                .ok_or_else(|| fail(LakeStatus::LakeNullArgument, "lake_attach: mirror_path is required"))?;
            let cp = c_path(o.cp_socket, "cp_socket")?;
            let name = c_path(o.name, "name")?.map_or_else(|| "engine".to_owned(), |p| p.display().to_string());
            if o.namespace.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_attach: namespace is required"));
            }
            // SAFETY: non-null, from lake_namespace_new (contract).
            let namespace = unsafe { (*o.namespace).0.id() };
            // Checked before connecting: a refused option attaches nothing.
            let object_kind = match o.object_kind {
                0 | 1 => ObjectKind::KvBlock,
                2 => ObjectKind::RecurrentState,
                other => {
                    return Err(fail(
                        LakeStatus::LakeInvalidArgument,
                        format!("object_kind is 1 (KV blocks) or 2 (recurrent state), not {other}"),
                    ));
                }
            };
            let agent_core = match o.pin_agent {
                0 => None,
                1 => {
                    let core = o.agent_core as usize;
                    let allowed = lake_dp::os::allowed_cores()
                        .map_err(|e| fail(LakeStatus::LakeIo, format!("reading this process's cores: {e}")))?;
                    if !allowed.contains(&core) {
                        return Err(fail(
                            LakeStatus::LakeInvalidArgument,
                            format!("agent_core {core}: this process may run on {allowed:?} only"),
                        ));
                    }
                    Some(core)
                }
                other => {
                    return Err(fail(LakeStatus::LakeInvalidArgument, format!("pin_agent is 0 or 1, not {other}")));
                }
            };
            let config = AgentConfig {
                arena: std::path::Path::new(""),
                mirror: &mirror_path,
                cp_socket: cp.as_deref(),
                name: &name,
                namespace,
                layout_fingerprint: o.layout_fingerprint,
                segment_bytes: o.segment_bytes,
                object_kind,
            };
            let agent =
                Agent::connect(&config, &dp).map_err(|e| fail(crate::status::status_of_attach(&e), e.to_string()))?;
            let largest = agent.payload_bytes_max();
            if o.block_bytes > largest {
                let blocks = o.block_bytes;
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!(
                        "this layout's blocks are {blocks} bytes, but the pool at {} holds blocks of at most {largest} \
                         bytes: every save would be refused; start lake serve with --block-bytes {blocks}, or add \
                         --l1-class {blocks}:SLOTS",
                        dp.display()
                    ),
                ));
            }
            // The agent's mirror (passed over the socket, or opened by its
            // path), mapped again for the pool's own reads.
            let mirror = agent.mirror().reopen().map_err(|e| fail(LakeStatus::LakeNotAttached, e.to_string()))?;
            let cluster = agent.reopen_cluster_view();
            let pins = agent.claim_pin_array().map_err(|e| fail(LakeStatus::LakeBusy, e.to_string()))?;

            if o.copy_threads > COPY_THREADS_MAX {
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("copy_threads {}: at most {COPY_THREADS_MAX}", o.copy_threads),
                ));
            }
            let lane_pins: Vec<PinArray> = (0..o.copy_threads).map_while(|_| agent.claim_pin_array().ok()).collect();
            let reader = Reader { namespace, layout_fingerprint: o.layout_fingerprint, kind: object_kind };
            let mut pool = start(agent, mirror, pins, reader, agent_core, lane_pins)?;
            pool.shard_code = o.shard_code;
            pool.shard = ShardMask::from_code(o.shard_code);
            pool.cluster = Mutex::new(Some(cluster));
            // SAFETY: writable (contract).
            unsafe { out.write(Box::into_raw(Box::new(pool))) };
            Ok(())
        })())
    })
}

pub(crate) fn pool_ref<'a>(pool: *const LakePool) -> Result<&'a LakePool, LakeStatus> {
    if pool.is_null() {
        return Err(fail(LakeStatus::LakeNullArgument, "pool is null"));
    }
    // SAFETY: non-null; from lake_attach and not detached (contract).
    let pool = unsafe { &*pool };
    if !pool.alive.load(Ordering::Acquire) {
        return Err(fail(LakeStatus::LakeNotAttached, "the pool's lake-dp went away: attach again"));
    }
    Ok(pool)
}

/// Detaches: the agent's thread stops (queued jobs complete as cancelled
/// is not promised: they are dropped), pins and leases go. Null accepted.
///
/// # Safety
///
/// `pool` null or from `lake_attach`, detached once, not in use.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_detach(pool: *mut LakePool) {
    if pool.is_null() {
        return;
    }
    // SAFETY: from Box::into_raw in lake_attach, detached once.
    let mut pool = unsafe { Box::from_raw(pool) };
    pool.stop.store(true, Ordering::Release);
    if let Some(jobs) = pool.jobs.take() {
        jobs.agent.unpark();
    }
    if let Some(thread) = pool.thread.take() {
        let _ = thread.join();
    }
}

/// The agent's figures into `stats` (whose `struct_size` must be set).
/// Thread-safe.
///
/// # Safety
///
/// `stats` writable, its `struct_size` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_stats(pool: *const LakePool, stats: *mut LakeStats) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if pool.is_null() || stats.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_stats: pool and stats are required"));
            }
            // SAFETY: non-null (contract).
            let size = unsafe { (*stats).struct_size };
            check_size(size, size_of::<LakeStats>(), "LakeStats")?;
            // SAFETY: non-null; from lake_attach.
            let pool = unsafe { &*pool };
            let s = *pool.stats.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
            let lanes = &pool.lane_stats;
            let (lane_reads, lane_bytes, lane_failures) = (
                lanes.l1_reads.load(Ordering::Relaxed),
                lanes.bytes_read.load(Ordering::Relaxed),
                lanes.failures.load(Ordering::Relaxed),
            );
            let value = LakeStats {
                struct_size: size,
                lookups: s.lookups,
                hit_blocks: s.hit_blocks,
                l1_loads: s.l1_reads + lane_reads,
                l2_loads: s.l2_loads,
                load_failures: s.fetch_failures + lane_failures,
                saves: s.saves,
                saves_skipped: s.saves_skipped,
                bytes_loaded: s.bytes_read + lane_bytes,
                bytes_saved: s.bytes_saved,
            };
            // SAFETY: writable, size checked.
            unsafe { stats.write(value) };
            Ok(())
        })())
    })
}

/// What loading one block from each tier has cost this pool's agent, as
/// it measured on its own loads (a moving average).
pub(crate) fn measured_load_costs(pool: &LakePool) -> Result<[u64; 4], LakeStatus> {
    let mut costs = pool.stats.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?.load_ns_per_block;
    // L1 hits are mostly copied by the lanes: theirs, where they copied.
    let lanes = pool.lane_stats.l1_ns_per_block.load(Ordering::Relaxed);
    if lanes > 0 {
        costs[1] = lanes;
    }
    Ok(costs)
}

/// What loading one block into engine memory costs this pool's agent from
/// each tier, as it measured on its own loads (ns, a moving average; 0 not
/// measured yet): `out[0]` L0 (the engine's own, always 0), `out[1]` L1,
/// `out[2]` L2, `out[3]` L3 — the live inputs `lake_route` takes for this
/// node with `LAKE_COST_MEASURED`. Up to `capacity` entries are written.
/// Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `out` points at `capacity` writable entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_load_costs(pool: *const LakePool, out: *mut u64, capacity: usize) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if out.is_null() && capacity > 0 {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_load_costs: out is null"));
            }
            let costs = measured_load_costs(pool)?;
            let n = costs.len().min(capacity);
            if n > 0 {
                // SAFETY: `capacity` writable entries (contract), n <= capacity.
                let out = unsafe { core::slice::from_raw_parts_mut(out, n) };
                out.copy_from_slice(&costs[..n]);
            }
            Ok(())
        })())
    })
}

/// The engine computed `blocks` blocks of a prompt (a prefill, or the
/// part of one that was not loaded) in `elapsed_ns`: folded into the
/// moving average of what computing one block costs this engine (weight
/// 1/8), which `lake_route` takes for this node where its
/// `compute_ns_per_block` is `LAKE_COST_MEASURED`. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_report_prefill(pool: *const LakePool, blocks: u64, elapsed_ns: u64) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if blocks == 0 || elapsed_ns == 0 {
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("lake_report_prefill: {blocks} blocks in {elapsed_ns} ns (both at least 1)"),
                ));
            }
            let per_block = std::time::Duration::from_nanos((elapsed_ns / blocks).max(1));
            // The closure always answers Some: the update cannot fail.
            let _ = pool.compute_ns_per_block.fetch_update(Ordering::AcqRel, Ordering::Acquire, |average| {
                Some(lake_agent::fold_load_cost(average, per_block))
            });
            Ok(())
        })())
    })
}

/// What computing one block costs this engine as it reported its prefills
/// (`lake_report_prefill`; ns, 0 not reported yet), into `*out`.
/// Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_compute_cost(pool: *const LakePool, out: *mut u64) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if out.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_compute_cost: out is null"));
            }
            // SAFETY: writable (contract), checked non-null.
            unsafe { out.write(pool.compute_ns_per_block.load(Ordering::Acquire)) };
            Ok(())
        })())
    })
}

/// Whether the pool refuses saves now, into `out` (1 yes, 0 no), read
/// from shared memory with no request: its data plane refused a save for
/// want of room within the last 100 ms, or it is stopping. A save
/// submitted meanwhile is skipped whole (each block `LAKE_SAVE_PRESSURE`),
/// and so is any later save under a block not saved; an engine may skip
/// saving the request outright. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_save_pressure(pool: *const LakePool, out: *mut u8) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if out.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_save_pressure: out is null"));
            }
            // SAFETY: writable (contract), checked non-null.
            unsafe { out.write(u8::from(pool.save_pressure.get())) };
            Ok(())
        })())
    })
}

/// `LakeOk` while the pool's `lake-dp` is there, `LakeNotAttached` once it
/// went away (attach again). Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_alive(pool: *const LakePool) -> LakeStatus {
    guard(|| status_of(pool_ref(pool).map(|_| ())))
}
