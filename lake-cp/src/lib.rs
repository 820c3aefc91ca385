//! `lake-cp` builds the `lake` command (and the `lake-dp` binary) on Lake's
//! control plane, [`lake_control`], which it re-exports whole: `lake_cp::tier`
//! is `lake_control::tier`. It adds the one piece that drives engines, the
//! embedded single-node pool demo ([`demo`]), which is why the engine's
//! agent is a dependency here and not of the control plane. See
//! `docs/controlplane.md`.

#![warn(missing_docs)]

pub use lake_control::*;

pub mod demo;
