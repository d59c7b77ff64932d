"""`gemmactl worker`: lend this machine's memory and compute to a head's model over llama.cpp RPC."""

from __future__ import annotations

import json
import signal

import click

from gemmactl.cli.output import warn
from gemmactl.sizes import format_size


@click.command("worker")
@click.option("--host", default="127.0.0.1", show_default=True, metavar="ADDR",
              help="Address to listen on. The protocol has no authentication: keep loopback unless the network is yours alone.")
@click.option("--port", default=50052, show_default=True, type=click.IntRange(1, 65535), metavar="N", help="Port to listen on.")
@click.option("--mem", metavar="SIZE", help="Memory the worker may use for the head's layers (enforced by the kernel; default: no limit).")
@click.option("--cache", "cache_dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Keep the head's large tensors in DIR so that a later load sends only their hashes.")
@click.option("--threads", type=click.IntRange(min=1), metavar="N", help="CPU threads (default: every core).")
@click.option("--json", "json_mode", is_flag=True, help="Print the worker's state as one JSON line once it answers.")
def worker(host, port, mem, cache_dir, threads, json_mode):
    """Lend this machine to a head's model over llama.cpp RPC.

    Runs llama.cpp's RPC server so that a head's model can place layers here. A head uses it with `--rpc HOST:PORT` (run, serve, bench), a recipe tier's `rpc:`, or plans for
    it with `gemmactl plan MODEL --rpc HOST:PORT=SIZE`. The worker runs the active build's
    ggml-rpc-server: build the same gemmactl and llama.cpp on every machine. A worker serves one
    head at a time. Stop it with Ctrl-C; `gemmactl ps` lists the workers of this machine.

    \b
    Examples:
      gemmactl worker
      gemmactl worker --host 192.168.1.20 --port 50052 --mem 20G --cache ~/.cache/gemmactl-rpc
    """
    from pathlib import Path

    from gemmactl.cli.serve import _check_host
    from gemmactl.llamacpp.build import active_build
    from gemmactl.endpoints import Endpoint
    from gemmactl.llamacpp.rpc import is_loopback
    from gemmactl.llamacpp.worker import start_worker
    from gemmactl.sizes import parse_size
    from gemmactl.store import Store

    _check_host(host)
    budget = parse_size(mem, option="--mem") if mem is not None else None
    store = Store()
    build = active_build(store)
    if build is None:
        raise click.ClickException("no llama.cpp build in the store; run `gemmactl build` first (the worker "
                                   "runs its ggml-rpc-server)")
    if not is_loopback(host):
        warn(f"the llama.cpp RPC protocol has no authentication: anyone who can reach {host}:{port} can allocate "
             "memory and run computations on this machine. Expose it only on a network that is yours alone, "
             "or keep --host 127.0.0.1 and reach it through an SSH tunnel.")
    running = start_worker(build, Endpoint(host, port), home=store.home, threads=threads,
                           cache_dir=Path(cache_dir).expanduser() if cache_dir else None, mem=budget)
    try:  # from here on, whatever ends this process stops the server too
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        info = running.info
        if json_mode:
            click.echo(json.dumps({"pid": running.pid, "log": str(running.log_path), **info.to_dict(),
                                   "mem_bytes": budget, "build": build.build_id}))
        else:
            lends = format_size(budget) if budget else f"all {format_size(info.free_bytes)} free"
            click.echo(f"worker on {host}:{port} (pid {running.pid}, build {build.build_id}, RPC protocol "
                       f"{info.version}); lends {lends}; log: {running.log_path}. Ctrl-C stops it.", err=True)
        code = running.process.wait()
        raise click.ClickException(f"ggml-rpc-server exited (code {code}); see its log: {running.log_path}")
    except KeyboardInterrupt:
        pass  # Ctrl-C or SIGTERM: the way a worker is stopped
    finally:
        running.stop()
