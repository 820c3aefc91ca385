//! What the C ABI tests against a real pool share.

#![allow(dead_code)] // each test binary uses what it needs

use std::time::{Duration, Instant};

use lake::pool::{LakeCompletion, LakePool, lake_poll};
use lake::status::LakeStatus;

pub(crate) fn ok(status: LakeStatus, what: &str) {
    assert_eq!(status, LakeStatus::LakeOk, "{what}");
}

/// Every completion of `request` (`count` of them), by index.
pub(crate) fn statuses(pool: *const LakePool, request: u64, count: usize) -> Vec<LakeStatus> {
    let mut out = vec![LakeStatus::LakeInternal; count];
    let mut seen = 0;
    let mut buffer = vec![LakeCompletion { request_id: 0, index: 0, status: LakeStatus::LakeOk }; 64];
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen < count {
        let mut n = 0;
        // SAFETY: a writable buffer of its length; the pool is attached.
        ok(unsafe { lake_poll(pool, buffer.as_mut_ptr(), buffer.len(), &raw mut n) }, "poll");
        for c in buffer[..n].iter().filter(|c| c.request_id == request) {
            out[c.index as usize] = c.status;
            seen += 1;
        }
        assert!(Instant::now() < deadline, "request {request}: {seen} of {count}");
        if n == 0 {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    out
}

pub(crate) mod pools;
