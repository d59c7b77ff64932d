"""An int4-stream artifact as a transformers model: built empty from its config, weights assigned.

`build_model` dequantizes every weight once, on the device the model computes on (the dense
weights the `int4` backend decodes with on a CPU); `runtime/int4_packed.py` builds the same model
with weights that stay packed.
"""

from __future__ import annotations

from gemmactl.errors import BackendError
from gemmactl.formats.int4.spec import HEAD_NAME


def empty_model(artifact, dtype=None):
    """(model, dtype): a transformers causal LM from the artifact's config with its parameters on
    the meta device (no allocation, no random init) and its buffers (rotary tables, embedding
    scales) built for real on the CPU; dtype defaults to the config's."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(artifact.config)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    dtype = dtype or getattr(torch, str(config_dict.get("dtype") or config_dict.get("torch_dtype") or "bfloat16"))
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: random init on meta tensors, slower, same result
        from contextlib import nullcontext as no_init_weights
    with init_empty_weights(include_buffers=False), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # The parameters are loaded next, so their (meta) random init is skipped above; the buffers
    # (rotary tables, embedding scales) still get the model's own init, module by module.
    for module in model.modules():
        if next(module.buffers(recurse=False), None) is not None:
            model._init_weights(module)
    return model, dtype


def build_model(artifact, dtype=None, device="cpu"):
    """A transformers causal LM from the artifact's config, holding its weights dequantized on device.

    Parameters are created on the meta device; each weight is copied packed to the device,
    dequantized there and assigned as the parameter itself.
    """
    model, dtype = empty_model(artifact, dtype)
    state = artifact.state_dict(device=device, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    if HEAD_NAME not in artifact.tensor_names():  # else the artifact's own head (`--head int4`) stays
        model.tie_weights()
    if str(device) != "cpu":
        model.to(device)  # the buffers; the parameters are there already
    return checked(model, artifact, unexpected)


def checked(model, artifact, unexpected):
    """The model in eval mode, once every parameter has a weight and no tensor was left over."""
    still_meta = [name for name, param in model.named_parameters() if param.is_meta]
    if unexpected or still_meta:
        raise BackendError(
            f"{artifact.path} does not fit a {type(model).__name__}: "
            + (f"unexpected tensors {unexpected[:3]}" if unexpected else f"no weights for {still_meta[:3]}"),
            hint="The artifact's config and tensors disagree; make it again with `gemmactl quantize`.",
        )
    return model.eval()
