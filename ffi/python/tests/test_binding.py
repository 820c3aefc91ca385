"""The binding against a real pool: the call sequence an engine makes
(keys, attach, register memory, save, lookup, load, poll), numpy in and
out, and bad arguments that must raise, never crash or write wrong bytes."""

import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

import lake
from conftest import needs

TOKENS = 16


def namespace(tenant=7):
    return lake.Namespace(bytes([tenant]) * 32, TOKENS, bytes([3]) * 32)


def attach(paths, ns):
    return lake.Pool(paths["DP_SOCKET"], paths["MIRROR"], ns, cp_socket=paths["CP_SOCKET"], segment_bytes=4096)


def kv(keys, block_bytes):
    """The stand-in model's KV: a function of each key."""
    out = np.empty((len(keys), block_bytes), dtype=np.uint8)
    for i, key in enumerate(keys):
        rng = np.random.default_rng(int.from_bytes(key[:8].tobytes(), "little"))
        out[i] = rng.integers(0, 256, block_bytes, dtype=np.uint8)
    return out


def wait_hits(pool, keys, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        hits, table = pool.lookup(keys)
        if hits >= want or time.monotonic() > deadline:
            return hits, table
        time.sleep(0.005)


def test_keys_are_deterministic_incremental_and_tenant_bound():
    tokens = np.arange(10 * TOKENS + 3, dtype=np.uint32) * 31
    ns = namespace()
    whole = ns.keys(tokens)
    assert whole.shape == (10, 16) and whole.dtype == np.uint8
    chain = lake.KeyChain(ns)
    parts = [chain.extend(tokens[:37]), chain.extend(tokens[37:38]), chain.extend(tokens[38:])]
    assert np.array_equal(np.concatenate(parts), whole)
    assert not np.array_equal(namespace(tenant=8).keys(tokens), whole), "another tenant, other keys"
    assert namespace().id == ns.id and namespace(tenant=8).id != ns.id


def test_save_lookup_load_round_trip(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(12 * TOKENS, dtype=np.uint32) + 1000)
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((24, block_bytes), dtype=np.uint8)
        memory[:12] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert not pool.save_pressure()
        request = pool.submit_save(memory_id, keys, np.arange(12))
        assert (pool.wait(request, 12) == 0).all()
        hits, table = wait_hits(pool, keys, 12)
        assert hits == 12 and table.dtype == lake.LOCATION_DTYPE
        assert set(table["tier"]) <= {1, 2}
        request = pool.submit_load(memory_id, keys, table, np.arange(12, 24))
        assert (pool.wait(request, 12) == 0).all()
        assert np.array_equal(memory[12:], memory[:12]), "the bytes came back"
        stats = pool.stats()
        assert stats["saves"] == 12 and stats["l1_loads"] + stats["l2_loads"] >= 12
        # Untraced loads leave no span; a traced one leaves one per block
        # it brought up from L2 (none for L1 hits), with its trace id.
        assert pool.trace_spans().shape[0] == 0
        hits, table = wait_hits(pool, keys, 12)
        lake.set_trace(0x7ACE)
        try:
            request = pool.submit_load(memory_id, keys, table, np.arange(12, 24))
            assert (pool.wait(request, 12) == 0).all()
        finally:
            lake.set_trace(0)
        spans = pool.trace_spans()
        assert (spans["trace"] == 0x7ACE).all() and (spans["tier"] == 2).all()
        assert spans.shape[0] >= int((table["tier"] == 2).sum())


def test_a_cluster_lookup_of_a_single_node_pool_names_this_nodes_blocks_as_lookup_does(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace(tenant=11)
    keys = ns.keys(np.arange(6 * TOKENS, dtype=np.uint32) + 7000)
    with attach(pool_paths, ns) as pool:
        memory = kv(keys[:4], block_bytes)
        request = pool.submit_save(pool.register_host_memory(memory), keys[:4], np.arange(4))
        assert (pool.wait(request, 4) == 0).all()
        hits, table = wait_hits(pool, keys, 4)
        found, where = pool.lookup_cluster(keys)
        assert where.dtype == lake.WHERE_DTYPE and (found, hits) == (4, 4)
        assert (where["local"] == 1).all() and (where["tier"] == table["tier"]).all()
        assert (where["location"] == table).all(), "this node's blocks carry lake_lookup's entries"
        assert pool.lookup_cluster(keys[4:])[0] == 0, "held nowhere"
        # Nothing to pull in a pool of one node: its own hit, at once.
        started = time.monotonic()
        assert pool.pull(keys, timeout_s=5.0) == 4
        assert time.monotonic() - started < 1.0
        assert pool.pull_cost() == 0, "nothing pulled, nothing measured"


def test_a_pool_that_refuses_saves_says_so_and_a_save_is_skipped_whole(closed_paths):
    # The pool began to stop: it refuses saves, and the engine reads that
    # from shared memory without asking. A save submitted anyway is not
    # sent: every block says why, none is in the pool.
    block_bytes = closed_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(6 * TOKENS, dtype=np.uint32) + 5000)
    with attach(closed_paths, ns) as pool:
        assert pool.save_pressure()
        memory = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        statuses = pool.wait(pool.submit_save(memory_id, keys[:3], np.arange(3)), 3)
        assert (statuses == lake.SAVE_PRESSURE).all(), statuses
        assert lake.STATUS[int(statuses[0])] == "LAKE_SAVE_PRESSURE"
        # The rest of the prompt, later: under blocks not saved, nothing
        # is sent either.
        statuses = pool.wait(pool.submit_save(memory_id, keys[3:], np.arange(3, 6), parent=keys[2]), 3)
        assert set(statuses.tolist()) <= {lake.SAVE_PRESSURE, lake.PREFIX_BROKEN}, statuses
        assert pool.lookup(keys)[0] == 0
        assert pool.stats()["saves"] == 0


def test_a_save_past_the_tenants_l1_quota_is_refused_over_quota_and_others_are_not_held(quota_paths):
    # Tenant 9 may hold 4 blocks of L1: a save of 8 has the blocks past
    # its quota refused at their commit, never published; the pool is not
    # under save pressure for that (another tenant saves on).
    block_bytes = quota_paths["BLOCK_BYTES"]
    ns = namespace(9)
    keys = ns.keys(np.arange(8 * TOKENS, dtype=np.uint32) + 7000)
    with attach(quota_paths, ns) as pool:
        memory = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        statuses = pool.wait(pool.submit_save(memory_id, keys, np.arange(8)), 8)
        refused = int((statuses == lake.OVER_QUOTA).sum())
        assert refused >= 1 and int((statuses == lake.OK).sum()) < 8, statuses
        first = int(np.argmax(statuses != lake.OK))
        assert first <= 4 and statuses[first] == lake.OVER_QUOTA, statuses
        assert lake.STATUS[int(statuses[first])] == "LAKE_OVER_QUOTA"
        assert not pool.save_pressure()
        # The control plane holds the tenant a slot below its quota: it moves
        # the coldest down while this reads, so a load may find a block gone
        # from where it was looked up (EVICTED) and look it up again, as an
        # engine does.
        out = np.zeros_like(memory)
        out_id = pool.register_host_memory(out)
        deadline = time.monotonic() + 10.0
        while True:
            hits, table = wait_hits(pool, keys, first)
            assert hits == first, (hits, statuses)
            loaded = pool.wait(pool.submit_load(out_id, keys[:hits], table[:hits], np.arange(hits)), hits)
            if (loaded == lake.OK).all():
                break
            assert set(loaded.tolist()) <= {lake.OK, lake.EVICTED, lake.PREFIX_BROKEN}, loaded
            assert time.monotonic() < deadline, loaded
        assert (out[:hits] == memory[:hits]).all()
    other = namespace(10)
    other_keys = other.keys(np.arange(8 * TOKENS, dtype=np.uint32) + 7000)
    with attach(quota_paths, other) as pool:
        memory = kv(other_keys, block_bytes)
        statuses = pool.wait(pool.submit_save(pool.register_host_memory(memory), other_keys, np.arange(8)), 8)
        assert (statuses == lake.OK).all(), statuses


def test_pinned_hits_load_in_the_calling_thread(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(4 * TOKENS, dtype=np.uint32) + 7000)
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((8, block_bytes), dtype=np.uint8)
        memory[:4] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(4)), 4) == 0).all()
        wait_hits(pool, keys, 4)
        hits, table, pins = pool.lookup_pinned(keys)
        with pins:
            assert hits == 4 and (table["tier"] == 1).all()
            statuses = pins.load(memory_id, np.arange(4, 8))
            assert (statuses == 0).all(), statuses
            assert np.array_equal(memory[4:], memory[:4])
            with pytest.raises(lake.LakeError):
                pins.load(memory_id, np.arange(3, 8))
        with pytest.raises(lake.LakeError):
            pins.load(memory_id, np.arange(4, 8))


def test_a_block_evicted_between_lookup_and_load_fails_cleanly(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(3 * TOKENS, dtype=np.uint32) + 5000)
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((6, block_bytes), dtype=np.uint8)
        memory[:3] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(3)), 3) == 0).all()
        hits, table = wait_hits(pool, keys, 3)
        assert hits == 3
        # What an eviction does to a reader: the slot's generation moved on.
        stale = table.copy()
        stale["generation"][1] += 1000
        statuses = pool.wait(pool.submit_load(memory_id, keys, stale, np.arange(3, 6)), 3)
        assert list(statuses) == [lake.OK, lake.EVICTED, lake.PREFIX_BROKEN], statuses
        assert np.array_equal(memory[3], memory[0])
        assert not memory[4:].any(), "nothing was written for the failed blocks"


def test_hybrid_state_checkpoints_are_objects_of_their_own(pool_paths):
    """A hybrid model's recurrent state, checkpointed after blocks 4 and 8
    of a 12-block prompt: the resume point is the deepest checkpoint at or
    below the KV hit, its bytes come back exact, and neither kind of reader
    is ever handed the other kind's bytes."""
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace(tenant=11)
    keys = ns.keys(np.arange(12 * TOKENS, dtype=np.uint32) + 9000)
    state_layout = lake.StateLayout(layers=3, state_bytes_per_layer=block_bytes // 4, dtype="float32")
    assert state_layout.block_bytes == 3 * (block_bytes // 4) and state_layout.segment_bytes == block_bytes // 4
    assert state_layout.fingerprint != lake.StateLayout(3, block_bytes // 8).fingerprint
    with attach(pool_paths, ns) as kv_pool, lake.Pool(
        pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, cp_socket=pool_paths["CP_SOCKET"], layout=state_layout
    ) as state_pool:
        memory = np.zeros((24, block_bytes), dtype=np.uint8)
        memory[:12] = kv(keys, block_bytes)
        kv_id = kv_pool.register_host_memory(memory)
        assert (kv_pool.wait(kv_pool.submit_save(kv_id, keys, np.arange(12)), 12) == 0).all()
        wait_hits(kv_pool, keys, 12)
        # Nothing checkpointed yet: the KV hit, no resume point.
        hits, table, state_blocks, _ = state_pool.lookup_state(keys)
        assert (hits, state_blocks) == (12, 0) and len(table) == 12
        states = np.zeros((4, state_layout.block_bytes), dtype=np.uint8)
        states[:2] = kv(lake.state_keys(keys[[3, 7]]), state_layout.block_bytes)
        state_id = state_pool.register_host_memory(states)
        for slot, block in enumerate((3, 7)):
            checkpoint = lake.state_keys(keys[block : block + 1])
            request = state_pool.submit_save(state_id, checkpoint, [slot], parent=keys[block])
            assert (state_pool.wait(request, 1) == 0).all()
        deadline = time.monotonic() + 10
        while state_pool.lookup_state(keys)[2] < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        hits, table, state_blocks, where = state_pool.lookup_state(keys)
        assert (hits, state_blocks) == (12, 8) and where["kind"][0] == 2 and where["tier"][0] in (1, 2)
        assert state_pool.lookup_state(keys[:7])[:3:2] == (7, 4)
        assert state_pool.lookup_state(keys[:3])[:3:2] == (3, 0)
        # The KV chain itself did not grow: a checkpoint is no block of it.
        assert kv_pool.lookup(keys)[0] == 12
        # The checkpoint after block 8 loads back exact.
        checkpoint = lake.state_keys(keys[7:8])
        statuses = state_pool.wait(state_pool.submit_load(state_id, checkpoint, where, [3]), 1)
        assert list(statuses) == [lake.OK] and np.array_equal(states[3], states[1])
        # A KV reader is never given a checkpoint's bytes, nor a state
        # reader a KV block's; neither memory is written.
        before = memory.copy()
        statuses = kv_pool.wait(kv_pool.submit_load(kv_id, checkpoint, where, [12]), 1)
        assert list(statuses) == [lake.LAYOUT_MISMATCH] and np.array_equal(memory, before)
        states[2] = 0
        statuses = state_pool.wait(state_pool.submit_load(state_id, keys[:1], table[:1], [2]), 1)
        assert list(statuses) == [lake.LAYOUT_MISMATCH] and not states[2].any()
    with pytest.raises(lake.LakeError, match="state layout"):
        lake.StateLayout(layers=0, state_bytes_per_layer=64)


def test_a_layout_whose_blocks_fit_no_l1_class_is_refused_at_attach(pool_paths):
    # Every save of such a block would be refused, silently: the attach
    # says so instead, naming both sizes and the flag that fits it.
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    too_big = lake.StateLayout(layers=2, state_bytes_per_layer=block_bytes, dtype="uint8")
    assert too_big.block_bytes == 2 * block_bytes
    with pytest.raises(lake.LakeError, match=f"blocks are {2 * block_bytes} bytes.*at most {block_bytes} bytes") as e:
        lake.Pool(pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, cp_socket=pool_paths["CP_SOCKET"], layout=too_big)
    assert f"--block-bytes {2 * block_bytes}" in str(e.value)
    fits = lake.StateLayout(layers=1, state_bytes_per_layer=block_bytes, dtype="uint8")
    lake.Pool(pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, cp_socket=pool_paths["CP_SOCKET"], layout=fits).close()


def test_bad_arguments_raise_and_change_nothing(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(2 * TOKENS, dtype=np.uint32) + 9000)
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((2, block_bytes), dtype=np.uint8)
        memory_id = pool.register_host_memory(memory)
        with pytest.raises(ValueError):
            pool.lookup(np.zeros((2, 15), dtype=np.uint8))
        with pytest.raises(ValueError):
            pool.submit_save(memory_id, keys, np.arange(3))
        with pytest.raises(ValueError):
            pool.register_host_memory(np.zeros(10, dtype=np.float32))
        with pytest.raises(lake.LakeError) as error:
            pool.submit_save(memory_id + 7, keys, np.arange(2))
        assert error.value.name == "LAKE_INVALID_ARGUMENT" and "not registered" in error.value.message
        with pytest.raises(lake.LakeError) as error:
            pool.submit_save(memory_id, keys, np.array([0, 99]))
        assert error.value.name == "LAKE_INVALID_ARGUMENT"
        bad_table = np.zeros(2, dtype=lake.LOCATION_DTYPE)
        bad_table["tier"] = 9
        with pytest.raises(lake.LakeError):
            pool.submit_load(memory_id, keys, bad_table, np.arange(2))
        with pytest.raises(ValueError):
            pool.lookup_shards(keys, [])
        with pytest.raises(lake.LakeError) as error:
            pool.lookup_shards(keys, np.zeros(257, dtype=np.uint64))
        assert error.value.name == "LAKE_INVALID_ARGUMENT" and "shards" in error.value.message
        with pytest.raises(lake.LakeError) as error:
            lake.shard_code(8, 4, 4)
        assert error.value.name == "LAKE_INVALID_ARGUMENT" and "head" in error.value.message
        with pytest.raises(lake.LakeError) as error:
            lake.shard_code(8, 2, 70000)
        assert error.value.name == "LAKE_INVALID_ARGUMENT"
        assert lake.shard_code(8, 0, 8) == 0, "every head: the whole block"
        assert pool.poll().size == 0, "refused calls queue nothing"
    # A layout's shard must be the pool's: a pool attached without the
    # shard code of the rank whose memory it registers is refused by name.
    rank1 = lake.Layout(layers=2, kv_heads=4, head_dim=8, dtype="float16", block_tokens=TOKENS, shard=(2, 4))
    with lake.Pool(
        pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, layout_fingerprint=rank1.fingerprint,
        segment_bytes=rank1.segment_bytes,
    ) as unsharded:
        with pytest.raises(lake.LakeError) as error:
            unsharded.register_kv_memory(rank1, 2, np.zeros((4, 4), dtype=np.int64))
        assert error.value.name == "LAKE_LAYOUT_MISMATCH" and "shard code" in error.value.message
    with pytest.raises(lake.LakeError) as error:
        pool.lookup(keys)
    assert error.value.name == "LAKE_NOT_ATTACHED", "a closed pool refuses, it does not crash"
    with pytest.raises(lake.LakeError) as error:
        lake.Pool("/nonexistent/dp.sock", pool_paths["MIRROR"], ns)
    assert error.value.name == "LAKE_NOT_ATTACHED"
    with pytest.raises(ValueError):
        lake.Namespace(b"short", TOKENS, bytes(32))
    with pytest.raises(lake.LakeError):
        lake.Namespace(bytes(32), 0, bytes(32))


def test_cancel_before_it_runs(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((64, block_bytes), dtype=np.uint8)
        memory_id = pool.register_host_memory(memory)
        requests = []
        for round in range(8):
            keys = ns.keys(np.arange(8 * TOKENS, dtype=np.uint32) + 20000 + round * 1000)
            requests.append((pool.submit_save(memory_id, keys, np.arange(8) + round * 8), 8))
        last, count = requests[-1]
        pool.cancel(last)
        statuses = pool.wait(last, count)
        # Either it had started (done) or it was cancelled whole.
        assert (statuses == 0).all() or (statuses == lake.CANCELLED).all(), statuses
        for request, count in requests[:-1]:
            pool.wait(request, count)


def test_a_pool_that_goes_away_is_reported_not_crashed(doomed_paths):
    ns = namespace()
    pool = attach(doomed_paths, ns)
    assert pool.alive()
    with open(doomed_paths["STOP_FILE"], "w") as f:
        f.write("stop")
    deadline = time.monotonic() + 20
    while pool.alive():
        assert time.monotonic() < deadline, "the agent never noticed its lake-dp left"
        time.sleep(0.02)
    with pytest.raises(lake.LakeError) as error:
        pool.lookup(ns.keys(np.arange(TOKENS, dtype=np.uint32)))
    assert error.value.name == "LAKE_NOT_ATTACHED"
    pool.close()


def metric(paths, name):
    text = urllib.request.urlopen(f"http://{paths['METRICS']}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{name} is not in /metrics")


# The engine process that dies: attaches, pins a hit, says so, waits to be
# killed (SIGKILL: no destructor, no detach, no goodbye).
DYING_ENGINE = """
import sys, time
import numpy as np
import lake
ns = lake.Namespace(bytes([7]) * 32, 16, bytes([3]) * 32)
pool = lake.Pool(sys.argv[1], sys.argv[2], ns, cp_socket=sys.argv[3])
keys = ns.keys(np.arange(3 * 16, dtype=np.uint32) + 70000)
hits, table, pins = pool.lookup_pinned(keys)
print(hits, flush=True)
time.sleep(120)
"""


def test_an_engine_killed_holding_pins_loses_them_and_nothing_else(pool_paths):
    needs(pool_paths, "METRICS")
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(3 * TOKENS, dtype=np.uint32) + 70000)
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((6, block_bytes), dtype=np.uint8)
        memory[:3] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(3)), 3) == lake.OK).all()
        assert wait_hits(pool, keys, 3)[0] == 3
        # No engine holds a pin now; the pool's own readers (the commit
        # check reads a block just saved) hold theirs for a moment.
        deadline = time.monotonic() + 20
        while (held := metric(pool_paths, "lake_dp_pins")) != 0:
            assert time.monotonic() < deadline, f"{held} pins held with no engine holding any"
            time.sleep(0.05)
        child = subprocess.Popen(
            [sys.executable, "-c", DYING_ENGINE, pool_paths["DP_SOCKET"], pool_paths["MIRROR"], pool_paths["CP_SOCKET"]],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "3", "the child did not pin the three blocks"
            deadline = time.monotonic() + 20
            while (held := metric(pool_paths, "lake_dp_pins")) < 3:
                assert time.monotonic() < deadline, f"the child's pins never showed: {held} held"
                time.sleep(0.05)
        finally:
            child.kill()
            child.wait()
        deadline = time.monotonic() + 20
        while (held := metric(pool_paths, "lake_dp_pins")) > 0:
            assert time.monotonic() < deadline, f"the dead engine's pins stayed: {held} held"
            time.sleep(0.05)
        # This engine goes on: its blocks are still there, bytes intact.
        hits, table = pool.lookup(keys)
        assert hits == 3
        assert (pool.wait(pool.submit_load(memory_id, keys, table, np.arange(3, 6)), 3) == lake.OK).all()
        assert np.array_equal(memory[3:], memory[:3])


def test_a_daemon_with_no_wire_version_in_common_is_refused_by_name(pool_paths):
    needs(pool_paths, "FUTURE_DP_SOCKET")
    with pytest.raises(lake.LakeError) as error:
        lake.Pool(pool_paths["FUTURE_DP_SOCKET"], pool_paths["MIRROR"], namespace())
    assert error.value.name == "LAKE_VERSION_MISMATCH", error.value
    # The real pool is unaffected.
    with attach(pool_paths, namespace()) as pool:
        assert pool.alive()


def test_an_engine_finding_every_agent_port_taken_is_told_to_try_again(pool_paths):
    pools = []
    try:
        while True:
            try:
                pools.append(attach(pool_paths, namespace()))
            except lake.LakeError as error:
                refused = error
                break
            assert len(pools) <= 64, "the pool never ran out of agent ports"
        # Every port taken, and not the arena's agent records first: each
        # port's engine has its own.
        assert refused.name == "LAKE_BUSY" and "every agent port is taken" in str(refused), refused
        assert pools, "no engine attached at all"
        # A port given back is taken again.
        pools.pop().close()
        deadline = time.monotonic() + 10
        while True:
            try:
                pools.append(attach(pool_paths, namespace()))
                break
            except lake.LakeError as error:
                assert error.name == "LAKE_BUSY" and time.monotonic() < deadline, error
                time.sleep(0.02)
    finally:
        for pool in pools:
            pool.close()
    # The ports are given back as the data plane sees the sockets close:
    # the next test's engine finds one.
    deadline = time.monotonic() + 10
    while True:
        try:
            attach(pool_paths, namespace()).close()
            break
        except lake.LakeError as error:
            assert error.name == "LAKE_BUSY" and time.monotonic() < deadline, error
            time.sleep(0.02)


def test_leases_priorities_and_a_pinned_agent_thread(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(4 * TOKENS, dtype=np.uint32) + 80000)
    with pytest.raises(lake.LakeError) as error:
        lake.Pool(pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, agent_core=1 << 20)
    assert error.value.name == "LAKE_INVALID_ARGUMENT" and "may run on" in error.value.message
    with lake.Pool(
        pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, cp_socket=pool_paths["CP_SOCKET"], agent_core=0
    ) as pool:
        memory = np.zeros((8, block_bytes), dtype=np.uint8)
        memory[:4] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(4)), 4) == lake.OK).all()
        hits, table = wait_hits(pool, keys, 4)
        assert hits == 4
        with pool.lease(keys, ttl_ms=3000) as lease:
            assert lease.granted == 4
            assert 0 < lease.deadline_unix_ns - time.time_ns() <= 3_100_000_000
            # A prefetch, behind critical loads, loads the same bytes.
            request = pool.submit_load(memory_id, keys, table, np.arange(4, 8), priority=lake.PRIORITY["write_back"])
            assert (pool.wait(request, 4) == lake.OK).all()
        assert np.array_equal(memory[4:], memory[:4])
        unknown = ns.keys(np.arange(2 * TOKENS, dtype=np.uint32) + 990000)
        with pool.lease(unknown) as nothing:
            assert nothing.granted == 0
        with pytest.raises(lake.LakeError) as error:
            pool.submit_load(memory_id, keys, table, np.arange(4, 8), priority=7)
        assert error.value.name == "LAKE_INVALID_ARGUMENT" and "priority" in error.value.message
    # Without lake-cp there is no one to lease from: said, not hidden.
    with lake.Pool(pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns) as pool:
        with pytest.raises(lake.LakeError) as error:
            pool.lease(keys)
        assert error.value.name == "LAKE_UNAVAILABLE"


def wait_metric(paths, name, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while (value := metric(paths, name)) != want:
        assert time.monotonic() < deadline, f"{name} is {value}, never {want}"
        time.sleep(0.02)


def test_blocks_kept_in_the_engines_gpu_are_reported_and_forgotten_on_detach(pool_paths):
    needs(pool_paths, "METRICS")
    ns = namespace()
    keys = ns.keys(np.arange(6 * TOKENS, dtype=np.uint32) + 150000)
    base = metric(pool_paths, "lake_l0_blocks")
    with attach(pool_paths, ns) as pool:
        pool.report_resident(keys)
        wait_metric(pool_paths, "lake_l0_blocks", base + 6)
        pool.report_resident(keys[4:], resident=False)
        wait_metric(pool_paths, "lake_l0_blocks", base + 4)
        with pytest.raises(lake.LakeError) as error:
            lake._check(lake._library().lake_report_resident(pool._h(), None, 3, 1))
        assert error.value.name == "LAKE_NULL_ARGUMENT"
        with pytest.raises(lake.LakeError) as error:
            lake._check(lake._library().lake_report_resident(pool._h(), lake._ptr(keys), 1, 2))
        assert error.value.name == "LAKE_INVALID_ARGUMENT" and "0 or 1" in error.value.message
    wait_metric(pool_paths, "lake_l0_blocks", base)
    # Without lake-cp there is no one to tell: said, not hidden.
    with lake.Pool(pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns) as pool:
        with pytest.raises(lake.LakeError) as error:
            pool.report_resident(keys)
        assert error.value.name == "LAKE_UNAVAILABLE"


def test_slot_space_names_this_pools_l1_and_a_bad_push_is_refused(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(2 * TOKENS, dtype=np.uint32) + 170000)
    with attach(pool_paths, ns) as pool:
        memory = np.zeros((2, block_bytes), dtype=np.uint8)
        memory[:] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(2)), 2) == lake.OK).all()
        hits, table = wait_hits(pool, keys, 2)
        region, epoch = pool.slot_space()
        assert hits == 2 and all(int(e["region"]) == region for e in table), (region, table)
        assert epoch > 0
        with pytest.raises(lake.LakeError) as error:
            pool.push("not an address", keys, table, region, epoch)
        assert error.value.name == "LAKE_INVALID_ARGUMENT" and "IP:PORT" in error.value.message
        with pytest.raises(ValueError):
            pool.push("127.0.0.1:1", keys, table[:1], region, epoch)
        with pytest.raises(lake.LakeError) as error:
            pool.push("eth0>127.0.0.1:1", keys, table, region, epoch)
        assert "local address" in error.value.message
        rails = pool.push_rails()
        assert rails.dtype == lake.RAIL_DTYPE and len(rails) == 0, "nothing pushed: no rails"


def test_copy_lanes_split_a_large_load_and_keep_its_prefix_rule(pool_paths):
    block_bytes = pool_paths["BLOCK_BYTES"]
    ns = namespace()
    keys = ns.keys(np.arange(32 * TOKENS, dtype=np.uint32) + 120000)
    with lake.Pool(
        pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, cp_socket=pool_paths["CP_SOCKET"], copy_threads=2
    ) as pool:
        memory = np.zeros((64, block_bytes), dtype=np.uint8)
        memory[:32] = kv(keys, block_bytes)
        memory_id = pool.register_host_memory(memory)
        assert (pool.wait(pool.submit_save(memory_id, keys, np.arange(32)), 32) == lake.OK).all()
        hits, table = wait_hits(pool, keys, 32)
        assert hits == 32
        before = pool.stats()
        assert (pool.wait(pool.submit_load(memory_id, keys, table, np.arange(32, 64)), 32) == lake.OK).all()
        assert np.array_equal(memory[32:], memory[:32])
        after = pool.stats()
        assert after["l1_loads"] - before["l1_loads"] == 32
        assert after["bytes_loaded"] - before["bytes_loaded"] == 32 * block_bytes
        # A block gone in the middle of one lane's share: it fails, every
        # block after it is reported broken whichever lane copied it.
        memory[32:] = 0
        stale = table.copy()
        stale["generation"][20] += 1000
        statuses = pool.wait(pool.submit_load(memory_id, keys, stale, np.arange(32, 64)), 32)
        assert (statuses[:20] == lake.OK).all(), statuses
        assert statuses[20] == lake.EVICTED and (statuses[21:] == lake.PREFIX_BROKEN).all(), statuses
        assert np.array_equal(memory[32:52], memory[:20])
        assert not memory[52].any(), "the failed block was not written"


try:
    import torch
except ImportError:  # the machines without a GPU
    torch = None


def _cuda_pieces(layers):
    out = []
    for t in layers:
        s, e = t.stride(), t.element_size()
        out += [(t.data_ptr() + p * s[0] * e, s[1] * e, s[2] * e, s[3] * e) for p in (0, 1)]
    return np.array(out, dtype=np.int64)


@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="torch with a CUDA GPU is not here")
def test_a_gpu_save_on_the_engines_stream_waits_for_its_writes(pool_paths):
    """The engine queues its writes to the blocks behind ~0.1 s of GPU work
    and submits the save at once, on its stream: Lake's reads wait on the
    GPU, so what is saved (and loaded back elsewhere) is what was written,
    not what the blocks held before."""
    layout = lake.Layout(layers=2, kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=TOKENS)
    assert layout.block_bytes <= pool_paths["BLOCK_BYTES"]
    blocks = 8
    shape = (2, 16, TOKENS, 2, 64)
    source = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    target = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    ns = namespace(tenant=31)
    keys = ns.keys(np.arange(blocks * TOKENS, dtype=np.uint32) + 123_000)
    with lake.Pool(
        pool_paths["DP_SOCKET"], pool_paths["MIRROR"], ns, cp_socket=pool_paths["CP_SOCKET"], layout=layout,
    ) as pool:
        saved = pool.register_kv_memory(layout, 16, _cuda_pieces(source), keep_alive=source, device=0)
        loaded = pool.register_kv_memory(layout, 16, _cuda_pieces(target), keep_alive=target, device=0)
        values = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(2)]
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(200_000_000)
        for t, v in zip(source, values):
            t.copy_(v)
        request = pool.submit_save(saved, keys, np.arange(blocks), stream=stream.cuda_stream)
        assert (pool.wait(request, blocks, timeout=30) == lake.OK).all()
        for _ in range(500):
            hits, table = pool.lookup(keys)
            if hits == blocks:
                break
            time.sleep(0.01)
        assert hits == blocks
        assert (pool.wait(pool.submit_load(loaded, keys, table, np.arange(blocks)), blocks, timeout=30) == lake.OK).all()
        torch.cuda.synchronize()
        for v, t in zip(values, target):
            assert torch.equal(v[:, :blocks], t[:, :blocks]), "the save read the blocks before the engine wrote them"


def test_route_places_a_request_by_its_hits_and_routes_around_a_failed_node(pool_paths):
    ns = namespace()
    keys = ns.keys(np.arange(4 * TOKENS, dtype=np.uint32) + 190000)
    node = lambda n, queue: {
        "node": n, "queue_ns": queue, "compute_ns_per_block": 500_000,
        "load_ns_per_block": [0, 50_000, 400_000, 3_000_000], "cnic_ns_per_block": 100_000,
    }
    with attach(pool_paths, ns) as pool:
        # Nothing cached here; node 1's engine holds all 4 blocks in HBM.
        others = [{"node": 1, "through": [4, 4, 4, 4]}]
        plan = pool.route(keys, [node(0, 0), node(1, 1_000_000)], others=others)
        assert plan["mode"] == "d_direct" and plan["prefill_node"] == 1 and plan["hit_blocks"] == 4, plan
        again = pool.route(keys, [node(0, 0), node(1, 1_000_000)], others=others, avoid=[1])
        assert again["mode"] == "colocated" and again["prefill_node"] == 0 and again["recomputed_blocks"] == 4, again
        with pytest.raises(lake.LakeError) as error:
            pool.route(keys, [node(0, 0)], avoid=[0])
        assert error.value.name == "LAKE_UNAVAILABLE"
        with pytest.raises(ValueError):
            pool.route(keys, [node(0, 0)], policy="sometimes")
        # Live costs: none measured yet, so a tier asked to be measured is
        # not loaded from.
        assert pool.load_costs() == [0, 0, 0, 0]
        live = dict(node(0, 0), load_ns_per_block=[0] + [lake.COST_MEASURED] * 3)
        assert pool.route(keys, [live])["hit_blocks"] == 0
        # The engine's own compute cost, as it reports its prefills.
        assert pool.compute_cost() == 0
        pool.report_prefill(4, 8_000_000)
        assert pool.compute_cost() == 2_000_000
        with pytest.raises(lake.LakeError) as error:
            pool.report_prefill(0, 1)
        assert error.value.name == "LAKE_INVALID_ARGUMENT"
