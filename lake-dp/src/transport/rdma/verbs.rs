//! The verbs: a device and its protection domain, memory registrations,
//! an RC queue pair with its completion queue, one-sided READs, and the
//! poll of the completion queue. Built with the `rdma` feature; runs where
//! a device exists.

use std::collections::HashMap;

use ibverbs_sys as ffi;

use super::{Endpoint, RdmaError};
use crate::constants::STORED_HEADER_BYTES;
use crate::tag::Tag;
use crate::transport::frame::{AckStatus, BlockAddr};
use crate::transport::{Completion, Landing, TransferError};

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
        // SAFETY: an allocated protection domain and a valid range
        // (contract).
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, base.cast(), len, access.0.cast_signed()) };
        if mr.is_null() {
            return Err(os_error("registering memory"));
        }
        Ok(Region { mr })
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
        let entries = i32::try_from(depth).map_err(|_| RdmaError("queue depth".into()))?;
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
                max_recv_wr: 1,
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
        let mut sge = ffi::ibv_sge { addr: into as u64, length: len, lkey };
        let mut wr = ffi::ibv_send_wr {
            wr_id: tag.raw(),
            next: core::ptr::null_mut(),
            sg_list: &raw mut sge,
            num_sge: 1,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: remote_address, rkey };
        let mut bad = core::ptr::null_mut();
        // SAFETY: a live queue pair.
        let context = unsafe { (*self.qp).context };
        // SAFETY: its live context's operations table.
        let post = unsafe { (*context).ops.post_send }.ok_or(RdmaError("no post_send".into()))?;
        // SAFETY: a live queue pair, a valid work request (its scatter
        // entry lives until the call returns: the driver copies it).
        let rc = unsafe { post(self.qp, &raw mut wr, &raw mut bad) };
        if rc != 0 {
            return Err(RdmaError(format!("posting a READ: error {rc}")));
        }
        self.posted += 1;
        Ok(())
    }

    /// Completions since the last poll: each READ's tag and whether it
    /// succeeded. Never blocks.
    pub fn poll(&mut self, out: &mut Vec<(Tag, Result<(), RdmaError>)>) -> usize {
        let mut wc = [ffi::ibv_wc::default(); 32];
        // SAFETY: a live completion queue.
        let context = unsafe { (*self.cq).context };
        // SAFETY: its live context's operations table.
        let Some(poll) = (unsafe { (*context).ops.poll_cq }) else { return 0 };
        // SAFETY: a live completion queue and room for 32 completions.
        let n = unsafe { poll(self.cq, 32, wc.as_mut_ptr()) };
        let n = usize::try_from(n).unwrap_or(0);
        for c in &wc[..n] {
            self.posted = self.posted.saturating_sub(1);
            let result = match c.error() {
                None => Ok(()),
                Some((status, vendor)) => Err(RdmaError(format!("READ failed: status {status}, vendor {vendor}"))),
            };
            out.push((Tag::from_raw(c.wr_id()), result));
        }
        n
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
                            AckStatus::Busy => Err(TransferError::Busy),
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
