"""lora.type on every ImageFamily family: DoRA's diffusers file loads back as the trained DoRA, LoKr's and LoHa's
ComfyUI files hold the update ComfyUI's LyCORIS loaders rebuild — or the job is refused, naming lora.type and why.

FLUX.1's own are in tests/engine/training/test_adapter_types.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config.job import parse_job
from engine.config.rules import IMAGE_LORA_TYPES
from engine.errors import JobInvalid
from engine.families import get_family
from engine.families.image.export import DIFFUSERS_FILE
from engine.families.image.flux3 import bfl_name as flux3_name
from engine.families.image.krea2 import comfyui_name as krea2_name
from tests.helpers.images import IMAGE_FAMILIES, make_images
from tests.helpers.lycoris import COMFY_LOHA, COMFY_LOKR, comfy_lycoris_delta, randomise_adapter

# The key ComfyUI maps to a module's weight, per family (its docstring says why).
COMFY_KEY = {"chroma": lambda name: "lycoris_" + name.replace(".", "_"),
             "qwen_image": lambda name: "diffusion_model." + name,
             "z_image": lambda name: "diffusion_model." + name,
             "krea2": lambda name: "diffusion_model." + krea2_name(name),
             "qwen_image_21": lambda name: name,
             "flux3": lambda name: "diffusion_model." + flux3_name(name),
             "hidream": lambda name: "diffusion_model." + name}


def _job(tmp_path, family: str, model, kind: str) -> dict:
    return {"name": "types", "model": {"family": family, "path": str(model), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8, "type": kind},
            "data": {"path": str(make_images(tmp_path / "data", [("a.png", 32, 32, "a")])), "resolution": [32]}}


def _loaded_transformer(model_path, out_dir):
    """The family's own pipeline (no VAE or text encoder) after load_lora_weights of out_dir (FLUX.3's is a modular
    pipeline: diffusers has no other)."""
    from diffusers import DiffusionPipeline, ModularPipeline

    if (model_path / "modular_model_index.json").exists():
        pipe = ModularPipeline.from_pretrained(model_path)
        pipe.load_components(names=["transformer"])
        pipe.load_lora_weights(str(out_dir))
        return pipe.transformer
    parts = DiffusionPipeline.load_config(model_path)
    # The processor stays: Qwen-Image 2.1's pipeline reads its chat template when it is built.
    drop = {k: None for k in parts if k.startswith(("text_encoder", "tokenizer", "vae"))}
    pipe = DiffusionPipeline.from_pretrained(model_path, **drop)
    pipe.load_lora_weights(str(out_dir))
    return pipe.transformer


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_each_lora_type_exports_what_the_loaders_apply_or_is_refused(family, kind, tiny_image_model, tmp_path):
    from engine.families.image.flow_lora import add_lora
    from engine.training.adapters import adapter_layers

    path = tiny_image_model(family)
    d = _job(tmp_path, family, path, kind)
    if kind not in IMAGE_LORA_TYPES.get(family, ("lora",)):
        with pytest.raises(JobInvalid) as e:
            parse_job(d, tmp_path)
        assert all(w in str(e.value) for w in ("lora.type", kind, family, "lora")), str(e.value)
        return
    cfg = parse_job(d, tmp_path)
    fam = get_family(family)
    model = fam.model.transformer_class().from_pretrained(path, subfolder="transformer")
    add_lora(model, cfg, fam.model.default_targets)
    randomise_adapter(model)
    out = tmp_path / "out"
    out.mkdir()
    names = fam.model.export(model, cfg, out, {"steps": 0})
    layers = adapter_layers(model)
    assert layers
    if kind == "dora":  # the diffusers file, loaded by the family's pipeline: every layer as trained
        assert names == [DIFFUSERS_FILE]
        loaded = _loaded_transformer(path, out)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, layer in layers.items():
                twin = loaded.get_submodule(name)
                assert twin.use_dora[next(iter(twin.use_dora))], name
                x = torch.randn(3, layer.in_features, generator=g)
                torch.testing.assert_close(twin(x), layer(x), rtol=1e-5, atol=1e-6)
        return
    (name,) = names  # LoKr, LoHa: the ComfyUI file only
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in load_file(str(out / name)).items():
        key, tensor = k.rsplit(".", 1)
        by_key.setdefault(key, {})[tensor] = v
    assert set(by_key) == {COMFY_KEY[family](n) for n in layers}
    allowed = COMFY_LOHA if kind == "loha" else COMFY_LOKR
    for module, layer in layers.items():
        tensors = by_key[COMFY_KEY[family](module)]
        assert set(tensors) <= allowed, set(tensors) - allowed  # ComfyUI would warn "lora key not loaded"
        want = layer.get_delta_weight("default").detach()
        torch.testing.assert_close(comfy_lycoris_delta(tensors, want.shape), want, rtol=1e-5, atol=1e-6)
