//! `lake-ffi` is the engine's door into Lake: a C ABI (exports prefixed
//! `lake_`, opaque typed handles, a generated header) and a Python binding
//! on top of it. Through it an engine's in-process agent reads the block
//! table from the shared-memory mirror, writes its own pin array, submits
//! loads and saves over shared-memory rings and polls for completion — no
//! syscall on the fast path. Every argument crossing the boundary is checked
//! and reported as an error code; nothing panics across it.
//!
//! The header `ffi/include/lake.h` is generated from this crate by
//! cbindgen and checked in; `cargo test -p lake-ffi --test header` fails
//! when it is stale (`LAKE_UPDATE_HEADER=1` rewrites it).

#![warn(missing_docs)]

#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod gpu;
mod lanes;
pub mod layout;
mod memory;
pub mod pool;
mod push;
pub mod route;
pub mod status;
pub mod trace;

use lake_dp::wire::{WIRE_VERSION_MAX, WIRE_VERSION_MIN};

/// The newest wire version this library speaks (C: `uint16_t
/// lake_wire_version_max(void)`).
#[unsafe(no_mangle)]
pub extern "C" fn lake_wire_version_max() -> u16 {
    WIRE_VERSION_MAX
}

/// The oldest wire version this library speaks.
#[unsafe(no_mangle)]
pub extern "C" fn lake_wire_version_min() -> u16 {
    WIRE_VERSION_MIN
}

/// The stored-object format version this library reads and writes.
#[unsafe(no_mangle)]
pub extern "C" fn lake_stored_version() -> u16 {
    lake_dp::stored::STORED_VERSION
}

#[cfg(test)]
mod tests {
    #[test]
    fn versions_match_the_core() {
        assert!(super::lake_wire_version_min() <= super::lake_wire_version_max());
        assert_eq!(super::lake_stored_version(), 1);
    }
}
