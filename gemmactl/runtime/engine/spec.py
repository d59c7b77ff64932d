"""The shape of a Gemma 3 / Gemma 4 text model as the engine runs it, read from an int4-stream artifact.

Per-layer facts come from the stored tensors themselves (head sizes from q_proj and k_proj, which
layers own a KV cache from whether they have k_proj), so the engine does not depend on how a
transformers version spells them in the config. What only the config knows (layer types, window,
norms' eps, scalings, rope) comes from the config, read through transformers' own classes.

Axes used in shape comments across the engine: T = tokens in a step, H = hidden size,
N = attention heads, K = KV heads, D = head dim, S = cache slots, V = vocabulary,
L = layers, P = per-layer-input width.
"""

from __future__ import annotations

from dataclasses import dataclass

from gemmactl.errors import UnsupportedModelError
from gemmactl.formats.int4.spec import HEAD_NAME

SLIDING, FULL = "sliding_attention", "full_attention"
FAMILIES = {"gemma3": "gemma3", "gemma3_text": "gemma3", "gemma4": "gemma4", "gemma4_text": "gemma4"}


# Attention materializes its scores: bfloat16 scores, their masked copy and the float32 softmax,
# 8 bytes a score. A prefill chunk's query rows are taken in blocks whose scores stay under
# SCORES_BLOCK_BYTES, so the working area does not grow with the context (a 256-token chunk of
# an E4B shape against a 32K cache would hold 512 MiB of scores at once).
SCORE_BYTES = 8
SCORES_BLOCK_BYTES = 32 << 20


def score_rows(heads: int, slots: int) -> int:
    """How many query rows attention takes at once against slots keys with heads heads."""
    return max(1, SCORES_BLOCK_BYTES // max(heads * slots * SCORE_BYTES, 1))


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str  # SLIDING or FULL: its mask and its rope
    heads: int  # N
    head_dim: int  # D
    kv_heads: int  # K
    kv_from: int  # the layer whose KV cache it reads: itself, or the producer it shares with
    k_eq_v: bool  # values are the keys' projection (Gemma 4 MoE global layers)

    @property
    def owns_kv(self) -> bool:
        return self.kv_from == self.index


@dataclass(frozen=True)
class ModelSpec:
    family: str  # gemma3 | gemma4
    hidden: int
    vocab: int
    layers: tuple[LayerSpec, ...]
    window: int  # sliding window: keys in (position - window, position]
    eps: float
    norm_plus_one: bool  # Gemma 3 RMSNorm scales by (1 + w), Gemma 4 by w
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    ple_dim: int  # P, Gemma 4 per-layer inputs (0: none)
    moe: bool
    tied: bool

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def hf_text_config(config: dict):
    """The artifact's config as transformers' text config object (gemma3 → Gemma3TextConfig, ...)."""
    from transformers import AutoConfig

    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"the engine runs Gemma 3 and Gemma 4 text models, and this artifact is a {model_type!r} model",
            hint="Quantize a Gemma 3 or Gemma 4 checkpoint.",
        )
    hf = AutoConfig.for_model(model_type, **values)
    return hf.get_text_config() if hasattr(hf, "get_text_config") else hf


def artifact_spec(artifact) -> ModelSpec:
    """The model's shape from an open int4-stream artifact (its config and its records' shapes,
    a stacked record's whole stack)."""
    return model_spec(artifact.config, {r.name: (r.stack_shape or r.shape) for r in artifact.records})


def model_spec(config: dict, shapes: dict[str, tuple[int, ...]]) -> ModelSpec:
    """The engine's view of a model: config facts, and per-layer sizes from the tensors' shapes."""
    hf = hf_text_config(config)
    family = FAMILIES[hf.model_type]
    prefix = "model." if any(name.startswith("model.layers.") for name in shapes) else ""
    n = hf.num_hidden_layers
    kinds = list(hf.layer_types)
    heads = hf.num_attention_heads
    moe = bool(getattr(hf, "enable_moe_block", False))
    owners = [f"{prefix}layers.{i}.self_attn.k_proj.weight" in shapes for i in range(n)]
    layers = []
    for i in range(n):
        q = shapes.get(f"{prefix}layers.{i}.self_attn.q_proj.weight")
        if q is None:
            raise UnsupportedModelError(f"layer {i} of the artifact has no q_proj weight", hint="Make the artifact again.")
        head_dim = q[0] // heads
        if owners[i]:
            kv_from = i
            kv_heads = shapes[f"{prefix}layers.{i}.self_attn.k_proj.weight"][0] // head_dim
        else:  # reads the last earlier layer of its kind that keeps a cache (Gemma 4 KV sharing)
            kv_from = next((j for j in range(i - 1, -1, -1) if owners[j] and kinds[j] == kinds[i]), None)
            if kv_from is None:
                raise UnsupportedModelError(f"layer {i} shares a KV cache that no earlier {kinds[i]} layer keeps")
            kv_heads = layers[kv_from].kv_heads
        k_eq_v = owners[i] and f"{prefix}layers.{i}.self_attn.v_proj.weight" not in shapes
        layers.append(LayerSpec(i, kinds[i], heads, head_dim, kv_heads, kv_from, k_eq_v))
    if family == "gemma3":
        query_scale = float(hf.query_pre_attn_scalar) ** -0.5
    else:
        query_scale = 1.0  # Gemma 4 normalizes q and k; its attention does not scale again
    ple = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0) if family == "gemma4" else 0
    return ModelSpec(
        family=family,
        hidden=hf.hidden_size,
        vocab=hf.vocab_size,
        layers=tuple(layers),
        window=int(hf.sliding_window or 0),
        eps=float(hf.rms_norm_eps),
        norm_plus_one=family == "gemma3",
        query_scale=query_scale,
        attn_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
        ple_dim=ple,
        moe=moe,
        tied=HEAD_NAME not in shapes,
    )


def yarn_config(config: dict, factor: float) -> dict:
    """The config with YaRN rope scaling by factor on the global-attention layers (their original
    context: the model's max_position_embeddings), as transformers' "yarn" rope type defines it."""
    from gemmactl.errors import InvalidOptionError

    if not factor or factor < 1:
        raise InvalidOptionError(f"a YaRN factor must be at least 1, got {factor}", hint="Give e.g. --yarn 4.")
    hf = hf_text_config(config)
    if FULL not in hf.layer_types:
        raise UnsupportedModelError("a YaRN factor scales the rope of the global-attention layers, and this model has none",
                                    hint="Drop the YaRN factor: its sliding layers never see past their window.")
    params = {kind: dict(values) for kind, values in hf.rope_parameters.items()}
    full = params[FULL]
    if full.get("rope_type", "default") not in ("default", "yarn"):
        raise UnsupportedModelError(
            f"YaRN on the {full['rope_type']!r} rope of this model's global layers is not supported yet",
            hint="YaRN applies to global layers with the default rope (Gemma 3); run without the factor.")
    params[FULL] = {"rope_type": "yarn", "factor": float(factor), "rope_theta": full["rope_theta"],
                    "original_max_position_embeddings": int(hf.max_position_embeddings)}
    return {**config, "rope_parameters": params, "max_position_embeddings": int(hf.max_position_embeddings * factor)}


def rope_frequencies(config: dict, yarn: float | None = None) -> dict:
    """The rope of each layer kind: {kind: (inverse frequencies, float32 [D/2]; attention scaling)}.

    As transformers' rotary modules for Gemma 3 and 4 take them: from its own rope functions
    (default, Gemma 4's proportional partial rope, linear or YaRN scaling), each layer kind with its
    own head dimension. Only the rope functions are imported: the modeling modules that hold those
    rotary classes cost seconds of every start. yarn: a factor for yarn_config.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_text_config(yarn_config(config, yarn) if yarn else config)
    out = {}
    for kind in sorted(set(hf.layer_types)):
        params = hf.rope_parameters[kind]
        # Gemma 4's layer kinds have their own head dimensions: the config resolved for the kind.
        kind_config = hf.per_layer_config[kind] if hasattr(hf, "per_layer_config") else hf
        if params["rope_type"] == "default":
            inv_freq, scaling = _default_rope(kind_config, kind)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](kind_config, None, layer_type=kind)
        out[kind] = (inv_freq.float(), float(scaling))
    return out


def rope_rows(positions, inv_freq, scaling: float, dtype):
    """cos and sin [T, D] for positions [T], computed where they are (as the rotary modules do):
    products and cos/sin in float32, rounded once to the compute dtype. The engine makes the rows
    of each step's positions rather than keeping tables for the whole context, which would grow
    with it (96 MiB of bfloat16 for an E4B shape at 32K tokens, on the GPU)."""
    import torch

    freqs = positions.float().unsqueeze(-1) * inv_freq  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def _default_rope(config, kind: str):
    """The original rope's inverse frequencies (as the rotary modules' default), and no scaling."""
    import torch

    base = config.rope_parameters[kind]["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
