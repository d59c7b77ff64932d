"""`gemmactl ps`: the gemmactl servers running on this machine and their tiers."""

from __future__ import annotations

import click

from gemmactl.cli.output import emit_json, table


@click.command("ps")
@click.option("--json", "json_mode", is_flag=True, help="Print the servers as a JSON array.")
def ps(json_mode: bool) -> None:
    """List running gemmactl servers and their tiers.

    Reads the state files under $GEMMACTL_HOME/servers, asks each server for its live state, and
    removes the files of servers that are gone (stopping any llama-server they left behind)."""
    from gemmactl.server.registry import fetch_health, running_servers
    from gemmactl.store import Store

    live, stale = running_servers(Store())
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
        return
    rows = []
    for state in live:
        for name, tier in state.get("tiers", {}).items():
            rows.append([state["url"], str(state["pid"]), name, tier.get("state") or "-", tier.get("backend") or "-",
                         str(tier.get("pid") or "-"), str(tier.get("parallel") or "-"), str(tier.get("queue", "-")),
                         tier.get("speculative") or "-", tier.get("placement") or tier.get("reason") or "-"])
    click.echo(table(rows, ["URL", "PID", "TIER", "STATE", "BACKEND", "BACKEND PID", "SLOTS", "QUEUE",
                            "SPECULATIVE", "PLACEMENT"]))
