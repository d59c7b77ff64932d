"""Run a torch-based bench target in a child process of its own.

torch and a CUDA build of llama.cpp can not always share one process: each brings its own CUDA
libraries, and on a machine with torch 2.11 (CUDA 13) and llama.cpp built against the system's
CUDA 13 toolkit, loading the second one crashed the process whichever came first. The
transformers targets therefore run in a worker process (`python -m gemmactl.bench.isolated`)
and answer over a pipe, one JSON object per line. Timestamps are taken inside the worker on
the same monotonic clock as the parent (CLOCK_MONOTONIC on Linux), so nothing the caller
measures includes the pipe. Memory figures are the worker's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

from gemmactl.bench.stats import RequestTiming
from gemmactl.bench.targets import Sample, TargetSettings, TargetUnavailable

WORKER_MEMORY_NOTE = "peak RSS of the target's own worker process"


class IsolatedTarget:
    """A proxy for a target class that lives in a worker process."""

    def __init__(self, class_name: str, settings: TargetSettings):
        self.class_name = class_name
        self.log_path = Path(settings.log_dir) / f"{class_name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gemmactl.bench.isolated"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
        )
        reply = self._call({"op": "load", "class": class_name, "settings": _settings_dict(settings)})
        self.name, self.prefix_reuse, self.note = reply["name"], reply["prefix_reuse"], reply["note"]
        self.load_s = reply["load_s"]

    def generate(self, prompt: str, max_tokens: int, cache: str = "off") -> Sample:
        reply = self._call({"op": "generate", "prompt": prompt, "max_tokens": max_tokens, "cache": cache})
        timing = RequestTiming(**reply["timing"]) if reply.get("timing") else None
        return Sample(reply["metrics"], reply["text"], timing, reply.get("engine_decode_tok_s"),
                      reply.get("cached_tokens"), reply.get("extra") or {})

    def memory(self) -> dict:
        return self._call({"op": "memory"})["memory"]

    def info(self) -> dict:
        return {**self._call({"op": "info"})["info"], "process": "worker"}

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._call({"op": "close"})
            except RuntimeError:
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def _call(self, message: dict) -> dict:
        line = None
        try:
            self._proc.stdin.write((json.dumps(message) + "\n").encode())
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            pass
        if not line:
            code = self._proc.wait()
            raise RuntimeError(f"the {self.class_name} worker exited with status {code}: {self._last_log_line()}")
        reply = json.loads(line)
        if "unavailable" in reply:
            self.close()
            raise TargetUnavailable(reply["unavailable"])
        if "error" in reply:
            raise RuntimeError(f"{self.class_name} worker: {reply['error']} (log: {self.log_path})")
        return reply

    def _last_log_line(self) -> str:
        self._log.flush()
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        return f"{lines[-1]} (log: {self.log_path})" if lines else f"no output (log: {self.log_path})"


def _settings_dict(settings: TargetSettings) -> dict:
    values = {f.name: getattr(settings, f.name) for f in fields(settings)}
    return {key: str(value) if isinstance(value, Path) else value for key, value in values.items()}


def _settings_from(data: dict) -> TargetSettings:
    paths = {"log_dir", "server_binary", "hf_model"}
    return TargetSettings(**{key: Path(value) if key in paths and value is not None else value
                             for key, value in data.items()})


def serve(inp, out) -> None:
    """The worker's loop: one request per line in, one reply per line out."""
    from gemmactl.bench import targets

    target = None
    for line in inp:
        message = json.loads(line)
        op = message["op"]
        try:
            if op == "load":
                target = getattr(targets, message["class"])(_settings_from(message["settings"]))
                reply = {"name": target.name, "prefix_reuse": target.prefix_reuse, "note": getattr(target, "note", None),
                         "load_s": target.load_s}
            elif op == "generate":
                sample = target.generate(message["prompt"], message["max_tokens"], message["cache"])
                reply = {"metrics": sample.metrics, "text": sample.text,
                         "timing": asdict(sample.timing) if sample.timing else None,
                         "engine_decode_tok_s": sample.engine_decode_tok_s,
                         "cached_tokens": sample.cached_tokens, "extra": sample.extra}
            elif op == "memory":
                reply = {"memory": {**target.memory(), "memory_scope": WORKER_MEMORY_NOTE}}
            elif op == "info":
                reply = {"info": target.info()}
            elif op == "close":
                if target is not None:
                    target.close()
                out.write(json.dumps({"closed": True}) + "\n")
                out.flush()
                return
            else:
                reply = {"error": f"unknown operation {op!r}"}
        except TargetUnavailable as exc:
            reply = {"unavailable": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            import traceback

            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main() -> None:
    # The protocol owns the real stdout; anything a library prints goes to the log instead.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(sys.stdin, protocol)


if __name__ == "__main__":
    main()
