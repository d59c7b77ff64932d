"""Chat templates: a model's Jinja2 template rendered in a sandbox."""

from __future__ import annotations

from typing import Any

from gemmactl.errors import BackendError


def render_chat_template(
    template: str,
    messages: list[dict],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
) -> str:
    """Render a GGUF chat template (Jinja2, sandboxed) for the given messages."""
    # Imported here so that commands which never render a template start fast.
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: Any) -> None:
        raise BackendError(f"the model's chat template rejected the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )
    # The template is code from the model file, so any failure inside it is the model's.
    except (TemplateError, TypeError, ValueError, LookupError, ArithmeticError) as exc:
        raise BackendError(f"the model's chat template failed: {exc}") from exc
