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
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from gemmactl.formats.int4.spec import HEAD_NAME
from gemmactl.runtime.engine import kv_attention
from gemmactl.runtime.engine.kernels import Linear, RepackCache, join_linears, joining, make_linear
from gemmactl.runtime.engine.kv import KVCache, make_cache
from gemmactl.runtime.engine.kv_modes import fused_rows, layer_mode
from gemmactl.runtime.engine.ops import key_scores, rms_norm, weighted_values
from gemmactl.runtime.engine.placement import HOST, RESIDENT, STREAMED, EnginePlacement, caches_on_host
from gemmactl.runtime.engine.streaming import LayerStreamer, StagedLayer
from gemmactl.runtime.engine.spec import SLIDING, LayerSpec, ModelSpec, artifact_spec, rope_frequencies, rope_rows, score_rows


GATE_UP = "gate+up"  # an MLP's gate and up joined into one product (Layer.join)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] with cos/sin [T, D] (rotate-half form)."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


@dataclass
class ExpertCall:
    """An MoE layer's experts to run: their input x [T, H], the residual stream the router read,
    and its choice (weights [T, k], experts [T, k])."""

    block: object  # the layer's MoEBlock
    x: torch.Tensor
    residual: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor
    guess: torch.Tensor | None = None  # [T, k]: the next MoE layer's router on this residual (a captured step's prefetch)
    choice: torch.Tensor | None = None  # [1, 2k]: experts and guess side by side (a captured step's host reads both at once)

    def run(self) -> torch.Tensor:
        return self.block.combine(self.x, self.residual, self.weights, self.experts)


@dataclass
class Attention:
    q: Linear
    k: Linear | None
    v: Linear | None
    o: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    v_norm: bool  # Gemma 4 normalizes values (without a scale)
    joined: Linear | None = None  # q with k (and v) as one product (kernels.join_linears); those parts are then None
    joined_parts: tuple = ()  # the parts it holds, in order: ("q", "k") or ("q", "k", "v")

    def projections(self, h: torch.Tensor, sizes: dict) -> dict:
        """q, k and v of h [T, H] by name (those the layer has), each [T, sizes[name]]."""
        found = {name: linear(h) for name, linear in (("q", self.q), ("k", self.k), ("v", self.v)) if linear is not None}
        if self.joined is not None:
            found.update(zip(self.joined_parts, self.joined(h).split([sizes[p] for p in self.joined_parts], dim=-1)))
        return found


class Layer:
    """One decoder layer's weights and the order Gemma applies them in."""

    def __init__(self, spec: LayerSpec, attn: Attention, norms: dict, mlp: dict, per_layer: dict | None,
                 layer_scalar: torch.Tensor | None, moe=None):
        self.spec = spec
        self.moe = moe  # a MoEBlock (Gemma 4 MoE layers: experts beside the dense MLP), or None
        self.attn = attn
        self.norms = norms  # input, post_attention, pre_feedforward, post_feedforward (+ post_per_layer_input)
        self.mlp = mlp  # gate, up, down: Linear
        self.per_layer = per_layer  # gate, projection: Linear (Gemma 4 per-layer inputs)
        self.layer_scalar = layer_scalar

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP (an MoE block replaces this callable)."""
        if GATE_UP in self.mlp:
            gate, up = self.mlp[GATE_UP](x).chunk(2, dim=-1)
        else:
            gate, up = self.mlp["gate"](x), self.mlp["up"](x)
        return self.mlp["down"](F.gelu(gate, approximate="tanh") * up)

    def join(self) -> "Layer":
        """The layer with the matrices that read one input joined into one product each where their
        kernels allow (kernels.join_linears): q with k (and v), gate with up."""
        a = self.attn
        parts = tuple(name for name, linear in (("q", a.q), ("k", a.k), ("v", a.v)) if linear is not None)
        joined = join_linears([getattr(a, name) for name in parts]) if len(parts) > 1 else None
        if joined is None and len(parts) == 3:  # v in another kernel (int8 rows): q with k alone
            parts = parts[:2]
            joined = join_linears([a.q, a.k])
        if joined is not None:
            left = {name: (None if name in parts else getattr(a, name)) for name in ("q", "k", "v")}
            self.attn = replace(a, **left, joined=joined, joined_parts=parts)
        if "gate" in self.mlp and "up" in self.mlp:
            gate_up = join_linears([self.mlp["gate"], self.mlp["up"]])
            if gate_up is not None:
                self.mlp = {GATE_UP: gate_up, "down": self.mlp["down"]}
        return self

    def linears(self) -> dict:
        """Every matrix of the layer by name (what placement moves)."""
        a, found = self.attn, {}
        for name, linear in (("q", a.q), ("k", a.k), ("v", a.v), ("+".join(a.joined_parts), a.joined), ("o", a.o),
                             *self.mlp.items(), *((f"per_layer_{k}", v) for k, v in (self.per_layer or {}).items())):
            if linear is not None:
                found[name] = linear
        return found

    def with_linears(self, linears: dict) -> "Layer":
        """The same layer with its matrices held elsewhere (None: without them)."""
        get = linears.get
        joined = get("+".join(self.attn.joined_parts)) if self.attn.joined_parts else None
        attn = Attention(get("q"), get("k"), get("v"), get("o"), self.attn.q_norm, self.attn.k_norm, self.attn.v_norm,
                         joined, self.attn.joined_parts)
        mlp = {key: get(key) for key in self.mlp}
        per_layer = {key: get(f"per_layer_{key}") for key in self.per_layer} if self.per_layer is not None else None
        return Layer(self.spec, attn, self.norms, mlp, per_layer, self.layer_scalar, self.moe)


class GemmaModel:
    """A Gemma text model on a device (layers resident, streamed or on the host), with its caches,
    ready to step."""

    def __init__(self, artifact, *, device: str, dtype: torch.dtype, context: int,
                 placement: EnginePlacement | None = None, experts=None, kv_mode: str | None = None,
                 yarn: float | None = None, spare_slots: int = 0, prefill_host_layers_on_device: bool | None = None):
        """experts: an ExpertSettings for MoE models (default: every expert cached, LRU).
        prefill_host_layers_on_device (default: on CUDA): the host layers are also kept in the
        device kernel's layout in (pinned) host memory, and a prefill chunk streams them through
        the staging areas and computes them on the device, their KV caches staying on the host: a
        chunk of many tokens costs the CPU's kernels far more than the copy (an E4B layer, 256
        tokens: about a second on 2 cores, against ~1 ms over an H200's link).
        spare_slots: ring slots beyond the window (speculation writes up to that many positions
        ahead and rolls back: their keys must not overwrite ones the window still needs).
        kv_mode: the KV caches' mode (runtime/engine/kv_modes.py; default bf16), or GLOBAL/WINDOWS
            for the sliding layers' own.
        yarn: a YaRN factor for the global-attention layers' rope (None: the model's own rope)."""
        self.artifact = artifact
        self.device, self.dtype, self.context = torch.device(device), dtype, context
        self.host = torch.device("cpu")
        self.spec: ModelSpec = artifact_spec(artifact)
        self.placement = placement or EnginePlacement.all_resident(self.spec.n_layers)
        if len(self.placement.layers) != self.spec.n_layers:
            raise ValueError(f"the placement has {len(self.placement.layers)} layers, the model {self.spec.n_layers}")
        self.prefix = "model." if any(r.name.startswith("model.") for r in artifact.records) else ""
        self.repack = RepackCache(artifact) if self.device.type == "cuda" else None
        spec = self.spec
        self.head = self._head()
        tables = self.host if self.placement.tables_on_host else self.device
        self.embed = self._table("embed_tokens.weight", tables)
        self.embed_scale = torch.tensor(spec.hidden ** 0.5, dtype=dtype, device=self.device)  # as transformers rounds it
        self.final_norm = self._norm("norm.weight")
        if spec.ple_dim:
            self.ple_table = self._table("embed_tokens_per_layer.weight", tables)
            self.ple_scale = torch.tensor(spec.ple_dim ** 0.5, dtype=dtype, device=self.device)
            self.ple_projection = self._linear("per_layer_model_projection.weight")
            self.ple_norm = self._norm("per_layer_projection_norm.weight")
        self.where = self.placement.layers
        self.experts = self._experts(experts) if spec.moe else None
        if prefill_host_layers_on_device is None:
            prefill_host_layers_on_device = self.device.type == "cuda"
        prefill_host_layers_on_device = prefill_host_layers_on_device and not spec.moe  # (a layer, one expert block)
        self.layers, staged, staged_host, device_twins = [], [], [], {}
        pin = self.device.type == "cuda"
        for layer_spec in spec.layers:
            where = self.where[layer_spec.index]
            layer = self._layer(layer_spec, self.host if where == HOST else self.device)
            if where == STREAMED:
                # Made in the device kernel's layout, then kept in (pinned) host memory only.
                staged.append(StagedLayer(layer_spec.index, layer.linears(), pin=pin))
                layer = layer.with_linears({})
            elif where == HOST and prefill_host_layers_on_device:
                twin = self._layer(layer_spec, self.device)  # its device layout, for prefill chunks
                staged_host.append(StagedLayer(layer_spec.index, twin.linears(), pin=pin))
                device_twins[layer_spec.index] = twin.with_linears({})
            self.layers.append(layer)
        # Two staging areas, each for the largest layer staged; a prefill chunk streams the host
        # layers too (in layer order with the streamed ones) through the same two.
        largest = max((item.nbytes for item in staged + staged_host), default=0)
        areas = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(2)] if largest else None
        self.streamer = LayerStreamer(staged, self.device, areas) if staged else None
        self.prefill_streamer = None
        if staged_host:
            both = sorted(staged + staged_host, key=lambda item: item.index)
            self.prefill_streamer = LayerStreamer(both, self.device, areas)
        # The two staged versions of each streamed (and prefill-staged host) layer, one per area.
        self.staged_layers = {item.index: [(device_twins.get(item.index) or self.layers[item.index])
                                           .with_linears(item.slots[slot]) for slot in range(2)]
                              for item in staged + staged_host}
        if self.repack is not None:
            self.repack.save()
        self.caches: dict[int, KVCache] = {}
        on_host = caches_on_host(spec.layers, self.where)
        for layer in spec.layers:
            if layer.owns_kv:
                ring = layer.kind == SLIDING and 0 < spec.window and spec.window + spare_slots < context
                slots = spec.window + spare_slots if ring else context
                home = self.host if layer.index in on_host else self.device
                self.caches[layer.index] = make_cache(layer_mode(kv_mode, layer.kind), slots, layer.kv_heads,
                                                      layer.head_dim, ring, dtype, home, seed=layer.index)
        self.kv_mode = kv_mode or "bf16"
        frequencies = rope_frequencies(artifact.config, yarn=yarn)
        self.devices = [self.device] + ([self.host] if HOST in self.where and self.host != self.device else [])
        # Each step makes its positions' rope rows (spec.rope_rows): no table grows with the context.
        self.rope = {dev: {kind: (inv_freq.to(dev), scaling) for kind, (inv_freq, scaling) in frequencies.items()}
                     for dev in self.devices}

    # -- weights ---------------------------------------------------------------------------------

    def _name(self, short: str) -> str:
        return short if short == HEAD_NAME else self.prefix + short

    def _record(self, short: str):
        return self.artifact.record(self._name(short))

    def _linear(self, short: str, device=None) -> Linear:
        device = device or self.device
        return make_linear(self.artifact, self._record(short), device, self.dtype,
                           self.repack if device.type == "cuda" else None)

    def _norm(self, short: str, device=None) -> torch.Tensor | None:
        name = self._name(short)
        if name not in self.artifact.tensor_names():
            return None
        w = self.artifact.load_tensor(name, device or self.device, torch.float32)
        return w + 1.0 if self.spec.norm_plus_one else w

    def _table(self, short: str, device):
        """An embedding table as stored (int8 rows + scales, or dense), for row gathers."""
        record = self._record(short)
        if record.scheme == "int8":
            parts = self.artifact.packed(record, device).parts
            return ("int8", parts["qweight"], parts["scales"])  # scales as stored (fp16), as the reference decodes
        return ("dense", self.artifact.decode(record, device, self.dtype), None)

    def _head(self) -> Linear:
        if HEAD_NAME in self.artifact.tensor_names():
            return self._linear(HEAD_NAME)
        return make_linear(self.artifact, self._record("embed_tokens.weight"), self.device, self.dtype, self.repack)

    def _layer(self, spec: LayerSpec, device) -> Layer:
        p = f"layers.{spec.index}."
        names = set(self.artifact.tensor_names())
        has = lambda short: self._name(p + short) in names  # noqa: E731
        linear = lambda short: self._linear(p + short, device)  # noqa: E731
        norm = lambda short: self._norm(p + short, device)  # noqa: E731
        attn = Attention(
            q=linear("self_attn.q_proj.weight"),
            k=linear("self_attn.k_proj.weight") if spec.owns_kv else None,
            v=linear("self_attn.v_proj.weight") if spec.owns_kv and not spec.k_eq_v else None,
            o=linear("self_attn.o_proj.weight"),
            q_norm=norm("self_attn.q_norm.weight"),
            k_norm=norm("self_attn.k_norm.weight") if spec.owns_kv else None,
            v_norm=self.spec.family == "gemma4",
        )
        norms = {key: norm(f"{key}_layernorm.weight") for key in ("input", "post_attention", "pre_feedforward", "post_feedforward")}
        mlp = {key: linear(f"mlp.{key}_proj.weight") for key in ("gate", "up", "down")}
        per_layer = None
        if self.spec.ple_dim:
            per_layer = {"gate": linear("per_layer_input_gate.weight"), "projection": linear("per_layer_projection.weight")}
            norms["post_per_layer_input"] = norm("post_per_layer_input_norm.weight")
        scalar = self.artifact.load_tensor(self._name(p + "layer_scalar"), device, self.dtype) if has("layer_scalar") else None
        moe = None
        if self.experts is not None and has("router.proj.weight"):
            for key in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
                norms[key] = norm(f"{key}.weight")
            router = {"proj": linear("router.proj.weight"),
                      "scale": self.artifact.load_tensor(self._name(p + "router.scale"), device, self.dtype),
                      "per_expert_scale": self.artifact.load_tensor(self._name(p + "router.per_expert_scale"), device,
                                                                    self.dtype)}
            moe = self.experts.block(spec.index, router)
        layer = Layer(spec, attn, norms, mlp, per_layer, scalar, moe)
        return layer.join() if joining(device) else layer

    def _experts(self, settings):
        """The MoE layers' expert store, device cache and counters (runtime/engine/experts.py)."""
        from gemmactl.runtime.engine.expert_settings import ExpertSettings
        from gemmactl.runtime.engine.experts import MoEExperts

        from gemmactl.runtime.engine.experts import MissRule

        placed = self.placement
        settings = settings or ExpertSettings()
        if settings.cache_bytes is None and placed.expert_cache_bytes is not None:
            settings = replace(settings, cache_bytes=placed.expert_cache_bytes)  # auto: the plan's room
        if settings.cpu_share is None and placed.expert_cpu_share is not None:
            settings = replace(settings, cpu_share=placed.expert_cpu_share)  # auto: the plan's split
        if settings.rule is None and placed.link_bytes_s and placed.host_bytes_s:
            settings = replace(settings, rule=MissRule(placed.link_bytes_s, placed.host_bytes_s))  # the plan's prices
        return MoEExperts(self, settings)

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

    def embed_tokens(self, tokens: torch.Tensor, rows_alone: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x [T, H], per-layer inputs [T, L, P] or None) for tokens [T]. rows_alone: each token's
        projection alone, as a one-token step makes it (forward says why)."""
        if rows_alone and tokens.shape[0] > 1:
            rows = [self.embed_tokens(tokens[i:i + 1]) for i in range(tokens.shape[0])]
            return (torch.cat([x for x, _ in rows]),
                    torch.cat([p for _, p in rows]) if rows[0][1] is not None else None)
        x = self._gather(self.embed, tokens) * self.embed_scale  # [T, H]
        if not self.spec.ple_dim:
            return x, None
        n, p = self.spec.n_layers, self.spec.ple_dim
        token_part = (self._gather(self.ple_table, tokens) * self.ple_scale).view(-1, n, p)  # [T, L, P]
        projected = (self.ple_projection(x) * self.spec.hidden ** -0.5).view(-1, n, p)  # [T, L, P]
        projected = rms_norm(projected, self.ple_norm, self.spec.eps)
        return x, (projected + token_part) * 2.0 ** -0.5

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, end: int | None = None,
             all_logits: bool = False, rows_as_decode: bool = False, rows_alone: bool = False) -> torch.Tensor:
        """Run tokens [T] at positions [T] (consecutive, continuing the cache); returns the last
        token's logits [V] in float32.

        end: the last position + 1 when the caller knows it on the host. Attention then reads only
        the slots written so far; without it (a captured graph, whose shapes cannot change) every
        slot is read and the unwritten ones masked. all_logits: every token's logits [T, V] instead.
        rows_as_decode: each token attends as a one-token step at its position would (speculation's
        verify step: _attention says why).
        rows_alone: each token also runs every product and norm on the device alone, as a one-token
        step does (forward says why).
        """
        x, per_layer_inputs = self.embed_tokens(tokens, rows_alone)
        return self.forward(x, per_layer_inputs, positions, end, all_logits, rows_as_decode=rows_as_decode,
                            rows_alone=rows_alone)

    def forward(self, x: torch.Tensor, per_layer_inputs: torch.Tensor | None, positions: torch.Tensor,
                end: int | None = None, all_logits: bool = False, experts_of=None,
                rows_as_decode: bool = False, rows_alone: bool = False) -> torch.Tensor:
        """experts_of: called with each MoE layer's `ExpertCall` (the experts' input and the router's
        choice), returns the experts' sum; by default the layer's block computes it. A captured
        step ends one CUDA graph and begins the next there (runtime/engine/graph_moe.py).

        rows_alone (speculation's verify step on a GPU): layer by layer, each row runs the layer
        alone, as a one-token step does, with `end` as the captured decode step has it (None: every
        slot read, the unwritten masked), and the head takes each row alone. A GPU's kernels give
        a row another rounding in a batch than alone (another kernel for a GEMV than for a few
        rows, other reduction splits), which moves near-ties: greedy speculation must give plain
        decoding's tokens. A layer still runs once for all the rows where it was copied in, so a
        streamed layer crosses the link once a round. Layers on the host run the rows together
        (rows_as_decode): the CPU's kernels give a row the same result in a batch (measured:
        benchmarks/batch_invariance.py)."""
        # Positions, rope rows and per-layer inputs on each device a layer runs on.
        here = {dev: self.inputs_on(dev, positions, per_layer_inputs) for dev in self.devices}
        # A chunk of several tokens runs the host layers on the device too, streamed (see __init__).
        # (Not the verify step's rows: its host layers run on the host, as the decode step's do.)
        chunk = x.shape[0] > 1 and not (rows_as_decode or rows_alone)
        streamer = self.prefill_streamer if chunk and self.prefill_streamer is not None else self.streamer
        if streamer is not None:
            streamer.begin()
        for layer in self.layers:
            s = layer.spec
            staged = streamer is not None and s.index in streamer.staged
            if staged:
                layer = self.staged_layers[s.index][streamer.fetch(s.index)]
            on_host = self.where[s.index] == HOST and not staged
            dev = self.host if on_host else self.device
            x = self.layer_rows(layer, x.to(dev), *here[dev], end, rows_as_decode or rows_alone,
                                rows_alone and not on_host, experts_of)
            if staged:
                streamer.release(s.index)
        return self.logits_of(x, all_logits, rows_alone)

    def layer_rows(self, layer: Layer, x: torch.Tensor, at: torch.Tensor, rope: dict, inputs, end: int | None = None,
                   rows_as_decode: bool = False, rows_alone: bool = False, experts_of=None) -> torch.Tensor:
        """layer_forward over x [T, H]; rows_alone (T > 1): each row alone, with end None (every slot
        read, as a captured one-token step reads them; forward says why). Either way each row
        attends as a one-token step at its position (rows_as_decode) when asked or alone."""
        if rows_alone and x.shape[0] > 1:
            return torch.cat([self.layer_forward(layer, x[i:i + 1], at[i:i + 1],
                                                 {kind: (cos[i:i + 1], sin[i:i + 1]) for kind, (cos, sin) in rope.items()},
                                                 inputs[i:i + 1] if inputs is not None else None, None, False, experts_of)
                              for i in range(x.shape[0])])
        return self.layer_forward(layer, x, at, rope, inputs, end, rows_as_decode or rows_alone, experts_of)

    def inputs_on(self, dev, positions: torch.Tensor, per_layer_inputs: torch.Tensor | None) -> tuple:
        """(positions, rope rows by layer kind, per-layer inputs) on dev, as layer_forward takes them."""
        at = positions.to(dev)
        rope = {kind: rope_rows(at, inv_freq, scaling, self.dtype) for kind, (inv_freq, scaling) in self.rope[dev].items()}
        return at, rope, per_layer_inputs.to(dev) if per_layer_inputs is not None else None

    def logits_of(self, x: torch.Tensor, all_logits: bool = False, rows_alone: bool = False) -> torch.Tensor:
        """The head over the last row of x (every row with all_logits: each alone with rows_alone, as
        a one-token step takes it), soft-capped, in float32."""
        if rows_alone and all_logits and x.shape[0] > 1:
            return torch.stack([self.logits_of(x[i:i + 1]) for i in range(x.shape[0])])
        spec = self.spec
        x = rms_norm((x if all_logits else x[-1:]).to(self.device), self.final_norm, spec.eps)  # [1, H]: the last token's
        logits = self.head(x)  # [1 or T, V]
        logits = logits if all_logits else logits[0]
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits.float()

    def layer_forward(self, layer: Layer, x: torch.Tensor, at: torch.Tensor, rope: dict, inputs, end: int | None = None,
                      rows_as_decode: bool = False, experts_of=None) -> torch.Tensor:
        """One decoder layer over x [T, H] on the device x and its weights are on (inputs_on's
        positions, rope rows and per-layer inputs there)."""
        spec, s = self.spec, layer.spec
        residual = x
        h = rms_norm(x, layer.norms["input"], spec.eps)
        h = self._attention(layer, h, at, rope[s.kind], end, rows_as_decode)
        x = residual + rms_norm(h, layer.norms["post_attention"], spec.eps)
        residual = x
        h = layer.feed_forward(rms_norm(x, layer.norms["pre_feedforward"], spec.eps))
        if layer.moe is not None:  # Gemma 4 MoE: the experts' sum beside the dense MLP's
            weights, chosen = layer.moe.route(x)
            call = ExpertCall(layer.moe, rms_norm(x, layer.norms["pre_feedforward_layernorm_2"], spec.eps), x,
                              weights, chosen)
            experts = experts_of(call) if experts_of is not None else call.run()
            h = (rms_norm(h, layer.norms["post_feedforward_layernorm_1"], spec.eps)
                 + rms_norm(experts, layer.norms["post_feedforward_layernorm_2"], spec.eps))
        x = residual + rms_norm(h, layer.norms["post_feedforward"], spec.eps)
        if layer.per_layer is not None:
            residual = x
            g = F.gelu(layer.per_layer["gate"](x), approximate="tanh") * inputs[:, s.index, :]
            x = residual + rms_norm(layer.per_layer["projection"](g), layer.norms["post_per_layer_input"], spec.eps)
        if layer.layer_scalar is not None:
            x = x * layer.layer_scalar
        return x

    def _attention(self, layer: Layer, h: torch.Tensor, positions: torch.Tensor, rope, end: int | None,
                   rows_as_decode: bool = False) -> torch.Tensor:
        """rows_as_decode (t > 1, speculation's verify step): the rows' keys and values are written
        first, then each row reads the cache exactly as a one-token step at its position does (the
        same slots, the same products in the same order), so its output is that step's bit for bit
        wherever the matrix kernels give a row the same result alone or in a batch (torch's CPU int4
        and int8 kernels do; a real-model test holds the text). Batched, the attention's products take other
        shapes, and a sliding layer's keys another order, whose rounding moved a near-tie of the
        real 270M in bfloat16: greedy speculation must give plain decoding's tokens. Writing the
        rows first is safe: a verify step runs at most k_max + 1 rows, and a ring keeps k_max spare
        slots, so no row overwrites a key an earlier row still reads."""
        s, a, eps = layer.spec, layer.attn, self.spec.eps
        cos, sin = rope
        t = h.shape[0]
        width = s.kv_heads * s.head_dim
        found = a.projections(h, {"q": s.heads * s.head_dim, "k": width, "v": width})
        q = found["q"].reshape(t, s.heads, s.head_dim)  # [T, N, D]
        q = rotate(rms_norm(q, a.q_norm, eps), cos, sin)
        cache = self.caches[s.kv_from]  # a shared cache may live on the other device
        # A host layer's cache stays on the host when a prefill chunk computes the layer on the
        # device: its keys are written there and read back here (a few MB a chunk).
        home, here = cache.device, h.device
        held = cache.slots if end is None else min(cache.slots, end)  # a ring fills slots 0.. first
        turned = None  # the queries turned by the cache's rotation, where the write turned them
        if s.owns_kv:
            k = found["k"].reshape(t, s.kv_heads, s.head_dim)  # [T, K, D]
            v = found["v"].reshape(t, s.kv_heads, s.head_dim) if "v" in found else k
            k = rotate(rms_norm(k, a.k_norm, eps), cos, sin)
            if a.v_norm:
                v = rms_norm(v, None, eps)
            if end is not None and end == t:  # a sequence's first chunk (positions from 0)
                cache.begin(k.to(home), v.to(home))
            if cache.ring and t > 1 and not rows_as_decode:
                # A chunk attends to the ring as it was (the window before it) and to itself, then
                # is written: writing first could overwrite keys its first tokens still need.
                held = cache.slots if end is None else min(cache.slots, end - t)  # slots written before
                old_k, old_v = (part.to(here) for part in cache.read(held))
                new_k, new_v = (part.to(here) for part in cache.space(k.to(home), v.to(home)))  # as the cache gives them
                # Keys the ring holds at the chunk's positions or later are left from a rolled-back
                # speculation: hidden as unwritten (-1), the chunk's own replace them.
                old_pos = cache.pos[:held].to(here)
                old_pos = old_pos.masked_fill(old_pos >= positions[0], -1)
                keys = (torch.cat((old_k, new_k)), torch.cat((old_v, new_v)), torch.cat((old_pos, positions)))
                cache.write(k.to(home), v.to(home), positions.to(home))
                rotation, offset = cache.rotation, cache.value_offset
                return self._scores(layer, q, *keys, positions, rotation.to(here) if rotation is not None else None,
                                    offset.to(here) if offset is not None else None)
            if cache.rotation is not None and not (rows_as_decode and t > 1) \
                    and self._reads_fused(layer, cache, q, held):
                turned = cache.write_turning(q, k, v, positions)  # the queries turned too (one kernel on CUDA)
            else:
                cache.write(k.to(home), v.to(home), positions.to(home))
        if rows_as_decode and t > 1:
            # Each row reads what its one-token step would: the slots written so far where the
            # host knows them (end given), else every slot, the unwritten masked (a captured step).
            ends = [int(p) + 1 for p in positions.tolist()] if end is not None else [cache.slots] * t
            return torch.cat([self._read_and_attend(layer, q[i:i + 1], cache, min(cache.slots, ends[i]),
                                                    positions[i:i + 1]) for i in range(t)])
        return self._read_and_attend(layer, q, cache, held, positions, turned)

    def _reads_fused(self, layer: Layer, cache, q, held: int) -> bool:
        """Whether query rows q read held slots of cache through the fused read (kv_attention.py):
        as many rows as its scores' room takes (kv_modes.fused_rows), else by blocks."""
        rows = q.shape[0]
        return cache.mode != "bf16" and cache.device == q.device and not self.spec.attn_softcap \
            and fused_rows(rows, layer.spec.heads, held) == rows \
            and kv_attention.usable(q.device, rows, layer.spec.head_dim, held)

    def _read_and_attend(self, layer: Layer, q, cache, held: int, positions, turned=None) -> torch.Tensor:
        """The attention of query rows q [T, N, D] over the first held slots of cache, projected
        (turned: q already turned by the cache's rotation, for the fused read)."""
        if self._reads_fused(layer, cache, q, held):
            return self._scores_fused(layer, q, cache, held, positions, turned=turned)
        if cache.mode != "bf16" and held > cache.read_block:
            return self._scores_by_blocks(layer, q, cache, held, positions)
        (k, v), key_positions = cache.read(held), cache.pos[:held]
        rotation, offset = cache.rotation, cache.value_offset
        if k.device != q.device:
            k, v, key_positions = k.to(q.device), v.to(q.device), key_positions.to(q.device)
            rotation = rotation.to(q.device) if rotation is not None else None
            offset = offset.to(q.device) if offset is not None else None
        return self._scores(layer, q, k, v, key_positions, positions, rotation, offset)

    def _scores(self, layer: Layer, q, k, v, key_positions, positions, rotation=None, offset=None) -> torch.Tensor:
        """softmax(q kᵀ · scale + mask) v for q [T, N, D] over k, v [S, K, D]; returns [T, N·D] projected.
        rotation: R when the cache holds keys and values turned by it (kv.py): q is turned the same
        way, and the output turned back. offset [K, D]: the values' centre, added back. The query
        rows go in blocks (spec.score_rows), so the scores held at once stay bounded."""
        s, t = layer.spec, q.shape[0]
        if rotation is not None:
            q = q @ rotation
        rows = score_rows(s.heads, k.shape[0])
        if rows >= t:
            out = self._attend(s, q, k, v, key_positions, positions)
        else:
            out = torch.cat([self._attend(s, q[i:i + rows], k, v, key_positions, positions[i:i + rows])
                             for i in range(0, t, rows)])
        return self._attended(layer, out, rotation, offset)

    def _attended(self, layer: Layer, out: torch.Tensor, rotation, offset) -> torch.Tensor:
        """Attention's output [T, K, g, D] with the values' centre added back, turned back from the
        cache's rotation, projected: [T, N·D]."""
        s, t = layer.spec, out.shape[0]
        if offset is not None:
            out = out + offset[None, :, None, :]
        if rotation is not None:
            out = out @ rotation.T
        return layer.attn.o(out.reshape(t, s.heads * s.head_dim))  # [T, N·D] projected

    def _scores_by_blocks(self, layer: Layer, q, cache, held: int, positions) -> torch.Tensor:
        """_scores over a quantized cache read a block of slots at a time (cache.read_block): each
        block decoded, its scores folded into a running softmax (the running maximum, the sum of
        the weights and the weighted values in float32), so the decoded cache is never held whole
        (kv_modes.READ_BLOCK_BYTES). The same attention as _scores up to float rounding: the
        weights are normalized at the end, not before they meet the values."""
        s, t, groups = layer.spec, q.shape[0], layer.spec.heads // layer.spec.kv_heads
        rotation = cache.rotation.to(q.device) if cache.rotation is not None else None
        offset = cache.value_offset.to(q.device)
        if rotation is not None:
            q = q @ rotation
        qg = q.reshape(t, s.kv_heads, groups, s.head_dim)  # [T, K, g, D]
        most = torch.full((t, s.kv_heads, groups), -torch.inf, dtype=torch.float32, device=q.device)
        total = torch.zeros((t, s.kv_heads, groups), dtype=torch.float32, device=q.device)
        summed = torch.zeros((t, s.kv_heads, groups, s.head_dim), dtype=torch.float32, device=q.device)
        for start in range(0, held, cache.read_block):
            stop = min(held, start + cache.read_block)
            k, v = (x.to(q.device) for x in cache.read_range(start, stop))
            scores = self._masked_scores(s, qg, k, cache.pos[start:stop].to(q.device), positions).float()
            new_most = torch.maximum(most, scores.amax(-1))
            weights = torch.exp(scores - new_most[..., None])  # [T, K, g, B]
            kept = torch.exp(most - new_most)
            total = total * kept + weights.sum(-1)
            summed = summed * kept[..., None] + weighted_values(weights.to(q.dtype), v).float()
            most = new_most
        out = (summed / total[..., None]).to(q.dtype)  # [T, K, g, D]
        return self._attended(layer, out, rotation, offset)

    def _scores_fused(self, layer: Layer, q, cache, held: int, positions, turned=None) -> torch.Tensor:
        """_scores over a quantized cache by the fused read (kv_attention.py): the codes of the first
        held slots read in place, nothing decoded into memory; a few query rows at most. turned:
        q turned by the cache's rotation already (TurboKVCache.write_turning)."""
        s, t, dtype = layer.spec, q.shape[0], q.dtype
        rotation = cache.rotation
        if turned is not None:
            q = turned
        elif rotation is not None:
            q = q @ rotation
        parts = cache.fused_parts(held)
        window = self.spec.window if s.kind == SLIDING and self.spec.window else 0
        out = kv_attention.quantized_attention(
            q.reshape(t, s.kv_heads, s.heads // s.kv_heads, s.head_dim), *parts["k"], *parts["v"], cache.pos[:held],
            positions, parts["k_bits"], parts["v_bits"], float(self.spec.query_scale), int(window))
        return self._attended(layer, out.to(dtype), rotation, cache.value_offset)

    def _masked_scores(self, s, qg, k, key_positions, positions) -> torch.Tensor:
        """q·k scaled (soft-capped where the model does), unseen keys at the dtype's minimum:
        [T, K, g, S] for query rows qg [T, K, g, D] at positions [T]."""
        spec = self.spec
        scores = key_scores(qg, k) * spec.query_scale  # [T, K, g, S]
        if spec.attn_softcap:
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
        seen = key_positions[None, :] <= positions[:, None]  # [T, S] causal (and written: -1 < any position)
        seen &= key_positions[None, :] >= 0
        if s.kind == SLIDING and spec.window:
            seen &= key_positions[None, :] > positions[:, None] - spec.window
        return scores.masked_fill(~seen[:, None, None, :], torch.finfo(scores.dtype).min)

    def _attend(self, s, q, k, v, key_positions, positions) -> torch.Tensor:
        """[T, K, g, D]: the attention of query rows q [T, N, D] at positions [T] over the keys."""
        t, groups = q.shape[0], s.heads // s.kv_heads
        qg = q.reshape(t, s.kv_heads, groups, s.head_dim)  # [T, K, g, D]
        scores = self._masked_scores(s, qg, k, key_positions, positions)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return weighted_values(weights, v)  # [T, K, g, D]

    def memory(self) -> dict:
        """Bytes by place: weights on the device and in host memory, the staging areas, KV caches,
        and what crosses the host link per decoded token (streamed layers, table rows, and the
        activations into and out of host layers)."""
        def size(t) -> int:
            return t.numel() * t.element_size() if t is not None else 0

        where = {"device": 0, "host": 0}
        for layer in self.layers:
            place = "host" if self.where[layer.spec.index] == HOST else "device"
            where[place] += sum(lin.nbytes() for lin in layer.linears().values())
            where[place] += sum(size(n) for n in (*layer.norms.values(), layer.attn.q_norm, layer.attn.k_norm,
                                                  layer.layer_scalar))
        streamed = self.streamer.bytes_per_step if self.streamer is not None else 0
        where["host"] += streamed
        if self.prefill_streamer is not None:  # the host layers' device layout, for prefill chunks
            where["host"] += sum(item.nbytes for index, item in self.prefill_streamer.staged.items()
                                 if self.where[index] == HOST)
        tables = [self.embed] + ([self.ple_table] if self.spec.ple_dim else [])
        row_bytes = 0
        for _, data, scales in tables:
            where["host" if self.placement.tables_on_host else "device"] += size(data) + size(scales)
            row_bytes += data.shape[1] * data.element_size() + (scales.element_size() if scales is not None else 0)
        where["device"] += self.head.nbytes() + (self.ple_projection.nbytes() if self.spec.ple_dim else 0)
        kv = {"device": 0, "host": 0}
        for index, cache in self.caches.items():
            kv["host" if cache.device.type == "cpu" and self.device.type != "cpu" else "device"] += cache.nbytes()
        crossings = sum(1 for a, b in zip((RESIDENT,) + self.where, self.where + (RESIDENT,))
                        if (a == HOST) != (b == HOST))
        link = streamed + (row_bytes if self.placement.tables_on_host else 0) + crossings * self.spec.hidden * 2
        staging = self.prefill_streamer or self.streamer  # (they share their areas)
        return {"weights_device_bytes": where["device"], "weights_host_bytes": where["host"],
                "staging_bytes": staging.staging_bytes if staging is not None else 0,
                "kv_device_bytes": kv["device"], "kv_host_bytes": kv["host"], "link_bytes_per_token": link}
