"""The engine's map under a cap with its host layers' operations priced lower: what fusing them
(benchmarks/engine_host_layer_compile.py) would buy, as plan/engine_map.py's schedule plays it out.

    python benchmarks/engine_host_whatif.py ARTIFACT [--plan PLAN.json] [--cap 3136M] [--context 4096]
                                             [--scales 1 0.6 0.4 0.2] [--unfused 3.7 1]

PLAN.json: a plan made on the machine of interest (its `hardware` section is the profile used);
by default the verified 3,136 MiB plan of an H100 machine in results/. Each scale multiplies what
a host layer's eager operations cost (HardwareProfile.engine_host_layer_s); its kernels' reads
stay as measured. Each --unfused factor replaces engine_map.ENGINE_UNFUSED_FACTOR (what a GPU
layer of a step captured without compile fusion costs against a fused one; 1: the pieces fused
too). Prints the map's counts and predicted decode rate for each pair.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--plan", type=Path, default=HERE / "results" / "plan-verify-e4b-head-int4-3136M-h100-2-gpu.json")
    parser.add_argument("--cap", default="3136M")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.6, 0.4, 0.2])
    parser.add_argument("--unfused", type=float, nargs="+", default=None)
    args = parser.parse_args()
    from gemmactl.plan import engine_map
    from gemmactl.plan.engine_map import plan_engine
    from gemmactl.plan.profile import HardwareProfile
    from gemmactl.sizes import parse_size

    hardware = json.loads(args.plan.read_text())["hardware"]
    profile = HardwareProfile(**{k: v for k, v in hardware.items() if k in HardwareProfile.__dataclass_fields__})
    priced, unfused = HardwareProfile.engine_host_layer_s, engine_map.ENGINE_UNFUSED_FACTOR
    for factor in args.unfused or [unfused]:
        engine_map.ENGINE_UNFUSED_FACTOR = factor
        for scale in args.scales:
            HardwareProfile.engine_host_layer_s = lambda self, weight_bytes, s=scale: priced(self, weight_bytes) * s
            chosen = plan_engine(args.artifact, profile, parse_size(args.cap), args.context)
            kinds = list(chosen.layers)
            counts = {kind: kinds.count(kind) for kind in ("resident", "streamed", "host")}
            print(f"unfused x{factor}, operations x{scale}: {counts}, {chosen.decode_tok_s:.1f} tok/s predicted "
                  f"(a 60 MB layer's operations {profile.engine_host_layer_s(60e6) * 1e3:.2f} ms, "
                  f"its kernels {60e6 / profile.host_kernel_bandwidth * 1e3:.2f} ms)")
    HardwareProfile.engine_host_layer_s, engine_map.ENGINE_UNFUSED_FACTOR = priced, unfused


if __name__ == "__main__":
    main()
