#!/usr/bin/env bash
# Store and retrieve through the Python binding with `lake serve`'s
# defaults, on the GPU machine: gpu_engine.py (copy engines) against one
# pool started with no commit-check flag — whole loads twice, layered loads
# once — then the same against `--commit-check trust` (the ceiling: no
# check at all), each beside the raw pinned copies it measures itself.
# Every run's JSON lines go to OUT/runs.jsonl, tagged with the pool's mode
# and the run; each pool's `lake top` and its log (the data plane's stats
# at stop: commits verified and found corrupt) to OUT/pools.log.
#
# Usage: bench/python/gpu_defaults.sh BIN OUT   (BIN holds lake and liblake.so)
set -euo pipefail
bin="$(realpath "$1")"
out="$2"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/serve_pool.sh"
for mode in default trust; do
    pool="$work/pool-$mode"
    flags=()
    [ "$mode" = trust ] && flags=(--commit-check trust)
    serve_pool "$bin" "$pool" "$work/serve-$mode.log" --l2-slots 64 "${flags[@]}"
    threads="$(cat /proc/"$serve"/task/*/comm 2>/dev/null | sort | uniq -c | tr '\n' ' ')"
    for run in whole-1 whole-2 layered; do
        groups=1
        [ "$run" = layered ] && groups=0
        LAKE_LIBRARY="$bin/liblake.so" PYTHONPATH=ffi/python python3 bench/python/gpu_engine.py \
            "$pool/dp.sock" "$mirror" "$pool/cp.sock" copy_engine "$groups" 2>>"$work/engine.err" |
            sed "s/^{/{\"mode\":\"$mode\",\"run\":\"$run\",/" >>"$out/runs.jsonl" || true
    done
    {
        echo "== $mode: threads: $threads"
        "$bin/lake" top --once --json --dir "$pool" || true
    } >>"$out/pools.log"
    kill -TERM "$serve"
    wait "$serve" || true
    { echo "== $mode: serve log"; cat "$work/serve-$mode.log"; } >>"$out/pools.log"
done
cat "$work/engine.err" >>"$out/pools.log" 2>/dev/null || true
