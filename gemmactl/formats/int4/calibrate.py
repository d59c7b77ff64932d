"""Activation importance for int4-stream: the mean square of every input a linear layer sees.

A weight w[r, c] multiplies input x[c], so rounding it by e adds e·x[c] to output r; over a
calibration text the expected squared output error of a row is about Σ_c e_c² · E[x_c²].
`collect_importance` measures E[x_c²] for every nn.Linear of the model (the diagonal of what
llama.cpp's imatrix collects), and the quantizer weighs each value's squared error by it.

This loads the whole model once through transformers (in bfloat16), unlike the rest of the
quantizer, which reads one block of rows at a time: calibration is optional for that reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from gemmactl.errors import InvalidOptionError, NotACheckpointError

DEFAULT_TOKENS = 4096
WINDOW = 512  # tokens per forward pass, each window led by BOS


@dataclass(frozen=True)
class Calibration:
    """The text a quantization is calibrated on, as the index records it."""

    path: Path
    sha256: str
    tokens: int  # tokens asked for; the text may hold fewer

    @classmethod
    def from_file(cls, path: Path, tokens: int = DEFAULT_TOKENS) -> Calibration:
        path = Path(path).expanduser()
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidOptionError(f"--calibration {path} is not a readable UTF-8 text file ({exc})") from exc
        if not data.strip():
            raise InvalidOptionError(f"--calibration {path} is empty")
        return cls(path.absolute(), hashlib.sha256(data).hexdigest(), tokens)

    def describe(self) -> dict:
        return {"text": self.path.name, "sha256": self.sha256, "tokens": self.tokens, "window": WINDOW}


def collect_importance(checkpoint_dir: Path, calibration: Calibration) -> dict:
    """{weight name: [C] float32 mean of x² over the calibration tokens} for every nn.Linear."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir)
    except (OSError, ValueError) as exc:
        raise NotACheckpointError(
            f"{checkpoint_dir} has no tokenizer to read the calibration text with ({exc})",
            hint="Calibrate a checkpoint that includes its tokenizer, or quantize without --calibration.",
        ) from exc
    model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.bfloat16).eval()
    ids = tokenizer(calibration.path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: calibration.tokens]
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def record(_module, inputs):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])  # [T, C]
            sums[name] = sums.get(name, 0) + x.square().sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return record

    handles = [
        module.register_forward_pre_hook(hook(f"{name}.weight"))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    body = WINDOW - 1
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    try:
        with torch.inference_mode():
            for start in range(0, max(len(ids), 1), body):
                window = bos + ids[start : start + body]
                if len(window) > len(bos):
                    model(torch.tensor([window]))
    finally:
        for handle in handles:
            handle.remove()
    return {name: (total / counts[name]).contiguous() for name, total in sums.items()}
