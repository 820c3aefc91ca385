//! `lake-kernels` owns the GPU side of a block's journey: CUDA kernels that
//! gather an engine's paged KV tensors (vLLM's per-layer `(2, blocks,
//! block_size, heads, head_dim)` in NHD or HND order, MLA's latent pages,
//! SGLang's host layouts) into contiguous pool blocks in the v1 memory order
//! of [`lake_dp::Layout`] and scatter them back, layer by layer, on the
//! engine's stream. The kernel sources are compiled at run time with NVRTC
//! through `cudarc`'s dynamic loading, so this crate builds, and its tests
//! skip with a printed reason, on machines with no CUDA toolkit or GPU.
//!
//! Status (issue \[5\] milestone (a), in progress): the gather and scatter
//! kernels and their host side ([`KvCopier`], [`RegisteredHost`],
//! [`probe`]); the segment CRCs on the GPU, the poller stage with events,
//! layer-wise events and the bench come next.

#![warn(missing_docs)]

pub mod crc;
mod gpu;
pub mod source;

pub use gpu::{DeviceKv, GpuError, KvCopier, Piece, QueuedCrcs, RegisteredHost, probe};
