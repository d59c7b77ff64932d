"""A plan as llama.cpp arguments: -ngl, the expert overrides (-ot / --n-cpu-moe), context and KV settings."""

from __future__ import annotations

from gemmactl.plan.solver import UBATCH, Plan, gpu_layer_range


def expert_override(layers: tuple[int, ...] | list[int]) -> str:
    """The -ot value that keeps these layers' expert stacks in RAM, e.g. blk\\.(3|4|5)\\.ffn_.*_exps=CPU."""
    return rf"blk\.({'|'.join(str(i) for i in sorted(layers))})\.ffn_.*_exps=CPU"


def n_cpu_moe(plan: Plan) -> int:
    """The --n-cpu-moe equivalent: experts of the first N layers in RAM (CPU layers come first, then the chosen GPU ones)."""
    if not plan.placement.cpu_expert_layers:
        return 0
    start = gpu_layer_range(plan.inventory.shape.n_layers, plan.placement.n_gpu_layers).start
    return start + len(plan.placement.cpu_expert_layers)


def tensor_overrides(plan: Plan) -> tuple[str, ...]:
    layers = plan.placement.cpu_expert_layers
    return (expert_override(layers),) if layers else ()


def llama_cpp_args(plan: Plan) -> dict:
    """The llama.cpp options that realise the plan, as a mapping and as one argv list."""
    args: dict = {
        "-ngl": plan.placement.n_gpu_layers,
        "-ot": list(tensor_overrides(plan)),
        "--n-cpu-moe": n_cpu_moe(plan),
        "-c": plan.context * plan.parallel,
        "-np": plan.parallel,
        "-ub": UBATCH,
        "-ctk": plan.inventory.kv_type,
        "-ctv": plan.inventory.kv_type,
        "--swa-full": False,
        "--fit": "off",
    }
    argv = ["-ngl", str(args["-ngl"])]
    for value in args["-ot"]:
        argv += ["-ot", value]
    kv = plan.inventory.kv_type
    argv += ["-c", str(args["-c"]), "-np", str(args["-np"]), "-ub", str(UBATCH), "-ctk", kv, "-ctv", kv]
    if kv != "f16":  # llama.cpp keeps a quantized V only with flash attention
        args["-fa"] = "on"
        argv += ["-fa", "on"]
    argv += ["--fit", "off"]
    args["argv"] = argv
    return args


def torch_device_map(plan: Plan, gpu: str = "cuda:0") -> dict[str, str]:
    """Module → device for a torch runtime (transformers module names of a Gemma causal LM)."""
    devices = {"model.embed_tokens": "cpu"}
    shape = plan.inventory.shape
    if shape.per_layer_hidden:
        devices.update({"model.embed_tokens_per_layer": "cpu", "model.per_layer_model_projection": "cpu",
                        "model.per_layer_projection_norm": "cpu"})
    for layer in plan.layers:
        device = gpu if layer.device == "gpu" else "cpu"
        devices[f"model.layers.{layer.index}"] = device
        if layer.experts_device is not None and layer.experts_device != layer.device:
            devices[f"model.layers.{layer.index}.experts"] = gpu if layer.experts_device == "gpu" else "cpu"
    head = gpu if plan.output_on_gpu else "cpu"
    devices["model.norm"] = head
    devices["lm_head"] = head
    return devices
