"""Tokenizer files rebuilt from llama.cpp's Gemma 4 vocabulary GGUF tokenize exactly as llama.cpp does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmactl.errors import NotAGGUFError, UnsupportedModelError
from gemmactl.formats.gguf_vocab import (
    CONTROL,
    USER_DEFINED,
    read_gguf_vocab,
    write_hf_tokenizer,
    write_hf_vocab,
)

# The separator llama.cpp's tests/test-tokenizer-0.cpp splits the .inp file on.
VECTOR_SEPARATOR = "\n__ggml_vocab_test__\n"
# Tokens convert_hf_to_gguf.py (Gemma4Model.set_vocab) forces to USER_DEFINED whatever the tokenizer says.
CONVERTER_VISIBLE_TOKENS = {
    "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'
}


def read_test_vectors(vocab_gguf: Path) -> dict[str, list[int]]:
    """The .inp/.out vectors next to a vocabulary, parsed as test-tokenizer-0.cpp's read_tests does."""
    raw = vocab_gguf.with_name(vocab_gguf.name + ".inp").read_bytes().decode("utf-8")
    inputs, pos = [], 0
    while pos < len(raw):
        cut = raw.find(VECTOR_SEPARATOR, pos)
        if cut < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:cut])
        pos = cut + len(VECTOR_SEPARATOR)
    out = vocab_gguf.with_name(vocab_gguf.name + ".out").read_bytes().decode("utf-8")
    lines = out.split("\n")[:-1] if out.endswith("\n") else out.split("\n")  # std::getline
    assert len(inputs) == len(lines), "input and output files have different numbers of tests"
    # A std::map in the C++ test: a repeated input keeps its last expectation.
    return {text: [int(tok) for tok in line.split()] for text, line in zip(inputs, lines)}


@pytest.fixture(scope="session")
def vocab_gguf(gemma4_vocab) -> Path:
    """The vocabulary of the llama.cpp source `gemmactl build` uses (conftest.py: llama_source)."""
    return gemma4_vocab


@pytest.fixture(scope="session")
def gguf_vocab(vocab_gguf):
    return read_gguf_vocab(vocab_gguf)


@pytest.fixture(scope="session")
def written(gguf_vocab, tmp_path_factory) -> list[Path]:
    return write_hf_vocab(gguf_vocab, tmp_path_factory.mktemp("gemma4-tokenizer"))


@pytest.fixture(scope="session")
def hf_dir(written) -> Path:
    return written[0].parent


@pytest.fixture(scope="session")
def hf_tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="session")
def llama(vocab_gguf):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(vocab_gguf), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def vectors(vocab_gguf) -> dict[str, list[int]]:
    return read_test_vectors(vocab_gguf)


def test_reads_the_gemma4_vocabulary(gguf_vocab):
    assert gguf_vocab.model == "gemma4"
    assert len(gguf_vocab.tokens) == len(gguf_vocab.token_types) == 262_144
    assert len(gguf_vocab.merges) == 514_906
    assert gguf_vocab.special_ids == {"bos_token": 2, "eos_token": 1, "unk_token": 3, "pad_token": 0, "mask_token": 4}
    assert gguf_vocab.add_bos is True
    assert "<|turn>" in gguf_vocab.chat_template


def test_writes_the_tokenizer_files(written, hf_dir, gguf_vocab, hf_tokenizer):
    assert sorted(p.name for p in written) == sorted(
        ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
    )
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "GemmaTokenizer"
    assert config["add_bos_token"] is True
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert config["chat_template"] == gguf_vocab.chat_template
    assert (hf_dir / "chat_template.jinja").read_text(encoding="utf-8") == gguf_vocab.chat_template
    assert hf_tokenizer.chat_template == gguf_vocab.chat_template
    assert type(hf_tokenizer).__name__ == "GemmaTokenizer"


def test_transformers_reproduces_llama_cpp_test_vectors(vectors, hf_tokenizer):
    assert len(vectors) > 40
    failures = []
    for text, expected in vectors.items():
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        decoded = hf_tokenizer.decode(ids)
        if ids != expected or decoded != text:
            failures.append(f"{text!r}: expected {expected}, got {ids}, decoded {decoded!r}")
    assert not failures, "\n".join(failures)


def test_tokenizer_json_alone_reproduces_the_test_vectors(vectors, hf_dir):
    # transformers rebuilds GemmaTokenizer's pipeline; plain `tokenizers` users get the file's own.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    failures = [
        f"{text!r}: expected {expected}, got {ids}"
        for text, expected in vectors.items()
        if (ids := tokenizer.encode(text, add_special_tokens=False).ids) != expected
    ]
    assert not failures, "\n".join(failures)


def test_llama_cpp_and_transformers_agree_on_the_vectors(vectors, hf_tokenizer, llama):
    failures = []
    for text in vectors:
        ours = llama.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        theirs = hf_tokenizer.encode(text, add_special_tokens=False)
        if ours != theirs:
            failures.append(f"{text!r}: llama.cpp {ours}, transformers {theirs}")
    assert not failures, "\n".join(failures)


EXTRA_TEXTS = [ch * n for ch in ("\n", " ", "\t") for n in range(1, 70)] + [
    "\n \n", " \n ", "a\n\nb", "\r\n", "x\r\n\r\ny", "\u00a0", "\u3000", "\x00", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "<0x41>",
    "<unused0>", "[multimodal]", "<|channel>thinking<channel|>", "<|turn>user\nhi<turn|>\n", "<pad><eos>",
]


def test_llama_cpp_and_transformers_agree_on_whitespace_bytes_and_special_text(hf_tokenizer, llama):
    failures = []
    for text in EXTRA_TEXTS:
        raw = text.encode("utf-8")
        # Without parse_special llama.cpp reads control tokens as text, as transformers does with
        # split_special_tokens; user-defined tokens match in both modes in both libraries.
        plain = llama.tokenize(raw, add_bos=False, special=False)
        plain_hf = hf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        special = llama.tokenize(raw, add_bos=False, special=True)
        special_hf = hf_tokenizer.encode(text, add_special_tokens=False)
        if plain != plain_hf or special != special_hf:
            failures.append(f"{text!r}: llama.cpp {plain} / {special}, transformers {plain_hf} / {special_hf}")
    assert not failures, "\n".join(failures)


def test_control_and_user_defined_tokens_are_single_ids(gguf_vocab, hf_tokenizer, llama):
    kinds = zip(gguf_vocab.tokens, gguf_vocab.token_types)
    marked = [(i, text) for i, (text, kind) in enumerate(kinds) if kind in (CONTROL, USER_DEFINED)]
    assert {"<|turn>", "<turn|>", "<|think|>", "<|channel>", "<|image|>"} <= {t for _, t in marked}
    for token_id, text in marked:
        assert hf_tokenizer.encode(text, add_special_tokens=False) == [token_id], text
        assert llama.tokenize(text.encode(), add_bos=False, special=True) == [token_id], text
    assert hf_tokenizer.convert_tokens_to_ids(["<|turn>", "<turn|>"]) == [105, 106]
    tok = hf_tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id, tok.mask_token_id) == (2, 1, 3, 0, 4)
    assert hf_tokenizer.encode("Hello world") == llama.tokenize(b"Hello world", add_bos=True) == [2, 9259, 1902]
    assert hf_tokenizer.decode([2, 105, 9259, 106], skip_special_tokens=True) == "Hello"


def test_the_converter_vocab_classes_read_back_the_gguf_vocabulary(hf_dir, gguf_vocab):
    import gguf

    vocab = gguf.LlamaHfVocab(hf_dir)
    entries = list(vocab.all_tokens())
    assert vocab.vocab_size == len(entries) == 262_144
    assert [text.decode("utf-8") for text, _, _ in entries] == gguf_vocab.tokens
    # What Gemma4Model.set_vocab writes as token types equals the original GGUF's.
    types = [
        int(gguf.TokenType.USER_DEFINED) if text.decode("utf-8") in CONVERTER_VISIBLE_TOKENS else int(kind)
        for text, _, kind in entries
    ]
    assert types == list(gguf_vocab.token_types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True)
    assert special.merges == gguf_vocab.merges
    assert special.special_token_ids == {"bos": 2, "eos": 1, "unk": 3, "pad": 0, "mask": 4}
    assert special.add_special_token["bos"] is True
    assert special.chat_template == gguf_vocab.chat_template


# -- small synthetic vocabularies: the error paths and the one-call API ----------------------------


def write_vocab_gguf(path: Path, model: str, tokens: list[str], merges: list[str] | None, types=None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(path, arch="gemma4")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if types:
        writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    for name, token_id in (("bos", 2), ("eos", 1), ("unk", 3), ("pad", 0)):
        getattr(writer, f"add_{name}_token_id")(token_id)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


TINY_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", *(f"<0x{b:02X}>" for b in range(256))]
TINY_TOKENS += ["▁", "a", "b", "▁a", "▁ab"]
TINY_TYPES = [CONTROL] * 5 + [6] * 256 + [1] * 5
TINY_MERGES = ["▁ a", "▁a b"]


def test_write_hf_tokenizer_on_a_tiny_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    source = write_vocab_gguf(tmp_path / "tiny.gguf", "gemma4", TINY_TOKENS, TINY_MERGES, TINY_TYPES)
    paths = write_hf_tokenizer(source, tmp_path / "out")
    assert {p.name for p in paths} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = tokenizer.encode(" ab<|turn>c")
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "▁ab", "<|turn>", "<0x63>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == " abc"


@pytest.mark.parametrize(
    ("model", "merges"),
    [("llama", TINY_MERGES), ("gpt2", TINY_MERGES), ("gemma4", None)],
    ids=["spm-llama", "gpt2", "no-merges"],
)
def test_rejects_vocabularies_it_cannot_rebuild(tmp_path, model, merges):
    source = write_vocab_gguf(tmp_path / "v.gguf", model, TINY_TOKENS, merges, TINY_TYPES)
    with pytest.raises(UnsupportedModelError):
        write_hf_tokenizer(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_rejects_a_file_that_is_not_gguf(tmp_path):
    bogus = tmp_path / "vocab.gguf"
    bogus.write_bytes(b"not a gguf file at all, just some bytes" * 4)
    with pytest.raises(NotAGGUFError):
        write_hf_tokenizer(bogus, tmp_path / "out")
