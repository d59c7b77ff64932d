"""The `int4` backend's decode speed in float32 vs bfloat16 compute (why it computes in the config's bfloat16).

Both load the same int4-stream artifact into a transformers model and decode through gemmactl's
streaming core (greedy, raw prompt, the same token count), interleaved A B A B.

    python benchmarks/int4_decode_dtype.py --artifact DIR [--tokens 32] [--repeats 3] [--out FILE]

DIR is an int4-stream artifact (`gemmactl quantize CKPT --int4-stream --out DIR`). The JSON report
goes to stdout and, with --out, to FILE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    args = parser.parse_args()

    from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate
    from gemmactl.runtime.int4_backend import Int4Backend

    backends = {name: Int4Backend(args.artifact, dtype=dtype) for name, dtype in
                (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    # Greedy, with the filters spelled out (GenerationRequest's defaults when this was written).
    request = GenerationRequest(prompt="The history of the city of Paris begins", max_tokens=args.tokens,
                                temperature=0, top_k=40, top_p=0.95, min_p=0.0, repeat_penalty=1.0, raw=True)
    rates: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name, backend in backends.items():
            stats = [e for e in stream_generate(backend, request) if isinstance(e, GenerationStats)][0]
            rates[name].append(stats.decode_tok_s)
    report = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
              "decode_tok_s_median": {name: statistics.median(v) for name, v in rates.items()}, "runs": rates}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
