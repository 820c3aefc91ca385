//! Lookups in the mirror: the longest cached prefix and its block table,
//! with a recurrent-state checkpoint, across a tensor-parallel group's
//! shards; and lookups that pin their L1 hits, with the loads from them.

use super::*;
use lake_dp::mirror::view::{PullWait, ViewOpener, Where, lookup as cluster_lookup};

/// L1 blocks pinned by a lookup (see [`lake_lookup_pinned`]): they stay
/// in L1, unchanged, until released, whatever eviction decides meanwhile.
pub struct LakePins {
    pub(super) array: Arc<Mutex<PinArray>>,
    /// By block-table index: the pin of an L1 hit, or none.
    pub(super) pins: Vec<Option<Pin>>,
    pub(super) keys: Vec<BlockKey>,
}

impl core::fmt::Debug for LakePins {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("LakePins").field("blocks", &self.pins.len()).finish_non_exhaustive()
    }
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

pub(super) fn entry_of(location: &LakeLocation) -> Option<MirrorEntry> {
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

/// The longest prefix of `keys` (`count`) held anywhere in the pool: its
/// length to `hits`, where each of its blocks is to `out` (room for
/// `capacity`). This node's blocks come first from its mirror (`local` 1,
/// with the block-table entry `lake_lookup` gives); a block this node
/// lacks comes from the cluster view of the other nodes' blocks (`local`
/// 0: which node, and its fastest tier there). A pool that keeps no
/// cluster view (one not reporting to a summary, or one with tenant
/// partitions) answers with this node's blocks only, as `lake_lookup`.
/// Shared memory only; the run of this node's blocks is reported as
/// `lake_lookup`'s hits are. `LAKE_BUFFER_TOO_SMALL` when the hit needs
/// more room. Thread-safe.
///
/// # Safety
///
/// `keys` points at `count` keys; `out` at `capacity` writable entries;
/// `hits` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_lookup_cluster(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    out: *mut LakeBlockWhere,
    capacity: usize,
    hits: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if hits.is_null() || (keys.is_null() && count > 0) || (out.is_null() && capacity > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_lookup_cluster: a required pointer is null"));
            }
            let keys = read_keys(pool, keys, count);
            let found = cluster_places(pool, &keys);
            let here = pool.mirror.header().node;
            for (i, place) in found.iter().take(capacity).enumerate() {
                let entry = match place {
                    Where::Local(entry) => LakeBlockWhere {
                        node: here,
                        tier: entry.tier as u8,
                        local: 1,
                        reserved: 0,
                        location: location_of(entry),
                    },
                    Where::Remote(holder) => {
                        LakeBlockWhere { node: holder.node.0, tier: holder.tier as u8, ..LakeBlockWhere::default() }
                    }
                };
                // SAFETY: i < capacity; writable (contract).
                unsafe { out.wrapping_add(i).write(entry) };
            }
            let local = found.iter().take_while(|w| matches!(w, Where::Local(_))).count();
            // SAFETY: writable (contract).
            unsafe { hits.write(found.len()) };
            if let Some(jobs) = &pool.jobs {
                let _ = jobs.push(false, Job::Accessed { keys, hits: local });
            }
            if found.len() > capacity {
                let need = found.len();
                return Err(fail(
                    LakeStatus::LakeBufferTooSmall,
                    format!("lake_lookup_cluster: {need} entries need room"),
                ));
            }
            Ok(())
        })())
    })
}

/// Where each block of the longest prefix of `keys` held anywhere is: this
/// pool's mirror, then its cluster view (opened when first asked for).
fn cluster_places(pool: &LakePool, keys: &[BlockKey]) -> Vec<Where> {
    let mut found = Vec::with_capacity(keys.len());
    let mut cluster = pool.cluster.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let view = cluster.as_mut().and_then(ViewOpener::reader);
    cluster_lookup(&pool.mirror, view, keys, &mut found);
    found
}

/// The hit view of `keys` this pool reads: every node's leading runs, from
/// its mirror and its cluster view (none: this node's alone), the nodes of
/// `down` left out ([`lake_dp::route::hits::hit_view`]).
pub(crate) fn cluster_hit_view(
    pool: &LakePool,
    keys: &[BlockKey],
    down: &[lake_dp::NodeId],
) -> lake_dp::route::HitView {
    let mut cluster = pool.cluster.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let view = cluster.as_mut().and_then(ViewOpener::reader);
    lake_dp::route::hits::hit_view(&pool.mirror, view, keys, down)
}

/// Makes as much of `keys` (`count`) this node's as the pool can within
/// `timeout_ms`: of its longest prefix held anywhere
/// (`lake_lookup_cluster`), the blocks only other nodes hold are asked
/// for — the summary's leader has each holder copy its block over the
/// storage network into this node's L1, or, a block held only in L3, this
/// node reads it from the object store the nodes share; it lands checked
/// — and the
/// call waits until that prefix is in this node's mirror or the time is
/// up. While it waits the view is read again: a block of this node's that
/// went meanwhile (moved to another reader), or one whose holder changed,
/// is asked for where it is now, and a block seen nowhere for a while
/// (gone from the pool, not moving) ends the wait before it
/// (`lake_dp::mirror::view::PullWait`). This node's hit then goes to `hits`: look it up and load it as
/// `lake_lookup`'s. A block that left its holder before it was copied
/// never lands; the hit ends before it and the engine computes the rest.
/// A pool keeping no cluster view, or whose control plane takes no pulls,
/// answers at once with its own hit. Blocks the calling thread; the
/// pulls go through the agent's thread. Thread-safe.
///
/// # Safety
///
/// `keys` points at `count` keys; `hits` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_pull(
    pool: *const LakePool,
    keys: *const LakeBlockKey,
    count: usize,
    timeout_ms: u32,
    hits: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if hits.is_null() || (keys.is_null() && count > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_pull: a required pointer is null"));
            }
            let keys = read_keys(pool, keys, count);
            let mut wait = PullWait::new(&keys, Duration::from_millis(u64::from(timeout_ms)));
            let (mut places, mut table) = (Vec::new(), Vec::with_capacity(keys.len()));
            let hit = loop {
                let writes = pool.mirror.writes();
                let lookup = |keys: &[BlockKey], out: &mut Vec<Where>| {
                    *out = cluster_places(pool, keys);
                    out.len()
                };
                let pulls = wait.look(&keys, lookup, &mut places);
                if !pulls.is_empty() && pool.has_control_plane {
                    let asked = pool
                        .jobs
                        .as_ref()
                        .is_some_and(|jobs| jobs.push(true, Job::Pull { pulls: pulls.clone() }).is_ok());
                    if asked {
                        wait.asked(&pulls);
                    }
                }
                let hit = pool.mirror.lookup(&keys[..wait.found()], &mut table);
                wait.saw(&keys, hit);
                if wait.over(hit) {
                    break hit;
                }
                wait.sleep(&pool.mirror, writes);
            };
            if let Some(per_block) = wait.per_block() {
                // The closure always answers Some: the update cannot fail.
                let _ = pool.pull_ns_per_block.fetch_update(Ordering::AcqRel, Ordering::Acquire, |average| {
                    Some(lake_agent::fold_load_cost(average, per_block))
                });
            }
            // SAFETY: writable (contract).
            unsafe { hits.write(hit) };
            Ok(())
        })())
    })
}

/// What a block pulled into this node has cost, as this pool measured its
/// pulls (`lake_pull`: from the ask to the last block landing, over the
/// blocks that landed; ns, a moving average; 0 none measured yet), into
/// `*out` — the cost `lake_route` weighs pulls into this node at where
/// its request's `pull_ns_per_block` is `LAKE_COST_MEASURED`. An engine
/// may pull only where it is below what computing a block costs it.
/// Thread-safe.
///
/// # Safety
///
/// `pool` from `lake_attach`; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_pull_cost(pool: *const LakePool, out: *mut u64) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if out.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_pull_cost: out is null"));
            }
            // SAFETY: writable (contract), checked non-null.
            unsafe { out.write(pool.pull_ns_per_block.load(Ordering::Acquire)) };
            Ok(())
        })())
    })
}
