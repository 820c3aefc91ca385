"""Lake's transport against Mooncake's transfer engine over TCP, same
machine, same loopback path, same block sizes, one run.

Mooncake side: its Python `TransferEngine` (PyPI
`mooncake-transfer-engine-non-cuda`, TCP protocol, P2P handshake — no
metadata server), the target memory held by a second process (so TCP is
measured, not memcpy), blocks written with `batch_transfer_sync_write` in
batches of a 16 MiB window (its best path: many transfers per call).
Lake side: `lake-bench tcp` with the same block size and total bytes.
CPU: user + system time of every process involved over the wall time.

Run through bench/mooncake/run.sh (it makes the throwaway venv). Prints
one JSON line per block size."""

import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

WINDOW = 16 << 20
TICK = os.sysconf("SC_CLK_TCK")


def engine():
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"mooncake initialize failed: {rc}")
    return e


def receiver():
    e = engine()
    buffer = e.allocate_managed_buffer(WINDOW)
    print(f"READY {e.get_rpc_port()} {buffer}", flush=True)
    sys.stdin.read()  # until the parent closes it


def cpu_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mooncake(block, total):
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = ""
    while not line.startswith("READY"):
        line = child.stdout.readline()
        if not line:
            raise SystemExit("the mooncake receiver did not start")
    _, port, remote = line.split()
    target, remote = f"127.0.0.1:{port}", int(remote)
    e = engine()
    local = e.allocate_managed_buffer(WINDOW)
    per_batch = max(1, WINDOW // block)
    sources = [local + (i * block) % WINDOW for i in range(per_batch)]
    targets = [remote + (i * block) % WINDOW for i in range(per_batch)]
    lengths = [block] * per_batch
    # One batch first: connections made outside the measurement.
    if e.batch_transfer_sync_write(target, sources, targets, lengths) != 0:
        raise SystemExit("mooncake batch write failed")
    batches = max(1, total // (block * per_batch))
    cpu = own_cpu() + cpu_of(child.pid)
    start = time.perf_counter()
    for _ in range(batches):
        if e.batch_transfer_sync_write(target, sources, targets, lengths) != 0:
            raise SystemExit("mooncake batch write failed")
    seconds = time.perf_counter() - start
    cores = (own_cpu() + cpu_of(child.pid) - cpu) / seconds
    child.stdin.close()
    child.wait(timeout=30)
    return batches * per_batch * block / seconds / 1e9, cores


def lake(binary, block, total):
    out = subprocess.run(
        [binary, "tcp", "--block-bytes", str(block), "--total-bytes", str(total), "--rounds", "3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    if sys.argv[1:] == ["--receiver"]:
        receiver()
        return
    binary = sys.argv[1]
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30
    goals = {65536: 5.0, 1 << 20: None, 16 << 20: 1.3}
    for block in (65536, 1 << 20, 16 << 20):
        runs = [mooncake(block, total) for _ in range(3)]
        runs.sort()
        mc_gbps, mc_cores = runs[1]
        ours = lake(binary, block, total)
        print(
            json.dumps(
                {
                    "block_bytes": block,
                    "lake_gbps": ours["lake_gbps"],
                    "lake_cores": ours["cpu_cores_used"],
                    "mooncake_gbps": round(mc_gbps, 4),
                    "mooncake_cores": round(mc_cores, 4),
                    "iperf_gbps": ours["iperf_gbps"],
                    "ratio": round(ours["lake_gbps"] / mc_gbps, 3),
                    "lake_gbps_per_core": round(ours["lake_gbps"] / ours["cpu_cores_used"], 3),
                    "mooncake_gbps_per_core": round(mc_gbps / mc_cores, 3),
                    "ratio_goal": goals[block],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
