//! Real, unmodified vLLM (its CPU build) with `lake.vllm.LakeConnector`
//! against a real `lake serve`: the pytest suite in `ffi/python/tests_vllm`,
//! run in the venv `.ci/vllm-venv` makes (`~/.cache/lake-vllm`, or
//! `LAKE_VLLM_VENV`). Every vLLM runs in a process of its own and every
//! output is compared bitwise with vLLM alone. Skips, saying why, where
//! the venv is not made; in CI (`CI` set), where `.ci/run` makes it, that
//! is a failure.

use std::path::PathBuf;
use std::process::Command;

/// The directory holding `liblake.so` for this build: `deps/` beside this
/// test, or the profile directory above it.
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let found = [deps.join("liblake.so"), deps.parent().unwrap().join("liblake.so")].into_iter().find(|p| p.exists());
    found.unwrap_or_else(|| panic!("no liblake.so beside {}: build lake-ffi", deps.display()))
}

fn venv() -> PathBuf {
    std::env::var_os("LAKE_VLLM_VENV").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/lake-vllm"),
        PathBuf::from,
    )
}

#[test]
fn real_vllm_gets_exact_kv_from_the_pool() {
    let venv = venv();
    let python = venv.join("bin/python");
    if !venv.join(".lake-ready").exists() {
        assert!(std::env::var_os("CI").is_none(), "no vLLM venv at {}: .ci/run makes it", venv.display());
        println!("SKIPPED: no vLLM venv at {} (make it with .ci/vllm-venv)", venv.display());
        return;
    }
    let suite = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../ffi/python/tests_vllm");
    let run = Command::new(&python)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-s"])
        .arg(&suite)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PYTHONPATH", suite.join(".."))
        .env("LAKE_BIN", env!("CARGO_BIN_EXE_lake"))
        .env("LAKE_LIBRARY", library())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "the real-vLLM suite failed:\n{stdout}\n{stderr}");
    let summary = stdout.lines().rev().find(|l| l.contains("passed")).unwrap_or("");
    assert!(!summary.contains("skipped"), "nothing may skip here: {summary}\n{stdout}");
    for line in stdout.lines().filter(|l| l.starts_with("engine-") || l.starts_with("vllm:")) {
        println!("{line}");
    }
    println!("pytest: {summary}");
}
