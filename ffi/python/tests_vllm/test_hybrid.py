"""A hybrid model under real vLLM and the Lake connector: a tiny
Qwen3-Next, one Gated DeltaNet layer (its conv and recurrent state in a
state group of vLLM's hybrid allocator) and one full-attention layer.

vLLM (prefix caching, ``mamba_cache_mode="align"``) resumes a hybrid
prefix only where it has the state after the prefix's last block; the
connector saves that state as a checkpoint object beside the KV blocks
and loads both. As in ``test_real_vllm.py``, the reference is vLLM alone
through the same phases in one process, whose own cache then resumes
from the same boundaries: tokens and top-k logprobs must agree bitwise,
which they do only if the KV and the state a process loaded from the pool
are the bytes vLLM computed."""

from __future__ import annotations

import pytest
from test_real_vllm import BLOCK, counters, external_hits, only, phase, tokens

HYBRID = {"dtype": "bfloat16", "kv_cache_bytes": 64 << 20}

# 7 blocks, then a tail: vLLM computes a prompt in steps that end on
# block boundaries, so the state after block 7 is checkpointed.
PREFIX = tokens(21, 7 * BLOCK)
A = PREFIX + tokens(22, 40)
B = PREFIX + tokens(23, 60)
# One token of the loaded part of the prefix changed.
B_CHANGED = PREFIX[:850] + [(PREFIX[850] % 999) + 1] + PREFIX[851:] + B[len(PREFIX) :]
# Shares 3 blocks with the prefix: vLLM's own cache then holds those (and
# the state after them), the pool the rest.
Q = PREFIX[: 3 * BLOCK] + tokens(24, 30)


def hybrid_connector(pool):
    return {"pool_dir": str(pool.dir), "tenant_key": "33" * 32}


@pytest.fixture(scope="module")
def reference(engine, hybrid_model_dir):
    return engine.run(
        [phase([A]), phase([Q]), phase([B]), phase([B_CHANGED])], model=hybrid_model_dir, **HYBRID
    )


@pytest.fixture(scope="module")
def saver(engine, pool, hybrid_model_dir, reference):
    return engine.run([phase([A])], model=hybrid_model_dir, connector=hybrid_connector(pool), **HYBRID)


@pytest.fixture(scope="module")
def reader(engine, pool, hybrid_model_dir, saver):
    """A new process: Q (its 3 shared blocks have no checkpoint in the
    pool: computed), then B: 3 blocks from vLLM's own cache, 4 and the
    state after block 7 from the pool."""
    return engine.run(
        [phase([Q]), phase([B], sleep_before=0.5)], model=hybrid_model_dir, connector=hybrid_connector(pool), **HYBRID
    )


def test_the_tiny_hybrid_output_depends_on_its_prefix(reference):
    assert only(reference, 2)["tokens"] != only(reference, 3)["tokens"]


def test_the_saver_checkpoints_the_state_beside_the_blocks(saver, reference):
    assert only(saver, 0) == only(reference, 0)
    assert counters(saver, 0)["vllm:lake_states_saved"] >= 1
    assert counters(saver, 0)["vllm:lake_blocks_saved"] >= 7


def test_no_checkpoint_no_hit(reader, reference):
    # The pool holds Q's first 3 blocks but no state after them: a hybrid
    # cannot resume there, so nothing is claimed.
    assert external_hits(reader, 0) == 0
    assert only(reader, 0) == only(reference, 1)


def test_a_new_process_resumes_a_hybrid_prefix_from_the_pool(reader, reference):
    hits = counters(reader, 1)["vllm:prefix_cache_hits"] - counters(reader, 0)["vllm:prefix_cache_hits"]
    assert hits == 3 * BLOCK
    assert external_hits(reader, 1) == 4 * BLOCK
    assert counters(reader, 1)["vllm:lake_states_loaded"] == 1
    assert counters(reader, 1).get("vllm:lake_blocks_load_failed", 0) == 0
    assert only(reader, 1) == only(reference, 2)


def damage_l1(arena: str) -> int:
    """Flips one payload byte of every slot of a pool's L1 arena (its
    header: docs/formats.md), as memory gone bad would; every block then
    fails its CRC when loaded. The slots it damaged."""
    import struct

    with open(arena, "r+b") as f:
        header = f.read(296)
        (class_count,) = struct.unpack_from("<H", header, 38)
        (slots_offset,) = struct.unpack_from("<Q", header, 88)
        damaged = 0
        for c in range(class_count):
            _first, slots, slot_bytes, offset = struct.unpack_from("<IIQQ", header, 104 + 24 * c)
            for i in range(slots):
                at = slots_offset + offset + i * slot_bytes + 8192
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0x5A]))
                damaged += 1
    return damaged


def test_a_failed_hybrid_load_is_recomputed_not_served(engine, lake_bin, hybrid_model_dir, reference, tmp_path):
    # The pool's copies go bad after the save: every load fails its CRC.
    # A hybrid request cannot resume part way without its state, so vLLM
    # is told the whole load failed (it takes no block ids of a model of
    # several KV cache groups) and recomputes the request; the output is
    # vLLM's own, and nothing raises into vLLM.
    from conftest import Pool

    pool = Pool(lake_bin, tmp_path / "damaged", 256 * 1024, 64, 64)
    try:
        engine.run([phase([A])], model=hybrid_model_dir, connector=hybrid_connector(pool), **HYBRID)
        assert damage_l1(pool.record["arena"]) == 64
        runs = {
            policy: engine.run(
                [phase([B])], model=hybrid_model_dir, connector=hybrid_connector(pool), load_failure_policy=policy,
                **HYBRID,
            )
            for policy in ("fail", "recompute")
        }
    finally:
        pool.stop()
    for policy, result in runs.items():
        print(policy, {k: v for k, v in counters(result, 0).items() if "lake" in k or "external" in k}, only(result, 0)["tokens"])
    # vLLM's default policy fails the request: no output, never wrong output.
    assert only(runs["fail"], 0)["tokens"] == []
    result = runs["recompute"]
    assert external_hits(result, 0) == 7 * BLOCK
    assert counters(result, 0)["vllm:lake_blocks_load_failed"] == 7
    assert counters(result, 0)["vllm:lake_states_loaded"] == 0
    assert only(result, 0) == only(reference, 2)
