//! Copy lanes through the C ABI against a real pool: a batch split by
//! blocks and a single block split by segments load bit-exact, and a
//! payload byte flipped in the L1 arena behind the pool's back is caught
//! by whichever thread checks that segment: `LakeBadCrc`, and the blocks
//! after it `LakePrefixBroken` (the engine recomputes them; segments other
//! threads copied meanwhile are overwritten by that recompute). A save
//! of several turns, split across the lanes, lands every byte under CRCs
//! that check when it is loaded back.

#![allow(clippy::cast_possible_truncation)] // small test numbers

mod common;

use common::{ok, statuses};

use std::ffi::CString;
use std::time::{Duration, Instant};

use lake::pool::{
    LakeAttachOptions, LakeBlockKey, LakeLocation, LakeNamespace, LakeNamespaceOptions, LakePool, lake_attach,
    lake_detach, lake_keychain_extend, lake_keychain_free, lake_keychain_new, lake_lookup, lake_namespace_free,
    lake_namespace_new, lake_register_host_memory, lake_submit_load, lake_submit_save,
};
use lake::status::LakeStatus;
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::BlockKey;
use lake_dp::stored::decode_header;

const BLOCK: usize = 512 * 1024;
const SEGMENT: usize = BLOCK / 8;
const BLOCKS: usize = 12;

#[test]
fn lanes_split_loads_by_blocks_and_by_segments_and_catch_a_flipped_byte() {
    loads_bit_exact_and_catch_a_flipped_byte(3);
}

#[test]
fn the_agent_thread_alone_loads_bit_exact_and_catches_a_flipped_byte() {
    loads_bit_exact_and_catch_a_flipped_byte(0);
}

fn loads_bit_exact_and_catch_a_flipped_byte(copy_threads: u32) {
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: BLOCK as u64,
        l1_slots: 32,
        l2_slots_per_file: 32,
        remote_agents: 8,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-lanes-{copy_threads}-{}", std::process::id())))
    })
    .unwrap();

    let options = LakeNamespaceOptions {
        struct_size: size_of::<LakeNamespaceOptions>(),
        tenant_key: [5; 32],
        block_tokens: 16,
        model_fingerprint: [6; 32],
        extra_keys_digest: [0; 32],
        key_scheme: 1,
    };
    let mut namespace: *mut LakeNamespace = core::ptr::null_mut();
    // SAFETY: valid options and out-pointer.
    ok(unsafe { lake_namespace_new(&raw const options, &raw mut namespace) }, "namespace");
    let tokens: Vec<u32> = (0..(BLOCKS * 16) as u32).map(|i| i * 7 + 3).collect();
    let mut keys = vec![LakeBlockKey::default(); BLOCKS];
    let mut chain = core::ptr::null_mut();
    let mut written = 0;
    // SAFETY: a valid namespace and out-pointer.
    ok(unsafe { lake_keychain_new(namespace, &raw mut chain) }, "chain");
    // SAFETY: a valid chain, arrays of their lengths.
    let extended = unsafe {
        lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), BLOCKS, &raw mut written)
    };
    ok(extended, "keys");
    // SAFETY: from lake_keychain_new, freed once.
    unsafe { lake_keychain_free(chain) };
    assert_eq!(written, BLOCKS);

    let dp = CString::new(pool.dp_socket.display().to_string()).unwrap();
    let mirror = CString::new(pool.mirror.display().to_string()).unwrap();
    let cp = CString::new(pool.cp_socket.display().to_string()).unwrap();
    let attach = LakeAttachOptions {
        struct_size: size_of::<LakeAttachOptions>(),
        dp_socket: dp.as_ptr(),
        mirror_path: mirror.as_ptr(),
        cp_socket: cp.as_ptr(),
        name: c"lanes".as_ptr(),
        namespace,
        layout_fingerprint: 7,
        segment_bytes: SEGMENT as u64,
        pin_agent: 0,
        agent_core: 0,
        copy_threads,
        shard_code: 0,
        object_kind: 1,
        block_bytes: 0,
    };
    let mut handle: *mut LakePool = core::ptr::null_mut();
    // SAFETY: valid options; strings live to the end of the test.
    ok(unsafe { lake_attach(&raw const attach, &raw mut handle) }, "attach");

    let mut memory = vec![0u8; 2 * BLOCKS * BLOCK];
    for (i, byte) in memory[..BLOCKS * BLOCK].iter_mut().enumerate() {
        *byte = (i.wrapping_mul(2_654_435_761) >> 13) as u8;
    }
    let mut memory_id = 0;
    let saved: Vec<u32> = (0..BLOCKS as u32).collect();
    let targets: Vec<u32> = (BLOCKS as u32..2 * BLOCKS as u32).collect();
    let mut request = 0;
    let count = (2 * BLOCKS) as u32;
    // SAFETY: the memory lives until detach.
    let registered =
        unsafe { lake_register_host_memory(handle, memory.as_mut_ptr(), BLOCK, count, &raw mut memory_id) };
    ok(registered, "register");
    let (k, s) = (keys.as_ptr(), saved.as_ptr());
    // SAFETY: arrays of BLOCKS entries.
    let submitted =
        unsafe { lake_submit_save(handle, memory_id, core::ptr::null(), k, s, BLOCKS, 2, &raw mut request) };
    ok(submitted, "save");
    assert!(statuses(handle, request, BLOCKS).iter().all(|&s| s == LakeStatus::LakeOk));
    let mut table = vec![LakeLocation::default(); BLOCKS];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut hits = 0;
        // SAFETY: arrays of their lengths.
        ok(unsafe { lake_lookup(handle, keys.as_ptr(), BLOCKS, table.as_mut_ptr(), BLOCKS, &raw mut hits) }, "lookup");
        if hits == BLOCKS {
            break;
        }
        assert!(Instant::now() < deadline, "published {hits}");
        std::thread::sleep(Duration::from_millis(2));
    }
    let load = |from: usize, count: usize, into: &[u32]| {
        let mut request = 0;
        // SAFETY: arrays of at least `count` entries; memory registered.
        let status = unsafe {
            lake_submit_load(
                handle,
                memory_id,
                keys[from..].as_ptr(),
                table[from..].as_ptr(),
                into.as_ptr(),
                count,
                0,
                &raw mut request,
            )
        };
        ok(status, "load");
        statuses(handle, request, count)
    };

    // Split by blocks: twelve blocks over three lanes and the agent (or
    // the agent alone).
    assert!(load(0, BLOCKS, &targets).iter().all(|&s| s == LakeStatus::LakeOk));
    assert_eq!(memory[..BLOCKS * BLOCK], memory[BLOCKS * BLOCK..], "split by blocks");
    // Split by segments: one block, eight segments over four threads (or
    // one).
    memory[BLOCKS * BLOCK..].fill(0);
    assert_eq!(load(5, 1, &targets[5..]), [LakeStatus::LakeOk]);
    assert_eq!(memory[5 * BLOCK..6 * BLOCK], memory[(BLOCKS + 5) * BLOCK..(BLOCKS + 6) * BLOCK], "by segments");

    // Flip one payload byte of block 5's slot, deep in its seventh segment
    // (a lane's share, where there are lanes), straight in the arena file.
    let arena = std::fs::OpenOptions::new().read(true).write(true).open(&pool.arena).unwrap();
    // SAFETY: a shared mapping of the live arena; this test writes one
    // byte of one committed slot, which is what it means to test.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&arena) }.unwrap();
    let key = BlockKey(keys[5].bytes);
    let slot = (0..map.len() / 4096)
        .map(|page| page * 4096)
        .find(|&at| decode_header(&map[at..]).is_ok_and(|h| h.meta().key == key))
        .expect("block 5's slot");
    map[slot + 4096 + 6 * SEGMENT + 100] ^= 0x40;
    memory[BLOCKS * BLOCK..].fill(0);
    assert_eq!(load(5, 1, &targets[5..]), [LakeStatus::LakeBadCrc], "one block, split by segments");
    let statuses = load(0, BLOCKS, &targets);
    assert!(statuses[..5].iter().all(|&s| s == LakeStatus::LakeOk), "{statuses:?}");
    assert_eq!(statuses[5], LakeStatus::LakeBadCrc, "{statuses:?}");
    assert!(statuses[6..].iter().all(|&s| s == LakeStatus::LakePrefixBroken), "{statuses:?}");
    map[slot + 4096 + 6 * SEGMENT + 100] ^= 0x40;
    drop(map);

    // SAFETY: attached above, detached once.
    unsafe { lake_detach(handle) };
    // SAFETY: from lake_namespace_new, freed once, no pool uses it now.
    unsafe { lake_namespace_free(namespace) };
    drop(pool.stop());
}

#[test]
fn a_save_of_several_turns_split_across_lanes_loads_back_bit_exact() {
    const SMALL: usize = 64 * 1024;
    // More than two turns of reserved slots, not a whole number of them.
    const MANY: usize = 150;
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: SMALL as u64,
        l1_slots: 2 * MANY as u32,
        l2_slots_per_file: 32,
        remote_agents: 8,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-lanes-save-{}", std::process::id())))
    })
    .unwrap();
    let namespace = common::pools::namespace(9);
    let keys = common::pools::keys(namespace, MANY, |i| i * 5 + 1);
    let (dp, mirror, cp) = (
        CString::new(pool.dp_socket.display().to_string()).unwrap(),
        CString::new(pool.mirror.display().to_string()).unwrap(),
        CString::new(pool.cp_socket.display().to_string()).unwrap(),
    );
    let attach = LakeAttachOptions {
        struct_size: size_of::<LakeAttachOptions>(),
        dp_socket: dp.as_ptr(),
        mirror_path: mirror.as_ptr(),
        cp_socket: cp.as_ptr(),
        name: c"lane-saves".as_ptr(),
        namespace,
        layout_fingerprint: 7,
        segment_bytes: SMALL as u64 / 4,
        pin_agent: 0,
        agent_core: 0,
        copy_threads: 3,
        shard_code: 0,
        object_kind: 1,
        block_bytes: 0,
    };
    let mut handle: *mut LakePool = core::ptr::null_mut();
    // SAFETY: valid options; strings live to the end of the test.
    ok(unsafe { lake_attach(&raw const attach, &raw mut handle) }, "attach");

    let mut memory = vec![0u8; 2 * MANY * SMALL];
    for (i, byte) in memory[..MANY * SMALL].iter_mut().enumerate() {
        *byte = (i.wrapping_mul(2_246_822_519) >> 11) as u8;
    }
    let (mut memory_id, mut request) = (0, 0);
    // SAFETY: the memory lives until detach.
    let registered =
        unsafe { lake_register_host_memory(handle, memory.as_mut_ptr(), SMALL, (2 * MANY) as u32, &raw mut memory_id) };
    ok(registered, "register");
    let saved: Vec<u32> = (0..MANY as u32).collect();
    // SAFETY: arrays of MANY entries.
    let submitted = unsafe {
        lake_submit_save(handle, memory_id, core::ptr::null(), keys.as_ptr(), saved.as_ptr(), MANY, 2, &raw mut request)
    };
    ok(submitted, "save");
    let saves = statuses(handle, request, MANY);
    assert!(saves.iter().all(|&s| s == LakeStatus::LakeOk), "{saves:?}");
    let table = common::pools::lookup(handle, &keys);

    let targets: Vec<u32> = (MANY as u32..2 * MANY as u32).collect();
    // SAFETY: arrays of MANY entries; memory registered.
    let submitted = unsafe {
        lake_submit_load(handle, memory_id, keys.as_ptr(), table.as_ptr(), targets.as_ptr(), MANY, 0, &raw mut request)
    };
    ok(submitted, "load");
    // Each segment loaded is checked against the CRC its header holds, so
    // a save that stored wrong CRCs fails here (or its blocks were evicted
    // by the data plane's check before).
    let loads = statuses(handle, request, MANY);
    assert!(loads.iter().all(|&s| s == LakeStatus::LakeOk), "{loads:?}");
    assert_eq!(memory[..MANY * SMALL], memory[MANY * SMALL..], "loaded back");

    // SAFETY: attached above, detached once.
    unsafe { lake_detach(handle) };
    // SAFETY: from lake_namespace_new, freed once, no pool uses it now.
    unsafe { lake_namespace_free(namespace) };
    drop(pool.stop());
}
