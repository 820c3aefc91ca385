//! A C program built with `cc` against the generated header and the
//! library attaches to a pool this test starts (`lake-cp` and a `lake-dp`
//! runner with an attach socket, each on a thread), saves blocks from its
//! own memory, finds them in the mirror, loads them back and checks the
//! bytes; bad arguments get errors. See `tests/c/pool_client.c`.

use std::path::PathBuf;
use std::process::Command;

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};

const BLOCK_BYTES: u64 = 32 * 1024;

/// The directory holding `liblake.so` for this build: beside this test in
/// `deps/` (where `cargo test` leaves it), or the profile directory above
/// (where `cargo build` puts it).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    if deps.join("liblake.so").exists() { deps } else { deps.parent().unwrap().to_path_buf() }
}

#[test]
fn a_c_engine_saves_looks_up_and_loads_through_the_header() {
    if Command::new("cc").arg("--version").output().is_err() {
        println!("SKIPPED: no C compiler (cc) on this machine");
        return;
    }
    let library = library_dir();
    assert!(library.join("liblake.so").exists(), "no liblake.so in {}", library.display());
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: BLOCK_BYTES,
        l1_slots: 64,
        l2_slots_per_file: 32,
        remote_agents: 4,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-ffi-c-{}", std::process::id())))
    })
    .unwrap();
    let dir = pool.dir.clone();

    // Build the engine.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let program = dir.join("pool_client");
    let built = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(root.join("ffi/include"))
        .arg(root.join("tests/c/pool_client.c"))
        .arg("-o")
        .arg(&program)
        .arg(format!("-L{}", library.display()))
        .arg("-llake")
        .arg(format!("-Wl,-rpath,{}", library.display()))
        .output()
        .unwrap();
    assert!(built.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&built.stderr));

    let run = Command::new(&program)
        .arg(&pool.dp_socket)
        .arg(&pool.mirror)
        .arg(&pool.cp_socket)
        .arg(BLOCK_BYTES.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success() && stdout.contains("OK"), "the C engine failed:\n{stdout}\n{stderr}");

    let (stats, _server) = pool.stop().unwrap();
    // Three attaches (the raw blocks, the paged KV memory, the same heads
    // under another geometry): 8 + 3 saves.
    assert_eq!(stats.agents_attached, 3);
    assert_eq!(stats.pool.saves, 11);
}
