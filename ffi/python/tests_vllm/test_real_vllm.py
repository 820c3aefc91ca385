"""lake.vllm.LakeConnector loaded by real, unmodified vLLM (its CPU build),
against a real `lake serve`, every vLLM in a process of its own.

The reference for every output is vLLM alone — no connector — run through
the same phases in one process, so its own prefix cache holds what the
pool holds in the connector's runs: the suffix each request computes is
then the same, and tokens and top-k logprobs must agree bitwise. That
holds only if every KV byte a process loaded from the pool is the byte
vLLM computed itself; that the tiny model's output depends on its
context is proven first (one prefix token changed changes the output)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest

BLOCK = 128


def tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(count)]


# A shared prefix of 24 blocks; vLLM's own cache will hold its first 8.
SHARED = tokens(1, 24 * BLOCK)
X = SHARED + tokens(2, 50)
Q = SHARED[: 8 * BLOCK] + tokens(3, 40)
Y = SHARED + tokens(4, 70)
Y_CHANGED = SHARED[:100] + [(SHARED[100] % 999) + 1] + SHARED[101:] + Y[len(SHARED) :]
# Prompt and output end exactly on a block boundary (the last sampled
# token's KV is never computed), and one token past one.
Z_END = tokens(5, 1000)  # 1000 + 24 = 8 blocks
Z_PAST = tokens(6, 1001)  # 1001 + 24 = 8 blocks and a token
END_TOKENS = 24


def phase(prompts, max_tokens=8, **extra):
    return {"prompts": [p if isinstance(p, dict) else list(p) for p in prompts], "max_tokens": max_tokens, "logprobs": 5, **extra}


def connector(pool, tenant="11"):
    return {"pool_dir": str(pool.dir), "tenant_key": tenant * 32}


def only(result, index):
    """The one request of phase ``index``: its tokens and top-k logprobs."""
    (request,) = result["phases"][index]["requests"]
    return request


def counters(result, index):
    return result["phases"][index]["counters"]


def external_hits(result, index):
    """vLLM's own count of prompt tokens the connector supplied, in phase
    ``index`` alone."""
    before = counters(result, index - 1)["vllm:external_prefix_cache_hits"] if index else 0
    return counters(result, index)["vllm:external_prefix_cache_hits"] - before


# A long decode killed part way: the kill comes when every token but the
# last sampled one lies in whole blocks (1000 + 153 - 1 = 9 blocks).
W = tokens(9, 1000)
W_TOKENS = 300
W_KILLED_AT = 153
FOLLOW_END = tokens(7, 30)
FOLLOW_PAST = tokens(8, 30)


@pytest.fixture(scope="module")
def reference(engine):
    """vLLM alone, every phase of the connector's runs in one process."""
    return engine.run(
        [
            phase([X]),
            phase([Q]),
            phase([Y]),
            phase([Y_CHANGED]),
            phase([Z_END], END_TOKENS),
            phase([{"after": 4, "then": FOLLOW_END}]),
            phase([Z_PAST], END_TOKENS),
            phase([{"after": 6, "then": FOLLOW_PAST}]),
            phase([W], W_TOKENS),
        ]
    )


def test_the_tiny_model_output_depends_on_its_context(reference):
    # One token of a 3,072-token prefix changed changes what follows it.
    assert only(reference, 2) != only(reference, 3)
    assert only(reference, 2)["tokens"] != only(reference, 3)["tokens"]


@pytest.fixture(scope="module")
def saver(engine, pool, reference):
    """One vLLM process (vLLM's default: scheduler and worker in processes of
    their own) computes X and the block-boundary prompts; its blocks reach
    the pool as they are computed."""
    return engine.run(
        [phase([X]), phase([Z_END], END_TOKENS), phase([Z_PAST], END_TOKENS)],
        connector=connector(pool),
        multiprocess=True,
    )


def test_vllm_reports_lakes_counters_and_hit_rate(saver, reader):
    # vLLM's own metrics show what the connector moved (its KV-connector
    # stats, as counters of vLLM's Prometheus registry).
    # Every block but the last one of the last request: a save is counted
    # once a later step sees it land, and that one may still be landing
    # when the counters are read.
    assert counters(saver, 2)["vllm:lake_blocks_saved"] >= 24 + 7 + 7
    assert counters(saver, 2).get("vllm:lake_blocks_loaded", 0) == 0
    assert counters(reader, 3)["vllm:lake_blocks_loaded"] == 8 + 16 + 7 + 8
    assert counters(reader, 3).get("vllm:lake_blocks_load_failed", 0) == 0
    # One wait per step that loaded, each of it timed.
    assert counters(reader, 3)["vllm:lake_load_seconds_count"] == 4
    assert counters(reader, 3)["vllm:lake_load_seconds_sum"] > 0


def test_the_saver_gets_what_vllm_alone_gets(saver, reference):
    # (And so the follow-up prompts, built from the reference's outputs,
    # are what the saver's conversation would have sent.)
    assert only(saver, 0) == only(reference, 0)
    assert only(saver, 1) == only(reference, 4)
    assert only(saver, 2) == only(reference, 6)
    assert external_hits(saver, 0) == 0


@pytest.fixture(scope="module")
def reader(engine, pool, saver, reference):
    """A new vLLM process: Q takes its 8 shared blocks from the pool (its
    own cache then holds them), Y takes the other 16 from the pool past
    vLLM's own 8, then the block-boundary follow-ups."""
    return engine.run(
        [phase([Q]), phase([Y]), phase([reference["phases"][5]["prompts"][0]]), phase([reference["phases"][7]["prompts"][0]])],
        connector=connector(pool),
    )


def test_a_new_process_reuses_the_shared_prefix_from_the_pool(reader, reference):
    assert external_hits(reader, 0) == 8 * BLOCK
    assert only(reader, 0) == only(reference, 1)


def test_vllms_own_cache_and_the_pool_each_supply_their_part(reader, reference):
    # vLLM's prefix cache holds Q's 8 blocks; the pool supplies blocks 8–23.
    assert counters(reader, 1)["vllm:prefix_cache_hits"] - counters(reader, 0)["vllm:prefix_cache_hits"] == 8 * BLOCK
    assert external_hits(reader, 1) == 16 * BLOCK
    assert only(reader, 1) == only(reference, 2)


def test_a_block_whose_last_token_was_never_computed_is_never_served(reader, reference):
    # Z_END's 8th block held its last sampled token, whose KV vLLM never
    # computed: only 7 blocks were saved, and the follow-up computes the rest.
    assert external_hits(reader, 2) == 7 * BLOCK
    assert only(reader, 2) == only(reference, 5)
    # One token past the boundary: all 8 blocks were computed and saved.
    assert external_hits(reader, 3) == 8 * BLOCK
    assert only(reader, 3) == only(reference, 7)


def test_tenants_never_hit_each_other(engine, pool, reader, reference):
    other = engine.run([phase([Y])], connector=connector(pool, tenant="22"))
    assert external_hits(other, 0) == 0
    assert only(other, 0)["tokens"] == only(reference, 2)["tokens"]


def test_a_killed_engines_successor_resumes_from_the_pool(engine, pool, reference):
    # The engine saves each block as its tokens are computed while it
    # decodes, so a process SIGKILLed mid-decode leaves its KV behind.
    killed = engine.run(
        [phase([W], W_TOKENS, kill_after_tokens=W_KILLED_AT)], connector=connector(pool, tenant="33"),
        expect_kill=True,
    )
    streamed = killed["streamed"][:W_KILLED_AT]
    assert len(streamed) == W_KILLED_AT
    expected = only(reference, 8)
    assert streamed == expected["tokens"][:W_KILLED_AT]
    successor = engine.run([phase([W + streamed], W_TOKENS - W_KILLED_AT)], connector=connector(pool, tenant="33"))
    assert external_hits(successor, 0) == 9 * BLOCK
    resumed = only(successor, 0)
    assert resumed["tokens"] == expected["tokens"][W_KILLED_AT:]
    assert resumed["logprobs"] == expected["logprobs"][W_KILLED_AT:]


SMALL = 32
SHARED_SMALL = tokens(10, 40 * SMALL)
X_SMALL = SHARED_SMALL + tokens(11, 20)
Y_SMALL = SHARED_SMALL + tokens(12, 25)


def test_vllm_block_size_32(engine, pool):
    # The CPU backend's smallest block (its kernels take multiples of 32;
    # 16 runs only on GPU backends). With vLLM's own prefix cache off, Y's
    # whole shared prefix comes from the pool, saved by X in this process.
    phases = [phase([X_SMALL]), phase([Y_SMALL], sleep_before=0.5)]
    alone = engine.run(phases, block_size=SMALL, max_model_len=2048)
    lake = engine.run(phases, block_size=SMALL, max_model_len=2048, connector=connector(pool), prefix_caching=False)
    assert external_hits(lake, 1) == 40 * SMALL
    assert only(lake, 0) == only(alone, 0)
    assert only(lake, 1) == only(alone, 1)


def test_preempted_requests_resume_from_the_pool(engine, pool):
    # A KV cache of 20 blocks of 128 for four requests of 8 blocks that
    # grow to 11: vLLM preempts, and a preempted request finds what it
    # had computed in the pool when it is scheduled again.
    prompts = [tokens(20 + i, 1000) for i in range(4)]
    phases = [phase(prompts, 300)]
    small = {"kv_cache_tokens": 20 * BLOCK, "max_model_len": 1408}
    alone = engine.run(phases, **small)
    lake = engine.run(phases, connector=connector(pool, tenant="44"), **small)
    assert counters(alone, 0)["vllm:num_preemptions"] > 0
    assert counters(lake, 0)["vllm:num_preemptions"] > 0
    # vLLM counts no prefix hits for a preempted request; Lake's own
    # counter in vLLM's metrics shows what it loaded for them.
    assert counters(lake, 0)["vllm:lake_blocks_loaded"] > 0
    # Tokens agree exactly. Logprobs agree to rounding only: vLLM alone
    # recomputes a preempted request's KV in one prefill, where with Lake it
    # gets back the KV its decode steps computed, one token at a time.
    for a, b in zip(alone["phases"][0]["requests"], lake["phases"][0]["requests"]):
        assert a["tokens"] == b["tokens"]
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            assert [t for t, _ in step_a] == [t for t, _ in step_b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(step_a, step_b)) < 1e-3


def pool_gauge(pool, name: str) -> float:
    for line in pool.metrics().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in the pool's metrics")


def test_an_aborted_request_while_its_load_runs_leaves_nothing_behind(engine, pool, saver, reference):
    # Loads asynchronous (vLLM holds the request in WAITING_FOR_REMOTE_KVS
    # until a worker reports the load): Y's 24 shared blocks are loading
    # when the client goes away after the first step. The connector
    # cancels the load, vLLM frees the blocks once it is reported, and the
    # next request is served exactly.
    async_connector = {**connector(pool), "load_async": True}
    result = engine.run(
        [phase([Y, Q], abort_after_steps=1), phase([Y])],
        connector=async_connector,
    )
    first, second = result["phases"]
    assert first["requests"][0] is None, "the aborted request produced output"
    assert first["requests"][1] == only(reference, 1)
    # Y again: Q's 8 blocks are in vLLM's own cache now, the pool gives 16.
    assert only(result, 1) == only(reference, 2)
    assert external_hits(result, 1) == 16 * BLOCK
    # Nothing left pinned in L1 nor leased below it.
    assert pool_gauge(pool, "lake_dp_pins") == 0
    assert pool_gauge(pool, "lake_cp_leases") == 0


def test_a_model_whose_blocks_the_pool_cannot_hold_is_refused_at_start(engine, lake_bin, tmp_path):
    # A pool of 64 KiB blocks; the model's are 256 KiB (128 tokens): every
    # save would be refused. vLLM does not start, and says what to change.
    from conftest import Pool

    small = Pool(lake_bin, tmp_path / "small", 64 * 1024, 16, 16)
    try:
        result = engine.run([phase([X])], connector={"pool_dir": str(small.dir)}, expect_failure=True)
    finally:
        small.stop()
    assert "holds blocks of at most 65536 bytes" in result["log"]
    assert "--block-bytes 262144" in result["log"]


def test_a_pool_killed_under_a_running_vllm_costs_hits_not_output(engine, lake_bin, tmp_path):
    # The engine goes on when its pool dies: loads fail and are recomputed,
    # saves are skipped, nothing raises into vLLM, and what it generates
    # stays what vLLM alone generates.
    from conftest import Pool

    doomed = Pool(lake_bin, tmp_path / "doomed", 128 * 2048, 256, 256)
    gate = str(tmp_path / "go")
    try:
        join = engine.start(
            [phase([X]), phase([Q], wait_for=gate), phase([Y])], connector={"pool_dir": str(doomed.dir)}
        )
        while not os.path.exists(gate + ".ready"):
            time.sleep(0.05)
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait()
        doomed.process = None
        open(gate, "w").close()
        result = join()
    finally:
        doomed.stop()
    # What the killed pool left in shared memory goes with the next start
    # on its directory (its record names it), as an operator's restart
    # would do.
    killed = [doomed.record["arena"], doomed.record["mirror"]]
    assert all(os.path.exists(path) for path in killed), killed
    doomed.start()
    doomed.stop()
    assert not any(os.path.exists(path) for path in killed), killed
    alone = engine.run([phase([X]), phase([Q]), phase([Y])])
    for index in range(3):
        assert only(result, index)["tokens"] == only(alone, index)["tokens"]


def test_a_pool_restarted_between_two_vllm_runs_serves_what_it_held(engine, lake_bin, reference, tmp_path):
    # `lake serve --dir` writes L1 down to its L2 files when it stops and
    # re-adopts them when it starts: a vLLM run after the restart takes
    # the prefix a run before it saved, exact.
    from conftest import Pool

    pool = Pool(lake_bin, tmp_path / "restarted", 128 * 2048, 256, 256)
    try:
        saved = engine.run([phase([X])], connector={"pool_dir": str(pool.dir)})
        pool.stop()
        assert '"blocks_left":0' in pool.log.read_text()
        pool.start()
        result = engine.run([phase([Q])], connector={"pool_dir": str(pool.dir)})
    finally:
        pool.stop()
    assert only(saved, 0) == only(reference, 0)
    assert external_hits(result, 0) == 8 * BLOCK
    assert counters(result, 0).get("vllm:lake_blocks_load_failed", 0) == 0
    assert only(result, 0) == only(reference, 1)


# Speculative decoding with a draft model: the tiny Qwen3 drafts for
# itself, so every proposal is accepted exactly when the draft's KV of the
# context is the KV vLLM computed for it.
SPEC = tokens(31, 4 * BLOCK + 88)


def test_a_draft_models_kv_is_pooled_with_the_targets(engine, lake_bin, model_dir, tmp_path):
    from conftest import KV_BYTES_PER_TOKEN, Pool

    draft = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 2}
    accepted = "vllm:spec_decode_num_accepted_tokens"
    # The draft's two layers are stored in each block beside the target's.
    pool = Pool(lake_bin, tmp_path / "spec", 2 * BLOCK * KV_BYTES_PER_TOKEN, 64, 64)
    try:
        alone = engine.run([phase([SPEC], 16)], speculative=draft)
        saver = engine.run([phase([SPEC], 16)], connector={"pool_dir": str(pool.dir)}, speculative=draft)
        reader = engine.run([phase([SPEC], 16)], connector={"pool_dir": str(pool.dir)}, speculative=draft)
    finally:
        pool.stop()
    assert counters(alone, 0)[accepted] == counters(alone, 0)["vllm:spec_decode_num_draft_tokens"] > 0
    assert external_hits(reader, 0) == 4 * BLOCK
    assert counters(reader, 0)["vllm:lake_blocks_loaded"] == 4
    for run in (saver, reader):
        assert only(run, 0) == only(alone, 0)
        assert counters(run, 0)[accepted] == counters(alone, 0)[accepted]
