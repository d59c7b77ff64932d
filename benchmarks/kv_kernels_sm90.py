"""The KV cache's Triton kernels compiled for an sm_90 GPU (an H100 or H200) without one: registers
a thread, bytes of stack (spilled registers) and shared memory of each, at the engine's default
tiles (the read's for long and short caches), for head dims 256 and 512 and each turbo mode.

    python benchmarks/kv_kernels_sm90.py [--modes tq4 tq3] [--dims 256 512] [--write-tile 32,64,4,3] [--out FILE]

Triton's own front end, passes and ptxas compile each kernel (as tests/test_engine_kv.py's compile
test does); cuobjdump, which Triton ships beside ptxas, reads the resources. Every kernel of
kv_turn_kernel.py and kv_attention_kernel.py whose name has no leading underscore is compiled, so
a form kept beside another for a measurement is compiled too. Prints one JSON object a kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Each argument's type by its name, across the kernels (constexprs are given apart).
TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*fp32", "vc_ptr": "*fp32",
         "sign_ptr": "*fp32", "h_ptr": "*fp16", "ke_ptr": "*fp32", "ve_ptr": "*fp32", "kcode_ptr": "*u8",
         "vcode_ptr": "*u8", "kscale_ptr": "*fp16", "vscale_ptr": "*fp16", "slot_ptr": "*i64", "at_ptr": "*i64",
         "out_ptr": "*fp32", "rows": "i32", "heads": "i32", "kv_heads": "i32", "slots": "i32", "inv_root": "fp32",
         "kw_ptr": "*i32", "ks_ptr": "*fp16", "kl_ptr": "*fp32", "kpos_ptr": "*i64", "pos_ptr": "*i64",
         "s_ptr": "*fp32", "S": "i32", "groups": "i32", "row_words": "i32", "query_scale": "fp32", "window": "i32",
         "w_ptr": "*fp32", "vw_ptr": "*i32", "vs_ptr": "*fp16", "vl_ptr": "*fp32", "per_share": "i32",
         "shares": "i32"}
OWN_TYPES = {"key_scores": {"q_ptr": "*fp32"}}  # where a kernel's argument of a shared name differs


def resources(kernel, constexprs: dict, warps: int, stages: int = 3) -> dict:
    """Registers, stack bytes and shared bytes of kernel compiled for sm_90 with constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    given = {name: value for name, value in constexprs.items() if name in names}
    types = {**TYPES, **OWN_TYPES.get(kernel.__name__, {})}
    signature = {name: "constexpr" if name in given else types[name] for name in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in given.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as work:
        cubin = Path(work) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)), "shared_bytes": compiled.metadata.shared}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["tq4", "tq3"])
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--write-tile", help="the write's tile, CHUNK,PART,WARPS[,STAGES] (default: the engine's)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said, so it does not warn
    import triton.language as tl

    from gemmactl.runtime.engine import kv_attention, kv_attention_kernel, kv_turn, kv_turn_kernel
    from gemmactl.runtime.engine.kv_modes import TURBO_BITS, code_planes

    rows = []
    write_tile = kv_turn.DEFAULT_TILE
    if args.write_tile:
        write_tile = kv_turn.Tile(*(int(v) for v in args.write_tile.split(",")))
    for mode in args.modes:
        k_bits, v_bits = TURBO_BITS[mode]
        (k0, k1), (v0, v1) = code_planes(k_bits), code_planes(v_bits)
        for dim in args.dims:
            write = dict(D=dim, ROWS=kv_turn.ROWS, CHUNK=min(write_tile.chunk, dim), PART=min(write_tile.part, dim),
                         KW0=k0, KW1=k1, VW0=v0, VW1=v1, K_EDGES=(1 << k_bits) - 1, V_EDGES=(1 << v_bits) - 1,
                         STAGES=write_tile.stages)
            kernels = [(kv_turn_kernel, name, write, write_tile.warps, "write")
                       for name in dir(kv_turn_kernel) if not name.startswith("_")]
            for label, tile in (("long", kv_attention.DEFAULT_READ_TILE), ("short", kv_attention.SHORT_READ_TILE)):
                read = dict(D=dim, GROUPS=16, DOT=tl.float16)
                kernels += [(kv_attention_kernel, "key_scores",
                             dict(read, W0=k0, W1=k1, BLOCK=tile.score_block, CHUNK=min(tile.score_chunk, dim)),
                             tile.warps, label),
                            (kv_attention_kernel, "weighted_values",
                             dict(read, W0=v0, W1=v1, BLOCK=tile.value_block, CHUNK=min(tile.value_chunk, dim)),
                             tile.warps, label)]
            for module, name, constexprs, warps, label in kernels:
                kernel = getattr(module, name)
                if not hasattr(kernel, "arg_names"):  # not a Triton kernel (the module's imports)
                    continue
                row = {"kernel": name, "tile": label, "mode": mode, "dim": dim, "warps": warps,
                       **resources(kernel, constexprs, warps, constexprs.get("STAGES", 3))}
                rows.append(row)
                print(json.dumps(row))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["benchmarks/kv_kernels_sm90.py", *sys.argv[1:]]),
                                        "kernels": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
