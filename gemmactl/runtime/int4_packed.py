"""int4-stream weights kept packed inside a transformers model: dequantized per call, never held dense.

`build_packed_model` builds the model on the meta device like `int4_model.build_model`, then
gives every quantized linear layer a `PackedLinear` and every quantized embedding table a
`PackedEmbedding` that hold the artifact's parts as stored (int4 codes + fp16 scale/zero per group,
or int8 rows + fp16 scale). On the CPU those parts are zero-copy views of the mapped shards, so
loading reads almost nothing; on a GPU only the packed bytes are copied. Norms, scalars and MoE
expert stacks (3-D parameters, not linear layers) are decoded dense as before.

Each call dequantizes the weight with the same function, on the same device, into the same dtype
as the dense path, and then runs the same `F.linear` (or row gather): the outputs are bit for bit
the dense model's (tests/test_int4_packed.py). What it trades: every forward pass pays the
dequantization of the weights it touches, so decoding is slower than from dense weights, above
all on a CPU (docs/benchmarks.md has both).

Embedding tables that are only looked up (Gemma 4's per-layer embeddings, an untied token
embedding) stay in RAM, mapped, whatever the model's device: a step gathers its rows there and
sends the few decoded rows to the model's device. A table the output head shares is placed on the
model's device, since the head multiplies by all of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gemmactl.formats.int4.quant import dequantize_int4, dequantize_int8_rows
from gemmactl.formats.int4.reader import PackedTensor
from gemmactl.formats.int4.spec import HEAD_NAME

PACKED_SCHEMES = ("int4", "int8")


def dequantize_parts(scheme: str, parts: dict, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A record's stored parts → the dense [rows, cols] tensor the dense path would hold."""
    if scheme == "int4":
        return dequantize_int4(parts["qweight"], parts["scales"], parts["zeros"], cols, dtype)
    if scheme == "int8":
        return dequantize_int8_rows(parts["qweight"], parts["scales"], dtype)
    raise ValueError(f"scheme {scheme} is not packed")


class PackedLinear(torch.nn.Module):
    """y = x Wᵀ with W dequantized from the packed parts at every call (no bias: Gemma has none)."""

    def __init__(self, packed: PackedTensor, dtype: torch.dtype):
        super().__init__()
        record = packed.record
        if record.scheme not in PACKED_SCHEMES or len(record.shape) != 2:
            raise ValueError(f"{record.key} ({record.scheme}, {list(record.shape)}) is not a packed 2-D weight")
        self.name = record.name
        self.scheme = record.scheme
        self.out_features, self.in_features = record.shape
        self.compute_dtype = dtype
        self._part_names = tuple(packed.parts)
        for part, tensor in packed.parts.items():
            self.register_buffer(part, tensor, persistent=False)

    def dense_weight(self) -> torch.Tensor:
        parts = {name: getattr(self, name) for name in self._part_names}
        return dequantize_parts(self.scheme, parts, self.in_features, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class PackedEmbedding(torch.nn.Module):
    """A row lookup in a packed table: gather the rows' codes, decode only them, scale as the original.

    The parts are plain attributes, not buffers, so `model.to(device)` leaves the table where it
    was placed (in RAM for a lookup-only table); `embed_scale` copies the Gemma embeddings'
    multiplier (sqrt(hidden size)), applied in the compute dtype exactly as they apply it.
    """

    def __init__(self, packed: PackedTensor, dtype: torch.dtype, embed_scale: torch.Tensor | None = None):
        super().__init__()
        record = packed.record
        if len(record.shape) != 2:
            raise ValueError(f"{record.key} is not a 2-D embedding table")
        self.name = record.name
        self.scheme = record.scheme
        self.num_embeddings, self.embedding_dim = record.shape
        self.compute_dtype = dtype
        self.parts = dict(packed.parts)
        self.table_device = next(iter(self.parts.values())).device
        # A plain tensor, not the original's buffer: `model.to(device)` must not move it off the table.
        scale = None if embed_scale is None else torch.tensor(embed_scale.item(), dtype=embed_scale.dtype, device=self.table_device)
        object.__setattr__(self, "embed_scale", scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.to(self.table_device).reshape(-1)
        rows = {name: part.index_select(0, ids) for name, part in self.parts.items()}
        if self.scheme in PACKED_SCHEMES:
            values = dequantize_parts(self.scheme, rows, self.embedding_dim, self.compute_dtype)
        else:
            values = rows["data"].to(self.compute_dtype)
        values = values.view(*input_ids.shape, self.embedding_dim)
        if self.embed_scale is not None:
            values = values * self.embed_scale.to(values.dtype)
        return values.to(input_ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}, on={self.table_device}"


def _swap(model, path: str, module: torch.nn.Module) -> None:
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, child, module)


def _tied(model) -> bool:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def build_packed_model(artifact, dtype=None, device="cpu", tables_device="cpu"):
    """A transformers causal LM whose quantized weights stay packed (see the module docstring).

    dtype: compute dtype (default the config's); device: where the model computes;
    tables_device: where lookup-only embedding tables live (default RAM, mapped).
    """
    from gemmactl.runtime.int4_model import checked, empty_model

    model, dtype = empty_model(artifact, dtype)
    modules = dict(model.named_modules())
    tied = _tied(model)
    head = model.get_output_embeddings() if tied else None
    head_source = None
    if tied and head is not None and HEAD_NAME not in artifact.tensor_names():
        embeddings = model.get_input_embeddings()
        head_source = next((path for path, module in modules.items() if module is embeddings), None)
    dense: dict[str, torch.Tensor] = {}
    for name in artifact.tensor_names():
        path, _, attr = name.rpartition(".")
        module = modules.get(path)
        records = artifact.records_of(name)
        record = records[0]
        single = len(records) == 1 and record.expert is None and attr == "weight"
        if single and isinstance(module, torch.nn.Linear) and record.scheme in PACKED_SCHEMES:
            _swap(model, path, PackedLinear(artifact.packed(record, device), dtype))
        elif single and isinstance(module, torch.nn.Embedding) and record.scheme in PACKED_SCHEMES:
            packed = artifact.packed(record, device if path == head_source else tables_device)
            _swap(model, path, PackedEmbedding(packed, dtype, getattr(module, "embed_scale", None)))
            if path == head_source:  # the tied head multiplies by the same parts: one copy
                _swap(model, _module_path(modules, head), PackedLinear(packed, dtype))
        else:
            dense[name] = artifact.load_tensor(name, device, dtype)
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    del dense
    if str(device) != "cpu":
        model.to(device)  # buffers (rotary tables, ...); packed parts are placed already
    return checked(model, artifact, unexpected)


def _module_path(modules: dict, target) -> str:
    return next(path for path, module in modules.items() if module is target)


def packed_bytes(model) -> int:
    """Bytes the packed parts of a model hold (each shared part counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        parts = module.parts.values() if isinstance(module, PackedEmbedding) else (
            [getattr(module, name) for name in module._part_names] if isinstance(module, PackedLinear) else []
        )
        for tensor in parts:
            seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
