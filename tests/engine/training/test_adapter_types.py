"""lora.type through peft: LoRA, DoRA, LoKr, LoHa train, export where each is loaded, and are refused where a
format cannot hold them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config.job import load_job
from engine.errors import JobInvalid
from engine.families.image.flux_export import COMFYUI_FILE, DIFFUSERS_FILE, bfl_target
from tests.helpers import images as fh
from tests.helpers.fakes import RecLog
from tests.helpers.jobs import tiny_job
from tests.helpers.lycoris import COMFY_LOHA, COMFY_LOKR, comfy_lycoris_delta, randomise_adapter

tiny_flux = fh.tiny_flux  # shared session fixture
TYPES = ["lora", "dora", "lokr", "loha"]


# ----------------------------------------------------------------- causal LM: the peft adapter
@pytest.mark.parametrize("kind", TYPES)
def test_each_type_exports_a_peft_adapter_that_from_pretrained_reproduces(kind, micro_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.families.causal_lm import CausalLM

    cfg = tiny_job(micro_model, tmp_path, lora={"type": kind, "dropout": 0.0, "rank": 4})
    family = CausalLM()
    model = family.load_model(cfg, tmp_path, torch.device("cpu"), RecLog())
    randomise_adapter(model)
    out = tmp_path / "out"
    out.mkdir()
    assert "adapter_model.safetensors" in family.export(model, cfg, out, {"steps": 0})
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)
        plain = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, out).eval()
        got = loaded(input_ids=ids).logits
    assert not torch.allclose(plain, want, atol=1e-4), "the adapter changes nothing; the test would prove nothing"
    assert type(loaded.peft_config["default"]).__name__ == {"lora": "LoraConfig", "dora": "LoraConfig",
                                                            "lokr": "LoKrConfig", "loha": "LoHaConfig"}[kind]
    assert loaded.peft_config["default"].use_dora == (kind == "dora") if kind in ("lora", "dora") else True
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ----------------------------------------------------------------- Flux: diffusers (LoRA, DoRA) and ComfyUI (LoKr, LoHa)
def _flux_with(tiny_flux, tmp_path, lora: dict, formats: list[str]):
    from diffusers import FluxTransformer2DModel

    from engine.families.image.flux import apply_lora

    job = fh.write_flux_job(tmp_path / "job.yaml", tiny_flux, fh.make_images(tmp_path / "data"),
                            lora={"dropout": 0.0, **lora}, output={"formats": formats})
    cfg = load_job(job)
    model = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer")
    apply_lora(model, cfg)
    randomise_adapter(model)
    return cfg, model


def _flux_inputs(model) -> dict:
    g = torch.Generator().manual_seed(0)
    c = model.config
    return {"hidden_states": torch.randn(1, 12, c.in_channels, generator=g),
            "encoder_hidden_states": torch.randn(1, 5, c.joint_attention_dim, generator=g),
            "pooled_projections": torch.randn(1, c.pooled_projection_dim, generator=g),
            "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(12, 3), "txt_ids": torch.zeros(5, 3),
            "guidance": torch.tensor([1.0]) if c.guidance_embeds else None, "return_dict": False}


def test_a_dora_flux_adapter_loads_in_diffusers_as_dora_and_reproduces_the_model(tiny_flux, tmp_path):
    from diffusers import FluxPipeline

    from engine.families.image.flux_export import export

    cfg, model = _flux_with(tiny_flux, tmp_path, {"type": "dora"}, ["diffusers"])
    out = tmp_path / "out"
    out.mkdir()
    assert export(model, cfg, out, {"steps": 0}) == [DIFFUSERS_FILE]
    assert any(k.endswith("lora_magnitude_vector") for k in load_file(str(out / DIFFUSERS_FILE)))
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    x = _flux_inputs(model)
    with torch.no_grad():
        want = model(**x)[0]
        base = pipe.transformer(**x)[0]
        pipe.load_lora_weights(str(out))
        got = pipe.transformer(**x)[0]
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert layer.use_dora[next(iter(layer.use_dora))]
    assert not torch.allclose(base, want, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [{"type": "loha"}, {"type": "lokr"}, {"type": "lokr", "rank": 64},
                                  {"type": "lokr", "decompose_both": True, "factor": 4}],
                         ids=["loha", "lokr", "lokr-unfactored", "lokr-both-factored"])
def test_lokr_and_loha_flux_files_follow_comfyuis_lycoris_rules_and_reproduce_peft(tiny_flux, tmp_path, lora):
    from engine.families.image.flux_export import export
    from engine.training.adapters import adapter_layers

    cfg, model = _flux_with(tiny_flux, tmp_path, lora, ["comfyui"])
    out = tmp_path / "out"
    out.mkdir()
    assert export(model, cfg, out, {"steps": 0}) == [COMFYUI_FILE]
    sd = load_file(str(out / COMFYUI_FILE))
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        key, tensor = k.split(".", 1)
        by_key.setdefault(key, {})[tensor] = v
    layers = adapter_layers(model)
    assert set(by_key) == {"lycoris_" + n.replace(".", "_") for n in layers}
    allowed = COMFY_LOHA if lora["type"] == "loha" else COMFY_LOKR
    for name, layer in layers.items():
        tensors = by_key["lycoris_" + name.replace(".", "_")]
        assert set(tensors) <= allowed, set(tensors) - allowed  # ComfyUI would warn "lora key not loaded"
        bfl_target(name)  # a module ComfyUI maps to a BFL weight
        want = layer.get_delta_weight("default").detach()
        torch.testing.assert_close(comfy_lycoris_delta(tensors, want.shape), want, rtol=1e-5, atol=1e-6)
    if lora.get("rank") == 64:  # nothing factored: ComfyUI ignores alpha, so no alpha is written
        assert not any(k.endswith(".alpha") for k in sd)


# ----------------------------------------------------------------- what validation refuses
@pytest.mark.parametrize("lora,formats,words", [
    ({"type": "lokr"}, ["diffusers"], ["output.formats", "lora.type", "lokr", "comfyui"]),
    ({"type": "loha"}, ["diffusers", "comfyui"], ["output.formats", "lora.type", "loha"]),
    ({"type": "dora"}, ["comfyui"], ["output.formats", "lora.type", "dora", "diffusers"]),
    ({"type": "lora", "factor": 4}, ["diffusers"], ["lora.factor", "lokr"]),
    ({"type": "dora", "decompose_both": True}, ["diffusers"], ["lora.decompose_both", "lokr"]),
    ({"type": "loha", "dropout": 0.1}, ["comfyui"], ["lora.dropout", "loha"]),
    ({"type": "lokr", "factor": 0}, ["comfyui"], ["lora.factor"]),
])
def test_combinations_a_format_cannot_hold_are_refused_naming_the_keys(tiny_flux, tmp_path, lora, formats, words):
    job = fh.write_flux_job(tmp_path / "job.yaml", tiny_flux, fh.make_images(tmp_path / "data"),
                            lora={"dropout": 0.0, **lora}, output={"formats": formats})
    with pytest.raises(JobInvalid) as e:
        load_job(job)
    for w in words:
        assert w in str(e.value)


def test_lycoris_flux_jobs_default_to_the_comfyui_file(tiny_flux, tmp_path):
    d = fh.flux_job_dict(tiny_flux, fh.make_images(tmp_path / "data"), lora={"type": "lokr", "dropout": 0.0})
    del d["output"]
    from engine.config.job import parse_job

    assert parse_job(d, tmp_path).output.formats == ["comfyui"]


def test_dora_over_an_fp8_base_is_an_invalid_job(micro_model, tmp_path):
    from engine.families.causal_lm import CausalLM

    cfg = tiny_job(micro_model, tmp_path, lora={"type": "dora"}, model={"base_precision": "fp8", "dtype": "bfloat16"})
    with pytest.raises(JobInvalid, match=r"lora\.type, model\.base_precision: dora .* bf16"):
        CausalLM().load_model(cfg, tmp_path, torch.device("cpu"), RecLog())

