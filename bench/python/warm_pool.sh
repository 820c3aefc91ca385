#!/usr/bin/env bash
# A full pool still takes what is new, on the GPU machine: gpu_engine.py
# twice against one `lake serve` of 4,000 L1 slots — the first run into
# the fresh pool, the second while L1 holds the first run's blocks — once
# with almost no L2 (victims are dropped) and once with room in L2.
# Each run's JSON lines (acked, published, store GB/s per token count) and
# the pool's `lake top` after go to OUT.
#
# Usage: bench/python/warm_pool.sh BIN OUT   (BIN holds lake and liblake.so)
set -euo pipefail
bin="$(realpath "$1")"
out="$2"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/serve_pool.sh"
for l2 in 64 2048; do
    pool="$work/pool-$l2"
    serve_pool "$bin" "$pool" "$out/serve-$l2.log" --l2-slots "$l2" --commit-check trust
    for run in fresh warm; do
        LAKE_LIBRARY="$bin/liblake.so" PYTHONPATH=ffi/python python3 bench/python/gpu_engine.py \
            "$pool/dp.sock" "$mirror" "$pool/cp.sock" copy_engine >"$out/l2-$l2-$run.jsonl" 2>"$out/l2-$l2-$run.err" || true
    done
    "$bin/lake" top --once --json --dir "$pool" >"$out/top-$l2.json" || true
    kill -TERM "$serve"
    wait "$serve" || true
done
