//! The same namespace gives the same keys in every process (no per-process
//! hash seed: the failure that gives peers zero cross-instance hits), and
//! different tenants or models never share a key.

use std::process::Command;

use lake_dp::KeyChain;

fn keys_from_child(tenant: u8, revision: &str, tokens: u32, env: (&str, &str)) -> Vec<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_lake-keys-print"))
        .args([tenant.to_string(), revision.to_owned(), tokens.to_string()])
        // Different environments (and address-space layouts) per child.
        .env(env.0, env.1)
        .output()
        .expect("start lake-keys-print");
    assert!(output.status.success(), "child failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("utf-8").lines().map(str::to_owned).collect()
}

#[test]
fn two_processes_agree_with_each_other_and_with_this_one() {
    let a = keys_from_child(1, "rev-a", 256, ("PYTHONHASHSEED", "1"));
    let b = keys_from_child(1, "rev-a", 256, ("PYTHONHASHSEED", "2"));
    assert_eq!(a.len(), 16);
    assert_eq!(a, b);
    let here: Vec<String> = KeyChain::keys(&lake_tests::namespace_from(1, "rev-a", "", ""), &lake_tests::prompt(256))
        .unwrap()
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(a, here);
}

#[test]
fn tenants_and_models_split_in_other_processes_too() {
    let base = keys_from_child(1, "rev-a", 64, ("X", "1"));
    let other_tenant = keys_from_child(2, "rev-a", 64, ("X", "1"));
    let other_model = keys_from_child(1, "rev-b", 64, ("X", "1"));
    for (i, key) in base.iter().enumerate() {
        assert_ne!(key, &other_tenant[i]);
        assert_ne!(key, &other_model[i]);
    }
}
