"""Lake's transport against Mooncake over TCP, same machine, same
loopback path, same block sizes, one run.

Mooncake's transfer engine: its Python `TransferEngine` (PyPI
`mooncake-transfer-engine-non-cuda`, TCP protocol, P2P handshake — no
metadata server), the target memory held by a second process (so TCP is
measured, not memcpy), blocks written with `batch_transfer_sync_write` in
batches of a 16 MiB window (its best path: many transfers per call).
Mooncake Store: its master (`mooncake_master`, with its HTTP metadata
server) on loopback, a second process holding the store's memory (a
mounted segment), and a client holding none, so every value crosses TCP;
values put with `batch_put_from` and read back with `batch_get_into` from
a registered 16 MiB window, a batch per window (its batch paths: one
master round trip per batch, not per key), bytes compared after the gets.
Lake side: `lake-bench tcp` with the same block size and total bytes.
CPU: user + system time of every process involved over the wall time.

Run through bench/mooncake/run.sh (it makes the throwaway venv). Prints
one JSON line per block size."""

import ctypes
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """Mooncake Store's master on loopback, with its HTTP metadata server."""

    def __init__(self):
        binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        self.rpc, self.http = free_port(), free_port()
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [
                binary,
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={self.http}",
                f"--rpc_port={self.rpc}",
                f"--metrics_port={free_port()}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.rpc), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    raise SystemExit("mooncake_master did not start: " + self.log.read().decode()[-2000:])
                time.sleep(0.1)
        self.args = [f"http://127.0.0.1:{self.http}/metadata", f"127.0.0.1:{self.rpc}"]

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)


def store(metadata, master, segment_bytes):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", metadata, segment_bytes, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise SystemExit(f"mooncake store setup failed: {rc}")
    return s


def store_holder(metadata, master, segment_bytes):
    held = store(metadata, master, int(segment_bytes))
    print("READY", flush=True)
    sys.stdin.read()  # until the parent closes it
    held.close()


def store_client(metadata, master, block, total, run):
    """Puts then gets `total` bytes of `block`-byte values; prints JSON."""
    block, total = int(block), int(total)
    s = store(metadata, master, 0)
    window = (ctypes.c_char * WINDOW)()
    base = ctypes.addressof(window)
    seed = sum(run.encode())
    pattern = bytes((i * 7 + seed) & 0xFF for i in range(251)) * (WINDOW // 251 + 1)
    ctypes.memmove(base, pattern, WINDOW)
    if s.register_buffer(base, WINDOW) != 0:
        raise SystemExit("mooncake register_buffer failed")
    per_batch = max(1, WINDOW // block)
    batches = max(1, total // (block * per_batch))
    pointers = [base + i * block for i in range(per_batch)]
    lengths = [block] * per_batch

    def keys(b):
        return [f"lake-cmp-{run}-{b}-{i}" for i in range(per_batch)]

    # One batch first (connections made outside the measurement), removed.
    warm = [f"lake-cmp-{run}-warm-{i}" for i in range(per_batch)]
    codes = s.batch_put_from(warm, pointers, lengths)
    if any(r != 0 for r in codes):
        raise SystemExit(f"mooncake batch_put_from failed: {sorted(set(codes))}")
    s.batch_remove(warm)
    cpu = own_cpu()
    start = time.perf_counter()
    for b in range(batches):
        if any(r != 0 for r in s.batch_put_from(keys(b), pointers, lengths)):
            raise SystemExit("mooncake batch_put_from failed")
    put_seconds = time.perf_counter() - start
    put_cpu = own_cpu() - cpu
    ctypes.memset(base, 0, WINDOW)
    cpu = own_cpu()
    start = time.perf_counter()
    for b in range(batches):
        if any(r != block for r in s.batch_get_into(keys(b), pointers, lengths)):
            raise SystemExit("mooncake batch_get_into failed")
    get_seconds = time.perf_counter() - start
    get_cpu = own_cpu() - cpu
    if ctypes.string_at(base, per_batch * block) != pattern[: per_batch * block]:
        raise SystemExit("mooncake store: the bytes read back differ")
    moved = batches * per_batch * block
    print(
        json.dumps(
            {
                "put_gbps": moved / put_seconds / 1e9,
                "get_gbps": moved / get_seconds / 1e9,
                "put_seconds": put_seconds,
                "get_seconds": get_seconds,
                "put_cpu": put_cpu,
                "get_cpu": get_cpu,
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # the parent reads the holder's CPU before we go


def mooncake_store(master, block, total, run):
    """(put GB/s, put cores, get GB/s, get cores): client, holder, master."""
    holder = subprocess.Popen(
        [sys.executable, __file__, "--store-holder", *master.args, str(total + (256 << 20))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    while not (line := holder.stdout.readline()).startswith("READY"):
        if not line:
            raise SystemExit("the mooncake store holder did not start")
    others = [holder.pid, master.process.pid]
    before = sum(cpu_of(p) for p in others)
    client = subprocess.Popen(
        [sys.executable, __file__, "--store-client", *master.args, str(block), str(total), str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = client.stdout.readline()
    after = sum(cpu_of(p) for p in others)
    client.stdin.close()
    client.wait(timeout=60)
    holder.stdin.close()
    holder.wait(timeout=60)
    if not line:
        raise SystemExit("the mooncake store client failed")
    r = json.loads(line)
    # The holder's and master's CPU split between put and get by time.
    seconds = r["put_seconds"] + r["get_seconds"]
    other = after - before
    put_cores = (r["put_cpu"] + other * r["put_seconds"] / seconds) / r["put_seconds"]
    get_cores = (r["get_cpu"] + other * r["get_seconds"] / seconds) / r["get_seconds"]
    return r["put_gbps"], put_cores, r["get_gbps"], get_cores


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
    if sys.argv[1:2] == ["--store-holder"]:
        store_holder(*sys.argv[2:])
        return
    if sys.argv[1:2] == ["--store-client"]:
        store_client(*sys.argv[2:])
        return
    binary = sys.argv[1]
    total = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30
    goals = {65536: 5.0, 1 << 20: None, 16 << 20: 1.3}
    master = Master()
    try:
        for block in (65536, 1 << 20, 16 << 20):
            compare(binary, block, total, goals[block], master)
    finally:
        master.stop()


def median(runs):
    return sorted(runs)[len(runs) // 2]


def compare(binary, block, total, goal, master):
    """One JSON line: Lake, the transfer engine and the Store at one size."""
    mc_gbps, mc_cores = median([mooncake(block, total) for _ in range(3)])
    stores = [mooncake_store(master, block, total, f"{block}-{i}") for i in range(3)]
    put_gbps, put_cores = median([(s[0], s[1]) for s in stores])
    get_gbps, get_cores = median([(s[2], s[3]) for s in stores])
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
                "store_put_gbps": round(put_gbps, 4),
                "store_get_gbps": round(get_gbps, 4),
                "ratio_store_put": round(ours["lake_gbps"] / put_gbps, 3),
                "ratio_store_get": round(ours["lake_gbps"] / get_gbps, 3),
                "store_put_gbps_per_core": round(put_gbps / put_cores, 3),
                "store_get_gbps_per_core": round(get_gbps / get_cores, 3),
                "ratio_goal": goal,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
