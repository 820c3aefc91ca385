"""lake.vllm against the recorded vLLM connector interface, its settings
and its layout descriptions, without vLLM. The scheduler side and the
whole connector run inside real vLLM in ``ffi/python/tests_vllm``
(``cargo test -p lake-cp --test vllm``)."""

import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import lake
from lake import vllm as lake_vllm

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_kv_connector_v1.json").read_text())


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


def test_missing_pool_settings_are_named(tmp_path):
    bad = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    with pytest.raises(ValueError, match="needs 'pool_dir'.*or 'dp_socket'"):
        lake_vllm.LakeConnector(bad, lake_vllm.KVConnectorRole.SCHEDULER)
    # A pool directory no `lake serve` runs in: the error says so.
    gone = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"pool_dir": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"no .*pool\.json: is `lake serve --dir .*` running\?"):
        lake_vllm.LakeConnector(gone, lake_vllm.KVConnectorRole.SCHEDULER)
    (tmp_path / "pool.json").write_text('{"dp_socket": "x"}')
    with pytest.raises(ValueError, match="names no mirror, cp_socket"):
        lake_vllm.LakeConnector(gone, lake_vllm.KVConnectorRole.SCHEDULER)


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


def test_pull_settings_are_checked_by_name():
    where = "kv_connector_extra_config"
    assert lake.pull_settings({}, where) == (True, lake.PULL_TIMEOUT_S, 0)
    assert lake.pull_settings({"pull": False, "pull_timeout_s": 0.5, "compute_ns_per_block": 9}, where) == (
        False, 0.5, 9,
    )
    bad = [
        ({"pull": "yes"}, "'pull'] is true or false"),
        ({"pull_timeout_s": 0}, "'pull_timeout_s'] is seconds in"),
        ({"pull_timeout_s": True}, "'pull_timeout_s'] is seconds in"),
        ({"pull_timeout_s": 61}, "'pull_timeout_s'] is seconds in"),
        ({"compute_ns_per_block": -1}, "'compute_ns_per_block'] is ns"),
        ({"compute_ns_per_block": 1.5}, "'compute_ns_per_block'] is ns"),
    ]
    for settings, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            lake.pull_settings(settings, where)
