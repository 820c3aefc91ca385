//! The receiving end: frames read off a connection, slices landed straight
//! in their slot, a block checked once whole, and the ack sent back.

use std::io::{ErrorKind, Read};

use super::rails::RAIL_COOLDOWN_NS;
use super::stream::{Link, QueuedFrame, ReadState};
use super::{DIRECT_READ_MIN, LATER_US_MIN, SMALL_READ_BYTES, TcpTransport, TraceEvent, bad_frame, bytes};
use crate::auth::handshake::{CLIENT_FINISH_BYTES, CLIENT_HELLO_BYTES, SERVER_HELLO_BYTES};
use crate::auth::{AuthError, Later, TAGS_BYTES};
use crate::transport::frame::{
    AckStatus, BlockAddr, FEATURE_TENANT, FEATURE_TRACE, FRAME_HEADER_BYTES, FrameHeader, FrameKind,
};
use crate::transport::{ANY_SLOT, Completion, Landing, TransferError};

/// A block landing here, until it is whole. A connection that brought
/// some of it may break: the sender then sends it again (a later attempt)
/// over another, or the deadline gives the slot back.
pub(super) struct Arriving {
    pub(super) transfer: u64,
    pub(super) attempt: u32,
    pub(super) base: *mut u8,
    pub(super) total: u64,
    pub(super) received: u64,
    /// Of `received`, bytes whose payload tag is being checked on the tag
    /// threads: the block is whole only once none are.
    pub(super) unverified: u64,
    /// Times its count was reset within one attempt (a slice that failed
    /// its tag): a verdict for an earlier count is dropped.
    pub(super) resets: u32,
    pub(super) deadline_ns: u64,
    /// The sender's trace id (0: untraced), and when it started landing.
    pub(super) trace: u64,
    pub(super) started_ns: u64,
}

impl Arriving {
    /// The block `frame` starts landing at `base`, at `now_ns`; given up
    /// `timeout_ns` later unless whole.
    fn new(frame: &FrameHeader, base: *mut u8, now_ns: u64, timeout_ns: u64) -> Self {
        Self {
            transfer: frame.transfer,
            attempt: frame.attempt,
            base,
            total: frame.total_len,
            received: 0,
            unverified: 0,
            resets: 0,
            deadline_ns: now_ns + timeout_ns,
            trace: 0,
            started_ns: now_ns,
        }
    }
}

/// A slice's payload tag being checked on the tag threads, its bytes in
/// the target.
pub(super) struct Checking {
    pub(super) token: usize,
    pub(super) serial: u64,
    pub(super) key: BlockAddr,
    pub(super) attempt: u32,
    pub(super) resets: u32,
    pub(super) len: u64,
    pub(super) verdict: Later<bool>,
}

impl TcpTransport {
    /// Reads what the connection has, frame by frame.
    pub(super) fn read(&mut self, token: usize, landing: &mut dyn Landing, now_ns: u64) -> bool {
        let mut busy = false;
        loop {
            let Some(stream) = self.streams[token].as_mut() else { return busy };
            // Bytes already buffered first.
            match stream.state {
                ReadState::Header if stream.handshaking() => {
                    let need = match stream.link {
                        Link::Server => CLIENT_HELLO_BYTES,
                        Link::Client(_) => SERVER_HELLO_BYTES,
                        _ => CLIENT_FINISH_BYTES,
                    };
                    if stream.filled - stream.parsed >= need {
                        let mut message = [0u8; SERVER_HELLO_BYTES];
                        message[..need].copy_from_slice(&stream.buffer[stream.parsed..stream.parsed + need]);
                        stream.parsed += need;
                        busy = true;
                        if !self.on_handshake(token, &message[..need]) {
                            return true;
                        }
                        continue;
                    }
                }
                ReadState::Header => {
                    let prefix = stream.prefix();
                    if stream.filled - stream.parsed >= prefix {
                        let mut header = [0u8; FRAME_HEADER_BYTES];
                        header.copy_from_slice(&stream.buffer[stream.parsed..stream.parsed + FRAME_HEADER_BYTES]);
                        if let Link::Ready(session) = &mut stream.link {
                            let mut tags = [0u8; TAGS_BYTES];
                            tags.copy_from_slice(
                                &stream.buffer[stream.parsed + FRAME_HEADER_BYTES..stream.parsed + prefix],
                            );
                            match session.open_header(&header, &tags) {
                                Ok(check) => stream.payload_check = Some(check),
                                Err(e) => {
                                    self.refuse_frame(token, &e);
                                    return true;
                                }
                            }
                        }
                        stream.parsed += prefix;
                        busy = true;
                        match FrameHeader::decode(&header) {
                            Ok(frame) => {
                                let carries = matches!(
                                    frame.kind,
                                    FrameKind::Data | FrameKind::Negotiate | FrameKind::Negotiated
                                ) && frame.slice_len > 0;
                                // A frame with no bytes after it: its bytes' tag
                                // is checked now.
                                if !carries
                                    && let Some(check) = stream.payload_check.take()
                                    && let Err(e) = check.verify(&[])
                                {
                                    self.refuse_frame(token, &e);
                                    return true;
                                }
                                if carries && frame.kind != FrameKind::Data {
                                    stream.state =
                                        ReadState::Negotiation { kind: frame.kind, len: bytes(frame.total_len) };
                                    continue;
                                }
                                self.on_frame(token, &frame, landing, now_ns);
                            }
                            Err(e) => {
                                self.stats.bad_frames += 1;
                                self.lose(token, &bad_frame(e));
                                return true;
                            }
                        }
                        continue;
                    }
                }
                ReadState::Slice { key, attempt, at, left, .. } => {
                    let buffered = (stream.filled - stream.parsed).min(left);
                    if buffered > 0 {
                        let from = &stream.buffer[stream.parsed..stream.parsed + buffered];
                        // SAFETY: `at` points into the target `Landing`
                        // placed for this block, `left` >= `buffered` bytes
                        // of room; the buffer is this stream's own.
                        unsafe { core::ptr::copy_nonoverlapping(from.as_ptr(), at, buffered) };
                        stream.parsed += buffered;
                        busy = true;
                        self.advance(token, (key, attempt), at, left, buffered, landing);
                        continue;
                    }
                    if left >= DIRECT_READ_MIN {
                        // SAFETY: as above: `left` bytes of the target.
                        let target = unsafe { core::slice::from_raw_parts_mut(at, left) };
                        self.stats.read_calls += 1;
                        match stream.socket.read(target) {
                            Ok(0) => {
                                self.lose(token, "closed by the peer");
                                return true;
                            }
                            Ok(n) => {
                                busy = true;
                                stream.progress_ns = self.now_ns;
                                self.advance(token, (key, attempt), at, left, n, landing);
                                continue;
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                                stream.readable = false;
                                return busy;
                            }
                            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                            Err(e) => {
                                self.lose(token, &e.to_string());
                                return true;
                            }
                        }
                    }
                }
                ReadState::Negotiation { kind, len } => {
                    if stream.filled - stream.parsed >= len {
                        let mut message = [0u8; crate::transport::frame::NEGOTIATE_BYTES_MAX as usize];
                        message[..len].copy_from_slice(&stream.buffer[stream.parsed..stream.parsed + len]);
                        stream.parsed += len;
                        stream.state = ReadState::Header;
                        busy = true;
                        if let Some(check) = stream.payload_check.take()
                            && let Err(e) = check.verify(&message[..len])
                        {
                            self.refuse_frame(token, &e);
                            return true;
                        }
                        self.on_negotiation(token, kind, &message[..len]);
                        continue;
                    }
                }
                ReadState::Discard { left } => {
                    let buffered = (stream.filled - stream.parsed).min(left);
                    if buffered > 0 {
                        stream.parsed += buffered;
                        stream.state = if left == buffered {
                            ReadState::Header
                        } else {
                            ReadState::Discard { left: left - buffered }
                        };
                        busy = true;
                        continue;
                    }
                }
            }
            // Refill the buffer.
            if stream.parsed == stream.filled {
                stream.parsed = 0;
                stream.filled = 0;
            } else if stream.parsed > 0 && stream.filled == stream.buffer.len() {
                stream.buffer.copy_within(stream.parsed..stream.filled, 0);
                stream.filled -= stream.parsed;
                stream.parsed = 0;
            }
            self.stats.read_calls += 1;
            let filled = stream.filled;
            // After a large slice the next one is likely large too: read
            // little through the buffer, so its bytes go straight to their
            // target instead of being copied out of the buffer.
            let end = if stream.large_slices {
                (filled + SMALL_READ_BYTES).min(stream.buffer.len())
            } else {
                stream.buffer.len()
            };
            match stream.socket.read(&mut stream.buffer[filled..end]) {
                Ok(0) => {
                    self.lose(token, "closed by the peer");
                    return true;
                }
                Ok(n) => {
                    stream.filled += n;
                    stream.heard = true;
                    stream.progress_ns = self.now_ns;
                    busy = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    stream.readable = false;
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

    /// `n` more bytes of a slice of attempt `attempt` arrived at `at`.
    pub(super) fn advance(
        &mut self,
        token: usize,
        (key, attempt): (BlockAddr, u32),
        at: *mut u8,
        left: usize,
        n: usize,
        landing: &mut dyn Landing,
    ) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        let (start, len) = match stream.state {
            ReadState::Slice { start, len, .. } => (start, len),
            _ => (at, n),
        };
        let mut checking = None;
        if n < left {
            stream.state = ReadState::Slice { key, attempt, at: at.wrapping_add(n), left: left - n, start, len };
        } else {
            stream.state = ReadState::Header;
            // The whole slice is in its target: its bytes count only if
            // they are the ones sealed.
            if let Some(check) = stream.payload_check.take() {
                let verdict = if self.config.tags_later {
                    // SAFETY: the slice's `len` bytes from `start` lie in
                    // the target placed for this block, every one written
                    // now; the slot is neither written again nor given back
                    // before the verdict is in (`settle_checks`).
                    unsafe { check.verify_later(start.cast_const(), len) }
                } else {
                    // SAFETY: as above, and the check ends here.
                    Err(check.verify(unsafe { core::slice::from_raw_parts(start.cast_const(), len) }))
                };
                match verdict {
                    Err(Ok(())) => {}
                    Err(Err(e)) => {
                        self.refuse_slice(token, (key, attempt), &e);
                        return;
                    }
                    Ok(verdict) => checking = Some((stream.serial, verdict)),
                }
            }
        }
        let Some(entry) = self.landing.get_mut(&key).filter(|e| e.attempt == attempt) else { return };
        entry.received += n as u64;
        if let Some((serial, verdict)) = checking {
            self.stats.checked_later += 1;
            entry.unverified += len as u64;
            let (resets, len) = (entry.resets, len as u64);
            self.checking.push(Checking { token, serial, key, attempt, resets, len, verdict });
            return;
        }
        self.complete_landing(Some(token), key, landing);
    }

    /// Lands `key`'s block if it is whole and checked, and acks it on
    /// connection `token` (if given and still open; else the sender's
    /// next attempt hears it).
    pub(super) fn complete_landing(&mut self, token: Option<usize>, key: BlockAddr, landing: &mut dyn Landing) {
        let Some(entry) = self.landing.get(&key) else { return };
        if entry.received < entry.total || entry.unverified > 0 {
            return;
        }
        let Some(entry) = self.landing.remove(&key) else { return };
        self.detach_readers(key);
        let status = landing.landed(&key, entry.total);
        if status == AckStatus::Landed {
            self.stats.landed += 1;
            self.stats.bytes_landed += entry.total;
            self.landed.insert(key, (entry.transfer, entry.attempt, self.now_ns));
        }
        let took_us = self.traced_landing(token, key, &entry, Some(status));
        if let Some(token) = token {
            if let Some(took_us) = took_us {
                self.trace_reply(token, (entry.transfer, entry.attempt), entry.total, took_us);
            }
            self.ack(token, (entry.transfer, entry.attempt), key, entry.total, status);
        }
    }

    /// A traced block's landing ended (`status`; none: given back at its
    /// deadline): its event, and its time in µs (none: untraced).
    pub(super) fn traced_landing(
        &mut self,
        token: Option<usize>,
        key: BlockAddr,
        entry: &Arriving,
        status: Option<AckStatus>,
    ) -> Option<u32> {
        if entry.trace == 0 {
            return None;
        }
        let us = u32::try_from(self.now_ns.saturating_sub(entry.started_ns) / 1000).unwrap_or(u32::MAX).max(1);
        let from = token.and_then(|t| self.streams[t].as_ref()).and_then(|s| s.socket.peer_addr().ok());
        let (trace, bytes) = (entry.trace, entry.total);
        self.trace_event(TraceEvent::Landed { trace, from, target: key, bytes, status, us });
        Some(us)
    }

    /// Queues the time this node took on a traced block, for the ack that
    /// follows on `token` — where its sender took trace ids.
    pub(super) fn trace_reply(&mut self, token: usize, transfer: (u64, u32), total: u64, took_us: u32) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        if stream.features & FEATURE_TRACE == 0 {
            return;
        }
        let header = FrameHeader::traced(transfer, total, took_us).encode();
        let prefix = stream.prefix();
        stream.push(QueuedFrame::new(None, header, core::ptr::null(), 0, prefix));
    }

    /// Verdicts of payload tags checked on the tag threads: a slice that
    /// passed counts toward its block (which may land now); one that failed
    /// is refused as a slice failing its tag here is.
    pub(super) fn take_verdicts(&mut self, landing: &mut dyn Landing) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.checking.len() {
            let Some(passed) = self.checking[i].verdict.get() else {
                i += 1;
                continue;
            };
            any = true;
            let Checking { token, serial, key, attempt, resets, len, .. } = self.checking.swap_remove(i);
            let current = self.landing.get(&key).is_some_and(|e| e.attempt == attempt && e.resets == resets);
            if !current {
                continue;
            }
            let open = self.streams.get(token).and_then(Option::as_ref).is_some_and(|s| s.serial == serial);
            if passed {
                if let Some(entry) = self.landing.get_mut(&key) {
                    entry.unverified = entry.unverified.saturating_sub(len);
                }
                self.complete_landing(open.then_some(token), key, landing);
            } else if open {
                self.refuse_slice(token, (key, attempt), &AuthError::BadTag);
            } else {
                // Its connection is gone already: the count starts again.
                self.stats.bad_tags += 1;
                if let Some(entry) = self.landing.get_mut(&key) {
                    entry.received = 0;
                    entry.unverified = 0;
                    entry.resets += 1;
                }
                self.detach_readers(key);
                self.settle_checks(key);
            }
        }
        any
    }

    /// Waits for, and drops, the checks still reading `key`'s slot (it is
    /// about to be written again or given back).
    pub(super) fn settle_checks(&mut self, key: BlockAddr) {
        self.checking.retain(|c| {
            if c.key == key {
                c.verdict.wait();
            }
            c.key != key
        });
    }

    pub(super) fn ack(&mut self, token: usize, transfer: (u64, u32), target: BlockAddr, total: u64, status: AckStatus) {
        if let Some(stream) = self.streams[token].as_mut() {
            let header = FrameHeader::ack(transfer, target, total, status).encode();
            let prefix = stream.prefix();
            stream.push(QueuedFrame::new(None, header, core::ptr::null(), 0, prefix));
            if stream.writable {
                self.flush(token);
            }
        }
    }

    pub(super) fn on_frame(&mut self, token: usize, frame: &FrameHeader, landing: &mut dyn Landing, now_ns: u64) {
        // Answers to this end's writes name them as they went on the wire:
        // back to the caller's ids.
        let answer = matches!(frame.kind, FrameKind::Ack | FrameKind::Reserved | FrameKind::Traced);
        let unsalted;
        let frame = if answer {
            unsalted = FrameHeader { transfer: frame.transfer.wrapping_sub(self.wire_salt), ..*frame };
            &unsalted
        } else {
            frame
        };
        match frame.kind {
            FrameKind::Ack => {
                // An answer on a rail: it works again; its next break waits
                // the base time.
                if let Some((peer, index)) = self.streams[token].as_ref().and_then(|s| s.peer)
                    && let Some(p) = self.peers.get_mut(peer.0 as usize)
                {
                    p.rails[index / self.config.streams_per_peer].cooldown_ns = RAIL_COOLDOWN_NS;
                }
                let Some(sending) = self.sending.get(&frame.transfer) else { return };
                // A landing is final whichever attempt it answers; any other
                // verdict only for the attempt in flight.
                if frame.status != AckStatus::Landed && frame.attempt != sending.attempt {
                    return;
                }
                let Some(sending) = self.sending.remove(&frame.transfer) else { return };
                if sending.block.trace != 0 {
                    let (trace, peer_us) = (sending.block.trace, sending.peer_us);
                    self.trace_event(TraceEvent::Answered { trace, transfer: frame.transfer, peer_us });
                }
                let result = match frame.status {
                    AckStatus::Landed => {
                        self.stats.sent += 1;
                        self.stats.bytes_sent += frame.total_len;
                        Ok(())
                    }
                    AckStatus::Refused => Err(TransferError::Refused),
                    AckStatus::Corrupt => Err(TransferError::Corrupt),
                    // `Later` answers reservations only (the decoder sees to it).
                    AckStatus::Busy | AckStatus::Later => Err(TransferError::Busy),
                };
                if result.is_err() {
                    self.stats.failed += 1;
                }
                self.done.push(Completion { transfer: frame.transfer, result, target: frame.target });
            }
            FrameKind::Data => self.on_slice(token, frame, landing, now_ns),
            FrameKind::Trace | FrameKind::Traced => self.on_trace(token, frame),
            // A declined offer (the others carry bytes: read whole first).
            FrameKind::Negotiate | FrameKind::Negotiated => self.on_negotiation(token, frame.kind, &[]),
            FrameKind::Reserve => self.on_reserve(token, frame, landing, now_ns),
            FrameKind::Reserved => {
                let Some(sending) = self.sending.get_mut(&frame.transfer) else { return };
                if frame.attempt != sending.attempt || sending.block.target.slot != ANY_SLOT {
                    return;
                }
                if frame.status == AckStatus::Later {
                    // The block's tenant is at the peer's cap on what it
                    // receives: asked again after the wait it named. Waiting
                    // is not failing: the deadline counts from then.
                    let wait_ns = frame.offset.max(LATER_US_MIN) * 1000;
                    sending.deadline_ns = sending.deadline_ns.max(now_ns + wait_ns + self.config.transfer_timeout_ns);
                    sending.streams = 0;
                    self.stats.reservations_later += 1;
                    if self.later.len() < self.later.capacity() {
                        self.later.push((frame.transfer, frame.attempt, now_ns + wait_ns));
                    }
                    return;
                }
                if frame.status != AckStatus::Landed {
                    let Some(sending) = self.sending.remove(&frame.transfer) else { return };
                    let result = Err(match frame.status {
                        AckStatus::Busy => TransferError::Busy,
                        _ => TransferError::Refused,
                    });
                    self.stats.failed += 1;
                    self.done.push(Completion { transfer: frame.transfer, result, target: sending.block.target });
                    return;
                }
                // A slot of the region asked for: the block goes there.
                let (asked, given) = (sending.block.target, frame.target);
                if given.region != asked.region || given.epoch != asked.epoch || given.slot == ANY_SLOT {
                    return;
                }
                let mut sending = match self.sending.remove(&frame.transfer) {
                    Some(sending) => sending,
                    None => return,
                };
                sending.block.target = given;
                let peer = sending.block.peer;
                if self.queue_slices(&mut sending, true).is_ok() {
                    self.sending.insert(frame.transfer, sending);
                    self.feed(peer);
                }
            }
        }
    }

    /// A trace frame: on an inbound connection, the id of the block whose
    /// data follows (kept with its landing); on an outbound one, the
    /// peer's time on a block of this end's, before its ack. The wrong
    /// way round, the connection is cut off.
    pub(super) fn on_trace(&mut self, token: usize, frame: &FrameHeader) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        match (frame.kind, stream.peer.is_some()) {
            (FrameKind::Trace, false) => {
                let (key, transfer, trace) = (frame.target, frame.transfer, frame.trace_id());
                match self.landing.get_mut(&key) {
                    Some(entry) if entry.transfer == transfer => {
                        if entry.trace == 0 {
                            entry.trace = trace;
                        }
                    }
                    // Its first slice is next on this connection.
                    _ => stream.trace_next = Some((key, transfer, trace)),
                }
            }
            (FrameKind::Traced, true) => {
                if let Some(sending) = self.sending.get_mut(&frame.transfer)
                    && sending.attempt == frame.attempt
                {
                    sending.peer_us = frame.took_us().max(1);
                }
            }
            _ => {
                self.stats.bad_frames += 1;
                self.lose(token, "a trace frame on the wrong side of a connection");
            }
        }
    }

    /// A peer asks for a slot: the node reserves one (or refuses), the
    /// transport places it and answers. Asked again for the same transfer
    /// (its sender did not hear the answer), the same slot is given.
    pub(super) fn on_reserve(&mut self, token: usize, frame: &FrameHeader, landing: &mut dyn Landing, now_ns: u64) {
        let key = (frame.transfer, frame.attempt);
        let known = self.landing.iter().find(|(_, a)| a.transfer == frame.transfer).map(|(&target, _)| target);
        let full = self.landing.len() >= self.config.landing_max;
        // The block's namespace, where the sender names it: a tenant at its
        // cap on what this node receives is told to ask again after the
        // wait, and its sender holds the block meanwhile.
        let tenants = self.streams[token].as_ref().is_some_and(|s| s.features & FEATURE_TENANT != 0);
        let named = (tenants && frame.offset != 0).then_some(frame.offset);
        if tenants
            && frame.offset != 0
            && known.is_none()
            && !full
            && let Err(wait_us) = landing.admit(frame.offset, frame.total_len, now_ns)
        {
            self.stats.reservations_held += 1;
            let later = FrameHeader::later(key, frame.target, frame.total_len, wait_us.max(LATER_US_MIN));
            self.answer_reservation(token, later);
            return;
        }
        let answer = match known {
            Some(target) => Ok(target),
            None if full => Err(AckStatus::Busy),
            None => {
                landing.reserve(frame.target.region, frame.target.epoch, frame.total_len, named).and_then(|target| {
                    let base = landing.place(&target, frame.total_len)?;
                    self.landing.insert(target, Arriving::new(frame, base, now_ns, self.config.transfer_timeout_ns));
                    Ok(target)
                })
            }
        };
        let (target, status) = match answer {
            Ok(target) => (target, AckStatus::Landed),
            Err(status) => (frame.target, status),
        };
        self.answer_reservation(token, FrameHeader::reserved(key, target, frame.total_len, status));
    }

    /// Queues the answer to a reservation on the connection it came by.
    pub(super) fn answer_reservation(&mut self, token: usize, answer: FrameHeader) {
        if let Some(stream) = self.streams[token].as_mut() {
            let prefix = stream.prefix();
            stream.push(QueuedFrame::new(None, answer.encode(), core::ptr::null(), 0, prefix));
            if stream.writable {
                self.flush(token);
            }
        }
    }

    /// A slice's header: where its bytes go, or that they are dropped.
    pub(super) fn on_slice(&mut self, token: usize, frame: &FrameHeader, landing: &mut dyn Landing, now_ns: u64) {
        enum Verdict {
            Into(*mut u8),
            Drop,
            Answer(AckStatus),
        }
        let key = frame.target;
        let full = self.landing.len() >= self.config.landing_max;
        let mut restarted = false;
        // A trace id named for this data frame (on this connection, just
        // before it) goes with its landing.
        let traced = self.streams[token].as_mut().and_then(|s| s.trace_next.take());
        let verdict = match self.landing.get_mut(&key) {
            Some(entry) if entry.transfer == frame.transfer && entry.total == frame.total_len => {
                if frame.attempt == entry.attempt {
                    Verdict::Into(entry.base)
                } else if frame.attempt > entry.attempt {
                    // Sent again (a connection broke): start over.
                    entry.attempt = frame.attempt;
                    entry.received = 0;
                    restarted = true;
                    Verdict::Into(entry.base)
                } else {
                    Verdict::Drop
                }
            }
            Some(_) => Verdict::Answer(AckStatus::Refused),
            None => match self.landed.get_mut(&key) {
                // Landed already; the sender did not hear so.
                Some((transfer, acked, _)) if *transfer == frame.transfer => {
                    if frame.attempt > *acked {
                        *acked = frame.attempt;
                        Verdict::Answer(AckStatus::Landed)
                    } else {
                        Verdict::Drop
                    }
                }
                _ if full => Verdict::Answer(AckStatus::Busy),
                _ => match landing.place(&key, frame.total_len) {
                    Ok(base) => {
                        self.landing.insert(key, Arriving::new(frame, base, now_ns, self.config.transfer_timeout_ns));
                        Verdict::Into(base)
                    }
                    Err(status) => Verdict::Answer(status),
                },
            },
        };
        if let (Verdict::Into(_), Some((at, transfer, trace))) = (&verdict, traced)
            && at == key
            && transfer == frame.transfer
            && let Some(entry) = self.landing.get_mut(&key)
            && entry.trace == 0
        {
            entry.trace = trace;
        }
        if restarted {
            // Slices of the older attempt still arriving on other
            // connections must not write into the slot any more, nor tag
            // threads read it.
            self.detach_readers(key);
            self.settle_checks(key);
            if let Some(entry) = self.landing.get_mut(&key) {
                entry.unverified = 0;
            }
        }
        let len = frame.slice_len as usize;
        let Some(stream) = self.streams[token].as_mut() else { return };
        match verdict {
            Verdict::Into(base) => {
                let at = base.wrapping_add(bytes(frame.offset));
                stream.state = ReadState::Slice { key, attempt: frame.attempt, at, left: len, start: at, len };
                stream.large_slices = len >= DIRECT_READ_MIN;
            }
            Verdict::Drop => {
                stream.state = ReadState::Discard { left: len };
                stream.payload_check = None;
            }
            Verdict::Answer(status) => {
                stream.state = ReadState::Discard { left: len };
                stream.payload_check = None;
                self.ack(token, (frame.transfer, frame.attempt), key, frame.total_len, status);
            }
        }
    }

    /// Connections reading a slice into `key`'s slot read the rest of it
    /// into nowhere: the slot is no longer theirs to write (its block
    /// landed, was given back, or is being sent again).
    pub(super) fn detach_readers(&mut self, key: BlockAddr) {
        for stream in self.streams.iter_mut().flatten() {
            if let ReadState::Slice { key: k, left, .. } = stream.state
                && k == key
            {
                stream.state = ReadState::Discard { left };
            }
        }
    }
}
