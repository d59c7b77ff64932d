"""The engine's forward pass: Gemma 3 and Gemma 4 text layers written for decoding.

One `step(tokens, positions)` serves prefill (a chunk of T tokens, batched matmuls) and decode
(T = 1, static shapes, so it can be captured in a CUDA graph). Arithmetic follows transformers'
modeling code operation for operation, in the compute dtype it uses: norms in float32 and cast
back, attention scores in the compute dtype, softmax in float32, so the engine's logits are the
reference's up to the order of floating-point sums.

KV caches are allocated once: a full-attention layer keeps `context` slots, a sliding layer a ring
of `window` slots (with the position each slot holds), a layer that shares KV (Gemma 4's last
layers) none: it reads its producer's cache. A layer is a `Layer` object whose feed-forward part
is one callable, so an MoE block can take its place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gemmactl.runtime.engine.kernels import Linear, RepackCache, make_linear
from gemmactl.runtime.engine.spec import SLIDING, LayerSpec, ModelSpec, model_spec, rope_tables


def rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm as transformers' Gemma norms compute it: in float32, then cast back. scale: already
    (1 + w) for Gemma 3, w for Gemma 4, None for a norm without one."""
    y = x.float()
    y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if scale is not None:
        y = y * scale
    return y.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] with cos/sin [T, D] (rotate-half form)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


@dataclass
class Attention:
    q: Linear
    k: Linear | None
    v: Linear | None
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    v_norm: bool  # Gemma 4 normalizes values (without a scale)


class KVCache:
    """One layer's keys and values: all positions (full attention) or a ring of the window (sliding)."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, ring: bool, dtype, device):
        self.k = torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)  # [S, K, D]
        self.v = torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)  # [S, K, D]
        self.ring = ring
        # The position each slot holds (-1: none yet); for a full cache, slot = position.
        self.pos = torch.full((slots,), -1, dtype=torch.long, device=device)  # [S]
        self.slots = slots

    def reset(self) -> None:
        self.pos.fill_(-1)

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [T, K, D] at their positions [T] (the last `slots` of them, for a ring)."""
        if self.ring and k.shape[0] > self.slots:
            k, v, positions = k[-self.slots:], v[-self.slots:], positions[-self.slots:]
        slots = positions % self.slots if self.ring else positions
        self.k.index_copy_(0, slots, k)
        self.v.index_copy_(0, slots, v)
        self.pos.index_copy_(0, slots, positions)


class Layer:
    """One decoder layer's weights and the order Gemma applies them in."""

    def __init__(self, spec: LayerSpec, attn: Attention, norms: dict, mlp: dict, per_layer: dict | None,
                 layer_scalar: torch.Tensor | None):
        self.spec = spec
        self.attn = attn
        self.norms = norms  # input, post_attention, pre_feedforward, post_feedforward (+ post_per_layer_input)
        self.mlp = mlp  # gate, up, down: Linear
        self.per_layer = per_layer  # gate, projection: Linear (Gemma 4 per-layer inputs)
        self.layer_scalar = layer_scalar

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP (an MoE block replaces this callable)."""
        gate = F.gelu(self.mlp["gate"](x), approximate="tanh")
        return self.mlp["down"](gate * self.mlp["up"](x))


class GemmaModel:
    """A Gemma text model on one device, with its caches, ready to step."""

    def __init__(self, artifact, *, device: str, dtype: torch.dtype, context: int):
        self.artifact = artifact
        self.device, self.dtype, self.context = torch.device(device), dtype, context
        shapes = {r.name: (r.stack_shape or r.shape) for r in artifact.records}
        self.spec: ModelSpec = model_spec(artifact.config, shapes)
        if self.spec.moe:
            from gemmactl.errors import UnsupportedModelError

            raise UnsupportedModelError("the engine does not run MoE experts yet",
                                        hint="MoE artifacts run on the transformers path (GEMMACTL_INT4_ENGINE=off).")
        self.prefix = "model." if any(n.startswith("model.") for n in shapes) else ""
        self.repack = RepackCache(artifact) if self.device.type == "cuda" else None
        spec = self.spec
        self.head = self._head()
        self.embed = self._table("embed_tokens.weight")
        if spec.tied and getattr(self.head, "q", None) is not None:
            self.embed = ("int8", self.head.q, self.embed[2])  # one copy of the tied table's codes
        self.embed_scale = torch.tensor(spec.hidden ** 0.5, dtype=dtype, device=self.device)  # as transformers rounds it
        self.final_norm = self._norm("norm.weight")
        if spec.ple_dim:
            self.ple_table = self._table("embed_tokens_per_layer.weight")
            self.ple_scale = torch.tensor(spec.ple_dim ** 0.5, dtype=dtype, device=self.device)
            self.ple_projection = self._linear("per_layer_model_projection.weight")
            self.ple_norm = self._norm("per_layer_projection_norm.weight")
        self.layers = [self._layer(layer) for layer in spec.layers]
        if self.repack is not None:
            self.repack.save()
        self.caches: dict[int, KVCache] = {}
        for layer in spec.layers:
            if layer.owns_kv:
                ring = layer.kind == SLIDING and 0 < spec.window < context
                slots = spec.window if ring else context
                self.caches[layer.index] = KVCache(slots, layer.kv_heads, layer.head_dim, ring, dtype, self.device)
        self.rope = {kind: (cos.to(self.device), sin.to(self.device))
                     for kind, (cos, sin) in rope_tables(artifact.config, context, dtype).items()}

    # -- weights ---------------------------------------------------------------------------------

    def _name(self, short: str) -> str:
        return short if short == "lm_head.weight" else self.prefix + short

    def _record(self, short: str):
        return self.artifact.record(self._name(short))

    def _linear(self, short: str) -> Linear:
        return make_linear(self.artifact, self._record(short), self.device, self.dtype, self.repack)

    def _norm(self, short: str, *, plain: bool = False) -> torch.Tensor | None:
        name = self._name(short)
        if name not in self.artifact.tensor_names():
            return None
        w = self.artifact.load_tensor(name, self.device, torch.float32)
        return w + 1.0 if self.spec.norm_plus_one and not plain else w

    def _table(self, short: str):
        """An embedding table as stored (int8 rows + scales, or dense), for row gathers."""
        record = self._record(short)
        parts = self.artifact.packed(record, self.device).parts
        if record.scheme == "int8":
            return ("int8", parts["qweight"], parts["scales"])  # scales as stored (fp16), as the reference decodes
        return ("dense", self.artifact.decode(record, self.device, self.dtype), None)

    def _head(self) -> Linear:
        if "lm_head.weight" in self.artifact.tensor_names():
            return self._linear("lm_head.weight")
        return make_linear(self.artifact, self._record("embed_tokens.weight"), self.device, self.dtype, self.repack)

    def _layer(self, spec: LayerSpec) -> Layer:
        p = f"layers.{spec.index}."
        names = set(self.artifact.tensor_names())
        has = lambda short: self._name(p + short) in names  # noqa: E731
        attn = Attention(
            q=self._linear(p + "self_attn.q_proj.weight"),
            k=self._linear(p + "self_attn.k_proj.weight") if spec.owns_kv else None,
            v=self._linear(p + "self_attn.v_proj.weight") if spec.owns_kv and not spec.k_eq_v else None,
            o=self._linear(p + "self_attn.o_proj.weight"),
            q_norm=self._norm(p + "self_attn.q_norm.weight"),
            k_norm=self._norm(p + "self_attn.k_norm.weight") if spec.owns_kv else None,
            v_norm=self.spec.family == "gemma4",
        )
        norms = {key: self._norm(p + f"{key}_layernorm.weight")
                 for key in ("input", "post_attention", "pre_feedforward", "post_feedforward")}
        mlp = {key: self._linear(p + f"mlp.{key}_proj.weight") for key in ("gate", "up", "down")}
        per_layer = None
        if self.spec.ple_dim:
            per_layer = {"gate": self._linear(p + "per_layer_input_gate.weight"),
                         "projection": self._linear(p + "per_layer_projection.weight")}
            norms["post_per_layer_input"] = self._norm(p + "post_per_layer_input_norm.weight")
        scalar = self.artifact.load_tensor(self._name(p + "layer_scalar"), self.device, self.dtype) if has("layer_scalar") else None
        return Layer(spec, attn, norms, mlp, per_layer, scalar)

    # -- the forward pass ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every cached position (a new sequence starts at position 0)."""
        with torch.inference_mode():  # the caches are inference tensors (made under inference mode)
            for cache in self.caches.values():
                cache.reset()

    def _gather(self, table, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of a stored table for tokens [T] → [T, width] in the compute dtype."""
        kind, data, scales = table
        ids = tokens.to(data.device)
        if kind == "int8":
            rows = (data.index_select(0, ids).float() * scales.index_select(0, ids).float().unsqueeze(1)).to(self.dtype)
        else:
            rows = data.index_select(0, ids)
        return rows.to(self.device)

    def embed_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x [T, H], per-layer inputs [T, L, P] or None) for tokens [T]."""
        x = self._gather(self.embed, tokens) * self.embed_scale  # [T, H]
        if not self.spec.ple_dim:
            return x, None
        n, p = self.spec.n_layers, self.spec.ple_dim
        token_part = (self._gather(self.ple_table, tokens) * self.ple_scale).view(-1, n, p)  # [T, L, P]
        projected = (self.ple_projection(x) * self.spec.hidden ** -0.5).view(-1, n, p)  # [T, L, P]
        projected = rms_norm(projected, self.ple_norm, self.spec.eps)
        return x, (projected + token_part) * 2.0 ** -0.5

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, end: int | None = None) -> torch.Tensor:
        """Run tokens [T] at positions [T] (consecutive, continuing the cache); returns the last
        token's logits [V] in float32.

        end: the last position + 1 when the caller knows it on the host. Attention then reads only
        the slots written so far; without it (a captured graph, whose shapes cannot change) every
        slot is read and the unwritten ones masked.
        """
        x, per_layer_inputs = self.embed_tokens(tokens)
        return self.forward(x, per_layer_inputs, positions, end)

    def forward(self, x: torch.Tensor, per_layer_inputs: torch.Tensor | None, positions: torch.Tensor,
                end: int | None = None) -> torch.Tensor:
        spec = self.spec
        rope = {kind: (cos.index_select(0, positions), sin.index_select(0, positions))
                for kind, (cos, sin) in self.rope.items()}
        for layer in self.layers:
            s = layer.spec
            residual = x
            h = rms_norm(x, layer.norms["input"], spec.eps)
            h = self._attention(layer, h, positions, rope[s.kind], end)
            x = residual + rms_norm(h, layer.norms["post_attention"], spec.eps)
            residual = x
            h = layer.feed_forward(rms_norm(x, layer.norms["pre_feedforward"], spec.eps))
            x = residual + rms_norm(h, layer.norms["post_feedforward"], spec.eps)
            if layer.per_layer is not None:
                residual = x
                g = F.gelu(layer.per_layer["gate"](x), approximate="tanh") * per_layer_inputs[:, s.index, :]
                x = residual + rms_norm(layer.per_layer["projection"](g), layer.norms["post_per_layer_input"], spec.eps)
            if layer.layer_scalar is not None:
                x = x * layer.layer_scalar
        x = rms_norm(x[-1:], self.final_norm, spec.eps)  # [1, H]: only the last token's logits are needed
        logits = self.head(x)[0]  # [V]
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits.float()

    def _attention(self, layer: Layer, h: torch.Tensor, positions: torch.Tensor, rope, end: int | None) -> torch.Tensor:
        s, a, eps = layer.spec, layer.attn, self.spec.eps
        cos, sin = rope
        t = h.shape[0]
        q = a.q(h).view(t, s.heads, s.head_dim)  # [T, N, D]
        q = rotate(rms_norm(q, a.q_norm, eps), cos, sin)
        cache = self.caches[s.kv_from]
        if s.owns_kv:
            k = a.k(h).view(t, s.kv_heads, s.head_dim)  # [T, K, D]
            v = a.v(h).view(t, s.kv_heads, s.head_dim) if a.v is not None else k
            k = rotate(rms_norm(k, a.k_norm, eps), cos, sin)
            if a.v_norm:
                v = rms_norm(v, None, eps)
            if cache.ring and t > 1:
                # A chunk attends to the ring as it was (the window before it) and to itself, then
                # is written: writing first could overwrite keys its first tokens still need.
                held = cache.slots if end is None else min(cache.slots, end - t)  # slots written before
                keys = (torch.cat((cache.k[:held], k)), torch.cat((cache.v[:held], v)),
                        torch.cat((cache.pos[:held], positions)))
                cache.write(k, v, positions)
                return self._scores(layer, q, *keys, positions)
            cache.write(k, v, positions)
        held = cache.slots if end is None else min(cache.slots, end)  # a ring fills slots 0.. first
        return self._scores(layer, q, cache.k[:held], cache.v[:held], cache.pos[:held], positions)

    def _scores(self, layer: Layer, q, k, v, key_positions, positions) -> torch.Tensor:
        """softmax(q kᵀ · scale + mask) v for q [T, N, D] over k, v [S, K, D]; returns [T, N·D] projected."""
        s, spec = layer.spec, self.spec
        t, groups = q.shape[0], s.heads // s.kv_heads
        qg = q.view(t, s.kv_heads, groups, s.head_dim)  # [T, K, g, D]
        scores = torch.einsum("tkgd,skd->tkgs", qg, k) * spec.query_scale  # [T, K, g, S]
        if spec.attn_softcap:
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        seen = key_positions[None, :] <= positions[:, None]  # [T, S] causal (and written: -1 < any position)
        seen &= key_positions[None, :] >= 0
        if s.kind == SLIDING and spec.window:
            seen &= key_positions[None, :] > positions[:, None] - spec.window
        scores = scores.masked_fill(~seen[:, None, None, :], torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.einsum("tkgs,skd->tkgd", weights, v).reshape(t, s.heads * s.head_dim)  # [T, N·D]
        return layer.attn.o(out)

    def nbytes(self) -> int:
        """Bytes the model's weights take on their devices (KV caches not included)."""
        total = 0
        for layer in self.layers:
            for item in (layer.attn.q, layer.attn.k, layer.attn.v, layer.attn.o, *layer.mlp.values(),
                         *(layer.per_layer or {}).values()):
                if item is not None:
                    total += item.nbytes()
        for kind, data, scales in [self.embed] + ([self.ple_table] if self.spec.ple_dim else []):
            total += data.numel() * data.element_size() + (scales.numel() * scales.element_size() if scales is not None else 0)
        return total + (self.head.nbytes() if self.head.kernel != "dense" or not self.spec.tied else 0)
