//! The C ABI's entry points that take an engine's structs and buffers:
//! `lake::fuzzing::exercise_entry_points` feeds them field
//! values, struct sizes and byte counts from the input; any values give a
//! status, never a panic (not even one the boundary catches), and what
//! succeeds is consistent. See ffi/src/fuzzing.rs.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lake::fuzzing::exercise_entry_points(data));
