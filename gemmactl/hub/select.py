"""Which files of a hub repo a pull takes: a safetensors checkpoint, or one GGUF quant with its shards."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import InvalidRepoIdError, NoFilesSelectedError
from gemmactl.hub.cache import RepoFile

DEFAULT_QUANT = "Q4_K_M"

# The hub's rule: letters, digits, '-', '_', '.'; no '--' or '..'; at most 96 characters a part.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID_RE = re.compile(rf"^(?:{_PART}/)?{_PART}$")

# A safetensors checkpoint: its weights and index, configs and tokenizer, all at the repo's top level
# (sub-folders hold other formats: original/, onnx/, gguf/ ...).
_CHECKPOINT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
_CHECKPOINT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "vocab.json",
        "merges.txt",
        "processor_config.json",
        "preprocessor_config.json",
    }
)
_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_TOKEN_RE = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class Selection:
    """The files a pull takes from a repo, and what kind of repo it is."""

    kind: str  # "safetensors", "gguf", or "files" (only what --include named)
    files: list[RepoFile]
    quant: str | None = None



# -- choosing -------------------------------------------------------------------------------------


_HOST_PREFIXES = ("hf.co/", "huggingface.co/")  # Ollama's form: hf.co/OWNER/NAME:QUANT


def parse_reference(reference: str, quant: str | None = None) -> tuple[str, str | None]:
    """(repo id, quant) from OWNER/NAME, OWNER/NAME:QUANT or hf.co/OWNER/NAME:QUANT (Ollama's form);
    a quantization written both there and in --quant must agree."""
    text = reference.strip()
    for prefix in _HOST_PREFIXES:
        if text.lower().startswith(prefix):
            text = text[len(prefix):]
            break
    repo_id, colon, tag = text.rpartition(":")
    if not colon or "/" in tag:  # no quantization written (a ':' inside a URL is not one)
        return validate_repo_id(text), quant
    if not tag:
        raise InvalidRepoIdError(f"'{reference}' ends with ':' but names no quantization",
                                 hint="Write it like OWNER/NAME:Q4_K_M, or leave the ':' out.")
    if quant and quant.upper() != tag.upper():
        raise InvalidRepoIdError(f"'{reference}' asks for {tag} but --quant says {quant}",
                                 hint="Give the quantization once.")
    return validate_repo_id(repo_id), tag


def validate_repo_id(repo_id: str) -> str:
    """Return the repo id if it is shaped like one (OWNER/NAME); raise InvalidRepoIdError otherwise."""
    if not _REPO_ID_RE.match(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        raise InvalidRepoIdError(f"'{repo_id}' is not a hub repo id")
    return repo_id


def select_files(
    files: list[RepoFile],
    *,
    quant: str | None = None,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    repo_id: str = "the repo",
) -> Selection:
    """Pick a repo's files: the checkpoint, or one GGUF quant with its shards; --include adds, --exclude removes."""
    include, exclude = list(include), list(exclude)
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    weights = [f for f in files if "/" not in f.name and f.name.endswith(".safetensors")]
    if quant is not None and not ggufs:
        raise NoFilesSelectedError(f"--quant applies to GGUF repos, and {repo_id} has no .gguf files")
    if ggufs and (quant is not None or not weights):
        kind, quant = "gguf", (quant or DEFAULT_QUANT).upper()
        base = _gguf_files(ggufs, quant, repo_id)
    elif weights:
        kind, base = "safetensors", [f for f in files if _is_checkpoint_file(f.name)]
    elif include:
        kind, base = "files", []
    else:
        raise NoFilesSelectedError(
            f"{repo_id} holds neither safetensors weights nor GGUF files",
            hint="Choose its files with --include GLOB (repeatable).",
        )
    chosen = {f.name for f in base} | {f.name for f in files if _matches(f.name, include)}
    chosen = {name for name in chosen if not _matches(name, exclude)}
    if not chosen:
        raise NoFilesSelectedError(f"no file of {repo_id} is left to pull after --include/--exclude")
    by_name = {f.name: f for f in files}
    return Selection(kind, [by_name[name] for name in sorted(chosen)], quant)


def _is_checkpoint_file(name: str) -> bool:
    if "/" in name:
        return False
    return name in _CHECKPOINT_FILES or any(fnmatch.fnmatchcase(name, p) for p in _CHECKPOINT_PATTERNS)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _gguf_files(ggufs: list[RepoFile], quant: str, repo_id: str) -> list[RepoFile]:
    """The GGUF file(s) of one quant type: the name holds it as a whole token (Q4_K does not match Q4_K_M)."""
    token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    picked = [f for f in ggufs if token.search(f.name) and not Path(f.name).name.lower().startswith("mmproj")]
    if not picked:
        found = sorted({m.upper() for f in ggufs for m in _QUANT_TOKEN_RE.findall(f.name)})
        raise NoFilesSelectedError(
            f"{repo_id} has no {quant} GGUF file (it has: {', '.join(found) or ', '.join(f.name for f in ggufs)})",
            hint="Pick one of those with --quant.",
        )
    _check_shards(picked, repo_id)
    return picked


def _check_shards(files: list[RepoFile], repo_id: str) -> None:
    """Refuse a split GGUF whose listing lacks shards: llama.cpp cannot load a partial set."""
    groups: dict[tuple[str, int], set[int]] = {}
    for file in files:
        match = _SHARD_RE.search(file.name)
        if match:
            key = (file.name[: match.start()], int(match.group(2)))
            groups.setdefault(key, set()).add(int(match.group(1)))
    for (prefix, count), present in groups.items():
        missing = sorted(set(range(1, count + 1)) - present)
        if missing:
            raise NoFilesSelectedError(
                f"{repo_id} lists only {len(present)} of the {count} shards of {prefix} (missing: {missing})"
            )
