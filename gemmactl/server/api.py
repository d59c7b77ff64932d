"""The OpenAI-compatible request and response shapes: body → routed request, events → JSON chunks.

The tier comes from `model` when it names one; otherwise (`auto`, the recipe's name, nothing)
the last user message's prefix or the heuristic picks it, exactly as `gemmactl run` does, and
the prefix is removed from what the model sees.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

from gemmactl.errors import EmptyPromptError, InvalidOptionError, UnknownTierError
from gemmactl.generate import make_request, route_prompt
from gemmactl.recipes import Recipe
from gemmactl.router import Route
from gemmactl.runtime.base import GenerationRequest

AUTO_MODELS = ("", "auto", "gemmactl", "default")
SEPARATE_REASONING = ("separate", "deepseek", "parsed", "auto")
ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class Routed:
    """A parsed request: which tier, the job for its backend, and how to answer."""

    kind: str  # "chat" or "completion"
    tier: str
    route: Route
    request: GenerationRequest  # the conversation (or raw prompt), sampling, stops; `whole` unless streamed
    stream: bool
    include_usage: bool
    reasoning: bool  # return thinking as reasoning_content instead of dropping it
    id: str
    created: int


def parse_request(kind: str, body: object, recipe: Recipe) -> Routed:
    """Validate an OpenAI body for /v1/chat/completions ("chat") or /v1/completions ("completion")."""
    if not isinstance(body, dict):
        raise InvalidOptionError("the request body must be a JSON object")
    tiers = list(recipe.tiers)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidOptionError("'model' must be a string")
    override = None
    if model and model in recipe.tiers:
        override = model
    elif (model or "") not in AUTO_MODELS and model != recipe.name:
        raise UnknownTierError(
            f"no model '{model}': this server's models are its tiers ({', '.join(tiers)}) or 'auto'",
            hint="List them with GET /v1/models.",
        )
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
        # Refused rather than ignored: a client that sends tools expects calls, not prose.
        raise InvalidOptionError("tool calling is not supported by this server ('tools', 'functions', 'tool_choice')",
                                 hint="Send the request without tools.")
    messages = None
    if kind == "chat":
        messages = normalize_messages(body.get("messages"))
        index = last_user_index(messages)
        chosen = _route(messages[index]["content"], recipe, override)
        messages[index] = dict(messages[index], content=chosen.prompt)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidOptionError("'prompt' must be a string (token lists and batches are not supported)")
        chosen = _route(prompt, recipe, override)
    tier = recipe.tier(chosen.tier)
    n = body.get("n", 1)
    if n != 1:
        raise InvalidOptionError("only n=1 is supported")
    stream_options = body.get("stream_options") or {}
    stream = bool(body.get("stream", False))
    request = make_request(
        chosen, tier, thinking=_thinking(body), **_sampling(body),
        messages=tuple(messages) if messages is not None else None, raw=messages is None,
        stops=_stops(body.get("stop")), whole=not stream,
    )
    return Routed(
        kind=kind, tier=tier.name, route=chosen, request=request,
        stream=stream,
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        reasoning=body.get("reasoning_format") in SEPARATE_REASONING or body.get("include_reasoning") is True,
        id=("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24],
        created=int(time.time()),
    )


def _route(text: str, recipe: Recipe, override: str | None) -> Route:
    """route_prompt, with an empty prompt answered in this API's words."""
    try:
        return route_prompt(text, recipe, tier=override)
    except EmptyPromptError as exc:
        raise InvalidOptionError(exc.message) from None  # without the CLI's hint


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


def _number(body: dict, key: str, *, integer: bool = False, low: float | None = None, high: float | None = None):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise InvalidOptionError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise InvalidOptionError(f"'{key}' must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidOptionError(f"'{key}' is out of range: {value}")
    return value


def _sampling(body: dict) -> dict:
    """The body's sampling fields, checked in its own words (None: the tier's)."""
    max_tokens = _number(body, "max_completion_tokens", integer=True, low=1) or _number(body, "max_tokens", integer=True, low=1)
    repeat = _number(body, "repeat_penalty", low=0)
    return {
        "max_tokens": max_tokens,
        "temperature": _number(body, "temperature", low=0),
        "top_k": _number(body, "top_k", integer=True, low=0),
        "top_p": _number(body, "top_p", low=0, high=1),
        "min_p": _number(body, "min_p", low=0, high=1),
        "repeat_penalty": repeat if repeat else _number(body, "repetition_penalty", low=0),
        "seed": _number(body, "seed", integer=True),
    }


def _thinking(body: dict) -> bool | None:
    thinking = body.get("thinking")
    kwargs = body.get("chat_template_kwargs")
    if thinking is None and isinstance(kwargs, dict):
        thinking = kwargs.get("enable_thinking")
    return None if thinking is None else bool(thinking)


def _stops(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return tuple(s for s in stop if s)
    raise InvalidOptionError("'stop' must be a string or a list of up to 16 strings")


# -- responses -----------------------------------------------------------------------------------


def finish_reason(stats) -> str:
    return "length" if stats is not None and stats.stop_reason == "length" else "stop"


def usage(stats) -> dict:
    prompt = stats.prompt_tokens if stats else 0
    generated = stats.generated_tokens if stats else 0
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def extension(r: Routed, stats, counters: dict | None, empty: bool = False) -> dict:
    """gemmactl's own fields in a response: routing, the request's timings, and why it stopped
    (and, for an answer that came out empty, why in words)."""
    data = {"tier": r.tier, "route": r.route.reason}
    if stats is not None:
        data.update({"ttft_s": round(stats.ttft_s, 4), "wall_s": round(stats.wall_s, 4),
                     "decode_tok_s": _rounded(stats.decode_tok_s), "stop_reason": stats.stop_reason,
                     "stop_string": stats.stop_string})
        if empty:
            data["empty_answer"] = stats.why_empty()
    if counters:
        data.update(counters)
    return data


def _rounded(rate: float | None) -> float | None:
    return None if rate is None else round(rate, 2)


def full_response(r: Routed, answer: str, thinking: str, stats, counters: dict | None) -> dict:
    if r.kind == "chat":
        message = {"role": "assistant", "content": answer.strip()}
        if r.reasoning and thinking:
            message["reasoning_content"] = thinking.strip()
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(stats), "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": answer, "finish_reason": finish_reason(stats), "logprobs": None}
        obj = "text_completion"
    return {"id": r.id, "object": obj, "created": r.created, "model": r.tier, "choices": [choice],
            "usage": usage(stats), "gemmactl": extension(r, stats, counters, empty=not answer.strip())}


def chunk(r: Routed, *, text: str | None = None, channel: str = "answer", first: bool = False,
          finish: str | None = None) -> dict:
    """One streamed chunk: the role, a piece of answer or reasoning, or the finish reason."""
    if r.kind == "chat":
        delta: dict = {}
        if first:
            delta = {"role": "assistant", "content": ""}
        elif text is not None:
            delta = {"reasoning_content" if channel == "thinking" else "content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj = "text_completion"
    return {"id": r.id, "object": obj, "created": r.created, "model": r.tier, "choices": [choice]}


def usage_chunk(r: Routed, stats, counters: dict | None, empty: bool = False) -> dict:
    obj = "chat.completion.chunk" if r.kind == "chat" else "text_completion"
    return {"id": r.id, "object": obj, "created": r.created, "model": r.tier, "choices": [],
            "usage": usage(stats), "gemmactl": extension(r, stats, counters, empty)}


def error_body(message: str, kind: str, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}
