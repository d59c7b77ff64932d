"""How messages become a model prompt: chat template, question frame, or raw completion.

`run` passes one user message, `serve` the whole conversation; both come here, so a server sees
exactly the text the in-process path feeds the model.

Instruction models carry a chat template (in their GGUF metadata or tokenizer files) and get
the conversation through it. A base model (like the embedded Gemma 3 270M) has none and only
continues text, so a question is wrapped in a "Question: … Answer:" frame and generation stops
where the next question would start; that frame is what gets a base model to answer instead of
rambling. Earlier turns become `Question:`/`Answer:` pairs above the last question, so a growing
conversation keeps a stable prefix that a server's prompt cache can reuse.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gemmactl.prompt.template import render_chat_template

QUESTION_STOPS = ("\nQuestion:", "\nAnswer:", "\n\n")
# A prompt that already ends in an answer cue ("...\nAnswer:") is its own frame.
_ANSWER_CUE = re.compile(r"(?:^|\n)\s*(?:answer|a)\s*:\s*$", re.IGNORECASE)
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ModelText:
    """What prompt building needs to know about a model: its chat template and special token texts."""

    chat_template: str | None
    bos_token: str
    eos_token: str


@dataclass(frozen=True)
class PromptText:
    """The prompt text to tokenize, how it was built, and where generation stops."""

    text: str
    mode: str  # "chat-template", "question-frame" or "completion"
    stops: tuple[str, ...]
    add_bos: bool

    @property
    def special(self) -> bool:
        """Whether the text's turn markers must become control tokens (only chat-template text)."""
        return self.mode == "chat-template"


def user_messages(prompt: str, system: str | None = None) -> list[dict]:
    """The conversation of a one-shot prompt: an optional system message, then the user's text."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def build_prompt(messages: Sequence[dict], model: ModelText, *, thinking: bool = False, raw: bool = False) -> PromptText:
    """The prompt for a conversation ({"role", "content"} dicts with at least one user message)."""
    if raw:
        # Completion: the last user text is continued as it is.
        return PromptText(_last_user(messages)["content"], "completion", (), add_bos=True)
    if model.chat_template:
        text = render_chat_template(
            model.chat_template, list(messages), bos_token=model.bos_token, eos_token=model.eos_token,
            add_generation_prompt=True, enable_thinking=thinking,
        )
        # Templates that write the BOS token themselves must not get a second one.
        return PromptText(text, "chat-template", (), add_bos=not text.startswith(model.bos_token))
    return _question_frame(messages)


def _question_frame(messages: Sequence[dict]) -> PromptText:
    system = "\n".join(m["content"].strip() for m in messages if m["role"] == "system" and m["content"].strip())
    turns = [m for m in messages if m["role"] != "system"]
    last = max(i for i, m in enumerate(turns) if m["role"] == "user")
    question = turns[last]["content"]
    if last == 0 and not system:
        if _ANSWER_CUE.search(question):
            return PromptText(question, "completion", QUESTION_STOPS, add_bos=True)
        return PromptText(f"Question: {question.strip()}\nAnswer:", "question-frame", QUESTION_STOPS, add_bos=True)
    lines = [system] if system else []
    for message in turns[:last]:
        label = "Question" if message["role"] == "user" else "Answer"
        lines.append(f"{label}: {message['content'].strip()}")
    lines.append(f"Question: {question.strip()}\nAnswer:")
    return PromptText("\n".join(lines), "question-frame", QUESTION_STOPS, add_bos=True)


def _last_user(messages: Sequence[dict]) -> dict:
    return next(m for m in reversed(messages) if m["role"] == "user")
