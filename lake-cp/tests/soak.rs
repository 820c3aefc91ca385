//! Load and soak: engines in other processes run a bounded mixed workload
//! against one pool — lookups, loads of what they find (L1 pins, leased
//! L2 and L3 loads), saves of what they miss, and loads cancelled part
//! way (an aborted request) — over a key universe larger than L1 and L2
//! together, so the tier manager demotes, promotes, moves to L3 and
//! evicts all along. Every delivered block is compared with the bytes its
//! key names; a cancelled load reads nothing past where it was stopped;
//! the pool's process (its `lake-cp` and `lake-dp`) must keep its
//! anonymous memory flat once warm.
//!
//! `LAKE_SOAK_SECS` sets the length: 60 by default (CI), 600 on demand
//! (`LAKE_SOAK_SECS=600 cargo test --release -p lake-cp --test soak --
//! --nocapture`). The engines are this test binary run again as children
//! (`SOAK_CHILD` in their environment).

#![allow(clippy::cast_possible_truncation)] // test arithmetic on small numbers

use std::io::BufRead;
use std::path::Path;
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::{BlockKey, NamespaceId};

const TEST: &str = "engines_in_other_processes_soak_the_pool_with_every_byte_right_and_memory_flat";
const PAYLOAD: usize = 16 * 1024;
/// Blocks of one prompt (a conversation's prefix).
const PROMPT: u32 = 8;
/// Distinct blocks: about 8× what L1 and L2 hold together (L3 holds them
/// all: its catalog is larger).
const UNIVERSE: u32 = 3000;
const ENGINES: usize = 3;
/// Growth of the pool process's anonymous memory allowed after warm-up.
const RSS_GROWTH_MAX_KB: u64 = 24 * 1024;

fn key(block: u32) -> BlockKey {
    let mut bytes = [0x5c; 16];
    bytes[..4].copy_from_slice(&block.to_le_bytes());
    BlockKey(bytes)
}

fn payload(block: u32) -> Vec<u8> {
    (0..PAYLOAD).map(|i| (block.wrapping_mul(2_654_435_761) >> (i % 24)) as u8 ^ (i / 7) as u8).collect()
}

fn agent_config<'a>(mirror: &'a Path, cp: &'a Path) -> AgentConfig<'a> {
    AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror,
        cp_socket: Some(cp),
        name: "soak-engine",
        namespace: NamespaceId(21),
        layout_fingerprint: 0x50a4,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    }
}

/// `RssAnon` of this process, in KiB (the arena and the mirror are shared
/// memory, counted apart).
fn rss_anon_kb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn metric(address: std::net::SocketAddr, name: &str) -> Option<u64> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: lake\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let line = text.lines().find(|l| l.starts_with(name))?;
    line.rsplit(' ').next()?.parse().ok()
}

/// One engine: until `seconds` pass, picks a prompt, loads the prefix the
/// pool has and checks it, saves the rest; prints its counts.
fn child(dp: &Path, mirror: &Path, cp: &Path, seed: u64, seconds: u64) {
    let mut agent = Agent::connect(&agent_config(mirror, cp), dp).expect("the engine attaches");
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let (mut turns, mut delivered, mut wrong, mut saved) = (0u64, 0u64, 0u64, 0u64);
    let (mut cancelled, mut overran) = (0u64, 0u64);
    let mut table = Vec::new();
    while Instant::now() < deadline {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Skewed: a few prompts come back often, most rarely.
        let prompts = u64::from(UNIVERSE / PROMPT);
        let prompt = ((state % prompts) * (((state >> 40) & 3) + 1) / 4) as u32;
        let blocks: Vec<u32> = (prompt * PROMPT..(prompt + 1) * PROMPT).collect();
        let keys: Vec<BlockKey> = blocks.iter().map(|&b| key(b)).collect();
        let hits = agent.lookup(&keys, &mut table);
        if hits > 1 && state.is_multiple_of(5) {
            // The request is aborted after `stop` blocks: the load stops
            // there, its pins and lease let go.
            let stop = 1 + (state >> 20) as usize % (hits - 1);
            let seen = std::cell::Cell::new(0usize);
            let got = agent.fetch_cancellable(&keys[..hits], &table[..hits], &|| seen.get() >= stop, |i, bytes| {
                seen.set(seen.get() + 1);
                if bytes != payload(blocks[i]).as_slice() {
                    wrong += 1;
                }
            });
            delivered += got as u64;
            if got > stop {
                overran += 1;
            }
            if got == stop && agent.last_fetch_failure() == Some(lake_agent::FetchFailure::Cancelled) {
                cancelled += 1;
            }
        } else if hits > 0 {
            delivered += agent.fetch(&keys[..hits], &table[..hits], |i, bytes| {
                if bytes != payload(blocks[i]).as_slice() {
                    wrong += 1;
                }
            }) as u64;
        }
        if hits < keys.len() {
            let payloads: Vec<Vec<u8>> = blocks[hits..].iter().map(|&b| payload(b)).collect();
            let save: Vec<SaveBlock<'_>> = (hits..keys.len())
                .map(|i| SaveBlock {
                    key: keys[i],
                    parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
                    block_index: i as u32,
                    payload: SavePayload::Bytes(&payloads[i - hits]),
                })
                .collect();
            saved += agent.save(&save) as u64;
        }
        turns += 1;
        if turns.is_multiple_of(16) {
            agent.pump();
        }
    }
    println!("DONE {turns} {delivered} {wrong} {saved} {cancelled} {overran} {}", agent.stats.l3_loads);
}

#[test]
fn engines_in_other_processes_soak_the_pool_with_every_byte_right_and_memory_flat() {
    let seconds: u64 = std::env::var("LAKE_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    if let Ok(args) = std::env::var("SOAK_CHILD") {
        let parts: Vec<&str> = args.split('|').collect();
        let seed = parts[3].parse().unwrap();
        child(Path::new(parts[0]), Path::new(parts[1]), Path::new(parts[2]), seed, seconds);
        return;
    }
    // L3 in a directory of its own (the pool removes its own at stop).
    let l3 = std::env::temp_dir().join(format!("lake-cp-soak-l3-{}", std::process::id()));
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: PAYLOAD as u64,
        l1_slots: 128,
        l2_slots_per_file: 128,
        remote_agents: 4,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        l3: Some(lake_dp::runner::config::L3Section {
            objects: 8192,
            ..lake_dp::runner::config::L3Section::dir(l3.clone())
        }),
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-soak-{}", std::process::id())))
    })
    .unwrap();
    let metrics = pool.metrics.unwrap();
    let paths = format!("{}|{}|{}", pool.dp_socket.display(), pool.mirror.display(), pool.cp_socket.display());
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<std::process::Child> = (0..ENGINES)
        .map(|n| {
            std::process::Command::new(&exe)
                .args(["--exact", TEST, "--nocapture"])
                .env("SOAK_CHILD", format!("{paths}|{}", n + 1))
                .env("LAKE_SOAK_SECS", seconds.to_string())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();

    // The pool process's anonymous memory, once a second; warm after a
    // third of the run (its tables full, its queues at their size).
    let started = Instant::now();
    let mut samples = Vec::new();
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(1));
        samples.push((started.elapsed().as_secs(), rss_anon_kb()));
    }
    let mut totals = [0u64; 7];
    for child in &mut children {
        let out = child.stdout.take().unwrap();
        // Read to the end: a closed pipe would fail the child's last prints.
        let lines: Vec<String> = std::io::BufReader::new(out).lines().map_while(Result::ok).collect();
        let line = lines.iter().find(|l| l.starts_with("DONE ")).expect("an engine finished its run");
        let counts: Vec<u64> = line.split(' ').skip(1).map(|n| n.parse().unwrap()).collect();
        for (total, n) in totals.iter_mut().zip(&counts) {
            *total += n;
        }
        assert!(child.wait().unwrap().success(), "an engine failed");
    }
    let [turns, delivered, wrong, saved, cancelled, overran, l3_loads] = totals;
    let to_l3 = metric(metrics, "lake_tier_moves_total{move=\"move_to_l3\"}").unwrap_or(0);
    let promoted = metric(metrics, "lake_dp_blocks_total{event=\"promoted\"}").unwrap_or(0);
    let demoted = metric(metrics, "lake_dp_blocks_total{event=\"demoted\"}").unwrap_or(0);
    let evicted = metric(metrics, "lake_dp_blocks_total{event=\"evicted\"}").unwrap_or(0);
    let warm: Vec<u64> = samples.iter().filter(|(t, _)| *t >= seconds / 3).map(|&(_, kb)| kb).collect();
    let (first, peak) = (warm[0], *warm.iter().max().unwrap());
    println!(
        "{seconds} s, {ENGINES} engines: {turns} turns, {delivered} blocks loaded ({wrong} wrong), {saved} saved; \
         {promoted} promoted, {demoted} demoted, {evicted} evicted, {to_l3} moved to L3, {l3_loads} loaded from L3; \
         {cancelled} loads cancelled part way ({overran} read past their stop); pool RssAnon {first} KiB warm, \
         {peak} KiB peak, {} KiB at the end",
        warm[warm.len() - 1]
    );
    assert_eq!(wrong, 0, "every loaded block holds its key's bytes");
    assert!(delivered > 0 && saved > 0, "the mix loaded and saved");
    assert!(promoted > 0 && demoted > 0 && evicted > 0, "the tiers moved blocks: {promoted} {demoted} {evicted}");
    assert!(to_l3 > 0 && l3_loads > 0, "L3 took blocks ({to_l3}) and gave them back ({l3_loads})");
    assert!(cancelled > 0, "loads were cancelled part way");
    assert_eq!(overran, 0, "a cancelled load read past its stop");
    assert!(peak - first <= RSS_GROWTH_MAX_KB, "the pool's memory grew {} KiB once warm: {samples:?}", peak - first);
    drop(pool.local_ports.drain(..));
    drop(pool.stop());
    let _ = std::fs::remove_dir_all(&l3);
}
