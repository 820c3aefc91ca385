//! Committed test vectors for the key chain, namespace ids and layout
//! fingerprints. These values are the key scheme: if a change alters any of
//! them, every stored block becomes unreachable, so that change must bump
//! the key-scheme or layout version instead. Other implementations (the
//! Python binding, a peer in another language) check against the same file.
//!
//! To regenerate after a deliberate version bump:
//! `LAKE_UPDATE_VECTORS=1 cargo test -p lake-dp --test vectors`.

use std::fmt::Write as _;

use lake_dp::model::layout::LayoutParams;
use lake_dp::{
    Dtype, ExtraKeys, KeyChain, KeyScheme, KvPlanes, Layout, ModelIdentity, Namespace, RecurrentLayout, Shard,
    ShardMask, TenantKey, engine_prefix_key, shard_code,
};

const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/vectors/v1.txt");

fn namespaces() -> Vec<(&'static str, Namespace)> {
    let model = |revision: &str| {
        ModelIdentity { weights_revision: revision, tokenizer: "qwen3-tokenizer", kv_dtype: "bfloat16", kv_scales: &[] }
            .fingerprint()
    };
    let plain = ExtraKeys::default().digest();
    let lora = ExtraKeys { lora: "sql-adapter", cache_salt: "", other: &[] }.digest();
    let make = |tenant: u8, scheme, block_tokens, revision: &str, extra| {
        Namespace::new(&TenantKey([tenant; 32]), scheme, block_tokens, model(revision), extra).unwrap()
    };
    vec![
        ("tenant0.qwen3-8b.bt16", make(0, KeyScheme::TokenIdsV1, 16, "Qwen/Qwen3-8B@main", plain)),
        ("tenant1.qwen3-8b.bt16", make(1, KeyScheme::TokenIdsV1, 16, "Qwen/Qwen3-8B@main", plain)),
        ("tenant0.qwen3-8b-rev2.bt16", make(0, KeyScheme::TokenIdsV1, 16, "Qwen/Qwen3-8B@rev2", plain)),
        ("tenant0.qwen3-8b.bt16.lora", make(0, KeyScheme::TokenIdsV1, 16, "Qwen/Qwen3-8B@main", lora)),
        ("tenant0.qwen3-8b.bt32", make(0, KeyScheme::TokenIdsV1, 32, "Qwen/Qwen3-8B@main", plain)),
        ("tenant0.qwen3-8b.enginehash", make(0, KeyScheme::EngineHashV1, 64, "Qwen/Qwen3-8B@main", plain)),
        ("tenant0.qwen3-8b.engineprefix", make(0, KeyScheme::EnginePrefixHashV1, 64, "Qwen/Qwen3-8B@main", plain)),
    ]
}

fn layouts() -> Vec<(&'static str, u64)> {
    let qwen = |shard| {
        Layout::new(LayoutParams {
            layers: 36,
            planes: KvPlanes::KeyValue,
            kv_heads: 8,
            shard,
            head_dim: 128,
            dtype: Dtype::Bf16,
            block_tokens: 16,
            layers_per_segment: 1,
        })
        .unwrap()
    };
    let deepseek = Layout::new(LayoutParams {
        layers: 61,
        planes: KvPlanes::Latent,
        kv_heads: 1,
        shard: Shard::Replicated,
        head_dim: 576,
        dtype: Dtype::Bf16,
        block_tokens: 64,
        layers_per_segment: 1,
    })
    .unwrap();
    let fp8 = Layout::new(LayoutParams {
        layers: 80,
        planes: KvPlanes::KeyValue,
        kv_heads: 8,
        shard: Shard::Heads { start: 0, end: 8 },
        head_dim: 128,
        dtype: Dtype::Fp8E4m3,
        block_tokens: 16,
        layers_per_segment: 4,
    })
    .unwrap();
    let mamba = RecurrentLayout::new(48, 1 << 20, Dtype::F32, Shard::Replicated, 1).unwrap();
    vec![
        ("layout.qwen3-8b.tp1", qwen(Shard::Heads { start: 0, end: 8 }).fingerprint()),
        ("layout.qwen3-8b.tp2-rank0", qwen(Shard::Heads { start: 0, end: 4 }).fingerprint()),
        ("layout.qwen3-8b.tp2-rank1", qwen(Shard::Heads { start: 4, end: 8 }).fingerprint()),
        ("layout.deepseek-v3.mla", deepseek.fingerprint()),
        ("layout.llama70b-fp8.groups4", fp8.fingerprint()),
        ("layout.recurrent.48x1MiB", mamba.fingerprint()),
    ]
}

/// The prompt every vector hashes: token id `i * 7919 mod 151936`.
fn prompt(tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| i * 7919 % 151_936).collect()
}

fn render() -> String {
    let mut out = String::from(
        "# Lake key scheme and layout fingerprint test vectors, v1.\n\
         # Tenant key: 32 bytes of the tenant byte. Model fingerprint: ModelIdentity\n\
         # {weights_revision, tokenizer \"qwen3-tokenizer\", kv_dtype \"bfloat16\", no scales}.\n\
         # Prompt: token i = i * 7919 mod 151936, 48 tokens. Engine-hash pages: 32 bytes of\n\
         # the page number + 1. Keys are hex; block i on its own line.\n",
    );
    for (name, namespace) in namespaces() {
        let _ = writeln!(out, "{name}.namespace_id {:016x}", namespace.id().0);
        let _ = writeln!(out, "{name}.root {}", hex(namespace.root()));
        let keys = match namespace.scheme() {
            KeyScheme::TokenIdsV1 => KeyChain::keys(&namespace, &prompt(48)).unwrap(),
            KeyScheme::EngineHashV1 => {
                let mut chain = KeyChain::new(&namespace);
                (0u8..3).map(|page| chain.extend_engine_hash(&[page + 1; 32]).unwrap()).collect()
            }
            KeyScheme::EnginePrefixHashV1 => {
                (0u8..3).map(|page| engine_prefix_key(&namespace, &[page + 1; 32]).unwrap()).collect()
            }
        };
        for (i, key) in keys.iter().enumerate() {
            let _ = writeln!(out, "{name}.key{i} {key}");
        }
    }
    for (name, fingerprint) in layouts() {
        let _ = writeln!(out, "{name} {fingerprint:016x}");
    }
    // A tensor-parallel rank's replica of tenant 0's first block (8 heads,
    // two ranks): the shard codes and the keys they are indexed under.
    let first = KeyChain::keys(&namespaces()[0].1, &prompt(16)).unwrap()[0];
    for (name, start, end) in [("shard.8heads.0-4", 0, 4), ("shard.8heads.4-8", 4, 8)] {
        let code = shard_code(8, start, end).unwrap();
        let _ = writeln!(out, "{name}.code {code:016x}");
        let _ = writeln!(out, "{name}.key0 {}", ShardMask::from_code(code).apply(first));
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn vectors_match_the_committed_file() {
    let actual = render();
    if std::env::var_os("LAKE_UPDATE_VECTORS").is_some() {
        std::fs::write(VECTORS, &actual).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(VECTORS).expect("committed vectors file");
    for (want, got) in committed.lines().zip(actual.lines()) {
        assert_eq!(got, want, "a key-scheme or layout vector changed");
    }
    assert_eq!(committed.lines().count(), actual.lines().count());
}

#[test]
fn committed_vectors_show_the_promised_separations() {
    let committed = std::fs::read_to_string(VECTORS).expect("committed vectors file");
    let value = |name: &str| {
        committed
            .lines()
            .find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
            .unwrap_or_else(|| panic!("{name} missing"))
            .to_owned()
    };
    let base = "tenant0.qwen3-8b.bt16";
    for other in ["tenant1.qwen3-8b.bt16", "tenant0.qwen3-8b-rev2.bt16", "tenant0.qwen3-8b.bt16.lora"] {
        for i in 0..3 {
            assert_ne!(value(&format!("{base}.key{i}")), value(&format!("{other}.key{i}")));
        }
    }
    assert_ne!(value("layout.qwen3-8b.tp2-rank0"), value("layout.qwen3-8b.tp2-rank1"));
    // Each rank's replica is named apart from the block and from the other.
    let block = value(&format!("{base}.key0"));
    let (rank0, rank1) = (value("shard.8heads.0-4.key0"), value("shard.8heads.4-8.key0"));
    assert!(rank0 != block && rank1 != block && rank0 != rank1);
    // Extending the prompt reproduces the earlier keys.
    let namespace = &namespaces()[0].1;
    let longer = KeyChain::keys(namespace, &prompt(48 + 160)).unwrap();
    for (i, key) in longer.iter().take(3).enumerate() {
        assert_eq!(key.to_string(), value(&format!("{base}.key{i}")));
    }
}
