//! The verbs: a device and its protection domain, memory registrations,
//! an RC queue pair with its completion queue, one-sided READs, and the
//! poll of the completion queue. Built with the `rdma` feature; runs where
//! a device exists.

use std::collections::HashMap;

use ibverbs_sys as ffi;

use super::pull::{MESSAGE_BYTES, Verbs, VerbsError, VerbsEvent};
use super::{Endpoint, RdmaError, inside};
use crate::constants::STORED_HEADER_BYTES;
use crate::tag::Tag;
use crate::transport::frame::{AckStatus, BlockAddr};
use crate::transport::{Completion, Landing, PeerId, TransferError};

fn os_error(what: &str) -> RdmaError {
    RdmaError(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// An opened RDMA device (one port) and its protection domain.
#[derive(Debug)]
pub struct Device {
    context: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    port: u8,
    lid: u16,
    gid: [u8; 16],
    gid_index: u8,
}

impl Device {
    /// Opens device `name` (the first one if `None`) on `port`, GID index
    /// `gid_index` (RoCE). A machine without a device says so.
    pub fn open(name: Option<&str>, port: u8, gid_index: u8) -> Result<Self, RdmaError> {
        let mut count = 0;
        // SAFETY: a valid out-pointer; the list is freed below.
        let list = unsafe { ffi::ibv_get_device_list(&raw mut count) };
        if list.is_null() || count <= 0 {
            if !list.is_null() {
                // SAFETY: from ibv_get_device_list.
                unsafe { ffi::ibv_free_device_list(list) };
            }
            return Err(RdmaError("no RDMA device on this machine".into()));
        }
        let mut chosen = core::ptr::null_mut();
        for i in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: `count` entries; `i` is below it.
            let device = unsafe { *list.wrapping_add(i) };
            // SAFETY: a device of the list.
            let raw_name = unsafe { ffi::ibv_get_device_name(device) };
            // SAFETY: the device's name, a C string it owns.
            let device_name = unsafe { std::ffi::CStr::from_ptr(raw_name) };
            if name.is_none_or(|n| device_name.to_bytes() == n.as_bytes()) {
                chosen = device;
                break;
            }
        }
        if chosen.is_null() {
            // SAFETY: from ibv_get_device_list.
            unsafe { ffi::ibv_free_device_list(list) };
            return Err(RdmaError(format!("no RDMA device named {name:?}")));
        }
        // SAFETY: a device of the list, opened before the list is freed.
        let context = unsafe { ffi::ibv_open_device(chosen) };
        // SAFETY: from ibv_get_device_list; the context keeps what it needs.
        unsafe { ffi::ibv_free_device_list(list) };
        if context.is_null() {
            return Err(os_error("opening the RDMA device"));
        }
        // SAFETY: an open context.
        let pd = unsafe { ffi::ibv_alloc_pd(context) };
        if pd.is_null() {
            // SAFETY: opened above, closed once.
            unsafe { ffi::ibv_close_device(context) };
            return Err(os_error("allocating a protection domain"));
        }
        let mut device = Self { context, pd, port, lid: 0, gid: [0; 16], gid_index };
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: an open context and a valid out-pointer.
        if unsafe { ffi::ibv_query_port(context, port, (&raw mut attr).cast()) } != 0 {
            return Err(os_error("querying the RDMA port"));
        }
        device.lid = attr.lid;
        let mut gid = ffi::ibv_gid::default();
        // SAFETY: as above.
        if unsafe { ffi::ibv_query_gid(context, port, i32::from(gid_index), &raw mut gid) } != 0 {
            return Err(os_error("querying the port's GID"));
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        device.gid = unsafe { gid.raw };
        Ok(device)
    }

    /// Registers `len` bytes at `base`: as a READ's local target (local
    /// write), and — `remote_read` — for one peer to read (its own key).
    ///
    /// # Safety
    ///
    /// The range stays valid (mapped) while the registration lives.
    pub unsafe fn register(&self, base: *mut u8, len: usize, remote_read: bool) -> Result<Region, RdmaError> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_read {
            access |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        }
        // SAFETY: the caller's contract is this one's.
        unsafe { self.register_with(base, len, access) }
    }

    /// Registers `len` bytes at `base` as a READ's local target and for
    /// memory windows to be bound over: no remote access through the
    /// registration's own key, only through a window's.
    ///
    /// # Safety
    ///
    /// As [`Device::register`].
    pub unsafe fn register_for_windows(&self, base: *mut u8, len: usize) -> Result<Region, RdmaError> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE | ffi::ibv_access_flags::IBV_ACCESS_MW_BIND;
        // SAFETY: the caller's contract is this one's.
        unsafe { self.register_with(base, len, access) }
    }

    /// # Safety
    ///
    /// As [`Device::register`].
    unsafe fn register_with(
        &self,
        base: *mut u8,
        len: usize,
        access: ffi::ibv_access_flags,
    ) -> Result<Region, RdmaError> {
        // SAFETY: an allocated protection domain and a valid range
        // (contract).
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, base.cast(), len, access.0.cast_signed()) };
        if mr.is_null() {
            return Err(os_error("registering memory"));
        }
        Ok(Region { mr })
    }

    /// `count` type 2 memory windows of the protection domain: the keys
    /// lent per transfer ([`super::pull::Verbs::lend`]). A device without
    /// them is said by name.
    fn windows(&self, count: u32) -> Result<Windows, RdmaError> {
        // SAFETY: an open context's operations table.
        let alloc = unsafe { (*self.context).ops.alloc_mw }
            .ok_or(RdmaError("the device has no memory windows (per-transfer keys need type 2 windows)".into()))?;
        let mut windows = Windows(Vec::new());
        for _ in 0..count {
            // SAFETY: an allocated protection domain.
            let mw = unsafe { alloc(self.pd, ffi::IBV_MW_TYPE_2) };
            if mw.is_null() {
                return Err(os_error("allocating a type 2 memory window (per-transfer keys need them)"));
            }
            // SAFETY: a window just allocated.
            let key = unsafe { (*mw).rkey };
            windows.0.push(Window { mw, key, state: WindowState::Free });
        }
        Ok(windows)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: allocated and opened in `open`, released once, after
        // every queue pair and registration (they borrow the device).
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
        }
        // SAFETY: as above.
        unsafe {
            ffi::ibv_close_device(self.context);
        }
    }
}

/// A memory registration; deregistered (its key revoked) when dropped.
#[derive(Debug)]
pub struct Region {
    mr: *mut ffi::ibv_mr,
}

impl Region {
    /// The key local work requests name it by.
    pub fn lkey(&self) -> u32 {
        // SAFETY: a live registration.
        unsafe { (*self.mr).lkey }
    }

    /// The key a peer reads it with.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// An RC queue pair to one peer and its completion queue.
#[derive(Debug)]
pub struct QueuePair {
    qp: *mut ffi::ibv_qp,
    cq: *mut ffi::ibv_cq,
    depth: u32,
    posted: u32,
    local: Endpoint,
}

impl QueuePair {
    /// A queue pair of `depth` outstanding READs, exporting `exported`
    /// (`region_len` bytes of `slot_bytes` slots at `region_base`, epoch
    /// `epoch`) to its peer.
    pub fn new(
        device: &Device,
        exported: (&Region, u64, u64),
        slot_bytes: u32,
        epoch: u64,
        depth: u32,
    ) -> Result<Self, RdmaError> {
        Self::with_receives(device, exported, slot_bytes, epoch, depth, 1)
    }

    /// As [`QueuePair::new`], with `receives` receive requests besides
    /// (two-sided messages); its completion queue holds both.
    pub fn with_receives(
        device: &Device,
        exported: (&Region, u64, u64),
        slot_bytes: u32,
        epoch: u64,
        depth: u32,
        receives: u32,
    ) -> Result<Self, RdmaError> {
        let entries =
            depth.checked_add(receives).and_then(|n| i32::try_from(n).ok()).ok_or(RdmaError("queue depth".into()))?;
        // SAFETY: an open context; no channel, no context pointer.
        let cq =
            unsafe { ffi::ibv_create_cq(device.context, entries, core::ptr::null_mut(), core::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(os_error("creating a completion queue"));
        }
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: core::ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: core::ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: depth,
                max_recv_wr: receives,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: an allocated protection domain and valid attributes.
        let qp = unsafe { ffi::ibv_create_qp(device.pd, &raw mut init) };
        if qp.is_null() {
            // SAFETY: created above, destroyed once.
            unsafe { ffi::ibv_destroy_cq(cq) };
            return Err(os_error("creating a queue pair"));
        }
        let mut pair = Self { qp, cq, depth, posted: 0, local: bytemuck::Zeroable::zeroed() };
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: device.port,
            qp_access_flags: ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as m;
        pair.modify(
            &mut attr,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        // SAFETY: a live queue pair.
        let qp_num = unsafe { (*qp).qp_num };
        let psn = (qp_num.wrapping_mul(2_654_435_761) ^ 0x5a_5a5a) & 0xff_ffff;
        let (region, base, len) = exported;
        pair.local = Endpoint::new(device.lid, qp_num, psn, device.gid, (base, len), region.rkey(), slot_bytes, epoch);
        Ok(pair)
    }

    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, to: &str) -> Result<(), RdmaError> {
        // SAFETY: a live queue pair and valid attributes for `mask`.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0.cast_signed()) };
        if rc == 0 { Ok(()) } else { Err(RdmaError(format!("queue pair to {to}: error {rc}"))) }
    }

    /// What the peer needs to connect to this end.
    pub fn endpoint(&self) -> Endpoint {
        self.local
    }

    /// Connects to the peer's `remote` endpoint (checked by
    /// [`Endpoint::decode`]): ready to receive, then to send.
    pub fn connect(&mut self, device: &Device, remote: &Endpoint) -> Result<(), RdmaError> {
        let mut ah =
            ffi::ibv_ah_attr { dlid: remote.lid, sl: 0, src_path_bits: 0, port_num: device.port, ..Default::default() };
        if remote.lid == 0 {
            // RoCE: addressed by GID.
            ah.is_global = 1;
            ah.grh.dgid = ffi::ibv_gid { raw: remote.gid };
            ah.grh.sgid_index = device.gid_index;
            ah.grh.hop_limit = 64;
        }
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: ffi::IBV_MTU_1024,
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ah_attr: ah,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as m;
        self.modify(
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.local.psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Posts a one-sided READ of `len` bytes at `remote_address` (key
    /// `rkey`) into `into` (registered, key `lkey`), tagged `tag`.
    ///
    /// # Safety
    ///
    /// `into` is valid for `len` bytes of the registration `lkey` names,
    /// and left alone until the READ's completion is polled.
    pub unsafe fn read(
        &mut self,
        tag: Tag,
        (remote_address, rkey): (u64, u32),
        into: *mut u8,
        (len, lkey): (u32, u32),
    ) -> Result<(), RdmaError> {
        if self.posted >= self.depth {
            return Err(RdmaError("queue pair full".into()));
        }
        // SAFETY: the caller's contract is this one's.
        unsafe { self.post_read(tag.raw(), (remote_address, rkey), into, (len, lkey)) }?;
        self.posted += 1;
        Ok(())
    }

    /// Posts a signalled one-sided READ, tagged `wr_id` (counted by the
    /// caller).
    ///
    /// # Safety
    ///
    /// As [`QueuePair::read`].
    unsafe fn post_read(
        &mut self,
        wr_id: u64,
        (remote_address, rkey): (u64, u32),
        into: *mut u8,
        (len, lkey): (u32, u32),
    ) -> Result<(), RdmaError> {
        let mut sge = ffi::ibv_sge { addr: into as u64, length: len, lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: core::ptr::null_mut(),
            sg_list: &raw mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: remote_address, rkey };
        // SAFETY: the scatter entry names registered memory left alone
        // until the READ completes (contract); it lives through the call.
        unsafe { self.post_send(&mut wr) }
    }

    /// Posts `wr` on the send queue (a SEND or a READ the caller built and
    /// counts).
    ///
    /// # Safety
    ///
    /// Its scatter entries name registered memory left alone until its
    /// completion is polled.
    unsafe fn post_send(&mut self, wr: &mut ffi::ibv_send_wr) -> Result<(), RdmaError> {
        let mut bad = core::ptr::null_mut();
        // SAFETY: a live queue pair.
        let context = unsafe { (*self.qp).context };
        // SAFETY: its live context's operations table.
        let post = unsafe { (*context).ops.post_send }.ok_or(RdmaError("no post_send".into()))?;
        // SAFETY: a live queue pair and a valid request (contract); the
        // driver copies the request and its scatter list.
        match unsafe { post(self.qp, wr, &raw mut bad) } {
            0 => Ok(()),
            rc => Err(RdmaError(format!("posting on the send queue: error {rc}"))),
        }
    }

    /// Posts a receive of up to `len` bytes into `into` (key `lkey`).
    ///
    /// # Safety
    ///
    /// `into` is valid for `len` bytes of the registration `lkey` names
    /// and left alone until the receive completes.
    unsafe fn post_recv(&mut self, wr_id: u64, into: *mut u8, len: u32, lkey: u32) -> Result<(), RdmaError> {
        let mut sge = ffi::ibv_sge { addr: into as u64, length: len, lkey };
        let mut wr = ffi::ibv_recv_wr { wr_id, next: core::ptr::null_mut(), sg_list: &raw mut sge, num_sge: 1 };
        let mut bad = core::ptr::null_mut();
        // SAFETY: a live queue pair.
        let context = unsafe { (*self.qp).context };
        // SAFETY: its live context's operations table.
        let post = unsafe { (*context).ops.post_recv }.ok_or(RdmaError("no post_recv".into()))?;
        // SAFETY: a live queue pair and a valid request (contract).
        match unsafe { post(self.qp, &raw mut wr, &raw mut bad) } {
            0 => Ok(()),
            rc => Err(RdmaError(format!("posting a receive: error {rc}"))),
        }
    }

    /// Completions since the last poll, as the device reports them.
    fn poll_raw<'a>(&mut self, wc: &'a mut [ffi::ibv_wc]) -> &'a [ffi::ibv_wc] {
        // SAFETY: a live completion queue.
        let context = unsafe { (*self.cq).context };
        // SAFETY: its live context's operations table.
        let Some(poll) = (unsafe { (*context).ops.poll_cq }) else { return &[] };
        let room = i32::try_from(wc.len()).unwrap_or(i32::MAX);
        // SAFETY: a live completion queue and room for `room` completions.
        let n = unsafe { poll(self.cq, room, wc.as_mut_ptr()) };
        &wc[..usize::try_from(n).unwrap_or(0)]
    }

    /// Moves the queue pair to the error state: nothing more is sent or
    /// answered on it (a peer's READs of this node's memory included);
    /// what was posted completes flushed.
    fn break_off(&mut self) {
        let mut attr = ffi::ibv_qp_attr { qp_state: ffi::ibv_qp_state::IBV_QPS_ERR, ..Default::default() };
        // Failing to move it leaves it where it was; the caller also
        // revokes the peer's key.
        let _ = self.modify(&mut attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE, "ERR");
    }

    /// Completions since the last poll: each READ's tag and whether it
    /// succeeded. Never blocks.
    pub fn poll(&mut self, out: &mut Vec<(Tag, Result<(), RdmaError>)>) -> usize {
        let mut wc = [ffi::ibv_wc::default(); 32];
        let done = self.poll_raw(&mut wc);
        for c in done {
            let result = match c.error() {
                None => Ok(()),
                Some((status, vendor)) => Err(RdmaError(format!("READ failed: status {status}, vendor {vendor}"))),
            };
            out.push((Tag::from_raw(c.wr_id()), result));
        }
        self.posted = self.posted.saturating_sub(u32::try_from(done.len()).unwrap_or(u32::MAX));
        done.len()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, the queue pair first.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
        // SAFETY: as above.
        unsafe { ffi::ibv_destroy_cq(self.cq) };
    }
}

/// A read in flight: what it reads, and where it lands.
#[derive(Clone, Copy, Debug)]
struct Reading {
    transfer: u64,
    source: BlockAddr,
    target: BlockAddr,
    len: u64,
    into: *mut u8,
}

/// Blocks pulled from one peer over RDMA into this node's slots, checked
/// where they land — the same `Landing` and completions as over TCP.
#[derive(Debug)]
pub struct RdmaReader {
    pair: QueuePair,
    remote: Endpoint,
    local_lkey: u32,
    reading: HashMap<u64, Reading>,
    polled: Vec<(Tag, Result<(), RdmaError>)>,
}

impl RdmaReader {
    /// A reader over a connected `pair` from the peer that exported
    /// `remote`; local slots are registered under `local_lkey`.
    pub fn new(pair: QueuePair, remote: Endpoint, local_lkey: u32) -> Self {
        Self { pair, remote, local_lkey, reading: HashMap::new(), polled: Vec::with_capacity(32) }
    }

    /// Reads the block in the peer's slot `source` (`len` bytes) into this
    /// node's slot `target`, placed by `landing`.
    pub fn read(
        &mut self,
        transfer: u64,
        source: BlockAddr,
        len: u64,
        target: BlockAddr,
        landing: &mut dyn Landing,
    ) -> Result<(), TransferError> {
        if source.epoch != self.remote.epoch {
            return Err(TransferError::Refused);
        }
        let address = self.remote.slot_address(source.slot).ok_or(TransferError::Invalid("source slot"))?;
        let len32 = u32::try_from(len).map_err(|_| TransferError::Invalid("length"))?;
        if len32 > self.remote.slot_bytes {
            return Err(TransferError::Invalid("length"));
        }
        let into = landing.place(&target, len).map_err(|_| TransferError::Refused)?;
        let tag = Tag::new(source.epoch, source.slot, source.generation);
        if self.reading.contains_key(&tag.raw()) {
            landing.abandoned(&target);
            return Err(TransferError::Invalid("that slot is being read already"));
        }
        // SAFETY: `into` is the placed target slot (at least `len` bytes,
        // registered under `local_lkey`), left to this read until it
        // completes.
        if let Err(e) = unsafe { self.pair.read(tag, (address, self.remote.rkey), into, (len32, self.local_lkey)) } {
            landing.abandoned(&target);
            return Err(TransferError::PeerLost(e.0));
        }
        self.reading.insert(tag.raw(), Reading { transfer, source, target, len, into });
        Ok(())
    }

    /// Reads that completed: checked where they landed (the header names
    /// the slot and generation read, every segment matches its CRC) and
    /// handed to `landing`, or failed by name.
    pub fn poll(&mut self, landing: &mut dyn Landing, out: &mut Vec<Completion>) -> usize {
        self.polled.clear();
        self.pair.poll(&mut self.polled);
        let mut done = 0;
        for (tag, result) in self.polled.drain(..) {
            let Some(read) = self.reading.remove(&tag.raw()) else { continue };
            done += 1;
            let result = match result {
                Err(e) => {
                    landing.abandoned(&read.target);
                    Err(TransferError::PeerLost(e.0))
                }
                Ok(()) => {
                    // SAFETY: the READ into the placed slot completed; the
                    // slot is this node's until landed or abandoned.
                    let bytes =
                        unsafe { core::slice::from_raw_parts(read.into, usize::try_from(read.len).unwrap_or(0)) };
                    let named = crate::stored::decode_header(bytes).is_ok_and(|h| {
                        let m = h.meta();
                        m.slot == read.source.slot
                            && m.generation == read.source.generation
                            && m.region_epoch == read.source.epoch
                            && m.region.0 == read.source.region
                            && bytes.len() >= STORED_HEADER_BYTES
                    });
                    if !named {
                        // The owner reused the slot while it was read.
                        landing.abandoned(&read.target);
                        Err(TransferError::Refused)
                    } else {
                        match landing.landed(&read.target, read.len) {
                            AckStatus::Landed => Ok(()),
                            AckStatus::Corrupt => Err(TransferError::Corrupt),
                            // `Later` answers reservations, not landings.
                            AckStatus::Busy | AckStatus::Later => Err(TransferError::Busy),
                            AckStatus::Refused => Err(TransferError::Refused),
                        }
                    }
                }
            };
            out.push(Completion { transfer: read.transfer, result, target: read.target });
        }
        done
    }
}

/// Receive requests per peer (offers and answers it may send at once).
const RECEIVES: u32 = 128;
/// Memory windows per peer, one a key lent: offers in flight to one peer
/// (`RdmaConfig::offers_per_peer`, 32 by default) and windows whose
/// invalidation has not completed yet.
const WINDOWS: u32 = 64;
/// Messages this end may have in flight to one peer.
const SENDS: u32 = 64;
/// READs this end may have in flight from one peer.
const READS: u32 = 32;
/// Bytes of a message, as a scatter entry's length.
#[allow(clippy::cast_possible_truncation)] // 64, checked below
const MESSAGE_LEN: u32 = MESSAGE_BYTES as u32;
const _: () = assert!(MESSAGE_LEN as usize == MESSAGE_BYTES);
/// Work-request ids of messages: above every READ's tag this end posts.
const MESSAGE_WR_BASE: u64 = u64::MAX - (RECEIVES + SENDS) as u64;
/// Work-request ids of window binds (even) and invalidations (odd): below
/// the messages', above every READ's tag.
const WINDOW_WR_BASE: u64 = MESSAGE_WR_BASE - 2 * WINDOWS as u64;

/// Where a memory window is in its cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WindowState {
    /// Unbound: free to lend.
    Free,
    /// Bound over one block for the peer (its bind may still be posted).
    Lent,
    /// Its invalidation is posted; free again once that completes.
    Invalidating,
}

/// A type 2 memory window and the key its last bind gave it.
#[derive(Debug)]
struct Window {
    mw: *mut ffi::ibv_mw,
    key: u32,
    state: WindowState,
}

/// A peer's memory windows; deallocated when dropped (after the queue
/// pair they were bound through).
#[derive(Debug)]
struct Windows(Vec<Window>);

impl Drop for Windows {
    fn drop(&mut self) {
        for w in &self.0 {
            // SAFETY: a window allocated by `Device::windows`, freed once
            // below; its context outlives it (the device drops last).
            let context = unsafe { (*w.mw).context };
            // SAFETY: that live context's operations table.
            if let Some(dealloc) = unsafe { (*context).ops.dealloc_mw } {
                // SAFETY: as above.
                unsafe { dealloc(w.mw) };
            }
        }
    }
}

/// A signalled work request on window `index` (no scatter entries): its
/// bind (even id) or its invalidation (odd id), by `opcode`.
fn window_request(index: usize, opcode: ffi::ibv_wr_opcode::Type) -> ffi::ibv_send_wr {
    let invalidation = u64::from(opcode == ffi::ibv_wr_opcode::IBV_WR_LOCAL_INV);
    ffi::ibv_send_wr {
        wr_id: WINDOW_WR_BASE + 2 * index as u64 + invalidation,
        next: core::ptr::null_mut(),
        sg_list: core::ptr::null_mut(),
        num_sge: 0,
        opcode,
        send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
        ..Default::default()
    }
}

/// The key a window's next bind gives it: the same window, the low 8 bits
/// (the key's tag) moved on, so a key taken back never reads again
/// (`ibv_inc_rkey`).
fn next_key(key: u32) -> u32 {
    (key & !0xff) | (key.wrapping_add(1) & 0xff)
}

/// One peer's queue pair, the memory windows it lends keys through and
/// its message buffers. Fields drop in order: the queue pair before the
/// windows bound through it and the memory it names.
#[derive(Debug)]
struct IbPeer {
    pair: QueuePair,
    /// One a key lent to the peer: bound read-only over one block through
    /// this queue pair, invalidated when the transfer ends.
    windows: Windows,
    messages: Region,
    buffers: Box<[u8]>,
    remote: Option<Endpoint>,
    sends: u32,
    next_send: u32,
    reads: u32,
    broken: Option<String>,
    reported: bool,
}

/// [`super::pull::Verbs`] over a device: one RC queue pair per peer, the
/// arena registered once — for local READ targets and for memory windows
/// to be bound over, with no remote access of its own — and per peer a
/// set of type 2 memory windows: each key lent is one window bound over
/// one block, read-only, usable only through that peer's queue pair, and
/// invalidated when its transfer ends. Fields drop in order: peers, then
/// the arena's registration, then the device.
#[derive(Debug)]
pub struct IbVerbs {
    peers: Vec<IbPeer>,
    local: Region,
    arena: (u64, u64),
    slot_bytes: u32,
    epoch: u64,
    device: Device,
}

// SAFETY: the verbs objects are used from whichever one thread owns this
// (libibverbs allows any thread, one at a time).
unsafe impl Send for IbVerbs {}

impl IbVerbs {
    /// Verbs on `device` over the arena of `len` bytes at `base` (slots of
    /// `slot_bytes`, region epoch `epoch`).
    ///
    /// # Safety
    ///
    /// The arena stays mapped while this lives.
    pub unsafe fn new(
        device: Device,
        base: *mut u8,
        len: usize,
        slot_bytes: u32,
        epoch: u64,
    ) -> Result<Self, RdmaError> {
        // SAFETY: the arena stays mapped (contract).
        let local = unsafe { device.register_for_windows(base, len) }?;
        Ok(Self { peers: Vec::new(), local, arena: (base as u64, len as u64), slot_bytes, epoch, device })
    }

    fn usable(&mut self, peer: PeerId) -> Result<&mut IbPeer, VerbsError> {
        let p = self.peers.get_mut(peer.0 as usize).ok_or_else(|| VerbsError::Broken("no such peer".into()))?;
        if let Some(why) = &p.broken {
            return Err(VerbsError::Broken(why.clone()));
        }
        if p.remote.is_none() {
            return Err(VerbsError::Broken("not connected yet".into()));
        }
        Ok(p)
    }
}

impl Verbs for IbVerbs {
    /// A queue pair for a new peer and the endpoint to give it (over TCP);
    /// [`Verbs::connect`] it with the peer's.
    fn add_peer(&mut self) -> Result<(PeerId, Endpoint), RdmaError> {
        let (base, len) = self.arena;
        // Sends, READs, and a bind and an invalidation per window.
        let mut pair = QueuePair::with_receives(
            &self.device,
            (&self.local, base, len),
            self.slot_bytes,
            self.epoch,
            SENDS + READS + 2 * WINDOWS,
            RECEIVES,
        )?;
        // No standing key: the arena's registration grants no remote
        // access; every offer carries the key lent for its block.
        pair.local.rkey = 0;
        let windows = self.device.windows(WINDOWS)?;
        let mut buffers = vec![0u8; (RECEIVES + SENDS) as usize * MESSAGE_BYTES].into_boxed_slice();
        // SAFETY: the buffers live in the peer, dropped after the
        // registration and the queue pair.
        let messages = unsafe { self.device.register(buffers.as_mut_ptr(), buffers.len(), false) }?;
        let endpoint = pair.endpoint();
        self.peers.push(IbPeer {
            pair,
            windows,
            messages,
            buffers,
            remote: None,
            sends: 0,
            next_send: 0,
            reads: 0,
            broken: None,
            reported: false,
        });
        Ok((PeerId(u32::try_from(self.peers.len() - 1).unwrap_or(u32::MAX)), endpoint))
    }

    /// Connects `peer` to the endpoint it sent (checked by
    /// [`Endpoint::decode`]) and posts its receives.
    fn connect(&mut self, peer: PeerId, remote: &Endpoint) -> Result<(), RdmaError> {
        let p = self.peers.get_mut(peer.0 as usize).ok_or(RdmaError("no such peer".into()))?;
        p.pair.connect(&self.device, remote)?;
        p.remote = Some(*remote);
        for i in 0..RECEIVES {
            let into = p.buffers[i as usize * MESSAGE_BYTES..].as_mut_ptr();
            // SAFETY: a message buffer of the registration, reposted only
            // once its receive completed.
            unsafe { p.pair.post_recv(MESSAGE_WR_BASE + u64::from(i), into, MESSAGE_LEN, p.messages.lkey()) }?;
        }
        Ok(())
    }

    fn send(&mut self, peer: PeerId, message: &[u8; MESSAGE_BYTES]) -> Result<(), VerbsError> {
        let p = self.usable(peer)?;
        if p.sends >= SENDS {
            return Err(VerbsError::Full);
        }
        let index = RECEIVES + p.next_send % SENDS;
        let at = index as usize * MESSAGE_BYTES;
        p.buffers[at..at + MESSAGE_BYTES].copy_from_slice(message);
        let mut sge =
            ffi::ibv_sge { addr: p.buffers[at..].as_ptr() as u64, length: MESSAGE_LEN, lkey: p.messages.lkey() };
        let mut wr = ffi::ibv_send_wr {
            wr_id: MESSAGE_WR_BASE + u64::from(index),
            next: core::ptr::null_mut(),
            sg_list: &raw mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        // SAFETY: the message buffer is registered and not rewritten until
        // its send completes (at most `SENDS` in flight, in ring order).
        unsafe { p.pair.post_send(&mut wr) }.map_err(|e| VerbsError::Broken(e.0))?;
        p.sends += 1;
        p.next_send = p.next_send.wrapping_add(1);
        Ok(())
    }

    fn lend(&mut self, peer: PeerId, address: u64, len: u64) -> Result<u32, VerbsError> {
        if !inside(self.arena, address, len) {
            return Err(VerbsError::Broken("a key lent outside the registered memory".into()));
        }
        let mr = self.local.mr;
        let p = self.usable(peer)?;
        let Some(index) = p.windows.0.iter().position(|w| w.state == WindowState::Free) else {
            return Err(VerbsError::Full);
        };
        let window = &mut p.windows.0[index];
        let key = next_key(window.key);
        let mut wr = window_request(index, ffi::ibv_wr_opcode::IBV_WR_BIND_MW);
        wr.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw: window.mw,
            rkey: key,
            bind_info: ffi::ibv_mw_bind_info {
                mr,
                addr: address,
                length: len,
                mw_access_flags: ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0,
            },
        };
        // SAFETY: a bind of a window of this protection domain over the
        // arena's registration (`inside` above); no scatter entries. The
        // offer naming the key is posted after it on the same send queue,
        // so the peer cannot READ before the bind took effect.
        unsafe { p.pair.post_send(&mut wr) }.map_err(|e| VerbsError::Broken(e.0))?;
        window.key = key;
        window.state = WindowState::Lent;
        Ok(key)
    }

    fn take_back(&mut self, peer: PeerId, key: u32) {
        let Some(p) = self.peers.get_mut(peer.0 as usize) else { return };
        let Some(index) = p.windows.0.iter().position(|w| w.state == WindowState::Lent && w.key == key) else {
            return;
        };
        let window = &mut p.windows.0[index];
        // Never lent again unless its invalidation completes; a broken
        // queue pair's windows are dead with it (nothing reaches them).
        window.state = WindowState::Invalidating;
        if p.broken.is_some() {
            return;
        }
        let mut wr = window_request(index, ffi::ibv_wr_opcode::IBV_WR_LOCAL_INV);
        wr.__bindgen_anon_1.invalidate_rkey = key;
        // SAFETY: an invalidation of a key this end's window holds; no
        // scatter entries.
        if let Err(e) = unsafe { p.pair.post_send(&mut wr) } {
            // The peer cannot be trusted with a key that could not be
            // taken back: its queue pair goes.
            p.pair.break_off();
            p.broken.get_or_insert(format!("taking a key back: {}", e.0));
        }
    }

    unsafe fn read(
        &mut self,
        peer: PeerId,
        wr_id: u64,
        (remote, rkey): (u64, u32),
        len: u32,
        into: *mut u8,
    ) -> Result<(), VerbsError> {
        if wr_id >= WINDOW_WR_BASE {
            return Err(VerbsError::Broken("a READ tag in the window and message work-request range".into()));
        }
        let lkey = self.local.lkey();
        let p = self.usable(peer)?;
        if p.reads >= READS {
            return Err(VerbsError::Full);
        }
        // SAFETY: `into` is registered under `lkey` and left alone until
        // the READ completes (the caller's contract).
        unsafe { p.pair.post_read(wr_id, (remote, rkey), into, (len, lkey)) }.map_err(|e| VerbsError::Broken(e.0))?;
        p.reads += 1;
        Ok(())
    }

    fn exports(&self, peer: PeerId, address: u64, len: u64) -> bool {
        self.peers.get(peer.0 as usize).is_some_and(|p| p.broken.is_none()) && inside(self.arena, address, len)
    }

    fn imports(&self, peer: PeerId, address: u64, len: u64) -> bool {
        self.peers
            .get(peer.0 as usize)
            .and_then(|p| p.remote)
            .is_some_and(|r| inside((r.region_base, r.region_len), address, len))
    }

    fn registered(&self, into: *const u8, len: u64) -> bool {
        inside(self.arena, into as u64, len)
    }

    fn poll(&mut self, out: &mut Vec<VerbsEvent>) {
        let mut wc = [ffi::ibv_wc::default(); 32];
        for (index, p) in self.peers.iter_mut().enumerate() {
            let peer = PeerId(u32::try_from(index).unwrap_or(u32::MAX));
            for c in p.pair.poll_raw(&mut wc) {
                let wr_id = c.wr_id();
                let failed =
                    c.error().map(|(status, vendor)| format!("work request failed: status {status}, vendor {vendor}"));
                if wr_id < WINDOW_WR_BASE {
                    p.reads = p.reads.saturating_sub(1);
                    out.push(VerbsEvent::ReadDone { wr_id, result: failed.clone().map_or(Ok(()), Err) });
                } else if wr_id < MESSAGE_WR_BASE {
                    // A bind (even) or an invalidation (odd): a window is
                    // free again once its key is dead; a failed one breaks
                    // the queue pair below.
                    let i = wr_id - WINDOW_WR_BASE;
                    let window = usize::try_from(i / 2).ok().and_then(|w| p.windows.0.get_mut(w));
                    if let Some(window) = window
                        && i % 2 == 1
                        && failed.is_none()
                    {
                        window.state = WindowState::Free;
                    }
                } else if wr_id - MESSAGE_WR_BASE >= u64::from(RECEIVES) {
                    p.sends = p.sends.saturating_sub(1);
                } else if failed.is_none() {
                    let i = usize::try_from(wr_id - MESSAGE_WR_BASE).unwrap_or(0);
                    let at = i * MESSAGE_BYTES;
                    let mut message = [0u8; MESSAGE_BYTES];
                    if c.len() == MESSAGE_BYTES {
                        message.copy_from_slice(&p.buffers[at..at + MESSAGE_BYTES]);
                    }
                    // A short message decodes as bad: the transport shuts the peer.
                    out.push(VerbsEvent::Received { peer, message });
                    let into = p.buffers[at..].as_mut_ptr();
                    // SAFETY: the buffer's receive completed and its
                    // bytes were copied out.
                    if let Err(e) = unsafe { p.pair.post_recv(wr_id, into, MESSAGE_LEN, p.messages.lkey()) } {
                        p.broken.get_or_insert(e.0);
                    }
                }
                if let Some(why) = failed {
                    p.broken.get_or_insert(why);
                }
            }
            if let Some(why) = &p.broken
                && !p.reported
            {
                p.reported = true;
                out.push(VerbsEvent::Broken { peer, why: why.clone() });
            }
        }
    }

    fn shut(&mut self, peer: PeerId, why: &str) {
        let Some(p) = self.peers.get_mut(peer.0 as usize) else { return };
        // In the error state, the windows bound through it serve no READ:
        // every key lent to it is dead.
        p.pair.break_off();
        p.broken.get_or_insert_with(|| format!("shut: {why}"));
        p.reported = true;
    }
}
