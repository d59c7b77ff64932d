"""The engine's KV caches, one per layer that owns one, in the modes of kv_modes.py.

Every cache has the same face to attention: `write(k, v, positions)` stores a chunk at its
positions (a sliding layer's ring keeps the last `slots`), `read(held)` gives keys and values of
the first `held` slots in the compute dtype, `space(k, v)` gives fresh keys and values as the
cache would give them back (same rounding, same space), and `rotation` is None or the orthogonal
matrix R the cache keeps vectors turned by (x ↦ x R): attention then turns the queries by R and
its output back by Rᵀ, once per query instead of once per cached vector, since q·k = (qR)·(kR).

The dense cache (bf16) is what the engine always had: read gives views of its buffers. The
quantized ones decode only the slots asked for. Everything is tensor operations on the cache's
device with static shapes, so a decode step that writes and reads them can be captured in a
CUDA graph.
"""

from __future__ import annotations

import math

import torch

from gemmactl.runtime.engine.kv_modes import DEFAULT_MODE, ENGINE_MODES, TURBO_BITS, code_planes, read_block_slots

# Tokens of a sequence's first chunk (after its first) that set the quantized caches' centres:
# the whole of the engine's first prefill chunk. On Gemma 3 270M (512-token window, tq4) a centre
# from 255 tokens gave KL 0.105 against 0.131 from 16, and 0.296 without centring.
CENTRE_TOKENS = 255


class KVCache:
    """One layer's keys and values, as computed: all positions (full attention) or a ring of the
    window (sliding)."""

    rotation = None
    mode = "bf16"

    def __init__(self, slots: int, kv_heads: int, head_dim: int, ring: bool, dtype, device):
        self.slots, self.ring, self.dtype = slots, ring, dtype
        self.kv_heads, self.head_dim = kv_heads, head_dim
        # The position each slot holds (-1: none yet); for a full cache, slot = position.
        self.pos = torch.full((slots,), -1, dtype=torch.long, device=device)  # [S]
        self._allocate(device)

    def _allocate(self, device) -> None:
        self.k = torch.zeros(self.slots, self.kv_heads, self.head_dim, dtype=self.dtype, device=device)  # [S, K, D]
        self.v = torch.zeros(self.slots, self.kv_heads, self.head_dim, dtype=self.dtype, device=device)  # [S, K, D]

    @property
    def device(self):
        return self.pos.device

    def reset(self) -> None:
        self.pos.fill_(-1)

    def _slots_for(self, k, v, positions):
        if self.ring and k.shape[0] > self.slots:
            k, v, positions = k[-self.slots:], v[-self.slots:], positions[-self.slots:]
        return k, v, positions, (positions % self.slots if self.ring else positions)

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [T, K, D] at their positions [T] (the last `slots` of them, for a ring)."""
        k, v, positions, slots = self._slots_for(k, v, positions)
        self.k.index_copy_(0, slots, k)
        self.v.index_copy_(0, slots, v)
        self.pos.index_copy_(0, slots, positions)

    value_offset = None  # added to attention's output (quantized caches store values less their centre)

    def begin(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """A sequence's first chunk of keys and values, before it is written (quantized caches
        take their centres from it)."""

    def read(self, held: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:held], self.v[:held]

    def space(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v

    def nbytes(self) -> int:
        """Bytes held: keys, values and each slot's position (what the plan sizes)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.pos))


class CenteredKVCache(KVCache):
    """What the quantized caches share: vectors are stored less a centre per head, taken from the
    sequence's first chunk (its tokens after the first, which is often an outlier; none when the
    chunk is one token).

    Keys of one head share a large common part (in Gemma 3 270M the mean key is 65–85% of a key's
    length), and a quantizer's error scales with the whole vector, while attention only tells keys
    apart: softmax(q·(k − c)) = softmax(q·k) for any c shared by all keys, so centred keys cost
    nothing and their error shrinks with the part that matters. Values: Σ w (v − c) = Σ w v − c
    since the weights sum to one, so the centre is added back to attention's output
    (`value_offset`). Both identities are exact; only the rounding moves."""

    def _allocate(self, device) -> None:
        shape = (self.slots, self.kv_heads)
        self.codes = {name: torch.zeros(*shape, *self._code_shape(name), dtype=self._code_dtype, device=device)
                      for name in "kv"}
        self.scales = {name: torch.zeros(*shape, dtype=torch.float16, device=device) for name in "kv"}
        self.centres = {name: torch.zeros(self.kv_heads, self.head_dim, dtype=torch.float32, device=device)
                        for name in "kv"}
        # The values' centre in the space read gives (turned by the rotation, if any), in the
        # compute dtype: made once per sequence in begin(), not on every attention read.
        self.value_offset = torch.zeros(self.kv_heads, self.head_dim, dtype=self.dtype, device=device)

    def reset(self) -> None:
        super().reset()
        for centre in self.centres.values():
            centre.zero_()
        self.value_offset.zero_()

    def begin(self, k, v) -> None:
        for name, x in (("k", k), ("v", v)):
            if x.shape[0] < 2:  # a lone first token is no guide: no centre
                self.centres[name].zero_()
            else:
                self.centres[name].copy_(x[1:1 + CENTRE_TOKENS].float().mean(0))
        self.value_offset.copy_(self._turn(self.centres["v"]))  # in place: a captured step reads this buffer

    def _turn(self, x):
        return x

    def _encode_as(self, name, x):
        return self._encode(x.float() - self.centres[name], name)

    def write(self, k, v, positions) -> None:
        k, v, positions, slots = self._slots_for(k, v, positions)
        self._store({name: self._encode_as(name, x) for name, x in (("k", k), ("v", v))}, slots, positions)

    def _store(self, encoded: dict, slots, positions) -> None:
        """Codes and scales per name (encoded: name -> (codes, scale)) and positions at slots."""
        for name, (codes, scale) in encoded.items():
            self.codes[name].index_copy_(0, slots, codes)
            self.scales[name].index_copy_(0, slots, scale)
        self.pos.index_copy_(0, slots, positions)

    def read(self, held: int):
        return tuple(self._decode_slots(n, held) for n in "kv")

    @property
    def read_block(self) -> int:
        """Slots attention decodes at once from this cache (kv_modes.read_block_slots)."""
        return read_block_slots(self.kv_heads, self.head_dim)

    def read_range(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots start..stop-1, decoded: a block of a read by blocks."""
        return tuple(self._decode(self.codes[n][start:stop], self.scales[n][start:stop], n) for n in "kv")

    def _decode_slots(self, name: str, held: int) -> torch.Tensor:
        """The first held slots decoded, a block of slots at a time (kv_modes.read_block_slots):
        the same values as decoding them at once, without that many int64 and float32 temporaries."""
        codes, scales = self.codes[name], self.scales[name]
        block = read_block_slots(self.kv_heads, self.head_dim)
        if held <= block:
            return self._decode(codes[:held], scales[:held], name)
        out = torch.empty((held, self.kv_heads, self.head_dim), dtype=self.dtype, device=codes.device)
        for start in range(0, held, block):
            stop = min(held, start + block)
            out[start:stop] = self._decode(codes[start:stop], scales[start:stop], name)
        return out

    def space(self, k, v):
        return tuple(self._decode(*self._encode_as(name, x), name) for name, x in (("k", k), ("v", v)))

    def fused_parts(self, held: int) -> dict:
        """The first held slots as the fused read takes them (kv_attention.py): per name, codes
        [held, K, D·bits/8] as bytes, scales [held, K] and the coefficients its levels are computed
        from (polynomial_levels: mid, c1, c3, c5); and the bits."""
        return {**{name: (self.codes[name][:held].view(torch.uint8), self.scales[name][:held], self._table(name))
                   for name in "kv"}, "k_bits": self._bits("k"), "v_bits": self._bits("v")}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.codes.values(), *self.scales.values(), self.pos))


class Int8KVCache(CenteredKVCache):
    """Each vector (one position, one head) as int8 codes with an fp16 scale (its largest |x| / 127)."""

    mode = "int8"
    _code_dtype = torch.int8

    def _code_shape(self, name):
        return (self.head_dim,)

    def _encode(self, x, name):
        x = x.float()
        scale = (x.abs().amax(-1) / 127.0).to(torch.float16)  # [T, K]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float().unsqueeze(-1)
        return torch.round(x / safe).clamp_(-127, 127).to(torch.int8), scale

    def _decode(self, codes, scale, name):
        return (codes.float() * scale.float().unsqueeze(-1)).to(self.dtype)

    def _allocate(self, device) -> None:
        super()._allocate(device)
        # The fused read computes a code's level as a polynomial of it (kv_attention.py): here the
        # byte's signed value, from the byte read unsigned plus 128 (wrapped), less 128.
        self._line = torch.tensor([128.0, 1.0, 0.0, 0.0], device=device)

    def _bits(self, name):
        return 8

    def _table(self, name):
        return self._line


def gaussian_levels(bits: int) -> tuple[list[float], list[float]]:
    """(levels, boundaries) of the Lloyd-Max quantizer of a standard Gaussian with 2**bits levels,
    by Lloyd's iteration on the exact density (centroids of the cells, boundaries halfway)."""
    n = 1 << bits
    levels = [(i + 0.5) / n * 6 - 3 for i in range(n)]  # a start spread over ±3σ

    def pdf(x):
        return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x):
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    for _ in range(500):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = [(pdf(a) - pdf(b)) / max(cdf(b) - cdf(a), 1e-300) for a, b in zip(edges, edges[1:])]
    return levels, [(a + b) / 2 for a, b in zip(levels, levels[1:])]


def polynomial_levels(bits: int) -> tuple[tuple[float, float, float, float], list[float], list[float]]:
    """(coefficients, levels, boundaries) of a quantizer of a standard Gaussian whose 2**bits levels
    are an odd polynomial of the code: with u = code - mid, level = u·(c1 + u²·(c3 + u²·c5)), so a
    kernel computes a level from its code in a few float operations instead of looking it up. The
    coefficients are fitted as Lloyd's iteration fits levels (each cell's centroid, weighted by its
    probability, by least squares), on the exact density: within 0.0%, 0.2% and 1.1% of the
    Lloyd-Max quantizer's distortion at 3, 4 and 5 bits. coefficients: (mid, c1, c3, c5); the
    levels in float32 as a kernel computes them; boundaries halfway between levels."""
    n = 1 << bits
    mid = (n - 1) / 2
    us = [i - mid for i in range(n)]

    def pdf(x):
        return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    def cdf(x):
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    def fit(targets, weights):  # weighted least squares of u·(c1 + c3 u² + c5 u⁴) to targets
        basis = torch.tensor([[u, u ** 3, u ** 5] for u in us], dtype=torch.float64)
        root = torch.tensor(weights, dtype=torch.float64).sqrt().unsqueeze(1)
        wanted = torch.tensor(targets, dtype=torch.float64).unsqueeze(1)
        return torch.linalg.lstsq(basis * root, wanted * root).solution.squeeze(1).tolist()

    coefficients = fit(gaussian_levels(bits)[0], [1.0] * n)
    for _ in range(200):
        levels = [u * (coefficients[0] + u * u * (coefficients[1] + u * u * coefficients[2])) for u in us]
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        mass = [max(cdf(b) - cdf(a), 1e-300) for a, b in zip(edges, edges[1:])]
        centroids = [(pdf(a) - pdf(b)) / m for (a, b), m in zip(zip(edges, edges[1:]), mass)]
        coefficients = fit(centroids, mass)
    c1, c3, c5 = (torch.tensor(c, dtype=torch.float32) for c in coefficients)
    u = torch.arange(n, dtype=torch.float32) - mid
    levels = (u * (c1 + u * u * (c3 + u * u * c5))).tolist()  # float32, in the kernel's order
    return (mid, float(c1), float(c3), float(c5)), levels, [(a + b) / 2 for a, b in zip(levels, levels[1:])]


def hadamard_rotation(dim: int, seed: int) -> torch.Tensor:
    """An orthogonal [dim, dim] matrix: a normalized Hadamard matrix (dim a power of two) after
    random signs, or a random orthogonal one (QR of a Gaussian) for other sizes. float32, CPU."""
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1
    if dim & (dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < dim:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return signs.unsqueeze(1) * h / math.sqrt(dim)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator))
    return q * torch.sign(torch.diagonal(r))


class TurboKVCache(CenteredKVCache):
    """TurboQuant-style: vectors turned by a random rotation, each coordinate quantized to levels
    for a Gaussian (polynomial_levels: about the Lloyd-Max quantizer's, as a polynomial of the
    code), scaled by the turned vector's RMS (fp16). Keys and values may
    take different bits (kv_modes.TURBO_BITS: keys one bit more, values one less, since a key's
    error moves every score). Codes are packed in planes of whole fields (_pack)."""

    def __init__(self, slots, kv_heads, head_dim, ring, dtype, device, *, bits, seed: int = 0, mode: str = ""):
        if head_dim % 32:  # whole 32-bit words in every plane (_pack)
            raise ValueError(f"{mode or 'a turbo cache'} needs a head dim divisible by 32, not {head_dim}")
        key_bits, value_bits = (bits, bits) if isinstance(bits, int) else bits
        self.bits = {"k": key_bits, "v": value_bits}
        self.mode = mode or f"tq{key_bits}"
        self.levels, self.edges, self.tables = {}, {}, {}
        for name, b in self.bits.items():
            coefficients, levels, edges = polynomial_levels(b)
            self.levels[name] = torch.tensor(levels, dtype=torch.float32, device=device)
            self.edges[name] = torch.tensor(edges, dtype=torch.float32, device=device)
            # what the fused read computes each level from (kv_attention.py): mid, c1, c3, c5
            self.tables[name] = torch.tensor(coefficients, dtype=torch.float32, device=device)
        self.rotation_f32 = hadamard_rotation(head_dim, seed).to(device)
        self.rotation = self.rotation_f32.to(dtype)
        # the rotation's signs (a Hadamard matrix's first column is all ones): what kv_turn.py's
        # kernel takes beside the ±1 matrix
        self.signs = torch.sign(self.rotation_f32[:, 0]).contiguous()
        super().__init__(slots, kv_heads, head_dim, ring, dtype, device)

    _code_dtype = torch.uint8

    def _code_shape(self, name):
        return (self.head_dim * self.bits[name] // 8,)

    def _turn(self, x):
        return x @ self.rotation_f32

    def _encode(self, x, name):
        return self._quantize(x.float() @ self.rotation_f32, name)

    def write_turning(self, q, k, v, positions) -> torch.Tensor:
        """write(k, v, positions) and return the queries q [T, N, D] turned (float32), for the fused
        read (kv_attention.py takes them turned). A decode step's few vectors go to one kernel
        (kv_turn.py) where it runs: otherwise each product and quantizing step costs about its
        launch; elsewhere the three are turned in one product."""
        from gemmactl.runtime.engine import kv_turn

        t = k.shape[0]
        if not (self.ring and t > self.slots) and kv_turn.usable(q.device, t, self.head_dim):
            _, _, positions, slots = self._slots_for(k, v, positions)
            turned_q = kv_turn.turned_write(q, k, v, self.centres["k"], self.centres["v"], self.signs,
                                            self.edges["k"], self.edges["v"], self.codes["k"], self.scales["k"],
                                            self.codes["v"], self.scales["v"], slots, positions, self.pos,
                                            self.bits["k"], self.bits["v"])
            return turned_q
        heads, kv_heads = q.shape[1], k.shape[1]
        centred = (q.float(), k.float() - self.centres["k"], v.float() - self.centres["v"])
        turned_q, k, v = (torch.cat(centred, 1) @ self.rotation_f32).split((heads, kv_heads, kv_heads), 1)
        k, v, positions, slots = self._slots_for(k, v, positions)
        self._store({name: self._quantize(x, name) for name, x in (("k", k), ("v", v))}, slots, positions)
        return turned_q

    def _quantize(self, turned, name):
        """Codes and scales of vectors [T, K, D] already turned (float32)."""
        scale = turned.pow(2).mean(-1).sqrt().to(torch.float16)  # [T, K]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).float().unsqueeze(-1)
        codes = torch.bucketize(turned / safe, self.edges[name]).to(torch.uint8)  # [T, K, D] in 0 .. 2**bits - 1
        return self._pack(codes, self.bits[name]), scale

    def _decode(self, packed, scale, name):
        values = self.levels[name][self._unpack(packed, self.bits[name]).long()] * scale.float().unsqueeze(-1)
        return values.to(self.dtype)

    def _bits(self, name):
        return self.bits[name]

    def _table(self, name):
        return self.tables[name]

    @staticmethod
    def _pack(codes, bits: int):
        """Codes [..., D] (uint8, below 2**bits) → bytes [..., D·bits/8] in planes (kv_modes.code_planes):
        the main plane's W0 low bits of every code, then the second plane's W1 high bits, each a
        little-endian stream of fields (code d's bits at bit d·w of its plane), so no code straddles
        a 32-bit word and the fused read takes a word's fields with shifts (kv_attention_kernel.py)."""
        parts, shift = [], 0
        for width in (w for w in code_planes(bits) if w):
            part = ((codes >> shift) & ((1 << width) - 1)).to(torch.int32)
            fields = part.reshape(*part.shape[:-1], part.shape[-1] * width // 8, 8 // width)  # [..., bytes, per byte]
            shifts = torch.arange(0, 8, width, device=codes.device, dtype=torch.int32)
            parts.append((fields << shifts).sum(-1).to(torch.uint8))
            shift += width
        return torch.cat(parts, -1)

    @staticmethod
    def _unpack(packed, bits: int):
        """_pack undone: bytes [..., D·bits/8] → codes [..., D] (uint8)."""
        dim = packed.shape[-1] * 8 // bits
        codes, shift, start = None, 0, 0
        for width in (w for w in code_planes(bits) if w):
            size = dim * width // 8
            plane = packed[..., start:start + size].to(torch.int32)
            shifts = torch.arange(0, 8, width, device=packed.device, dtype=torch.int32)
            part = ((plane.unsqueeze(-1) >> shifts) & ((1 << width) - 1)).flatten(-2) << shift
            codes = part if codes is None else codes | part
            shift, start = shift + width, start + size
        return codes.to(torch.uint8)


def make_cache(mode: str | None, slots: int, kv_heads: int, head_dim: int, ring: bool, dtype, device,
               seed: int = 0) -> KVCache:
    """A layer's cache in mode (None: the default); seed picks a layer's rotation (tq modes)."""
    mode = mode or DEFAULT_MODE
    if mode == "bf16":
        return KVCache(slots, kv_heads, head_dim, ring, dtype, device)
    if mode == "int8":
        return Int8KVCache(slots, kv_heads, head_dim, ring, dtype, device)
    if mode in TURBO_BITS:
        return TurboKVCache(slots, kv_heads, head_dim, ring, dtype, device, bits=TURBO_BITS[mode], seed=seed, mode=mode)
    raise ValueError(f"unknown KV cache mode {mode!r} (known: {', '.join(ENGINE_MODES)})")
