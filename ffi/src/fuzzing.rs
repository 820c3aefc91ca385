//! What the `ffi_entry` fuzz target runs (feature `fuzzing`; never in a
//! release build): the C ABI's entry points that take an engine's structs
//! and buffers, fed field values and byte counts from the fuzzer's input.
//! Any values give a status — never a panic, not even one the boundary
//! catches (`LAKE_INTERNAL`) — and whatever succeeds is consistent. Every
//! pointer passed is valid: the C contract is the caller's; what is
//! fuzzed is what Lake makes of the values.

use crate::layout::{
    LakeLayoutInfo, LakeLayoutOptions, LakeStateLayoutInfo, LakeStateLayoutOptions, lake_layout_describe,
    lake_shard_code, lake_state_layout_describe,
};
use crate::pool::{
    LakeBlockKey, LakeNamespaceOptions, lake_keychain_extend, lake_keychain_free, lake_keychain_new,
    lake_namespace_free, lake_namespace_new, lake_page_keys,
};
use crate::status::LakeStatus;

/// Plain-data structs of integers and byte arrays: any bytes are a value.
///
/// # Safety
///
/// Implemented only for `repr(C)` structs whose every field is an integer
/// or an array of them.
unsafe trait Plain: Copy {}
// SAFETY: repr(C), integers only.
unsafe impl Plain for LakeLayoutOptions {}
// SAFETY: repr(C), integers only.
unsafe impl Plain for LakeStateLayoutOptions {}
// SAFETY: repr(C), integers and byte arrays only.
unsafe impl Plain for LakeNamespaceOptions {}
// SAFETY: repr(C), integers only.
unsafe impl Plain for LakeStateLayoutInfo {}

/// A `T` from the next bytes of `input` (zeros past its end).
fn take<T: Plain>(input: &mut &[u8]) -> T {
    // SAFETY: `Plain`: all-zero bytes are a value of T.
    let mut value: T = unsafe { core::mem::zeroed() };
    let (head, rest) = input.split_at(size_of::<T>().min(input.len()));
    // SAFETY: at most size_of::<T>() bytes into a T, any bytes being a
    // value of it (`Plain`).
    unsafe { core::ptr::copy_nonoverlapping(head.as_ptr(), (&raw mut value).cast::<u8>(), head.len()) };
    *input = rest;
    value
}

fn no_panic(status: LakeStatus, what: &str) -> LakeStatus {
    assert_ne!(status, LakeStatus::LakeInternal, "{what} panicked");
    status
}

/// Runs the entry points on `data`. Panics (the fuzzer's finding) where
/// one panicked or answered inconsistently.
pub fn exercise_entry_points(data: &[u8]) {
    let Some((&mode, mut input)) = data.split_first() else { return };
    // Half the time a struct_size that matches, so the field checks run.
    let fixed = |given: usize, real: usize| if mode & 1 == 1 { real } else { given };

    let mut layout: LakeLayoutOptions = take(&mut input);
    layout.struct_size = fixed(layout.struct_size, size_of::<LakeLayoutOptions>());
    let mut info = LakeLayoutInfo { struct_size: size_of::<LakeLayoutInfo>(), ..LakeLayoutInfo::default() };
    // SAFETY: both point at live values of their types.
    let status = no_panic(unsafe { lake_layout_describe(&layout, &mut info) }, "lake_layout_describe");
    if status == LakeStatus::LakeOk {
        assert!(info.segment_bytes > 0 && info.block_bytes >= info.segment_bytes, "{info:?}");
    }
    let mut code = 0u64;
    // SAFETY: `code` is a live u64.
    let shard = unsafe { lake_shard_code(layout.kv_heads, layout.shard_start, layout.shard_end, &mut code) };
    no_panic(shard, "lake_shard_code");

    let mut state: LakeStateLayoutOptions = take(&mut input);
    state.struct_size = fixed(state.struct_size, size_of::<LakeStateLayoutOptions>());
    let mut state_info: LakeStateLayoutInfo = take(&mut &[][..]);
    state_info.struct_size = size_of::<LakeStateLayoutInfo>();
    // SAFETY: both point at live values of their types.
    no_panic(unsafe { lake_state_layout_describe(&state, &mut state_info) }, "lake_state_layout_describe");

    let mut options: LakeNamespaceOptions = take(&mut input);
    options.struct_size = fixed(options.struct_size, size_of::<LakeNamespaceOptions>());
    let mut namespace = core::ptr::null_mut();
    // SAFETY: live options, a live out pointer.
    let status = no_panic(unsafe { lake_namespace_new(&options, &mut namespace) }, "lake_namespace_new");
    if status != LakeStatus::LakeOk {
        assert!(namespace.is_null(), "a failed lake_namespace_new gave a namespace");
        return;
    }
    let (capacity, input) = match input.split_first() {
        Some((&capacity, rest)) => (usize::from(capacity), rest),
        None => (0, &[][..]),
    };
    let mut keys = vec![LakeBlockKey { bytes: [0; 16] }; capacity];
    let tokens: Vec<u32> = input.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let mut chain = core::ptr::null_mut();
    // SAFETY: a namespace from lake_namespace_new, a live out pointer.
    if no_panic(unsafe { lake_keychain_new(namespace, &mut chain) }, "lake_keychain_new") == LakeStatus::LakeOk {
        let mut written = 0usize;
        // SAFETY: a chain from lake_keychain_new; `tokens.len()` tokens;
        // `capacity` writable keys; a live count.
        let extended = unsafe {
            lake_keychain_extend(chain, tokens.as_ptr(), tokens.len(), keys.as_mut_ptr(), capacity, &mut written)
        };
        if no_panic(extended, "lake_keychain_extend") == LakeStatus::LakeOk {
            assert!(written <= capacity, "{written} keys written into {capacity}");
        }
        // SAFETY: from lake_keychain_new, freed once.
        unsafe { lake_keychain_free(chain) };
    }
    // The same bytes as page hashes of a size the input picks.
    let hash_bytes = usize::from(mode >> 1) % 48;
    let count = input.len().checked_div(hash_bytes).map_or(input.len().min(3), |n| n.min(capacity));
    // SAFETY: `count * hash_bytes` bytes of `input` readable (0 when
    // hash_bytes is 0, refused before any read), `count` <= `capacity`
    // writable keys.
    let paged = unsafe { lake_page_keys(namespace, input.as_ptr(), hash_bytes, count, keys.as_mut_ptr()) };
    no_panic(paged, "lake_page_keys");
    // SAFETY: from lake_namespace_new, freed once.
    unsafe { lake_namespace_free(namespace) };
}
