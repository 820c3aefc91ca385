#!/usr/bin/env bash
# LMCache 0.5.6 and Lake back to back in one run on the GPU machine, so
# every ratio is measured side by side: Lake's store/retrieve of a
# Qwen3-8B-shaped paged cache with `lake serve`'s defaults and with
# `--commit-check trust` (gpu_defaults.sh), then the peer's of the same
# cache (lmcache_engine.py) — each beside the raw pinned copies measured in
# its own process.
#
# WHEELS holds LMCache's wheel and the wheels it imports that the machine
# lacks, and LMCache's source release (lmcache-0.5.6.tar.gz) for its CUDA
# kernels, rebuilt here against the machine's torch (build_lmcache_ops.py)
# unless WHEELS holds the `cuda_ops.so.gz` a run before built (this run
# leaves the one it builds in OUT).
#
# Usage: bench/python/side_by_side.sh BIN WHEELS OUT
#   (BIN holds lake and liblake.so; OUT gets lmcache.jsonl, runs.jsonl,
#   pools.log, lmcache.log, host_memory.jsonl)
set -uo pipefail
bin="$1"
wheels="$(realpath "$2")"
out="$3"
mkdir -p "$out"
bash bench/python/gpu_defaults.sh "$bin" "$out"
python3 bench/python/host_memory.py >"$out/host_memory.jsonl" 2>>"$out/pools.log"
site=/tmp/lmcache-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl \
    >"$out/lmcache.log" 2>&1
ops=""
if [ -f "$wheels"/cuda_ops.so.gz ]; then
    ops=/tmp/cuda_ops.cpython-312-x86_64-linux-gnu.so
    gunzip -c "$wheels"/cuda_ops.so.gz >"$ops"
fi
if [ -z "$ops" ]; then
    src=/tmp/lmcache-src
    mkdir -p "$src" && tar xzf "$wheels"/lmcache-0.5.6.tar.gz -C "$src" --strip-components=1
    started=$(date +%s)
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" timeout 420 python3 bench/python/build_lmcache_ops.py "$src" /tmp/lmcache-ops \
        >>"$out/lmcache.log" 2>&1
    echo "== cuda_ops built in $(($(date +%s) - started)) s" >>"$out/lmcache.log"
    ops="$(ls /tmp/lmcache-ops/lmcache/cuda_ops*.so 2>/dev/null | head -1)"
    # Kept for later runs (WHEELS/cuda_ops.so.gz): the build takes minutes.
    [ -n "$ops" ] && gzip -c "$ops" >"$out/cuda_ops.so.gz"
fi
if [ -n "$ops" ]; then
    cp "$ops" "$site"/lmcache/
    PYTHONPATH="$site" PYTHONUNBUFFERED=1 timeout 180 python3 bench/python/lmcache_engine.py \
        >"$out/lmcache.jsonl" 2>>"$out/lmcache.log"
    echo "== lmcache_engine.py exit $?" >>"$out/lmcache.log"
else
    echo "== no cuda_ops: LMCache not run" >>"$out/lmcache.log"
fi
