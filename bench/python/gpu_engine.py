"""Store and retrieve through Lake's Python binding, as an engine calls it,
for a Qwen3-8B-like paged KV cache on the GPU — the measurement LMCache's
figures come from (docs/gpu.md has both side by side).

Layout: 36 layers, 8 KV heads, head dim 128, bf16, vLLM flash-attention
paged blocks of 16 tokens, one tensor per layer (2, blocks, 16, 8, 128).
For each token count: the prompt's blocks live at scattered engine block
ids; a store saves them into the pool (the GPU gathers them straight into
L1 slots), a retrieve loads them into other scattered blocks of a second
cache; the bytes are compared after every retrieve. Raw pinned copies of
the same bytes each way are measured in the same run.

Run on the GPU machine against a pool started by hand:

    lake serve --dir /tmp/lk --block-bytes 2359296 --l1-slots 4000 --l2-slots 64 --agents 8
    LAKE_LIBRARY=.../liblake.so PYTHONPATH=ffi/python python3 bench/python/gpu_engine.py \\
        /tmp/lk/dp.sock MIRROR /tmp/lk/cp.sock [copy_engine|direct] [LAYER_GROUPS]

LAYER_GROUPS: the groups the retrieving memory's loads go in (0, the
default: 8, for layer-by-layer waits; 1: every block whole, for an engine
that waits for the whole retrieve, as LMCache's figures do).

Prints one JSON line per token count."""

import json
import os
import sys
import time

import numpy as np
import torch

import lake
from kv_cache import CACHE_BLOCKS, DIM, HEADS, LAYERS, TOKENS, cache, figures, timed


def pieces(layers):
    out = []
    for t in layers:
        s, e = t.stride(), t.element_size()
        for plane in (0, 1):
            out.append((t.data_ptr() + plane * s[0] * e, s[1] * e, s[2] * e, s[3] * e))
    return np.array(out, dtype=np.int64)


def main(dp, mirror, cp, gpu_path="copy_engine", layer_groups="0"):
    layer_groups = int(layer_groups)
    layout = lake.Layout(layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype="bfloat16", block_tokens=TOKENS)
    block_bytes = layout.block_bytes
    # A seed of its own per run: two runs against one pool must not share
    # keys (a key names the bytes; the pool keeps the first copy it got).
    rng = np.random.default_rng([os.getpid(), time.time_ns()])
    source, target = cache(), cache()
    for t in source:
        t.copy_(torch.randn(t.shape, dtype=torch.float32, device="cuda").to(torch.bfloat16))
    for tokens in (512, 8192, 32768):
        ns = lake.Namespace(rng.bytes(32), TOKENS, rng.bytes(32))  # a fresh namespace per size
        pool = lake.Pool(dp, mirror, ns, cp_socket=cp, layout=layout, name="gpu-bench")
        memory_src = pool.register_kv_memory(layout, CACHE_BLOCKS, pieces(source), keep_alive=source, device=0, gpu_path=gpu_path)
        memory_dst = pool.register_kv_memory(
            layout, CACHE_BLOCKS, pieces(target), keep_alive=target, device=0, gpu_path=gpu_path, layer_groups=layer_groups
        )
        blocks = tokens // TOKENS
        keys = ns.keys(rng.integers(0, 150_000, tokens, dtype=np.uint32))
        src_ids = rng.permutation(CACHE_BLOCKS)[:blocks].astype(np.uint32)
        dst_ids = rng.permutation(CACHE_BLOCKS)[:blocks].astype(np.uint32)
        # The process's first store and retrieve pay one-time costs
        # (page-locked CRC buffers, the driver's first use of these paths):
        # measured apart, on keys of their own, so each size's figure is
        # the steady state.
        first = first_retrieve = None
        if tokens == 512:
            warm_keys = ns.keys(rng.integers(0, 150_000, tokens, dtype=np.uint32))
            first = timed(lambda: pool.wait(pool.submit_save(memory_src, warm_keys, src_ids), blocks, timeout=120))
            # And its first retrieve, of those keys (where all were
            # published: a pool under pressure may not have them).
            for _ in range(500):
                warm_hits, warm_table = pool.lookup(warm_keys)
                if warm_hits >= blocks:
                    break
                time.sleep(0.01)
            if warm_hits == blocks:
                first_retrieve = timed(
                    lambda: pool.wait(pool.submit_load(memory_dst, warm_keys, warm_table, dst_ids), blocks, timeout=120)
                )
                # The same bytes the retrieve below must land: cleared, so it
                # is its own bytes that are compared.
                for t in target:
                    t.zero_()
        stored = []
        store = timed(lambda: stored.append(pool.wait(pool.submit_save(memory_src, keys, src_ids), blocks, timeout=120)))
        # Acked: saved by the pool; published: found as the prefix it is.
        # Into a warm pool (a run before this one against the same pool
        # filled its L1) every acked block must still be published.
        acked = int((stored[0] == lake.OK).sum())
        refused = {lake.STATUS[int(s)]: int((stored[0] == s).sum()) for s in np.unique(stored[0]) if s != lake.OK}
        for _ in range(500):
            hits, table = pool.lookup(keys)
            if hits >= acked:
                break
            time.sleep(0.01)
        assert hits == acked, f"{acked} of {blocks} acked, {hits} published"
        # The retrieve reads what was published (all of it, in a pool with
        # room).
        blocks = hits
        keys, src_ids, dst_ids, table = keys[:hits], src_ids[:hits], dst_ids[:hits], table[:hits]
        statuses = []
        retrieve = timed(lambda: statuses.append(pool.wait(pool.submit_load(memory_dst, keys, table, dst_ids), blocks, timeout=120)))
        assert (statuses[0] == lake.OK).all(), statuses[0]
        src, dst = torch.as_tensor(src_ids.astype(np.int64), device="cuda"), torch.as_tensor(dst_ids.astype(np.int64), device="cuda")
        for s, d in zip(source, target):
            assert torch.equal(s[:, src], d[:, dst]), "retrieved bytes differ"
        # Layer by layer: how soon the engine's stream may use layer 0
        # (direct loads of L1 hits land in layer groups; others whole).
        stream = torch.cuda.current_stream()
        torch.cuda.synchronize()
        start = time.perf_counter()
        request = pool.submit_load(memory_dst, keys, table, dst_ids)
        submitted = time.perf_counter() - start
        pool.wait_layer(request, 0, stream.cuda_stream)
        stream.synchronize()
        first_layer = time.perf_counter() - start
        pool.wait_layer(request, LAYERS - 1, stream.cuda_stream)
        stream.synchronize()
        last_layer = time.perf_counter() - start
        assert (pool.wait(request, blocks, timeout=120) == lake.OK).all()
        whole = time.perf_counter() - start
        nbytes = blocks * block_bytes
        print(
            json.dumps(
                {
                    "gpu_path": gpu_path,
                    "layer_groups": layer_groups,
                    "tokens": tokens,
                    "blocks": tokens // TOKENS,
                    "acked": acked,
                    "published": hits,
                    **({"refused": refused} if refused else {}),
                    **figures(nbytes, store, retrieve, first, first_retrieve),
                    "submit_ms": round(submitted * 1e3, 2),
                    "layer0_ms": round(first_layer * 1e3, 2),
                    "last_layer_ms": round(last_layer * 1e3, 2),
                    "whole_ms": round(whole * 1e3, 2),
                }
            ),
            flush=True,
        )
        pool.close()


if __name__ == "__main__":
    main(*sys.argv[1:6])
