"""The bus's rate from the host memory Lake's L1 is made of, against the
page-locked memory the raw figures of gpu_engine.py use (GPU machine).

Lake's L1 is a shared file mapping (/dev/shm, or hugetlbfs where the
operator gives huge pages) that the engine's process registers with the
driver (cuMemHostRegister); torch's `pin_memory` tensors come from the
driver's own allocator. Both directions, one contiguous copy each, and the
same bytes as 2.36 MB copies one per block (gpu_engine.py's blocks), for
each kind of memory. Prints one JSON line per kind.

    python3 bench/python/host_memory.py [BYTES]"""

import ctypes
import json
import mmap
import os
import sys
import time

import torch

BLOCK = 36 * 2 * 16 * 8 * 128 * 2


def timed(fn, rounds=5):
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def rates(kind, host, device):
    nbytes = host.numel()
    blocks = nbytes // BLOCK

    def per_block(to, frm):
        for i in range(blocks):
            to[i * BLOCK : (i + 1) * BLOCK].copy_(frm[i * BLOCK : (i + 1) * BLOCK], non_blocking=True)

    h2d = timed(lambda: device.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(device, non_blocking=True))
    h2d_blocks = timed(lambda: per_block(device, host))
    d2h_blocks = timed(lambda: per_block(host, device))
    print(
        json.dumps(
            {
                "memory": kind,
                "bytes": nbytes,
                "h2d_gbps": round(nbytes / h2d / 1e9, 2),
                "d2h_gbps": round(nbytes / d2h / 1e9, 2),
                "h2d_blocks_gbps": round(nbytes / h2d_blocks / 1e9, 2),
                "d2h_blocks_gbps": round(nbytes / d2h_blocks / 1e9, 2),
            }
        ),
        flush=True,
    )


def main(nbytes=str(512 * BLOCK)):
    nbytes = int(nbytes) // BLOCK * BLOCK
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates("pinned_alloc", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), device)
    path = f"/dev/shm/lake-host-memory-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        host = torch.frombuffer(mapped, dtype=torch.uint8)
        host.fill_(1)  # touched, as a mlocked arena is
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        cudart = torch.cuda.cudart()
        status = cudart.cudaHostRegister(address, nbytes, 0)
        if int(status) != 0:
            sys.exit(f"cudaHostRegister: {status}")
        rates("shm_registered", host, device)
        cudart.cudaHostUnregister(address)
        del host
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main(*sys.argv[1:2])
