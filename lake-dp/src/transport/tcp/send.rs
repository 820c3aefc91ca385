//! The sending end: a block cut into slices, fed to the peer's
//! connections that are up (least loaded first), written out with their
//! headers, and sent again or failed when a connection breaks or the
//! deadline passes.

use std::io::{ErrorKind, IoSlice, Write};

use super::negotiate::Offered;
use super::rails::{FEED_BYTES_MIN, FEED_SLICES, PendingSlice};
use super::stream::{Link, QueuedFrame, seal_ahead};
use super::{FRAMES_PER_WRITE, TcpTransport, bytes};
use crate::transport::frame::{BlockAddr, FEATURE_TENANT, FEATURE_TRACE, FRAME_HEADER_BYTES, FrameHeader};
use crate::transport::{ANY_SLOT, Completion, Landing, TransferError};
use crate::transport::{Outgoing, PeerId};

/// A transfer this end sent, until its ack.
pub(super) struct Sending {
    pub(super) block: Outgoing,
    pub(super) deadline_ns: u64,
    /// Which sending of it this is.
    pub(super) attempt: u32,
    /// Which of the peer's connections carry a slice of this attempt (0:
    /// waiting for one to come up).
    pub(super) streams: u64,
    /// Some of its bytes were written (it can no longer be cancelled).
    pub(super) wrote: bool,
    /// The peer's time on it, from its `Traced` frame (0: none).
    pub(super) peer_us: u32,
}

/// Sendings of one transfer beyond one per connection of its peer: a
/// transfer whose connection broke is sent again, whole, over the peer's
/// other connections (or the next to come up), this many times more than
/// the peer has connections — each may have died unnoticed at once.
pub(super) const EXTRA_ATTEMPTS: u32 = 2;

impl TcpTransport {
    /// Queues `block` for its peer: split into slices over the peer's
    /// connections that are up. Completes (once) through [`poll`].
    ///
    /// # Safety
    ///
    /// `block.source` is valid for `block.len` bytes, unchanged, until the
    /// transfer's completion has been returned by [`poll`].
    ///
    /// [`poll`]: TcpTransport::poll
    pub unsafe fn write(&mut self, block: &Outgoing, now_ns: u64) -> Result<(), TransferError> {
        if block.len == 0 || block.len > crate::transport::frame::OBJECT_BYTES_MAX {
            return Err(TransferError::Invalid("length"));
        }
        if self.sending.len() >= self.config.in_flight_max {
            return Err(TransferError::Busy);
        }
        if self.sending.contains_key(&block.transfer) {
            return Err(TransferError::Invalid("transfer id in flight"));
        }
        if self.peers.get(block.peer.0 as usize).is_none() {
            return Err(TransferError::Invalid("peer"));
        }
        let mut sending = Sending {
            block: *block,
            deadline_ns: now_ns + self.config.transfer_timeout_ns,
            attempt: 0,
            streams: 0,
            wrote: false,
            peer_us: 0,
        };
        // No connection up (yet, or again): it waits for one, or its deadline.
        self.queue_slices(&mut sending, false)?;
        self.sending.insert(block.transfer, sending);
        self.feed(block.peer);
        Ok(())
    }

    /// Queues the slices of `sending` (its current attempt) over its peer's
    /// connections that are up, the least loaded first.
    /// Cuts `sending` (its current attempt) into slices waiting for a
    /// connection: behind what waits already, or — a transfer sent again —
    /// ahead of it (it is the oldest, nearest its deadline).
    pub(super) fn queue_slices(&mut self, sending: &mut Sending, first: bool) -> Result<(), TransferError> {
        let block = sending.block;
        let peer = self.peers.get_mut(block.peer.0 as usize).ok_or(TransferError::Invalid("peer"))?;
        sending.streams = 0;
        if block.target.slot == ANY_SLOT {
            // No slot yet: ask for one first (a slice of no bytes).
            let ask = PendingSlice { transfer: block.transfer, attempt: sending.attempt, offset: 0, len: 0 };
            let queue = &mut peer.pending[block.priority as usize];
            if first {
                queue.push_front(ask);
            } else {
                queue.push_back(ask);
            }
            return Ok(());
        }
        let slice = u64::from(self.config.slice_bytes);
        let count = block.len.div_ceil(slice);
        for k in 0..count {
            // Ahead: pushed last slice first, so they keep their order.
            let k = if first { count - 1 - k } else { k };
            let offset = k * slice;
            let len = slice.min(block.len - offset);
            let pending = PendingSlice { transfer: block.transfer, attempt: sending.attempt, offset, len };
            let queue = &mut peer.pending[block.priority as usize];
            if first {
                queue.push_front(pending);
            } else {
                queue.push_back(pending);
            }
        }
        Ok(())
    }

    /// Hands `peer`'s pending slices, oldest first, to its connections that
    /// have room ([`FEED_SLICES`] queued at most), the least loaded first,
    /// on rails that did not break lately (any rail, when every one did).
    /// A connection that drains faster comes back for more sooner: the
    /// slices spread by each rail's measured speed.
    pub(super) fn feed(&mut self, peer: PeerId) {
        let per_rail = self.config.streams_per_peer;
        let salt = self.wire_salt;
        let bound = (FEED_SLICES * (self.config.slice_bytes as usize + FRAME_HEADER_BYTES)).max(FEED_BYTES_MIN);
        let Some(p) = self.peers.get_mut(peer.0 as usize) else { return };
        loop {
            // The most urgent class first.
            let Some(class) = p.pending.iter().position(|q| !q.is_empty()) else { return };
            let Some(&next) = p.pending[class].front() else { return };
            // A slice of a transfer that ended or was sent again since.
            let Some(sending) = self.sending.get_mut(&next.transfer).filter(|s| s.attempt == next.attempt) else {
                p.pending[class].pop_front();
                continue;
            };
            let mut best: Option<(usize, usize, usize)> = None;
            // Over several rails, what the kernel still holds counts too:
            // its send buffers would otherwise hide a slow rail.
            let rails = p.rails.len() > 1;
            // A reservation waits for a connection whose features are
            // settled: it names the block's namespace only where the
            // receiver said it takes one, and a receiver capping the
            // block's tenant could not hold one sent before the answer
            // (every peer answers the offer; one of an older build
            // declines it). A traced block's slices take a settled one
            // first (its trace id then goes with them), any if none has
            // room.
            let traced = sending.block.trace != 0;
            let passes: &[(bool, bool)] = if next.len == 0 {
                &[(true, true), (false, true)]
            } else if traced {
                &[(true, true), (true, false), (false, false)]
            } else {
                &[(true, false), (false, false)]
            };
            for &(healthy_only, settled_only) in passes {
                for (index, token) in p.streams.iter().enumerate() {
                    let cooling = p.rails[index / per_rail].cooldown_until > self.now_ns;
                    let Some(token) = *token else { continue };
                    let Some(stream) = self.streams[token].as_mut().filter(|s| s.connected) else { continue };
                    let load = stream.queued_bytes + if rails { stream.kernel_unsent(self.now_ns) } else { 0 };
                    let unsettled = stream.offers.contains(&Offered::Features);
                    if (healthy_only && cooling) || (settled_only && unsettled) || load >= bound {
                        continue;
                    }
                    if best.is_none_or(|(_, _, least)| load < least) {
                        best = Some((index, token, load));
                    }
                }
                if best.is_some() {
                    break;
                }
            }
            let Some((index, token, _)) = best else { return };
            p.pending[class].pop_front();
            let block = sending.block;
            sending.streams |= 1 << index;
            let slice_len = u32::try_from(next.len).unwrap_or(self.config.slice_bytes);
            let header = if next.len == 0 {
                let (region, epoch) = (block.target.region, block.target.epoch);
                let reserve =
                    FrameHeader::reserve((block.transfer.wrapping_add(salt), next.attempt), region, epoch, block.len);
                // The receiver may hold the block's tenant to a cap.
                let tenants = self.streams[token].as_ref().is_some_and(|s| s.features & FEATURE_TENANT != 0);
                if tenants { reserve.for_namespace(block.namespace) } else { reserve }
            } else {
                let transfer = block.transfer.wrapping_add(salt);
                FrameHeader::data((transfer, next.attempt), block.target, block.len, next.offset, slice_len)
            }
            .with_priority(block.priority)
            .encode();
            if let Some(stream) = self.streams[token].as_mut() {
                let prefix = stream.prefix();
                if block.trace != 0 && next.len > 0 && stream.features & FEATURE_TRACE != 0 {
                    // The trace id, for the data frame right behind it.
                    let wire = (block.transfer.wrapping_add(salt), next.attempt);
                    let trace = FrameHeader::trace(wire, block.target, block.len, block.trace)
                        .with_priority(block.priority)
                        .encode();
                    stream.push(QueuedFrame::new(Some(block.transfer), trace, core::ptr::null(), 0, prefix));
                }
                let source = block.source.wrapping_add(bytes(next.offset));
                stream.push(QueuedFrame::new(Some(block.transfer), header, source, bytes(next.len), prefix));
                // Its tags are begun now, while earlier frames go out.
                self.stats.sealed_later += seal_ahead(stream, self.config.tags_later);
            }
        }
    }

    /// Moves the completions that may go to `out`: a transfer with a frame
    /// still queued (one already tagged must go out whole even after its
    /// transfer ended) keeps its completion, so its source stays the
    /// caller's to keep, until the frame is written or its connection gone.
    pub(super) fn release_done(&mut self, out: &mut Vec<Completion>) {
        let streams = &self.streams;
        let queued =
            |transfer: u64| streams.iter().flatten().any(|s| s.queue.iter().any(|f| f.transfer == Some(transfer)));
        if self.done.iter().all(|c| !queued(c.transfer)) {
            out.append(&mut self.done);
            return;
        }
        let mut held = Vec::new();
        for completion in self.done.drain(..) {
            if queued(completion.transfer) { held.push(completion) } else { out.push(completion) }
        }
        self.done = held;
    }

    /// Writes what the connection has queued, many frames a call.
    pub(super) fn flush(&mut self, token: usize) -> bool {
        let mut busy = false;
        loop {
            let Some(stream) = self.streams[token].as_mut() else { return busy };
            // Handshake bytes before anything else.
            while stream.handshake_pending() {
                match stream.socket.write(&stream.handshake_out[stream.handshake_sent..]) {
                    Ok(0) => {
                        self.lose(token, "the connection took no bytes");
                        return true;
                    }
                    Ok(n) => {
                        stream.handshake_sent += n;
                        stream.progress_ns = self.now_ns;
                        busy = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        stream.writable = false;
                        return busy;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.lose(token, &e.to_string());
                        return true;
                    }
                }
            }
            if !stream.connected || stream.queue.is_empty() {
                return busy;
            }
            self.stats.sealed_later += seal_ahead(stream, self.config.tags_later);
            let authenticated = !matches!(stream.link, Link::Plain);
            // Frames whose tags are made go; one still being tagged holds
            // those behind it (a frame's tags follow the ones before it).
            let mut going = 0;
            for frame in stream.queue.iter_mut().take(FRAMES_PER_WRITE) {
                if !frame.ready(authenticated) {
                    break;
                }
                going += 1;
            }
            if going == 0 {
                return busy;
            }
            let mut slices: [IoSlice<'_>; FRAMES_PER_WRITE * 2] = [IoSlice::new(&[]); FRAMES_PER_WRITE * 2];
            let mut count = 0;
            for frame in stream.queue.iter().take(going) {
                if frame.sent < frame.prefix {
                    slices[count] = IoSlice::new(&frame.header[frame.sent..frame.prefix]);
                    count += 1;
                }
                if frame.len > 0 {
                    let from = frame.sent.saturating_sub(frame.prefix);
                    let start = frame.bytes.wrapping_add(from);
                    // SAFETY: the caller of `write` keeps the source valid
                    // for `len` bytes until the transfer completes.
                    let bytes = unsafe { core::slice::from_raw_parts(start, frame.len - from) };
                    slices[count] = IoSlice::new(bytes);
                    count += 1;
                }
            }
            self.stats.write_calls += 1;
            match stream.socket.write_vectored(&slices[..count]) {
                Ok(0) => {
                    self.lose(token, "the connection took no bytes");
                    return true;
                }
                Ok(mut n) => {
                    busy = true;
                    stream.queued_bytes -= n;
                    // Held by the kernel now, until the next time it is asked.
                    stream.unsent += n;
                    stream.progress_ns = self.now_ns;
                    if let Some((peer, index)) = stream.peer
                        && let Some(p) = self.peers.get_mut(peer.0 as usize)
                    {
                        p.rails[index / self.config.streams_per_peer].bytes += n as u64;
                    }
                    let mut wrote: [Option<u64>; FRAMES_PER_WRITE] = [None; FRAMES_PER_WRITE];
                    let mut touched = 0;
                    while n > 0 {
                        let Some(front) = stream.queue.front_mut() else { break };
                        // A slice's bytes went out: its transfer is past
                        // cancelling.
                        if front.len > 0 && touched < FRAMES_PER_WRITE {
                            wrote[touched] = front.transfer;
                            touched += 1;
                        }
                        let left = front.total() - front.sent;
                        if n >= left {
                            n -= left;
                            stream.queue.pop_front();
                        } else {
                            front.sent += n;
                            n = 0;
                        }
                    }
                    let stream_peer = stream.peer;
                    for transfer in wrote[..touched].iter().flatten() {
                        if let Some(sending) = self.sending.get_mut(transfer) {
                            sending.wrote = true;
                        }
                    }
                    // Room again: more of the peer's slices.
                    if let Some((peer, _)) = stream_peer
                        && self.peers.get(peer.0 as usize).is_some_and(|p| p.pending.iter().any(|q| !q.is_empty()))
                    {
                        self.feed(peer);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    stream.writable = false;
                    return busy;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.lose(token, &e.to_string());
                    return true;
                }
            }
        }
    }

    /// Cancels `transfer` if none of its bytes went out yet (its slices
    /// still wait for a connection, or are queued untouched and untagged):
    /// it ends `Cancelled` at the next poll, and its source is the caller's
    /// again then. One with a slice written or tagged goes on to its end
    /// (the stream's framing and count need it whole): `false` then, or for
    /// a transfer not in flight. A slot the peer reserved for it (sent to
    /// `ANY_SLOT`) is given back there at its deadline.
    pub fn cancel(&mut self, transfer: u64) -> bool {
        let Some(sending) = self.sending.get(&transfer) else { return false };
        if sending.wrote {
            return false;
        }
        let peer = sending.block.peer;
        let Some(p) = self.peers.get(peer.0 as usize) else { return false };
        let started = p.streams.iter().flatten().any(|&t| {
            self.streams[t]
                .as_ref()
                .is_some_and(|s| s.queue.iter().any(|f| f.transfer == Some(transfer) && (f.sent > 0 || f.sealed)))
        });
        if started {
            return false;
        }
        let Some(sending) = self.sending.remove(&transfer) else { return false };
        if let Some(p) = self.peers.get_mut(peer.0 as usize) {
            for class in &mut p.pending {
                class.retain(|s| s.transfer != transfer);
            }
        }
        self.unqueue(peer, transfer);
        self.stats.failed += 1;
        self.done.push(Completion { transfer, result: Err(TransferError::Cancelled), target: sending.block.target });
        true
    }

    /// Drops the frames of `transfer` not yet started from `peer`'s
    /// connections (one partly written must finish: the stream's framing).
    pub(super) fn unqueue(&mut self, peer: PeerId, transfer: u64) {
        let Some(p) = self.peers.get(peer.0 as usize) else { return };
        for token in p.streams.iter().flatten() {
            let Some(stream) = self.streams[*token].as_mut() else { continue };
            let before = stream.queue.len();
            let mut dropped = 0;
            stream.queue.retain(|f| {
                let drop = f.transfer == Some(transfer) && f.sent == 0 && !f.sealed;
                if drop {
                    dropped += f.total();
                }
                !drop
            });
            if stream.queue.len() != before {
                stream.queued_bytes -= dropped;
            }
        }
    }

    /// Reservations answered `Later` whose wait is over: asked again,
    /// behind what waits already.
    pub(super) fn ask_again(&mut self, now_ns: u64) {
        let mut at = 0;
        while at < self.later.len() {
            let (transfer, attempt, when_ns) = self.later[at];
            if when_ns > now_ns {
                at += 1;
                continue;
            }
            self.later.swap_remove(at);
            let Some(mut sending) = self.sending.remove(&transfer) else { continue };
            if sending.attempt != attempt {
                self.sending.insert(transfer, sending);
                continue;
            }
            let peer = sending.block.peer;
            if self.queue_slices(&mut sending, false).is_ok() {
                self.sending.insert(transfer, sending);
                self.feed(peer);
            } else {
                self.stats.failed += 1;
                self.done.push(Completion {
                    transfer,
                    result: Err(TransferError::Invalid("peer")),
                    target: sending.block.target,
                });
            }
        }
    }

    /// Why connection `token` is to be given up now, if it is: silent
    /// since its accept, a handshake or a connect not done in time, or
    /// stalled with bytes to move.
    fn lost(&mut self, token: usize, now_ns: u64) -> Option<&'static str> {
        let stream = self.streams[token].as_mut()?;
        let late = now_ns.saturating_sub(stream.progress_ns) > self.config.stall_ns;
        let silent = stream.peer.is_none() && !stream.heard;
        if silent && now_ns.saturating_sub(stream.progress_ns) > self.config.silent_ns {
            self.stats.inbound_silent += 1;
            if self.stats.inbound_silent.is_power_of_two() {
                let shed = self.stats.inbound_silent;
                self.security_event(token, &format!("closed: nothing came in on it ({shed} closed so)"));
            }
            Some("nothing came in on it")
        } else if stream.up && stream.handshaking() {
            if late {
                self.stats.handshakes_refused += 1;
                self.security_event(token, "handshake refused: not done in time");
            }
            late.then_some("the handshake was not done in time")
        } else if !stream.connected {
            late.then_some("connect timed out")
        } else {
            let owed = !stream.queue.is_empty() || stream.kernel_unsent(now_ns) > 0;
            (owed && late).then_some("stalled: nothing moved with bytes to move")
        }
    }

    /// Deadlines, stalls, reconnects, abandoned landings.
    pub(super) fn sweep(&mut self, landing: &mut dyn Landing, now_ns: u64) {
        self.ask_again(now_ns);
        // Connections that stopped moving: a cut link sends no error for
        // minutes, so silence with bytes to move counts as a break.
        for token in 0..self.streams.len() {
            if let Some(why) = self.lost(token, now_ns) {
                self.lose(token, why);
            }
        }
        let late: Vec<u64> = self.sending.iter().filter(|(_, s)| s.deadline_ns <= now_ns).map(|(&t, _)| t).collect();
        for transfer in late {
            let Some(sending) = self.sending.remove(&transfer) else { continue };
            self.unqueue(sending.block.peer, transfer);
            self.stats.failed += 1;
            let result = if sending.streams == 0 && self.connected(sending.block.peer) == 0 {
                let last = self.peers.get(sending.block.peer.0 as usize).and_then(|p| p.last_break.as_deref());
                let why = last.map_or_else(String::new, |why| format!(" (the last one broke: {why})"));
                Err(TransferError::PeerLost(format!("no connection to the peer came up before the deadline{why}")))
            } else {
                Err(TransferError::Timeout)
            };
            self.done.push(Completion { transfer, result, target: sending.block.target });
        }
        let stale: Vec<BlockAddr> =
            self.landing.iter().filter(|(_, l)| l.deadline_ns <= now_ns).map(|(&k, _)| k).collect();
        for key in stale {
            if let Some(entry) = self.landing.remove(&key) {
                self.traced_landing(None, key, &entry, None);
            }
            // Nothing writes into the slot once it is given back, nor
            // reads it.
            self.detach_readers(key);
            self.settle_checks(key);
            landing.abandoned(&key);
        }
        let keep_ns = self.config.transfer_timeout_ns;
        self.landed.retain(|_, &mut (_, _, at)| now_ns.saturating_sub(at) < keep_ns);
        for peer in 0..self.peers.len() {
            for index in 0..self.peers[peer].streams.len() {
                let (at, _) = self.peers[peer].retry_at[index];
                if self.peers[peer].streams[index].is_none() && at <= now_ns {
                    let id = PeerId(u32::try_from(peer).unwrap_or(u32::MAX));
                    if self.connect(id, index).is_err() {
                        let (_, wait) = self.peers[peer].retry_at[index];
                        self.peers[peer].retry_at[index] =
                            (now_ns + wait, (wait * 2).min(self.config.reconnect_ns * 64));
                    }
                }
            }
        }
    }
}
