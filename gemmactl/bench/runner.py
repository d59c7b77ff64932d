"""The order of a bench run: load, warm up, interleave A B A B, warm prefix, concurrency."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from gemmactl.bench import stats
from gemmactl.bench.manifest import build_manifest, llama_cpp_identity, load_average, model_identity
from gemmactl.bench.prompts import LONG_PREFIX, BenchPrompt, load_prompts, long_conversation
from gemmactl.bench.targets import (
    COMPARE_CLASSES, COMPARE_TARGETS, ISOLATED, OURS, WARMUP_TOKENS, GemmactlTarget, TargetSettings, TargetUnavailable,
)
from gemmactl.errors import InvalidOptionError, NoLlamaBuildError, PromptTooLongError
from gemmactl.store import Store

RATIO_METRICS = ("wall_tok_s", "decode_tok_s", "ttft_s")
SUMMARY_METRICS = ("ttft_s", "prefill_tok_s", "decode_tok_s", "wall_tok_s", "wall_s")
Progress = Callable[[str, int, int], None]  # (what runs now, steps done, steps in all)


class _Steps:
    """Counts a bench run's steps (loads, warm-ups, measured requests) for one progress bar."""

    def __init__(self, report: Progress, total: int):
        self.report, self.total, self.done = report, total, 0

    def __call__(self, message: str) -> None:
        self.done += 1
        self.report(message, self.done, self.total)


@dataclass
class BenchConfig:
    """Everything a bench run was asked for (the CLI's flags, parsed)."""

    recipe: str | None = None
    model: str | None = None
    tier: str | None = None
    prompts: str = "builtin"
    max_tokens: int = 128
    concurrency: list[int] = field(default_factory=lambda: [1])
    repeat: int = 3
    warm_prefix: bool = False
    compare: list[str] = field(default_factory=list)
    gguf: str | None = None  # the same model as GGUF, for the llama.cpp targets of a non-GGUF --model
    hf_model: str | None = None
    vram_bytes: int | None = None
    context: int | None = None
    timeout_s: float = 600.0
    draft: str | None = None  # speculative decoding in llama-server with this draft model
    draft_max: int | None = None
    rpc: tuple[str, ...] = ()  # RPC workers for gemmactl's own target (instead of the tier's rpc)
    experts: tuple = (None, None, None, None)  # --expert-cache, --expert-policy, --expert-prefetch, --expert-cpu-share
    flags: dict = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)


def parse_concurrency(text: str) -> list[int]:
    """"1,16,64" → [1, 16, 64]; anything else is bad input."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or any(level < 1 for level in levels):
        raise InvalidOptionError(
            f"--concurrency {text!r} is not a list of positive whole numbers", hint="Write it like 1,16,64."
        )
    return sorted(set(levels))


def parse_compare(values: list[str]) -> list[str]:
    """Targets from repeated and comma-separated --compare values, each known, in order, once."""
    names = [name.strip() for value in values for name in value.split(",") if name.strip()]
    for name in names:
        if name not in COMPARE_TARGETS:
            raise InvalidOptionError(
                f"unknown --compare target '{name}'", hint=f"Choose from {', '.join(COMPARE_TARGETS)}."
            )
    return list(dict.fromkeys(names))


def check_config(config: BenchConfig) -> list[BenchPrompt]:
    """Refuse bad input before anything loads; returns the prompts."""
    if config.max_tokens < 1 or config.repeat < 1:
        raise InvalidOptionError("--max-tokens and --repeat must be at least 1")
    compare = parse_compare(config.compare)
    if config.draft_max is not None and not config.draft:
        raise InvalidOptionError("--draft-max sets how many tokens the draft model proposes, and there is no --draft",
                                 hint="Pass --draft GGUF as well, or leave --draft-max out.")
    if config.rpc and (set(compare) & {"llama-server", "llama-cpp-python"} or max(config.concurrency) > 1):
        raise InvalidOptionError("--rpc measures gemmactl's own target alone: a worker serves one head at a time, "
                                 "and the llama.cpp targets would wait on it",
                                 hint="Leave out --compare llama-server/llama-cpp-python and --concurrency above 1.")
    from gemmactl.runtime.engine.expert_settings import check_policy, parse_cpu_share, parse_expert_cache

    cache, policy, _, share = config.experts
    if cache is not None:
        parse_expert_cache(cache)
    parse_cpu_share(share)
    if policy is not None:
        check_policy(policy)
    if config.draft and "llama-server" not in compare and max(config.concurrency) == 1:
        raise InvalidOptionError("--draft runs speculative decoding in llama-server, and this run starts none",
                                 hint="Add --compare llama-server (or --concurrency 1,N).")
    return load_prompts(config.prompts)


def run_bench(config: BenchConfig, store: Store, *, log_dir: Path, progress: Progress | None = None) -> dict:
    """Measure gemmactl (and each --compare target) and return the result with its manifest."""
    from gemmactl.generate import plan_run, resolve_run_model
    from gemmactl.recipes import resolve_recipe

    load_at_start = load_average()
    prompts = check_config(config)
    compare = parse_compare(config.compare)
    per_target = 2 + config.repeat * len(prompts) + (config.repeat if config.warm_prefix else 0)  # load, warm-up, runs
    levels = len(config.concurrency) * config.repeat if config.concurrency != [1] else 0
    progress = _Steps(progress or (lambda message, done, total: None), per_target * (1 + len(compare)) + levels)
    spec = plan_run("bench", resolve_recipe(config.recipe), tier=config.tier, model=config.model,
                    max_tokens=config.max_tokens, temperature=0.0, raw=True)
    # Greedy and unpenalised on every side, so that all targets can produce the same text.
    request = replace(spec.request, repeat_penalty=1.0, seed=0)
    model = resolve_run_model(spec, store)
    model_path = model.path
    speculative_args, speculative = _speculative(config, spec.tier, store)
    is_gguf = model.format == "gguf"
    gguf_path = _gguf_twin(config.gguf, is_gguf, store) or (model_path if is_gguf else None)
    needs_server = any(level > 1 for level in config.concurrency)
    server_binary = _server_binary(store, required=needs_server)
    hf_model = _hf_model(config.hf_model, model_path, store)

    progress(f"loading {model_path.name}")
    tier = replace(spec.tier, rpc=config.rpc) if config.rpc else spec.tier
    backend, context_note = _load_fitting(model, tier, request, prompts, config, store)
    # Every llama.cpp target runs with gemmactl's placement, so they measure the same configuration.
    placement = backend.placement
    settings = TargetSettings(
        model_path=str(gguf_path or model_path), is_gguf=gguf_path is not None,
        context=backend.context_size, threads=backend.threads or _threads(),
        extra_buffers=_extra_buffers() if gguf_path else True,
        n_gpu_layers=placement.n_gpu_layers if placement else -1,
        tensor_overrides=placement.tensor_overrides if placement else (),
        placement_args=placement.llama_server_args if placement else (),
        log_dir=log_dir, server_binary=server_binary, hf_model=hf_model,
        vram_bytes=config.vram_bytes, speculative_args=speculative_args,
    )
    targets = [GemmactlTarget(backend, request)]
    skipped = []
    try:
        for name in compare:
            progress(f"loading {name}")
            try:
                targets.append(_open_target(name, settings))
            except TargetUnavailable as exc:
                skipped.append({"target": name, "reason": str(exc)})
                progress.total -= per_target - 1
        for target in targets:
            progress(f"{target.name}: warm-up")
            target.generate(prompts[0].text, WARMUP_TOKENS)
        runs = _interleaved(targets, prompts, config, progress)
        warm = _warm_prefix(targets, config, progress) if config.warm_prefix else []
        loads = {target.name: target.load_s for target in targets}
        infos = {target.name: target.info() for target in targets}
    finally:
        for target in reversed(targets):
            target.close()

    concurrency = []
    if config.concurrency != [1]:
        from gemmactl.bench.concurrency import run_level

        loaded = [p for p in prompts if p.set != LONG_PREFIX] or prompts
        for level in config.concurrency:
            concurrency.append(run_level(settings, loaded, level, rounds=config.repeat, max_tokens=config.max_tokens,
                                         timeout_s=config.timeout_s, progress=progress))
        base = next((row for row in concurrency if row["concurrency"] == 1), None)
        for row in concurrency:
            if base and base["aggregate_tok_s"]["median"]:
                row["speedup_vs_1"] = row["aggregate_tok_s"]["median"] / base["aggregate_tok_s"]["median"]

    manifest = build_manifest(
        store=store,
        model=model_identity(model_path, store, _gguf_metadata(model_path) if is_gguf else None),
        llama_cpp=llama_cpp_identity(store, backend.library),
        settings={
            "context": settings.context, "context_note": context_note, "threads": settings.threads,
            "extra_buffers": settings.extra_buffers, "n_gpu_layers": settings.n_gpu_layers,
            "temperature": 0.0, "repeat_penalty": 1.0, "max_tokens": config.max_tokens, "repeat": config.repeat,
            "warmup": f"one untimed {WARMUP_TOKENS}-token request per target after loading",
            "tier": spec.tier.name, "backend": backend.name, "prompts": [p.name for p in prompts],
            **({"placement": placement.reason} if placement else {}),
            **({"speculative": speculative} if speculative else {}),
        },
        flags=config.flags, argv=config.argv, load_at_start=load_at_start,
    )
    return {
        "manifest": manifest,
        "targets": {name: {"load_s": loads[name], **infos[name]} for name in loads},
        "runs": runs,
        "summary": _summaries(runs),
        "comparisons": _comparisons(runs, [t.name for t in targets if t.name != OURS]),
        "warm_prefix": warm,
        "warm_prefix_summary": _warm_summaries(warm, {t.name: t for t in targets}),
        "concurrency": concurrency,
        "skipped": skipped,
        "checks": _checks(runs),
    }


def _open_target(name: str, settings: TargetSettings):
    """Load one --compare target: llama.cpp ones in this process, torch ones in a worker (bench/isolated.py)."""
    if name in ISOLATED:
        from gemmactl.bench.isolated import IsolatedTarget

        return IsolatedTarget(ISOLATED[name], settings)
    return COMPARE_CLASSES[name](settings)


def _gguf_twin(ref: str | None, is_gguf: bool, store: Store) -> Path | None:
    """--gguf: the GGUF the llama.cpp targets run beside a model of another format."""
    if ref is None:
        return None
    if is_gguf:
        raise InvalidOptionError("--gguf gives the llama.cpp targets a GGUF beside a model of another format, "
                                 "and --model is a GGUF already", hint="Leave --gguf out.")
    from gemmactl.store.refs import GGUF, resolve_model

    return Path(resolve_model(ref, store, accept=(GGUF,)).path)


def _speculative(config: BenchConfig, tier, store: Store) -> tuple[tuple[str, ...], dict | None]:
    """llama-server's flags for --draft, built as `gemmactl serve` builds a tier's, and what they mean."""
    if not config.draft:
        return (), None
    from gemmactl.generate import speculative_args
    from gemmactl.recipes import Speculative
    from gemmactl.store.refs import GGUF, resolve_model

    draft_path = resolve_model(config.draft, store, accept=(GGUF,)).path
    recipe = tier.speculative or Speculative()
    draft_max = config.draft_max or recipe.draft_max
    chosen = Speculative(kind="draft", draft_model=str(draft_path), draft_max=draft_max,
                         draft_min=min(recipe.draft_min, draft_max))
    args, _ = speculative_args(chosen, store)
    origin = "--draft-max" if config.draft_max else ("the tier's speculative.draft_max" if tier.speculative
                                                     else "the recipe default")
    return args, {"draft": str(draft_path), "draft_max": chosen.draft_max, "draft_min": chosen.draft_min,
                  "draft_max_from": origin, "server_args": list(args)}


def _load_fitting(model, tier, request, prompts, config: BenchConfig, store: Store):
    """gemmactl's backend with a context that holds the longest prompt plus --max-tokens (and why, if raised)."""
    from gemmactl.generate import backend_for, draft_settings_for, expert_settings_for, open_backend

    backend = open_backend(model, context=config.context or tier.context, store=store, vram=tier.vram, rpc=tier.rpc,
                           experts=expert_settings_for(tier, *config.experts), kv_cache=tier.kv_cache, yarn=tier.yarn,
                           draft=draft_settings_for(tier, store, engine=backend_for(model) == "int4"))
    try:
        longest = max(len(backend.prepare(replace(request, prompt=p.text)).tokens) for p in _all_prompts(prompts, config))
    except BaseException:
        backend.close()
        raise
    needed = longest + config.max_tokens
    if needed <= backend.context_size:
        return backend, None
    backend.close()
    if config.context:
        raise PromptTooLongError(
            f"the longest prompt is {longest} tokens; with --max-tokens {config.max_tokens} it needs a "
            f"context of {needed}, but --context is {config.context}",
            hint=f"Pass --context {_round_up(needed)} or fewer --max-tokens.",
        )
    note = f"raised from the tier's {backend.context_size} to fit {longest} prompt + {config.max_tokens} tokens"
    # llama_cpp is imported by now with the library chosen for the first load: select_library reuses it.
    return open_backend(model, context=_round_up(needed), store=store, vram=tier.vram, rpc=tier.rpc,
                        experts=expert_settings_for(tier, *config.experts), kv_cache=tier.kv_cache, yarn=tier.yarn,
                        draft=draft_settings_for(tier, store, engine=backend_for(model) == "int4")), note


def _extra_buffers() -> bool:
    """The extra-buffer choice gemmactl's llama.cpp backend made (the compared llama.cpps make the same)."""
    from gemmactl.runtime.llamacpp import use_extra_buffers

    return use_extra_buffers()


def _gguf_metadata(path: Path) -> dict:
    from gemmactl.formats.gguf_header import read_gguf_header

    return read_gguf_header(path, tensors=False).metadata


def _all_prompts(prompts: list[BenchPrompt], config: BenchConfig) -> list[BenchPrompt]:
    extra = [BenchPrompt(LONG_PREFIX, "warm", long_conversation(1))] if config.warm_prefix else []
    return prompts + extra


def _round_up(tokens: int, step: int = 512) -> int:
    return -(-tokens // step) * step


def _threads() -> int:
    from gemmactl.runtime.llamacpp import default_threads

    return default_threads()


def _server_binary(store: Store, *, required: bool) -> Path | None:
    from gemmactl.llamacpp.build import active_build

    build = active_build(store)
    if build is None or "llama-server" not in build.binaries:
        if required:
            raise NoLlamaBuildError("--concurrency above 1 runs against llama-server, and there is no llama.cpp build with it")
        return None
    return build.binary("llama-server")


def _hf_model(ref: str | None, model_path: Path, store: Store) -> Path | None:
    """--hf-model (a directory or store name), else the store's checkpoint the GGUF was made from."""
    if ref:
        artifact = store.get(ref)
        path = Path(artifact.path) if artifact else Path(ref).expanduser()
        if not (path / "config.json").is_file():
            raise InvalidOptionError(f"--hf-model {ref}: no config.json there; pass a Hugging Face checkpoint directory")
        return path
    made = next((a for a in store.list() if Path(a.path) == model_path), None)
    if made is None or not made.source:
        return None
    origin = next((a for a in store.list() if a.format == "hf" and a.source == made.source), None)
    return Path(origin.path) if origin else None


def _interleaved(targets, prompts: list[BenchPrompt], config: BenchConfig, progress: Progress) -> list[dict]:
    """Repeat by repeat, prompt by prompt, each target in turn: A B A B, so drift hits all alike."""
    rows = []
    for repeat in range(1, config.repeat + 1):
        for prompt in prompts:
            for target in targets:
                progress(f"{target.name}: {prompt.name}, repeat {repeat}/{config.repeat}")
                sample = target.generate(prompt.text, config.max_tokens)
                rows.append({
                    "target": target.name, "prompt_set": prompt.set, "prompt": prompt.name, "repeat": repeat,
                    "load_s": target.load_s, **sample.metrics,
                    "engine_decode_tok_s": sample.engine_decode_tok_s, **sample.extra, **target.memory(),
                    "text": sample.text,
                })
    return rows


def _warm_prefix(targets, config: BenchConfig, progress: Progress) -> list[dict]:
    """The long conversation cold, then the same again warm; a new variant each repeat, so cold is cold."""
    rows = []
    for repeat in range(1, config.repeat + 1):
        text = long_conversation(variant=repeat)
        for target in targets:
            progress(f"{target.name}: warm prefix, repeat {repeat}/{config.repeat}")
            cold = target.generate(text, config.max_tokens, cache="fill")
            warm = target.generate(text, config.max_tokens, cache="reuse")
            rows.append({
                "target": target.name, "repeat": repeat, "prompt_tokens": cold.metrics["prompt_tokens"],
                "cold_ttft_s": cold.metrics["ttft_s"], "warm_ttft_s": warm.metrics["ttft_s"],
                "warm_over_cold": warm.metrics["ttft_s"] / cold.metrics["ttft_s"] if cold.metrics["ttft_s"] else None,
                "cached_tokens": warm.cached_tokens, "same_text": cold.text == warm.text,
                "first_difference": _first_difference(cold.text, warm.text), "cold_text": cold.text, "warm_text": warm.text,
            })
    return rows


def _warm_summaries(rows: list[dict], targets: dict) -> list[dict]:
    out = []
    for name in dict.fromkeys(row["target"] for row in rows):
        mine = [row for row in rows if row["target"] == name]
        out.append({
            "target": name,
            "prefix_reuse": targets[name].prefix_reuse,
            "note": targets[name].note,
            "prompt_tokens": mine[0]["prompt_tokens"],
            "cold_ttft_s": stats.summary([row["cold_ttft_s"] for row in mine]),
            "warm_ttft_s": stats.summary([row["warm_ttft_s"] for row in mine]),
            "warm_over_cold": stats.summary([row["warm_over_cold"] for row in mine if row["warm_over_cold"]]),
            "cached_tokens": stats.summary([row["cached_tokens"] or 0 for row in mine]),
            "same_text": all(row["same_text"] for row in mine),
            "same_text_repeats": sum(row["same_text"] for row in mine),
            "repeats": len(mine),
        })
    return out


def _first_difference(a: str, b: str) -> int | None:
    """Index of the first character where two texts differ (None when equal): a late flip is a near tie, an early one a broken cache."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _summaries(runs: list[dict]) -> list[dict]:
    """min/median/max of each metric per target and prompt set (and over all prompts)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in runs:
        groups.setdefault((row["target"], row["prompt_set"]), []).append(row)
        groups.setdefault((row["target"], "all"), []).append(row)
    return [
        {"target": target, "prompt_set": prompt_set, "runs": len(rows), "load_s": rows[0]["load_s"],
         "prompt_tokens": stats.summary([r["prompt_tokens"] for r in rows]),
         "generated_tokens": stats.summary([r["generated_tokens"] for r in rows]),
         **{metric: stats.summary([r[metric] for r in rows]) for metric in SUMMARY_METRICS},
         **(stats.draft_totals(rows) if "draft_tokens" in rows[0] else {}),
         "peak_rss_bytes": max((r["peak_rss_bytes"] or 0) for r in rows), "memory_scope": rows[0]["memory_scope"]}
        for (target, prompt_set), rows in sorted(groups.items(), key=lambda item: (item[0][1] == "all", _order(runs, item[0])))
    ]


def _order(runs: list[dict], key: tuple[str, str]) -> tuple[int, int]:
    """Prompt sets in the order they ran, targets in the order they ran within a set."""
    sets = list(dict.fromkeys(r["prompt_set"] for r in runs))
    targets = list(dict.fromkeys(r["target"] for r in runs))
    return (sets.index(key[1]) if key[1] in sets else len(sets), targets.index(key[0]))


def _comparisons(runs: list[dict], others: list[str]) -> list[dict]:
    """gemmactl ÷ target, pair by pair (same prompt, same repeat), per prompt set and over all."""
    ours = {(r["prompt"], r["repeat"]): r for r in runs if r["target"] == OURS}
    out = []
    for name in others:
        pairs = [(ours[(r["prompt"], r["repeat"])], r) for r in runs if r["target"] == name]
        sets = ["all"] + list(dict.fromkeys(r["prompt_set"] for _, r in pairs))
        for prompt_set in sets:
            chosen = [(a, b) for a, b in pairs if prompt_set == "all" or b["prompt_set"] == prompt_set]
            ratios = {m: stats.pair_ratios([a[m] for a, _ in chosen], [b[m] for _, b in chosen]) for m in RATIO_METRICS}
            row = {
                "target": name, "prompt_set": prompt_set, "pairs": len(chosen),
                "ratio_gemmactl_over_target": {m: {**stats.summary(v), "pairs": v} for m, v in ratios.items() if v},
                "same_text": all(a["text"] == b["text"] for a, b in chosen),
                "same_tokens": all(a["prompt_tokens"] == b["prompt_tokens"] and a["generated_tokens"] == b["generated_tokens"]
                                   for a, b in chosen),
            }
            if chosen and "draft_tokens" in chosen[0][1]:
                # The target decoded speculatively: is its greedy text still gemmactl's plain one? Reported,
                # not required: verifying a batch of drafted tokens can flip a near tie.
                row["target_speculative"] = True
                row["same_text_pairs"] = sum(a["text"] == b["text"] for a, b in chosen)
                row["first_differences"] = [_first_difference(a["text"], b["text"]) for a, b in chosen]
            out.append(row)
    return out


def _checks(runs: list[dict]) -> dict:
    """The arithmetic's invariants on the measured runs (see stats.py)."""
    return {
        "wall_identity_max_error_s": max((stats.wall_identity_error(r) for r in runs), default=0.0),
        "wall_above_decode_runs": sum(stats.wall_exceeds_decode(r) for r in runs),
        "runs": len(runs),
    }
