"""LMCache's store and retrieve of the cache `gpu_engine.py` measures for
Lake, the same way: the peer's figures for the side-by-side run
(`bench/python/side_by_side.sh`, GPU machine).

Layout as gpu_engine.py: 36 layers, 8 KV heads, head dim 128, bf16, vLLM
flash-attention paged blocks of 16 tokens, one tensor per layer (2, blocks,
16, 8, 128); for each token count the prompt's blocks sit at scattered
engine block ids. LMCache 0.5.6 with its CPU backend (the local CPU
memory pool, chunks of 256 tokens, vLLM's paged connector): a store of the
prompt from the source cache, then a retrieve into other scattered blocks
of a second cache, every retrieved byte compared; raw pinned copies of the
same bytes each way in the same process. The process's first store and
retrieve (tokens of their own) are measured apart, as gpu_engine.py does.

    python3 bench/python/lmcache_engine.py

Prints one JSON line per token count."""

import json
import os
import sys
import time

import numpy as np
import torch

from kv_cache import BLOCK_BYTES, CACHE_BLOCKS, DIM, HEADS, LAYERS, TOKENS, cache, figures, timed

CHUNK = 256

def slots(ids):
    """vLLM's slot mapping of the tokens in engine blocks `ids`, in order."""
    ids = torch.as_tensor(ids.astype(np.int64), device="cuda")
    return (ids[:, None] * TOKENS + torch.arange(TOKENS, device="cuda")[None, :]).reshape(-1)


def engine():
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2
    from lmcache.v1.metadata import LMCacheMetadata

    config = LMCacheEngineConfig.from_legacy(chunk_size=CHUNK, remote_url=None)
    # Room for every size's prompt and the first store's (GB).
    config.max_local_cpu_size = 24
    metadata = LMCacheMetadata(
        model_name="qwen3-8b-shaped",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM),
    )
    connector = VLLMPagedMemGPUConnectorV2(HEADS * DIM, LAYERS)
    built = LMCacheEngineBuilder.get_or_create(
        "side-by-side", config, metadata, connector, lambda *a, **k: None, lambda obj, *a, **k: obj
    )
    # Its storage (the CPU pool) is made here, as vLLM's connector does.
    built.post_init()
    return built


def aimed(lm):
    """LMCache's connector keeps the device pointers of the first cache it
    was given (an engine has one); this bench moves between two, so they
    are dropped before each call, untimed — as LMCache's own tests do."""
    lm.gpu_connector.kv_cache_pointers_on_gpu = {}


def main():
    import lmcache

    try:
        import lmcache.cuda_ops as ops
    except ImportError as e:
        # Without its kernels LMCache falls back to a slower path: the
        # figures would not be its own.
        sys.exit(f"lmcache.cuda_ops does not load ({e}): rebuild it for this torch")
    print(json.dumps({"lmcache": getattr(lmcache, "__version__", "?"), "cuda_ops": ops.__file__}), flush=True)
    lm = engine()
    rng = np.random.default_rng([os.getpid(), time.time_ns()])
    source, target = cache(), cache()
    for t in source:
        t.copy_(torch.randn(t.shape, dtype=torch.float32, device="cuda").to(torch.bfloat16))
    for tokens in (512, 8192, 32768):
        blocks = tokens // TOKENS
        ids = torch.as_tensor(rng.integers(0, 150_000, tokens), dtype=torch.int64, device="cuda")
        src_ids = rng.permutation(CACHE_BLOCKS)[:blocks].astype(np.uint32)
        dst_ids = rng.permutation(CACHE_BLOCKS)[:blocks].astype(np.uint32)
        first = first_retrieve = None
        if tokens == 512:
            warm = torch.as_tensor(rng.integers(0, 150_000, tokens), dtype=torch.int64, device="cuda")
            aimed(lm)
            first = timed(lambda: lm.store(tokens=warm, kvcaches=source, slot_mapping=slots(src_ids)))
            deadline = time.time() + 60
            while lm.lookup(warm) < tokens and time.time() < deadline:
                time.sleep(0.001)
            aimed(lm)
            first_retrieve = timed(lambda: lm.retrieve(warm, kvcaches=target, slot_mapping=slots(dst_ids)))
            # The same bytes the retrieve below must land: cleared, so it
            # is its own bytes that are compared.
            for t in target:
                t.zero_()
        src_slots, dst_slots = slots(src_ids), slots(dst_ids)
        aimed(lm)
        store = timed(lambda: lm.store(tokens=ids, kvcaches=source, slot_mapping=src_slots))
        deadline = time.time() + 60
        while lm.lookup(ids) < tokens:
            assert time.time() < deadline, f"{lm.lookup(ids)} of {tokens} tokens stored"
            time.sleep(0.001)
        masks = []
        aimed(lm)
        retrieve = timed(lambda: masks.append(lm.retrieve(ids, kvcaches=target, slot_mapping=dst_slots)))
        assert int(masks[0].sum()) == tokens, f"{int(masks[0].sum())} of {tokens} tokens retrieved"
        src, dst = torch.as_tensor(src_ids.astype(np.int64), device="cuda"), torch.as_tensor(dst_ids.astype(np.int64), device="cuda")
        for s, d in zip(source, target):
            assert torch.equal(s[:, src], d[:, dst]), "retrieved bytes differ"
        nbytes = blocks * BLOCK_BYTES
        print(
            json.dumps(
                {
                    "peer": "lmcache",
                    "tokens": tokens,
                    "blocks": blocks,
                    **figures(nbytes, store, retrieve, first, first_retrieve),
                    "store_ms": round(store * 1e3, 2),
                    "retrieve_ms": round(retrieve * 1e3, 2),
                }
            ),
            flush=True,
        )
        for t in target:
            t.zero_()


if __name__ == "__main__":
    # LMCache's threads keep the interpreter from exiting: leave at once,
    # with the status the run earned.
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
