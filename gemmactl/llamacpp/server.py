"""A llama-server process on 127.0.0.1 and its HTTP client: start, health, stop, streamed completions.

`gemmactl bench` starts one per measurement; `gemmactl serve` keeps one per GGUF tier and restarts
it when it dies. Every server gets `--swa-full`, and `-fa off` unless a recipe tier asks for flash
attention: with both, its attention work, and so its greedy text, equals the in-process backend's
(docs/benchmarks.md).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from gemmactl.errors import ServerError

HOST = "127.0.0.1"
# llama-server's greedy text equals the in-process backend's on Gemma with `-fa off` (no flash
# attention) and `--swa-full` (a full-size cache for the sliding-window layers: the C API's
# default; the server's own default keeps only the window, which also breaks prefix reuse).
# `-fa on` and `-fa auto` (the server decides) give up that equality for other attention kernels;
# `--swa-full` stays, so prefix reuse keeps working.
FLASH_ATTN_MODES = ("off", "on", "auto")
# llama-server's filters that cannot change an argmax, as no-ops.
NEUTRAL_FILTERS = {"top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "xtc_probability": 0.0}


def sampling_fields(temperature: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, *,
                    on_backend: bool = False) -> dict:
    """The sampling part of a llama-server /completion body.

    Greedy (temperature 0) takes the argmax whatever the filters keep, so they are sent in the
    form that costs least. Left at llama-server's defaults, its top-k 40 ranks the whole vocabulary
    (262,144 entries for Gemma) for every slot at every step before the argmax: a partial sort on
    the CPU, a full sort on a GPU when sampling runs there (`--backend-sampling`). On the CPU
    `top_k: 1` is one pass that leaves a single candidate; on the backend `top_k: 0` (off) lets
    the temperature-0 step take the argmax in one reduction. The result is the same token, the
    argmax, which is also the in-process backend's greedy (llama-cpp-python: penalties, then greedy).
    """
    if temperature <= 0:
        return {"temperature": 0.0, "top_k": 0 if on_backend else 1, "repeat_penalty": repeat_penalty,
                **NEUTRAL_FILTERS}
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "repeat_penalty": repeat_penalty}


def _repack(repack: bool | None) -> bool:
    """llama-server's weight repacking: as asked, else the in-process backend's choice (off by default)."""
    if repack is not None:
        return repack
    from gemmactl.runtime.llamacpp import use_extra_buffers

    return use_extra_buffers()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class LlamaServer:
    """llama-server for one GGUF with N slots, each holding `context` tokens; stopped on exit.

    `placement` replaces the default `-ngl N` (e.g. the planner's `-ngl 20 -ot ...`); `extra_args`
    are appended (speculative decoding, ...). `flash_attn` is `-fa`'s value; `--swa-full` stays.
    """

    def __init__(
        self,
        binary: Path,
        model_path: str,
        *,
        threads: int,
        context: int,
        parallel: int = 1,
        n_gpu_layers: int = 999,
        repack: bool | None = None,
        log_dir: Path,
        placement: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        port: int | None = None,
        label: str = "",
        flash_attn: str = "off",
        api_key: str | None = None,
    ):
        if flash_attn not in FLASH_ATTN_MODES:
            raise ValueError(f"flash_attn must be one of {', '.join(FLASH_ATTN_MODES)}, got {flash_attn!r}")
        self.binary = Path(binary)
        self.model_path = str(model_path)
        self.port = port or free_port()
        self.parallel = parallel
        self.context = context
        self.flash_attn = flash_attn
        gpu = list(placement) if placement else ["-ngl", str(n_gpu_layers)]
        # Without --kv-unified the context is split evenly over the slots: size it per slot.
        self.command = [
            str(binary), "-m", self.model_path, "--host", HOST, "--port", str(self.port),
            "-t", str(threads), "-tb", str(threads), "-c", str(context * parallel), "-np", str(parallel),
            *gpu, "--no-kv-unified", "-fa", flash_attn, "--swa-full",
        ] + ([] if _repack(repack) else ["--no-repack"]) + list(extra_args)
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"llama-server-{label}-{self.port}" if label else f"llama-server-np{parallel}-{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.process: subprocess.Popen | None = None
        self.load_s = 0.0
        # A key only this client knows, so no other local user can use the server behind gemmactl's
        # back; it goes in the environment, which other users cannot read (the command line they can).
        self.api_key = api_key if api_key is not None else secrets.token_urlsafe(24)

    @property
    def samples_on_backend(self) -> bool:
        """Whether this server samples on its compute backend (`--backend-sampling`)."""
        return "--backend-sampling" in self.command

    def sampling_fields(self, temperature: float, top_k: int, top_p: float, min_p: float,
                        repeat_penalty: float) -> dict:
        """sampling_fields() for this server's sampler (CPU or backend)."""
        return sampling_fields(temperature, top_k, top_p, min_p, repeat_penalty, on_backend=self.samples_on_backend)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 180) -> float:
        """Start and wait for /health; returns the seconds it took (the server's load time)."""
        started = time.perf_counter()
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, env=dict(os.environ, LLAMA_API_KEY=self.api_key) if self.api_key else None,
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

    def speculation_refused(self) -> str | None:
        """Why this run of the server turned down its draft model (it then decodes without one), or None.

        llama-server logs the refusal (e.g. an incompatible vocabulary) and starts anyway.
        """
        if "-md" not in self.command and "--spec-type" not in self.command:
            return None
        try:
            with open(self.log_path, "rb") as log:
                log.seek(getattr(self, "_log_start", 0))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        marks = ("failed to initialize speculative decoding", "vocabs are not compatible", "failed to load draft model")
        found = [line for line in lines if any(mark in line for mark in marks)]
        if not found:
            return None
        detail = next((line for line in lines if "must match target model" in line), found[-1])
        return detail.split(": ", 1)[-1].strip() if ": " in detail else detail.strip()

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

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

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
        from gemmactl.runtime.base import peak_rss_bytes

        return peak_rss_bytes(self.pid)

    # -- HTTP ---------------------------------------------------------------------------------------

    def get_json(self, path: str, timeout: float = 10) -> dict:
        """GET a JSON endpoint (/props, /slots, ...)."""
        return self._request("GET", path, None, timeout)

    def post_json(self, path: str, payload: dict, timeout: float = 60,
                  cancelled: Callable[[], bool] | None = None) -> dict:
        """POST a JSON body and read a JSON answer (/tokenize, non-streamed /completion).

        cancelled: asked every CANCEL_POLL_S while the answer is awaited; once it says True the
        connection is closed (llama-server then cancels the task and frees its slot) and
        RequestCancelled is raised.
        """
        return self._request("POST", path, payload, timeout, cancelled)

    def stream(self, payload: dict, *, timeout: float = 300) -> Iterator[dict]:
        """POST a streaming /completion and yield its events; the last one has "stop": true.

        Closing the iterator early closes the connection, which makes llama-server cancel the task.
        """
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            try:
                connection.request("POST", "/completion", json.dumps(dict(payload, stream=True)),
                                   self._headers({"Content-Type": "application/json"}))
                response = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise ServerError(f"llama-server did not answer: {exc}", hint=f"See its log: {self.log_path}") from exc
            if response.status != 200:
                raise ServerError(
                    f"llama-server answered HTTP {response.status}: {response.read()[:200].decode(errors='replace')}",
                    hint=f"See its log: {self.log_path}",
                )
            while True:
                try:
                    raw = response.readline()
                except (OSError, http.client.HTTPException) as exc:
                    raise ServerError(f"streaming from llama-server failed: {exc}",
                                      hint=f"See its log: {self.log_path}") from exc
                if not raw:
                    raise ServerError("llama-server closed the stream before the end of the answer",
                                      hint=f"See its log: {self.log_path}")
                if not raw.startswith(b"data: "):
                    continue
                try:
                    event = json.loads(raw[6:])
                except ValueError as exc:
                    raise ServerError(f"llama-server sent a malformed event: {raw[:120]!r}") from exc
                if "error" in event:
                    raise ServerError(f"llama-server failed: {event['error'].get('message', event['error'])}",
                                      hint=f"See its log: {self.log_path}")
                yield event
                if event.get("stop"):
                    return
        finally:
            connection.close()

    def _request(self, method: str, path: str, payload: dict | None, timeout: float,
                 cancelled: Callable[[], bool] | None = None) -> dict:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            body = json.dumps(payload) if payload is not None else None
            connection.request(method, path, body, self._headers({"Content-Type": "application/json"} if body else {}))
            if cancelled is not None:
                _await_answer(connection.sock, timeout, cancelled)
            response = connection.getresponse()
            data = response.read()
            if response.status != 200:
                raise ServerError(f"llama-server answered HTTP {response.status} to {path}: "
                                  f"{data[:200].decode(errors='replace')}", hint=f"See its log: {self.log_path}")
            return json.loads(data)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise ServerError(f"llama-server {path} failed: {exc}", hint=f"See its log: {self.log_path}") from exc
        finally:
            connection.close()

    def _headers(self, headers: dict) -> dict:
        return {**headers, "Authorization": f"Bearer {self.api_key}"} if self.api_key else headers

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
        """Why this run stopped: the message of a ggml abort (the debugger's backtrace follows it),
        else its first error line (the cause; the lines after it are consequences), else the last line."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(getattr(self, "_log_start", 0))
                lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        aborts = [m.group(1) for m in map(_ABORT.search, lines) if m]
        if aborts:
            return aborts[-1].strip()[:200]
        errors = [m.group(1) for m in map(_ERROR.search, lines) if m]
        if errors:
            return errors[0].strip()[:200]
        return lines[-1].strip()[:200] if lines else "no output"


CANCEL_POLL_S = 0.25
_ERROR = re.compile(r"^[\d.]+ E (?:\S+\s+)?(\w+: .+)$")  # llama.cpp's log: "0.01.459 E func: message"
_ABORT = re.compile(r"/ggml/src/\S+\.(?:c|cpp|cu):\d+: (.+)$")  # GGML_ABORT's "file:line: message"


class RequestCancelled(Exception):
    """The caller gave up on a request (its own client went away); llama-server was told by the
    connection closing. Not a GemmactlError: nobody is left to show it to."""


def _await_answer(sock: socket.socket, timeout: float, cancelled: Callable[[], bool]) -> None:
    """Wait until llama-server starts answering on sock, asking `cancelled` in between."""
    deadline = time.monotonic() + timeout
    while not select.select([sock], [], [], CANCEL_POLL_S)[0]:
        if cancelled():
            raise RequestCancelled("the client went away")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {timeout:.0f} s")
