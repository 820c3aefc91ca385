//! `classes`: what sharing L1 between size classes buys when the traffic
//! moves from one model to another.
//!
//! One embedded pool serves two models whose blocks differ in size (model
//! A's `--a-bytes`, model B's `--b-bytes`), so L1 has two size classes.
//! The run is made twice over the same L1 bytes (`--l1-mib`): with the
//! classes owning half of it each (`fixed`, how an operator would split
//! it), and with the classes sharing it in chunks (`shared`, `lake serve
//! --l1-chunk-bytes`). Each run has two phases, A's then B's: the model of
//! the phase serves `--requests` one-block prompts drawn at random from a
//! working set of `--set-percent` of L1's bytes — more than half of L1 —
//! the way an engine does: a prompt found in L1 is read from there, one in
//! L2 is loaded, one found nowhere is computed and saved (best effort: a
//! refused save is counted and the block stays uncached). The second half
//! of each phase is measured (the first warms up): the share of requests
//! served from L1, from L2, and computed again. The bound is the share of
//! the working set that fits in L1 below the tier manager's high-water
//! mark.

#![allow(clippy::cast_possible_truncation, clippy::cast_precision_loss, clippy::cast_sign_loss)] // ratios of small positive counts

use std::time::Instant;

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::rng::SimRng;
use lake_dp::{BlockKey, NamespaceId, Tier};

use crate::report::Report;

/// What one phase's measured half saw.
#[derive(Debug, Default)]
struct Served {
    l1: u64,
    l2: u64,
    computed: u64,
    saves_refused: u64,
}

impl Served {
    fn total(&self) -> u64 {
        self.l1 + self.l2 + self.computed
    }

    fn share(&self, count: u64) -> f64 {
        count as f64 / self.total().max(1) as f64
    }
}

fn prompt(model: u8, n: u64) -> BlockKey {
    let mut bytes = [0u8; 16];
    bytes[0] = model;
    bytes[1..9].copy_from_slice(&n.to_le_bytes());
    BlockKey(bytes)
}

/// `requests` prompts of a `set`-prompt working set, served by `agent`;
/// the second half counted.
fn serve(agent: &mut Agent, model: u8, set: u64, requests: u64, payload: &[u8], seed: u64) -> Served {
    let mut rng = SimRng::new(seed);
    let mut table = Vec::new();
    let mut served = Served::default();
    for r in 0..requests {
        let key = prompt(model, rng.below(set));
        let counted = r >= requests / 2;
        let found = agent.lookup(&[key], &mut table) == 1;
        let tier = found.then(|| table[0].tier);
        let read = found
            && agent.fetch(&[key], &table, |_, bytes| {
                std::hint::black_box(bytes);
            }) == 1;
        if read {
            match tier {
                Some(Tier::L1Dram) if counted => served.l1 += 1,
                Some(_) if counted => served.l2 += 1,
                _ => {}
            }
            continue;
        }
        // Computed again (found nowhere, or gone before it was read), then
        // saved for the next request of it.
        let block = SaveBlock { key, parent: BlockKey::NONE, block_index: 0, payload: SavePayload::Bytes(payload) };
        let saved = agent.save(std::slice::from_ref(&block)) == 1;
        if counted {
            served.computed += 1;
            served.saves_refused += u64::from(!saved);
        }
    }
    served
}

struct Run {
    a: Served,
    b: Served,
    stats: lake_dp::runner::RunnerStats,
}

fn run_once(
    dir: &std::path::Path,
    (a_bytes, b_bytes): (u64, u64),
    l1_bytes: u64,
    chunk_bytes: u64,
    (set_a, set_b, requests): (u64, u64, u64),
) -> Result<Run, String> {
    let slot = lake_dp::stored::object_bytes;
    // Half of L1's bytes each (fixed), or their sum sizing the shared
    // arena: the same bytes either way.
    let (a_slots, b_slots) = ((l1_bytes / 2 / slot(a_bytes)) as u32, (l1_bytes / 2 / slot(b_bytes)) as u32);
    let config = EmbeddedConfig {
        block_bytes: a_bytes,
        l1_slots: a_slots,
        l1_classes: vec![(b_bytes, b_slots)],
        l1_chunk_bytes: chunk_bytes,
        l2_slots_per_file: ((set_a + set_b) as u32).max(256),
        local_agents: 2,
        remote_agents: 1,
        ..EmbeddedConfig::new(dir.to_path_buf())
    };
    let mut pool = EmbeddedPool::start(&config)?;
    let model = |pool: &mut EmbeddedPool, namespace: u64| {
        let agent_config = AgentConfig {
            arena: &pool.arena,
            mirror: &pool.mirror,
            cp_socket: Some(&pool.cp_socket),
            name: "classes-bench",
            namespace: NamespaceId(namespace),
            layout_fingerprint: 0xc1a5 + namespace,
            segment_bytes: 64 * 1024,
            object_kind: lake_dp::ObjectKind::KvBlock,
        };
        Agent::attach(&agent_config, pool.local_ports.remove(0)).map_err(|e| e.to_string())
    };
    let (mut agent_a, mut agent_b) = (model(&mut pool, 0xa)?, model(&mut pool, 0xb)?);
    let a = serve(&mut agent_a, 0xa, set_a, requests, &vec![0xa5; a_bytes as usize], 1);
    let b = serve(&mut agent_b, 0xb, set_b, requests, &vec![0xb5; b_bytes as usize], 2);
    drop((agent_a, agent_b));
    let (stats, _server) = pool.stop()?;
    Ok(Run { a, b, stats })
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct ClassesArgs {
    /// Directory for the files it makes (removed after).
    #[arg(long)]
    pub(crate) dir: Option<String>,
    /// L1 size in MiB, shared by both models.
    #[arg(long, default_value_t = 32)]
    pub(crate) l1_mib: u64,
    /// Payload bytes of model A's blocks.
    #[arg(long, default_value_t = 256 * 1024)]
    pub(crate) a_bytes: u64,
    /// Payload bytes of model B's blocks.
    #[arg(long, default_value_t = 96 * 1024)]
    pub(crate) b_bytes: u64,
    /// Share of requests for model A, percent.
    #[arg(long, default_value_t = 80)]
    pub(crate) set_percent: u64,
    /// Requests.
    #[arg(long, default_value_t = 4000)]
    pub(crate) requests: u64,
    /// Slots of the largest class per shared chunk.
    #[arg(long, default_value_t = 4)]
    pub(crate) chunk_slots: u64,
}

pub(crate) fn run(args: &ClassesArgs) -> Result<Report, String> {
    let dir: String =
        args.dir.clone().unwrap_or_else(|| std::env::temp_dir().join("lake-bench-classes").display().to_string());
    let l1_bytes = args.l1_mib << 20;
    let a_bytes: u64 = args.a_bytes;
    let b_bytes: u64 = args.b_bytes;
    let set_percent: u64 = args.set_percent;
    let requests: u64 = args.requests;
    // A shared chunk holds this many of the larger class's slots.
    let chunk_slots: u64 = args.chunk_slots;
    if a_bytes == 0 || b_bytes == 0 || set_percent == 0 || requests < 2 || chunk_slots == 0 {
        return Err("--a-bytes, --b-bytes, --set-percent, --chunk-slots at least 1, --requests at least 2".into());
    }
    let slot = lake_dp::stored::object_bytes;
    let set_a = l1_bytes * set_percent / 100 / slot(a_bytes);
    let set_b = l1_bytes * set_percent / 100 / slot(b_bytes);
    let chunk_bytes = slot(a_bytes).max(slot(b_bytes)) * chunk_slots;
    let dir = std::path::PathBuf::from(dir).join(format!("run-{}", std::process::id()));
    let started = Instant::now();
    let fixed = run_once(&dir.join("fixed"), (a_bytes, b_bytes), l1_bytes, 0, (set_a, set_b, requests))?;
    let shared = run_once(&dir.join("shared"), (a_bytes, b_bytes), l1_bytes, chunk_bytes, (set_a, set_b, requests))?;
    let _ = std::fs::remove_dir_all(&dir);
    let elapsed = started.elapsed();

    let mut report = Report::new("classes");
    report.int("l1_bytes", l1_bytes);
    report.int("a_bytes", a_bytes);
    report.int("b_bytes", b_bytes);
    report.int("set_percent_of_l1", set_percent);
    report.int("requests_per_phase", requests);
    report.int("chunk_bytes", chunk_bytes);
    // The bound: L1 kept at the tier manager's 90–95% marks, the rest of
    // the working set read from L2.
    report.float("l1_share_bound", (0.9 * 100.0 / set_percent as f64).min(1.0));
    for (name, run) in [("fixed", &fixed), ("shared", &shared)] {
        for (model, served) in [("a", &run.a), ("b", &run.b)] {
            report.float(&format!("{name}_{model}_from_l1"), served.share(served.l1));
            report.float(&format!("{name}_{model}_from_l2"), served.share(served.l2));
            report.float(&format!("{name}_{model}_computed"), served.share(served.computed));
            report.int(&format!("{name}_{model}_saves_refused"), served.saves_refused);
        }
    }
    report.int("shared_chunks_taken", shared.stats.l1_chunks_moved);
    report.int("shared_chunks_emptied", shared.stats.l1_chunks_evacuated);
    report.int("shared_blocks_moved", shared.stats.pool.l1_moves);
    report.int("shared_moves_failed", shared.stats.pool.l1_moves_failed);
    let ratio = |f: &Served, s: &Served| s.share(s.l1) / f.share(f.l1).max(1e-9);
    report.float("a_from_l1_shared_over_fixed", ratio(&fixed.a, &shared.a));
    report.float("b_from_l1_shared_over_fixed", ratio(&fixed.b, &shared.b));
    report.float("seconds", elapsed.as_secs_f64());
    Ok(report)
}
