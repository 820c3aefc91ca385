//! Encryption at rest: a tenant's blocks on L2 (and what L2 passes to L3)
//! are AES-256-GCM ciphertext under a key only that tenant's namespaces
//! are given, held in memory only.
//!
//! Each stored object gets a key of its own, derived from the tenant's
//! data key and a fresh 16-byte random salt (so no key ever encrypts
//! twice and the GCM nonce can be fixed); the associated data is the
//! block's identity (key, parent, namespace, layout, kind, lengths), so
//! ciphertext moved under another block's header fails its tag. The salt,
//! the tag and the data key's id go in the stored header ([`Seal`]); its
//! segment CRCs are over the ciphertext, so corruption is still found by
//! CRC before any key is used. Forgetting a tenant's key (its namespaces'
//! entries in the [`KeyRing`]) leaves its stored blocks unreadable:
//! crypto-shredding.

use std::collections::HashMap;

use zeroize::Zeroize;

use crate::constants::{SEGMENTS_MAX, STORED_HEADER_BYTES};
use crate::model::namespace::NamespaceId;
use crate::stored::{DecodedHeader, ObjectMeta, Seal, encode_header, segment_crcs};

const CONTEXT_KEY_ID: &str = "lake 2026-12 data key id";
const CONTEXT_BLOCK_KEY: &str = "lake 2026-12 at-rest object key";

/// A tenant's data key. Never printed; wiped when dropped.
#[derive(Clone)]
pub struct DataKey {
    bytes: [u8; 32],
    id: u64,
}

impl core::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "DataKey(id {:016x})", self.id)
    }
}

impl Drop for DataKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

impl DataKey {
    /// A key of these bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self { id: super::key_id(CONTEXT_KEY_ID, &bytes), bytes }
    }

    /// A key read from a file as a link key is ([`super::LinkKey::load`]:
    /// 64 hex digits or 32 bytes, readable by its owner only).
    pub fn load(path: &std::path::Path) -> Result<Self, super::KeyError> {
        let link = super::LinkKey::load(path)?;
        Ok(Self::from_bytes(*link.secret()))
    }

    /// The key's public id (stored in each object it seals).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn object_key(&self, salt: &[u8; 16]) -> ring::aead::LessSafeKey {
        let mut hasher = blake3::Hasher::new_derive_key(CONTEXT_BLOCK_KEY);
        hasher.update(&self.bytes);
        hasher.update(salt);
        let mut derived = *hasher.finalize().as_bytes();
        let key = ring::aead::UnboundKey::new(&ring::aead::AES_256_GCM, &derived);
        derived.zeroize();
        // A 32-byte key is always accepted for AES-256-GCM.
        ring::aead::LessSafeKey::new(key.unwrap_or_else(|_| unreachable!("AES-256-GCM takes a 32-byte key")))
    }
}

/// Why a sealed payload could not be opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenError {
    /// No key for the object's namespace (never given, or forgotten).
    NoKey,
    /// The namespace's key is not the one that sealed it (rotated).
    OtherKey {
        /// The id the object names.
        sealed_with: u64,
        /// The id held now.
        held: u64,
    },
    /// The tag does not check: tampered, or moved under another header.
    Tag,
    /// Not a sealed object, or shorter than its header says.
    Malformed,
}

impl core::fmt::Display for OpenError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NoKey => f.write_str("no data key for its namespace (forgotten: the block is shredded)"),
            Self::OtherKey { sealed_with, held } => {
                write!(f, "sealed with data key {sealed_with:016x}, the namespace now has {held:016x}")
            }
            Self::Tag => f.write_str("its AEAD tag does not check"),
            Self::Malformed => f.write_str("not a whole sealed object"),
        }
    }
}

impl std::error::Error for OpenError {}

/// The associated data binding a sealed payload to its block.
fn identity(meta: &ObjectMeta) -> [u8; 66] {
    let mut out = [0u8; 66];
    out[..16].copy_from_slice(&meta.key.0);
    out[16..32].copy_from_slice(&meta.parent_key.0);
    out[32..40].copy_from_slice(&meta.namespace.0.to_le_bytes());
    out[40..48].copy_from_slice(&meta.layout_fingerprint.to_le_bytes());
    out[48..50].copy_from_slice(&(meta.kind as u16).to_le_bytes());
    out[50..58].copy_from_slice(&meta.payload_len.to_le_bytes());
    out[58..66].copy_from_slice(&meta.segment_bytes.to_le_bytes());
    out
}

/// Encrypts `payload` (the object's `meta.payload_len` bytes) in place
/// under `key`; returns the seal its header must carry.
pub fn seal(key: &DataKey, meta: &ObjectMeta, payload: &mut [u8]) -> std::io::Result<Seal> {
    let mut salt = [0u8; 16];
    super::random_bytes(&mut salt)?;
    let aad = identity(meta);
    let tag = key
        .object_key(&salt)
        .seal_in_place_separate_tag(
            ring::aead::Nonce::assume_unique_for_key([0; 12]),
            ring::aead::Aad::from(&aad),
            payload,
        )
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "payload too long to seal"))?;
    let mut tag_bytes = [0u8; 16];
    tag_bytes.copy_from_slice(tag.as_ref());
    Ok(Seal { key_id: key.id(), salt, tag: tag_bytes })
}

/// Decrypts `payload` in place if `seal` checks under `key`. On an error
/// the payload is left as it was only for [`OpenError::NoKey`] and
/// [`OpenError::OtherKey`]; after [`OpenError::Tag`] it is garbage.
pub fn open(key: &DataKey, meta: &ObjectMeta, seal: &Seal, payload: &mut [u8]) -> Result<(), OpenError> {
    if seal.key_id != key.id() {
        return Err(OpenError::OtherKey { sealed_with: seal.key_id, held: key.id() });
    }
    let aad = identity(meta);
    let tag = ring::aead::Tag::from(seal.tag);
    key.object_key(&seal.salt)
        .open_in_place_separate_tag(
            ring::aead::Nonce::assume_unique_for_key([0; 12]),
            ring::aead::Aad::from(&aad),
            tag,
            payload,
            0..,
        )
        .map(|_| ())
        .map_err(|_| OpenError::Tag)
}

/// Opens the sealed stored object in `bytes` (its header decoded as
/// `decoded`, its CRCs over the ciphertext already checked) where it lies:
/// the payload decrypted, the header rewritten as `meta` in the clear,
/// with the plaintext's CRCs — what L1 readers check.
pub fn open_object(
    key: &DataKey,
    decoded: &DecodedHeader,
    meta: &ObjectMeta,
    bytes: &mut [u8],
) -> Result<(), OpenError> {
    let seal = decoded.seal().ok_or(OpenError::Malformed)?;
    let (header, body) = bytes.split_at_mut_checked(STORED_HEADER_BYTES).ok_or(OpenError::Malformed)?;
    let header: &mut [u8; STORED_HEADER_BYTES] = header.try_into().map_err(|_| OpenError::Malformed)?;
    let payload_len = usize::try_from(meta.payload_len).map_err(|_| OpenError::Malformed)?;
    let payload = body.get_mut(..payload_len).ok_or(OpenError::Malformed)?;
    open(key, decoded.meta(), seal, payload)?;
    let mut crcs = [0u32; SEGMENTS_MAX];
    let count = segment_crcs(payload, meta.segment_bytes, &mut crcs).map_err(|_| OpenError::Malformed)?;
    encode_header(meta, &crcs[..usize::from(count)], header).map_err(|_| OpenError::Malformed)
}

/// The data keys of the namespaces whose blocks are sealed at rest, and
/// whether a namespace without one may be stored in the clear.
#[derive(Clone, Debug, Default)]
pub struct KeyRing {
    keys: HashMap<NamespaceId, DataKey>,
    /// Namespaces without a key are not written below L1 at all.
    pub required: bool,
}

impl KeyRing {
    /// An empty ring (namespaces stored in the clear).
    pub fn new() -> Self {
        Self::default()
    }

    /// Gives `namespace` its tenant's key (a new key replaces the old: new
    /// writes use it, blocks sealed with the old stay unreadable).
    pub fn insert(&mut self, namespace: NamespaceId, key: DataKey) {
        self.keys.insert(namespace, key);
    }

    /// Forgets `namespace`'s key; whether it had one.
    pub fn forget(&mut self, namespace: NamespaceId) -> bool {
        self.keys.remove(&namespace).is_some()
    }

    /// The key of `namespace`, if it has one.
    pub fn get(&self, namespace: NamespaceId) -> Option<&DataKey> {
        self.keys.get(&namespace)
    }

    /// Whether blocks of `namespace` may be written below L1 (sealed, or in
    /// the clear where that is allowed).
    pub fn may_store(&self, namespace: NamespaceId) -> bool {
        !self.required || self.keys.contains_key(&namespace)
    }

    /// Namespaces with a key.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no namespace has a key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// A change to a running data plane's key ring.
#[derive(Debug)]
pub enum KeyChange {
    /// `namespace`'s blocks are sealed with this key from now on.
    Set(NamespaceId, DataKey),
    /// `namespace`'s key is forgotten and its blocks below L1 — and in L1
    /// — are dropped: crypto-shredding, from the headers the node keeps,
    /// no payload read.
    Forget(NamespaceId),
    /// Whether namespaces without a key may be stored below L1.
    Require(bool),
}

/// Key changes handed to a running data plane (it takes them between
/// passes).
#[derive(Debug, Default)]
pub struct TenantKeys {
    changes: std::sync::Mutex<Vec<KeyChange>>,
    pending: std::sync::atomic::AtomicBool,
}

impl TenantKeys {
    /// Queues `change`.
    pub fn change(&self, change: KeyChange) {
        let mut changes = self.changes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        changes.push(change);
        self.pending.store(true, std::sync::atomic::Ordering::Release);
    }

    /// The changes queued since the last call (none allocated when none
    /// are queued).
    pub fn take(&self) -> Vec<KeyChange> {
        if !self.pending.swap(false, std::sync::atomic::Ordering::Acquire) {
            return Vec::new();
        }
        core::mem::take(&mut *self.changes.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::key::BlockKey;
    use crate::model::replica::{ObjectKind, RegionId};

    fn meta(key: u8) -> ObjectMeta {
        ObjectMeta {
            kind: ObjectKind::KvBlock,
            key: BlockKey([key; 16]),
            parent_key: BlockKey::NONE,
            block_index: 0,
            namespace: NamespaceId(7),
            layout_fingerprint: 9,
            region: RegionId(1),
            region_epoch: 1,
            slot: 0,
            generation: 1,
            committed_unix_ns: 0,
            payload_len: 5000,
            segment_bytes: 4096,
        }
    }

    #[test]
    fn a_sealed_payload_opens_only_with_its_key_under_its_own_header() {
        let key = DataKey::from_bytes([3; 32]);
        let plain: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        let mut bytes = plain.clone();
        let sealed = seal(&key, &meta(1), &mut bytes).unwrap();
        assert_ne!(bytes, plain, "sealed bytes are ciphertext");
        assert!(!bytes.windows(64).any(|w| plain.windows(64).next() == Some(w)));
        // Another key, another block's header, a flipped byte: refused.
        let other = DataKey::from_bytes([4; 32]);
        assert!(matches!(open(&other, &meta(1), &sealed, &mut bytes.clone()), Err(OpenError::OtherKey { .. })));
        assert_eq!(open(&key, &meta(2), &sealed, &mut bytes.clone()), Err(OpenError::Tag));
        let mut flipped = bytes.clone();
        flipped[100] ^= 1;
        assert_eq!(open(&key, &meta(1), &sealed, &mut flipped), Err(OpenError::Tag));
        open(&key, &meta(1), &sealed, &mut bytes).unwrap();
        assert_eq!(bytes, plain);
        // Each sealing draws a fresh salt: the same payload twice differs.
        let (mut a, mut b) = (plain.clone(), plain.clone());
        let (sa, sb) = (seal(&key, &meta(1), &mut a).unwrap(), seal(&key, &meta(1), &mut b).unwrap());
        assert_ne!(sa.salt, sb.salt);
        assert_ne!(a, b);
    }

    #[test]
    fn a_ring_forgets_and_may_require_keys() {
        let mut ring = KeyRing::new();
        assert!(ring.may_store(NamespaceId(1)));
        ring.required = true;
        assert!(!ring.may_store(NamespaceId(1)));
        ring.insert(NamespaceId(1), DataKey::from_bytes([1; 32]));
        assert!(ring.may_store(NamespaceId(1)) && ring.get(NamespaceId(1)).is_some());
        assert!(ring.forget(NamespaceId(1)));
        assert!(!ring.forget(NamespaceId(1)));
        assert!(ring.get(NamespaceId(1)).is_none());
    }
}
