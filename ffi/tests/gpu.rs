//! GPU engine memory through the C ABI against a real pool: an engine's
//! paged KV cache in HBM (one tensor per layer, flash attention NHD) is
//! saved, found in the mirror and loaded into another engine's cache in
//! HND order by the kernels — every element where it belongs, other
//! blocks untouched — and a byte flipped in an L1 slot is caught by the
//! segment CRCs the GPU computes (`LakeBadCrc`, the rest
//! `LakePrefixBroken`). A direct load goes layer by layer: an engine
//! stream made to wait for each layer (`lake_wait_layer`) reads the loaded
//! bytes with no host wait for the load. Skips, saying why, without CUDA
//! (CI).

#![allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap, clippy::cast_sign_loss)] // small test numbers

mod common;

use common::{ok, statuses};

use std::ffi::CString;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, DevicePtr};
use lake::layout::{LakeLayoutInfo, LakeLayoutOptions, lake_layout_describe};
use lake::pool::{
    LakeAttachOptions, LakeBlockKey, LakeKvMemoryOptions, LakeKvPiece, LakeLocation, LakeNamespace,
    LakeNamespaceOptions, LakePool, lake_attach, lake_detach, lake_keychain_extend, lake_keychain_free,
    lake_keychain_new, lake_lookup, lake_namespace_free, lake_namespace_new, lake_register_kv_memory, lake_submit_load,
    lake_submit_save, lake_wait_layer,
};
use lake::status::LakeStatus;
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::BlockKey;
use lake_dp::stored::decode_header;

const NB: usize = 16;
const LAYERS: usize = 2;
const TOKENS: usize = 16;
const HEADS: usize = 4;
const DIM: usize = 64;
const E: usize = 2;
const LAYER_ELEMENTS: usize = 2 * NB * TOKENS * HEADS * DIM;

/// Element offset of (plane, block, token, head) in one layer's tensor.
fn offset(hnd: bool, p: usize, b: usize, t: usize, h: usize) -> usize {
    if hnd { (((p * NB + b) * HEADS + h) * TOKENS + t) * DIM } else { (((p * NB + b) * TOKENS + t) * HEADS + h) * DIM }
}

fn pieces(hnd: bool, bases: &[u64]) -> Vec<LakeKvPiece> {
    let bytes = |p, b, t, h| (offset(hnd, p, b, t, h) * E) as i64;
    let mut out = Vec::new();
    for &base in bases {
        for p in 0..2 {
            out.push(LakeKvPiece {
                address: (base + bytes(p, 0, 0, 0) as u64) as usize,
                block_stride: bytes(p, 1, 0, 0) - bytes(p, 0, 0, 0),
                token_stride: bytes(p, 0, 1, 0) - bytes(p, 0, 0, 0),
                head_stride: bytes(p, 0, 0, 1) - bytes(p, 0, 0, 0),
            });
        }
    }
    out
}

/// Block `b`'s bytes in Lake's order, from host copies of the tensors.
fn block(hnd: bool, layers: &[Vec<u8>], b: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in layers {
        for p in 0..2 {
            for t in 0..TOKENS {
                for h in 0..HEADS {
                    let at = offset(hnd, p, b, t, h) * E;
                    out.extend_from_slice(&layer[at..at + DIM * E]);
                }
            }
        }
    }
    out
}

#[test]
fn gpu_memory_saves_loads_across_layouts_and_catches_a_flipped_byte() {
    if let Err(why) = lake_kernels::probe() {
        println!("SKIPPED: {why}");
        return;
    }
    let layout = LakeLayoutOptions {
        struct_size: size_of::<LakeLayoutOptions>(),
        layers: LAYERS as u32,
        planes: 2,
        kv_heads: HEADS as u32,
        shard_start: 0,
        shard_end: HEADS as u32,
        head_dim: DIM as u32,
        dtype: 2,
        block_tokens: TOKENS as u32,
        layers_per_segment: 1,
    };
    let mut info = LakeLayoutInfo { struct_size: size_of::<LakeLayoutInfo>(), ..LakeLayoutInfo::default() };
    // SAFETY: valid options and out-struct.
    ok(unsafe { lake_layout_describe(&raw const layout, &raw mut info) }, "layout");
    let block_bytes = info.block_bytes as usize;
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: info.block_bytes,
        l1_slots: 64,
        l2_slots_per_file: 64,
        remote_agents: 4,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-gpu-{}", std::process::id())))
    })
    .unwrap();

    let ns_options = LakeNamespaceOptions {
        struct_size: size_of::<LakeNamespaceOptions>(),
        tenant_key: [8; 32],
        block_tokens: TOKENS as u32,
        model_fingerprint: [9; 32],
        extra_keys_digest: [0; 32],
        key_scheme: 1,
    };
    let mut namespace: *mut LakeNamespace = core::ptr::null_mut();
    // SAFETY: valid options and out-pointer.
    ok(unsafe { lake_namespace_new(&raw const ns_options, &raw mut namespace) }, "namespace");
    let tokens: Vec<u32> = (0..(6 * TOKENS) as u32).map(|i| i * 13 + 1).collect();
    let mut keys = vec![LakeBlockKey::default(); 6];
    let (mut chain, mut written) = (core::ptr::null_mut(), 0);
    // SAFETY: valid namespace and out-pointer.
    ok(unsafe { lake_keychain_new(namespace, &raw mut chain) }, "chain");
    // SAFETY: arrays of their lengths.
    let extended =
        unsafe { lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), 6, &raw mut written) };
    ok(extended, "keys");
    // SAFETY: from lake_keychain_new, freed once.
    unsafe { lake_keychain_free(chain) };

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
        name: c"gpu-engine".as_ptr(),
        namespace,
        layout_fingerprint: info.fingerprint,
        segment_bytes: info.segment_bytes,
        pin_agent: 0,
        agent_core: 0,
        copy_threads: 0,
        shard_code: info.shard_code,
        object_kind: 1,
        block_bytes: 0,
    };
    let mut handle: *mut LakePool = core::ptr::null_mut();
    // SAFETY: valid options; strings live to the end of the test.
    ok(unsafe { lake_attach(&raw const attach, &raw mut handle) }, "attach");

    // Engine A (NHD, random bytes) and engine B (HND, zeros), in HBM.
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    let mut state = 0x1234_5678_9abc_def1u64;
    let host_a: Vec<Vec<u8>> = (0..LAYERS)
        .map(|_| {
            (0..LAYER_ELEMENTS * E)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state.to_le_bytes()[4]
                })
                .collect()
        })
        .collect();
    let a: Vec<_> = host_a.iter().map(|h| stream.clone_htod(h).unwrap()).collect();
    let b: Vec<_> = (0..LAYERS).map(|_| stream.alloc_zeros::<u8>(LAYER_ELEMENTS * E).unwrap()).collect();
    let c: Vec<_> = (0..LAYERS).map(|_| stream.alloc_zeros::<u8>(LAYER_ELEMENTS * E).unwrap()).collect();
    let d: Vec<_> = (0..LAYERS).map(|_| stream.alloc_zeros::<u8>(LAYER_ELEMENTS * E).unwrap()).collect();
    let base = |t: &cudarc::driver::CudaSlice<u8>| t.device_ptr(&stream).0;
    let register = |pieces: &[LakeKvPiece], gpu_path: u32, layer_groups: u32| {
        let options = LakeKvMemoryOptions {
            struct_size: size_of::<LakeKvMemoryOptions>(),
            layout: &raw const layout,
            block_count: NB as u32,
            pieces: pieces.as_ptr(),
            piece_count: pieces.len(),
            memory_kind: 1,
            device: 0,
            gpu_path,
            layer_groups,
        };
        let mut id = 0;
        // SAFETY: valid options; the tensors live to the end of the test.
        ok(unsafe { lake_register_kv_memory(handle, &raw const options, &raw mut id) }, "register GPU memory");
        id
    };
    // A saves through the copy engines, B loads by kernel across the bus,
    // C loads through the copy engines, D too with every block whole (one
    // layer group): both ways, both directions.
    let memory_a = register(&pieces(false, &a.iter().map(base).collect::<Vec<_>>()), 0, 0);
    let memory_b = register(&pieces(true, &b.iter().map(base).collect::<Vec<_>>()), 1, 0);
    let memory_c = register(&pieces(true, &c.iter().map(base).collect::<Vec<_>>()), 0, 0);
    let memory_d = register(&pieces(true, &d.iter().map(base).collect::<Vec<_>>()), 0, 1);

    let from: [u32; 6] = [3, 1, 4, 9, 15, 0];
    let into: [u32; 6] = [2, 7, 1, 8, 11, 5];
    let mut request = 0;
    // SAFETY: arrays of 6; memory registered.
    let submitted = unsafe {
        lake_submit_save(handle, memory_a, core::ptr::null(), keys.as_ptr(), from.as_ptr(), 6, 2, &raw mut request)
    };
    ok(submitted, "save");
    assert_eq!(statuses(handle, request, 6), [LakeStatus::LakeOk; 6], "saved from HBM");
    let mut table = vec![LakeLocation::default(); 6];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut hits = 0;
        // SAFETY: arrays of 6.
        ok(unsafe { lake_lookup(handle, keys.as_ptr(), 6, table.as_mut_ptr(), 6, &raw mut hits) }, "lookup");
        if hits == 6 {
            break;
        }
        assert!(Instant::now() < deadline, "published {hits}");
        std::thread::sleep(Duration::from_millis(2));
    }
    let submit = |memory: u32, count: usize| {
        let mut request = 0;
        // SAFETY: arrays of at least `count`; memory registered.
        let status = unsafe {
            lake_submit_load(handle, memory, keys.as_ptr(), table.as_ptr(), into.as_ptr(), count, 0, &raw mut request)
        };
        ok(status, "load");
        request
    };
    let load = |memory: u32, count: usize| statuses(handle, submit(memory, count), count);
    for (memory, tensors) in [(memory_b, &b), (memory_c, &c), (memory_d, &d)] {
        assert_eq!(load(memory, 6), [LakeStatus::LakeOk; 6], "loaded into HBM");
        let host: Vec<Vec<u8>> = tensors.iter().map(|t| stream.clone_dtoh(t).unwrap()).collect();
        for (i, (&f, &t)) in from.iter().zip(&into).enumerate() {
            assert!(block(true, &host, t as usize) == block(false, &host_a, f as usize), "memory {memory} block {i}");
        }
        for untouched in (0..NB).filter(|x| !into.contains(&(*x as u32))) {
            assert!(block(true, &host, untouched).iter().all(|&x| x == 0), "block {untouched} written");
        }
    }

    // Layer by layer, on both paths: B and C zeroed, loaded again; an
    // engine stream waits for each layer on the GPU and reads the tensors
    // right after, before anyone polls.
    let engine = ctx.new_stream().unwrap();
    let mut request = 0;
    for (memory, mut tensors) in [(memory_b, b), (memory_c, c), (memory_d, d)] {
        for tensor in &mut tensors {
            stream.memset_zeros(tensor).unwrap();
        }
        stream.synchronize().unwrap();
        request = submit(memory, 6);
        for layer in 0..LAYERS as u32 {
            // SAFETY: a live stream of device 0's primary context.
            ok(unsafe { lake_wait_layer(handle, request, layer, engine.cu_stream() as u64) }, "wait for a layer");
        }
        let host: Vec<Vec<u8>> = tensors.iter().map(|t| engine.clone_dtoh(t).unwrap()).collect();
        for (i, (&f, &t)) in from.iter().zip(&into).enumerate() {
            assert!(block(true, &host, t as usize) == block(false, &host_a, f as usize), "layered {memory} block {i}");
        }
        assert_eq!(statuses(handle, request, 6), [LakeStatus::LakeOk; 6], "the layered load's completions");
    }
    // SAFETY: 0 is the legacy default stream.
    assert_eq!(unsafe { lake_wait_layer(handle, request, LAYERS as u32, 0) }, LakeStatus::LakeInvalidArgument);
    // SAFETY: as above.
    assert_eq!(unsafe { lake_wait_layer(handle, 1 << 40, 0, 0) }, LakeStatus::LakeInvalidArgument);

    // A byte flipped in block 2's L1 slot, second layer: the GPU's CRCs of
    // the landed block disagree with the stored ones.
    let arena = std::fs::OpenOptions::new().read(true).write(true).open(&pool.arena).unwrap();
    // SAFETY: a shared mapping of the live arena; one byte of one
    // committed slot is flipped, which is the point.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&arena) }.unwrap();
    let key = BlockKey(keys[2].bytes);
    let slot = (0..map.len() / 4096)
        .map(|page| page * 4096)
        .find(|&at| decode_header(&map[at..]).is_ok_and(|h| h.meta().key == key))
        .expect("block 2's slot");
    map[slot + 4096 + block_bytes / 2 + 17] ^= 0x08;
    for memory in [memory_b, memory_c, memory_d] {
        let got = load(memory, 6);
        assert_eq!(got[..2], [LakeStatus::LakeOk; 2], "{got:?}");
        assert_eq!(got[2], LakeStatus::LakeBadCrc, "{got:?}");
        assert!(got[3..].iter().all(|&s| s == LakeStatus::LakePrefixBroken), "{got:?}");
    }
    drop(map);

    // SAFETY: attached above, detached once.
    unsafe { lake_detach(handle) };
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
    drop(pool.stop());
}
