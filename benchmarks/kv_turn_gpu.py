"""A decode step's write to a turbo KV cache on the GPU: the one kernel (kv_turn.py) against the
torch it replaces (the queries turned by one product, then the cache's write: keys and values
turned in float32, quantized, packed and stored), each captured in a CUDA graph and replayed as a
decode step runs it, for each tile given.

    python benchmarks/kv_turn_gpu.py [--mode tq4] [--heads 8 --kv-heads 2] [--dims 256 512]
                                     [--tiles 64,64,4 32,64,4] [--out FILE]

The shape defaults to E4B's (8 query heads, 2 KV heads; sliding layers 256 wide, global 512), one
token. Without torch.compile, so the torch write's time is its eager kernels' (the compiled step
fuses some of them: docs/benchmarks.md has the step's profile). Prints one JSON object (and writes
it to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_read_gpu import time_ms  # noqa: E402


def measure(mode: str, heads: int, kv_heads: int, dim: int, tiles: list[str]) -> dict:
    import torch

    from gemmactl.runtime.engine import kv_turn
    from gemmactl.runtime.engine.kv import make_cache

    torch.manual_seed(0)
    cache = make_cache(mode, 4096, kv_heads, dim, False, torch.bfloat16, "cuda", seed=1)
    cache.begin(torch.randn(8, kv_heads, dim, device="cuda"), torch.randn(8, kv_heads, dim, device="cuda"))
    q = torch.randn(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    positions = torch.tensor([100], device="cuda")

    def torch_write():  # as the step did before the kernel: the queries turned, then write()
        turned = q @ cache.rotation
        cache.write(k, v, positions)
        return turned

    row = {"dim": dim, "torch_us": round(1000 * time_ms(torch_write, graph=True), 2), "kernel_us": {}}
    for spec in tiles:
        kv_turn.tile.cache_clear()
        import os

        os.environ[kv_turn.TILE_ENV] = spec
        row["kernel_us"][spec] = round(1000 * time_ms(lambda: cache.write_turning(q, k, v, positions), graph=True), 2)
    return row


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="tq4")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--tiles", nargs="+", default=["64,64,4"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"command": " ".join(["benchmarks/kv_turn_gpu.py", *sys.argv[1:]]), "mode": args.mode,
              "device": torch.cuda.get_device_name(0),
              "rows": [measure(args.mode, args.heads, args.kv_heads, d, args.tiles) for d in args.dims]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
