"""lake.vllm against the recorded vLLM connector interface, and its
scheduler side driven through the call sequence vLLM's scheduler makes:

  for each waiting request:  get_num_new_matched_tokens (maybe twice)
  after allocation:          update_state_after_alloc(request, blocks, n)
  once per step:             build_connector_meta(scheduler_output)
  when a request ends:       request_finished(_all_groups)(request, block ids)

against a real pool (vLLM itself cannot be installed here; its config,
request and block objects are plain records with the fields the
connector reads)."""

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import lake
from lake import vllm as lake_vllm

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_kv_connector_v1.json").read_text())
BLOCK = 16


def parameters(function):
    names = []
    for p in inspect.signature(function).parameters.values():
        names.append(("**" if p.kind is p.VAR_KEYWORD else "") + p.name)
    return names


def test_the_connector_has_the_recorded_interface():
    cls = lake_vllm.LakeConnector
    assert parameters(cls.__init__) == FIXTURE["constructor"]
    for name, expected in FIXTURE["abstract"].items():
        assert name in cls.__dict__, f"missing {name}"
        assert parameters(getattr(cls, name)) == expected, name
    # Optional hooks: whichever the connector overrides has the recorded
    # parameters (the rest come from vLLM's base where it is installed).
    overridden = [name for name in FIXTURE["optional"] if name in cls.__dict__]
    assert {"register_kv_caches", "get_finished", "request_finished", "get_block_ids_with_load_errors"} <= set(
        overridden
    )
    for name in overridden:
        assert parameters(getattr(cls, name)) == FIXTURE["optional"][name], name
    hma = FIXTURE["hma"]
    assert issubclass(cls, lake_vllm.SupportsHMA)
    assert parameters(getattr(cls, hma["method"])) == hma["parameters"]
    for name, expected in FIXTURE["classmethods"].items():
        assert parameters(getattr(cls, name).__func__) == expected, name
    assert cls.requires_piecewise_for_cudagraph({}) is True


def config(paths):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={
                "dp_socket": paths["DP_SOCKET"],
                "mirror": paths["MIRROR"],
                "cp_socket": paths["CP_SOCKET"],
                "tenant_key": "11" * 32,
            }
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=SimpleNamespace(model="test/tiny", revision="main", tokenizer="test/tiny", dtype="bfloat16"),
    )


def request(request_id, tokens, computed=0):
    return SimpleNamespace(
        request_id=request_id, prompt_token_ids=list(tokens), all_token_ids=list(tokens), num_computed_tokens=computed
    )


def test_the_scheduler_side_matches_plans_loads_and_saves(pool_paths):
    connector = lake_vllm.LakeConnector(config(pool_paths), lake_vllm.KVConnectorRole.SCHEDULER)
    tokens = (np.arange(10 * BLOCK + 5) * 7 + 3).tolist()
    first = request("r1", tokens)
    assert connector.get_num_new_matched_tokens(first, 0) == (0, False)

    # A previous request's worker saved the first 8 blocks of this prompt.
    keys = connector.namespace.keys(np.asarray(tokens[: 8 * BLOCK], dtype=np.uint32))
    memory = np.zeros((8, pool_paths["BLOCK_BYTES"]), dtype=np.uint8)
    memory[:] = np.arange(8, dtype=np.uint8)[:, None]
    memory_id = connector.pool.register_host_memory(memory)
    assert (connector.pool.wait(connector.pool.submit_save(memory_id, keys, np.arange(8)), 8) == 0).all()
    deadline = 200
    while connector.pool.lookup(keys)[0] < 8 and deadline:
        deadline -= 1
        __import__("time").sleep(0.01)

    # Asked twice, the same answer: nothing is kept or pinned.
    second = request("r2", tokens)
    assert connector.get_num_new_matched_tokens(second, 0) == (8 * BLOCK, False)
    assert connector.get_num_new_matched_tokens(second, 0) == (8 * BLOCK, False)
    assert connector.get_num_new_matched_tokens(second, 3 * BLOCK) == (5 * BLOCK, False), "beyond vLLM's own hit"
    assert connector.build_connector_meta(None).loads == []

    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(100, 111)),))
    connector.update_state_after_alloc(second, blocks, 0)
    assert connector.build_connector_meta(None).loads == [], "no tokens, no load, whatever the blocks"
    connector.update_state_after_alloc(second, blocks, 8 * BLOCK)
    meta = connector.build_connector_meta(None)
    assert len(meta.loads) == 1
    load = meta.loads[0]
    assert load.request_id == "r2" and load.block_ids == list(range(100, 108))
    assert np.array_equal(load.keys, keys)
    assert connector.build_connector_meta(None).loads == [], "each step's plan is shipped once"

    # A whole prompt cached: vLLM still computes the last token itself.
    whole = tokens[: 8 * BLOCK]
    assert connector.get_num_new_matched_tokens(request("r3", whole), 0) == (7 * BLOCK, False)

    # Finished: its full blocks past the cached prefix are saved, under the
    # prefix's last block; vLLM keeps them until the save is reported.
    finished = request("r2", tokens + [5] * 20)
    assert connector.request_finished_all_groups(finished, (list(range(100, 112)), [7, 8])) == (True, None)
    meta = connector.build_connector_meta(None)
    assert len(meta.saves) == 1 and meta.saves[0].block_ids == list(range(108, 111)), "the cached 8 are not saved again"
    assert len(meta.saves[0].keys) == 3 and np.array_equal(meta.saves[0].parent, keys[7])
    all_keys = connector.namespace.keys(np.asarray(finished.prompt_token_ids[: 11 * BLOCK], dtype=np.uint32))
    assert np.array_equal(meta.saves[0].keys, all_keys[8:])
    # Wholly cached: nothing to save, nothing for vLLM to keep.
    assert connector.request_finished(request("r4", tokens[: 8 * BLOCK]), list(range(100, 108))) == (False, None)
    connector.shutdown()


def test_missing_pool_settings_are_named():
    bad = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    with pytest.raises(ValueError, match="dp_socket"):
        lake_vllm.LakeConnector(bad, lake_vllm.KVConnectorRole.SCHEDULER)


def test_layouts_are_described_from_shape_and_strides():
    # (2, blocks, tokens, heads, dim), contiguous: NHD.
    flash_nhd = lake_vllm.describe_layout((2, 100, 16, 8, 128), (1638400, 16384, 1024, 128, 1), 2, 16)
    assert (flash_nhd.kind, flash_nhd.order, flash_nhd.num_blocks, flash_nhd.kv_heads) == ("kv_first", "NHD", 100, 8)
    assert flash_nhd.bytes_per_block == 2 * 16 * 8 * 128 * 2
    # Physically HND, permuted to the logical NHD shape.
    flash_hnd = lake_vllm.describe_layout((2, 100, 16, 8, 128), (1638400, 16384, 128, 2048, 1), 2, 16)
    assert flash_hnd.order == "HND"
    blocks_first = lake_vllm.describe_layout((100, 2, 16, 8, 128), (32768, 16384, 1024, 128, 1), 2, 16)
    assert blocks_first.kind == "blocks_first"
    mla = lake_vllm.describe_layout((100, 16, 576), (9216, 576, 1), 2, 16)
    assert (mla.kind, mla.head_size, mla.bytes_per_block) == ("mla", 576, 16 * 576 * 2)
    for shape, stride in [((100, 16), (16, 1)), ((3, 100, 16, 8, 128), (1, 1, 1, 1, 1)), ((100, 8, 576), (1, 1, 1))]:
        with pytest.raises(ValueError):
            lake_vllm.describe_layout(shape, stride, 2, 16)
