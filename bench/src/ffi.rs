//! `ffi`: the engine's path through the C ABI against an embedded pool in
//! this process (its `lake-dp` on its own thread, the engine attached over
//! the attach socket like any other process). Lookups from the mirror per
//! block; loads of L1 blocks into engine host memory, against a plain
//! memcpy of the same bytes in the same run; one block's submit-to-complete
//! latency against memcpy + CRC of 64 KiB, and the same block through a
//! pinned lookup and an inline copy.

use std::ffi::CString;
use std::hint::black_box;
use std::time::{Duration, Instant};

use lake::pool::{
    LakeAttachOptions, LakeBlockKey, LakeCompletion, LakeLocation, LakeNamespace, LakeNamespaceOptions, LakePool,
    lake_attach, lake_detach, lake_keychain_extend, lake_keychain_free, lake_keychain_new, lake_load_pinned,
    lake_lookup, lake_lookup_pinned, lake_namespace_free, lake_namespace_new, lake_pins_release, lake_poll,
    lake_register_host_memory, lake_submit_load, lake_submit_save,
};
use lake::status::LakeStatus;
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::runner::pool::CommitCheck;

use crate::report::{Report, median, percentile};

/// The engine path's goals.
const GOAL_RATIO: f64 = 0.9;
const GOAL_SLACK_US: f64 = 1.5;

fn check(status: LakeStatus, what: &str) -> Result<(), String> {
    if status == LakeStatus::LakeOk {
        return Ok(());
    }
    let mut message = [0u8; 256];
    // SAFETY: a writable buffer of its length.
    let len = unsafe { lake::status::lake_last_error(message.as_mut_ptr().cast(), message.len()) };
    let text = String::from_utf8_lossy(&message[..len.min(message.len() - 1)]).into_owned();
    Err(format!("{what}: {status:?}: {text}"))
}

/// Completions polled, counted per request: (seen, ok).
type Tally = std::collections::HashMap<u64, (usize, usize)>;

/// How long [`wait`] yields before it naps, and each nap.
const WAIT_SPIN: Duration = Duration::from_micros(50);
/// See [`WAIT_SPIN`].
const WAIT_NAP: Duration = Duration::from_micros(20);

/// Polls until `count` completions of `request` arrived (keeping counts of
/// other requests' for their own waits); returns how many were ok.
fn wait(
    pool: *const LakePool,
    request: u64,
    count: usize,
    out: &mut [LakeCompletion],
    tally: &mut Tally,
) -> Result<usize, String> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(60);
    loop {
        let (seen, ok) = tally.get(&request).copied().unwrap_or((0, 0));
        if seen >= count {
            tally.remove(&request);
            return Ok(ok);
        }
        let mut n = 0;
        // SAFETY: `out` is writable for its length; pool attached.
        check(unsafe { lake_poll(pool, out.as_mut_ptr(), out.len(), &raw mut n) }, "poll")?;
        for completion in &out[..n] {
            let entry = tally.entry(completion.request_id).or_default();
            entry.0 += 1;
            entry.1 += usize::from(completion.status == LakeStatus::LakeOk);
        }
        if n == 0 {
            if Instant::now() > deadline {
                return Err(format!("request {request}: {seen} of {count} completions in 60 s"));
            }
            // Give the core to the agent and the pool while nothing is
            // back (an engine's waiting thread does not spin them off it):
            // yielded at first, so a one-block request's completion is
            // seen at once; asleep once it has waited longer than one
            // block takes (a batch), or the poll loop takes half of a
            // two-core machine from the agent it waits for.
            if started.elapsed() < WAIT_SPIN {
                std::thread::yield_now();
            } else {
                std::thread::sleep(WAIT_NAP);
            }
        }
    }
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct FfiArgs {
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 65_536)]
    pub(crate) block_bytes: u64,
    /// Blocks.
    #[arg(long, default_value_t = 4096)]
    pub(crate) blocks: u32,
    /// Rounds measured.
    #[arg(long, default_value_t = 5)]
    pub(crate) rounds: usize,
    /// Single-block samples timed.
    #[arg(long, default_value_t = 2000)]
    pub(crate) samples: usize,
    /// Copy lanes of the agent.
    #[arg(long, default_value_t = 0)]
    pub(crate) copy_threads: u32,
    /// How commits are checked: auto, inline, background or trust.
    #[arg(long, default_value = "auto")]
    pub(crate) commit_check: String,
}

pub(crate) fn run(args: &FfiArgs) -> Result<Report, String> {
    let block_bytes: u64 = args.block_bytes;
    let blocks: u32 = args.blocks;
    let rounds: usize = args.rounds;
    let samples: usize = args.samples;
    let copy_threads: u32 = args.copy_threads;
    let commit_check_name: String = args.commit_check.clone();
    let commit_check = match commit_check_name.as_str() {
        "auto" => CommitCheck::Auto,
        "inline" => CommitCheck::Inline,
        "background" => CommitCheck::Background,
        "trust" => CommitCheck::Trust,
        other => return Err(format!("--commit-check is auto, inline, background or trust, not {other}")),
    };
    let block = usize::try_from(block_bytes).map_err(|e| e.to_string())?;
    let count = blocks as usize;

    let dir = std::env::temp_dir().join(format!("lake-bench-ffi-{}", std::process::id()));
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes,
        // Room for every block and the single-block loads, so everything
        // measured is an L1 hit.
        l1_slots: blocks + 1024,
        l2_slots_per_file: 64,
        // Each attach takes two pin arrays, and one per copy lane.
        remote_agents: 2 + copy_threads,
        commit_check,
        ..EmbeddedConfig::new(dir)
    })?;

    // Namespace and keys through the ABI.
    let options = LakeNamespaceOptions {
        struct_size: size_of::<LakeNamespaceOptions>(),
        tenant_key: [9; 32],
        block_tokens: 16,
        model_fingerprint: [4; 32],
        extra_keys_digest: [0; 32],
        key_scheme: 1,
    };
    let mut namespace: *mut LakeNamespace = core::ptr::null_mut();
    // SAFETY: valid options and out-pointer.
    check(unsafe { lake_namespace_new(&raw const options, &raw mut namespace) }, "namespace")?;
    let tokens: Vec<u32> = (0..blocks * 16).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect();
    let mut keys = vec![LakeBlockKey::default(); count];
    let mut chain = core::ptr::null_mut();
    // SAFETY: valid namespace and out-pointer.
    check(unsafe { lake_keychain_new(namespace, &raw mut chain) }, "keychain")?;
    let mut written = 0;
    // SAFETY: token and key buffers of the lengths given.
    let status = unsafe {
        lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), count, &raw mut written)
    };
    check(status, "keys")?;
    // SAFETY: from lake_keychain_new, freed once.
    unsafe { lake_keychain_free(chain) };

    let dp = CString::new(pool.dp_socket.display().to_string()).map_err(|e| e.to_string())?;
    let mirror = CString::new(pool.mirror.display().to_string()).map_err(|e| e.to_string())?;
    let cp = CString::new(pool.cp_socket.display().to_string()).map_err(|e| e.to_string())?;
    let attach = LakeAttachOptions {
        struct_size: size_of::<LakeAttachOptions>(),
        dp_socket: dp.as_ptr(),
        mirror_path: mirror.as_ptr(),
        cp_socket: cp.as_ptr(),
        name: c"lake-bench".as_ptr(),
        namespace,
        layout_fingerprint: 1,
        segment_bytes: (block_bytes / 8).max(4096),
        pin_agent: 0,
        agent_core: 0,
        copy_threads,
        shard_code: 0,
        object_kind: 1,
        block_bytes: 0,
    };
    let mut handle: *mut LakePool = core::ptr::null_mut();
    // SAFETY: valid options (strings live to the end of this function).
    check(unsafe { lake_attach(&raw const attach, &raw mut handle) }, "attach")?;

    // Engine memory: the blocks to save, and as many to load into.
    let mut memory = vec![0u8; 2 * count * block];
    for (i, byte) in memory[..count * block].iter_mut().enumerate() {
        *byte = (i.wrapping_mul(31) >> 3).to_le_bytes()[0];
    }
    let mut memory_id = 0;
    // SAFETY: the memory lives until detach below.
    let status =
        unsafe { lake_register_host_memory(handle, memory.as_mut_ptr(), block, 2 * blocks, &raw mut memory_id) };
    check(status, "register")?;
    let mut completions = vec![LakeCompletion { request_id: 0, index: 0, status: LakeStatus::LakeOk }; 1024];
    let mut tally = Tally::new();
    let saved: Vec<u32> = (0..blocks).collect();
    let save_started = Instant::now();
    for (chunk_keys, chunk_blocks) in keys.chunks(256).zip(saved.chunks(256)) {
        let mut request = 0;
        // SAFETY: arrays of `len` entries; parent null (chained by order
        // within the chunk; chunks after the first are roots: fine here).
        let status = unsafe {
            lake_submit_save(
                handle,
                memory_id,
                core::ptr::null(),
                chunk_keys.as_ptr(),
                chunk_blocks.as_ptr(),
                chunk_keys.len(),
                2,
                &raw mut request,
            )
        };
        check(status, "save")?;
        let ok = wait(handle, request, chunk_keys.len(), &mut completions, &mut tally)?;
        if ok != chunk_keys.len() {
            return Err(format!("only {ok} of {} blocks saved", chunk_keys.len()));
        }
    }
    let save_gbps = (count * block) as f64 / save_started.elapsed().as_secs_f64() / 1e9;
    // What any save must do at least, in the same run: copy the bytes
    // once and CRC them once (one thread, memory to memory).
    let mut copy_crc_gbps = Vec::new();
    {
        let mut scratch = vec![0u8; count * block];
        for _ in 0..rounds.min(3) {
            let started = Instant::now();
            for (to, from) in scratch.chunks_mut(block).zip(memory[..count * block].chunks(block)) {
                to.copy_from_slice(black_box(from));
                black_box(crc32fast::hash(black_box(to)));
            }
            copy_crc_gbps.push((count * block) as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
    }

    // Lookups: all of them published, per block.
    let mut table = vec![LakeLocation::default(); count];
    let mut hits = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // SAFETY: arrays of `count` entries.
        let status = unsafe { lake_lookup(handle, keys.as_ptr(), count, table.as_mut_ptr(), count, &raw mut hits) };
        check(status, "lookup")?;
        // Chunks after the first were saved as roots: the longest prefix
        // stops at 256; look the chunks up one by one below instead.
        if hits >= 256.min(count) {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("only {hits} blocks published"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut lookup_ns = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        for (chunk, out) in keys.chunks(256).zip(table.chunks_mut(256)) {
            let mut found = 0;
            // SAFETY: arrays of the chunk's length.
            let status = unsafe {
                lake_lookup(handle, chunk.as_ptr(), chunk.len(), out.as_mut_ptr(), out.len(), &raw mut found)
            };
            check(status, "lookup")?;
            if found != chunk.len() {
                return Err(format!("lookup found {found} of {}", chunk.len()));
            }
        }
        lookup_ns.push(started.elapsed().as_nanos() as f64 / count as f64);
    }

    // Loads of every block into the other half, against memcpy of the
    // same bytes, interleaved.
    let targets: Vec<u32> = (blocks..2 * blocks).collect();
    let (mut lake_gbps, mut memcpy_gbps, mut arena_gbps) = (Vec::new(), Vec::new(), Vec::new());
    let mut scratch = vec![0u8; count * block];
    // The L1 arena itself, mapped read-only: where Lake's loads read from
    // (shared memory, which this VM reads slower than private memory).
    let arena_file = std::fs::File::open(&pool.arena).map_err(|e| format!("{}: {e}", pool.arena.display()))?;
    // SAFETY: a read-only view of the live arena, only memcpy'd from (the
    // bytes may change under it; the copy's result is thrown away).
    let arena = unsafe { memmap2::Mmap::map(&arena_file) }.map_err(|e| format!("mapping the arena: {e}"))?;
    let arena_span = arena.len().saturating_sub(4096).min(count * block);
    for _ in 0..rounds {
        let started = Instant::now();
        let mut requests = Vec::new();
        for ((k, t), d) in keys.chunks(256).zip(table.chunks(256)).zip(targets.chunks(256)) {
            let mut request = 0;
            // SAFETY: arrays of the chunk's length; memory registered.
            let status = unsafe {
                lake_submit_load(handle, memory_id, k.as_ptr(), t.as_ptr(), d.as_ptr(), k.len(), 0, &raw mut request)
            };
            check(status, "load")?;
            requests.push((request, k.len()));
        }
        for (request, len) in requests {
            let ok = wait(handle, request, len, &mut completions, &mut tally)?;
            if ok != len {
                return Err(format!("only {ok} of {len} blocks loaded"));
            }
        }
        lake_gbps.push((count * block) as f64 / started.elapsed().as_secs_f64() / 1e9);
        let started = Instant::now();
        scratch.copy_from_slice(black_box(&memory[..count * block]));
        black_box(&scratch);
        memcpy_gbps.push((count * block) as f64 / started.elapsed().as_secs_f64() / 1e9);
        let started = Instant::now();
        scratch[..arena_span].copy_from_slice(black_box(&arena[4096..4096 + arena_span]));
        black_box(&scratch);
        arena_gbps.push(arena_span as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    if memory[..count * block] != memory[count * block..] {
        return Err("loaded bytes differ from the saved ones".into());
    }

    // One block, submit to complete, against memcpy + CRC of one block
    // (bytes in cache, as the goal states them; and a memcpy from cold
    // memory, what Lake's read of an L1 slot meets).
    let (mut lake_us, mut memcpy_us, mut crc_us) = (Vec::new(), Vec::new(), Vec::new());
    let mut cold_us = Vec::new();
    let mut arena_cold_us = Vec::new();
    let arena_blocks = arena_span / block;
    let cold_stride = count / 2 + 1;
    let mut one = vec![0u8; block];
    for i in 0..samples {
        let b = i % count;
        let started = Instant::now();
        let mut request = 0;
        // SAFETY: one-entry arrays; memory registered.
        let status = unsafe {
            lake_submit_load(
                handle,
                memory_id,
                &raw const keys[b],
                &raw const table[b],
                &raw const targets[b],
                1,
                0,
                &raw mut request,
            )
        };
        check(status, "load one")?;
        if wait(handle, request, 1, &mut completions, &mut tally)? != 1 {
            return Err("a single-block load failed".into());
        }
        lake_us.push(started.elapsed().as_nanos() as f64 / 1e3);
        let source = &memory[b * block..(b + 1) * block];
        let started = Instant::now();
        one.copy_from_slice(black_box(source));
        black_box(&one);
        memcpy_us.push(started.elapsed().as_nanos() as f64 / 1e3);
        let started = Instant::now();
        black_box(crc32fast::hash(black_box(source)));
        crc_us.push(started.elapsed().as_nanos() as f64 / 1e3);
        // A block far from those just touched: not in cache (the whole
        // engine memory is many times the caches).
        let far = (b + cold_stride) % count;
        let cold = &memory[far * block..(far + 1) * block];
        let started = Instant::now();
        one.copy_from_slice(black_box(cold));
        black_box(&one);
        cold_us.push(started.elapsed().as_nanos() as f64 / 1e3);
        // What a load really moves: a block of the arena, not in cache,
        // into an engine block not in cache either.
        if arena_blocks > 0 {
            let from = 4096 + ((b + cold_stride) % arena_blocks) * block;
            let to = (count + (b + cold_stride / 2) % count) * block;
            let started = Instant::now();
            memory[to..to + block].copy_from_slice(black_box(&arena[from..from + block]));
            black_box(&memory);
            arena_cold_us.push(started.elapsed().as_nanos() as f64 / 1e3);
        }
    }

    // The same block through a pinned lookup and an inline copy (no queue,
    // no agent thread): lookup + pin, check + copy, release.
    let mut pinned_us = Vec::new();
    let mut status = [LakeStatus::LakeOk; 1];
    for i in 0..samples {
        let b = i % count;
        let started = Instant::now();
        let mut pins = core::ptr::null_mut();
        let mut found = 0;
        let mut location = LakeLocation::default();
        // SAFETY: one-key arrays; out-pointers valid.
        let looked = unsafe {
            lake_lookup_pinned(handle, &raw const keys[b], 1, &raw mut location, 1, &raw mut found, &raw mut pins)
        };
        check(looked, "pinned lookup")?;
        // SAFETY: pins from the lookup; one-entry arrays.
        let loaded =
            unsafe { lake_load_pinned(handle, pins, memory_id, &raw const targets[b], 1, status.as_mut_ptr()) };
        // SAFETY: from lake_lookup_pinned, released once.
        unsafe { lake_pins_release(pins) };
        check(loaded, "pinned load")?;
        if found != 1 || status[0] != LakeStatus::LakeOk {
            return Err(format!("a pinned load failed: {found} found, {:?}", status[0]));
        }
        pinned_us.push(started.elapsed().as_nanos() as f64 / 1e3);
    }

    // SAFETY: attached above, detached once; then the namespace.
    unsafe { lake_detach(handle) };
    // SAFETY: from lake_namespace_new, freed once, no pool uses it now.
    unsafe { lake_namespace_free(namespace) };
    drop(arena);
    drop(pool.stop());

    let lake = median(&mut lake_gbps);
    let raw = median(&mut memcpy_gbps);
    let p50 = percentile(&mut lake_us, 500);
    let memcpy_64k = median(&mut memcpy_us);
    let crc_64k = median(&mut crc_us);
    let mut report = Report::new("ffi");
    report.int("block_bytes", block_bytes);
    report.int("blocks", u64::from(blocks));
    report.int("copy_threads", u64::from(copy_threads));
    report.text("commit_check", &commit_check_name);
    report.float("save_gbps", save_gbps);
    let copy_crc = median(&mut copy_crc_gbps);
    report.float("copy_crc_gbps", copy_crc);
    report.float("save_ratio", save_gbps / copy_crc);
    report.float("lookup_ns_per_block", median(&mut lookup_ns));
    report.float("load_gbps", lake);
    report.float("memcpy_gbps", raw);
    report.float("ratio", lake / raw);
    // A load does at least what a save does: one pass that copies the
    // bytes and one that CRCs them.
    report.float("load_ratio_copy_crc", lake / copy_crc);
    report.float("ratio_goal", GOAL_RATIO);
    report.float("submit_to_complete_p50_us", p50);
    report.float("p99_us", percentile(&mut lake_us, 990));
    report.float("pinned_lookup_load_p50_us", percentile(&mut pinned_us, 500));
    report.float("pinned_p99_us", percentile(&mut pinned_us, 990));
    report.float("memcpy_64k_us", memcpy_64k);
    report.float("crc_64k_us", crc_64k);
    let cold = median(&mut cold_us);
    report.float("memcpy_64k_cold_us", cold);
    // One block's overhead over a raw copy of it from memory not in cache.
    report.float("p50_over_cold_us", p50 - cold);
    report.float("pinned_p50_over_cold_us", percentile(&mut pinned_us, 500) - cold);
    // Beside the goal's baselines: the same copies out of the L1 arena's
    // own shared-memory mapping (what Lake reads), for the record.
    let arena_raw = median(&mut arena_gbps);
    report.float("memcpy_arena_gbps", arena_raw);
    report.float("ratio_vs_arena_memcpy", lake / arena_raw);
    report.float("memcpy_64k_arena_cold_us", median(&mut arena_cold_us));
    report.float("p50_goal_us", memcpy_64k + crc_64k + GOAL_SLACK_US);
    Ok(report)
}
