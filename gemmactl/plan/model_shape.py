"""The shape facts placement needs (layers, KV heads, windows, experts), from a config or a GGUF header.

Gemma 3 and Gemma 4 text models. Gemma 4 specifics: full-attention layers use
`global_head_dim` (and `num_global_key_value_heads` when K = V), the last
`num_kv_shared_layers` layers read an earlier layer's KV and hold none, E2B/E4B add
per-layer embeddings, 26B-A4B adds an expert block next to the dense MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

from gemmactl.errors import UnsupportedModelError
from gemmactl.formats.int4.spec import HEAD_NAME

SUPPORTED = ("gemma3", "gemma4")
_MODEL_TYPES = {"gemma3": "gemma3", "gemma3_text": "gemma3", "gemma4": "gemma4", "gemma4_text": "gemma4"}


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # gemma3 | gemma4
    n_layers: int
    hidden: int
    vocab: int
    n_heads: int
    intermediate: int
    sliding: tuple[bool, ...]
    kv_heads: tuple[int, ...]  # per layer; 0 = KV shared from an earlier layer
    head_dim_k: tuple[int, ...]
    head_dim_v: tuple[int, ...]
    sliding_window: int
    max_context: int
    tied_output: bool = True
    n_experts: int = 0
    experts_used: int = 0
    moe_intermediate: int = 0
    per_layer_hidden: int = 0  # Gemma 4 per-layer embedding width (0 = none)
    per_layer_vocab: int = 0
    kv_shared_layers: int = 0
    k_eq_v: bool = False
    double_wide_mlp: bool = False
    global_head_dim: int = 0
    global_kv_heads: int = 0
    head_dim: int = 0


def _text_config(config: dict) -> tuple[str, dict]:
    model_type = str(config.get("model_type", ""))
    if model_type in ("gemma3", "gemma4") and isinstance(config.get("text_config"), dict):
        text = dict(config["text_config"])
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        return _MODEL_TYPES[model_type], text
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type], config
    named = model_type or (config.get("architectures") or ["no model_type"])[0]
    raise UnsupportedModelError(
        f"unknown architecture '{named}': plan knows Gemma 3 and Gemma 4 ({', '.join(sorted(_MODEL_TYPES))})",
        hint="Pass a Gemma 3 or Gemma 4 model.",
    )


def _layer_types(text: dict, n_layers: int, default_pattern: int) -> list[bool]:
    types = text.get("layer_types")
    if types:
        return [t == "sliding_attention" for t in types]
    pattern = int(text.get("sliding_window_pattern") or default_pattern)
    return [bool((i + 1) % pattern) for i in range(n_layers)]


# Config fields read as whole numbers (a missing one takes its default).
_WHOLE_NUMBERS = (
    "num_hidden_layers", "hidden_size", "head_dim", "num_key_value_heads", "global_head_dim",
    "num_global_key_value_heads", "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size",
    "num_attention_heads", "intermediate_size", "sliding_window", "max_position_embeddings", "num_experts",
    "top_k_experts", "moe_intermediate_size", "vocab_size_per_layer_input",
)


def shape_from_config(config: dict) -> ModelShape:
    """Shape facts from a config.json (a Gemma 3/4 text config, or one holding a text_config)."""
    arch, text = _text_config(config)
    for key in _WHOLE_NUMBERS:
        value = text.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise UnsupportedModelError(f"config.json: {key} must be a whole number, got {value!r}",
                                        hint="Fix the config, or use the checkpoint's original config.json.")
    if "hidden_size" not in text:
        raise UnsupportedModelError("config.json has no hidden_size", hint="Use the checkpoint's original config.json.")
    try:
        return _shape(arch, text)
    except (TypeError, ValueError, AttributeError) as exc:  # a field of an unexpected shape
        raise UnsupportedModelError(f"config.json cannot be read as a {arch} config: {exc}",
                                    hint="Use the checkpoint's original config.json.") from exc


def _shape(arch: str, text: dict) -> ModelShape:
    n_layers = int(text.get("num_hidden_layers", 0))
    if n_layers <= 0:
        raise UnsupportedModelError("the config has no num_hidden_layers")
    sliding = _layer_types(text, n_layers, 6)
    if arch == "gemma4":
        sliding[-1] = False  # transformers forces the last Gemma 4 layer to full attention
    head_dim = int(text.get("head_dim", 256))
    kv = int(text.get("num_key_value_heads", 1))
    global_dim = int(text.get("global_head_dim", 512)) if arch == "gemma4" else head_dim
    k_eq_v = bool(text.get("attention_k_eq_v", False)) if arch == "gemma4" else False
    global_kv = int(text.get("num_global_key_value_heads") or kv) if k_eq_v else kv
    shared = int(text.get("num_kv_shared_layers", 0) or 0) if arch == "gemma4" else 0
    # transformers 5.23 saves the full-attention overrides as per_layer_config {"05": {"head_dim": 512}}
    # instead of global_head_dim / num_global_key_value_heads; the released configs use the latter.
    overrides = {int(k): v for k, v in (text.get("per_layer_config") or {}).items() if str(k).isdigit()}
    kv_heads, dims = [], []
    for i, is_sliding in enumerate(sliding):
        if overrides or "per_layer_config" in text:
            layer = overrides.get(i, {})
            heads, dim = int(layer.get("num_key_value_heads", kv)), int(layer.get("head_dim", head_dim))
        else:
            heads, dim = (kv, head_dim) if is_sliding else (global_kv, global_dim)
        kv_heads.append(0 if i >= n_layers - shared else heads)
        dims.append(dim)
    moe = arch == "gemma4" and bool(text.get("enable_moe_block", False))
    ple = int(text.get("hidden_size_per_layer_input", 0) or 0) if arch == "gemma4" else 0
    return ModelShape(
        architecture=arch,
        n_layers=n_layers,
        hidden=int(text["hidden_size"]),
        vocab=int(text.get("vocab_size", 262_144)),
        n_heads=int(text.get("num_attention_heads", 8)),
        intermediate=int(text.get("intermediate_size", 0)),
        sliding=tuple(sliding),
        kv_heads=tuple(kv_heads),
        head_dim_k=tuple(dims),
        head_dim_v=tuple(dims),
        sliding_window=int(text.get("sliding_window", 512) or 0),
        max_context=int(text.get("max_position_embeddings", 131_072)),
        tied_output=bool(text.get("tie_word_embeddings", True)),
        n_experts=int(text.get("num_experts") or 0) if moe else 0,
        experts_used=int(text.get("top_k_experts") or 0) if moe else 0,
        moe_intermediate=int(text.get("moe_intermediate_size") or 0) if moe else 0,
        per_layer_hidden=ple,
        per_layer_vocab=int(text.get("vocab_size_per_layer_input", 262_144)) if ple else 0,
        kv_shared_layers=shared,
        k_eq_v=k_eq_v,
        double_wide_mlp=bool(text.get("use_double_wide_mlp", False)) if arch == "gemma4" else False,
        global_head_dim=global_dim,
        global_kv_heads=global_kv,
        head_dim=head_dim,
    )


def _per_layer(value, n: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value or 0)] * n


def shape_from_gguf(header) -> ModelShape:
    """Shape facts from a GGUF header's metadata, with KV-holding layers read off the tensor list."""
    arch = header.architecture
    if arch not in SUPPORTED:
        raise UnsupportedModelError(
            f"unknown architecture '{arch}' in {header.path.name}: plan knows {', '.join(SUPPORTED)}",
            hint="Pass a Gemma 3 or Gemma 4 GGUF.",
        )
    key = header.arch_key
    n_layers = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(v) for v in pattern]
    else:
        every = int(pattern) if pattern else 6  # llama.cpp's Gemma 3 pattern: 5 sliding, 1 full
        sliding = [bool((i + 1) % every) for i in range(n_layers)]
    heads_kv = _per_layer(key("attention.head_count_kv", 1), n_layers)
    dim_full = int(key("attention.key_length", 256))
    dim_swa = int(key("attention.key_length_swa", dim_full))
    vdim_full = int(key("attention.value_length", dim_full))
    vdim_swa = int(key("attention.value_length_swa", dim_swa))
    names = {t.name for t in header.tensors}
    holds_kv = [f"blk.{i}.attn_k.weight" in names or f"blk.{i}.attn_qkv.weight" in names for i in range(n_layers)]
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    n_experts = int(key("expert_count", 0) or 0)
    ff = key("feed_forward_length", 0)
    return ModelShape(
        architecture=arch,
        n_layers=n_layers,
        hidden=int(key("embedding_length")),
        vocab=int(embd.shape[1]) if embd else 262_144,
        n_heads=_per_layer(key("attention.head_count", 8), n_layers)[0],
        intermediate=max(_per_layer(ff, n_layers)) if ff else 0,
        sliding=tuple(sliding),
        kv_heads=tuple(h if kv else 0 for h, kv in zip(heads_kv, holds_kv)),
        head_dim_k=tuple(dim_swa if s else dim_full for s in sliding),
        head_dim_v=tuple(vdim_swa if s else vdim_full for s in sliding),
        sliding_window=int(key("attention.sliding_window", 0) or 0),
        max_context=int(key("context_length", 0) or 0),
        tied_output="output.weight" not in names,
        n_experts=n_experts,
        experts_used=int(key("expert_used_count", 0) or 0),
        moe_intermediate=int(key("expert_feed_forward_length", 0) or 0) if n_experts else 0,
        per_layer_hidden=int(key("embedding_length_per_layer_input", 0) or 0),
        kv_shared_layers=int(key("attention.shared_kv_layers", 0) or 0),
        global_head_dim=dim_full,
        head_dim=dim_swa,
    )


def tensors_from_config(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """The text model's tensors (transformers names, torch shapes) a checkpoint of this config holds."""
    h, tensors = shape.hidden, []
    prefix = "model"
    tensors.append((f"{prefix}.embed_tokens.weight", (shape.vocab, h)))
    n = shape.n_layers
    first_shared = n - shape.kv_shared_layers
    for i in range(n):
        p = f"{prefix}.layers.{i}"
        hd = shape.head_dim_k[i]
        kv = shape.kv_heads[i]
        tensors += [(f"{p}.self_attn.q_proj.weight", (shape.n_heads * hd, h)), (f"{p}.self_attn.q_norm.weight", (hd,))]
        if i < first_shared:
            tensors += [(f"{p}.self_attn.k_proj.weight", (kv * hd, h)), (f"{p}.self_attn.k_norm.weight", (hd,))]
            if not (shape.k_eq_v and not shape.sliding[i]):
                tensors.append((f"{p}.self_attn.v_proj.weight", (kv * hd, h)))
        tensors.append((f"{p}.self_attn.o_proj.weight", (h, shape.n_heads * hd)))
        ff = shape.intermediate * (2 if shape.double_wide_mlp and i >= first_shared else 1)
        tensors += [
            (f"{p}.mlp.gate_proj.weight", (ff, h)),
            (f"{p}.mlp.up_proj.weight", (ff, h)),
            (f"{p}.mlp.down_proj.weight", (h, ff)),
        ]
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        tensors += [(f"{p}.{norm}.weight", (h,)) for norm in norms]
        if shape.architecture == "gemma4":
            tensors.append((f"{p}.layer_scalar", (1,)))
        if shape.per_layer_hidden:
            tensors += [
                (f"{p}.per_layer_input_gate.weight", (shape.per_layer_hidden, h)),
                (f"{p}.per_layer_projection.weight", (h, shape.per_layer_hidden)),
                (f"{p}.post_per_layer_input_norm.weight", (h,)),
            ]
        if shape.n_experts:
            e, f = shape.n_experts, shape.moe_intermediate
            tensors += [
                (f"{p}.router.scale", (h,)),
                (f"{p}.router.per_expert_scale", (e,)),
                (f"{p}.router.proj.weight", (e, h)),
                (f"{p}.experts.gate_up_proj", (e, 2 * f, h)),
                (f"{p}.experts.down_proj", (e, h, f)),
            ]
            tensors += [(f"{p}.{norm}.weight", (h,)) for norm in
                        ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")]
    tensors.append((f"{prefix}.norm.weight", (h,)))
    if shape.per_layer_hidden:
        width = n * shape.per_layer_hidden
        tensors += [
            (f"{prefix}.embed_tokens_per_layer.weight", (shape.per_layer_vocab, width)),
            (f"{prefix}.per_layer_model_projection.weight", (width, h)),
            (f"{prefix}.per_layer_projection_norm.weight", (shape.per_layer_hidden,)),
        ]
    if not shape.tied_output:
        tensors.append((HEAD_NAME, (shape.vocab, h)))
    return tensors
