# Used by docs/gpu.md: run beside `lake-bench gpu` to measure the kernels while the GPU computes.
# A large bf16 GEMM kept running on the GPU for `seconds` (the engine's
# compute that Lake's kernels share the SMs with).
import sys, time, torch
seconds = float(sys.argv[1])
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
end = time.time() + seconds
n = 0
start = time.time()
while time.time() < end:
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
    n += 10
print(f"gemm: {n} GEMMs of 8192^3 in {time.time()-start:.1f} s: {2*8192**3*n/(time.time()-start)/1e12:.0f} TFLOP/s", flush=True)
