"""A model split across machines with llama.cpp's RPC backend, on loopback: two `gemmactl worker`s
(ggml-rpc-server of the tests' build) and a head on 127.0.0.1 with the embedded model."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import run_gemmactl
from test_serve import serve_home  # noqa: F401 - the fixture: a store of this module's own sharing the build

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Worker:
    """`gemmactl worker` in a process of its own, read from its --json line."""

    def __init__(self, home: Path, *args: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "gemmactl", "worker", "--port", str(self.port), "--json",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, GEMMACTL_HOME=str(home)))
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.state = json.loads(line)
        self.address = f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        os.kill(self.state["pid"], signal.SIGKILL)  # the rpc-server itself, as a crashed box would

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stderr.read()


@pytest.fixture
def workers(serve_home):
    started = []

    def start(*args):
        worker = Worker(serve_home, *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def run(home, gguf, *args, tokens: int = 24) -> subprocess.CompletedProcess:
    return run_gemmactl(["run", "--model", str(gguf), "--json", "--stats", "--temperature", "0", "--max-tokens",
                         str(tokens), *args, QUESTION], env={"GEMMACTL_HOME": str(home)})


def test_two_workers_and_a_head_answer_like_one_box(serve_home, embedded_gguf, workers):
    one, two = workers(), workers()
    assert one.state["protocol"] == two.state["protocol"] and one.state["build"] == two.state["build"]
    alone = run(serve_home, embedded_gguf)
    split = run(serve_home, embedded_gguf, "--rpc", f"{one.address},{two.address}")
    assert alone.returncode == 0 and split.returncode == 0, split.stderr
    assert json.loads(split.stdout)["answer"] == json.loads(alone.stdout)["answer"]
    assert "Paris" in json.loads(alone.stdout)["answer"]
    # The stats name the split: layers on this machine and on each worker.
    placement = next(line for line in split.stderr.splitlines() if line.startswith("placement:"))
    assert "rpc0" in placement and "rpc1" in placement and f"--rpc {one.address},{two.address}" in placement
    listed = run_gemmactl(["ps", "--workers", "--json"], env={"GEMMACTL_HOME": str(serve_home)})
    assert {w["address"] for w in json.loads(listed.stdout)} >= {one.address, two.address}


def test_the_split_is_what_the_plan_said(serve_home, embedded_gguf):
    """-ngl and -ts put the planned layer counts on each device (llama.cpp's own assignment rule)."""
    from gemmactl.plan.inventory import inventory_from_gguf
    from gemmactl.plan.profile import load_profile
    from gemmactl.plan.rpc_split import split_layers

    class Lent:
        def __init__(self, address, lends):
            from gemmactl.endpoints import parse_endpoint

            self.endpoint, self.lends = parse_endpoint(address), lends

    inventory = inventory_from_gguf(embedded_gguf)
    n = inventory.shape.n_layers
    split = split_layers(inventory, [Lent("127.0.0.1:1", 8 << 30), Lent("127.0.0.1:2", 8 << 30)], head_bytes=8 << 30,
                         head_gpu=False, profile=load_profile("desktop-4g"), context=2048)
    counts = [len(device.layers) for device in split.devices]
    assert sum(counts) == n and max(counts) - min(counts) <= 1  # equal lenders, equal shares
    head = counts[0]
    assert split.n_gpu_layers == n - head + 1  # the workers' layers and the output matrix
    # llama.cpp: offloaded layer i (output = n) goes to the first device whose cumulative share exceeds it.
    cumulative, total = [], sum(split.tensor_split)
    for share in split.tensor_split:
        cumulative.append((cumulative[-1] if cumulative else 0) + share / total)
    start = n + 1 - split.n_gpu_layers
    assigned = [next(j for j, c in enumerate(cumulative) if c > (i - start) / split.n_gpu_layers)
                for i in range(start, n + 1)]
    assert assigned == [0] * counts[1] + [1] * (counts[2] + 1)


def test_a_worker_killed_mid_request_fails_it_and_the_tier_comes_back_without_it(serve_home, embedded_gguf, workers):
    import openai

    from test_serve import client, start, wait_for

    one, two = workers(), workers()
    recipe = (f"tiers:\n  fast:\n    model: {embedded_gguf}\n    context: 2048\n    parallel: 1\n"
              f"    rpc: [{one.address}, {two.address}]\n    sampling: {{temperature: 0.0}}\n")
    service = start(serve_home, recipe)
    try:
        backend = service.lanes["fast"].backend
        assert "rpc0" in backend.info.placement and "rpc1" in backend.info.placement
        api = client(service)
        stream = api.completions.create(model="fast", prompt="Counting: 1, 2, 3, 4, 5,", max_tokens=1500, stream=True)
        events = iter(stream)
        next(events)
        two.kill()
        began = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in events:
                pass
        assert time.monotonic() - began < 30  # an error, never a hang
        wait_for(lambda: backend.state == "ready" and backend.restarts >= 1, timeout=120, what="the restart")
        assert "rpc0" in backend.info.placement and "rpc1" not in backend.info.placement
        reply = api.chat.completions.create(model="fast", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=16)
        assert "Paris" in reply.choices[0].message.content
    finally:
        service.close()


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_an_unreachable_worker_is_named(serve_home, embedded_gguf):
    port = free_port()
    line = one_line_error(run(serve_home, embedded_gguf, "--rpc", f"127.0.0.1:{port}"))
    assert f"cannot reach the worker 127.0.0.1:{port}" in line and "gemmactl worker" in line


@pytest.mark.parametrize("bad", ["localhost", "127.0.0.1:", "127.0.0.1:99999", "a b:1", "127.0.0.1:50052=lots"])
def test_a_malformed_worker_address_is_a_usage_error(serve_home, embedded_gguf, bad):
    proc = run(serve_home, embedded_gguf, "--rpc", bad)
    line = one_line_error(proc)
    assert bad.split("=")[0] in line or "lots" in line
    assert proc.returncode == 2


class OtherBuildWorker(threading.Thread):
    """Answers the RPC HELLO as a ggml-rpc-server of another llama.cpp build would: with its own
    protocol version (the first message of the protocol; ggml-rpc.cpp negotiate_hello)."""

    def __init__(self, version=(6, 1, 0)):
        super().__init__(daemon=True)
        self.version = version
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                command = conn.recv(1)
                size = struct.unpack("<Q", conn.recv(8))[0]
                conn.recv(size)
                if command == bytes([14]):
                    conn.sendall(struct.pack("<Q", 28) + bytes([*self.version, 0]) + bytes(24))


def test_a_worker_of_another_build_names_both_versions(serve_home, embedded_gguf):
    from gemmactl.llamacpp.build import active_build
    from gemmactl.llamacpp.rpc import build_protocol
    from gemmactl.store import Store

    other = OtherBuildWorker()
    other.start()
    try:
        line = one_line_error(run(serve_home, embedded_gguf, "--rpc", f"127.0.0.1:{other.port}"))
    finally:
        other.sock.close()
    ours = ".".join(map(str, build_protocol(Path(active_build(Store(serve_home)).source["path"]))))
    assert "speaks llama.cpp RPC protocol 6.1.0" in line and f"speaks {ours}" in line


def test_a_worker_beyond_loopback_says_there_is_no_authentication(serve_home):
    worker = Worker(serve_home, "--host", "0.0.0.0")
    try:
        assert worker.state["address"].endswith(str(worker.port))
    finally:
        stderr = worker.close()
    assert "no authentication" in stderr


def test_a_worker_holds_no_more_than_its_mem(serve_home, embedded_gguf, workers):
    """--mem is enforced: a head told a 16 MiB worker lends 64G puts most layers there and fails to load,
    naming the worker's device, and exits non-zero without a traceback."""
    small = workers("--mem", "16M")
    line = one_line_error(run(serve_home, embedded_gguf, "--rpc", f"{small.address}=64G"))  # it claims far more
    assert f"failed to allocate RPC0[{small.address}]" in line and "--mem" in line


def test_plan_rpc_shows_the_split_and_prices_the_network(model_home, runner):
    from conftest import invoke

    result = invoke(runner, ["plan", "embedded", "--rpc", "127.0.0.1:50052=1G,127.0.0.1:50053=1G", "--vram", "1G",
                             "--hardware", "desktop-4g", "--context", "2048", "--json"])
    assert result.exit_code == 0, result.output
    split = json.loads(result.output)["rpc"]
    names = [d["name"] for d in split["devices"]]
    assert names == ["rpc0", "rpc1", "head-gpu"]  # llama.cpp's order: workers, then the head's GPU
    assert all(d["count"] > 0 for d in split["devices"]) and split["link_bytes_per_token"] > 0
    assert split["server_args"][:2] == ["--rpc", "127.0.0.1:50052,127.0.0.1:50053"]
    text = invoke(runner, ["plan", "embedded", "--rpc", "127.0.0.1:50052=1G", "--vram", "1G", "--hardware",
                           "desktop-4g", "--context", "2048"])
    assert "network:" in text.output and "Gbit/s" in text.output and "--rpc 127.0.0.1:50052" in text.output
    tiny = invoke(runner, ["plan", "embedded", "--rpc", "127.0.0.1:50052=1M", "--vram", "320M", "--hardware",
                           "desktop-4g", "--context", "2048"])
    assert tiny.exit_code != 0 and "lend" in tiny.output and "Traceback" not in tiny.output


def test_a_split_model_takes_the_kv_cache_type(serve_home, embedded_gguf, workers, monkeypatch):
    """`run --rpc … --kv-cache q8_0` answers as one box does with the same cache type, and the
    served head it loads gets -ctk/-ctv q8_0 with flash attention on (a quantized V needs it)."""
    from gemmactl.generate import gpu_placement, open_backend
    from gemmactl.store import Store
    from gemmactl.store.refs import resolve_model

    one = workers()
    alone = run(serve_home, embedded_gguf, "--kv-cache", "q8_0")
    split = run(serve_home, embedded_gguf, "--rpc", one.address, "--kv-cache", "q8_0")
    assert alone.returncode == 0 and split.returncode == 0, split.stderr
    assert json.loads(split.stdout)["answer"] == json.loads(alone.stdout)["answer"]

    monkeypatch.setenv("GEMMACTL_HOME", str(serve_home))
    store = Store(serve_home)
    model = resolve_model(str(embedded_gguf), store)
    placement = gpu_placement(model.path, 2048, store=store, rpc=(one.address,), kv_cache="q8_0")
    backend = open_backend(model, context=2048, store=store, placement=placement, kv_cache="q8_0")
    try:
        command = backend.server.command
        assert command[command.index("-ctk") + 1] == command[command.index("-ctv") + 1] == "q8_0"
        assert command[command.index("-fa") + 1] == "on"
    finally:
        backend.close()
