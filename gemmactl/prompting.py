"""How a user's text becomes a model prompt: chat template, question frame, or raw completion.

Instruction models carry a chat template in their GGUF metadata and are prompted through it.
A base model (like the embedded Gemma 3 270M) has none and only continues text, so a question
is wrapped in a "Question: … Answer:" frame and generation stops where the next question would
start; that frame is what gets a base model to answer instead of rambling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemmactl.chat import render_chat_template

QUESTION_STOPS = ("\nQuestion:", "\nAnswer:", "\n\n")
# A prompt that already ends in an answer cue ("...\nAnswer:") is its own frame.
_ANSWER_CUE = re.compile(r"(?:^|\n)\s*(?:answer|a)\s*:\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class PromptText:
    """The prompt text to tokenize, how it was built, and where generation stops."""

    text: str
    mode: str  # "chat-template", "question-frame" or "completion"
    stops: tuple[str, ...]
    add_bos: bool


def build_prompt_text(
    prompt: str,
    *,
    chat_template: str | None,
    bos_token: str,
    eos_token: str,
    thinking: bool = False,
    raw: bool = False,
    system: str | None = None,
) -> PromptText:
    """Pick the prompt mode for this model and build the text to feed it."""
    if raw:
        return PromptText(prompt, "completion", (), add_bos=True)
    if chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = render_chat_template(
            chat_template,
            messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        # Templates that write the BOS token themselves must not get a second one.
        return PromptText(text, "chat-template", (), add_bos=not text.startswith(bos_token))
    if _ANSWER_CUE.search(prompt):
        return PromptText(prompt, "completion", QUESTION_STOPS, add_bos=True)
    framed = f"Question: {prompt.strip()}\nAnswer:"
    return PromptText(framed, "question-frame", QUESTION_STOPS, add_bos=True)
