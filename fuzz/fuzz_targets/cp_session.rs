//! The control plane's decoding of everything a `lake-dp` (or anyone who
//! connects to its socket) sends: a byte stream, split into reads at
//! arbitrary points, fed to one connection's session. Never a panic; once
//! the session closes it applies nothing more; every reply is a valid
//! frame; the node's bounded state stays bounded.
//!
//! The first input byte is the read size (0 → 1 byte at a time).

#![no_main]

use lake_cp::node::{Node, PENDING_MAX};
use lake_cp::server::{Context, Flow, ServerCounters, Session};
use lake_dp::NodeId;
use lake_dp::constants::WIRE_FRAME_BYTES_MAX;
use lake_dp::wire::hello::{Identity, hello};
use lake_dp::wire::message::Role;
use lake_dp::wire::{Limits, decode_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&split, stream)) = data.split_first() else { return };
    let identity = Identity { role: Role::ControlPlane, node: 3, pid: 1, region_epoch: 0, features: 0, name: "cp" };
    let local = hello(&identity).expect("a fixed hello");
    let mut node = Node::new(NodeId(3), 1, None);
    let mut counters = ServerCounters::default();
    let mut session = Session::new(1);
    let mut out = Vec::new();
    let mut closed_at: Option<u64> = None;
    for piece in stream.chunks(usize::from(split).max(1)) {
        let mut ctx = Context { node: &mut node, local_hello: &local, term: 1, now_ns: 0, counters: &mut counters };
        let flow = session.feed(piece, &mut ctx, &mut out);
        if let Some(frames) = closed_at {
            assert_eq!(flow, Flow::Close, "a closed session stays closed");
            assert_eq!(counters.frames, frames, "nothing is applied after close");
        } else if flow == Flow::Close {
            closed_at = Some(counters.frames);
        }
        assert!(session.buffered() <= WIRE_FRAME_BYTES_MAX + piece.len());
    }
    assert!(node.waiting() <= PENDING_MAX);
    let mut replies = &out[..];
    while !replies.is_empty() {
        let frame = decode_frame(replies, &Limits::default()).expect("every reply is a whole, valid frame");
        replies = &replies[frame.len()..];
    }
});
