"""`gemmactl serve` as a library: start every tier's warm backend and the front, stop them all.

Tiers with the same model and server settings share one llama-server. Without a llama.cpp
build, GGUF tiers run in process (one request at a time) and a warning says so; int4 tiers
always run in process.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemmactl.errors import GemmactlError, InvalidOptionError, NoLlamaBuildError, PortInUseError, ServeAddressError
from gemmactl.llamacpp.draft_tuner import ServerDraftTuner
from gemmactl.recipes import Recipe
from gemmactl.store.refs import ResolvedModel
from gemmactl.server.backends import InProcessBackend, ServerBackend
from gemmactl.server.lanes import Lane
from gemmactl.server.peers import PeerSet
from gemmactl.server.registry import state_path, write_state
from gemmactl.store import Store, utc_now

log = logging.getLogger("gemmactl.serve")

DEFAULT_QUEUE = 512
DEFAULT_PORT = 8080
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_SLOTS = 4  # a `parallel: auto` tier whose model the planner cannot read


@dataclass
class ServeConfig:
    recipe: Recipe
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: any free port
    api_key: str | None = None
    peers: list[str] = field(default_factory=list)
    queue: int = DEFAULT_QUEUE  # requests waiting per tier before 503
    speculative: bool = True  # False turns off every tier's speculative decoding
    threads: int | None = None
    request_timeout: float = 600.0  # longest wait for a slot
    require_build: bool = False  # fail instead of falling back to the in-process backend
    log_path: Path | None = None  # where this server's log goes (`gemmactl logs`)
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open client connections; past it, 503 at once


@dataclass(frozen=True)
class BackendPlan:
    """How one backend is made: which tiers share it and with what settings."""

    key: tuple
    kind: str  # "llama-server", "llamacpp" or "int4" (the last two in process)
    model: ResolvedModel
    tiers: list[str]
    context: int
    parallel: int
    spec_args: tuple[str, ...] = ()
    spec_note: str = "off"
    slots_note: str = ""  # why a `parallel: auto` tier got its slots
    flash_attn: str = "off"  # llama-server -fa (the tiers' recipe flash_attn)
    backend_sampling: bool = False  # llama-server --backend-sampling (the tiers' recipe backend_sampling)
    vram: int | None = None  # the tiers' GPU budget (recipe vram)
    rpc: tuple[str, ...] = ()  # the tiers' RPC workers (recipe rpc), for llama.cpp tiers
    experts: object | None = None  # the tiers' expert cache (recipe expert_*), for int4 tiers
    kv_cache: str | None = None  # the tiers' KV cache mode (recipe kv_cache)
    yarn: float | None = None  # the tiers' YaRN factor (recipe yarn), for int4 tiers
    draft: object | None = None  # the tiers' draft (recipe speculative: draft_model), for int4 tiers


def _draft_max(spec_args: tuple[str, ...]) -> int | None:
    """The --spec-draft-n-max of a tier's speculative flags (None for n-grams, which have none)."""
    args = list(spec_args)
    return int(args[args.index("--spec-draft-n-max") + 1]) if "--spec-draft-n-max" in args else None


def plan_backends(recipe: Recipe, store: Store, *, speculative: bool, require_build: bool
                  ) -> tuple[list[BackendPlan], dict[str, str], list[str]]:
    """(backend plans, tier → why it cannot run, warnings); loads nothing."""
    from gemmactl.generate import backend_for, draft_settings_for, expert_settings_for, speculative_args
    from gemmactl.llamacpp.build import active_build
    from gemmactl.store.refs import RUNNABLE, resolve_model

    build = active_build(store)
    server_binary = build.binaries.get("llama-server") if build else None
    if require_build and server_binary is None:
        raise NoLlamaBuildError("no llama.cpp build with llama-server to serve GGUF tiers from")
    plans: dict[tuple, BackendPlan] = {}
    unavailable: dict[str, str] = {}
    warnings: list[str] = []
    for name, tier in recipe.tiers.items():
        hint = f" Make it with: {' && '.join(tier.make)}" if tier.make else ""
        try:
            model = resolve_model(tier.model, store, accept=RUNNABLE, missing_hint=hint.strip() or None)
            path = model.path
            kind = backend_for(model)
            spec_args, spec_note = speculative_args(tier.speculative if speculative and kind == "llamacpp" else None,
                                                    store)
        except GemmactlError as exc:
            unavailable[name] = f"{exc.message}.{hint or (' ' + exc.hint if exc.hint else '')}"
            continue
        slots, slots_note = tier.parallel, ""
        engine_draft = (kind == "int4" and speculative and tier.speculative is not None
                        and tier.speculative.enabled and tier.speculative.kind == "draft")
        if kind == "llamacpp" and server_binary is not None:
            if slots == "auto":
                slots, slots_note = auto_slots(path, tier.context, store, tier.kv_cache)
            key = ("llama-server", str(path), tier.context, slots, spec_args, tier.flash_attn, tier.backend_sampling,
                   tier.vram, tier.rpc, tier.kv_cache)
            kind = "llama-server"
        else:
            if kind == "llamacpp":
                warnings.append(f"tier {name}: no llama.cpp build with llama-server, so it runs in process, one "
                                "request at a time, without prompt caching; run `gemmactl build` for the server")
            if tier.speculative and tier.speculative.enabled and speculative and not engine_draft:
                warnings.append(f"tier {name}: speculative decoding needs llama-server (or an int4 tier with a "
                                "draft model); it is off for this tier")
            for field, value in (("flash_attn", tier.flash_attn != "off"), ("backend_sampling", tier.backend_sampling)):
                if value:
                    warnings.append(f"tier {name}: {field} needs llama-server; it is off for this tier")
            key = (kind, str(path), tier.context, tier.vram, tier.rpc, tier.expert_cache, tier.expert_policy,
                   tier.expert_prefetch, tier.expert_cpu_share, tier.kv_cache, tier.yarn, tier.speculative if engine_draft else None)
            spec_args, spec_note = (), "off"
            if engine_draft:
                spec_note = f"engine draft {tier.speculative.draft_model}, k≤{tier.speculative.draft_max}, tuned"
        if key in plans:
            plans[key].tiers.append(name)
        else:
            parallel = slots if kind == "llama-server" else 1
            served = kind == "llama-server"
            plans[key] = BackendPlan(key, kind, model, [name], tier.context, parallel, spec_args, spec_note, slots_note,
                                     tier.flash_attn if served else "off", tier.backend_sampling and served,
                                     tier.vram, tier.rpc, expert_settings_for(tier) if kind == "int4" else None,
                                     tier.kv_cache, tier.yarn,
                                     draft_settings_for(tier, store, engine=True) if engine_draft else None)
    _one_head_per_worker(plans.values())
    return list(plans.values()), unavailable, warnings


def _one_head_per_worker(plans) -> None:
    """A worker serves one head at a time: two backends naming one worker would wait on each other."""
    owner: dict[str, BackendPlan] = {}
    for plan in plans:
        for worker in plan.rpc:
            address = worker.split("=", 1)[0]
            if address in owner:
                raise InvalidOptionError(
                    f"the RPC worker {address} is named by tiers {', '.join(owner[address].tiers)} and "
                    f"{', '.join(plan.tiers)}, which run separate backends; a worker serves one at a time",
                    hint="Give each tier its own workers, or the same model and settings so that they share a server.")
            owner[address] = plan


def reachable_workers(workers: tuple[str, ...], tiers) -> tuple[str, ...]:
    """The RPC workers that answer now; the others are left out, each with a warning."""
    from gemmactl.endpoints import parse_endpoint
    from gemmactl.llamacpp.rpc import WorkerError, probe

    kept = []
    for worker in workers:
        try:
            probe(parse_endpoint(worker))
            kept.append(worker)
        except WorkerError as exc:
            log.warning("tiers %s: %s; restarting without it", ",".join(tiers), exc.message)
    return tuple(kept)


def auto_slots(model_path: Path, context: int, store: Store, kv_cache: str | None = None) -> tuple[int, str]:
    """The slots of a `parallel: auto` tier, sized by the planner for its KV cache type
    (DEFAULT_SLOTS when it cannot tell)."""
    try:
        from gemmactl.plan.auto import auto_parallel

        return auto_parallel(Path(model_path), context, store=store, kv_cache=kv_cache)
    except (GemmactlError, OSError, ValueError) as exc:
        return DEFAULT_SLOTS, f"parallel auto: {DEFAULT_SLOTS} slots (the planner could not read the model: {exc})"


class Service:
    """The running server: backends, lanes, peers, the HTTP front and the state file."""

    def __init__(self, config: ServeConfig, store: Store | None = None):
        self.config = config
        self.store = store or Store()
        self.recipe = config.recipe
        self.backends: list = []
        self.lanes: dict[str, Lane] = {}
        self.peers = PeerSet(config.peers)
        self.warnings: list[str] = []
        self.httpd = None
        self.started = utc_now()
        self.state_file: Path | None = None
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "Service":
        """Start every backend (warm), then the front; raises if no tier can run."""
        try:
            from gemmactl.server.front import make_http_server

            # Bind first: a taken port fails before any model loads; connections wait in the backlog.
            try:
                self.httpd = make_http_server(self)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(f"{self.config.host}:{self.config.port} is already in use") from None
                raise ServeAddressError(f"cannot listen on {self.config.host}:{self.config.port}: "
                                        f"{exc.strerror or exc}") from None
            self._start_backends()
            self.peers.start()
            self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                            name="front", daemon=True)
            self._thread.start()
            self.state_file = state_path(self.store, os.getpid(), self.httpd.server_address[1])
            self.write_state()
        except BaseException:
            self.close()
            raise
        return self

    def _start_backends(self) -> None:
        plans, unavailable, warnings = plan_backends(
            self.recipe, self.store, speculative=self.config.speculative, require_build=self.config.require_build)
        self.warnings.extend(warnings)
        for warning in warnings:
            log.warning(warning)
        by_tier = {}
        errors = dict(unavailable)
        for plan in plans:
            try:
                backend = self._open(plan)
            except GemmactlError as exc:
                for name in plan.tiers:
                    errors[name] = f"{exc.message}. {exc.hint or ''}".strip()
                continue
            self.backends.append(backend)
            for name in plan.tiers:
                by_tier[name] = backend
        if not by_tier:
            first = next(iter(errors.items()))
            raise GemmactlError(f"no tier of recipe '{self.recipe.name}' can run; {first[0]}: {first[1]}",
                                hint="Fix the first problem above, or serve another recipe with --recipe.")
        for name, tier in self.recipe.tiers.items():
            if name in errors:
                log.warning("tier %s is unavailable: %s", name, errors[name])
            self.lanes[name] = Lane(tier, by_tier.get(name), self.config.queue, unavailable=errors.get(name))

    def _open(self, plan: BackendPlan):
        from gemmactl.generate import gpu_placement, open_backend
        from gemmactl.runtime.llamacpp import default_threads

        threads = self.config.threads or default_threads()
        started = time.perf_counter()
        if plan.kind == "llama-server":
            from gemmactl.llamacpp.build import active_build

            def place(workers: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
                # The placement `run` would use, with this tier's slots.
                placed = gpu_placement(plan.model.path, plan.context, parallel=plan.parallel, store=self.store,
                                       vram=plan.vram, rpc=workers, kv_cache=plan.kv_cache)
                note = f"planned: {placed.reason}" if placed.applied else placed.reason
                return placed.llama_server_args, f"{note}; {plan.slots_note}" if plan.slots_note else note

            def replan() -> tuple[tuple[str, ...], str]:
                # Before a restart: the workers that still answer (a dead one took its llama-server down).
                return place(reachable_workers(plan.rpc, plan.tiers))

            placement, note = place(plan.rpc)
            build = active_build(self.store)
            # A tier's draft goes through its tuner: off (a restart without it) when plain decoding is faster.
            tuner = ServerDraftTuner(_draft_max(plan.spec_args)) if plan.spec_args else None
            backend = ServerBackend(
                build.binary("llama-server"), plan.model.path, tiers=plan.tiers, context=plan.context,
                parallel=plan.parallel, threads=threads, log_dir=self.store.home / "logs" / "serve",
                placement=placement, placement_note=note,
                speculative=plan.spec_note + (", tuned" if tuner is not None else ""),
                draft_args=plan.spec_args, draft_tuner=tuner,
                extra_args=(("--backend-sampling",) if plan.backend_sampling else ())
                + (("-ctk", plan.kv_cache, "-ctv", plan.kv_cache) if plan.kv_cache else ()),
                # llama.cpp keeps a quantized V only with flash attention
                flash_attn="on" if plan.kv_cache not in (None, "f16") else plan.flash_attn,
                on_change=self.write_state, replan=replan if plan.rpc else None,
            )
            backend.start()
            log.info("tiers %s: llama-server pid %s on port %s, %d slots of %d tokens, -fa %s, backend sampling %s, "
                     "placement: %s, speculative: %s (%.1f s)", ",".join(plan.tiers), backend.pid, backend.server.port,
                     plan.parallel, plan.context, plan.flash_attn, "on" if plan.backend_sampling else "off", note,
                     backend.info.speculative, time.perf_counter() - started)
            return backend
        loaded = open_backend(plan.model, context=plan.context, store=self.store, threads=threads, vram=plan.vram,
                              rpc=plan.rpc, experts=plan.experts, kv_cache=plan.kv_cache, yarn=plan.yarn,
                              draft=plan.draft)
        for notice in loaded.notices:
            log.warning(notice)
        log.info("tiers %s: %s in process, one request at a time (%.1f s)", ",".join(plan.tiers), plan.kind,
                 time.perf_counter() - started)
        note = "in process" + (f"; {loaded.placement.reason}" if loaded.placement is not None else "")
        return InProcessBackend(loaded, tiers=plan.tiers, context=plan.context, note=note)

    def state(self) -> dict:
        tiers = {}
        for name, lane in self.lanes.items():
            backend = lane.backend
            tiers[name] = {
                "state": lane.state, "backend": backend.info.kind if backend else None,
                "model": backend.info.model_path if backend else None,
                "pid": backend.pid if backend else None,
                "port": backend.server.port if isinstance(backend, ServerBackend) else None,
                "parallel": backend.info.parallel if backend else None,
                "placement": backend.info.placement if backend else None,
                "speculative": backend.info.speculative if backend else None,
                "reason": lane.unavailable,
            }
        return {
            "pid": os.getpid(), "url": self.url, "started": self.started, "recipe": self.recipe.name,
            "recipe_path": self.recipe.path, "api_key": bool(self.config.api_key),
            "log": str(self.config.log_path) if self.config.log_path else None,
            "peers": [p.url for p in self.peers.peers], "tiers": tiers,
        }

    def write_state(self) -> None:
        if self.state_file is None or self.httpd is None:
            return
        with self._state_lock:
            try:
                write_state(self.state_file, self.state())
            except OSError as exc:
                log.warning("could not write %s: %s", self.state_file, exc)

    def wait(self) -> None:
        """Block until the front stops (close() from a signal handler or another thread)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def close(self) -> None:
        """Stop the front, every backend (llama-server children included) and the peer checks."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._close()

    def _close(self) -> None:
        if self.httpd is not None:
            if self._thread is not None and self._thread.is_alive():
                self.httpd.shutdown()
            self.httpd.server_close()
        self.peers.stop()
        for backend in self.backends:
            try:
                backend.stop()
            except Exception as exc:  # noqa: BLE001 - stopping the others matters more
                log.warning("stopping a backend failed: %s", exc)
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)
            self.state_file = None


def serve(config: ServeConfig, store: Store | None = None) -> Service:
    """Start a server and return it running; call close() to stop it."""
    return Service(config, store).start()
