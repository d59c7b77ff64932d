"""Bad input and faults, as a new user or a hostile client meets them: the real CLI and real HTTP.

Every case ends in one line (exit 2 for input, 1 for the machine) or an HTTP status with a JSON
error, never a traceback, a temporary path, or advice about something else.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from conftest import invoke, run_gemmactl


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in stderr, stderr
    return lines[0]


# -- the CLI --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_temperature_that_is_no_number(isolated_home, value):
    proc = run_gemmactl(["run", "--temperature", value, "hello"])
    assert proc.returncode == 2 and "--temperature" in one_line(proc.stderr)
    assert proc.stdout == "" and not isolated_home.exists()  # refused before anything is written


def test_binary_on_stdin_is_named_not_reported_as_a_bug(isolated_home):
    import subprocess
    import sys

    data = bytes(1 + i % 255 for i in range(4096))  # 4096 bytes, half of them not UTF-8
    proc = subprocess.run([sys.executable, "-m", "gemmactl", "run"], input=data, capture_output=True)
    line = one_line(proc.stderr.decode())
    assert proc.returncode == 2 and "not valid text" in line and "not UTF-8" in line and "report" not in line


def test_an_empty_folder_as_the_model(isolated_home, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    proc = run_gemmactl(["run", "--model", "empty", "hello"])  # no slash: still the folder it names
    assert proc.returncode == 2 and "is a directory with no model in it" in one_line(proc.stderr)


@pytest.mark.parametrize("size", ["0.5", "1.5", "4"])
def test_a_size_without_a_unit_says_so(isolated_home, size):
    proc = run_gemmactl(["plan", "embedded", "--vram", size])
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and "has no unit" in line and f"--vram {size}G" in line


def test_a_config_with_a_field_of_the_wrong_kind(isolated_home, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"model_type": "gemma3_text", "num_hidden_layers": "many", "hidden_size": 640}))
    proc = run_gemmactl(["plan", str(tmp_path / "m"), "--vram", "4G"])
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and "num_hidden_layers must be a whole number" in line and "'many'" in line


@pytest.mark.real_model
def test_a_gguf_cut_in_half(model_home, embedded_gguf, tmp_path):
    half = tmp_path / "half.gguf"
    with open(embedded_gguf, "rb") as source, open(half, "wb") as out:
        out.write(source.read(embedded_gguf.stat().st_size // 2))
    proc = run_gemmactl(["plan", str(half), "--vram", "4G"])
    assert proc.returncode == 2 and "is truncated" in one_line(proc.stderr)


@pytest.mark.real_model
def test_plan_out_into_a_missing_folder_names_the_folder(model_home, tmp_path):
    proc = run_gemmactl(["plan", "embedded", "--vram", "4G", "--out", str(tmp_path / "missing" / "plan.json")])
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and str(tmp_path / "missing") in line and ".tmp" not in line


@pytest.mark.real_model
def test_plan_out_onto_a_full_disk_leaves_nothing_and_names_the_file(runner, model_home, tmp_path, monkeypatch):
    import gemmactl.fileio as fileio

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    out = tmp_path / "plan.json"
    result = invoke(runner, ["plan", "embedded", "--vram", "4G", "--out", str(out)])
    line = one_line(result.stderr)
    assert result.exit_code == 1 and f"no space left on device for {out}" in line
    assert "GEMMACTL_HOME" not in line and "write it somewhere else" in line
    assert list(tmp_path.iterdir()) == []  # neither the plan nor a temporary file


def test_serve_on_an_address_that_is_none(isolated_home):
    proc = run_gemmactl(["serve", "--host", "256.1.1.1"])
    assert proc.returncode == 2 and "--host" in one_line(proc.stderr)


# -- HTTP -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(llama_build_store, tmp_path_factory, embedded_gguf):
    from test_serve import start

    home = tmp_path_factory.mktemp("abuse-home")
    for sub in ("builds", "sources"):
        (home / sub).symlink_to(llama_build_store / sub, target_is_directory=True)
    recipe = f"tiers:\n  fast:\n    model: {embedded_gguf}\n    context: 512\n    parallel: 2\n"
    service = start(home, recipe, max_connections=8)
    yield service
    service.close()


def http(service, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(service.url + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.real_model
@pytest.mark.parametrize("body, words", [
    (b'{"prompt": "hi", "temperature": NaN}', "'temperature' must be a finite number"),
    (b'{"prompt": "hi", "temperature": 1e309}', "'temperature' must be a finite number"),
    (b'{"prompt": "hi \\ud800 there"}', "lone surrogate"),
    (b'{"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}', "tool calling"),
])
def test_bad_fields_are_400_in_the_api_s_words(served, body, words):
    status, answer = http(served, body)
    assert status == 400 and words in answer["error"]["message"] and "--" not in answer["error"]["message"]


@pytest.mark.real_model
def test_a_request_just_after_llama_server_died_is_503_to_retry(served):
    import urllib.error
    import urllib.request

    backend = served.lanes["fast"].backend
    old = backend.pid
    os.kill(old, signal.SIGKILL)
    backend.server.process.wait()
    request = urllib.request.Request(served.url + "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 503 and caught.value.headers["Retry-After"]
    deadline = time.monotonic() + 90
    while (backend.state != "ready" or backend.pid == old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http(served, b'{"prompt": "The capital of France is", "max_tokens": 3}')[0] == 200


@pytest.mark.real_model
def test_llama_server_answers_only_the_front(served):
    import urllib.error
    import urllib.request

    server = served.lanes["fast"].backend.server
    request = urllib.request.Request(f"{server.url}/completion", b'{"prompt": "hi", "n_predict": 1}',
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:  # another local user, without the run's key
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 401
    assert str(server.api_key) not in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")


@pytest.mark.real_model
def test_a_stalled_client_is_dropped_and_a_flood_gets_503(served, monkeypatch):
    import gemmactl.server.front as front

    monkeypatch.setattr(front, "READ_TIMEOUT_S", 1.0)
    host, port = served.httpd.server_address[:2]
    slow = socket.create_connection((host, port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\n")  # then a byte now and then, never the end
    start = time.monotonic()
    with pytest.raises(OSError):
        for _ in range(40):
            time.sleep(0.25)
            slow.sendall(b"X")
            slow.settimeout(0.01)
            try:
                if slow.recv(1) == b"":
                    raise ConnectionResetError("closed")
            except socket.timeout:
                pass
    assert time.monotonic() - start < 5  # dropped at the deadline, not when the client pleases
    held = [socket.create_connection((host, port)) for _ in range(served.config.max_connections)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection((host, port))
        extra.settimeout(10)
        assert extra.recv(100).startswith(b"HTTP/1.1 503")
    finally:
        for sock in held:
            sock.close()


@pytest.mark.real_model
def test_clients_that_leave_early_are_one_line_each(served, caplog):
    import logging

    host, port = served.httpd.server_address[:2]
    with caplog.at_level(logging.INFO, logger="gemmactl.serve"):
        for _ in range(5):
            sock = socket.create_connection((host, port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"prom")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
            sock.close()
        time.sleep(1)
    assert not any(record.exc_info for record in caplog.records)
    assert "Traceback" not in caplog.text
