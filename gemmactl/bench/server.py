"""A llama-server process on 127.0.0.1 and a streaming `/completion` client timed like the core."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from gemmactl.bench.stats import RequestTiming
from gemmactl.errors import ServerError

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class ServerReply:
    """One streamed completion: its timing, text and the server's own counters."""

    timing: RequestTiming
    text: str
    final: dict = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return int(self.final.get("timings", {}).get("cache_n", 0))

    @property
    def engine_decode_tok_s(self) -> float | None:
        return self.final.get("timings", {}).get("predicted_per_second")


class LlamaServer:
    """llama-server for one GGUF with N slots, each holding `context` tokens; stopped on exit."""

    def __init__(
        self,
        binary: Path,
        model_path: str,
        *,
        threads: int,
        context: int,
        parallel: int = 1,
        n_gpu_layers: int = 999,
        repack: bool = True,
        log_dir: Path,
    ):
        self.port = free_port()
        self.parallel = parallel
        # Without --kv-unified the context is split evenly over the slots: size it per slot.
        self.command = [
            str(binary), "-m", str(model_path), "--host", HOST, "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-c", str(context * parallel), "-np", str(parallel),
            "-ngl", str(n_gpu_layers), "--no-kv-unified",
            # The same attention work as in process (llama-cpp-python): no flash attention, and a
            # full-size cache for the sliding-window layers (the C API's default; the server's own
            # default keeps only the window). Either difference flips near-tie greedy tokens.
            "-fa", "off", "--swa-full",
        ] + ([] if repack else ["--no-repack"])
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-np{parallel}-{self.port}.log"
        self.process: subprocess.Popen | None = None
        self.load_s = 0.0

    def start(self, timeout: float = 180) -> float:
        """Start and wait for /health; returns the seconds it took (the server's load time)."""
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            try:
                self.process = subprocess.Popen(
                    self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as exc:
                raise ServerError(f"llama-server could not start: {exc}", hint=f"See its log: {self.log_path}") from exc
        deadline = started + timeout
        while time.perf_counter() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerError(
                    f"llama-server exited with code {code} before it was ready: {self._last_log_line()}",
                    hint=f"See its log: {self.log_path}",
                )
            if self._healthy():
                self.load_s = time.perf_counter() - started
                return self.load_s
            time.sleep(0.05)
        self.stop()
        raise ServerError(f"llama-server was not ready after {timeout:.0f} s", hint=f"See its log: {self.log_path}")

    def stop(self) -> None:
        """Ask the server to stop; kill it if it does not within 10 s."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def __enter__(self) -> "LlamaServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def peak_rss_bytes(self) -> int | None:
        """The server process's peak resident memory (VmHWM), while it runs."""
        if self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def complete(self, prompt: str, max_tokens: int, *, cache_prompt: bool, timeout: float = 300) -> ServerReply:
        """Stream one greedy completion; request start → first and last token events, as the core times them."""
        if self.process is None or self.process.poll() is not None:
            raise ServerError("llama-server is not running", hint=f"See its log: {self.log_path}")
        payload = {
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True,
            "cache_prompt": cache_prompt, "seed": 0,
        }
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        pieces: list[str] = []
        first = last = None
        final: dict = {}
        try:
            start = time.perf_counter()
            connection.request("POST", "/completion", json.dumps(payload), {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise ServerError(
                    f"llama-server answered HTTP {response.status}: {response.read()[:200].decode(errors='replace')}",
                    hint=f"See its log: {self.log_path}",
                )
            for raw in response:
                if not raw.startswith(b"data: "):
                    continue
                event = json.loads(raw[6:])
                now = time.perf_counter()
                if event.get("stop"):
                    final = event
                    pieces.append(event.get("content", ""))
                    break
                # One event per generated token (its text may be "" while a character is incomplete).
                first = first if first is not None else now
                last = now
                pieces.append(event.get("content", ""))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ServerError(f"streaming from llama-server failed: {exc}", hint=f"See its log: {self.log_path}") from exc
        finally:
            connection.close()
        generated = int(final.get("tokens_predicted", 0))
        timing = RequestTiming(start, first, last, int(final.get("tokens_evaluated", 0)), generated)
        return ServerReply(timing, "".join(pieces), final)

    def _healthy(self) -> bool:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=2)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def _last_log_line(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return lines[-1].strip()[:200] if lines else "no output"

