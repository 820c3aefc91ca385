//! Block keys: a chained, keyed name for a whole prefix.
//!
//! A chain starts at its namespace's root (DESIGN's `key(0)`). Block `i`
//! (0-based) is hashed as `BLAKE3-keyed(key = cv(i-1), message = block i)`,
//! where `cv(-1)` is the root; the full 32-byte output is the next chaining
//! value and its first 16 bytes are the block's [`BlockKey`]. With 16 token
//! ids of 4 bytes each the message is exactly one 64-byte BLAKE3 block: one
//! compression per block.
//!
//! Because a key is a truncation, holding keys (as every mirror reader does)
//! does not let anyone extend a chain: that takes the chaining value, which
//! only the holder of the tokens and the namespace can compute.

use core::fmt;

use bytemuck::{Pod, Zeroable};

use super::namespace::{Digest32, KeyScheme, Namespace};
use crate::constants::ENGINE_HASH_BYTES_MAX;

/// The 128-bit name of a block and, through the chain, of its whole prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
#[repr(transparent)]
pub struct BlockKey(pub [u8; 16]);

impl BlockKey {
    /// The all-zero key, never produced by a chain; used as "no parent".
    pub const NONE: Self = Self([0; 16]);

    /// Whether this is [`BlockKey::NONE`].
    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }

    /// The name of the recurrent-state checkpoint taken after this block
    /// (a hybrid model's Mamba or linear-attention layers carry state, not
    /// KV): an object of its own beside the block. Every bit is flipped,
    /// so it hashes far from the block's key without a second hash.
    pub fn state_key(&self) -> BlockKey {
        BlockKey(self.0.map(|b| !b))
    }
}

/// How the replicas of one shard of a block are named (DESIGN §3: a key
/// names the logical block; a replica holds one shard). A replica of the
/// whole block — every KV head, or an MLA latent every rank holds alike —
/// is indexed under the block's own key. A replica of part of the heads
/// (one tensor-parallel rank's) is an object of its own, indexed under the
/// key XOR a 128-bit mask derived from the shard ([`crate::Layout::shard_code`]):
/// each rank's blocks form their own prefix chain, so a lookup hits only
/// blocks whose bytes that rank can use, and a hit for a whole tensor-
/// parallel group is the shortest of its ranks' hits. XOR keeps it one
/// instruction per key and invertible, so a stored header that names the
/// masked key loses nothing; the mask is a keyed derivation, so masked keys
/// are as unpredictable as the keys themselves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ShardMask([u8; 16]);

/// BLAKE3 derivation context of [`ShardMask`] (part of the key scheme:
/// changing it renames every shard's blocks).
const CONTEXT_SHARD: &str = "lake 2026-11 shard key mask v1";

impl ShardMask {
    /// The whole block: keys as they are.
    pub const WHOLE: Self = Self([0; 16]);

    /// The mask of shard `code` (0: the whole block).
    pub fn from_code(code: u64) -> Self {
        if code == 0 {
            return Self::WHOLE;
        }
        let digest = blake3::derive_key(CONTEXT_SHARD, &code.to_le_bytes());
        let mut mask = [0u8; 16];
        mask.copy_from_slice(&digest[..16]);
        Self(mask)
    }

    /// Whether keys stay as they are.
    pub fn is_whole(&self) -> bool {
        *self == Self::WHOLE
    }

    /// The key this shard's replica of `key` is indexed under;
    /// [`BlockKey::NONE`] ("no parent") stays itself.
    pub fn apply(&self, key: BlockKey) -> BlockKey {
        if key.is_none() {
            return key;
        }
        let mut out = key.0;
        for (byte, mask) in out.iter_mut().zip(self.0) {
            *byte ^= mask;
        }
        BlockKey(out)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// The full 32-byte state after a prefix: what continues a chain.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ChainValue(pub Digest32);

impl fmt::Debug for ChainValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ChainValue(..)")
    }
}

/// Errors extending a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyError {
    /// A token method on an engine-hash chain, or the reverse.
    SchemeMismatch {
        /// The chain's scheme.
        chain: KeyScheme,
    },
    /// A single-block call got a token count other than `block_tokens`.
    BlockLength {
        /// Tokens per block in this namespace.
        expected: u32,
        /// Tokens passed.
        actual: usize,
    },
    /// An engine page hash was empty or longer than
    /// [`ENGINE_HASH_BYTES_MAX`].
    EngineHashLength(usize),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SchemeMismatch { chain } => {
                write!(f, "key chain uses scheme {chain:?}; this call needs the other")
            }
            Self::BlockLength { expected, actual } => {
                write!(f, "a block has {expected} tokens, got {actual}")
            }
            Self::EngineHashLength(n) => {
                write!(f, "engine page hash of {n} bytes; expected 1..={ENGINE_HASH_BYTES_MAX}")
            }
        }
    }
}

impl std::error::Error for KeyError {}

/// The bytes a block of token ids is hashed as: little-endian `u32`s. On
/// every supported target (see the `compile_error!` in the crate root) that
/// is the slice's own memory, so this is a free cast.
pub fn token_bytes(tokens: &[u32]) -> &[u8] {
    bytemuck::cast_slice(tokens)
}

/// The key of a page named by an engine hash that already covers its whole
/// prefix (namespace scheme [`KeyScheme::EnginePrefixHashV1`]): one keyed
/// BLAKE3 of the page hash under the namespace root, truncated to 128 bits.
/// Lake adds no chaining of its own — the engine's hash is the chain — so a
/// page's key needs nothing but its hash, and a tenant's keys stay
/// unguessable to another tenant even when the engine hashes without a key.
pub fn engine_prefix_key(namespace: &Namespace, page_hash: &[u8]) -> Result<BlockKey, KeyError> {
    if namespace.scheme() != KeyScheme::EnginePrefixHashV1 {
        return Err(KeyError::SchemeMismatch { chain: namespace.scheme() });
    }
    if page_hash.is_empty() || page_hash.len() > ENGINE_HASH_BYTES_MAX {
        return Err(KeyError::EngineHashLength(page_hash.len()));
    }
    let hash = blake3::keyed_hash(namespace.root(), page_hash);
    let mut key = [0u8; 16];
    key.copy_from_slice(&hash.as_bytes()[..16]);
    Ok(BlockKey(key))
}

/// An incremental key chain over one namespace. Extending a prefix hashes
/// only the new blocks; [`KeyChain::resume`] continues a chain saved earlier.
#[derive(Clone, Debug)]
pub struct KeyChain {
    scheme: KeyScheme,
    block_tokens: u32,
    cv: ChainValue,
    blocks: u64,
}

impl KeyChain {
    /// A chain at the empty prefix of `namespace`.
    pub fn new(namespace: &Namespace) -> Self {
        Self::resume(namespace, ChainValue(*namespace.root()), 0)
    }

    /// A chain continuing after `blocks` blocks whose chaining value is `cv`.
    pub fn resume(namespace: &Namespace, cv: ChainValue, blocks: u64) -> Self {
        Self { scheme: namespace.scheme(), block_tokens: namespace.block_tokens(), cv, blocks }
    }

    /// Blocks hashed so far.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Tokens per block.
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }

    /// The chaining value after the last block hashed.
    pub fn chain_value(&self) -> ChainValue {
        self.cv
    }

    /// Hashes the full blocks at the front of `tokens`, at most `out.len()`
    /// of them, writing their keys to `out`. Returns how many blocks were
    /// hashed; the caller keeps `tokens[n * block_tokens..]` for later.
    pub fn extend_tokens(&mut self, tokens: &[u32], out: &mut [BlockKey]) -> Result<usize, KeyError> {
        self.expect_scheme(KeyScheme::TokenIdsV1)?;
        let block_tokens = self.block_tokens as usize;
        let mut hashed = 0;
        for (block, key) in tokens.chunks_exact(block_tokens).zip(out.iter_mut()) {
            *key = self.step(blake3::keyed_hash(&self.cv.0, token_bytes(block)));
            hashed += 1;
        }
        Ok(hashed)
    }

    /// Hashes exactly one block whose positions carry extra key material
    /// (for example the hash of an image whose placeholder tokens it holds),
    /// so equal placeholder tokens with different images get different keys.
    pub fn extend_block_with_extra(&mut self, block: &[u32], extra: &Digest32) -> Result<BlockKey, KeyError> {
        self.expect_scheme(KeyScheme::TokenIdsV1)?;
        if block.len() != self.block_tokens as usize {
            return Err(KeyError::BlockLength { expected: self.block_tokens, actual: block.len() });
        }
        let mut hasher = blake3::Hasher::new_keyed(&self.cv.0);
        hasher.update(token_bytes(block));
        hasher.update(extra);
        Ok(self.step(hasher.finalize()))
    }

    /// Hashes one block named by the engine's own page hash (SGLang hands
    /// over a SHA-256 chain per page). The engine's chain is re-keyed by
    /// ours, so tenants stay apart even when engines hash without a key.
    pub fn extend_engine_hash(&mut self, page_hash: &[u8]) -> Result<BlockKey, KeyError> {
        self.expect_scheme(KeyScheme::EngineHashV1)?;
        if page_hash.is_empty() || page_hash.len() > ENGINE_HASH_BYTES_MAX {
            return Err(KeyError::EngineHashLength(page_hash.len()));
        }
        Ok(self.step(blake3::keyed_hash(&self.cv.0, page_hash)))
    }

    /// Convenience for callers off the hot path: every full block's key.
    pub fn keys(namespace: &Namespace, tokens: &[u32]) -> Result<Vec<BlockKey>, KeyError> {
        let mut chain = Self::new(namespace);
        let mut keys = vec![BlockKey::NONE; tokens.len() / namespace.block_tokens() as usize];
        let hashed = chain.extend_tokens(tokens, &mut keys)?;
        debug_assert_eq!(hashed, keys.len());
        Ok(keys)
    }

    fn expect_scheme(&self, needed: KeyScheme) -> Result<(), KeyError> {
        if self.scheme == needed { Ok(()) } else { Err(KeyError::SchemeMismatch { chain: self.scheme }) }
    }

    #[inline]
    fn step(&mut self, output: blake3::Hash) -> BlockKey {
        let bytes = output.as_bytes();
        self.cv = ChainValue(*bytes);
        self.blocks += 1;
        let mut key = [0u8; 16];
        key.copy_from_slice(&bytes[..16]);
        BlockKey(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::namespace::{ExtraKeys, TenantKey};

    fn namespace(tenant: u8, scheme: KeyScheme) -> Namespace {
        Namespace::new(&TenantKey([tenant; 32]), scheme, 16, [3; 32], ExtraKeys::default().digest()).unwrap()
    }

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).map(|i| i.wrapping_mul(2_654_435_761) % 151_936).collect()
    }

    #[test]
    fn one_block_is_one_keyed_hash_of_the_token_bytes() {
        let ns = namespace(1, KeyScheme::TokenIdsV1);
        let toks = tokens(16);
        let keys = KeyChain::keys(&ns, &toks).unwrap();
        let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        let expected = blake3::keyed_hash(ns.root(), &bytes);
        assert_eq!(keys[0].0, expected.as_bytes()[..16]);
    }

    #[test]
    fn partial_blocks_and_short_outputs_stop_early() {
        let ns = namespace(1, KeyScheme::TokenIdsV1);
        let mut chain = KeyChain::new(&ns);
        let mut out = [BlockKey::NONE; 8];
        assert_eq!(chain.extend_tokens(&tokens(47), &mut out).unwrap(), 2);
        let mut chain = KeyChain::new(&ns);
        assert_eq!(chain.extend_tokens(&tokens(160), &mut out[..3]).unwrap(), 3);
        assert_eq!(chain.blocks(), 3);
    }

    #[test]
    fn resume_continues_the_same_chain() {
        let ns = namespace(1, KeyScheme::TokenIdsV1);
        let toks = tokens(64);
        let all = KeyChain::keys(&ns, &toks).unwrap();
        let mut first = KeyChain::new(&ns);
        let mut out = [BlockKey::NONE; 2];
        first.extend_tokens(&toks[..32], &mut out).unwrap();
        let mut resumed = KeyChain::resume(&ns, first.chain_value(), first.blocks());
        resumed.extend_tokens(&toks[32..], &mut out).unwrap();
        assert_eq!(out, all[2..]);
        assert_eq!(resumed.blocks(), 4);
    }

    #[test]
    fn extra_material_changes_only_its_block_onward() {
        let ns = namespace(1, KeyScheme::TokenIdsV1);
        let toks = tokens(32);
        let plain = KeyChain::keys(&ns, &toks).unwrap();
        let mut chain = KeyChain::new(&ns);
        let mut out = [BlockKey::NONE; 1];
        chain.extend_tokens(&toks[..16], &mut out).unwrap();
        assert_eq!(out[0], plain[0]);
        let image_a = chain.clone().extend_block_with_extra(&toks[16..], &[1; 32]).unwrap();
        let image_b = chain.clone().extend_block_with_extra(&toks[16..], &[2; 32]).unwrap();
        assert_ne!(image_a, image_b);
        assert_ne!(image_a, plain[1]);
        assert_eq!(
            chain.extend_block_with_extra(&toks[..5], &[1; 32]),
            Err(KeyError::BlockLength { expected: 16, actual: 5 })
        );
    }

    #[test]
    fn schemes_do_not_mix() {
        let tokens_ns = namespace(1, KeyScheme::TokenIdsV1);
        let hash_ns = namespace(1, KeyScheme::EngineHashV1);
        let mut out = [BlockKey::NONE; 1];
        assert!(KeyChain::new(&hash_ns).extend_tokens(&tokens(16), &mut out).is_err());
        assert!(KeyChain::new(&tokens_ns).extend_engine_hash(&[1; 32]).is_err());
        let mut chain = KeyChain::new(&hash_ns);
        assert_eq!(chain.extend_engine_hash(&[]), Err(KeyError::EngineHashLength(0)));
        assert_eq!(chain.extend_engine_hash(&[0; 65]), Err(KeyError::EngineHashLength(65)));
        let prefix_ns = namespace(1, KeyScheme::EnginePrefixHashV1);
        assert!(KeyChain::new(&prefix_ns).extend_tokens(&tokens(16), &mut out).is_err());
        assert!(engine_prefix_key(&hash_ns, &[9; 32]).is_err(), "a chained namespace is not a prefix-hash one");
        assert_eq!(engine_prefix_key(&prefix_ns, &[]), Err(KeyError::EngineHashLength(0)));
        let page = engine_prefix_key(&prefix_ns, &[9; 32]).unwrap();
        assert_eq!(page.0, blake3::keyed_hash(prefix_ns.root(), &[9; 32]).as_bytes()[..16]);
        assert_eq!(page, engine_prefix_key(&prefix_ns, &[9; 32]).unwrap(), "a page alone names its key");
        assert_ne!(page, engine_prefix_key(&namespace(2, KeyScheme::EnginePrefixHashV1), &[9; 32]).unwrap());
        let a = chain.extend_engine_hash(&[9; 32]).unwrap();
        let b = chain.extend_engine_hash(&[9; 32]).unwrap();
        assert_ne!(a, b, "the same page hash at two depths names two prefixes");
    }
}
