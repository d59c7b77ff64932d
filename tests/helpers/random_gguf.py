"""A random GGUF of a checkpoint's shapes, written directly as quantized blocks: no weights read.

Run by random_gemma.write_random_gguf with a llama.cpp source tree on sys.path (its `conversion`
package and its own gguf-py), so the metadata and tensor names are exactly what that tree's
converter writes for the model. The converter runs lazily over the checkpoint's safetensors
headers (the weights it would read are never touched: the files may be sparse), then every tensor
it would write goes out as random blocks instead:

- matrices as Q4_K (Q5_0 where a row is not a whole number of 256-value blocks, as llama-quantize
  falls back), with scales that give values of about transformers' initial spread (0.02);
- vectors (norms, scalars) as float32 ones, as transformers initialises them.

    python random_gguf.py SOURCE_TREE CHECKPOINT_DIR OUT.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

QK_K, QK5_0 = 256, 32


def _q4_k_blocks(rng, blocks: int):
    """Q4_K blocks of 144 bytes: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of codes."""
    import numpy as np

    data = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    # value = d·scale·q − dmin·min with scale, min in 0..63 and q in 0..15: about ±0.035.
    data[:, 0:2] = np.frombuffer(np.float16(0.0693 / (63 * 15)).tobytes(), dtype=np.uint8)
    data[:, 2:4] = np.frombuffer(np.float16(0.0346 / 63).tobytes(), dtype=np.uint8)
    return data


def _q5_0_blocks(rng, blocks: int):
    """Q5_0 blocks of 22 bytes: d (fp16), 4 bytes of high bits, 16 of low nibbles; value = d·(q − 16)."""
    import numpy as np

    data = rng.integers(0, 256, size=(blocks, 22), dtype=np.uint8)
    data[:, 0:2] = np.frombuffer(np.float16(0.0693 / 32).tobytes(), dtype=np.uint8)
    return data


def main() -> None:
    source_tree, checkpoint, out = map(Path, sys.argv[1:4])
    sys.path[:0] = [str(source_tree / "gguf-py"), str(source_tree)]
    import numpy as np
    import torch

    import gguf
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    with torch.inference_mode():
        hparams = ModelBase.load_hparams(checkpoint, False)
        model_class = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
        model = model_class(checkpoint, gguf.LlamaFileType.MOSTLY_BF16, out)
        model.prepare_tensors()  # lazy: names, shapes and types only
        model.prepare_metadata(vocab_only=False)
    source = model.gguf_writer
    kv = dict(source.kv_data[0])
    kv[gguf.Keys.General.FILE_TYPE] = gguf.GGUFValue(int(gguf.LlamaFileType.MOSTLY_Q4_K_M), gguf.GGUFValueType.UINT32)
    writer = gguf.GGUFWriter(out, arch=kv[gguf.Keys.General.ARCHITECTURE].value)
    writer.kv_data[0].update(kv)
    F32 = gguf.GGMLQuantizationType.F32
    blocks = {gguf.GGMLQuantizationType.Q4_K: (QK_K, 144, _q4_k_blocks),
              gguf.GGMLQuantizationType.Q5_0: (QK5_0, 22, _q5_0_blocks)}
    plan = []
    for name, info in source.tensors[0].items():
        shape = [int(d) for d in info.shape]  # numpy order: the row is the last
        row = shape[-1]
        if len(shape) == 1 or row % QK5_0:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)), raw_dtype=F32)
            plan.append((name, shape, F32))
            continue
        kind = gguf.GGMLQuantizationType.Q4_K if row % QK_K == 0 else gguf.GGMLQuantizationType.Q5_0
        per_block, size, _ = blocks[kind]
        byte_shape = [*shape[:-1], row // per_block * size]
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=kind)
        plan.append((name, byte_shape, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, kind in plan:
        if kind == F32:
            values = np.ones(shape, dtype=np.float32) if len(shape) == 1 else \
                rng.uniform(-0.0346, 0.0346, size=shape).astype(np.float32)
            writer.write_tensor_data(values)
            continue
        _, size, make = blocks[kind]
        writer.write_tensor_data(make(rng, int(np.prod(shape)) // size).reshape(shape))
    writer.close()
    print(f"{out}: {len(plan)} tensors", file=sys.stderr)


if __name__ == "__main__":
    main()
