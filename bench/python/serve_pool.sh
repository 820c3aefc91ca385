# Sourced by the GPU bench scripts: `serve_pool BIN DIR LOG [FLAG...]`
# starts `BIN/lake serve --dir DIR` with the benches' pool (2.25 MiB blocks,
# 4,000 L1 slots, 8 agents, no metrics) and FLAG..., its output to LOG,
# and waits for it to serve: `serve` holds its pid, `mirror` its mirror.
serve_pool() {
    local bin="$1" dir="$2" log="$3"
    shift 3
    "$bin/lake" serve --dir "$dir" --block-bytes 2359296 --l1-slots 4000 --agents 8 --metrics off "$@" \
        >"$log" 2>&1 &
    serve=$!
    for _ in $(seq 1 600); do
        [ -f "$dir/pool.json" ] && break
        sleep 0.1
    done
    mirror="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['mirror'])" "$dir/pool.json")"
}
