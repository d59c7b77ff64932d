"""Tests for gemmactl.recipes: the shipped recipes, validation errors, and recipe lookup."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gemmactl.errors import RecipeError, UnknownTierError
from gemmactl.recipes import (
    FLASH_ATTN_MODES,
    KNOWN_BACKENDS,
    Recipe,
    Sampling,
    Tier,
    builtin_recipe_names,
    builtin_recipe_path,
    load_recipe,
    parse_recipe,
    resolve_recipe,
)

MINIMAL = "tiers:\n  fast:\n    model: embedded\n"


@pytest.fixture(autouse=True)
def _no_recipe_env(monkeypatch):
    """Keep a GEMMACTL_RECIPE from the developer's shell out of every test."""
    monkeypatch.delenv("GEMMACTL_RECIPE", raising=False)


# -- shipped recipes -----------------------------------------------------------------------------


def test_builtin_names():
    assert builtin_recipe_names() == ["default", "gemma4-4gb"]


def test_default_recipe_uses_embedded_model_everywhere():
    recipe = resolve_recipe("default")
    assert recipe.name == "default"
    assert recipe.default_tier == "fast"
    assert list(recipe.tiers) == ["fast", "deep"]
    for tier in recipe.tiers.values():
        assert tier.model == "embedded"
        assert tier.backend == "llamacpp"
        assert tier.context == 2048
        assert tier.make == []
        assert tier.needs == ""
        assert tier.sampling.temperature == 0.0
        assert tier.sampling.top_k == 40
        assert tier.sampling.top_p == 0.95
        assert tier.sampling.repeat_penalty == 1.1
    assert recipe.tier("fast").sampling.max_tokens == 128
    assert recipe.tier("deep").sampling.max_tokens == 256


def test_gemma4_4gb_recipe():
    recipe = resolve_recipe("gemma4-4gb")
    assert recipe.default_tier == "fast"
    assert list(recipe.tiers) == ["fast", "deep", "reason"]

    fast = recipe.tier("fast")
    assert fast.model == "gemma-4-E2B-it-Q4_K_M"
    assert fast.backend == "llamacpp"
    assert fast.context == 8192
    assert (fast.sampling.temperature, fast.sampling.top_k, fast.sampling.top_p) == (1.0, 64, 0.95)
    assert fast.make == [
        "gemmactl pull google/gemma-4-E2B-it",
        "gemmactl quantize google/gemma-4-E2B-it --gguf Q4_K_M",
    ]
    assert fast.needs == ""

    deep = recipe.tier("deep")
    assert deep.model == "gemma-4-E4B-it-int4"
    assert deep.backend == "int4"
    assert deep.context == 8192
    assert deep.make == [
        "gemmactl pull google/gemma-4-E4B-it",
        "gemmactl quantize google/gemma-4-E4B-it --int4-stream",
    ]
    assert deep.needs.startswith("an int4-stream artifact of Gemma 4 E4B")
    assert deep.vram == 4 * 2**30 and fast.vram is None

    reason = recipe.tier("reason")  # reason:/think: prompts (router.REASON)
    assert (reason.model, reason.backend, reason.thinking, reason.vram) == ("gemma-4-26B-A4B-it-int4", "int4", True, 4 << 30)
    assert (reason.expert_cache, reason.expert_policy) == (None, "lfu")  # auto: the plan's room
    assert reason.make[-1] == "gemmactl quantize google/gemma-4-26B-A4B-it --int4-stream"


def test_every_recipe_backend_has_a_runtime():
    """A backend name a recipe may give (and each built-in tier's) opens through gemmactl.runtime."""
    from gemmactl.runtime import available_backends, backend_class

    assert set(KNOWN_BACKENDS) == set(available_backends())
    used = {tier.backend for name in builtin_recipe_names() for tier in resolve_recipe(name).tiers.values()}
    assert used <= set(KNOWN_BACKENDS)
    for backend in KNOWN_BACKENDS:
        assert callable(backend_class(backend)), backend


# -- parsing ---------------------------------------------------------------------------------------


def test_minimal_recipe_gets_defaults():
    recipe = parse_recipe(MINIMAL)
    assert recipe.default_tier == "fast"
    assert recipe.path is None
    assert recipe.tiers["fast"] == Tier(name="fast", model="embedded")
    assert recipe.tiers["fast"].sampling == Sampling()
    assert recipe.tiers["fast"].backend == "llamacpp"


def test_default_tier_falls_back_to_first_tier_without_fast():
    recipe = parse_recipe("tiers:\n  small:\n    model: a\n  big:\n    model: b\n")
    assert recipe.default_tier == "small"
    assert list(recipe.tiers) == ["small", "big"]


def test_default_tier_prefers_fast_even_when_not_first():
    recipe = parse_recipe("tiers:\n  deep:\n    model: a\n  fast:\n    model: b\n")
    assert recipe.default_tier == "fast"
    assert list(recipe.tiers) == ["deep", "fast"]


def test_full_tier_parses():
    recipe = parse_recipe(
        textwrap.dedent(
            """\
            name: mine
            description: my recipe
            default_tier: deep
            tiers:
              fast:
                model: embedded
              deep:
                model: /models/x.gguf
                backend: int4
                context: 128
                thinking: yes
                description: big one
                make: [a, b]
                needs: a GPU
                sampling:
                  temperature: 0
                  top_k: 0
                  top_p: 1
                  min_p: 0.05
                  repeat_penalty: 1.2
                  max_tokens: 1
            """
        )
    )
    assert (recipe.name, recipe.description, recipe.default_tier) == ("mine", "my recipe", "deep")
    deep = recipe.tier("deep")
    assert deep == Tier(
        name="deep",
        model="/models/x.gguf",
        backend="int4",
        context=128,
        thinking=True,
        sampling=Sampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.05, repeat_penalty=1.2, max_tokens=1),
        description="big one",
        make=["a", "b"],
        needs="a GPU",
    )


def test_unknown_tier():
    recipe = parse_recipe("tiers:\n  fast:\n    model: a\n  deep:\n    model: b\n")
    with pytest.raises(UnknownTierError) as info:
        recipe.tier("huge")
    assert str(info.value) == "unknown tier 'huge'; this recipe has fast, deep"
    assert info.value.hint == "Pick one with --tier fast, or add the tier to the recipe."


# Each case: recipe text, text the message must contain (naming the field), 1-based line.
MALFORMED = [
    pytest.param("tiers:\n  fast:\n    model: [a\n", "invalid YAML", 4, id="yaml-syntax"),
    pytest.param("tiers:\n  fast:\n\tmodel: a\n", "invalid YAML", 3, id="yaml-tab"),
    pytest.param("", "needs at least 'tiers'", 1, id="empty-file"),
    pytest.param("- fast\n- deep\n", "top level must be a mapping", 1, id="top-level-list"),
    pytest.param("just text\n", "top level must be a mapping", 1, id="top-level-scalar"),
    pytest.param("name: x\ndescription: y\n", "missing required key 'tiers'", 1, id="missing-tiers"),
    pytest.param("name: x\ntier:\n  fast: {}\n", "unknown key 'tier' (did you mean 'tiers'?)", 2, id="unknown-top-key"),
    pytest.param(MINIMAL + "    temp: 1\n", "unknown key 'tiers.fast.temp'", 4, id="unknown-tier-key"),
    pytest.param(
        MINIMAL + "    sampling:\n      topk: 3\n", "unknown key 'tiers.fast.sampling.topk'", 5, id="unknown-sampling-key"
    ),
    pytest.param("tiers:\n  fast:\n    backend: llamacpp\n", "tiers.fast is missing required key 'model'", 2, id="missing-model"),
    pytest.param("tiers:\n  fast:\n", "tiers.fast is missing required key 'model'", 2, id="null-tier"),
    pytest.param("tiers:\n  fast: embedded\n", "tiers.fast must be a mapping, got 'embedded'", 2, id="tier-not-mapping"),
    pytest.param("tiers: {}\n", "tiers must define at least one tier", 1, id="empty-tiers"),
    pytest.param("name: x\ntiers:\n", "tiers must define at least one tier", 2, id="null-tiers"),
    pytest.param("tiers:\n  - fast\n", "tiers must be a mapping, got a list", 2, id="tiers-list"),
    pytest.param("tiers:\n  Fast:\n    model: a\n", "tiers.Fast: tier names must match", 2, id="tier-name-upper"),
    pytest.param("tiers:\n  1st:\n    model: a\n", "tiers.1st: tier names must match", 2, id="tier-name-digit"),
    pytest.param("tiers:\n  fast:\n    model: 7\n", "tiers.fast.model must be a non-empty string, got 7", 3, id="model-int"),
    pytest.param("tiers:\n  fast:\n    model: ''\n", "tiers.fast.model must be a non-empty string", 3, id="model-empty"),
    pytest.param(MINIMAL + "    backend: vllm\n", "tiers.fast.backend must be one of llamacpp, int4, got 'vllm'", 4, id="backend"),
    pytest.param(MINIMAL + "    context: abc\n", "tiers.fast.context must be an integer of at least 128, got 'abc'", 4, id="context-str"),
    pytest.param(MINIMAL + "    context: 64\n", "tiers.fast.context must be an integer of at least 128, got 64", 4, id="context-small"),
    pytest.param(MINIMAL + "    context: -4096\n", "tiers.fast.context", 4, id="context-negative"),
    pytest.param(MINIMAL + "    context: 4096.5\n", "tiers.fast.context", 4, id="context-float"),
    pytest.param(MINIMAL + "    context: true\n", "tiers.fast.context", 4, id="context-bool"),
    pytest.param(MINIMAL + "    thinking: 'true'\n", "tiers.fast.thinking must be true or false, got 'true'", 4, id="thinking-str"),
    pytest.param(MINIMAL + "    thinking: 1\n", "tiers.fast.thinking must be true or false, got 1", 4, id="thinking-int"),
    pytest.param(MINIMAL + "    description: [a]\n", "tiers.fast.description must be a string, got a list", 4, id="description"),
    pytest.param(MINIMAL + "    needs: 3\n", "tiers.fast.needs must be a string, got 3", 4, id="needs"),
    pytest.param(MINIMAL + "    make: gemmactl pull x\n", "tiers.fast.make must be a list of commands", 4, id="make-str"),
    pytest.param(MINIMAL + "    make:\n      - ok\n      - 5\n", "tiers.fast.make[1] must be a non-empty string", 6, id="make-item"),
    pytest.param(MINIMAL + "    sampling: 0.7\n", "tiers.fast.sampling must be a mapping", 4, id="sampling-scalar"),
    pytest.param(
        MINIMAL + "    sampling:\n      temperature: -0.1\n",
        "tiers.fast.sampling.temperature must be a number >= 0, got -0.1",
        5,
        id="temperature-negative",
    ),
    pytest.param(
        MINIMAL + "    sampling:\n      temperature: hot\n", "tiers.fast.sampling.temperature", 5, id="temperature-str"
    ),
    pytest.param(
        MINIMAL + "    sampling:\n      temperature: .nan\n", "tiers.fast.sampling.temperature", 5, id="temperature-nan"
    ),
    pytest.param(MINIMAL + "    sampling:\n      top_p: 0\n", "tiers.fast.sampling.top_p must be a number in (0, 1]", 5, id="top-p-zero"),
    pytest.param(MINIMAL + "    sampling:\n      top_p: 1.5\n", "tiers.fast.sampling.top_p", 5, id="top-p-big"),
    pytest.param(MINIMAL + "    sampling:\n      min_p: -1\n", "tiers.fast.sampling.min_p", 5, id="min-p"),
    pytest.param(MINIMAL + "    sampling:\n      top_k: -1\n", "tiers.fast.sampling.top_k must be a non-negative integer", 5, id="top-k"),
    pytest.param(MINIMAL + "    sampling:\n      repeat_penalty: 0\n", "tiers.fast.sampling.repeat_penalty", 5, id="repeat-penalty"),
    pytest.param(
        MINIMAL + "    sampling:\n      max_tokens: 0\n", "tiers.fast.sampling.max_tokens must be a positive integer", 5, id="max-tokens"
    ),
    pytest.param(
        "default_tier: deep\n" + MINIMAL, "default_tier 'deep' is not one of the tiers (fast)", 1, id="default-tier-missing"
    ),
    pytest.param("default_tier: 3\n" + MINIMAL, "default_tier must be a non-empty string", 1, id="default-tier-int"),
    pytest.param("name: ''\n" + MINIMAL, "name must be a non-empty string", 1, id="name-empty"),
    pytest.param(MINIMAL + "  fast:\n    model: b\n", "tiers.fast is given twice", 4, id="duplicate-tier"),
    pytest.param(MINIMAL + "    model: b\n", "tiers.fast.model is given twice", 4, id="duplicate-key"),
    pytest.param(MINIMAL + "    parallel: 0\n", "tiers.fast.parallel must be an integer from 1 to 256", 4, id="parallel-zero"),
    pytest.param(MINIMAL + "    parallel: 1000\n", "tiers.fast.parallel must be an integer from 1 to 256, got 1000", 4,
                 id="parallel-big"),
    pytest.param(MINIMAL + "    speculative:\n      type: eagle\n", "tiers.fast.speculative.type must be one of draft, mtp, ngram", 5,
                 id="speculative-type"),
    pytest.param(MINIMAL + "    speculative:\n      type: draft\n", "tiers.fast.speculative of type draft is missing required key 'draft_model'",
                 4, id="speculative-draft-needs-model"),
    pytest.param(MINIMAL + "    speculative:\n      type: ngram\n      draft_max: 0\n",
                 "tiers.fast.speculative.draft_max must be a positive integer", 6, id="speculative-draft-max"),
    pytest.param(MINIMAL + "    speculative:\n      type: mtp\n      draft_min: 9\n",
                 "tiers.fast.speculative.draft_min (9) is above draft_max (8)", 4, id="speculative-min-above-max"),
    pytest.param(MINIMAL + "    speculative:\n      type: ngram\n      enabled: 'no'\n",
                 "tiers.fast.speculative.enabled must be true or false", 6, id="speculative-enabled"),
    pytest.param(MINIMAL + "    flash_attn: fast\n", "tiers.fast.flash_attn must be one of off, on, auto, got 'fast'", 4,
                 id="flash-attn-word"),
    pytest.param(MINIMAL + "    flash_attn: 1\n", "tiers.fast.flash_attn must be one of off, on, auto, got 1", 4,
                 id="flash-attn-int"),
    pytest.param(MINIMAL + "    flash_attn: [on]\n", "tiers.fast.flash_attn must be one of off, on, auto, got a list", 4,
                 id="flash-attn-list"),
    pytest.param(MINIMAL + "    flash_attn:\n", "tiers.fast.flash_attn must be one of off, on, auto, got nothing", 4,
                 id="flash-attn-empty"),
    pytest.param(MINIMAL + "    vram: lots\n", "tiers.fast.vram 'lots' is not a size", 4, id="vram-word"),
    pytest.param(MINIMAL + "    vram: 4\n", "tiers.fast.vram '4' has no unit", 4, id="vram-no-unit"),
    pytest.param(MINIMAL + "    vram: 0G\n", "tiers.fast.vram must be more than zero", 4, id="vram-zero"),
    pytest.param(MINIMAL + "    vram: [4G]\n", "tiers.fast.vram must be a size such as 4G, got a list", 4,
                 id="vram-list"),
    pytest.param(MINIMAL + "    rpc: [box]\n", "tiers.fast.rpc 'box' is not HOST:PORT", 4, id="rpc-no-port"),
    pytest.param(MINIMAL + "    rpc: {box: 1}\n", "tiers.fast.rpc must be a list of HOST:PORT, got a mapping", 4,
                 id="rpc-mapping"),
    pytest.param(MINIMAL + "    rpc: [a:1, a:1]\n", "tiers.fast.rpc names the worker a:1 twice", 4, id="rpc-twice"),
]


@pytest.mark.parametrize(("text", "expected", "line"), MALFORMED)
def test_malformed_recipe(text, expected, line):
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, source="recipes/x.yaml")
    message = str(info.value)
    assert message.startswith(f"recipes/x.yaml line {line}: "), message
    assert expected in message, message
    assert "\n" not in message


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(RecipeError) as info:
        parse_recipe(MINIMAL + "    gpu: yes\n")
    assert "allowed keys are model, backend, context, thinking, sampling, description, make, needs, parallel, speculative" in str(info.value)


def test_parallel_and_speculative_parse():
    from gemmactl.recipes import Speculative

    recipe = parse_recipe(MINIMAL + "    parallel: 16\n    speculative:\n      type: draft\n      draft_model: small.gguf\n"
                          "      draft_max: 12\n      enabled: false\n")
    tier = recipe.tiers["fast"]
    assert tier.parallel == 16
    assert tier.speculative == Speculative(kind="draft", draft_model="small.gguf", draft_max=12, enabled=False)
    assert tier.speculative.spec_type == "draft-simple"
    assert parse_recipe(MINIMAL).tiers["fast"].speculative is None
    assert parse_recipe(MINIMAL + "    speculative: {type: mtp}\n").tiers["fast"].speculative.spec_type == "draft-mtp"
    assert parse_recipe(MINIMAL + "    parallel: auto\n").tiers["fast"].parallel == "auto"
    with pytest.raises(RecipeError, match="from 1 to 256, or auto"):
        parse_recipe(MINIMAL + "    parallel: many\n")


@pytest.mark.parametrize(("value", "expected"), [
    ("off", "off"), ("on", "on"), ("auto", "auto"),
    ("'off'", "off"), ("'on'", "on"),  # quoted: the strings themselves
    ("true", "on"), ("false", "off"), ("yes", "on"), ("no", "off"),  # YAML booleans
])
def test_flash_attn_parses(value, expected):
    assert parse_recipe(MINIMAL + f"    flash_attn: {value}\n").tiers["fast"].flash_attn == expected


def test_flash_attn_is_off_by_default_and_per_tier():
    assert parse_recipe(MINIMAL).tiers["fast"].flash_attn == "off"
    recipe = parse_recipe(MINIMAL + "    flash_attn: on\n  bulk:\n    model: embedded\n    parallel: 64\n")
    assert (recipe.tier("fast").flash_attn, recipe.tier("bulk").flash_attn) == ("on", "off")


@pytest.mark.parametrize("value", [*FLASH_ATTN_MODES, "true", "false"])  # every mode, and the YAML booleans
def test_flash_attn_reaches_llama_server_as_its_fa_value(value, tmp_path):
    """Whatever a tier's flash_attn parses to, the real llama-server argument builder takes it as `-fa`."""
    from gemmactl.llamacpp.server import LlamaServer

    mode = parse_recipe(MINIMAL + f"    flash_attn: {value}\n").tiers["fast"].flash_attn
    server = LlamaServer(tmp_path / "llama-server", "m.gguf", threads=1, context=128, log_dir=tmp_path, port=1,
                         flash_attn=mode)
    fa = server.command.index("-fa")
    assert server.command[fa + 1] == mode


def test_error_carries_hint():
    with pytest.raises(RecipeError) as info:
        parse_recipe("tiers: {}\n")
    assert info.value.hint
    assert info.value.exit_code == 2


# -- files and lookup ----------------------------------------------------------------------------


def test_load_recipe_reports_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(MINIMAL + "    context: abc\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml line 4: tiers\.fast\.context"):
        load_recipe(path)


def test_load_recipe_names_recipe_after_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(MINIMAL)
    recipe = load_recipe(path)
    assert recipe.name == "mine"
    assert recipe.path == str(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == f"recipe file not found: {path}"


def test_builtin_recipe_path():
    path = builtin_recipe_path("gemma4-4gb")
    assert isinstance(path, Path)
    assert path.name == "gemma4-4gb.yaml"
    assert path.is_file()
    assert builtin_recipe_path("gemma4-4gb.yaml") == path


def test_resolve_default():
    recipe = resolve_recipe(None)
    assert recipe.name == "default"
    assert isinstance(recipe, Recipe)


@pytest.mark.parametrize("ref", ["gemma4-4gb", "gemma4-4gb.yaml"])
def test_resolve_builtin_by_name(ref):
    assert resolve_recipe(ref).name == "gemma4-4gb"


def test_resolve_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\n" + MINIMAL)
    assert resolve_recipe(str(path)).path == str(path)


def test_resolve_file_wins_over_builtin_name(tmp_path, monkeypatch):
    (tmp_path / "default").write_text("name: local\n" + MINIMAL)
    monkeypatch.chdir(tmp_path)
    assert resolve_recipe("default").name == "local"


def test_resolve_env_var_path(tmp_path, monkeypatch):
    path = tmp_path / "env.yaml"
    path.write_text("name: from-env\n" + MINIMAL)
    monkeypatch.setenv("GEMMACTL_RECIPE", str(path))
    assert resolve_recipe(None).name == "from-env"


def test_resolve_env_var_builtin(monkeypatch):
    monkeypatch.setenv("GEMMACTL_RECIPE", "gemma4-4gb")
    assert resolve_recipe(None).name == "gemma4-4gb"


def test_explicit_ref_wins_over_env_var(monkeypatch):
    monkeypatch.setenv("GEMMACTL_RECIPE", "gemma4-4gb")
    assert resolve_recipe("default").name == "default"


def test_unknown_builtin():
    with pytest.raises(RecipeError) as info:
        resolve_recipe("huge")
    assert str(info.value) == "no recipe 'huge': not a file and not a built-in (default, gemma4-4gb)"
    with pytest.raises(RecipeError, match="no recipe 'huge'"):
        builtin_recipe_path("huge")


def test_unknown_builtin_from_env_says_so(monkeypatch):
    monkeypatch.setenv("GEMMACTL_RECIPE", "huge")
    with pytest.raises(RecipeError, match=r"no recipe 'huge' \(from \$GEMMACTL_RECIPE\)"):
        resolve_recipe(None)


def test_backend_sampling_parses_as_a_boolean_and_is_off_by_default():
    assert parse_recipe(MINIMAL).tiers["fast"].backend_sampling is False
    assert parse_recipe(MINIMAL + "    backend_sampling: true\n").tiers["fast"].backend_sampling is True
    with pytest.raises(RecipeError, match="backend_sampling"):
        parse_recipe(MINIMAL + "    backend_sampling: gpu\n")


def test_one_source_of_sampling_defaults():
    from gemmactl.runtime.base import GenerationRequest

    request, tier = GenerationRequest(prompt="x"), Sampling()
    for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "max_tokens"):
        assert getattr(request, name) == getattr(tier, name), name


def test_vram_is_a_binary_size_and_absent_by_default():
    assert parse_recipe(MINIMAL).tiers["fast"].vram is None
    assert parse_recipe(MINIMAL + "    vram: 3.5G\n").tiers["fast"].vram == int(3.5 * 2**30)
    assert parse_recipe(MINIMAL + "    vram: 4096MiB\n").tiers["fast"].vram == 4 * 2**30


def test_rpc_workers_are_a_list_or_one_string():
    assert parse_recipe(MINIMAL).tiers["fast"].rpc == ()
    listed = parse_recipe(MINIMAL + "    rpc: [10.0.0.2:50052, '10.0.0.3:50052=8G']\n").tiers["fast"].rpc
    assert listed == ("10.0.0.2:50052", "10.0.0.3:50052=8G")
    assert parse_recipe(MINIMAL + "    rpc: 10.0.0.2:50052,10.0.0.3:50052\n").tiers["fast"].rpc == listed[:1] + ("10.0.0.3:50052",)


def test_expert_cache_fields():
    recipe = parse_recipe("tiers:\n  deep:\n    model: a\n    expert_cache: 2G\n    expert_policy: hot\n"
                          "    expert_prefetch: true\n"
                          "  fast:\n    model: a\n    expert_cache: off\n    expert_prefetch: false\n  other:\n    model: a\n    expert_cache: auto\n")
    assert (recipe.tiers["deep"].expert_cache, recipe.tiers["deep"].expert_policy) == (2 << 30, "hot")
    assert recipe.tiers["deep"].expert_prefetch and not recipe.tiers["fast"].expert_prefetch
    assert recipe.tiers["other"].expert_prefetch  # on unless a tier turns it off (measured to pay)
    assert recipe.tiers["fast"].expert_cache == 0 and recipe.tiers["other"].expert_cache is None
    with pytest.raises(RecipeError, match=r"tiers\.deep\.expert_policy must be one of lru, lfu, hot"):
        parse_recipe("tiers:\n  deep:\n    model: a\n    expert_policy: fifo\n")
    with pytest.raises(RecipeError, match=r"tiers\.deep\.expert_cache"):
        parse_recipe("tiers:\n  deep:\n    model: a\n    expert_cache: lots\n")
    shares = parse_recipe("tiers:\n  deep:\n    model: a\n    expert_cpu_share: 0.25\n  fast:\n    model: a\n"
                          "    expert_cpu_share: auto\n  other:\n    model: a\n")
    assert [shares.tiers[name].expert_cpu_share for name in ("deep", "fast", "other")] == [0.25, None, None]
    for bad in ("1.5", "half", "-0.1", "true", "[1]"):
        with pytest.raises(RecipeError, match=r"tiers\.deep\.expert_cpu_share must be a fraction from 0 to 1 or auto"):
            parse_recipe(f"tiers:\n  deep:\n    model: a\n    expert_cpu_share: {bad}\n")


def test_kv_cache_and_yarn_fields_follow_the_tiers_backend():
    recipe = parse_recipe("tiers:\n  fast:\n    model: a\n    kv_cache: q8_0\n"
                          "  deep:\n    model: b\n    backend: int4\n    kv_cache: tq4\n    yarn: 4\n")
    assert recipe.tiers["fast"].kv_cache == "q8_0" and recipe.tiers["fast"].yarn is None
    assert (recipe.tiers["deep"].kv_cache, recipe.tiers["deep"].yarn) == ("tq4", 4.0)
    mixed = parse_recipe("tiers:\n  deep:\n    model: b\n    backend: int4\n    kv_cache: tq4/bf16\n")
    assert mixed.tiers["deep"].kv_cache == "tq4/bf16"  # the sliding windows' own mode
    for text, message in (("    kv_cache: tq4\n", r"tiers\.fast\.kv_cache must be one of f16, q8_0, q4_0 with backend llamacpp"),
                          ("    kv_cache: q8_0/f16\n", r"must be one of f16, q8_0, q4_0 with backend llamacpp, got 'q8_0/f16'"),
                          ("    backend: int4\n    kv_cache: q4_0\n", r"must be one of bf16, int8, tq4, tq3 \(or GLOBAL/WINDOWS"),
                          ("    backend: int4\n    kv_cache: tq4/bf16/int8\n", r"with backend int4, got 'tq4/bf16/int8'"),
                          ("    yarn: 4\n", r"tiers\.fast\.yarn needs backend: int4"),
                          ("    backend: int4\n    yarn: 0.5\n", r"a YaRN factor from 1 to 64")):
        with pytest.raises(RecipeError, match=message):
            parse_recipe("tiers:\n  fast:\n    model: a\n" + text)
