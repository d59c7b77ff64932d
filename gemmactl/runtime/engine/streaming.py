"""Streaming layers through the device: double-buffered staging areas fed from pinned host memory.

On a CPU "device" the same code runs with plain copies, which is how the tests check that every
placement decodes the same tokens.
"""

from __future__ import annotations

import torch

ALIGN = 512  # bytes: every tensor of a staged layer starts at a multiple of this


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class StagedLayer:
    """One streamed layer: its linears' tensors packed into one host buffer, and where each lies."""

    def __init__(self, index: int, linears: dict, pin: bool):
        self.index = index
        self.slots: list = [None, None]  # the layer's linears as views into staging area 0 and 1
        self.layout: dict = {}  # (linear name, tensor name) → (offset, dtype, shape)
        offset = 0
        for name, linear in linears.items():
            for key, t in linear.tensors().items():
                self.layout[(name, key)] = (offset, t.dtype, tuple(t.shape))
                offset = _aligned(offset + t.numel() * t.element_size())
        self.nbytes = offset
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        for (name, key), (start, _, _) in self.layout.items():
            raw = _as_bytes(linears[name].tensors()[key].cpu())
            host[start:start + raw.numel()].copy_(raw)
        self.host = host
        # Each linear's kind and shapes without its memory (meta tensors): the device copies go.
        self.kinds = {name: linear.with_tensors({key: t.to("meta") for key, t in linear.tensors().items()})
                      for name, linear in linears.items()}

    def bind(self, slot: int, area: torch.Tensor) -> None:
        """Build this layer's linears as views into a staging area."""
        views: dict = {}
        for (name, key), (start, dtype, shape) in self.layout.items():
            count = 1
            for d in shape:
                count *= d
            size = count * torch.empty((), dtype=dtype).element_size()
            views.setdefault(name, {})[key] = area[start:start + size].view(dtype).view(shape)
        self.slots[slot] = {name: self.kinds[name].with_tensors(tensors) for name, tensors in views.items()}


class LayerStreamer:
    """Double-buffered staging of streamed layers on the device, in layer order.

    Per step: `begin()` starts copying the first streamed layer; `fetch(i)` waits for layer i's
    copy, starts the next one into the other area, and returns the area layer i is in; `release(i)`
    marks its area free once its compute is queued.

    Every wait is on work of the same step: `begin()` orders the copy stream after everything the
    compute stream has queued (the previous step included), and a copy waits for its area's
    release only once that area was released in this step. So the step can be captured in a CUDA
    graph, which cannot wait on events recorded outside its capture.
    """

    def __init__(self, staged: list[StagedLayer], device: torch.device, areas: list | None = None):
        """areas: two staging areas to share with another streamer (the model's decode and
        prefill streamers share theirs; the prefill's also stages the host layers); each must
        hold the largest of these layers. By default, two of that size are made."""
        self.staged = {layer.index: layer for layer in staged}
        self.order = [layer.index for layer in staged]
        self.device = device
        self.cuda = device.type == "cuda"
        size = max((layer.nbytes for layer in staged), default=0)
        self.areas = areas or [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        if self.areas[0].numel() < size:
            raise ValueError(f"a staging area of {self.areas[0].numel()} bytes cannot hold a layer of {size}")
        for position, layer in enumerate(staged):
            for slot in range(2):
                layer.bind(slot, self.areas[slot])
        self.slot_of = {index: position % 2 for position, index in enumerate(self.order)}
        self.next_of = {index: (self.order[p + 1] if p + 1 < len(self.order) else None)
                        for p, index in enumerate(self.order)}
        self.bytes_per_step = sum(layer.nbytes for layer in staged)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            self.free = [torch.cuda.Event(), torch.cuda.Event()]
        self.released: set[int] = set()  # areas released in this step

    @property
    def staging_bytes(self) -> int:
        return sum(area.numel() for area in self.areas)

    def _copy(self, index: int) -> None:
        layer, slot = self.staged[index], self.slot_of[index]
        if not self.cuda:
            self.areas[slot][:layer.nbytes].copy_(layer.host)
            return
        with torch.cuda.stream(self.copy_stream):
            if slot in self.released:
                self.copy_stream.wait_event(self.free[slot])
            self.areas[slot][:layer.nbytes].copy_(layer.host, non_blocking=True)
            self.copied[slot].record(self.copy_stream)

    def begin(self) -> None:
        self.released = set()
        if self.order:
            if self.cuda:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            self._copy(self.order[0])

    def fetch(self, index: int) -> int:
        """Wait for layer `index` in its staging area, start the next copy; returns the area (0 or 1)."""
        slot = self.slot_of[index]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        following = self.next_of[index]
        if following is not None:
            self._copy(following)
        return slot

    def release(self, index: int) -> None:
        if self.cuda:
            slot = self.slot_of[index]
            self.free[slot].record(torch.cuda.current_stream(self.device))
            self.released.add(slot)
