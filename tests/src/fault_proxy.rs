//! A seeded userspace fault proxy for TCP: it relays every connection made
//! to it to a target, chunk by chunk, and — while its faults are on —
//! delays chunks, stalls a connection, flips a byte, drops a chunk, swaps
//! two chunks (bytes reordered) or resets the connection. This kernel has
//! no `netem` qdisc; the proxy stands in for a bad network between nodes.
//! One seed gives each connection and direction its own fault sequence.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use lake_dp::rng::SimRng;

/// What goes wrong, per relayed chunk, in chances per million.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Seeds every connection's fault sequence.
    pub seed: u64,
    /// Bytes relayed per chunk at most.
    pub chunk_bytes: usize,
    /// A chunk waits up to `delay_max_us` first.
    pub delay: u32,
    /// Longest delay.
    pub delay_max_us: u64,
    /// The connection stalls `stall_ms` before the chunk.
    pub stall: u32,
    /// Length of a stall.
    pub stall_ms: u64,
    /// One byte of the chunk is flipped.
    pub flip: u32,
    /// The chunk is dropped (the stream loses bytes).
    pub drop: u32,
    /// The chunk goes after the next one (bytes reordered).
    pub swap: u32,
    /// The connection is reset (both ways, abruptly).
    pub reset: u32,
}

/// Faults injected so far.
#[derive(Debug, Default)]
pub struct FaultCounts {
    /// Connections relayed.
    pub connections: AtomicU64,
    /// Bytes relayed.
    pub bytes: AtomicU64,
    /// Delays, stalls, flips, drops, swaps, resets injected.
    pub delays: AtomicU64,
    /// See `delays`.
    pub stalls: AtomicU64,
    /// See `delays`.
    pub flips: AtomicU64,
    /// See `delays`.
    pub drops: AtomicU64,
    /// See `delays`.
    pub swaps: AtomicU64,
    /// See `delays`.
    pub resets: AtomicU64,
}

impl FaultCounts {
    /// Faults of every kind injected so far.
    pub fn total(&self) -> u64 {
        [&self.delays, &self.stalls, &self.flips, &self.drops, &self.swaps, &self.resets]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

/// A running proxy; stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
    enabled: Arc<AtomicBool>,
    /// What it injected.
    pub counts: Arc<FaultCounts>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// A proxy on a free loopback port relaying to `target`, faults on.
    pub fn start(target: SocketAddr, faults: Faults) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let enabled = Arc::new(AtomicBool::new(true));
        let counts = Arc::new(FaultCounts::default());
        let accept = {
            let (stop, enabled, counts) = (Arc::clone(&stop), Arc::clone(&enabled), Arc::clone(&counts));
            std::thread::spawn(move || accept_loop(&listener, target, faults, &stop, &enabled, &counts))
        };
        Ok(Self { address, stop, enabled, counts, accept: Some(accept) })
    }

    /// Where to connect instead of the target.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Turns the faults on or off (connections stay as they are).
    pub fn set_faults(&self, on: bool) {
        self.enabled.store(on, Ordering::Release);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
    }
}

fn accept_loop(
    listener: &TcpListener,
    target: SocketAddr,
    faults: Faults,
    stop: &Arc<AtomicBool>,
    enabled: &Arc<AtomicBool>,
    counts: &Arc<FaultCounts>,
) {
    let mut seeds = SimRng::new(faults.seed);
    while !stop.load(Ordering::Acquire) {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(_) => continue,
        };
        let Ok(server) = TcpStream::connect(target) else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        counts.connections.fetch_add(1, Ordering::Relaxed);
        let _ = client.set_nonblocking(false);
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        for (from, to) in [(&client, &server), (&server, &client)] {
            let (Ok(from), Ok(to)) = (from.try_clone(), to.try_clone()) else { continue };
            let rng = seeds.fork();
            let (stop, enabled, counts) = (Arc::clone(stop), Arc::clone(enabled), Arc::clone(counts));
            std::thread::spawn(move || relay(from, to, faults, rng, &stop, &enabled, &counts));
        }
    }
}

/// One direction of one connection.
fn relay(
    mut from: TcpStream,
    mut to: TcpStream,
    faults: Faults,
    mut rng: SimRng,
    stop: &AtomicBool,
    enabled: &AtomicBool,
    counts: &FaultCounts,
) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(50)));
    let mut buffer = vec![0u8; faults.chunk_bytes.max(1)];
    let mut held: Option<Vec<u8>> = None;
    loop {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let n = match from.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                // Nothing to read: a chunk held back for a swap goes now.
                if let Some(chunk) = held.take()
                    && to.write_all(&chunk).is_err()
                {
                    break;
                }
                continue;
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        counts.bytes.fetch_add(n as u64, Ordering::Relaxed);
        let mut chunk = buffer[..n].to_vec();
        if enabled.load(Ordering::Acquire) {
            if rng.chance(faults.reset) {
                counts.resets.fetch_add(1, Ordering::Relaxed);
                reset(&from);
                reset(&to);
                return;
            }
            if rng.chance(faults.delay) {
                counts.delays.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_micros(rng.below(faults.delay_max_us.max(1))));
            }
            if rng.chance(faults.stall) {
                counts.stalls.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(faults.stall_ms));
            }
            if rng.chance(faults.flip) {
                counts.flips.fetch_add(1, Ordering::Relaxed);
                let at = usize::try_from(rng.below(n as u64)).unwrap_or(0);
                chunk[at] ^= 1 << rng.below(8);
            }
            if rng.chance(faults.drop) {
                counts.drops.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if held.is_none() && rng.chance(faults.swap) {
                counts.swaps.fetch_add(1, Ordering::Relaxed);
                held = Some(chunk);
                continue;
            }
        }
        if to.write_all(&chunk).is_err() {
            break;
        }
        if let Some(chunk) = held.take()
            && to.write_all(&chunk).is_err()
        {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Closes a connection abruptly: the peer sees a reset, not an end.
fn reset(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a correctly sized option value.
    let _ = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            libc::socklen_t::try_from(size_of::<libc::linger>()).unwrap_or(0),
        )
    };
    let _ = stream.shutdown(Shutdown::Both);
}
