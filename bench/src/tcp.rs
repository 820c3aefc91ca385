//! `lake-bench tcp`: blocks from one node's slots into another's over
//! loopback TCP through Lake's transport — striped over several
//! connections, received straight into the target slots, every block's
//! CRCs checked there before its ack — against one plain TCP stream
//! moving the same bytes (an iperf-style loop: one writer, one reader,
//! no framing, no checks) in the same run.

// Sizes and counts here are small (slots < 2^24, nanoseconds < 2^64).
#![allow(clippy::cast_possible_truncation)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use lake_dp::Priority;
use lake_dp::model::replica::ObjectKind;
use lake_dp::stored::{ObjectMeta, encode_object};
use lake_dp::transport::frame::{AckStatus, BlockAddr};
use lake_dp::transport::tcp::{Outgoing, TcpConfig, TcpTransport};
use lake_dp::transport::{Landing, check_and_adopt};
use lake_dp::{BlockKey, NamespaceId, RegionId};

use crate::report::Report;

const HEADER: usize = lake_dp::constants::STORED_HEADER_BYTES;

/// The receiving node: slots in memory; a slot is filled by one block at a
/// time (the sender reuses a slot only after its block was acked).
struct Slots {
    memory: memmap2::MmapMut,
    slot_bytes: usize,
    filling: Vec<bool>,
    corrupt: u64,
}

impl Landing for Slots {
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus> {
        let slot = target.slot as usize;
        if slot >= self.filling.len() || self.filling[slot] || len > self.slot_bytes as u64 {
            return Err(AckStatus::Refused);
        }
        self.filling[slot] = true;
        Ok(self.memory[slot * self.slot_bytes..].as_mut_ptr())
    }

    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        let slot = target.slot as usize;
        self.filling[slot] = false;
        let bytes = &mut self.memory[slot * self.slot_bytes..(slot + 1) * self.slot_bytes];
        match check_and_adopt(bytes, len, target) {
            Ok(_) => AckStatus::Landed,
            Err(status) => {
                self.corrupt += 1;
                status
            }
        }
    }

    fn abandoned(&mut self, target: &BlockAddr) {
        if let Some(f) = self.filling.get_mut(target.slot as usize) {
            *f = false;
        }
    }
}

/// A stored object of `block_bytes` (header and payload), key `seed`, in
/// namespace 1.
pub(crate) fn object(block_bytes: usize, seed: u32) -> Result<Vec<u8>, String> {
    let payload_len = block_bytes - HEADER;
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&seed.to_le_bytes());
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey(key),
        parent_key: BlockKey::NONE,
        block_index: seed,
        namespace: NamespaceId(1),
        layout_fingerprint: 1,
        region: RegionId(1),
        region_epoch: 1,
        slot: seed,
        generation: 1,
        committed_unix_ns: 1,
        payload_len: payload_len as u64,
        segment_bytes: (payload_len as u64).div_ceil(64).next_multiple_of(4096).max(4096),
    };
    let payload: Vec<u8> = (0..payload_len).map(|i| (i as u32).wrapping_mul(seed | 1).to_le_bytes()[1]).collect();
    let mut out = vec![0u8; lake_dp::stored::object_bytes(payload_len as u64) as usize];
    let len = encode_object(&meta, &payload, &mut out).map_err(|e| format!("encoding a block: {e}"))?;
    out.truncate(len);
    Ok(out)
}

/// `len` bytes of anonymous memory as a node's arena is: backed by huge
/// pages where the kernel gives them (transparent, on request), touched
/// once up front — no page faults, and few TLB misses, inside a
/// measurement.
fn arena_memory(len: usize) -> Result<memmap2::MmapMut, String> {
    let mut map =
        memmap2::MmapOptions::new().len(len.max(1)).map_anon().map_err(|e| format!("mapping {len} bytes: {e}"))?;
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(0xee);
    Ok(map)
}

fn cpu_seconds() -> f64 {
    let mut usage = core::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: a valid out-pointer for getrusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
        return 0.0;
    }
    // SAFETY: initialised by the successful call above.
    let usage = unsafe { usage.assume_init() };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// Lake's transport: GB/s, CPU cores used.
fn lake(
    block_bytes: usize,
    total: u64,
    config: TcpConfig,
    window_bytes: u64,
    arena_bytes: u64,
    key: Option<&lake_dp::auth::LinkKey>,
) -> Result<(f64, f64, u64), String> {
    let in_flight = (window_bytes / block_bytes as u64).clamp(1, 4096) as usize;
    // Slots at the receiver: twice what may be in flight (ids carry them
    // in 24 bits).
    // The receiver's slots span an arena (used round-robin, so blocks land
    // in cold memory as on a node whose arena is far larger than a cache).
    let slots = (in_flight * 2).max((arena_bytes / block_bytes as u64) as usize).min(1 << 24);
    let mut receiver = TcpTransport::new(config, Some("127.0.0.1:0".parse().map_err(|e| format!("{e}"))?))
        .map_err(|e| e.to_string())?;
    if let Some(key) = key {
        receiver.authenticate(key.clone(), 2).map_err(|e| e.to_string())?;
    }
    let address = receiver.local_addr().ok_or("no listening address")?;
    let stop = Arc::new(AtomicBool::new(false));
    // Made (and touched) before any clock starts.
    let memory = arena_memory(slots * block_bytes)?;
    let receiving = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut node = Slots { memory, slot_bytes: block_bytes, filling: vec![false; slots], corrupt: 0 };
            let start = Instant::now();
            let mut sink = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let now = start.elapsed().as_nanos() as u64;
                receiver.poll_wait(&mut node, now, &mut sink, std::time::Duration::from_millis(1));
            }
            (receiver.stats, node.corrupt)
        })
    };
    let mut sender = TcpTransport::new(config, None).map_err(|e| e.to_string())?;
    if let Some(key) = key {
        sender.authenticate(key.clone(), 1).map_err(|e| e.to_string())?;
    }
    let peer = sender.add_peer(address).map_err(|e| e.to_string())?;
    // The sender's blocks span a quarter of that (cold as well).
    let distinct = ((arena_bytes / 4 / block_bytes as u64) as usize).clamp(16, 4096);
    let mut sources = arena_memory(distinct * block_bytes)?;
    for (i, place) in sources.chunks_mut(block_bytes).enumerate() {
        let block = object(block_bytes, i as u32)?;
        place[..block.len()].copy_from_slice(&block);
    }
    let source_len = object(block_bytes, 0)?.len();
    let start = Instant::now();
    let clock = || start.elapsed().as_nanos() as u64;
    let mut none = Slots { memory: arena_memory(0)?, slot_bytes: 0, filling: Vec::new(), corrupt: 0 };
    while sender.connected(peer) < config.streams_per_peer {
        if start.elapsed().as_secs() > 10 {
            return Err("the transport's connections never came up".into());
        }
        sender.poll(&mut none, clock(), &mut Vec::new());
    }
    let blocks = total.div_ceil(block_bytes as u64);
    let mut done = Vec::with_capacity(in_flight);
    let mut free: std::collections::VecDeque<u32> = (0..slots as u32).collect();
    let (mut sent, mut completed, mut failed) = (0u64, 0u64, 0u64);
    let cpu_before = cpu_seconds();
    let started = Instant::now();
    while completed < blocks {
        while sent < blocks && sender.in_flight() < in_flight {
            let Some(slot) = free.pop_front() else { break };
            let source = &sources[(sent % distinct as u64) as usize * block_bytes..][..source_len];
            // The transfer id carries its slot (completions come in any
            // order across the connections).
            let block = Outgoing {
                transfer: (sent << 24) | u64::from(slot),
                peer,
                source: source.as_ptr(),
                len: source.len() as u64,
                target: BlockAddr { region: 1, epoch: 1, slot, generation: 1 },
                priority: Priority::WriteBack,
                trace: 0,
                namespace: 0,
            };
            // SAFETY: `sources` outlives every transfer (all complete
            // before this function returns).
            if unsafe { sender.write(&block, clock()) }.is_err() {
                free.push_front(slot);
                break;
            }
            sent += 1;
        }
        // Nothing more to send until acks come: sleep for them.
        let wait = if sent < blocks && sender.in_flight() < in_flight {
            std::time::Duration::ZERO
        } else {
            std::time::Duration::from_millis(1)
        };
        sender.poll_wait(&mut none, clock(), &mut done, wait);
        for completion in done.drain(..) {
            completed += 1;
            if completion.result.is_err() {
                failed += 1;
            }
            free.push_back((completion.transfer & 0xff_ffff) as u32);
        }
        if start.elapsed().as_secs() > 120 {
            return Err(format!("{completed} of {blocks} blocks in 120 s"));
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let cores = (cpu_seconds() - cpu_before) / seconds;
    stop.store(true, Ordering::Relaxed);
    let (stats, corrupt) = receiving.join().map_err(|_| "the receiving thread panicked")?;
    if failed > 0 || corrupt > 0 || stats.landed != blocks {
        return Err(format!("{failed} failed, {corrupt} corrupt, {} of {blocks} landed", stats.landed));
    }
    Ok((blocks as f64 * block_bytes as f64 / seconds / 1e9, cores, blocks))
}

/// One plain TCP stream over loopback: a writer and a reader thread,
/// `chunk` bytes a call; the reader reads into a buffer of `spread` bytes
/// (touched up front), moving through it — one chunk, reused, as iperf
/// does, or a whole arena's worth of cold memory.
fn raw_stream(total: u64, chunk: usize, spread: usize) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    // Made before the clock starts.
    let mut buffer = arena_memory(spread.max(chunk))?;
    let reader = std::thread::spawn(move || -> Result<u64, String> {
        let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
        let mut got = 0u64;
        let mut at = 0;
        while got < total {
            if at + chunk > buffer.len() {
                at = 0;
            }
            match stream.read(&mut buffer[at..at + chunk]) {
                Ok(0) => break,
                Ok(n) => {
                    got += n as u64;
                    at += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(got)
    });
    let mut stream = TcpStream::connect(address).map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let data = vec![0x5au8; chunk];
    let started = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        let n = chunk.min((total - sent) as usize);
        stream.write_all(&data[..n]).map_err(|e| e.to_string())?;
        sent += n as u64;
    }
    drop(stream);
    let got = reader.join().map_err(|_| "the reader panicked")??;
    let seconds = started.elapsed().as_secs_f64();
    if got != total {
        return Err(format!("the raw stream moved {got} of {total} bytes"));
    }
    Ok(total as f64 / seconds / 1e9)
}

/// `SO_ZEROCOPY` (linux/asm-generic/socket.h): lets a socket take
/// `MSG_ZEROCOPY` sends.
const SO_ZEROCOPY: libc::c_int = 60;
/// `SO_EE_ORIGIN_ZEROCOPY` (linux/errqueue.h): a send's pages released.
const SO_EE_ORIGIN_ZEROCOPY: u8 = 5;
/// `SO_EE_CODE_ZEROCOPY_COPIED`: the kernel copied after all.
const SO_EE_CODE_ZEROCOPY_COPIED: u8 = 1;

/// Source buffers a zero-copy stream cycles through (a buffer is reused
/// only once the kernel says it let go of its pages).
const ZEROCOPY_BUFFERS: usize = 64;

/// Reads the zero-copy notifications queued on `fd`'s error queue (waits
/// for one first if `wait`): returns how many sends they release, and how
/// many of those the kernel copied anyway.
fn reap_zerocopy(fd: libc::c_int, wait: bool, done: &mut u64, copied: &mut u64) -> Result<(), String> {
    if wait {
        let mut pfd = libc::pollfd { fd, events: 0, revents: 0 };
        // SAFETY: one valid pollfd; POLLERR is always reported.
        if unsafe { libc::poll(&raw mut pfd, 1, 1000) } < 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
    }
    loop {
        let mut control = [0u64; 16];
        let mut msg: libc::msghdr = empty_msghdr();
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = core::mem::size_of_val(&control) as _;
        // SAFETY: a msghdr with no data buffers and a control buffer of
        // its stated size.
        let n = unsafe { libc::recvmsg(fd, &raw mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return if e.kind() == std::io::ErrorKind::WouldBlock { Ok(()) } else { Err(e.to_string()) };
        }
        // SAFETY: the control buffer the kernel filled, walked with the
        // libc macros within `msg_controllen`.
        let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
        while !cmsg.is_null() {
            // SAFETY: a header inside the control buffer (CMSG_FIRSTHDR and
            // CMSG_NXTHDR keep it inside).
            let header = unsafe { cmsg.read_unaligned() };
            let err = (header.cmsg_level == libc::SOL_IP && header.cmsg_type == libc::IP_RECVERR).then(|| {
                // SAFETY: an IP_RECVERR message's data is a sock_extended_err.
                let data = unsafe { libc::CMSG_DATA(cmsg) };
                // SAFETY: as above, inside the control buffer.
                unsafe { data.cast::<libc::sock_extended_err>().read_unaligned() }
            });
            // SAFETY: as above.
            cmsg = unsafe { libc::CMSG_NXTHDR(&raw const msg, cmsg) };
            if let Some(err) = err
                && err.ee_origin == SO_EE_ORIGIN_ZEROCOPY
            {
                // Sends `ee_info..=ee_data` (numbered from 0) released.
                let released = u64::from(err.ee_data.wrapping_sub(err.ee_info)) + 1;
                *done = (*done).max(u64::from(err.ee_data) + 1);
                if err.ee_code & SO_EE_CODE_ZEROCOPY_COPIED != 0 {
                    *copied += released;
                }
            }
        }
    }
}

fn empty_msghdr() -> libc::msghdr {
    // SAFETY: msghdr is plain old data; all-zero is an empty message.
    unsafe { core::mem::zeroed() }
}

/// The plain stream of [`raw_stream`] sent with `MSG_ZEROCOPY` instead of
/// copies: the rate, and the fraction of sends the kernel copied anyway
/// (loopback and veth deliver locally, where the kernel must copy).
fn zerocopy_stream(total: u64, chunk: usize) -> Result<(f64, f64), String> {
    use std::os::fd::AsRawFd;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    let mut buffer = arena_memory(chunk)?;
    let reader = std::thread::spawn(move || -> Result<u64, String> {
        let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
        let mut got = 0u64;
        while got < total {
            match stream.read(&mut buffer[..]) {
                Ok(0) => break,
                Ok(n) => got += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(got)
    });
    let stream = TcpStream::connect(address).map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    let on: libc::c_int = 1;
    // SAFETY: an int option of its size on a live socket.
    let set = unsafe {
        libc::setsockopt(fd, libc::SOL_SOCKET, SO_ZEROCOPY, (&raw const on).cast(), size_of::<libc::c_int>() as _)
    };
    if set != 0 {
        return Err(format!("SO_ZEROCOPY: {}", std::io::Error::last_os_error()));
    }
    let mut sources = arena_memory(chunk * ZEROCOPY_BUFFERS)?;
    sources.fill(0x5a);
    // The send number that last used each buffer.
    let mut last_send = [None::<u64>; ZEROCOPY_BUFFERS];
    let (mut issued, mut done, mut copied) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let mut sent = 0u64;
    let mut turn = 0usize;
    while sent < total {
        let slot = turn % ZEROCOPY_BUFFERS;
        turn += 1;
        while last_send[slot].is_some_and(|s| s >= done) {
            reap_zerocopy(fd, true, &mut done, &mut copied)?;
        }
        let n = chunk.min((total - sent) as usize);
        let mut at = slot * chunk;
        let end = at + n;
        while at < end {
            let from = sources.as_ptr().wrapping_add(at);
            // SAFETY: a live socket; the range lies in `sources`, not
            // written again until the kernel releases this send.
            let wrote = unsafe { libc::send(fd, from.cast(), end - at, libc::MSG_ZEROCOPY) };
            if wrote < 0 {
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    // Too many sends' pages held: wait for releases.
                    Some(libc::ENOBUFS) => {
                        reap_zerocopy(fd, true, &mut done, &mut copied)?;
                        continue;
                    }
                    _ => return Err(e.to_string()),
                }
            }
            last_send[slot] = Some(issued);
            issued += 1;
            at += wrote.cast_unsigned();
        }
        sent += n as u64;
        reap_zerocopy(fd, false, &mut done, &mut copied)?;
    }
    while done < issued {
        reap_zerocopy(fd, true, &mut done, &mut copied)?;
    }
    drop(stream);
    let got = reader.join().map_err(|_| "the reader panicked")??;
    let seconds = started.elapsed().as_secs_f64();
    if got != total {
        return Err(format!("the zero-copy stream moved {got} of {total} bytes"));
    }
    Ok((total as f64 / seconds / 1e9, copied as f64 / issued.max(1) as f64))
}

/// This benchmark's flags.
#[derive(clap::Args, Debug)]
pub(crate) struct TcpArgs {
    /// Payload bytes of a block.
    #[arg(long, default_value_t = 1 << 20)]
    pub(crate) block_bytes: usize,
    /// Bytes moved per round.
    #[arg(long, default_value_t = 1 << 30)]
    pub(crate) total_bytes: u64,
    /// TCP connections per peer.
    #[arg(long, default_value_t = 4)]
    pub(crate) streams: usize,
    /// Bytes per slice on the wire.
    #[arg(long, default_value_t = 1 << 20)]
    pub(crate) slice_bytes: u32,
    /// Bytes in flight per peer (default: 16 MiB, at least three blocks).
    #[arg(long)]
    pub(crate) window_bytes: Option<u64>,
    /// Arena bytes at each end.
    #[arg(long, default_value_t = 1 << 30)]
    pub(crate) arena_bytes: u64,
    /// Rounds measured.
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Also run every round with a link key (handshake, two tags a frame).
    #[arg(long, value_name = "on|off", default_value = "off")]
    pub(crate) auth: String,
    /// Threads tagging large slices (as lake serve --tag-threads).
    #[arg(long, default_value_t = 0)]
    pub(crate) tag_threads: usize,
}

pub(crate) fn run(args: &TcpArgs) -> Result<Report, String> {
    // `--tag-threads N`: payload tags of large slices spread over N
    // threads (`lake_dp::auth::spread_tags`, as `lake serve --tag-threads`).
    let tag_threads: usize = args.tag_threads;
    lake_dp::auth::spread_tags(tag_threads)?;
    // `--auth on`: every round also runs the transport with a link key
    // (handshake, two tags a frame), for the ratio and the added latency.
    let auth = match args.auth.as_str() {
        "on" => Some(lake_dp::auth::LinkKey::from_bytes([0x42; 32])),
        "off" => None,
        other => return Err(format!("--auth is on or off, not {other}")),
    };
    let block_bytes: usize = args.block_bytes;
    let total: u64 = args.total_bytes;
    let streams: usize = args.streams;
    let slice_bytes: u32 = args.slice_bytes;
    // 16 MiB in flight, and never fewer than three blocks: with one block
    // in flight the link idles while the receiver checks it and acks.
    let window: u64 = args.window_bytes.unwrap_or_else(|| (16 << 20).max(3 * block_bytes as u64));
    let arena: u64 = args.arena_bytes;
    let rounds: usize = args.rounds;
    if block_bytes <= HEADER {
        return Err(format!("--block-bytes must exceed the {HEADER}-byte stored header"));
    }
    let config = TcpConfig { streams_per_peer: streams, slice_bytes, ..TcpConfig::default() };
    let (mut lake_gbps, mut raw_gbps, mut cores) = (Vec::new(), Vec::new(), Vec::new());
    let mut arena_gbps = Vec::new();
    let (mut zerocopy_gbps, mut zerocopy_copied) = (Vec::new(), Vec::new());
    let mut blocks = 0;
    let (mut auth_gbps, mut auth_cores, mut plain_us, mut auth_us) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Interleaved, so both meet the same machine.
    for _ in 0..rounds {
        let (gbps, used, moved) = lake(block_bytes, total, config, window, arena, None)?;
        lake_gbps.push(gbps);
        cores.push(used);
        blocks = moved;
        if let Some(key) = &auth {
            let (gbps, used, _) = lake(block_bytes, total, config, window, arena, Some(key))?;
            auth_gbps.push(gbps);
            auth_cores.push(used);
            // One block in flight at a time: a block's time end to end.
            let probe = (block_bytes as u64 * 256).min(total);
            let per_block_us = |gbps: f64| block_bytes as f64 / (gbps * 1e9) * 1e6;
            let (gbps, _, _) = lake(block_bytes, probe, config, block_bytes as u64, arena, None)?;
            plain_us.push(per_block_us(gbps));
            let (gbps, _, _) = lake(block_bytes, probe, config, block_bytes as u64, arena, Some(key))?;
            auth_us.push(per_block_us(gbps));
        }
        let chunk = block_bytes.min(1 << 20);
        raw_gbps.push(raw_stream(total, chunk, chunk)?);
        arena_gbps.push(raw_stream(total, chunk, usize::try_from(arena).unwrap_or(usize::MAX))?);
        let (gbps, copied) = zerocopy_stream(total, chunk)?;
        zerocopy_gbps.push(gbps);
        zerocopy_copied.push(copied);
    }
    let lake = crate::report::median(&mut lake_gbps);
    let raw = crate::report::median(&mut raw_gbps);
    let mut report = Report::new("tcp");
    report.int("block_bytes", block_bytes as u64);
    report.int("blocks", blocks);
    report.int("streams", streams as u64);
    report.int("slice_bytes", u64::from(slice_bytes));
    report.float("lake_gbps", lake);
    report.float("iperf_gbps", raw);
    report.float("ratio", lake / raw);
    // Beside the goal's baseline: the same plain stream read into cold
    // memory spanning the arena, as Lake's blocks land.
    let into_arena = crate::report::median(&mut arena_gbps);
    report.float("raw_into_arena_gbps", into_arena);
    report.float("ratio_vs_raw_into_arena", lake / into_arena);
    // The same plain stream with MSG_ZEROCOPY sends (the transport writes
    // with writev: zero-copy would be worth its page pinning and error-
    // queue reaping only where it beats this copy).
    report.float("raw_zerocopy_gbps", crate::report::median(&mut zerocopy_gbps));
    report.float("zerocopy_copied_fraction", crate::report::median(&mut zerocopy_copied));
    report.int("window_bytes", window);
    report.int("arena_bytes", arena);
    report.float("cpu_cores_used", crate::report::median(&mut cores));
    report.float("ratio_goal", if block_bytes <= 64 * 1024 { 0.5 } else { 0.9 });
    if auth.is_some() {
        let authenticated = crate::report::median(&mut auth_gbps);
        report.float("lake_auth_gbps", authenticated);
        report.float("auth_ratio", authenticated / lake);
        report.float("auth_ratio_goal", 0.9);
        report.int("tag_threads", lake_dp::auth::tag_threads() as u64);
        report.float("auth_cpu_cores_used", crate::report::median(&mut auth_cores));
        let (plain, tagged) = (crate::report::median(&mut plain_us), crate::report::median(&mut auth_us));
        report.float("block_us_plain", plain);
        report.float("block_us_auth", tagged);
        report.float("auth_added_us_per_block", tagged - plain);
    }
    Ok(report)
}
