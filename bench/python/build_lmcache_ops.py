"""Builds LMCache's CUDA kernels (`lmcache.cuda_ops`) from the csrc of its
source release, against this machine's torch: LMCache's wheel is built for
another torch, and without its kernels it falls back, silently, to a path
4-15x slower — the figures would not be its own.

    python3 bench/python/build_lmcache_ops.py SRC OUT

SRC holds LMCache's `csrc/` (0.5.6's source release); the module lands in
OUT/lmcache/. Built for this machine's GPU only (TORCH_CUDA_ARCH_LIST, or
the GPU's own capability)."""

import os
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension

SOURCES = [
    "csrc/cuda/pybind.cpp",
    "csrc/cuda/mem_kernels.cu",
    "csrc/cuda/mp_mem_kernels.cu",
    "csrc/cuda/phase_timing_recorder.cu",
    "csrc/cuda/blend_kernels.cu",
    "csrc/cuda/cal_cdf.cu",
    "csrc/cuda/ac_enc.cu",
    "csrc/cuda/ac_dec.cu",
    "csrc/cuda/pos_kernels.cu",
    "csrc/cuda/mem_alloc.cpp",
    "csrc/cuda/utils.cpp",
    "csrc/cuda/event_recorder.cpp",
    "csrc/cuda/completion_recorder.cpp",
]


def main(src, out):
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    abi = "-D_GLIBCXX_USE_CXX11_ABI=1"
    extension = cpp_extension.CUDAExtension(
        "lmcache.cuda_ops",
        sources=[os.path.join(src, s) for s in SOURCES],
        include_dirs=[os.path.join(src, "csrc")],
        extra_compile_args={"cxx": ["-O3", abi], "nvcc": ["-O3", abi]},
    )
    setup(
        name="lmcache-cuda-ops",
        ext_modules=[extension],
        cmdclass={"build_ext": cpp_extension.BuildExtension},
        script_args=["build_ext", "--build-lib", out, "--build-temp", os.path.join(out, "build")],
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
