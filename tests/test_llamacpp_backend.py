"""The llama.cpp backend on the real Gemma 3 270M GGUF."""

from __future__ import annotations

import itertools

import pytest

from gemmactl.runtime.base import GenerationRequest, GenerationStats, stream_generate

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def backend(embedded_gguf):
    from gemmactl.runtime.llamacpp import LlamaCppBackend

    loaded = LlamaCppBackend(str(embedded_gguf), context_size=512)
    yield loaded
    loaded.close()


def test_base_model_has_no_chat_template_and_gets_the_question_frame(backend):
    prepared = backend.prepare(GenerationRequest(prompt="What is the capital of France?"))
    assert backend.chat_template is None
    assert prepared.mode == "question-frame"
    assert prepared.text == "Question: What is the capital of France?\nAnswer:"
    assert prepared.tokens[0] == backend._llm.token_bos()


def test_streamed_pieces_join_to_the_full_detokenization(backend):
    """Per-token text, decoded incrementally, must equal llama-cpp-python's own decoding."""
    request = GenerationRequest(prompt="Les monuments de Paris — été, café, 東京 and", max_tokens=40, temperature=0, raw=True)
    prepared = backend.prepare(request)
    pieces = list(itertools.islice(backend.generate(prepared, request), 40))
    backend._llm.reset()  # the library's own prefix reuse is wrong on Gemma's sliding-window cache
    theirs = backend._llm.create_completion(request.prompt, max_tokens=len(pieces), temperature=0)["choices"][0]["text"]
    assert "".join(pieces) == theirs
    assert len(pieces) == 40


def test_greedy_paris_and_engine_timings(backend):
    events = list(
        stream_generate(backend, GenerationRequest(prompt="Question: What is the capital of France?\nAnswer:", max_tokens=8, temperature=0))
    )
    stats = events[-1]
    assert isinstance(stats, GenerationStats)
    assert "Paris" in "".join(e.text for e in events[:-1])
    assert stats.engine_decode_tok_s and stats.engine_decode_tok_s > 0
    assert stats.decode_tok_s > 0


def test_greedy_matches_raw_llama_cpp_python(backend):
    """Our loop must give the same greedy tokens as llama-cpp-python's own completion API."""
    prompt = "The three primary colors are"
    ours = "".join(
        e.text
        for e in stream_generate(backend, GenerationRequest(prompt=prompt, max_tokens=24, temperature=0, raw=True))
        if not isinstance(e, GenerationStats)
    )
    backend._llm.reset()
    theirs = backend._llm.create_completion(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
    assert ours == theirs


def test_repeated_generations_are_identical(backend):
    """Each generation starts clean: the same greedy request twice gives the same tokens."""
    request = GenerationRequest(prompt="Les monuments de Paris — été, café, 東京 and", max_tokens=30, temperature=0, raw=True)
    outputs = ["".join(backend.generate(backend.prepare(request), request)) for _ in range(3)]
    assert outputs[0] == outputs[1] == outputs[2]


def test_prefix_reuse_in_the_library_is_what_we_avoid(backend):
    """Documents why generate() resets: llama-cpp-python's own prefix reuse changes greedy output."""
    llm = backend._llm
    prompt = "Les monuments de Paris — été, café, 東京 and"
    llm.reset()
    fresh = llm.create_completion(prompt, max_tokens=20, temperature=0)["choices"][0]["text"]
    reused = llm.create_completion(prompt, max_tokens=20, temperature=0)["choices"][0]["text"]
    if fresh == reused:
        pytest.skip("this llama-cpp-python reuses the prefix correctly; the reset is now only a safeguard")
    ours = "".join(
        e.text
        for e in stream_generate(backend, GenerationRequest(prompt=prompt, max_tokens=20, temperature=0, raw=True))
        if not isinstance(e, GenerationStats)
    )
    assert ours == fresh
