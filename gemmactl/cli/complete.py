"""Shell completion of the things only gemmactl knows: store names, tiers, recipes, running servers.

click does the rest (commands, options, files): `eval "$(_GEMMACTL_COMPLETE=bash_source gemmactl)"`
and the zsh and fish equivalents (docs/cli.md). A completion never fails: a broken store or
recipe completes nothing.
"""

from __future__ import annotations

from click.shell_completion import CompletionItem


def _matching(names, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(name) for name in sorted(set(names)) if name.startswith(incomplete)]


def models(ctx, param, incomplete: str) -> list[CompletionItem]:
    """Store names and `embedded`, then files and folders (a path is a model reference too)."""
    try:
        from gemmactl.store import Store

        names = [artifact.name for artifact in Store().list()] + ["embedded"]
    except Exception:  # noqa: BLE001 - completion must not fail
        names = ["embedded"]
    return _matching(names, incomplete) + [CompletionItem(incomplete, type="file")]


def store_names(ctx, param, incomplete: str) -> list[CompletionItem]:
    """Entries of the store (what `gemmactl rm` takes)."""
    try:
        from gemmactl.store import Store

        return _matching([artifact.name for artifact in Store().list()], incomplete)
    except Exception:  # noqa: BLE001
        return []


def recipes(ctx, param, incomplete: str) -> list[CompletionItem]:
    """Built-in recipe names, then recipe files."""
    try:
        from gemmactl.recipes import builtin_recipe_names

        names = builtin_recipe_names()
    except Exception:  # noqa: BLE001
        names = []
    return _matching(names, incomplete) + [CompletionItem(incomplete, type="file")]


def tiers(ctx, param, incomplete: str) -> list[CompletionItem]:
    """The tiers of the recipe on the command line (or the default recipe)."""
    try:
        from gemmactl.recipes import resolve_recipe

        return _matching(resolve_recipe(ctx.params.get("recipe")).tiers, incomplete)
    except Exception:  # noqa: BLE001
        return []


def servers(ctx, param, incomplete: str) -> list[CompletionItem]:
    """Running servers, by pid."""
    try:
        from gemmactl.server.registry import running_servers
        from gemmactl.store import Store

        live, _ = running_servers(Store())
        return [CompletionItem(str(s["pid"]), help=s.get("url")) for s in live if str(s["pid"]).startswith(incomplete)]
    except Exception:  # noqa: BLE001
        return []
