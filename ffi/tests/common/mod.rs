//! What the C ABI tests against a real pool share.

#![allow(dead_code)] // each test binary uses what it needs

use std::time::{Duration, Instant};

use lake::pool::{LakeCompletion, LakePool, lake_poll};
use lake::status::LakeStatus;

/// The traced blocks `handle`'s agent handed over since the last call
/// (`lake_trace_spans`).
pub(crate) fn spans(handle: *mut LakePool) -> Vec<lake::trace::LakeTraceSpan> {
    let mut out = vec![
        lake::trace::LakeTraceSpan {
            trace: 0,
            key: lake::pool::LakeBlockKey::default(),
            tier: 0,
            status: LakeStatus::LakeInternal,
            took_ns: 0,
            data_plane_us: 0,
            op: 0,
        };
        300
    ];
    let mut n = 0;
    // SAFETY: a writable array of its length.
    ok(unsafe { lake::trace::lake_trace_spans(handle, out.as_mut_ptr(), out.len(), &raw mut n) }, "trace spans");
    out.truncate(n);
    out
}

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
