"""`gemmactl run` end to end on the real embedded Gemma 3 270M, and its bad-input paths."""

from __future__ import annotations

import json
import re

import pytest

from conftest import invoke, run_gemmactl
from gemmactl.prompt.build import QUESTION_STOPS

PARIS_PROMPT = "quick: Question: What is the capital of France?\nAnswer:"

pytestmark = pytest.mark.real_model


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def test_run_answers_paris_through_the_console_script(model_home):
    proc = run_gemmactl(["run", "--temperature", "0", "--max-tokens", "8", PARIS_PROMPT])
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Question:" not in proc.stdout  # the question frame's stop string held


def test_plain_question_gets_framed_and_answered(model_home, runner):
    result = invoke(runner, ["run", "--temperature", "0", "--json", "What is the capital of France?"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert "Paris" in payload["answer"]
    assert payload["stats"]["prompt_mode"] == "question-frame"
    # The frame's stop string ends the greedy answer, long before the tier's max_tokens.
    assert payload["stats"]["stop_reason"] == "stop"
    assert payload["stats"]["stop_string"] in QUESTION_STOPS


def test_json_output_has_answer_route_and_stats(model_home, embedded_gguf, runner):
    result = invoke(runner, ["run", "--temperature", "0", "--max-tokens", "8", "--json", PARIS_PROMPT])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["tier"] == "fast"
    assert payload["route"] == {"tier": "fast", "reason": "prefix 'quick:'", "prefix": "quick:", "thinking": False}
    stats = payload["stats"]
    assert 0 < stats["generated_tokens"] <= 8
    assert stats["prompt_tokens"] > 5
    assert stats["ttft_s"] > 0 and stats["wall_s"] >= stats["ttft_s"]
    # Decoding reads every weight of the model (the tied embedding too, for the logits), so the
    # process held at least the GGUF's bytes in memory at its peak.
    assert stats["wall_tok_s"] > 0 and stats["peak_rss_bytes"] >= embedded_gguf.stat().st_size
    assert stats["load_s"] > 0
    assert payload["thinking"] is None


def test_stats_go_to_stderr_with_the_routing_decision(model_home, runner):
    result = invoke(runner, ["run", "--temperature", "0", "--max-tokens", "4", "--stats", "deep: Say hi"])
    assert result.exit_code == 0, result.stderr
    assert "route: tier deep (prefix 'deep:')" in result.stderr
    assert "decode" in result.stderr and "wall" in result.stderr
    assert "route:" not in result.stdout


def test_prompt_from_stdin(model_home):
    proc = run_gemmactl(["run", "--temperature", "0", "--max-tokens", "8"], input=PARIS_PROMPT)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_greedy_is_deterministic_and_seed_repeats(model_home, runner):
    args = ["run", "--max-tokens", "12", "--json", "--raw", "Once upon a time"]
    greedy = [json.loads(invoke(runner, [*args, "--temperature", "0"]).stdout)["answer"] for _ in range(2)]
    assert greedy[0] == greedy[1]
    seeded = [json.loads(invoke(runner, [*args, "--temperature", "1.0", "--seed", "7"]).stdout)["answer"] for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_model_option_takes_a_gguf_path(model_home, embedded_gguf, runner):
    result = invoke(runner, ["run", "--model", str(embedded_gguf), "--temperature", "0", "--max-tokens", "8", PARIS_PROMPT])
    assert result.exit_code == 0, result.stderr
    assert "Paris" in result.stdout


def test_first_run_assembles_the_embedded_model(isolated_home, runner):
    result = invoke(runner, ["run", "--temperature", "0", "--max-tokens", "8", PARIS_PROMPT])
    assert result.exit_code == 0, result.stderr
    assert "Paris" in result.stdout
    listing = json.loads(invoke(runner, ["list", "--json"]).stdout)
    assert [entry["name"] for entry in listing] == ["gemma3-270m"]


# -- bad input: one line, exit 2, no traceback, nothing written ----------------------------------
# (A temperature that is no number: test_bad_input.py; an option value click refuses and an unknown
# command: test_cli.py.)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run", "--tier", "huge", "hello"], "unknown tier 'huge'"),
        (["run", ""], "prompt is empty"),
        (["run", "quick:   "], "empty after the 'quick:' prefix"),
        (["run", "--max-tokens", "-3", "hello"], "--max-tokens"),
        (["run", "--temperature", "-1", "hello"], "--temperature"),
        (["run", "--model", "/no/such/model.gguf", "hello"], "no such model file"),
        (["run", "--model", "not-in-store", "hello"], "no model named 'not-in-store'"),
        (["run", "--recipe", "no-such-recipe", "hello"], "no recipe 'no-such-recipe'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(isolated_home, args, expected):
    proc = run_gemmactl(args)
    assert proc.returncode == 2, proc.stderr
    assert expected in _one_error_line(proc.stderr)
    assert proc.stdout == ""
    assert not isolated_home.exists()


def test_empty_stdin_is_an_empty_prompt(isolated_home):
    proc = run_gemmactl(["run"], input="")
    assert proc.returncode == 2
    assert "prompt is empty" in _one_error_line(proc.stderr)


def test_model_that_is_not_a_gguf(isolated_home, tmp_path):
    fake = tmp_path / "weights.gguf"
    fake.write_text("not a model")
    proc = run_gemmactl(["run", "--model", str(fake), "hello"])
    assert proc.returncode == 2
    assert "is not a GGUF file" in _one_error_line(proc.stderr)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    proc = run_gemmactl(["run", "--model", str(folder), "hello"])
    assert proc.returncode == 2
    assert "is a directory" in _one_error_line(proc.stderr)


def test_prompt_longer_than_the_context_says_the_numbers(model_home, tmp_path):
    recipe = tmp_path / "small.yaml"
    recipe.write_text("tiers:\n  fast:\n    model: embedded\n    context: 128\n")
    proc = run_gemmactl(["run", "--recipe", str(recipe), "--raw", "word " * 400])
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    # llama.cpp rounds the context up to a multiple of 256; the message gives the real size.
    assert re.search(r"the prompt is 4\d\d tokens but the context holds 256", line), line


def test_malformed_recipe_names_field_and_line(isolated_home, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("tiers:\n  fast:\n    model: embedded\n    context: lots\n")
    proc = run_gemmactl(["run", "--recipe", str(recipe), "hello"])
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "tiers.fast.context" in line and "line 4" in line
    assert not isolated_home.exists()


def test_recipe_tier_whose_model_is_not_made_says_which_command_makes_it(isolated_home):
    proc = run_gemmactl(["run", "--recipe", "gemma4-4gb", "quick: hi"])
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert "gemma-4-E2B-it-Q4_K_M" in line
    assert "gemmactl pull google/gemma-4-E2B-it" in line
    assert "gemmactl quantize google/gemma-4-E2B-it --gguf Q4_K_M" in line


def test_recipe_int4_tier_whose_model_is_not_made_says_which_commands_make_it(isolated_home):
    proc = run_gemmactl(["run", "--recipe", "gemma4-4gb", "deep: hi"])
    assert proc.returncode == 1
    line = _one_error_line(proc.stderr)
    assert "gemma-4-E4B-it-int4" in line and "not in the store" in line
    assert "gemmactl pull google/gemma-4-E4B-it" in line
    assert "gemmactl quantize google/gemma-4-E4B-it --int4-stream" in line
    assert not isolated_home.exists()


def test_readme_quickstart_question_answers_paris(model_home):
    proc = run_gemmactl(["run", "quick: What is the capital of France?"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Paris"


def test_prompt_words_are_joined_so_the_prefix_can_stand_alone(model_home, runner):
    result = invoke(runner, ["run", "--json", "--max-tokens", "4", "deep:", "Who wrote Hamlet?"])
    assert result.exit_code == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["tier"] == "deep" and payload["route"]["prefix"] == "deep:"
    assert payload["answer"] and payload["stats"]["prompt_mode"] == "question-frame"


def test_streamed_output_ends_with_a_newline(model_home):
    proc = run_gemmactl(["run", "--max-tokens", "6", "--raw", "Once upon a time"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and proc.stdout.strip()
