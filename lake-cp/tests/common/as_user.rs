//! Engines run as other users: this test binary again, as `uid`, running
//! only `test` with `spec` in the environment variable `var` (the test
//! finds it there and plays the engine), and what the engine said on its
//! lines starting `engine:`; and what a mirror publishes, read as the
//! pool's user.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use lake_dp::BlockKey;
use lake_dp::mirror::MirrorReader;

/// Runs test `test` of this binary as `uid` (and group `uid`) with `var`
/// set to `spec`: the lines its engine said, joined.
pub(crate) fn run_engine(test: &str, var: &str, uid: u32, spec: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env(var, spec)
        .uid(uid)
        .gid(uid)
        .current_dir("/")
        .output()
        .unwrap();
    let said: Vec<&str> =
        std::str::from_utf8(&out.stdout).unwrap().lines().filter_map(|l| Some(&l[l.find("engine:")?..])).collect();
    assert!(out.status.success(), "engine: {}", String::from_utf8_lossy(&out.stderr));
    said.join("\n")
}

/// How many of `keys` the mirror at `path` publishes.
pub(crate) fn published(path: &Path, keys: &[BlockKey]) -> usize {
    let Ok(reader) = MirrorReader::attach(path) else { return 0 };
    let mut table = Vec::new();
    if reader.is_ready() { reader.lookup(keys, &mut table) } else { 0 }
}
