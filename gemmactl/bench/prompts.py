"""Prompt sets: the built-in ones (short factual, long shared prefix, code, free prose) and files.

Prompts are sent as they are (no chat template, no question frame) so that every target sees
the same tokens. The long conversation is generated here, deterministically, with no network.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import InvalidOptionError

LONG_PREFIX = "long-prefix"


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a set; `name` is unique within a run."""

    set: str
    name: str
    text: str


SHORT = (
    "Question: What is the capital of France?\nAnswer:",
    "Question: Who wrote the play Hamlet?\nAnswer:",
)
CODE = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "# Print the numbers from 1 to 20, one per line.\nfor i in range(1, 21):\n",
)
PROSE = (
    "Once upon a time, in a small village by the sea, there lived",
    "The history of the city of Paris begins",
)

# Word lists for the catalogue conversation: 36 books, each talked about in one exchange.
_ADJECTIVES = ("Silent", "Golden", "Hidden", "Broken", "Northern", "Quiet", "Burning", "Last", "Distant", "Open")
_NOUNS = ("River", "Garden", "Harbour", "Letter", "Mountain", "Winter", "Bridge", "Lantern", "Orchard", "Station")
_FIRST = ("Ana", "Tomas", "Mei", "Kofi", "Ingrid", "Ravi", "Lucia", "Omar", "Sofia", "Jonas", "Amara", "Pavel")
_LAST = ("Costa", "Berg", "Okafor", "Lindqvist", "Sato", "Moreau", "Novak", "Haddad", "Romano", "Keller")
_TOPICS = ("a ferry crossing", "a family farm", "a long war", "an old lighthouse", "a chess club", "a missing map")
_BOOKS = 36


def catalogue() -> list[dict]:
    """The books of the long conversation (the same for every variant)."""
    books = []
    for i in range(_BOOKS):
        books.append({
            "title": f"The {_ADJECTIVES[i % 10]} {_NOUNS[(i * 7 + 3) % 10]}",
            "author": f"{_FIRST[(i * 5) % 12]} {_LAST[(i * 3 + 1) % 10]}",
            "year": 1950 + (i * 37) % 70,
            "shelf": f"{'ABCDEFGH'[i % 8]}{1 + (i * 11) % 9}",
            "topic": _TOPICS[(i * 13) % 6],
        })
    return books


def long_conversation(variant: int = 0) -> str:
    """A ≥ 2k-token conversation with a library assistant, ending in a question to answer.

    `variant` changes only the first line, so each variant is a prefix no cache has seen yet
    while every variant has the same length and the same final question.
    """
    lines = [
        f"Conversation {variant + 1} between a reader and the catalogue assistant of the City Library.",
        "The assistant answers from the catalogue, briefly and exactly.",
        "",
    ]
    for i, book in enumerate(catalogue()):
        lines.append(f"Reader: Do you have \"{book['title']}\"? I am looking for a book about {book['topic']}.")
        lines.append(
            f"Assistant: Yes. \"{book['title']}\" by {book['author']} was published in {book['year']} "
            f"and stands on shelf {book['shelf']}. It is book number {i + 1} of our catalogue."
        )
    asked = catalogue()[17]
    lines.append(f"Reader: Which shelf holds \"{asked['title']}\", and who wrote it?")
    lines.append("Assistant:")
    return "\n".join(lines)


def builtin_sets() -> dict[str, list[BenchPrompt]]:
    """Every built-in set by name."""
    def make(set_name: str, texts) -> list[BenchPrompt]:
        return [BenchPrompt(set_name, f"{set_name}-{i + 1}", text) for i, text in enumerate(texts)]

    return {
        "short": make("short", SHORT),
        LONG_PREFIX: [BenchPrompt(LONG_PREFIX, f"{LONG_PREFIX}-1", long_conversation())],
        "code": make("code", CODE),
        "prose": make("prose", PROSE),
    }


def load_prompts(spec: str) -> list[BenchPrompt]:
    """`builtin` (all sets), set names joined by commas, or a prompts file."""
    sets = builtin_sets()
    if spec == "builtin":
        return [prompt for prompts in sets.values() for prompt in prompts]
    names = [name.strip() for name in spec.split(",")]
    if all(name in sets for name in names):
        return [prompt for name in dict.fromkeys(names) for prompt in sets[name]]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise InvalidOptionError(
            f"--prompts {spec!r} is neither a built-in set nor a file",
            hint=f"Use builtin, one or more of {', '.join(sets)} (comma-separated), or a prompts file.",
        )
    return read_prompts_file(path)


def read_prompts_file(path: Path) -> list[BenchPrompt]:
    """A .jsonl file (a JSON string or {"name", "prompt"} per line) or text (one prompt per line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidOptionError(f"cannot read the prompts file {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        name = f"{path.stem}-{len(prompts) + 1}"
        if path.suffix == ".jsonl":
            try:
                item = json.loads(line)
            except ValueError as exc:
                raise InvalidOptionError(f"{path} line {number}: not JSON ({exc})") from None
            if isinstance(item, dict):
                name, item = str(item.get("name") or name), item.get("prompt")
            if not isinstance(item, str) or not item.strip():
                raise InvalidOptionError(f"{path} line {number}: expected a prompt string or {{\"prompt\": …}}")
            prompts.append(BenchPrompt(path.stem, name, item))
        else:
            # Text files hold one prompt per line; a literal \n inside a line is a newline.
            prompts.append(BenchPrompt(path.stem, name, line.replace("\\n", "\n")))
    if not prompts:
        raise InvalidOptionError(f"the prompts file {path} holds no prompts", hint="Put one prompt per line.")
    return prompts
