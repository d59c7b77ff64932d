"""Decode speed → implied memory bandwidth, beside the bandwidth the device really has.

Decode reads every weight once per token, except lookup tables that are only gathered (the
per-layer token embeddings of Gemma 4); tied output embeddings are read in full by the output
projection. So bytes/token = GGUF tensor bytes − gathered-only tables, and
implied GB/s = tg tok/s × bytes/token.

    python benchmarks/decode_bandwidth.py --bench llama-bench.json --gguf MODEL.gguf [--measure-device]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

GATHERED_ONLY = ("per_layer_token_embd",)


def bytes_per_token(gguf_path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    gathered = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(GATHERED_ONLY))
    return {"tensor_bytes": total, "gathered_only_bytes": gathered, "read_per_token_bytes": total - gathered}


def device_bandwidth_gbs(size_bytes: int = 4 << 30, repeats: int = 10) -> dict:
    """Device-to-device copy bandwidth (read + write) and pinned host-to-device, with torch."""
    import torch

    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    d2d = 2 * size_bytes * repeats / (time.perf_counter() - start) / 1e9
    host = torch.empty(size_bytes // 2, dtype=torch.bfloat16, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        src.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = size_bytes * 3 / (time.perf_counter() - start) / 1e9
    return {"device_copy_gbs": round(d2d, 1), "host_to_device_gbs": round(h2d, 1), "gpu": torch.cuda.get_device_name()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, action="append", default=[], help="llama-bench -o json output")
    parser.add_argument("--gguf", type=Path, action="append", default=[], help="the GGUF of each --bench, in order")
    parser.add_argument("--measure-device", action="store_true")
    args = parser.parse_args()
    out = {"models": []}
    for bench_path, gguf_path in zip(args.bench, args.gguf):
        rows = json.loads(bench_path.read_text())
        sizes = bytes_per_token(gguf_path)
        entry = {"gguf": gguf_path.name, **sizes, "runs": []}
        for row in rows:
            kind = "pp" if row.get("n_prompt") else "tg"
            run = {"test": f"{kind}{row.get('n_prompt') or row.get('n_gen')}", "tok_s": round(row["avg_ts"], 1),
                   "stddev": round(row.get("stddev_ts", 0.0), 1), "n_gpu_layers": row.get("n_gpu_layers"),
                   "backend": row.get("backends") or row.get("backend")}
            if kind == "tg":
                run["implied_gbs"] = round(row["avg_ts"] * sizes["read_per_token_bytes"] / 1e9, 1)
            entry["runs"].append(run)
        out["models"].append(entry)
    if args.measure_device:
        out["device"] = device_bandwidth_gbs()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
