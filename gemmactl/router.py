"""Routing: decide which tier answers a prompt.

In order of precedence: the --tier option, then a prefix typed at the start of the prompt
("quick:", "deep:", "think:", ...), then a heuristic that sends code, reasoning requests and
long prompts to the deep tier and everything else to the fast one. A tier the recipe lacks
falls back to the recipe's default tier, and the route's reason says so.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gemmactl.recipes import unknown_tier_error

FAST = "fast"
DEEP = "deep"
REASON = "reason"

PREFIXES: dict[str, tuple[str, bool | None]] = {
    "quick:": (FAST, None),
    "fast:": (FAST, None),
    "deep:": (DEEP, None),
    "reason:": (REASON, True),
    "think:": (REASON, True),
}
"""Prefix → (tier, thinking). None leaves thinking to the tier; True turns it on. A recipe without
a `reason` tier answers reason:/think: on its deep tier (with thinking on)."""

CODE_FENCE = "```"
"""A Markdown code fence anywhere in the prompt sends it to the deep tier."""

CODE_LINE_ENDINGS = (";", "{", "}")
"""Lines (stripped of surrounding whitespace) ending with one of these look like code."""

CODE_LINE_STARTS = ("def ", "class ", "import ", "#include", "function ")
"""Lines (stripped of leading whitespace) starting with one of these look like code."""

CODE_LINES_MIN = 2
"""How many code-looking lines make a prompt code; one alone is too easily prose."""

REASONING_WORDS = (
    "prove",
    "proof",
    "derive",
    "step by step",
    "step-by-step",
    "explain why",
    "analyze",
    "analyse",
    "compare",
    "trade-off",
    "trade-offs",
    "tradeoff",
    "tradeoffs",
    "debug",
    "optimize",
    "design",
)
"""Whole words or phrases, matched case-insensitively, that ask for reasoning."""

LONG_PROMPT_WORDS = 60
"""Prompts with more words than this (split on whitespace) go to the deep tier."""

# Only a known word followed by a colon at the very start counts, so "deep learning: x" and
# "quickly: x" stay ordinary prompts.
_PREFIX = re.compile(r"\s*([A-Za-z]+)[ \t]*:\s*")
# Whole words only, so "improve" does not match "prove"; phrases accept any run of whitespace.
_REASONING = re.compile(
    r"\b(?:" + "|".join(re.escape(word).replace(r"\ ", r"\s+") for word in REASONING_WORDS) + r")\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Route:
    """The tier chosen for a prompt, the prompt to send it, and why."""

    tier: str
    prompt: str
    thinking: bool | None
    reason: str
    prefix: str | None = None


def split_prefix(prompt: str) -> tuple[str | None, str]:
    """Return (the prefix as written in PREFIXES, or None; the prompt without it)."""
    match = _PREFIX.match(prompt)
    if match:
        prefix = match.group(1).lower() + ":"
        if prefix in PREFIXES:
            return prefix, prompt[match.end() :]
    return None, prompt


def heuristic(prompt: str) -> tuple[str, str]:
    """Return (tier, what triggered it) for a prompt without a prefix."""
    if CODE_FENCE in prompt:
        return DEEP, "code block"
    code_lines = sum(1 for line in prompt.splitlines() if _looks_like_code(line))
    if code_lines >= CODE_LINES_MIN:
        return DEEP, f"{code_lines} lines look like code"
    match = _REASONING.search(prompt)
    if match:
        word = " ".join(match.group(0).lower().split())
        return DEEP, f"reasoning word '{word}'"
    words = len(prompt.split())
    if words > LONG_PROMPT_WORDS:
        return DEEP, f"{words} words > {LONG_PROMPT_WORDS}"
    return FAST, "short prompt"


def _looks_like_code(line: str) -> bool:
    """Whether one line looks like source code (see CODE_LINE_ENDINGS and CODE_LINE_STARTS)."""
    stripped = line.strip()
    return bool(stripped) and (stripped.endswith(CODE_LINE_ENDINGS) or stripped.startswith(CODE_LINE_STARTS))


def route(prompt: str, tiers: Sequence[str], *, default_tier: str, override: str | None = None) -> Route:
    """Pick the tier for prompt among tiers; override (from --tier) wins over prefix and heuristic."""
    prefix, text = split_prefix(prompt)
    thinking = PREFIXES[prefix][1] if prefix else None
    if override is not None:
        if override not in tiers:
            raise unknown_tier_error(override, tiers, default_tier)
        # The prefix is still stripped so the model never sees it; only its tier is overridden.
        ignored = f" (over prefix '{prefix}')" if prefix else ""
        return Route(override, text, thinking, f"--tier {override}{ignored}", prefix)
    if prefix:
        wanted = PREFIXES[prefix][0]
        if wanted == REASON and REASON not in tiers:
            wanted = DEEP
        why = f"prefix '{prefix}'"
    else:
        wanted, trigger = heuristic(text)
        why = f"heuristic: {trigger}"
    if wanted in tiers:
        return Route(wanted, text, thinking, why, prefix)
    return Route(default_tier, text, thinking, f"{why} → {wanted}, not in recipe; using {default_tier}", prefix)
