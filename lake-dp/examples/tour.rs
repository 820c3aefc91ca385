//! A tour of Lake's foundation, end to end on this machine: name a prompt's
//! blocks in a tenant's namespace, lay out one block of a Qwen3-8B-shaped KV
//! cache, store it in the v1 stored-object format in a file, read it back
//! and verify every segment, corrupt one byte and watch the CRC catch it,
//! frame a "block committed" message on the wire, and hold the block in an
//! L1 shared-memory arena that an agent pins without a round trip.
//!
//! Run: `cargo run --release -p lake-dp --example tour`.

use std::io::{Read, Seek, SeekFrom, Write};

use lake_dp::arena::{Arena, ArenaConfig};
use lake_dp::model::layout::LayoutParams;
use lake_dp::region::SlotClass;
use lake_dp::stored::{ObjectMeta, decode_object, encode_object, object_bytes};
use lake_dp::wire::message::BlockRecord;
use lake_dp::wire::{FrameMeta, Limits, Message, WIRE_VERSION_MAX, decode_frame, encode_frame};
use lake_dp::{
    BlockKey, Dtype, Durability, ExtraKeys, KeyChain, KeyScheme, KvPlanes, Layout, ModelIdentity, Namespace, NodeId,
    ObjectKind, RegionId, Replica, Shard, TenantKey, Tier,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 1. A namespace: tenant secret, model identity, extra keys.
    let model = ModelIdentity {
        weights_revision: "Qwen/Qwen3-8B@main",
        tokenizer: "qwen3-tokenizer",
        kv_dtype: "bfloat16",
        kv_scales: &[],
    };
    let namespace = Namespace::new(
        &TenantKey([7; 32]),
        KeyScheme::TokenIdsV1,
        16,
        model.fingerprint(),
        ExtraKeys::default().digest(),
    )?;
    println!("namespace {:016x} (block_tokens {})", namespace.id().0, namespace.block_tokens());

    // 2. Keys for a 100-token prompt: six full blocks, four tokens left over.
    let prompt: Vec<u32> = (0..100).map(|i| (i * 7919) % 151_936).collect();
    let mut chain = KeyChain::new(&namespace);
    let mut keys = [BlockKey::NONE; 8];
    let full = chain.extend_tokens(&prompt, &mut keys)?;
    for (i, key) in keys[..full].iter().enumerate() {
        println!("  block {i}: {key}");
    }
    println!("  ({} tokens wait for the next block)", prompt.len() - full * 16);

    // 3. One block's layout: 36 layers, K and V, 8 KV heads of 128, bf16.
    let layout = Layout::new(LayoutParams {
        layers: 36,
        planes: KvPlanes::KeyValue,
        kv_heads: 8,
        shard: Shard::Heads { start: 0, end: 8 },
        head_dim: 128,
        dtype: Dtype::Bf16,
        block_tokens: 16,
        layers_per_segment: 1,
    })?;
    println!(
        "layout {:016x}: {} bytes per block, {} segments of {} bytes",
        layout.fingerprint(),
        layout.block_bytes(),
        layout.segment_count(),
        layout.segment_bytes()
    );

    // 4. Store block 1 in the v1 format, in a real file.
    let payload: Vec<u8> = (0..layout.block_bytes()).map(|i| u8::try_from(i % 251).unwrap_or(0)).collect();
    let meta = ObjectMeta {
        kind: ObjectKind::KvBlock,
        key: keys[1],
        parent_key: keys[0],
        block_index: 1,
        namespace: namespace.id(),
        layout_fingerprint: layout.fingerprint(),
        region: RegionId(0),
        region_epoch: 1,
        slot: 0,
        generation: 1,
        committed_unix_ns: u64::try_from(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_nanos(),
        )?,
        payload_len: layout.block_bytes(),
        segment_bytes: layout.segment_bytes(),
    };
    let mut object = vec![0u8; usize::try_from(object_bytes(meta.payload_len))?];
    encode_object(&meta, &payload, &mut object)?;
    let path = std::env::temp_dir().join(format!("lake-tour-{}.slot", std::process::id()));
    std::fs::File::create(&path)?.write_all(&object)?;
    let mut read_back = Vec::new();
    std::fs::File::open(&path)?.read_to_end(&mut read_back)?;
    let (header, data) = decode_object(&read_back)?;
    assert_eq!(header.meta(), &meta);
    assert_eq!(data, &payload[..]);
    println!(
        "stored {} bytes at {}; read back, {} segment CRCs verified",
        read_back.len(),
        path.display(),
        header.crcs().len()
    );

    // 5. Flip one payload byte on disk: the segment CRC names the damage.
    let mut file = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
    file.seek(SeekFrom::Start(4096 + 20 * layout.segment_bytes() + 5))?;
    file.write_all(&[0xff])?;
    let mut damaged = Vec::new();
    file.seek(SeekFrom::Start(0))?;
    file.read_to_end(&mut damaged)?;
    match decode_object(&damaged) {
        Err(e) => println!("after corrupting one byte: refused ({e})"),
        Ok(_) => return Err("a corrupted object was accepted".into()),
    }
    std::fs::remove_file(&path)?;

    // 6. Announce the block on the wire.
    let replica =
        Replica { tier: Tier::L2Nvme, node: NodeId(1), region: RegionId(0), region_epoch: 1, slot: 0, generation: 1 };
    let record = BlockRecord {
        replica: replica.to_wire(),
        key: meta.key,
        parent_key: meta.parent_key,
        namespace: meta.namespace.0,
        layout_fingerprint: meta.layout_fingerprint,
        payload_len: meta.payload_len,
        block_index: meta.block_index,
        kind: ObjectKind::KvBlock as u16,
        durability: Durability::Acked as u8,
        flags: 0,
    };
    let mut buf = [0u8; 256];
    let frame_meta = FrameMeta { version: WIRE_VERSION_MAX, flags: 0, request_id: 1, leader_term: 1 };
    let len = encode_frame(frame_meta, &Message::BlockCommitted(record), &mut buf)?;
    let frame = decode_frame(&buf[..len], &Limits::default())?;
    println!("wire: {:?} frame of {len} bytes for replica {replica}", frame.message.kind());

    // 7. The L1 arena: lake-dp creates it in /dev/shm with a size class for
    //    this layout; an agent (here a second mapping in this process) pins
    //    the block by writing its own pin entry, no RPC; eviction waits for
    //    the pin.
    let arena_path = format!("/dev/shm/lake-tour-{}", std::process::id());
    let classes = [SlotClass::for_payload(meta.payload_len, 64)];
    let (arena, mut table) = Arena::create(&ArenaConfig { lock: false, ..ArenaConfig::shm(&arena_path, &classes) })?;
    let grant = table.allocate(0).ok_or("no free L1 slot")?;
    let region = arena.region()?;
    // SAFETY: the slot table just granted this slot; no agent knows it yet.
    let slot = unsafe { region.slot_mut(grant.slot) }.ok_or("slot out of range")?;
    slot[..object.len()].copy_from_slice(&object);
    let agent = Arena::attach(std::path::Path::new(&arena_path))?;
    let mut pins = agent.claim_agent()?;
    let pin = pins.pin(grant.slot, grant.generation)?;
    let (pinned_header, _) = decode_object(pins.bytes(&pin))?;
    table.retire(grant.slot)?;
    let while_pinned = table.reclaim();
    pins.unpin(pin);
    let after = table.reclaim();
    println!(
        "L1 arena {} ({} bytes, {} slots of {} bytes): agent {} pinned slot {} generation {} (key {}); \
         eviction waited ({} pinned), then freed {}",
        arena_path,
        arena.header().total_bytes,
        arena.header().slots,
        grant.slot_bytes,
        pins.agent(),
        grant.slot,
        grant.generation,
        pinned_header.meta().key,
        while_pinned.pinned,
        after.freed
    );
    Ok(())
}
