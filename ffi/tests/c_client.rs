//! A C program built with `cc` against the generated header and the
//! library attaches to a pool this test starts (`lake-cp` and a `lake-dp`
//! runner with an attach socket, each on a thread), saves blocks from its
//! own memory, finds them in the mirror, loads them back and checks the
//! bytes; bad arguments get errors. See `tests/c/pool_client.c`.

use std::path::{Path, PathBuf};
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

/// Builds `tests/c/pool_client.c` of the source tree `root` against its
/// header and the library in `library`, and runs it against `pool`: it
/// must say OK.
fn run_client(pool: &EmbeddedPool, root: &Path, library: &Path) {
    let program = pool.dir.join("pool_client");
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
    // The library named, not one the test harness's library path (this
    // build's target directory, ahead of the program's run path) finds.
    let run = Command::new(&program)
        .env("LD_LIBRARY_PATH", library)
        .arg(&pool.dp_socket)
        .arg(&pool.mirror)
        .arg(&pool.cp_socket)
        .arg(BLOCK_BYTES.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success() && stdout.contains("OK"), "the C engine failed:\n{stdout}\n{stderr}");
}

fn start(name: &str) -> EmbeddedPool {
    EmbeddedPool::start(&EmbeddedConfig {
        block_bytes: BLOCK_BYTES,
        l1_slots: 64,
        l2_slots_per_file: 32,
        remote_agents: 4,
        ..EmbeddedConfig::new(std::env::temp_dir().join(format!("lake-ffi-c-{name}-{}", std::process::id())))
    })
    .unwrap()
}

#[test]
fn a_c_engine_saves_looks_up_and_loads_through_the_header() {
    if Command::new("cc").arg("--version").output().is_err() {
        println!("SKIPPED: no C compiler (cc) on this machine");
        return;
    }
    let library = library_dir();
    assert!(library.join("liblake.so").exists(), "no liblake.so in {}", library.display());
    let pool = start("now");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    run_client(&pool, &root, &library);
    let (stats, _server) = pool.stop().unwrap();
    // Four attaches (the raw blocks, the paged KV memory, one refused once
    // the arena said its blocks fit no L1 class, the same heads under
    // another geometry): 8 + 3 saves.
    assert_eq!(stats.agents_attached, 4);
    assert_eq!(stats.pool.saves, 11);
}

/// Rolling upgrade, the agent a release behind: the previous release's
/// library (`liblake.so` built from `tests/previous-release`'s commit,
/// `LAKE_PREVIOUS_FFI` its directory) and its own C engine and header
/// (`LAKE_PREVIOUS_SRC`, that commit's tree) against this build's
/// `lake-cp` and `lake-dp`: the same saves, lookups, loads and refusals.
/// `.ci/run` builds both; without them it says SKIPPED and why.
#[test]
fn the_previous_releases_c_engine_and_library_work_against_this_pool() {
    let (Some(library), Some(root)) = (std::env::var_os("LAKE_PREVIOUS_FFI"), std::env::var_os("LAKE_PREVIOUS_SRC"))
    else {
        println!(
            "SKIPPED: LAKE_PREVIOUS_FFI and LAKE_PREVIOUS_SRC name no previous release's library (.ci/run builds one)"
        );
        return;
    };
    if Command::new("cc").arg("--version").output().is_err() {
        println!("SKIPPED: no C compiler (cc) on this machine");
        return;
    }
    let (library, root) = (PathBuf::from(library), PathBuf::from(root));
    assert!(library.join("liblake.so").is_file(), "no liblake.so in {}", library.display());
    assert!(root.join("tests/c/pool_client.c").is_file(), "no tests/c/pool_client.c in {}", root.display());
    let pool = start("previous");
    run_client(&pool, &root, &library);
    let (stats, _server) = pool.stop().unwrap();
    assert!(stats.agents_attached >= 1 && stats.pool.saves > 0, "{stats:?}");
    assert_eq!(stats.pool.requests_invalid, 0, "the old agent sent nothing this data plane refused: {stats:?}");
}
