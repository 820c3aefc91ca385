//! `lake-kernels` owns the GPU side of a block's journey: CUDA kernels that
//! gather an engine's paged KV tensors (vLLM's per-layer `(2, blocks,
//! block_size, heads, head_dim)` in NHD or HND order, MLA's latent pages,
//! SGLang's host layouts) into contiguous pool blocks in the v1 memory order
//! of [`lake_dp::Layout`] and scatter them back, layer by layer, on the
//! engine's stream. The kernel sources are compiled at run time with NVRTC
//! through `cudarc`'s dynamic loading, so this crate builds, and its tests
//! skip with a printed reason, on machines with no CUDA toolkit or GPU.
//! Issue [5] writes the kernels; today the crate is only this contract and
//! carries no CUDA dependency, keeping CI's build lean.

#![warn(missing_docs)]
