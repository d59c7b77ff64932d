"""The engine's products on the CPU in bfloat16: torch's own int4 and int8 CPU kernels.

A decode step on the CPU is bound by the bytes it reads. Dequantized once into dense bfloat16,
an int4 matrix reads four times its stored bytes and an int8 row matrix twice. torch ships CPU
kernels that read them as stored and fuse the dequantization into the product
(`aten._weight_int4pack_mm_for_cpu`, `aten._weight_int8pack_mm`, vectorized for AVX2 and
AVX-512, the ones torchao's CPU int4/int8 weight-only paths call): well-kept, nothing compiled
here. Measured on a 2-core AVX-512 host, one token (benchmarks/engine_cpu_kernels.py,
docs/benchmarks.md): Gemma 3 270M's 2,048×640 int4 gate_proj took 82 µs against 177 µs dense (and
2.6 ms to decode it first, what a missed MoE expert on the host used to cost), its 262,144×640
int8 head 14.7 ms against 23.7 ms dense. In a one-off trial, a product of our own over the stored
layout, fused by torch.compile's C++ backend, took 2.7 ms for a 1,408×2,816 int4 matrix against
the kernel's 0.14 ms: not a contender.

What it costs in numbers: the int4 kernel takes each group's scale and zero′ (zero + 8·scale) in
bfloat16 and the int8 kernel each row's scale in bfloat16, where the dense path rounds every
decoded weight to bfloat16 instead. Both are bfloat16-sized errors, a few hundredths of the int4
step itself; docs/benchmarks.md measures the KL divergence of both against float32.
float32 runs (the fidelity tests against transformers) stay dense, operation for operation the
reference's.

The int4 kernel's layout is its own (blocks of output rows interleaved along the columns), made
at load from the artifact's codes; it needs the rows in multiples of 16 and the columns in whole
groups. Other machines (ARM, no AVX2) keep dense weights: torch's kernels there are its scalar
reference loops.
"""

from __future__ import annotations

from gemmactl.runtime.engine.ops import in_row_blocks

CPU_GROUPS = (32, 64, 128, 256)
ROW_MULTIPLE = 16  # the int4 kernel's layout takes rows in multiples of this
# The kernels' time grows with the tokens (a 1,408×2,816 int4 matrix: 0.14 ms for 1 token, 3.8 ms
# for 64, 15.8 ms for 256, where decoding it takes 6.4 ms and the dense product of 256 tokens
# 1.3 ms): past this many tokens a product decodes the stored codes and multiplies densely.
KERNEL_TOKENS_MAX = 64
DECODE_BLOCK_VALUES = 1 << 22  # values a product past KERNEL_TOKENS_MAX decodes at once (8 MB in bfloat16)
CONVERT_ROWS = 128  # rows made into the kernel's layout at a time (a multiple of its tile of 64)
TRIM_EVERY = 32  # experts made in the kernel's layout between two release_freed_memory() calls


def cpu_kernels_kept(dtype, dense_forced: bool = False) -> bool:
    """Whether this machine's CPU runs int4/int8 weights as stored: bfloat16 compute, an x86 CPU
    with AVX2 or AVX-512, and dense weights not forced (kernels.KERNEL_ENV=dense, which the caller
    reads)."""
    import torch

    if dtype != torch.bfloat16 or dense_forced:
        return False
    return torch.backends.cpu.get_cpu_capability().startswith("AVX")


def release_freed_memory() -> None:
    """Hand the allocator's freed memory back to the system (glibc's malloc_trim; elsewhere nothing).

    Making an expert's layout frees tens of megabytes of temporaries at a time; glibc then raises
    its thresholds and keeps what was freed. On 26B-A4B with every expert made on the host, the
    process held 11.5 GB where its experts took 6.4 (the same with the layout made 128 rows at a
    time); trimming after every few experts held 6.7 GB, at 20 ms a trim."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            _LIBC = libc if libc is not None and hasattr(libc, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


def cpu_int4_fits(shape: tuple, group_size: int | None) -> bool:
    return group_size in CPU_GROUPS and shape[0] % ROW_MULTIPLE == 0


class _CpuLinear:
    """What the engine asks of a matrix (the interface of runtime/engine/kernels.Linear): y = x Wᵀ
    in the kernel for up to KERNEL_TOKENS_MAX tokens (_product), else a block of decoded rows at a
    time (_decode_rows) in a dense product."""

    kernel = "cpu"
    out_features = in_features = 0
    mapped = False  # its tensors are pages of a layout file (runtime/engine/expert_layouts.py)

    def __call__(self, x):
        import torch

        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if flat.shape[0] > KERNEL_TOKENS_MAX:
            y = in_row_blocks(flat, self.out_features, self.in_features, self._decode_rows, DECODE_BLOCK_VALUES)
        else:
            y = self._product(flat)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _product(self, flat):
        raise NotImplementedError

    def _decode_rows(self, rows):
        raise NotImplementedError

    def tensors(self) -> dict:
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class Int4CpuLinear(_CpuLinear):
    """int4 codes in the CPU kernel's layout, (scale, zero′) per group in bfloat16; the input's
    columns padded to whole groups with zeros (the stored codes there are finite, so they add 0).
    More than KERNEL_TOKENS_MAX tokens (a prefill chunk) decode the stored codes (views of the
    artifact's mapped shard, no copy held) a block of rows at a time into a dense product."""

    kernel = "int4-cpu"

    def __init__(self, packed, scales_and_zeros, group_size: int, out_features: int, in_features: int, columns: int,
                 stored: dict):
        self.packed, self.scales_and_zeros = packed, scales_and_zeros  # [out, columns/2] uint8, [G, out, 2]
        self.group_size, self.columns, self.stored = group_size, columns, stored  # stored: qweight, scales, zeros
        self.out_features, self.in_features = out_features, in_features

    def _product(self, flat):
        import torch
        import torch.nn.functional as F

        if self.columns != self.in_features:
            flat = F.pad(flat, (0, self.columns - self.in_features))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)

    def _decode_rows(self, rows):
        import torch

        qweight, scales, zeros = (self.stored[name][rows] for name in ("qweight", "scales", "zeros"))
        n, groups = scales.shape
        codes = torch.empty((n, qweight.shape[1], 2), dtype=torch.uint8)
        torch.bitwise_and(qweight, 0x0F, out=codes[..., 0])
        torch.bitwise_right_shift(qweight, 4, out=codes[..., 1])
        w = torch.addcmul(zeros.to(torch.bfloat16).unsqueeze(-1), codes.view(n, groups, -1).to(torch.bfloat16),
                          scales.to(torch.bfloat16).unsqueeze(-1))
        return w.view(n, -1)[:, :self.in_features]

    def tensors(self) -> dict:
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}

    def with_tensors(self, tensors: dict) -> "Int4CpuLinear":
        return Int4CpuLinear(tensors["packed"], tensors["scales_and_zeros"], self.group_size, self.out_features,
                             self.in_features, self.columns, self.stored)


class Int8CpuLinear(_CpuLinear):
    """Row-wise int8 as stored (the artifact's mapped codes, not copied), each row's scale in
    bfloat16, through torch's CPU int8 kernel; more than KERNEL_TOKENS_MAX tokens decode a block
    of rows at a time into a dense product."""

    kernel = "int8-cpu"

    def __init__(self, qweight, scales):
        self.qweight, self.scales = qweight, scales  # int8 [out, in], bfloat16 [out]
        self.out_features, self.in_features = qweight.shape

    def _product(self, flat):
        import torch

        return torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)

    def _decode_rows(self, rows):
        import torch

        return (self.qweight[rows].float() * self.scales[rows].float().unsqueeze(1)).to(torch.bfloat16)

    def tensors(self) -> dict:
        return {"qweight": self.qweight, "scales": self.scales}

    def with_tensors(self, tensors: dict) -> "Int8CpuLinear":
        return Int8CpuLinear(tensors["qweight"], tensors["scales"])


def cpu_int4_layout(qweight, scales, zeros):
    """int4-stream parts (codes nibble-packed low first [out, Cp/2], fp16 scales and zeros [out, G])
    → (codes in the CPU kernel's layout [out, Cp/2] uint8, scales_and_zeros [G, out, 2] bfloat16),
    w = (q − 8)·scale + zero′ with zero′ = zero + 8·scale."""
    import torch

    from gemmactl.formats.int4.quant import unpack_nibbles

    # The layout tiles the rows in blocks of 64, each made alone: converted a block at a time, the
    # temporaries (codes as int32, 8 bytes a stored byte) stay small.
    rows = qweight.shape[0]
    packed = torch.empty_like(qweight)
    for start in range(0, rows, CONVERT_ROWS):
        codes = unpack_nibbles(qweight[start:start + CONVERT_ROWS]).to(torch.int32)
        packed[start:start + CONVERT_ROWS] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale = scales.float()
    zero = zeros.float() + 8 * scale
    return packed, torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)


def cpu_linear(artifact, record):
    """The record as a CPU kernel's Linear, or None where the kernels do not take it."""
    import torch

    if record.scheme == "int4" and cpu_int4_fits(tuple(record.shape), record.group_size):
        parts = artifact.packed(record, "cpu").parts
        packed, sz = cpu_int4_layout(parts["qweight"], parts["scales"], parts["zeros"])
        return Int4CpuLinear(packed, sz, record.group_size, *record.shape, columns=sz.shape[0] * record.group_size,
                             stored=parts)
    if record.scheme == "int8":
        parts = artifact.packed(record, "cpu").parts
        return Int8CpuLinear(parts["qweight"].contiguous(), parts["scales"].to(torch.bfloat16))
    return None


def cpu_linear_bytes(scheme: str, shape: tuple, group_size: int | None) -> int | None:
    """Bytes cpu_linear holds for a stored matrix, or None where it keeps it dense."""
    out_features, in_features = shape
    if scheme == "int4" and cpu_int4_fits(shape, group_size):
        groups = -(-in_features // group_size)
        return out_features * groups * group_size // 2 + groups * out_features * 2 * 2
    if scheme == "int8":
        return out_features * in_features + out_features * 2
    return None
