"""A model split across a head and its RPC workers (llama.cpp `--rpc`), from the GGUF's headers.

llama.cpp's order fixes the shape of every split: the head's CPU holds the first layers, then the
offloaded layers go to the devices in their order, workers first (in `--rpc` order) and the head's
GPU last, in the proportions of `--tensor-split`; the output matrix follows the last device. So a
split is a count of layers per device, given as `-ngl` (everything past the head's CPU share) and
`-ts` (the shares of the offloaded layers).

Shares follow capacity: every device gets layers in proportion to the memory it lends (a worker:
its `=SIZE` or the free memory it reports; the head: its GPU budget, else its RAM), never more
than fits it. Each layer's cost is its weights and its KV cache at the context.

Per token, a worker costs its layers' bytes at its memory bandwidth (assumed to be the head
profile's CPU bandwidth: a worker with a GPU is faster) plus the network: LINK_ROUND_TRIPS round
trips and the bytes llama.cpp sends for a decode step (LINK_BYTES_PER_WORKER and
LINK_BYTES_PER_LAYER: the graph it describes and the activations), at LINK_BANDWIDTH with
LINK_LATENCY_S per round trip — a gigabit LAN, assumed. The bytes are fitted to the loopback
measurement in docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gemmactl.errors import BudgetTooSmallError
from gemmactl.sizes import format_size

# A head without a GPU keeps the output matrix (tied: the token embedding) itself: on the last
# worker, every token's logits (vocabulary × 4 bytes, 1 MiB for Gemma) would cross the network.
OUTPUT_ON_HEAD = r"^(output|token_embd)\.weight$=CPU"
LINK_BANDWIDTH = 125e6  # bytes/s: 1 Gbit/s Ethernet
LINK_LATENCY_S = 200e-6  # one round trip on a LAN
LINK_ROUND_TRIPS = 3  # per worker per decoded token: inputs in, the graph computed, outputs back
# Bytes per decoded token, fitted to the loopback measurement (docs/benchmarks.md, Gemma 3 270M:
# 25.1 KB with one worker holding 9 layers, 42.5 KB with two holding 6 each): each worker gets
# the graph of its part and the activations, about 13 KiB, and 1.3 KiB more per layer it holds.
LINK_BYTES_PER_WORKER = 13 << 10
LINK_BYTES_PER_LAYER = 1300


@dataclass
class Device:
    name: str  # "head-cpu", "rpc0", …, "head-gpu"
    address: str  # the worker's HOST:PORT, or "this machine"
    capacity: int
    layers: list[int] = field(default_factory=list)
    bytes: int = 0

    def to_dict(self) -> dict:
        return {"name": self.name, "address": self.address, "capacity_bytes": self.capacity,
                "layers": [self.layers[0], self.layers[-1]] if self.layers else [], "count": len(self.layers),
                "bytes": self.bytes}


@dataclass
class RpcSplit:
    devices: list[Device]
    n_gpu_layers: int
    tensor_split: tuple[float, ...]
    decode_tok_s: float
    link_bytes_per_token: int
    reason: str

    @property
    def server_args(self) -> list[str]:
        workers = [d.address for d in self.devices if d.name.startswith("rpc")]
        args = ["--rpc", ",".join(workers), "-ngl", str(self.n_gpu_layers),
                "-ts", ",".join(f"{share:g}" for share in self.tensor_split)]
        if self.devices[0].name == "head-cpu":
            args += ["-ot", OUTPUT_ON_HEAD]
        return args

    def to_dict(self) -> dict:
        return {"devices": [d.to_dict() for d in self.devices], "n_gpu_layers": self.n_gpu_layers,
                "tensor_split": list(self.tensor_split), "server_args": self.server_args,
                "decode_tok_s": round(self.decode_tok_s, 2), "link_bytes_per_token": self.link_bytes_per_token,
                "assumed_link": {"bandwidth_bytes_s": LINK_BANDWIDTH, "latency_s": LINK_LATENCY_S,
                                 "round_trips_per_token": LINK_ROUND_TRIPS, "bytes_per_worker": LINK_BYTES_PER_WORKER,
                                 "bytes_per_layer": LINK_BYTES_PER_LAYER},
                "reason": self.reason}


def layer_costs(inventory, context: int, parallel: int = 1) -> list[int]:
    """Bytes each decoder layer needs where it runs: weights and its KV cache."""
    from gemmactl.plan.solver import kv_bytes, kv_cells

    return [sum(layer.bytes.values()) + kv_bytes(layer, kv_cells(layer, inventory.shape, context, parallel))
            for layer in inventory.layers]


def split_layers(inventory, workers, *, head_bytes: int, head_gpu: bool, profile, context: int,
                 parallel: int = 1) -> RpcSplit:
    """Layers per device for a head (head_bytes: its GPU budget when head_gpu, else its RAM) and
    workers (rpc.WorkerInfo or anything with .endpoint and .lends)."""
    costs = layer_costs(inventory, context, parallel)
    output = inventory.globals.get("output") or (inventory.globals.get("token_embd", 0) if inventory.output_tied else 0)
    remote = [Device(f"rpc{i}", w.endpoint.address, int(w.lends)) for i, w in enumerate(workers)]
    # The head's GPU keeps its CUDA context and runtime out of what layers may use.
    usable = max(int(head_bytes) - (profile.gpu_reserve_bytes if head_gpu else 0), 0)
    head = Device("head-gpu" if head_gpu else "head-cpu", "this machine", usable)
    # llama.cpp's order: head CPU first; offloaded layers to the workers, then the head's GPU.
    order = ([head] + remote) if not head_gpu else (remote + [head])
    total = sum(d.capacity for d in order)
    need = sum(costs) + output
    if total < need:
        raise BudgetTooSmallError(
            f"the head and its {len(remote)} workers lend {format_size(total)}, and this model needs "
            f"{format_size(need)} at context {context}",
            hint="Add a worker, give a worker more (HOST:PORT=SIZE), or plan a smaller --context.")
    n = len(costs)
    holder = head  # the output matrix: the head's GPU, or the head itself when it has none
    index = 0
    for position, device in enumerate(order):
        last = position == len(order) - 1
        share = round(n * device.capacity / total) if not last else n - index
        room = device.capacity - (output if device is holder else 0)
        while share > 0 and index < n and device.bytes + costs[index] <= room:
            device.layers.append(index)
            device.bytes += costs[index]
            index += 1
            share -= 1
    # What proportions left over (rounding, a full device): the first device with room takes it.
    for device in order:
        room = device.capacity - (output if device is holder else 0)
        while index < n and device.bytes + costs[index] <= room and (not device.layers or device.layers[-1] == index - 1):
            device.layers.append(index)
            device.bytes += costs[index]
            index += 1
    if index < n:
        raise BudgetTooSmallError(
            f"layers {index}–{n - 1} fit on no device in order (llama.cpp keeps each device's layers contiguous)",
            hint="Give the workers more (HOST:PORT=SIZE) or plan a smaller --context.")
    holder.bytes += output
    cpu_layers = len(head.layers) if not head_gpu else 0
    offloaded = [d for d in order if d.name != "head-cpu"]
    # -ts in layers: llama.cpp gives device j the offloaded layers whose offset falls in its share
    # of the cumulative split, and the output matrix (one more offset) to the last device.
    counts = [len(d.layers) for d in offloaded]
    if counts:
        counts[-1] += 1
    shares = tuple(float(c) for c in counts)
    seconds = 0.0
    link = 0
    for device in order:
        bandwidth = profile.gpu_bandwidth if device.name == "head-gpu" else profile.cpu_bandwidth
        latency = profile.gpu_layer_latency_s if device.name == "head-gpu" else profile.cpu_layer_latency_s
        seconds += device.bytes / bandwidth + latency * len(device.layers)
        if device.name.startswith("rpc") and device.layers:
            sent = LINK_BYTES_PER_WORKER + LINK_BYTES_PER_LAYER * len(device.layers)
            link += sent
            seconds += LINK_ROUND_TRIPS * LINK_LATENCY_S + sent / LINK_BANDWIDTH
    where = ", ".join(f"{d.name} {len(d.layers)}" for d in order)
    reason = (f"rpc split: layers {where}; {format_size(link)} over the network per token "
              f"(assumed {LINK_BANDWIDTH * 8 / 1e9:g} Gbit/s, {LINK_LATENCY_S * 1e3:g} ms round trips)")
    return RpcSplit(order, n - cpu_layers + 1, shares, 1.0 / seconds if seconds else 0.0, link, reason)
