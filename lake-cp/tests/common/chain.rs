//! Saving a prefix block by block into a small L1, and the `lake` CLI, as
//! several pool tests do them.

use std::time::{Duration, Instant};

use lake_agent::{Agent, SaveBlock, SavePayload};
use lake_dp::BlockKey;

/// Saves `keys` as one prefix, block `i` holding `payload(i)`, one block
/// at a time: L1 is small, so a save waits (20 s at most) while the tier
/// manager makes room.
#[allow(dead_code)] // not every test that runs the CLI saves this way
pub(crate) fn save_chain(agent: &mut Agent, keys: &[BlockKey], payload: impl Fn(usize) -> Vec<u8>) {
    for i in 0..keys.len() {
        let bytes = payload(i);
        let block = || SaveBlock {
            key: keys[i],
            parent: if i == 0 { BlockKey::NONE } else { keys[i - 1] },
            block_index: u32::try_from(i).unwrap_or(u32::MAX),
            payload: SavePayload::Bytes(&bytes),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while agent.save(&[block()]) != 1 {
            assert!(Instant::now() < deadline, "block {i} not saved in 20 s");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Runs `lake ARGS`; its stdout, or its stderr if it failed.
#[allow(dead_code)] // not every test that saves runs the CLI
pub(crate) fn lake(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lake")).args(args).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}
