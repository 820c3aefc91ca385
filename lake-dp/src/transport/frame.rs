//! The transport's frames on a byte stream: a 64-byte header, CRC'd, then
//! (for data) the slice's bytes.
//!
//! A block travels as one or more *slices* of its stored object (header and
//! payload, exactly as it sits in the sender's slot), each in a `Data`
//! frame naming the target slot at the receiver — `(region, epoch, slot,
//! generation)` — and where in the object the slice goes. The receiver
//! answers a whole block with one `Ack` carrying a status: the block is
//! complete only once it arrived whole and its own header and segment CRCs
//! checked at the target. The frame header guards itself (a CRC over its
//! first 60 bytes); the bytes it carries are guarded by the stored object's
//! CRCs, checked on arrival.

use bytemuck::{Pod, Zeroable};

use crate::model::replica::Priority;

/// Bytes of a frame header.
pub const FRAME_HEADER_BYTES: usize = 64;

/// "LKTX", little-endian.
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"LKTX");

/// The frame format this code speaks.
pub const FRAME_VERSION: u8 = 1;

/// A slice carries at most this many bytes.
pub const SLICE_BYTES_MAX: u32 = 16 << 20;

/// An object (one block, header and payload) is at most this long.
pub const OBJECT_BYTES_MAX: u64 = 1 << 30;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A slice of a block for the receiver's target slot.
    Data = 1,
    /// The receiver's verdict on a whole block.
    Ack = 2,
    /// A request for a slot: "a `total_len`-byte block of this class is
    /// coming for your region and epoch; which slot?" (slot and
    /// generation 0).
    Reserve = 3,
    /// The answer: the slot reserved for it (status 0), or why none.
    Reserved = 4,
    /// An offer of another transport for this link (an RDMA endpoint):
    /// `slice_len` bytes follow, opaque to TCP. Sent by the connection's
    /// writer once the link is up (authenticated where a key is set).
    Negotiate = 5,
    /// The answer: the receiver's half (`slice_len` bytes, status 0), or
    /// none (status `Refused`: it has no such transport, or refused the
    /// offer) — the link then stays on TCP.
    Negotiated = 6,
    /// The engine's trace id of a transfer (`offset`, never 0) whose data
    /// frame for `target` follows on this connection: the receiver logs
    /// the block's landing under it. Sent only on a connection whose
    /// receiver took [`FEATURE_TRACE`].
    Trace = 7,
    /// The receiver's time on a traced block (`offset`, in µs), just
    /// before its `Ack` on the same connection. Sent only on a connection
    /// whose sender offered [`FEATURE_TRACE`].
    Traced = 8,
}

/// A connection's writer offers what it speaks beyond the frames every
/// build reads, in its first negotiation frame ([`Features`]); the reader
/// answers with what both speak. A build before this feature declines the
/// offer (it is not an RDMA endpoint), and so speaks none.
pub const FEATURE_TRACE: u64 = 1 << 0;

/// A `Reserve` names the namespace of its block (`offset`), so the
/// receiver can hold a tenant to what it may receive; a reservation over
/// that cap is answered `Reserved` with [`AckStatus::Later`] and the wait
/// (`offset`, µs), and the sender asks again then. Only on a connection
/// whose sender offered it.
pub const FEATURE_TENANT: u64 = 1 << 1;

/// Every feature this build speaks.
pub const FEATURES_SPOKEN: u64 = FEATURE_TRACE | FEATURE_TENANT;

/// Bytes of an encoded [`Features`].
pub const FEATURES_BYTES: usize = 16;

/// [`FEATURES_BYTES`] as a negotiation frame's length.
#[allow(clippy::cast_possible_truncation)] // 16
pub const FEATURES_LEN: u32 = FEATURES_BYTES as u32;

/// "LKFT", little-endian.
const FEATURES_MAGIC: u32 = u32::from_le_bytes(*b"LKFT");
const FEATURES_VERSION: u8 = 1;

/// What one end of a connection speaks beyond the frames every build
/// reads: the bytes of a negotiation frame (kind 5 offers it, kind 6
/// answers with what both speak). Told apart from an RDMA endpoint by its
/// magic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features(pub u64);

impl Features {
    /// Its bytes: magic, version, three zero bytes, the feature bits.
    pub fn encode(&self) -> [u8; FEATURES_BYTES] {
        let mut out = [0u8; FEATURES_BYTES];
        out[..4].copy_from_slice(&FEATURES_MAGIC.to_le_bytes());
        out[4] = FEATURES_VERSION;
        out[8..].copy_from_slice(&self.0.to_le_bytes());
        out
    }

    /// Whether `bytes` are a features record at all (else: another
    /// transport's offer, for the owner).
    pub fn is_features(bytes: &[u8]) -> bool {
        bytes.len() >= 4 && bytes[..4] == FEATURES_MAGIC.to_le_bytes()
    }

    /// Decodes a features record; a bad one is named.
    pub fn decode(bytes: &[u8]) -> Result<Self, &'static str> {
        if bytes.len() != FEATURES_BYTES {
            return Err("a features record is 16 bytes");
        }
        if !Self::is_features(bytes) {
            return Err("not a features record (magic)");
        }
        if bytes[4] != FEATURES_VERSION {
            return Err("a features version this end does not speak");
        }
        if bytes[5..8] != [0; 3] {
            return Err("reserved features bytes set");
        }
        let mut bits = [0u8; 8];
        bits.copy_from_slice(&bytes[8..]);
        Ok(Self(u64::from_le_bytes(bits)))
    }
}

/// The longest wait a `Later` answer asks of its sender, µs (a second).
pub const LATER_US_MAX: u64 = 1_000_000;

/// Bytes a negotiation frame carries at most.
pub const NEGOTIATE_BYTES_MAX: u32 = 256;

/// The receiver's verdict on a block, carried by an `Ack`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum AckStatus {
    /// Landed whole, checked, published.
    Landed = 0,
    /// No such target: not reserved for this block, stale epoch or
    /// generation, or a length that does not fit.
    Refused = 1,
    /// Arrived whole, but its header or CRCs do not check: not published.
    Corrupt = 2,
    /// The receiver has no room for another block in flight.
    Busy = 3,
    /// A reservation's answer only ([`FEATURE_TENANT`]): the block's
    /// tenant is at its cap on what this node receives; ask again after
    /// the wait the frame carries.
    Later = 4,
}

impl AckStatus {
    /// Decodes a status.
    pub fn from_u16(value: u16) -> Option<Self> {
        Some(match value {
            0 => Self::Landed,
            1 => Self::Refused,
            2 => Self::Corrupt,
            3 => Self::Busy,
            4 => Self::Later,
            _ => return None,
        })
    }
}

/// Where a block goes at the receiver: one of its slots, named so that a
/// stale name (the slot reused since) never matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BlockAddr {
    /// The receiver's region.
    pub region: u16,
    /// That region's epoch.
    pub epoch: u64,
    /// The slot.
    pub slot: u32,
    /// The slot's generation.
    pub generation: u32,
}

/// A frame header as it is on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct RawFrameHeader {
    magic: u32,
    version: u8,
    kind: u8,
    /// Data: 0. Ack: the [`AckStatus`].
    status: u16,
    transfer: u64,
    region: u16,
    priority: u8,
    reserved0: u8,
    slot: u32,
    generation: u32,
    attempt: u32,
    epoch: u64,
    total_len: u64,
    offset: u64,
    slice_len: u32,
    header_crc: u32,
}

const _: () = assert!(size_of::<RawFrameHeader>() == FRAME_HEADER_BYTES);

/// A decoded, checked frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Data or Ack.
    pub kind: FrameKind,
    /// The sender's id of the transfer (echoed by the Ack).
    pub transfer: u64,
    /// Which sending of it (a transfer whose connection broke is sent
    /// again, whole, over the others; echoed by the Ack).
    pub attempt: u32,
    /// The work's class (DESIGN §4): kept on the wire, so each end can
    /// put critical loads ahead of write-back and replication.
    pub priority: Priority,
    /// The target slot.
    pub target: BlockAddr,
    /// The whole object's bytes.
    pub total_len: u64,
    /// Where this slice starts in the object (Data).
    pub offset: u64,
    /// The slice's bytes that follow this header (Data; 0 for Ack).
    pub slice_len: u32,
    /// The verdict (Ack).
    pub status: AckStatus,
}

/// Why a frame header was refused: the stream can no longer be trusted and
/// is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Not a transport frame.
    Magic,
    /// A version this code does not speak.
    Version(u8),
    /// The header's CRC does not match.
    Crc,
    /// A field out of its domain (named).
    Field(&'static str),
}

impl core::fmt::Display for FrameError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::Magic => f.write_str("not a transport frame (magic)"),
            Self::Version(v) => write!(f, "frame version {v}, this end speaks {FRAME_VERSION}"),
            Self::Crc => f.write_str("frame header CRC mismatch"),
            Self::Field(name) => write!(f, "frame field out of range: {name}"),
        }
    }
}

impl std::error::Error for FrameError {}

impl FrameHeader {
    /// A data frame: `slice_len` bytes at `offset` of a `total_len`-byte
    /// object for `target`.
    pub fn data(
        (transfer, attempt): (u64, u32),
        target: BlockAddr,
        total_len: u64,
        offset: u64,
        slice_len: u32,
    ) -> Self {
        Self {
            kind: FrameKind::Data,
            transfer,
            attempt,
            priority: Priority::WriteBack,
            target,
            total_len,
            offset,
            slice_len,
            status: AckStatus::Landed,
        }
    }

    /// The verdict on attempt `attempt` of transfer `transfer` (a whole
    /// `total_len`-byte block).
    pub fn ack((transfer, attempt): (u64, u32), target: BlockAddr, total_len: u64, status: AckStatus) -> Self {
        Self {
            kind: FrameKind::Ack,
            transfer,
            attempt,
            priority: Priority::WriteBack,
            target,
            total_len,
            offset: 0,
            slice_len: 0,
            status,
        }
    }

    /// A request for a slot of `region` at `epoch` for a `total_len`-byte
    /// block (transfer, attempt).
    pub fn reserve((transfer, attempt): (u64, u32), region: u16, epoch: u64, total_len: u64) -> Self {
        Self {
            kind: FrameKind::Reserve,
            transfer,
            attempt,
            priority: Priority::WriteBack,
            target: BlockAddr { region, epoch, slot: 0, generation: 0 },
            total_len,
            offset: 0,
            slice_len: 0,
            status: AckStatus::Landed,
        }
    }

    /// The same reservation naming its block's namespace (sent only over
    /// a connection that agreed [`FEATURE_TENANT`]).
    pub fn for_namespace(self, namespace: u64) -> Self {
        debug_assert_eq!(self.kind, FrameKind::Reserve);
        Self { offset: namespace, ..self }
    }

    /// The answer to a reservation over its tenant's receive cap: ask
    /// again in `wait_us` (at most [`LATER_US_MAX`]).
    pub fn later((transfer, attempt): (u64, u32), target: BlockAddr, total_len: u64, wait_us: u64) -> Self {
        Self {
            offset: wait_us.min(LATER_US_MAX),
            ..Self::reserved((transfer, attempt), target, total_len, AckStatus::Later)
        }
    }

    /// The answer to a reservation: `target` reserved (status `Landed`,
    /// meaning "go"), or the status that refuses it.
    pub fn reserved((transfer, attempt): (u64, u32), target: BlockAddr, total_len: u64, status: AckStatus) -> Self {
        Self { kind: FrameKind::Reserved, ..Self::ack((transfer, attempt), target, total_len, status) }
    }

    /// An offer of another transport: `len` bytes (1 to
    /// [`NEGOTIATE_BYTES_MAX`]) follow.
    pub fn negotiate(len: u32) -> Self {
        Self {
            kind: FrameKind::Negotiate,
            transfer: 0,
            attempt: 0,
            priority: Priority::CriticalLoad,
            target: BlockAddr::default(),
            total_len: u64::from(len),
            offset: 0,
            slice_len: len,
            status: AckStatus::Landed,
        }
    }

    /// The answer to an offer: `len` bytes follow (accepted), or none
    /// (declined).
    pub fn negotiated(len: u32) -> Self {
        let status = if len == 0 { AckStatus::Refused } else { AckStatus::Landed };
        Self { kind: FrameKind::Negotiated, status, ..Self::negotiate(len) }
    }

    /// The trace id `trace` (not 0) of the transfer whose data frame for
    /// `target` (a `total_len`-byte block) follows on the connection.
    pub fn trace((transfer, attempt): (u64, u32), target: BlockAddr, total_len: u64, trace: u64) -> Self {
        Self {
            kind: FrameKind::Trace,
            offset: trace,
            ..Self::ack((transfer, attempt), target, total_len, AckStatus::Landed)
        }
    }

    /// The receiver's time on traced attempt `attempt` of `transfer` (a
    /// `total_len`-byte block), µs; its `Ack` follows.
    pub fn traced((transfer, attempt): (u64, u32), total_len: u64, took_us: u32) -> Self {
        Self {
            kind: FrameKind::Traced,
            offset: u64::from(took_us),
            ..Self::ack((transfer, attempt), BlockAddr::default(), total_len, AckStatus::Landed)
        }
    }

    /// A `Trace` frame's trace id.
    pub fn trace_id(&self) -> u64 {
        self.offset
    }

    /// A `Traced` frame's time, µs.
    pub fn took_us(&self) -> u32 {
        u32::try_from(self.offset).unwrap_or(u32::MAX)
    }

    /// The same frame in class `priority`.
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// The header's 64 bytes.
    pub fn encode(&self) -> [u8; FRAME_HEADER_BYTES] {
        let mut raw = RawFrameHeader {
            magic: FRAME_MAGIC.to_le(),
            version: FRAME_VERSION,
            kind: self.kind as u8,
            status: (if matches!(self.kind, FrameKind::Ack | FrameKind::Reserved | FrameKind::Negotiated) {
                self.status as u16
            } else {
                0
            })
            .to_le(),
            transfer: self.transfer.to_le(),
            region: self.target.region.to_le(),
            priority: self.priority as u8,
            reserved0: 0,
            slot: self.target.slot.to_le(),
            generation: self.target.generation.to_le(),
            attempt: self.attempt.to_le(),
            epoch: self.target.epoch.to_le(),
            total_len: self.total_len.to_le(),
            offset: self.offset.to_le(),
            slice_len: self.slice_len.to_le(),
            header_crc: 0,
        };
        let crc = crc32fast::hash(&bytemuck::bytes_of(&raw)[..FRAME_HEADER_BYTES - 4]);
        raw.header_crc = crc.to_le();
        let mut out = [0u8; FRAME_HEADER_BYTES];
        out.copy_from_slice(bytemuck::bytes_of(&raw));
        out
    }

    /// Decodes and checks a header: every field in its domain, so a header
    /// that decodes re-encodes to the same bytes.
    pub fn decode(bytes: &[u8; FRAME_HEADER_BYTES]) -> Result<Self, FrameError> {
        let raw: RawFrameHeader = bytemuck::pod_read_unaligned(bytes);
        if u32::from_le(raw.magic) != FRAME_MAGIC {
            return Err(FrameError::Magic);
        }
        if raw.version != FRAME_VERSION {
            return Err(FrameError::Version(raw.version));
        }
        if crc32fast::hash(&bytes[..FRAME_HEADER_BYTES - 4]) != u32::from_le(raw.header_crc) {
            return Err(FrameError::Crc);
        }
        if raw.reserved0 != 0 {
            return Err(FrameError::Field("reserved"));
        }
        let priority = Priority::from_u8(raw.priority).ok_or(FrameError::Field("priority"))?;
        let total_len = u64::from_le(raw.total_len);
        let offset = u64::from_le(raw.offset);
        let slice_len = u32::from_le(raw.slice_len);
        let status = u16::from_le(raw.status);
        let kind = match raw.kind {
            1 => FrameKind::Data,
            2 => FrameKind::Ack,
            3 => FrameKind::Reserve,
            4 => FrameKind::Reserved,
            5 => FrameKind::Negotiate,
            6 => FrameKind::Negotiated,
            7 => FrameKind::Trace,
            8 => FrameKind::Traced,
            _ => return Err(FrameError::Field("kind")),
        };
        let negotiation = matches!(kind, FrameKind::Negotiate | FrameKind::Negotiated);
        if (total_len == 0 && !negotiation) || total_len > OBJECT_BYTES_MAX {
            return Err(FrameError::Field("total_len"));
        }
        let status = match kind {
            FrameKind::Data => {
                if status != 0 {
                    return Err(FrameError::Field("status"));
                }
                if slice_len == 0 || slice_len > SLICE_BYTES_MAX {
                    return Err(FrameError::Field("slice_len"));
                }
                if offset.checked_add(u64::from(slice_len)).is_none_or(|end| end > total_len) {
                    return Err(FrameError::Field("offset"));
                }
                AckStatus::Landed
            }
            FrameKind::Ack | FrameKind::Reserved => {
                let status = AckStatus::from_u16(status).ok_or(FrameError::Field("status"))?;
                // `Later` answers reservations alone, and carries its wait.
                let later = kind == FrameKind::Reserved && status == AckStatus::Later;
                if status == AckStatus::Later && !later {
                    return Err(FrameError::Field("status"));
                }
                if slice_len != 0 {
                    return Err(FrameError::Field("slice_len"));
                }
                if (offset != 0 && !later) || offset > LATER_US_MAX {
                    return Err(FrameError::Field("offset"));
                }
                status
            }
            FrameKind::Reserve => {
                // `offset`: the block's namespace ([`FEATURE_TENANT`]), or 0.
                if status != 0 || slice_len != 0 || raw.slot != 0 || raw.generation != 0 {
                    return Err(FrameError::Field("reserve"));
                }
                AckStatus::Landed
            }
            FrameKind::Negotiate | FrameKind::Negotiated => {
                let status = AckStatus::from_u16(status).ok_or(FrameError::Field("status"))?;
                let fits = match (kind, status) {
                    (FrameKind::Negotiate, AckStatus::Landed) | (FrameKind::Negotiated, AckStatus::Landed) => {
                        (1..=NEGOTIATE_BYTES_MAX).contains(&slice_len)
                    }
                    (FrameKind::Negotiated, AckStatus::Refused) => slice_len == 0,
                    _ => false,
                };
                if !fits || total_len != u64::from(slice_len) || offset != 0 {
                    return Err(FrameError::Field("negotiation"));
                }
                let addressed = raw.transfer != 0 || raw.attempt != 0 || raw.slot != 0 || raw.generation != 0;
                if addressed || raw.region != 0 || raw.epoch != 0 {
                    return Err(FrameError::Field("negotiation"));
                }
                status
            }
            FrameKind::Trace => {
                if status != 0 || slice_len != 0 || offset == 0 {
                    return Err(FrameError::Field("trace"));
                }
                AckStatus::Landed
            }
            FrameKind::Traced => {
                let addressed = raw.slot != 0 || raw.generation != 0 || raw.region != 0 || raw.epoch != 0;
                if status != 0 || slice_len != 0 || offset > u64::from(u32::MAX) || addressed {
                    return Err(FrameError::Field("traced"));
                }
                AckStatus::Landed
            }
        };
        Ok(Self {
            kind,
            transfer: u64::from_le(raw.transfer),
            attempt: u32::from_le(raw.attempt),
            priority,
            target: BlockAddr {
                region: u16::from_le(raw.region),
                epoch: u64::from_le(raw.epoch),
                slot: u32::from_le(raw.slot),
                generation: u32::from_le(raw.generation),
            },
            total_len,
            offset,
            slice_len,
            status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> BlockAddr {
        BlockAddr { region: 3, epoch: 0x1122_3344_5566, slot: 77, generation: 9 }
    }

    #[test]
    fn headers_round_trip_and_every_flipped_bit_is_refused() {
        let frames = [
            FrameHeader::data((5, 0), target(), 1 << 20, 4096, 65536).with_priority(Priority::CriticalLoad),
            FrameHeader::ack((5, 1), target(), 1 << 20, AckStatus::Corrupt),
            FrameHeader::ack((u64::MAX, u32::MAX), target(), 1, AckStatus::Landed),
            FrameHeader::reserve((7, 2), 3, 9, 1 << 20).with_priority(Priority::PrefillToDecode),
            FrameHeader::reserved((7, 2), target(), 1 << 20, AckStatus::Busy),
            FrameHeader::reserve((7, 3), 3, 9, 1 << 20).for_namespace(0x7e4a_0017),
            FrameHeader::later((7, 3), target(), 1 << 20, 1500),
            FrameHeader::negotiate(72),
            FrameHeader::negotiated(72),
            FrameHeader::negotiated(0),
            FrameHeader::trace((9, 1), target(), 1 << 20, 0x5eed_0000_7ace).with_priority(Priority::PrefillToDecode),
            FrameHeader::traced((9, 1), 1 << 20, 274),
            FrameHeader::traced((9, 1), 1 << 20, u32::MAX),
        ];
        for frame in frames {
            let bytes = frame.encode();
            assert_eq!(FrameHeader::decode(&bytes), Ok(frame));
            for bit in 0..FRAME_HEADER_BYTES * 8 {
                let mut bad = bytes;
                bad[bit / 8] ^= 1 << (bit % 8);
                assert!(FrameHeader::decode(&bad).is_err(), "bit {bit} of {frame:?}");
            }
        }
    }

    #[test]
    fn fields_out_of_their_domain_are_named() {
        let check = |frame: FrameHeader| FrameHeader::decode(&frame.encode());
        assert_eq!(check(FrameHeader::data((1, 0), target(), 100, 90, 20)), Err(FrameError::Field("offset")));
        assert_eq!(check(FrameHeader::data((1, 0), target(), 100, u64::MAX, 20)), Err(FrameError::Field("offset")));
        assert_eq!(check(FrameHeader::data((1, 0), target(), 100, 0, 0)), Err(FrameError::Field("slice_len")));
        assert_eq!(
            check(FrameHeader::data((1, 0), target(), 1 << 40, 0, SLICE_BYTES_MAX + 1)),
            Err(FrameError::Field("total_len"))
        );
        assert_eq!(check(FrameHeader::data((1, 0), target(), 0, 0, 1)), Err(FrameError::Field("total_len")));
        let mut wrong_version = FrameHeader::ack((1, 0), target(), 10, AckStatus::Busy).encode();
        wrong_version[4] = 2;
        assert_eq!(FrameHeader::decode(&wrong_version), Err(FrameError::Version(2)));
        assert_eq!(FrameHeader::decode(&[0; FRAME_HEADER_BYTES]), Err(FrameError::Magic));
        let negotiation = Err(FrameError::Field("negotiation"));
        assert_eq!(check(FrameHeader::negotiate(0)), negotiation);
        assert_eq!(check(FrameHeader::negotiate(NEGOTIATE_BYTES_MAX + 1)), negotiation);
        assert_eq!(check(FrameHeader { total_len: 10, ..FrameHeader::negotiate(72) }), negotiation);
        assert_eq!(check(FrameHeader { status: AckStatus::Refused, ..FrameHeader::negotiated(72) }), negotiation);
        assert_eq!(check(FrameHeader { target: target(), ..FrameHeader::negotiate(72) }), negotiation);
        assert_eq!(check(FrameHeader::trace((1, 0), target(), 10, 0)), Err(FrameError::Field("trace")));
        assert_eq!(
            check(FrameHeader { slice_len: 4, ..FrameHeader::trace((1, 0), target(), 10, 3) }),
            Err(FrameError::Field("trace"))
        );
        assert_eq!(check(FrameHeader::trace((1, 0), target(), 0, 3)), Err(FrameError::Field("total_len")));
        let traced = Err(FrameError::Field("traced"));
        assert_eq!(check(FrameHeader { offset: 1 << 32, ..FrameHeader::traced((1, 0), 10, 0) }), traced);
        assert_eq!(check(FrameHeader { target: target(), ..FrameHeader::traced((1, 0), 10, 5) }), traced);
        // `Later` answers a reservation only, with a wait of at most a second.
        assert_eq!(check(FrameHeader::ack((1, 0), target(), 10, AckStatus::Later)), Err(FrameError::Field("status")));
        assert_eq!(
            check(FrameHeader { offset: 5, ..FrameHeader::reserved((1, 0), target(), 10, AckStatus::Busy) }),
            Err(FrameError::Field("offset"))
        );
        let later = FrameHeader::later((1, 0), target(), 10, u64::MAX);
        assert_eq!(check(later).map(|f| f.offset), Ok(LATER_US_MAX));
        assert_eq!(check(FrameHeader { offset: LATER_US_MAX + 1, ..later }), Err(FrameError::Field("offset")));
        let trace = FrameHeader::trace((4, 2), target(), 10, 0xfeed);
        assert_eq!(check(trace).map(|f| f.trace_id()), Ok(0xfeed));
        assert_eq!(check(FrameHeader::traced((4, 2), 10, 99)).map(|f| f.took_us()), Ok(99));
    }

    #[test]
    fn the_fuzz_seeds_of_trace_and_tenant_frames_decode_as_such() {
        let seed = |n: u32| {
            let path = format!("{}/../fuzz/seeds/transport_frame/seed-{n:02}", env!("CARGO_MANIFEST_DIR"));
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let mut header = [0u8; FRAME_HEADER_BYTES];
            header.copy_from_slice(&bytes[1..=FRAME_HEADER_BYTES]);
            FrameHeader::decode(&header).unwrap()
        };
        let trace = seed(9);
        assert_eq!((trace.kind, trace.trace_id()), (FrameKind::Trace, 0x5eed_0000_7ace));
        let traced = seed(10);
        assert_eq!((traced.kind, traced.took_us()), (FrameKind::Traced, 274));
        // A reservation naming its namespace, and its answer "later".
        let reserve = seed(11);
        assert_eq!((reserve.kind, reserve.offset), (FrameKind::Reserve, 0x7e4a_0017));
        let later = seed(12);
        assert_eq!((later.kind, later.status, later.offset), (FrameKind::Reserved, AckStatus::Later, 1500));
    }

    #[test]
    fn features_round_trip_and_bad_records_are_named() {
        let record = Features(FEATURE_TRACE).encode();
        assert_eq!(Features::decode(&record), Ok(Features(FEATURE_TRACE)));
        assert!(Features::is_features(&record));
        // An RDMA endpoint (its own magic) is not one.
        assert!(!Features::is_features(b"LKRD\x02\x00"));
        let mut version = record;
        version[4] = 2;
        assert!(Features::decode(&version).unwrap_err().contains("version"));
        let mut reserved = record;
        reserved[6] = 1;
        assert!(Features::decode(&reserved).unwrap_err().contains("reserved"));
        assert!(Features::decode(&record[..12]).unwrap_err().contains("16 bytes"));
    }
}
