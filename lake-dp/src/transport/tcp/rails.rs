//! Peers and their rails: the paths to a peer (one per local interface
//! on a multi-NIC node), the connections opened over each, and what each
//! has carried.

use std::net::SocketAddr;

use mio::net::TcpStream;
use mio::{Interest, Token};

use super::stream::{Link, Stream, connect_from};
use super::{STREAMS_PER_PEER_MAX, TcpError, TcpTransport, io_error};
use crate::model::replica::Priority;
use crate::transport::PeerId;

/// One path to a peer: its address there and, optionally, the local
/// address (interface) to leave from — one rail of a multi-NIC node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rail {
    /// The peer's address on this rail.
    pub remote: SocketAddr,
    /// The local address to bind to (`None`: the kernel's choice).
    pub local: Option<std::net::IpAddr>,
}

impl Rail {
    /// A rail to `remote`, leaving from wherever the kernel routes it.
    pub fn to(remote: SocketAddr) -> Self {
        Self { remote, local: None }
    }

    /// A rail as an operator writes it: `IP:PORT` (the peer's address on
    /// that network, leaving by the kernel's route) or `LOCAL>IP:PORT`
    /// (leaving from local address `LOCAL`: one NIC).
    pub fn parse(text: &str) -> Result<Self, String> {
        let (local, remote) = match text.split_once('>') {
            Some((local, remote)) => {
                (Some(local.parse().map_err(|e| format!("local address {local:?}: {e}"))?), remote)
            }
            None => (None, text),
        };
        let remote = remote.parse().map_err(|e| format!("address {remote:?}: {e}"))?;
        Ok(Self { remote, local })
    }

    /// Rails separated by commas (one peer reached over several NICs).
    pub fn parse_list(text: &str) -> Result<Vec<Self>, String> {
        let rails = text.split(',').map(Self::parse).collect::<Result<Vec<_>, _>>()?;
        if rails.len() > STREAMS_PER_PEER_MAX {
            return Err(format!("{} rails: at most {STREAMS_PER_PEER_MAX}", rails.len()));
        }
        Ok(rails)
    }
}

/// A rail's state at one peer.
pub(super) struct RailState {
    pub(super) rail: Rail,
    /// No new slices before this (it broke lately), and the next wait.
    pub(super) cooldown_until: u64,
    pub(super) cooldown_ns: u64,
    /// Bytes written on it.
    pub(super) bytes: u64,
    /// Times it was set aside after a connection on it broke.
    pub(super) breaks: u64,
}

/// What one rail to a peer carried (for accounting and metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailReport {
    /// The rail as configured.
    pub rail: Rail,
    /// Bytes written on it.
    pub bytes: u64,
    /// Times it was set aside after a connection on it broke.
    pub breaks: u64,
    /// Whether it takes new slices now (not cooling down after a break).
    pub up: bool,
}

/// A slice waiting for a connection with room.
#[derive(Clone, Copy, Debug)]
pub(super) struct PendingSlice {
    pub(super) transfer: u64,
    pub(super) attempt: u32,
    pub(super) offset: u64,
    /// 0: the request for a slot (a block sent to [`ANY_SLOT`]).
    pub(super) len: u64,
}

/// Slices a connection is given at a time at most (with what its kernel
/// queue still holds, over several rails) — or [`FEED_BYTES_MIN`] of small
/// ones: enough for many frames a `writev`, few enough that a slow rail
/// does not hoard slices a fast one could send.
pub(super) const FEED_SLICES: usize = 2;

/// See [`FEED_SLICES`].
pub(super) const FEED_BYTES_MIN: usize = 1 << 20;

/// A rail that broke is passed over this long at first (doubling while it
/// keeps breaking, to 64 times; back to this once a block is acked on it).
pub(super) const RAIL_COOLDOWN_NS: u64 = 200_000_000;

/// A peer's connections: `streams_per_peer` on each rail, rail after rail.
pub(super) struct Peer {
    pub(super) rails: Vec<RailState>,
    /// Token of each connection, `None` while it is down.
    pub(super) streams: Vec<Option<usize>>,
    /// Slices not yet given to a connection, per class, oldest first.
    pub(super) pending: [std::collections::VecDeque<PendingSlice>; Priority::COUNT],
    /// When each down connection may be tried again, and the next wait.
    pub(super) retry_at: Vec<(u64, u64)>,
    /// Why its last connection broke (for a transfer that fails with none
    /// up: "another link key" says more than "no connection").
    pub(super) last_break: Option<String>,
    /// The link version its handshakes offer: this node's latest, until
    /// the peer says it speaks only an older one.
    pub(super) link_version: u8,
}

impl TcpTransport {
    /// A peer at `address`: its connections are opened (non-blocking) now.
    pub fn add_peer(&mut self, address: SocketAddr) -> Result<PeerId, TcpError> {
        self.add_peer_rails(&[Rail::to(address)])
    }

    /// A peer reached over several rails (NICs): `streams_per_peer`
    /// connections on each; slices go to the connections that drain
    /// fastest, away from rails that broke lately.
    pub fn add_peer_rails(&mut self, rails: &[Rail]) -> Result<PeerId, TcpError> {
        let id = PeerId(u32::try_from(self.peers.len()).map_err(|_| TcpError::Setting("too many peers".into()))?);
        let streams = self.config.streams_per_peer * rails.len();
        if rails.is_empty() || streams > STREAMS_PER_PEER_MAX {
            return Err(TcpError::Setting(format!(
                "a peer has 1 or more rails and at most {STREAMS_PER_PEER_MAX} connections in all"
            )));
        }
        self.peers.push(Peer {
            rails: rails
                .iter()
                .map(|&rail| RailState { rail, cooldown_until: 0, cooldown_ns: RAIL_COOLDOWN_NS, bytes: 0, breaks: 0 })
                .collect(),
            streams: vec![None; streams],
            pending: core::array::from_fn(|_| std::collections::VecDeque::with_capacity(256)),
            retry_at: vec![(0, self.config.reconnect_ns); streams],
            last_break: None,
            link_version: self.link_version,
        });
        for index in 0..streams {
            self.connect(id, index)?;
        }
        Ok(id)
    }

    /// Connections to `peer` that are up.
    pub fn connected(&self, peer: PeerId) -> usize {
        self.peers.get(peer.0 as usize).map_or(0, |p| {
            p.streams.iter().flatten().filter(|&&t| self.streams[t].as_ref().is_some_and(|s| s.connected)).count()
        })
    }

    /// Bytes written to `peer` on each of its rails.
    pub fn rail_bytes(&self, peer: PeerId) -> Vec<u64> {
        self.rail_reports(peer).iter().map(|r| r.bytes).collect()
    }

    /// Each of `peer`'s rails, in configured order: what it carried and
    /// whether it is in use now.
    pub fn rail_reports(&self, peer: PeerId) -> Vec<RailReport> {
        self.peers.get(peer.0 as usize).map_or_else(Vec::new, |p| {
            p.rails
                .iter()
                .map(|r| RailReport {
                    rail: r.rail,
                    bytes: r.bytes,
                    breaks: r.breaks,
                    up: r.cooldown_until <= self.now_ns,
                })
                .collect()
        })
    }

    pub(super) fn connect(&mut self, peer: PeerId, index: usize) -> Result<(), TcpError> {
        let rail = self.peers[peer.0 as usize].rails[index / self.config.streams_per_peer].rail;
        let mut socket = match rail.local {
            None => TcpStream::connect(rail.remote).map_err(io_error("connecting"))?,
            Some(local) => connect_from(local, rail.remote).map_err(io_error("connecting from a rail's address"))?,
        };
        let _ = socket.set_nodelay(true);
        let token = self.free_token();
        self.poll
            .registry()
            .register(&mut socket, Token(token), Interest::READABLE | Interest::WRITABLE)
            .map_err(io_error("registering a connection"))?;
        let link = if self.auth.is_some() { Link::Client(None) } else { Link::Plain };
        let mut stream = Stream::new(socket, Some((peer, index)), false, link, self.now_ns);
        stream.serial = self.next_serial;
        self.next_serial += 1;
        self.streams[token] = Some(stream);
        self.peers[peer.0 as usize].streams[index] = Some(token);
        Ok(())
    }
}

#[cfg(test)]
mod rail_tests {
    use super::Rail;

    #[test]
    fn a_rail_is_an_address_with_an_optional_local_one() {
        let bare = Rail::parse("10.0.0.2:7000").unwrap();
        assert_eq!((bare.remote.to_string(), bare.local), ("10.0.0.2:7000".to_owned(), None));
        let nic = Rail::parse("10.0.1.1>10.0.1.2:7000").unwrap();
        assert_eq!(nic.to_string(), "10.0.1.1>10.0.1.2:7000", "written back as given");
        assert!(Rail::parse("10.0.1.1>").unwrap_err().starts_with("address"));
        assert!(Rail::parse("nic0>10.0.1.2:7000").unwrap_err().starts_with("local address"));
        assert!(Rail::parse("10.0.1.2").unwrap_err().starts_with("address"), "a port is needed");
        let two = Rail::parse_list("127.0.0.1>127.0.0.1:9,127.0.0.2>127.0.0.1:9").unwrap();
        assert_eq!(two.len(), 2);
        assert!(Rail::parse_list(&vec!["127.0.0.1:9"; 65].join(",")).is_err(), "more rails than connections");
        assert!(Rail::parse_list("").is_err());
    }
}
