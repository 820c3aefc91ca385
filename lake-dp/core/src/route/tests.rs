use super::*;

const MS: u64 = 1_000_000;

/// A node of both roles: 0.5 ms to compute a block, 0.05 / 0.4 / 3 ms to
/// load one from L1 / L2 / L3, 0.1 ms over the compute network and to pull
/// one from another node.
fn node(id: u32, queue_ms: u64) -> NodeLoad {
    NodeLoad {
        node: NodeId(id),
        prefill: true,
        decode: true,
        queue_ns: queue_ms * MS,
        compute_ns_per_block: MS / 2,
        load_ns_per_block: [0, MS / 20, 2 * MS / 5, 3 * MS],
        cnic_ns_per_block: MS / 10,
        pull_ns_per_block: MS / 10,
    }
}

fn hits(id: u32, through: [u32; 4]) -> NodeHits {
    NodeHits { node: NodeId(id), through }
}

fn request(blocks: u32) -> Request {
    Request { blocks, avoid: Vec::new() }
}

#[test]
fn with_no_hits_the_least_busy_node_computes_everything() {
    let loads = LoadView { nodes: vec![node(1, 30), node(2, 10), node(3, 20)] };
    let plan = route(&request(100), &HitView::default(), &loads, Policy::Any).unwrap();
    assert_eq!(plan.mode, Mode::Colocated { node: NodeId(2) });
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (0, 100));
    assert_eq!(plan.ttft_ns, 10 * MS + 50 * MS);
    assert!(plan.moves.is_empty());
}

#[test]
fn a_prefix_in_an_engines_hbm_starts_the_request_there() {
    // Node 2 is busier but holds 80 of 100 blocks in HBM: 10 + 10 ms
    // against node 1's 0 + 50 ms.
    let loads = LoadView { nodes: vec![node(1, 0), node(2, 10)] };
    let view = HitView { nodes: vec![hits(2, [80, 80, 80, 80])], l3_through: 0, pool: Vec::new() };
    let plan = route(&request(100), &view, &loads, Policy::Any).unwrap();
    assert_eq!(plan.mode, Mode::DDirect { node: NodeId(2) });
    assert_eq!((plan.hit_blocks, plan.ttft_ns), (80, 20 * MS));
    assert_eq!(plan.blocks_moved_between_nodes(), 0);
}

#[test]
fn a_hit_counts_only_where_loading_beats_recomputing() {
    // L1 holds 20, L2 the next 30, L3 everything; on this node L2 loads
    // slower than it computes: the prefix stops after L1, L3 unused.
    let mut slow_disk = node(1, 0);
    slow_disk.load_ns_per_block[2] = MS;
    let view = HitView { nodes: vec![hits(1, [0, 20, 50, 50])], l3_through: 100, pool: Vec::new() };
    let plan = route(&request(100), &view, &LoadView { nodes: vec![slow_disk] }, Policy::Any).unwrap();
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (20, 80));
    assert_eq!(
        plan.moves,
        vec![Move { first: 0, last: 20, from: (NodeId(1), Tier::L1Dram), to: NodeId(1), network: Network::Local }]
    );
    // With a disk that pays, L1 then L2 load and L3 (slower than compute
    // here) still does not.
    let view = HitView { nodes: vec![hits(1, [0, 20, 50, 50])], l3_through: 100, pool: Vec::new() };
    let plan = route(&request(100), &view, &LoadView { nodes: vec![node(1, 0)] }, Policy::Any).unwrap();
    assert_eq!(plan.hit_blocks, 50);
    assert_eq!(plan.moves.len(), 2);
    assert_eq!(plan.ttft_ns, 25 * MS, "50 computed (25 ms) hide 20 × 0.05 + 30 × 0.4 ms of loads");
}

#[test]
fn a_failed_execution_is_routed_around_its_node() {
    let loads = LoadView { nodes: vec![node(1, 0), node(2, 0)] };
    let view =
        HitView { nodes: vec![hits(2, [90, 90, 90, 90]), hits(1, [0, 40, 40, 40])], l3_through: 0, pool: Vec::new() };
    let first = route(&request(100), &view, &loads, Policy::Any).unwrap();
    assert_eq!(first.mode, Mode::DDirect { node: NodeId(2) });
    // Node 2 died mid-request: the same function, node 2 avoided.
    let again = Request { blocks: 100, avoid: vec![NodeId(2)] };
    let second = route(&again, &view, &loads, Policy::Any).unwrap();
    assert_eq!(second.mode, Mode::Colocated { node: NodeId(1) });
    assert_eq!(second.hit_blocks, 40);
    let none = Request { blocks: 100, avoid: vec![NodeId(1), NodeId(2)] };
    assert_eq!(route(&none, &view, &loads, Policy::Any), Err(RouteError::NoNode));
}

#[test]
fn pd_sends_the_whole_prompt_over_the_compute_network() {
    let mut prefill = node(1, 0);
    prefill.decode = false;
    let mut decode = node(2, 0);
    decode.prefill = false;
    let loads = LoadView { nodes: vec![prefill, decode] };
    let view = HitView { nodes: vec![hits(1, [0, 40, 40, 40])], l3_through: 0, pool: Vec::new() };
    let plan = route(&request(100), &view, &loads, Policy::Any).unwrap();
    assert_eq!(plan.mode, Mode::PdDisaggregated { prefill: NodeId(1), decode: NodeId(2) });
    assert_eq!(plan.ttft_ns, 30 * MS + 10 * MS, "60 computed, then 100 blocks at 0.1 ms");
    assert_eq!(plan.blocks_moved_between_nodes(), 100);
    assert_eq!(plan.moves.last().unwrap().network, Network::Compute);
    // Colocated only: no node runs both roles here.
    assert_eq!(route(&request(100), &view, &loads, Policy::AlwaysColocated), Err(RouteError::NoNode));
}

#[test]
fn the_router_picks_pd_when_it_is_faster_and_the_baselines_are_held_to_their_mode() {
    // Node 1 (both roles) is backed up; node 3 only prefills and is idle.
    let mut idle_prefill = node(3, 0);
    idle_prefill.decode = false;
    let loads = LoadView { nodes: vec![node(1, 200), idle_prefill] };
    let plan = route(&request(100), &HitView::default(), &loads, Policy::Any).unwrap();
    assert_eq!(plan.mode, Mode::PdDisaggregated { prefill: NodeId(3), decode: NodeId(1) });
    let colocated = route(&request(100), &HitView::default(), &loads, Policy::AlwaysColocated).unwrap();
    assert_eq!(colocated.mode, Mode::Colocated { node: NodeId(1) });
    // Always PD never colocates, even where that would be faster.
    let both = LoadView { nodes: vec![node(1, 0), node(2, 0)] };
    let pd = route(&request(10), &HitView::default(), &both, Policy::AlwaysPd).unwrap();
    assert!(matches!(pd.mode, Mode::PdDisaggregated { .. }), "{pd:?}");
}

#[test]
fn at_equal_speed_the_prefix_already_in_hbm_wins_over_loading_it() {
    // 80 of 100 blocks: node 1 would load them from L1 (4 ms, hidden under
    // 10 ms of compute), node 2 has them in HBM: the same TTFT, no loads.
    let loads = LoadView { nodes: vec![node(1, 0), node(2, 0)] };
    let view =
        HitView { nodes: vec![hits(1, [0, 80, 80, 80]), hits(2, [80, 80, 80, 80])], l3_through: 0, pool: Vec::new() };
    let plan = route(&request(100), &view, &loads, Policy::Any).unwrap();
    assert_eq!(plan.mode, Mode::DDirect { node: NodeId(2) });
    assert_eq!((plan.ttft_ns, plan.blocks_moved()), (10 * MS, 0));
}

fn run(first: u32, last: u32, id: u32, tier: Tier) -> PoolRun {
    PoolRun { first, last, node: NodeId(id), tier }
}

#[test]
fn past_its_own_prefix_a_node_pulls_the_pools_runs_where_that_beats_recomputing() {
    // Node 1 holds 10 of 100 blocks in L1; the pool goes on to 60 in node
    // 2's L1 and to 70 in node 3's L2. Node 2 is backed up (500 ms), so
    // node 1 runs it: its own 10 loaded, 50 pulled (0.1 ms a block, under
    // 0.5 ms of compute), 40 computed (20 ms).
    let loads = LoadView { nodes: vec![node(1, 0), node(2, 500)] };
    let pool = vec![run(0, 10, 1, Tier::L1Dram), run(10, 60, 2, Tier::L1Dram), run(60, 70, 3, Tier::L2Nvme)];
    let view = HitView { nodes: vec![hits(1, [0, 10, 10, 10]), hits(2, [0, 60, 60, 60])], l3_through: 0, pool };
    let plan = route(&request(100), &view, &loads, Policy::Any).unwrap();
    assert_eq!(plan.mode, Mode::Colocated { node: NodeId(1) });
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (70, 30), "{plan:?}");
    let own = Move { first: 0, last: 10, from: (NodeId(1), Tier::L1Dram), to: NodeId(1), network: Network::Local };
    let pulled = |first, last, id, tier| Move {
        first,
        last,
        from: (NodeId(id), tier),
        to: NodeId(1),
        network: Network::Storage,
    };
    assert_eq!(plan.moves, [own, pulled(10, 60, 2, Tier::L1Dram), pulled(60, 70, 3, Tier::L2Nvme)]);
    assert_eq!(plan.ttft_ns, 15 * MS, "30 computed; 0.5 + 6 ms of loads hidden under them");
    assert_eq!(plan.blocks_moved_between_nodes(), 60);

    // Where a pull costs more than recomputing, the prefix stops at the
    // node's own blocks, and L3 past it is not reached either.
    let mut slow = node(1, 0);
    slow.pull_ns_per_block = MS;
    let view = HitView { l3_through: 100, ..view };
    let plan = route(&request(100), &view, &LoadView { nodes: vec![slow] }, Policy::Any).unwrap();
    assert_eq!((plan.hit_blocks, plan.moves.len()), (10, 1), "{plan:?}");

    // The holder itself loads its own run locally, not over the network;
    // the pool's run past a gap is not reached.
    let loads = LoadView { nodes: vec![node(2, 0)] };
    let pool = vec![run(0, 60, 2, Tier::L1Dram), run(61, 90, 3, Tier::L1Dram)];
    let view = HitView { nodes: Vec::new(), l3_through: 0, pool };
    let plan = route(&request(100), &view, &loads, Policy::Any).unwrap();
    assert_eq!(plan.hit_blocks, 60, "{plan:?}");
    assert_eq!(plan.moves[0].network, Network::Local);
    assert_eq!(plan.blocks_moved_between_nodes(), 0);
}

#[test]
fn a_run_only_in_another_nodes_l3_is_read_from_the_shared_store_at_the_nodes_own_l3_rate() {
    // Node 1 holds 10 of 100 blocks in L1; blocks 10..40 are only in node
    // 2's L3. A pull costs node 1 more than recomputing (1 ms), an L3 read
    // (0.3 ms here) less: it reads the 30 from the store, as it reads its
    // own L3, and computes the last 60.
    let mut one = node(1, 0);
    one.pull_ns_per_block = MS;
    one.load_ns_per_block[3] = 3 * MS / 10;
    let pool = vec![run(0, 10, 1, Tier::L1Dram), run(10, 40, 2, Tier::L3Object)];
    let view = HitView { nodes: vec![hits(1, [0, 10, 10, 10])], l3_through: 0, pool };
    let plan = route(&request(100), &view, &LoadView { nodes: vec![one] }, Policy::Any).unwrap();
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (40, 60), "{plan:?}");
    let read =
        Move { first: 10, last: 40, from: (NodeId(2), Tier::L3Object), to: NodeId(1), network: Network::Storage };
    assert_eq!(plan.moves[1], read, "{plan:?}");
    // Where its own L3 reads cost more than recomputing, the run is not
    // read.
    let mut slow = one;
    slow.load_ns_per_block[3] = MS;
    let plan = route(&request(100), &view, &LoadView { nodes: vec![slow] }, Policy::Any).unwrap();
    assert_eq!(plan.hit_blocks, 10, "{plan:?}");
}
