"""Inference backends, looked up by the name a recipe's tier gives."""

from __future__ import annotations

from importlib import import_module

# name → "module:class"; imported only when a tier needs it (keeps `--help` fast).
BACKENDS = {
    "llamacpp": "gemmactl.runtime.llamacpp:LlamaCppBackend",
    "int4": "gemmactl.runtime.engine.backend:open_int4_backend",
}


def available_backends() -> tuple[str, ...]:
    return tuple(BACKENDS)


def backend_class(name: str):
    """The backend class registered under `name`."""
    module_name, _, attr = BACKENDS[name].partition(":")
    return getattr(import_module(module_name), attr)
