//! Requests: leases, residency reports, loads, saves, pushes, cancel and
//! the completions they end in.

use super::*;

/// A lease on lower-tier replicas (see [`lake_lease`]).
pub struct LakeLease {
    pub(super) id: u64,
    pub(super) queues: Option<Queues>,
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

pub(super) fn submit(pool: &LakePool, urgent: bool, job: Job) -> Result<(), LakeStatus> {
    let jobs = pool.jobs.as_ref().ok_or_else(|| fail(LakeStatus::LakeNotAttached, "detached"))?;
    match jobs.push(urgent, job) {
        Ok(()) => Ok(()),
        Err(TrySendError::Full(_)) => Err(fail(LakeStatus::LakeBusy, "the agent's queue is full: poll, then retry")),
        Err(TrySendError::Disconnected(_)) => Err(fail(LakeStatus::LakeNotAttached, "the agent's thread stopped")),
    }
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
pub(super) fn urgent(priority: Priority) -> bool {
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
