"""Recipes: YAML files that name a recipe's tiers and how each one runs.

A recipe maps tier names (``fast``, ``deep``, ...) to a model, a backend, a context size and
sampling settings. Every validation error names the field and the line it sits on, so a user
can fix a hand-edited file without guessing.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gemmactl.errors import RecipeError, UnknownTierError
from gemmactl.runtime.base import Sampling

KNOWN_BACKENDS = ("llamacpp", "int4")
# A served tier's flash attention (llama-server's -fa); "off" keeps its greedy text equal to the
# in-process backend's.
FLASH_ATTN_MODES = ("off", "on", "auto")
# Friendly speculative-decoding kinds → llama-server's --spec-type value.
SPECULATIVE_KINDS = {"draft": "draft-simple", "mtp": "draft-mtp", "ngram": "ngram-simple"}
MAX_PARALLEL = 256
DEFAULT_RECIPE = "default"
RECIPE_ENV = "GEMMACTL_RECIPE"
MIN_CONTEXT = 128
TIER_NAME = re.compile(r"[a-z][a-z0-9_-]*")

# Used when the package is run from a source tree, where recipes/ is not yet installed as
# gemmactl.builtin_recipes.
_SOURCE_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding for a tier served by llama-server: a draft model, an MTP assistant, or n-grams."""

    kind: str = "draft"  # draft | mtp | ngram (SPECULATIVE_KINDS)
    draft_model: str | None = None  # "embedded", a store name or a .gguf path; draft and mtp need one
    draft_max: int = 8  # most tokens drafted per step
    draft_min: int = 0  # fewest tokens drafted per step
    enabled: bool = True  # the off switch (also `gemmactl serve --no-speculative`)

    @property
    def spec_type(self) -> str:
        return SPECULATIVE_KINDS[self.kind]


@dataclass(frozen=True)
class Tier:
    """One way of answering: a model, the backend that runs it, and its settings."""

    name: str
    model: str
    backend: str = "llamacpp"
    context: int = 4096
    thinking: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    description: str = ""
    make: list[str] = field(default_factory=list)
    needs: str = ""
    parallel: int | str = 4  # concurrent slots when served (llama-server -np), or "auto" (sized by the planner); in-process backends run one at a time
    speculative: Speculative | None = None
    flash_attn: str = "off"  # llama-server -fa when served: off, on or auto (FLASH_ATTN_MODES)
    backend_sampling: bool = False  # llama-server --backend-sampling when served: sample on the GPU, not the CPU
    vram: int | None = None  # bytes of GPU memory the tier's placement may use (None: the GPU's free memory)
    rpc: tuple[str, ...] = ()  # llama.cpp RPC workers, HOST:PORT[=SIZE], that take a share of the layers
    expert_cache: int | None = None  # MoE on the int4 engine: device bytes for cached experts (None: auto, 0: off)
    expert_policy: str | None = None  # lru, lfu or hot (None: the engine's default)
    expert_prefetch: bool = True  # copy in the next MoE layer's likely experts ahead of it
    expert_cpu_share: float | None = None  # share of each MoE layer's experts computed on the CPU (None: the plan's)
    kv_cache: str | None = None  # KV cache mode: bf16/int8/tq4/tq3 (int4 engine), f16/q8_0/q4_0 (llama.cpp)
    yarn: float | None = None  # YaRN factor for the global layers' rope (int4 engine)


@dataclass(frozen=True)
class Recipe:
    """A named set of tiers, one of which answers when no other is chosen."""

    name: str
    description: str
    default_tier: str
    tiers: dict[str, Tier]
    path: str | None = None

    def tier(self, name: str) -> Tier:
        """Return the tier called name, or raise UnknownTierError."""
        try:
            return self.tiers[name]
        except KeyError:
            raise unknown_tier_error(name, list(self.tiers), self.default_tier) from None


def unknown_tier_error(name: str, tiers: Sequence[str], default_tier: str) -> UnknownTierError:
    """Build the error for a tier name the recipe does not define."""
    return UnknownTierError(
        f"unknown tier '{name}'; this recipe has {', '.join(tiers)}",
        hint=f"Pick one with --tier {default_tier}, or add the tier to the recipe.",
    )


# -- loading -------------------------------------------------------------------------------------


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate the recipe file at path."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: recipe file is not UTF-8 text") from None
    except OSError as exc:
        raise RecipeError(f"cannot read recipe file {path}: {exc.strerror}") from None
    return _parse(text, source=str(path), default_name=file.stem, path=str(path))


def parse_recipe(text: str, source: str = "<string>") -> Recipe:
    """Validate recipe YAML text; source names it in error messages."""
    return _parse(text, source=source, default_name="recipe", path=None)


def _parse(text: str, *, source: str, default_name: str, path: str | None) -> Recipe:
    """Compose text into YAML nodes (which keep line numbers) and read a Recipe from them."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f" line {mark.line + 1}" if mark else ""
        # PyYAML splits its explanation: context says what it was doing, problem what went wrong.
        problem = ", ".join(part for part in (exc.context, exc.problem) if part) or "cannot parse"
        raise RecipeError(f"{source}{line}: invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        # Reader errors (e.g. control characters) carry no mark; their text spans several lines.
        raise RecipeError(f"{source}: invalid YAML: {str(exc).splitlines()[0]}") from None
    if root is None:
        raise RecipeError(f"{source} line 1: the recipe is empty; it needs at least 'tiers'")
    return _Reader(source).recipe(root, default_name=default_name, path=path)


# -- built-in recipes ----------------------------------------------------------------------------


def builtin_recipe_names() -> list[str]:
    """Names of the recipes shipped with gemmactl, sorted."""
    return sorted(entry.name[: -len(".yaml")] for entry in _builtin_dir().iterdir() if entry.name.endswith(".yaml"))


def builtin_recipe_path(name: str) -> Path:
    """Path of the built-in recipe called name (".yaml" optional)."""
    stem = name.removesuffix(".yaml")
    if stem not in builtin_recipe_names():
        raise _no_recipe(name)
    entry = _builtin_dir() / f"{stem}.yaml"
    return entry if isinstance(entry, Path) else Path(str(entry))


def resolve_recipe(ref: str | None) -> Recipe:
    """Load a recipe from a file path or built-in name; None means $GEMMACTL_RECIPE or "default"."""
    from_env = ref is None and bool(os.environ.get(RECIPE_ENV))
    if ref is None:
        ref = os.environ.get(RECIPE_ENV) or DEFAULT_RECIPE
    if Path(ref).is_file():
        return load_recipe(ref)
    if ref.removesuffix(".yaml") not in builtin_recipe_names():
        raise _no_recipe(ref, from_env=from_env)
    return load_recipe(builtin_recipe_path(ref))


def _no_recipe(ref: str, *, from_env: bool = False) -> RecipeError:
    """The error for a recipe reference that is neither a file nor a built-in name."""
    names = ", ".join(builtin_recipe_names())
    # A stale environment variable is easy to forget, so say where the name came from.
    origin = f" (from ${RECIPE_ENV})" if from_env else ""
    return RecipeError(
        f"no recipe '{ref}'{origin}: not a file and not a built-in ({names})",
        hint="Pass a path to a recipe .yaml file or one of the built-in names.",
    )


def _builtin_dir() -> Traversable:
    """Directory holding the built-in recipes, installed or in the source tree."""
    try:
        return resources.files("gemmactl.builtin_recipes")
    except ModuleNotFoundError:
        return _SOURCE_RECIPES


# -- validation ----------------------------------------------------------------------------------

_TOP_KEYS = ("name", "description", "default_tier", "tiers")
_TIER_KEYS = (
    "model", "backend", "context", "thinking", "sampling", "description", "make", "needs", "parallel", "speculative",
    "flash_attn", "backend_sampling", "vram", "rpc", "expert_cache", "expert_policy",
    "expert_prefetch", "expert_cpu_share", "kv_cache", "yarn",
)
_SPECULATIVE_KEYS = ("type", "draft_model", "draft_max", "draft_min", "enabled")
_SAMPLING_KEYS = tuple(f.name for f in fields(Sampling))


@dataclass(frozen=True)
class _Field:
    """A mapping entry: its key, dotted path, key node (for its line) and value node."""

    name: str
    path: str
    key: Node
    value: Node


class _Reader:
    """Turns a composed YAML node tree into a Recipe, failing with field paths and lines."""

    def __init__(self, source: str):
        self.source = source

    def error(self, node: Node, message: str) -> RecipeError:
        """A RecipeError pointing at node's line (1-based)."""
        return RecipeError(f"{self.source} line {node.start_mark.line + 1}: {message}")

    def recipe(self, root: Node, *, default_name: str, path: str | None) -> Recipe:
        """Read the top-level mapping."""
        if not isinstance(root, MappingNode):
            raise self.error(root, f"the top level must be a mapping of recipe fields, got {_shown(root)}")
        entries = self.fields(root, "", _TOP_KEYS, required=("tiers",), anchor=root)
        name = self.string(entries["name"], non_empty=True) if "name" in entries else default_name
        description = self.string(entries["description"]) if "description" in entries else ""
        tiers = self.tiers(entries["tiers"])
        if "default_tier" in entries:
            entry = entries["default_tier"]
            default_tier = self.string(entry, non_empty=True)
            if default_tier not in tiers:
                raise self.error(
                    entry.value, f"default_tier '{default_tier}' is not one of the tiers ({', '.join(tiers)})"
                )
        else:
            default_tier = "fast" if "fast" in tiers else next(iter(tiers))
        return Recipe(name=name, description=description, default_tier=default_tier, tiers=tiers, path=path)

    def tiers(self, entry: _Field) -> dict[str, Tier]:
        """Read the tiers mapping, keeping the file's order."""
        node = entry.value
        if _is_null(node) or (isinstance(node, MappingNode) and not node.value):
            raise self.error(entry.key, "tiers must define at least one tier, e.g. 'fast:' with a 'model:'")
        tiers: dict[str, Tier] = {}
        for tier_entry in self.entries(node, "tiers"):
            name = tier_entry.name
            if not TIER_NAME.fullmatch(name):
                raise self.error(
                    tier_entry.key, f"{tier_entry.path}: tier names must match {TIER_NAME.pattern}, got '{name}'"
                )
            tiers[name] = self.tier(name, tier_entry)
        return tiers

    def tier(self, name: str, entry: _Field) -> Tier:
        """Read one tier; absent keys keep Tier's defaults."""
        values = self.fields(entry.value, entry.path, _TIER_KEYS, required=("model",), anchor=entry.key)
        model = self.string(values["model"], non_empty=True)
        changes: dict[str, object] = {}
        if "backend" in values:
            backend = self.string(values["backend"])
            if backend not in KNOWN_BACKENDS:
                raise self.error(
                    values["backend"].value,
                    f"{values['backend'].path} must be one of {', '.join(KNOWN_BACKENDS)}, got '{backend}'",
                )
            changes["backend"] = backend
        if "context" in values:
            changes["context"] = self.integer(values["context"], MIN_CONTEXT, f"an integer of at least {MIN_CONTEXT}")
        if "thinking" in values:
            changes["thinking"] = self.boolean(values["thinking"])
        if "sampling" in values:
            changes["sampling"] = self.sampling(values["sampling"])
        if "description" in values:
            changes["description"] = self.string(values["description"])
        if "make" in values:
            changes["make"] = self.string_list(values["make"])
        if "needs" in values:
            changes["needs"] = self.string(values["needs"])
        if "parallel" in values and _scalar(values["parallel"].value) == "auto":
            changes["parallel"] = "auto"
        elif "parallel" in values:
            changes["parallel"] = self.integer(values["parallel"], 1, f"an integer from 1 to {MAX_PARALLEL}, or auto")
            if changes["parallel"] > MAX_PARALLEL:
                raise self.error(
                    values["parallel"].value,
                    f"{values['parallel'].path} must be an integer from 1 to {MAX_PARALLEL}, got {changes['parallel']}",
                )
        if "speculative" in values:
            changes["speculative"] = self.speculative(values["speculative"])
        if "flash_attn" in values:
            changes["flash_attn"] = self.flash_attn(values["flash_attn"])
        if "backend_sampling" in values:
            changes["backend_sampling"] = self.boolean(values["backend_sampling"])
        if "vram" in values:
            changes["vram"] = self.size(values["vram"])
        if "rpc" in values:
            changes["rpc"] = self.workers(values["rpc"])
        if "expert_cache" in values:
            entry = values["expert_cache"]
            word = _scalar(entry.value)
            if word is False:  # YAML reads an unquoted off as false
                changes["expert_cache"] = 0
            elif isinstance(word, str) and word.strip().lower() in ("auto", "off"):
                changes["expert_cache"] = None if word.strip().lower() == "auto" else 0
            else:
                changes["expert_cache"] = self.size(entry)
        if "expert_policy" in values:
            from gemmactl.runtime.engine.expert_settings import POLICIES

            entry = values["expert_policy"]
            if _scalar(entry.value) not in POLICIES:
                raise self.error(entry.value, f"{entry.path} must be one of {', '.join(POLICIES)}, got {_shown(entry.value)}")
            changes["expert_policy"] = _scalar(entry.value)
        if "expert_prefetch" in values:
            changes["expert_prefetch"] = self.boolean(values["expert_prefetch"])
        if "expert_cpu_share" in values:
            from gemmactl.errors import InvalidOptionError
            from gemmactl.runtime.engine.expert_settings import parse_cpu_share

            entry = values["expert_cpu_share"]
            try:
                changes["expert_cpu_share"] = parse_cpu_share(_scalar(entry.value), option=entry.path)
            except InvalidOptionError:
                raise self.error(entry.value, f"{entry.path} must be a fraction from 0 to 1 or auto, "
                                              f"got {_shown(entry.value)}") from None
        if "kv_cache" in values:
            from gemmactl.runtime.engine.kv_modes import ENGINE_MODES, LLAMACPP_MODES, mode_problem

            entry = values["kv_cache"]
            backend = changes.get("backend", "llamacpp")
            known = ", ".join(ENGINE_MODES if backend == "int4" else LLAMACPP_MODES)
            if backend == "int4":
                known += " (or GLOBAL/WINDOWS, e.g. tq4/bf16)"
            mode = _scalar(entry.value)
            if not isinstance(mode, str) or mode_problem(mode, backend):
                raise self.error(entry.value, f"{entry.path} must be one of {known} with backend "
                                              f"{backend}, got {_shown(entry.value)}")
            changes["kv_cache"] = mode
        if "yarn" in values:
            if changes.get("backend", "llamacpp") != "int4":
                raise self.error(values["yarn"].value, f"{values['yarn'].path} needs backend: int4 (the engine applies YaRN)")
            changes["yarn"] = self.number(values["yarn"], lambda x: 1 <= x <= 64, "a YaRN factor from 1 to 64")
        return Tier(name=name, model=model, **changes)  # type: ignore[arg-type]

    def workers(self, entry: _Field) -> tuple[str, ...]:
        """A list of HOST:PORT[=SIZE] (or one string of them, comma-separated)."""
        from gemmactl.errors import GemmactlError
        from gemmactl.endpoints import parse_endpoints

        node = entry.value
        if isinstance(node, SequenceNode) and all(isinstance(item, ScalarNode) for item in node.value):
            items = [str(_scalar(item)) for item in node.value]
        elif isinstance(node, ScalarNode) and not _is_null(node):
            items = [str(_scalar(node))]
        else:
            raise self.error(node, f"{entry.path} must be a list of HOST:PORT, got {_shown(node)}")
        try:
            parse_endpoints(items, option=entry.path)
        except GemmactlError as exc:
            raise RecipeError(str(self.error(node, exc.message)), hint=exc.hint) from None
        return tuple(part.strip() for item in items for part in item.split(",") if part.strip())

    def size(self, entry: _Field) -> int:
        """A size such as 4G or 3.5GiB (docs/cli.md, sizes)."""
        from gemmactl.errors import GemmactlError
        from gemmactl.sizes import parse_size

        text = _scalar(entry.value)
        if not isinstance(entry.value, ScalarNode) or _is_null(entry.value) or isinstance(text, bool):
            raise self.error(entry.value, f"{entry.path} must be a size such as 4G, got {_shown(entry.value)}")
        try:
            return parse_size(str(text), option=entry.path)
        except GemmactlError as exc:
            raise RecipeError(str(self.error(entry.value, exc.message)), hint=exc.hint) from None

    def flash_attn(self, entry: _Field) -> str:
        """One of FLASH_ATTN_MODES; YAML's true/false (also unquoted on/off) mean on/off."""
        value = _scalar(entry.value)
        if isinstance(value, bool):
            return "on" if value else "off"
        if value not in FLASH_ATTN_MODES:
            raise self.error(
                entry.value, f"{entry.path} must be one of {', '.join(FLASH_ATTN_MODES)}, got {_shown(entry.value)}"
            )
        return value

    def sampling(self, entry: _Field) -> Sampling:
        """Read a tier's sampling mapping; absent keys keep Sampling's defaults."""
        values = self.fields(entry.value, entry.path, _SAMPLING_KEYS, required=(), anchor=entry.key)
        checks: dict[str, tuple[Callable[[float], bool], str]] = {
            "temperature": (lambda v: v >= 0, "a number >= 0"),
            "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
            "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "repeat_penalty": (lambda v: v > 0, "a number > 0"),
        }
        changes: dict[str, object] = {}
        for key, value in values.items():
            if key == "top_k":
                changes[key] = self.integer(value, 0, "a non-negative integer (0 turns it off)")
            elif key == "max_tokens":
                changes[key] = self.integer(value, 1, "a positive integer")
            else:
                ok, expected = checks[key]
                changes[key] = self.number(value, ok, expected)
        return Sampling(**changes)  # type: ignore[arg-type]

    def speculative(self, entry: _Field) -> Speculative:
        """Read a tier's speculative mapping: draft and mtp need a draft_model."""
        values = self.fields(entry.value, entry.path, _SPECULATIVE_KEYS, required=("type",), anchor=entry.key)
        kind = self.string(values["type"])
        if kind not in SPECULATIVE_KINDS:
            raise self.error(
                values["type"].value,
                f"{values['type'].path} must be one of {', '.join(SPECULATIVE_KINDS)}, got '{kind}'",
            )
        changes: dict[str, object] = {"kind": kind}
        if "draft_model" in values:
            changes["draft_model"] = self.string(values["draft_model"], non_empty=True)
        elif kind == "draft":
            raise self.error(entry.key, f"{entry.path} of type draft is missing required key 'draft_model'")
        for key in ("draft_max", "draft_min"):
            if key in values:
                changes[key] = self.integer(values[key], 0 if key == "draft_min" else 1,
                                            "a non-negative integer" if key == "draft_min" else "a positive integer")
        if "enabled" in values:
            changes["enabled"] = self.boolean(values["enabled"])
        result = Speculative(**changes)  # type: ignore[arg-type]
        if result.draft_min > result.draft_max:
            raise self.error(
                entry.key, f"{entry.path}.draft_min ({result.draft_min}) is above draft_max ({result.draft_max})"
            )
        return result

    # -- structure --------------------------------------------------------------------------------

    def entries(self, node: Node, path: str) -> list[_Field]:
        """The entries of a mapping node, with string keys and no duplicates."""
        if not isinstance(node, MappingNode):
            raise self.error(node, f"{path or 'the top level'} must be a mapping, got {_shown(node)}")
        seen: set[str] = set()
        result = []
        for key_node, value_node in node.value:
            key = _scalar(key_node)
            if not isinstance(key, str):
                raise self.error(key_node, f"{path or 'the top level'}: keys must be names, got {_shown(key_node)}")
            dotted = f"{path}.{key}" if path else key
            if key in seen:
                raise self.error(key_node, f"{dotted} is given twice")
            seen.add(key)
            result.append(_Field(key, dotted, key_node, value_node))
        return result

    def fields(
        self, node: Node, path: str, allowed: Sequence[str], *, required: Sequence[str], anchor: Node
    ) -> dict[str, _Field]:
        """A mapping's entries by key, rejecting unknown keys and reporting missing ones at anchor."""
        if _is_null(node) and required:
            raise self.error(anchor, f"{path} is missing required key '{required[0]}'")
        if _is_null(node):
            return {}
        result: dict[str, _Field] = {}
        for entry in self.entries(node, path):
            key = entry.name
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                guess = f" (did you mean '{close[0]}'?)" if close else ""
                raise self.error(
                    entry.key, f"unknown key '{entry.path}'{guess}; allowed keys are {', '.join(allowed)}"
                )
            result[key] = entry
        for key in required:
            if key not in result:
                where = path or "the recipe"
                raise self.error(anchor, f"{where} is missing required key '{key}'")
        return result

    # -- scalars ----------------------------------------------------------------------------------

    def string(self, entry: _Field, *, non_empty: bool = False) -> str:
        """A string value (quoted or not); numbers and booleans are refused."""
        value = _scalar(entry.value)
        if not isinstance(value, str) or (non_empty and not value.strip()):
            expected = "a non-empty string" if non_empty else "a string"
            raise self.error(entry.value, f"{entry.path} must be {expected}, got {_shown(entry.value)}")
        return value

    def integer(self, entry: _Field, minimum: int, expected: str) -> int:
        """An integer of at least minimum; booleans do not count as integers."""
        value = _scalar(entry.value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(entry.value, f"{entry.path} must be {expected}, got {_shown(entry.value)}")
        return value

    def number(self, entry: _Field, ok: Callable[[float], bool], expected: str) -> float:
        """A finite int or float value accepted by ok."""
        value = _scalar(entry.value)
        valid = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not valid or not math.isfinite(value) or not ok(value):
            raise self.error(entry.value, f"{entry.path} must be {expected}, got {_shown(entry.value)}")
        return float(value)

    def boolean(self, entry: _Field) -> bool:
        """A YAML boolean; the quoted string "true" is refused so a typo is not silently truthy."""
        value = _scalar(entry.value)
        if not isinstance(value, bool):
            raise self.error(entry.value, f"{entry.path} must be true or false, got {_shown(entry.value)}")
        return value

    def string_list(self, entry: _Field) -> list[str]:
        """A list of non-empty strings."""
        node = entry.value
        if not isinstance(node, SequenceNode):
            raise self.error(node, f"{entry.path} must be a list of commands, got {_shown(node)}")
        items = []
        for index, item in enumerate(node.value):
            items.append(self.string(_Field(str(index), f"{entry.path}[{index}]", item, item), non_empty=True))
        return items


def _scalar(node: Node) -> object:
    """The Python value of a scalar node (as yaml.safe_load would give it), or the node itself."""
    if not isinstance(node, ScalarNode):
        return node
    # A fresh constructor each time: it caches by node and would otherwise grow without bound.
    return SafeConstructor().construct_object(node)


def _is_null(node: Node) -> bool:
    """Whether node is an empty or null scalar, as in 'key:' with nothing after it."""
    return isinstance(node, ScalarNode) and node.tag == "tag:yaml.org,2002:null"


def _shown(node: Node) -> str:
    """How a value appears in an error message: quoted strings, raw YAML for the rest."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if _is_null(node):
        return "nothing"
    value = _scalar(node)
    return repr(value) if isinstance(value, str) else str(node.value)
