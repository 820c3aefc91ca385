//! Namespaces: the boundary of sharing.
//!
//! Two requests can share KV only inside one namespace. A namespace is the
//! tenant's secret key, the key-scheme version, the model fingerprint and a
//! digest of the engine's extra keys; all four feed the root of every key
//! chain, so a tenant cannot hit — or time — another tenant's prefixes.

use core::fmt;

/// A 32-byte BLAKE3 digest.
pub type Digest32 = [u8; 32];

/// BLAKE3 key-derivation contexts. Changing any of these changes every key:
/// that is a key-scheme version bump.
const CONTEXT_ROOT: &str = "lake 2026-11 namespace root v1";
const CONTEXT_ID: &str = "lake 2026-11 namespace id v1";
const CONTEXT_MODEL: &str = "lake 2026-11 model fingerprint v1";
const CONTEXT_EXTRA: &str = "lake 2026-11 extra keys v1";

/// A tenant's 32-byte secret. Keys of different tenants are unrelated even
/// for identical tokens.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TenantKey(pub [u8; 32]);

impl fmt::Debug for TenantKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A secret: never print it.
        f.write_str("TenantKey(..)")
    }
}

/// How token positions turn into key material.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum KeyScheme {
    /// Each block's message is its token ids as little-endian `u32`s.
    TokenIdsV1 = 1,
    /// Each block's message is the engine's own page hash (SGLang's SHA-256
    /// chain), for deployments that hand Lake those instead of tokens.
    EngineHashV1 = 2,
    /// Each key is the keyed hash of the engine's page hash alone, under
    /// the namespace root: for engines whose page hash already names the
    /// whole prefix (SGLang's SHA-256 chain over parent hash and tokens)
    /// and whose storage calls hand over runs of pages that may start
    /// mid-prompt, without the pages before them. See
    /// [`crate::model::key::engine_prefix_key`].
    EnginePrefixHashV1 = 3,
}

impl KeyScheme {
    /// Decodes a scheme version.
    pub fn from_u32(value: u32) -> Result<Self, NamespaceError> {
        match value {
            1 => Ok(Self::TokenIdsV1),
            2 => Ok(Self::EngineHashV1),
            3 => Ok(Self::EnginePrefixHashV1),
            other => Err(NamespaceError::UnknownKeyScheme(other)),
        }
    }
}

/// Errors building a namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamespaceError {
    /// The key-scheme version is not one this build knows.
    UnknownKeyScheme(u32),
    /// `block_tokens` is zero or above [`crate::constants::BLOCK_TOKENS_MAX`].
    BlockTokens(u32),
}

impl fmt::Display for NamespaceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::UnknownKeyScheme(v) => write!(f, "unknown key scheme version {v}"),
            Self::BlockTokens(n) => write!(f, "block_tokens {n} is outside 1..={}", crate::constants::BLOCK_TOKENS_MAX),
        }
    }
}

impl std::error::Error for NamespaceError {}

/// What makes KV bytes of one model interchangeable: weights revision,
/// tokenizer, KV dtype and quantization scales. Any difference must give a
/// different fingerprint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelIdentity<'a> {
    /// Weights revision (a commit or content hash of the checkpoint).
    pub weights_revision: &'a str,
    /// Tokenizer identity (its content hash or revision).
    pub tokenizer: &'a str,
    /// KV cache dtype as the engine names it ("bfloat16", "fp8_e4m3", ...).
    pub kv_dtype: &'a str,
    /// Serialized KV quantization scales; empty when unquantized.
    pub kv_scales: &'a [u8],
}

impl ModelIdentity<'_> {
    /// The 32-byte model fingerprint that enters the namespace.
    pub fn fingerprint(&self) -> Digest32 {
        digest_parts(
            CONTEXT_MODEL,
            &[self.weights_revision.as_bytes(), self.tokenizer.as_bytes(), self.kv_dtype.as_bytes(), self.kv_scales],
        )
    }
}

/// The engine's extra keys that split sharing: LoRA adapter, multimodal
/// hashes, cache salt. Order matters and is part of the digest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExtraKeys<'a> {
    /// LoRA adapter name or id; empty for the base model.
    pub lora: &'a str,
    /// Per-request cache salt (vLLM's `cache_salt`); empty for none.
    pub cache_salt: &'a str,
    /// Anything else the engine keys on, in a fixed order.
    pub other: &'a [&'a [u8]],
}

impl ExtraKeys<'_> {
    /// The 32-byte digest that enters the namespace.
    pub fn digest(&self) -> Digest32 {
        let mut hasher = blake3::Hasher::new_derive_key(CONTEXT_EXTRA);
        update_framed(&mut hasher, self.lora.as_bytes());
        update_framed(&mut hasher, self.cache_salt.as_bytes());
        hasher.update(&(self.other.len() as u64).to_le_bytes());
        for part in self.other {
            update_framed(&mut hasher, part);
        }
        *hasher.finalize().as_bytes()
    }
}

/// A namespace's 64-bit id: what stored headers and wire messages carry. It
/// is derived from the root, so it reveals nothing of the tenant key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct NamespaceId(pub u64);

/// A namespace, with the root of its key chains computed once.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Namespace {
    scheme: KeyScheme,
    block_tokens: u32,
    model_fingerprint: Digest32,
    extra_keys_digest: Digest32,
    root: Digest32,
    id: NamespaceId,
}

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Namespace")
            .field("id", &format_args!("{:016x}", self.id.0))
            .field("scheme", &self.scheme)
            .field("block_tokens", &self.block_tokens)
            .finish_non_exhaustive()
    }
}

impl Namespace {
    /// Builds a namespace. `block_tokens` enters the root: a chain of 16-token
    /// blocks and one of 32-token blocks never share keys.
    pub fn new(
        tenant: &TenantKey,
        scheme: KeyScheme,
        block_tokens: u32,
        model_fingerprint: Digest32,
        extra_keys_digest: Digest32,
    ) -> Result<Self, NamespaceError> {
        if block_tokens == 0 || block_tokens > crate::constants::BLOCK_TOKENS_MAX {
            return Err(NamespaceError::BlockTokens(block_tokens));
        }
        let mut hasher = blake3::Hasher::new_derive_key(CONTEXT_ROOT);
        hasher.update(&tenant.0);
        hasher.update(&(scheme as u32).to_le_bytes());
        hasher.update(&block_tokens.to_le_bytes());
        hasher.update(&model_fingerprint);
        hasher.update(&extra_keys_digest);
        let root = *hasher.finalize().as_bytes();
        let id_bytes = blake3::derive_key(CONTEXT_ID, &root);
        let id = NamespaceId(u64::from_le_bytes(first_8(&id_bytes)));
        Ok(Self { scheme, block_tokens, model_fingerprint, extra_keys_digest, root, id })
    }

    /// The key scheme of every chain in this namespace.
    pub fn scheme(&self) -> KeyScheme {
        self.scheme
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// The model fingerprint this namespace was built with.
    pub fn model_fingerprint(&self) -> &Digest32 {
        &self.model_fingerprint
    }

    /// The extra-keys digest this namespace was built with.
    pub fn extra_keys_digest(&self) -> &Digest32 {
        &self.extra_keys_digest
    }

    /// The chaining value of the empty prefix: DESIGN's `key(0)`.
    pub fn root(&self) -> &Digest32 {
        &self.root
    }

    /// The namespace's public 64-bit id.
    pub fn id(&self) -> NamespaceId {
        self.id
    }
}

fn first_8(bytes: &[u8; 32]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[..8]);
    out
}

/// Length-framed digest of several parts, so ("ab", "c") ≠ ("a", "bc").
fn digest_parts(context: &str, parts: &[&[u8]]) -> Digest32 {
    let mut hasher = blake3::Hasher::new_derive_key(context);
    for part in parts {
        update_framed(&mut hasher, part);
    }
    *hasher.finalize().as_bytes()
}

fn update_framed(hasher: &mut blake3::Hasher, part: &[u8]) {
    hasher.update(&(part.len() as u64).to_le_bytes());
    hasher.update(part);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> Digest32 {
        ModelIdentity {
            weights_revision: "qwen3-8b@1a2b",
            tokenizer: "qwen3@1a2b",
            kv_dtype: "bfloat16",
            kv_scales: &[],
        }
        .fingerprint()
    }

    #[test]
    fn framing_separates_parts() {
        let a = ExtraKeys { lora: "ab", cache_salt: "c", other: &[] }.digest();
        let b = ExtraKeys { lora: "a", cache_salt: "bc", other: &[] }.digest();
        assert_ne!(a, b);
        let c = ExtraKeys { lora: "", cache_salt: "", other: &[b"x", b"y"] }.digest();
        let d = ExtraKeys { lora: "", cache_salt: "", other: &[b"xy"] }.digest();
        assert_ne!(c, d);
    }

    #[test]
    fn every_part_changes_the_root() {
        let tenant = TenantKey([7; 32]);
        let extra = ExtraKeys::default().digest();
        let base = Namespace::new(&tenant, KeyScheme::TokenIdsV1, 16, model(), extra).unwrap();
        let other_tenant = Namespace::new(&TenantKey([8; 32]), KeyScheme::TokenIdsV1, 16, model(), extra).unwrap();
        let other_scheme = Namespace::new(&tenant, KeyScheme::EngineHashV1, 16, model(), extra).unwrap();
        let other_block = Namespace::new(&tenant, KeyScheme::TokenIdsV1, 32, model(), extra).unwrap();
        let other_model = Namespace::new(&tenant, KeyScheme::TokenIdsV1, 16, [1; 32], extra).unwrap();
        let salted = ExtraKeys { cache_salt: "s", ..ExtraKeys::default() }.digest();
        let other_extra = Namespace::new(&tenant, KeyScheme::TokenIdsV1, 16, model(), salted).unwrap();
        let all = [base, other_tenant, other_scheme, other_block, other_model, other_extra];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a.root(), b.root());
                assert_ne!(a.id(), b.id());
            }
        }
    }

    #[test]
    fn bad_parameters_are_errors() {
        let tenant = TenantKey([0; 32]);
        assert_eq!(
            Namespace::new(&tenant, KeyScheme::TokenIdsV1, 0, [0; 32], [0; 32]),
            Err(NamespaceError::BlockTokens(0))
        );
        assert_eq!(KeyScheme::from_u32(9), Err(NamespaceError::UnknownKeyScheme(9)));
        assert!(format!("{:?}", tenant).contains(".."));
    }
}
