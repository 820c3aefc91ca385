//! What the transport tests share: a receiving node whose slots are plain
//! memory (reserved targets, checked landings, what it published) and the
//! stored objects senders send.

use std::collections::HashMap;

use lake_dp::model::replica::ObjectKind;
use lake_dp::stored::{ObjectMeta, encode_object, object_bytes};
use lake_dp::transport::frame::{AckStatus, BlockAddr};
use lake_dp::transport::{Landing, check_and_adopt};
use lake_dp::{BlockKey, NamespaceId, RegionId};

/// Bytes of a test node's slot.
pub const SLOT_BYTES: usize = 4 << 20;
/// The test node's region.
pub const REGION: u16 = 5;
/// Its epoch.
pub const EPOCH: u64 = 42;

/// A node's slots in plain memory, and the targets reserved in it.
#[derive(Debug)]
pub struct Node {
    /// The slots, `SLOT_BYTES` each.
    pub memory: Vec<u8>,
    /// Reserved targets: true while free to fill, false while filling.
    pub reserved: HashMap<BlockAddr, bool>,
    /// Blocks landed, checked and published, with their rewritten headers.
    pub published: Vec<(BlockAddr, ObjectMeta)>,
    /// Blocks given back unfinished.
    pub abandoned: usize,
}

impl Node {
    /// A node of `slots` slots.
    pub fn new(slots: usize) -> Self {
        Self { memory: vec![0; slots * SLOT_BYTES], reserved: HashMap::new(), published: Vec::new(), abandoned: 0 }
    }

    /// Reserves slot `slot` at `generation` for an incoming block.
    pub fn reserve(&mut self, slot: u32, generation: u32) -> BlockAddr {
        let target = BlockAddr { region: REGION, epoch: EPOCH, slot, generation };
        self.reserved.insert(target, true);
        target
    }

    /// A slot's memory.
    pub fn slot(&mut self, slot: u32) -> &mut [u8] {
        let at = slot as usize * SLOT_BYTES;
        &mut self.memory[at..at + SLOT_BYTES]
    }

    /// The stored object published in `target`'s slot, `len` bytes.
    pub fn landed_bytes(&self, target: &BlockAddr, len: usize) -> &[u8] {
        &self.memory[target.slot as usize * SLOT_BYTES..][..len]
    }
}

impl Landing for Node {
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus> {
        if self.reserved.get(target) != Some(&true) || len > SLOT_BYTES as u64 {
            return Err(AckStatus::Refused);
        }
        // Filling now: a second block for it is refused.
        self.reserved.insert(*target, false);
        Ok(self.slot(target.slot).as_mut_ptr())
    }

    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        self.reserved.remove(target);
        match check_and_adopt(self.slot(target.slot), len, target) {
            Ok(meta) => {
                self.published.push((*target, meta));
                AckStatus::Landed
            }
            Err(status) => status,
        }
    }

    fn abandoned(&mut self, target: &BlockAddr) {
        self.reserved.remove(target);
        self.abandoned += 1;
    }

    fn reserve(&mut self, region: u16, epoch: u64, len: u64, _namespace: Option<u64>) -> Result<BlockAddr, AckStatus> {
        if region != REGION || epoch != EPOCH || len > SLOT_BYTES as u64 {
            return Err(AckStatus::Refused);
        }
        let slots = u32::try_from(self.memory.len() / SLOT_BYTES).unwrap_or(0);
        let taken = |slot: u32| {
            self.reserved.keys().any(|t| t.slot == slot) || self.published.iter().any(|(t, _)| t.slot == slot)
        };
        let slot = (0..slots).find(|&slot| !taken(slot)).ok_or(AckStatus::Busy)?;
        Ok(Node::reserve(self, slot, 1))
    }
}

/// A stored object for `key` with `payload_len` bytes, as a sender's slot
/// `slot` holds it.
pub fn object(key: u32, payload_len: usize, slot: u32) -> Vec<u8> {
    let mut bytes = [0u8; 16];
    bytes[..4].copy_from_slice(&key.to_le_bytes());
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: BlockKey(bytes),
        parent_key: BlockKey::NONE,
        block_index: 0,
        namespace: NamespaceId(3),
        layout_fingerprint: 7,
        region: RegionId(1),
        region_epoch: 9,
        slot,
        generation: 1,
        committed_unix_ns: 1,
        payload_len: payload_len as u64,
        segment_bytes: 64 * 1024,
    };
    let payload: Vec<u8> = (0..payload_len)
        .map(|i| {
            (i.to_le_bytes()[0] ^ key.wrapping_mul(2_654_435_761).to_le_bytes()[0])
                .wrapping_add((i >> 8).to_le_bytes()[0])
        })
        .collect();
    let mut out = vec![0u8; usize::try_from(object_bytes(payload_len as u64)).unwrap_or(0)];
    match encode_object(&meta, &payload, &mut out) {
        Ok(len) => out.truncate(len),
        Err(e) => panic!("a test object does not encode: {e}"),
    }
    out
}

/// A block to send: the stored object in `bytes` (kept alive and unchanged
/// by the caller until its completion) for `target` at `peer`.
pub fn outgoing(
    transfer: u64,
    peer: lake_dp::transport::tcp::PeerId,
    bytes: &[u8],
    target: BlockAddr,
    priority: lake_dp::Priority,
) -> lake_dp::transport::tcp::Outgoing {
    lake_dp::transport::tcp::Outgoing {
        transfer,
        peer,
        source: bytes.as_ptr(),
        len: bytes.len() as u64,
        target,
        priority,
        trace: 0,
        namespace: 0,
    }
}

/// Nanoseconds since `start`, the clock the transports are given.
pub fn now_ns(start: std::time::Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Polls `sender` and `receiver` (landing into `node`) until `want` of the
/// sender's completions came back; fails after 10 s.
pub fn drive<S: lake_dp::transport::Transport, R: lake_dp::transport::Transport>(
    sender: &mut S,
    receiver: &mut R,
    node: &mut Node,
    start: std::time::Instant,
    want: usize,
) -> Vec<lake_dp::transport::Completion> {
    let mut done = Vec::new();
    let mut none = Node::new(0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while done.len() < want {
        assert!(std::time::Instant::now() < deadline, "{} of {want} completions in 10 s", done.len());
        sender.poll(&mut none, now_ns(start), &mut done);
        receiver.poll(node, now_ns(start), &mut Vec::new());
    }
    done
}

/// A receiving node that holds tenants to their caps on what it receives
/// (`RatePath::NetReceive`), as a pool does.
#[derive(Debug)]
pub struct Capped {
    /// The node the blocks land in.
    pub node: Node,
    /// The caps.
    pub rates: lake_dp::rates::TenantRates,
}

impl Capped {
    /// `node`, holding the blocks of `namespace` to `bytes_per_s` of what
    /// it receives (a tenant named "batch").
    pub fn new(node: Node, namespace: u64, bytes_per_s: u64) -> Self {
        use lake_dp::rates::{RATE_PATHS, RatePath, TenantRate, TenantRates};
        let mut caps = [None; RATE_PATHS];
        caps[RatePath::NetReceive as usize] = Some(bytes_per_s);
        let tenant = TenantRate { name: "batch".into(), namespaces: vec![namespace], bytes_per_s: caps };
        Self { node, rates: TenantRates::new(&[tenant]) }
    }
}

impl Landing for Capped {
    fn place(&mut self, target: &BlockAddr, len: u64) -> Result<*mut u8, AckStatus> {
        self.node.place(target, len)
    }

    fn landed(&mut self, target: &BlockAddr, len: u64) -> AckStatus {
        self.node.landed(target, len)
    }

    fn abandoned(&mut self, target: &BlockAddr) {
        self.node.abandoned(target);
    }

    fn reserve(&mut self, region: u16, epoch: u64, len: u64, namespace: Option<u64>) -> Result<BlockAddr, AckStatus> {
        lake_dp::transport::Landing::reserve(&mut self.node, region, epoch, len, namespace)
    }

    fn admit(&mut self, namespace: u64, len: u64, now_ns: u64) -> Result<(), u64> {
        self.rates.admit_or_wait(namespace, lake_dp::rates::RatePath::NetReceive, len, now_ns)
    }
}
