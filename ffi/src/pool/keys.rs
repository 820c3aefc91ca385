//! Namespaces and block keys: the names an engine gives its blocks.

use super::*;

/// Options of [`lake_namespace_new`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LakeNamespaceOptions {
    /// `sizeof(LakeNamespaceOptions)`.
    pub struct_size: usize,
    /// The tenant's secret key.
    pub tenant_key: [u8; 32],
    /// Tokens per block (1 to 1024).
    pub block_tokens: u32,
    /// Digest of the model identity (weights revision, tokenizer, KV dtype
    /// and scales).
    pub model_fingerprint: [u8; 32],
    /// Digest of the engine's extra keys (LoRA, multimodal, salt); zeros if
    /// none.
    pub extra_keys_digest: [u8; 32],
    /// How keys are made: 1 from token ids (`lake_keychain_extend`); 3 from
    /// engine page hashes that already name their whole prefix, such as
    /// SGLang's (`lake_page_keys`). 0 means 1.
    pub key_scheme: u32,
}

/// A namespace.
#[derive(Debug)]
pub struct LakeNamespace(pub(super) Namespace);

/// An incremental key chain in a namespace; tokens of an unfinished block
/// wait inside it.
#[derive(Debug)]
pub struct LakeKeyChain {
    pub(super) chain: KeyChain,
    pub(super) pending: Vec<u32>,
}

/// Makes a namespace. Thread-safe.
///
/// # Safety
///
/// `options` must point at a `LakeNamespaceOptions`; `out` at a writable
/// pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_namespace_new(
    options: *const LakeNamespaceOptions,
    out: *mut *mut LakeNamespace,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if out.is_null() {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_namespace_new: out is required"));
            }
            // SAFETY: null or a LakeNamespaceOptions (contract).
            let o = unsafe { read_options(options, "LakeNamespaceOptions") }?;
            let scheme = match o.key_scheme {
                0 | 1 => KeyScheme::TokenIdsV1,
                3 => KeyScheme::EnginePrefixHashV1,
                other => {
                    return Err(fail(
                        LakeStatus::LakeInvalidArgument,
                        format!("key_scheme {other}: 1 (token ids) or 3 (engine prefix hashes)"),
                    ));
                }
            };
            let namespace = Namespace::new(
                &TenantKey(o.tenant_key),
                scheme,
                o.block_tokens,
                o.model_fingerprint,
                o.extra_keys_digest,
            )
            .map_err(|e| fail(LakeStatus::LakeInvalidArgument, e.to_string()))?;
            // SAFETY: non-null; the caller gave a writable pointer.
            unsafe { out.write(Box::into_raw(Box::new(LakeNamespace(namespace)))) };
            Ok(())
        })())
    })
}

/// The keys of `count` pages named by engine page hashes of `hash_bytes`
/// bytes each (`hashes` holds them back to back), into `keys`, in a
/// namespace of key scheme 3. Each page's key needs only its own hash, so
/// any run of pages can be keyed, wherever it starts. Thread-safe.
///
/// # Safety
///
/// `namespace` from `lake_namespace_new`; `hashes` points at `count *
/// hash_bytes` bytes; `keys` at `count` writable keys.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_page_keys(
    namespace: *const LakeNamespace,
    hashes: *const u8,
    hash_bytes: usize,
    count: usize,
    keys: *mut LakeBlockKey,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            if count > 0 && hash_bytes == 0 {
                return Err(fail(LakeStatus::LakeInvalidArgument, "lake_page_keys: hash_bytes is zero"));
            }
            if namespace.is_null() || (count > 0 && (hashes.is_null() || keys.is_null())) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_page_keys: a required pointer is null"));
            }
            let total = hash_bytes
                .checked_mul(count)
                .filter(|&n| isize::try_from(n).is_ok())
                .ok_or_else(|| fail(LakeStatus::LakeInvalidArgument, "lake_page_keys: too many bytes"))?;
            if count == 0 {
                return Ok(());
            }
            // SAFETY: from lake_namespace_new (contract), non-null.
            let namespace = unsafe { &(*namespace).0 };
            // SAFETY: `count * hash_bytes` readable bytes (contract), checked
            // to fit an isize.
            let hashes = unsafe { core::slice::from_raw_parts(hashes, total) };
            for (i, hash) in hashes.chunks_exact(hash_bytes).enumerate() {
                let key = lake_dp::engine_prefix_key(namespace, hash)
                    .map_err(|e| fail(LakeStatus::LakeInvalidArgument, format!("lake_page_keys: {e}")))?;
                // SAFETY: i < count writable keys (contract).
                unsafe { keys.wrapping_add(i).write(LakeBlockKey { bytes: key.0 }) };
            }
            Ok(())
        })())
    })
}

/// Frees a namespace (null is accepted). Not while a chain or pool made
/// from it is in use on another thread.
///
/// # Safety
///
/// `namespace` must be null or come from `lake_namespace_new`, once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_namespace_free(namespace: *mut LakeNamespace) {
    if !namespace.is_null() {
        // SAFETY: from Box::into_raw in lake_namespace_new, freed once.
        drop(unsafe { Box::from_raw(namespace) });
    }
}

/// The namespace's public 64-bit id. Thread-safe.
///
/// # Safety
///
/// `namespace` must come from `lake_namespace_new`; `id` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_namespace_id(namespace: *const LakeNamespace, id: *mut u64) -> LakeStatus {
    if namespace.is_null() || id.is_null() {
        return fail(LakeStatus::LakeNullArgument, "lake_namespace_id: namespace and id are required");
    }
    // SAFETY: non-null and valid (contract).
    let value = unsafe { (*namespace).0.id().0 };
    // SAFETY: non-null and writable (contract).
    unsafe { id.write(value) };
    LakeStatus::LakeOk
}

/// A new key chain at the start of a prompt. Thread-safe.
///
/// # Safety
///
/// `namespace` from `lake_namespace_new`; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_keychain_new(namespace: *const LakeNamespace, out: *mut *mut LakeKeyChain) -> LakeStatus {
    if namespace.is_null() || out.is_null() {
        return fail(LakeStatus::LakeNullArgument, "lake_keychain_new: namespace and out are required");
    }
    // SAFETY: valid namespace (contract).
    let chain = KeyChain::new(unsafe { &(*namespace).0 });
    // SAFETY: writable (contract).
    unsafe { out.write(Box::into_raw(Box::new(LakeKeyChain { chain, pending: Vec::new() }))) };
    LakeStatus::LakeOk
}

/// Extends a chain by `count` tokens: the keys of the blocks they complete
/// go to `keys` (room for `capacity`), their number to `written`; tokens
/// of an unfinished block wait inside the chain. On `LakeBufferTooSmall`
/// nothing is consumed and `written` says how many keys were needed. One
/// thread at a time per chain.
///
/// # Safety
///
/// `chain` from `lake_keychain_new`; `tokens` points at `count` values;
/// `keys` at `capacity` writable keys; `written` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_keychain_extend(
    chain: *mut LakeKeyChain,
    tokens: *const u32,
    count: usize,
    keys: *mut LakeBlockKey,
    capacity: usize,
    written: *mut usize,
) -> LakeStatus {
    guard(|| {
        if chain.is_null() || written.is_null() || (tokens.is_null() && count > 0) || (keys.is_null() && capacity > 0) {
            return fail(LakeStatus::LakeNullArgument, "lake_keychain_extend: a required pointer is null");
        }
        // SAFETY: valid chain, used by one thread (contract).
        let chain = unsafe { &mut *chain };
        // SAFETY: `count` tokens (contract); a null pointer only with 0.
        let tokens = if count == 0 { &[][..] } else { unsafe { core::slice::from_raw_parts(tokens, count) } };
        let block_tokens = chain.chain.block_tokens() as usize;
        let needed = (chain.pending.len() + count) / block_tokens;
        if needed > capacity {
            // SAFETY: writable (contract).
            unsafe { written.write(needed) };
            return fail(LakeStatus::LakeBufferTooSmall, format!("lake_keychain_extend: {needed} keys need room"));
        }
        chain.pending.extend_from_slice(tokens);
        let mut out = vec![BlockKey::NONE; needed];
        let n = match chain.chain.extend_tokens(&chain.pending, &mut out) {
            Ok(n) => n,
            Err(e) => return fail(LakeStatus::LakeInvalidArgument, e.to_string()),
        };
        chain.pending.drain(..n * block_tokens);
        for (i, key) in out[..n].iter().enumerate() {
            // SAFETY: i < n <= capacity keys (checked above).
            unsafe { keys.wrapping_add(i).write(LakeBlockKey { bytes: key.0 }) };
        }
        // SAFETY: writable (contract).
        unsafe { written.write(n) };
        LakeStatus::LakeOk
    })
}

/// Frees a chain (null accepted).
///
/// # Safety
///
/// `chain` null or from `lake_keychain_new`, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_keychain_free(chain: *mut LakeKeyChain) {
    if !chain.is_null() {
        // SAFETY: from Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(chain) });
    }
}

/// The engine's `count` keys as this pool's shard names them (the keys
/// the mirror, the pool and the stored headers use).
pub(crate) fn read_keys(pool: &LakePool, keys: *const LakeBlockKey, count: usize) -> Vec<BlockKey> {
    if count == 0 {
        return Vec::new();
    }
    // SAFETY: `count` keys (the callers' contract, checked non-null).
    let keys = unsafe { core::slice::from_raw_parts(keys, count) };
    keys.iter().map(|k| pool.shard.apply(BlockKey(k.bytes))).collect()
}
