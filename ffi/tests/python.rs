//! The Python binding's pytest suite (`ffi/python/tests`), run against
//! real pools this test starts: a main one, and one the suite asks to
//! stop (by writing a file) to see an agent whose `lake-dp` went away.
//! Skips, saying why, where python3 with numpy and pytest is missing
//! (`.ci/run` installs them); inside the suite only the tests that need
//! torch may skip (it is not installable on the CI machines).

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lake_dp::wire::hello::HELLO_WIRE_VERSION;
use lake_dp::wire::message::{ErrorBody, ErrorCode, text_field};
use lake_dp::wire::{FLAG_REPLY, FrameMeta, Message, encode_frame};

use lake_cp::embedded::{EmbeddedConfig, EmbeddedPool};

const BLOCK_BYTES: u64 = 16 * 1024;

/// The directory holding `liblake.so` for this build: beside this test in
/// `deps/` (where `cargo test` leaves it), or the profile directory above
/// (where `cargo build` puts it).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    if deps.join("liblake.so").exists() { deps } else { deps.parent().unwrap().to_path_buf() }
}

/// A daemon from the future: it answers every hello the way a `lake-dp`
/// that shares no wire version with this library does (an `Error` frame
/// naming `VersionMismatch`), so the suite can see the library report it.
fn future_daemon(path: &Path) {
    let listener = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut hello = [0u8; 512];
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = stream.read(&mut hello);
            let body = ErrorBody {
                code: ErrorCode::VersionMismatch as u32,
                reserved: 0,
                failed_request: 0,
                detail: text_field("detail", "wire versions 200..=201 only").unwrap(),
            };
            let meta = FrameMeta { version: HELLO_WIRE_VERSION, flags: FLAG_REPLY, request_id: 0, leader_term: 0 };
            let mut frame = [0u8; 256];
            let len = encode_frame(meta, &Message::Error(body), &mut frame).unwrap();
            let _ = std::io::Write::write_all(&mut stream, &frame[..len]);
        }
    });
}

fn config(dir: PathBuf) -> EmbeddedConfig {
    EmbeddedConfig {
        block_bytes: BLOCK_BYTES,
        l1_slots: 256,
        l2_slots_per_file: 256,
        remote_agents: 32,
        ..EmbeddedConfig::new(dir)
    }
}

/// A pool holding the suite's tenant 9 (`namespace(9)` in
/// `test_binding.py`) to 4 blocks of L1.
fn quota_config(dir: PathBuf) -> EmbeddedConfig {
    let tenant =
        lake_dp::Namespace::new(&lake_dp::TenantKey([9; 32]), lake_dp::KeyScheme::TokenIdsV1, 16, [3; 32], [0; 32])
            .unwrap();
    let mut config = config(dir);
    config.tiers.tenant_quotas = vec![lake_cp::tier::TenantQuota {
        tenant: "nine".into(),
        namespaces: vec![tenant.id().0],
        tier: lake_dp::Tier::L1Dram,
        bytes: 4 * lake_dp::stored::object_bytes(BLOCK_BYTES),
    }];
    config
}

#[test]
fn the_python_binding_passes_its_suite_against_a_real_pool() {
    let probe = Command::new("python3").args(["-c", "import numpy, pytest"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("SKIPPED: python3 with numpy and pytest is not installed (pip install numpy pytest)");
        return;
    }
    let library = library_dir().join("liblake.so");
    assert!(library.exists(), "no {}", library.display());
    let pid = std::process::id();
    let root = std::env::temp_dir().join(format!("lake-ffi-py-{pid}"));
    let pool = EmbeddedPool::start(&EmbeddedConfig {
        metrics: Some(lake_cp::embedded::METRICS_ANY_LOCAL_PORT),
        ..config(root.join("main"))
    })
    .unwrap();
    let metrics = pool.metrics.unwrap();
    let future = root.join("future-dp.sock");
    future_daemon(&future);
    let doomed = EmbeddedPool::start(&config(root.join("doomed"))).unwrap();
    let small = EmbeddedPool::start(&EmbeddedConfig { l1_slots: 16, ..config(root.join("small")) }).unwrap();
    // A pool that began to stop: it takes no save (L1 is being written
    // down), and says so.
    let mut closed = EmbeddedPool::start(&config(root.join("closed"))).unwrap();
    closed.empty_l1();
    let quota = EmbeddedPool::start(&quota_config(root.join("quota"))).unwrap();
    let stop_file = root.join("stop-doomed");
    let (doomed_dp, doomed_mirror, doomed_cp) =
        (doomed.dp_socket.clone(), doomed.mirror.clone(), doomed.cp_socket.clone());
    let watcher = {
        let stop_file = stop_file.clone();
        std::thread::spawn(move || {
            for _ in 0..6000 {
                if stop_file.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            drop(doomed.stop());
        })
    };
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python");
    let run = Command::new("python3")
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(source.join("tests"))
        .env("PYTHONPATH", &source)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LAKE_LIBRARY", &library)
        .env("LAKE_DP_SOCKET", &pool.dp_socket)
        .env("LAKE_MIRROR", &pool.mirror)
        .env("LAKE_CP_SOCKET", &pool.cp_socket)
        .env("LAKE_BLOCK_BYTES", BLOCK_BYTES.to_string())
        .env("LAKE_METRICS", metrics.to_string())
        .env("LAKE_FUTURE_DP_SOCKET", &future)
        .env("LAKE_DOOMED_DP_SOCKET", &doomed_dp)
        .env("LAKE_DOOMED_MIRROR", &doomed_mirror)
        .env("LAKE_DOOMED_CP_SOCKET", &doomed_cp)
        .env("LAKE_DOOMED_BLOCK_BYTES", BLOCK_BYTES.to_string())
        .env("LAKE_DOOMED_STOP_FILE", &stop_file)
        .env("LAKE_SMALL_DP_SOCKET", &small.dp_socket)
        .env("LAKE_SMALL_MIRROR", &small.mirror)
        .env("LAKE_SMALL_CP_SOCKET", &small.cp_socket)
        .env("LAKE_SMALL_BLOCK_BYTES", BLOCK_BYTES.to_string())
        .env("LAKE_CLOSED_DP_SOCKET", &closed.dp_socket)
        .env("LAKE_CLOSED_MIRROR", &closed.mirror)
        .env("LAKE_CLOSED_CP_SOCKET", &closed.cp_socket)
        .env("LAKE_CLOSED_BLOCK_BYTES", BLOCK_BYTES.to_string())
        .env("LAKE_QUOTA_DP_SOCKET", &quota.dp_socket)
        .env("LAKE_QUOTA_MIRROR", &quota.mirror)
        .env("LAKE_QUOTA_CP_SOCKET", &quota.cp_socket)
        .env("LAKE_QUOTA_BLOCK_BYTES", BLOCK_BYTES.to_string())
        .output()
        .unwrap();
    let _ = std::fs::write(&stop_file, "done");
    watcher.join().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    drop(pool);
    drop(small);
    drop(closed);
    drop(quota);
    let _ = std::fs::remove_dir_all(&root);
    assert!(run.status.success(), "pytest failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("passed"), "{stdout}");
    // Only what needs torch (absent here, present on the GPU machine) may
    // skip; a skip for a missing pool means the harness is broken.
    for line in stdout.lines().filter(|l| l.starts_with("SKIPPED")) {
        assert!(line.contains("torch"), "unexpected skip: {line}");
    }
    // What ran and what skipped, in the test's output (`--nocapture`),
    // with the figures tests print (shown with PYTEST_ADDOPTS=-rP).
    for line in stdout.lines().filter(|l| l.starts_with("F4:")) {
        println!("{line}");
    }
    println!("pytest: {}", stdout.lines().rev().find(|l| l.contains("passed")).unwrap_or(""));
}
