"""`gemmactl serve` over real HTTP on 127.0.0.1: the official openai client, routing, load, faults, peers, keys.

Servers run the embedded Gemma 3 270M on the cached CPU llama.cpp build's llama-server; requests
are kept short (few tokens) so the whole file stays within a minute or two on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import invoke

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"


def recipe_text(model: Path, *, parallel: int = 4, deep_context: int | None = None) -> str:
    """fast and deep on the embedded GGUF; a different deep context gives deep its own llama-server."""
    deep = f"    context: {deep_context}\n" if deep_context else "    context: 2048\n"
    return (
        "name: serve-test\n"
        "tiers:\n"
        f"  fast:\n    model: {model}\n    context: 2048\n    parallel: {parallel}\n"
        "    sampling: {temperature: 0.0, repeat_penalty: 1.1, max_tokens: 16}\n"
        f"  deep:\n    model: {model}\n{deep}    parallel: {parallel}\n"
        "    sampling: {temperature: 0.0, repeat_penalty: 1.1, max_tokens: 32}\n"
    )


@pytest.fixture(scope="module")
def serve_home(llama_build_store, tmp_path_factory) -> Path:
    """A store of this module's own that shares the cached llama.cpp build."""
    home = tmp_path_factory.mktemp("serve-home")
    for sub in ("builds", "sources"):
        (home / sub).symlink_to(llama_build_store / sub, target_is_directory=True)
    return home


def start(home: Path, recipe, **options):
    """A service on a free port for a recipe's text (or a Recipe)."""
    from gemmactl.recipes import parse_recipe
    from gemmactl.server.service import ServeConfig, Service
    from gemmactl.store import Store

    config = ServeConfig(recipe=parse_recipe(recipe) if isinstance(recipe, str) else recipe, port=0, **options)
    return Service(config, Store(home)).start()


def one_slot(recipe):
    """The recipe with one slot per tier. A text compared with `run` must not depend on which slot
    (and so which cached prefix) llama-server picks: a prompt evaluated after another cached prefix
    is a batch of another size, and llama.cpp's CPU kernels do not promise the same last bits for
    every batch size (its docs say so of cache_prompt). With several slots that choice depends on
    when the previous answer's slot was released."""
    from dataclasses import replace

    return replace(recipe, tiers={name: replace(tier, parallel=1) for name, tier in recipe.tiers.items()})


@pytest.fixture(scope="module")
def server(serve_home, embedded_gguf):
    service = start(serve_home, recipe_text(embedded_gguf))
    yield service
    service.close()


def post(url: str, body: dict, key: str | None = None, timeout: float = 120):
    """(status, headers, parsed JSON body) of a POST."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def get(url: str, key: str | None = None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def client(service, key: str = "unused"):
    from openai import OpenAI

    return OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0, timeout=120)


def wait_for(predicate, timeout: float = 60, what: str = "condition", every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


# -- the OpenAI surface ----------------------------------------------------------------------------


def test_openai_client_answers_like_run_streamed_and_not(embedded_gguf, serve_home, tmp_path):
    """The official client gets, whole and streamed, the text `gemmactl run` prints for the same
    recipe and prompt (greedy, up to 64 tokens)."""
    from gemmactl.recipes import parse_recipe

    recipe = tmp_path / "serve-test.yaml"
    recipe.write_text(recipe_text(embedded_gguf))
    service = start(serve_home, one_slot(parse_recipe(recipe.read_text())))
    try:
        _answers_like_run(client(service), recipe, serve_home)
    finally:
        service.close()


def _answers_like_run(api, recipe, serve_home):
    for prompt in (QUESTION, "Describe a sunset in two sentences."):
        messages = [{"role": "user", "content": prompt}]
        reply = api.chat.completions.create(model="fast", messages=messages, max_tokens=64)
        answer = reply.choices[0].message.content
        assert reply.model == "fast" and answer.strip(), prompt
        assert reply.usage.prompt_tokens > 5 and reply.usage.completion_tokens >= 1

        stream = api.chat.completions.create(model="fast", messages=messages, max_tokens=64, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer, prompt
        assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens, prompt

        ran = subprocess.run([sys.executable, "-m", "gemmactl", "run", "--recipe", str(recipe), "--tier", "fast",
                              "--max-tokens", "64", "--json", prompt], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, GEMMACTL_HOME=str(serve_home)))
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["answer"] == answer, prompt
        if prompt == QUESTION:
            assert "Paris" in answer and reply.choices[0].finish_reason == "stop"


def test_routing_by_model_and_by_prefix(server):
    api = client(server)
    by_prefix = api.chat.completions.create(model="auto", messages=[{"role": "user", "content": f"deep: {QUESTION}"}])
    assert by_prefix.model == "deep" and "Paris" in by_prefix.choices[0].message.content
    by_model = api.chat.completions.create(model="deep", messages=[{"role": "user", "content": QUESTION}])
    assert by_model.model == "deep"
    # The prefix is routing, never prompt text: stripped, the model sees the same question.
    assert by_prefix.choices[0].message.content == by_model.choices[0].message.content
    quick = api.chat.completions.create(model="auto", messages=[{"role": "user", "content": f"quick: {QUESTION}"}])
    assert quick.model == "fast"
    status, _, body = post(f"{server.url}/v1/chat/completions",
                           {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and "fast, deep" in body["error"]["message"]
    status, _, body = post(f"{server.url}/v1/chat/completions", {"messages": []})
    assert status == 400 and "messages" in body["error"]["message"]


def test_completions_models_health_and_metrics(server):
    api = client(server)
    done = api.completions.create(model="fast", prompt="Question: Who wrote the play Hamlet?\nAnswer:",
                                  max_tokens=6, temperature=0)
    assert "Shakespeare" in done.choices[0].text
    pieces = list(api.completions.create(model="fast", prompt="The history of the city of Paris begins",
                                         max_tokens=5, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces if p.choices).strip()
    assert [m.id for m in api.models.list().data] == ["auto", "fast", "deep"]  # auto: the README's name
    status, text = get(f"{server.url}/metrics")
    assert status == 200
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("gemmactl_"))
    assert int(series['gemmactl_completed_total{tier="fast"}']) >= 2
    assert int(series['gemmactl_generated_tokens_total{tier="fast"}']) >= 2
    assert 'gemmactl_queue_depth{tier="deep"}' in series and 'gemmactl_cache_hits_total{tier="fast"}' in series
    assert series['gemmactl_backend_up{tier="fast"}'] == "1"
    health = json.loads(get(f"{server.url}/health")[1])
    assert health["status"] == "ok" and health["tiers"]["fast"]["backend"] == "llama-server"
    # fast and deep have the same model and settings here: one process serves both.
    assert health["tiers"]["fast"]["pid"] == health["tiers"]["deep"]["pid"]


def test_warm_conversation_reuses_the_cached_prefix(server):
    from gemmactl.bench.prompts import catalogue

    messages = []
    for book in catalogue()[:14]:
        messages.append({"role": "user", "content": f"Do you have \"{book['title']}\"?"})
        messages.append({"role": "assistant", "content": f"Yes, by {book['author']}, {book['year']}, shelf {book['shelf']}."})
    messages.append({"role": "user", "content": "Which shelf holds the third book?"})
    status, _, first = post(f"{server.url}/v1/chat/completions", {"model": "fast", "messages": messages, "max_tokens": 4})
    assert status == 200
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And who wrote it?"}]
    status, _, second = post(f"{server.url}/v1/chat/completions", {"model": "fast", "messages": messages, "max_tokens": 4})
    assert status == 200
    # The second turn's prompt starts with the whole first prompt: the server skipped it.
    assert second["gemmactl"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 2
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]


# -- load -----------------------------------------------------------------------------------------


def test_burst_of_120_concurrent_requests_none_dropped(server):
    def one(i: int):
        return post(f"{server.url}/v1/completions",
                    {"model": "fast", "prompt": f"Question: What is {i} plus {i}?\nAnswer:", "max_tokens": 2})

    before = server.lanes["fast"].counters.completed
    with ThreadPoolExecutor(max_workers=120) as pool:
        results = list(pool.map(one, range(120)))
    assert [status for status, _, _ in results] == [200] * 120
    assert all(body["usage"]["completion_tokens"] >= 1 for _, _, body in results)
    assert server.lanes["fast"].counters.completed - before == 120


def test_past_the_queue_bound_is_503_with_retry_after(serve_home, embedded_gguf):
    service = start(serve_home, recipe_text(embedded_gguf, parallel=1), queue=1)
    try:
        api = client(service)
        holder = api.completions.create(model="fast", prompt="Once upon a time", max_tokens=400, stream=True)
        next(iter(holder))  # the only slot is now busy
        waiter = ThreadPoolExecutor(1).submit(post, f"{service.url}/v1/completions",
                                              {"model": "fast", "prompt": "Hello", "max_tokens": 2})
        wait_for(lambda: service.lanes["fast"].waiting == 1, what="a queued request")
        status, headers, body = post(f"{service.url}/v1/completions", {"model": "fast", "prompt": "Hi", "max_tokens": 2})
        assert status == 503 and headers["Retry-After"] == "2" and "saturated" in body["error"]["message"]
        holder.close()  # the client goes away: its slot is released and the queued request runs
        assert waiter.result(timeout=120)[0] == 200
        assert service.lanes["fast"].counters.rejected == 1
    finally:
        service.close()


def test_a_client_that_goes_away_frees_its_slot_streamed_or_not(serve_home, embedded_gguf):
    """A client that closes its connection mid-answer ends the generation: llama-server's slot and
    the tier's slot are free within seconds, long before the 1500 asked-for tokens could be made
    (counting runs on for all of them at a few dozen tokens a second on the CPU)."""
    import socket
    from urllib.parse import urlsplit

    service = start(serve_home, recipe_text(embedded_gguf, parallel=1))
    try:
        backend, address = service.lanes["fast"].backend, urlsplit(service.url)
        for stream in (False, True):
            earlier = {s.get("id_task") for s in backend.server.get_json("/slots")}

            def ours():
                return [s for s in backend.server.get_json("/slots") if s.get("id_task", earlier) not in earlier]

            body = json.dumps({"model": "fast", "prompt": "Counting: 1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1500,
                               "stream": stream}).encode()
            connection = socket.create_connection((address.hostname, address.port))
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: any(s["is_processing"] and s["next_token"][0]["n_decoded"] >= 8 for s in ours()),
                     what="the answer to be under way")
            connection.close()
            # llama-server looks at a waiting request's connection only after a second with no
            # other result arriving, and each /slots answer is one: ask less often than that.
            wait_for(lambda: not any(s["is_processing"] for s in ours()), timeout=12, every=1.5,
                     what=f"llama-server to free the slot of a {'streamed' if stream else 'whole'} request")
            assert ours()[0]["next_token"][0]["n_decoded"] < 1500, ours()
            wait_for(lambda: service.lanes["fast"].running == 0, timeout=10, what="the tier's slot")
    finally:
        service.close()


# -- faults and peers -----------------------------------------------------------------------------


def test_killed_backend_fails_its_request_then_recovers(serve_home, embedded_gguf):
    import openai

    service = start(serve_home, recipe_text(embedded_gguf, parallel=2))
    try:
        api = client(service)
        backend = service.lanes["fast"].backend
        old_pid = backend.pid
        stream = api.completions.create(model="fast", prompt="Once upon a time", max_tokens=1000, stream=True)
        events = iter(stream)
        next(events)
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in events:
                pass
        wait_for(lambda: backend.state == "ready" and backend.pid != old_pid, timeout=90, what="the restart")
        reply = api.chat.completions.create(model="fast", messages=[{"role": "user", "content": QUESTION}])
        assert "Paris" in reply.choices[0].message.content
        assert backend.restarts == 1
        assert json.loads(get(f"{service.url}/health")[1])["tiers"]["fast"]["restarts"] == 1

        # A non-streamed request waits on one answer: a death mid-answer is a 502, not a hang.
        # A slot may still read as processing the answer above for a moment after it was sent:
        # wait for a task that was not there before this request.
        second_pid = backend.pid
        earlier = {s.get("id_task") for s in backend.server.get_json("/slots")}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, f"{service.url}/v1/completions",
                                  {"model": "fast", "prompt": "Once upon a time", "max_tokens": 1000})
            wait_for(lambda: any(s.get("is_processing") and s.get("id_task") not in earlier
                                 for s in backend.server.get_json("/slots")),
                     what="the request to reach a slot")
            os.kill(second_pid, signal.SIGKILL)
            status, _, body = pending.result(timeout=60)
        assert status == 502 and body["error"]["type"] == "backend_error"
        wait_for(lambda: backend.state == "ready" and backend.pid != second_pid, timeout=90, what="the restart")
        assert backend.restarts == 2
    finally:
        service.close()
    assert not _running(old_pid) and not _running(backend.pid)


def test_peer_answers_when_the_local_tier_is_down(serve_home, embedded_gguf, server):
    local = start(serve_home, recipe_text(embedded_gguf, parallel=1), peers=[server.url], queue=0)
    try:
        api = client(local)
        # Saturated (one slot, no queue): the second of two concurrent requests goes to the peer.
        holder = api.completions.create(model="fast", prompt="Once upon a time", max_tokens=300, stream=True)
        next(iter(holder))
        status, headers, body = post(f"{local.url}/v1/chat/completions",
                                     {"model": "fast", "messages": [{"role": "user", "content": QUESTION}]})
        assert status == 200 and headers["X-Gemmactl-Peer"] == server.url and "Paris" in body["choices"][0]["message"]["content"]
        holder.close()
        # Down: the local server's backend is stopped; the peer answers, streamed through the local front.
        local.lanes["fast"].backend.stop()
        stream = api.chat.completions.create(model="fast", messages=[{"role": "user", "content": QUESTION}], stream=True)
        assert "Paris" in "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert local.lanes["fast"].counters.forwarded == 2
        # With the peer gone too (marked down by its health check), the answer is a 503, never a hang.
        local.peers.peers[0].healthy = False
        status, headers, _ = post(f"{local.url}/v1/chat/completions",
                                  {"model": "fast", "messages": [{"role": "user", "content": QUESTION}]})
        assert status == 503 and "Retry-After" in headers
    finally:
        local.close()


def test_api_key_is_enforced(serve_home, embedded_gguf):
    import openai

    service = start(serve_home, recipe_text(embedded_gguf, parallel=1), api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client(service, key="wrong").models.list()
        assert get(f"{service.url}/metrics")[0] == 401
        assert post(f"{service.url}/v1/completions", {"prompt": "Hi"})[0] == 401
        assert get(f"{service.url}/health")[0] == 200  # health stays open for peers and load balancers
        reply = client(service, key="s3cret").chat.completions.create(
            model="fast", messages=[{"role": "user", "content": QUESTION}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        service.close()


# -- the command ----------------------------------------------------------------------------------


def test_serve_command_ps_and_clean_shutdown(serve_home, embedded_gguf, tmp_path, runner, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(recipe_text(embedded_gguf, parallel=1))
    env = dict(os.environ, GEMMACTL_HOME=str(serve_home), GEMMACTL_NO_PROGRESS="1")
    proc = subprocess.Popen([sys.executable, "-m", "gemmactl", "serve", "--recipe", str(recipe), "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        state = json.loads(proc.stdout.readline())
        child = state["tiers"]["fast"]["pid"]
        assert _running(child) and state["url"].startswith("http://127.0.0.1:")
        monkeypatch.setenv("GEMMACTL_HOME", str(serve_home))
        listed = json.loads(invoke(runner, ["ps", "--json"]).stdout)
        mine = next(s for s in listed if s["pid"] == proc.pid)
        assert mine["status"] == "ok" and mine["tiers"]["fast"]["state"] == "ready"
        table = invoke(runner, ["ps"]).stdout
        assert state["url"] in table and "llama-server" in table
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _running(child)
    assert not any(s["pid"] == proc.pid for s in json.loads(invoke(runner, ["ps", "--json"]).stdout))


def test_ps_removes_stale_state(serve_home, runner, monkeypatch, tmp_path):
    home = tmp_path / "home"
    (home / "servers").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (home / "servers" / f"{dead.pid}-1.json").write_text(json.dumps({"pid": dead.pid, "url": "http://127.0.0.1:1", "tiers": {}}))
    monkeypatch.setenv("GEMMACTL_HOME", str(home))
    result = invoke(runner, ["ps"])
    assert result.exit_code == 0 and "No gemmactl server is running" in result.stdout
    assert "which is gone" in result.stderr and not list((home / "servers").glob("*.json"))


def test_without_a_build_tiers_run_in_process_with_a_warning(tmp_path, embedded_gguf):
    from gemmactl.store import Store

    service = start(tmp_path / "no-build", recipe_text(embedded_gguf, parallel=2))
    try:
        assert any("no llama.cpp build" in w for w in service.warnings)
        lane = service.lanes["fast"]
        assert lane.backend.info.kind == "in-process llamacpp" and lane.backend is service.lanes["deep"].backend
        reply = client(service).chat.completions.create(model="fast", messages=[{"role": "user", "content": QUESTION}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        service.close()
    assert Store(tmp_path / "no-build").home.exists()


def _running(pid: int | None) -> bool:
    from gemmactl.server.registry import pid_alive

    return pid_alive(pid)


@pytest.mark.real_model
def test_int4_tier_is_served_in_process(gemma3_hf_checkpoint, isolated_home, runner):
    """An int4-stream tier runs on the int4 backend inside the server, one request at a time."""
    from conftest import invoke

    made = invoke(runner, ["quantize", str(gemma3_hf_checkpoint), "--int4-stream", "--json"])
    assert made.exit_code == 0, made.stderr
    name = json.loads(made.stdout)["artifact"]["name"]
    recipe = (
        "name: serve-int4\n"
        "tiers:\n"
        f"  deep:\n    model: {name}\n    backend: int4\n    context: 512\n"
        "    sampling: {temperature: 0.0, repeat_penalty: 1.0, max_tokens: 12}\n"
    )
    service = start(isolated_home, recipe)
    try:
        lane = service.lanes["deep"]
        assert lane.backend.info.kind == "in-process int4" and lane.backend.info.parallel == 1
        status, _, body = post(f"{service.url}/v1/completions",
                               {"model": "deep", "prompt": "Question: What is the capital of France?\nAnswer:"})
        assert status == 200 and "Paris" in body["choices"][0]["text"]
        assert lane.snapshot()["completed"] == 1
    finally:
        service.close()


def test_parallel_auto_takes_its_slots_from_the_planner(serve_home, embedded_gguf):
    from gemmactl.plan.auto import AUTO_PARALLEL_MAX
    from gemmactl.recipes import parse_recipe
    from gemmactl.server.service import plan_backends
    from gemmactl.store import Store

    recipe = parse_recipe(recipe_text(embedded_gguf).replace("parallel: 4", "parallel: auto"))
    plans, unavailable, _ = plan_backends(recipe, Store(serve_home), speculative=False, require_build=True)
    assert not unavailable
    for plan in plans:
        assert plan.kind == "llama-server" and 1 <= plan.parallel <= AUTO_PARALLEL_MAX
        assert plan.slots_note.startswith(f"parallel auto: {plan.parallel} slot")


def test_backend_sampling_tier_gives_the_plain_tiers_greedy_text(serve_home, embedded_gguf):
    """Sampling on the backend is an optimization: one request at a time, the same greedy tokens."""
    recipe = recipe_text(embedded_gguf).replace(
        "    sampling: {temperature: 0.0, repeat_penalty: 1.1, max_tokens: 32}\n",
        "    sampling: {temperature: 0.0, repeat_penalty: 1.0, max_tokens: 32}\n    backend_sampling: true\n",
    ).replace("repeat_penalty: 1.1, max_tokens: 16", "repeat_penalty: 1.0, max_tokens: 32")
    service = start(serve_home, recipe)
    try:
        commands = {tier: lane.backend.info.command for tier, lane in service.lanes.items()}
        assert "--backend-sampling" in commands["deep"] and "--backend-sampling" not in commands["fast"]
        for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
            texts = [post(f"{service.url}/v1/completions", {"model": tier, "prompt": prompt, "max_tokens": 24})[2]
                     ["choices"][0]["text"] for tier in ("fast", "deep")]
            assert texts[0] == texts[1] and texts[0], prompt
    finally:
        service.close()


def test_cheap_greedy_fields_give_llama_servers_own_greedy_text(serve_home, embedded_gguf, tmp_path):
    """Greedy with the filters as no-ops (gemmactl's request) = greedy after llama-server's default filters."""
    from gemmactl.llamacpp.build import active_build
    from gemmactl.llamacpp.server import LlamaServer
    from gemmactl.store import Store

    binary = active_build(Store(serve_home)).binary("llama-server")
    for extra in ((), ("--backend-sampling",)):
        with LlamaServer(binary, str(embedded_gguf), threads=2, context=512, parallel=1, log_dir=tmp_path,
                         extra_args=extra) as server:
            assert server.samples_on_backend == bool(extra)
            for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
                body = {"prompt": prompt, "n_predict": 24, "ignore_eos": True, "cache_prompt": False}
                cheap = server.post_json("/completion", body | server.sampling_fields(0, 64, 0.95, 0.05, 1.1))
                plain = server.post_json("/completion", body | {"temperature": 0, "repeat_penalty": 1.1})
                assert cheap["tokens_predicted"] == plain["tokens_predicted"] == 24
                assert cheap["content"] == plain["content"], (extra, prompt)


def test_non_streamed_answer_equals_the_streamed_one_with_stops_and_lengths(server):
    """Non-streamed requests are made in one llama-server call: same text, counts and finish reasons.

    The prompt is one whose greedy answer has wide margins: llama-server's prompt cache evaluates
    a reused prompt's last token alone, and its logits may differ in the last bits from the
    batched prompt's (llama.cpp documents this for cache_prompt), which can flip a close call.
    """
    api = client(server)
    prompt = "Counting: 1, 2, 3, 4, 5, 6, 7, 8,"
    free = api.completions.create(model="fast", prompt=prompt, max_tokens=40).choices[0].text
    words = free.split(" ")
    middle = " " + next(w for w in words[len(words) // 2:] if w.strip())  # a word the answer reaches
    for stop, max_tokens in ((None, 12), ([middle], 40), (["no such words", middle], 40)):
        whole = api.completions.create(model="fast", prompt=prompt, stop=stop, max_tokens=max_tokens)
        chunks = list(api.completions.create(model="fast", prompt=prompt, stop=stop, max_tokens=max_tokens,
                                             stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert whole.choices[0].text == streamed and streamed, stop
        assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens, stop
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert whole.choices[0].finish_reason == finish[-1] == ("length" if stop is None else "stop"), stop
        if stop:
            assert free.startswith(streamed) and middle not in streamed, stop


# Plain requests as a new user types them; several start their answer with a blank line.
PLAIN_PROMPTS = [
    "Write a poem about the sea.", "Write a haiku about autumn.", "Give me three tips for sleeping better.",
    "Write a Python function that adds two numbers.", "What is the capital of France?", "Tell me a joke.",
    "What is photosynthesis?", "Name three primary colors.", "How do I boil an egg?", "Who wrote Hamlet?",
    "What is the largest planet in the solar system?", "Describe a sunset in two sentences.",
    "Translate 'good morning' into Spanish.", "What is 12 times 12?", "Suggest a name for a cat.",
    "Why do leaves change color in the fall?", "List four fruits.", "What does a bee make?",
    "Write a short story opening about a lighthouse.", "What is the boiling point of water?",
    "Give me a synonym for happy.", "What is the speed of light?",
]


def test_the_default_recipe_answers_every_plain_prompt_alike_in_run_and_serve(serve_home):
    """No vanishing answers: the default recipe's greedy text is the same through `run`'s path
    and through `serve` (whole and streamed), and never empty."""
    from gemmactl.recipes import resolve_recipe

    recipe, limit = resolve_recipe("default"), 40
    # `run`'s path in a process of its own, as the command runs: llama.cpp is then the active
    # build's library, the one llama-server runs (this test process may hold another).
    script = (
        "import json, sys\n"
        "from gemmactl.generate import open_backend, plan_run, resolve_run_model\n"
        "from gemmactl.recipes import resolve_recipe\n"
        "from gemmactl.runtime.base import Piece, stream_generate\n"
        "from gemmactl.store import Store\n"
        "recipe, store, prompts = resolve_recipe('default'), Store(), json.loads(sys.argv[1])\n"
        f"spec = plan_run(prompts[0], recipe, max_tokens={limit})\n"
        "backend = open_backend(resolve_run_model(spec, store), context=spec.tier.context, store=store)\n"
        f"print(json.dumps({{p: ''.join(e.text for e in stream_generate(backend, plan_run(p, recipe, max_tokens={limit}).request)"
        " if isinstance(e, Piece) and e.channel == 'answer').strip() for p in prompts}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(PLAIN_PROMPTS)], capture_output=True, text=True,
                          env=dict(os.environ, GEMMACTL_HOME=str(serve_home)), timeout=600)
    assert proc.returncode == 0, proc.stderr
    ran = json.loads(proc.stdout)
    # Each prompt on a fresh service: in a slot that answered before, llama-server reuses the cached
    # chat-template prefix and evaluates the rest of the prompt as a smaller batch, and llama.cpp's
    # CPU kernels do not promise the same last bits for every batch size. On an AVX-512/AMX Xeon
    # that flipped one answer of these 22 midway ("List four fruits."), while the same prompt on a
    # fresh slot gave `run`'s text. What is compared here is the two paths, not the prefix cache.
    for index, prompt in enumerate(PLAIN_PROMPTS):
        service = start(serve_home, one_slot(recipe))
        try:
            api = client(service)
            messages = [{"role": "user", "content": prompt}]
            if index % 4:
                served = api.chat.completions.create(model="auto", messages=messages, max_tokens=limit)
                text = served.choices[0].message.content
            else:
                chunks = api.chat.completions.create(model="auto", messages=messages, max_tokens=limit, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finally:
            service.close()
        assert text.strip(), f"empty answer to {prompt!r}"
        assert text.strip() == ran[prompt], prompt


def test_detach_logs_and_stop(serve_home, embedded_gguf, tmp_path, monkeypatch):
    from conftest import run_gemmactl
    from gemmactl.server.registry import pid_alive

    env = {"GEMMACTL_HOME": str(serve_home)}
    recipe = tmp_path / "detached.yaml"
    recipe.write_text(recipe_text(embedded_gguf))
    started = run_gemmactl(["serve", "--recipe", str(recipe), "--port", "0", "--detach", "--json"], env=env)
    assert started.returncode == 0, started.stderr
    state = json.loads(started.stdout)
    pid, child = state["pid"], state["tiers"]["fast"]["pid"]
    try:
        assert pid_alive(pid) and pid_alive(child) and Path(state["log"]).is_file()
        assert get(f"{state['url']}/health")[0] == 200  # the command returned only once it was ready
        listed = json.loads(run_gemmactl(["ps", "--json"], env=env).stdout)
        assert pid in [s["pid"] for s in listed]  # (beside this module's own server)
        shown = run_gemmactl(["logs", str(pid), "--lines", "5"], env=env)
        assert shown.returncode == 0 and "llama-server pid" in (shown.stdout + Path(state["log"]).read_text())
        assert run_gemmactl(["stop", "424242"], env=env).returncode == 2
        stopped = run_gemmactl(["stop", str(state["url"].rsplit(":", 1)[1])], env=env)  # by port
        assert stopped.returncode == 0 and "stopped" in stopped.stdout and state["log"] in stopped.stdout
        wait_for(lambda: not pid_alive(pid) and not pid_alive(child), what="the server and its llama-server to end")
        assert pid not in [s["pid"] for s in json.loads(run_gemmactl(["ps", "--json"], env=env).stdout)]
        assert "stopping (signal 15)" in Path(state["log"]).read_text()
    finally:
        for leftover in (pid, child):
            if pid_alive(leftover):
                os.kill(leftover, signal.SIGKILL)


def test_a_detached_server_that_cannot_start_says_why(serve_home, tmp_path):
    from conftest import run_gemmactl

    recipe = tmp_path / "broken.yaml"
    recipe.write_text("tiers:\n  fast:\n    model: /no/such/model.gguf\n")
    proc = run_gemmactl(["serve", "--recipe", str(recipe), "--port", "0", "--detach"], env={"GEMMACTL_HOME": str(serve_home)})
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert "exited before it was ready" in line and "no such model file" in line and "log" in line


def test_a_draft_that_llama_server_turns_down_is_shown_as_refused(serve_home, embedded_gguf, tiny_checkpoint, tmp_path):
    """A Gemma 4 draft for the Gemma 3 target: llama-server refuses it (other vocabulary) and starts
    without it; every place that shows the tier says so instead of "draft"."""
    from conftest import run_gemmactl

    made = run_gemmactl(["quantize", str(tiny_checkpoint("dense-ple")), "--gguf", "F16", "--out",
                         str(tmp_path / "draft.gguf"), "--json"], env={"GEMMACTL_HOME": str(serve_home)})
    assert made.returncode == 0, made.stderr
    recipe = (f"tiers:\n  fast:\n    model: {embedded_gguf}\n    context: 2048\n    parallel: 1\n"
              f"    speculative: {{type: draft, draft_model: {tmp_path / 'draft.gguf'}}}\n"
              "    sampling: {temperature: 0.0, max_tokens: 8}\n")
    service = start(serve_home, recipe)
    try:
        shown = service.lanes["fast"].snapshot()["speculative"]
        assert shown.startswith("refused by llama-server") and "vocab" in shown
        assert f'speculative="{shown}"' in get(f"{service.url}/metrics")[1]
        assert service.state()["tiers"]["fast"]["speculative"] == shown  # what `gemmactl ps` reads
        status, _, body = post(f"{service.url}/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4})
        assert status == 200 and body["gemmactl"]["draft_tokens"] == 0  # it answers, without drafting
    finally:
        service.close()


def test_a_gemma4_tier_drafts_with_its_mtp_assistant(serve_home, tiny_checkpoint, tiny_assistant, tmp_path):
    """Gemma 4's MTP assistant as a tier's draft: the vendored converter writes it, llama-server runs
    it (--spec-type draft-mtp, reading the target's KV), it drafts, and its greedy text starts as the
    tier's without it. Not all of it need agree: llama.cpp verifies drafts in a batch, whose
    rounding can move a near-tie, and this random model's logits are nearly flat (docs/speculation.md)."""
    from conftest import run_gemmactl

    env = {"GEMMACTL_HOME": str(serve_home)}
    paths = {}
    for name, checkpoint in (("target", tiny_checkpoint("dense-ple")), ("assistant", tiny_assistant)):
        made = run_gemmactl(["quantize", str(checkpoint), "--gguf", "Q8_0", "--out", str(tmp_path / f"{name}.gguf"),
                             "--json"], env=env)
        assert made.returncode == 0, made.stderr[-2000:]
        paths[name] = tmp_path / f"{name}.gguf"
    tier = (f"    model: {paths['target']}\n    context: 1024\n    parallel: 1\n"
            "    sampling: {temperature: 0.0, max_tokens: 24}\n")
    recipe = (f"tiers:\n  fast:\n{tier}"
              f"  deep:\n{tier}    speculative: {{type: mtp, draft_model: {paths['assistant']}, draft_max: 3}}\n")
    service = start(serve_home, recipe)
    try:
        assert service.lanes["deep"].snapshot()["speculative"].startswith("mtp (assistant.gguf)")
        answers = {}
        for tier_name in ("fast", "deep"):
            status, _, body = post(f"{service.url}/v1/completions",
                                   {"model": tier_name, "prompt": "The capital of France is", "max_tokens": 24})
            assert status == 200, body
            answers[tier_name] = body
        plain, drafted = (answers[t]["choices"][0]["text"] for t in ("fast", "deep"))
        assert drafted and drafted.split()[0] == plain.split()[0]  # the first words: before any draft was verified
        assert answers["deep"]["gemmactl"]["draft_tokens"] > 0 and answers["fast"]["gemmactl"]["draft_tokens"] == 0
    finally:
        service.close()
