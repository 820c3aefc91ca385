//! Execution-mode routing: the control plane's use of
//! [`lake_dp::route`] (the pure function lives beside the model types so
//! that the engine library, `lake-ffi`, exposes it to external routers
//! without linking the control plane).

pub use lake_dp::route::*;
