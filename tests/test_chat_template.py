"""The chat-template path on a real GGUF: the embedded model re-written with a template in its metadata."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import invoke
from gemmactl.runtime.base import GenerationRequest

pytestmark = pytest.mark.real_model

# Gemma's turn format, with a thinking switch the way Gemma 4 templates take it (enable_thinking).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
    "{% if loop.first and enable_thinking %}Think step by step first.\n{% endif %}"
    "{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def templated_gguf(embedded_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("templated") / "gemma3-270m-chat.gguf"
    subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(embedded_gguf), str(out), "--chat-template", TEMPLATE, "--force"],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="module")
def backend(templated_gguf):
    from gemmactl.runtime.llamacpp import LlamaCppBackend

    loaded = LlamaCppBackend(str(templated_gguf), context_size=512)
    yield loaded
    loaded.close()


def test_a_model_with_a_chat_template_is_prompted_through_it(backend):
    prepared = backend.prepare(GenerationRequest(prompt="What is the capital of France?"))
    assert prepared.mode == "chat-template"
    assert prepared.text == "<bos><start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"
    llm = backend._llm
    assert prepared.tokens.count(llm.token_bos()) == 1 and prepared.tokens[0] == llm.token_bos()
    # The turn markers became their control tokens, not text pieces.
    start_of_turn = llm.tokenize(b"<start_of_turn>", add_bos=False, special=True)
    assert len(start_of_turn) == 1 and prepared.tokens.count(start_of_turn[0]) == 2
    assert prepared.stops == ()


def test_thinking_switches_the_templates_enable_thinking(backend):
    on = backend.prepare(GenerationRequest(prompt="Why is the sky blue?", thinking=True))
    off = backend.prepare(GenerationRequest(prompt="Why is the sky blue?", thinking=False))
    assert "Think step by step first." in on.text
    assert "Think step by step first." not in off.text


def test_raw_bypasses_the_template(backend):
    assert backend.prepare(GenerationRequest(prompt="Once upon", raw=True)).mode == "completion"


def test_run_uses_the_template_and_think_prefix(model_home, templated_gguf, runner):
    result = invoke(runner, ["run", "--model", str(templated_gguf), "--temperature", "0", "--max-tokens", "8", "--json", "think: Why is the sky blue?"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["stats"]["prompt_mode"] == "chat-template"
    assert payload["route"]["thinking"] is True and payload["tier"] == "deep"
    assert "<end_of_turn>" not in payload["answer"] and "<start_of_turn>" not in payload["answer"]
