//! `lake-tests` holds Lake's multi-process tests (in `tests/tests/`) and the
//! small helper programs they start (in `src/bin/`): processes that talk to
//! each other through the real formats, files and sockets.

#![warn(missing_docs)]

pub mod fault_proxy;
pub mod moto;
pub mod netns;
pub mod tls;
pub mod transport;

use lake_dp::{ExtraKeys, KeyScheme, ModelIdentity, Namespace, TenantKey};

/// The namespace both sides of a cross-process key test build from the same
/// textual description: tenant byte, model revision, LoRA and salt.
pub fn namespace_from(tenant: u8, revision: &str, lora: &str, salt: &str) -> Namespace {
    let model = ModelIdentity { weights_revision: revision, tokenizer: "tok", kv_dtype: "bfloat16", kv_scales: &[] }
        .fingerprint();
    let extra = ExtraKeys { lora, cache_salt: salt, other: &[] }.digest();
    match Namespace::new(&TenantKey([tenant; 32]), KeyScheme::TokenIdsV1, 16, model, extra) {
        Ok(namespace) => namespace,
        // 16 tokens per block is always valid.
        Err(e) => unreachable!("fixed namespace parameters rejected: {e}"),
    }
}

/// The token ids both sides hash: a fixed pseudo-random prompt.
pub fn prompt(tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect()
}

/// Payload bytes of the stamped objects the arena tests move between
/// processes.
pub const STAMPED_PAYLOAD_BYTES: u64 = 60 * 1024;

/// The stored-object header a stamped object carries for `(slot,
/// generation)`.
pub fn stamped_meta(slot: u32, generation: u32) -> lake_dp::stored::ObjectMeta {
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&slot.to_le_bytes());
    key[4..8].copy_from_slice(&generation.to_le_bytes());
    lake_dp::stored::ObjectMeta {
        kind: lake_dp::ObjectKind::KvBlock,
        key: lake_dp::BlockKey(key),
        parent_key: lake_dp::BlockKey::NONE,
        block_index: generation,
        namespace: lake_dp::NamespaceId(7),
        layout_fingerprint: 0x1a7e,
        region: lake_dp::RegionId(0),
        region_epoch: 1,
        slot,
        generation,
        committed_unix_ns: 0,
        payload_len: STAMPED_PAYLOAD_BYTES,
        segment_bytes: 16 * 1024,
    }
}

/// Writes the stamped object for `(slot, generation)` into `out` (a slot).
pub fn write_stamped(slot: u32, generation: u32, out: &mut [u8]) {
    let seed = u64::from(slot) << 32 | u64::from(generation);
    let payload: Vec<u8> = (0..STAMPED_PAYLOAD_BYTES)
        .map(|i| (i.wrapping_mul(0x9e37_79b9).wrapping_add(seed) >> 7).to_le_bytes()[0])
        .collect();
    if let Err(e) = lake_dp::stored::encode_object(&stamped_meta(slot, generation), &payload, out) {
        unreachable!("a fixed object does not encode: {e}");
    }
}

/// Whether `bytes` hold the intact stamped object of `(slot, generation)`:
/// header and payload CRCs good and the header naming that slot and
/// generation.
pub fn check_stamped(bytes: &[u8], slot: u32, generation: u32) -> Result<(), String> {
    let (header, _payload) = lake_dp::stored::decode_object(bytes).map_err(|e| e.to_string())?;
    let meta = header.meta();
    if *meta != stamped_meta(slot, generation) {
        return Err(format!("header names slot {} generation {}", meta.slot, meta.generation));
    }
    Ok(())
}

/// The L2 tier of the crash test: one file of 64 slots of 64 KiB in `dir`.
pub fn crash_l2_config(dir: &std::path::Path) -> lake_dp::l2::L2Config {
    lake_dp::l2::L2Config {
        paths: vec![dir.join("l2-0.lake")],
        slots_per_file: 64,
        slot_bytes: 64 * 1024,
        region_first: 1,
    }
}

/// Payload bytes of a crash-test block.
pub const CRASH_PAYLOAD_BYTES: u64 = CRASH_PAYLOAD_LEN as u64;
const CRASH_PAYLOAD_LEN: usize = 60 * 1024 - 100;

/// The key of the crash-test block written as number `seq` into `slot`.
pub fn crash_key(slot: u32, seq: u64) -> lake_dp::BlockKey {
    let mut key = [0u8; 16];
    key[..4].copy_from_slice(&slot.to_le_bytes());
    key[4..12].copy_from_slice(&seq.to_le_bytes());
    key[12..].copy_from_slice(b"CRSH");
    lake_dp::BlockKey(key)
}

/// Fills an L1 slot with the payload of crash-test block `(slot, seq)` and
/// returns the header the poller should seal for it.
pub fn crash_write(slot: u32, seq: u64, l1_slot: &mut [u8]) -> lake_dp::stored::ObjectMeta {
    let payload = &mut l1_slot[4096..4096 + CRASH_PAYLOAD_LEN];
    for (i, byte) in (0u64..).zip(payload.iter_mut()) {
        *byte = (seq.wrapping_mul(0x9e37_79b9_7f4a_7c15).wrapping_add(i) >> 13).to_le_bytes()[0];
    }
    lake_dp::stored::ObjectMeta {
        kind: lake_dp::ObjectKind::KvBlock,
        key: crash_key(slot, seq),
        parent_key: lake_dp::BlockKey::NONE,
        block_index: slot,
        namespace: lake_dp::NamespaceId(3),
        layout_fingerprint: 0xc4a5,
        region: lake_dp::RegionId(1),
        region_epoch: seq >> 32,
        slot,
        generation: u32::try_from(seq & 0xffff_ffff).unwrap_or(0),
        committed_unix_ns: 0,
        payload_len: CRASH_PAYLOAD_BYTES,
        segment_bytes: 8 * 1024,
    }
}

/// The key of the mirror stress test's entry `i`.
pub fn mirror_key(i: u64) -> lake_dp::BlockKey {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&lake_dp::rng::SimRng::new(i ^ 0x6d69_7272).next_u64().to_le_bytes());
    k[8..].copy_from_slice(&i.to_le_bytes());
    lake_dp::BlockKey(k)
}

/// The entry the mirror stress test's writer publishes for key `i` at its
/// `version`: every field derived from both, so a reader can tell a whole
/// entry from a torn one.
#[allow(clippy::cast_possible_truncation)] // fields cut from one random word
pub fn mirror_entry(i: u64, version: u32) -> lake_dp::mirror::MirrorEntry {
    let mix = lake_dp::rng::SimRng::new(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(version)).next_u64();
    lake_dp::mirror::MirrorEntry {
        kind: lake_dp::ObjectKind::KvBlock,
        tier: lake_dp::Tier::ALL[(version % 4) as usize],
        tiers: (mix & 0xf) as u8,
        region: lake_dp::RegionId(((mix >> 8) % 1024) as u16),
        epoch_tag: (mix >> 24) as u8,
        slot: version,
        generation: (mix >> 32) as u32,
    }
}
