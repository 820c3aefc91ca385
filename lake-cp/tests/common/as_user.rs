//! Engines run as other users: this test binary again, as `uid`, running
//! only `test` with `spec` in the environment variable `var` (the test
//! finds it there and plays the engine), and what the engine said on its
//! lines starting `engine:`; what such an engine does with its chain;
//! and what a mirror publishes, read as the pool's user.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use lake_agent::{Agent, SaveBlock, SavePayload};
use lake_dp::BlockKey;
use lake_dp::mirror::{MirrorEntry, MirrorReader};

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

/// Saves `keys` as one chain in one call, block `i` holding `payload(i)`:
/// how many the pool took.
pub(crate) fn save_at_once(agent: &mut Agent, keys: &[BlockKey], payload: impl Fn(usize) -> Vec<u8>) -> usize {
    let payloads: Vec<Vec<u8>> = (0..keys.len()).map(payload).collect();
    let blocks: Vec<SaveBlock<'_>> = (0..keys.len())
        .map(|i| SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap(),
            payload: SavePayload::Bytes(&payloads[i]),
        })
        .collect();
    agent.save(&blocks)
}

/// Loads the first `hits` of `keys` by `table` and says so on an
/// `engine:` line: how many loaded, and whether each held `payload(i)`.
pub(crate) fn load_and_say(
    agent: &mut Agent,
    keys: &[BlockKey],
    table: &[MirrorEntry],
    hits: usize,
    payload: impl Fn(usize) -> Vec<u8>,
) {
    let mut exact = true;
    let loaded = agent.fetch(&keys[..hits], &table[..hits], |i, bytes| exact &= bytes == &payload(i)[..]);
    println!("engine: loaded {loaded} {}", if exact { "exact" } else { "differs" });
}
