"""model.assistant_lora: an assistant ("training adapter") LoRA merged into the frozen base at load.

Distilled bases (Z-Image Turbo, Krea 2 Turbo, FLUX.2 klein distilled) lose their distillation under plain LoRA
training; an assistant LoRA, merged into the base while training, absorbs that drift so that the trained LoRA,
used on the distilled base without the assistant, keeps the few-step behaviour.

Where it goes: after the transformer is read from disk and before anything else touches it — before
base_precision's fp8 quantises the frozen linears (so the merged weights are what get quantised) and before
lorad's own adapter is added (engine/families/image/flow_lora.py). bitsandbytes (nf4, int8) quantises while
reading the files, before any merge could happen: that pairing is refused at submit (engine/config/model.py).

How: the family's own pipeline class (model_index.json's `_class_name`) reads the file with its
`lora_state_dict` (which converts kohya, ComfyUI and ai-toolkit names into diffusers'), every module it names is
checked against the transformer (the module exists, the factors' shapes fit its weight), then its
`load_lora_into_transformer` adds it as the peft adapter "assistant", diffusers' `fuse_lora` merges it into the
base weights (W + scale·B·A, peft's merge) and `unload_lora` takes the peft layers away again. What is left is a
plain transformer whose weights are the merged ones: lorad's adapter is added to it as to any base, so no export,
checkpoint or model card can hold the assistant.

Its identity (engine/config/schema.py): a local file's sha256 (assistant_sha256), a hub id's repo id and
model.assistant_lora_revision as written.
"""

from __future__ import annotations

import torch

from engine.config.assistant import KEY, local_file
from engine.errors import JobInvalid

_FACTORS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector", ".lokr_", ".lora_down.", ".lora_up.")


def _pipeline_class(model_path: str, revision: str | None) -> type:
    import diffusers
    from diffusers import DiffusionPipeline

    name = DiffusionPipeline.load_config(model_path, revision=revision).get("_class_name", "")
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "load_lora_into_transformer"):
        raise JobInvalid(f"{KEY}: {name or 'this base'}'s pipeline has no LoRA loader to merge an assistant with")
    return cls


def read_assistant(cls: type, value: str, revision: str | None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(state dict in diffusers' names, diffusers' adapter metadata) of the assistant, through the pipeline's own
    lora_state_dict."""
    p = local_file(value)
    where, kwargs = (str(p.parent), {"weight_name": p.name}) if p is not None else (value, {"revision": revision})
    try:
        sd, meta = cls.lora_state_dict(where, return_lora_metadata=True, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise JobInvalid(f"{KEY}: {value} could not be read as a LoRA: {str(e).splitlines()[0]}") from None
    return sd, meta


def check_fits(transformer: torch.nn.Module, sd: dict[str, torch.Tensor], value: str, display: str) -> None:
    """JobInvalid, in one line naming model.assistant_lora and the first key, unless every tensor of `sd` is a
    factor of a module the transformer has, with shapes that fit its weight."""
    modules = dict(transformer.named_modules())
    if not sd:
        raise JobInvalid(f"{KEY}: {value} holds no LoRA tensors")
    for k, t in sd.items():
        inner = k.removeprefix("transformer.")
        cut = min((i for i in (inner.find(f) for f in _FACTORS) if i > 0), default=-1)
        mod = modules.get(inner[:cut]) if k.startswith("transformer.") and cut > 0 else None
        if mod is None:
            raise JobInvalid(f"{KEY}: {value} does not fit this {display} base: its key {k} names no module "
                             "of the transformer (a LoRA for another model?)")
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2 or t.dim() != 2:
            continue  # conv, LoKr and DoRA factors: peft's own loader checks their shapes
        down, up = ".lora_A." in k or ".lora_down." in k, ".lora_B." in k or ".lora_up." in k
        if (down and t.shape[1] != w.shape[1]) or (up and t.shape[0] != w.shape[0]):
            raise JobInvalid(f"{KEY}: {value} does not fit this {display} base: its key {k} has shape "
                             f"{list(t.shape)}, the base's {inner[:cut]}.weight is {list(w.shape)}")


def merge_assistant(transformer: torch.nn.Module, model_path: str, cfg, log) -> None:
    """Merge model.assistant_lora into `transformer`'s frozen weights and leave no trace of it but the merged
    weights (module docstring)."""
    from engine.registry.families import display

    value = cfg.model.assistant_lora
    cls = _pipeline_class(model_path, cfg.model.revision)
    sd, meta = read_assistant(cls, value, cfg.model.assistant_lora_revision)
    check_fits(transformer, sd, value, display(cfg.model.family))
    cls.load_lora_into_transformer(sd, transformer=transformer, adapter_name="assistant", metadata=meta)
    transformer.fuse_lora(adapter_names=["assistant"])
    transformer.unload_lora()  # peft's merge cast each update to its base weight's dtype
    log.info("assistant_lora", source=value, tensors=len(sd), merged=True)
