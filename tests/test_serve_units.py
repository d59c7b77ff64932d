"""The serving pieces without a model: request parsing and routing, prompt building, admission, GGUF metadata."""

from __future__ import annotations

import struct
import threading

import pytest

from gemmactl.errors import InvalidOptionError, UnknownTierError
from gemmactl.recipes import parse_recipe
from gemmactl.server.api import parse_request
from gemmactl.server.lanes import Lane, Saturated, Unavailable
from gemmactl.formats.gguf_header import read_gguf_header
from gemmactl.prompt.build import ModelText
from gemmactl.prompt.build import build_prompt as render_messages

RECIPE = parse_recipe("name: two\ntiers:\n  fast:\n    model: embedded\n  deep:\n    model: embedded\n    thinking: false\n")
BASE = ModelText(None, "<bos>", "<eos>")


def chat(content: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], **extra}


def test_model_names_the_tier_and_prefix_is_stripped():
    routed = parse_request("chat", chat("deep: why is the sky blue?", model="fast"), RECIPE)
    assert routed.tier == "fast" and routed.request.messages[-1]["content"] == "why is the sky blue?"
    auto = parse_request("chat", chat("think: why is the sky blue?", model="auto"), RECIPE)
    assert auto.tier == "deep" and auto.request.thinking is True and auto.route.prefix == "think:"
    assert parse_request("chat", chat("hello", model="two"), RECIPE).tier == "fast"  # the recipe's name is auto
    # The last user message decides, not the first.
    body = {"messages": [{"role": "user", "content": "deep: a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "quick: c"}]}
    assert parse_request("chat", body, RECIPE).tier == "fast"


def test_request_sampling_overrides_the_tier():
    routed = parse_request("completion", {"prompt": "x", "temperature": 0, "max_tokens": 7, "stop": ["\n"], "seed": 3}, RECIPE)
    request = routed.request
    assert (request.temperature, request.max_tokens, request.seed) == (0, 7, 3)
    assert routed.request.stops == ("\n",) and routed.request.messages is None
    assert parse_request("completion", {"prompt": "x"}, RECIPE).request.max_tokens == RECIPE.tier("fast").sampling.max_tokens


@pytest.mark.parametrize(("kind", "body", "error", "words"), [
    ("chat", chat("hi", model="gpt-4"), UnknownTierError, "fast, deep"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, InvalidOptionError, "role"),
    ("chat", {"messages": [{"role": "system", "content": "x"}]}, InvalidOptionError, "user message"),
    ("chat", chat("deep:   "), InvalidOptionError, "empty after the 'deep:' prefix"),
    ("chat", chat("hi", temperature="hot"), InvalidOptionError, "'temperature' must be a number"),
    ("chat", chat("hi", max_tokens=0), InvalidOptionError, "out of range"),
    ("chat", chat("hi", temperature=float("nan")), InvalidOptionError, "'temperature' must be a finite number"),
    ("completion", {"prompt": "x", "top_p": float("inf")}, InvalidOptionError, "'top_p' must be a finite number"),
    ("completion", {"prompt": "   "}, InvalidOptionError, "the prompt is empty"),
    ("chat", chat("hi", tools=[{"type": "function", "function": {"name": "f"}}]), InvalidOptionError, "tool calling"),
    ("chat", chat("hi", tool_choice="auto"), InvalidOptionError, "tool calling"),
    ("chat", chat("hi", n=2), InvalidOptionError, "n=1"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, InvalidOptionError, "text content"),
    ("completion", {"prompt": [1, 2]}, InvalidOptionError, "'prompt' must be a string"),
])
def test_bad_requests(kind, body, error, words):
    with pytest.raises(error) as info:
        parse_request(kind, body, RECIPE)
    assert words in info.value.message
    assert "--" not in info.value.message and "--" not in (info.value.hint or "")  # HTTP fields, not CLI flags


def test_base_model_conversation_keeps_a_stable_prefix():
    one = [{"role": "user", "content": "What is 2+2?"}]
    assert render_messages(one, BASE, thinking=False).text == "Question: What is 2+2?\nAnswer:"
    two = one + [{"role": "assistant", "content": " 4"}, {"role": "user", "content": "And 3+3?"}]
    built = render_messages([{"role": "system", "content": "Be brief."}] + two, BASE, thinking=False)
    assert built.text == "Be brief.\nQuestion: What is 2+2?\nAnswer: 4\nQuestion: And 3+3?\nAnswer:"
    assert built.mode == "question-frame" and "\nQuestion:" in built.stops
    # Turn n's prompt minus its answer cue is a prefix of turn n+1's: the prompt cache can reuse it.
    first = render_messages([{"role": "system", "content": "Be brief."}] + one, BASE, thinking=False).text
    assert built.text.startswith(first)


def test_chat_template_gets_the_whole_conversation_and_thinking():
    template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}"
                "{% if enable_thinking %}<think>{% endif %}<assistant>")
    model = ModelText(template, "<bos>", "<eos>")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    built = render_messages(messages, model, thinking=True)
    assert built.text == "<bos><user>a</><assistant>b</><user>c</><think><assistant>"
    assert built.mode == "chat-template" and built.add_bos is False


class WatchedSlots(threading.Semaphore):
    """A backend's slots that say when a request starts waiting for one (a blocking acquire)."""

    def __init__(self, value: int):
        super().__init__(value)
        self.waited_on = threading.Event()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if blocking:
            self.waited_on.set()
        return super().acquire(blocking, timeout)


class FakeBackend:
    def __init__(self, parallel: int):
        self.slots = WatchedSlots(parallel)
        self.state = "ready"


def test_lane_admits_up_to_slots_plus_queue_then_refuses():
    backend = FakeBackend(parallel=1)
    lane = Lane(RECIPE.tier("fast"), backend, bound=1)
    entered, release = threading.Event(), threading.Event()

    def hold():
        with lane.slot(timeout=60):
            entered.set()
            release.wait(60)

    def wait_then_run():
        with lane.slot(timeout=60):
            pass

    holder = threading.Thread(target=hold)
    holder.start()
    assert entered.wait(60)
    waiter = threading.Thread(target=wait_then_run)
    waiter.start()
    # The lane counts a request as waiting before it blocks on the backend's slots.
    assert backend.slots.waited_on.wait(60)
    assert lane.waiting == 1 and lane.saturated
    with pytest.raises(Saturated):
        with lane.slot(timeout=10):
            pass
    release.set()
    for thread in (holder, waiter):
        thread.join(60)
        assert not thread.is_alive()
    assert lane.waiting == 0 and lane.counters.rejected == 1 and lane.counters.requests == 2
    backend.state = "restarting"
    with pytest.raises(Unavailable, match="restarting"):
        with lane.slot(timeout=1):
            pass


def _gguf(path, kv: list[tuple[str, int, bytes]]) -> None:
    """A GGUF holding only metadata: (key, type, packed value)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, kind, value in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", kind) + value
    path.write_bytes(out)


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def gguf_metadata(path, keys):
    return {key: value for key, value in read_gguf_header(path, tensors=False).metadata.items() if key in keys}


def test_gguf_metadata_skips_arrays_and_reads_the_template(tmp_path):
    path = tmp_path / "m.gguf"
    tokens = struct.pack("<IQ", 8, 3) + b"".join(_string(t) for t in ("<bos>", "a", "b"))
    _gguf(path, [
        ("general.architecture", 8, _string("gemma3")),
        ("tokenizer.ggml.tokens", 9, tokens),
        ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, 1, 2)),
        ("tokenizer.ggml.add_bos_token", 7, b"\x01"),
        ("tokenizer.chat_template", 8, _string("{{ messages }}")),
    ])
    found = gguf_metadata(path, ("tokenizer.chat_template", "tokenizer.ggml.add_bos_token", "missing"))
    assert found == {"tokenizer.chat_template": "{{ messages }}", "tokenizer.ggml.add_bos_token": True}


def test_a_taken_port_fails_before_anything_loads(tmp_path):
    import socket

    from gemmactl.errors import PortInUseError
    from gemmactl.server.service import ServeConfig, Service
    from gemmactl.store import Store

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port} is already in use"):
            Service(ServeConfig(recipe=RECIPE, port=port), Store(tmp_path)).start()
    assert not (tmp_path / "models").exists()  # the embedded model was not even assembled


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_llama_server_command_carries_flash_attn(tmp_path, mode):
    from gemmactl.llamacpp.server import LlamaServer
    from gemmactl.server.backends import ServerBackend

    server = LlamaServer(tmp_path / "llama-server", "m.gguf", threads=2, context=512, parallel=4, log_dir=tmp_path,
                         flash_attn=mode)
    command = server.command
    assert command[command.index("-fa") + 1] == mode and command.count("-fa") == 1
    assert "--swa-full" in command and "--no-kv-unified" in command
    # The serve backend passes its tiers' setting on; nothing starts until start().
    backend = ServerBackend(tmp_path / "llama-server", tmp_path / "m.gguf", tiers=["fast"], context=512, parallel=4,
                            threads=2, log_dir=tmp_path, flash_attn=mode)
    assert backend.info.command[backend.info.command.index("-fa") + 1] == mode and backend.pid is None


def test_llama_server_flash_attn_defaults_to_off_and_refuses_other_values(tmp_path):
    from gemmactl.llamacpp.server import LlamaServer

    command = LlamaServer(tmp_path / "llama-server", "m.gguf", threads=2, context=512, log_dir=tmp_path).command
    assert command[command.index("-fa") + 1] == "off"
    with pytest.raises(ValueError, match="flash_attn must be one of off, on, auto"):
        LlamaServer(tmp_path / "llama-server", "m.gguf", threads=2, context=512, log_dir=tmp_path, flash_attn="yes")


@pytest.mark.real_model
def test_tiers_with_other_server_settings_get_their_own_server(built_home):
    from gemmactl.server.service import plan_backends
    from gemmactl.store import Store

    recipe = parse_recipe("tiers:\n  fast:\n    model: embedded\n  deep:\n    model: embedded\n"
                          "  bulk:\n    model: embedded\n    flash_attn: on\n"
                          "  batch:\n    model: embedded\n    flash_attn: on\n    backend_sampling: true\n")
    plans, unavailable, _ = plan_backends(recipe, Store(built_home), speculative=True, require_build=True)
    assert not unavailable
    assert sorted((p.tiers, p.flash_attn, p.backend_sampling) for p in plans) == [
        (["batch"], "on", True), (["bulk"], "on", False), (["fast", "deep"], "off", False)]


def test_greedy_sampling_fields_turn_the_filters_into_their_cheapest_no_ops(tmp_path):
    from gemmactl.llamacpp.server import LlamaServer, sampling_fields

    cpu = sampling_fields(0.0, 64, 0.9, 0.05, 1.1)
    backend = sampling_fields(0.0, 64, 0.9, 0.05, 1.1, on_backend=True)
    # One candidate on the CPU; the argmax of the temperature-0 step on the backend (no sort).
    assert cpu["top_k"] == 1 and backend["top_k"] == 0
    for fields in (cpu, backend):
        assert fields["temperature"] == 0 and fields["repeat_penalty"] == 1.1
        assert (fields["top_p"], fields["min_p"], fields["typical_p"], fields["xtc_probability"]) == (1.0, 0.0, 1.0, 0.0)
    # Sampling with a temperature keeps every filter as asked.
    assert sampling_fields(0.7, 64, 0.9, 0.05, 1.1, on_backend=True) == {
        "temperature": 0.7, "top_k": 64, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1}
    plain = LlamaServer(tmp_path / "llama-server", "m.gguf", threads=2, context=512, log_dir=tmp_path)
    on_gpu = LlamaServer(tmp_path / "llama-server", "m.gguf", threads=2, context=512, log_dir=tmp_path,
                         extra_args=("--backend-sampling",))
    assert not plain.samples_on_backend and on_gpu.samples_on_backend
    assert on_gpu.sampling_fields(0, 40, 0.95, 0.0, 1.0)["top_k"] == 0
