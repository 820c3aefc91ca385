//! Execution-mode routing through the C ABI: an external router (a
//! gateway beside the engines) asks `lake_dp::route` where a request runs,
//! with this node's hits read from the shared-memory mirror — no round
//! trip to any process — and the other nodes' hits and every node's load
//! as it knows them.

use std::sync::atomic::Ordering;

use lake_dp::route::{HitView, LoadView, Mode, Network, NodeHits, NodeLoad, Policy, Request, route};
use lake_dp::{NodeId, Tier};

use crate::pool::{LakeBlockKey, LakePool, pool_ref, read_keys, status_of};
use crate::status::{LakeStatus, fail, guard};

/// [`LakeNodeLoad::roles`]: the node runs prefill work.
pub const LAKE_ROLE_PREFILL: u32 = 1;
/// [`LakeNodeLoad::roles`]: the node runs decode work.
pub const LAKE_ROLE_DECODE: u32 = 2;

/// One node as the router sees it (`lake_dp::route::NodeLoad`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeNodeLoad {
    /// The node.
    pub node: u32,
    /// `LAKE_ROLE_PREFILL | LAKE_ROLE_DECODE`, either or both.
    pub roles: u32,
    /// Time before a new request's prefill would start there (ns).
    pub queue_ns: u64,
    /// Recomputing one block there (ns); for this node,
    /// [`LAKE_COST_MEASURED`] takes what its engine reported of its
    /// prefills (`lake_report_prefill`; not reported yet: dearer than any
    /// load, so a measured hit is loaded).
    pub compute_ns_per_block: u64,
    /// Moving one block into its HBM from L0 (0), L1, L2, L3 (ns); for
    /// this node, [`LAKE_COST_MEASURED`] in a tier takes what this pool's
    /// agent measured on its own loads (`lake_load_costs`; not measured
    /// yet: the block is not loaded from that tier, it is recomputed).
    pub load_ns_per_block: [u64; 4],
    /// Moving one block over the compute network to or from it (ns).
    pub cnic_ns_per_block: u64,
}

/// A [`LakeNodeLoad::load_ns_per_block`] entry of this node: the cost this
/// pool's agent measured (live), not one the caller gives.
pub const LAKE_COST_MEASURED: u64 = u64::MAX;

/// This node's compute cost while its engine has reported no prefill: a
/// second a block, dearer than any load (a measured hit is loaded), yet
/// far enough below `u64::MAX` that the router's sums do not saturate.
const UNMEASURED_COMPUTE_NS: u64 = 1_000_000_000;

/// What another node holds of the request's prefix: blocks available at
/// L0, L0–L1, L0–L2, L0–L3 (never decreasing).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeNodeHits {
    /// The node.
    pub node: u32,
    /// Prefix blocks through each tier.
    pub through: [u32; 4],
    /// Zero.
    pub reserved: u32,
}

/// A routing question (`lake_route`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeRouteRequest {
    /// `sizeof(LakeRouteRequest)`.
    pub struct_size: usize,
    /// The prompt's block keys (`count`), in order.
    pub keys: *const LakeBlockKey,
    /// Blocks of the prompt.
    pub count: usize,
    /// This node's id (its hits come from its mirror).
    pub local_node: u32,
    /// Prefix blocks an engine of this node holds in its HBM (the mirror
    /// does not carry L0; the engine knows).
    pub local_l0_blocks: u32,
    /// Prefix blocks in the object store.
    pub l3_blocks: u32,
    /// 0: whatever is fastest; 1: PD only; 2: colocated only.
    pub policy: u32,
    /// Other nodes' hits (`others_count`), as the caller knows them. None
    /// (0): as this pool's cluster view has them, where it keeps one — the
    /// view names nodes by the pool's ids, which `local_node` and `loads`
    /// then use too.
    pub others: *const LakeNodeHits,
    /// See `others`.
    pub others_count: usize,
    /// Every node that may run work (`loads_count`), this one included.
    pub loads: *const LakeNodeLoad,
    /// See `loads`.
    pub loads_count: usize,
    /// Nodes a failed execution ran on (`avoid_count`): routed around.
    pub avoid: *const u32,
    /// See `avoid`.
    pub avoid_count: usize,
    /// Pulling one block only other nodes hold into the node that
    /// computes the prompt, over the storage network (ns): the runs of
    /// such blocks in this pool's cluster view (`others` none) are weighed
    /// at it, and pulled only where that beats computing them. 0: none
    /// is pulled. [`LAKE_COST_MEASURED`]: into this node, what this pool
    /// measured on its own pulls (`lake_pull_cost`; none measured yet:
    /// none is pulled); into another node, none. A request whose
    /// `struct_size` ends before this field: 0.
    pub pull_ns_per_block: u64,
}

/// The size of a [`LakeRouteRequest`] built before
/// [`LakeRouteRequest::pull_ns_per_block`]: still taken, as pulling none.
const ROUTE_REQUEST_BEFORE_PULLS: usize = core::mem::offset_of!(LakeRouteRequest, pull_ns_per_block);

/// [`LakeRoutePlan::mode`].
pub const LAKE_MODE_COLOCATED: u32 = 0;
/// See [`LAKE_MODE_COLOCATED`].
pub const LAKE_MODE_PD: u32 = 1;
/// See [`LAKE_MODE_COLOCATED`].
pub const LAKE_MODE_DDIRECT: u32 = 2;

/// The plan (`lake_dp::route::Plan`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeRoutePlan {
    /// `LAKE_MODE_*`.
    pub mode: u32,
    /// Where the prompt is computed.
    pub prefill_node: u32,
    /// Where tokens are generated (the prefill node but for PD).
    pub decode_node: u32,
    /// Prefix blocks loaded or already in HBM.
    pub hit_blocks: u32,
    /// Blocks recomputed.
    pub recomputed_blocks: u32,
    /// Moves in the plan (those past the caller's capacity are not
    /// written).
    pub moves: u32,
    /// The modelled time to first token (ns).
    pub ttft_ns: u64,
}

/// [`LakeRouteMove::network`]: a node's own tiers into its HBM.
pub const LAKE_NETWORK_LOCAL: u32 = 0;
/// See [`LAKE_NETWORK_LOCAL`]: the storage network.
pub const LAKE_NETWORK_STORAGE: u32 = 1;
/// See [`LAKE_NETWORK_LOCAL`]: the compute network.
pub const LAKE_NETWORK_COMPUTE: u32 = 2;

/// Blocks `first..last` moving from (`from_node`, `from_tier`) into
/// `to_node`'s HBM over `network`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LakeRouteMove {
    /// First block.
    pub first: u32,
    /// One past the last.
    pub last: u32,
    /// Where they are.
    pub from_node: u32,
    /// Their tier there (0 L0 … 3 L3).
    pub from_tier: u32,
    /// Where they go.
    pub to_node: u32,
    /// `LAKE_NETWORK_*`.
    pub network: u32,
}

/// Slice of `n` entries at `p` (empty for 0), or the named error.
///
/// # Safety
///
/// `p` points at `n` entries when `n > 0`.
unsafe fn entries<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], LakeStatus> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(fail(LakeStatus::LakeNullArgument, format!("lake_route: {what} is null")));
    }
    if n > 1 << 20 {
        return Err(fail(LakeStatus::LakeInvalidArgument, format!("lake_route: {n} {what}")));
    }
    // SAFETY: `n` entries (contract), non-null.
    Ok(unsafe { core::slice::from_raw_parts(p, n) })
}

/// Where `request` should run: this node's hits read from its mirror
/// (the longest prefix in L1, then in L1 or L2), other nodes' as given or,
/// none given, as the pool's cluster view has them, the rest as given; the
/// plan into `plan`, its moves into `moves` (room for `moves_capacity`;
/// `plan->moves` says how many there are). `LAKE_UNAVAILABLE` when no node
/// may run it (every one avoided, or none with the roles a mode needs).
/// Reads shared memory only; thread-safe.
///
/// # Safety
///
/// `request` points at a `LakeRouteRequest` whose arrays hold their
/// counts; `plan` writable; `moves` at `moves_capacity` writable entries
/// (or null with 0).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_route(
    pool: *const LakePool,
    request: *const LakeRouteRequest,
    plan: *mut LakeRoutePlan,
    moves: *mut LakeRouteMove,
    moves_capacity: usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if request.is_null() || plan.is_null() || (moves.is_null() && moves_capacity > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_route: a required pointer is null"));
            }
            // SAFETY: non-null; the caller's struct (contract), read only
            // as far as its stated size says it goes.
            let size = unsafe { (*request).struct_size };
            if size != size_of::<LakeRouteRequest>() && size != ROUTE_REQUEST_BEFORE_PULLS {
                return Err(fail(LakeStatus::LakeInvalidArgument, format!("lake_route: struct_size {size}")));
            }
            let mut whole = core::mem::MaybeUninit::<LakeRouteRequest>::zeroed();
            // SAFETY: the caller's struct is `size` bytes (contract), at
            // most this one's; the fields it ends before stay zero.
            unsafe { core::ptr::copy_nonoverlapping(request.cast::<u8>(), whole.as_mut_ptr().cast::<u8>(), size) };
            // SAFETY: every field is an integer or a pointer, for which
            // zero is a value: initialised whole.
            let r = unsafe { whole.assume_init() };
            let policy = match r.policy {
                0 => Policy::Any,
                1 => Policy::AlwaysPd,
                2 => Policy::AlwaysColocated,
                other => return Err(fail(LakeStatus::LakeInvalidArgument, format!("lake_route: policy {other}"))),
            };
            if r.keys.is_null() && r.count > 0 {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_route: keys is null"));
            }
            let blocks = u32::try_from(r.count)
                .map_err(|_| fail(LakeStatus::LakeInvalidArgument, "lake_route: too many blocks"))?;
            // SAFETY: the request's arrays hold their counts (contract).
            let others = unsafe { entries(r.others, r.others_count, "others") }?;
            // SAFETY: as above.
            let loads = unsafe { entries(r.loads, r.loads_count, "loads") }?;
            // SAFETY: as above.
            let avoid = unsafe { entries(r.avoid, r.avoid_count, "avoid") }?;
            for load in loads {
                if load.roles & !(LAKE_ROLE_PREFILL | LAKE_ROLE_DECODE) != 0 {
                    return Err(fail(LakeStatus::LakeInvalidArgument, format!("lake_route: roles {}", load.roles)));
                }
            }
            // This node's hits from its mirror: the leading run in L1,
            // then in L1 or L2.
            let keys = read_keys(pool, r.keys, r.count);
            let mut table = Vec::with_capacity(keys.len());
            let found = pool.mirror.lookup(&keys, &mut table);
            let in_l1 = table[..found].iter().take_while(|e| e.tier == Tier::L1Dram).count();
            let (l1, l2) = (u32::try_from(in_l1).unwrap_or(0), u32::try_from(found).unwrap_or(0));
            let l0 = r.local_l0_blocks.min(blocks);
            let mut view =
                HitView { nodes: Vec::with_capacity(others.len() + 1), l3_through: r.l3_blocks, pool: Vec::new() };
            view.nodes.push(NodeHits { node: NodeId(r.local_node), through: [l0, l1.max(l0), l2.max(l1).max(l0), 0] });
            view.nodes.extend(others.iter().map(|h| NodeHits { node: NodeId(h.node), through: h.through }));
            // None given: the other nodes' hits, and the runs of blocks
            // only other nodes hold, as this pool's cluster view has them
            // (none without a view), the avoided left out.
            if others.is_empty() {
                let down: Vec<NodeId> = avoid.iter().map(|&n| NodeId(n)).collect();
                let seen = crate::pool::cluster_hit_view(pool, &keys, &down);
                let here = [NodeId(pool.mirror.header().node), NodeId(r.local_node)];
                view.nodes.extend(seen.nodes.into_iter().filter(|n| !here.contains(&n.node)));
                view.pool = seen.pool;
            }
            // Measured costs are this node's alone.
            for load in loads {
                let asks = load.compute_ns_per_block == LAKE_COST_MEASURED
                    || load.load_ns_per_block.contains(&LAKE_COST_MEASURED);
                if asks && load.node != r.local_node {
                    return Err(fail(
                        LakeStatus::LakeInvalidArgument,
                        format!("lake_route: node {}'s costs: LAKE_COST_MEASURED is this node's alone", load.node),
                    ));
                }
            }
            // This node's compute asked to be measured: what its engine
            // reported; not yet, dearer than any load.
            let compute = |l: &LakeNodeLoad| match l.compute_ns_per_block {
                LAKE_COST_MEASURED => match pool.compute_ns_per_block.load(Ordering::Acquire) {
                    0 => UNMEASURED_COMPUTE_NS,
                    measured => measured,
                },
                given => given,
            };
            // This node's tiers asked to be measured: what the agent saw.
            let measured = crate::pool::measured_load_costs(pool)?;
            let live = |l: &LakeNodeLoad| {
                let mut costs = l.load_ns_per_block;
                if l.node == r.local_node {
                    for (cost, seen) in costs.iter_mut().zip(measured) {
                        if *cost == LAKE_COST_MEASURED {
                            // Not measured yet: as dear as recomputing it.
                            *cost = if seen == 0 { compute(l) } else { seen };
                        }
                    }
                }
                costs
            };
            // Pulls into a node as the request prices them (`u64::MAX`:
            // none).
            let pull = |l: &LakeNodeLoad| match r.pull_ns_per_block {
                0 => u64::MAX,
                LAKE_COST_MEASURED if l.node != r.local_node => u64::MAX,
                LAKE_COST_MEASURED => match pool.pull_ns_per_block.load(Ordering::Acquire) {
                    0 => u64::MAX,
                    measured => measured,
                },
                given => given,
            };
            let load_view = LoadView {
                nodes: loads
                    .iter()
                    .map(|l| NodeLoad {
                        node: NodeId(l.node),
                        prefill: l.roles & LAKE_ROLE_PREFILL != 0,
                        decode: l.roles & LAKE_ROLE_DECODE != 0,
                        queue_ns: l.queue_ns,
                        compute_ns_per_block: compute(l),
                        load_ns_per_block: live(l),
                        cnic_ns_per_block: l.cnic_ns_per_block,
                        pull_ns_per_block: pull(l),
                    })
                    .collect(),
            };
            let ask = Request { blocks, avoid: avoid.iter().map(|&n| NodeId(n)).collect() };
            let chosen = route(&ask, &view, &load_view, policy)
                .map_err(|_| fail(LakeStatus::LakeUnavailable, "lake_route: no node may run the request"))?;
            let (mode, prefill, decode) = match chosen.mode {
                Mode::Colocated { node } => (LAKE_MODE_COLOCATED, node, node),
                Mode::PdDisaggregated { prefill, decode } => (LAKE_MODE_PD, prefill, decode),
                Mode::DDirect { node } => (LAKE_MODE_DDIRECT, node, node),
            };
            let out = LakeRoutePlan {
                mode,
                prefill_node: prefill.0,
                decode_node: decode.0,
                hit_blocks: chosen.hit_blocks,
                recomputed_blocks: chosen.recomputed_blocks,
                moves: u32::try_from(chosen.moves.len()).unwrap_or(u32::MAX),
                ttft_ns: chosen.ttft_ns,
            };
            // SAFETY: writable (contract).
            unsafe { plan.write(out) };
            for (i, m) in chosen.moves.iter().take(moves_capacity).enumerate() {
                let network = match m.network {
                    Network::Local => LAKE_NETWORK_LOCAL,
                    Network::Storage => LAKE_NETWORK_STORAGE,
                    Network::Compute => LAKE_NETWORK_COMPUTE,
                };
                let written = LakeRouteMove {
                    first: m.first,
                    last: m.last,
                    from_node: m.from.0.0,
                    from_tier: m.from.1 as u32,
                    to_node: m.to.0,
                    network,
                };
                // SAFETY: i < moves_capacity writable entries (contract).
                unsafe { moves.wrapping_add(i).write(written) };
            }
            Ok(())
        })())
    })
}
