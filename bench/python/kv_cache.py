"""The Qwen3-8B-shaped paged KV cache the GPU benches move (gpu_engine.py
for Lake, lmcache_engine.py for LMCache), and the figures each reports
beside the raw pinned copies of the same bytes, measured in its own
process: 36 layers, 8 KV heads, head dim 128, bf16, vLLM flash-attention
paged blocks of 16 tokens, one tensor per layer (2, blocks, 16, 8, 128)."""

import time

import torch

LAYERS, HEADS, DIM, TOKENS = 36, 8, 128, 16
CACHE_BLOCKS = 2304  # engine blocks per cache (36 layers x 1.1 GiB)
BLOCK_BYTES = LAYERS * 2 * TOKENS * HEADS * DIM * 2


def cache():
    return [torch.zeros((2, CACHE_BLOCKS, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def figures(nbytes, store, retrieve, first_store=None, first_retrieve=None):
    """GB/s of a store and a retrieve of `nbytes` (seconds each; the
    process's first of each, where measured), beside one pinned copy of
    the same bytes each way."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = timed(lambda: host.copy_(device, non_blocking=True))
    h2d = timed(lambda: device.copy_(host, non_blocking=True))
    rate = lambda seconds: round(nbytes / seconds / 1e9, 2)  # noqa: E731
    return {
        "bytes": nbytes,
        "store_gbps": rate(store),
        **({"first_store_gbps": rate(first_store)} if first_store else {}),
        **({"first_retrieve_gbps": rate(first_retrieve)} if first_retrieve else {}),
        "retrieve_gbps": rate(retrieve),
        "raw_d2h_gbps": rate(d2h),
        "raw_h2d_gbps": rate(h2d),
    }
