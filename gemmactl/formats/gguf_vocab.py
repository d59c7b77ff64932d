"""Hugging Face tokenizer files rebuilt from a Gemma vocabulary GGUF (e.g. llama.cpp's ggml-vocab-gemma-4.gguf)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import NotAGGUFError, UnsupportedModelError

# tokenizer.ggml.model values whose vocabulary is SPM-style BPE ("▁" for spaces, <0xXX> byte fallback).
GEMMA_TOKENIZER_MODELS = ("gemma4",)

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Types llama.cpp matches in raw text only when asked to parse special tokens.
SPECIAL_TYPES = (CONTROL, UNKNOWN)

# tokenizer_config.json key → GGUF metadata key of its token id.
SPECIAL_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "mask_token": "tokenizer.ggml.mask_token_id",
}


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer part of a GGUF: token texts, their llama.cpp types, merges and special tokens."""

    model: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]
    add_bos: bool
    chat_template: str | None


def read_gguf_vocab(vocab_gguf: Path) -> GgufVocab:
    """Read the tokenizer metadata of a GGUF file (tensor data, if any, is not touched)."""
    from gemmactl.formats.gguf_header import read_gguf_header

    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    metadata = read_gguf_header(Path(vocab_gguf), arrays=arrays, tensors=False).metadata

    def value(key: str, default=None):
        return metadata.get(key, default)

    model = value("tokenizer.ggml.model")
    if model not in GEMMA_TOKENIZER_MODELS:
        raise UnsupportedModelError(
            f"{vocab_gguf}: tokenizer model {model!r} is not a Gemma 4 BPE vocabulary",
            hint="Pass a Gemma 4 vocabulary such as llama.cpp's models/ggml-vocab-gemma-4.gguf.",
        )
    tokens, merges = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise UnsupportedModelError(f"{vocab_gguf}: the GGUF has no tokenizer tokens or no merges")
    ids = {name: value(key) for name, key in SPECIAL_KEYS.items()}
    return GgufVocab(
        model=model,
        tokens=tokens,
        token_types=value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens),
        merges=merges,
        special_ids={name: i for name, i in ids.items() if i is not None and 0 <= i < len(tokens)},
        add_bos=bool(value("tokenizer.ggml.add_bos_token", True)),
        chat_template=value("tokenizer.chat_template"),
    )


def build_tokenizer(vocab: GgufVocab):
    """A tokenizers.Tokenizer that splits text exactly as llama.cpp's gemma4 tokenizer does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    # Split each "a b" where llama.cpp does: at the first space after the first character.
    cuts = [merge.find(" ", 1) for merge in vocab.merges]
    if min(cuts, default=0) < 0:
        raise UnsupportedModelError(f"a merge of the vocabulary has no space: {vocab.merges[cuts.index(-1)]!r}")
    pairs = [(merge[:cut], merge[cut + 1 :]) for merge, cut in zip(vocab.merges, cuts)]
    unk = vocab.tokens[vocab.special_ids["unk_token"]] if "unk_token" in vocab.special_ids else None
    model = BPE(
        vocab={text: i for i, text in enumerate(vocab.tokens)},
        merges=pairs,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    # llama.cpp escapes spaces to "▁" with no prefix space, then runs BPE on each run of newlines
    # and each run of other text separately (regex "[^\n]+|[\n]+"). transformers' GemmaTokenizer
    # rebuilds this pipeline without the newline split; no Gemma 4 merge mixes newlines with other
    # characters, so both give the same ids.
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_tokens(
        [
            # Control tokens are special (skipped on decode, kept as text with split_special_tokens,
            # as llama.cpp does without parse_special); user-defined ones always match and show.
            AddedToken(text, special=kind in SPECIAL_TYPES, normalized=False)
            for text, kind in zip(vocab.tokens, vocab.token_types)
            if kind in (*SPECIAL_TYPES, USER_DEFINED)
        ]
    )
    if vocab.add_bos and "bos_token" in vocab.special_ids:
        bos_id = vocab.special_ids["bos_token"]
        bos = vocab.tokens[bos_id]
        # The template transformers itself builds for add_bos_token.
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def tokenizer_config(vocab: GgufVocab) -> dict:
    """tokenizer_config.json for the vocabulary: special tokens, BOS policy, class and chat template."""
    named = {name: vocab.tokens[i] for name, i in vocab.special_ids.items()}
    named_ids = set(vocab.special_ids.values())
    # The other control tokens are listed as special so that gguf.LlamaHfVocab (which types a token
    # CONTROL only when it is in all_special_ids) gives them the control type again; as normal tokens
    # llama.cpp would split "<|turn>" in a prompt into pieces.
    kinds = enumerate(zip(vocab.tokens, vocab.token_types))
    extra = [text for i, (text, kind) in kinds if kind in SPECIAL_TYPES and i not in named_ids]
    config = {
        # transformers maps no tokenizer to gemma4; GemmaTokenizer is its "▁"-space, byte-fallback BPE
        # class for the other Gemmas, and AutoTokenizer loads it from this key.
        "tokenizer_class": "GemmaTokenizer",
        **named,
        # transformers 5 reads this key as its list of extra special tokens; 4.x wants a dict under
        # the newer name, so the older name keeps both working.
        "additional_special_tokens": extra,
        "add_bos_token": vocab.add_bos,
        "add_eos_token": False,
        # Decoding must give back the text as llama.cpp pieces it, without English space clean-up.
        "clean_up_tokenization_spaces": False,
    }
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    return config


def write_hf_vocab(vocab: GgufVocab, out_dir: Path) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json (and chat_template.jinja)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "tokenizer.json"]
    build_tokenizer(vocab).save(str(written[0]))
    config = tokenizer_config(vocab)
    written.append(out_dir / "tokenizer_config.json")
    written[-1].write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special_map = {key: config[key] for key in (*SPECIAL_KEYS, "additional_special_tokens") if key in config}
    written.append(out_dir / "special_tokens_map.json")
    written[-1].write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if vocab.chat_template:
        written.append(out_dir / "chat_template.jinja")
        written[-1].write_text(vocab.chat_template, encoding="utf-8")
    return written


def write_hf_tokenizer(vocab_gguf: Path, out_dir: Path) -> list[Path]:
    """Write Hugging Face tokenizer files for the vocabulary in vocab_gguf into out_dir; returns the paths."""
    return write_hf_vocab(read_gguf_vocab(vocab_gguf), out_dir)
