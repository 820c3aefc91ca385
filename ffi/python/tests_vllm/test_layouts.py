"""Every KV layout vLLM can hand a connector, made by vLLM itself: each
``KVCacheLayout`` stride order of ``[L, B, H, N, C]``, for full attention
and for MLA, with and without kernel blocks, viewed per layer by vLLM's
own ``create_kv_cache_views`` (what its workers pass to
``register_kv_caches``). lake.vllm's description of each view must name
the address vLLM's own indexing gives for every (block, token, head,
element) of K and V; a view it cannot describe is refused, naming it."""

from __future__ import annotations

import random

import pytest
import torch

from lake.vllm import describe_layout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

LAYERS = 3
NUM_BLOCKS = 6


def views(spec, layout, kernel_block_size=None):
    """vLLM's per-layer views over one backing buffer, as its worker makes
    them (``vllm/v1/worker/utils.py: allocate_kv_cache``)."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    size = LAYERS * NUM_BLOCKS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=[f"layer.{i}" for i in range(LAYERS)], layer_stride=layer_stride,
                           block_stride=block_stride)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block_size)


def check_addresses(spec, layout, mla, kernel_block_size=None):
    kernel = kernel_block_size or spec.block_size
    rng = random.Random(f"{layout.name}-{mla}-{kernel}")
    for view in views(spec, layout, kernel_block_size):
        described = describe_layout(
            view.shape, view.stride(), view.element_size(), spec.block_size, num_blocks=NUM_BLOCKS, mla=mla
        )
        assert described.num_blocks == NUM_BLOCKS and described.block_size == spec.block_size
        assert described.kv_heads == spec.num_kv_heads and described.head_size == spec.head_size
        pieces = described.pieces(view.data_ptr())
        assert len(pieces) == (1 if mla else 2)
        e = view.element_size()
        for _ in range(200):
            block, token = rng.randrange(NUM_BLOCKS), rng.randrange(spec.block_size)
            head, i, plane = rng.randrange(spec.num_kv_heads), rng.randrange(spec.head_size), rng.randrange(len(pieces))
            kernel_block, kernel_token = block * (spec.block_size // kernel) + token // kernel, token % kernel
            expected = view[kernel_block, head, kernel_token, plane * spec.head_size + i].data_ptr()
            address, block_stride, token_stride, head_stride = pieces[plane]
            assert address + block * block_stride + token * token_stride + head * head_stride + i * e == expected


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_views_are_described_exactly(layout, dtype):
    spec = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=16, dtype=dtype)
    check_addresses(spec, layout, mla=False)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda layout: layout.name)
def test_mla_views_are_described_exactly(layout):
    spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=72, dtype=torch.bfloat16)
    check_addresses(spec, layout, mla=True)


def test_kernel_blocks_whose_tokens_run_on_are_described():
    # vLLM splits each block of 64 tokens into two kernel blocks of 32
    # (it does so only for layer-compact, dense pages); token-major pages
    # keep one token stride across the split.
    spec = FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=16, dtype=torch.float32)
    check_addresses(spec, KVCacheLayout.LBNHC, mla=False, kernel_block_size=32)


def test_head_major_kernel_blocks_are_refused_naming_the_shape():
    # The CPU backend's head-major pages (LBHNC) split into kernel blocks:
    # the tokens of one vLLM block do not lie at one stride.
    spec = FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\(12, 4, 32, 32\).*--block-size 32"):
        check_addresses(spec, KVCacheLayout.LBHNC, mla=False, kernel_block_size=32)


def test_shapes_vllm_never_makes_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"rank 4, 5 or 3 \(MLA\), not 2: \(6, 16\)"):
        describe_layout((6, 16), (16, 1), 4, 32)
    with pytest.raises(ValueError, match=r"\(6, 4, 32, 33\): content 33 is not K and V"):
        describe_layout((6, 4, 32, 33), (4224, 1056, 33, 1), 4, 32)
    with pytest.raises(ValueError, match=r"\(6, 4, 32, 32\) has 4 heads, not 1"):
        describe_layout((6, 4, 32, 32), (4096, 1024, 32, 1), 2, 32, mla=True)
    with pytest.raises(ValueError, match=r"\(7, 4, 32, 32\) holds neither vLLM's 6 blocks"):
        describe_layout((7, 4, 32, 32), (4096, 1024, 32, 1), 4, 32, num_blocks=6)
    with pytest.raises(ValueError, match=r"innermost dimension of \(6, 4, 32, 32\) is not contiguous"):
        describe_layout((6, 4, 32, 32), (4096, 1, 128, 4), 4, 32)
