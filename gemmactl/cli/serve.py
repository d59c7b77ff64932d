"""`gemmactl serve`: every tier of a recipe as a warm backend behind one OpenAI-compatible front."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import click

from gemmactl.cli import complete

DETACHED_LOG = "GEMMACTL_SERVE_LOG"  # set for a detached server: the log file its stderr goes to
READY_TIMEOUT_S = 900  # loading big models and starting every tier can take minutes


@click.command("serve")
@click.option("--recipe", "recipe", metavar="FILE|NAME", shell_complete=complete.recipes, help="Recipe of tiers (default: built-in 'default', or $GEMMACTL_RECIPE).")
@click.option("--host", default="127.0.0.1", show_default=True, metavar="ADDR", help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), metavar="N", help="Port to listen on (0: any free port).")
@click.option("--api-key", metavar="KEY", envvar="GEMMACTL_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (or set GEMMACTL_API_KEY).")
@click.option("--peer", "peers", multiple=True, metavar="URL", help="Another gemmactl server that takes requests when a local tier is down or saturated; repeatable.")
@click.option("--queue", default=512, show_default=True, type=click.IntRange(min=0), metavar="N", help="Requests that may wait per tier; past it, 503 with Retry-After (or a peer).")
@click.option("--max-connections", default=1024, show_default=True, type=click.IntRange(min=1), metavar="N",
              help="Open client connections at most; past it, 503 at once (a request must arrive within 30 s).")
@click.option("--no-speculative", is_flag=True, help="Turn off every tier's speculative decoding.")
@click.option("--threads", type=click.IntRange(min=1), metavar="N", help="CPU threads per backend (default: every core).")
@click.option("--detach", is_flag=True, help="Start the server in the background, wait until it is ready, print its URL and pid and return.")
@click.option("--rpc", "rpc", multiple=True, metavar="HOST:PORT[=SIZE]", help="RPC workers (`gemmactl worker`) for the default tier's llama-server (a worker serves one); repeatable or comma-separated.")
@click.option("--json", "json_mode", is_flag=True, help="Print the server's state as one JSON line once it is ready.")
def serve(recipe, host, port, api_key, peers, queue, max_connections, no_speculative, threads, detach, rpc, json_mode):
    """Serve every tier of a recipe behind one OpenAI-compatible endpoint.

    Each GGUF tier gets a persistent llama-server from `gemmactl build` (prompt cache on,
    parallel slots from the recipe); without a build they run in process. Requests go to
    /v1/chat/completions and /v1/completions; `model` names a tier, or `auto` routes by prefix
    as `gemmactl run` does. Stop with Ctrl-C: the llama-server children stop too.

    \b
    The log goes to stderr and to a file under the store (`gemmactl logs PID` shows it);
    `--detach` runs the server in the background and `gemmactl stop PID` ends it.

    \b
    Examples:
      gemmactl serve
      gemmactl serve --recipe gemma4-4gb --port 9000 --api-key secret --peer http://box2:8080
      gemmactl serve --detach && gemmactl ps
    """
    from gemmactl.recipes import resolve_recipe
    from gemmactl.server.registry import logs_dir
    from gemmactl.server.service import ServeConfig, Service
    from gemmactl.store import Store

    _check_host(host)
    resolved = resolve_recipe(recipe)  # a bad recipe fails here, before anything starts
    if rpc:
        from dataclasses import replace

        from gemmactl.cli.run import _workers

        workers = _workers(rpc)
        tiers = dict(resolved.tiers)
        tiers[resolved.default_tier] = replace(tiers[resolved.default_tier], rpc=workers)
        resolved = replace(resolved, tiers=tiers)
    store = Store()
    if detach:
        args = ["--host", host, "--port", str(port), "--queue", str(queue), "--max-connections", str(max_connections)]
        args += [a for worker in rpc for a in ("--rpc", worker)]
        args += (["--recipe", recipe] if recipe else []) + [a for peer in peers for a in ("--peer", peer)]
        args += (["--no-speculative"] if no_speculative else []) + (["--threads", str(threads)] if threads else [])
        state = _detach(store, args, api_key)
        if json_mode:
            click.echo(json.dumps(state))
        else:
            click.echo(f"gemmactl serve: {state['url']} (pid {state['pid']}, recipe {state['recipe']}); "
                       f"logs: gemmactl logs {state['pid']}; stop: gemmactl stop {state['pid']}")
        return 0
    # A detached server's stderr is its log file already (the parent opened it).
    log_path = Path(os.environ[DETACHED_LOG]) if os.environ.get(DETACHED_LOG) else \
        logs_dir(store) / f"serve-{os.getpid()}.log"
    handlers = [logging.StreamHandler(sys.stderr)]
    if not os.environ.get(DETACHED_LOG):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers)
    config = ServeConfig(
        recipe=resolved, host=host, port=port, api_key=api_key, peers=list(peers), queue=queue,
        speculative=not no_speculative, threads=threads, log_path=log_path, max_connections=max_connections,
    )
    service = Service(config, store)
    stopping = []

    def stop(signum, frame):
        if not stopping:
            stopping.append(signum)
            logging.getLogger("gemmactl.serve").info("stopping (signal %d)", signum)
            # Stopping the llama-server children takes a moment: do it off the signal handler.
            threading.Thread(target=service.close, name="close", daemon=True).start()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        service.start()
        if json_mode:
            click.echo(json.dumps(service.state()))
        else:
            click.echo(f"gemmactl serve: {service.url} (recipe {config.recipe.name}; tiers "
                       f"{', '.join(service.lanes)}); Ctrl-C stops it", err=True)
        service.wait()
    finally:
        service.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _detach(store, args: list[str], api_key: str | None) -> dict:
    """Start `gemmactl serve ARGS` in a session of its own, logging to a file; return its state once ready."""
    from gemmactl.errors import ServerError
    from gemmactl.server.registry import logs_dir, pid_alive, servers_dir

    log_path = logs_dir(store) / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{DETACHED_LOG: str(log_path), "GEMMACTL_HOME": str(store.home)})
    if api_key:
        env["GEMMACTL_API_KEY"] = api_key  # not on the command line, where any user could read it
    with open(log_path, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "gemmactl", "serve", *args], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for path in servers_dir(store).glob(f"{child.pid}-*.json"):
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                pass  # being written: read it again
        if child.poll() is not None or not pid_alive(child.pid):
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            raise ServerError(f"the server exited before it was ready: {lines[-1] if lines else 'no output'}",
                              hint=f"See its log: {log_path}")
        time.sleep(0.1)
    child.terminate()
    raise ServerError(f"the server was not ready after {READY_TIMEOUT_S} s", hint=f"See its log: {log_path}")


def _check_host(host: str) -> None:
    """Refuse an address that is no address at all (256.1.1.1, a typo'd name) before anything starts."""
    import socket

    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise click.BadParameter(f"{host!r} is not an address or host name this machine can resolve ({exc})",
                                 param_hint="--host") from None
