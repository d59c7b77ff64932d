"""What an int4-stream artifact holds: totals, compression against bf16, and one row per layer."""

from __future__ import annotations


def summarize(artifact) -> dict:
    """Sizes of an opened Int4Artifact: totals, compression vs bf16, and one row per layer."""
    rows: dict[str, dict] = {}
    for record in artifact.records:
        key = "global" if record.layer is None else str(record.layer)
        row = rows.setdefault(
            key, {"layer": record.layer, "tensors": set(), "experts": set(), "params": 0, "stored_bytes": 0, "schemes": {}}
        )
        row["tensors"].add(record.name)
        if record.expert is not None:
            row["experts"].add(record.expert)
        row["params"] += record.numel
        row["stored_bytes"] += record.nbytes
        row["schemes"][record.scheme] = row["schemes"].get(record.scheme, 0) + 1
    layers = []
    for row in rows.values():
        bf16 = row["params"] * 2
        layers.append(
            {
                "layer": row["layer"],
                "tensors": len(row["tensors"]),
                "experts": len(row["experts"]),
                "params": row["params"],
                "stored_bytes": row["stored_bytes"],
                "bf16_bytes": bf16,
                "compression": bf16 / row["stored_bytes"] if row["stored_bytes"] else None,
                "schemes": row["schemes"],
            }
        )
    layers.sort(key=lambda row: -1 if row["layer"] is None else row["layer"])
    params = sum(row["params"] for row in layers)
    files = sum(artifact.shards.values())
    index = artifact.index
    return {
        "path": str(artifact.path),
        "format": index["format"],
        "version": index["version"],
        "source": index.get("source", {}),
        "model_type": artifact.config.get("model_type"),
        "scheme": artifact.scheme,
        "shards": len(artifact.shards),
        "tensors": len(artifact.tensor_names()),
        "records": len(artifact.records),
        "params": params,
        "size_bytes": files,
        "bf16_bytes": params * 2,
        "compression": params * 2 / files if files else None,
        "bits_per_param": files * 8 / params if params else None,
        "layers": layers,
    }
