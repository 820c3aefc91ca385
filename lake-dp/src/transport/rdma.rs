//! RDMA for the transport: RC queue pairs, one-sided READs into this
//! node's slots, the completion queue polled by the owner's loop, each
//! READ tagged `epoch | slot | generation` ([`Tag`]).
//!
//! Two ways to use it, both pulls — a node's slots are only ever written
//! by the node's own READs:
//!
//! - [`pull::RdmaTransport`], the [`crate::transport::Transport`]: a
//!   sender offers a block (a small message: where it is, where it goes,
//!   and a key lent for it alone — a memory window bound read-only over
//!   its bytes, usable only through that peer's queue pair, invalidated
//!   when the transfer ends), the receiver READs it into the target slot,
//!   checks it there and answers. The sender's source is fenced by its
//!   transfer (unchanged until the answer). No peer holds a standing key
//!   to the arena. Above it, everything is as over TCP, and
//!   [`crate::transport::fallback::Fallback`] puts it in front of TCP.
//! - [`verbs::RdmaReader`]: a node reads a block it knows by name from the
//!   peer's slot, through a read-only registration that peer was given
//!   (its own remote key, revoked by dropping it). That read cannot be
//!   fenced against the owner reusing the slot, so the header must name
//!   the slot and generation read, and every segment match its CRC,
//!   before it is published.
//!
//! The [`Endpoint`] a peer needs to connect (queue pair number, address,
//! the exported region and its key) travels over TCP first; it is plain
//! data and is always compiled and tested, as are the transport's
//! protocol ([`pull`]) and the in-process verbs that test it
//! ([`loopback`]). The device verbs ([`verbs`]) need `libibverbs` and a
//! device: this machine has neither an RDMA NIC nor a kernel with
//! soft-RoCE, so they compile here (CI builds them under the `rdma`
//! feature) and run only where a device exists.

use bytemuck::{Pod, Zeroable};

/// Why RDMA could not be set up or a work request failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaError(pub String);

impl core::fmt::Display for RdmaError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RdmaError {}

/// "LKRD", little-endian.
const ENDPOINT_MAGIC: u32 = u32::from_le_bytes(*b"LKRD");
/// Version 3: `pull`'s messages are version 3 (72 bytes: an offer names
/// its namespace, an answer may say *later*). Version 2: the transport's
/// endpoints carry no standing key (`rkey` 0), its offers a key per
/// transfer. Ends of different versions decline each other's offers:
/// their links stay on TCP.
const ENDPOINT_VERSION: u16 = 3;

/// Bytes of an encoded [`Endpoint`].
pub const ENDPOINT_BYTES: usize = 72;

/// One end of an RC queue pair, as the other end needs it to connect and
/// to address its slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
#[repr(C)]
pub struct Endpoint {
    magic: u32,
    version: u16,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The queue pair's number (24 bits).
    pub qp_num: u32,
    /// Its first packet sequence number (24 bits).
    pub psn: u32,
    /// The port's GID (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// Where the exported slots start, in the exporter's address space.
    pub region_base: u64,
    /// Their bytes.
    pub region_len: u64,
    /// The standing remote key this peer reads them with
    /// ([`verbs::RdmaReader`]), or 0: none — keys are lent per transfer,
    /// in offers ([`pull::RdmaTransport`]).
    pub rkey: u32,
    /// Bytes of one slot.
    pub slot_bytes: u32,
    /// The exporter's region epoch (a restarted node's slots are others).
    pub epoch: u64,
    reserved: u32,
    crc: u32,
}

const _: () = assert!(size_of::<Endpoint>() == ENDPOINT_BYTES);

impl Endpoint {
    /// An endpoint (checked when decoded by the peer).
    #[allow(clippy::too_many_arguments)] // the fields of one record
    pub fn new(
        lid: u16,
        qp_num: u32,
        psn: u32,
        gid: [u8; 16],
        (region_base, region_len): (u64, u64),
        rkey: u32,
        slot_bytes: u32,
        epoch: u64,
    ) -> Self {
        Self {
            magic: ENDPOINT_MAGIC,
            version: ENDPOINT_VERSION,
            lid,
            qp_num,
            psn,
            gid,
            region_base,
            region_len,
            rkey,
            slot_bytes,
            epoch,
            reserved: 0,
            crc: 0,
        }
    }

    /// Its bytes (little-endian hosts only: RDMA here is x86-64 and arm64).
    pub fn encode(&self) -> [u8; ENDPOINT_BYTES] {
        let mut copy = *self;
        copy.crc = 0;
        copy.crc = crc32fast::hash(&bytemuck::bytes_of(&copy)[..ENDPOINT_BYTES - 4]);
        let mut out = [0u8; ENDPOINT_BYTES];
        out.copy_from_slice(bytemuck::bytes_of(&copy));
        out
    }

    /// Decodes and checks a peer's endpoint: a bad one is refused by name
    /// before any queue pair is touched.
    pub fn decode(bytes: &[u8; ENDPOINT_BYTES]) -> Result<Self, RdmaError> {
        let endpoint: Self = bytemuck::pod_read_unaligned(bytes);
        let field = |what: &str| Err(RdmaError(format!("peer endpoint: {what}")));
        if endpoint.magic != ENDPOINT_MAGIC {
            return field("not a Lake RDMA endpoint (magic)");
        }
        if endpoint.version != ENDPOINT_VERSION {
            return field("a version this end does not speak");
        }
        if crc32fast::hash(&bytes[..ENDPOINT_BYTES - 4]) != endpoint.crc {
            return field("CRC mismatch");
        }
        if endpoint.reserved != 0 {
            return field("reserved bytes set");
        }
        if endpoint.qp_num >= 1 << 24 || endpoint.psn >= 1 << 24 {
            return field("queue pair number or PSN past 24 bits");
        }
        if endpoint.slot_bytes == 0
            || endpoint.region_len == 0
            || !endpoint.region_len.is_multiple_of(u64::from(endpoint.slot_bytes))
            || endpoint.region_base.checked_add(endpoint.region_len).is_none()
        {
            return field("exported region and slot size do not fit");
        }
        Ok(endpoint)
    }

    /// The address of slot `slot` in the exporter's space, if it has it.
    pub fn slot_address(&self, slot: u32) -> Option<u64> {
        let offset = u64::from(slot).checked_mul(u64::from(self.slot_bytes))?;
        (offset < self.region_len).then(|| self.region_base + offset)
    }
}

/// Whether `bytes` bytes at `address` lie inside the range `(base, len)`
/// (the check a remote or local key makes).
fn inside((base, len): (u64, u64), address: u64, bytes: u64) -> bool {
    address >= base && address.checked_add(bytes).is_some_and(|end| base.checked_add(len).is_some_and(|top| end <= top))
}

/// An RDMA device as an operator names it: `NAME[:PORT[:GID_INDEX]]`, or
/// `any` (the first device), port 1 and GID index 0 unless given; or
/// `loopback`, the in-process verbs ([`loopback::Fabric::process`]) that
/// join only pools and engines of one process (tests, demos).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaDevice {
    /// The device's name (`mlx5_0`); none: the first.
    pub name: Option<String>,
    /// Its port.
    pub port: u8,
    /// The GID index (RoCE v2 is often 1 or 3).
    pub gid_index: u8,
}

impl RdmaDevice {
    /// Parses `NAME[:PORT[:GID_INDEX]]` or `any[:PORT[:GID_INDEX]]`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut parts = text.split(':');
        let name = parts.next().filter(|n| !n.is_empty()).ok_or("an RDMA device is NAME[:PORT[:GID_INDEX]]")?;
        let number = |what: &str, value: Option<&str>, default: u8| {
            value.map_or(Ok(default), |v| v.parse::<u8>().map_err(|e| format!("RDMA device {what} {v:?}: {e}")))
        };
        let port = number("port", parts.next(), 1)?;
        let gid_index = number("GID index", parts.next(), 0)?;
        if parts.next().is_some() {
            return Err(format!("RDMA device {text:?}: NAME[:PORT[:GID_INDEX]]"));
        }
        Ok(Self { name: (name != "any").then(|| name.to_owned()), port, gid_index })
    }
}

/// The name of the in-process verbs as an [`RdmaDevice`].
pub const LOOPBACK_DEVICE: &str = "loopback";

/// Slots' alignment as an [`Endpoint`] states it for the arena opened by
/// [`open_links`]: the page (slot classes are whole pages).
const ARENA_PAGE: u32 = 4096;

/// Loopback ends' message and READ depth.
const LOOPBACK_DEPTH: usize = 256;

/// `tcp`, with RDMA over `device` in front of it where one is named —
/// negotiated per link over TCP, falling back to it — for an arena of
/// `len` bytes at `base` (region epoch `epoch`) that peers read blocks
/// from and READs land in. A device that cannot be opened, or a build
/// without the `rdma` feature asked for one, is said by name.
///
/// # Safety
///
/// The arena stays mapped while the returned transport lives.
pub unsafe fn open_links(
    tcp: crate::transport::tcp::TcpTransport,
    device: Option<&RdmaDevice>,
    base: *mut u8,
    len: usize,
    epoch: u64,
) -> Result<Box<dyn crate::transport::Links>, String> {
    let Some(device) = device else { return Ok(Box::new(tcp)) };
    let fail = |e: &dyn core::fmt::Display| format!("RDMA device {device}: {e}");
    if !len.is_multiple_of(ARENA_PAGE as usize) {
        return Err(fail(&"the arena is not a whole number of pages"));
    }
    if device.name.as_deref() == Some(LOOPBACK_DEVICE) {
        let mut verbs = loopback::Fabric::process().end(LOOPBACK_DEPTH);
        // SAFETY: the arena stays mapped while the transport lives (this
        // function's contract).
        unsafe { verbs.register_arena(base, len, ARENA_PAGE, epoch) };
        return Ok(negotiated(verbs, tcp));
    }
    #[cfg(feature = "rdma")]
    {
        let opened =
            verbs::Device::open(device.name.as_deref(), device.port, device.gid_index).map_err(|e| fail(&e))?;
        // SAFETY: as above.
        let verbs = unsafe { verbs::IbVerbs::new(opened, base, len, ARENA_PAGE, epoch) }.map_err(|e| fail(&e))?;
        Ok(negotiated(verbs, tcp))
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (tcp, base, epoch);
        Err(fail(&"built without the `rdma` feature (only `loopback`, the in-process verbs, opens)"))
    }
}

/// RDMA over `verbs` negotiated on `tcp`'s links, TCP behind it.
fn negotiated<V: pull::Verbs + 'static>(
    verbs: V,
    tcp: crate::transport::tcp::TcpTransport,
) -> Box<dyn crate::transport::Links> {
    let rdma = pull::RdmaTransport::new(verbs, pull::RdmaConfig::default());
    Box::new(over_tcp::RdmaOverTcp::new(rdma, tcp, over_tcp::OverTcpConfig::default()))
}

impl core::fmt::Display for RdmaDevice {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}:{}:{}", self.name.as_deref().unwrap_or("any"), self.port, self.gid_index)
    }
}

pub mod loopback;
pub mod over_tcp;
pub mod pull;
#[cfg(feature = "rdma")]
pub mod verbs;

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint::new(7, 0x12_3456, 0xab_cdef, [3; 16], (0x7f00_0000_0000, 64 << 20), 0xdead_beef, 1 << 20, 9)
    }

    #[test]
    fn endpoints_round_trip_and_a_flipped_bit_is_refused() {
        let bytes = endpoint().encode();
        assert_eq!(Endpoint::decode(&bytes), Ok(endpoint().with_crc_of(&bytes)));
        for bit in 0..ENDPOINT_BYTES * 8 {
            let mut bad = bytes;
            bad[bit / 8] ^= 1 << (bit % 8);
            assert!(Endpoint::decode(&bad).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn fields_that_do_not_fit_are_named_and_slots_stay_inside() {
        let mut wide = endpoint();
        wide.qp_num = 1 << 24;
        assert!(Endpoint::decode(&wide.encode()).unwrap_err().0.contains("24 bits"));
        let mut ragged = endpoint();
        ragged.region_len += 1;
        assert!(Endpoint::decode(&ragged.encode()).unwrap_err().0.contains("do not fit"));
        let e = endpoint();
        assert_eq!(e.slot_address(0), Some(0x7f00_0000_0000));
        assert_eq!(e.slot_address(63), Some(0x7f00_0000_0000 + (63 << 20)));
        assert_eq!(e.slot_address(64), None);
        assert_eq!(e.slot_address(u32::MAX), None);
    }

    impl Endpoint {
        fn with_crc_of(mut self, bytes: &[u8; ENDPOINT_BYTES]) -> Self {
            self.crc = u32::from_le_bytes(bytes[ENDPOINT_BYTES - 4..].try_into().unwrap());
            self
        }
    }
}
