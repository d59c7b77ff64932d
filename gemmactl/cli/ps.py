"""`gemmactl ps`, `stop` and `logs`: the gemmactl servers running on this machine."""

from __future__ import annotations

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json, table


@click.command("ps")
@click.option("--json", "json_mode", is_flag=True, help="Print the servers as a JSON array (workers: --workers --json).")
@click.option("--workers", "workers_only", is_flag=True, help="List only the RPC workers (`gemmactl worker`).")
def ps(json_mode: bool, workers_only: bool) -> None:
    """List running gemmactl servers and workers.

    Servers come with their tiers; RPC workers (`gemmactl worker`) follow.

    Reads the state files under $GEMMACTL_HOME/servers and /workers, asks each server for its live
    state, and removes the files of servers and workers that are gone (stopping any llama-server
    they left behind)."""
    from gemmactl.llamacpp.worker import running_workers
    from gemmactl.server.registry import fetch_health, running_servers
    from gemmactl.store import Store

    store = Store()
    workers = running_workers(store.home)
    if workers_only:
        if json_mode:
            emit_json(workers)
        else:
            click.echo(_workers_table(workers) if workers else "No gemmactl worker is running. Start one with "
                       "`gemmactl worker`.")
        return
    live, stale = running_servers(store)
    for state in live:
        health = fetch_health(state["url"], timeout=2.0)
        state["status"] = health["status"] if health else "not answering"
        for name, tier in state.get("tiers", {}).items():
            now = (health or {}).get("tiers", {}).get(name)
            if now:
                tier.update({k: now.get(k) for k in ("state", "queue", "running", "requests", "tok_s", "pid", "restarts")})
    if json_mode:
        emit_json(live)
        return
    for state in stale:
        click.echo(f"Removed the state of server {state.get('pid')} ({state.get('url')}), which is gone.", err=True)
    if not live:
        click.echo("No gemmactl server is running. Start one with `gemmactl serve`.")
        if workers:
            click.echo("\n" + _workers_table(workers))
        return
    rows = []
    for state in live:
        for name, tier in state.get("tiers", {}).items():
            rows.append([state["url"], str(state["pid"]), name, tier.get("state") or "-", tier.get("backend") or "-",
                         str(tier.get("pid") or "-"), str(tier.get("parallel") or "-"), str(tier.get("queue", "-")),
                         tier.get("speculative") or "-", tier.get("placement") or tier.get("reason") or "-"])
    click.echo(table(rows, ["URL", "PID", "TIER", "STATE", "BACKEND", "BACKEND PID", "SLOTS", "QUEUE",
                            "SPECULATIVE", "PLACEMENT"]))
    if workers:
        click.echo("\n" + _workers_table(workers))


def _workers_table(workers: list[dict]) -> str:
    from gemmactl.sizes import format_size

    rows = [[w["address"], str(w["pid"]), w["build"], w["protocol"],
             format_size(w["mem_bytes"]) if w.get("mem_bytes") else "no limit", w.get("cache") or "-"]
            for w in workers]
    return table(rows, ["WORKER", "PID", "BUILD", "RPC", "MEM", "CACHE"])


@click.command("stop")
@click.argument("name", required=False, shell_complete=complete.servers)
@click.option("--all", "all_servers", is_flag=True, help="Stop every gemmactl server of this store.")
@click.option("--timeout", type=click.FloatRange(min=1), default=30, show_default=True, metavar="S",
              help="Seconds to wait for a clean stop before killing the server.")
def stop(name, all_servers, timeout):
    """Stop a running gemmactl server (and its llama-server children).

    NAME is the server's pid, port or URL, as `gemmactl ps` shows them; --all stops every one.
    """
    from gemmactl.server.registry import find_servers, running_servers, stop_server
    from gemmactl.store import Store

    if bool(name) == all_servers:
        raise click.UsageError("name one server (its pid, port or URL), or pass --all")
    store = Store()
    servers = find_servers(store, None if all_servers else name)
    if not servers:
        click.echo("No gemmactl server is running.")
        return
    for state in servers:
        clean = stop_server(state, timeout)
        how = "stopped" if clean else f"killed after {timeout:.0f} s"
        log = f"; its log: {state['log']}" if state.get("log") else ""
        click.echo(f"Server {state['pid']} ({state['url']}) {how}{log}.")
    running_servers(store)  # a killed server's llama-server children are stopped here


@click.command("logs")
@click.argument("name", shell_complete=complete.servers)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the server stops (or Ctrl-C).")
@click.option("-n", "--lines", "lines", type=click.IntRange(min=0), metavar="N", help="Only the last N lines.")
def logs(name, follow, lines):
    """Print a running gemmactl server's log.

    NAME is the server's pid, port or URL, as `gemmactl ps` shows them.
    """
    import time
    from pathlib import Path

    from gemmactl.errors import ServerError
    from gemmactl.server.registry import find_servers, pid_alive
    from gemmactl.store import Store

    servers = find_servers(Store(), name)
    if len(servers) > 1:
        raise click.UsageError(f"'{name}' names {len(servers)} servers; name one by its pid")
    state = servers[0]
    if not state.get("log"):
        raise ServerError(f"server {state['pid']} keeps no log file (it was started by an older gemmactl)",
                          hint="Its log went to the terminal that started it.")
    path = Path(state["log"])
    with open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
        shown = text.splitlines(keepends=True)
        click.echo("".join(shown[-lines:] if lines is not None else shown), nl=False)
        while follow and pid_alive(state["pid"]):
            more = handle.read()
            if more:
                click.echo(more, nl=False)
            else:
                time.sleep(0.2)
        if follow:
            click.echo(handle.read(), nl=False)
