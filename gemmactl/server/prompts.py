"""OpenAI messages → the prompt text a tier's model gets, built the same way `run` builds it.

A model with a chat template gets the whole conversation through it. A base model (no template,
like the embedded Gemma 3 270M) gets the question frame `run` uses; earlier turns become
`Question:`/`Answer:` pairs above the last question, so a growing conversation keeps a stable
prefix that the server's prompt cache can reuse.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gemmactl.chat import render_chat_template
from gemmactl.errors import InvalidOptionError
from gemmactl.formats import GGUF_MAGIC
from gemmactl.prompting import QUESTION_STOPS, PromptText, build_prompt_text

ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ModelText:
    """What prompt building needs to know about a model: its template and special token texts."""

    chat_template: str | None
    bos_token: str
    eos_token: str


def message_text(message: dict) -> str:
    """The text of an OpenAI message: a string, or the text parts of a content list."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise InvalidOptionError("only text content is supported (no images or audio in messages)")
        return "".join(parts)
    raise InvalidOptionError("message content must be a string or a list of text parts")


def normalize_messages(messages: object) -> list[dict]:
    """Validate OpenAI chat messages into [{"role", "content"}] with text content."""
    if not isinstance(messages, list) or not messages:
        raise InvalidOptionError("'messages' must be a non-empty list")
    result = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise InvalidOptionError(f"messages[{index}] needs a role: one of {', '.join(ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        result.append({"role": role, "content": message_text(message)})
    if not any(m["role"] == "user" for m in result):
        raise InvalidOptionError("'messages' must hold at least one user message")
    return result


def last_user_index(messages: list[dict]) -> int:
    return max(i for i, m in enumerate(messages) if m["role"] == "user")


def render_messages(messages: list[dict], model: ModelText, *, thinking: bool) -> PromptText:
    """The prompt for a chat: the model's template, or the question frame for a base model."""
    if model.chat_template:
        text = render_chat_template(
            model.chat_template, messages, bos_token=model.bos_token, eos_token=model.eos_token,
            add_generation_prompt=True, enable_thinking=thinking,
        )
        # Templates that write the BOS token themselves must not get a second one.
        return PromptText(text, "chat-template", (), add_bos=not text.startswith(model.bos_token))
    system = "\n".join(m["content"].strip() for m in messages if m["role"] == "system" and m["content"].strip())
    turns = [m for m in messages if m["role"] != "system"]
    last = max(i for i, m in enumerate(turns) if m["role"] == "user")
    if last == 0 and not system:
        # A single question: exactly what `gemmactl run` sends.
        return build_prompt_text(turns[0]["content"], chat_template=None, bos_token=model.bos_token,
                                 eos_token=model.eos_token)
    lines = [system] if system else []
    for message in turns[:last]:
        label = "Question" if message["role"] == "user" else "Answer"
        lines.append(f"{label}: {message['content'].strip()}")
    lines.append(f"Question: {turns[last]['content'].strip()}\nAnswer:")
    return PromptText("\n".join(lines), "question-frame", QUESTION_STOPS, add_bos=True)


def completion_prompt(prompt: str) -> PromptText:
    """/v1/completions: the text is continued as it is."""
    return PromptText(prompt, "completion", (), add_bos=True)


# -- GGUF metadata -------------------------------------------------------------------------------

# GGUF value types → struct format of a scalar (strings and arrays are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path, keys: tuple[str, ...]) -> dict[str, object]:
    """The values of the given metadata keys of a GGUF file (tensor data is never read).

    llama-server reports a fallback template for a model that has none, so whether a model has
    its own chat template has to come from the file.
    """
    wanted = set(keys)
    found: dict[str, object] = {}
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != GGUF_MAGIC:
            raise InvalidOptionError(f"{path} is not a GGUF file")
        (n_kv,) = struct.unpack_from("<Q", data, 16)
        offset = 24

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", data, at)
            return data[at + 8 : at + 8 + length].decode("utf-8", errors="replace"), at + 8 + length

        def value(kind: int, at: int, keep: bool) -> tuple[object, int]:
            if kind == _STRING:
                if keep:
                    return string(at)
                (length,) = struct.unpack_from("<Q", data, at)
                return None, at + 8 + length
            if kind == _ARRAY:
                item_kind, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if item_kind in _SCALARS:  # fixed size: skip in one step
                    size = struct.calcsize("<" + _SCALARS[item_kind])
                    return None, at + size * count
                for _ in range(count):
                    _, at = value(item_kind, at, False)
                return None, at
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)

        for _ in range(n_kv):
            key, offset = string(offset)
            (kind,) = struct.unpack_from("<I", data, offset)
            item, offset = value(kind, offset + 4, key in wanted)
            if key in wanted:
                found[key] = item
                if len(found) == len(wanted):
                    break
    return found


def model_text_from_gguf(path: Path, bos_token: str, eos_token: str) -> ModelText:
    """The chat template stored in the GGUF (None when it has none) with the server's special texts."""
    template = gguf_metadata(path, ("tokenizer.chat_template",)).get("tokenizer.chat_template")
    return ModelText(str(template) if template else None, bos_token, eos_token)
