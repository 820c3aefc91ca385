"""lake.sglang against the recorded HiCache storage interface, driven
through the calls SGLang's cache controller makes, against a real pool:

  at start:      backend = LakeStore(storage_config, kwargs)   (the factory)
                 backend.register_mem_pool_host(host_pool)
  write-back:    batch_set_v1(page hashes, host indices, extra_info)  per
                 storage batch, extra_info.prefix_keys growing by the
                 batch's hashes
  prefetch:      batch_exists(page hashes, extra_info)  -> pages held
                 batch_get_v1(page hashes, host indices, extra_info)
                 per storage batch, stopping at the first short batch

Host pools are records with SGLang's fields and a numpy ``kv_buffer`` in
each host layout's dimensions (SGLang and torch are not installed here);
page hashes are a SHA-256 chain over the parent's hash and the page's
tokens, shaped like SGLang's ``get_hash_str``."""

import hashlib
import inspect
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import lake
from lake import sglang as lake_sglang

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "sglang_hicache_storage.json").read_text())
PAGE = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
MLA_DIM = 40
PAGES = 24
BATCH = 4  # SGLang's storage batch, small here to exercise several


def parameters(function):
    return [p.name for p in inspect.signature(function).parameters.values()]


def test_the_store_has_the_recorded_interface():
    cls = lake_sglang.LakeStore
    for name, expected in FIXTURE["methods"].items():
        assert name in cls.__dict__ or name == "register_mem_pool_host", f"missing {name}"
        assert parameters(getattr(cls, name)) == expected, name
    assert parameters(cls.__init__) == ["self", "storage_config", "kwargs"]
    assert set(FIXTURE["host_kv_buffer_dims"]["mha"]) == set(lake_sglang.HOST_DIMENSIONS[False])
    assert set(FIXTURE["host_kv_buffer_dims"]["mla"]) == set(lake_sglang.HOST_DIMENSIONS[True])
    for mla, kind in ((False, "mha"), (True, "mla")):
        for layout, dims in FIXTURE["host_kv_buffer_dims"][kind].items():
            assert len(dims) == len(lake_sglang.HOST_DIMENSIONS[mla][layout]), layout


def test_host_layouts_it_does_not_serve_are_refused_by_name():
    # SGLang's host pools whose buffer is no fixed tuple of dimensions
    # (read from its source into the fixture) are refused at registration.
    for kind, layouts in FIXTURE["host_layouts_not_served"].items():
        for layout in layouts:
            with pytest.raises(ValueError, match=f"host layout '{layout}'"):
                lake_sglang.describe_host_pool(np.zeros((2, 4, 16, 2, 8)), layout, PAGE, kind == "mla")


def test_decode_context_parallelism_is_refused():
    config = SimpleNamespace(
        extra_config={"dp_socket": "x", "mirror": "y", "interface_v1": 1}, is_mla_model=True, tp_rank=1, tp_size=2,
        dcp_size=2, dcp_rank=1,
    )
    with pytest.raises(ValueError, match="dcp_size 2"):
        lake_sglang.LakeStore(config, None)


def test_the_pool_is_named_by_its_directory_alone(pool_paths, tmp_path):
    # What `lake serve --dir` records there at its start.
    record = {"dp_socket": pool_paths["DP_SOCKET"], "mirror": pool_paths["MIRROR"], "cp_socket": pool_paths["CP_SOCKET"]}
    (tmp_path / "pool.json").write_text(json.dumps(record))
    config = storage_config(pool_paths, "by-dir")
    for name in ("dp_socket", "mirror", "cp_socket"):
        del config.extra_config[name]
    config.extra_config["pool_dir"] = str(tmp_path)
    store = lake_sglang.LakeStore(config, {})
    host = host_pool("page_first")
    store.register_mem_pool_host(host)
    tokens = list(range(3 * PAGE))
    keys = page_hashes(tokens)
    write_back(store, keys, [0, 1, 2])
    wait_held(store, keys, 3)
    store.close()


def storage_config(paths, model, mla=False, tp_rank=0, tp_size=1, **extra):
    config = {
        "backend_name": "lake",
        "module_path": "lake.sglang",
        "class_name": "LakeStore",
        "interface_v1": 1,
        "dp_socket": paths["DP_SOCKET"],
        "mirror": paths["MIRROR"],
        "cp_socket": paths["CP_SOCKET"],
        "tenant_key": "33" * 32,
    }
    config.update(extra)
    return SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model,
        extra_config=config,
    )


def host_pool(layout, mla=False, fill=None):
    """A host pool record with SGLang's kv_buffer dimensions for ``layout``."""
    size = PAGES * PAGE
    dims = {
        (False, "layer_first"): (2, LAYERS, size, HEADS, HEAD_DIM),
        (False, "page_first"): (2, size, LAYERS, HEADS, HEAD_DIM),
        (False, "page_first_direct"): (2, PAGES, LAYERS, PAGE, HEADS, HEAD_DIM),
        (False, "page_head"): (2, PAGES, HEADS, PAGE, LAYERS, HEAD_DIM),
        (True, "layer_first"): (LAYERS, size, 1, MLA_DIM),
        (True, "page_first"): (size, LAYERS, 1, MLA_DIM),
        (True, "page_first_direct"): (PAGES, LAYERS, PAGE, 1, MLA_DIM),
    }[(mla, layout)]
    buffer = np.zeros(dims, np.float16) if fill is None else fill.integers(-999, 999, dims).astype(np.float16)
    return SimpleNamespace(kv_buffer=buffer, layout=layout, page_size=PAGE, layer_num=LAYERS, size=size, dtype="float16")


def page_view(pool, page, mla=False):
    """One page in one logical order whatever the layout: MHA (2, layer,
    token, head, dim), MLA (layer, token, dim)."""
    b, s = pool.kv_buffer, slice(page * PAGE, (page + 1) * PAGE)
    if mla:
        return {
            "layer_first": lambda: b[:, s, 0],
            "page_first": lambda: b[s, :, 0].transpose(1, 0, 2),
            "page_first_direct": lambda: b[page, :, :, 0],
        }[pool.layout]()
    return {
        "layer_first": lambda: b[:, :, s],
        "page_first": lambda: b[:, s].transpose(0, 2, 1, 3, 4),
        "page_first_direct": lambda: b[:, page],
        "page_head": lambda: b[:, page].transpose(0, 3, 2, 1, 4),
    }[pool.layout]()


def page_hashes(tokens):
    """A SHA-256 chain, one hex digest per full page (like SGLang's)."""
    hashes, parent = [], b""
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        digest = hashlib.sha256(parent + np.asarray(tokens[i : i + PAGE], np.int64).tobytes()).hexdigest()
        hashes.append(digest)
        parent = bytes.fromhex(digest)
    return hashes


def host_indices(pages):
    if not len(pages):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(p * PAGE, (p + 1) * PAGE) for p in pages]).astype(np.int64)


def write_back(store, keys, pages):
    """SGLang's backup of pages to storage, batch by batch."""
    prefix = []
    for i in range(0, len(keys), BATCH):
        info = SimpleNamespace(prefix_keys=list(prefix) or None, extra_info=None)
        assert store.batch_set_v1(keys[i : i + BATCH], host_indices(pages[i : i + BATCH]), info) == [True] * len(
            keys[i : i + BATCH]
        )
        prefix += keys[i : i + BATCH]


def wait_held(store, keys, count):
    """Saves are published to the mirror by lake-cp a moment after they
    complete: wait for it, as a later prefetch would."""
    for _ in range(500):
        if store.batch_exists(keys) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"{count} saved pages never showed in the mirror")


def prefetch(store, keys, pages):
    """SGLang's prefetch: how many pages storage holds, then the loads,
    batch by batch, stopping at the first batch that comes back short."""
    held = store.batch_exists(keys, SimpleNamespace(prefix_keys=None, extra_info=None))
    loaded = 0
    for i in range(0, held, BATCH):
        batch = keys[i : min(i + BATCH, held)]
        results = store.batch_get_v1(batch, host_indices(pages[i : i + len(batch)]))
        loaded += results.index(False) if False in results else len(results)
        if not all(results):
            break
    return held, loaded


@pytest.mark.parametrize(
    "writer,reader,mla",
    [
        ("layer_first", "page_first", False),
        ("page_first_direct", "page_head", False),
        ("page_head", "layer_first", False),
        ("layer_first", "page_first_direct", True),
        ("page_first", "layer_first", True),
    ],
)
def test_one_instance_backs_up_and_another_prefetches_bit_exact(pool_paths, writer, reader, mla):
    model = f"test/sglang-{writer}-{reader}-{mla}"
    rng = np.random.default_rng(len(model) * 7 + mla)
    tokens = (np.arange(7 * PAGE + 5) * 11 + len(model)).tolist()
    keys = page_hashes(tokens)
    assert len(keys) == 7

    a = lake_sglang.LakeStore(storage_config(pool_paths, model, mla), {})
    pool_a = host_pool(writer, mla, fill=rng)
    a.register_mem_pool_host(pool_a)
    assert a.batch_exists(keys) == 0
    pages_a = [3, 0, 9, 4, 21, 22, 7]
    write_back(a, keys, pages_a)
    wait_held(a, keys, 7)
    # Written again (write-through of a shared prefix): held, not rewritten.
    saves = a.get_stats()["saves"]
    assert a.batch_set_v1(keys[:3], host_indices(pages_a[:3])) == [True] * 3
    assert a.get_stats()["saves"] == saves

    b = lake_sglang.LakeStore(storage_config(pool_paths, model, mla), {})
    pool_b = host_pool(reader, mla)
    b.register_mem_pool_host(pool_b)
    assert b.layout.fingerprint == a.layout.fingerprint, "one model, one layout, any host layout"
    pages_b = [10, 11, 1, 2, 15, 23, 5]
    assert prefetch(b, keys, pages_b) == (7, 7)
    for pa, pb in zip(pages_a, pages_b):
        assert np.array_equal(page_view(pool_b, pb, mla), page_view(pool_a, pa, mla)), (pa, pb)
    for page in set(range(PAGES)) - set(pages_b):
        assert not page_view(pool_b, page, mla).any(), f"page {page} written"

    # A longer prompt sharing the first five pages: storage holds five.
    other = page_hashes(tokens[: 5 * PAGE] + [1] * (3 * PAGE))
    assert other[:5] == keys[:5] and b.batch_exists(other) == 5
    results = b.batch_get_v1(other, host_indices([12, 13, 14, 16, 17, 18, 19, 20]))
    assert results == [True] * 5 + [False] * 3
    for connector in (a, b):
        connector.close()


def test_bad_calls_answer_false_and_never_raise_into_sglang(pool_paths):
    store = lake_sglang.LakeStore(storage_config(pool_paths, "test/sglang-bad"), {})
    # Before registration: nothing to read into, no exception.
    assert store.batch_exists(["ab" * 32]) == 0
    pool = host_pool("layer_first", fill=np.random.default_rng(3))
    store.register_mem_pool_host(pool)
    keys = page_hashes(list(range(3 * PAGE)))
    write_back(store, keys, [0, 1, 2])
    wait_held(store, keys, 3)
    before = pool.kv_buffer.copy()
    assert store.batch_get_v1(keys, host_indices([5, 6])) == [False] * 3, "too few host indices"
    assert store.batch_get_v1(keys, host_indices([5, 6, 7]) + 3) == [False] * 3, "not page aligned"
    assert store.batch_get_v1(keys, host_indices([5, 6, PAGES + 4])) == [False] * 3, "outside the pool"
    fresh = page_hashes(list(range(5000, 5000 + PAGE)))
    assert store.batch_set_v1(fresh, host_indices([99])) == [False], "outside the pool"
    assert np.array_equal(pool.kv_buffer, before), "a refused call wrote the host pool"
    assert store.batch_get_v1([], host_indices([])) == [] and store.batch_exists([]) == 0
    with pytest.raises(NotImplementedError, match="v1"):
        store.get(keys[0])
    store.clear()  # logged, the shared pool is left alone
    assert store.batch_exists(keys) == 3
    store.close()


def test_configuration_errors_are_named(pool_paths):
    with pytest.raises(ValueError, match="interface_v1"):
        lake_sglang.LakeStore(storage_config(pool_paths, "m", interface_v1=0), {})
    bad = storage_config(pool_paths, "m")
    del bad.extra_config["dp_socket"]
    with pytest.raises(ValueError, match="dp_socket"):
        lake_sglang.LakeStore(bad, {})
    missing = storage_config(pool_paths, "m")
    missing.extra_config = {"interface_v1": 1, "pool_dir": "/nonexistent/pool"}
    with pytest.raises(ValueError, match="is `lake serve --dir /nonexistent/pool` running"):
        lake_sglang.LakeStore(missing, {})
    store = lake_sglang.LakeStore(storage_config(pool_paths, "m"), {})
    with pytest.raises(ValueError, match="not one of"):
        store.register_mem_pool_host(SimpleNamespace(kv_buffer=np.zeros((2, 2)), layout="sideways", page_size=PAGE))
    wrong = host_pool("page_first_direct")
    wrong.page_size = PAGE * 2
    with pytest.raises(ValueError, match="pages of"):
        store.register_mem_pool_host(wrong)


def test_each_tensor_parallel_rank_backs_up_and_reads_its_own_pages(pool_paths):
    model = "test/sglang-tp"
    keys = page_hashes(list(range(1000, 1000 + 4 * PAGE)))
    rank0 = lake_sglang.LakeStore(storage_config(pool_paths, model, tp_rank=0, tp_size=2), {})
    pool0 = host_pool("page_first", fill=np.random.default_rng(5))
    rank0.register_mem_pool_host(pool0)
    write_back(rank0, keys, [0, 1, 2, 3])
    wait_held(rank0, keys, 4)
    rank1 = lake_sglang.LakeStore(storage_config(pool_paths, model, tp_rank=1, tp_size=2), {})
    pool1 = host_pool("page_first", fill=np.random.default_rng(6))
    rank1.register_mem_pool_host(pool1)
    assert rank1.layout.fingerprint != rank0.layout.fingerprint
    assert rank1.layout.shard_code != rank0.layout.shard_code
    # Each rank (SGLang runs a cache controller per rank) asks for its own
    # heads: rank 0's pages are no hit for rank 1, whose bytes they are not.
    assert rank1.batch_exists(keys) == 0
    untouched = pool1.kv_buffer.copy()
    assert rank1.batch_get_v1(keys, host_indices([4, 5, 6, 7])) == [False] * 4
    assert np.array_equal(pool1.kv_buffer, untouched), "a failed get wrote into the host pool"
    # Rank 1 backs up its own; each rank then reads back exactly its pages.
    write_back(rank1, keys, [0, 1, 2, 3])
    wait_held(rank1, keys, 4)
    assert rank1.batch_exists(keys) == 4 and rank0.batch_exists(keys) == 4
    for store, pool in ((rank0, host_pool("page_first")), (rank1, host_pool("page_first"))):
        reader = lake_sglang.LakeStore(storage_config(pool_paths, model, tp_rank=store.tp_rank, tp_size=2), {})
        reader.register_mem_pool_host(pool)
        assert reader.batch_get_v1(keys, host_indices([8, 9, 10, 11])) == [True] * 4
        source = pool0 if store is rank0 else pool1
        for page, saved in zip([8, 9, 10, 11], [0, 1, 2, 3]):
            assert np.array_equal(page_view(pool, page), page_view(source, saved)), (store.tp_rank, page)
        reader.close()
    rank0.close()
    rank1.close()
