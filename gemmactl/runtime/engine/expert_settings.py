"""What a tier asks of the MoE expert cache (`--expert-cache`, `--expert-policy`, recipe fields).

Kept apart from runtime/engine/experts.py so recipes and the CLI can check the options without
importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("lru", "lfu", "hot")
# The best hit rate on the skewed synthetic traces of benchmarks/expert_policies.py (26B-A4B's
# shape, the 4 GiB plan's 369 experts), and even with hot on the uniform one: uniform 8.0% (lru
# 6.2%, hot 8.1%), Zipf 0.8 36.1% (lru 16.8%, hot 29.4%), Zipf 1.2 55.5% (lru 33.3%, hot 51.2%);
# docs/benchmarks.md.
DEFAULT_POLICY = "lfu"
CACHE_WORDS = ("auto", "off")
EXPERT_SCRATCH_ROWS = 2  # device rows, beside the cache, for the misses it does not keep (the plan counts them)


@dataclass(frozen=True)
class ExpertSettings:
    cache_bytes: int | None = None  # device bytes for cached experts; None: auto (the plan's room, else every expert)
    policy: str = DEFAULT_POLICY
    miss: str | None = None  # force "copy" or "cpu" for every miss (measurements, tests)
    rule: object | None = None  # a MissRule with the machine's prices; None: copy every miss
    prefetch: bool = True  # copy in the next MoE layer's likely experts (measured to pay on an H200: docs/benchmarks.md)
    arena: bool | None = None  # experts laid out for copying (runtime/engine/expert_arena.py); None: on CUDA
    progress: object | None = None  # callback(done, total bytes) while a first load writes the CPU layouts
    # The share of each MoE layer's experts computed on the CPU, always (runtime/engine/experts.py,
    # "homes"); None: the plan's choice, else none. 1.0 is llama.cpp's --n-cpu-moe for every layer.
    cpu_share: float | None = None

    @property
    def is_default(self) -> bool:
        return (self.cache_bytes is None and self.policy == DEFAULT_POLICY and self.miss is None and self.prefetch
                and self.cpu_share is None)


def parse_expert_cache(value: str | int | None, *, option: str = "--expert-cache") -> int | None:
    """'auto'/None → None (sized for the model), 'off' → 0, a size ('2G', '512MiB', bytes) → bytes."""
    from gemmactl.sizes import parse_size

    if value is None or str(value).strip().lower() == "auto":
        return None
    if str(value).strip().lower() == "off":
        return 0
    return parse_size(str(value), option=option)


def parse_cpu_share(value: str | float | None, *, option: str = "--expert-cpu-share") -> float | None:
    """'auto'/None → None (the plan's choice), a fraction in [0, 1] → itself."""
    from gemmactl.errors import InvalidOptionError

    if value is None or str(value).strip().lower() == "auto":
        return None
    try:  # a YAML true or a list is not a fraction, whatever float() makes of it
        share = -1.0 if isinstance(value, bool) or not isinstance(value, (str, int, float)) else float(value)
    except (TypeError, ValueError):
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise InvalidOptionError(f"{option} {value!r} is not a fraction from 0 to 1",
                                 hint="Give e.g. 0.5 (half of each MoE layer's experts on the CPU), 0, 1 or auto.")
    return share


def describe_counters(stats: dict) -> str:
    """The expert cache's counters (ExpertCache.stats, as `run --json` and `bench --json` give them)
    in one line for a person: policy, size, hit rate, bytes over the link per decoded token (where
    nothing was decoded one token at a time: per token, a prompt's included) and the share of expert
    uses computed on the host."""
    from gemmactl.sizes import format_size

    rate = "-" if stats["hit_rate"] is None else f"{stats['hit_rate']:.0%}"
    decoded = stats.get("link_bytes_per_decode_token")
    link = (f"{format_size(decoded)} over the link per decoded token" if decoded is not None
            else f"{format_size(stats['link_bytes_per_token'])} over the link per token")
    return (f"{stats['policy']} cache of {stats['capacity_experts']} ({format_size(stats['cache_bytes'])}), "
            f"hit rate {rate}, {link}, {stats['host_share']:.0%} computed on the CPU")


def check_policy(value: str | None, *, option: str = "--expert-policy") -> str:
    from gemmactl.errors import InvalidOptionError

    if value is None:
        return DEFAULT_POLICY
    if value not in POLICIES:
        raise InvalidOptionError(f"{option} {value!r} is not an expert cache policy",
                                 hint=f"Use one of: {', '.join(POLICIES)}.")
    return value
