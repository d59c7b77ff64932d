"""The int4 GEMV (runtime/engine/int4_gemv.py) against tinygemm on this GPU, per matrix shape of a model.

    python benchmarks/int4_gemv_sweep.py [--shapes e2b,26b-a4b] [--rows 2,4,8,16] [--groups 4,8,16,32]
                                         [--warps 2,4,8] [--budget-s S] [--expert-tiles R,G,W,P;...]
                                         [--only-experts]

For every int4 matrix shape a decode step of the model runs (groups of 32, as the E2B artifacts
are written), the Triton kernel in every tile and torch's tinygemm
(`aten._weight_int4pack_mm`, on the same codes repacked) are captured in a CUDA graph over
distinct copies of the matrix (so no copy sits in L2, as in a real step), replayed, and timed with
CUDA events; cuBLAS on a bfloat16 copy is timed the same way. Each kernel's output is checked
against the dequantized matrix in float32 first.

For an MoE model, a layer's chosen experts (top_k of them: gate_up, then down on each expert's
own activation) are timed three ways: tinygemm one expert at a time (what the engine ran), the
grouped kernel over the experts in device memory (one launch for gate_up, one for down; in the
engine's tile and in each of --expert-tiles), and the
grouped kernel reading experts straight from pinned host memory over the link (no copy, no host
decision between router and experts).

Prints one JSON object (per shape: tinygemm, cuBLAS, every tile, the best; the step's int4 time
for tinygemm, the engine's own tiles and the best tile per shape; the experts' timings).
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

sys.path.insert(0, os.path.dirname(__file__))
from int8_gemv_sweep import COPY_BYTES, _graph_us  # noqa: E402

GROUP = 32
# (out, in): how many a decode step reads. E2B (tests/helpers/random_gemma.py E2B, v_proj and
# down_proj int8): q_proj of 28 sliding (8×256) and 7 global (8×512) layers, k_proj of the 12
# sliding and 3 global layers with their own KV, o_proj, gate and up of the 15 layers with their own
# KV (6144) and of the 20 sharing ones (12288), the per-layer input gate (k_proj's sliding shape) and
# projection.
SHAPES = {
    "e2b": {(2048, 1536): 28, (4096, 1536): 7, (256, 1536): 12 + 35, (512, 1536): 3, (1536, 2048): 28,
            (1536, 4096): 7, (6144, 1536): 30, (12288, 1536): 40, (1536, 256): 35},
    # 26B-A4B's dense parts: q (16×256 sliding, 16×512 global), k (8×256, 2×512), o, the dense MLP.
    "26b-a4b": {(4096, 2816): 25, (8192, 2816): 5, (2048, 2816): 25, (1024, 2816): 5, (2816, 4096): 25,
                (2816, 8192): 5, (2112, 2816): 60, (2816, 2112): 30},
}
EXPERTS = {"26b-a4b": dict(hidden=2816, width=704, experts=128, top_k=8, layers=30)}


def name(tile) -> str:
    return ",".join(map(str, tile))


def random_int4(copies: int, rows: int, cols: int, device="cuda"):
    groups = -(-cols // GROUP)
    q = torch.randint(0, 256, (copies, rows, groups * GROUP // 2), dtype=torch.uint8, device=device)
    s = (torch.rand((copies, rows, groups), device=device) / 50 + 1e-3).half()
    z = (-8 * s.float() + torch.randn((copies, rows, groups), device=device) / 100).half()
    return q, s, z


def dequantized(q, s, z, cols: int) -> torch.Tensor:
    from gemmactl.formats.int4.quant import unpack_nibbles

    codes = unpack_nibbles(q).float()  # [R, Cp]
    w = codes.reshape(q.shape[0], s.shape[1], GROUP) * s.float()[:, :, None] + z.float()[:, :, None]
    return w.reshape(q.shape[0], -1)[:, :cols]


def shape_row(out_features, in_features, count, tiles, x, sms):
    from gemmactl.runtime.engine import int4_gemv
    from gemmactl.runtime.engine.kernels import tinygemm_columns, tinygemm_layout

    n = max(2, min(256, math.ceil(COPY_BYTES / (out_features * in_features // 2))))
    q, s, z = random_int4(n, out_features, in_features)
    xs = x[:in_features].contiguous()
    row = {"count": count, "copies": n, "bytes": q[0].numel() + 4 * s[0].numel(), "tiles": {}}
    reference = dequantized(q[0], s[0], z[0], in_features) @ xs.float()
    scale = reference.abs().max().item()
    row["max_error"] = (int4_gemv.int4_gemv(xs, q[0], s[0], z[0], in_features).float() - reference).abs().max().item() / scale
    columns = tinygemm_columns(in_features, GROUP)
    packed = [tinygemm_layout(q[i], s[i], z[i], in_features, "cuda", columns) for i in range(n)]
    xp = F.pad(xs, (0, columns - in_features))[None]
    tiny = torch.ops.aten._weight_int4pack_mm(xp, packed[0][0], GROUP, packed[0][1])[0]
    row["tinygemm_max_error"] = (tiny.float() - reference).abs().max().item() / scale
    row["tinygemm"] = {"us": _graph_us(lambda i: torch.ops.aten._weight_int4pack_mm(xp, packed[i % n][0], GROUP,
                                                                                    packed[i % n][1]), n)}
    del packed
    for tile in tiles:
        int4_gemv.tile_for.cache_clear()
        os.environ[int4_gemv.TILE_ENV] = name(tile)
        try:
            us = _graph_us(lambda i: int4_gemv.int4_gemv(xs, q[i % n], s[i % n], z[i % n], in_features), n)
        except Exception as exc:  # a tile the compiler refuses
            row["tiles"][name(tile)] = {"error": str(exc).splitlines()[0][:200]}
            continue
        row["tiles"][name(tile)] = {"us": us, "gb_s": row["bytes"] / us / 1e3,
                                    "splits": int4_gemv.split(out_features, s.shape[2], sms, tile)[0]}
    os.environ.pop(int4_gemv.TILE_ENV, None)
    int4_gemv.tile_for.cache_clear()
    row["default"] = name(int4_gemv.tile_for(out_features, in_features))
    del q, s, z
    copies = max(2, min(n, math.ceil(COPY_BYTES / (2 * out_features * in_features))))
    w = torch.randn((copies, out_features, in_features), dtype=torch.bfloat16, device="cuda")
    row["cublas_bf16"] = {"us": _graph_us(lambda i: F.linear(xs[None], w[i % copies]), copies)}
    del w
    torch.cuda.empty_cache()
    timed = {t: r["us"] for t, r in row["tiles"].items() if "us" in r}
    row["best"] = min(timed, key=timed.get)
    row["tinygemm"]["gb_s"] = row["bytes"] / row["tinygemm"]["us"] / 1e3
    return row


def expert_rows(shape: dict, tiles: list) -> dict:
    """A layer's top_k experts: tinygemm one at a time, grouped from device memory (the engine's tile, then
    every tile of `tiles`), grouped from pinned host."""
    from gemmactl.runtime.engine import int4_gemv
    from gemmactl.runtime.engine.kernels import tinygemm_columns, tinygemm_layout

    hidden, width, experts, top_k = shape["hidden"], shape["width"], shape["experts"], shape["top_k"]
    layers = 4  # distinct layers' experts, so a replay reads from memory, not L2
    result = {}
    x = torch.randn(hidden, dtype=torch.bfloat16, device="cuda")
    choice = [torch.randperm(experts)[:top_k].tolist() for _ in range(layers)]

    up = random_int4(layers * experts, 2 * width, hidden)
    down = random_int4(layers * experts, hidden, width)
    # correctness of the grouped kernel: experts of layer 0 against the dequantized reference
    def addresses(parts, layer):
        q, s, z = parts
        rows = [layer * experts + e for e in choice[layer]]
        return torch.tensor([[q[r].data_ptr(), s[r].data_ptr(), z[r].data_ptr()] for r in rows], dtype=torch.int64,
                            device="cuda")

    up_at = [addresses(up, i) for i in range(layers)]
    down_at = [addresses(down, i) for i in range(layers)]

    def grouped_layer(i):
        h = int4_gemv.grouped(x, up_at[i], 2 * width, hidden, GROUP)  # [k, 2w]
        a = F.gelu(h[:, :width], approximate="tanh") * h[:, width:]
        return int4_gemv.grouped(a.contiguous(), down_at[i], hidden, width, GROUP)  # [k, hidden]

    got = grouped_layer(0).float()
    want = []
    for e in choice[0]:
        h = dequantized(up[0][e], up[1][e], up[2][e], hidden) @ x.float()
        a = F.gelu(h[:width], approximate="tanh") * h[width:]
        want.append(dequantized(down[0][e], down[1][e], down[2][e], width) @ a.bfloat16().float())
    want = torch.stack(want)
    result["grouped_max_error"] = ((got - want).abs().max() / want.abs().max()).item()
    result["grouped_device_us"] = _graph_us(grouped_layer, layers)  # the engine's tile
    result["expert_bytes_per_layer"] = top_k * sum(t[0].numel() + 4 * t[1].numel() for t in (
        (up[0][0], up[1][0]), (down[0][0], down[1][0])))
    by_tile = {}
    for tile in tiles:
        int4_gemv.tile_for.cache_clear()
        os.environ[int4_gemv.TILE_ENV] = name(tile)
        try:
            agrees = torch.equal(grouped_layer(0), grouped_layer(0))  # compiles the tile first
            us = _graph_us(grouped_layer, layers)
        except Exception as exc:  # a tile the compiler refuses
            by_tile[name(tile)] = {"error": str(exc).splitlines()[0][:200]}
            continue
        error = ((grouped_layer(0).float() - want).abs().max() / want.abs().max()).item()
        by_tile[name(tile)] = {"us": us, "gb_s": result["expert_bytes_per_layer"] / us / 1e3, "max_error": error,
                               "repeatable": agrees}
    os.environ.pop(int4_gemv.TILE_ENV, None)
    int4_gemv.tile_for.cache_clear()
    if by_tile:
        timed = {t: r["us"] for t, r in by_tile.items() if "us" in r}
        result["grouped_by_tile"] = by_tile
        result["grouped_best_tile"] = min(timed, key=timed.get) if timed else None
    # tinygemm, one expert at a time (its layout, padded columns for down)
    cols_up, cols_down = tinygemm_columns(hidden, GROUP), tinygemm_columns(width, GROUP)
    tiny = {}
    for i in range(layers):
        for e in choice[i]:
            r = i * experts + e
            tiny[(i, e)] = (tinygemm_layout(up[0][r], up[1][r], up[2][r], hidden, "cuda", cols_up),
                            tinygemm_layout(down[0][r], down[1][r], down[2][r], width, "cuda", cols_down))

    def tinygemm_layer(i):
        out = []
        for e in choice[i]:
            (pu, su), (pd, sd) = tiny[(i, e)]
            h = torch.ops.aten._weight_int4pack_mm(x[None], pu, GROUP, su)[0]
            a = F.gelu(h[:width], approximate="tanh") * h[width:]
            a = F.pad(a, (0, cols_down - width))[None]
            out.append(torch.ops.aten._weight_int4pack_mm(a, pd, GROUP, sd)[0])
        return torch.stack(out)

    result["tinygemm_loop_us"] = _graph_us(tinygemm_layer, layers)
    # from pinned host memory: the kernel reads the same codes over the link
    host = [tuple(t.cpu().pin_memory() for t in parts) for parts in (up, down)]
    del tiny, up, down, up_at, down_at
    torch.cuda.empty_cache()
    up, down = host
    up_at = [addresses(up, i) for i in range(layers)]
    down_at = [addresses(down, i) for i in range(layers)]
    try:
        got = grouped_layer(0).float()
        result["host_max_error"] = ((got - want).abs().max() / want.abs().max()).item()
        result["grouped_host_us"] = _graph_us(grouped_layer, layers)
        per_layer = result["expert_bytes_per_layer"]
        result["host_gb_s"] = per_layer / result["grouped_host_us"] / 1e3
        # a copy of the same bytes over the link, for comparison
        staging = torch.empty(per_layer, dtype=torch.uint8, device="cuda")
        source = torch.empty(per_layer, dtype=torch.uint8).pin_memory()
        result["copy_us"] = _graph_us(lambda i: staging.copy_(source, non_blocking=True), 4)
    except Exception as exc:
        result["host_error"] = str(exc).splitlines()[0][:300]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="e2b,26b-a4b")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--groups", default="4,8,16,32")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--programs", default="4")
    parser.add_argument("--budget-s", type=float, default=float("inf"))
    parser.add_argument("--expert-tiles", default="4,16,4,4;4,16,4,1;8,16,4,4;8,16,4,1;8,16,8,1;16,16,8,1;"
                        "8,32,8,1;16,8,4,1;16,16,4,1;32,8,8,1;8,8,4,1;4,32,4,1",
                        help="ROWS,GROUPS,WARPS,PROGRAMS;...: the tiles a MoE layer's grouped experts are timed in")
    parser.add_argument("--only-experts", action="store_true", help="time the experts alone (no dense shapes)")
    args = parser.parse_args()
    from gemmactl.runtime.engine import int4_gemv

    tiles = []
    for rows, groups, warps, programs in itertools.product(
            *(map(int, v.split(",")) for v in (args.rows, args.groups, args.warps, args.programs))):
        per_thread = rows * groups * GROUP / 2 / (32 * warps)  # code bytes a thread holds
        if 2 <= per_thread <= 64:
            tiles.append(int4_gemv.Tile(rows, groups, warps, programs))
    os.environ.pop(int4_gemv.TILE_ENV, None)
    tiles += [t for t in (int4_gemv.DEFAULT_TILE,) if t not in tiles]
    expert_tiles = [int4_gemv.Tile(*map(int, t.split(","))) for t in args.expert_tiles.split(";") if t]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(16384, dtype=torch.bfloat16, device="cuda")
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "sms": sms, "group": GROUP, "models": {}}
    started = time.perf_counter()
    for model in args.shapes.split(","):
        results = {}
        for (out_features, in_features), count in SHAPES[model].items():
            if args.only_experts or time.perf_counter() - started > args.budget_s:
                break
            row = shape_row(out_features, in_features, count, tiles, x, sms)
            results[f"{out_features}x{in_features}"] = row
            best = row["tiles"][row["best"]]
            print(f"{model} {out_features}x{in_features}: best {row['best']} {best['us']:.1f} µs "
                  f"{best['gb_s']:.0f} GB/s; tinygemm {row['tinygemm']['us']:.1f} µs; cuBLAS bf16 "
                  f"{row['cublas_bf16']['us']:.1f} µs; error {row['max_error']:.1e} (tinygemm "
                  f"{row['tinygemm_max_error']:.1e})", file=sys.stderr)

        def step(pick):
            total = 0.0
            for row in results.values():
                us = pick(row)
                if us is None:
                    return None
                total += row["count"] * us
            return total

        entry = {"shapes": results, "step_us": {
            "tinygemm": step(lambda r: r["tinygemm"]["us"]),
            "cublas_bf16": step(lambda r: r["cublas_bf16"]["us"]),
            "default_tiles": step(lambda r: r["tiles"].get(r["default"], {}).get("us")),
            "best_tile_per_shape": step(lambda r: r["tiles"][r["best"]]["us"])}}
        if not results:  # --only-experts
            entry = {}
        singles = {name(t): step(lambda r, t=name(t): r["tiles"].get(t, {}).get("us")) for t in tiles} if results else {}
        singles = {t: v for t, v in singles.items() if v is not None}
        if singles:
            best = min(singles, key=singles.get)
            entry["step_us"]["best_single_tile"] = singles[best]
            entry["best_single_tile"] = best
        if model in EXPERTS and time.perf_counter() - started <= args.budget_s:
            entry["experts"] = expert_rows(EXPERTS[model], expert_tiles)
            print(f"{model} experts: {json.dumps(entry['experts'])}", file=sys.stderr)
        out["models"][model] = entry
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
