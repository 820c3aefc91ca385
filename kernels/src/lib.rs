//! `lake-kernels` owns the GPU side of a block's journey: CUDA kernels that
//! gather an engine's paged KV tensors (vLLM's per-layer `(2, blocks,
//! block_size, heads, head_dim)` in NHD or HND order, MLA's latent pages,
//! SGLang's host layouts) into contiguous pool blocks in the v1 memory order
//! of `lake-dp`'s `Layout` and scatter them back, layer by layer, on the
//! engine's stream. The kernel sources are compiled at run time with NVRTC
//! through `cudarc`'s dynamic loading, so this crate builds, and its tests
//! skip with a printed reason, on machines with no CUDA toolkit or GPU.
//!
//! What is here: the gather and scatter kernels and their host side
//! ([`KvCopier`], [`RegisteredHost`], [`probe`]); segment CRCs computed on
//! the GPU; staged loads ([`KvCopier::load_staged`]: the copy engines move
//! the bytes into an HBM staging region of [`STAGING_UNITS`] ×
//! [`STAGING_UNIT_BYTES`] while the kernels change the layout of the unit
//! before). The poller stage that completes loads lives in `lake-ffi`.

#![warn(missing_docs)]

pub mod crc;
mod gpu;
pub mod source;

pub use gpu::{
    DeviceKv, GpuError, KvCopier, Piece, QueuedCrcs, RegisteredHost, STAGING_UNIT_BYTES, STAGING_UNITS, probe,
};
