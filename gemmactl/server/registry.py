"""Running servers on this machine: one state file each under `$GEMMACTL_HOME/servers/`, read by `ps`.

A server writes its file when it starts and whenever a backend changes (restart, new pid), and
removes it when it stops. A file whose server process is gone is stale: reading the registry
removes it and stops the llama-server children it left behind (checked by their command line,
so an unrelated process that took over a pid is never touched).
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

from gemmactl.errors import InvalidOptionError, ServerError
from gemmactl.fileio import atomic_write_text
from gemmactl.store import Store

log = logging.getLogger("gemmactl.serve")


def servers_dir(store: Store) -> Path:
    return store.home / "servers"


def state_path(store: Store, pid: int, port: int) -> Path:
    return servers_dir(store) / f"{pid}-{port}.json"


def write_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(state, indent=2, sort_keys=True))


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def running_servers(store: Store) -> tuple[list[dict], list[dict]]:
    """(live servers' states, stale states removed); orphaned llama-server children are stopped."""
    live, stale = [], []
    folder = servers_dir(store)
    if not folder.is_dir():
        return live, stale
    for path in sorted(folder.glob("*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if pid_alive(state.get("pid")):
            live.append(state)
            continue
        for tier in state.get("tiers", {}).values():
            child, port = tier.get("pid"), tier.get("port")
            command = _cmdline(child) if child else []
            if command and any(part.endswith("llama-server") for part in command) and str(port) in command:
                log.warning("stopping llama-server %s left behind by server %s", child, state.get("pid"))
                try:
                    os.kill(child, signal.SIGTERM)
                except OSError:
                    pass
        path.unlink(missing_ok=True)
        stale.append(state)
    return live, stale


def logs_dir(store: Store) -> Path:
    return store.home / "logs" / "serve"


def find_servers(store: Store, name: str | None) -> list[dict]:
    """The running servers NAME picks: its pid, its port, or its URL; None picks them all."""
    live, _ = running_servers(store)
    if name is None:
        return live
    wanted = name.strip().rstrip("/")
    found = [s for s in live if wanted in (str(s.get("pid")), str(_port(s)), s.get("url", "").rstrip("/"))]
    if not found:
        names = ", ".join(f"{s['pid']} ({s['url']})" for s in live) or "none is running"
        raise InvalidOptionError(f"no running gemmactl server '{name}'; running: {names}",
                                 hint="Name a server by its pid, port or URL, as `gemmactl ps` shows them.")
    return found


def _port(state: dict) -> int | None:
    try:
        return int(state["url"].rsplit(":", 1)[1])
    except (KeyError, ValueError, IndexError):
        return None


def stop_server(state: dict, timeout: float = 30.0) -> bool:
    """Ask a server to stop (SIGTERM: it stops its llama-servers and removes its state file); after
    timeout, kill it. Returns whether it stopped by itself."""
    pid = state["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    except PermissionError as exc:
        raise ServerError(f"not allowed to stop server {pid}: {exc}", hint="Stop it as the user who started it.") from exc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    log.warning("server %s did not stop within %.0f s; killing it", pid, timeout)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return False


def fetch_health(url: str, timeout: float = 2.0) -> dict | None:
    """A server's /health as JSON, or None when it does not answer."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        return json.loads(response.read())
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        connection.close()
