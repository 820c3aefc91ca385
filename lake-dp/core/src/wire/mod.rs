//! Wire format v1: every message between `lake-cp`, `lake-dp` and the
//! engine's in-process agent.
//!
//! A frame is a fixed 40-byte little-endian [`FrameHeader`] followed by a
//! body of `body_len` bytes: one `#[repr(C)]` record per message kind,
//! optionally followed by a counted list of fixed records (lookup keys,
//! delta entries). The header carries the leader term (fencing), a request
//! id, and two CRC32s: one over the body and one over the header itself, so
//! a damaged length field is caught before it is trusted.
//!
//! Encoding writes into a caller's buffer and decoding borrows from one:
//! neither allocates. Decoding checks every field and returns a typed
//! [`WireError`] for any malformed input; it never panics and never reads
//! past the buffer. A frame decodes only from its canonical encoding, so
//! `encode(decode(bytes)) == bytes` for every accepted frame.
//!
//! The version is negotiated by a [`hello`] exchange; the hello records are
//! frozen across versions so that any two builds can at least agree to
//! disagree.

pub mod hello;
pub mod message;

use core::fmt;
use core::mem::size_of;

use bytemuck::{Pod, Zeroable};

pub use message::{Message, MessageKind, Records};

use crate::constants::WIRE_FRAME_BYTES_MAX;

/// The first four bytes of every frame: "LAKW".
pub const WIRE_MAGIC: u32 = u32::from_le_bytes(*b"LAKW");

/// Oldest wire version this build speaks.
pub const WIRE_VERSION_MIN: u16 = 1;

/// Newest wire version this build speaks.
pub const WIRE_VERSION_MAX: u16 = 1;

/// Feature bit (hello `features`): the side takes [`message::RailStats`]
/// (kind 24, added to version 1 after it was frozen). A data plane sends
/// it only where the control plane's answer names this bit, so a
/// `lake-cp` built before kind 24 — which would take it for a bad frame
/// and close the link — never meets it, whichever side is upgraded first.
pub const FEATURE_RAIL_STATS: u64 = 1 << 0;

/// Feature bit: the side takes [`message::PathLatency`] (kind 27, the
/// data plane's per-path latency histograms), sent only where offered.
pub const FEATURE_PATH_LATENCY: u64 = 1 << 1;

/// Feature bit: the side takes [`message::DrainRegion`] (kind 28) and
/// moves blocks between its L2 files (`MoveBlock` L2→L2): a control plane
/// drains a disk only through a data plane that offered it.
pub const FEATURE_DRAIN: u64 = 1 << 2;

/// Feature bit: the side takes [`message::PathLatency`] entries of paths
/// 5 and 6 (L3 reads and writes) and up to six entries; a control plane
/// without it is sent the first four paths only (it refuses a path code
/// it does not know, and more entries than four).
pub const FEATURE_PATHS_L3: u64 = 1 << 3;

/// Feature bit (the data plane's attach socket, not the `lake-cp` link):
/// its agent ports take a
/// trace id on a load (`RequestEntry::trace`, zero in builds before) and
/// answer a traced load with the data plane's time on it
/// (`CompletionEntry::took_us`). An agent sends trace ids only to a data
/// plane that offered it (an older one refuses a request whose reserved
/// bytes are not zero).
pub const FEATURE_TRACE: u64 = 1 << 4;

/// Feature bit: the side takes [`message::PathLatency`] from agents, with
/// entries of paths 7 to 9 (the agent's side of reads and loads); an
/// agent sends its histograms only where offered (a control plane without
/// it refuses path codes it does not know).
pub const FEATURE_PATHS_AGENT: u64 = 1 << 5;

/// Feature bit: the side takes [`message::TenantThrottles`] (kind 29: how
/// often each capped tenant's work waited), sent only where offered.
pub const FEATURE_TENANT_THROTTLES: u64 = 1 << 6;

/// Feature bit (the attach socket): the agent takes
/// [`message::PushCaps`] (kind 30) at attach and holds its tenants'
/// pushes to those caps; a data plane sends it only where offered.
pub const FEATURE_PUSH_CAPS: u64 = 1 << 7;

/// Feature bit: the side takes [`message::TenantWaits`] (kind 31: each
/// capped tenant's waits on every path, what it received too), sent only
/// where offered; [`FEATURE_TENANT_THROTTLES`] alone gets the first five.
pub const FEATURE_TENANT_WAITS: u64 = 1 << 8;

/// Feature bit: the side takes [`message::EvictReason::Moved`] (an L1
/// block moved to another slot of its region, its new replica reported
/// next): a data plane empties an L1 chunk for another size class by
/// moving its blocks only where offered (a control plane without it
/// refuses the reason code).
pub const FEATURE_L1_MOVES: u64 = 1 << 9;

/// Feature bit: the side takes [`message::MarkEvictable`] and
/// [`message::UnmarkEvictable`] (kinds 32 and 33): the control plane
/// names L1 blocks it has chosen as victims, in order, and the data plane
/// takes them on the spot for a save that finds no free slot (reporting
/// each as evicted). A control plane marks only where offered; without
/// marks a full L1 refuses saves until the control plane makes room.
pub const FEATURE_EVICTABLE: u64 = 1 << 10;

/// Feature bit: the side takes [`message::SaveRefusals`] (kind 34): the
/// data plane's refused saves by reason, beside its figures.
pub const FEATURE_SAVE_REFUSALS: u64 = 1 << 11;

/// Feature bit: the side takes [`message::VictimsLeft`] (kind 35): the
/// control plane says when it has no more L1 victims to mark, and a data
/// plane refuses a save at once rather than wait for one.
pub const FEATURE_VICTIMS_LEFT: u64 = 1 << 12;

/// Feature bit: the side takes [`message::ConnectionsShed`] (kind 36): the
/// data plane's listeners' shed connections, beside its figures.
pub const FEATURE_CONNECTIONS_SHED: u64 = 1 << 13;

/// Feature bit: the side reads [`message::SaveRefusals::over_quota`]: saves
/// a data plane refused at their commit for an L1 quota (counted under
/// `no_space` for a control plane without it).
pub const FEATURE_QUOTA_REFUSALS: u64 = 1 << 14;

/// Feature bit (attach): the agent takes descriptors of its own, opened
/// for it by the data plane: the arena as a fresh open of its file (its
/// records' locks are taken on it, where an agent would otherwise reopen
/// the file itself) and the mirror as a fourth descriptor. The files can
/// then stay their owner's alone (mode 0600) and still be used by the
/// engines of other users the attach socket lets in.
pub const FEATURE_OWN_FDS: u64 = 1 << 15;

/// Feature bit (attach): the agent maps a partitioned arena (layout
/// version 3) with only the partition it is given: `Attached::partition`
/// names it, and a partition past 0 comes as one more descriptor, after
/// the wake-up eventfd and before the mirror. A data plane whose arena is
/// partitioned refuses an agent without it.
pub const FEATURE_PARTITIONS: u64 = 1 << 16;

/// Feature bit (the summary link): the node's `lake-cp` keeps the cluster
/// view — it takes [`message::Message::ViewDelta`] and
/// [`message::Message::ViewSnapshot`] (kinds 37 and 38) from the leader,
/// and asks for a view snapshot with [`message::SnapshotRequest`] naming
/// itself. A leader streams its view only to a node that offered it.
pub const FEATURE_CLUSTER_VIEW: u64 = 1 << 17;

/// Feature bit: the side takes a pull — [`message::Message::CopyBlock`]
/// asking for another node's block in this node's L1 — from an engine's
/// agent (a `lake-cp`), and from a node on the summary link (the
/// summary's leader, which asks the holder to copy it). An agent pulls
/// only from a control plane that offered it; a node's `lake-cp` pulls
/// only through a leader that streams it the cluster view.
pub const FEATURE_PULL: u64 = 1 << 18;

/// Feature bit (the summary link): a pull moves the block. The reader's
/// copy is the one the pool keeps; the holder lets its own go once the
/// copy landed (a block read on another node follows its reader, so a
/// prefix gathers where it was last read). Offered by a node's `lake-cp`;
/// a leader acks it where the pool keeps blocks where they are read.
/// Without it a pulled copy is a copy, first to go, and the holder's
/// stays.
pub const FEATURE_PULLS_MOVE: u64 = 1 << 19;

/// Feature bit (the summary link): a full node spills. An L1 victim that
/// would be dropped (no room below it, no L3) is offered to the leader
/// instead, which asks the node to place it in another member's L1 with
/// room — the pool's capacity is every member's. Offered by a node's
/// `lake-cp`; acked by a leader that places spills. Without it the victim
/// is dropped.
pub const FEATURE_SPILLS: u64 = 1 << 20;

/// Feature bit (the summary link): the node's `lake-cp` takes the
/// cluster view with each block's namespace —
/// [`message::Message::ViewDeltaNamed`] and
/// [`message::Message::ViewSnapshotNamed`] (kinds 39 and 40) in place of
/// kinds 37 and 38 — to show each tenant it keeps apart only its own
/// namespaces' blocks. Offered with [`FEATURE_CLUSTER_VIEW`]; a leader
/// that acks it sends the named kinds, an older one the plain ones.
pub const FEATURE_VIEW_NAMESPACES: u64 = 1 << 21;

/// Feature bit (attach): the agent takes the cluster view it is to read
/// as a descriptor, after the mirror: its tenant's own view where it maps
/// a tenant's partition, else the pool's. Passed only with the mirror, so
/// an agent gets the three descriptors (and the partition's), then none,
/// the mirror, or the mirror and the view. The views can then stay their
/// owner's alone (mode 0600) and still be read by the engines of other
/// users, each shown only what its tenant may see.
pub const FEATURE_VIEW_FD: u64 = 1 << 22;

/// Feature bit (the summary link): the node says which tenants it keeps
/// apart ([`message::Message::KeptApart`], kind 41: each namespace and its
/// tenant), once the leader acked the bit and before its first report.
/// The leader then moves a block of a namespace its holder keeps apart
/// only to a node that keeps that namespace apart for the same tenant, and
/// shows it in no other node's view. Offered by a node keeping tenants
/// apart; a leader that acks it takes none of the node's reports before
/// the list.
pub const FEATURE_KEPT_APART: u64 = 1 << 23;

/// The feature bits this build offers on a link to `lake-cp`.
pub const FEATURES: u64 = FEATURE_RAIL_STATS
    | FEATURE_PATH_LATENCY
    | FEATURE_DRAIN
    | FEATURE_PATHS_L3
    | FEATURE_PATHS_AGENT
    | FEATURE_TENANT_THROTTLES
    | FEATURE_TENANT_WAITS
    | FEATURE_L1_MOVES
    | FEATURE_EVICTABLE
    | FEATURE_SAVE_REFUSALS
    | FEATURE_VICTIMS_LEFT
    | FEATURE_CONNECTIONS_SHED
    | FEATURE_QUOTA_REFUSALS
    | FEATURE_PULL;

/// The feature bits this build's data plane offers an agent at attach, and
/// its agent takes.
pub const ATTACH_FEATURES: u64 =
    FEATURE_TRACE | FEATURE_PUSH_CAPS | FEATURE_OWN_FDS | FEATURE_PARTITIONS | FEATURE_VIEW_FD;

/// Each feature bit this build knows and its name for an operator (what
/// `lake-cp`'s `peers` shows of each session).
pub const FEATURE_NAMES: [(u64, &str); 24] = [
    (FEATURE_RAIL_STATS, "rail_stats"),
    (FEATURE_PATH_LATENCY, "path_latency"),
    (FEATURE_DRAIN, "drain"),
    (FEATURE_PATHS_L3, "paths_l3"),
    (FEATURE_PATHS_AGENT, "paths_agent"),
    (FEATURE_TENANT_THROTTLES, "tenant_throttles"),
    (FEATURE_TRACE, "trace"),
    (FEATURE_PUSH_CAPS, "push_caps"),
    (FEATURE_TENANT_WAITS, "tenant_waits"),
    (FEATURE_L1_MOVES, "l1_moves"),
    (FEATURE_EVICTABLE, "evictable"),
    (FEATURE_SAVE_REFUSALS, "save_refusals"),
    (FEATURE_VICTIMS_LEFT, "victims_left"),
    (FEATURE_CONNECTIONS_SHED, "connections_shed"),
    (FEATURE_QUOTA_REFUSALS, "quota_refusals"),
    (FEATURE_OWN_FDS, "own_fds"),
    (FEATURE_PARTITIONS, "partitions"),
    (FEATURE_CLUSTER_VIEW, "cluster_view"),
    (FEATURE_PULL, "pull"),
    (FEATURE_PULLS_MOVE, "pulls_move"),
    (FEATURE_SPILLS, "spills"),
    (FEATURE_VIEW_NAMESPACES, "view_namespaces"),
    (FEATURE_VIEW_FD, "view_fd"),
    (FEATURE_KEPT_APART, "kept_apart"),
];

/// Bytes in a frame header.
pub const FRAME_HEADER_BYTES: usize = size_of::<FrameHeader>();

/// Flag: this frame answers the request with the same id.
pub const FLAG_REPLY: u32 = 1;

/// Flags defined in v1.
const FLAGS_KNOWN: u32 = FLAG_REPLY;

/// The fixed header in front of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct FrameHeader {
    /// [`WIRE_MAGIC`].
    pub magic: u32,
    /// Wire version of the body.
    pub version: u16,
    /// [`MessageKind`] code.
    pub kind: u16,
    /// [`FLAG_REPLY`] and future flags.
    pub flags: u32,
    /// Bytes after the header.
    pub body_len: u32,
    /// Id chosen by the requester; replies echo it.
    pub request_id: u64,
    /// The leader term the sender acts under; receivers refuse lower terms.
    pub leader_term: u64,
    /// CRC32 of the body.
    pub body_crc: u32,
    /// CRC32 of the 36 bytes before this field.
    pub header_crc: u32,
}

const _: () = assert!(FRAME_HEADER_BYTES == 40);
const _: () = assert!(core::mem::offset_of!(FrameHeader, header_crc) == 36);

/// The per-frame values a sender chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FrameMeta {
    /// Wire version to encode with.
    pub version: u16,
    /// Flags ([`FLAG_REPLY`]).
    pub flags: u32,
    /// Request id.
    pub request_id: u64,
    /// Leader term.
    pub leader_term: u64,
}

/// What a frame decoder enforces: the versions it accepts and the largest
/// frame it will wait for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Oldest version accepted.
    pub version_min: u16,
    /// Newest version accepted.
    pub version_max: u16,
    /// Largest frame accepted, header included.
    pub frame_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { version_min: WIRE_VERSION_MIN, version_max: WIRE_VERSION_MAX, frame_bytes_max: WIRE_FRAME_BYTES_MAX }
    }
}

/// Why bytes were not a valid frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireError {
    /// Not enough bytes yet: read at least `needed` in total and try again.
    /// The only error after which the stream is still usable.
    Incomplete {
        /// Total bytes needed (header, or header plus body).
        needed: usize,
    },
    /// Not a Lake frame.
    BadMagic(u32),
    /// The header's own CRC does not match.
    HeaderCrc,
    /// A version outside the accepted range.
    UnsupportedVersion(u16),
    /// Flag bits this version does not define.
    UnknownFlags(u32),
    /// A frame larger than the limit.
    FrameTooLarge {
        /// Frame bytes announced.
        bytes: u64,
        /// The limit.
        max: usize,
    },
    /// The body's CRC does not match.
    BodyCrc,
    /// An unknown message kind.
    UnknownKind(u16),
    /// A body of the wrong size for its kind.
    BodyLength {
        /// The kind.
        kind: MessageKind,
        /// Body bytes received.
        actual: usize,
    },
    /// A record count that disagrees with the body size, or exceeds its limit.
    Count {
        /// The kind.
        kind: MessageKind,
        /// Count announced.
        count: u32,
    },
    /// A field holds a value outside its domain.
    Field {
        /// The field, as `message.field`.
        field: &'static str,
        /// The value found (widened).
        value: u64,
    },
    /// A reserved field is not zero.
    Reserved(&'static str),
    /// The hello exchange found no common version.
    VersionMismatch {
        /// Our range.
        local: (u16, u16),
        /// The peer's range.
        remote: (u16, u16),
    },
    /// The output buffer is too small for the frame.
    BufferTooSmall {
        /// Bytes needed.
        needed: usize,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Incomplete { needed } => write!(f, "incomplete frame: need {needed} bytes"),
            Self::BadMagic(m) => write!(f, "bad frame magic {m:#010x}"),
            Self::HeaderCrc => f.write_str("frame header CRC mismatch"),
            Self::UnsupportedVersion(v) => write!(f, "unsupported wire version {v}"),
            Self::UnknownFlags(flags) => write!(f, "unknown frame flags {flags:#x}"),
            Self::FrameTooLarge { bytes, max } => write!(f, "frame of {bytes} bytes exceeds {max}"),
            Self::BodyCrc => f.write_str("frame body CRC mismatch"),
            Self::UnknownKind(k) => write!(f, "unknown message kind {k}"),
            Self::BodyLength { kind, actual } => write!(f, "{kind:?} body of {actual} bytes has the wrong size"),
            Self::Count { kind, count } => write!(f, "{kind:?} record count {count} disagrees with its body"),
            Self::Field { field, value } => write!(f, "field {field} holds invalid value {value}"),
            Self::Reserved(field) => write!(f, "reserved field {field} is not zero"),
            Self::VersionMismatch { local, remote } => {
                write!(f, "no common wire version: ours {}..={}, peer's {}..={}", local.0, local.1, remote.0, remote.1)
            }
            Self::BufferTooSmall { needed } => write!(f, "output buffer too small: need {needed} bytes"),
        }
    }
}

impl std::error::Error for WireError {}

/// A decoded frame: its header and its message, borrowing the input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Frame<'a> {
    /// The checked header.
    pub header: FrameHeader,
    /// The checked message.
    pub message: Message<'a>,
}

impl Frame<'_> {
    /// Bytes the frame occupied in the input.
    pub fn len(&self) -> usize {
        FRAME_HEADER_BYTES + self.header.body_len as usize
    }

    /// A frame is never empty; present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The frame's sender-chosen values.
    pub fn meta(&self) -> FrameMeta {
        FrameMeta {
            version: self.header.version,
            flags: self.header.flags,
            request_id: self.header.request_id,
            leader_term: self.header.leader_term,
        }
    }
}

/// Encodes `message` into `out`; returns the frame's length.
pub fn encode_frame(meta: FrameMeta, message: &Message<'_>, out: &mut [u8]) -> Result<usize, WireError> {
    if meta.flags & !FLAGS_KNOWN != 0 {
        return Err(WireError::UnknownFlags(meta.flags));
    }
    if !(WIRE_VERSION_MIN..=WIRE_VERSION_MAX).contains(&meta.version) {
        return Err(WireError::UnsupportedVersion(meta.version));
    }
    let body_len = message.body_len();
    let total = FRAME_HEADER_BYTES + body_len;
    if total > WIRE_FRAME_BYTES_MAX {
        return Err(WireError::FrameTooLarge { bytes: total as u64, max: WIRE_FRAME_BYTES_MAX });
    }
    let Some(frame) = out.get_mut(..total) else {
        return Err(WireError::BufferTooSmall { needed: total });
    };
    let (head, body) = frame.split_at_mut(FRAME_HEADER_BYTES);
    message.encode_body(body)?;
    let mut header = FrameHeader {
        magic: WIRE_MAGIC,
        version: meta.version,
        kind: message.kind() as u16,
        flags: meta.flags,
        body_len: u32::try_from(body_len)
            .map_err(|_| WireError::FrameTooLarge { bytes: total as u64, max: WIRE_FRAME_BYTES_MAX })?,
        request_id: meta.request_id,
        leader_term: meta.leader_term,
        body_crc: crc32fast::hash(body),
        header_crc: 0,
    };
    header.header_crc = header_crc(&header);
    head.copy_from_slice(bytemuck::bytes_of(&header));
    Ok(total)
}

/// Encodes `message` at the end of `out`, which grows by exactly the
/// frame's length (nothing is appended on an error).
pub fn append_frame(out: &mut Vec<u8>, meta: FrameMeta, message: &Message<'_>) -> Result<(), WireError> {
    let start = out.len();
    out.resize(start + FRAME_HEADER_BYTES + message.body_len(), 0);
    match encode_frame(meta, message, &mut out[start..]) {
        Ok(len) => {
            out.truncate(start + len);
            Ok(())
        }
        Err(e) => {
            out.truncate(start);
            Err(e)
        }
    }
}

/// Decodes one frame from the front of `input`. [`WireError::Incomplete`]
/// asks for more bytes; any other error means the stream is corrupt and the
/// connection should be closed.
pub fn decode_frame<'a>(input: &'a [u8], limits: &Limits) -> Result<Frame<'a>, WireError> {
    let header = decode_header(input, limits)?;
    let total = FRAME_HEADER_BYTES + header.body_len as usize;
    let Some(body) = input.get(FRAME_HEADER_BYTES..total) else {
        return Err(WireError::Incomplete { needed: total });
    };
    if crc32fast::hash(body) != header.body_crc {
        return Err(WireError::BodyCrc);
    }
    let kind = MessageKind::from_u16(header.kind).ok_or(WireError::UnknownKind(header.kind))?;
    let message = Message::decode_body(kind, body)?;
    Ok(Frame { header, message })
}

/// Decodes and checks just the header: enough to know how many bytes the
/// whole frame needs, before waiting for them.
pub fn decode_header(input: &[u8], limits: &Limits) -> Result<FrameHeader, WireError> {
    let Some(head) = input.get(..FRAME_HEADER_BYTES) else {
        return Err(WireError::Incomplete { needed: FRAME_HEADER_BYTES });
    };
    let header: FrameHeader = bytemuck::pod_read_unaligned(head);
    if header.magic != WIRE_MAGIC {
        return Err(WireError::BadMagic(header.magic));
    }
    if header.header_crc != header_crc(&header) {
        return Err(WireError::HeaderCrc);
    }
    if header.version < limits.version_min || header.version > limits.version_max {
        return Err(WireError::UnsupportedVersion(header.version));
    }
    if header.flags & !FLAGS_KNOWN != 0 {
        return Err(WireError::UnknownFlags(header.flags));
    }
    let max = limits.frame_bytes_max.min(WIRE_FRAME_BYTES_MAX);
    let total = FRAME_HEADER_BYTES as u64 + u64::from(header.body_len);
    if total > max as u64 {
        return Err(WireError::FrameTooLarge { bytes: total, max });
    }
    Ok(header)
}

fn header_crc(header: &FrameHeader) -> u32 {
    crc32fast::hash(&bytemuck::bytes_of(header)[..36])
}

#[cfg(test)]
mod tests;

#[doc(hidden)]
pub mod samples;
