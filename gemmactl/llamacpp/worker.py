"""A worker: ggml-rpc-server of the active build, lending this machine's memory and compute to a
head elsewhere (`gemmactl worker`; docs/rpc.md). One state file per worker under
`$GEMMACTL_HOME/workers/`, read by `gemmactl ps`.

ggml-rpc-server has no memory limit of its own. A budget (`--mem`) is enforced by the kernel:
the worker's data segment (heap and private mappings, where its buffers live) is limited to the
budget plus its own overhead (WORKER_OVERHEAD_BYTES and a stack per thread), so a head that asks
for more fails to load, with the reason, instead of the machine swapping. A tensor being received
is held twice for a moment (the message and the buffer): the largest tensor counts once more.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import ServerError
from gemmactl.fileio import atomic_write_text
from gemmactl.endpoints import Endpoint
from gemmactl.llamacpp.rpc import WorkerError, WorkerInfo, probe

# Beyond the budget: the server's own heap (32 MiB) and each compute thread's 8 MiB stack (both
# count as data). An idle ggml-rpc-server uses about 1 MiB of data.
WORKER_OVERHEAD_BYTES = 32 << 20
THREAD_STACK_BYTES = 8 << 20
START_TIMEOUT_S = 30.0


def workers_dir(home: Path) -> Path:
    return Path(home) / "workers"


@dataclass
class WorkerProcess:
    endpoint: Endpoint
    process: subprocess.Popen
    log_path: Path
    state_path: Path
    info: WorkerInfo | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.state_path.unlink(missing_ok=True)


def start_worker(build, endpoint: Endpoint, *, home: Path, threads: int | None = None, cache_dir: Path | None = None,
                 mem: int | None = None) -> WorkerProcess:
    """Start ggml-rpc-server on endpoint and wait until it answers HELLO; write its state file."""
    binary = build.binary("ggml-rpc-server")
    if not binary.exists():
        raise ServerError(f"the active llama.cpp build ({build.build_id}) has no ggml-rpc-server",
                          hint="Run `gemmactl build`: this version builds the RPC backend too.")
    command = [str(binary), "-H", endpoint.host, "-p", str(endpoint.port)]
    if threads:
        command += ["-t", str(threads)]
    env = dict(os.environ)
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        command.append("-c")
        env["LLAMA_CACHE"] = str(cache_dir)  # the server keeps its tensor cache in LLAMA_CACHE/rpc
    folder = workers_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / f"{endpoint.host}-{endpoint.port}.log"

    cap = None if mem is None else mem + WORKER_OVERHEAD_BYTES + THREAD_STACK_BYTES * (threads or os.cpu_count() or 1)

    def limit():  # in the child, before exec
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True, preexec_fn=limit)
    worker = WorkerProcess(endpoint, process, log_path, folder / f"{process.pid}.json")
    try:
        _wait_until_it_answers(worker, log_path)
    except BaseException:  # Ctrl-C while starting included: never leave the server behind
        worker.stop()
        raise
    state = {"pid": process.pid, "address": endpoint.address, "build": build.build_id,
             "protocol": worker.info.version, "devices": worker.info.devices, "free_bytes": worker.info.free_bytes,
             "mem_bytes": mem, "cache": str(cache_dir) if cache_dir else None, "log": str(log_path),
             "started": time.time()}
    atomic_write_text(worker.state_path, json.dumps(state, indent=2, sort_keys=True))
    return worker


def _wait_until_it_answers(worker: WorkerProcess, log_path: Path) -> None:
    endpoint, process = worker.endpoint, worker.process
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if not worker.alive():
            raise ServerError(f"ggml-rpc-server exited at once (code {process.returncode}): {_last_line(log_path)}",
                              hint=f"Is the port {endpoint.port} free? See its log: {log_path}")
        try:
            worker.info = probe(endpoint, timeout=2.0)
            break
        except WorkerError:
            if time.monotonic() > deadline:
                raise ServerError(f"ggml-rpc-server did not answer on {endpoint} within {START_TIMEOUT_S:.0f} s",
                                  hint=f"See its log: {log_path}") from None
            time.sleep(0.1)


def running_workers(home: Path) -> list[dict]:
    """The state of every worker of this store still running; files of gone ones are removed."""
    live = []
    folder = workers_dir(home)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if state.get("pid") and "ggml-rpc-server" in _cmdline(state["pid"]):  # gone, or a reused pid: stale
            live.append(state)
        else:
            path.unlink(missing_ok=True)
    return live


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "no output"
