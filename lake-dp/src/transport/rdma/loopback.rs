//! Verbs between ends in one process: a [`Fabric`] joins
//! [`LoopbackVerbs`] ends with reliable in-order message queues of a fixed
//! depth, and a READ is a copy from the peer's memory, made only through
//! a key the peer lent this end on this link, inside the bytes that key
//! covers, and into what this end registered — the checks a device makes
//! with a memory window bound to one queue pair and its local key. A key
//! is lent only over what the end exported to that peer (a device: its
//! registration). Links can be cut (both ends see `Broken`, READs in
//! flight fail, keys die) and an end muted (its messages are lost: the
//! other side sees silence).
//!
//! This is how the RDMA transport's protocol ([`super::pull`]) is tested
//! where no RDMA device exists (this machine and CI): everything above the
//! verbs runs as it does over a device. It is not a device: no DMA, no
//! queue pair states, no remote keys on a wire.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::pull::{MESSAGE_BYTES, Verbs, VerbsError, VerbsEvent};
use super::{Endpoint, RdmaError};
use crate::transport::PeerId;

/// Address ranges, `(base, bytes)`.
type Ranges = Vec<(u64, u64)>;

/// Keys an end lent its peer: each with the one range it reads.
type Lent = Vec<(u32, (u64, u64))>;

#[derive(Debug)]
struct Link {
    ends: (usize, usize),
    /// The ends' peer ids for each other, where made from endpoints
    /// (`.0`: `ends.0`'s id for `ends.1`).
    ids: Option<(u32, u32)>,
    /// Why it is cut.
    cut: Option<String>,
    /// Messages in flight towards each end (`.0` to `ends.0`).
    to: (VecDeque<[u8; MESSAGE_BYTES]>, VecDeque<[u8; MESSAGE_BYTES]>),
    /// Ranges each end may lend the other keys over (`.0`: `ends.0`'s).
    exported: (Ranges, Ranges),
    /// Keys each end lent the other and has not taken back (`.0`:
    /// `ends.0`'s).
    lent: (Lent, Lent),
}

impl Link {
    fn side(&self, node: usize) -> bool {
        self.ends.1 == node
    }
}

#[derive(Debug, Default)]
struct State {
    links: Vec<Link>,
    muted: Vec<usize>,
    nodes: usize,
}

/// Joins loopback ends. Cloning shares it.
#[derive(Clone, Debug, Default)]
pub struct Fabric(Arc<Mutex<State>>);

impl Fabric {
    /// An empty fabric.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process's own fabric: the one the `loopback` RDMA device
    /// ([`super::RdmaDevice`]) joins, so that pools and engines' pushers in
    /// one process (tests, demos) reach each other's ends by endpoint.
    pub fn process() -> Self {
        static PROCESS: std::sync::OnceLock<Fabric> = std::sync::OnceLock::new();
        PROCESS.get_or_init(Fabric::new).clone()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new end that may have `depth` messages in flight to each peer
    /// (a send beyond is `Full` until the peer polls) and `depth` READs
    /// posted.
    pub fn end(&self, depth: usize) -> LoopbackVerbs {
        let mut state = self.state();
        state.nodes += 1;
        LoopbackVerbs {
            fabric: self.clone(),
            node: state.nodes - 1,
            depth,
            peers: Vec::new(),
            registered: Vec::new(),
            reads: Vec::new(),
            arena: None,
            last_key: 0,
        }
    }

    /// Connects `a` and `b`: the peer ids each knows the other by.
    pub fn connect(a: &mut LoopbackVerbs, b: &mut LoopbackVerbs) -> (PeerId, PeerId) {
        let mut state = a.fabric.state();
        state.links.push(Link {
            ends: (a.node, b.node),
            ids: None,
            cut: None,
            to: Default::default(),
            exported: Default::default(),
            lent: Default::default(),
        });
        let link = state.links.len() - 1;
        drop(state);
        a.peers.push(End { link: Some(link), reported: false });
        b.peers.push(End { link: Some(link), reported: false });
        (
            PeerId(u32::try_from(a.peers.len() - 1).unwrap_or(u32::MAX)),
            PeerId(u32::try_from(b.peers.len() - 1).unwrap_or(u32::MAX)),
        )
    }

    /// Cuts every link of `node`'s (as a dead NIC would): both ends see
    /// `Broken` at their next poll; READs in flight fail.
    pub fn cut(&self, node: usize, why: &str) {
        for link in &mut self.state().links {
            if (link.ends.0 == node || link.ends.1 == node) && link.cut.is_none() {
                link.cut = Some(why.to_owned());
            }
        }
    }

    /// Cuts every link of the fabric (as a dead fabric would).
    pub fn cut_all(&self, why: &str) {
        for link in &mut self.state().links {
            if link.cut.is_none() {
                link.cut = Some(why.to_owned());
            }
        }
    }

    /// Loses every message `node` sends from now on (a peer gone silent;
    /// its links stay up).
    pub fn mute(&self, node: usize) {
        self.state().muted.push(node);
    }
}

#[derive(Debug)]
struct End {
    /// None until connected.
    link: Option<usize>,
    /// Whether its cut was reported.
    reported: bool,
}

#[derive(Debug)]
struct Read {
    peer: PeerId,
    wr_id: u64,
    remote: u64,
    key: u32,
    len: u32,
    into: *mut u8,
}

/// One end of a [`Fabric`].
#[derive(Debug)]
pub struct LoopbackVerbs {
    fabric: Fabric,
    node: usize,
    depth: usize,
    peers: Vec<End>,
    registered: Vec<(u64, u64)>,
    reads: Vec<Read>,
    /// What keys for each peer added by endpoint may be lent over (the
    /// arena), and its slots' bytes and region epoch, as a device's
    /// endpoint tells them.
    arena: Option<((u64, u64), u32, u64)>,
    /// The last key lent (keys are never reused by an end).
    last_key: u32,
}

// SAFETY: the pointers it holds are READ targets the transport placed, as
// valid on the owner's thread as on any (the `Verbs::read` contract).
unsafe impl Send for LoopbackVerbs {}

fn covers(ranges: &[(u64, u64)], address: u64, len: u64) -> bool {
    ranges.iter().any(|&range| super::inside(range, address, len))
}

impl LoopbackVerbs {
    /// Its node number in the fabric (for [`Fabric::cut`] and
    /// [`Fabric::mute`]).
    pub fn node(&self) -> usize {
        self.node
    }

    /// Registers `len` bytes at `base` as memory READs may land in.
    ///
    /// # Safety
    ///
    /// The range stays valid while this end lives.
    pub unsafe fn register(&mut self, base: *mut u8, len: usize) {
        self.registered.push((base as u64, len as u64));
    }

    /// Lets keys lent to `peer` read inside `len` bytes at `base`.
    ///
    /// # Safety
    ///
    /// The range stays valid (its bytes readable) while this end lives.
    pub unsafe fn export(&mut self, peer: PeerId, base: *const u8, len: usize) {
        let Some(link) = self.link_of(peer) else { return };
        let mut state = self.fabric.state();
        let link = &mut state.links[link];
        let range = (base as u64, len as u64);
        if link.side(self.node) { link.exported.1.push(range) } else { link.exported.0.push(range) }
    }

    /// Registers the arena of `len` bytes at `base` (slots of
    /// `slot_bytes`, region epoch `epoch`) for READs to land in and for
    /// keys lent to each peer added by endpoint ([`Verbs::add_peer`]), as
    /// [`super::verbs::IbVerbs`] does.
    ///
    /// # Safety
    ///
    /// The range stays valid while this end lives.
    pub unsafe fn register_arena(&mut self, base: *mut u8, len: usize, slot_bytes: u32, epoch: u64) {
        self.registered.push((base as u64, len as u64));
        self.arena = Some(((base as u64, len as u64), slot_bytes, epoch));
    }

    fn link_of(&self, peer: PeerId) -> Option<usize> {
        self.peers.get(peer.0 as usize).and_then(|e| e.link)
    }

    /// Keys this end has lent and not taken back, over all its links.
    pub fn keys_out(&self) -> usize {
        let state = self.fabric.state();
        let mine = |l: &Link| if l.side(self.node) { l.lent.1.len() } else { l.lent.0.len() };
        self.peers.iter().filter_map(|e| e.link).map(|l| mine(&state.links[l])).sum()
    }

    /// Posts a READ through `key` as [`Verbs::read`] does, without the
    /// transport: how a test plays a peer that misuses a key (one taken
    /// back, or past the bytes it covers).
    ///
    /// # Safety
    ///
    /// As [`Verbs::read`].
    pub unsafe fn read_raw(
        &mut self,
        peer: PeerId,
        wr_id: u64,
        remote: (u64, u32),
        len: u32,
        into: *mut u8,
    ) -> Result<(), VerbsError> {
        // SAFETY: the caller's contract is `read`'s.
        unsafe { Verbs::read(self, peer, wr_id, remote, len, into) }
    }
}

impl Verbs for LoopbackVerbs {
    fn add_peer(&mut self) -> Result<(PeerId, Endpoint), RdmaError> {
        let ((base, len), slot_bytes, epoch) =
            self.arena.ok_or_else(|| RdmaError("no arena registered (register_arena)".into()))?;
        let id = u32::try_from(self.peers.len()).ok().filter(|&i| i < 1 << 24);
        let id = id.ok_or_else(|| RdmaError("too many peers".into()))?;
        self.peers.push(End { link: None, reported: false });
        // The node and the process in the GID, the peer id as the queue
        // pair number.
        let mut gid = [0u8; 16];
        gid[..8].copy_from_slice(&(self.node as u64).to_le_bytes());
        gid[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        Ok((PeerId(id), Endpoint::new(0, id, 0, gid, (base, len), 0, slot_bytes, epoch)))
    }

    fn connect(&mut self, peer: PeerId, remote: &Endpoint) -> Result<(), RdmaError> {
        let ((base, len), _, _) = self.arena.ok_or_else(|| RdmaError("no arena registered".into()))?;
        let end = self.peers.get(peer.0 as usize).ok_or_else(|| RdmaError("no such peer".into()))?;
        if end.link.is_some() {
            return Err(RdmaError("already connected".into()));
        }
        let (mut node, mut pid) = ([0u8; 8], [0u8; 4]);
        node.copy_from_slice(&remote.gid[..8]);
        pid.copy_from_slice(&remote.gid[8..12]);
        // Another process's node numbers are not this fabric's.
        let pid = u32::from_le_bytes(pid);
        if pid != std::process::id() {
            return Err(RdmaError(format!("an end of process {pid}: loopback verbs join ends of one process only")));
        }
        let other = usize::try_from(u64::from_le_bytes(node)).map_err(|_| RdmaError("no such node".into()))?;
        let mut state = self.fabric.state();
        if other >= state.nodes || other == self.node {
            return Err(RdmaError(format!("no node {other} on the fabric")));
        }
        // The link the other end made for this pair already, or a new one.
        let found =
            state.links.iter().position(|l| l.ends == (other, self.node) && l.ids == Some((remote.qp_num, peer.0)));
        let link = match found {
            Some(link) => {
                state.links[link].exported.1.push((base, len));
                link
            }
            None => {
                state.links.push(Link {
                    ends: (self.node, other),
                    ids: Some((peer.0, remote.qp_num)),
                    cut: None,
                    to: Default::default(),
                    exported: (vec![(base, len)], Vec::new()),
                    lent: Default::default(),
                });
                state.links.len() - 1
            }
        };
        drop(state);
        self.peers[peer.0 as usize].link = Some(link);
        Ok(())
    }

    fn send(&mut self, peer: PeerId, message: &[u8; MESSAGE_BYTES]) -> Result<(), VerbsError> {
        let link = self.link_of(peer).ok_or_else(|| VerbsError::Broken("no such peer".into()))?;
        let mut state = self.fabric.state();
        let muted = state.muted.contains(&self.node);
        let node = self.node;
        let link = &mut state.links[link];
        if let Some(why) = &link.cut {
            return Err(VerbsError::Broken(why.clone()));
        }
        let inbox = if link.side(node) { &mut link.to.0 } else { &mut link.to.1 };
        if inbox.len() >= self.depth {
            return Err(VerbsError::Full);
        }
        if !muted {
            inbox.push_back(*message);
        }
        Ok(())
    }

    fn lend(&mut self, peer: PeerId, address: u64, len: u64) -> Result<u32, VerbsError> {
        let link = self.link_of(peer).ok_or_else(|| VerbsError::Broken("no such peer".into()))?;
        let node = self.node;
        let mut state = self.fabric.state();
        let link = &mut state.links[link];
        if let Some(why) = &link.cut {
            return Err(VerbsError::Broken(why.clone()));
        }
        let (exported, lent) =
            if link.side(node) { (&link.exported.1, &mut link.lent.1) } else { (&link.exported.0, &mut link.lent.0) };
        if !covers(exported, address, len) {
            return Err(VerbsError::Broken("a key lent outside the registered memory".into()));
        }
        if lent.len() >= self.depth {
            return Err(VerbsError::Full);
        }
        self.last_key = self.last_key.wrapping_add(1).max(1);
        lent.push((self.last_key, (address, len)));
        Ok(self.last_key)
    }

    fn take_back(&mut self, peer: PeerId, key: u32) {
        let Some(link) = self.link_of(peer) else { return };
        let node = self.node;
        let mut state = self.fabric.state();
        let link = &mut state.links[link];
        let lent = if link.side(node) { &mut link.lent.1 } else { &mut link.lent.0 };
        lent.retain(|&(k, _)| k != key);
    }

    unsafe fn read(
        &mut self,
        peer: PeerId,
        wr_id: u64,
        (remote, key): (u64, u32),
        len: u32,
        into: *mut u8,
    ) -> Result<(), VerbsError> {
        if self.reads.len() >= self.depth {
            return Err(VerbsError::Full);
        }
        if self.link_of(peer).is_none() {
            return Err(VerbsError::Broken("no such peer".into()));
        }
        self.reads.push(Read { peer, wr_id, remote, key, len, into });
        Ok(())
    }

    fn exports(&self, peer: PeerId, address: u64, len: u64) -> bool {
        let Some(link) = self.link_of(peer) else { return false };
        let state = self.fabric.state();
        let link = &state.links[link];
        covers(if link.side(self.node) { &link.exported.1 } else { &link.exported.0 }, address, len)
    }

    fn imports(&self, peer: PeerId, address: u64, len: u64) -> bool {
        let Some(link) = self.link_of(peer) else { return false };
        let state = self.fabric.state();
        let link = &state.links[link];
        covers(if link.side(self.node) { &link.exported.0 } else { &link.exported.1 }, address, len)
    }

    fn registered(&self, into: *const u8, len: u64) -> bool {
        covers(&self.registered, into as u64, len)
    }

    fn poll(&mut self, out: &mut Vec<VerbsEvent>) {
        let node = self.node;
        let fabric = self.fabric.clone();
        let mut state = fabric.state();
        // READs first: each a copy a key the peer lent allows, or a
        // failure (a cut link, a key not lent on this link or taken back,
        // past the bytes the key covers, outside this end's registration —
        // the remote and local key checks).
        for read in self.reads.drain(..) {
            let Some(link) = self.peers[read.peer.0 as usize].link else { continue };
            let link = &state.links[link];
            let lent = if link.side(node) { &link.lent.0 } else { &link.lent.1 };
            let window = lent.iter().find(|&&(k, _)| k == read.key).map(|&(_, range)| range);
            let len = u64::from(read.len);
            let result = if let Some(why) = &link.cut {
                Err(format!("flushed: {why}"))
            } else if window.is_none() {
                Err("remote access error: no such key (never lent on this link, or taken back)".into())
            } else if !window.is_some_and(|w| super::inside(w, read.remote, len)) {
                Err("remote access error: outside the bytes the key was lent for".into())
            } else if !covers(&self.registered, read.into as u64, len) {
                Err("local protection error: outside this end's registration".into())
            } else {
                // SAFETY: the source lies in a key's range, inside what the
                // peer exported (valid while it lives: `export`'s and
                // `register_arena`'s contracts) and the target in
                // what this end registered and the transport placed for
                // this READ (`read`'s contract); they are distinct slots.
                unsafe { core::ptr::copy_nonoverlapping(read.remote as *const u8, read.into, read.len as usize) };
                Ok(())
            };
            out.push(VerbsEvent::ReadDone { wr_id: read.wr_id, result });
        }
        for (index, end) in self.peers.iter_mut().enumerate() {
            let peer = PeerId(u32::try_from(index).unwrap_or(u32::MAX));
            let Some(link) = end.link else { continue };
            let link = &mut state.links[link];
            if let Some(why) = &link.cut {
                if !end.reported {
                    end.reported = true;
                    out.push(VerbsEvent::Broken { peer, why: why.clone() });
                }
                continue;
            }
            let inbox = if link.side(node) { &mut link.to.1 } else { &mut link.to.0 };
            out.extend(inbox.drain(..).map(|message| VerbsEvent::Received { peer, message }));
        }
    }

    fn shut(&mut self, peer: PeerId, why: &str) {
        let Some(link) = self.link_of(peer) else { return };
        let mut state = self.fabric.state();
        let link = &mut state.links[link];
        if link.cut.is_none() {
            link.cut = Some(format!("shut by the peer: {why}"));
        }
        // Every key lent through it dies with it.
        let lent = if link.side(self.node) { &mut link.lent.1 } else { &mut link.lent.0 };
        lent.clear();
        // This end's READs through it fail now, before the call returns.
        drop(state);
        let mut flushed = Vec::new();
        self.reads.retain(|r| {
            if r.peer == peer {
                flushed.push(r.wr_id);
            }
            r.peer != peer
        });
        // Reported by the next poll, as a device's flushed completions.
        for wr_id in flushed {
            self.reads.push(Read { peer, wr_id, remote: 0, key: 0, len: 0, into: core::ptr::null_mut() });
        }
        if let Some(end) = self.peers.get_mut(peer.0 as usize) {
            end.reported = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_connect_by_endpoint_within_a_process_and_never_to_another_process() {
        let fabric = Fabric::new();
        let (mut a, mut b) = (fabric.end(4), fabric.end(4));
        let mut arenas = [vec![0u8; 8192], vec![0u8; 8192]];
        for (end, arena) in [&mut a, &mut b].into_iter().zip(&mut arenas) {
            // SAFETY: the arenas outlive the ends (dropped after them).
            unsafe { end.register_arena(arena.as_mut_ptr(), arena.len(), 4096, 1) };
        }
        let (to_b, from_a) = a.add_peer().unwrap();
        let (to_a, from_b) = b.add_peer().unwrap();
        // The same endpoint from a process of another id: refused, named.
        let mut stranger = from_b;
        stranger.gid[8..12].copy_from_slice(&std::process::id().wrapping_add(1).to_le_bytes());
        let refused = a.connect(to_b, &stranger).unwrap_err();
        assert!(refused.0.contains("one process"), "{refused}");
        // This process's: connected both ways, and a message goes through.
        a.connect(to_b, &from_b).unwrap();
        b.connect(to_a, &from_a).unwrap();
        a.send(to_b, &[7; MESSAGE_BYTES]).unwrap();
        let mut events = Vec::new();
        b.poll(&mut events);
        assert!(
            matches!(events.as_slice(), [VerbsEvent::Received { peer, message }] if *peer == to_a && message[0] == 7),
            "{events:?}"
        );
    }
}
