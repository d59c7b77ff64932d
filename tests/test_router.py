"""Tests for gemmactl.router: prefixes, the heuristic, --tier, and fallback to the default tier."""

from __future__ import annotations

import pytest

from gemmactl.errors import UnknownTierError
from gemmactl.router import LONG_PROMPT_WORDS, PREFIXES, REASONING_WORDS, Route, route, split_prefix

BOTH = ("fast", "deep")


def words(count: int) -> str:
    """A prompt of count plain words that trigger nothing else."""
    return " ".join(["word"] * count)


# prompt → (tier, prompt sent to the model, thinking)
TABLE = [
    # every prefix
    ("quick: hi", "fast", "hi", None),
    ("fast: hi", "fast", "hi", None),
    ("deep: hi", "deep", "hi", None),
    ("reason: hi", "deep", "hi", True),
    ("think: hi", "deep", "hi", True),
    # case variants
    ("QUICK: hi", "fast", "hi", None),
    ("Deep: hi", "deep", "hi", None),
    ("ThInK: hi", "deep", "hi", True),
    # whitespace variants
    ("  Deep :  explain", "deep", "explain", None),
    ("\tquick:hi", "fast", "hi", None),
    ("reason:\n\nwhy is the sky blue", "deep", "why is the sky blue", True),
    ("fast\t: hi there  ", "fast", "hi there  ", None),
    ("\n think :  x", "deep", "x", True),
    # empty after prefix
    ("quick:", "fast", "", None),
    ("deep:   ", "deep", "", None),
    ("think:\n", "deep", "", True),
    # only the first prefix is stripped
    ("quick: deep: hi", "fast", "deep: hi", None),
    # lookalikes that are not prefixes
    ("quickly: x", "fast", "quickly: x", None),
    ("fast food is tasty", "fast", "fast food is tasty", None),
    ("quick question", "fast", "quick question", None),
    ("deep learning: x", "fast", "deep learning: x", None),
    ("deeper: x", "fast", "deeper: x", None),
    ("rethink: x", "fast", "rethink: x", None),
    ("say quick: hi", "fast", "say quick: hi", None),
    ("https://example.com", "fast", "https://example.com", None),
    # heuristic: code
    ("fix this:\n```\nprint(1)\n```", "deep", "fix this:\n```\nprint(1)\n```", None),
    ("what does this do\nint x = 1;\nx++;", "deep", "what does this do\nint x = 1;\nx++;", None),
    ("def f(x):\n    return g(x)\nclass A:", "deep", "def f(x):\n    return g(x)\nclass A:", None),
    ("import os\nimport sys", "deep", "import os\nimport sys", None),
    ("#include <stdio.h>\nint main() {", "deep", "#include <stdio.h>\nint main() {", None),
    ("function f() {\n}", "deep", "function f() {\n}", None),
    ("one line ending in a semicolon;", "fast", "one line ending in a semicolon;", None),
    # heuristic: reasoning words, one of each kind
    ("prove that 2 is prime", "deep", "prove that 2 is prime", None),
    ("give a PROOF", "deep", "give a PROOF", None),
    ("derive the formula", "deep", "derive the formula", None),
    ("solve it step by step", "deep", "solve it step by step", None),
    ("a step-by-step guide", "deep", "a step-by-step guide", None),
    ("explain why it rains", "deep", "explain why it rains", None),
    ("analyze this", "deep", "analyze this", None),
    ("analyse this", "deep", "analyse this", None),
    ("compare cats and dogs", "deep", "compare cats and dogs", None),
    ("the trade-off here", "deep", "the trade-off here", None),
    ("what tradeoffs exist", "deep", "what tradeoffs exist", None),
    ("debug my script", "deep", "debug my script", None),
    ("optimize the loop", "deep", "optimize the loop", None),
    ("design a cache", "deep", "design a cache", None),
    # reasoning words only as whole words
    ("improve my essay", "fast", "improve my essay", None),
    ("a proofreader", "fast", "a proofreader", None),
    ("explain it", "fast", "explain it", None),
    ("designer clothes", "fast", "designer clothes", None),
    # heuristic: length edges
    (words(LONG_PROMPT_WORDS), "fast", words(LONG_PROMPT_WORDS), None),
    (words(LONG_PROMPT_WORDS + 1), "deep", words(LONG_PROMPT_WORDS + 1), None),
    # plain short prompt
    ("hello", "fast", "hello", None),
    ("", "fast", "", None),
]


@pytest.mark.parametrize(("prompt", "tier", "text", "thinking"), TABLE)
def test_route_table(prompt, tier, text, thinking):
    result = route(prompt, BOTH, default_tier="fast")
    assert (result.tier, result.prompt, result.thinking) == (tier, text, thinking)


def test_every_prefix_is_covered_by_the_table():
    tested = {split_prefix(prompt)[0] for prompt, *_ in TABLE}
    assert set(PREFIXES) <= tested


def test_every_reasoning_word_triggers_deep():
    for word in REASONING_WORDS:
        result = route(f"please {word.upper()} this", BOTH, default_tier="fast")
        assert result.tier == "deep", word
        assert result.reason == f"heuristic: reasoning word '{word}'"


# -- reasons ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "reason", "prefix"),
    [
        ("  Quick : hi", "prefix 'quick:'", "quick:"),
        ("THINK: hi", "prefix 'think:'", "think:"),
        ("```x```", "heuristic: code block", None),
        ("a;\nb;\nc", "heuristic: 2 lines look like code", None),
        ("please Prove it", "heuristic: reasoning word 'prove'", None),
        ("go Step  By\nStep", "heuristic: reasoning word 'step by step'", None),
        (words(75), "heuristic: 75 words > 60", None),
        ("hello", "heuristic: short prompt", None),
    ],
)
def test_reason_names_the_trigger(prompt, reason, prefix):
    result = route(prompt, BOTH, default_tier="fast")
    assert result.reason == reason
    assert result.prefix == prefix


def test_route_is_a_route():
    assert route("deep: x", BOTH, default_tier="fast") == Route("deep", "x", None, "prefix 'deep:'", "deep:")


# -- --tier override -------------------------------------------------------------------------------


def test_override_wins_over_heuristic():
    result = route("prove it step by step", BOTH, default_tier="fast", override="fast")
    assert (result.tier, result.prompt, result.thinking, result.reason) == ("fast", "prove it step by step", None, "--tier fast")


def test_override_still_strips_prefix():
    result = route("quick: hi", BOTH, default_tier="fast", override="deep")
    assert (result.tier, result.prompt, result.prefix) == ("deep", "hi", "quick:")
    assert result.reason.startswith("--tier deep")


def test_override_keeps_thinking_prefix():
    result = route("think: why", BOTH, default_tier="fast", override="fast")
    assert (result.tier, result.prompt, result.thinking) == ("fast", "why", True)


def test_override_unknown_tier():
    with pytest.raises(UnknownTierError) as info:
        route("hi", BOTH, default_tier="fast", override="huge")
    assert str(info.value) == "unknown tier 'huge'; this recipe has fast, deep"
    assert info.value.hint == "Pick one with --tier fast, or add the tier to the recipe."


# -- fallback to the default tier ------------------------------------------------------------------


def test_prefix_tier_missing_falls_back():
    result = route("deep: x", ["fast"], default_tier="fast")
    assert (result.tier, result.prompt) == ("fast", "x")
    assert result.reason == "prefix 'deep:' → deep, not in recipe; using fast"


def test_thinking_prefix_survives_fallback():
    result = route("reason: x", ["fast"], default_tier="fast")
    assert (result.tier, result.thinking) == ("fast", True)


def test_heuristic_tier_missing_falls_back():
    result = route("prove it", ["small", "big"], default_tier="small")
    assert result.tier == "small"
    assert result.reason == "heuristic: reasoning word 'prove' → deep, not in recipe; using small"


def test_short_prompt_falls_back_when_no_fast_tier():
    result = route("hi", ["deep"], default_tier="deep")
    assert result.tier == "deep"
    assert result.reason == "heuristic: short prompt → fast, not in recipe; using deep"


def test_custom_tier_needs_override():
    result = route("hi", ["fast", "deep", "huge"], default_tier="fast", override="huge")
    assert result.tier == "huge"


def test_reason_prefixes_take_a_reason_tier_when_the_recipe_has_one():
    tiers = ("fast", "deep", "reason")
    for prompt in ("reason: why", "think: why"):
        result = route(prompt, tiers, default_tier="fast")
        assert (result.tier, result.thinking) == ("reason", True)
    assert route("deep: why", tiers, default_tier="fast").tier == "deep"
    assert route("prove it", tiers, default_tier="fast").tier == "deep"  # the heuristic stays on deep
