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

import logging
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


def config(paths, model, tp_rank=0, tp_size=1, mla=False):
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
        model_config=SimpleNamespace(
            model=model,
            revision="main",
            tokenizer=model,
            dtype="float16",
            use_mla=mla,
            get_total_num_kv_heads=lambda: HEADS * tp_size,
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
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


def scheduler_output(compute=None):
    """vLLM's SchedulerOutput as the connector reads it: each request in
    ``compute`` ([(request, its block ids)]) has every token it holds
    computed by this step; ``num_computed_tokens`` is advanced after the
    plan, as vLLM's scheduler does."""
    compute = compute or []
    blocks = {r.request_id: (list(ids),) for r, ids in compute}
    return SimpleNamespace(
        num_scheduled_tokens={r.request_id: len(r.all_token_ids) - r.num_computed_tokens for r, _ in compute},
        scheduled_spec_decode_tokens={},
        preempted_req_ids=set(),
        kv_connector_block_state=SimpleNamespace(get_block_ids=blocks.get),
    )


def plan(scheduler, compute=None):
    meta = scheduler.build_connector_meta(scheduler_output(compute))
    for r, _ in compute or []:
        r.num_computed_tokens = len(r.all_token_ids)
    return meta


def step(scheduler, worker, caches, finished=frozenset(), compute=None):
    """One engine step through both sides; returns the worker's
    get_finished answer and its load errors."""
    meta = plan(scheduler, compute)
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


def instance(paths, kind, backend, model, fill=None):
    """One vLLM instance of one rank: its scheduler and its worker."""
    scheduler = lake_vllm.LakeConnector(config(paths, model, mla=kind == "mla"), lake_vllm.KVConnectorRole.SCHEDULER)
    worker, caches = rank_worker(paths, kind, backend, model, 0, 1, fill)
    return scheduler, worker, caches


def rank_worker(paths, kind, backend, model, tp_rank, tp_size, fill=None):
    """The worker of one tensor-parallel rank, with its own KV tensors."""
    cfg = config(paths, model, tp_rank, tp_size, mla=kind == "mla")
    worker = lake_vllm.LakeConnector(cfg, lake_vllm.KVConnectorRole.WORKER)
    caches = {f"model.layers.{i}.self_attn.attn": paged(kind, backend, fill) for i in range(LAYERS)}
    worker.register_kv_caches(caches)
    return worker, caches


def wait_held(hits, blocks, what):
    """A save is reported finished when its blocks are written, a moment
    before the mirror shows them: waits until ``hits()`` does."""
    for _ in range(500):
        if hits() >= blocks:
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} never showed in the mirror: {hits()} of {blocks}")


def wait_cached(scheduler, tokens, blocks):
    keys = scheduler.namespace.keys(np.asarray(tokens[: blocks * BLOCK], dtype=np.uint32))
    wait_held(lambda: scheduler._hits(keys), blocks, "the saved blocks")


def wait_rank_cached(worker, keys, blocks):
    wait_held(lambda: worker.pool.lookup(keys)[0], blocks, "the rank's saved blocks")


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
    # The step computes the prompt: its six full blocks are saved then.
    assert step(sched_a, worker_a, caches_a, compute=[(first, ids_a)]) == (set(), set())
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


def group_step(scheduler, ranks, finished=frozenset(), compute=None):
    """One engine step of a tensor-parallel group: the scheduler's plan goes
    to every rank's worker, as vLLM's executor ships it. Returns each rank's
    (finished saves, load errors)."""
    meta = plan(scheduler, compute)
    answers = []
    for worker, caches in ranks:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(SimpleNamespace())
        for name, tensor in caches.items():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, tensor, SimpleNamespace())
        worker.wait_for_save()
        sending, _ = worker.get_finished(set(finished))
        answers.append((sending or set(), worker.get_block_ids_with_load_errors()))
        worker.clear_connector_metadata()
    return answers


def save_group(scheduler, ranks, request_id, tokens, ids):
    """A request computed and finished, saved by every rank (vLLM's output
    aggregator reports it once all ranks have)."""
    computed = request(request_id, tokens)
    scheduler.update_state_after_alloc(computed, allocated(ids), 0)
    group_step(scheduler, ranks, compute=[(computed, ids)])
    assert scheduler.request_finished(computed, ids) == (True, None)
    pending = set(range(len(ranks)))
    deadline = time.monotonic() + 10
    while pending:
        assert time.monotonic() < deadline, "a rank's save was never reported finished"
        for rank, (sending, errors) in enumerate(group_step(scheduler, ranks, {request_id})):
            assert errors == set()
            if request_id in sending:
                pending.discard(rank)
        time.sleep(0.001)


def test_each_tensor_parallel_rank_reads_its_own_shard(pool_paths):
    model = "test/shards"
    rng = np.random.default_rng(7)
    tokens = (np.arange(4 * BLOCK) * 31 + 1).tolist()
    scheduler = lake_vllm.LakeConnector(config(pool_paths, model, 0, TP_SIZE), lake_vllm.KVConnectorRole.SCHEDULER)
    ranks = [rank_worker(pool_paths, "flash_nhd", "numpy", model, r, TP_SIZE, fill=rng) for r in range(TP_SIZE)]
    assert ranks[0][0].layout.shard_code != ranks[1][0].layout.shard_code != 0
    ids = [1, 2, 3, 4]

    # Only rank 0 saved (rank 1's save was skipped, say): its blocks are
    # no hit for the group — rank 1 has nothing to load — and rank 1's own
    # lookup never finds rank 0's bytes.
    save_group(scheduler, ranks[:1], "s-0", tokens, ids)
    keys = scheduler.namespace.keys(np.asarray(tokens, dtype=np.uint32))
    wait_rank_cached(ranks[0][0], keys, 4)
    assert ranks[1][0].pool.lookup(keys)[0] == 0
    assert scheduler.get_num_new_matched_tokens(request("s-1", tokens + [9]), 0) == (0, False)

    # Both ranks saved: the group hits the whole prefix.
    save_group(scheduler, ranks, "s-2", tokens, ids)
    wait_cached(scheduler, tokens, 4)
    assert scheduler.get_num_new_matched_tokens(request("s-3", tokens + [9]), 0) == (4 * BLOCK, False)

    # A second group (new tensors, other block ids) loads it: each rank gets
    # its own heads' bytes, bit for bit.
    readers = [rank_worker(pool_paths, "flash_nhd", "numpy", model, r, TP_SIZE) for r in range(TP_SIZE)]
    third = request("c-1", tokens + [9])
    ids_c = [10, 11, 12, 13, 14]
    scheduler.update_state_after_alloc(third, allocated(ids_c), 4 * BLOCK)
    assert [errors for _, errors in group_step(scheduler, readers)] == [set(), set()]
    for (_, saved), (_, loaded) in zip(ranks, readers):
        for name in saved:
            for a, c in zip(ids, ids_c[:4]):
                assert np.array_equal(block_of("flash_nhd", loaded[name], c), block_of("flash_nhd", saved[name], a))
    assert not np.array_equal(ranks[0][1][name][:, 1], ranks[1][1][name][:, 1]), "the ranks' heads differ"

    # Another prompt, of which rank 1 holds only the first two blocks: the
    # group's hit is the shorter one.
    tokens2 = (np.arange(4 * BLOCK) * 5 + 2).tolist()
    save_group(scheduler, ranks[:1], "p-0", tokens2, ids)
    save_group(scheduler, ranks[1:], "p-1", tokens2[: 2 * BLOCK], ids[:2])
    keys2 = scheduler.namespace.keys(np.asarray(tokens2, dtype=np.uint32))
    wait_rank_cached(ranks[0][0], keys2, 4)
    wait_rank_cached(ranks[1][0], keys2, 2)
    assert scheduler.get_num_new_matched_tokens(request("p-2", tokens2 + [9]), 0) == (2 * BLOCK, False)

    # A plan made before rank 1 lost the other two (as when they are
    # evicted between the plan and the load): rank 0 loads all four, rank 1
    # loads its two and reports the rest, which vLLM recomputes; nothing
    # else is written.
    ids_d = [20, 21, 22, 23]
    for worker, caches in readers:
        worker.bind_connector_metadata(lake_vllm.LakeConnectorMetadata(loads=[lake_vllm.LoadSpec("p-3", keys2, ids_d)]))
        worker.start_load_kv(SimpleNamespace())
        for name in caches:
            worker.wait_for_layer_load(name)
        worker.wait_for_save()
    assert readers[0][0].get_block_ids_with_load_errors() == set()
    assert readers[1][0].get_block_ids_with_load_errors() == {22, 23}
    for name in ranks[1][1]:
        for a, d in zip(ids[:2], ids_d[:2]):
            assert np.array_equal(block_of("flash_nhd", readers[1][1][name], d), block_of("flash_nhd", ranks[1][1][name], a))
        assert not block_of("flash_nhd", readers[1][1][name], 22).any() and not block_of("flash_nhd", readers[1][1][name], 23).any()
    for worker, _ in readers + ranks:
        worker.shutdown()
    scheduler.shutdown()


def test_bad_kv_caches_are_refused_by_name(pool_paths):
    cfg = config(pool_paths, "test/bad")
    worker = lake_vllm.LakeConnector(cfg, lake_vllm.KVConnectorRole.WORKER)
    with pytest.raises(ValueError, match="no KV caches"):
        worker.register_kv_caches({})
    # Layers of one geometry may lie in memory differently (each layer is
    # described on its own); layers of different geometry cannot make one
    # block.
    mixed = {"a": paged("flash_nhd", "numpy"), "b": paged("mla", "numpy")}
    with pytest.raises(ValueError, match="differs"):
        worker.register_kv_caches(mixed)
    # head_size not innermost: vLLM never does it, and gathering it would
    # be wrong, so it is refused.
    odd = np.zeros((2, NUM_BLOCKS, BLOCK, HEAD_SIZE, HEADS), dtype=np.float16).transpose(0, 1, 2, 4, 3)
    with pytest.raises(ValueError, match="not contiguous"):
        worker.register_kv_caches({"a": odd})
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.bind_connector_metadata(lake_vllm.LakeConnectorMetadata(loads=[lake_vllm.LoadSpec("x", np.zeros((1, 16), np.uint8), [0])]))
        worker.start_load_kv(SimpleNamespace())


def test_a_sampled_request_is_traced_through_the_data_plane(small_paths, caplog):
    """``trace_every``: a sampled request's loads carry a trace id made
    from its vLLM request id; its blocks loaded from L2 come back as spans
    with the data plane's time, summed on one log line under that id."""
    model = "test/traced"
    sched_a, worker_a, caches_a = instance(small_paths, "flash_nhd", "numpy", model, fill=np.random.default_rng(7))
    # Three prompts of 6 blocks each: L1 holds 16, so the first goes down to
    # L2 as the others come.
    prompts = [(np.arange(6 * BLOCK + 1) * 7 + 5 + 100_000 * p).tolist() for p in range(3)]
    ids_a = [list(range(7 * p, 7 * p + 7)) for p in range(3)]
    for p, tokens in enumerate(prompts):
        keys = sched_a.namespace.keys(np.asarray(tokens[: 6 * BLOCK], dtype=np.uint32))
        # Saves are best effort: in a small L1 under other tests' blocks
        # some are skipped, so the engine serves the prompt again (a new
        # request, saving what is not cached yet) until all of it is, as the
        # tier manager makes room.
        for attempt in range(50):
            if sched_a._hits(keys) >= 6:
                break
            first = request(f"t-{p}-{attempt}", tokens)
            sched_a.update_state_after_alloc(first, allocated(ids_a[p]), 0)
            step(sched_a, worker_a, caches_a, compute=[(first, ids_a[p])])
            assert sched_a.request_finished(first, ids_a[p]) == (True, None), "part of it is not cached"
            deadline = time.monotonic() + 10
            done = set()
            while first.request_id not in done and time.monotonic() < deadline:
                done |= step(sched_a, worker_a, caches_a, finished={first.request_id})[0]
            time.sleep(0.1)
        wait_cached(sched_a, tokens, 6)

    cfg = config(small_paths, model)
    cfg.kv_transfer_config.kv_connector_extra_config["trace_every"] = 1
    sched_b = lake_vllm.LakeConnector(cfg, lake_vllm.KVConnectorRole.SCHEDULER)
    worker_b = lake_vllm.LakeConnector(cfg, lake_vllm.KVConnectorRole.WORKER)
    caches_b = {f"model.layers.{i}.self_attn.attn": paged("flash_nhd", "numpy", None) for i in range(LAYERS)}
    worker_b.register_kv_caches(caches_b)
    second = request("t-b", prompts[0])
    hit_tokens, _ = sched_b.get_num_new_matched_tokens(second, 0)
    assert hit_tokens == 6 * BLOCK
    ids_b = list(range(30, 37))
    sched_b.update_state_after_alloc(second, allocated(ids_b), hit_tokens)
    with caplog.at_level(logging.INFO, logger="lake.vllm"):
        assert step(sched_b, worker_b, caches_b) == (set(), set())
    for name in caches_a:
        for a, b in zip(ids_a[0][:6], ids_b[:6]):
            assert np.array_equal(block_of("flash_nhd", caches_b[name], b), block_of("flash_nhd", caches_a[name], a))
    text = caplog.text
    assert "request t-b traced as" in text, text
    line = next((l for l in text.splitlines() if "request t-b (trace" in l), None)
    assert line is not None, f"no trace line (no block of the first prompt came from L2?): {text}"
    loaded = int(line.split("): ")[1].split(" blocks")[0])
    assert loaded >= 1 and " 0 not loaded" in line, line
    for connector in (worker_a, worker_b, sched_a, sched_b):
        connector.shutdown()
