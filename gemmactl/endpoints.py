"""Addresses of llama.cpp RPC workers: HOST:PORT, optionally with the memory lent, HOST:PORT=SIZE.

Read by recipes (a tier's `rpc:`), the CLI (`--rpc`) and the planner; talking to a worker is
gemmactl/llamacpp/rpc.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemmactl.errors import InvalidOptionError

DEFAULT_PORT = 50052
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])$")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    budget: int | None = None  # bytes it lends (HOST:PORT=SIZE); None: what it reports free

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.address


def parse_endpoint(text: str, *, option: str = "--rpc") -> Endpoint:
    """HOST:PORT or HOST:PORT=SIZE (IPv6 in brackets: [::1]:50052)."""
    from gemmactl.sizes import parse_size

    raw = str(text).strip()
    address, equals, size = raw.partition("=")
    host, colon, port_text = address.rpartition(":")
    hint = f"Write each worker as HOST:PORT, e.g. {option} 127.0.0.1:{DEFAULT_PORT} (optionally =SIZE, e.g. =8G)."
    if not colon or not _HOST.match(host) or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidOptionError(f"{option} '{raw}' is not HOST:PORT with a port from 1 to 65535", hint=hint)
    if equals and not size:
        raise InvalidOptionError(f"{option} '{raw}' has '=' but no size after it", hint=hint)
    budget = parse_size(size, option=f"{option} {address}=") if size else None
    return Endpoint(host.strip("[]"), int(port_text), budget)


def parse_endpoints(values, *, option: str = "--rpc") -> tuple[Endpoint, ...]:
    """Comma-separated or repeated HOST:PORT[=SIZE] entries; each worker once."""
    entries = [part for value in values for part in str(value).split(",") if part.strip()]
    endpoints = tuple(parse_endpoint(entry, option=option) for entry in entries)
    seen = set()
    for endpoint in endpoints:
        if endpoint.address in seen:
            raise InvalidOptionError(f"{option} names the worker {endpoint.address} twice",
                                     hint="Name each worker once; a worker serves one head.")
        seen.add(endpoint.address)
    return endpoints
