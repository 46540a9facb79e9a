"""What the adapter-type tests share: adapters with non-trivial factors, and ComfyUI's LyCORIS rules restated."""

from __future__ import annotations

import torch


def randomise_adapter(model: torch.nn.Module, seed: int = 0) -> None:
    """Zero-initialised factors (LoRA B, LoKr w2, LoHa w2) would make every export trivially right."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


# ComfyUI's rules, restated here to check our files against them (comfy/lora.py model_lora_keys_unet;
# comfy/weight_adapter/lokr.py and loha.py calculate_weight): its LoKr/LoHa loaders read `<key>.<tensor>` for every
# key its LoRA loader maps (FLUX.1 and Chroma: `lycoris_<diffusers module, dots as underscores>`, a row slice of
# the fused BFL weight for q/k/v/mlp; Qwen-Image and Z-Image: `diffusion_model.<diffusers module>`); these are the
# only tensor names they read.
COMFY_LOKR = {"lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2", "alpha"}
COMFY_LOHA = {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2", "alpha"}


def comfy_lycoris_delta(t: dict[str, torch.Tensor], shape) -> torch.Tensor:
    """The weight update ComfyUI adds for one key's LyCORIS tensors (`t`: tensor name -> tensor)."""
    alpha = float(t["alpha"]) if "alpha" in t else None
    if "hada_w1_a" in t:
        scale = alpha / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        return scale * ((t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])).reshape(shape)
    dim = None
    w1 = t.get("lokr_w1")
    if w1 is None:
        dim, w1 = t["lokr_w1_b"].shape[0], t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t.get("lokr_w2")
    if w2 is None:
        dim, w2 = t["lokr_w2_b"].shape[0], t["lokr_w2_a"] @ t["lokr_w2_b"]
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return scale * torch.kron(w1, w2).reshape(shape)
