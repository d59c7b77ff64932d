"""`gemmactl list` and `gemmactl rm`: what the store holds."""

from __future__ import annotations

import sys

import click

from gemmactl.cli import complete
from gemmactl.cli.output import emit_json, table
from gemmactl.sizes import format_size


@click.command("list")
@click.option("--json", "json_mode", is_flag=True, help="Print the entries as a JSON array.")
def list_cmd(json_mode: bool) -> None:
    """List the models and artifacts in the store.

    The store is $GEMMACTL_HOME (default: $XDG_DATA_HOME/gemmactl)."""
    from gemmactl.store import Store

    store = Store()
    artifacts = store.list()
    if json_mode:
        emit_json([artifact.to_dict() for artifact in artifacts])
        return
    if not artifacts:
        click.echo(f"The store at {store.home} is empty. `gemmactl run` adds the embedded model on first use.")
        return
    rows = [
        [a.name, a.format, format_size(a.size), a.source, (a.revision or "")[:12], a.created[:19].replace("T", " ")]
        for a in artifacts
    ]
    click.echo(table(rows, ["NAME", "FORMAT", "SIZE", "SOURCE", "REVISION", "CREATED"]))


@click.command("rm")
@click.argument("name", shell_complete=complete.store_names)
@click.option("-y", "--yes", is_flag=True, help="Remove without asking.")
@click.option("--purge", is_flag=True, help="Also delete the Hugging Face cache files that only this pull uses.")
@click.option("--json", "json_mode", is_flag=True, help="Print what was removed as JSON.")
def rm_cmd(name: str, yes: bool, purge: bool, json_mode: bool) -> None:
    """Remove a model or artifact from the store.

    Deletes NAME's entry and its files when they live inside the store; files elsewhere stay.
    With --purge, a pulled model's files in the Hugging Face cache go too, except those another
    store entry or another cached snapshot still uses."""
    from gemmactl.errors import ConfirmationRequiredError, StoreEntryNotFoundError
    from gemmactl.store import Store

    store = Store()
    artifact = store.get(name)
    if artifact is None:
        raise StoreEntryNotFoundError(f"no entry named '{name}' in the store")
    if not yes:
        if sys.stdin is None or not sys.stdin.isatty():
            raise ConfirmationRequiredError(
                f"refusing to remove '{name}' without confirmation", hint="Pass --yes to remove it."
            )
        also = " and purge its Hugging Face cache files" if purge else ""
        click.confirm(f"Remove '{name}' ({format_size(artifact.size)}, {artifact.path}){also}?", abort=True)
    removed = store.remove(name)
    purged = None
    if purge:
        from gemmactl.hub.cache import purge_pull

        purged = purge_pull(removed.extra, removed.revision, [(a.revision, a.extra) for a in store.list()])
    if json_mode:
        emit_json({"removed": removed.to_dict(), **({"purged": vars(purged)} if purged else {})})
    else:
        freed = f"; purged {purged.files} cache files ({format_size(purged.bytes)})" if purged else ""
        click.echo(f"Removed {name} ({format_size(removed.size)}){freed}.")
