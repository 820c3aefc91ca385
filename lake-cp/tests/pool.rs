//! The whole single-node pool, each part real: `lake-cp` (server, tier
//! manager, mirror) on one thread, a `lake-dp` runner (io_uring on files,
//! the L1 arena in /dev/shm) on another, and an engine's agent on the
//! test's thread. The agent saves more than L1 holds; the control plane
//! demotes the coldest leaves to L2; a later lookup finds the whole prompt
//! across both tiers, and fetching it promotes the L2 blocks back through
//! leases — every payload byte checked.

use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload, SaveStatus};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_cp::tier::TierConfig;
use lake_dp::{BlockKey, NamespaceId, Tier};

const PAYLOAD: usize = 60 * 1024;

fn key(prompt: u8, block: u32) -> BlockKey {
    let mut bytes = [0x5a; 16];
    bytes[0] = prompt;
    bytes[1..5].copy_from_slice(&block.to_le_bytes());
    BlockKey(bytes)
}

fn payload(key: &BlockKey) -> Vec<u8> {
    (0..PAYLOAD).map(|i| key.0[i % 5] ^ (i / 7).to_le_bytes()[0]).collect()
}

/// One prompt's blocks to save: each the child of the one before.
fn chain<'a>(keys: &[BlockKey], payloads: &'a [Vec<u8>]) -> Vec<SaveBlock<'a>> {
    (0..keys.len())
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: SavePayload::Bytes(&payloads[i]),
        })
        .collect()
}

/// Held by the tests whose assertions depend on the tier manager's timing
/// (the flood below saturates both of CI's cores; beside it, the
/// leaf-first order of a slower test's demotions was seen to slip).
static TIMING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test engine's agent, in-process, on the pool's first local port.
fn attach(pool: &mut EmbeddedPool) -> Agent {
    let config = AgentConfig {
        arena: &pool.arena,
        mirror: &pool.mirror,
        cp_socket: Some(&pool.cp_socket),
        name: "test-engine",
        namespace: NamespaceId(7),
        layout_fingerprint: 0xfeed,
        segment_bytes: 16 * 1024,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::attach(&config, pool.local_ports.remove(0)).unwrap()
}

#[test]
fn saves_overflow_l1_into_l2_and_fetching_promotes_them_back() {
    let _alone = TIMING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 64,
        l2_slots_per_file: 128,
        local_agents: 1,
        remote_agents: 1,
        tiers: TierConfig { high_percent: 80, low_percent: 60, ..TierConfig::default() },
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-pool-{}", std::process::id())))
    })
    .unwrap();
    let metrics = pool.metrics.unwrap();
    let mut agent = attach(&mut pool);

    // Prompt A: 48 blocks. Prompt B: A's first 16 (a shared system
    // prompt), then 40 of its own. Together more than L1's 64 slots.
    let prompt_a: Vec<BlockKey> = (0..48).map(|i| key(1, i)).collect();
    let prompt_b: Vec<BlockKey> = prompt_a[..16].iter().copied().chain((16..56).map(|i| key(2, i))).collect();
    let save = |agent: &mut Agent, keys: &[BlockKey], from: usize| {
        let payloads: Vec<Vec<u8>> = keys[from..].iter().map(payload).collect();
        let blocks: Vec<SaveBlock<'_>> = (from..keys.len())
            .map(|i| SaveBlock {
                key: keys[i],
                parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
                block_index: u32::try_from(i).unwrap(),
                payload: SavePayload::Bytes(&payloads[i - from]),
            })
            .collect();
        // Eight blocks a forward pass, as an engine saves; L1 is kept under
        // its high-water mark meanwhile. A save refused (saves are best
        // effort: on a loaded machine demotion can fall behind) is offered
        // again, so the prompt ends whole.
        let mut saved = 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        for (i, block) in blocks.iter().enumerate() {
            while agent.save(std::slice::from_ref(block)) != 1 {
                if Instant::now() > deadline {
                    return saved;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            saved += 1;
            if i % 8 == 7 {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        saved
    };
    assert_eq!(save(&mut agent, &prompt_a, 0), 48);
    assert_eq!(save(&mut agent, &prompt_b, 16), 40);

    // Both prompts are found whole, across the tiers, once the demotions
    // have landed.
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a = agent.lookup(&prompt_a, &mut table);
        let in_l2 = table.iter().filter(|e| e.tier == Tier::L2Nvme).count();
        if a == 48 && in_l2 > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "prompt A: {a} hits, {in_l2} in L2");
        std::thread::sleep(Duration::from_millis(10));
    }
    let in_l2 = table.iter().filter(|e| e.tier == Tier::L2Nvme).count() as u64;
    // Leaf-first: A's shared head leaves L1 only after the whole of A's
    // tail did. (How deep L1 went down is the tier manager's: it chooses
    // victims a quarter of L1 ahead of demand, and a save takes several
    // at once.)
    let head_gone = table[..16].iter().any(|e| e.tier != Tier::L1Dram);
    let tail_in_l1 = table[16..].iter().any(|e| e.tier == Tier::L1Dram);
    assert!(!(head_gone && tail_in_l1), "the shared head left L1 before A's tail: {table:?}");
    assert!(table[16..].iter().any(|e| e.tier == Tier::L2Nvme), "A's tail went down first: {table:?}");

    let mut seen = [false; 48];
    let delivered = agent.fetch(&prompt_a, &table, |i, bytes| {
        assert_eq!(bytes, &payload(&prompt_a[i])[..], "block {i}");
        seen[i] = true;
    });
    assert_eq!(delivered, 48, "{:?}", agent.stats);
    assert!(seen.iter().all(|&s| s));
    assert_eq!(agent.stats.l2_loads, in_l2);
    let hits_b = agent.lookup(&prompt_b, &mut table);
    assert_eq!(hits_b, 56);

    // The operator's view: tier bytes, moves, hits, the data plane's own
    // figures.
    let text = http_get(metrics, "/metrics");
    let value = |line: &str| -> u64 {
        let found = text.lines().find(|l| l.starts_with(line)).unwrap_or_else(|| panic!("no {line} in {text}"));
        found.rsplit(' ').next().unwrap().parse().unwrap()
    };
    // Demoted, or written below ahead of demand (then dropped from L1).
    assert!(
        value("lake_tier_moves_total{move=\"demote_l1_l2\"}") + value("lake_tier_moves_total{move=\"clean_l1_l2\"}")
            > 0
    );
    assert!(value("lake_tier_bytes{tier=\"L2\"}") > 0);
    assert!(value("lake_cp_lookup_blocks_total{result=\"hit\"}") >= 48);
    assert!(text.contains("lake_dp_pins "), "{text}");
    // Every path the blocks took is timed and counted: the demotions' L2
    // writes, and the L2 reads the fetch waited on (sent with the data
    // plane's stats, once a second).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = http_get(metrics, "/metrics");
        let count = |path: &str| -> u64 {
            let name = format!("lake_path_latency_seconds_count{{path=\"{path}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(name.as_str())).map_or(0, |v| v.parse().unwrap())
        };
        // And the engine's own side, as its agent saw it (sent by the agent
        // once a second, with its pump): every L1 hit it read, every L2
        // block it waited for.
        if count("l2_write") >= stats_demotions_floor(&text)
            && count("l2_read_critical") >= in_l2
            && count("l2_write") > 0
            && count("agent_read_l1") >= 48 - in_l2
            && count("agent_load_l2") >= in_l2
        {
            assert!(text.contains("lake_path_latency_seconds_bucket{path=\"l2_read_critical\",le=\"+Inf\"}"));
            assert!(text.contains("lake_path_latency_seconds_bucket{path=\"agent_load_l2\",le=\"+Inf\"}"));
            assert_eq!(count("agent_load_l3"), 0, "{text}");
            break;
        }
        agent.pump();
        assert!(Instant::now() < deadline, "paths not timed: {text}");
        std::thread::sleep(Duration::from_millis(100));
    }

    drop(agent);
    let (stats, server) = pool.stop().unwrap();
    assert!(stats.pool.saves >= 88, "{stats:?}");
    assert!(stats.pool.demotions + stats.pool.write_backs > 0 && stats.pool.promotions >= in_l2, "{stats:?}");
    assert_eq!((stats.pool.commits_corrupt, stats.pool.commands_failed), (0, 0), "{stats:?}");
    let counters = server.node().tiers.counters;
    assert!(counters.demotions >= stats.pool.demotions, "{counters:?}");
    assert_eq!(counters.failed, 0, "{counters:?}");
    assert_eq!(server.counters.bad_frames, 0);
}

/// The demotions `lake-cp` counted (each an L2 write the data plane timed).
fn stats_demotions_floor(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("lake_tier_moves_total{move=\"demote_l1_l2\"} "))
        .map_or(0, |v| v.parse().unwrap())
}

fn http_get(address: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: lake\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    response
}

/// The segment CRCs of each payload, as `agent` cuts them.
fn segment_crcs(agent: &Agent, payloads: &[Vec<u8>]) -> Vec<Vec<u32>> {
    let segment = usize::try_from(agent.segment_bytes_for(PAYLOAD as u64)).unwrap();
    payloads.iter().map(|p| p.chunks(segment).map(crc32fast::hash).collect()).collect()
}

/// A small pool with one local engine port, in a directory of its own
/// named after `name`.
fn one_engine_pool(name: &str) -> EmbeddedConfig {
    EmbeddedConfig {
        l1_slots: 32,
        l2_slots_per_file: 32,
        local_agents: 1,
        remote_agents: 0,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-{name}-{}", std::process::id())))
    }
}

/// `keys` as one prompt's prepared saves (each block the parent of the
/// next), with `crcs` computed by `origin`.
fn prepared_chain<'a>(
    keys: &[BlockKey],
    crcs: &'a [Vec<u32>],
    origin: lake_agent::CrcOrigin,
) -> Vec<lake_agent::PreparedSave<'a>> {
    (0..keys.len())
        .map(|i| lake_agent::PreparedSave {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            len: PAYLOAD,
            crcs: &crcs[i],
            crcs_from: origin,
        })
        .collect()
}

/// An agent that commits bytes its CRCs do not describe (a GPU gather
/// that had not landed, a bug): checked inline, the commit is refused;
/// checked in the background (by the check's own thread), the block is
/// published, then found out, evicted as corrupt and gone from the mirror
/// — the sound blocks beside it stay, read through and counted. The
/// default (`Auto`) does the latter for CRCs Lake's kernel computed, the
/// former for CRCs whose origin the agent does not say.
#[test]
fn a_commit_whose_bytes_lie_is_refused_inline_and_evicted_in_the_background() {
    use lake_agent::CrcOrigin;
    use lake_dp::runner::pool::CommitCheck;
    assert_eq!(CommitCheck::default(), CommitCheck::Auto);
    let cases = [
        (CommitCheck::Inline, CrcOrigin::Kernel),
        (CommitCheck::Background, CrcOrigin::Unknown),
        (CommitCheck::Auto, CrcOrigin::Kernel),
        (CommitCheck::Auto, CrcOrigin::Unknown),
    ];
    for (check, origin) in cases {
        let inline = !check.publishes_first(origin);
        let mut pool = EmbeddedPool::start(&EmbeddedConfig {
            commit_check: check,
            ..one_engine_pool(&format!("check-{check:?}-{origin:?}"))
        })
        .unwrap();
        let mut agent = attach(&mut pool);
        let keys: Vec<BlockKey> = (0..4).map(|i| key(9, i)).collect();
        let payloads: Vec<Vec<u8>> = keys.iter().map(payload).collect();
        let segment = usize::try_from(agent.segment_bytes_for(PAYLOAD as u64)).unwrap();
        let crcs = segment_crcs(&agent, &payloads);
        let blocks = prepared_chain(&keys, &crcs, origin);
        // Block 3's third segment is written wrong.
        let mut statuses = [SaveStatus::NotSent; 4];
        let committed = agent.save_prepared(&blocks, &mut statuses, |bodies| {
            for &(i, body) in bodies {
                let mut bytes = payloads[i].clone();
                if i == 3 {
                    bytes[2 * segment + 5] ^= 0x40;
                }
                // SAFETY: a reserved slot's payload area of PAYLOAD bytes.
                unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), body, PAYLOAD) };
            }
            true
        });
        let mut table = Vec::new();
        let settled = |agent: &mut Agent, table: &mut Vec<_>, want: usize| {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let hits = agent.lookup(&keys, table);
                if hits == want {
                    return;
                }
                assert!(Instant::now() < deadline, "{check:?}, {origin:?}: {hits} hits, never {want}");
                std::thread::sleep(Duration::from_millis(5));
            }
        };
        match inline {
            true => {
                assert_eq!(committed, 3, "{check:?}, {origin:?}: the lying commit is refused");
                let refused = SaveStatus::Refused(lake_agent::port::AgentError::Corrupt);
                assert_eq!(statuses, [SaveStatus::Saved, SaveStatus::Saved, SaveStatus::Saved, refused]);
            }
            false => assert_eq!(committed, 4, "{check:?}, {origin:?}: published before its payload is read"),
        }
        // Either way the mirror ends with the three sound blocks. Checked
        // in the background, three hits may be seen before the fourth is
        // published: the check's eviction is given time to come.
        settled(&mut agent, &mut table, 3);
        if !inline {
            std::thread::sleep(Duration::from_millis(500));
            settled(&mut agent, &mut table, 3);
        }
        let delivered = agent.fetch(&keys[..3], &table[..3], |i, bytes| assert_eq!(bytes, &payloads[i][..]));
        assert_eq!(delivered, 3);
        drop(agent);
        let (stats, _server) = pool.stop().unwrap();
        match inline {
            true => {
                assert_eq!((stats.pool.commits_corrupt, stats.pool.commits_corrupt_late), (1, 0), "{stats:?}");
            }
            false => {
                assert_eq!((stats.pool.commits_corrupt, stats.pool.commits_corrupt_late), (0, 1), "{stats:?}");
                assert_eq!(stats.pool.commits_verified, 3, "{stats:?}");
            }
        }
    }
}

/// A save in turns (a GPU save fills one turn's slots while it reserves
/// the next): the next turn is reserved before the one before is
/// committed, so a refused commit is known only after its children hold
/// slots. Those children are not committed — aborted, `ParentUnsaved` —
/// and the pool publishes the prefix up to the refused block, no further.
#[test]
fn a_turn_whose_parent_was_refused_at_commit_is_not_committed() {
    use lake_agent::CrcOrigin;
    use lake_agent::port::AgentError;
    let mut pool = EmbeddedPool::start(&one_engine_pool("turns")).unwrap();
    let mut agent = attach(&mut pool);
    let keys: Vec<BlockKey> = (0..4).map(|i| key(11, i)).collect();
    let payloads: Vec<Vec<u8>> = keys.iter().map(payload).collect();
    let crcs = segment_crcs(&agent, &payloads);
    // CRCs of unknown origin: checked before publishing (the default
    // check), so the lie below is refused at commit.
    let blocks = prepared_chain(&keys, &crcs, CrcOrigin::Unknown);
    let fill = |bodies: &[(usize, *mut u8)], first: usize, lie: Option<usize>| {
        for &(i, body) in bodies {
            let mut bytes = payloads[first + i].clone();
            if Some(first + i) == lie {
                bytes[7] ^= 1;
            }
            // SAFETY: a reserved slot's payload area of PAYLOAD bytes.
            unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), body, PAYLOAD) };
        }
    };
    let mut statuses = [SaveStatus::NotSent; 4];
    agent.forget_unsaved_of(&keys);
    let (front, back) = statuses.split_at_mut(2);
    // Turn one: blocks 0 and 1, block 1's bytes lie.
    let one = agent.reserve_prepared(&blocks[..2], front);
    fill(&one.bodies, 0, Some(1));
    // Turn two reserved before turn one is committed.
    let two = agent.reserve_prepared(&blocks[2..], back);
    assert_eq!(two.bodies.len(), 2, "turn two holds its slots");
    fill(&two.bodies, 2, None);
    let sent = agent.commit_prepared(one, &blocks[..2], true, front);
    assert_eq!(agent.await_prepared(sent, &blocks[..2], front), 1);
    let sent = agent.commit_prepared(two, &blocks[2..], true, back);
    assert_eq!(agent.await_prepared(sent, &blocks[2..], back), 0, "{statuses:?}");
    assert_eq!(
        statuses,
        [
            SaveStatus::Saved,
            SaveStatus::Refused(AgentError::Corrupt),
            SaveStatus::ParentUnsaved,
            SaveStatus::ParentUnsaved,
        ]
    );
    drop(agent);
    let (stats, _server) = pool.stop().unwrap();
    assert_eq!(stats.pool.saves, 1, "{stats:?}");
}

/// A turn's CRCs may still be on their way when it is reserved (a GPU
/// save computes each turn's CRCs beside its copies): its slots are
/// reserved from the keys alone and the headers written at the commit,
/// with the CRCs known then. The blocks are served exact; a block whose
/// CRCs do not fit its payload is aborted at the commit (`Invalid`), and
/// its child with it.
#[test]
fn a_turn_is_reserved_before_its_crcs_are_known_and_headed_at_commit() {
    use lake_agent::CrcOrigin;
    use lake_agent::port::AgentError;
    let mut pool = EmbeddedPool::start(&one_engine_pool("late-crcs")).unwrap();
    let mut agent = attach(&mut pool);
    let keys: Vec<BlockKey> = (0..5).map(|i| key(12, i)).collect();
    let payloads: Vec<Vec<u8>> = keys.iter().map(payload).collect();
    let crcs = segment_crcs(&agent, &payloads);
    let unknown: Vec<Vec<u32>> = vec![Vec::new(); keys.len()];
    let mut statuses = [SaveStatus::NotSent; 5];
    agent.forget_unsaved_of(&keys);
    let reserving = prepared_chain(&keys, &unknown, CrcOrigin::Kernel);
    let turn = agent.reserve_prepared(&reserving, &mut statuses);
    assert_eq!(turn.bodies.len(), 5, "every block holds a slot with no CRCs yet: {statuses:?}");
    for &(i, body) in &turn.bodies {
        // SAFETY: a reserved slot's payload area of PAYLOAD bytes.
        unsafe { core::ptr::copy_nonoverlapping(payloads[i].as_ptr(), body, PAYLOAD) };
    }
    // Block 3's CRCs come short by one segment.
    let mut known = crcs.clone();
    known[3].pop();
    let committing = prepared_chain(&keys, &known, CrcOrigin::Kernel);
    let sent = agent.commit_prepared(turn, &committing, true, &mut statuses);
    assert_eq!(agent.await_prepared(sent, &committing, &mut statuses), 3);
    assert_eq!(
        statuses,
        [
            SaveStatus::Saved,
            SaveStatus::Saved,
            SaveStatus::Saved,
            SaveStatus::Refused(AgentError::Invalid),
            SaveStatus::ParentUnsaved,
        ]
    );
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while agent.lookup(&keys, &mut table) < 3 {
        assert!(Instant::now() < deadline, "the three headed blocks never showed in the mirror");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(agent.lookup(&keys, &mut table), 3, "only the prefix up to the short block");
    let delivered = agent.fetch(&keys[..3], &table[..3], |i, bytes| assert_eq!(bytes, &payloads[i][..]));
    assert_eq!(delivered, 3);
    drop(agent);
    let (stats, _server) = pool.stop().unwrap();
    assert_eq!(stats.pool.commits_corrupt + stats.pool.commits_corrupt_late, 0, "{stats:?}");
}

/// One save of more blocks than the agent's port has request slots (256)
/// is carried out whole: it goes in windows, and a full ring is not taken
/// for a full pool (it was: every block past the 256th came back skipped).
#[test]
fn a_save_larger_than_the_port_is_saved_whole() {
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: 4096,
        l2_slots_per_file: 64,
        local_agents: 1,
        remote_agents: 1,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-pool-big-{}", std::process::id())))
    })
    .unwrap();
    let mut agent = attach(&mut pool);
    let keys: Vec<BlockKey> = (0..600).map(|i| key(9, i)).collect();
    let payloads: Vec<Vec<u8>> = keys.iter().map(|k| payload(k)[..4096].to_vec()).collect();
    let blocks = chain(&keys, &payloads);
    assert_eq!(agent.save(&blocks), 600);
    assert_eq!(agent.stats.saves_skipped, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut table = Vec::new();
    while agent.lookup(&keys, &mut table) < 600 {
        assert!(Instant::now() < deadline, "the 600 blocks never all showed in the mirror");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(agent);
    pool.stop().unwrap();
}

/// An engine waiting for a block to be published (a pull's wait) sleeps on
/// the mirror and is woken as `lake-cp` publishes it, not at its timeout.
#[test]
fn a_reader_waiting_on_the_mirror_is_woken_when_the_pool_publishes_a_block() {
    let mut pool = EmbeddedPool::start(&one_engine_pool("wake")).unwrap();
    let mut agent = attach(&mut pool);
    let reader = lake_dp::mirror::MirrorReader::attach(&pool.mirror).unwrap();
    let key = key(3, 0);
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        loop {
            let seen = reader.writes();
            if reader.get(&key).is_hit() {
                return start.elapsed();
            }
            reader.wait_for_writes(seen, Duration::from_secs(10));
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    let payloads = [payload(&key)];
    assert_eq!(agent.save(&chain(&[key], &payloads)), 1);
    let waited = waiter.join().unwrap();
    assert!(waited < Duration::from_secs(5), "woken at its timeout, not as the block was published: {waited:?}");
    drop(agent);
    pool.stop().unwrap();
}

/// A pool that began to stop (it writes L1 down before its data plane
/// goes) takes no new save: a block acked then would be lost with L1.
/// Each is refused `Stopping`, the agent sees the pool under save
/// pressure without asking, and a later save under a refused block is not
/// sent at all; what was saved before is still served.
#[test]
fn saves_after_the_pool_began_to_stop_are_refused_as_stopping() {
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 64,
        l2_slots_per_file: 64,
        local_agents: 1,
        remote_agents: 1,
        durable: true,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-cp-pool-stopping-{}", std::process::id())))
    })
    .unwrap();
    let mut agent = attach(&mut pool);
    let keys: Vec<BlockKey> = (0..12).map(|i| key(11, i)).collect();
    let payloads: Vec<Vec<u8>> = keys.iter().map(payload).collect();
    let blocks = chain(&keys, &payloads);
    let mut statuses = vec![SaveStatus::NotSent; 4];
    assert_eq!(agent.save_with_statuses(&blocks[..4], &mut statuses), 4);
    assert!(statuses.iter().all(|s| *s == SaveStatus::Saved), "{statuses:?}");
    assert!(!agent.save_pressure());

    let (left, _) = pool.empty_l1();
    assert_eq!(left, 0, "L1 written down");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !agent.save_pressure() {
        assert!(Instant::now() < deadline, "the agent never saw the pool refuse saves");
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut statuses = vec![SaveStatus::NotSent; 4];
    assert_eq!(agent.save_with_statuses(&blocks[4..8], &mut statuses), 0);
    assert_eq!(statuses[0], SaveStatus::Refused(lake_agent::port::AgentError::Stopping), "{statuses:?}");
    assert!(statuses[1..].iter().all(|s| *s == SaveStatus::ParentUnsaved), "{statuses:?}");
    // The rest of the prompt, in a call of its own: under a block not
    // saved, nothing is sent.
    let mut statuses = vec![SaveStatus::NotSent; 4];
    assert_eq!(agent.save_with_statuses(&blocks[8..], &mut statuses), 0);
    assert!(statuses.iter().all(|s| *s == SaveStatus::ParentUnsaved), "{statuses:?}");

    // What was saved before is whole and served.
    let mut table = Vec::new();
    assert_eq!(agent.lookup(&keys, &mut table), 4);
    let mut seen = 0;
    let delivered = agent.fetch(&keys[..4], &table[..4], |i, bytes| {
        assert_eq!(bytes, &payloads[i][..], "block {i}");
        seen += 1;
    });
    assert_eq!((delivered, seen), (4, 4), "{:?}", agent.stats);
    drop(agent);
    let (stats, _) = pool.stop().unwrap();
    // The first call's four asked, the second's none.
    assert_eq!((stats.pool.saves_refused, stats.pool.saves_refused_stopping), (4, 4), "{stats:?}");
}

/// Loads on a request's critical path under a flood of saves into a full
/// L1: the last free L1 slots are kept from saves (the load reserve), and
/// a load that finds neither a free slot nor a marked victim waits for the
/// control plane's next marks, as a save does, so almost every load is
/// answered at its first ask. What remains is victim starvation: two
/// writers saving as fast as the pool takes them outrun demotion into a
/// 64-slot L1 (blocks under 100 ms old are not written below, under 250 ms
/// not dropped), and a load then waits its 50 ms and is asked again — 2–6
/// of 150 loads on the 2-core VM, with the reserve or without it (10–17
/// before loads waited for marks; none, either way, with writers paced at
/// one save per 0.3–1 ms each). A reserve that would keep L1 under its
/// high-water mark, so nothing were ever demoted, is refused.
#[test]
fn loads_find_the_l1_slots_a_flood_of_saves_leaves_them() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let _alone = TIMING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);

    let dir = std::env::temp_dir().join(format!("lake-cp-pool-reserve-{}", std::process::id()));
    let refused = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 64,
        l1_load_reserve: Some(4),
        ..EmbeddedConfig::new(dir.join("refused"))
    });
    // Refused as settings: `lake serve` exits 2 for it.
    let Err(lake_cp::embedded::ServeError::Settings(error)) = refused else {
        panic!("a reserve of 4 of 64 slots at a 95% mark was not refused as settings: {refused:?}")
    };
    assert!(error.contains("at most 3"), "{error}");

    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        l1_slots: 64,
        l2_slots_per_file: 512,
        local_agents: 3,
        remote_agents: 1,
        ..EmbeddedConfig::new(dir.join("pool"))
    })
    .unwrap();
    assert_eq!(pool.load_reserve_slots, 3, "64 slots at a 95% high-water mark leave 3 above it");
    let mut reader = attach(&mut pool);
    let set: Vec<BlockKey> = (0..256).map(|n| key(1, n)).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for key in &set {
        let bytes = payload(key);
        let block =
            SaveBlock { key: *key, parent: BlockKey::NONE, block_index: 0, payload: SavePayload::Bytes(&bytes) };
        while reader.save(std::slice::from_ref(&block)) != 1 {
            assert!(Instant::now() < deadline, "the set could not be saved");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let (saved, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let writers: Vec<_> = (0..2u8)
        .map(|w| {
            let mut writer = attach(&mut pool);
            let (stop, saved, refused) = (Arc::clone(&stop), Arc::clone(&saved), Arc::clone(&refused));
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Acquire) {
                    let key = key(10 + w, n);
                    n += 1;
                    let bytes = payload(&key);
                    let block =
                        SaveBlock { key, parent: BlockKey::NONE, block_index: 0, payload: SavePayload::Bytes(&bytes) };
                    if writer.save(std::slice::from_ref(&block)) == 1 {
                        saved.fetch_add(1, Ordering::Relaxed);
                    } else {
                        refused.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));

    // Traced loads: the agent keeps a span of each ask of the data plane.
    reader.set_trace(0x5e7);
    let (mut loads, mut asked_again, mut table, mut pick) = (0u32, 0u32, Vec::new(), 7u64);
    let deadline = Instant::now() + Duration::from_secs(30);
    while loads < 150 && Instant::now() < deadline {
        pick = pick.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let key = set[(pick >> 33) as usize % set.len()];
        if reader.lookup(&[key], &mut table) != 1 || table[0].tier != Tier::L2Nvme {
            continue;
        }
        let expected = payload(&key);
        let fetched =
            reader.fetch(&[key], &table, |_, bytes| assert_eq!(bytes, &expected[..], "a loaded block's bytes"));
        let mut asks = 0;
        reader.take_spans(|_| asks += 1);
        if fetched == 1 {
            loads += 1;
            asked_again += u32::from(asks > 1);
        }
    }
    stop.store(true, Ordering::Release);
    for writer in writers {
        writer.join().unwrap();
    }
    drop(reader);
    let (stats, _) = pool.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    let (saved, refused) = (saved.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    let taken = stats.pool.victims_clean + stats.pool.victims_dropped;
    println!("{loads} loads, {asked_again} asked again; {saved} saves taken, {refused} refused, {taken} took a victim");
    assert!(loads >= 50, "too few L2 loads under the flood: {loads}");
    // L1 was full: saves were refused, or took a marked victim's slot.
    assert!(refused + taken > 0, "the writers never filled L1: no flood ({saved} saves taken)");
    // Starvation episodes only (see above): at most one load in 15.
    assert!(asked_again <= 10, "{asked_again} of {loads} loads were refused a slot and asked again");
}

/// Two models on one node, one L1 whose size classes share 256 KiB
/// chunks: model A's blocks take 64 KiB slots (four a chunk), model B's
/// 32 KiB ones (eight). A's two tenants fill eight chunks, their blocks
/// interleaved; one tenant is purged, leaving every one of those chunks
/// half full and none empty. B then saves 72 blocks: it takes the three
/// chunks nobody uses, and then the pool empties A's chunks by moving A's
/// blocks together, and B takes those too. Every block left reads back
/// byte for byte, the moved ones from their new slots.
#[test]
fn a_model_short_of_l1_gets_the_chunks_another_models_blocks_are_moved_out_of() {
    const SMALL: usize = 28 * 1024;
    let small = |key: &BlockKey| -> Vec<u8> { payload(key)[..SMALL].to_vec() };
    let dir = std::env::temp_dir().join(format!("lake-cp-pool-classes-{}", std::process::id()));
    let mut pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: PAYLOAD as u64,
        l1_slots: 40,
        l1_classes: vec![(SMALL as u64, 8)],
        l1_chunk_bytes: 256 * 1024,
        l2_slots_per_file: 256,
        local_agents: 3,
        remote_agents: 1,
        ..EmbeddedConfig::new(dir.clone())
    })
    .unwrap();
    let admin = pool.admin_socket.clone();
    let mut model = |namespace: u64| {
        let config = AgentConfig {
            arena: &pool.arena,
            mirror: &pool.mirror,
            cp_socket: Some(&pool.cp_socket),
            name: "test-engine",
            namespace: NamespaceId(namespace),
            layout_fingerprint: 0xfeed + namespace,
            segment_bytes: 4 * 1024,
            object_kind: lake_dp::ObjectKind::KvBlock,
        };
        Agent::attach(&config, pool.local_ports.remove(0)).unwrap()
    };
    let (mut kept, mut purged, mut b) = (model(7), model(9), model(8));
    let save_one = |agent: &mut Agent, key: BlockKey, bytes: &[u8]| {
        let block = SaveBlock { key, parent: BlockKey::NONE, block_index: 0, payload: SavePayload::Bytes(bytes) };
        let deadline = Instant::now() + Duration::from_secs(20);
        // A save refused (no slot yet) is offered again, as an engine's
        // next forward pass would.
        while agent.save(std::slice::from_ref(&block)) != 1 {
            assert!(Instant::now() < deadline, "a block never saved");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let keys_kept: Vec<BlockKey> = (0..16).map(|i| key(1, i)).collect();
    let keys_purged: Vec<BlockKey> = (0..16).map(|i| key(3, i)).collect();
    for (k, p) in keys_kept.iter().zip(&keys_purged) {
        save_one(&mut kept, *k, &payload(k));
        save_one(&mut purged, *p, &payload(p));
    }
    // Acked blocks reach the mirror with the control plane's next pass.
    let mut table = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while kept.lookup(&keys_kept, &mut table) < 16 {
        assert!(Instant::now() < deadline, "A's acked blocks never all showed: {table:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(table.iter().all(|e| e.tier == Tier::L1Dram), "A fits in L1: {table:?}");
    let slots: Vec<u32> = table.iter().map(|e| e.slot).collect();

    // Purge the other tenant: half of each of A's chunks is free, no
    // chunk is empty.
    let answer = admin_line(&admin, &format!("{{\"op\":\"purge\",\"namespace\":\"{:016x}\"}}", 9));
    assert!(!answer.contains("error"), "{answer}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while purged.lookup(&keys_purged, &mut table) > 0 {
        assert!(Instant::now() < deadline, "the purge never ended");
        std::thread::sleep(Duration::from_millis(10));
    }

    let keys_b: Vec<BlockKey> = (0..72).map(|i| key(2, i)).collect();
    for k in &keys_b {
        save_one(&mut b, *k, &small(k));
        std::thread::sleep(Duration::from_millis(2));
    }
    // B holds more of L1 than the three chunks nobody used could give it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let in_l1 = loop {
        let hits = b.lookup(&keys_b, &mut table);
        let in_l1 = table.iter().filter(|e| e.tier == Tier::L1Dram).count();
        if hits == 72 && in_l1 > 24 {
            break in_l1;
        }
        assert!(Instant::now() < deadline, "B: {hits} hits, {in_l1} in L1");
        std::thread::sleep(Duration::from_millis(20));
    };
    // Every block still there reads back, as an engine would fetch it:
    // looked up again where a concurrent move or demotion beat the fetch.
    let read_all = |agent: &mut Agent, keys: &[BlockKey], bytes: &dyn Fn(&BlockKey) -> Vec<u8>| {
        let mut got = vec![false; keys.len()];
        let mut table = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.iter().any(|g| !g) && Instant::now() < deadline {
            let missing: Vec<usize> = (0..keys.len()).filter(|&i| !got[i]).collect();
            for i in missing {
                if agent.lookup(&keys[i..=i], &mut table) == 1 {
                    agent.fetch(&keys[i..=i], &table, |_, read| {
                        assert_eq!(read, &bytes(&keys[i])[..], "block {i}");
                        got[i] = true;
                    });
                }
            }
        }
        got.iter().filter(|&&g| g).count()
    };
    let (read_b, read_kept) = (read_all(&mut b, &keys_b, &small), read_all(&mut kept, &keys_kept, &payload));
    assert_eq!(kept.lookup(&keys_kept, &mut table), 16);
    let moved: Vec<usize> = (0..16).filter(|&i| table[i].tier == Tier::L1Dram && table[i].slot != slots[i]).collect();
    // The operator's view of a moved block: gone from its old slot as
    // moved, committed at its new one (a block in a new slot that went
    // down a tier and came back was not moved).
    for &i in &moved {
        let hex: String = keys_kept[i].0.iter().map(|b| format!("{b:02x}")).collect();
        let answer = admin_line(&admin, &format!("{{\"op\":\"inspect\",\"key\":\"{hex}\"}}"));
        if !answer.contains("evicted (demoted)") {
            assert!(answer.contains("evicted (moved)"), "{answer}");
            break;
        }
    }
    let moved = moved.len();

    drop((kept, purged, b));
    let (stats, server) = pool.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "B: {in_l1} of 72 in L1; A's blocks in new slots {moved}; chunks taken {}, emptied {}, blocks moved {}; \
         {:?}",
        stats.l1_chunks_moved, stats.l1_chunks_evacuated, stats.pool.l1_moves, stats.pool
    );
    assert_eq!((read_b, read_kept), (72, 16));
    assert!(stats.l1_chunks_evacuated > 0 && stats.pool.l1_moves > 0, "no chunk was emptied: {stats:?}");
    assert_eq!((stats.pool.commits_corrupt, stats.pool.l1_moves_failed), (0, 0), "{stats:?}");
    assert_eq!(server.counters.bad_frames, 0);
}

/// One line to the operator's socket, its answer.
fn admin_line(socket: &std::path::Path, line: &str) -> String {
    use std::io::{BufRead, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    writeln!(stream, "{line}").unwrap();
    let mut answer = String::new();
    std::io::BufReader::new(stream).read_line(&mut answer).unwrap();
    answer
}
