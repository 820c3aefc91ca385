"""Prefill with and without Lake in real vLLM (its CPU build), one run.

A shared prefix (4,096 and 16,384 tokens by default) with a different
suffix per request. Without Lake, a fresh vLLM process computes each
request's whole prompt. With Lake, one vLLM process computes the prefix
once (its blocks go to the pool as they are computed), then a fresh vLLM
process serves the same requests, taking the prefix from the pool. vLLM's
own prefix cache is off in the measuring processes, so every request
either computes or loads the whole prefix. Time to first token is the
time of a one-token generate; the pool's load time per block is the sum
of vLLM's ``vllm:lake_load_seconds`` over ``vllm:lake_blocks_loaded``.
Every request's first token is compared with and without Lake, and the
largest difference of their top-5 logprobs is printed (a loaded prefix
and a computed suffix round differently from one whole prefill).

    python bench/python/vllm_prefix.py [--lake target/release/lake]
        [--prefix 4096,16384] [--requests 3] [--model DIR]

Run in the venv `.ci/vllm-venv` makes; the model defaults to the tiny
Qwen3 the real-vLLM tests write. Prints one JSON line per prefix length."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "ffi/python/tests_vllm/engine.py"
sys.path.insert(0, str(ENGINE.parent))

import engine  # noqa: E402
import tiny_model  # noqa: E402

BLOCK = 128
KV_BYTES_PER_TOKEN = 2 * 2 * tiny_model.KV_HEADS * tiny_model.HEAD_DIM * 4


def run_engine(workdir: Path, name: str, spec: dict) -> dict:
    spec_path, out, log = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = engine.environment()
    with open(log, "w") as f:
        command = [sys.executable, str(ENGINE), str(spec_path), str(out)]
        code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if code != 0:
        raise SystemExit(f"{name} exited {code}: see {log}")
    return json.loads(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lake", default=str(ROOT / "target/release/lake"))
    parser.add_argument("--prefix", default="4096,16384")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--model")
    args = parser.parse_args()
    if not os.environ.get("LAKE_LIBRARY"):
        os.environ["LAKE_LIBRARY"] = str(Path(args.lake).parent / "liblake.so")
    lengths = [int(x) for x in args.prefix.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lake-vllm-bench-"))
    model = Path(args.model) if args.model else tiny_model.write(work / "model")
    longest = max(lengths) + 2 * BLOCK
    pool_dir = work / "pool"
    blocks = sum(lengths) // BLOCK + 64
    serve = subprocess.Popen(
        [args.lake, "serve", "--metrics", "127.0.0.1:0", "--dir", str(pool_dir), "--block-bytes", str(BLOCK * KV_BYTES_PER_TOKEN),
         "--l1-slots", str(blocks), "--l2-slots", str(blocks)],
        stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT,
    )
    try:
        while not (pool_dir / "pool.json").exists():
            if serve.poll() is not None:
                raise SystemExit(f"lake serve exited: see {work / 'serve.log'}")
            time.sleep(0.05)
        for length in lengths:
            rng = random.Random(length)
            prefix = [rng.randrange(1, 1000) for _ in range(length)]
            requests = [prefix + [rng.randrange(1, 1000) for _ in range(37)] for _ in range(args.requests)]
            warmup = {"prompts": [[rng.randrange(1, 1000) for _ in range(300)]], "max_tokens": 1}
            measure = [{"prompts": [r], "max_tokens": 1, "logprobs": 5} for r in requests]
            common = {
                "model": str(model), "dtype": "float32", "block_size": BLOCK, "max_model_len": longest,
                "kv_cache_bytes": 2 * longest * KV_BYTES_PER_TOKEN, "max_num_batched_tokens": longest,
            }
            connector = {"pool_dir": str(pool_dir)}
            alone = run_engine(work, f"alone-{length}", {**common, "connector": None, "prefix_caching": False,
                                                         "phases": [warmup, *measure]})
            run_engine(work, f"saver-{length}", {**common, "connector": connector, "phases": [
                {"prompts": [prefix + [1]], "max_tokens": 1}]})
            lake = run_engine(work, f"lake-{length}", {**common, "connector": connector, "prefix_caching": False,
                                                       "phases": [{**warmup, "sleep_before": 0.5}, *measure]})
            without = [p["seconds"] for p in alone["phases"][1:]]
            with_lake = [p["seconds"] for p in lake["phases"][1:]]
            last = lake["phases"][-1]["counters"]
            loaded = last.get("vllm:lake_blocks_loaded", 0)
            # Loading the prefix and computing the suffix rounds differently
            # from computing the whole prompt at once: tokens must agree,
            # logprobs to rounding.
            pairs = [(a["requests"][0], b["requests"][0]) for a, b in zip(alone["phases"][1:], lake["phases"][1:])]
            same_tokens = all(a["tokens"] == b["tokens"] for a, b in pairs)
            difference = max(
                abs(x - y)
                for a, b in pairs
                for step_a, step_b in zip(a["logprobs"], b["logprobs"])
                for (_, x), (_, y) in zip(step_a, step_b)
            )
            print(json.dumps({
                "prefix_tokens": length,
                "requests": args.requests,
                "prefill_s_without_lake": sorted(without),
                "ttft_s_with_lake": sorted(with_lake),
                "ratio_median": round(sorted(with_lake)[len(with_lake) // 2] / sorted(without)[len(without) // 2], 4),
                "external_hit_tokens": last.get("vllm:external_prefix_cache_hits", 0),
                "blocks_loaded": loaded,
                "load_ms_per_block": round(1e3 * last.get("vllm:lake_load_seconds_sum", 0) / loaded, 4) if loaded else None,
                "first_tokens_equal": same_tokens,
                "logprob_max_difference": difference,
            }), flush=True)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


if __name__ == "__main__":
    main()
