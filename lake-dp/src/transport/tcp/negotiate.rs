//! What is agreed on a connection before and beside its blocks: the
//! link handshake (and what is refused when a tag fails), the link
//! version and features, and the offers of another transport.

use std::io::Write;

use super::stream::{Link, QueuedFrame, ReadState};
use super::{InboundLink, NEGOTIATIONS_PER_STREAM_MAX, NEGOTIATIONS_WAITING_MAX, Negotiation, TcpError, TcpTransport};
use crate::auth::handshake::{CLIENT_FINISH_BYTES, CLIENT_HELLO_BYTES, SERVER_HELLO_BYTES};
use crate::auth::{AuthError, ServerHandshake, Session};
use crate::transport::PeerId;
use crate::transport::frame::{BlockAddr, Features, FrameHeader, FrameKind};

/// Which negotiation an outbound connection's next answer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Offered {
    /// Its features offer ([`Features`]).
    Features,
    /// The owner's offer of another transport.
    Owner,
}

impl TcpTransport {
    /// The next handshake message of connection `token` arrived: answers
    /// it, or completes the handshake. Returns whether the connection
    /// lives on.
    pub(super) fn on_handshake(&mut self, token: usize, message: &[u8]) -> bool {
        let Some((key, node)) = self.auth.clone() else { return false };
        let Some(stream) = self.streams[token].as_mut() else { return false };
        let stream_peer = stream.peer;
        let link = core::mem::replace(&mut stream.link, Link::Plain);
        let outcome: Result<Option<Session>, AuthError> = match link {
            Link::Server => {
                let mut hello = [0u8; CLIENT_HELLO_BYTES];
                hello.copy_from_slice(message);
                match crate::auth::nonce() {
                    Err(_) => Err(AuthError::NotAHandshake),
                    Ok(nonce) => match ServerHandshake::answer_up_to(&key, node, nonce, &hello, self.link_version) {
                        Ok((handshake, answer)) => {
                            stream.link = Link::Answered(Some(handshake));
                            stream.handshake_out = answer.to_vec();
                            stream.handshake_sent = 0;
                            Ok(None)
                        }
                        Err((e, answer)) => {
                            // Told why (another key, another version), best
                            // effort, before the close.
                            if let Some(answer) = answer {
                                let _ = stream.socket.write(&answer);
                            }
                            Err(e)
                        }
                    },
                }
            }
            Link::Answered(Some(handshake)) => {
                let mut finish = [0u8; CLIENT_FINISH_BYTES];
                finish.copy_from_slice(message);
                handshake.finish(&finish).map(|(session, _)| Some(session))
            }
            Link::Client(Some(handshake)) => {
                let mut answer = [0u8; SERVER_HELLO_BYTES];
                answer.copy_from_slice(message);
                handshake.finish(&answer).map(|(finish, session, _)| {
                    stream.handshake_out = finish.to_vec();
                    stream.handshake_sent = 0;
                    Some(session)
                })
            }
            _ => Err(AuthError::NotAHandshake),
        };
        match outcome {
            Ok(None) => {
                self.flush(token);
                true
            }
            Ok(Some(session)) => {
                stream.link = Link::Ready(session);
                self.stats.handshakes += 1;
                self.on_connected(token);
                self.flush(token);
                true
            }
            Err(e) => {
                self.stats.handshakes_refused += 1;
                let what = format!("handshake refused: {e}");
                self.security_event(token, &what);
                // A peer that speaks only an older link version (one
                // release behind, in a rolling upgrade) is offered that one
                // from its next connection on, made at once.
                let older = match e {
                    AuthError::Version(v) if crate::auth::handshake::speaks(v) => Some(v),
                    _ => None,
                };
                self.lose(token, &what);
                if let (Some(version), Some((peer, index))) = (older, stream_peer)
                    && let Some(p) = self.peers.get_mut(peer.0 as usize)
                    && version < p.link_version
                {
                    p.link_version = version;
                    p.retry_at[index].0 = self.now_ns;
                    self.note(format!("peer {}: speaking link version {version}, the latest it speaks", peer.0));
                }
                false
            }
        }
    }

    /// A frame's header failed its tag: nothing of it is acted on; the
    /// connection is closed.
    pub(super) fn refuse_frame(&mut self, token: usize, why: &AuthError) {
        self.stats.bad_tags += 1;
        let what = format!("frame refused: {why}");
        self.security_event(token, &what);
        self.lose(token, &what);
    }

    /// A slice's bytes failed their tag: they never count. The block they
    /// were for waits for its sender's next attempt (its slices of this
    /// attempt on other connections are dropped too), or its deadline;
    /// the connection is closed.
    pub(super) fn refuse_slice(&mut self, token: usize, (key, attempt): (BlockAddr, u32), why: &AuthError) {
        if let Some(entry) = self.landing.get_mut(&key)
            && entry.attempt == attempt
        {
            entry.received = 0;
            entry.unverified = 0;
            entry.resets += 1;
            self.detach_readers(key);
            self.settle_checks(key);
        }
        self.stats.bad_tags += 1;
        let what = format!("slice for slot {} refused: {why}", key.slot);
        self.security_event(token, &what);
        self.lose(token, &what);
    }

    /// Passes offers of another transport on inbound links to the owner
    /// ([`TcpTransport::take_negotiations`]) from now on; off (the
    /// default), each is declined at once.
    pub fn negotiate(&mut self, on: bool) {
        self.negotiates = on;
    }

    /// Offers `bytes` (this node's half of another transport for the link,
    /// 1 to [`crate::transport::frame::NEGOTIATE_BYTES_MAX`]) to `peer` on its first
    /// connection that may carry frames; the answer comes as
    /// [`Negotiation::Answered`]. None up: an error (offer again later).
    pub fn offer_transport(&mut self, peer: PeerId, bytes: &[u8]) -> Result<(), TcpError> {
        let len =
            u32::try_from(bytes.len()).ok().filter(|l| (1..=crate::transport::frame::NEGOTIATE_BYTES_MAX).contains(l));
        let len = len.ok_or_else(|| {
            TcpError::Size(format!("an offer is 1 to {} bytes", crate::transport::frame::NEGOTIATE_BYTES_MAX))
        })?;
        let p = self.peers.get(peer.0 as usize).ok_or(TcpError::NoPeer)?;
        let token = p
            .streams
            .iter()
            .flatten()
            .copied()
            .find(|&t| self.streams[t].as_ref().is_some_and(|s| s.connected))
            .ok_or(TcpError::Closed("no connection to the peer is up"))?;
        self.queue_negotiation(token, FrameHeader::negotiate(len), bytes, Some(Offered::Owner))
    }

    /// What every connection up to `peer` agreed to speak beyond the
    /// frames every build reads ([`Features`]; 0 with none up, or before
    /// the peer answered).
    pub fn peer_features(&self, peer: PeerId) -> u64 {
        let Some(p) = self.peers.get(peer.0 as usize) else { return 0 };
        let mut up = p.streams.iter().flatten().filter_map(|&t| self.streams[t].as_ref()).filter(|s| s.connected);
        let first = up.next().map_or(0, |s| s.features);
        up.fold(first, |all, s| all & s.features)
    }

    /// Answers the offer made on `to`: this node's half (accepted) or none
    /// (declined). The link closed since: an error, nothing sent.
    pub fn answer_transport(&mut self, to: InboundLink, bytes: Option<&[u8]>) -> Result<(), TcpError> {
        let open = self.streams.get(to.token).and_then(Option::as_ref).is_some_and(|s| s.serial == to.serial);
        if !open {
            return Err(TcpError::Closed("the link the offer came on is closed"));
        }
        let bytes = bytes.unwrap_or(&[]);
        let len = u32::try_from(bytes.len())
            .ok()
            .filter(|&l| l <= crate::transport::frame::NEGOTIATE_BYTES_MAX)
            .ok_or_else(|| {
                TcpError::Size(format!("an answer is at most {} bytes", crate::transport::frame::NEGOTIATE_BYTES_MAX))
            })?;
        self.queue_negotiation(to.token, FrameHeader::negotiated(len), bytes, None)
    }

    /// Negotiations since the last call, oldest first.
    pub fn take_negotiations(&mut self) -> Vec<Negotiation> {
        core::mem::take(&mut self.negotiations)
    }

    /// Queues a negotiation frame carrying `bytes` (kept with the
    /// connection while it lives); an offer (`offered`) is noted as
    /// waiting for its answer before anything is flushed, since a flush
    /// feeds the peer's waiting slices to this connection, which must know
    /// by then whether its features are settled.
    pub(super) fn queue_negotiation(
        &mut self,
        token: usize,
        header: FrameHeader,
        bytes: &[u8],
        offered: Option<Offered>,
    ) -> Result<(), TcpError> {
        let stream = self.streams[token].as_mut().ok_or(TcpError::Closed("connection closed"))?;
        if stream.owned.len() >= NEGOTIATIONS_PER_STREAM_MAX {
            return Err(TcpError::Busy);
        }
        if let Some(offered) = offered {
            stream.offers.push_back(offered);
        }
        let owned: Box<[u8]> = bytes.into();
        // The boxed bytes do not move while the connection keeps them.
        let at = if owned.is_empty() { core::ptr::null() } else { owned.as_ptr() };
        stream.owned.push(owned);
        let prefix = stream.prefix();
        stream.push(QueuedFrame::new(None, header.encode(), at, bytes.len(), prefix));
        if stream.writable {
            self.flush(token);
        }
        Ok(())
    }

    /// A negotiation frame: an offer on an inbound link (for the owner, or
    /// declined), an answer on an outbound one; either on the wrong side,
    /// or too many, cuts the connection off.
    pub(super) fn on_negotiation(&mut self, token: usize, kind: FrameKind, bytes: &[u8]) {
        let Some(stream) = self.streams[token].as_mut() else { return };
        stream.state = ReadState::Header;
        stream.negotiations_in += 1;
        let flooded =
            stream.negotiations_in > NEGOTIATIONS_PER_STREAM_MAX || self.negotiations.len() >= NEGOTIATIONS_WAITING_MAX;
        match (kind, stream.peer) {
            _ if flooded => {
                self.stats.bad_frames += 1;
                self.lose(token, "too many negotiations on one connection");
            }
            (FrameKind::Negotiate, None) if Features::is_features(bytes) => {
                // What the writer speaks: this end takes what both do (none
                // where it speaks none: declined, as by a build before).
                let from = InboundLink { token, serial: stream.serial };
                let agreed = Features::decode(bytes).map_or(0, |theirs| theirs.0 & self.config.features);
                stream.features = agreed;
                let answer = Features(agreed).encode();
                let _ = self.answer_transport(from, (self.config.features != 0).then_some(&answer[..]));
            }
            (FrameKind::Negotiate, None) => {
                let from = InboundLink { token, serial: stream.serial };
                let address = stream.socket.peer_addr().ok();
                if self.negotiates {
                    self.negotiations.push(Negotiation::Offered { from, address, bytes: bytes.to_vec() });
                } else {
                    // Not offered to anyone here: TCP it stays.
                    let _ = self.answer_transport(from, None);
                }
            }
            (FrameKind::Negotiated, Some((peer, _))) => {
                // Answers come in the order the offers went.
                if stream.offers.pop_front() == Some(Offered::Features) {
                    let theirs = Features::decode(bytes).map_or(0, |f| f.0);
                    stream.features = theirs & self.config.features;
                    return;
                }
                let bytes = (!bytes.is_empty()).then(|| bytes.to_vec());
                self.negotiations.push(Negotiation::Answered { peer, bytes });
            }
            _ => {
                self.stats.bad_frames += 1;
                self.lose(token, "a negotiation frame on the wrong side of a connection");
            }
        }
    }
}
