"""Real vLLM (its CPU build) against a real `lake serve`.

These tests run in the venv `.ci/vllm-venv` makes (vLLM's CPU build and
torch), started by `cargo test -p lake-cp --test vllm`, which passes the
`lake` binary and the engine library in LAKE_BIN and LAKE_LIBRARY. Every
vLLM runs in a process of its own (`engine.py`), as an engine would;
the model is a tiny Qwen3 with seeded random weights written here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# This directory (the engine, the model) and the `lake` package beside it.
sys.path[:0] = [str(HERE), str(HERE.parent)]

import engine as engine_process  # noqa: E402
import tiny_model  # noqa: E402

# The KV cache of the tiny model in float32: 2 layers, K and V, 2 heads of
# 64, 4 bytes, per token.
KV_BYTES_PER_TOKEN = 2 * 2 * tiny_model.KV_HEADS * tiny_model.HEAD_DIM * 4


def _needed(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set: run through `cargo test -p lake-cp --test vllm`")
    return value


class Pool:
    """A `lake serve` process with its directory."""

    def __init__(
        self, binary: str, directory: Path, block_bytes: int, l1_slots: int, l2_slots: int, extra_args=(),
        on=(), metrics_host="127.0.0.1",
    ):
        """``on``: the prefix that runs it on a host of a ``netns.Switch``
        (its metrics then served at that host's address,
        ``metrics_host``)."""
        self.dir = directory
        self.log = directory.parent / f"{directory.name}.log"
        self.args = [
            *on, binary, "serve", "--metrics", f"{metrics_host}:0", "--dir", str(directory), "--block-bytes", str(block_bytes),
            "--l1-slots", str(l1_slots), "--l2-slots", str(l2_slots), *extra_args,
        ]
        self.process = None
        self.start()

    def start(self):
        self.process = subprocess.Popen(self.args, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        record = self.dir / "pool.json"
        deadline = time.monotonic() + 60
        # This process's record: one a killed pool left names another pid.
        while not (record.exists() and json.loads(record.read_text()).get("pid") == self.process.pid):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lake serve did not start:\n{self.log.read_text()}")
            time.sleep(0.05)
        self.record = json.loads(record.read_text())

    def metrics(self) -> str:
        import urllib.request

        return urllib.request.urlopen(f"http://{self.record['metrics']}/metrics", timeout=5).read().decode()

    def stop(self):
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.process = None
        assert code == 0, f"lake serve exited {code}:\n{self.log.read_text()}"


@pytest.fixture(scope="session")
def lake_bin() -> str:
    return _needed("LAKE_BIN")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model.write(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def hybrid_model_dir(tmp_path_factory) -> Path:
    return tiny_model.write_hybrid(tmp_path_factory.mktemp("hybrid") / "model")


@pytest.fixture(scope="session")
def pool(lake_bin, tmp_path_factory):
    _needed("LAKE_LIBRARY")
    # Slots of one block of 128 tokens; a model of smaller blocks fits too.
    pool = Pool(lake_bin, tmp_path_factory.mktemp("pool") / "lake", 128 * KV_BYTES_PER_TOKEN, 768, 1024)
    yield pool
    pool.stop()


class Engine:
    """Runs one vLLM process (`engine.py`) and returns what it produced."""

    def __init__(self, model: Path, workdir: Path):
        self.model = model
        self.workdir = workdir
        self.runs = 0

    def start(self, phases, **options):
        """Runs a vLLM process in the background (see ``run``); ``join()``
        on what this returns waits for it and returns its result."""
        import threading

        box = {}
        thread = threading.Thread(target=lambda: box.update(result=self.run(phases, **options)))
        thread.start()

        def join():
            thread.join()
            return box["result"]

        return join

    def run(self, phases, block_size=128, connector=None, kv_cache_tokens=16384, max_model_len=4096,
            prefix_caching=True, multiprocess=False, expect_kill=False, expect_failure=False, max_num_seqs=8,
            model=None, dtype="float32", kv_cache_bytes=None, load_failure_policy="fail", speculative=None,
            kv_role="kv_both", metrics_port=None, on=(), metrics_host="127.0.0.1"):
        """``model``, ``dtype``, ``kv_cache_bytes``: another model than the
        tiny Qwen3 (its KV cache then sized in bytes); ``speculative``:
        vLLM's ``speculative_config``; ``metrics_port``: where the process
        serves vLLM's metrics while it runs (at ``metrics_host``); ``on``:
        the prefix that runs it on a host of a ``netns.Switch``."""
        self.runs += 1
        name = f"engine-{self.runs}"
        spec = {
            "model": str(model or self.model),
            "dtype": dtype,
            "block_size": block_size,
            "kv_cache_bytes": kv_cache_bytes or kv_cache_tokens * KV_BYTES_PER_TOKEN,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "prefix_caching": prefix_caching,
            "connector": connector,
            "load_failure_policy": load_failure_policy,
            "speculative": speculative,
            "kv_role": kv_role,
            "metrics_port": metrics_port,
            "metrics_host": metrics_host,
            "phases": phases,
        }
        spec_path, out, log = (self.workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
        spec_path.write_text(json.dumps(spec))
        env = engine_process.environment(multiprocess)
        started = time.monotonic()
        with open(log, "w") as f:
            code = subprocess.run(
                [*on, sys.executable, str(HERE / "engine.py"), str(spec_path), str(out)],
                stdout=f, stderr=subprocess.STDOUT, env=env, timeout=600,
            ).returncode
        took = time.monotonic() - started
        text = log.read_text()
        if expect_kill:
            assert code == -signal.SIGKILL, f"{name} was to kill itself, exited {code}:\n{text[-6000:]}"
        elif expect_failure:
            assert code not in (0, -signal.SIGKILL), f"{name} was to fail, exited {code}:\n{text[-6000:]}"
        else:
            assert code == 0, f"{name} exited {code}:\n{text[-6000:]}"
        print(f"{name}: {took:.1f} s, connector={connector is not None}")
        result = json.loads(out.read_text()) if out.exists() else {"phases": []}
        result["log"] = text
        return result


@pytest.fixture(scope="session")
def engine(model_dir, tmp_path_factory) -> Engine:
    return Engine(model_dir, tmp_path_factory.mktemp("engines"))
