"""What torch's CPU products read per second on E4B's MLP shapes, by kernel, dtype and thread count.

    python benchmarks/cpu_kernel_threads.py [THREADS ...]   (default: torch's thread count)

The kernels a host layer of the engine runs (runtime/engine/cpu_kernels.py): the int4 kernel on a
10,240×2,560 matrix in groups of 32, the int8 row kernel on the same shape, and the dense product,
in bfloat16 and float32, one token, over 6 distinct matrices (3 dense) so the caches do not serve
them; GB/s of stored bytes. The profile's `cpu_kernel_bandwidth` is the int4 and int8 pair at the
default thread count (plan/profile.py), the fastest of its rounds where this script gives the mean
of five.
"""

from __future__ import annotations

import sys
import time

import torch

ROWS, COLUMNS, GROUP, COPIES = 10240, 2560, 32, 6


def rate(product, nbytes: int, copies: int, repeats: int = 5) -> float:
    with torch.inference_mode():
        product(0)
        start = time.perf_counter()
        for _ in range(repeats):
            for c in range(copies):
                product(c)
        return copies * nbytes * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    print("capability", torch.backends.cpu.get_cpu_capability(), "threads", torch.get_num_threads(), torch.__version__)
    codes = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (ROWS, COLUMNS), dtype=torch.int32), 1) for _ in range(COPIES)]
    int8 = [torch.randint(-127, 128, (ROWS, COLUMNS), dtype=torch.int8) for _ in range(COPIES)]
    for threads in [int(t) for t in sys.argv[1:]] or [torch.get_num_threads()]:
        torch.set_num_threads(threads)
        found = []
        for dtype in (torch.bfloat16, torch.float32):
            name = str(dtype).removeprefix("torch.")
            x = torch.randn(1, COLUMNS, dtype=dtype)
            scales_zeros = torch.full((COLUMNS // GROUP, ROWS, 2), 0.01, dtype=dtype)
            row_scales = torch.full((ROWS,), 0.01, dtype=dtype)
            found.append((f"int4 {name}", rate(
                lambda c: torch.ops.aten._weight_int4pack_mm_for_cpu(x, codes[c], GROUP, scales_zeros),
                codes[0].numel() + scales_zeros.numel() * scales_zeros.element_size(), COPIES)))
            found.append((f"int8 {name}", rate(
                lambda c: torch.ops.aten._weight_int8pack_mm(x, int8[c], row_scales), ROWS * COLUMNS, COPIES)))
            dense = [torch.randn(ROWS, COLUMNS, dtype=dtype) for _ in range(3)]
            found.append((f"dense {name}", rate(lambda c: x @ dense[c % 3].t(), ROWS * COLUMNS * x.element_size(), 3)))
            del dense
        print(f"threads {threads:2d}: " + ", ".join(f"{k} {v:.1f}" for k, v in found), flush=True)


if __name__ == "__main__":
    main()
