//! Pools in this process and engines attached to them through the C ABI:
//! what the P→D tests share.

use std::ffi::CString;
use std::time::{Duration, Instant};

use lake::pool::{
    LakeAttachOptions, LakeBlockKey, LakeLocation, LakeNamespace, LakeNamespaceOptions, LakePool, LakeRailStat,
    lake_attach, lake_keychain_extend, lake_keychain_free, lake_keychain_new, lake_lookup, lake_namespace_new,
    lake_push, lake_push_rails, lake_register_host_memory, lake_slot_space, lake_submit_load, lake_submit_save,
};
use lake::status::LakeStatus;
use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};
use lake_dp::runner::RdmaDevice;

use super::{ok, statuses};

/// A block's bytes in these pools.
pub(crate) const BLOCK: usize = 64 * 1024;

/// A pool named `name`; with `listen`, its transport takes blocks there
/// (over RDMA too, negotiated, where `rdma` names a device).
pub(crate) fn start(name: &str, listen: Option<std::net::SocketAddr>, rdma: Option<RdmaDevice>) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: BLOCK as u64,
        l1_slots: 32,
        l2_slots_per_file: 32,
        remote_agents: 4,
        transport_listen: listen,
        rdma,
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-ffi-push-{name}-{}", std::process::id())))
    })
    .unwrap()
}

/// A loopback address no one listens on now.
pub(crate) fn free_address() -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// An engine attached to `pool` through the C ABI; the strings it points
/// at live as long as the returned handle's holder keeps them.
pub(crate) fn attach(pool: &EmbeddedPool, namespace: *mut LakeNamespace, strings: &mut Vec<CString>) -> *mut LakePool {
    attach_at([&pool.dp_socket, &pool.mirror, &pool.cp_socket], namespace, strings)
}

/// An engine attached through the C ABI to the pool whose data plane's
/// socket, mirror and control plane's socket are `paths` (a pool of
/// another process).
pub(crate) fn attach_at(
    paths: [&std::path::Path; 3],
    namespace: *mut LakeNamespace,
    strings: &mut Vec<CString>,
) -> *mut LakePool {
    for path in paths {
        strings.push(CString::new(path.display().to_string()).unwrap());
    }
    let n = strings.len();
    let options = LakeAttachOptions {
        struct_size: size_of::<LakeAttachOptions>(),
        dp_socket: strings[n - 3].as_ptr(),
        mirror_path: strings[n - 2].as_ptr(),
        cp_socket: strings[n - 1].as_ptr(),
        name: c"engine".as_ptr(),
        namespace,
        layout_fingerprint: 11,
        segment_bytes: 16 * 1024,
        pin_agent: 0,
        agent_core: 0,
        copy_threads: 0,
        shard_code: 0,
        object_kind: 1,
        block_bytes: 0,
    };
    let mut handle: *mut LakePool = core::ptr::null_mut();
    // SAFETY: valid options; the strings outlive the pool (kept by the caller).
    ok(unsafe { lake_attach(&raw const options, &raw mut handle) }, "attach");
    handle
}

/// A namespace of tenant `tenant` (16 tokens a block), freed by the caller.
pub(crate) fn namespace(tenant: u8) -> *mut LakeNamespace {
    let options = LakeNamespaceOptions {
        struct_size: size_of::<LakeNamespaceOptions>(),
        tenant_key: [tenant; 32],
        block_tokens: 16,
        model_fingerprint: [tenant.wrapping_add(1); 32],
        extra_keys_digest: [0; 32],
        key_scheme: 1,
    };
    let mut namespace: *mut LakeNamespace = core::ptr::null_mut();
    // SAFETY: valid options and out-pointer.
    ok(unsafe { lake_namespace_new(&raw const options, &raw mut namespace) }, "namespace");
    namespace
}

/// The keys of a prompt of `blocks` blocks whose tokens `token` makes.
pub(crate) fn keys(namespace: *mut LakeNamespace, blocks: usize, token: impl Fn(u32) -> u32) -> Vec<LakeBlockKey> {
    let tokens: Vec<u32> = (0..u32::try_from(blocks * 16).unwrap()).map(token).collect();
    let mut keys = vec![LakeBlockKey::default(); blocks];
    let (mut chain, mut written) = (core::ptr::null_mut(), 0);
    // SAFETY: a valid namespace and out-pointer.
    ok(unsafe { lake_keychain_new(namespace, &raw mut chain) }, "chain");
    // SAFETY: arrays of their lengths.
    let extended = unsafe {
        lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), blocks, &raw mut written)
    };
    ok(extended, "keys");
    // SAFETY: from lake_keychain_new, freed once.
    unsafe { lake_keychain_free(chain) };
    keys
}

/// Waits until every one of `keys` is published in `handle`'s pool; their
/// locations.
pub(crate) fn lookup(handle: *mut LakePool, keys: &[LakeBlockKey]) -> Vec<LakeLocation> {
    let mut table = vec![LakeLocation::default(); keys.len()];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut hits = 0;
        // SAFETY: arrays of their lengths.
        let status =
            unsafe { lake_lookup(handle, keys.as_ptr(), keys.len(), table.as_mut_ptr(), keys.len(), &raw mut hits) };
        ok(status, "lookup");
        if hits == keys.len() {
            return table;
        }
        assert!(Instant::now() < deadline, "{hits} of {} published", keys.len());
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Block `i`'s indices in host memory of `blocks` blocks.
fn indices(blocks: usize) -> Vec<u32> {
    (0..u32::try_from(blocks).unwrap()).collect()
}

/// Saves `kv` (one `BLOCK` for each of `keys`) into `handle`'s pool as a
/// prompt's blocks (registered as host memory: `kv` must live until
/// detach); their locations once published.
pub(crate) fn save(handle: *mut LakePool, keys: &[LakeBlockKey], kv: &mut [u8]) -> Vec<LakeLocation> {
    assert_eq!(kv.len(), keys.len() * BLOCK);
    let (mut memory, mut request) = (0, 0);
    let count = u32::try_from(keys.len()).unwrap();
    // SAFETY: the memory lives until detach (the caller's).
    ok(unsafe { lake_register_host_memory(handle, kv.as_mut_ptr(), BLOCK, count, &raw mut memory) }, "register");
    let blocks = indices(keys.len());
    // SAFETY: arrays of `keys.len()` entries.
    let saved = unsafe {
        lake_submit_save(
            handle,
            memory,
            core::ptr::null(),
            keys.as_ptr(),
            blocks.as_ptr(),
            keys.len(),
            2,
            &raw mut request,
        )
    };
    ok(saved, "save");
    assert!(statuses(handle, request, keys.len()).iter().all(|&s| s == LakeStatus::LakeOk));
    lookup(handle, keys)
}

/// Loads `keys` (found in `handle`'s pool) into fresh host memory (kept
/// in `into` until detach), one `BLOCK` each; every block's status.
pub(crate) fn load(handle: *mut LakePool, keys: &[LakeBlockKey], into: &mut Vec<u8>) -> Vec<LakeStatus> {
    let found = lookup(handle, keys);
    *into = vec![0u8; keys.len() * BLOCK];
    let (mut memory, mut request) = (0, 0);
    let count = u32::try_from(keys.len()).unwrap();
    // SAFETY: the memory lives until detach (the caller's).
    let registered = unsafe { lake_register_host_memory(handle, into.as_mut_ptr(), BLOCK, count, &raw mut memory) };
    ok(registered, "register for the load");
    let blocks = indices(keys.len());
    // SAFETY: arrays of `keys.len()` entries.
    let loaded = unsafe {
        lake_submit_load(
            handle,
            memory,
            keys.as_ptr(),
            found.as_ptr(),
            blocks.as_ptr(),
            keys.len(),
            0,
            &raw mut request,
        )
    };
    ok(loaded, "load");
    statuses(handle, request, keys.len())
}

/// Where `handle`'s pool takes pushed blocks: its L1's region and epoch.
pub(crate) fn slot_space(handle: *mut LakePool) -> (u16, u64) {
    let (mut region, mut epoch) = (0u16, 0u64);
    // SAFETY: writable out-values.
    ok(unsafe { lake_slot_space(handle, &raw mut region, &raw mut epoch) }, "slot space");
    (region, epoch)
}

/// Pushes `keys` (at `table`, from a lookup in `from`'s pool) over `rails`
/// to `(region, epoch)`, P→D class; every block's status.
pub(crate) fn push(
    from: *mut LakePool,
    rails: &str,
    keys: &[LakeBlockKey],
    table: &[LakeLocation],
    (region, epoch): (u16, u64),
) -> Vec<LakeStatus> {
    let address = CString::new(rails).unwrap();
    let mut request = 0;
    // SAFETY: arrays of `keys.len()` entries; a C string.
    let pushed = unsafe {
        lake_push(from, address.as_ptr(), keys.as_ptr(), table.as_ptr(), keys.len(), region, epoch, 1, &raw mut request)
    };
    ok(pushed, "push");
    statuses(from, request, keys.len())
}

/// A rail's figures, zero.
pub(crate) fn empty_rail() -> LakeRailStat {
    LakeRailStat { peer: 0, rail: 0, up: 0, reserved: 0, bytes: 0, breaks: 0, address: [0; 64] }
}

/// What each compute rail of `handle`'s pushes carried.
pub(crate) fn rails(handle: *mut LakePool) -> Vec<LakeRailStat> {
    let mut count = 0;
    // SAFETY: capacity 0 with a null array; writable count.
    ok(unsafe { lake_push_rails(handle, core::ptr::null_mut(), 0, &raw mut count) }, "rail count");
    let mut stats = vec![empty_rail(); count];
    // SAFETY: `count` writable entries.
    ok(unsafe { lake_push_rails(handle, stats.as_mut_ptr(), count, &raw mut count) }, "rails");
    stats
}
