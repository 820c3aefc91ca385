//! The engine's calls: namespaces and block keys, attaching to a pool,
//! registering engine memory, lookups from the mirror, asynchronous loads
//! and saves run by the agent's own thread, completions, cancel, stats.

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

/// Options of [`lake_namespace_new`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeNamespaceOptions {
    /// `sizeof(LakeNamespaceOptions)`.
    pub struct_size: usize,
    /// The tenant's secret key.
    pub tenant_key: [u8; 32],
    /// Tokens per block (1 to 1024).
    pub block_tokens: u32,
    /// Digest of the model identity (weights revision, tokenizer, KV dtype
    /// and scales).
    pub model_fingerprint: [u8; 32],
    /// Digest of the engine's extra keys (LoRA, multimodal, salt); zeros if
    /// none.
    pub extra_keys_digest: [u8; 32],
    /// How keys are made: 1 from token ids (`lake_keychain_extend`); 3 from
    /// engine page hashes that already name their whole prefix, such as
    /// SGLang's (`lake_page_keys`). 0 means 1.
    pub key_scheme: u32,
}

/// A namespace.
#[derive(Debug)]
pub struct LakeNamespace(Namespace);

/// An incremental key chain in a namespace; tokens of an unfinished block
/// wait inside it.
#[derive(Debug)]
pub struct LakeKeyChain {
    chain: KeyChain,
    pending: Vec<u32>,
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

enum Job {
    Accessed {
        keys: Vec<BlockKey>,
        hits: usize,
    },
    Resident {
        keys: Vec<BlockKey>,
        resident: bool,
    },
    Push(Box<crate::push::PushJob>),
    Lease {
        keys: Vec<BlockKey>,
        ttl_ms: u32,
        reply: SyncSender<Option<Granted>>,
    },
    ReleaseLease {
        id: u64,
    },
    Load {
        request: u64,
        /// The engine's trace id for it (`lake_set_trace`), 0 untraced.
        trace: u64,
        priority: Priority,
        memory: Memory,
        keys: Vec<BlockKey>,
        table: Vec<MirrorEntry>,
        blocks: Vec<u32>,
    },
    Save {
        request: u64,
        memory: Memory,
        keys: Vec<BlockKey>,
        parents: Vec<BlockKey>,
        blocks: Vec<u32>,
        /// GPU memory: an event on the engine's stream the save's reads
        /// wait for (`lake_submit_save_on_stream`).
        after: Option<Arc<cudarc::driver::CudaEvent>>,
    },
}

// SAFETY: a job carries engine memory addresses (plain integers here); the
// engine registered that memory and promises it stays valid until it
// detaches (the header says so), and only the agent thread touches it.
unsafe impl Send for Job {}

/// A registered engine memory: host memory the agent copies with the CPU,
/// or a GPU's, moved by kernels.
#[derive(Clone)]
enum Memory {
    Host(Arc<EngineMemory>),
    Gpu(Arc<GpuMemory>),
}

impl Memory {
    fn blocks(&self) -> u32 {
        match self {
            Self::Host(m) => m.blocks(),
            Self::Gpu(m) => m.blocks,
        }
    }
}

/// L1 blocks pinned by a lookup (see [`lake_lookup_pinned`]): they stay
/// in L1, unchanged, until released, whatever eviction decides meanwhile.
pub struct LakePins {
    array: Arc<Mutex<PinArray>>,
    /// By block-table index: the pin of an L1 hit, or none.
    pins: Vec<Option<Pin>>,
    keys: Vec<BlockKey>,
}

impl core::fmt::Debug for LakePins {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LakePins").field("blocks", &self.pins.len()).finish_non_exhaustive()
    }
}

/// An attached pool: the engine's side of Lake.
pub struct LakePool {
    pub(crate) mirror: MirrorReader,
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

/// Jobs queued for the agent thread at most, per queue.
const JOBS_MAX: usize = 1024;

/// The agent thread's two queues — what a request waits for (critical and
/// prefill-to-decode loads, leases) ahead of the rest (saves, prefetches,
/// access reports) — and the thread to wake after a push (an `unpark` is
/// one atomic when it is not asleep).
#[derive(Clone)]
struct Queues {
    urgent: SyncSender<Job>,
    background: SyncSender<Job>,
    agent: std::thread::Thread,
}

impl Queues {
    fn push(&self, urgent: bool, job: Job) -> Result<(), TrySendError<Job>> {
        let queue = if urgent { &self.urgent } else { &self.background };
        queue.try_send(job)?;
        self.agent.unpark();
        Ok(())
    }
}

/// How long the agent thread spins for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// How often the agent thread sends what it queued for `lake-cp` and
/// checks that its `lake-dp` is there (it sleeps at most this long).
/// How often, at most, the compute network's rails are reported to the
/// control plane while pushes go on.
const RAILS_REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

const PUMP_EVERY: Duration = Duration::from_millis(5);

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

/// Makes a namespace. Thread-safe.
///
/// # Safety
///
/// `options` must point at a `LakeNamespaceOptions`; `out` at a writable
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_namespace_new(
    options: *const LakeNamespaceOptions,
    out: *mut *mut LakeNamespace,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if out.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_namespace_new: out is required"));
            }
            // SAFETY: null or a LakeNamespaceOptions (contract).
            let o = unsafe { read_options(options, "LakeNamespaceOptions") }?;
            let scheme = match o.key_scheme {
                0 | 1 => KeyScheme::TokenIdsV1,
                3 => KeyScheme::EnginePrefixHashV1,
                other => {
                    return Err(fail(
                        LakeStatus::LakeInvalidArgument,
                        format!("key_scheme {other}: 1 (token ids) or 3 (engine prefix hashes)"),
                    ));
                }
            };
            let namespace = Namespace::new(
                &TenantKey(o.tenant_key),
                scheme,
                o.block_tokens,
                o.model_fingerprint,
                o.extra_keys_digest,
            )
            .map_err(|e| fail(LakeStatus::LakeInvalidArgument, e.to_string()))?;
            // SAFETY: non-null; the caller gave a writable pointer.
            unsafe { out.write(Box::into_raw(Box::new(LakeNamespace(namespace)))) };
            Ok(())
        })())
    })
}

/// The keys of `count` pages named by engine page hashes of `hash_bytes`
/// bytes each (`hashes` holds them back to back), into `keys`, in a
/// namespace of key scheme 3. Each page's key needs only its own hash, so
/// any run of pages can be keyed, wherever it starts. Thread-safe.
///
/// # Safety
///
/// `namespace` from `lake_namespace_new`; `hashes` points at `count *
/// hash_bytes` bytes; `keys` at `count` writable keys.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_page_keys(
    namespace: *const LakeNamespace,
    hashes: *const u8,
    hash_bytes: usize,
    count: usize,
    keys: *mut LakeBlockKey,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if count > 0 && hash_bytes == 0 {
                return Err(fail(LakeStatus::LakeInvalidArgument, "lake_page_keys: hash_bytes is zero"));
            }
            if namespace.is_null() || (count > 0 && (hashes.is_null() || keys.is_null())) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_page_keys: a required pointer is null"));
            }
            let total = hash_bytes
                .checked_mul(count)
                .filter(|&n| isize::try_from(n).is_ok())
                .ok_or_else(|| fail(LakeStatus::LakeInvalidArgument, "lake_page_keys: too many bytes"))?;
            if count == 0 {
                return Ok(());
            }
            // SAFETY: from lake_namespace_new (contract), non-null.
            let namespace = unsafe { &(*namespace).0 };
            // SAFETY: `count * hash_bytes` readable bytes (contract), checked
            // to fit an isize.
            let hashes = unsafe { core::slice::from_raw_parts(hashes, total) };
            for (i, hash) in hashes.chunks_exact(hash_bytes).enumerate() {
                let key = lake_dp::engine_prefix_key(namespace, hash)
                    .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("lake_page_keys: {e}")))?;
                // SAFETY: i < count writable keys (contract).
                unsafe { keys.wrapping_add(i).write(LakeBlockKey { bytes: key.0 }) };
            }
            Ok(())
        })())
    })
}

/// Frees a namespace (null is accepted). Not while a chain or pool made
/// from it is in use on another thread.
///
/// # Safety
///
/// `namespace` must be null or come from `lake_namespace_new`, once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_namespace_free(namespace: *mut LakeNamespace) {
    if !namespace.is_null() {
        // SAFETY: from Box::into_raw in lake_namespace_new, freed once.
        drop(unsafe { Box::from_raw(namespace) });
    }
}

/// The namespace's public 64-bit id. Thread-safe.
///
/// # Safety
///
/// `namespace` must come from `lake_namespace_new`; `id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_namespace_id(namespace: *const LakeNamespace, id: *mut u64) -> LakeStatus {
    if namespace.is_null() || id.is_null() {
        return fail(LakeStatus::LakeNullArgument, "lake_namespace_id: namespace and id are required");
    }
    // SAFETY: non-null and valid (contract).
    let value = unsafe { (*namespace).0.id().0 };
    // SAFETY: non-null and writable (contract).
    unsafe { id.write(value) };
    LakeStatus::LakeOk
}

/// A new key chain at the start of a prompt. Thread-safe.
///
/// # Safety
///
/// `namespace` from `lake_namespace_new`; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_keychain_new(namespace: *const LakeNamespace, out: *mut *mut LakeKeyChain) -> LakeStatus {
    if namespace.is_null() || out.is_null() {
        return fail(LakeStatus::LakeNullArgument, "lake_keychain_new: namespace and out are required");
    }
    // SAFETY: valid namespace (contract).
    let chain = KeyChain::new(unsafe { &(*namespace).0 });
    // SAFETY: writable (contract).
    unsafe { out.write(Box::into_raw(Box::new(LakeKeyChain { chain, pending: Vec::new() }))) };
    LakeStatus::LakeOk
}

/// Extends a chain by `count` tokens: the keys of the blocks they complete
/// go to `keys` (room for `capacity`), their number to `written`; tokens
/// of an unfinished block wait inside the chain. On `LakeBufferTooSmall`
/// nothing is consumed and `written` says how many keys were needed. One
/// thread at a time per chain.
///
/// # Safety
///
/// `chain` from `lake_keychain_new`; `tokens` points at `count` values;
/// `keys` at `capacity` writable keys; `written` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_keychain_extend(
    chain: *mut LakeKeyChain,
    tokens: *const u32,
    count: usize,
    keys: *mut LakeBlockKey,
    capacity: usize,
    written: *mut usize,
) -> LakeStatus {
    guard(|| {
        if chain.is_null() || written.is_null() || (tokens.is_null() && count > 0) || (keys.is_null() && capacity > 0) {
            return fail(LakeStatus::LakeNullArgument, "lake_keychain_extend: a required pointer is null");
        }
        // SAFETY: valid chain, used by one thread (contract).
        let chain = unsafe { &mut *chain };
        // SAFETY: `count` tokens (contract); a null pointer only with 0.
        let tokens = if count == 0 { &[][..] } else { unsafe { core::slice::from_raw_parts(tokens, count) } };
        let block_tokens = chain.chain.block_tokens() as usize;
        let needed = (chain.pending.len() + count) / block_tokens;
        if needed > capacity {
            // SAFETY: writable (contract).
            unsafe { written.write(needed) };
            return fail(LakeStatus::LakeBufferTooSmall, format!("lake_keychain_extend: {needed} keys need room"));
        }
        chain.pending.extend_from_slice(tokens);
        let mut out = vec![BlockKey::NONE; needed];
        let n = match chain.chain.extend_tokens(&chain.pending, &mut out) {
            Ok(n) => n,
            Err(e) => return fail(LakeStatus::LakeInvalidArgument, e.to_string()),
        };
        chain.pending.drain(..n * block_tokens);
        for (i, key) in out[..n].iter().enumerate() {
            // SAFETY: i < n <= capacity keys (checked above).
            unsafe { keys.wrapping_add(i).write(LakeBlockKey { bytes: key.0 }) };
        }
        // SAFETY: writable (contract).
        unsafe { written.write(n) };
        LakeStatus::LakeOk
    })
}

/// Frees a chain (null accepted).
///
/// # Safety
///
/// `chain` null or from `lake_keychain_new`, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_keychain_free(chain: *mut LakeKeyChain) {
    if !chain.is_null() {
        // SAFETY: from Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(chain) });
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
            let mirror =
                MirrorReader::attach(&mirror_path).map_err(|e| fail(LakeStatus::LakeNotAttached, e.to_string()))?;
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
            // SAFETY: writable (contract).
            unsafe { out.write(Box::into_raw(Box::new(pool))) };
            Ok(())
        })())
    })
}

fn start(
    agent: Agent,
    mirror: MirrorReader,
    pins: PinArray,
    reader: Reader,
    agent_core: Option<usize>,
    lane_pins: Vec<PinArray>,
) -> Result<LakePool, LakeStatus> {
    let arena_region = agent.arena_region();
    let arena_epoch = agent.arena_epoch();
    let has_control_plane = agent.has_control_plane();
    let save_pressure = agent.save_pressure_probe();
    let slot_area = {
        let (base, len) = agent.slot_area();
        (base as usize, len)
    };
    let pins = Arc::new(Mutex::new(pins));
    let lanes = Lanes::start(lane_pins, reader);
    let lane_stats = Arc::clone(&lanes.stats);
    let layers = Arc::new(gpu::LayerEvents::default());
    let shared = AgentShared { lanes, pins: Arc::clone(&pins), reader, arena_region, layers: Arc::clone(&layers) };
    let (urgent, urgent_rx) = sync_channel::<Job>(JOBS_MAX);
    let (background, background_rx) = sync_channel::<Job>(JOBS_MAX);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = sync_channel::<Result<(), String>>(1);
    let cancelled = Arc::new(Mutex::new(HashSet::new()));
    let stats = Arc::new(Mutex::new(AgentStats::default()));
    let alive = Arc::new(AtomicBool::new(true));
    let stop = Arc::new(AtomicBool::new(false));
    let push_rails = Arc::new(Mutex::new(Vec::new()));
    let spans = Arc::new(Mutex::new(VecDeque::with_capacity(lake_agent::SPANS_KEPT)));
    let thread = {
        let (cancelled, stats, alive) = (Arc::clone(&cancelled), Arc::clone(&stats), Arc::clone(&alive));
        let (stop, push_rails, spans) = (Arc::clone(&stop), Arc::clone(&push_rails), Arc::clone(&spans));
        std::thread::Builder::new()
            .name("lake-agent".into())
            .spawn(move || {
                if let Some(core) = agent_core
                    && let Err(e) = lake_dp::os::pin_to_core(core)
                {
                    let _ = ready_tx.send(Err(format!("agent_core {core}: {e}")));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                let queues = (urgent_rx, background_rx);
                let signals = Signals { cancelled, stats, alive, stop, push_rails, spans };
                agent_thread(agent, &queues, &shared, &signals, &done_tx);
            })
            .map_err(|e| fail(LakeStatus::LakeInternal, format!("starting the agent thread: {e}")))?
    };
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(message)) => {
            let _ = thread.join();
            return Err(fail(LakeStatus::LakeInvalidArgument, message));
        }
        Err(_) => return Err(fail(LakeStatus::LakeInternal, "the agent thread did not start")),
    }
    let queues = Queues { urgent, background, agent: thread.thread().clone() };
    Ok(LakePool {
        mirror,
        arena_region,
        arena_epoch,
        pins,
        lane_stats,
        jobs: Some(queues),
        completions: Mutex::new(done_rx),
        cancelled,
        stats,
        alive,
        memories: Mutex::new(Vec::new()),
        gpu: Mutex::new(None),
        slot_area,
        namespace: reader.namespace,
        layout_fingerprint: reader.layout_fingerprint,
        object_kind: reader.kind,
        shard_code: 0,
        shard: ShardMask::WHOLE,
        has_control_plane,
        save_pressure,
        layers,
        next_request: AtomicU64::new(1),
        compute_ns_per_block: AtomicU64::new(0),
        thread: Some(thread),
        stop,
        push_rails,
        spans,
    })
}

/// The agent's own thread: runs loads and saves, pumps `lake-cp`.
fn agent_thread(
    mut agent: Agent,
    (urgent, background): &(Receiver<Job>, Receiver<Job>),
    shared: &AgentShared,
    signals: &Signals,
    done: &std::sync::mpsc::Sender<LakeCompletion>,
) {
    let Signals { cancelled, stats, alive, stop, push_rails, spans } = signals;
    let mut last_job = std::time::Instant::now();
    let mut last_pump = last_job;
    // The poller stage: GPU loads on their way, completed when their
    // stream has passed them (oldest first: one stream keeps them in order).
    let mut in_flight: VecDeque<gpu::InFlight> = VecDeque::new();
    // Pushes to other nodes' pools (P→D), polled like loads in flight.
    let mut pushes = crate::push::Pushes::default();
    let epoch_start = std::time::Instant::now();
    // The compute network's rails go to the control plane's metrics too:
    // when pushes end, at most every quarter second while they go on.
    let mut rails_reported = epoch_start;
    loop {
        if stop.load(Ordering::Acquire) {
            for load in in_flight.drain(..) {
                load.abandon(&shared.pins);
            }
            return;
        }
        if !retire(&mut in_flight, &mut agent, shared, stats, done) {
            return;
        }
        if pushes.in_flight() > 0 {
            // Pushes of requests aborted since: what has not gone out stays.
            if let Ok(mut set) = cancelled.lock()
                && !set.is_empty()
            {
                pushes.cancel(&mut set);
            }
            let mut ended = Vec::new();
            pushes.poll(nanos_since(epoch_start), &mut ended);
            // Traced pushes' blocks: before their completions, so a caller
            // that saw its push end finds their spans.
            if !ended.is_empty()
                && let Ok(mut kept) = spans.lock()
            {
                pushes.take_spans(|span| {
                    if kept.len() >= lake_agent::SPANS_KEPT {
                        kept.pop_front();
                    }
                    kept.push_back(LakeTraceSpan::from(span));
                });
            }
            if !ended.is_empty()
                && let Ok(mut rails) = push_rails.lock()
            {
                // Before the completions: a caller that saw its push end
                // sees the bytes it moved.
                *rails = pushes.rail_stats();
                if pushes.in_flight() == 0 || rails_reported.elapsed() >= RAILS_REPORT_EVERY {
                    rails_reported = std::time::Instant::now();
                    let entries: Vec<lake_dp::wire::message::RailEntry> = rails
                        .iter()
                        .map(|r| lake_dp::wire::message::RailEntry {
                            node: r.peer,
                            rail: u16::try_from(r.rail).unwrap_or(u16::MAX),
                            up: u8::from(r.up != 0),
                            reserved: 0,
                            bytes: r.bytes,
                            breaks: r.breaks,
                        })
                        .collect();
                    agent.report_rails(lake_dp::wire::message::Network::Compute, &entries);
                    agent.pump();
                }
            }
            if !complete_each(done, &ended) {
                return;
            }
        }
        if last_pump.elapsed() >= PUMP_EVERY {
            agent.pump();
            if !agent.data_plane_alive() {
                alive.store(false, Ordering::Release);
            }
            last_pump = std::time::Instant::now();
        }
        let job = match urgent.try_recv() {
            Ok(job) => job,
            Err(TryRecvError::Disconnected) => return,
            Err(TryRecvError::Empty) => match background.try_recv() {
                Ok(job) => job,
                Err(TryRecvError::Disconnected) => return,
                // Right after a job the next one often follows: spin a
                // little before sleeping, so a single block's round trip
                // does not pay a thread wake-up. Loads on the GPU are
                // polled, never slept on.
                Err(TryRecvError::Empty)
                    if last_job.elapsed() < SPIN || !in_flight.is_empty() || pushes.in_flight() > 0 =>
                {
                    std::hint::spin_loop();
                    continue;
                }
                Err(TryRecvError::Empty) => {
                    std::thread::park_timeout(PUMP_EVERY);
                    continue;
                }
            },
        };
        last_job = std::time::Instant::now();
        let (request, count) = match &job {
            Job::Accessed { keys, hits } => {
                agent.report_access(keys, *hits);
                continue;
            }
            Job::Resident { keys, resident } => {
                agent.report_resident(keys, *resident);
                continue;
            }
            Job::Push(push) => {
                let mut ended = Vec::new();
                if alive.load(Ordering::Acquire) {
                    pushes.start(&agent, push, nanos_since(epoch_start), &mut ended);
                } else {
                    ended
                        .extend((0..push.keys.len()).map(|i| {
                            (push.request, u32::try_from(i).unwrap_or(u32::MAX), LakeStatus::LakeNotAttached)
                        }));
                }
                if !complete_each(done, &ended) {
                    return;
                }
                continue;
            }
            Job::Lease { keys, ttl_ms, reply } => {
                let _ = reply.try_send(agent.lease_for(keys, *ttl_ms));
                continue;
            }
            Job::ReleaseLease { id } => {
                agent.release_lease(*id);
                continue;
            }
            Job::Load { request, blocks, .. } | Job::Save { request, blocks, .. } => (*request, blocks.len()),
        };
        // A traced load's blocks are loaded under its trace id, and what
        // the agent saw of each kept for `lake_trace_spans`.
        let trace = if let Job::Load { trace, .. } = &job { *trace } else { 0 };
        agent.set_trace(trace);
        let was_cancelled = cancelled.lock().map(|mut c| c.remove(&request)).unwrap_or(false);
        let mut statuses = vec![LakeStatus::LakeOk; count];
        if was_cancelled {
            statuses.fill(LakeStatus::LakeCancelled);
            shared.layers.finished(request);
        } else if !alive.load(Ordering::Acquire) {
            statuses.fill(LakeStatus::LakeNotAttached);
            shared.layers.finished(request);
        } else {
            match job {
                Job::Accessed { .. }
                | Job::Resident { .. }
                | Job::Push(_)
                | Job::Lease { .. }
                | Job::ReleaseLease { .. } => {}
                Job::Load { memory: Memory::Gpu(memory), keys, table, blocks, priority, .. } => {
                    // Pins are finite: loads in flight hold at most a
                    // layered load's worth; older ones complete first.
                    while !in_flight.is_empty()
                        && in_flight.iter().map(gpu::InFlight::pinned).sum::<usize>() + count > gpu::LAYERED_BLOCKS_MAX
                    {
                        if !retire(&mut in_flight, &mut agent, shared, stats, done) {
                            return;
                        }
                        std::hint::spin_loop();
                    }
                    let (pins, reader, region) = (&shared.pins, shared.reader, shared.arena_region);
                    let events = (request, &*shared.layers);
                    match gpu::load(&mut agent, pins, reader, region, &memory, events, &keys, &table, &blocks, priority)
                    {
                        gpu::Loaded::Done(done) => statuses = done,
                        gpu::Loaded::InFlight(load) => {
                            in_flight.push_back(load);
                            agent.set_trace(0);
                            keep_spans(&mut agent, spans);
                            continue;
                        }
                    }
                    statuses.resize(count, LakeStatus::LakePrefixBroken);
                }
                Job::Save { keys, .. } if agent.save_pressure() => {
                    // The pool refuses saves now: none of it is sent (a
                    // prefix saved in part is of use only up to the part),
                    // and a later save under it is not sent either.
                    statuses.fill(LakeStatus::LakeSavePressure);
                    agent.note_unsaved(&keys);
                    agent.stats.saves_skipped += keys.len() as u64;
                }
                Job::Save { memory: Memory::Gpu(memory), keys, parents, blocks, after, .. } => {
                    statuses = gpu::save(&mut agent, &memory, &keys, &parents, &blocks, after.as_deref());
                }
                Job::Load { memory: Memory::Host(memory), keys, table, blocks, priority, .. } => {
                    let load =
                        LoadJob { memory, keys, table, blocks, priority, request, cancelled: Arc::clone(cancelled) };
                    statuses = run_load(&mut agent, shared, load);
                    // A cancel that came while it ran is spent.
                    if let Ok(mut set) = cancelled.lock() {
                        set.remove(&request);
                    }
                }
                Job::Save { memory: Memory::Host(memory), keys, parents, blocks, .. } => {
                    statuses = run_save(&mut agent, shared, &memory, &keys, &parents, &blocks);
                }
            }
        }
        if let Ok(mut s) = stats.lock() {
            *s = agent.stats;
        }
        if trace != 0 {
            agent.set_trace(0);
            keep_spans(&mut agent, spans);
        }
        if !complete(done, request, statuses) {
            for load in in_flight.drain(..) {
                load.abandon(&shared.pins);
            }
            return;
        }
    }
}

/// Completes the GPU loads in flight that their stream has passed, oldest
/// first (one stream keeps them in order); false once no one takes
/// completions.
fn retire(
    in_flight: &mut VecDeque<gpu::InFlight>,
    agent: &mut Agent,
    shared: &AgentShared,
    stats: &Mutex<AgentStats>,
    done: &std::sync::mpsc::Sender<LakeCompletion>,
) -> bool {
    while let Some(load) = in_flight.front_mut() {
        let Some(statuses) = load.poll(agent, &shared.pins) else { break };
        let request = load.request;
        in_flight.pop_front();
        if let Ok(mut s) = stats.lock() {
            *s = agent.stats;
        }
        if !complete(done, request, statuses) {
            return false;
        }
    }
    true
}

/// Sends completions `(request, index, status)`; false once no one takes
/// them.
fn complete_each(done: &std::sync::mpsc::Sender<LakeCompletion>, ended: &[(u64, u32, LakeStatus)]) -> bool {
    ended.iter().all(|&(request_id, index, status)| done.send(LakeCompletion { request_id, index, status }).is_ok())
}

fn nanos_since(start: std::time::Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Sends a request's completions, one per block; false once no one takes
/// them (the pool is gone).
fn complete(done: &std::sync::mpsc::Sender<LakeCompletion>, request: u64, statuses: Vec<LakeStatus>) -> bool {
    statuses.into_iter().enumerate().all(|(i, status)| {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        done.send(LakeCompletion { request_id: request, index, status }).is_ok()
    })
}

/// What the engine threads and the agent thread tell each other.
struct Signals {
    cancelled: Arc<Mutex<HashSet<u64>>>,
    stats: Arc<Mutex<AgentStats>>,
    alive: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    push_rails: Arc<Mutex<Vec<LakeRailStat>>>,
    spans: Arc<Mutex<VecDeque<LakeTraceSpan>>>,
}

/// Moves the agent's traced loads into what `lake_trace_spans` hands out
/// (the oldest go past [`lake_agent::SPANS_KEPT`]).
fn keep_spans(agent: &mut Agent, spans: &Mutex<VecDeque<LakeTraceSpan>>) {
    let Ok(mut kept) = spans.lock() else { return };
    agent.take_spans(|span| {
        if kept.len() >= lake_agent::SPANS_KEPT {
            kept.pop_front();
        }
        kept.push_back(LakeTraceSpan::from(span));
    });
}

/// What the agent thread shares with its lanes and the engine threads.
struct AgentShared {
    lanes: Lanes,
    /// The engine threads' pin array: the agent thread's share of a split
    /// load pins through it.
    pins: Arc<Mutex<PinArray>>,
    reader: Reader,
    arena_region: u16,
    /// Per-layer events of GPU loads.
    layers: Arc<gpu::LayerEvents>,
}

struct LoadJob {
    memory: Arc<EngineMemory>,
    keys: Vec<BlockKey>,
    table: Vec<MirrorEntry>,
    blocks: Vec<u32>,
    priority: Priority,
    /// Its request, and the requests `lake_cancel` named: checked between
    /// the blocks the agent loads, so a cancel reaches a load under way.
    request: u64,
    cancelled: Arc<Mutex<HashSet<u64>>>,
}

/// Runs one load; a status per block: the first failure says why, the
/// blocks after it `LakePrefixBroken`. A long leading run of L1 hits is
/// split across the lanes and this thread; the rest goes through the
/// agent (leases, lower-tier loads).
fn run_load(agent: &mut Agent, shared: &AgentShared, job: LoadJob) -> Vec<LakeStatus> {
    let count = job.keys.len();
    let run = job.table.iter().take_while(|e| e.tier == Tier::L1Dram && e.region.0 == shared.arena_region).count();
    let parts = (run / LANE_BLOCKS_MIN).min(shared.lanes.count() + 1);
    if parts < 2 {
        if run == 0 || shared.lanes.count() == 0 || job.memory.block_bytes() < SPLIT_BLOCK_BYTES_MIN {
            return fetch_through_agent(agent, &job, 0);
        }
        // Too few blocks to split by blocks: each is split by segments.
        let mut statuses = vec![LakeStatus::LakePrefixBroken; count];
        let Ok(mut pins) = shared.pins.lock() else { return fetch_through_agent(agent, &job, 0) };
        for i in 0..run {
            statuses[i] = load_split(
                &shared.lanes,
                &mut pins,
                &job.table[i],
                &job.keys[i],
                shared.reader,
                &job.memory,
                job.blocks[i],
            );
            if statuses[i] != LakeStatus::LakeOk {
                return statuses;
            }
        }
        drop(pins);
        if run < count {
            let rest = fetch_through_agent(agent, &job, run);
            statuses[run..].copy_from_slice(&rest);
        }
        return statuses;
    }
    let mut statuses = vec![LakeStatus::LakePrefixBroken; count];
    let keys: Arc<[BlockKey]> = job.keys[..run].into();
    let table: Arc<[MirrorEntry]> = job.table[..run].into();
    let blocks: Arc<[u32]> = job.blocks[..run].into();
    let (reply, replies) = sync_channel(parts);
    let share_of = |part: usize| {
        let range = run * part / parts..run * (part + 1) / parts;
        Share {
            keys: Arc::clone(&keys),
            table: Arc::clone(&table),
            blocks: Arc::clone(&blocks),
            memory: Arc::clone(&job.memory),
            range,
            reply: reply.clone(),
        }
    };
    let mut own = vec![share_of(0)];
    for part in 1..parts {
        if let Err(share) = shared.lanes.send(part - 1, share_of(part)) {
            own.push(share);
        }
    }
    let mut sent = parts - own.len();
    if let Ok(mut pins) = shared.pins.lock() {
        for share in &own {
            let done = load_run(&mut pins, share, shared.reader, &shared.lanes.stats);
            statuses[share.range.start..share.range.start + done.len()].copy_from_slice(&done);
        }
    }
    while sent > 0 {
        let Ok((range, done)) = replies.recv() else { break };
        statuses[range.start..range.start + done.len()].copy_from_slice(&done);
        sent -= 1;
    }
    // Every block of the run copied: the rest of the batch, if any, goes
    // through the agent.
    if statuses[..run].iter().all(|&s| s == LakeStatus::LakeOk) {
        if run < count {
            let rest = fetch_through_agent(agent, &job, run);
            statuses[run..].copy_from_slice(&rest);
        }
        return statuses;
    }
    if let Some(first) = statuses.iter().position(|&s| s != LakeStatus::LakeOk) {
        for status in &mut statuses[first + 1..] {
            *status = LakeStatus::LakePrefixBroken;
        }
    }
    statuses
}

/// Blocks to a host save's turn at most: the slots reserved at once.
const HOST_SAVE_TURN: usize = 64;

/// Runs one save from host memory; a status per block. The save goes in
/// turns: a turn's slots are reserved, its blocks copied into them (split
/// across the lanes and this thread where it has the blocks) with each
/// segment checksummed on the way, then its headers written and commits
/// sent; the next turn is reserved and copied while those commits are
/// answered.
fn run_save(
    agent: &mut Agent,
    shared: &AgentShared,
    memory: &Arc<EngineMemory>,
    keys: &[BlockKey],
    parents: &[BlockKey],
    blocks: &[u32],
) -> Vec<LakeStatus> {
    let len = memory.block_bytes();
    let segment_bytes = agent.segment_bytes_for(len as u64);
    let prepared: Vec<PreparedSave<'_>> = (0..keys.len())
        .map(|i| PreparedSave {
            key: keys[i],
            parent: parents[i],
            block_index: u32::try_from(i).unwrap_or(u32::MAX),
            len,
            crcs: &[],
            // Lake's own copy computes them, from the bytes it copies.
            crcs_from: lake_agent::CrcOrigin::Slot,
        })
        .collect();
    let mut saved = vec![lake_agent::SaveStatus::NotSent; keys.len()];
    agent.forget_unsaved_of(keys);
    let mut answering: Option<(std::ops::Range<usize>, lake_agent::SentCommits)> = None;
    for first in (0..keys.len()).step_by(HOST_SAVE_TURN) {
        let turn_range = first..(first + HOST_SAVE_TURN).min(keys.len());
        let turn = agent.reserve_prepared(&prepared[turn_range.clone()], &mut saved[turn_range.clone()]);
        let bodies: Vec<(u32, *mut u8)> = turn.bodies.iter().map(|&(i, body)| (blocks[first + i], body)).collect();
        // SAFETY: the bodies are payload areas of slots just reserved to
        // this agent, `len` bytes each (the reserve checked), one per
        // block, committed below only after this returns.
        let (crcs, filled) = unsafe { save_split(&shared.lanes, memory, &bodies, len, segment_bytes) };
        // A turn's blocks are committed once the turn before is answered:
        // a block under one refused there is not sent.
        if let Some((range, sent)) = answering.take() {
            agent.await_prepared(sent, &prepared[range.clone()], &mut saved[range]);
        }
        let per_block = crcs.len() / bodies.len().max(1);
        let mut turn_blocks = prepared[turn_range.clone()].to_vec();
        for (k, &(i, _)) in turn.bodies.iter().enumerate() {
            if filled[k] {
                turn_blocks[i].crcs = &crcs[k * per_block..(k + 1) * per_block];
            }
        }
        let sent = agent.commit_prepared(turn, &turn_blocks, true, &mut saved[turn_range.clone()]);
        answering = Some((turn_range, sent));
    }
    if let Some((range, sent)) = answering {
        agent.await_prepared(sent, &prepared[range.clone()], &mut saved[range]);
    }
    saved.into_iter().map(crate::status::status_of_save).collect()
}

/// Loads `job`'s blocks `from..` through the agent: its pin, its leases,
/// its lower-tier loads. A status per block loaded.
fn fetch_through_agent(agent: &mut Agent, job: &LoadJob, from: usize) -> Vec<LakeStatus> {
    let (keys, table, blocks) = (&job.keys[from..], &job.table[from..], &job.blocks[from..]);
    let mut statuses = vec![LakeStatus::LakeOk; keys.len()];
    let mut misfit = None;
    let cancelled = || job.cancelled.lock().is_ok_and(|set| set.contains(&job.request));
    let delivered = agent.fetch_segments_cancellable(keys, table, job.priority, &cancelled, |i, offset, segment| {
        if misfit.is_none() && !job.memory.scatter(blocks[i], offset, segment) {
            misfit = Some(i);
        }
    });
    let failure = crate::status::status_of_fetch(agent.last_fetch_failure());
    // A payload that does not fit the engine's block (raw memory
    // registered smaller than what was saved) is not this reader's:
    // nothing of it was copied.
    let good = misfit.map_or(delivered, |i| i.min(delivered));
    if let Some(status) = statuses.get_mut(good) {
        *status = if good < delivered { LakeStatus::LakeLayoutMismatch } else { failure };
    }
    // Cancelled: every block not delivered says so; otherwise the ones
    // after the first failure break the prefix.
    let after = if failure == LakeStatus::LakeCancelled { failure } else { LakeStatus::LakePrefixBroken };
    for status in statuses.iter_mut().skip(good + 1) {
        *status = after;
    }
    statuses
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

/// A lease on lower-tier replicas (see [`lake_lease`]).
pub struct LakeLease {
    id: u64,
    queues: Option<Queues>,
}

impl core::fmt::Debug for LakeLease {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LakeLease").field("id", &self.id).finish_non_exhaustive()
    }
}

/// Leases the replicas of the leading run of `keys` (`count`) that has a
/// ready one — L2 blocks above all, which no pin covers — for `ttl_ms`
/// (at most 60 s): until released or past the deadline, eviction passes
/// them over, so a load planned now finds them. How many keys are covered
/// goes to `granted`, the deadline (Unix ns) to `deadline_unix_ns`, the
/// handle to `lease` (release it with [`lake_lease_release`]). Loads lease
/// what they need themselves; this is for an engine that plans a load
/// ahead (asynchronous loads, prefetch). A round trip to `lake-cp`: blocks
/// the caller up to 10 s. `LAKE_UNAVAILABLE` without `lake-cp` (attach
/// with `cp_socket`) or without an answer. Thread-safe.
///
/// # Safety
///
/// `keys` points at `count` keys; `granted`, `deadline_unix_ns` and
/// `lease` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_lease(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    ttl_ms: u32,
    granted: *mut usize,
    deadline_unix_ns: *mut u64,
    lease: *mut *mut LakeLease,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if granted.is_null() || deadline_unix_ns.is_null() || lease.is_null() || (keys.is_null() && count > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_lease: a required pointer is null"));
            }
            if ttl_ms == 0 {
                return Err(fail(LakeStatus::LakeInvalidArgument, "lake_lease: ttl_ms is zero"));
            }
            let keys = read_keys(pool, keys, count);
            let jobs = pool.jobs.as_ref().ok_or_else(|| fail(LakeStatus::LakeNotAttached, "detached"))?;
            let (reply, answer) = sync_channel(1);
            jobs.push(true, Job::Lease { keys, ttl_ms, reply }).map_err(|e| match e {
                TrySendError::Full(_) => fail(LakeStatus::LakeBusy, "the agent's queue is full: retry"),
                TrySendError::Disconnected(_) => fail(LakeStatus::LakeNotAttached, "the agent's thread stopped"),
            })?;
            let grant = answer
                .recv_timeout(lake_agent::WAIT_MAX + Duration::from_secs(1))
                .map_err(|_| fail(LakeStatus::LakeUnavailable, "lake_lease: the agent did not answer"))?
                .ok_or_else(|| {
                    fail(
                        LakeStatus::LakeUnavailable,
                        "lake_lease: no lease from lake-cp (attached without cp_socket, or no answer)",
                    )
                })?;
            // SAFETY: writable (contract).
            unsafe { granted.write(grant.entries.len()) };
            // SAFETY: writable (contract).
            unsafe { deadline_unix_ns.write(grant.deadline_unix_ns) };
            let handle = LakeLease { id: grant.lease_id, queues: Some(jobs.clone()) };
            // SAFETY: writable (contract).
            unsafe { lease.write(Box::into_raw(Box::new(handle))) };
            Ok(())
        })())
    })
}

/// Releases a lease (null accepted). After detach it is freed only:
/// `lake-cp` ended the agent's leases when it went.
///
/// # Safety
///
/// `lease` null or from `lake_lease`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_lease_release(lease: *mut LakeLease) {
    if lease.is_null() {
        return;
    }
    // SAFETY: from Box::into_raw in lake_lease, released once.
    let mut lease = unsafe { Box::from_raw(lease) };
    if let Some(queues) = lease.queues.take() {
        let _ = queues.push(false, Job::ReleaseLease { id: lease.id });
    }
}

/// Tells `lake-cp` that the engine now holds the blocks `keys` (`count`)
/// in its own GPU memory (`resident` 1: it computed or loaded them and
/// keeps them), or no longer does (`resident` 0: it freed them). These are
/// advisory L0 replicas: Lake never reads, leases or evicts them (the
/// engine owns that memory); `lake-cp` remembers them for routing requests
/// to the engine that holds their prefix, and forgets them when the engine
/// reports them gone or detaches. Queued with the access reports: returns
/// without waiting. `LAKE_UNAVAILABLE` without `lake-cp` (attach with
/// `cp_socket`); `LAKE_BUSY` when the agent's background queue is full.
/// Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `keys` points at `count` keys.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_report_resident(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    resident: u32,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if keys.is_null() && count > 0 {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_report_resident: keys is null"));
            }
            if resident > 1 {
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("lake_report_resident: resident is 0 or 1, not {resident}"),
                ));
            }
            if !pool.has_control_plane {
                return Err(fail(
                    LakeStatus::LakeUnavailable,
                    "lake_report_resident: attached without cp_socket: no lake-cp to tell",
                ));
            }
            if count == 0 {
                return Ok(());
            }
            let keys = read_keys(pool, keys, count);
            let jobs = pool.jobs.as_ref().ok_or_else(|| fail(LakeStatus::LakeNotAttached, "detached"))?;
            jobs.push(false, Job::Resident { keys, resident: resident == 1 }).map_err(|e| match e {
                TrySendError::Full(_) => fail(LakeStatus::LakeBusy, "the agent's queue is full: retry"),
                TrySendError::Disconnected(_) => fail(LakeStatus::LakeNotAttached, "the agent's thread stopped"),
            })
        })())
    })
}

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

/// The longest cached prefix of `keys` (`count`): its length to `hits`,
/// its block table to `locations` (room for `capacity`; at most `count`
/// entries are written). Reads shared memory only: no round trip, no
/// pin, no side effect on the pool beyond an access report. Thread-safe.
///
/// # Safety
///
/// `keys` points at `count` keys; `locations` at `capacity` writable
/// entries; `hits` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_lookup(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    locations: *mut LakeLocation,
    capacity: usize,
    hits: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if hits.is_null() || (keys.is_null() && count > 0) || (locations.is_null() && capacity > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_lookup: a required pointer is null"));
            }
            let keys = read_keys(pool, keys, count);
            let mut table = Vec::with_capacity(count);
            pool.mirror.lookup(&keys, &mut table);
            // SAFETY: the caller's contract is this function's.
            unsafe { hand_out(pool, keys, &table, (locations, capacity), hits, "lake_lookup") }
        })())
    })
}

/// A lookup's answer to the caller: the block table into `locations`
/// (room for `capacity`), the hit into `hits`, and the access report queued
/// for `lake-cp` on the agent's thread, off this path (dropped if its queue
/// is full). `LAKE_BUFFER_TOO_SMALL` when the hit needs more room.
///
/// # Safety
///
/// `locations` points at `capacity` writable entries; `hits` writable.
unsafe fn hand_out(
    pool: &LakePool,
    keys: Vec<BlockKey>,
    table: &[MirrorEntry],
    (locations, capacity): (*mut LakeLocation, usize),
    hits: *mut usize,
    what: &str,
) -> Result<(), LakeStatus> {
    let found = table.len();
    for (i, entry) in table.iter().take(capacity).enumerate() {
        // SAFETY: i < capacity writable entries (contract).
        unsafe { locations.wrapping_add(i).write(location_of(entry)) };
    }
    // SAFETY: writable (contract).
    unsafe { hits.write(found) };
    if let Some(jobs) = &pool.jobs {
        let _ = jobs.push(false, Job::Accessed { keys, hits: found });
    }
    if found > capacity {
        return Err(fail(LakeStatus::LakeBufferTooSmall, format!("{what}: {found} entries need room")));
    }
    Ok(())
}

/// Where a hybrid model resumes (DESIGN §3): the longest cached prefix of
/// `keys` (`count`) and its block table, as [`lake_lookup`] gives them
/// (`hits`, `locations`), and the deepest position at most `hits` whose
/// block has a recurrent-state checkpoint — the checkpoint taken after
/// `keys[state_blocks - 1]` — to `state_blocks` (0: none) with the
/// checkpoint's location to `state_location` (zeroed when none). Load the
/// checkpoint (its key: every bit of that block's key flipped) with the
/// KV of `keys[..state_blocks]`, and compute from there. Called on a pool
/// attached for recurrent state (`object_kind` 2), the shard code the
/// rank's KV pool has. Shared memory only; access reports as
/// `lake_lookup`'s. Thread-safe.
///
/// # Safety
///
/// As [`lake_lookup`]; `state_blocks` and `state_location` writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)] // lake_lookup's, and the checkpoint's two
pub unsafe extern "C" fn lake_lookup_state(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    locations: *mut LakeLocation,
    capacity: usize,
    hits: *mut usize,
    state_blocks: *mut usize,
    state_location: *mut LakeLocation,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if hits.is_null()
                || state_blocks.is_null()
                || state_location.is_null()
                || (keys.is_null() && count > 0)
                || (locations.is_null() && capacity > 0)
            {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_lookup_state: a required pointer is null"));
            }
            let keys = read_keys(pool, keys, count);
            let mut table = Vec::with_capacity(count);
            let (_, state, entry) = pool.mirror.lookup_with_state(&keys, &mut table);
            // SAFETY: writable (contract).
            unsafe { state_blocks.write(state) };
            // SAFETY: writable (contract).
            unsafe { state_location.write(entry.map(|e| location_of(&e)).unwrap_or_default()) };
            if let (Some(jobs), Some(block)) = (&pool.jobs, state.checked_sub(1)) {
                let _ = jobs.push(false, Job::Accessed { keys: vec![keys[block].state_key()], hits: 1 });
            }
            // SAFETY: the caller's contract is this function's.
            unsafe { hand_out(pool, keys, &table, (locations, capacity), hits, "lake_lookup_state") }
        })())
    })
}

/// The longest prefix of `keys` (`count`) cached for every one of the
/// shards `shard_codes` (`shards` of them; `lake_shard_code` gives a
/// rank's): the hit of a tensor-parallel group, each of whose ranks loads
/// its own heads, is the shortest of its ranks' hits. To `hits`. For a
/// scheduler that plans for ranks it is not (vLLM's): reads shared memory
/// only, pins nothing and reports no access (the ranks' own lookups at
/// load time do). The pool's own shard code plays no part. Thread-safe.
///
/// # Safety
///
/// `keys` points at `count` keys, `shard_codes` at `shards` codes; `hits`
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_lookup_shards(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    shard_codes: *const u64,
    shards: usize,
    hits: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if hits.is_null() || (keys.is_null() && count > 0) || shard_codes.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_lookup_shards: a required pointer is null"));
            }
            if shards == 0 || shards > SHARDS_MAX {
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("lake_lookup_shards: shards is 1 to {SHARDS_MAX}, not {shards}"),
                ));
            }
            let given: &[LakeBlockKey] = if count == 0 {
                &[]
            } else {
                // SAFETY: `count` keys (contract), non-null (checked).
                unsafe { core::slice::from_raw_parts(keys, count) }
            };
            // SAFETY: `shards` codes (contract), non-null (checked), bounded.
            let codes = unsafe { core::slice::from_raw_parts(shard_codes, shards) };
            let mut shortest = count;
            let mut masked = Vec::with_capacity(count);
            let mut table = Vec::with_capacity(count);
            for &code in codes {
                let mask = ShardMask::from_code(code);
                masked.clear();
                masked.extend(given.iter().take(shortest).map(|k| mask.apply(BlockKey(k.bytes))));
                shortest = pool.mirror.lookup(&masked, &mut table);
                if shortest == 0 {
                    break;
                }
            }
            // SAFETY: writable (contract).
            unsafe { hits.write(shortest) };
            Ok(())
        })())
    })
}

/// Shards one [`lake_lookup_shards`] may ask for (tensor parallelism of at
/// most this many ranks).
const SHARDS_MAX: usize = 256;

/// The engine's `count` keys as this pool's shard names them (the keys
/// the mirror, the pool and the stored headers use).
pub(crate) fn read_keys(pool: &LakePool, keys: *const LakeBlockKey, count: usize) -> Vec<BlockKey> {
    if count == 0 {
        return Vec::new();
    }
    // SAFETY: `count` keys (the callers' contract, checked non-null).
    let keys = unsafe { core::slice::from_raw_parts(keys, count) };
    keys.iter().map(|k| pool.shard.apply(BlockKey(k.bytes))).collect()
}

fn location_of(entry: &MirrorEntry) -> LakeLocation {
    LakeLocation {
        tier: entry.tier as u8,
        tiers: entry.tiers,
        kind: entry.kind as u8,
        epoch_tag: entry.epoch_tag,
        region: entry.region.0,
        reserved: 0,
        slot: entry.slot,
        generation: entry.generation,
    }
}

fn entry_of(location: &LakeLocation) -> Option<MirrorEntry> {
    Some(MirrorEntry {
        kind: match location.kind {
            1 => ObjectKind::KvBlock,
            2 => ObjectKind::RecurrentState,
            _ => return None,
        },
        tier: Tier::from_u8(location.tier)?,
        tiers: location.tiers,
        region: RegionId(location.region),
        epoch_tag: location.epoch_tag,
        slot: location.slot,
        generation: location.generation,
    })
}

fn submit(pool: &LakePool, urgent: bool, job: Job) -> Result<(), LakeStatus> {
    let jobs = pool.jobs.as_ref().ok_or_else(|| fail(LakeStatus::LakeNotAttached, "detached"))?;
    match jobs.push(urgent, job) {
        Ok(()) => Ok(()),
        Err(TrySendError::Full(_)) => Err(fail(LakeStatus::LakeBusy, "the agent's queue is full: poll, then retry")),
        Err(TrySendError::Disconnected(_)) => Err(fail(LakeStatus::LakeNotAttached, "the agent's thread stopped")),
    }
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

fn memory(pool: &LakePool, id: u32, blocks: &[u32]) -> Result<Memory, LakeStatus> {
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

fn priority_of(code: u32) -> Result<Priority, LakeStatus> {
    u8::try_from(code).ok().and_then(Priority::from_u8).ok_or_else(|| {
        fail(
            LakeStatus::LakeInvalidArgument,
            format!("priority {code}: 0 critical load, 1 prefill to decode, 2 write-back, 3 demotion, 4 replication"),
        )
    })
}

/// Whether work of `priority` goes ahead of the rest on the agent thread.
fn urgent(priority: Priority) -> bool {
    matches!(priority, Priority::CriticalLoad | Priority::PrefillToDecode)
}

/// Loads the looked-up blocks `keys[i]` (entries `locations[i]`) into
/// engine blocks `engine_blocks[i]` of memory `memory_id`, in order, on
/// the agent's thread; one completion per block (`lake_poll`): the first
/// failure says why, the blocks after it `LAKE_PREFIX_BROKEN` (recompute
/// them). `priority` (0 critical load: a request waits for it; 1 prefill
/// to decode; 2 and up: prefetch) orders it on the agent thread and in
/// the data plane: critical and prefill-to-decode work goes ahead of saves
/// and prefetches. The request's id goes to `request_id`. Thread-safe.
///
/// # Safety
///
/// The arrays point at `count` entries each; `request_id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_submit_load(
    pool: *const LakePool,
    memory_id: u32,
    keys: *const LakeBlockKey,
    locations: *const LakeLocation,
    engine_blocks: *const u32,
    count: usize,
    priority: u32,
    request_id: *mut u64,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            let priority = priority_of(priority)?;
            if request_id.is_null() || (count > 0 && (keys.is_null() || locations.is_null() || engine_blocks.is_null()))
            {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_submit_load: a required pointer is null"));
            }
            let keys = read_keys(pool, keys, count);
            let (locations, blocks) = if count == 0 {
                (&[][..], &[][..])
            } else {
                // SAFETY: `count` entries (contract), non-null (checked).
                let locations = unsafe { core::slice::from_raw_parts(locations, count) };
                // SAFETY: as above.
                let blocks = unsafe { core::slice::from_raw_parts(engine_blocks, count) };
                (locations, blocks)
            };
            let table: Option<Vec<MirrorEntry>> = locations.iter().map(entry_of).collect();
            let table = table.ok_or_else(|| fail(LakeStatus::LakeInvalidArgument, "a location's tier or kind"))?;
            let memory = memory(pool, memory_id, blocks)?;
            let request = pool.next_request.fetch_add(1, Ordering::Relaxed);
            if let Memory::Gpu(gpu) = &memory {
                pool.layers.start(request, Arc::clone(&gpu.gpu), gpu.layers);
            }
            let submitted = submit(
                pool,
                urgent(priority),
                Job::Load {
                    request,
                    trace: crate::trace::current(),
                    priority,
                    memory,
                    keys,
                    table,
                    blocks: blocks.to_vec(),
                },
            );
            if submitted.is_err() {
                pool.layers.finished(request);
            }
            submitted?;
            // SAFETY: writable (contract).
            unsafe { request_id.write(request) };
            Ok(())
        })())
    })
}

/// Makes the engine's CUDA stream wait, on the GPU, until layer `layer` of
/// GPU load `request_id` has landed — vLLM's `wait_for_layer_load` without
/// a host block: the caller returns as soon as the agent thread has queued
/// that layer (direct loads of L1 hits, `gpu_path` 1, go layer by layer:
/// every block's layer 0 first; other loads land whole, and the wait
/// returns once they have). `cuda_stream` is a raw `CUstream` of the
/// device's primary context (PyTorch's `torch.cuda.current_stream()
/// .cuda_stream`), 0 for the legacy default stream. The bytes are checked
/// after they land (GPU segment CRCs): a block that fails completes
/// `LAKE_BAD_CRC` through [`lake_poll`], and the engine must drain a
/// load's completions before it keeps what it computed from it. A host
/// memory load, or one finished long ago, has nothing to wait for:
/// `LAKE_OK`. `LAKE_INVALID_ARGUMENT` for a request never submitted or a
/// layer past the model's; `LAKE_UNAVAILABLE` when the agent thread did
/// not reach the load within 10 s. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `cuda_stream` a live stream of the GPU
/// memory's device (primary context), or 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_wait_layer(
    pool: *const LakePool,
    request_id: u64,
    layer: u32,
    cuda_stream: u64,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            // SAFETY: the caller's contract.
            match unsafe { pool.layers.wait(request_id, layer as usize, cuda_stream) } {
                Ok(()) => Ok(()),
                Err(gpu::LayerWaitError::Unknown)
                    if request_id > 0 && request_id < pool.next_request.load(Ordering::Relaxed) =>
                {
                    Ok(())
                }
                Err(gpu::LayerWaitError::Unknown) => Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("lake_wait_layer: no request {request_id} was submitted"),
                )),
                Err(gpu::LayerWaitError::Layer(layers)) => Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("lake_wait_layer: layer {layer}: the model has {layers}"),
                )),
                Err(gpu::LayerWaitError::Timeout) => Err(fail(
                    LakeStatus::LakeUnavailable,
                    format!("lake_wait_layer: request {request_id} did not reach layer {layer} in time"),
                )),
                Err(gpu::LayerWaitError::Driver(e)) => {
                    Err(fail(LakeStatus::LakeIo, format!("lake_wait_layer: the stream wait failed: {e}")))
                }
            }
        })())
    })
}

/// This node's L1 as a push target: its region and epoch (`region`,
/// `epoch`). A node that pushes blocks here ([`lake_push`]) names them;
/// they travel with the request that routes work here. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `region` and `epoch` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_slot_space(pool: *const LakePool, region: *mut u16, epoch: *mut u64) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if region.is_null() || epoch.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_slot_space: a required pointer is null"));
            }
            // SAFETY: writable (contract).
            unsafe { region.write(pool.arena_region) };
            // SAFETY: writable (contract).
            unsafe { epoch.write(pool.arena_epoch) };
            Ok(())
        })())
    })
}

/// Pushes the looked-up L1 blocks `keys[i]` (entries `locations[i]`, from
/// [`lake_lookup`]) to another node's pool — the node at `address`
/// (`"IP:PORT"`, its data plane's transport; or its rails on the compute
/// network, one per NIC, `"LOCAL>IP:PORT,LOCAL>IP:PORT"`: slices spread
/// over them by measured speed, a broken one passed over, each accounted
/// in [`lake_push_rails`]) — into any slot of its L1
/// `region` at `epoch` ([`lake_slot_space`] there): P→D, the prefill
/// engine handing its prompt's KV to the decode node. Each block is
/// pinned where it sits and sent from there on the agent's thread; the
/// peer checks it where it lands and publishes it. One completion per
/// block ([`lake_poll`]): `LAKE_OK` landed; `LAKE_EVICTED` gone here
/// before it was sent; `LAKE_BAD_CRC` it did not check there;
/// `LAKE_UNAVAILABLE` not an L1 block here, or the peer refused it or
/// could not be reached by the deadline; `LAKE_BUSY` the peer had no room.
/// `priority` as for loads (1, prefill to decode, is what a push usually
/// is). Thread-safe.
///
/// # Safety
///
/// `address` a C string; the arrays point at `count` entries each;
/// `request_id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_push(
    pool: *const LakePool,
    address: *const c_char,
    keys: *const LakeBlockKey,
    locations: *const LakeLocation,
    count: usize,
    region: u16,
    epoch: u64,
    priority: u32,
    request_id: *mut u64,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            let priority = priority_of(priority)?;
            if request_id.is_null() || address.is_null() || (count > 0 && (keys.is_null() || locations.is_null())) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_push: a required pointer is null"));
            }
            // SAFETY: a C string (contract).
            let text = unsafe { std::ffi::CStr::from_ptr(address) };
            let rails = text.to_str().map_err(|e| e.to_string()).and_then(lake_dp::transport::tcp::Rail::parse_list);
            let rails = rails.map_err(|e| {
                fail(
                    LakeStatus::LakeInvalidArgument,
                    format!("lake_push: address {text:?}: [LOCAL>]IP:PORT[,...]: {e}"),
                )
            })?;
            let peer = (text.to_string_lossy().into_owned(), rails);
            let keys = read_keys(pool, keys, count);
            let locations = if count == 0 {
                &[][..]
            } else {
                // SAFETY: `count` entries (contract), non-null (checked).
                unsafe { core::slice::from_raw_parts(locations, count) }
            };
            let table: Option<Vec<MirrorEntry>> = locations.iter().map(entry_of).collect();
            let table = table.ok_or_else(|| fail(LakeStatus::LakeInvalidArgument, "a location's tier or kind"))?;
            let request = pool.next_request.fetch_add(1, Ordering::Relaxed);
            let trace = crate::trace::current();
            let job = crate::push::PushJob { request, peer, keys, table, to: (region, epoch), priority, trace };
            submit(pool, urgent(priority), Job::Push(Box::new(job)))?;
            // SAFETY: writable (contract).
            unsafe { request_id.write(request) };
            Ok(())
        })())
    })
}

/// What each rail of the compute network carried for this pool's pushes
/// (P→D, D→P): up to `capacity` entries into `out` — peer after peer in
/// the order first pushed to, rail after rail as given — and into
/// `written` how many there are in all (call with `capacity` 0 to size
/// the array). Figures as of the agent thread's last turn. Thread-safe.
///
/// # Safety
///
/// `out` points at `capacity` writable entries (or is null with
/// `capacity` 0); `written` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_push_rails(
    pool: *const LakePool,
    out: *mut LakeRailStat,
    capacity: usize,
    written: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if written.is_null() || (out.is_null() && capacity > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_push_rails: a required pointer is null"));
            }
            let rails = pool.push_rails.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
            for (i, rail) in rails.iter().take(capacity).enumerate() {
                // SAFETY: i < capacity writable entries (contract).
                unsafe { out.wrapping_add(i).write(*rail) };
            }
            // SAFETY: writable (contract).
            unsafe { written.write(rails.len()) };
            Ok(())
        })())
    })
}

/// Saves engine blocks `engine_blocks[i]` of memory `memory_id` as blocks
/// `keys[i]` (each under `keys[i-1]`, the first under `parent`, which may
/// be null for a prompt's first block), on the agent's thread, behind
/// its urgent work unless `priority` is 0 or 1 (2, write-back, is what a
/// save usually is). Best effort: a block with no room completes
/// `LakeNoSpace`. GPU memory: Lake reads the blocks on a stream of its own,
/// not ordered after the engine's, so the engine's writes to them must be
/// complete when it calls (blocks of earlier steps, or its stream
/// synchronized) — or it calls [`lake_submit_save_on_stream`] instead.
/// Thread-safe.
///
/// # Safety
///
/// The arrays point at `count` entries each; `parent` null or one key;
/// `request_id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_submit_save(
    pool: *const LakePool,
    memory_id: u32,
    parent: *const LakeBlockKey,
    keys: *const LakeBlockKey,
    engine_blocks: *const u32,
    count: usize,
    priority: u32,
    request_id: *mut u64,
) -> LakeStatus {
    let save = SaveArgs { memory_id, parent, keys, engine_blocks, count, priority, request_id };
    // SAFETY: the caller's contract is this function's.
    guard(|| status_of(unsafe { submit_save(pool, &save, None, "lake_submit_save") }))
}

/// Like [`lake_submit_save`], with the save's reads of GPU memory ordered
/// on the GPU after everything the engine has queued on `cuda_stream` so
/// far (a raw `CUstream` of the device's primary context, PyTorch's
/// `torch.cuda.current_stream().cuda_stream`; 0 for the legacy default
/// stream): the engine may submit right after queuing the kernels that
/// write the blocks, with no synchronization of its own. An event is
/// recorded on that stream in this call; the host waits for nothing. For
/// host memory the stream plays no part. Thread-safe.
///
/// # Safety
///
/// As [`lake_submit_save`]; `cuda_stream` a live stream of the GPU
/// memory's device (primary context), or 0.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_submit_save_on_stream(
    pool: *const LakePool,
    memory_id: u32,
    parent: *const LakeBlockKey,
    keys: *const LakeBlockKey,
    engine_blocks: *const u32,
    count: usize,
    priority: u32,
    cuda_stream: u64,
    request_id: *mut u64,
) -> LakeStatus {
    let save = SaveArgs { memory_id, parent, keys, engine_blocks, count, priority, request_id };
    // SAFETY: the caller's contract is this function's.
    guard(|| status_of(unsafe { submit_save(pool, &save, Some(cuda_stream), "lake_submit_save_on_stream") }))
}

/// The arguments both save calls take.
struct SaveArgs {
    memory_id: u32,
    parent: *const LakeBlockKey,
    keys: *const LakeBlockKey,
    engine_blocks: *const u32,
    count: usize,
    priority: u32,
    request_id: *mut u64,
}

/// Queues a save; `stream`: the engine's stream its GPU reads are ordered
/// after.
///
/// # Safety
///
/// As [`lake_submit_save_on_stream`].
unsafe fn submit_save(
    pool: *const LakePool,
    save: &SaveArgs,
    stream: Option<u64>,
    call: &str,
) -> Result<(), LakeStatus> {
    let &SaveArgs { memory_id, parent, keys, engine_blocks, count, priority, request_id } = save;
    let pool = pool_ref(pool)?;
    let priority = priority_of(priority)?;
    if request_id.is_null() || (count > 0 && (keys.is_null() || engine_blocks.is_null())) {
        return Err(fail(LakeStatus::LakeNullArgument, format!("{call}: a required pointer is null")));
    }
    let keys = read_keys(pool, keys, count);
    let blocks = if count == 0 {
        &[][..]
    } else {
        // SAFETY: `count` entries (contract).
        unsafe { core::slice::from_raw_parts(engine_blocks, count) }
    };
    let memory = memory(pool, memory_id, blocks)?;
    let first_parent = if parent.is_null() {
        BlockKey::NONE
    } else {
        // SAFETY: one key (contract).
        pool.shard.apply(BlockKey(unsafe { (*parent).bytes }))
    };
    let parents: Vec<BlockKey> = core::iter::once(first_parent).chain(keys.iter().copied()).take(keys.len()).collect();
    let after = match (&memory, stream) {
        (Memory::Gpu(gpu), Some(stream)) => {
            // SAFETY: a live stream of the memory's device (contract).
            let event =
                unsafe { gpu.gpu.record_on(stream) }.map_err(|e| fail(LakeStatus::LakeIo, format!("{call}: {e}")))?;
            Some(Arc::new(event))
        }
        _ => None,
    };
    let request = pool.next_request.fetch_add(1, Ordering::Relaxed);
    submit(pool, urgent(priority), Job::Save { request, memory, keys, parents, blocks: blocks.to_vec(), after })?;
    // SAFETY: writable (contract).
    unsafe { request_id.write(request) };
    Ok(())
}

/// Cancels a request not yet started: its blocks complete
/// `LakeCancelled`. Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_cancel(pool: *const LakePool, request_id: u64) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            pool.cancelled.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?.insert(request_id);
            Ok(())
        })())
    })
}

/// Takes up to `capacity` completions into `out`; their number to
/// `written`. Never blocks. Thread-safe (one poller at a time sees each
/// completion once).
///
/// # Safety
///
/// `out` points at `capacity` writable completions; `written` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_poll(
    pool: *const LakePool,
    out: *mut LakeCompletion,
    capacity: usize,
    written: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if pool.is_null() || written.is_null() || (out.is_null() && capacity > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_poll: a required pointer is null"));
            }
            // SAFETY: non-null; from lake_attach (contract). Completions are
            // handed out even after the data plane went away.
            let pool = unsafe { &*pool };
            let receiver = pool.completions.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
            let mut n = 0;
            while n < capacity {
                let Ok(completion) = receiver.try_recv() else { break };
                // SAFETY: n < capacity writable entries (contract).
                unsafe { out.wrapping_add(n).write(completion) };
                n += 1;
            }
            // SAFETY: writable (contract).
            unsafe { written.write(n) };
            Ok(())
        })())
    })
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

/// Like [`lake_lookup`], and pins the L1 blocks of the hit (their handle to
/// `pins`): until [`lake_pins_release`], they stay in L1 unchanged, and
/// [`lake_load_pinned`] copies them into engine memory in the calling
/// thread with no queue and no lease. A block whose pin fails (evicted
/// since the mirror was read) ends the hit there. Thread-safe.
///
/// # Safety
///
/// As [`lake_lookup`]; `pins` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_lookup_pinned(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    locations: *mut LakeLocation,
    capacity: usize,
    hits: *mut usize,
    pins: *mut *mut LakePins,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if pins.is_null()
                || hits.is_null()
                || (keys.is_null() && count > 0)
                || (locations.is_null() && capacity > 0)
            {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_lookup_pinned: a required pointer is null"));
            }
            let keys = read_keys(pool, keys, count);
            let mut table = Vec::with_capacity(count);
            let mut found = pool.mirror.lookup(&keys, &mut table);
            if found > capacity {
                // SAFETY: writable (contract).
                unsafe { hits.write(found) };
                return Err(fail(
                    LakeStatus::LakeBufferTooSmall,
                    format!("lake_lookup_pinned: {found} entries need room"),
                ));
            }
            let mut held = Vec::with_capacity(found);
            {
                let mut array = pool.pins.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
                for (i, entry) in table.iter().take(found).enumerate() {
                    if entry.tier != Tier::L1Dram || entry.region.0 != pool.arena_region {
                        held.push(None);
                        continue;
                    }
                    match array.pin(entry.slot, entry.generation) {
                        Ok(pin) => held.push(Some(pin)),
                        Err(lake_dp::arena::PinError::Full) => {
                            for pin in held.into_iter().flatten() {
                                array.unpin(pin);
                            }
                            return Err(fail(LakeStatus::LakeBusy, "every pin entry is in use: release some"));
                        }
                        Err(_) => {
                            found = i;
                            break;
                        }
                    }
                }
            }
            for (i, entry) in table.iter().take(found).enumerate() {
                // SAFETY: i < found <= capacity writable entries (contract).
                unsafe { locations.wrapping_add(i).write(location_of(entry)) };
            }
            // SAFETY: writable (contract).
            unsafe { hits.write(found) };
            if let Some(jobs) = &pool.jobs {
                let _ = jobs.push(false, Job::Accessed { keys: keys.clone(), hits: found });
            }
            let set = LakePins { array: Arc::clone(&pool.pins), pins: held, keys: keys[..found].to_vec() };
            // SAFETY: writable (contract).
            unsafe { pins.write(Box::into_raw(Box::new(set))) };
            Ok(())
        })())
    })
}

/// Copies the pinned L1 blocks `0..count` of `pins` into engine blocks
/// `engine_blocks[i]` of memory `memory_id`, in the calling thread, every
/// segment checked against its CRC; `statuses[i]` says how each went
/// (`LAKE_EVICTED` for a block the lookup did not pin: load it with
/// `lake_submit_load`). Thread-safe; the pins stay until released.
///
/// # Safety
///
/// `pins` from `lake_lookup_pinned` on this pool, not released;
/// `engine_blocks` and `statuses` point at `count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_load_pinned(
    pool: *const LakePool,
    pins: *const LakePins,
    memory_id: u32,
    engine_blocks: *const u32,
    count: usize,
    statuses: *mut LakeStatus,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if pins.is_null() || (count > 0 && (engine_blocks.is_null() || statuses.is_null())) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_load_pinned: a required pointer is null"));
            }
            // SAFETY: from lake_lookup_pinned, not released (contract).
            let set = unsafe { &*pins };
            if count > set.pins.len() {
                return Err(fail(LakeStatus::LakeInvalidArgument, "lake_load_pinned: more blocks than the lookup hit"));
            }
            let blocks = if count == 0 {
                &[][..]
            } else {
                // SAFETY: `count` entries (contract).
                unsafe { core::slice::from_raw_parts(engine_blocks, count) }
            };
            let Memory::Host(memory) = memory(pool, memory_id, blocks)? else {
                return Err(fail(
                    LakeStatus::LakeInvalidArgument,
                    "lake_load_pinned: GPU memory is loaded with lake_submit_load (a kernel, on the agent's thread)",
                ));
            };
            let array = set.array.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
            for (i, (&block, (pin, key))) in blocks.iter().zip(set.pins.iter().zip(&set.keys)).enumerate() {
                let status = match pin {
                    None => LakeStatus::LakeEvicted,
                    Some(pin) => copy_checked(array.bytes(pin), key, pool.reader(), &memory, block),
                };
                // SAFETY: i < count writable statuses (contract).
                unsafe { statuses.wrapping_add(i).write(status) };
            }
            Ok(())
        })())
    })
}

/// Releases the pins of a pinned lookup (null accepted). Works after the
/// pool detached too (its pins were kept for this).
///
/// # Safety
///
/// `pins` null or from `lake_lookup_pinned`, released once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_pins_release(pins: *mut LakePins) {
    if pins.is_null() {
        return;
    }
    // SAFETY: from Box::into_raw in lake_lookup_pinned, released once.
    let set = unsafe { Box::from_raw(pins) };
    let LakePins { array, pins, .. } = *set;
    if let Ok(mut array) = array.lock() {
        for pin in pins.into_iter().flatten() {
            array.unpin(pin);
        }
    }
}
