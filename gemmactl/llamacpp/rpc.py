"""llama.cpp's RPC backend: workers (ggml-rpc-server) that lend their memory and compute to a head.

A worker is addressed as HOST:PORT, optionally with the budget it lends: HOST:PORT=SIZE. Before a
head starts, every worker is asked for its protocol version and memory with the protocol's own
HELLO, DEVICE_COUNT and GET_DEVICE_MEMORY commands (ggml/src/ggml-rpc/ggml-rpc.cpp), so that an
unreachable worker or one from another llama.cpp build is one clear line, not a crash of the
head. A worker serves one client at a time: ask it before the head connects.

The protocol has no authentication: a worker bound beyond loopback lets anyone who reaches its
port allocate memory and run graphs on that machine.
"""

from __future__ import annotations

import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from gemmactl.endpoints import Endpoint
from gemmactl.errors import UserInputError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROBE_TIMEOUT_S = 5.0

# Wire format (little-endian): request = command (1 byte) | size (8 bytes) | data;
# answer = size (8 bytes) | data.
_HELLO, _DEVICE_COUNT, _GET_DEVICE_MEMORY = 14, 15, 11
_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE (ggml-rpc/transport.h): no transport upgrade asked for


class WorkerError(UserInputError):
    default_hint = "Start it there with `gemmactl worker --host ADDRESS --port PORT`, or leave it out of --rpc."


@dataclass(frozen=True)
class WorkerInfo:
    endpoint: Endpoint
    protocol: tuple[int, int, int]
    devices: int
    free_bytes: int
    total_bytes: int

    @property
    def version(self) -> str:
        return ".".join(map(str, self.protocol))

    @property
    def lends(self) -> int:
        """The bytes the head may place there: the budget given, else what the worker has free."""
        return self.endpoint.budget if self.endpoint.budget is not None else self.free_bytes

    def to_dict(self) -> dict:
        return {"address": self.endpoint.address, "protocol": self.version, "devices": self.devices,
                "free_bytes": self.free_bytes, "total_bytes": self.total_bytes, "lends_bytes": self.lends}


def _call(sock: socket.socket, command: int, payload: bytes, answer_size: int) -> bytes:
    sock.sendall(struct.pack("<BQ", command, len(payload)) + payload)
    size = struct.unpack("<Q", _read(sock, 8))[0]
    if size != answer_size:
        raise ValueError(f"answered {size} bytes to command {command}, expected {answer_size}")
    return _read(sock, size)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the worker closed the connection")
        data += chunk
    return data


def probe(endpoint: Endpoint, *, timeout: float = PROBE_TIMEOUT_S, build=None) -> WorkerInfo:
    """The worker's protocol version, device count and the first device's memory. With a build,
    a worker whose protocol that build's llama.cpp would refuse stops here, both versions named."""
    ours = build_protocol(Path(build.source["path"])) if build is not None else None
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=timeout) as sock:
            hello = _call(sock, _HELLO, bytes(_CAPS_SIZE), 4 + _CAPS_SIZE)
            protocol = (hello[0], hello[1], hello[2])
            # llama.cpp's own rule (negotiate_hello): the same major version, a minor no newer than ours.
            if ours and (protocol[0] != ours[0] or protocol[1] > ours[1]):
                raise WorkerError(
                    f"the worker {endpoint} speaks llama.cpp RPC protocol {'.'.join(map(str, protocol))}, but this "
                    f"build ({build.build_id}, {build.source.get('version', 'llama.cpp')}) speaks "
                    f"{'.'.join(map(str, ours))}",
                    hint="Run the worker from the same llama.cpp build as the head: the same gemmactl version and "
                         "`gemmactl build` on both machines.",
                )
            devices = struct.unpack("<I", _call(sock, _DEVICE_COUNT, b"", 4))[0]
            free, total = struct.unpack("<QQ", _call(sock, _GET_DEVICE_MEMORY, struct.pack("<I", 0), 16))
    except socket.timeout:
        raise WorkerError(f"the worker {endpoint} did not answer within {timeout:.0f} s "
                          "(it may be serving another head: a worker serves one at a time)") from None
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise WorkerError(f"cannot reach the worker {endpoint} ({reason.lower()})") from None
    return WorkerInfo(endpoint, protocol, devices, free, total)


def build_protocol(source_path: Path) -> tuple[int, int, int] | None:
    """The RPC protocol version a llama.cpp source tree speaks (ggml/include/ggml-rpc.h)."""
    try:
        text = (Path(source_path) / "ggml" / "include" / "ggml-rpc.h").read_text(encoding="utf-8")
    except OSError:
        return None
    found = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)", text)}
    if len(found) != 3:
        return None
    return found["MAJOR"], found["MINOR"], found["PATCH"]


def check_workers(endpoints, build) -> list[WorkerInfo]:
    """Probe every worker; one that cannot be reached or speaks another protocol stops here."""
    return [probe(endpoint, build=build) for endpoint in endpoints]


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")
