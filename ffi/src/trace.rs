//! Trace ids through the pool: an engine names the request it is serving
//! (`lake_set_trace`, per calling thread), the loads it then submits carry
//! that id to the data plane, which logs each under it with its time
//! (`{"event":"trace",...}` in `lake-dp`'s log) and answers with that
//! time; the pushes it submits (`lake_push`) carry it to the peer's pool,
//! which logs each block's landing under it and answers with its time;
//! the agent keeps what it saw of each (`lake_trace_spans`). Trace ids are
//! the engine's to choose — one per sampled request, say a hash of its
//! request id; 0 traces nothing.

use std::cell::Cell;

use lake_agent::TraceSpan;

use crate::pool::{LakeBlockKey, LakePool, pool_ref, status_of};
use crate::status::{LakeStatus, fail, guard};

/// One block of a traced load or push, as the agent saw it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LakeTraceSpan {
    /// The engine's trace id.
    pub trace: u64,
    /// The block.
    pub key: LakeBlockKey,
    /// The tier it was loaded from (2 L2, 3 L3); a push: 1 (sent from
    /// this node's L1).
    pub tier: u32,
    /// How it ended: its load in the data plane, its push at the peer.
    pub status: LakeStatus,
    /// From asking the data plane (a load) or the push to its answer, as
    /// the agent saw it, ns.
    pub took_ns: u64,
    /// The data plane's own time on it, µs, from its answer — a push: the
    /// peer pool's, from its reservation or first slice to its check (0:
    /// a data plane or peer that does not take trace ids, an older build).
    pub data_plane_us: u32,
    /// What it was: [`LAKE_SPAN_LOAD`] or [`LAKE_SPAN_PUSH`] (a build
    /// from before pushes were traced has only loads: 0).
    pub op: u32,
}

/// A [`LakeTraceSpan`] of a load from L2 or L3.
pub const LAKE_SPAN_LOAD: u32 = 0;

/// A [`LakeTraceSpan`] of a push to another node's pool (P→D, D→P).
pub const LAKE_SPAN_PUSH: u32 = 1;

thread_local! {
    /// The trace id this thread's next submits carry.
    static TRACE: Cell<u64> = const { Cell::new(0) };
}

/// The trace id the calling thread set (0: none).
pub(crate) fn current() -> u64 {
    TRACE.with(Cell::get)
}

impl From<&TraceSpan> for LakeTraceSpan {
    fn from(span: &TraceSpan) -> Self {
        Self {
            trace: span.trace,
            key: LakeBlockKey { bytes: span.key.0 },
            tier: u32::from(span.tier),
            status: span.result.map_or_else(crate::status::status_of_agent_error, |()| LakeStatus::LakeOk),
            took_ns: span.took_ns,
            data_plane_us: span.data_plane_us,
            op: LAKE_SPAN_LOAD,
        }
    }
}

impl From<&lake_agent::push::PushSpan> for LakeTraceSpan {
    fn from(span: &lake_agent::push::PushSpan) -> Self {
        Self {
            trace: span.trace,
            key: LakeBlockKey { bytes: span.key.0 },
            tier: 1,
            status: span.result.as_ref().map_or_else(crate::status::status_of_transfer, |()| LakeStatus::LakeOk),
            took_ns: span.took_ns,
            data_plane_us: span.peer_us,
            op: LAKE_SPAN_PUSH,
        }
    }
}

/// Sets the trace id the loads and pushes this thread submits from now on
/// carry, on any pool (0: none, the default). Cheap; call it before a
/// request's `lake_submit_load` or `lake_push`.
#[unsafe(no_mangle)]
pub extern "C" fn lake_set_trace(trace: u64) {
    TRACE.with(|t| t.set(trace));
}

/// Hands over the traced loads' and pushes' blocks done since the last call, oldest
/// first: up to `capacity` into `out`, how many into `written` (the rest
/// wait for the next call; at most the newest 256 are kept). Thread-safe.
///
/// # Safety
///
/// `out` points at `capacity` writable entries (or is null with
/// `capacity` 0); `written` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_trace_spans(
    pool: *const LakePool,
    out: *mut LakeTraceSpan,
    capacity: usize,
    written: *mut usize,
) -> LakeStatus {
    guard(|| {
        status_of((|| {
            let pool = pool_ref(pool)?;
            if written.is_null() || (out.is_null() && capacity > 0) {
                return Err(fail(LakeStatus::LakeNullArgument, "lake_trace_spans: a required pointer is null"));
            }
            let mut spans = pool.spans.lock().map_err(|_| fail(LakeStatus::LakeInternal, "poisoned"))?;
            let n = spans.len().min(capacity);
            for (i, span) in spans.drain(..n).enumerate() {
                // SAFETY: i < capacity writable entries (contract).
                unsafe { out.wrapping_add(i).write(span) };
            }
            // SAFETY: writable (contract).
            unsafe { written.write(n) };
            Ok(())
        })())
    })
}
