"""lake.vllm's worker side, driven through the calls vLLM's model runner
makes (``kv_connector_model_runner_mixin.py`` and the attention layers),
against a real pool, with the scheduler side planning as in vLLM:

  once per worker:  register_kv_caches({layer name: paged KV tensor})
  every step:       scheduler: build_connector_meta(scheduler_output)
                    worker:    bind_connector_metadata(meta)
                               start_load_kv(forward_context)
                               per attention layer, in order:
                                   wait_for_layer_load(name)
                                   (attention reads and writes the layer)
                                   save_kv_layer(name, kv_layer, attn_metadata)
                               wait_for_save()
                               get_finished(finished request ids)
                               get_block_ids_with_load_errors()
                               clear_connector_metadata()
                    scheduler: update_connector_output(output)

The tensors have the shapes and strides vLLM's attention backends give
them — flash attention ``(2, blocks, block_size, kv_heads, head_size)`` in
NHD and (permuted) HND order, ``(blocks, 2, ...)``, and MLA ``(blocks,
block_size, head_size)`` — as numpy arrays, as torch CPU tensors, and as
CUDA tensors moved by Lake's kernels where torch and a GPU are there (the
GPU machine; torch is not installable here). vLLM
itself is not installed: its config and request objects are records with
the fields the connector reads."""

import time
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

import lake
from lake import vllm as lake_vllm

BLOCK = 16
LAYERS = 4
HEADS = 2  # per rank; the model has HEADS * TP_SIZE
HEAD_SIZE = 8
MLA_SIZE = 72
TP_SIZE = 2
NUM_BLOCKS = 48

try:
    import torch
except ImportError:  # the machines without a GPU
    torch = None


def backends():
    no_cuda = torch is None or not torch.cuda.is_available()
    return [
        "numpy",
        pytest.param("torch", marks=pytest.mark.skipif(torch is None, reason="torch is not installed")),
        pytest.param("cuda", marks=pytest.mark.skipif(no_cuda, reason="torch with a CUDA GPU is not here")),
    ]


def config(paths, model, tp_rank=0):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={
                "dp_socket": paths["DP_SOCKET"],
                "mirror": paths["MIRROR"],
                "cp_socket": paths["CP_SOCKET"],
                "tenant_key": "22" * 32,
                "tp_rank": tp_rank,
            }
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=SimpleNamespace(model=model, revision="main", tokenizer=model, dtype="float16"),
        parallel_config=SimpleNamespace(tensor_parallel_size=TP_SIZE),
    )


def request(request_id, tokens):
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(tokens), all_token_ids=list(tokens), num_computed_tokens=0
    )


def allocated(block_ids):
    """vLLM's KVCacheBlocks: block ids per KV cache group."""
    return SimpleNamespace(get_block_ids=lambda: (list(block_ids),))


def paged(kind, backend, fill=None):
    """One layer's paged KV tensor as the attention backend lays it out."""
    physical, permute = {
        "flash_nhd": ((2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE), None),
        # Physically (2, blocks, heads, tokens, dim), seen through the
        # logical NHD shape, as vLLM does for HND.
        "flash_hnd": ((2, NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE), (0, 1, 3, 2, 4)),
        "blocks_first": ((NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_SIZE), None),
        "mla": ((NUM_BLOCKS, BLOCK, MLA_SIZE), None),
    }[kind]
    values = np.zeros(physical, dtype=np.float16) if fill is None else fill.integers(-1000, 1000, physical).astype(np.float16)
    if backend in ("torch", "cuda"):
        tensor = torch.from_numpy(values.copy())
        if backend == "cuda":
            tensor = tensor.cuda()
        return tensor.permute(*permute) if permute else tensor
    return values.transpose(permute) if permute else values


def block_of(kind, tensor, block_id):
    """The bytes of one vLLM block of one layer, whatever the layout."""
    array = tensor.cpu().numpy() if torch is not None and isinstance(tensor, torch.Tensor) else tensor
    if kind in ("flash_nhd", "flash_hnd"):
        return np.ascontiguousarray(array[:, block_id])
    return np.ascontiguousarray(array[block_id])


def step(scheduler, worker, caches, finished=frozenset()):
    """One engine step through both sides; returns the worker's
    get_finished answer and its load errors."""
    meta = scheduler.build_connector_meta(SimpleNamespace())
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace())
    for name, tensor in caches.items():
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, tensor, SimpleNamespace())
    worker.wait_for_save()
    sending, receiving = worker.get_finished(set(finished))
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    scheduler.update_connector_output(SimpleNamespace(finished_sending=sending or set(), finished_recving=receiving))
    return sending or set(), errors


def instance(paths, kind, backend, model, tp_rank=0, fill=None):
    scheduler = lake_vllm.LakeConnector(config(paths, model, tp_rank), lake_vllm.KVConnectorRole.SCHEDULER)
    worker = lake_vllm.LakeConnector(config(paths, model, tp_rank), lake_vllm.KVConnectorRole.WORKER)
    caches = {f"model.layers.{i}.self_attn.attn": paged(kind, backend, fill) for i in range(LAYERS)}
    worker.register_kv_caches(caches)
    return scheduler, worker, caches


def wait_cached(scheduler, tokens, blocks):
    keys = scheduler.namespace.keys(np.asarray(tokens[: blocks * BLOCK], dtype=np.uint32))
    for _ in range(500):
        if scheduler.pool.lookup(keys)[0] >= blocks:
            return
        time.sleep(0.01)
    raise AssertionError("the saved blocks never showed in the mirror")


def canonical(kind, caches, block_id):
    """Lake's payload order for one vLLM block: layer after layer, K then V
    (or the one MLA latent), each ``[tokens][heads][head_size]``."""
    parts = []
    for tensor in caches.values():
        block = block_of(kind, tensor, block_id)
        planes = [block] if kind == "mla" else [block[0], block[1]]
        parts += [np.ascontiguousarray(plane).view(np.uint8).ravel() for plane in planes]
    return np.concatenate(parts)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize(
    "saver,loader",
    [("flash_nhd", "flash_nhd"), ("flash_hnd", "flash_nhd"), ("blocks_first", "flash_hnd"), ("mla", "mla")],
)
def test_one_instance_saves_and_another_loads_bit_exact(pool_paths, saver, loader, backend):
    model = f"test/{saver}-{loader}-{backend}"
    rng = np.random.default_rng(zlib.crc32(model.encode()))
    tokens = (np.arange(6 * BLOCK + 3) * 13 + len(model)).tolist()

    # Instance A computes the prompt (nothing cached), then finishes it.
    sched_a, worker_a, caches_a = instance(pool_paths, saver, backend, model, fill=rng)
    ids_a = [5, 9, 2, 30, 31, 17, 8]
    first = request("a-1", tokens)
    assert sched_a.get_num_new_matched_tokens(first, 0) == (0, False)
    sched_a.update_state_after_alloc(first, allocated(ids_a), 0)
    assert step(sched_a, worker_a, caches_a) == (set(), set())
    assert sched_a.request_finished(first, ids_a) == (True, None), "vLLM must keep the blocks until saved"
    done = set()
    deadline = time.monotonic() + 10
    while "a-1" not in done and time.monotonic() < deadline:
        # vLLM goes on stepping other requests meanwhile.
        sending, errors = step(sched_a, worker_a, caches_a, finished={"a-1"})
        assert errors == set()
        done |= sending
        time.sleep(0.001)
    assert done == {"a-1"}, "the save was never reported finished"
    wait_cached(sched_a, tokens, 6)

    # Instance B — another attention backend's layout where it differs, its
    # own block ids and tensors — loads the six full blocks.
    sched_b, worker_b, caches_b = instance(pool_paths, loader, backend, model)
    assert worker_b.layout.fingerprint == worker_a.layout.fingerprint, "one model, one layout, any memory order"
    second = request("b-1", tokens)
    assert sched_b.get_num_new_matched_tokens(second, 0) == (6 * BLOCK, False)
    ids_b = [40, 3, 11, 12, 47, 0, 21]
    sched_b.update_state_after_alloc(second, allocated(ids_b), 6 * BLOCK)
    assert step(sched_b, worker_b, caches_b) == (set(), set())
    for name in caches_a:
        for a, b in zip(ids_a[:6], ids_b[:6]):
            assert np.array_equal(block_of(loader, caches_b[name], b), block_of(saver, caches_a[name], a)), (name, a, b)
        untouched = [i for i in range(NUM_BLOCKS) if i not in ids_b[:6]]
        assert not any(block_of(loader, caches_b[name], i).any() for i in untouched), "a load strayed"

    # The stored payload itself is in Lake's order, whatever A's was: read
    # the blocks raw into plain memory under the same layout.
    keys = sched_b.namespace.keys(np.asarray(tokens[: 6 * BLOCK], dtype=np.uint32))
    with lake.Pool(
        pool_paths["DP_SOCKET"], pool_paths["MIRROR"], sched_b.namespace, cp_socket=pool_paths["CP_SOCKET"],
        layout=worker_a.layout,
    ) as raw:
        plain = np.zeros((6, worker_a.layout.block_bytes), dtype=np.uint8)
        memory_id = raw.register_host_memory(plain)
        hits, table = raw.lookup(keys)
        assert hits == 6
        assert (raw.wait(raw.submit_load(memory_id, keys, table, np.arange(6)), 6) == lake.OK).all()
    for i, a in enumerate(ids_a[:6]):
        assert np.array_equal(plain[i], canonical(saver, caches_a, a)), f"block {i} is not in Lake's order"
    for connector in (worker_a, worker_b, sched_a, sched_b):
        connector.shutdown()


def test_another_shard_never_reads_these_bytes_and_vllm_recomputes(pool_paths):
    model = "test/shards"
    rng = np.random.default_rng(7)
    tokens = (np.arange(4 * BLOCK) * 31 + 1).tolist()
    sched_a, worker_a, caches_a = instance(pool_paths, "flash_nhd", "numpy", model, tp_rank=0, fill=rng)
    ids = [1, 2, 3, 4]
    sched_a.update_state_after_alloc(request("s-1", tokens), allocated(ids), 0)
    assert sched_a.request_finished(request("s-1", tokens), ids) == (True, None)
    deadline = time.monotonic() + 10
    while "s-1" not in step(sched_a, worker_a, caches_a)[0]:
        assert time.monotonic() < deadline, "the save was never reported finished"
        time.sleep(0.001)
    wait_cached(sched_a, tokens, 4)

    # Rank 1 holds the other heads: the mirror names the blocks (a key is
    # the logical block), but their bytes are rank 0's. Its load fails
    # block by block, vLLM is told which, and nothing is written.
    sched_c, worker_c, caches_c = instance(pool_paths, "flash_nhd", "numpy", model, tp_rank=1)
    assert worker_c.layout.fingerprint != worker_a.layout.fingerprint
    third = request("c-1", tokens + [9])
    matched, _ = sched_c.get_num_new_matched_tokens(third, 0)
    assert matched == 4 * BLOCK
    ids_c = [10, 11, 12, 13, 14]
    sched_c.update_state_after_alloc(third, allocated(ids_c), matched)
    _, errors = step(sched_c, worker_c, caches_c)
    assert errors == set(ids_c[:4])
    assert not any(t.any() for t in caches_c.values())
    assert worker_c.pool.stats()["load_failures"] >= 4
    for connector in (sched_a, worker_a, sched_c, worker_c):
        connector.shutdown()


def test_bad_kv_caches_are_refused_by_name(pool_paths):
    cfg = config(pool_paths, "test/bad")
    worker = lake_vllm.LakeConnector(cfg, lake_vllm.KVConnectorRole.WORKER)
    with pytest.raises(ValueError, match="no KV caches"):
        worker.register_kv_caches({})
    mixed = {"a": paged("flash_nhd", "numpy"), "b": paged("blocks_first", "numpy")}
    with pytest.raises(ValueError, match="differs"):
        worker.register_kv_caches(mixed)
    # head_size not innermost: vLLM never does it, and gathering it would
    # be wrong, so it is refused.
    odd = np.zeros((2, NUM_BLOCKS, BLOCK, HEAD_SIZE, HEADS), dtype=np.float16).transpose(0, 1, 2, 4, 3)
    with pytest.raises(ValueError, match="innermost"):
        worker.register_kv_caches({"a": odd})
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.bind_connector_metadata(lake_vllm.LakeConnectorMetadata(loads=[lake_vllm.LoadSpec("x", np.zeros((1, 16), np.uint8), np.zeros(1, lake.LOCATION_DTYPE), [0])]))
        worker.start_load_kv(SimpleNamespace())
