//! The Python package as a user installs it: the wheel `pip wheel
//! ffi/python` builds (`lake-kv`, carrying `liblake.so`), made a manylinux
//! wheel by `auditwheel repair` (as it is published), installed into a
//! new venv outside the checkout, imported from a directory that is not
//! the checkout with no `LAKE_LIBRARY` and no `PYTHONPATH`, against a real
//! `lake serve`: blocks saved and loaded back exact. Skips, saying why,
//! where python3 with numpy and pip is missing; in CI (`CI` set) that is
//! a failure. The wheel build fetches setuptools into pip's isolated
//! build environment (the registry must be reachable).

use std::path::PathBuf;
use std::process::Command;

/// This build's `liblake.so`: `deps/` beside this test, or the profile
/// directory above it.
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let found = [deps.join("liblake.so"), deps.parent().unwrap().join("liblake.so")].into_iter().find(|p| p.exists());
    found.unwrap_or_else(|| panic!("no liblake.so beside {}: build lake-ffi", deps.display()))
}

/// What the user runs after `pip install lake-kv`, in a directory of its own.
const USER_SCRIPT: &str = r#"
import os, subprocess, sys, time, json
from pathlib import Path
import numpy as np
import lake

here = Path(sys.argv[1])
assert "LAKE_LIBRARY" not in os.environ
assert Path(lake.__file__).resolve().is_relative_to(here / "venv"), lake.__file__
library = lake._find_library()
assert Path(library).resolve() == (Path(lake.__file__).parent / "liblake.so").resolve(), library

pool_dir = here / "pool"
serve = subprocess.Popen([os.environ["LAKE_BIN"], "serve", "--dir", str(pool_dir), "--metrics", "127.0.0.1:0",
                          "--block-bytes", "16KiB", "--l1-slots", "64", "--l2-slots", "64"],
                         stdout=subprocess.PIPE, text=True)
try:
    assert json.loads(serve.stdout.readline())["event"] == "serving"
    record = lake.pool_record(str(pool_dir))
    ns = lake.Namespace(bytes([9]) * 32, 16, bytes([4]) * 32)
    keys = ns.keys(np.arange(8 * 16, dtype=np.uint32))
    with lake.Pool(record["dp_socket"], record["mirror"], ns, cp_socket=record["cp_socket"]) as pool:
        memory = np.zeros((16, 16384), dtype=np.uint8)
        memory[:8] = np.random.default_rng(5).integers(0, 256, (8, 16384), dtype=np.uint8)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(8)), 8) == 0).all()
        deadline = time.monotonic() + 10
        while (hits := pool.lookup(keys))[0] < 8:
            assert time.monotonic() < deadline, "never published"
            time.sleep(0.01)
        assert (pool.wait(pool.submit_load(memory_id, keys, hits[1], np.arange(8, 16)), 8) == 0).all()
        assert np.array_equal(memory[8:], memory[:8])
    print("wheel-ok", library)
finally:
    serve.terminate()
    serve.wait(timeout=60)
"#;

#[test]
fn the_wheel_installed_in_a_clean_venv_saves_and_loads() {
    let ready = Command::new("python3").args(["-c", "import numpy, pip, venv"]).output();
    if !ready.is_ok_and(|o| o.status.success()) {
        assert!(std::env::var_os("CI").is_none(), "python3 with numpy and pip: .ci/run installs them");
        println!("SKIPPED: python3 with numpy, pip and venv is not here");
        return;
    }
    let here = std::env::temp_dir().join(format!("lake-wheel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&here);
    std::fs::create_dir_all(&here).unwrap();
    let package = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../ffi/python");
    // The wheel, around this build's library; build/ and the egg-info go
    // where the build puts them, so a copy of the package is built.
    let source = here.join("source");
    copy_tree(&package, &source);
    let built = Command::new("python3")
        .args(["-m", "pip", "wheel", "--no-deps", "-q", "-w"])
        .arg(here.join("dist"))
        .arg(&source)
        .env("LAKE_WHEEL_LIBRARY", library())
        .output()
        .unwrap();
    assert!(built.status.success(), "pip wheel: {}", String::from_utf8_lossy(&built.stderr));
    let wheel = std::fs::read_dir(here.join("dist")).unwrap().map(|e| e.unwrap().path()).next().unwrap();
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("lake_kv-") && name.ends_with("-py3-none-linux_x86_64.whl"), "{name}");
    // What is published: the wheel auditwheel checks against the manylinux
    // policies and tags for the oldest glibc its library's symbols allow.
    let repaired = Command::new("python3")
        .args(["-m", "auditwheel", "repair", "-w"])
        .arg(here.join("wheelhouse"))
        .arg(&wheel)
        .output()
        .unwrap();
    let wheel = if repaired.status.success() {
        let wheel = std::fs::read_dir(here.join("wheelhouse")).unwrap().map(|e| e.unwrap().path()).next().unwrap();
        let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("lake_kv-0.1.0-py3-none-manylinux_") && name.ends_with("_x86_64.whl"), "{name}");
        println!("published wheel: {name}");
        wheel
    } else {
        let said = String::from_utf8_lossy(&repaired.stderr);
        assert!(std::env::var_os("CI").is_none(), "auditwheel repair (.ci/run installs auditwheel): {said}");
        println!("SKIPPED the manylinux wheel (auditwheel: {}); installing the linux one", said.trim());
        wheel
    };
    // A venv of its own (numpy from the system's site-packages).
    let venv = here.join("venv");
    let made = Command::new("python3").args(["-m", "venv", "--system-site-packages"]).arg(&venv).output().unwrap();
    assert!(made.status.success(), "{made:?}");
    let installed =
        Command::new(venv.join("bin/pip")).args(["install", "-q", "--no-deps"]).arg(&wheel).output().unwrap();
    assert!(installed.status.success(), "pip install: {}", String::from_utf8_lossy(&installed.stderr));
    let run = Command::new(venv.join("bin/python"))
        .args(["-c", USER_SCRIPT])
        .arg(&here)
        .current_dir(&here)
        .env_remove("LAKE_LIBRARY")
        .env_remove("PYTHONPATH")
        .env("LAKE_BIN", env!("CARGO_BIN_EXE_lake"))
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success() && said.contains("wheel-ok"), "{said}");
    std::fs::remove_dir_all(&here).unwrap();
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == "build" || name.ends_with(".egg-info") || name == "__pycache__" || name.starts_with("tests") {
            continue;
        }
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &to.join(&*name));
        } else {
            std::fs::copy(entry.path(), to.join(&*name)).unwrap();
        }
    }
}
