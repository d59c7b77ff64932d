"""Tiles of the int8-row GEMV (runtime/engine/int8_gemv.py) on this GPU, per matrix shape of a model.

    python benchmarks/int8_gemv_sweep.py [--shapes e2b] [--rows 2,4,8,16,32] [--cols 256,512,1024,2048]
                                         [--warps 2,4,8] [--programs 4] [--budget-s S]

For every tile (rows a program owns × columns per iteration × warps × programs per
multiprocessor below which K is split) and every int8 matrix shape
a decode step of the model runs, the kernel is captured in a CUDA graph over distinct copies of
the matrix (so no copy sits in L2, as in a real step, where each weight is read once), replayed,
and timed with CUDA events. cuBLAS on the bfloat16 copy of each matrix is timed the same way, as
the reference the kernel replaced. Prints one JSON object: per shape the best tile and its GB/s,
the step's int8 time for the engine's own tiles (int8_gemv.tile_for), for the best single tile and for the best tile of each
shape, and the best single tile as GEMMACTL_INT8_TILE would take it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

# (out, in): how many matrices of that shape a decode step reads. E2B (tests/helpers/random_gemma.py
# E2B): the tied 262,144-row head; down_proj of the 15 layers with their own KV (intermediate 6144)
# and of the 20 KV-shared layers (double-wide, 12288); v_proj of the 12 sliding (head dim 256) and
# 3 global (512) layers that compute KV.
SHAPES = {"e2b": {(262_144, 1536): 1, (1536, 6144): 15, (1536, 12288): 20, (256, 1536): 12, (512, 1536): 3}}
COPY_BYTES = 256 << 20  # distinct copies per shape: at least this many bytes, five times L2
REPEATS = 5


def name(tile) -> str:
    """A tile as GEMMACTL_INT8_TILE takes it."""
    return ",".join(map(str, tile))


def _copies(out_features: int, in_features: int) -> int:
    return max(2, min(512, math.ceil(COPY_BYTES / (out_features * in_features))))


def _graph_us(fn, calls: int) -> float:
    """µs per call of fn(i) for i in range(calls), captured in one graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="e2b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="2,4,8,16,32")
    parser.add_argument("--cols", default="256,512,1024,2048")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--programs", default="4", help="programs per multiprocessor below which K is split")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new shape after this many seconds (the JSON covers the shapes done)")
    args = parser.parse_args()
    from gemmactl.runtime.engine import int8_gemv

    shapes = SHAPES[args.shapes]
    tiles = []
    values = (args.rows, args.cols, args.warps, args.programs)
    for rows, cols, warps, programs in itertools.product(*(map(int, v.split(",")) for v in values)):
        per_thread = rows * cols / (32 * warps)
        if 4 <= per_thread <= 128:  # fewer starves the loads, more spills the accumulator's registers
            tiles.append(int8_gemv.Tile(rows, cols, warps, programs))
    os.environ.pop(int8_gemv.TILE_ENV, None)
    defaults = {shape: int8_gemv.tile_for(*shape) for shape in shapes}  # the tiles the engine picks
    tiles += [t for t in set(defaults.values()) if t not in tiles]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(max(k for _, k in shapes), dtype=torch.bfloat16, device="cuda")
    results = {}
    started = time.perf_counter()
    for (out_features, in_features), count in shapes.items():
        if time.perf_counter() - started > args.budget_s:
            break
        n = _copies(out_features, in_features)
        q = torch.randint(-127, 128, (n, out_features, in_features), dtype=torch.int8, device="cuda")
        s = torch.rand((n, out_features), dtype=torch.float16, device="cuda") / 100
        xs = x[:in_features].contiguous()
        row = {"count": count, "copies": n, "bytes": out_features * in_features, "tiles": {},
               "default": name(defaults[(out_features, in_features)])}
        reference = int8_gemv.int8_rows_gemv(xs, q[0], s[0]).float()
        dense = (q[0].float() * s[0].float()[:, None]) @ xs.float()
        row["max_error"] = (reference - dense).abs().max().item() / dense.abs().max().item()
        for tile in tiles:
            int8_gemv.tile_for.cache_clear()
            os.environ[int8_gemv.TILE_ENV] = name(tile)
            try:
                us = _graph_us(lambda i: int8_gemv.int8_rows_gemv(xs, q[i % n], s[i % n]), n)
            except Exception as exc:  # a tile the compiler refuses (registers, shared memory)
                row["tiles"][name(tile)] = {"error": str(exc).splitlines()[0][:200]}
                continue
            row["tiles"][name(tile)] = {"us": us, "gb_s": row["bytes"] / us / 1e3,
                                                     "splits": int8_gemv.split(out_features, in_features, sms, tile)[0]}
        os.environ.pop(int8_gemv.TILE_ENV, None)
        int8_gemv.tile_for.cache_clear()
        del q, s
        copies = min(n, max(2, math.ceil(COPY_BYTES / (2 * out_features * in_features))))
        w = torch.randn((copies, out_features, in_features), dtype=torch.bfloat16, device="cuda")
        us = _graph_us(lambda i: F.linear(xs[None], w[i % copies]), copies)
        row["cublas_bf16"] = {"us": us, "gb_s": 2 * row["bytes"] / us / 1e3}
        del w
        torch.cuda.empty_cache()
        timed = {t: r["us"] for t, r in row["tiles"].items() if "us" in r}
        row["best"] = min(timed, key=timed.get)
        results[f"{out_features}x{in_features}"] = row
        print(f"{out_features}x{in_features}: best {row['best']} {row['tiles'][row['best']]['gb_s']:.0f} GB/s, "
              f"cuBLAS bf16 {row['cublas_bf16']['gb_s']:.0f} GB/s", file=sys.stderr)

    def step_us(pick) -> float | None:
        total = 0.0
        for row in results.values():
            r = row["tiles"].get(pick(row), {})
            if "us" not in r:
                return None
            total += row["count"] * r["us"]
        return total

    singles = {name(t): step_us(lambda row, t=name(t): t) for t in tiles}
    singles = {t: v for t, v in singles.items() if v is not None}
    best_single = min(singles, key=singles.get)
    print(json.dumps({
        "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "sms": sms, "step_int8_bytes": sum(r["count"] * r["bytes"] for r in results.values()),
        "step_us": {"default_tiles": step_us(lambda row: row["default"]), "best_single_tile": singles[best_single],
                    "best_tile_per_shape": step_us(lambda row: row["best"]),
                    "cublas_bf16": sum(r["count"] * r["cublas_bf16"]["us"] for r in results.values())},
        "best_single_tile": best_single, "sweep_s": time.perf_counter() - started,
        "shapes": results}))


if __name__ == "__main__":
    main()
