"""The F4 case: a decode engine killed mid-generation (SIGKILL) is
resumed by another from the pool, losing at most one block, and the
output goes on exactly as the uninterrupted generation's.

The engine is a deterministic CPU stand-in (``f4_engine``) in a process of
its own, saving each block as it fills; the pool's L1 holds 16 blocks, so
most of the request's blocks are in L2 when the second engine loads
them."""

import os
import signal
import subprocess
import sys
import time

import numpy as np

import f4_engine
import lake
from f4_engine import TOKENS

PROMPT, NEW, KILL_AFTER = 160, 320, 250


def resume(paths, tokens, kv_blocks, hits):
    engine = f4_engine.Engine(paths["BLOCK_BYTES"], tokens, kv=kv_blocks[:hits])
    return [engine.step() for _ in range(NEW - (len(tokens) - PROMPT))]


def test_a_decode_engine_killed_mid_generation_resumes_from_l2_identically(small_paths):
    block_bytes, seed = small_paths["BLOCK_BYTES"], 4242
    want = f4_engine.reference(block_bytes, seed, PROMPT, NEW)
    args = [small_paths["DP_SOCKET"], small_paths["MIRROR"], small_paths["CP_SOCKET"], str(block_bytes)]
    engine = subprocess.Popen(
        [sys.executable, f4_engine.__file__, *args, str(seed), str(PROMPT), str(NEW)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(lake.__file__) + "/.."),
    )
    try:
        assert engine.stdout.readline().strip() == "ready"
        streamed = []
        while len(streamed) < KILL_AFTER:
            line = engine.stdout.readline()
            assert line, "the engine ended early"
            streamed.append(int(line))
        engine.send_signal(signal.SIGKILL)
    finally:
        engine.kill()
        engine.wait()
    # What the client saw is what the model says.
    assert streamed == want[:KILL_AFTER]

    # Another engine takes the request: the prompt and the tokens streamed.
    ns = f4_engine.namespace(seed)
    tokens = f4_engine.prompt(seed, PROMPT) + streamed
    full = len(tokens) // TOKENS
    keys = ns.keys(np.asarray(tokens[: full * TOKENS], dtype=np.uint32))
    with lake.Pool(
        small_paths["DP_SOCKET"], small_paths["MIRROR"], ns, cp_socket=small_paths["CP_SOCKET"], segment_bytes=4096
    ) as pool:
        # A save acked just before the kill is published a moment later.
        deadline = time.monotonic() + 2
        hits, table = pool.lookup(keys)
        while hits < full and time.monotonic() < deadline:
            time.sleep(0.02)
            hits, table = pool.lookup(keys)
        assert hits >= full - 1, f"{hits} of {full} blocks: more than one lost"
        # Loaded a few blocks at a time, looked up again before each: L1
        # holds 16 blocks and moves under this load (promotions from L2,
        # demotions of what the killed engine saved last), so a block may
        # leave L1 between a lookup and its load (LAKE_EVICTED): looked up
        # again, it is found where it went.
        memory = np.zeros((hits, block_bytes), dtype=np.uint8)
        memory_id = pool.register_host_memory(memory)
        loaded, from_l2, tries = 0, 0, 0
        while loaded < hits:
            tries += 1
            assert tries < 50, f"{loaded} of {hits} blocks loaded after {tries} tries"
            found, table = pool.lookup(keys[:hits])
            assert found == hits, f"block {found} went missing"
            end = min(hits, loaded + 4)
            request = pool.submit_load(memory_id, keys[loaded:end], table[loaded:end], np.arange(loaded, end))
            statuses = pool.wait(request, end - loaded, timeout=30)
            assert set(statuses.tolist()) <= {lake.OK, lake.EVICTED, lake.PREFIX_BROKEN}, statuses
            ok = int(np.argmin(statuses == lake.OK)) if (statuses != lake.OK).any() else end - loaded
            from_l2 += int((table["tier"][loaded : loaded + ok] == 2).sum())
            loaded += ok
        assert from_l2 >= full - 16, f"only {from_l2} of {hits} blocks came from L2"
        print(f"F4: {hits} of {full} blocks restored ({from_l2} from L2, {tries} loads), {full - hits} recomputed")
        kv_blocks = [memory[i].tobytes() for i in range(hits)]
        assert streamed + resume(small_paths, tokens, kv_blocks, hits) == want, "the output diverged"
        # The check can fail: one wrong byte in the restored KV diverges.
        bad = list(kv_blocks)
        bad[hits - 1] = bytes([bad[hits - 1][0] ^ 1]) + bad[hits - 1][1:]
        assert streamed + resume(small_paths, tokens, bad, hits) != want
        assert pool.alive(), "the pool outlived the engine"
