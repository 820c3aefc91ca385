//! `cluster-hits`: one pool across three nodes against the same capacity
//! as one pool and as three islands. Three `lake serve` nodes, each in a
//! network namespace of its own on one switch (a bridge), members of a
//! cluster in a real etcd with a `lake summary` leader, replay agent
//! conversations whose turns land on random nodes. Each turn's engine (an
//! agent of that node's pool: its sockets and shared memory cross no
//! network) asks for the context it has so far:
//!
//! - **cluster**: the whole pool (`lookup_cluster`), and pulls the blocks
//!   only other nodes hold (`pull_cluster`) — its hit is what landed here;
//!   once with each block kept where it was last read (`lake summary`'s
//!   default, `--placement read`), once where it was saved (`saved`), once
//!   in its home (`home`);
//! - **islands** (three fresh nodes, no view, no pulls): its node's mirror;
//! - **one pool** (one node with the three nodes' L1 and L2 together):
//!   its mirror;
//!
//! computes the rest and saves it, with its reply, on its node. The hit
//! ratio is the context blocks hit over the context blocks asked for.
//! Then, between two of the cluster's namespaces, a remote load — blocks
//! held only on node 2 pulled into node 1, one at a time and as one batch
//! — against raw TCP between the same namespaces (a block's bytes asked
//! for and sent back; the batch's bytes streamed). Needs root and etcd.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use lake_agent::{Agent, AgentConfig, SaveBlock, SavePayload};
use lake_dp::mirror::view::Where;
use lake_dp::rng::SimRng;
use lake_dp::{BlockKey, NamespaceId};
use lake_tests::netns::{Switch, enter};

use crate::report::{Report, percentile};

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct ClusterHitsArgs {
    /// The `lake` and etcd binaries.
    #[command(flatten)]
    pub(crate) binaries: Binaries,
    /// Conversations.
    #[arg(long, default_value_t = 60)]
    pub(crate) conversations: u32,
    /// Turns of each.
    #[arg(long, default_value_t = 8)]
    pub(crate) turns: u32,
    /// L1 slots of each of the three nodes (one pool: three times).
    #[arg(long, default_value_t = 600)]
    pub(crate) l1_slots: u32,
    /// Slots of each of a node's two L2 files (one pool: three times).
    #[arg(long, default_value_t = 300)]
    pub(crate) l2_slots: u32,
    /// Blocks pulled one at a time, and as one batch.
    #[arg(long, default_value_t = 64)]
    pub(crate) pulls: u32,
    /// The modes replayed (default: all); `one_pool` is always, as the
    /// baseline.
    #[arg(long, value_delimiter = ',', value_parser = MODE_NAMES)]
    pub(crate) modes: Vec<String>,
}

/// The binaries a deployment runs.
#[derive(clap::Args, Debug)]
pub(crate) struct Binaries {
    /// The `lake` binary (default: beside this one).
    #[arg(long)]
    pub(crate) lake: Option<PathBuf>,
    /// The etcd binary.
    #[arg(long, default_value = "etcd")]
    pub(crate) etcd: PathBuf,
}

impl Binaries {
    /// The `lake` binary: as given, or the one beside this bench.
    pub(crate) fn lake(&self) -> Result<PathBuf, String> {
        let lake = match &self.lake {
            Some(path) => path.clone(),
            None => std::env::current_exe().map_err(|e| e.to_string())?.with_file_name("lake"),
        };
        if !lake.is_file() {
            return Err(format!("{}: no lake binary (cargo build --release -p lake-cp --bin lake)", lake.display()));
        }
        Ok(lake)
    }
}

const NODES: usize = 3;
pub(crate) const BLOCK_BYTES: usize = 16 * 1024;
const SYSTEM_BLOCKS: u32 = 8;
pub(crate) const NAMESPACE: u64 = 0x4854;

/// A process of the deployment: its stdout lines on a channel; stopped
/// (SIGTERM, then SIGKILL) when dropped.
pub(crate) struct Proc {
    pub(crate) child: Child,
    lines: Receiver<String>,
}

impl Proc {
    pub(crate) fn start(mut command: std::process::Command) -> Result<Self, String> {
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().map_err(|e| e.to_string())?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Self { child, lines })
    }

    pub(crate) fn wait_for(&self, what: &str, want: impl Fn(&str) -> bool) -> Result<String, String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if want(&line) => return Ok(line),
                Ok(_) => {}
                Err(_) => return Err(format!("{what}: not within 30 s")),
            }
        }
    }
}

impl Proc {
    /// The last line `want` takes of those printed so far, or the next.
    pub(crate) fn latest(&self, what: &str, want: impl Fn(&str) -> bool) -> Result<String, String> {
        let mut last = None;
        while let Ok(line) = self.lines.try_recv() {
            if want(&line) {
                last = Some(line);
            }
        }
        match last {
            Some(line) => Ok(line),
            None => self.wait_for(what, want),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // A stop as a service manager asks it (its shared memory goes).
        let _ = std::process::Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(line: &str, name: &str) -> Result<String, String> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    value[name].as_str().map(str::to_owned).ok_or_else(|| format!("no {name} in {line}"))
}

pub(crate) fn agent(serving: &str) -> Result<Agent, String> {
    let (dp, cp, mirror) = (field(serving, "dp_socket")?, field(serving, "cp_socket")?, field(serving, "mirror")?);
    let config = AgentConfig {
        arena: Path::new("/nonexistent"),
        mirror: Path::new(&mirror),
        cp_socket: Some(Path::new(&cp)),
        name: "cluster-hits",
        namespace: NamespaceId(NAMESPACE),
        layout_fingerprint: 0x48,
        segment_bytes: 8192,
        object_kind: lake_dp::ObjectKind::KvBlock,
    };
    Agent::connect(&config, Path::new(&dp)).map_err(|e| e.to_string())
}

/// Block `i` of `conversation`'s chain. Spread over the whole key space
/// as the keys engines make are (a keyed hash's output): the pool's
/// tables place a block by its key's bits.
pub(crate) fn key(conversation: u32, i: u32) -> BlockKey {
    // The system prompt's blocks are every conversation's.
    let owner = if i < SYSTEM_BLOCKS { 0 } else { conversation + 1 };
    let lo = mix((u64::from(owner) << 32) | u64::from(i));
    let mut bytes = [0; 16];
    bytes[..8].copy_from_slice(&lo.to_le_bytes());
    bytes[8..].copy_from_slice(&mix(lo ^ 0x4854_4854_4854_4854).to_le_bytes());
    BlockKey(bytes)
}

/// splitmix64's finalizer: a bijection of u64 whose outputs look uniform.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Saves blocks `from..` of `keys` (each continuing the one before), a
/// save refused for room offered again a few times. Returns how many.
pub(crate) fn save(agent: &mut Agent, keys: &[BlockKey], from: usize) -> usize {
    save_lacking(agent, keys, from, BLOCK_BYTES, |_, _| false)
}

/// [`save`], but a block `held(agent, key)` says the pool holds already
/// is not written again (counted saved).
fn save_lacking(
    agent: &mut Agent,
    keys: &[BlockKey],
    from: usize,
    block_bytes: usize,
    mut held: impl FnMut(&mut Agent, &BlockKey) -> bool,
) -> usize {
    let payload = vec![0x5a; block_bytes];
    let mut saved = 0;
    for i in from..keys.len() {
        if held(agent, &keys[i]) {
            saved += 1;
            continue;
        }
        let block = SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap_or(u32::MAX),
            payload: SavePayload::Bytes(&payload),
        };
        for _ in 0..20 {
            if agent.save(std::slice::from_ref(&block)) == 1 {
                saved += 1;
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    saved
}

/// The deployment's scratch: its directory, removed when dropped.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How turns ask the pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    /// Blocks kept where they were last read (`lake summary`'s default),
    /// a full node's victims spilled into the member with most room.
    Cluster,
    /// As `Cluster`, a full node's victims dropped (`--no-spills`).
    ClusterNoSpills,
    /// Blocks kept where they were saved (`--placement saved`).
    ClusterSaved,
    /// Blocks kept in their homes (`--placement home`).
    ClusterHome,
    Islands,
    OnePool,
}

/// The modes in the order they run, and their names in the report.
const MODES: [Mode; 6] =
    [Mode::OnePool, Mode::Islands, Mode::Cluster, Mode::ClusterNoSpills, Mode::ClusterSaved, Mode::ClusterHome];
const MODE_NAMES: [&str; 6] = ["one_pool", "islands", "cluster", "cluster_no_spills", "cluster_saved", "cluster_home"];

impl Mode {
    fn cluster(self) -> bool {
        matches!(self, Self::Cluster | Self::ClusterNoSpills | Self::ClusterSaved | Self::ClusterHome)
    }

    /// `lake summary --placement` (a cluster's).
    fn placement(self) -> &'static str {
        match self {
            Self::ClusterSaved => "saved",
            Self::ClusterHome => "home",
            _ => "read",
        }
    }
}

/// What one replay measured.
#[derive(Default)]
struct Replay {
    asked: u64,
    hit: u64,
    pulled: u64,
    pull_ns: Vec<f64>,
    /// Blocks a save was refused for (twenty times over).
    unsaved: u64,
    /// Turns whose hit ended at a block no node held (evicted from the
    /// whole pool, or never saved).
    ended_gone: u64,
    /// Turns whose hit ended at a block another node held that did not
    /// land here (not in the view yet, or its pull failed).
    ended_elsewhere: u64,
    /// At the end: the conversations' blocks held somewhere, and the
    /// copies of them the nodes hold together.
    distinct_held: u64,
    copies_held: u64,
    /// At the end: the conversations' blocks whose whole prefix is held
    /// somewhere (what a next turn could hit).
    prefix_held: u64,
}

/// The nodes holding `key` (their mirrors read, no access reported).
fn holders(agents: &[Agent], key: &BlockKey) -> u64 {
    let mut table = Vec::new();
    agents.iter().filter(|a| a.mirror().lookup(std::slice::from_ref(key), &mut table) == 1).count() as u64
}

/// A deployment: etcd and the summary in host 0's namespace, the pools.
pub(crate) struct Deployment {
    nodes: Vec<(Proc, String)>,
    summary: Option<Proc>,
    _etcd: Option<Proc>,
}

pub(crate) fn deploy(args: &ArgsPaths, switch: &Switch, mode: Mode, base: &Path) -> Result<Deployment, String> {
    let cluster = mode.cluster();
    let (etcd, summary, endpoint, summary_at) = if cluster {
        let host = switch.address(0);
        let client = format!("http://{host}:2379");
        let mut command = switch.command(0, &args.etcd);
        let data = base.join("etcd");
        command.args(["--name", "hits", "--data-dir"]).arg(&data);
        command.args(["--listen-client-urls", &client, "--advertise-client-urls", &client]);
        command.args(["--listen-peer-urls", "http://127.0.0.1:2380"]);
        command.args(["--initial-advertise-peer-urls", "http://127.0.0.1:2380"]);
        command.args(["--initial-cluster", "hits=http://127.0.0.1:2380"]);
        let etcd = Proc::start(command)?;
        let summary_at = format!("{host}:7100");
        let mut command = switch.command(0, &args.lake);
        command.args(["summary", "--listen", &summary_at, "--etcd", &client, "--cluster", "hits", "--ttl", "2"]);
        command.args(["--placement", mode.placement()]);
        if mode == Mode::ClusterNoSpills {
            command.arg("--no-spills");
        }
        // etcd may take a moment to answer: the summary retries its start.
        let mut summary = None;
        for _ in 0..50 {
            std::thread::sleep(Duration::from_millis(100));
            let started = Proc::start(command_again(&command))?;
            if started.wait_for("the summary leads", |l| l.contains("\"leading\"")).is_ok() {
                summary = Some(started);
                break;
            }
        }
        (Some(etcd), Some(summary.ok_or("the summary never led")?), client, summary_at)
    } else {
        (None, None, String::new(), String::new())
    };
    let hosts = if mode == Mode::OnePool { 1 } else { NODES };
    let scale = if mode == Mode::OnePool { u32::try_from(NODES).unwrap_or(1) } else { 1 };
    let mut nodes = Vec::new();
    for host in 0..hosts {
        let mut command = switch.command(host, &args.lake);
        let dir = base.join(format!("{mode:?}-{host}"));
        command.args(["serve", "--metrics", "off", "--node", &(host + 1).to_string(), "--dir"]).arg(&dir);
        command.args(["--block-bytes", &args.block_bytes.to_string()]);
        command.args(["--l1-slots", &(args.l1_slots * scale).to_string()]);
        command.args(["--l2-slots", &(args.l2_slots * scale).to_string()]);
        if cluster {
            command.args(["--etcd", &endpoint, "--cluster", "hits", "--member-ttl", "2", "--summary-to", &summary_at]);
            command.args(["--transport-listen", &format!("{}:7200", switch.address(host))]);
            for other in (0..NODES).filter(|&o| o != host) {
                command.args(["--transport-peer", &format!("{}={}:7200", other + 1, switch.address(other))]);
            }
        }
        let proc = Proc::start(command)?;
        let serving = proc.wait_for("a node serves", |l| l.contains("\"serving\""))?;
        nodes.push((proc, serving));
    }
    Ok(Deployment { nodes, summary, _etcd: etcd })
}

/// A copy of `command` (its program and arguments), to start again.
pub(crate) fn command_again(command: &std::process::Command) -> std::process::Command {
    let mut again = std::process::Command::new(command.get_program());
    again.args(command.get_args());
    again
}

/// What a deployment runs, and each node's room.
pub(crate) struct ArgsPaths {
    pub(crate) lake: PathBuf,
    pub(crate) etcd: PathBuf,
    pub(crate) l1_slots: u32,
    pub(crate) l2_slots: u32,
    pub(crate) block_bytes: usize,
}

/// The turns, in the order they arrive: every conversation's first turn,
/// then every second, … each on a random node.
fn replay(args: &ClusterHitsArgs, deployment: &Deployment, mode: Mode) -> Result<Replay, String> {
    let mut agents: Vec<Agent> = deployment.nodes.iter().map(|(_, s)| agent(s)).collect::<Result<_, _>>()?;
    let mut rng = SimRng::new(0x48_17);
    let mut lengths = vec![SYSTEM_BLOCKS; args.conversations as usize];
    let mut out = Replay::default();
    let (mut places, mut table) = (Vec::new(), Vec::new());
    for _ in 0..args.turns {
        for c in 0..args.conversations {
            let node = usize::try_from(rng.below(NODES as u64)).unwrap_or(0);
            // One pool's engines are all agents of its one node.
            let at = if mode == Mode::OnePool { 0 } else { node };
            let message = 2 + u32::try_from(rng.below(5)).unwrap_or(0);
            let reply = 2 + u32::try_from(rng.below(3)).unwrap_or(0);
            let context = lengths[c as usize];
            let prompt: Vec<BlockKey> = (0..context + message).map(|i| key(c, i)).collect();
            let agent = &mut agents[at];
            let asked = &prompt[..context as usize];
            let hit = match mode {
                Mode::Cluster | Mode::ClusterNoSpills | Mode::ClusterSaved | Mode::ClusterHome => {
                    let anywhere = agent.lookup_cluster(asked, &mut places);
                    let remote = places.iter().filter(|p| matches!(p, Where::Remote(_))).count();
                    if remote > 0 {
                        let started = Instant::now();
                        let landed = agent.pull_cluster(&asked[..anywhere], Duration::from_secs(2), &mut table);
                        out.pull_ns.push(started.elapsed().as_nanos() as f64 / remote as f64);
                        out.pulled += remote as u64;
                        landed
                    } else {
                        anywhere
                    }
                }
                Mode::Islands | Mode::OnePool => agent.lookup(asked, &mut table),
            };
            out.asked += u64::from(context);
            out.hit += hit as u64;
            if mode.cluster() && hit < asked.len() {
                if holders(&agents, &asked[hit]) == 0 {
                    out.ended_gone += 1;
                } else {
                    out.ended_elsewhere += 1;
                }
            }
            let agent = &mut agents[at];
            // The rest computed; the prompt and the reply saved here.
            let whole: Vec<BlockKey> = (0..context + message + reply).map(|i| key(c, i)).collect();
            // Blocks past the hit the pool holds (past a gap) are not
            // written again: in the cluster, held anywhere; else, here.
            let held = |agent: &mut Agent, key: &BlockKey| {
                let one = std::slice::from_ref(key);
                match mode {
                    Mode::Cluster | Mode::ClusterNoSpills | Mode::ClusterSaved | Mode::ClusterHome => {
                        agent.lookup_cluster(one, &mut Vec::new()) == 1
                    }
                    Mode::Islands | Mode::OnePool => agent.lookup(one, &mut Vec::new()) == 1,
                }
            };
            out.unsaved += (whole.len() - hit - save_lacking(agent, &whole, hit, BLOCK_BYTES, held)) as u64;
            lengths[c as usize] = context + message + reply;
        }
    }
    held_at_end(&agents, &lengths, &mut out);
    Ok(out)
}

/// What the pool holds of the conversations (their `lengths` so far) at
/// the end of a replay, into `out`.
fn held_at_end(agents: &[Agent], lengths: &[u32], out: &mut Replay) {
    for (c, &length) in lengths.iter().enumerate() {
        let mut whole_prefix = true;
        for i in 0..length {
            let copies = holders(agents, &key(u32::try_from(c).unwrap_or(0), i));
            whole_prefix &= copies > 0;
            // The system prompt's blocks once, with the first
            // conversation's.
            if c == 0 || i >= SYSTEM_BLOCKS {
                out.distinct_held += u64::from(copies > 0);
                out.copies_held += copies;
                out.prefix_held += u64::from(whole_prefix);
            }
        }
    }
}

/// Blocks held only on node 2 pulled into node 1: one at a time (ns a
/// block each), then as one batch (the batch's seconds).
/// Blocks of `block_bytes` held only on node 2 pulled into node 1:
/// `pulls` one at a time (ns each), then `pulls` more as one batch
/// (seconds).
pub(crate) fn remote_loads(pulls: u32, block_bytes: usize, deployment: &Deployment) -> Result<(Vec<f64>, f64), String> {
    let mut holder = agent(&deployment.nodes[1].1)?;
    let mut puller = agent(&deployment.nodes[0].1)?;
    let count = pulls as usize;
    let keys: Vec<BlockKey> = (0..2 * pulls).map(|i| key(1_000_000, SYSTEM_BLOCKS + i)).collect();
    // Node 2 is full after a replay: a save finds room as it evicts.
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0..keys.len() {
        while save_lacking(&mut holder, &keys[..=i], i, block_bytes, |_, _| false) == 0 {
            if Instant::now() > deadline {
                return Err(format!("node 2 took {i} of the {} blocks to pull in 10 s", keys.len()));
            }
        }
    }
    let mut places = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Each key alone (the chain's parents are not asked): seen from node 1.
    while keys.iter().any(|k| puller.lookup_cluster(std::slice::from_ref(k), &mut places) != 1) {
        if Instant::now() > deadline {
            return Err("node 2's blocks never reached node 1's view".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut table = Vec::new();
    let mut singles = Vec::with_capacity(count);
    for k in &keys[..count] {
        let started = Instant::now();
        if puller.pull_cluster(std::slice::from_ref(k), Duration::from_secs(2), &mut table) != 1 {
            return Err("a pull did not land".into());
        }
        singles.push(started.elapsed().as_nanos() as f64);
    }
    let started = Instant::now();
    let batch = &keys[count..];
    let landed = pull_each(&mut puller, batch, &mut table);
    let batch_s = started.elapsed().as_secs_f64();
    if landed != batch.len() {
        return Err(format!("{landed} of {} pulled blocks landed", batch.len()));
    }
    Ok((singles, batch_s))
}

/// Pulls every one of `keys` (not a chain: each alone) as one batch: all
/// asked at once, then waited for. Returns how many landed.
pub(crate) fn pull_each(agent: &mut Agent, keys: &[BlockKey], table: &mut Vec<lake_dp::mirror::MirrorEntry>) -> usize {
    let mut places = Vec::new();
    let mut pulls = Vec::with_capacity(keys.len());
    for k in keys {
        agent.lookup_cluster(std::slice::from_ref(k), &mut places);
        pulls.extend(lake_dp::mirror::view::remote(std::slice::from_ref(k), &places));
    }
    agent.pull(&pulls);
    let deadline = Instant::now() + Duration::from_secs(10);
    // Each key looked up until it lands, not again after: the bench's
    // own lookups share the machine with the nodes.
    let mut waiting = keys.to_vec();
    loop {
        let writes = agent.mirror().writes();
        waiting.retain(|k| agent.lookup(std::slice::from_ref(k), table) != 1);
        if waiting.is_empty() || Instant::now() > deadline {
            return keys.len() - waiting.len();
        }
        // Woken as node 1's `lake-cp` publishes, as an engine's pull is.
        agent.mirror().wait_for_writes(writes, Duration::from_micros(200));
    }
}

/// Raw TCP between node 2's namespace and node 1's: a block's bytes asked
/// for and sent back (ns each), and `batch` blocks streamed (seconds).
pub(crate) fn raw_tcp(
    switch: &Switch,
    count: usize,
    batch: usize,
    block_bytes: usize,
) -> Result<(Vec<f64>, f64), String> {
    let (server_ns, address) = (switch.hosts[1].clone(), format!("{}:7300", switch.address(1)));
    let (ready_tx, ready) = channel();
    let server = std::thread::spawn(move || -> Result<(), String> {
        enter(&server_ns)?;
        let listener = std::net::TcpListener::bind(&address).map_err(|e| e.to_string())?;
        let _ = ready_tx.send(());
        let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let block = vec![0x5a; block_bytes];
        let mut ask = [0u8; 16];
        for _ in 0..count {
            stream.read_exact(&mut ask).map_err(|e| e.to_string())?;
            stream.write_all(&block).map_err(|e| e.to_string())?;
        }
        stream.read_exact(&mut ask).map_err(|e| e.to_string())?;
        for _ in 0..batch {
            stream.write_all(&block).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
    ready.recv_timeout(Duration::from_secs(10)).map_err(|_| "the raw server never listened")?;
    let (client_ns, address) = (switch.hosts[0].clone(), format!("{}:7300", switch.address(1)));
    let client = std::thread::spawn(move || -> Result<(Vec<f64>, f64), String> {
        enter(&client_ns)?;
        let mut stream = std::net::TcpStream::connect(&address).map_err(|e| e.to_string())?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        let mut block = vec![0u8; block_bytes];
        let mut singles = Vec::with_capacity(count);
        for _ in 0..count {
            let started = Instant::now();
            stream.write_all(&[1u8; 16]).map_err(|e| e.to_string())?;
            stream.read_exact(&mut block).map_err(|e| e.to_string())?;
            singles.push(started.elapsed().as_nanos() as f64);
        }
        let started = Instant::now();
        stream.write_all(&[2u8; 16]).map_err(|e| e.to_string())?;
        for _ in 0..batch {
            stream.read_exact(&mut block).map_err(|e| e.to_string())?;
        }
        Ok((singles, started.elapsed().as_secs_f64()))
    });
    let measured = client.join().map_err(|_| "the raw client panicked")??;
    server.join().map_err(|_| "the raw server panicked")??;
    Ok(measured)
}

/// The leader's count of full nodes' victims it placed in other members,
/// and of those no member had room for, into `report` as `name`'s.
fn spills(deployment: &Deployment, name: &str, report: &mut Report) -> Result<(), String> {
    let Some(summary) = &deployment.summary else { return Ok(()) };
    let line = summary.latest("the summary's report", |l| l.contains("\"event\":\"summary\""))?;
    let value: serde_json::Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
    for what in ["placed", "unplaced"] {
        let count = value["spills"][what].as_u64().ok_or_else(|| format!("no spills in {line}"))?;
        report.int(&format!("{name}_spills_{what}"), count);
    }
    Ok(())
}

/// What a cluster's replay pulled, and how its nodes took it.
fn cluster_figures(deployment: &Deployment, name: &str, replay: Replay, report: &mut Report) -> Result<(), String> {
    report.int(&format!("{name}_blocks_pulled"), replay.pulled);
    report.int(&format!("{name}_turns_ended_at_a_block_gone"), replay.ended_gone);
    report.int(&format!("{name}_turns_ended_at_a_block_elsewhere"), replay.ended_elsewhere);
    let mut ns = replay.pull_ns;
    report.float(&format!("{name}_turn_pull_p50_ns_per_block"), percentile(&mut ns, 500));
    spills(deployment, name, report)?;
    let [waited, rooted, again] = nodes_top(deployment, ["/blocks_waited", "/blocks_rooted", "/copies_asked_again"])?;
    report.int(&format!("{name}_blocks_waited_for_their_parent"), waited);
    report.int(&format!("{name}_blocks_applied_as_roots"), rooted);
    report.int(&format!("{name}_copies_asked_again"), again);
    Ok(())
}

/// The nodes' `top` (their admin sockets) at `fields` (JSON pointers),
/// each summed over the nodes.
fn nodes_top<const N: usize>(deployment: &Deployment, fields: [&str; N]) -> Result<[u64; N], String> {
    use std::io::{BufRead, Write};
    let mut sums = [0; N];
    for (_, serving) in &deployment.nodes {
        let record: serde_json::Value = serde_json::from_str(serving).map_err(|e| e.to_string())?;
        let path = record["admin_socket"].as_str().ok_or_else(|| format!("no admin socket in {serving}"))?;
        let mut stream = std::os::unix::net::UnixStream::connect(path).map_err(|e| format!("{path}: {e}"))?;
        writeln!(stream, "{{\"op\":\"top\"}}").map_err(|e| format!("{path}: {e}"))?;
        let mut line = String::new();
        std::io::BufReader::new(stream).read_line(&mut line).map_err(|e| format!("{path}: {e}"))?;
        let top: serde_json::Value = serde_json::from_str(&line).map_err(|e| format!("{path}: {e}"))?;
        for (sum, field) in sums.iter_mut().zip(fields) {
            *sum += top
                .pointer(field)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| format!("{path}: no {field} in top"))?;
        }
    }
    Ok(sums)
}

pub(crate) fn run(args: &ClusterHitsArgs) -> Result<Report, String> {
    let lake = args.binaries.lake()?;
    let paths = ArgsPaths {
        lake,
        etcd: args.binaries.etcd.clone(),
        l1_slots: args.l1_slots,
        l2_slots: args.l2_slots,
        block_bytes: BLOCK_BYTES,
    };
    let switch = Switch::new(NODES, 1).map_err(|e| format!("network namespaces (root?): {e}"))?;
    let base = Scratch(std::env::temp_dir().join(format!("lake-bench-hits-{}", std::process::id())));
    std::fs::create_dir_all(&base.0).map_err(|e| e.to_string())?;
    let mut report = Report::new("cluster-hits");
    report.int("nodes", NODES as u64);
    report.int("turns", u64::from(args.conversations * args.turns));
    report.int("l1_slots_per_node", u64::from(args.l1_slots));
    report.int("l2_slots_per_node", 2 * u64::from(args.l2_slots));
    let mut ratios = [f64::NAN; MODES.len()];
    for (i, (mode, name)) in MODES.into_iter().zip(MODE_NAMES).enumerate() {
        if i > 0 && !args.modes.is_empty() && !args.modes.iter().any(|m| m == name) {
            continue;
        }
        let deployment = deploy(&paths, &switch, mode, &base.0)?;
        if mode.cluster() {
            // Every node in the leader's view before the first turn.
            std::thread::sleep(Duration::from_secs(1));
        }
        let replay = replay(args, &deployment, mode)?;
        ratios[i] = replay.hit as f64 / replay.asked as f64;
        report.int(&format!("{name}_context_blocks"), replay.asked);
        report.float(&format!("{name}_hit_ratio"), ratios[i]);
        report.int(&format!("{name}_unsaved_blocks"), replay.unsaved);
        report.int(&format!("{name}_blocks_held_at_end"), replay.distinct_held);
        report.int(&format!("{name}_copies_held_at_end"), replay.copies_held);
        report.int(&format!("{name}_prefix_blocks_held_at_end"), replay.prefix_held);
        let [indexed, l1, l2] = nodes_top(&deployment, ["/blocks", "/tiers/0/blocks", "/tiers/1/blocks"])?;
        report.int(&format!("{name}_blocks_indexed_at_end"), indexed);
        report.int(&format!("{name}_l1_blocks_at_end"), l1);
        report.int(&format!("{name}_l2_blocks_at_end"), l2);
        if mode.cluster() {
            cluster_figures(&deployment, name, replay, &mut report)?;
        }
        if mode == Mode::Cluster {
            let (mut singles, batch_s) = remote_loads(args.pulls, BLOCK_BYTES, &deployment)?;
            report.float("remote_load_p50_ns", percentile(&mut singles, 500));
            report.float("remote_load_p99_ns", percentile(&mut singles, 990));
            let blocks = f64::from(args.pulls);
            report.float("remote_load_batch_mb_per_s", blocks * BLOCK_BYTES as f64 / batch_s / 1e6);
            report.float("remote_load_batch_blocks_per_s", blocks / batch_s);
        }
    }
    for (i, name) in MODE_NAMES.into_iter().enumerate().skip(1) {
        if !ratios[i].is_nan() {
            report.float(&format!("{name}_vs_one_pool"), ratios[i] / ratios[0]);
        }
    }
    let (mut singles, batch_s) = raw_tcp(&switch, args.pulls as usize, args.pulls as usize, BLOCK_BYTES)?;
    report.float("raw_tcp_block_p50_ns", percentile(&mut singles, 500));
    report.float("raw_tcp_block_p99_ns", percentile(&mut singles, 990));
    let blocks = f64::from(args.pulls);
    report.float("raw_tcp_batch_mb_per_s", blocks * BLOCK_BYTES as f64 / batch_s / 1e6);
    Ok(report)
}
