"""One 26B-A4B expert on the CPU, one token, in torch's CPU int4 kernel, at several thread counts.

    python benchmarks/cpu_expert_kernel.py [--threads 16,8,4,2] [--experts 64]

An expert as the engine computes one homed on the host (runtime/engine/ops.expert_forward):
the joined gate/up product (1,408×2,816, groups of 32), GELU(tanh)·up, the down product
(2,816×704); "products" is the two products alone. --experts distinct random experts (238 MB at
64 in the kernel's layout, past the caches) are run in turn; the fastest of 5 rounds is reported per expert, with the
stored bytes it read per second.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="16,8,4,2")
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    group = 32

    def matrix(rows: int, columns: int):
        codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (rows, columns), dtype=torch.int32), 1)
        return codes, torch.full((columns // group, rows, 2), 0.01, dtype=torch.bfloat16)

    experts = [(matrix(1408, 2816), matrix(2816, 704)) for _ in range(args.experts)]
    x = torch.randn(1, 2816, dtype=torch.bfloat16)

    def expert(pair):
        (up_codes, up_scales), (down_codes, down_scales) = pair
        gate, up = torch.ops.aten._weight_int4pack_mm_for_cpu(x, up_codes, group, up_scales).chunk(2, dim=-1)
        a = F.gelu(gate, approximate="tanh") * up
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a, down_codes, group, down_scales)

    def products(pair):
        (up_codes, up_scales), (down_codes, down_scales) = pair
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, up_codes, group, up_scales)
        torch.ops.aten._weight_int4pack_mm_for_cpu(x[:, :704], down_codes, group, down_scales)

    nbytes = sum(codes.numel() * codes.element_size() + scales.numel() * 2 for codes, scales in experts[0])
    with torch.inference_mode():
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for name, work in (("expert", expert), ("products", products)):
                for pair in experts[:8]:
                    work(pair)
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    for pair in experts:
                        work(pair)
                    best = min(best, (time.perf_counter() - start) / len(experts))
                print(f"threads {threads} {name}: {best * 1e6:.1f} us/expert, {nbytes / best / 1e9:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
