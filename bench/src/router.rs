//! `router`: what `lake route` takes to answer. A node's pool is stood up
//! as its shared memory alone — a mirror holding the first third of each
//! prompt (this node's L1) and a cluster view holding the second third on
//! another node (with `--blocks` other blocks beside them) — and `--nodes`
//! nodes that run both roles. Each request is a prompt of `--prompt`
//! blocks, asked:
//!
//! - in process, by keys and by tokens (`Router::answer`: the JSON read,
//!   keys chained, the hit view read from the mirror and the view, the
//!   route function, the JSON written);
//! - over HTTP on loopback, one kept-alive connection (`lake route`'s
//!   server: the router's answer time as a gateway sees it);
//!
//! against the raw beneath each, in the same run: the lookup of the same
//! keys through mirror and view (`view::lookup`), the route function
//! alone on the same hit view, and a loopback TCP round trip of the same
//! request and answer bytes (an echo of them).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use lake_cp::router::Router;
use lake_cp::router::config::RouterConfig;
use lake_cp::router::server::Server;
use lake_cp::router::signals::Signal;
use lake_dp::mirror::view::{self, ViewReader, ViewWriter};
use lake_dp::mirror::{MirrorBacking, MirrorConfig, MirrorEntry, MirrorReader, MirrorWriter};
use lake_dp::rng::SimRng;
use lake_dp::route::{HitView, LoadView, NodeHits, Policy, PoolRun, Request, route};
use lake_dp::{BlockKey, KeyChain, KeyScheme, Namespace, NodeId, ObjectKind, RegionId, TenantKey, Tier};

use crate::cp_scale::key;
use crate::report::{Report, percentile};

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct RouterArgs {
    /// Other blocks in the node's view, beside the prompts'.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) blocks: usize,
    /// Blocks a prompt (16 tokens each).
    #[arg(long, default_value_t = 128)]
    pub(crate) prompt: usize,
    /// Distinct prompts.
    #[arg(long, default_value_t = 1000)]
    pub(crate) prompts: usize,
    /// Requests of each kind.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) requests: usize,
    /// Nodes that may run requests.
    #[arg(long, default_value_t = 3)]
    pub(crate) nodes: u32,
}

const BLOCK_TOKENS: u32 = 16;

struct Files(Vec<std::path::PathBuf>);

impl Drop for Files {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
        if let Some(dir) = self.0.first().and_then(|p| p.parent()) {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn namespace() -> Result<Namespace, String> {
    Namespace::new(&TenantKey([5; 32]), KeyScheme::TokenIdsV1, BLOCK_TOKENS, [6; 32], [0; 32])
        .map_err(|e| e.to_string())
}

/// The prompts' tokens and keys.
/// A prompt: its tokens and their keys.
type Prompt = (Vec<u32>, Vec<BlockKey>);

fn prompts(args: &RouterArgs) -> Result<Vec<Prompt>, String> {
    let namespace = namespace()?;
    let mut rng = SimRng::new(29);
    (0..args.prompts)
        .map(|_| {
            let tokens: Vec<u32> =
                (0..args.prompt * BLOCK_TOKENS as usize).map(|_| (rng.next_u64() % 150_000) as u32).collect();
            let mut keys = vec![BlockKey::NONE; args.prompt];
            KeyChain::new(&namespace).extend_tokens(&tokens, &mut keys).map_err(|e| e.to_string())?;
            Ok((tokens, keys))
        })
        .collect()
}

/// The pool's shared memory and its `pool.json`, in a directory of its
/// own: each prompt's first third in the mirror, its second third on node
/// 2 in the view.
fn pool(args: &RouterArgs, prompts: &[Prompt]) -> Result<(Files, MirrorWriter, ViewWriter), String> {
    let pid = std::process::id();
    let dir = std::env::temp_dir().join(format!("lake-bench-router-{pid}"));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let (mirror_path, view_path) = (
        std::path::PathBuf::from(format!("/dev/shm/lake-bench-router-mirror-{pid}")),
        std::path::PathBuf::from(format!("/dev/shm/lake-bench-router-view-{pid}")),
    );
    let files = Files(vec![dir.join("pool.json"), mirror_path.clone(), view_path.clone()]);
    let third = args.prompt / 3;
    let entries = (args.prompts * args.prompt) as u64;
    let table = |path: &std::path::Path, entries| MirrorConfig {
        node: NodeId(1),
        ..MirrorConfig::for_entries(MirrorBacking::Shm(path.to_owned()), entries)
    };
    let mut mirror = MirrorWriter::create(&table(&mirror_path, entries)).map_err(|e| e.to_string())?;
    let mut view = ViewWriter::create(&table(&view_path, entries + args.blocks as u64)).map_err(|e| e.to_string())?;
    let here = MirrorEntry {
        kind: ObjectKind::KvBlock,
        tier: Tier::L1Dram,
        tiers: 1 << Tier::L1Dram as u8,
        region: RegionId(0),
        epoch_tag: 0,
        slot: 0,
        generation: 1,
    };
    for (_, keys) in prompts {
        for k in &keys[..third] {
            mirror.upsert(k, &here).map_err(|e| e.to_string())?;
        }
        for k in &keys[third..2 * third] {
            view.set(k, NodeId(2), Some(Tier::L1Dram), ObjectKind::KvBlock).map_err(|e| e.to_string())?;
        }
    }
    let mut rng = SimRng::new(31);
    for i in 0..args.blocks {
        let node = NodeId(2 + u32::try_from(i).unwrap_or(0) % (args.nodes - 1).max(1));
        view.set(&key(&mut rng), node, Some(Tier::L1Dram), ObjectKind::KvBlock).map_err(|e| e.to_string())?;
    }
    let record = format!("{{\"mirror\":\"{}\",\"cluster_view\":\"{}\"}}", mirror_path.display(), view_path.display());
    std::fs::write(dir.join("pool.json"), record).map_err(|e| e.to_string())?;
    Ok((files, mirror, view))
}

fn config(args: &RouterArgs, dir: &std::path::Path) -> Result<RouterConfig, String> {
    let node = |id: u32| {
        format!(
            "[[nodes]]\nid = {id}\nroles = [\"prefill\", \"decode\"]\ncompute_ns_per_block = 545000\n\
             load_ns_per_block = [0, 43000, 390000, 2400000]\npull_ns_per_block = 100000\ncnic_ns_per_block = 94000\n"
        )
    };
    let nodes: String = (1..=args.nodes).map(node).collect();
    let text = format!(
        "listen = \"127.0.0.1:0\"\npool_dir = \"{}\"\n[namespace]\ntenant_key = \"{}\"\nblock_tokens = {BLOCK_TOKENS}\n\
         model_fingerprint = \"{}\"\n{nodes}",
        dir.display(),
        "05".repeat(32),
        "06".repeat(32)
    );
    toml_config(&text)
}

fn toml_config(text: &str) -> Result<RouterConfig, String> {
    let path = std::env::temp_dir().join(format!("lake-bench-router-{}.toml", std::process::id()));
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    let config = RouterConfig::read(&path);
    let _ = std::fs::remove_file(&path);
    config
}

fn hex(keys: &[BlockKey]) -> String {
    let list: Vec<String> =
        keys.iter().map(|k| format!("\"{}\"", k.0.iter().map(|b| format!("{b:02x}")).collect::<String>())).collect();
    format!("{{\"keys\":[{}]}}", list.join(","))
}

fn tokens(tokens: &[u32]) -> String {
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    format!("{{\"tokens\":[{}]}}", list.join(","))
}

/// Nanoseconds of each call of `f` on request `i`, `n` of them.
fn timed(n: usize, mut f: impl FnMut(usize) -> Result<(), String>) -> Result<Vec<f64>, String> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let start = Instant::now();
        f(i)?;
        out.push(start.elapsed().as_nanos() as f64);
    }
    Ok(out)
}

fn summarize(report: &mut Report, name: &str, mut ns: Vec<f64>) -> f64 {
    let p50 = percentile(&mut ns, 500);
    report.float(&format!("{name}_p50_ns"), p50);
    report.float(&format!("{name}_p99_ns"), percentile(&mut ns, 990));
    p50
}

pub(crate) fn run(args: &RouterArgs) -> Result<Report, String> {
    if args.prompt < 3 || args.prompts == 0 || args.requests == 0 || args.nodes < 2 {
        return Err("--prompt at least 3, --prompts and --requests positive, --nodes at least 2".into());
    }
    let prompts = prompts(args)?;
    let (files, _mirror, _view) = pool(args, &prompts)?;
    let dir = files.0[0].parent().ok_or("no directory")?.to_owned();
    let mut router = Router::new(config(args, &dir)?)?;
    // The nodes' signals: read at once (no addresses to ask).
    std::thread::sleep(Duration::from_millis(100));
    let mut report = Report::new("router");
    report.int("prompt_blocks", args.prompt as u64);
    report.int("view_blocks", (args.blocks + args.prompts * (args.prompt / 3)) as u64);
    report.int("nodes", u64::from(args.nodes));
    let bodies: Vec<(String, String)> = prompts.iter().map(|(t, k)| (hex(k), tokens(t))).collect();
    let pick = |i: usize| (i.wrapping_mul(2_654_435_761)) % prompts.len();
    let blocks = u32::try_from(args.prompt).map_err(|_| "--prompt: too long")?;
    let third = blocks / 3;
    let check = |answer: &serde_json::Value| {
        if answer["hit_blocks"].as_u64() == Some(u64::from(2 * third)) {
            Ok(())
        } else {
            Err(format!("an answer that missed the prefix: {answer}"))
        }
    };
    let keyed = timed(args.requests, |i| {
        let (status, answer) = router.answer("POST", "/route", bodies[pick(i)].0.as_bytes());
        if status != 200 { Err(format!("{status} {answer}")) } else { check(&answer) }
    })?;
    let keyed_p50 = summarize(&mut report, "answer_keys", keyed);
    let tokened = timed(args.requests, |i| {
        let (status, answer) = router.answer("POST", "/route", bodies[pick(i)].1.as_bytes());
        if status != 200 { Err(format!("{status} {answer}")) } else { check(&answer) }
    })?;
    summarize(&mut report, "answer_tokens", tokened);

    // The raw beneath: the same keys' lookup, and the route function on
    // the hit view they give.
    let mirror = MirrorReader::attach(&files.0[1]).map_err(|e| e.to_string())?;
    let view = ViewReader::attach(&files.0[2]).map_err(|e| e.to_string())?;
    let mut places = Vec::new();
    let lookup = timed(args.requests, |i| {
        let found = view::lookup(&mirror, Some(&view), std::hint::black_box(&prompts[pick(i)].1), &mut places);
        if found == 2 * third as usize { Ok(()) } else { Err(format!("the lookup found {found}")) }
    })?;
    let lookup_p50 = summarize(&mut report, "raw_lookup", lookup);
    let hits = HitView {
        nodes: vec![NodeHits { node: NodeId(1), through: [0, third, third, third] }],
        l3_through: 0,
        pool: vec![
            PoolRun { first: 0, last: third, node: NodeId(1), tier: Tier::L1Dram },
            PoolRun { first: third, last: 2 * third, node: NodeId(2), tier: Tier::L1Dram },
        ],
    };
    let loads = LoadView { nodes: router.config().nodes.iter().map(|n| n.load_with(&Signal::default())).collect() };
    let request = Request { blocks, avoid: Vec::new() };
    let routed = timed(args.requests, |_| {
        let plan = route(&request, std::hint::black_box(&hits), &loads, Policy::Any);
        plan.map(|_| ()).map_err(|e| format!("{e:?}"))
    })?;
    let route_p50 = summarize(&mut report, "raw_route", routed);
    report.float("answer_keys_vs_lookup_and_route", keyed_p50 / (lookup_p50 + route_p50));

    http(args, router, &bodies, &mut report)?;
    drop(files);
    Ok(report)
}

/// The same requests over HTTP on loopback, one kept-alive connection,
/// against an echo of the same bytes.
fn http(args: &RouterArgs, router: Router, bodies: &[(String, String)], report: &mut Report) -> Result<(), String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = std::sync::Arc::clone(&stop);
    let server = std::thread::spawn(move || -> Result<(), String> {
        let mut router = router;
        let mut server = Server::new(listener, 16).map_err(|e| e.to_string())?;
        server.run(&mut router, || stopping.load(std::sync::atomic::Ordering::Relaxed)).map_err(|e| e.to_string())
    });
    let mut stream = TcpStream::connect(address).map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let pick = |i: usize| (i.wrapping_mul(2_654_435_761)) % bodies.len();
    let mut answer_bytes = 0usize;
    let mut buffer = vec![0u8; 1 << 16];
    let asked = timed(args.requests, |i| {
        let body = &bodies[pick(i)].0;
        let head = format!("POST /route HTTP/1.1\r\nHost: bench\r\nContent-Length: {}\r\n\r\n", body.len());
        stream.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
        stream.write_all(body.as_bytes()).map_err(|e| e.to_string())?;
        let got = read_answer(&mut stream, &mut buffer)?;
        answer_bytes = answer_bytes.max(got);
        Ok(())
    })?;
    let http_p50 = summarize(report, "answer_http", asked);
    drop(stream);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    server.join().map_err(|_| "the server panicked")??;

    // The raw: the same request bytes out and answer bytes back, echoed.
    let echo = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let echo_address = echo.local_addr().map_err(|e| e.to_string())?;
    let request_bytes = bodies[0].0.len() + 64;
    let echoer = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = echo.accept()?;
        stream.set_nodelay(true)?;
        let (mut input, output) = (vec![0u8; request_bytes], vec![b'x'; answer_bytes]);
        while stream.read_exact(&mut input).is_ok() {
            stream.write_all(&output)?;
        }
        Ok(())
    });
    let mut stream = TcpStream::connect(echo_address).map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let (request, mut answer) = (vec![b'r'; request_bytes], vec![0u8; answer_bytes]);
    let echoed = timed(args.requests, |_| {
        stream.write_all(&request).map_err(|e| e.to_string())?;
        stream.read_exact(&mut answer).map_err(|e| e.to_string())
    })?;
    let echo_p50 = summarize(report, "raw_tcp_roundtrip", echoed);
    drop(stream);
    let _ = echoer.join();
    report.float("answer_http_vs_tcp_roundtrip", http_p50 / echo_p50);
    report.int("answer_bytes", answer_bytes as u64);
    Ok(())
}

/// Reads one answer (head, then its Content-Length of body); its bytes.
fn read_answer(stream: &mut TcpStream, buffer: &mut [u8]) -> Result<usize, String> {
    let mut have = 0;
    loop {
        let n = stream.read(&mut buffer[have..]).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("the router closed the connection".into());
        }
        have += n;
        let text = &buffer[..have];
        if let Some(end) = text.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&text[..end]).map_err(|e| e.to_string())?;
            if !head.starts_with("HTTP/1.1 200") {
                return Err(format!("the router answered {head}"));
            }
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or("no Content-Length")?;
            if have >= end + 4 + length {
                return Ok(have);
            }
        }
    }
}
