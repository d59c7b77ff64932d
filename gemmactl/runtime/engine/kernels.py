"""The engine's matrix products over int4-stream weights: which kernel runs each weight, and its layout.

On CUDA, dense int4 weights run in torch's built-in int4 weight-only matmul
(`aten._weight_int4pack_mm`, the "tinygemm" kernel that gpt-fast and torchao's int4 weight-only
path use): a well-kept kernel that ships with torch, needs nothing compiled here, and fuses the
dequantization into the product. Its layout is its own, so the codes are repacked at the first
load and the result kept beside the artifact (`engine-cache/`). MoE experts stay as the artifact
stores them (`Int4GroupsLinear`): one token runs the Triton GEMV of runtime/engine/int4_gemv.py,
which reads codes, scales and zeros in place, so a layer's chosen experts run in one grouped
launch wherever each of them lies, in a device slot or in pinned host memory. Measured on the
H200 (benchmarks/int4_gemv_sweep.py, docs/benchmarks.md), tinygemm was faster on every dense
matrix shape of E2B and 26B-A4B (3.5–10.5 µs against 5.7–11.2 for the best Triton tile), and the
grouped kernel faster for a layer's 8 experts (87 µs against 117 for tinygemm one by one).
`GEMMACTL_ENGINE_INT4=tinygemm` or `groups` puts every int4 matrix in one kernel (measurements).
Several tokens (a prefill chunk, a verify step) decode an `Int4GroupsLinear` a block of rows at a
time into cuBLAS. int8 rows (the head, and v_proj and down_proj under `--sensitive int8`) stay
int8 on the device (`Int8Linear`): one token, or a verify step's few, runs the Triton GEMV of
runtime/engine/int8_gemv.py once per token (why not torch's own int8 kernels is said there); more
tokens dequantize a block of rows at a time into cuBLAS. `GEMMACTL_ENGINE_INT8=dense` keeps bfloat16
copies in cuBLAS instead (twice the bytes; for measurements and machines without Triton). On an
x86 CPU in bfloat16, int4 and int8 weights run in torch's CPU kernels as stored
(runtime/engine/cpu_kernels.py says why and what they cost); in float32 (the fidelity tests), on
other CPUs and under `GEMMACTL_ENGINE_KERNEL=dense`, every weight is dequantized once into a dense
matrix in the compute dtype and multiplied by `F.linear`: its numbers are exactly the dense
reference's.

On CUDA, matrices that read the same input are joined into one (`join_linears`: q with k and v
where they share a kernel, gate with up; `GEMMACTL_ENGINE_JOIN`): the same bytes, one launch and one
pass over the input instead of two or three, 1.05× the decode rate of E2B measured side by side.

int4-stream decodes w = q·scale + zero (q in 0..15, per group of g columns); tinygemm decodes
w = (q − 8)·scale + zero′, so zero′ = zero + 8·scale, kept with the scale in bfloat16.
"""

from __future__ import annotations

import os

KERNEL_ENV = "GEMMACTL_ENGINE_KERNEL"  # auto | dense: force dense weights (for measurements)
INT8_ENV = "GEMMACTL_ENGINE_INT8"  # rows (default) | dense: int8 rows kept as int8, or as bfloat16 copies
JOIN_ENV = "GEMMACTL_ENGINE_JOIN"  # auto (on CUDA) | on | off: q+k(+v), gate+up as one product
INT4_ENV = "GEMMACTL_ENGINE_INT4"  # auto (experts as stored, the rest tinygemm) | groups (all as stored) | tinygemm (all)
INT8_BLOCK_VALUES = 1 << 22  # values a block path (several tokens) dequantizes at once (about 24 MB of temporaries)
INNER_K_TILES = 8
TINYGEMM_GROUPS = (32, 64, 128, 256)


class Linear:
    """y = x Wᵀ for x [T, in] → [T, out], by whichever kernel holds W."""

    kernel = "dense"

    def __init__(self, weight):
        self.weight = weight  # [out, in]
        self.out_features, self.in_features = weight.shape

    def __call__(self, x):
        import torch
        import torch.nn.functional as F

        flat = x.reshape(-1, x.shape[-1])
        if few_rows(flat):
            # cuBLAS picks its kernel (and so a row's sums) by the number of rows: a verify step's
            # few rows each take the product alone, as a one-token step does
            rows = [F.linear(flat[i:i + 1], self.weight) for i in range(flat.shape[0])]
            return torch.cat(rows).reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight)

    def tensors(self) -> dict:
        """The tensors that hold the weight, by name (what streaming copies)."""
        return {"weight": self.weight}

    def with_tensors(self, tensors: dict) -> "Linear":
        """The same weight held in other tensors of the same shapes (a staging copy)."""
        return Linear(tensors["weight"])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class Int4Linear(Linear):
    """tinygemm: int4 codes packed for the kernel, (scale, zero′) per group in bfloat16."""

    kernel = "int4-tinygemm"

    def __init__(self, packed, scales_and_zeros, group_size: int, out_features: int, in_features: int,
                 columns: int | None = None):
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros  # [columns/g, out, 2]
        self.group_size = group_size
        self.out_features, self.in_features = out_features, in_features
        self.columns = columns or in_features  # in_features padded with zero weights (tinygemm_columns)

    def __call__(self, x):
        import torch
        import torch.nn.functional as F

        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.columns != self.in_features:  # the padded columns' weights are zero: any finite input does
            flat = F.pad(flat, (0, self.columns - self.in_features))
        y = torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        return y.reshape(*shape[:-1], self.out_features)

    def tensors(self) -> dict:
        return {"packed": self.packed, "scales_and_zeros": self.scales_and_zeros}

    def with_tensors(self, tensors: dict) -> "Int4Linear":
        return Int4Linear(tensors["packed"], tensors["scales_and_zeros"], self.group_size, self.out_features,
                          self.in_features, self.columns)


class Int4GroupsLinear(Linear):
    """int4 as the artifact stores it: codes nibble-packed [out, Cp/2] uint8, fp16 scales and zeros
    [out, G]. One token runs the Triton GEMV of runtime/engine/int4_gemv.py; several tokens decode
    a block of rows at a time into cuBLAS."""

    kernel = "int4-groups"

    def __init__(self, qweight, scales, zeros, in_features: int):
        self.qweight, self.scales, self.zeros = qweight, scales, zeros
        self.out_features, self.in_features = qweight.shape[0], in_features
        self.group_size = qweight.shape[1] * 2 // scales.shape[1]

    def __call__(self, x):
        from gemmactl.runtime.engine.int4_gemv import int4_gemv

        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, in]
        if flat.shape[0] == 1 and flat.is_cuda:
            y = int4_gemv(flat.reshape(-1), self.qweight, self.scales, self.zeros, self.in_features)
        else:
            y = self._blocks(flat)
        return y.reshape(*shape[:-1], self.out_features)

    def _blocks(self, flat):
        from gemmactl.runtime.engine.int4_gemv import dequantize

        return _in_row_blocks(flat, self, lambda rows: dequantize(self.qweight[rows], self.scales[rows],
                                                                  self.zeros[rows], self.in_features, flat.dtype))

    def tensors(self) -> dict:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}

    def with_tensors(self, tensors: dict) -> "Int4GroupsLinear":
        return Int4GroupsLinear(tensors["qweight"], tensors["scales"], tensors["zeros"], self.in_features)


class Int8Linear(Linear):
    """Row-wise symmetric int8: w = q · scale, q int8 [out, in] and scale [out] as stored (float16)."""

    kernel = "int8-rows"

    def __init__(self, qweight, scales):
        self.qweight, self.scales = qweight, scales
        self.out_features, self.in_features = qweight.shape

    def __call__(self, x):
        from gemmactl.runtime.engine.int8_gemv import FEW_TOKENS_MAX, int8_rows_gemv

        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, in]
        if flat.shape[0] <= FEW_TOKENS_MAX and flat.is_cuda:
            # one token, or a verify step's few: the GEMV per token, each row as it would be alone
            y = int8_rows_gemv(flat, self.qweight, self.scales)  # [T, out]
        else:
            y = self._blocks(flat)
        return y.reshape(*shape[:-1], self.out_features)

    def _blocks(self, flat):
        return _in_row_blocks(flat, self, lambda rows: (self.qweight[rows].float()
                                                        * self.scales[rows].float().unsqueeze(1)).to(flat.dtype))

    def tensors(self) -> dict:
        return {"qweight": self.qweight, "scales": self.scales}

    def with_tensors(self, tensors: dict) -> "Int8Linear":
        return Int8Linear(tensors["qweight"], tensors["scales"])


def few_rows(flat) -> bool:
    """Whether a product over flat [T, in] is a verify step's few rows on CUDA (2 to FEW_TOKENS_MAX),
    which must each get the result a one-token step gets."""
    from gemmactl.runtime.engine.int8_gemv import FEW_TOKENS_MAX

    return flat.is_cuda and 1 < flat.shape[0] <= FEW_TOKENS_MAX


def join_linears(parts: list) -> Linear | None:
    """One matrix whose outputs are the parts' outputs side by side (q and k, gate and up: the same
    input), so one kernel call replaces several; None where they do not share a kernel and its
    settings. Every part's rows are kept as they are: tinygemm's layout tiles the output rows in
    blocks of 8 (`_convert_weight_to_int4pack` gives [out/8, ...]) and every part's rows are a
    multiple of 8 (_tinygemm_fits), so the joined codes are the parts' codes one after the other and
    the joined product is the parts' products side by side (tests/test_engine_join.py holds it on
    the GPU). On the H200 a 6,144×1,536 int4 matrix took 6.9 µs and a 12,288×1,536 one 10.2
    (benchmarks/int4_gemv_sweep.py): at decode sizes a launch and its last wave cost about as much
    as the bytes, so two matrices read in one call take about 70% of the time of two calls."""
    import torch

    first = parts[0]
    if len(parts) < 2 or any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        return None
    out = sum(p.out_features for p in parts)
    if isinstance(first, Int4Linear):
        if any(p.group_size != first.group_size or p.columns != first.columns for p in parts):
            return None
        return Int4Linear(torch.cat([p.packed for p in parts]), torch.cat([p.scales_and_zeros for p in parts], dim=1),
                          first.group_size, out, first.in_features, first.columns)
    if isinstance(first, Int4GroupsLinear):
        if any(p.group_size != first.group_size for p in parts):
            return None
        return Int4GroupsLinear(*(torch.cat([getattr(p, name) for p in parts]) for name in ("qweight", "scales", "zeros")),
                                first.in_features)
    if isinstance(first, Int8Linear):
        return Int8Linear(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))
    if type(first) is Linear and all(p.weight.dtype == first.weight.dtype for p in parts):
        return Linear(torch.cat([p.weight for p in parts]))
    return None


def joining(device) -> bool:
    """Whether the engine joins matrices of one input (JOIN_ENV): by default on CUDA, where a
    decode step is launches of small products; on the CPU each part stays its own product, so the
    CPU's numbers stay the dense reference's operation for operation."""
    setting = os.environ.get(JOIN_ENV, "auto").lower()
    return setting == "on" or (setting == "auto" and str(device).startswith("cuda"))


def _in_row_blocks(flat, linear: Linear, decode_rows):
    """flat [T, in] times a quantized matrix, decoded a block of rows at a time (decode_rows(slice) →
    [rows, in] in flat's dtype) into cuBLAS: the temporaries stay bounded (INT8_BLOCK_VALUES)."""
    from gemmactl.runtime.engine.ops import in_row_blocks

    return in_row_blocks(flat, linear.out_features, linear.in_features, decode_rows, INT8_BLOCK_VALUES)


def int8_rows_kept() -> bool:
    """Whether CUDA keeps int8 rows as int8 (Int8Linear) rather than as bfloat16 copies: by
    default where Triton is there for the one-token kernel."""
    from gemmactl.runtime.engine.int8_gemv import available

    return os.environ.get(INT8_ENV, "rows").lower() != "dense" and available("cuda")


def int4_groups_kept(expert: bool = False) -> bool:
    """Whether CUDA keeps an int4 matrix as stored (Int4GroupsLinear) rather than in tinygemm's
    layout. By default (INT4_ENV auto) MoE experts only, where Triton is there: a layer's chosen
    experts then run in one grouped launch and can be read in place from host memory; tinygemm was
    faster on every dense matrix of E2B and 26B-A4B (benchmarks/int4_gemv_sweep.py)."""
    from gemmactl.runtime.engine.int4_gemv import available

    return _int4_groups_setting(expert) and available("cuda")


def _int4_groups_setting(expert: bool) -> bool:
    setting = os.environ.get(INT4_ENV, "auto").lower()
    return setting == "groups" or (setting != "tinygemm" and expert)


def _int4_groups_planned(expert: bool) -> bool:
    """int4_groups_kept() where this machine has CUDA; for another machine, as a standard CUDA
    install of torch (with Triton) will hold them."""
    import torch

    if torch.cuda.is_available():
        return int4_groups_kept(expert)
    return _int4_groups_setting(expert)


def tinygemm_fits(record) -> bool:
    return _tinygemm_fits(tuple(record.shape), record.group_size)


def _groups_fit(group_size: int | None) -> bool:
    """Whether the Triton int4 kernels take a group size: a power of two of at least 4 columns."""
    return bool(group_size) and group_size >= 4 and group_size & (group_size - 1) == 0


def _tinygemm_fits(shape: tuple, group_size: int | None, pad: bool = False) -> bool:
    """Whether tinygemm takes the matrix as it is, or (pad) with its columns padded by zero weights."""
    out_features, in_features = shape
    if group_size not in TINYGEMM_GROUPS or out_features % 8:
        return False
    return pad or (in_features % (INNER_K_TILES * 16) == 0 and in_features % group_size == 0)


def tinygemm_columns(in_features: int, group_size: int) -> int:
    """The columns tinygemm multiplies for in_features padded: the next multiple of its k tile and
    of the group. MoE experts are padded (Gemma 4 26B-A4B's down_proj takes 704 columns, not a
    multiple of 128): their weights in tinygemm's layout are half the bytes of a dense copy, so a
    device cache holds twice the experts, and a miss copies int4 codes rather than decoding."""
    step = max(group_size, INNER_K_TILES * 16)
    return -(-in_features // step) * step


def linear_bytes(scheme: str, shape: tuple, group_size: int | None, *, cuda: bool, dtype_bytes: int = 2,
                 pad: bool = False) -> int:
    """Bytes make_linear allocates for a stored matrix (the planner's rule and the engine's, one place):
    int4 on CUDA as stored where that is kept (codes at half a byte, fp16 scale and zero per group;
    pad: an MoE expert, by default kept so), else in tinygemm's layout (bfloat16 scale and zero′
    per group; pad: columns padded as make_linear pads them), int8 rows as stored on CUDA (a byte a value, a
    float16 scale a row), int4 and int8 as the CPU kernels hold them on the host in bfloat16
    (cpu_kernels.py), everything else dense in the compute dtype."""
    out_features, in_features = shape
    if cuda and scheme == "int4" and _groups_fit(group_size) and _int4_groups_planned(pad):
        groups = -(-in_features // group_size)
        return out_features * groups * group_size // 2 + groups * out_features * 2 * 2
    if cuda and scheme == "int4" and _tinygemm_fits((out_features, in_features), group_size, pad):
        columns = tinygemm_columns(in_features, group_size) if pad else in_features
        return out_features * columns // 2 + (columns // group_size) * out_features * 2 * 2
    if cuda and scheme == "int8" and _int8_rows_planned():
        return out_features * in_features + out_features * 2
    if not cuda and dtype_bytes == 2:
        import torch

        from gemmactl.runtime.engine.cpu_kernels import cpu_kernels_kept, cpu_linear_bytes

        kept = cpu_kernels_kept(torch.bfloat16, dense_forced=_dense_forced())  # the plan's host layers
        held = cpu_linear_bytes(scheme, shape, group_size) if kept else None
        if held is not None:
            return held
    return out_features * in_features * dtype_bytes


def _dense_forced() -> bool:
    return os.environ.get(KERNEL_ENV, "auto") == "dense"


def _int8_rows_planned() -> bool:
    """Whether a CUDA device keeps int8 rows: as int8_rows_kept() says where this machine has CUDA;
    planned for another machine (none here), as a standard CUDA install of torch does (Triton ships
    with it), so a plan made on a laptop for a 4 GB box counts the head as that box will hold it."""
    import torch

    if torch.cuda.is_available():
        return int8_rows_kept()
    return os.environ.get(INT8_ENV, "rows").lower() != "dense"


def make_linear(artifact, record, device, dtype, cache=None, pad: bool = False) -> Linear:
    """The record as a Linear on device: a fused int4/int8 kernel on CUDA, torch's int4/int8 CPU
    kernels on an x86 CPU in bfloat16 (runtime/engine/cpu_kernels.py), dense elsewhere.

    cache: a RepackCache keeping tinygemm layouts between loads. pad: an MoE expert's matrix, kept
    as stored by default (int4_groups_kept), or in tinygemm with its columns padded
    (tinygemm_columns) where tinygemm does not take them as they are, rather than made dense.
    """
    import torch

    cuda = str(device).startswith("cuda")
    forced_dense = _dense_forced()
    if cuda and not forced_dense and dtype == torch.bfloat16:
        if record.scheme == "int4" and _groups_fit(record.group_size) and int4_groups_kept(pad):
            parts = artifact.packed(record, device).parts
            return Int4GroupsLinear(parts["qweight"].contiguous(), parts["scales"].contiguous(),
                                    parts["zeros"].contiguous(), record.shape[1])
        if record.scheme == "int4" and _tinygemm_fits(tuple(record.shape), record.group_size, pad):
            in_features = record.shape[1]
            columns = tinygemm_columns(in_features, record.group_size) if pad else in_features
            packed, sz = ((cache.get(record) if cache is not None else None)
                          or _tinygemm_layout(artifact, record, device, columns))
            if cache is not None:
                cache.put(record, packed, sz)
            return Int4Linear(packed.to(device), sz.to(device), record.group_size, *record.shape, columns)
        if record.scheme == "int8" and int8_rows_kept():
            parts = artifact.packed(record, device).parts
            return Int8Linear(parts["qweight"].contiguous(), parts["scales"].contiguous())
    if not cuda and str(device) == "cpu":
        from gemmactl.runtime.engine.cpu_kernels import cpu_kernels_kept, cpu_linear

        linear = cpu_linear(artifact, record) if cpu_kernels_kept(dtype, dense_forced=forced_dense) else None
        if linear is not None:
            return linear
    return Linear(artifact.decode(record, device, dtype).contiguous())


def _tinygemm_layout(artifact, record, device, columns=None):
    """The record's int4 parts in tinygemm's layout, made on the device."""
    parts = artifact.packed(record, "cpu").parts
    return tinygemm_layout(parts["qweight"], parts["scales"], parts["zeros"], record.shape[1], device, columns)


def tinygemm_layout(qweight, scales, zeros, in_features: int, device=None, columns=None):
    """int4-stream parts (codes nibble-packed low first [out, Cp/2], fp16 scales and zeros [out, G])
    → (packed codes, scales_and_zeros [columns/g, out, 2] bf16) for `_weight_int4pack_mm`, on device
    (default: the parts'). columns (default in_features) pads the matrix with zero weights: code 0
    with scale and zero 0 beyond the stored groups. The codes cross and are reordered a block of
    rows at a time, so the repack needs about twice the packed matrix on the device, not six times."""
    import torch
    import torch.nn.functional as F

    from gemmactl.formats.int4.quant import unpack_nibbles
    from gemmactl.formats.int4.reader import DEVICE_BLOCK_VALUES

    device = device or qweight.device
    columns = columns or in_features
    rows = qweight.shape[0]
    # The kernel takes the codes nibble-packed two to a byte, high nibble first.
    pairs = torch.zeros((rows, columns // 2), dtype=torch.uint8, device=device)  # [out, columns/2]
    step = max(1, min(rows, DEVICE_BLOCK_VALUES // max(columns, 1)))
    for start in range(0, rows, step):
        codes = unpack_nibbles(qweight[start:start + step].to(device))[:, :columns]  # [r, ≤ columns] uint8 0..15
        pairs[start:start + step, :codes.shape[1] // 2] = codes[:, ::2] << 4 | codes[:, 1::2]
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, INNER_K_TILES)
    del pairs
    scale = scales.to(device).float()  # [out, G]
    zero = zeros.to(device).float() + 8 * scale  # zero′: what code 8 decodes to
    group_size = qweight.shape[1] * 2 // scales.shape[1]
    extra = columns // group_size - scales.shape[1]  # padded groups: scale and zero′ 0, weights exactly 0
    if extra > 0:
        scale, zero = F.pad(scale, (0, extra)), F.pad(zero, (0, extra))
    sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(torch.bfloat16)  # [G, out, 2]
    return packed, sz


class RepackCache:
    """tinygemm layouts of an artifact's int4 weights, kept in `engine-cache/` next to its shards.

    Keyed by the artifact's plan fingerprint, the record and the torch version, so a changed
    artifact or torch never reads a stale layout. Written whole or not at all.
    """

    def __init__(self, artifact):
        import torch

        self.folder = artifact.path / "engine-cache" / f"tinygemm-{artifact.plan.hex()[:16]}-torch{torch.__version__}"
        self.hits = self.misses = 0
        self._pending: dict = {}

    def _file(self, record):
        return self.folder / (record.key.replace("/", "_").replace("#", "-") + ".pt")

    def get(self, record):
        import torch

        path = self._file(record)
        if not path.is_file():
            self.misses += 1
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError):
            self.misses += 1
            return None
        self.hits += 1
        return saved["packed"], saved["scales_and_zeros"]

    def put(self, record, packed, sz) -> None:
        if self._file(record).is_file():
            return
        # Held in host memory until save(): a streamed layer's device copy must go as soon as
        # it is staged, or a first load would keep every streamed layer on the device at once.
        self._pending[record.key] = (record, packed.cpu(), sz.cpu())

    def save(self) -> None:
        """Write what this load repacked (skipped silently where the artifact's folder is read-only)."""
        import io

        import torch

        from gemmactl.fileio import atomic_write_bytes

        if not self._pending:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for record, packed, sz in self._pending.values():
                buffer = io.BytesIO()
                torch.save({"packed": packed.cpu(), "scales_and_zeros": sz.cpu()}, buffer)
                atomic_write_bytes(self._file(record), buffer.getvalue())
        except OSError:
            pass
        self._pending.clear()
