//! Opening a node: the process claimed (signals, core, NUMA node), L2
//! opened and re-adopted, the L1 arena, the control plane's link, the
//! poller over io_uring, the block service, L3, the transport and, last,
//! the agents' socket — then the line that says it serves.

use super::*;

impl Node {
    /// Opens the node in the order its parts depend on — signals, cores
    /// and NUMA binding, L2 (re-adopting what it holds), the L1 arena, the
    /// control plane's link, io_uring and the poller, the block service,
    /// L3, the transport, and last the agents' socket (a node whose
    /// transport cannot open never appears ready) — and says it serves.
    pub(super) fn open(
        config: &RunnerConfig,
        options: &RunnerOptions,
        ports: &mut RunnerPorts,
        out: &mut dyn Write,
    ) -> Result<Self, RunnerError> {
        let Claimed { signals, cores, numa_node } = claim_process(config, options, ports.stop.is_some())?;
        let l2_config = config.l2();
        if config.l2.format_if_missing && l2_config.paths.iter().all(|p| !p.exists()) {
            try_to!("formatting the L2 tier", format(&l2_config));
        }
        let tier = try_to!("opening the L2 tier", L2Tier::open(&l2_config));
        let epoch = tier.epoch();
        let found = try_to!("re-adopting L2", tier.readopt(config.l2.queue_depth));
        let mut arena_config = config.arena(epoch);
        arena_config.numa_node = numa_node;
        let (arena, table) = try_to!("creating the L1 arena", Arena::create(&arena_config));
        let region = try_to!("mapping the L1 slots", arena.region());
        let link = link_to_cp(config, &tier, &found, &arena)?;
        let wakeup = match ports.wakeup.take() {
            Some(wakeup) => wakeup,
            None => Arc::new(try_to!("creating the wake-up eventfd", Wakeup::new())),
        };
        let mut poller = open_poller(config, &tier, &region, &wakeup, epoch)?;
        let p = &config.poller;
        let l2_slots = L2Slots::from_readoption(tier.geometry(), &found);
        let header = *arena.header();
        let BlockService { pool, l3_scan, tenants } = open_pool(config, ports, &tier, &found, &arena, &wakeup)?;
        let park_fds: Vec<libc::pollfd> = Vec::with_capacity(os::PARK_FDS_MAX);
        let extra_fds = vec![-1; os::PARK_FDS_MAX];
        let node_id = config.node.id;
        let (transport, peers_by_node) = open_transport(ports, &region, node_id, epoch)?;
        // The agents' socket is bound last: a node whose transport (its listen
        // address, its RDMA device, its peers) cannot open never appears ready.
        let attach = open_attach(config, &tenants, &arena, epoch)?;
        let selftest = (options.selftest_blocks > 0)
            .then(|| Selftest::adopting(config, options.selftest_blocks, l2_config.slot_bytes, &table, &tier, &found));
        let events = vec![Event::placeholder(); p.batch_max as usize];
        poller.seal();
        announce(out, epoch, &tier, &found, &arena, &l2_slots, &cores, numa_node, config.l3.is_some());

        Ok(Self {
            attach,
            peers_by_node,
            transport,
            extra_fds,
            park_fds,
            l3_scan,
            pool,
            l2_slots,
            poller,
            wakeup,
            link,
            region,
            table,
            arena,
            geometry: tier.geometry(),
            tier: Some(tier),
            signals,
            selftest,
            events,
            transfers: Transfers::new(),
            epoch,
            header,
            node_id,
            reconnect: Reconnect::new(),
            clock: MonotonicClock,
            pace: serve::Pace::default(),
        })
    }
}

/// What [`claim_process`] holds for the runner.
struct Claimed {
    signals: Option<Signals>,
    cores: Vec<usize>,
    numa_node: Option<u32>,
}

/// What the runner claims of its process before anything else: SIGTERM
/// and SIGINT blocked and read through a signalfd (unless the embedder
/// stops it through a flag), the poll thread pinned to its core, memory
/// bound to its NUMA node. The signals, the cores and the node.
fn claim_process(config: &RunnerConfig, options: &RunnerOptions, stop_flag: bool) -> Result<Claimed, RunnerError> {
    // Before anything else: later threads inherit the blocked mask. An
    // embedder that passes a stop flag owns termination (`lake serve` reads
    // SIGTERM itself and stops the pool through the flag): a second
    // signalfd here would take the one signal from it, and the embedder
    // would wait for ever on a pool already stopped.
    let signals = if stop_flag { None } else { Some(try_to!("blocking SIGTERM/SIGINT", Signals::new())) };
    let cores = options.cores.clone().unwrap_or_else(|| config.node.cores.clone());
    if let Some(&core) = cores.first() {
        let allowed = try_to!("reading the allowed cores", os::allowed_cores());
        if !allowed.contains(&core) {
            return Err(RunnerError::Config(format!(
                "--cores: core {core} is not available to this process (allowed: {allowed:?})"
            )));
        }
        try_to!("pinning the poll thread", os::pin_to_core(core));
    }
    let numa_node = options.numa_node.or(config.node.numa_node);
    if let Some(node) = numa_node {
        if !crate::numa::node_exists(node) {
            return Err(RunnerError::Config(format!(
                "--numa-node: no NUMA node {node} (nodes: {:?})",
                crate::numa::nodes()
            )));
        }
        // For the runner's whole life: every pool below lands on the node.
        try_to!("binding memory to the NUMA node", crate::numa::bind_thread(node));
    }
    Ok(Claimed { signals, cores, numa_node })
}

/// io_uring over the L2 files, with the L1 arena and the wake-up eventfd
/// registered, and the poller that drives it.
fn open_poller(
    config: &RunnerConfig,
    tier: &L2Tier,
    region: &Arc<SlotRegion>,
    wakeup: &Wakeup,
    epoch: u64,
) -> Result<Poller<UringBackend>, RunnerError> {
    let mut backend = try_to!(
        "setting up io_uring",
        UringBackend::new(try_to!("opening L2 files for io_uring", tier.backend_files()), config.l2.queue_depth)
    );
    // SAFETY: the region keeps the arena mapped, and it outlives the
    // backend: the poller (which owns the backend) is dropped first
    // (see `Node`).
    try_to!("registering the L1 arena with io_uring", unsafe { backend.register_region(region) });
    try_to!("registering the wake-up eventfd with io_uring", backend.register_eventfd(wakeup.fd()));
    let poller_config = poller_config(config, tier.geometry(), epoch);
    Ok(try_to!("building the poller", Poller::new(poller_config, backend, Arc::clone(region))))
}

/// The poller's settings from the config's, over L2 `geometry`.
pub(super) fn poller_config(config: &RunnerConfig, geometry: L2Geometry, epoch: u64) -> PollerConfig {
    let p = &config.poller;
    PollerConfig {
        epoch,
        ops_max: p.ops_max,
        batch_max: p.batch_max,
        io_retries_max: p.io_retries_max,
        flush_delay_ns: p.flush_delay_us * 1000,
        flush_batch: p.flush_batch,
        l2: geometry,
        background_in_flight_max: config.l2.background_depth,
    }
}

/// The transport's id of each peer node.
pub(super) type PeersByNode = Vec<(u32, crate::transport::PeerId)>;

/// The node's transport, where it has a listen address or peers: TCP,
/// authenticated where the node has a link key, with RDMA negotiated over
/// it where a device is; and the peers' ids by node.
fn open_transport(
    ports: &RunnerPorts,
    region: &SlotRegion,
    node_id: u32,
    epoch: u64,
) -> Result<(Option<Box<dyn crate::transport::Links>>, PeersByNode), RunnerError> {
    // Blocks peers send into this node's L1 (P→D, replication), and the
    // copies lake-cp asks of this node for others.
    let mut transport = if ports.transport_listen.is_some() || !ports.transport_peers.is_empty() {
        let mut config = crate::transport::tcp::TcpConfig::default();
        if let Some(max) = ports.transport_inbound_max {
            config.inbound_max = max;
        }
        let listen = ports.transport_listen;
        let mut transport = crate::transport::tcp::TcpTransport::new(config, listen)
            .map_err(|e| fail(&format!("transport.listen {listen:?}"))(&e))?;
        if let Some(key) = &ports.link_key {
            transport.authenticate(key.clone(), u64::from(node_id)).map_err(|e| fail("transport")(&e))?;
        }
        // The node's transport: TCP, or RDMA negotiated over TCP with each
        // peer where a device is, for the L1 arena peers read blocks from.
        // SAFETY: the region keeps the arena mapped, and the transport is
        // dropped before it (see `Node`).
        let links = unsafe {
            crate::transport::rdma::open_links(transport, ports.rdma.as_ref(), region.base(), region.len(), epoch)
        };
        Some(links.map_err(|e| fail("transport.rdma")(&e))?)
    } else if let Some(device) = &ports.rdma {
        return Err(RunnerError::Config(format!(
            "transport.rdma {device:?}: RDMA runs under the node's transport; give it a listen address or peers"
        )));
    } else {
        None
    };
    let mut peers_by_node = Vec::with_capacity(ports.transport_peers.len());
    if let Some(transport) = &mut transport {
        for (node, rails) in &ports.transport_peers {
            let peer = transport.add_peer_rails(rails).map_err(|e| fail(&format!("transport peer {node}"))(&e))?;
            peers_by_node.push((*node, peer));
        }
    }
    Ok((transport, peers_by_node))
}

/// The agents' socket, where the config names one: its ports in shared
/// memory, its mode and group, and the tenants' push caps for agents to
/// keep to.
fn open_attach(
    config: &RunnerConfig,
    tenants: &[crate::rates::TenantRate],
    arena: &Arena,
    epoch: u64,
) -> Result<Option<attach::AttachServer>, RunnerError> {
    let arena_region = arena.header().region;
    let attach = match &config.agents.socket {
        None => None,
        Some(socket) => {
            let files = Arc::new(try_to!(
                "creating the agent ports",
                crate::agent::shm::PortFile::create(config.agents.ports, config.agents.depth)
            ));
            let identity = Identity {
                role: Role::DataPlane,
                node: config.node.id,
                pid: std::process::id(),
                region_epoch: epoch,
                features: crate::wire::ATTACH_FEATURES,
                name: "lake-dp",
            };
            let mut server = attach::AttachServer::bind(socket, files, &identity, arena_region)
                .map_err(|e| fail(&format!("agents.socket {}", socket.display()))(&e))?;
            let (gid, mode, policy) = config.agents.access().map_err(|e| RunnerError::Config(e.0))?;
            server
                .restrict(policy, mode, gid)
                .map_err(|e| fail(&format!("agents.socket {}: mode and group", socket.display()))(&e))?;
            // The caps on tenants' pushes, for the agents to keep to.
            let push_caps: Vec<(Vec<u64>, u64)> = config
                .tenants
                .iter()
                .zip(tenants)
                .filter_map(|(section, rate)| section.push_bytes_per_s.map(|cap| (rate.namespaces.clone(), cap)))
                .collect();
            server.push_caps(&push_caps).map_err(|e| RunnerError::Config(format!("tenants: {e}")))?;
            if let Some(ports) = config.agents.ports_per_uid {
                server.limit_ports_per_uid(ports as usize);
            }
            server.pass_mirror(config.agents.mirror.clone());
            if arena.geometry().partitioned() {
                let partitions = config.partitions().map_err(|e| RunnerError::Config(e.0))?;
                let mut files = Vec::with_capacity(partitions.each.len() + 1);
                for index in 0..=partitions.each.len() {
                    let fd = arena.partition_fd(index).ok_or_else(|| RunnerError::Config("partitions".into()))?;
                    files.push(try_to!("keeping a partition's file for the agents", fd.try_clone_to_owned()));
                }
                server.partition(partitions, files);
            }
            Some(server)
        }
    };
    Ok(attach)
}

/// The block service and what feeds it: L3's scan of the store, the
/// tenants' rates.
struct BlockService {
    pool: pool::Pool,
    l3_scan: Option<std::sync::mpsc::Receiver<ScanMessage>>,
    tenants: Vec<crate::rates::TenantRate>,
}

/// The block service over the node's L1, L2 (with what L2 re-adopted)
/// and L3: its load reserve, commit check (on its own thread where it
/// can have one) and tenants' rates.
fn open_pool(
    config: &RunnerConfig,
    ports: &mut RunnerPorts,
    tier: &L2Tier,
    found: &crate::l2::Readoption,
    arena: &Arena,
    wakeup: &Arc<Wakeup>,
) -> Result<BlockService, RunnerError> {
    let header = *arena.header();
    let epoch = tier.epoch();
    let shape = pool::PoolShape {
        node: config.node.id,
        epoch,
        l1_region: header.region,
        l1_slots: header.slots,
        geometry: tier.geometry(),
        ops: config.poller.ops_max,
    };
    let shared_ports = if config.agents.socket.is_some() { config.agents.ports } else { 0 };
    let mut pool = pool::Pool::new(&shape, std::mem::take(&mut ports.agents), shared_ports);
    pool.set_load_reserve(config.l1.load_reserve_slots);
    let mut l3_scan = None;
    if let Some(l3) = &config.l3 {
        let (tier, scan) = start_l3(l3, wakeup)?;
        pool.set_l3(tier);
        l3_scan = Some(scan);
    }
    pool.set_commit_check(ports.commit_check);
    // The check then runs beside the poller; without its thread (no agent
    // record left for its pins) the poller reads a share each pass.
    if let Err(e) = pool.start_verifier(arena, Arc::clone(wakeup)) {
        tracing::warn!(event = "commit_check_thread", error = %e, "payloads are read on the poll thread");
    }
    let tenants = config
        .tenants
        .iter()
        .enumerate()
        .map(|(index, tenant)| tenant.rate(index))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RunnerError::Config(e.to_string()))?;
    pool.set_rates(crate::rates::TenantRates::new(&tenants));
    let quotas = config
        .quotas
        .iter()
        .enumerate()
        .map(|(index, quota)| quota.quota(index))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RunnerError::Config(e.to_string()))?;
    pool.set_quotas(crate::quota::L1Quotas::new(&quotas, header.slots).map_err(RunnerError::Config)?);
    pool.set_partitions(config.partitions().map_err(|e| RunnerError::Config(e.0))?);
    for adopted in &found.adopted {
        let slot = L2Slot { file: adopted.file, slot: adopted.slot };
        pool.l2_written(slot, &adopted.meta);
    }
    Ok(BlockService { pool, l3_scan, tenants })
}

/// The line that says the node serves, with what it found and holds.
#[allow(clippy::too_many_arguments)] // one line's fields
fn announce(
    out: &mut dyn Write,
    epoch: u64,
    tier: &L2Tier,
    found: &crate::l2::Readoption,
    arena: &Arena,
    l2_slots: &L2Slots,
    cores: &[usize],
    numa_node: Option<u32>,
    l3: bool,
) {
    let _ = writeln!(
        out,
        "{{\"event\":\"serving\",\"pid\":{},\"epoch\":{epoch},\"previous_shutdown_clean\":{},\"adopted\":{},\
         \"scrubbed\":{},\"torn\":{},\"damaged\":{},\"l1_bytes\":{},\"l1_chunk_bytes\":{},\"l2_free_slots\":{},\"core\":{},\"numa_node\":{},\"l3\":{}}}",
        std::process::id(),
        tier.previous_shutdown_clean(),
        found.adopted.len(),
        found.scrubbed,
        found.torn.len(),
        found.damaged.len(),
        arena.header().total_bytes,
        arena.header().chunk_bytes,
        l2_slots.free_slots(),
        cores.first().map_or("null".into(), ToString::to_string),
        numa_node.map_or("null".into(), |n| n.to_string()),
        l3,
    );
    let _ = out.flush();
}
