"""`gemmactl pull`: download a model from the Hugging Face hub into the HF cache, verified and resumable."""

from __future__ import annotations

import click

from gemmactl.cli.output import emit_json, progress_enabled, table
from gemmactl.sizes import format_size


@click.command("pull")
@click.argument("repo_id")
@click.option("--revision", metavar="REV", help="Branch, tag or commit sha to pull (default: main).")
@click.option("--include", multiple=True, metavar="GLOB", help="Also take the files matching GLOB (repeatable).")
@click.option("--exclude", multiple=True, metavar="GLOB", help="Leave out the files matching GLOB (repeatable).")
@click.option("--quant", metavar="TYPE", help="GGUF repos: the quantization to take, e.g. Q8_0 (default: Q4_K_M).")
@click.option("--token", metavar="TOKEN", help="Hub access token (default: $HF_TOKEN, else the saved `hf auth login`).")
@click.option("--dry-run", is_flag=True, help="List the files, their sizes and the total; download nothing.")
@click.option("--offline", is_flag=True, help="Use only the local cache (as HF_HUB_OFFLINE=1 does); name any missing file.")
@click.option("--verify", is_flag=True, help="Re-check the checksums of an existing pull; download nothing.")
@click.option("--json", "json_mode", is_flag=True, help="Print the result as JSON, without progress bars.")
def pull_cmd(repo_id, revision, include, exclude, quant, token, dry_run, offline, verify, json_mode):
    """Download a model from the Hugging Face hub, verified and resumable.

    REPO_ID is OWNER/NAME; OWNER/NAME:QUANT or hf.co/OWNER/NAME:QUANT (as Ollama writes it)
    also names a GGUF repo's quantization. Files go to the standard Hugging Face cache
    ($HF_HOME/hub). A safetensors repo gives its weights, configs and tokenizer; a GGUF repo gives
    the --quant file and its shards. Every
    file's checksum is checked before the pull is registered in the store; a rerun after an
    interruption continues where it stopped.

    \b
    Examples:
      gemmactl pull google/gemma-4-E2B-it --dry-run
      gemmactl pull unsloth/gemma-4-E2B-it-GGUF --quant Q8_0
      gemmactl pull hf.co/unsloth/gemma-4-E2B-it-GGUF:Q8_0
      gemmactl pull google/gemma-4-E2B-it --offline
    """
    from gemmactl.hub.pull import plan_pull, pull, verify_pull

    if dry_run and verify:
        raise click.UsageError("--dry-run and --verify do not go together")
    plan = plan_pull(
        repo_id,
        revision=revision,
        include=include,
        exclude=exclude,
        quant=quant,
        token=token,
        offline=offline,
        prefer_cache=verify,
    )
    if dry_run:
        _dry_run(plan, json_mode)
    elif verify:
        checked = verify_pull(plan)
        if json_mode:
            emit_json({**_describe(plan), "verified": [f.name for f in checked]})
        else:
            click.echo(
                f"Verified {len(checked)} files of {plan.repo_id} at {plan.commit[:12]} "
                f"({format_size(plan.total)}): every checksum matches."
            )
    else:
        result = pull(plan, token=token, progress=progress_enabled(json_mode))
        if json_mode:
            files = [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in plan.files]
            emit_json({**_describe(plan), "name": result.artifact.name, "path": result.artifact.path,
                       "files": files, "downloaded": result.downloaded, "verified": True})
        else:
            click.echo(
                f"Pulled {plan.repo_id} at {plan.commit[:12]}: {len(plan.files)} files, {format_size(plan.total)} "
                f"(downloaded {format_size(result.downloaded)}), checksums verified."
            )
            click.echo(f"Store name: {result.artifact.name}")
            click.echo(f"Path: {result.artifact.path}")


def _dry_run(plan, json_mode: bool) -> None:
    """Show what a pull would take; refuse (after showing it) when the disk lacks room."""
    from gemmactl.hub.pull import check_disk_space, file_states, free_bytes, missing_bytes

    states = file_states(plan)
    needed, free = missing_bytes(states), free_bytes(plan.cache.cache_dir)
    if json_mode:
        files = [
            {"name": s.file.name, "size": s.file.size, "sha256": s.file.sha256, "cached": s.complete, "present": s.present}
            for s in states
        ]
        emit_json({**_describe(plan), "files": files, "to_download": needed, "free": free, "enough_space": needed <= free})
    else:
        kind = {"safetensors": "safetensors checkpoint", "gguf": f"GGUF {plan.selection.quant}"}.get(
            plan.selection.kind, "files named by --include"
        )
        click.echo(f"{plan.repo_id} at {plan.commit[:12]} ({kind}) into {plan.cache.cache_dir}")
        rows = [[s.file.name, format_size(s.file.size), _cache_state(s)] for s in states]
        click.echo(table(rows, ["FILE", "SIZE", "IN CACHE"]))
        click.echo(
            f"Total {format_size(plan.total)} in {len(states)} files; to download {format_size(needed)}; "
            f"free {format_size(free)}."
        )
    check_disk_space(plan, states)


def _cache_state(state) -> str:
    if state.complete:
        return "yes"
    if state.present:
        return f"partial ({100 * state.present // max(state.file.size, 1)}%)"
    return "no"


def _describe(plan) -> dict:
    return {
        "repo": plan.repo_id,
        "revision": plan.revision,
        "commit": plan.commit,
        "kind": plan.selection.kind,
        "quant": plan.selection.quant,
        "cache_dir": str(plan.cache.cache_dir),
        "total": plan.total,
        "from_cache": plan.from_cache,
    }
