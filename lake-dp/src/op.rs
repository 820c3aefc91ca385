//! What an embedder asks the poller to do, and what it hears back.

use core::fmt;

use crate::model::key::BlockKey;
use crate::model::replica::{Durability, Priority};
use crate::stored::{ObjectMeta, StoredError};
use crate::tag::Tag;

/// An L2 slot: a file of the L2 tier and a slot in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct L2Slot {
    /// The file's index in the tier.
    pub file: u16,
    /// The slot in that file.
    pub slot: u32,
}

/// Write a block from an L1 slot to an L2 slot (demotion, write-back). The
/// payload is already in the L1 slot after its 4 KiB header area; the
/// poller computes the segment CRCs, writes the header and sends the whole
/// object in one transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteBlock {
    /// The L1 slot holding the payload (at offset 4096).
    pub l1_slot: u32,
    /// Where it goes.
    pub target: L2Slot,
    /// The stored header's contents. `slot` must equal `target.slot`,
    /// `region_epoch` the poller's epoch, `region` the target file's region.
    pub meta: ObjectMeta,
    /// [`Durability::Acked`]: done when the write completes.
    /// [`Durability::Durable`]: done when a later fdatasync completes.
    pub durability: Durability,
    /// The payload in the slot is sealed (encrypted at rest) so: its header
    /// says so, its CRCs are over the ciphertext.
    pub seal: Option<crate::stored::Seal>,
}

/// Read a block from an L2 slot into an L1 slot (promotion, load). Done only
/// after the header and every segment CRC check out and the header names
/// the expected key, slot and generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadBlock {
    /// Where it is.
    pub source: L2Slot,
    /// Where it goes.
    pub l1_slot: u32,
    /// The key expected in the header.
    pub key: BlockKey,
    /// The slot generation expected in the header.
    pub generation: u32,
    /// Payload bytes expected.
    pub payload_len: u64,
}

/// A command for the poller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// L1 → L2.
    Write(WriteBlock),
    /// L2 → L1.
    Read(ReadBlock),
    /// Make every acked write to this L2 file durable.
    Flush {
        /// The file.
        file: u16,
    },
}

/// A command with its scheduling terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub command: Command,
    /// Its class; higher classes are issued first.
    pub priority: Priority,
    /// Give up if not started by this monotonic time (0: never).
    pub deadline_ns: u64,
    /// Returned untouched in the event.
    pub cookie: u64,
}

/// The handle of an admitted request: cancel with it; events carry it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub Tag);

/// A request the poller would not take, handed back whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// The request, for retrying later.
    pub request: Request,
    /// Why.
    pub reason: RejectReason,
}

/// Why a request was refused at the door.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Every operation slot is in use: back off and retry (backpressure).
    Full,
    /// Another operation is using this L1 slot.
    L1SlotBusy,
    /// A field is out of range or inconsistent.
    Invalid(&'static str),
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full => f.write_str("no free operation slot"),
            Self::L1SlotBusy => f.write_str("L1 slot has an operation in flight"),
            Self::Invalid(what) => write!(f, "invalid request: {what}"),
        }
    }
}

/// How an operation failed. Every failure is per block: the poller goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpError {
    /// The device returned an error (errno).
    Io(i32),
    /// The device kept returning fewer bytes than asked.
    Short {
        /// Bytes asked for.
        expected: u32,
        /// Bytes obtained before giving up.
        got: u32,
    },
    /// The stored object failed a check (header or segment CRC, geometry).
    Corrupt(StoredError),
    /// A valid object, but not the one expected (key, slot, generation or
    /// length differ): a stale reference or a misdirected write.
    Mismatch(&'static str),
    /// Cancelled by the requester.
    Cancelled,
    /// Not started before its deadline.
    DeadlineExceeded,
    /// The request was malformed (it arrived through a ring, so it could not
    /// be handed back).
    Invalid(&'static str),
    /// The fdatasync that should have made the write durable failed
    /// (errno): the data's durability is unknown.
    FlushFailed(i32),
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(errno) => write!(f, "I/O error (errno {errno})"),
            Self::Short { expected, got } => write!(f, "short transfer: {got} of {expected} bytes"),
            Self::Corrupt(e) => write!(f, "corrupt object: {e}"),
            Self::Mismatch(what) => write!(f, "unexpected object: {what} differs"),
            Self::Cancelled => f.write_str("cancelled"),
            Self::DeadlineExceeded => f.write_str("deadline exceeded before start"),
            Self::Invalid(what) => write!(f, "invalid request: {what}"),
            Self::FlushFailed(errno) => write!(f, "fdatasync failed (errno {errno})"),
        }
    }
}

impl std::error::Error for OpError {}

/// What a finished operation achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Done {
    /// Bytes moved (whole object, header included).
    pub bytes: u64,
    /// For writes: the durability reached. For reads: [`Durability::Volatile`].
    pub durability: Durability,
}

/// The one event every admitted request ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// The request's ticket.
    pub ticket: Ticket,
    /// The request's cookie.
    pub cookie: u64,
    /// The command, for the caller's bookkeeping.
    pub command: Command,
    /// Success or the reason for failure.
    pub outcome: Result<Done, OpError>,
}

impl Event {
    /// A filler for the event buffers callers hand to `reap`, before it
    /// writes real events there (no request ends with it).
    pub fn placeholder() -> Self {
        Self {
            ticket: Ticket(crate::tag::Tag::default()),
            cookie: 0,
            command: Command::Flush { file: 0 },
            outcome: Err(OpError::Cancelled),
        }
    }
}
