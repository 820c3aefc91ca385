"""Real vLLM on three nodes of one pool: P→D, D→pool and D→P through
Lake, and a decode engine SIGKILLed mid-request resumed where `lake
route` sends it (F4).

Three `lake serve` nodes, each on a host of its own (a network namespace
on one switch, `netns.Switch`), are members of a cluster in a real etcd,
with a `lake summary` leader streaming each node's blocks back to the
others (their cluster views) and transports between them over the
switch; etcd and the summary run in the test's own namespace, on the
switch too. `lake route` runs beside node 2, on its host, reading that
pool. Node 1 runs prefill and decode, node 2 decode only, node 3 prefill
only. Every vLLM is a process of its own on the host of the node the
router names, its connector attached to that node's pool; nothing tells
a connector where a block is but the pool, and a block reaches another
node only over the switch.

- P→D: a prefill (``kv_producer``) on node 1 computes the prompt; the
  router names node 2 to decode; the decode (``kv_consumer``) on node 2
  finds the prompt's blocks in node 1's pool through its view, pulls them
  and loads them; the pool keeps a block where it was last read, so they
  move to node 2.
- D→pool: the decode saves the blocks its tokens fill as it goes; it is
  SIGKILLed part way. Asked again with node 2 avoided, the router sends
  the request to node 1, pulling the prompt and what the dead decode
  saved from node 2's pool; the successor there resumes from the pool,
  pulling them back.
- D→P: the next turn's prefill, with node 1 taken out of rotation,
  goes to node 3, which computed none of the conversation: it pulls the
  prompt's and both decodes' blocks from nodes 1 and 2 and reuses them.

The reference is vLLM alone running the same phases in one process (its
own prefix cache then holds what the pool holds): tokens and top-k
logprobs must agree bitwise."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import lake
import netns
from conftest import KV_BYTES_PER_TOKEN, Pool
from test_real_vllm import external_hits, only, phase, pool_gauge, tokens

BLOCK = 128
TENANT = "55" * 32


# Ten full blocks and 60 tokens. The decode is killed when every token
# but its last sampled one lies in whole blocks (1340 + 69 - 1 = 11
# blocks), so its successor computes one token, as the decode would have.
PROMPT = tokens(51, 10 * BLOCK + 60)
DECODE_TOKENS = 200
KILLED_AT = 69
NEXT = tokens(52, 50)
NODES = (1, 2, 3)


# The port each host's transport listens on, and node 1's vLLM metrics.
TRANSPORT_PORT = 7200
ENGINE_METRICS_PORT = 7300


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    """A process of the cluster, its output in a log file."""

    def __init__(self, args, log):
        self.log = log
        self.process = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait_for(self, pattern: str, within: float = 30) -> str:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if pattern in line:
                    return line
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} from {self.log}:\n{self.log.read_text()[-4000:]}")

    def stop(self, signal_number=15):
        if self.process.poll() is None:
            self.process.send_signal(signal_number)
            self.process.wait(timeout=30)


class Etcd(Proc):
    def __init__(self, directory, host: str):
        binary = os.environ.get("LAKE_ETCD") or shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            if os.environ.get("CI"):
                raise AssertionError("no etcd binary: .ci/run installs etcd-server")
            pytest.skip("no etcd binary (apt install etcd-server, or LAKE_ETCD=path)")
        client, peer = f"http://{host}:{free_port(host)}", f"http://127.0.0.1:{free_port()}"
        self.endpoint = client
        super().__init__(
            [
                binary, "--name", "lake-test", "--data-dir", str(directory / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"lake-test={peer}",
            ],
            directory / "etcd.log",
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                if b"true" in urllib.request.urlopen(client + "/health", timeout=1).read():
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, (directory / "etcd.log").read_text()
            time.sleep(0.1)


def ask(router: str, request: dict) -> tuple[int, dict]:
    """POST /route: the status and the answer."""
    body = json.dumps(request).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{router}/route", body), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def route_until(router: str, request: dict, done, within: float = 20) -> dict:
    deadline = time.monotonic() + within
    while True:
        status, answer = ask(router, request)
        if status == 200 and done(answer):
            return answer
        assert time.monotonic() < deadline, f"{status} {answer}"
        time.sleep(0.1)


class Cluster(dict):
    """The nodes' pools by node, and the switch whose hosts they run on
    (node n on host n - 1)."""

    def __init__(self, switch: netns.Switch):
        super().__init__()
        self.switch = switch

    def on(self, node: int) -> list[str]:
        """The prefix that runs a command on node ``node``'s host."""
        return self.switch.on(node - 1)

    def address(self, node: int) -> str:
        return self.switch.address(node - 1)


@pytest.fixture(scope="module")
def cluster(lake_bin, tmp_path_factory):
    """etcd, a summary leader, nodes 1 to 3 each on a host of its own (a
    pool listening for the others' transports), as their operator would
    start them."""
    try:
        switch = netns.Switch(len(NODES))
    except OSError as e:
        if os.environ.get("CI"):
            raise AssertionError(f"network namespaces (CI runs as root): {e}") from e
        pytest.skip(f"network namespaces (root?): {e}")
    base = tmp_path_factory.mktemp("cluster")
    nodes = Cluster(switch)
    try:
        etcd = Etcd(base, switch.here)
    except BaseException:
        switch.close()
        raise
    summary_at = f"{switch.here}:{free_port(switch.here)}"
    summary = Proc(
        # The default placement: a pulled block moves to its reader (the
        # flows below name where each prefix is pulled from).
        [lake_bin, "summary", "--listen", summary_at, "--etcd", etcd.endpoint, "--cluster", "vllm", "--ttl", "2"],
        base / "summary.log",
    )
    try:
        summary.wait_for('"event":"leading"')
        transports = {node: f"{nodes.address(node)}:{TRANSPORT_PORT}" for node in NODES}
        for node in NODES:
            peers = [
                arg for other in NODES if other != node for arg in ("--transport-peer", f"{other}={transports[other]}")
            ]
            nodes[node] = Pool(
                lake_bin, base / f"node{node}", BLOCK * KV_BYTES_PER_TOKEN, 64, 64,
                extra_args=[
                    "--node", str(node), "--etcd", etcd.endpoint, "--cluster", "vllm", "--summary-to", summary_at,
                    "--member-ttl", "2", "--transport-listen", transports[node], *peers,
                ],
                on=nodes.on(node), metrics_host=nodes.address(node),
            )
        yield nodes
    finally:
        for pool in nodes.values():
            pool.stop()
        summary.stop()
        etcd.stop(9)
        switch.close()


def pool_paths(pool: Pool) -> dict:
    """A node's pool as the binding's tests name its paths."""
    record = pool.record
    return {"DP_SOCKET": record["dp_socket"], "MIRROR": record["mirror"], "CP_SOCKET": record["cp_socket"]}


def router_for(lake_bin, cluster, base, fingerprint: str, engines=None) -> Proc:
    """`lake route` beside node 2, on its host: node 1 prefills and decodes, node 2
    decodes, node 3 prefills; 10 ms to compute a block of the tiny model
    here, 0.2 ms to load one from L1, 1 ms to pull one. ``engines``: the
    address of a node's vLLM metrics, by node."""
    engines = engines or {}
    nodes = "".join(
        f'[[nodes]]\nid = {node}\nroles = {roles}\nlake_metrics = "{cluster[node].record["metrics"]}"\n'
        + (f'engine_metrics = "{engines[node]}"\n' if node in engines else "")
        + "compute_ns_per_block = 10000000\nload_ns_per_block = [0, 200000, 1000000, 20000000]\n"
        "pull_ns_per_block = 1000000\ncnic_ns_per_block = 1000000\n\n"
        for node, roles in ((1, '["prefill", "decode"]'), (2, '["decode"]'), (3, '["prefill"]'))
    )
    config = base / "route.toml"
    config.write_text(
        f'listen = "{cluster.address(2)}:0"\npool_dir = "{cluster[2].dir}"\nscrape_ms = 100\n\n'
        f'[namespace]\ntenant_key = "{TENANT}"\nblock_tokens = {BLOCK}\nmodel_fingerprint = "{fingerprint}"\n\n'
        + nodes
    )
    return Proc([*cluster.on(2), lake_bin, "route", "--config", str(config)], base / "route.log")


@pytest.fixture(scope="module")
def reference(engine):
    """vLLM alone: the prefill, the whole decode (its own cache holding
    the prompt's blocks, as the decode's pool does), the next turn."""
    return engine.run(
        [
            phase([PROMPT], 1),
            phase([PROMPT], DECODE_TOKENS),
            phase([{"after": 1, "then": NEXT}], 8),
        ]
    )


def test_prefill_decode_and_the_next_turn_on_three_nodes_through_the_pool(
    engine, lake_bin, cluster, reference, tmp_path
):
    def connector(node):
        return {"pool_dir": str(cluster[node].dir), "tenant_key": TENANT}

    def on(node):
        """A vLLM with its connector attached to node ``node``'s pool, on
        that node's host."""
        return {"connector": connector(node), "on": cluster.on(node)}

    # P: the prefill on node 1 computes the prompt; its ten full blocks
    # go to node 1's pool.
    prefill = engine.run([phase([PROMPT], 1)], **on(1), kv_role="kv_producer")
    assert only(prefill, 0) == only(reference, 0)
    # The router chains tokens as the engines do: the namespace the
    # connector logged at its start.
    found = re.search(r"lake\.vllm: namespace [0-9a-f]+: block_tokens (\d+), model_fingerprint ([0-9a-f]{64})",
                      prefill["log"])
    assert found and int(found.group(1)) == BLOCK, prefill["log"][-3000:]
    router_proc = router_for(lake_bin, cluster, tmp_path, found.group(2))
    try:
        router = json.loads(router_proc.wait_for('"routing"'))["listen"]
        pd = route_until(router, {"tokens": PROMPT, "policy": "pd"}, lambda a: a["hit_blocks"] == 10)
        assert (pd["mode"], pd["prefill"], pd["decode"]) == ("pd", 1, 2), pd

        # D: the decode on node 2 sees the prompt's blocks only in node
        # 1's pool: it pulls them, loads them, and computes the last 60
        # tokens; the blocks its tokens fill go to node 2's pool. Killed.
        sent = 'lake_cluster_pulls_total{result="sent"}'
        pulls_before = pool_gauge(cluster[2], sent)
        killed = engine.run(
            [phase([PROMPT], DECODE_TOKENS, kill_after_tokens=KILLED_AT)], **on(2),
            kv_role="kv_consumer", expect_kill=True,
        )
        streamed = killed["streamed"][:KILLED_AT]
        expected = only(reference, 1)
        assert streamed == expected["tokens"][:KILLED_AT]
        assert killed["counters"]["vllm:external_prefix_cache_hits"] == 10 * BLOCK
        assert pool_gauge(cluster[2], sent) > pulls_before

        # F4: the same question with the failed node avoided. Node 1 runs
        # the rest: the prompt's ten blocks, moved to node 2 by the
        # decode's pull, and the block the dead decode saved, all pulled
        # from node 2's pool (alive: only its engine died).
        resumed_prompt = PROMPT + streamed
        rerouted = route_until(
            router,
            {"tokens": resumed_prompt, "avoid": [2]},
            lambda a: a["hit_blocks"] == 11 and a["pulled_blocks"] == 11,
        )
        assert (rerouted["prefill"], rerouted["decode"], rerouted["pulled_blocks"]) == (1, 1, 11), rerouted
        assert {"first": 0, "last": 11, "from_node": 2, "from_tier": "l1", "to": 1, "network": "storage"} in (
            rerouted["moves"]
        ), rerouted
        successor = engine.run([phase([resumed_prompt], DECODE_TOKENS - KILLED_AT)], **on(1))
        assert external_hits(successor, 0) == 11 * BLOCK
        resumed = only(successor, 0)
        assert resumed["tokens"] == expected["tokens"][KILLED_AT:]
        assert resumed["logprobs"] == expected["logprobs"][KILLED_AT:]

        # D→P: the next turn (the prompt, the whole answer, 50 more
        # tokens) reuses the prompt's blocks and both decodes' (blocks 10
        # and 11). Node 1, which holds them all (the successor's pull moved
        # them back), is out of rotation (as a gateway takes out a node it
        # drains): the router names node 3, which holds none and pulls all
        # twelve.
        turn = reference["phases"][2]["prompts"][0]
        assert turn[: len(PROMPT) + DECODE_TOKENS] == PROMPT + expected["tokens"]
        answer = route_until(
            router, {"tokens": turn, "policy": "pd", "avoid": [1]}, lambda a: a["hit_blocks"] == 12
        )
        assert (answer["prefill"], answer["pulled_blocks"]) == (3, 12), answer
        pulls = [move for move in answer["moves"] if move["network"] == "storage"]
        assert pulls and all(move["to"] == 3 and move["from_node"] in (1, 2) for move in pulls), answer
        pulls_before = pool_gauge(cluster[3], sent)
        third = engine.run([phase([turn], 8)], **on(3), kv_role="kv_producer")
        assert external_hits(third, 0) == 12 * BLOCK
        assert pool_gauge(cluster[3], sent) > pulls_before
        assert only(third, 0) == only(reference, 2)
    finally:
        router_proc.stop()


def router_nodes(router: str) -> dict:
    """GET /nodes: each node's signals as the router last read them, by
    node."""
    with urllib.request.urlopen(f"http://{router}/nodes", timeout=10) as r:
        return {n["node"]: n for n in json.loads(r.read())["nodes"]}


def test_the_router_reads_a_running_vllms_queue_from_its_metrics(engine, lake_bin, cluster, tmp_path):
    """The router's load signal from a real vLLM as it runs: its
    Prometheus registry — what vLLM's OpenAI server exposes at /metrics,
    served here from the engine's process by prometheus_client, the
    library vLLM's server serves it with — read for node 1. Once a
    prefill has run the router has its mean; with one request running and
    three queued behind it (``max_num_seqs`` 1) it sees them waiting and
    prices node 1's queue at waiting × mean prefill; the engine gone, node
    1 is down. The engine runs on node 1's host, the router on node 2's."""
    port, host = ENGINE_METRICS_PORT, cluster.address(1)
    release = tmp_path / "release"
    queued = [tokens(60 + i, 2 * BLOCK) for i in range(4)]
    phases = [phase([PROMPT], 1), phase(queued, 150, wait_for=str(release))]
    ran = {}
    worker = threading.Thread(target=lambda: ran.update(engine.run(
        phases, max_num_seqs=1, metrics_port=port, metrics_host=host, on=cluster.on(1))))
    worker.start()
    router_proc = None
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(f"{release}.ready"):
            assert worker.is_alive() and time.monotonic() < deadline, "the engine never finished its first phase"
            time.sleep(0.05)
        router_proc = router_for(lake_bin, cluster, tmp_path, "0" * 64, engines={1: f"{host}:{port}"})
        router = json.loads(router_proc.wait_for('"routing"'))["listen"]
        deadline = time.monotonic() + 20
        while (one := router_nodes(router)[1])["prefill_ns"] == 0:
            assert time.monotonic() < deadline, one
            time.sleep(0.1)
        assert one["down"] is None and one["waiting"] == 0 and one["queue_ns"] == 0, one
        mean_prefill = one["prefill_ns"]
        # Four requests, one at a time: the router sees the others wait.
        release.touch()
        seen = None
        while worker.is_alive() and seen is None:
            one = router_nodes(router)[1]
            if one["waiting"] > 0:
                seen = one
            time.sleep(0.05)
        assert seen is not None, "the router never saw a request waiting"
        assert 1 <= seen["waiting"] <= 3 and seen["queue_ns"] == seen["waiting"] * seen["prefill_ns"], seen
        print(f"router: node 1's vLLM had {seen['waiting']} waiting, mean prefill {mean_prefill / 1e6:.1f} ms")
        worker.join(timeout=300)
        assert len(ran["phases"][1]["requests"]) == 4, ran.get("phases")
        # The engine gone: node 1 is down, and why.
        deadline = time.monotonic() + 20
        while (one := router_nodes(router)[1])["down"] is None:
            assert time.monotonic() < deadline, one
            time.sleep(0.1)
        assert one["down"].startswith(f"engine at {host}:{port}"), one
    finally:
        release.touch()
        worker.join(timeout=300)
        if router_proc is not None:
            router_proc.stop()


def replayed(name: str):
    """A module of ``ffi/python/tests``, whose helpers replay an engine's
    calls (SGLang does not install here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    return importlib.import_module(name)


def wait_in_view(store, keys, count: int):
    """Until ``count`` leading pages of ``keys`` are in the cluster view of
    ``store``'s node."""
    deadline = time.monotonic() + 20
    while store.pool.lookup_cluster(store._keys(keys))[0] < count:
        assert time.monotonic() < deadline, "node 1's pages never reached node 2's view"
        time.sleep(0.05)


def test_sglangs_prefetch_on_one_node_pulls_what_another_node_backed_up(cluster):
    # SGLang's HiCache calls (as ffi/python/tests/test_sglang.py replays
    # them: SGLang itself does not install here) against two nodes:
    # an instance on node 1 backs pages up; one on node 2 finds them in
    # node 1's pool, pulls them in its prefetch's batch_exists, and loads
    # them bit-exact. With "pull": false it finds none.
    import numpy as np

    sg = replayed("test_sglang")

    def config(node, **extra):
        paths = pool_paths(cluster[node])
        return sg.storage_config(paths, "test/sglang-cluster", **extra)

    rng = np.random.default_rng(5)
    keys = sg.page_hashes((np.arange(7 * sg.PAGE + 3) * 13).tolist())
    a = sg.lake_sglang.LakeStore(config(1), {})
    pool_a = sg.host_pool("layer_first", fill=rng)
    a.register_mem_pool_host(pool_a)
    pages_a = [3, 0, 9, 4, 21, 22, 7]
    sg.write_back(a, keys, pages_a)
    sg.wait_held(a, keys, 7)

    alone = sg.lake_sglang.LakeStore(config(2, pull=False), {})
    alone.register_mem_pool_host(sg.host_pool("page_first"))
    wait_in_view(alone, keys, 7)
    assert alone.batch_exists(keys) == 0

    b = sg.lake_sglang.LakeStore(config(2), {})
    pool_b = sg.host_pool("page_first")
    b.register_mem_pool_host(pool_b)
    pages_b = [10, 11, 1, 2, 15, 23, 5]
    assert sg.prefetch(b, keys, pages_b) == (7, 7)
    for pa, pb in zip(pages_a, pages_b):
        assert np.array_equal(sg.page_view(pool_b, pb), sg.page_view(pool_a, pa)), (pa, pb)
    for store in (a, alone, b):
        store.close()


def test_sglangs_prefetch_stops_pulling_once_a_pulled_page_costs_more_than_computing_one(cluster, monkeypatch):
    # SGLang's HiCache calls against two nodes, as above: an instance on
    # node 1 backs up two prefixes. On node 2, told that computing a page
    # costs 1 ns, the prefetch's batch_exists pulls the first (and
    # measures what a pulled page cost); for the second it answers node
    # 2's own hit, none, and asks no pull, until its figure is old.
    import numpy as np

    sg = replayed("test_sglang")

    def config(node, **extra):
        return sg.storage_config(pool_paths(cluster[node]), "test/sglang-pull-cost", **extra)

    prefixes = [sg.page_hashes((np.arange(7 * sg.PAGE) * k + 1).tolist()) for k in (17, 19)]
    saver = sg.lake_sglang.LakeStore(config(1), {})
    saver.register_mem_pool_host(sg.host_pool("layer_first", fill=np.random.default_rng(6)))
    for i, keys in enumerate(prefixes):
        sg.write_back(saver, keys, list(range(7 * i, 7 * i + 7)))
        sg.wait_held(saver, keys, 7)
    thrifty = sg.lake_sglang.LakeStore(config(2, compute_ns_per_block=1), {})
    thrifty.register_mem_pool_host(sg.host_pool("page_first"))
    for keys in prefixes:
        wait_in_view(thrifty, keys, 7)

    sent = 'lake_cluster_pulls_total{result="sent"}'
    before = pool_gauge(cluster[2], sent)
    assert thrifty.batch_exists(prefixes[0]) == 7
    after_first = pool_gauge(cluster[2], sent)
    assert after_first > before
    assert thrifty.batch_exists(prefixes[1]) == 0, "a pull dearer than computing was asked"
    assert pool_gauge(cluster[2], sent) == after_first
    assert thrifty.pull_gate.ns_per_block > 1
    # Measured again once its figure is old: it pulls (and finds pulls
    # still dearer than 1 ns a page).
    monkeypatch.setattr(lake, "PULL_REMEASURE_S", 0.0)
    assert thrifty.batch_exists(prefixes[1]) == 7
    assert pool_gauge(cluster[2], sent) > after_first
    assert thrifty.pull_gate.ns_per_block > 1
    for store in (saver, thrifty):
        store.close()


def test_the_vllm_connector_stops_pulling_once_a_pulled_block_costs_more_than_computing_one(cluster, monkeypatch):
    # vLLM's scheduler-side calls, as ffi/python/tests/test_vllm_worker.py
    # replays them, against the real connector on two of the nodes: an
    # instance on node 1 saves two prompts; on node 2 the first prompt's
    # blocks are pulled, and what a pulled block cost is measured. Told
    # that computing a block costs 1 ns, the connector asks no pull for
    # the second prompt (vLLM computes it) until its figure is old; told
    # nothing, it pulls.
    import numpy as np

    from lake import vllm as lake_vllm

    vw = replayed("test_vllm_worker")

    model = "test/pull-cost"

    def cfg(node, **extra):
        paths = pool_paths(cluster[node])
        config = vw.config(paths, model)
        config.kv_transfer_config.kv_connector_extra_config.update(extra)
        return config

    def scheduler(node, **extra):
        return lake_vllm.LakeConnector(cfg(node, **extra), lake_vllm.KVConnectorRole.SCHEDULER)

    def hit(connector, request_id, prompt):
        """vLLM's question, asked each step until the connector answers."""
        deadline = time.monotonic() + 10
        while True:
            tokens, _ = connector.get_num_new_matched_tokens(vw.request(request_id, prompt + [9]), 0)
            if tokens is not None:
                return tokens
            assert time.monotonic() < deadline, "the connector never answered"
            time.sleep(0.01)

    prompts = [(np.arange(4 * vw.BLOCK) * k + 3).tolist() for k in (7, 11, 13)]
    saver = scheduler(1)
    worker = lake_vllm.LakeConnector(cfg(1), lake_vllm.KVConnectorRole.WORKER)
    caches = {f"model.layers.{i}.self_attn.attn": vw.paged("flash_nhd", "numpy", np.random.default_rng(i))
              for i in range(vw.LAYERS)}
    worker.register_kv_caches(caches)
    for i, prompt in enumerate(prompts):
        vw.save_group(saver, [(worker, caches)], f"save-{i}", prompt, [1, 2, 3, 4])
    thrifty = scheduler(2, compute_ns_per_block=1)
    for prompt in prompts:
        keys = saver.namespace.keys(np.asarray(prompt, dtype=np.uint32))
        deadline = time.monotonic() + 20
        while saver.pool.lookup(keys)[0] < 4 or thrifty.pool.lookup_cluster(keys)[0] < 4:
            assert time.monotonic() < deadline, "node 1's blocks never reached node 2's view"
            time.sleep(0.05)

    sent = 'lake_cluster_pulls_total{result="sent"}'
    before = pool_gauge(cluster[2], sent)
    assert hit(thrifty, "first", prompts[0]) == 4 * vw.BLOCK
    assert thrifty.pull_gate.ns_per_block > 1
    after_first = pool_gauge(cluster[2], sent)
    assert after_first > before
    assert hit(thrifty, "second", prompts[1]) == 0
    assert pool_gauge(cluster[2], sent) == after_first

    eager = scheduler(2)
    assert hit(eager, "third", prompts[2]) == 4 * vw.BLOCK
    after_third = pool_gauge(cluster[2], sent)
    assert after_third > after_first
    # Measured again once its figure is old: the thrifty one pulls (and
    # finds pulls still dearer than 1 ns a block).
    monkeypatch.setattr(lake, "PULL_REMEASURE_S", 0.0)
    assert hit(thrifty, "second again", prompts[1]) == 4 * vw.BLOCK
    assert thrifty.pull_gate.ns_per_block > 1
    assert pool_gauge(cluster[2], sent) > after_third
    for connector in (saver, worker, thrifty, eager):
        connector.shutdown()
