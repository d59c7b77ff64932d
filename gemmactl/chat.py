"""A conversation at the terminal: history, tiers and a system text, through the one generation path.

Each turn is routed as `run` routes a prompt (prefix, `/tier`, heuristic), then generated from
the whole conversation so far, so the model sees every earlier turn. The models of the tiers
used stay loaded for the session (tiers that share a model share one backend).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from gemmactl.errors import InvalidOptionError
from gemmactl.generate import (RunSpec, backend_for, check_backend, draft_settings_for, expert_settings_for,
                               make_request, open_backend, resolve_run_model, route_prompt)
from gemmactl.recipes import Recipe
from gemmactl.runtime.base import Backend, GenerationStats, Piece, stream_generate
from gemmactl.store import Store

COMMANDS = {
    "/tier": "/tier NAME: answer every turn on this tier; /tier auto: route each turn again",
    "/system": "/system TEXT: the system text for the rest of the conversation; /system alone clears it",
    "/clear": "/clear: forget the conversation so far (the tier and system text stay)",
    "/help": "/help: these commands",
    "/exit": "/exit (or /bye, Ctrl-D): leave",
}


@dataclass
class Turn:
    """What one turn produced: the pieces as they came, then the stats."""

    tier: str
    reason: str
    answer: str = ""
    thinking: str = ""
    stats: GenerationStats | None = None


@dataclass
class ChatSession:
    """A conversation: its history, the tier it is pinned to (if any), its system text, open backends."""

    recipe: Recipe
    store: Store
    tier: str | None = None
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    history: list[dict] = field(default_factory=list)
    _backends: dict = field(default_factory=dict)

    def set_tier(self, name: str | None) -> None:
        """Pin every turn to a tier (None or "auto": route each turn)."""
        if name in (None, "", "auto"):
            self.tier = None
            return
        self.recipe.tier(name)  # raises UnknownTierError naming the recipe's tiers
        self.tier = name

    def clear(self) -> None:
        self.history.clear()

    def ask(self, text: str, turn: Turn | None = None) -> Iterator[Piece | GenerationStats]:
        """Answer one user message with the whole conversation; the exchange joins the history."""
        chosen = route_prompt(text, self.recipe, tier=self.tier)
        tier = self.recipe.tier(chosen.tier)
        check_backend(self.recipe, tier)
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.history + [
            {"role": "user", "content": chosen.prompt}]
        request = make_request(chosen, tier, max_tokens=self.max_tokens, temperature=self.temperature,
                               seed=self.seed, messages=tuple(messages))
        backend = self._backend(RunSpec(chosen, tier, tier.model, True, request))
        if turn is not None:
            turn.tier, turn.reason = tier.name, chosen.reason
        answer = []
        for event in stream_generate(backend, request):
            if isinstance(event, Piece) and event.channel == "answer":
                answer.append(event.text)
            yield event
        self.history += [{"role": "user", "content": chosen.prompt},
                         {"role": "assistant", "content": "".join(answer).strip()}]

    def _backend(self, spec: RunSpec) -> Backend:
        model = resolve_run_model(spec, self.store)
        key = (str(model.path), spec.tier.context)
        if key not in self._backends:
            self._backends[key] = open_backend(model, context=spec.tier.context, store=self.store, vram=spec.tier.vram,
                                               experts=expert_settings_for(spec.tier), kv_cache=spec.tier.kv_cache,
                                               yarn=spec.tier.yarn,
                                               draft=draft_settings_for(spec.tier, self.store,
                                                                        engine=backend_for(model) == "int4"))
        return self._backends[key]

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()
        self._backends.clear()


def parse_command(line: str) -> tuple[str, str] | None:
    """("/tier", "deep") for a command line, None for a message; unknown commands are bad input."""
    if not line.startswith("/"):
        return None
    name, _, rest = line.strip().partition(" ")
    name = {"/bye": "/exit", "/quit": "/exit", "/?": "/help"}.get(name, name)
    if name not in COMMANDS:
        raise InvalidOptionError(f"unknown command {name}", hint="Type /help for the commands.")
    return name, rest.strip()
