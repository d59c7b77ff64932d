"""The `int4` backend's decode speed on CPU in float32 vs bfloat16 compute (why float32 is its default).

Both load the same int4-stream artifact into a transformers model and decode through gemmactl's
streaming core (greedy, raw prompt, the same token count), interleaved A B A B.

    python benchmarks/int4_decode_dtype.py --artifact DIR [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate
    from gemmactl.runtime.int4_backend import Int4Backend

    backends = {name: Int4Backend(args.artifact, dtype=dtype) for name, dtype in
                (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    request = GenerationRequest(prompt="The history of the city of Paris begins", max_tokens=args.tokens,
                                temperature=0, raw=True)
    rates: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name, backend in backends.items():
            stats = [e for e in stream_generate(backend, request) if isinstance(e, GenerationStats)][0]
            rates[name].append(stats.decode_tok_s)
    report = {"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
              "decode_tok_s_median": {name: statistics.median(v) for name, v in rates.items()}, "runs": rates}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
