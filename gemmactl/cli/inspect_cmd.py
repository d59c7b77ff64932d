"""`gemmactl inspect`: what an int4-stream artifact holds, and whether its bytes are intact."""

from __future__ import annotations

import click

from gemmactl.cli import complete
from gemmactl.cli.output import byte_progress, emit_json, progress_enabled, table
from gemmactl.sizes import format_size


@click.command("inspect")
@click.argument("artifact", shell_complete=complete.models)
@click.option("--verify", is_flag=True, help="Recompute every checksum; name the shard and tensor of any mismatch (exit 1).")
@click.option("--json", "json_mode", is_flag=True, help="Print the summary as one JSON object.")
def inspect_cmd(artifact, verify, json_mode):
    """Show the size and layers of an int4-stream artifact, and verify it.

    ARTIFACT is a store name or an artifact directory. The table lists each layer's tensors,
    parameters, stored bytes and compression against bf16.
    """
    from gemmactl.errors import ArtifactCorruptError
    from gemmactl.formats.int4.reader import open_artifact
    from gemmactl.formats.int4.summary import summarize
    from gemmactl.store import Store
    from gemmactl.store.refs import ARTIFACTS, resolve_model

    opened = open_artifact(resolve_model(artifact, Store(), accept=ARTIFACTS).path)
    summary = summarize(opened)
    mismatches = None
    if verify:
        with byte_progress("verifying", progress_enabled(json_mode)) as progress:
            mismatches = opened.verify(progress)
        summary["verify"] = {"ok": not mismatches, "mismatches": [m.__dict__ for m in mismatches]}
    if json_mode:
        emit_json(summary)
    else:
        click.echo(_summary_text(summary))
        if mismatches == []:
            click.echo(f"verify: all {summary['records']} checksums match")
    if mismatches:
        first = mismatches[0]
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        raise ArtifactCorruptError(f"{opened.path}: shard {first.shard}, tensor {first.tensor}: {first.reason}{more}")


def _summary_text(s: dict) -> str:
    source = s["source"]
    revision = f"@{source['revision'][:12]}" if source.get("revision") else ""
    scheme = s["scheme"]
    lines = [
        s["path"],
        f"format {s['format']} v{s['version']} · model {s['model_type']} · source {source.get('model', '?')}{revision}",
        f"scheme {scheme.get('name')} ({_policy(scheme)}) · {s['shards']} shard(s) · "
        f"{s['tensors']} tensors in {s['records']} records",
        f"size {format_size(s['size_bytes'])} · bf16 {format_size(s['bf16_bytes'])} · "
        f"{s['compression']:.2f}× smaller · {s['bits_per_param']:.2f} bits/param",
        "",
    ]
    rows = [
        [
            "global" if row["layer"] is None else str(row["layer"]),
            str(row["tensors"]),
            str(row["experts"] or "-"),
            f"{row['params']:,}",
            format_size(row["stored_bytes"]),
            format_size(row["bf16_bytes"]),
            f"{row['compression']:.2f}×" if row["compression"] else "-",
            " ".join(f"{k}:{v}" for k, v in sorted(row["schemes"].items())),
        ]
        for row in s["layers"]
    ]
    lines.append(table(rows, ["LAYER", "TENSORS", "EXPERTS", "PARAMS", "STORED", "BF16", "RATIO", "SCHEMES"]))
    return "\n".join(lines)


def _policy(scheme: dict) -> str:
    """The scheme's policies in words; artifacts written before a policy existed simply lack its key."""
    words = [f"embeddings {scheme.get('embeddings')}"]
    if "sensitive" in scheme:
        words.append(f"sensitive {scheme['sensitive']}")
    if "head" in scheme:
        words.append(f"head {scheme['head']}")
    if "fit" in scheme:
        words.append(f"fit {scheme['fit']}")
    calibration = scheme.get("calibration")
    if calibration:
        words.append(f"calibrated on {calibration.get('text')} ({calibration.get('tokens')} tokens)")
    return ", ".join(words)
