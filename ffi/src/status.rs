//! Status codes, the per-thread last error, and the guard every export
//! runs its body in: arguments are checked, a panic never crosses the
//! boundary (it becomes `LAKE_INTERNAL` with its message).

use std::cell::RefCell;
use std::ffi::c_char;

/// What every call returns.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LakeStatus {
    /// Done.
    LakeOk = 0,
    /// A pointer argument was null.
    LakeNullArgument = 1,
    /// An argument is out of its domain (`lake_last_error` says which).
    LakeInvalidArgument = 2,
    /// An option struct's `struct_size` is not one this library knows.
    LakeBadStructSize = 3,
    /// The output buffer is too small; the count needed is returned.
    LakeBufferTooSmall = 4,
    /// The pool is not there (never attached, or its `lake-dp` went away).
    LakeNotAttached = 5,
    /// The library and the daemon have no wire version in common.
    LakeVersionMismatch = 6,
    /// No room in the pool: a save refused, L1 full of blocks the pool
    /// could not let go of in time (not yet written below, or held).
    LakeNoSpace = 7,
    /// The block was evicted or replaced between lookup and load:
    /// recompute it.
    LakeEvicted = 8,
    /// The block failed its CRC checks: recompute it.
    LakeBadCrc = 9,
    /// A device or socket failed.
    LakeIo = 10,
    /// A queue is full: retry later.
    LakeBusy = 11,
    /// The request was cancelled.
    LakeCancelled = 12,
    /// A bug in this library (a panic caught at the boundary).
    LakeInternal = 13,
    /// The block was saved under another layout (another shard, dtype or
    /// geometry) or namespace than this engine's memory: its bytes are not
    /// this reader's; recompute it.
    LakeLayoutMismatch = 14,
    /// A lower-tier block could not be leased or brought into L1 in time
    /// (no `lake-cp`, a refused lease, no room, a device error): recompute
    /// it.
    LakeUnavailable = 15,
    /// An earlier block of the same request failed, so this one was not
    /// loaded (a prefix is only of use whole): recompute it.
    LakePrefixBroken = 16,
    /// A save refused: the only free L1 slots are the load reserve, kept
    /// for loads.
    LakeLoadReserve = 17,
    /// Refused: the pool is stopping.
    LakeStopping = 18,
    /// A save not sent: the pool refuses saves now (see
    /// `lake_pool_save_pressure`), so the whole save was skipped rather
    /// than saved in part.
    LakeSavePressure = 19,
    /// A save refused: its namespace, or its tenant across its namespaces,
    /// is at its L1 quota. The pool makes room by moving that tenant's own
    /// coldest blocks down; later saves go in.
    LakeOverQuota = 20,
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Records `message` as this thread's last error and returns `status`.
pub(crate) fn fail(status: LakeStatus, message: impl Into<String>) -> LakeStatus {
    let message = message.into();
    LAST_ERROR.with(|last| *last.borrow_mut() = message);
    status
}

/// Runs an export's body: a panic becomes `LakeInternal`.
pub(crate) fn guard(body: impl FnOnce() -> LakeStatus) -> LakeStatus {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(status) => status,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_owned());
            fail(LakeStatus::LakeInternal, format!("internal error: {what}"))
        }
    }
}

/// Copies this thread's last error message into `buffer` (`capacity`
/// bytes, NUL-terminated, cut to fit) and returns the message's full
/// length. Thread-safe: each thread has its own last error.
///
/// # Safety
///
/// `buffer` must be null or point at `capacity` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lake_last_error(buffer: *mut c_char, capacity: usize) -> usize {
    LAST_ERROR.with(|last| {
        let last = last.borrow();
        let bytes = last.as_bytes();
        if !buffer.is_null() && capacity > 0 {
            let n = bytes.len().min(capacity - 1);
            // SAFETY: the caller gave `capacity` writable bytes; n < capacity.
            unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.cast::<u8>(), n) };
            // SAFETY: n < capacity.
            unsafe { buffer.wrapping_add(n).write(0) };
        }
        bytes.len()
    })
}

// What the agent's answers read as at the boundary: one mapping each.

/// The status a failed attach reads as: a refusal by its code (no wire
/// version in common; every agent port taken), the arena's agent records
/// all claimed (both busy: try again once an engine detaches), a
/// configuration no agent can attach with, and otherwise no pool there.
pub(crate) fn status_of_attach(error: &lake_agent::AttachError) -> LakeStatus {
    use lake_agent::AttachError;
    use lake_dp::wire::message::ErrorCode;
    match error {
        AttachError::Refused { code: Some(ErrorCode::VersionMismatch), .. } => LakeStatus::LakeVersionMismatch,
        AttachError::Refused { code: Some(ErrorCode::QueueFull), .. } | AttachError::RecordsFull => {
            LakeStatus::LakeBusy
        }
        AttachError::Invalid(_) => LakeStatus::LakeInvalidArgument,
        AttachError::Refused { .. }
        | AttachError::Socket { .. }
        | AttachError::Protocol(_)
        | AttachError::Memory(_)
        | AttachError::ControlPlane(_) => LakeStatus::LakeNotAttached,
    }
}

/// The status a block of a save reads as.
pub(crate) fn status_of_save(status: lake_agent::SaveStatus) -> LakeStatus {
    use lake_agent::SaveStatus;
    match status {
        SaveStatus::Saved => LakeStatus::LakeOk,
        SaveStatus::Refused(error) => status_of_agent_error(error),
        SaveStatus::ParentUnsaved => LakeStatus::LakePrefixBroken,
        SaveStatus::NotSent => LakeStatus::LakeBusy,
    }
}

/// The status the block a fetch stopped at reads as (`None`: the fetch
/// ended without naming why, as when the block left its slot).
pub(crate) fn status_of_fetch(failure: Option<lake_agent::FetchFailure>) -> LakeStatus {
    use lake_agent::FetchFailure;
    match failure {
        None | Some(FetchFailure::Evicted) => LakeStatus::LakeEvicted,
        Some(FetchFailure::Corrupt) => LakeStatus::LakeBadCrc,
        Some(FetchFailure::Foreign) => LakeStatus::LakeLayoutMismatch,
        Some(FetchFailure::Unavailable) => LakeStatus::LakeUnavailable,
        Some(FetchFailure::Cancelled) => LakeStatus::LakeCancelled,
    }
}

/// The status an agent's error reads as.
pub(crate) fn status_of_agent_error(error: lake_agent::port::AgentError) -> LakeStatus {
    use lake_agent::port::AgentError;
    match error {
        AgentError::NoSpace => LakeStatus::LakeNoSpace,
        AgentError::Stale => LakeStatus::LakeEvicted,
        AgentError::Corrupt => LakeStatus::LakeBadCrc,
        AgentError::Io => LakeStatus::LakeIo,
        AgentError::Busy => LakeStatus::LakeBusy,
        AgentError::Invalid => LakeStatus::LakeInvalidArgument,
        AgentError::Cancelled => LakeStatus::LakeCancelled,
        AgentError::Reserved => LakeStatus::LakeLoadReserve,
        AgentError::Stopping => LakeStatus::LakeStopping,
        AgentError::OverQuota => LakeStatus::LakeOverQuota,
    }
}

/// The status a push's failed block reads as.
pub(crate) fn status_of_transfer(error: &lake_dp::transport::TransferError) -> LakeStatus {
    use lake_dp::transport::TransferError;
    match error {
        TransferError::Corrupt => LakeStatus::LakeBadCrc,
        TransferError::Busy => LakeStatus::LakeBusy,
        TransferError::Invalid(_) => LakeStatus::LakeInvalidArgument,
        TransferError::Cancelled => LakeStatus::LakeCancelled,
        TransferError::Refused
        | TransferError::PeerLost(_)
        | TransferError::Timeout
        | TransferError::Unreachable(_) => LakeStatus::LakeUnavailable,
    }
}
