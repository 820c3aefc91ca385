//! What the `ffi_entry` fuzz target runs (feature `fuzzing`; never in a
//! release build): the C ABI's entry points that take an engine's structs
//! and buffers, fed field values and byte counts from the fuzzer's input.
//! Any values give a status — never a panic, not even one the boundary
//! catches (`LAKE_INTERNAL`) — and whatever succeeds is consistent. Every
//! pointer passed is valid: the C contract is the caller's; what is
//! fuzzed is what Lake makes of the values.

use crate::layout::{
    LakeLayoutInfo, LakeLayoutOptions, LakeStateLayoutInfo, LakeStateLayoutOptions, lake_layout_describe,
    lake_shard_code, lake_state_layout_describe,
};
use crate::pool::{
    LakeBlockKey, LakeNamespaceOptions, lake_keychain_extend, lake_keychain_free, lake_keychain_new,
    lake_namespace_free, lake_namespace_new, lake_page_keys,
};
use crate::status::LakeStatus;

/// Plain-data structs of integers and byte arrays: any bytes are a value.
///
/// # Safety
///
/// Implemented only for `repr(C)` structs whose every field is an integer
/// or an array of them.
unsafe trait Plain: Copy {}
// SAFETY: repr(C), integers only.
unsafe impl Plain for LakeLayoutOptions {}
// SAFETY: repr(C), integers only.
unsafe impl Plain for LakeStateLayoutOptions {}
// SAFETY: repr(C), integers and byte arrays only.
unsafe impl Plain for LakeNamespaceOptions {}
// SAFETY: repr(C), integers only.
unsafe impl Plain for LakeStateLayoutInfo {}

/// A `T` from the next bytes of `input` (zeros past its end).
fn take<T: Plain>(input: &mut &[u8]) -> T {
    // SAFETY: `Plain`: all-zero bytes are a value of T.
    let mut value: T = unsafe { core::mem::zeroed() };
    let (head, rest) = input.split_at(size_of::<T>().min(input.len()));
    // SAFETY: at most size_of::<T>() bytes into a T, any bytes being a
    // value of it (`Plain`).
    unsafe { core::ptr::copy_nonoverlapping(head.as_ptr(), (&raw mut value).cast::<u8>(), head.len()) };
    *input = rest;
    value
}

fn no_panic(status: LakeStatus, what: &str) -> LakeStatus {
    assert_ne!(status, LakeStatus::LakeInternal, "{what} panicked");
    status
}

/// Runs the entry points on `data`. Panics (the fuzzer's finding) where
/// one panicked or answered inconsistently.
pub fn exercise_entry_points(data: &[u8]) {
    let Some((&mode, mut input)) = data.split_first() else { return };
    // Half the time a struct_size that matches, so the field checks run.
    let fixed = |given: usize, real: usize| if mode & 1 == 1 { real } else { given };

    let mut layout: LakeLayoutOptions = take(&mut input);
    layout.struct_size = fixed(layout.struct_size, size_of::<LakeLayoutOptions>());
    let mut info = LakeLayoutInfo { struct_size: size_of::<LakeLayoutInfo>(), ..LakeLayoutInfo::default() };
    // SAFETY: both point at live values of their types.
    let status = no_panic(unsafe { lake_layout_describe(&layout, &mut info) }, "lake_layout_describe");
    if status == LakeStatus::LakeOk {
        assert!(info.segment_bytes > 0 && info.block_bytes >= info.segment_bytes, "{info:?}");
    }
    let mut code = 0u64;
    // SAFETY: `code` is a live u64.
    let shard = unsafe { lake_shard_code(layout.kv_heads, layout.shard_start, layout.shard_end, &mut code) };
    no_panic(shard, "lake_shard_code");

    let mut state: LakeStateLayoutOptions = take(&mut input);
    state.struct_size = fixed(state.struct_size, size_of::<LakeStateLayoutOptions>());
    let mut state_info: LakeStateLayoutInfo = take(&mut &[][..]);
    state_info.struct_size = size_of::<LakeStateLayoutInfo>();
    // SAFETY: both point at live values of their types.
    no_panic(unsafe { lake_state_layout_describe(&state, &mut state_info) }, "lake_state_layout_describe");

    let mut options: LakeNamespaceOptions = take(&mut input);
    options.struct_size = fixed(options.struct_size, size_of::<LakeNamespaceOptions>());
    let mut namespace = core::ptr::null_mut();
    // SAFETY: live options, a live out pointer.
    let status = no_panic(unsafe { lake_namespace_new(&options, &mut namespace) }, "lake_namespace_new");
    if status != LakeStatus::LakeOk {
        assert!(namespace.is_null(), "a failed lake_namespace_new gave a namespace");
        return;
    }
    let (capacity, input) = match input.split_first() {
        Some((&capacity, rest)) => (usize::from(capacity), rest),
        None => (0, &[][..]),
    };
    let mut keys = vec![LakeBlockKey { bytes: [0; 16] }; capacity];
    let tokens: Vec<u32> = input.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let mut chain = core::ptr::null_mut();
    // SAFETY: a namespace from lake_namespace_new, a live out pointer.
    if no_panic(unsafe { lake_keychain_new(namespace, &mut chain) }, "lake_keychain_new") == LakeStatus::LakeOk {
        let mut written = 0usize;
        // SAFETY: a chain from lake_keychain_new; `tokens.len()` tokens;
        // `capacity` writable keys; a live count.
        let extended = unsafe {
            lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), capacity, &mut written)
        };
        if no_panic(extended, "lake_keychain_extend") == LakeStatus::LakeOk {
            assert!(written <= capacity, "{written} keys written into {capacity}");
        }
        // SAFETY: from lake_keychain_new, freed once.
        unsafe { lake_keychain_free(chain) };
    }
    // The same bytes as page hashes of a size the input picks.
    let hash_bytes = usize::from(mode >> 1) % 48;
    let count = input.len().checked_div(hash_bytes).map_or(input.len().min(3), |n| n.min(capacity));
    // SAFETY: `count * hash_bytes` bytes of `input` readable (0 when
    // hash_bytes is 0, refused before any read), `count` <= `capacity`
    // writable keys.
    let paged = unsafe { lake_page_keys(namespace, input.as_ptr(), hash_bytes, count, keys.as_mut_ptr()) };
    no_panic(paged, "lake_page_keys");
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
}

/// The entry points that take a pool handle, on one pool attached to a
/// running `lake-dp`/`lake-cp` (the `ffi_pool` fuzz target starts an
/// embedded one and attaches once): lookups, leases, residency reports,
/// pinned lookups, host memory registration, saves and loads with any
/// keys, block indices, block tables, counts, capacities, priorities and
/// request ids the input gives. Every status is one of the C ABI's, never
/// a panic (not even a caught one); what succeeds is consistent (a hit
/// never longer than asked, a written count within the capacity).
pub struct PoolHarness {
    pool: *mut crate::pool::LakePool,
    namespace: *mut crate::pool::LakeNamespace,
    /// Host memory registered (id, blocks); the bytes are kept in
    /// [`REGISTERED`] until the process ends (a registration must outlive
    /// the pool's use of it).
    memory: Vec<(u32, u32)>,
    requests: Vec<u64>,
}

impl core::fmt::Debug for PoolHarness {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PoolHarness").field("memory", &self.memory.len()).finish_non_exhaustive()
    }
}

/// The bytes of every registration the harness made, reachable until the
/// process ends.
static REGISTERED: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// Device memory the harness laid GPU pieces over, kept until the
/// process ends (as [`REGISTERED`]).
static DEVICE_MEMORY: std::sync::Mutex<Vec<cudarc::driver::CudaSlice<u8>>> = std::sync::Mutex::new(Vec::new());

/// The address of `bytes` fresh bytes of CUDA device 0's memory, kept for
/// the process; `None` for 0 bytes or where there is no GPU (said once).
fn device_memory(bytes: usize) -> Option<usize> {
    use cudarc::driver::DevicePtr;
    static STREAM: std::sync::OnceLock<Option<std::sync::Arc<cudarc::driver::CudaStream>>> = std::sync::OnceLock::new();
    if bytes == 0 {
        return None;
    }
    let stream = STREAM.get_or_init(|| match lake_kernels::probe() {
        Ok(_) => cudarc::driver::CudaContext::new(0).ok().map(|context| context.default_stream()),
        Err(why) => {
            eprintln!("ffi_pool: GPU memory stays host memory here: {why}");
            None
        }
    });
    let stream = stream.as_ref()?;
    let slice = stream.alloc_zeros::<u8>(bytes).ok()?;
    let address = usize::try_from(slice.device_ptr(stream).0).ok()?;
    DEVICE_MEMORY.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(slice);
    Some(address)
}

/// The harness pool's layout: 2 layers of K and V, 2 heads of 64 f16, 16
/// tokens a block — 4 pieces of 4 KiB a block.
fn harness_layout() -> LakeLayoutOptions {
    LakeLayoutOptions {
        struct_size: size_of::<LakeLayoutOptions>(),
        layers: 2,
        planes: 2,
        kv_heads: 2,
        shard_start: 0,
        shard_end: 2,
        head_dim: 64,
        dtype: 1,
        block_tokens: 16,
        layers_per_segment: 1,
    }
}

/// Bytes of one piece of one block in [`harness_layout`] (16 tokens × 2
/// heads × 128 bytes), and its pieces.
const HARNESS_PIECE_BYTES: usize = 16 * 2 * 128;
const HARNESS_PIECES: usize = 4;

/// Registrations the harness makes at most, and bytes each.
const HARNESS_REGISTRATIONS_MAX: usize = 8;
const HARNESS_MEMORY_MAX: usize = 4 << 20;

impl PoolHarness {
    /// Attaches to the pool whose sockets and mirror these are.
    pub fn attach(dp_socket: &str, mirror: &str, cp_socket: &str) -> Result<Self, LakeStatus> {
        use crate::pool::{LakeAttachOptions, lake_attach};
        let options = LakeNamespaceOptions {
            struct_size: size_of::<LakeNamespaceOptions>(),
            tenant_key: [0x33; 32],
            block_tokens: 16,
            model_fingerprint: [0x44; 32],
            extra_keys_digest: [0; 32],
            key_scheme: 1,
        };
        // The pool's layout: KV memory registered with it gets past the
        // fingerprint check to the rest.
        let layout = harness_layout();
        let mut info = LakeLayoutInfo { struct_size: size_of::<LakeLayoutInfo>(), ..LakeLayoutInfo::default() };
        // SAFETY: both live.
        let status = unsafe { lake_layout_describe(&layout, &mut info) };
        if status != LakeStatus::LakeOk {
            return Err(status);
        }
        let mut namespace = core::ptr::null_mut();
        // SAFETY: live options and out pointer.
        let status = unsafe { lake_namespace_new(&options, &mut namespace) };
        if status != LakeStatus::LakeOk {
            return Err(status);
        }
        let c = |s: &str| std::ffi::CString::new(s).map_err(|_| LakeStatus::LakeInvalidArgument);
        let (dp, mirror, cp) = (c(dp_socket)?, c(mirror)?, c(cp_socket)?);
        let attach = LakeAttachOptions {
            struct_size: size_of::<LakeAttachOptions>(),
            dp_socket: dp.as_ptr(),
            mirror_path: mirror.as_ptr(),
            cp_socket: cp.as_ptr(),
            name: c"fuzz".as_ptr(),
            namespace,
            layout_fingerprint: info.fingerprint,
            segment_bytes: 4096,
            pin_agent: 0,
            agent_core: 0,
            copy_threads: 1,
            shard_code: info.shard_code,
            object_kind: 1,
            block_bytes: 0,
        };
        let mut pool = core::ptr::null_mut();
        // SAFETY: live options whose strings live through the call.
        let status = unsafe { lake_attach(&attach, &mut pool) };
        if status != LakeStatus::LakeOk {
            return Err(status);
        }
        Ok(Self { pool, namespace, memory: Vec::new(), requests: Vec::new() })
    }

    /// Runs the input's operations on the pool.
    pub fn exercise(&mut self, data: &[u8]) {
        use crate::pool::{
            LakeCompletion, LakeLocation, LakeStats, lake_alive, lake_cancel, lake_lease, lake_lease_release,
            lake_load_pinned, lake_lookup, lake_lookup_pinned, lake_lookup_shards, lake_lookup_state,
            lake_pins_release, lake_poll, lake_push, lake_push_rails, lake_register_host_memory,
            lake_register_kv_memory, lake_report_resident, lake_slot_space, lake_stats, lake_submit_load,
            lake_submit_save, lake_submit_save_on_stream, lake_wait_layer,
        };
        let mut input = data;
        let byte = |input: &mut &[u8]| -> u8 {
            let (&b, rest) = input.split_first().unwrap_or((&0, &[]));
            *input = rest;
            b
        };
        let word = |input: &mut &[u8]| -> u32 {
            let mut bytes = [0u8; 4];
            for b in &mut bytes {
                let (&x, rest) = input.split_first().unwrap_or((&0, &[]));
                *b = x;
                *input = rest;
            }
            u32::from_le_bytes(bytes)
        };
        let pool = self.pool.cast_const();
        for _ in 0..8 {
            if input.is_empty() {
                return;
            }
            let op = byte(&mut input) % 15;
            let count = usize::from(byte(&mut input) % 40);
            let capacity = usize::from(byte(&mut input) % 48);
            // Keys: some from the namespace's chain (they may hit), the
            // rest the input's bytes.
            let mut keys = vec![LakeBlockKey::default(); count];
            for key in &mut keys {
                for b in &mut key.bytes {
                    *b = byte(&mut input);
                }
            }
            let mut table = vec![LakeLocation::default(); capacity.max(count)];
            let mut hits = usize::MAX;
            match op {
                0 => {
                    // SAFETY: `count` keys, `capacity` writable locations.
                    let s = unsafe { lake_lookup(pool, keys.as_ptr(), count, table.as_mut_ptr(), capacity, &mut hits) };
                    if no_panic(s, "lake_lookup") == LakeStatus::LakeOk {
                        assert!(hits <= count.min(capacity), "{hits} hits of {count} keys into {capacity}");
                    }
                }
                1 => {
                    let (mut state_blocks, mut state) = (0usize, LakeLocation::default());
                    // SAFETY: as above, and live outs.
                    let s = unsafe {
                        lake_lookup_state(
                            pool,
                            keys.as_ptr(),
                            count,
                            table.as_mut_ptr(),
                            capacity,
                            &mut hits,
                            &mut state_blocks,
                            &mut state,
                        )
                    };
                    if no_panic(s, "lake_lookup_state") == LakeStatus::LakeOk {
                        assert!(hits <= count && state_blocks <= hits.max(count), "{hits} {state_blocks}");
                    }
                }
                2 => {
                    let codes: Vec<u64> = (0..capacity % 5).map(|_| u64::from(word(&mut input))).collect();
                    // SAFETY: `count` keys, `codes.len()` codes, a live out.
                    let s = unsafe {
                        lake_lookup_shards(pool, keys.as_ptr(), count, codes.as_ptr(), codes.len(), &mut hits)
                    };
                    no_panic(s, "lake_lookup_shards");
                }
                3 => {
                    let (mut granted, mut deadline, mut lease) = (0usize, 0u64, core::ptr::null_mut());
                    let ttl = word(&mut input);
                    // SAFETY: `count` keys and live outs.
                    let s =
                        unsafe { lake_lease(pool, keys.as_ptr(), count, ttl, &mut granted, &mut deadline, &mut lease) };
                    if no_panic(s, "lake_lease") == LakeStatus::LakeOk {
                        assert!(granted <= count);
                    }
                    // SAFETY: null or from lake_lease, released once.
                    unsafe { lake_lease_release(lease) };
                }
                4 => {
                    let resident = word(&mut input);
                    // SAFETY: `count` keys.
                    no_panic(unsafe { lake_report_resident(pool, keys.as_ptr(), count, resident) }, "report_resident");
                }
                5 => {
                    let mut pins = core::ptr::null_mut();
                    // SAFETY: as lake_lookup, and a live out.
                    let s = unsafe {
                        lake_lookup_pinned(
                            pool,
                            keys.as_ptr(),
                            count,
                            table.as_mut_ptr(),
                            capacity,
                            &mut hits,
                            &mut pins,
                        )
                    };
                    if no_panic(s, "lake_lookup_pinned") == LakeStatus::LakeOk {
                        assert!(hits <= count.min(capacity));
                        // Copied out into a registered memory, or any id.
                        let pick = byte(&mut input);
                        let memory_id = self.memory.get(usize::from(pick) % 9).map_or(u32::from(pick), |m| m.0);
                        let blocks = usize::from(byte(&mut input) % 48);
                        let indices: Vec<u32> = (0..blocks).map(|_| word(&mut input) % 80).collect();
                        let mut statuses = vec![LakeStatus::LakeOk; blocks];
                        // SAFETY: live pins, `blocks` indices and statuses;
                        // the memory registered lives for the process.
                        let s = unsafe {
                            lake_load_pinned(pool, pins, memory_id, indices.as_ptr(), blocks, statuses.as_mut_ptr())
                        };
                        no_panic(s, "lake_load_pinned");
                    }
                    // SAFETY: null or from lake_lookup_pinned, released once.
                    unsafe { lake_pins_release(pins) };
                }
                6 => {
                    let block_bytes = (word(&mut input) % (1 << 20)) as usize;
                    let blocks = word(&mut input) % 64;
                    let bytes = block_bytes.saturating_mul(blocks as usize);
                    if self.memory.len() < HARNESS_REGISTRATIONS_MAX && bytes <= HARNESS_MEMORY_MAX {
                        let mut memory = vec![0u8; bytes.max(1)];
                        let mut id = u32::MAX;
                        // SAFETY: `bytes` bytes live for the process (kept in the harness).
                        let s = unsafe {
                            lake_register_host_memory(pool, memory.as_mut_ptr(), block_bytes, blocks, &mut id)
                        };
                        if no_panic(s, "lake_register_host_memory") == LakeStatus::LakeOk {
                            self.memory.push((id, blocks));
                        }
                        // Kept either way: a failed call may have looked at it.
                        REGISTERED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(memory);
                    }
                }
                7 | 8 | 12 => {
                    // A memory id the harness registered, or any.
                    let pick = byte(&mut input);
                    let memory_id = self.memory.get(usize::from(pick) % 9).map_or(u32::from(pick), |m| m.0);
                    let indices: Vec<u32> = (0..count).map(|_| word(&mut input) % 80).collect();
                    let priority = u32::from(byte(&mut input) % 7);
                    let mut request = 0u64;
                    let s = if op == 12 {
                        // SAFETY: as lake_submit_save; stream 0 (the legacy
                        // default), which host memory does not use.
                        unsafe {
                            lake_submit_save_on_stream(
                                pool,
                                memory_id,
                                core::ptr::null(),
                                keys.as_ptr(),
                                indices.as_ptr(),
                                count,
                                priority,
                                0,
                                &mut request,
                            )
                        }
                    } else if op == 7 {
                        // SAFETY: `count` keys and block indices, a live out;
                        // the memory registered lives for the process.
                        unsafe {
                            lake_submit_save(
                                pool,
                                memory_id,
                                core::ptr::null(),
                                keys.as_ptr(),
                                indices.as_ptr(),
                                count,
                                priority,
                                &mut request,
                            )
                        }
                    } else {
                        for location in table.iter_mut().take(count) {
                            location.tier = byte(&mut input) % 4;
                            location.region = u16::from(byte(&mut input));
                            location.slot = word(&mut input);
                            location.generation = word(&mut input);
                        }
                        // SAFETY: `count` keys, locations and block indices,
                        // a live out; the memory lives for the process.
                        unsafe {
                            lake_submit_load(
                                pool,
                                memory_id,
                                keys.as_ptr(),
                                table.as_ptr(),
                                indices.as_ptr(),
                                count,
                                priority,
                                &mut request,
                            )
                        }
                    };
                    if no_panic(s, "lake_submit_save/load") == LakeStatus::LakeOk {
                        self.requests.push(request);
                    }
                }
                10 => {
                    // A push to an address of a few (bounded peers: each
                    // keeps its connections), good, refused or malformed.
                    const ADDRESSES: [&core::ffi::CStr; 6] = [
                        c"127.0.0.1:9",
                        c"",
                        c"not an address",
                        c"10.255.255.1>127.0.0.1:9",
                        c"127.0.0.1:9,127.0.0.1:10",
                        c"127.0.0.1:99999",
                    ];
                    let address = ADDRESSES[usize::from(byte(&mut input)) % ADDRESSES.len()];
                    for location in table.iter_mut().take(count) {
                        location.tier = byte(&mut input) % 4;
                        location.region = u16::from(byte(&mut input));
                        location.slot = word(&mut input);
                        location.generation = word(&mut input);
                    }
                    let (region, epoch) = (u16::from(byte(&mut input)), u64::from(word(&mut input)));
                    let priority = u32::from(byte(&mut input) % 7);
                    let mut request = 0u64;
                    // SAFETY: a C string, `count` keys and locations, a live out.
                    let s = unsafe {
                        lake_push(
                            pool,
                            address.as_ptr(),
                            keys.as_ptr(),
                            table.as_ptr(),
                            count,
                            region,
                            epoch,
                            priority,
                            &mut request,
                        )
                    };
                    if no_panic(s, "lake_push") == LakeStatus::LakeOk {
                        self.requests.push(request);
                    }
                    let empty = crate::pool::LakeRailStat {
                        peer: 0,
                        rail: 0,
                        up: 0,
                        reserved: 0,
                        bytes: 0,
                        breaks: 0,
                        address: [0; 64],
                    };
                    let mut rails = vec![empty; capacity % 9];
                    let mut written = usize::MAX;
                    // SAFETY: `rails.len()` writable entries, a live out.
                    let s = unsafe { lake_push_rails(pool, rails.as_mut_ptr(), rails.len(), &mut written) };
                    no_panic(s, "lake_push_rails");
                }
                11 => {
                    // Any request id and layer, on the legacy default stream.
                    let id = self.requests.last().copied().unwrap_or(0) ^ u64::from(byte(&mut input) & 1);
                    // SAFETY: a pool handle; stream 0.
                    no_panic(unsafe { lake_wait_layer(pool, id, word(&mut input), 0) }, "lake_wait_layer");
                }
                13 => {
                    // KV memory: the pool's layout or any; pieces laid out
                    // right over memory the harness keeps (then loads and
                    // saves scatter and gather through them), or none, or
                    // too few; any sizes, counts and memory kinds (a GPU one
                    // over device memory where a GPU is, failing cleanly
                    // where there is none).
                    let mut layout: LakeLayoutOptions = take(&mut input);
                    let flags = byte(&mut input);
                    if flags & 1 == 1 {
                        layout.struct_size = size_of::<LakeLayoutOptions>();
                    }
                    if flags & 2 == 2 {
                        layout = harness_layout();
                    }
                    let block_count = if flags & 4 == 4 { u32::from(byte(&mut input) % 64) } else { word(&mut input) };
                    let with_pieces =
                        flags & 8 == 8 && block_count <= 64 && self.memory.len() < HARNESS_REGISTRATIONS_MAX;
                    let block_bytes = HARNESS_PIECE_BYTES * HARNESS_PIECES;
                    let memory_kind = u32::from(byte(&mut input) % 3);
                    let bytes = if with_pieces { block_bytes * block_count.max(1) as usize } else { 0 };
                    let mut memory = vec![0u8; bytes];
                    // GPU memory is laid over device memory where a GPU is
                    // (host memory passed as device memory would break the
                    // C contract, not Lake); elsewhere over host memory,
                    // and the registration fails cleanly (no GPU).
                    let base = match device_memory(if memory_kind == 1 { bytes } else { 0 }) {
                        Some(device) => device,
                        None => memory.as_mut_ptr() as usize,
                    };
                    // Block b's piece p at (b × pieces + p) × piece bytes;
                    // tokens of 2 heads of 128 bytes.
                    let pieces: Vec<crate::pool::LakeKvPiece> = (0..HARNESS_PIECES)
                        .map(|p| crate::pool::LakeKvPiece {
                            address: base + p * HARNESS_PIECE_BYTES,
                            block_stride: i64::try_from(block_bytes).unwrap_or(0),
                            token_stride: 256,
                            head_stride: 128,
                        })
                        .collect();
                    let piece_count = if with_pieces { HARNESS_PIECES - usize::from(flags & 16 == 16) } else { 0 };
                    let options = crate::pool::LakeKvMemoryOptions {
                        struct_size: if byte(&mut input) & 1 == 1 {
                            size_of::<crate::pool::LakeKvMemoryOptions>()
                        } else {
                            word(&mut input) as usize
                        },
                        layout: if byte(&mut input) & 1 == 1 { &raw const layout } else { core::ptr::null() },
                        block_count,
                        pieces: if with_pieces { pieces.as_ptr() } else { core::ptr::null() },
                        piece_count,
                        memory_kind,
                        device: u32::from(byte(&mut input) % 2),
                        gpu_path: u32::from(byte(&mut input) % 3),
                        layer_groups: u32::from(byte(&mut input)),
                    };
                    let mut id = u32::MAX;
                    // SAFETY: live options (a live layout or null; pieces
                    // null or `piece_count` of them, each block's bytes in
                    // `memory` or device memory, kept for the process), a
                    // live out.
                    let s = unsafe { lake_register_kv_memory(pool, &options, &mut id) };
                    if no_panic(s, "lake_register_kv_memory") == LakeStatus::LakeOk {
                        assert!(with_pieces && piece_count == HARNESS_PIECES, "registered with {piece_count} pieces");
                        self.memory.push((id, block_count));
                    }
                    REGISTERED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(memory);
                }
                14 => {
                    // A routing question: hits from the mirror, the rest any values.
                    use crate::route::{
                        LAKE_COST_MEASURED, LakeNodeHits, LakeNodeLoad, LakeRouteMove, LakeRoutePlan, LakeRouteRequest,
                        lake_route,
                    };
                    let cost = |input: &mut &[u8]| match byte(input) % 4 {
                        0 => LAKE_COST_MEASURED,
                        _ => u64::from(word(input)),
                    };
                    let others: Vec<LakeNodeHits> = (0..byte(&mut input) % 6)
                        .map(|_| LakeNodeHits {
                            node: u32::from(byte(&mut input) % 8),
                            through: [0; 4].map(|_: u32| word(&mut input) % 96),
                            reserved: 0,
                        })
                        .collect();
                    let loads: Vec<LakeNodeLoad> = (0..byte(&mut input) % 7)
                        .map(|_| LakeNodeLoad {
                            node: u32::from(byte(&mut input) % 8),
                            roles: u32::from(byte(&mut input) % 5),
                            queue_ns: u64::from(word(&mut input)),
                            compute_ns_per_block: cost(&mut input),
                            load_ns_per_block: [0; 4].map(|_: u64| cost(&mut input)),
                            cnic_ns_per_block: u64::from(word(&mut input)),
                        })
                        .collect();
                    let avoid: Vec<u32> = (0..byte(&mut input) % 4).map(|_| u32::from(byte(&mut input) % 8)).collect();
                    let request = LakeRouteRequest {
                        struct_size: if byte(&mut input) & 1 == 1 {
                            size_of::<LakeRouteRequest>()
                        } else {
                            word(&mut input) as usize
                        },
                        keys: keys.as_ptr(),
                        count,
                        local_node: u32::from(byte(&mut input) % 8),
                        local_l0_blocks: word(&mut input) % 64,
                        l3_blocks: word(&mut input) % 64,
                        policy: u32::from(byte(&mut input) % 4),
                        others: others.as_ptr(),
                        others_count: others.len(),
                        loads: loads.as_ptr(),
                        loads_count: loads.len(),
                        avoid: avoid.as_ptr(),
                        avoid_count: avoid.len(),
                        pull_ns_per_block: cost(&mut input),
                    };
                    let mut moves = vec![LakeRouteMove::default(); capacity % 9];
                    let mut plan = LakeRoutePlan { mode: u32::MAX, ..LakeRoutePlan::default() };
                    // SAFETY: a live request whose arrays hold their counts,
                    // a live plan, `moves.len()` writable moves.
                    let s = unsafe { lake_route(pool, &request, &mut plan, moves.as_mut_ptr(), moves.len()) };
                    if no_panic(s, "lake_route") == LakeStatus::LakeOk {
                        let blocks = u32::try_from(count).unwrap_or(u32::MAX);
                        assert!(plan.mode <= 2, "{plan:?}");
                        assert_eq!(plan.hit_blocks + plan.recomputed_blocks, blocks, "{plan:?}");
                        for node in [plan.prefill_node, plan.decode_node] {
                            assert!(loads.iter().any(|l| l.node == node), "{plan:?} runs on a node not offered");
                            assert!(!avoid.contains(&node), "{plan:?} runs on an avoided node");
                        }
                    }
                    // SAFETY: a null request is refused by name.
                    let s = unsafe { lake_route(pool, core::ptr::null(), &mut plan, core::ptr::null_mut(), 0) };
                    assert_eq!(s, LakeStatus::LakeNullArgument, "lake_route(null request)");
                }
                _ => {
                    // The bookkeeping calls, with any request id.
                    let id = self.requests.last().copied().unwrap_or(0) ^ u64::from(byte(&mut input) & 1);
                    // SAFETY: a pool handle.
                    no_panic(unsafe { lake_cancel(pool, id) }, "lake_cancel");
                    let mut out =
                        vec![LakeCompletion { request_id: 0, index: 0, status: LakeStatus::LakeOk }; capacity];
                    let mut written = usize::MAX;
                    // SAFETY: `capacity` writable completions, a live out.
                    let s = unsafe { lake_poll(pool, out.as_mut_ptr(), capacity, &mut written) };
                    if no_panic(s, "lake_poll") == LakeStatus::LakeOk {
                        assert!(written <= capacity, "{written} completions into {capacity}");
                    }
                    let mut stats = LakeStats { struct_size: size_of::<LakeStats>(), ..LakeStats::default() };
                    if byte(&mut input) & 1 == 1 {
                        stats.struct_size = word(&mut input) as usize;
                    }
                    // SAFETY: a live LakeStats (its size field the input's).
                    no_panic(unsafe { lake_stats(pool, &mut stats) }, "lake_stats");
                    let (mut region, mut epoch) = (0u16, 0u64);
                    // SAFETY: live outs.
                    no_panic(unsafe { lake_slot_space(pool, &mut region, &mut epoch) }, "lake_slot_space");
                    // SAFETY: a pool handle.
                    no_panic(unsafe { lake_alive(pool) }, "lake_alive");
                    let mut costs = vec![0u64; capacity % 7];
                    // SAFETY: `costs.len()` writable entries.
                    let s = unsafe { crate::pool::lake_load_costs(pool, costs.as_mut_ptr(), costs.len()) };
                    no_panic(s, "lake_load_costs");
                    // Any counts, zero ones included.
                    let (blocks, elapsed) = (u64::from(word(&mut input) % 4096), u64::from(word(&mut input)));
                    // SAFETY: a pool handle.
                    no_panic(unsafe { crate::pool::lake_report_prefill(pool, blocks, elapsed) }, "lake_report_prefill");
                    let mut compute = 0u64;
                    // SAFETY: a live out.
                    let s = unsafe { crate::pool::lake_compute_cost(pool, &mut compute) };
                    no_panic(s, "lake_compute_cost");
                    // SAFETY: a null out is refused by name.
                    let s = unsafe { crate::pool::lake_compute_cost(pool, core::ptr::null_mut()) };
                    assert_eq!(s, LakeStatus::LakeNullArgument, "lake_compute_cost(null)");
                }
            }
        }
    }
}

impl Drop for PoolHarness {
    fn drop(&mut self) {
        // SAFETY: from lake_attach and lake_namespace_new, released once.
        unsafe {
            crate::pool::lake_detach(self.pool);
        }
        // SAFETY: as above.
        unsafe { lake_namespace_free(self.namespace) };
    }
}
