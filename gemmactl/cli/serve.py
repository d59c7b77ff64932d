"""`gemmactl serve`: every tier of a recipe as a warm backend behind one OpenAI-compatible front."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import click


@click.command("serve")
@click.option("--recipe", "recipe", metavar="FILE|NAME", help="Recipe of tiers (default: built-in 'default', or $GEMMACTL_RECIPE).")
@click.option("--host", default="127.0.0.1", show_default=True, metavar="ADDR", help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), metavar="N", help="Port to listen on (0: any free port).")
@click.option("--api-key", metavar="KEY", envvar="GEMMACTL_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/* and /metrics (or set GEMMACTL_API_KEY).")
@click.option("--peer", "peers", multiple=True, metavar="URL", help="Another gemmactl server that takes requests when a local tier is down or saturated; repeatable.")
@click.option("--queue", default=512, show_default=True, type=click.IntRange(min=0), metavar="N", help="Requests that may wait per tier; past it, 503 with Retry-After (or a peer).")
@click.option("--no-speculative", is_flag=True, help="Turn off every tier's speculative decoding.")
@click.option("--threads", type=click.IntRange(min=1), metavar="N", help="CPU threads per backend (default: every core).")
@click.option("--json", "json_mode", is_flag=True, help="Print the server's state as one JSON line once it is ready.")
def serve(recipe, host, port, api_key, peers, queue, no_speculative, threads, json_mode):
    """Serve every tier of a recipe behind one OpenAI-compatible endpoint.

    Each GGUF tier gets a persistent llama-server from `gemmactl build` (prompt cache on,
    parallel slots from the recipe); without a build they run in process. Requests go to
    /v1/chat/completions and /v1/completions; `model` names a tier, or `auto` routes by prefix
    as `gemmactl run` does. Stop with Ctrl-C: the llama-server children stop too.

    \b
    Examples:
      gemmactl serve
      gemmactl serve --recipe gemma4-4gb --port 9000 --api-key secret --peer http://box2:8080
    """
    from gemmactl.recipes import resolve_recipe
    from gemmactl.server.service import ServeConfig, Service

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    config = ServeConfig(
        recipe=resolve_recipe(recipe), host=host, port=port, api_key=api_key, peers=list(peers), queue=queue,
        speculative=not no_speculative, threads=threads,
    )
    service = Service(config)
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
