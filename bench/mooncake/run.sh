#!/usr/bin/env bash
# Lake's TCP transport beside Mooncake's transfer engine on this machine:
# installs Mooncake's CPU build into a throwaway venv (nothing of it is kept
# in the repository), builds lake-bench, runs bench/mooncake/compare.py.
#   bench/mooncake/run.sh [TOTAL_BYTES]
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${MOONCAKE_VENV:-/tmp/lake-mooncake-venv}
if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    apt-get install -y -q libibverbs1 >/dev/null
fi
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q mooncake-transfer-engine-non-cuda
cargo build --release -q -p lake-bench
"$venv/bin/python" bench/mooncake/compare.py "$PWD/target/release/lake-bench" "${1:-1073741824}"
