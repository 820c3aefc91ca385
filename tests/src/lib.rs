//! `lake-tests` holds Lake's multi-process tests (in `tests/tests/`) and the
//! small helper programs they start (in `src/bin/`): processes that talk to
//! each other through the real formats, files and sockets.

#![warn(missing_docs)]

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
