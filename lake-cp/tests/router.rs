//! `lake route` across processes: two nodes (`lake serve`, members of a
//! cluster in a real etcd, their summary's view streamed back to each),
//! and the router beside node 1 reading that node's pool. A prompt's
//! blocks saved on node 2 are found from node 1 through the view: the
//! router sends the request where its prefix is, and with that node
//! avoided (F4) to node 1, pulling the prefix over the storage network.
//! Node 2 SIGKILLed: the router sees its pool stop answering and routes
//! around it with no request naming it. Bad requests get a status and a
//! reason naming the field; a flood of idle connections is capped and
//! timed out, and the router answers again after it.

#[path = "common/cluster.rs"]
mod cluster;
#[path = "common/etcd.rs"]
mod etcd_server;
#[path = "common/metrics.rs"]
mod metrics;
#[path = "common/scratch.rs"]
mod scratch;
#[path = "common/supervise.rs"]
mod supervise;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use lake_agent::{SaveBlock, SavePayload};
use lake_dp::{BlockKey, KeyChain, KeyScheme, Namespace, TenantKey};
use serde_json::{Value, json};

use cluster::{Proc, agent_of, field, http_ask as ask, leader, start_router};
use scratch::Scratch;

const BLOCK_TOKENS: u32 = 16;

fn namespace() -> Namespace {
    Namespace::new(&TenantKey([0x42; 32]), KeyScheme::TokenIdsV1, BLOCK_TOKENS, [0x17; 32], [0; 32]).unwrap()
}

/// A prompt of `blocks` full blocks: its tokens and their keys.
fn prompt(seed: u32, blocks: usize) -> (Vec<u32>, Vec<BlockKey>) {
    let tokens: Vec<u32> = (0..u32::try_from(blocks).unwrap() * BLOCK_TOKENS).map(|i| seed * 100_000 + i).collect();
    let mut keys = vec![BlockKey::NONE; blocks];
    assert_eq!(KeyChain::new(&namespace()).extend_tokens(&tokens, &mut keys).unwrap(), blocks);
    (tokens, keys)
}

fn save(serving: &str, keys: &[BlockKey]) {
    let mut agent = agent_of(serving, namespace().id(), "router-test");
    let payload = vec![7u8; 16 * 1024];
    for (i, key) in keys.iter().enumerate() {
        let block = SaveBlock {
            key: *key,
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: SavePayload::Bytes(&payload),
        };
        assert_eq!(agent.save(&[block]), 1, "block {i}");
    }
}

/// `GET /metrics`: Prometheus text.
fn router_metrics(router: &str) -> String {
    let mut stream = TcpStream::connect(router).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: lake\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    assert!(head.starts_with("HTTP/1.1 200") && head.contains("Content-Type: text/plain; version=0.0.4"), "{head}");
    body.to_owned()
}

/// The value of the sample `name` (with its labels) in `metrics`.
fn metric_value(metrics: &str, name: &str) -> u64 {
    let prefix = format!("{name} ");
    metrics.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn route(router: &str, request: &Value) -> (u16, Value) {
    ask(router, "POST /route HTTP/1.1", request.to_string().as_bytes())
}

/// The router's answer to `request` once `done` holds (within 20 s).
fn route_until(router: &str, request: &Value, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, answer) = route(router, request);
        if status == 200 && done(&answer) {
            return answer;
        }
        assert!(Instant::now() < deadline, "{status} {answer}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_router_sends_a_request_where_its_prefix_is_and_around_a_failed_node() {
    let Some(etcd) = etcd_server::EtcdServer::start("router") else { return };
    let endpoint = etcd.endpoint();
    let base = std::env::temp_dir().join(format!("lake-router-{}", std::process::id()));
    let _scratch = Scratch(base.clone(), Vec::new());
    let port = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{}", port());
    // Blocks stay where they were saved: the routes asserted name the
    // node that saved each prefix.
    let leader = leader(&listen, &endpoint, "rt", Some("saved"), &[]);
    let transports = [format!("127.0.0.1:{}", port()), format!("127.0.0.1:{}", port())];
    // Each node listens for the other's transport and dials it: a node
    // sends blocks over the connections it dials, and a pull goes either
    // way.
    let node = |id: u32| {
        let dir = base.join(format!("node{id}")).display().to_string();
        let args = ["serve", "--metrics", "127.0.0.1:0", "--node", &id.to_string(), "--dir", &dir];
        let cluster = ["--block-bytes", "16384", "--summary-to", &listen, "--etcd", &endpoint, "--cluster", "rt"];
        let (own, other) = if id == 1 { (&transports[0], &transports[1]) } else { (&transports[1], &transports[0]) };
        let peer = format!("{}={other}", 3 - id);
        let rest = ["--member-ttl", "2", "--transport-listen", own, "--transport-peer", &peer];
        Proc::start(&[&args[..], &cluster[..], &rest[..]].concat())
    };
    let one = node(1);
    let mut two = node(2);
    let serving_one = one.wait_for("node 1 serves", Duration::from_secs(20), |l| l.contains("\"event\":\"serving\""));
    let serving_two = two.wait_for("node 2 serves", Duration::from_secs(20), |l| l.contains("\"event\":\"serving\""));

    // The router beside node 1: both nodes run prefill and decode.
    let chain = format!(
        "scrape_ms = 200\nconnections_max = 8\n\n\
         [namespace]\ntenant_key = \"{}\"\nblock_tokens = {BLOCK_TOKENS}\nmodel_fingerprint = \"{}\"\n",
        "42".repeat(32),
        "17".repeat(32),
    );
    let nodes = [(1, serving_one.as_str()), (2, serving_two.as_str())];
    let (mut router_proc, router) = start_router(&base.join("route.toml"), &base.join("node1"), &nodes, &chain);

    // A 50-block prompt, its first 40 blocks saved on node 2 only.
    let (tokens, keys) = prompt(1, 50);
    save(&serving_two, &keys[..40]);
    let request = json!({ "tokens": tokens });
    let started = Instant::now();
    let answer = route_until(&router, &request, |a| a["hit_blocks"] == 40 && a["down"].as_array().unwrap().is_empty());
    println!("router: node 2's 40 blocks seen from node 1 within {:?}: {answer}", started.elapsed());
    // Node 2 loads them from its own L1 (2 ms, under 5 ms of compute);
    // node 1 would pull them (4 ms, as hidden): as fast, but nothing
    // crosses between nodes on node 2.
    assert_eq!(answer["mode"], "colocated", "{answer}");
    assert_eq!((answer["prefill"].as_u64(), answer["decode"].as_u64()), (Some(2), Some(2)), "{answer}");
    assert_eq!((answer["blocks"].as_u64(), answer["recomputed_blocks"].as_u64()), (Some(50), Some(10)));
    let local = json!({ "first": 0, "last": 40, "from_node": 2, "from_tier": "l1", "to": 2, "network": "local" });
    assert_eq!(answer["moves"], json!([local]), "{answer}");
    assert_eq!(answer["ttft_ns"], 5_000_000u64);
    assert_eq!(answer["pool"], json!({ "node": 1, "cluster_view": true, "partitions": 0 }));
    // The same prompt by its keys: the same plan.
    let hex: Vec<String> = keys.iter().map(|k| k.0.iter().map(|b| format!("{b:02x}")).collect()).collect();
    let by_keys = route(&router, &json!({ "keys": hex, "blocks": 50 })).1;
    assert_eq!((by_keys["moves"].clone(), by_keys["hit_blocks"].clone()), (answer["moves"].clone(), json!(40)));

    // F4: node 2 failed this request: node 1 runs it, pulling the 40
    // blocks from node 2's L1 over the storage network.
    let (status, rerouted) = route(&router, &json!({ "tokens": tokens, "avoid": [2] }));
    assert_eq!(status, 200, "{rerouted}");
    assert_eq!((rerouted["mode"].as_str(), rerouted["prefill"].as_u64()), (Some("colocated"), Some(1)), "{rerouted}");
    let pulled = json!({ "first": 0, "last": 40, "from_node": 2, "from_tier": "l1", "to": 1, "network": "storage" });
    assert_eq!(rerouted["moves"], json!([pulled]), "{rerouted}");
    assert_eq!(rerouted["pulled_blocks"], 40);
    // Node 1's pool has measured no pull yet: the router weighs a pull
    // there as configured. An engine on node 1 pulls the 40 blocks; the
    // pool measures what one cost, and the router weighs pulls to node 1
    // by that from its next reading on.
    let nodes_of = |router: &str| ask(router, "GET /nodes HTTP/1.1", b"").1;
    let before = nodes_of(&router);
    assert_eq!(
        (before["nodes"][0]["pull_cost"].as_str(), before["nodes"][0]["pull_ns_per_block"].as_u64()),
        (Some("configured"), Some(100_000)),
        "{before}"
    );
    // Another prompt's 40 blocks on node 2 (the first stays node 2's
    // alone, for the failure below).
    let (_, pulled_keys) = prompt(2, 40);
    save(&serving_two, &pulled_keys);
    let mut engine = agent_of(&serving_one, namespace().id(), "router-test-puller");
    let mut table = Vec::new();
    // Once node 1's view shows them, one pull lands them all — node 1
    // started a moment ago: the pull names its L1 to the leader, which
    // may not know it from the membership yet.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut places = Vec::new();
    while engine.lookup_cluster(&pulled_keys, &mut places) < 40 {
        assert!(Instant::now() < deadline, "node 2's blocks never showed in node 1's view");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(engine.pull_cluster(&pulled_keys, Duration::from_secs(10), &mut table), 40);
    let metrics = field(&serving_one, "metrics").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let measured = loop {
        let value = metrics::metric(metrics, "lake_cluster_pull_ns_per_block");
        if let Some(value) = value.filter(|&v| v > 0) {
            break value;
        }
        assert!(Instant::now() < deadline, "node 1 never measured its pull: {value:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("router: node 1 measured a pulled block at {measured} ns");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = nodes_of(&router);
        if now["nodes"][0]["pull_cost"] == "measured" {
            assert_eq!(now["nodes"][0]["pull_ns_per_block"].as_u64(), Some(measured), "{now}");
            break;
        }
        assert!(Instant::now() < deadline, "the router never took node 1's measure: {now}");
        std::thread::sleep(Duration::from_millis(50));
    }

    an_engine_through_the_c_abi_pulls_where_its_measured_pull_beats_computing(&serving_one, &serving_two);

    // Both avoided: no node may run it, and the answer says so.
    let (status, none) = route(&router, &json!({ "tokens": tokens, "avoid": [1, 2] }));
    assert_eq!((status, none["error"].as_str()), (503, Some("no node may run the request")), "{none}");

    bad_requests_are_refused_by_name(&router);
    a_flood_of_idle_connections_is_capped_and_outlived(&router);

    // Node 2 dies: its pool stops answering, and the router routes around
    // it with no request naming it.
    two.kill();
    let killed = Instant::now();
    let around = route_until(&router, &request, |a| a["prefill"] == 1);
    println!("router: node 2 SIGKILLed, routed around within {:?}: {around}", killed.elapsed());
    assert_eq!(around["down"][0]["node"], 2, "{around}");
    // Its blocks, still in the view until its membership lapses, are not
    // planned on: the prompt is computed.
    assert_eq!((around["hit_blocks"].as_u64(), around["pulled_blocks"].as_u64()), (Some(0), Some(0)), "{around}");
    supervise::reclaim_killed(&base.join("node2"));
    let (status, nodes) = ask(&router, "GET /nodes HTTP/1.1", b"");
    assert_eq!(status, 200);
    assert!(nodes["nodes"][0]["down"].is_null() && nodes["nodes"][1]["down"].is_string(), "{nodes}");
    // Its own metrics say so too, with what it answered.
    let metrics = router_metrics(&router);
    for line in ["lake_router_node_down{node=\"1\"} 0\n", "lake_router_node_down{node=\"2\"} 1\n"] {
        assert!(metrics.contains(line), "{line}: {metrics}");
    }
    assert!(metrics.contains("lake_router_pool_read{what=\"mirror\"} 1\n"), "{metrics}");
    assert!(metrics.contains("lake_router_answers_total{class=\"5xx\"} 1\n"), "the one 503: {metrics}");
    let routed = metric_value(&metrics, "lake_router_routed_total");
    assert!(routed >= 5 && metric_value(&metrics, "lake_router_answers_total{class=\"2xx\"}") > routed, "{metrics}");
    assert!(metric_value(&metrics, "lake_router_routed_ns_total") > routed * 1_000, "{metrics}");

    // A stop: the router exits 0 and says what it answered.
    // SAFETY: a child process of this test, still running.
    unsafe { libc::kill(i32::try_from(router_proc.child.id()).unwrap(), libc::SIGTERM) };
    let stopped = router_proc.wait_for("the router stops", Duration::from_secs(10), |l| l.contains("\"stopped\""));
    assert!(router_proc.child.wait().unwrap().success(), "{stopped}");
    assert!(stopped.contains("\"over_cap\":"), "{stopped}");
    drop(one);
    drop(leader);
}

/// An engine on node 1 attached through the C ABI pulls a prompt only
/// node 2 holds (`lake_pull`): its pool measures what a pulled block
/// cost (`lake_pull_cost`), and `lake_route`, asked to weigh pulls into
/// node 1 at that measure, pulls another prompt node 2 holds where it is
/// below node 1's compute, and computes it where it is above.
fn an_engine_through_the_c_abi_pulls_where_its_measured_pull_beats_computing(serving_one: &str, serving_two: &str) {
    use lake::pool::{
        LakeAttachOptions, LakeBlockKey, LakeNamespaceOptions, lake_attach, lake_detach, lake_lookup_cluster,
        lake_namespace_free, lake_namespace_new, lake_pull, lake_pull_cost,
    };
    use lake::route::{
        LAKE_COST_MEASURED, LAKE_NETWORK_STORAGE, LAKE_ROLE_DECODE, LAKE_ROLE_PREFILL, LakeNodeLoad, LakeRouteMove,
        LakeRoutePlan, LakeRouteRequest, lake_route,
    };
    use lake::status::LakeStatus;

    let ok = |status: LakeStatus, what: &str| assert_eq!(status, LakeStatus::LakeOk, "{what}");
    let options = LakeNamespaceOptions {
        struct_size: size_of::<LakeNamespaceOptions>(),
        tenant_key: [0x42; 32],
        block_tokens: BLOCK_TOKENS,
        model_fingerprint: [0x17; 32],
        extra_keys_digest: [0; 32],
        key_scheme: 1,
    };
    let mut namespace = core::ptr::null_mut();
    // SAFETY: valid options, a writable handle.
    ok(unsafe { lake_namespace_new(&raw const options, &raw mut namespace) }, "namespace");
    let paths: Vec<std::ffi::CString> = ["dp_socket", "mirror", "cp_socket"]
        .iter()
        .map(|name| std::ffi::CString::new(field(serving_one, name)).unwrap())
        .collect();
    let attach = LakeAttachOptions {
        struct_size: size_of::<LakeAttachOptions>(),
        dp_socket: paths[0].as_ptr(),
        mirror_path: paths[1].as_ptr(),
        cp_socket: paths[2].as_ptr(),
        name: c"router-test-c".as_ptr(),
        namespace,
        layout_fingerprint: 11,
        segment_bytes: 16 * 1024,
        pin_agent: 0,
        agent_core: 0,
        copy_threads: 0,
        shard_code: 0,
        object_kind: 1,
        block_bytes: 0,
    };
    let mut pool = core::ptr::null_mut();
    // SAFETY: valid options whose strings outlive the pool; a writable handle.
    ok(unsafe { lake_attach(&raw const attach, &raw mut pool) }, "attach");
    let p = pool.cast_const();
    let c_keys = |keys: &[BlockKey]| keys.iter().map(|k| LakeBlockKey { bytes: k.0 }).collect::<Vec<_>>();
    // Two more prompts only node 2 holds, once node 1's view shows them.
    let (pulled, routed) = (c_keys(&prompt(3, 8).1), c_keys(&prompt(4, 8).1));
    save(serving_two, &prompt(3, 8).1);
    save(serving_two, &prompt(4, 8).1);
    let deadline = Instant::now() + Duration::from_secs(20);
    for keys in [&pulled, &routed] {
        let mut places = vec![lake::pool::LakeBlockWhere::default(); 8];
        loop {
            let mut held = 0;
            // SAFETY: 8 keys, 8 writable places, `held` writable.
            let status = unsafe { lake_lookup_cluster(p, keys.as_ptr(), 8, places.as_mut_ptr(), 8, &raw mut held) };
            if status == LakeStatus::LakeOk && held == 8 {
                break;
            }
            assert!(Instant::now() < deadline, "node 2's prompts never showed in node 1's view");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let mut cost = u64::MAX;
    // SAFETY: `cost` writable.
    ok(unsafe { lake_pull_cost(p, &raw mut cost) }, "pull cost");
    assert_eq!(cost, 0, "no pull yet");
    let mut hits = 0;
    // SAFETY: 8 keys; `hits` writable.
    ok(unsafe { lake_pull(p, pulled.as_ptr(), 8, 10_000, &raw mut hits) }, "pull");
    assert_eq!(hits, 8, "the pulled prompt is node 1's now");
    // SAFETY: `cost` writable.
    ok(unsafe { lake_pull_cost(p, &raw mut cost) }, "pull cost");
    println!("router: node 1's engine measured a pulled block at {cost} ns");
    assert!(cost > 0 && cost < 10_000_000_000, "{cost}");
    // Node 1 alone may run the other prompt.
    let route = |compute_ns_per_block: u64| {
        let loads = [LakeNodeLoad {
            node: 1,
            roles: LAKE_ROLE_PREFILL | LAKE_ROLE_DECODE,
            queue_ns: 0,
            compute_ns_per_block,
            load_ns_per_block: [0, 50_000, 400_000, 3_000_000],
            cnic_ns_per_block: 100_000,
        }];
        let request = LakeRouteRequest {
            struct_size: size_of::<LakeRouteRequest>(),
            keys: routed.as_ptr(),
            count: 8,
            local_node: 1,
            local_l0_blocks: 0,
            l3_blocks: 0,
            policy: 0,
            others: core::ptr::null(),
            others_count: 0,
            loads: loads.as_ptr(),
            loads_count: 1,
            avoid: core::ptr::null(),
            avoid_count: 0,
            pull_ns_per_block: LAKE_COST_MEASURED,
        };
        let (mut plan, mut moves) = (LakeRoutePlan::default(), [LakeRouteMove::default(); 2]);
        // SAFETY: a request whose arrays hold their counts; a writable
        // plan and two writable moves.
        ok(unsafe { lake_route(p, &raw const request, &raw mut plan, moves.as_mut_ptr(), 2) }, "route");
        (plan, moves)
    };
    let (plan, moves) = route(cost.saturating_mul(4));
    assert_eq!((plan.prefill_node, plan.hit_blocks, plan.moves), (1, 8, 1), "{plan:?}");
    let pull = (moves[0].first, moves[0].last, moves[0].from_node, moves[0].to_node, moves[0].network);
    assert_eq!(pull, (0, 8, 2, 1, LAKE_NETWORK_STORAGE), "{moves:?}");
    let (plan, _) = route(cost / 4);
    assert_eq!((plan.hit_blocks, plan.recomputed_blocks), (0, 8), "a pull dearer than computing: {plan:?}");
    // SAFETY: from lake_attach, detached once.
    unsafe { lake_detach(pool) };
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
}

fn bad_requests_are_refused_by_name(router: &str) {
    let post = |body: &str| route_raw(router, body);
    let cases: [(&str, u16, &str); 11] = [
        ("not json", 400, "a JSON object"),
        ("[1, 2]", 400, "a JSON object"),
        ("{\"tokens\": [1]", 400, "the body: EOF"),
        ("{}", 400, "no keys and no tokens"),
        (r#"{"keys": ["0123456789abcdef0123456789abcdef"], "tokens": [1]}"#, 400, "not both"),
        (r#"{"keys": ["0123456789abcdef0123456789abcdef", "zz"]}"#, 400, "keys[1]: invalid value"),
        (r#"{"tokens": [1, -2]}"#, 400, "tokens[1]: invalid value"),
        (r#"{"tokens": [1], "avoid": ["x"]}"#, 400, "avoid[0]"),
        (r#"{"tokens": [1], "policy": "fastest"}"#, 400, "policy: unknown variant"),
        (r#"{"tokens": [1], "avoids": [2]}"#, 400, "unknown field `avoids`"),
        (r#"{"tokens": [1], "blocks": 0}"#, 400, "no blocks"),
    ];
    for (body, status, says) in cases {
        let (got, answer) = post(body);
        let why = answer["error"].as_str().unwrap_or_default().to_owned();
        assert!(got == status && why.contains(says), "{body}: {got} {answer}");
    }
    assert_eq!(ask(router, "GET /route HTTP/1.1", b"").0, 405);
    assert_eq!(ask(router, "GET /elsewhere HTTP/1.1", b"").0, 404);
    // A body past the limit is refused from its head, unread.
    let mut stream = TcpStream::connect(router).unwrap();
    write!(stream, "POST /route HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");
    // Not HTTP at all.
    let mut stream = TcpStream::connect(router).unwrap();
    stream.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
}

fn route_raw(router: &str, body: &str) -> (u16, Value) {
    ask(router, "POST /route HTTP/1.1", body.as_bytes())
}

fn a_flood_of_idle_connections_is_capped_and_outlived(router: &str) {
    // Twice the cap (8), each sending half a request and nothing more.
    let flood: Vec<TcpStream> = (0..16)
        .map(|_| {
            let mut stream = TcpStream::connect(router).unwrap();
            let _ = stream.write_all(b"POST /route HTTP/1.1\r\n");
            stream
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Held past their time, they are closed; the router answers again.
    let started = Instant::now();
    let answer = loop {
        let (status, answer) = ask(router, "GET /healthz HTTP/1.1", b"");
        if status == 200 {
            break answer;
        }
        assert!(started.elapsed() < Duration::from_secs(15), "the router never answered again");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(answer, json!({ "ok": true }));
    println!("router: a flood of 16 idle connections (cap 8) outlived within {:?}", started.elapsed());
    drop(flood);
}
