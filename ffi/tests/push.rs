//! P→D through the C ABI: two pools (two `lake-cp`s and `lake-dp`s in one
//! process); the prefill engine saves a prompt into its pool, asks the
//! decode pool where its L1 is (`lake_slot_space`), pushes the prompt
//! there (`lake_push`), and the decode engine finds it with `lake_lookup`
//! and loads it byte for byte. Bad arguments are refused by name. And the
//! routing question before such a push (`lake_route`): this node's hits
//! read from its mirror, another node's as given. And the cluster lookup
//! (`lake_lookup_cluster`): this node's blocks from its mirror, then the
//! blocks only other nodes hold from the cluster view beside it.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)] // small test numbers, seconds shown

mod common;

use common::pools::{BLOCK, attach, empty_rail, keys, lookup, namespace, save, start};
use common::{ok, statuses};

use std::ffi::CString;
use std::time::{Duration, Instant};

use lake::pool::{
    LakeBlockKey, LakeBlockWhere, LakeNamespace, LakeNamespaceOptions, lake_cancel, lake_compute_cost, lake_detach,
    lake_keychain_extend, lake_keychain_free, lake_keychain_new, lake_load_costs, lake_lookup_cluster,
    lake_namespace_free, lake_namespace_new, lake_pull, lake_pull_cost, lake_push, lake_push_rails,
    lake_register_host_memory, lake_report_prefill, lake_slot_space, lake_submit_load, lake_submit_save,
};
use lake::route::{
    LAKE_COST_MEASURED, LAKE_MODE_COLOCATED, LAKE_MODE_DDIRECT, LAKE_NETWORK_LOCAL, LAKE_NETWORK_STORAGE,
    LAKE_ROLE_DECODE, LAKE_ROLE_PREFILL, LakeNodeHits, LakeNodeLoad, LakeRouteMove, LakeRoutePlan, LakeRouteRequest,
    lake_route,
};
use lake::status::LakeStatus;

const BLOCKS: usize = 10;

#[test]
fn a_prompt_pushed_to_the_decode_pool_is_found_and_loaded_there() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let decode_address = listener.local_addr().unwrap();
    drop(listener);
    let prefill = start("prefill", None, None);
    let decode = start("decode", Some(decode_address), None);

    let namespace = namespace(1);
    let keys = keys(namespace, BLOCKS, |i| i * 31 + 5);

    let mut strings = Vec::new();
    let p = attach(&prefill, namespace, &mut strings);
    let d = attach(&decode, namespace, &mut strings);

    // Prefill's KV, saved into its own pool.
    let mut kv = vec![0u8; BLOCKS * BLOCK];
    for (i, byte) in kv.iter_mut().enumerate() {
        *byte = (i.wrapping_mul(40_503) >> 9) as u8;
    }
    let (mut memory, mut request) = (0, 0);
    let blocks: Vec<u32> = (0..BLOCKS as u32).collect();
    // SAFETY: the memory lives until detach.
    ok(unsafe { lake_register_host_memory(p, kv.as_mut_ptr(), BLOCK, BLOCKS as u32, &raw mut memory) }, "register");
    // SAFETY: arrays of BLOCKS entries.
    let saved = unsafe {
        lake_submit_save(p, memory, core::ptr::null(), keys.as_ptr(), blocks.as_ptr(), BLOCKS, 2, &raw mut request)
    };
    ok(saved, "save");
    assert!(statuses(p, request, BLOCKS).iter().all(|&s| s == LakeStatus::LakeOk));
    let table = lookup(p, &keys);

    // Where the decode pool takes blocks, and the push.
    let (mut region, mut epoch) = (0u16, 0u64);
    // SAFETY: writable out-values.
    ok(unsafe { lake_slot_space(d, &raw mut region, &raw mut epoch) }, "slot space");
    // Over two rails of the compute network (two local addresses).
    let rails = format!("127.0.0.1>{decode_address},127.0.0.2>{decode_address}");
    let address = CString::new(rails.clone()).unwrap();
    // SAFETY: arrays of BLOCKS entries; a C string.
    let pushed = unsafe {
        lake_push(p, address.as_ptr(), keys.as_ptr(), table.as_ptr(), BLOCKS, region, epoch, 1, &raw mut request)
    };
    ok(pushed, "push");
    assert_eq!(statuses(p, request, BLOCKS), vec![LakeStatus::LakeOk; BLOCKS], "every block landed");
    // Each rail's own accounting: both carried blocks, the bytes of the
    // blocks in all (and little more: headers and frames).
    let mut count = 0;
    // SAFETY: capacity 0 with a null array; writable count.
    ok(unsafe { lake_push_rails(p, core::ptr::null_mut(), 0, &raw mut count) }, "rail count");
    assert_eq!(count, 2, "one peer, two rails");
    let mut rail_stats = vec![empty_rail(); count];
    // SAFETY: `count` writable entries.
    ok(unsafe { lake_push_rails(p, rail_stats.as_mut_ptr(), count, &raw mut count) }, "rails");
    let given: Vec<&str> = rails.split(',').collect();
    for (i, stat) in rail_stats.iter().enumerate() {
        // SAFETY: NUL-terminated by the library.
        let text = unsafe { std::ffi::CStr::from_ptr(stat.address.as_ptr()) }.to_str().unwrap();
        assert_eq!((stat.peer, stat.rail as usize, text), (0, i, given[i]), "{stat:?}");
        assert!(stat.bytes > 0 && stat.up == 1, "rail {i} carried nothing: {stat:?}");
    }
    let total: u64 = rail_stats.iter().map(|s| s.bytes).sum();
    assert!((BLOCKS * BLOCK) as u64 <= total && total < 2 * (BLOCKS * BLOCK) as u64 + (1 << 20), "{total} bytes");
    // The same figures reach the prefill node's control plane: its
    // /metrics shows the engine's compute rails, each its own series.
    let metrics = prefill.metrics.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let shown = loop {
        let text = http_get(metrics, "/metrics");
        let rails: Vec<(u64, u64)> = text
            .lines()
            .filter(|l| l.starts_with("lake_rail_bytes_total{network=\"compute\",sender=\"engine-"))
            .filter_map(|l| {
                let rail = l.split("rail=\"").nth(1)?.split('"').next()?.parse().ok()?;
                Some((rail, l.rsplit(' ').next()?.parse().ok()?))
            })
            .collect();
        if rails.iter().map(|(_, b)| b).sum::<u64>() == total {
            break rails;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "compute rails in /metrics: {rails:?}, want {total} bytes\n{text}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut by_rail: Vec<(u64, u64)> = shown;
    by_rail.sort_unstable();
    assert_eq!(by_rail, rail_stats.iter().map(|s| (u64::from(s.rail), s.bytes)).collect::<Vec<_>>());

    // The decode engine finds the prompt in its own pool and loads it.
    let found = lookup(d, &keys);
    let mut into = vec![0u8; BLOCKS * BLOCK];
    let mut decode_memory = 0;
    // SAFETY: the memory lives until detach.
    let registered =
        unsafe { lake_register_host_memory(d, into.as_mut_ptr(), BLOCK, BLOCKS as u32, &raw mut decode_memory) };
    ok(registered, "register at decode");
    // SAFETY: arrays of BLOCKS entries.
    let loaded = unsafe {
        lake_submit_load(d, decode_memory, keys.as_ptr(), found.as_ptr(), blocks.as_ptr(), BLOCKS, 0, &raw mut request)
    };
    ok(loaded, "load at decode");
    assert!(statuses(d, request, BLOCKS).iter().all(|&s| s == LakeStatus::LakeOk));
    assert!(into == kv, "the decode engine loaded other bytes");

    // Bad arguments, refused by name; a region the peer does not have is
    // refused by the peer, block by block.
    // SAFETY: as above.
    let bad = unsafe {
        lake_push(p, c"not an address".as_ptr(), keys.as_ptr(), table.as_ptr(), 1, region, epoch, 1, &raw mut request)
    };
    assert_eq!(bad, LakeStatus::LakeInvalidArgument);
    // SAFETY: as above.
    let bad = unsafe {
        lake_push(
            p,
            c"eth0>10.0.0.2:7000".as_ptr(),
            keys.as_ptr(),
            table.as_ptr(),
            1,
            region,
            epoch,
            1,
            &raw mut request,
        )
    };
    assert_eq!(bad, LakeStatus::LakeInvalidArgument, "a rail's local side is an address");
    // SAFETY: as above.
    let bad =
        unsafe { lake_push(p, address.as_ptr(), keys.as_ptr(), table.as_ptr(), 1, region, epoch, 9, &raw mut request) };
    assert_eq!(bad, LakeStatus::LakeInvalidArgument);
    // SAFETY: as above.
    let elsewhere = unsafe {
        lake_push(p, address.as_ptr(), keys.as_ptr(), table.as_ptr(), 2, region + 1, epoch, 1, &raw mut request)
    };
    ok(elsewhere, "push to another region");
    assert_eq!(statuses(p, request, 2), vec![LakeStatus::LakeUnavailable; 2]);
    // A push to a node that does not answer, aborted: its blocks end
    // cancelled at once, not at the transfer's 10 s deadline.
    let asked = Instant::now();
    // SAFETY: as above.
    let stuck = unsafe {
        lake_push(p, c"127.0.0.1:1".as_ptr(), keys.as_ptr(), table.as_ptr(), 2, region, epoch, 1, &raw mut request)
    };
    ok(stuck, "push to a closed port");
    // SAFETY: an attached pool.
    ok(unsafe { lake_cancel(p, request) }, "cancel");
    assert_eq!(statuses(p, request, 2), vec![LakeStatus::LakeCancelled; 2]);
    assert!(asked.elapsed() < Duration::from_secs(5), "cancelled in {:?}", asked.elapsed());

    // SAFETY: attached above, detached once; then the namespace.
    unsafe { lake_detach(p) };
    // SAFETY: as above.
    unsafe { lake_detach(d) };
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
    let (decode_stats, _) = decode.stop().unwrap();
    assert_eq!(decode_stats.pool.remote_landed, BLOCKS as u64);
    drop(prefill.stop());
}

#[test]
fn the_router_reads_this_nodes_hits_from_its_mirror() {
    let pool = start("route", None, None);
    let options = LakeNamespaceOptions {
        struct_size: size_of::<LakeNamespaceOptions>(),
        tenant_key: [3; 32],
        block_tokens: 16,
        model_fingerprint: [4; 32],
        extra_keys_digest: [0; 32],
        key_scheme: 1,
    };
    let mut namespace: *mut LakeNamespace = core::ptr::null_mut();
    // SAFETY: valid options and out-pointer.
    ok(unsafe { lake_namespace_new(&raw const options, &raw mut namespace) }, "namespace");
    let tokens: Vec<u32> = (0..8 * 16).map(|i| i * 7 + 1).collect();
    let mut keys = vec![LakeBlockKey::default(); 8];
    let (mut chain, mut written) = (core::ptr::null_mut(), 0);
    // SAFETY: a valid namespace and out-pointer.
    ok(unsafe { lake_keychain_new(namespace, &raw mut chain) }, "chain");
    // SAFETY: arrays of their lengths.
    ok(
        unsafe { lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), 8, &raw mut written) },
        "keys",
    );
    // SAFETY: from lake_keychain_new, freed once.
    unsafe { lake_keychain_free(chain) };
    let mut strings = Vec::new();
    let p = attach(&pool, namespace, &mut strings);
    // The first 6 of the prompt's 8 blocks saved here (L1).
    let mut kv = vec![7u8; 6 * BLOCK];
    let (mut memory, mut request) = (0, 0);
    let blocks: Vec<u32> = (0..6).collect();
    // SAFETY: the memory lives until detach.
    ok(unsafe { lake_register_host_memory(p, kv.as_mut_ptr(), BLOCK, 6, &raw mut memory) }, "register");
    // SAFETY: arrays of 6 entries.
    ok(
        unsafe {
            lake_submit_save(p, memory, core::ptr::null(), keys.as_ptr(), blocks.as_ptr(), 6, 2, &raw mut request)
        },
        "save",
    );
    assert!(statuses(p, request, 6).iter().all(|&s| s == LakeStatus::LakeOk));
    lookup(p, &keys[..6]);

    let node = |id, queue_ns| LakeNodeLoad {
        node: id,
        roles: LAKE_ROLE_PREFILL | LAKE_ROLE_DECODE,
        queue_ns,
        compute_ns_per_block: 500_000,
        load_ns_per_block: [0, 50_000, 400_000, 3_000_000],
        cnic_ns_per_block: 100_000,
    };
    let loads = [node(0, 0), node(1, 0)];
    // Node 1's engine holds the whole prompt in its HBM.
    let others = [LakeNodeHits { node: 1, through: [8; 4], reserved: 0 }];
    let ask = |avoid: &[u32], loads: &[LakeNodeLoad], policy: u32, size: usize| {
        let request = LakeRouteRequest {
            struct_size: size,
            keys: keys.as_ptr(),
            count: 8,
            local_node: 0,
            local_l0_blocks: 0,
            l3_blocks: 0,
            policy,
            others: others.as_ptr(),
            others_count: others.len(),
            loads: loads.as_ptr(),
            loads_count: loads.len(),
            avoid: avoid.as_ptr(),
            avoid_count: avoid.len(),
            pull_ns_per_block: 0,
        };
        let mut plan = LakeRoutePlan::default();
        let mut moves = [LakeRouteMove::default(); 4];
        // SAFETY: a request whose arrays hold their counts; writable plan and moves.
        let status = unsafe { lake_route(p, &raw const request, &raw mut plan, moves.as_mut_ptr(), moves.len()) };
        (status, plan, moves)
    };
    let size = size_of::<LakeRouteRequest>();
    let (status, plan, _) = ask(&[], &loads, 0, size);
    ok(status, "route");
    assert_eq!((plan.mode, plan.prefill_node, plan.hit_blocks, plan.moves), (LAKE_MODE_DDIRECT, 1, 8, 0), "{plan:?}");
    // Node 1 failed the request: routed again around it, this node's own
    // six blocks in L1 (read from its mirror) load, two are computed.
    let (status, plan, moves) = ask(&[1], &loads, 0, size);
    ok(status, "reroute");
    assert_eq!((plan.mode, plan.prefill_node, plan.hit_blocks, plan.recomputed_blocks), (LAKE_MODE_COLOCATED, 0, 6, 2));
    assert_eq!((plan.moves, moves[0].first, moves[0].last, moves[0].from_tier), (1, 0, 6, 1));
    assert_eq!((moves[0].from_node, moves[0].to_node, moves[0].network), (0, 0, LAKE_NETWORK_LOCAL));
    assert_eq!(plan.ttft_ns, 1_000_000, "two blocks computed hide six loaded");
    // Cost-aware with live inputs: nothing loaded yet, so this node's L1
    // cost is unmeasured and counts as dear as recomputing.
    let mut costs = [u64::MAX; 4];
    // SAFETY: 4 writable entries.
    ok(unsafe { lake_load_costs(p, costs.as_mut_ptr(), 4) }, "costs");
    assert_eq!(costs, [0, 0, 0, 0], "nothing loaded, nothing measured");
    let measured = |compute_ns_per_block| LakeNodeLoad {
        compute_ns_per_block,
        load_ns_per_block: [0, LAKE_COST_MEASURED, LAKE_COST_MEASURED, LAKE_COST_MEASURED],
        ..node(0, 0)
    };
    let (status, plan, _) = ask(&[1], &[measured(500_000), node(1, 0)], 0, size);
    ok(status, "route, unmeasured");
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (0, 8), "an unmeasured tier is not loaded from: {plan:?}");
    // The engine loads its six L1 blocks: the copies are timed.
    let table = lookup(p, &keys[..6]);
    // SAFETY: arrays of 6 entries; the memory lives until detach.
    ok(
        unsafe { lake_submit_load(p, memory, keys.as_ptr(), table.as_ptr(), blocks.as_ptr(), 6, 0, &raw mut request) },
        "load",
    );
    assert!(statuses(p, request, 6).iter().all(|&s| s == LakeStatus::LakeOk));
    // SAFETY: 4 writable entries.
    ok(unsafe { lake_load_costs(p, costs.as_mut_ptr(), 4) }, "costs");
    assert!(costs[1] > 0 && costs[1] < 500_000_000, "L1 measured: {costs:?}");
    // Loading beats recomputing at 0.5 s a block; not at 1 ns a block.
    let (status, plan, _) = ask(&[1], &[measured(500_000_000), node(1, 0)], 0, size);
    ok(status, "route, measured");
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (6, 2), "{plan:?} with L1 at {} ns", costs[1]);
    let (status, plan, _) = ask(&[1], &[measured(1), node(1, 0)], 0, size);
    ok(status, "route, cheap compute");
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (0, 8), "{plan:?}");
    // The compute cost measured too, as the engine reports its prefills.
    let compute = || {
        let mut ns = u64::MAX;
        // SAFETY: a writable out.
        ok(unsafe { lake_compute_cost(p, &raw mut ns) }, "compute cost");
        ns
    };
    assert_eq!(compute(), 0, "no prefill reported");
    let both = LakeNodeLoad { compute_ns_per_block: LAKE_COST_MEASURED, ..measured(0) };
    let (status, plan, _) = ask(&[1], &[both, node(1, 0)], 0, size);
    ok(status, "route, compute unmeasured");
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (6, 2), "unreported compute is dearer than a load: {plan:?}");
    // SAFETY: a pool handle.
    ok(unsafe { lake_report_prefill(p, 8, 4_000_000_000) }, "a slow prefill");
    assert_eq!(compute(), 500_000_000);
    let (status, plan, _) = ask(&[1], &[both, node(1, 0)], 0, size);
    ok(status, "route, slow compute measured");
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (6, 2), "{plan:?}");
    // Prefills turn fast (1 ns a block): the average follows, and
    // recomputing wins.
    for _ in 0..200 {
        // SAFETY: a pool handle.
        ok(unsafe { lake_report_prefill(p, 8, 8) }, "a fast prefill");
    }
    assert!(compute() < 10, "{} ns a block", compute());
    let (status, plan, _) = ask(&[1], &[both, node(1, 0)], 0, size);
    ok(status, "route, fast compute measured");
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (0, 8), "{plan:?}");
    // Bad reports and questions, refused by name.
    // SAFETY: a pool handle.
    assert_eq!(unsafe { lake_report_prefill(p, 0, 5) }, LakeStatus::LakeInvalidArgument);
    // SAFETY: as above.
    assert_eq!(unsafe { lake_report_prefill(p, 5, 0) }, LakeStatus::LakeInvalidArgument);
    // SAFETY: a pool handle; a null out, refused.
    assert_eq!(unsafe { lake_compute_cost(p, core::ptr::null_mut()) }, LakeStatus::LakeNullArgument);
    // SAFETY: a null pool, refused.
    assert_eq!(unsafe { lake_report_prefill(core::ptr::null(), 1, 1) }, LakeStatus::LakeNullArgument);
    let elsewhere = LakeNodeLoad { compute_ns_per_block: LAKE_COST_MEASURED, ..node(1, 0) };
    assert_eq!(ask(&[], &[node(0, 0), elsewhere], 0, size).0, LakeStatus::LakeInvalidArgument);
    // Bad questions, refused by name; no node left is `LAKE_UNAVAILABLE`.
    assert_eq!(ask(&[0, 1], &loads, 0, size).0, LakeStatus::LakeUnavailable);
    assert_eq!(ask(&[], &loads, 7, size).0, LakeStatus::LakeInvalidArgument);
    // A size neither this build's request nor one built before its last
    // field (`pull_ns_per_block`) has.
    for odd in [size - 16, size - 4, size + 8] {
        assert_eq!(ask(&[], &loads, 0, odd).0, LakeStatus::LakeInvalidArgument, "struct_size {odd}");
    }
    let odd = [LakeNodeLoad { roles: 4, ..node(0, 0) }];
    assert_eq!(ask(&[], &odd, 0, size).0, LakeStatus::LakeInvalidArgument);
    let mut plan = LakeRoutePlan::default();
    // SAFETY: a null request is the point.
    let null = unsafe { lake_route(p, core::ptr::null(), &raw mut plan, core::ptr::null_mut(), 0) };
    assert_eq!(null, LakeStatus::LakeNullArgument);
    // SAFETY: attached above, detached once; then the namespace.
    unsafe { lake_detach(p) };
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
    drop(pool.stop());
}

fn http_get(address: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: lake\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// The previous release's whole pool (`lake serve` of `LAKE_PREVIOUS_LAKE`,
/// built by `.ci/run`), its transport listening on `listen`; its data
/// plane's socket, mirror and control plane's socket, from the line it
/// prints when it serves.
struct OldPool {
    child: std::process::Child,
    paths: [std::path::PathBuf; 3],
    /// Its shared memory (arena, mirror): killed, it leaves them.
    shared: [std::path::PathBuf; 2],
    log: std::path::PathBuf,
    dir: std::path::PathBuf,
}

impl OldPool {
    fn start(binary: &std::path::Path, listen: std::net::SocketAddr) -> Self {
        use std::io::BufRead;
        let dir = std::env::temp_dir().join(format!("lake-ffi-push-old-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("serve.log");
        let mut child = std::process::Command::new(binary)
            // The previous release's flags (it has no --metrics: its
            // metrics port is a free one).
            .args(["serve", "--block-bytes", &BLOCK.to_string(), "--l1-slots", "32", "--l2-slots", "32"])
            .arg("--dir")
            .arg(dir.join("pool"))
            .args(["--transport-listen", &listen.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        // `{"event":"serving","dp_socket":"…",…}`: the paths are plain.
        let path = |field: &str| {
            let at = line.find(&format!("\"{field}\":\"")).unwrap_or_else(|| {
                panic!("no {field} in {line:?}\n{:?}", std::fs::read_to_string(&log).unwrap_or_default())
            });
            let rest = &line[at + field.len() + 4..];
            std::path::PathBuf::from(&rest[..rest.find('"').unwrap()])
        };
        let shared = [path("arena"), path("mirror")];
        Self { child, paths: [path("dp_socket"), path("mirror"), path("cp_socket")], shared, log, dir }
    }
}

impl Drop for OldPool {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        for file in &self.shared {
            let _ = std::fs::remove_file(file);
        }
    }
}

/// Rolling upgrade on the compute network: this build's engine pushes a
/// prompt, under a trace id, into the previous release's pool. Its links
/// offer trace ids; the old pool, built before them, declines; the blocks
/// land there untraced (no span carries its time, its log has no trace
/// line) and an engine attached to it loads them byte for byte.
#[test]
fn a_traced_push_into_the_previous_releases_pool_lands_there_untraced() {
    use common::pools::{attach_at, free_address, load, push, save, slot_space};
    let Some(binary) = std::env::var_os("LAKE_PREVIOUS_LAKE").map(std::path::PathBuf::from) else {
        println!("SKIPPED: LAKE_PREVIOUS_LAKE names no `lake` of the previous release (.ci/run builds one)");
        return;
    };
    let listen = free_address();
    let old = OldPool::start(&binary, listen);
    let prefill = start("prefill-for-old", None, None);
    let namespace = namespace(6);
    let keys = keys(namespace, BLOCKS, |i| i * 17 + 3);
    let mut strings = Vec::new();
    let p = attach(&prefill, namespace, &mut strings);
    let d = attach_at([&old.paths[0], &old.paths[1], &old.paths[2]], namespace, &mut strings);
    let mut kv: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i as u8).wrapping_mul(29) ^ (i / BLOCK) as u8).collect();
    let table = save(p, &keys, &mut kv);

    lake::trace::lake_set_trace(0x01d0_0000_9e5d);
    let pushed = push(p, &listen.to_string(), &keys, &table, slot_space(d));
    lake::trace::lake_set_trace(0);
    assert_eq!(pushed, vec![LakeStatus::LakeOk; BLOCKS], "{}", std::fs::read_to_string(&old.log).unwrap_or_default());
    let spans = common::spans(p);
    let n = spans.len();
    assert_eq!(n, BLOCKS, "a span a pushed block");
    assert!(
        spans[..n].iter().all(|s| s.op == 1 && s.status == LakeStatus::LakeOk && s.data_plane_us == 0),
        "{spans:?}"
    );

    let mut into = Vec::new();
    assert_eq!(load(d, &keys, &mut into), vec![LakeStatus::LakeOk; BLOCKS]);
    assert!(into == kv, "the old pool holds the prompt byte for byte");
    let log = std::fs::read_to_string(&old.log).unwrap_or_default();
    assert!(!log.contains("\"event\":\"trace\""), "the old pool traced nothing: {log}");
    assert!(!log.contains("link_refused") && !log.contains("bad frame"), "{log}");
    for handle in [p, d] {
        // SAFETY: attached above, each detached once.
        unsafe { lake_detach(handle) };
    }
    drop((kv, into, strings));
    prefill.stop().unwrap();
}

/// A tenant capped on its pushes (`push_bytes_per_s`, told to each agent
/// at attach) pushes no faster than its cap, and another tenant's pushes
/// from the same pool are not held behind it.
#[test]
fn a_tenant_capped_on_its_pushes_pushes_no_faster_and_the_other_is_not_held() {
    use common::pools::{free_address, save, slot_space};
    const CAP: u64 = 256 * 1024;
    let (capped_ns, free_ns) = (namespace(5), namespace(6));
    let mut id = 0;
    // SAFETY: a live namespace and a writable id.
    ok(unsafe { lake::pool::lake_namespace_id(capped_ns, &raw mut id) }, "namespace id");
    let tenant = lake_dp::runner::config::TenantSection {
        name: "capped".into(),
        namespaces: vec![format!("{id:016x}")],
        l2_read_bytes_per_s: None,
        l2_write_bytes_per_s: None,
        l3_read_bytes_per_s: None,
        l3_write_bytes_per_s: None,
        net_send_bytes_per_s: None,
        push_bytes_per_s: Some(CAP),
        net_receive_bytes_per_s: None,
    };
    let dir = std::env::temp_dir().join(format!("lake-ffi-push-cap-{}", std::process::id()));
    let prefill = lake_cp::embedded::EmbeddedPool::start(&lake_cp::embedded::EmbeddedConfig {
        block_bytes: BLOCK as u64,
        l1_slots: 48,
        l2_slots_per_file: 32,
        remote_agents: 4,
        tenant_rates: vec![tenant],
        ..lake_cp::embedded::EmbeddedConfig::new(dir)
    })
    .unwrap();
    let decode_address = free_address();
    let decode = start("cap-decode", Some(decode_address), None);
    let mut strings = Vec::new();
    let (p5, p6) = (attach(&prefill, capped_ns, &mut strings), attach(&prefill, free_ns, &mut strings));
    let d = attach(&decode, capped_ns, &mut strings);
    let to = slot_space(d);
    let (keys5, keys6) = (keys(capped_ns, BLOCKS, |i| i * 3 + 1), keys(free_ns, BLOCKS, |i| i * 5 + 2));
    let mut kv5: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i as u8).wrapping_mul(7)).collect();
    let mut kv6: Vec<u8> = (0..BLOCKS * BLOCK).map(|i| (i as u8).wrapping_mul(11)).collect();
    let (table5, table6) = (save(p5, &keys5, &mut kv5), save(p6, &keys6, &mut kv6));
    let push_of = |handle, keys: &[LakeBlockKey], table: &[lake::pool::LakeLocation]| {
        let address = CString::new(decode_address.to_string()).unwrap();
        let mut request = 0;
        // SAFETY: arrays of `keys.len()` entries; a C string.
        let pushed = unsafe {
            lake_push(
                handle,
                address.as_ptr(),
                keys.as_ptr(),
                table.as_ptr(),
                keys.len(),
                to.0,
                to.1,
                1,
                &raw mut request,
            )
        };
        ok(pushed, "push");
        request
    };
    let asked = Instant::now();
    let (capped, free) = (push_of(p5, &keys5, &table5), push_of(p6, &keys6, &table6));
    assert_eq!(statuses(p6, free, BLOCKS), vec![LakeStatus::LakeOk; BLOCKS]);
    let free_time = asked.elapsed();
    assert_eq!(statuses(p5, capped, BLOCKS), vec![LakeStatus::LakeOk; BLOCKS]);
    let capped_time = asked.elapsed();
    // Its bytes past the bucket's burst (a tenth of a second's worth) and
    // the one block it may go into debt by, at the cap; a block travels as
    // its stored object.
    let object = (lake_dp::constants::STORED_HEADER_BYTES + BLOCK) as u64;
    let floor = (BLOCKS as u64 * object - CAP / 10 - object) as f64 / CAP as f64;
    println!("push cap: capped tenant {capped_time:?} (floor {floor:.2} s), the other {free_time:?}");
    assert!(capped_time.as_secs_f64() >= floor, "capped: {capped_time:?} under the floor {floor:.2} s");
    assert!(free_time.as_secs_f64() < floor / 2.0, "the other tenant was held: {free_time:?}");
    // They landed: the decode pool has every block of both.
    lookup(d, &keys5);
    let d6 = attach(&decode, free_ns, &mut strings);
    lookup(d6, &keys6);
    for handle in [p5, p6, d, d6] {
        // SAFETY: attached above, each detached once.
        unsafe { lake_detach(handle) };
    }
    drop((kv5, kv6, strings));
    prefill.stop().unwrap();
    decode.stop().unwrap();
}

/// The cluster view is written here as the node's `lake-cp` writes what
/// the leader streams (that stream, between real processes, is
/// `lake-cp --test summary_cluster`'s); what is tested is the engine's
/// side: the C ABI reading the pool's mirror and its view together.
#[test]
fn a_cluster_lookup_names_this_nodes_blocks_then_the_blocks_only_another_node_holds() {
    use lake_dp::mirror::view::ViewWriter;
    use lake_dp::mirror::{MirrorBacking, MirrorConfig};
    use lake_dp::{NodeId, ObjectKind, Tier};

    let pool = start("cluster-view", None, None);
    let namespace = namespace(6);
    let keys = keys(namespace, 8, |i| i * 5 + 3);
    let mut strings = Vec::new();
    let p = attach(&pool, namespace, &mut strings);
    let mut kv = vec![9u8; 6 * BLOCK];
    let table = save(p, &keys[..6], &mut kv);
    let ask = |capacity: usize| {
        let mut out = vec![LakeBlockWhere::default(); 8];
        let mut hits = usize::MAX;
        // SAFETY: arrays of 8 entries, `capacity` at most 8.
        let status =
            unsafe { lake_lookup_cluster(p, keys.as_ptr(), keys.len(), out.as_mut_ptr(), capacity, &raw mut hits) };
        (status, hits, out)
    };
    // No view beside the mirror (the pool reports to no summary): this
    // node's blocks, as lake_lookup gives them.
    let (status, hits, out) = ask(8);
    assert_eq!((status, hits), (LakeStatus::LakeOk, 6));
    for (place, location) in out.iter().zip(&table) {
        assert_eq!((place.node, place.tier, place.local, place.location), (0, 1, 1, *location));
    }

    // Node 5 holds the whole prompt in L2.
    let mut path = pool.mirror.clone().into_os_string();
    path.push(".cluster");
    let config =
        MirrorConfig { node: NodeId(0), ..MirrorConfig::for_entries(MirrorBacking::Shm(path.clone().into()), 64) };
    let mut view = ViewWriter::create(&config).unwrap();
    for key in &keys {
        view.set(&lake_dp::BlockKey(key.bytes), NodeId(5), Some(Tier::L2Nvme), ObjectKind::KvBlock).unwrap();
    }
    // The view is looked for again at most once a second.
    std::thread::sleep(lake_dp::mirror::view::ViewOpener::RETRY);
    let (status, hits, out) = ask(8);
    assert_eq!((status, hits), (LakeStatus::LakeOk, 8));
    assert!(out[..6].iter().all(|w| w.local == 1 && w.node == 0), "this node's own first: {out:?}");
    for place in &out[6..] {
        assert_eq!((place.node, place.tier, place.local), (5, 2, 0));
        assert_eq!(place.location, lake::pool::LakeLocation::default(), "no block-table entry here");
    }
    // Routed with no other nodes' hits given: the view's. Node 5 holds all
    // eight in L2, this node six in L1; loading the eight from node 5's L2
    // beats computing two here, so node 5 runs it.
    let load = |node| LakeNodeLoad {
        node,
        roles: LAKE_ROLE_PREFILL | LAKE_ROLE_DECODE,
        queue_ns: 0,
        compute_ns_per_block: 500_000,
        load_ns_per_block: [0, 50_000, 100_000, 3_000_000],
        cnic_ns_per_block: 100_000,
    };
    let loads = [load(0), load(5)];
    let route_on = |loads: &[LakeNodeLoad], avoid: &[u32], pull_ns_per_block: u64, struct_size: usize| {
        let request = LakeRouteRequest {
            struct_size,
            keys: keys.as_ptr(),
            count: 8,
            local_node: 0,
            local_l0_blocks: 0,
            l3_blocks: 0,
            policy: 0,
            others: core::ptr::null(),
            others_count: 0,
            loads: loads.as_ptr(),
            loads_count: loads.len(),
            avoid: avoid.as_ptr(),
            avoid_count: avoid.len(),
            pull_ns_per_block,
        };
        let (mut plan, mut moves) = (LakeRoutePlan::default(), [LakeRouteMove::default(); 4]);
        // SAFETY: a request whose arrays hold their counts; a writable
        // plan and four writable moves.
        ok(unsafe { lake_route(p, &raw const request, &raw mut plan, moves.as_mut_ptr(), moves.len()) }, "route");
        (plan, moves)
    };
    let whole = size_of::<LakeRouteRequest>();
    let route = |avoid: &[u32]| route_on(&loads, avoid, 0, whole).0;
    let plan = route(&[]);
    assert_eq!((plan.prefill_node, plan.hit_blocks, plan.recomputed_blocks), (5, 8, 0), "{plan:?}");
    // Node 5 failed it: routed around it, this node's six load.
    let plan = route(&[5]);
    assert_eq!((plan.prefill_node, plan.hit_blocks, plan.recomputed_blocks), (0, 6, 2), "{plan:?}");
    // Only this node may run it: its six load, and the two only node 5
    // holds are pulled where the request prices a pull below computing.
    let here = [load(0)];
    let (plan, moves) = route_on(&here, &[], 100_000, whole);
    assert_eq!((plan.prefill_node, plan.hit_blocks, plan.recomputed_blocks), (0, 8, 0), "{plan:?}");
    let pulled = moves[..plan.moves as usize].iter().find(|m| m.network == LAKE_NETWORK_STORAGE);
    let pulled = pulled.map(|m| (m.first, m.last, m.from_node, m.from_tier, m.to_node));
    assert_eq!(pulled, Some((6, 8, 5, 2, 0)), "{moves:?}");
    // Dearer than computing, not pulled; nor where the request prices no
    // pull, nor at this pool's measure before it pulled anything, nor
    // from a request built before pulls were priced (its size ends
    // before the field, whatever lies past it).
    let costs = [1_000_000, 0, LAKE_COST_MEASURED];
    for (pull, size) in costs.into_iter().map(|c| (c, whole)).chain([(100_000, whole - size_of::<u64>())]) {
        let (plan, _) = route_on(&here, &[], pull, size);
        assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (6, 2), "pull {pull}, size {size}: {plan:?}");
    }
    let mut cost = u64::MAX;
    // SAFETY: `cost` writable.
    ok(unsafe { lake_pull_cost(p, &raw mut cost) }, "pull cost");
    assert_eq!(cost, 0, "nothing pulled, nothing measured");
    // Too little room: the hit is said, with the status.
    let (status, hits, _) = ask(7);
    assert_eq!((status, hits), (LakeStatus::LakeBufferTooSmall, 8));
    // A pull no leader relays (this pool reports to no summary): nothing
    // lands, and when the time is up the hit is this node's six.
    let (started, mut pulled) = (Instant::now(), usize::MAX);
    // SAFETY: an array of 8 keys; `pulled` writable.
    ok(unsafe { lake_pull(p, keys.as_ptr(), keys.len(), 300, &raw mut pulled) }, "pull");
    assert_eq!(pulled, 6);
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited for the two: {:?}", started.elapsed());
    // Node 5 lets its last block go: the prefix ends before it.
    view.set(&lake_dp::BlockKey(keys[7].bytes), NodeId(5), None, ObjectKind::KvBlock).unwrap();
    assert_eq!(ask(8).1, 7);
    let mut hits = 0;
    // SAFETY: a null pointer is refused before any is read.
    let null = unsafe { lake_lookup_cluster(p, keys.as_ptr(), 8, core::ptr::null_mut(), 8, &raw mut hits) };
    assert_eq!(null, LakeStatus::LakeNullArgument);
    view.retire();
    let _ = std::fs::remove_file(&path);
    // SAFETY: from lake_attach, detached once.
    unsafe { lake_detach(p) };
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
}
