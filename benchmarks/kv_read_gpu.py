"""One decode step's attention read of a KV cache on the GPU: the fused read of a quantized cache
against torch's attention over the same slots in bfloat16.

    python benchmarks/kv_read_gpu.py [--slots 4096 32768 131072] [--rows 1 5] [--modes int8 tq4 tq3]
                                     [--heads 2 --groups 4 --dim 512] [--graph] [--out FILE]
                                     [--tiles 32,128,32,128,4 64,128,16,128,8 ...]

The shape defaults to an E4B-shaped global layer (2 KV heads, 4 query heads each, 512 wide).
Each cache is filled with random keys and values at every slot; each read is timed with CUDA
events over many calls after a warm-up (the fastest of five rounds' means), eagerly, so short
caches measure the launches from Python more than the kernel, or with --graph captured in a CUDA
graph and replayed, as a decode step runs it. The bf16 rows are a reference only:
torch's scaled_dot_product_attention with grouped heads over a bfloat16 copy of the same slots,
not the engine's own bf16 read, which the fused step compiles with the rest (its effect on decode
is measured by `plan --verify` at a context, docs/benchmarks.md). "bytes" is what the read must
fetch of the cache, so bytes / time is the bandwidth the read reaches. Prints one JSON object (and
writes it to --out). --tiles: each quantized read once a tile (GEMMACTL_KV_READ_TILE's form:
SCORE_BLOCK,SCORE_CHUNK,VALUE_BLOCK,VALUE_CHUNK,WARPS[,PROGRAMS_PER_SM]), the engine's own first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def time_ms(call, repeats: int = 50, graph: bool = False) -> float:
    import torch

    for _ in range(3):
        call()
    if graph:  # the read captured as a decode step holds it: no launches from Python in the time
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        call = captured.replay
        call()
    best = float("inf")
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) / repeats)
    return best


def measure(mode: str, slots: int, rows: int, heads: int, groups: int, dim: int, graph: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    from gemmactl.runtime.engine import kv_attention
    from gemmactl.runtime.engine.kv import make_cache
    from gemmactl.runtime.engine.kv_modes import pair_bytes

    device = torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(rows, heads, groups, dim, device=device, dtype=torch.bfloat16)
    positions = torch.arange(slots - rows, slots, device=device)
    if mode == "bf16":
        k = torch.randn(1, heads, slots, dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        query = q.permute(1, 2, 0, 3).reshape(1, heads * groups, rows, dim)

        def call():
            return F.scaled_dot_product_attention(query, k, v, enable_gqa=True, scale=dim ** -0.5)
    else:
        cache = make_cache(mode, slots, heads, dim, False, torch.bfloat16, device)
        cache.begin(torch.randn(64, heads, dim, device=device) + 0.5, torch.randn(64, heads, dim, device=device))
        step = 8192
        for start in range(0, slots, step):
            n = min(step, slots - start)
            cache.write(torch.randn(n, heads, dim, device=device) + 0.5, torch.randn(n, heads, dim, device=device),
                        torch.arange(start, start + n, device=device))
        parts = cache.fused_parts(slots)

        def call():
            return kv_attention.quantized_attention(q, *parts["k"], *parts["v"], cache.pos, positions, parts["k_bits"],
                                                    parts["v_bits"], dim ** -0.5, 0)
    ms = time_ms(call, graph=graph)
    read = slots * heads * pair_bytes(mode, dim)
    return {"mode": mode, "slots": slots, "rows": rows, "ms": round(ms, 4), "bytes": read,
            "gb_s": round(read / ms / 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--modes", nargs="+", default=["int8", "tq4", "tq3"])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--graph", action="store_true", help="time the read captured in a CUDA graph")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiles", nargs="+", default=[], help="read tiles to sweep (the engine's own first)")
    args = parser.parse_args()
    import os

    import torch

    from gemmactl.runtime.engine import kv_attention

    def tiled(tile: str, slots: int = 0):
        if tile:
            os.environ[kv_attention.TILE_ENV] = tile
        else:
            os.environ.pop(kv_attention.TILE_ENV, None)
        kv_attention.read_tile.cache_clear()
        return ",".join(map(str, kv_attention.tile_for(slots)))

    results = []
    for slots in args.slots:
        for rows in args.rows:
            base = measure("bf16", slots, rows, args.heads, args.groups, args.dim, args.graph)
            results.append(base)
            for mode in args.modes:
                for tile in [""] + args.tiles:
                    name = tiled(tile, slots)
                    try:
                        row = measure(mode, slots, rows, args.heads, args.groups, args.dim, args.graph)
                    except Exception as error:  # a tile that does not compile or fit: noted, the sweep goes on
                        row = {"mode": mode, "slots": slots, "rows": rows, "error": str(error)[:300]}
                    row["tile"] = name
                    if "ms" in row:
                        row["vs_bf16"] = round(base["ms"] / row["ms"], 3)
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
    tiled("")
    report = {"device": torch.cuda.get_device_name(), "graph": args.graph, "heads": args.heads, "groups": args.groups, "dim": args.dim,
              "reads": results}
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
