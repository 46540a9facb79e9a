"""lora.type on SDXL (builtin:tiny-sdxl, UNet and both text encoders): DoRA's diffusers file reproduces the model
through StableDiffusionXLPipeline.load_lora_weights; LoKr's and LoHa's kohya files hold, under the keys ComfyUI's
SDXL rules map (tests/helpers/comfy_sdxl.py), the LyCORIS tensors whose update ComfyUI computes
(tests/helpers/lycoris.py) equal to the trained one; a file a type cannot be read from is refused at submit.

The adapters are loaded as a job loads them and randomised (zero-initialised factors would make any file right):
what a file holds is a function of the adapter's weights, not of how they were trained. And lora.text_encoder_lr:
the encoders' parameters in an optimizer group of their own, following the schedule at that multiple."""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine.config.job import load_job, parse_job
from engine.errors import JobInvalid
from tests.helpers.comfy_sdxl import (
    comfy_clip_key_map,
    comfy_key_map,
    comfy_unet_config,
    comfy_unet_to_diffusers,
)
from tests.helpers.images import make_images
from tests.helpers.kill_chain import Quiet
from tests.helpers.lycoris import COMFY_LOHA, COMFY_LOKR, comfy_lycoris_delta, randomise_adapter

PROMPT = "sks, a yellow sun"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_image_model):
    root = tmp_path_factory.mktemp("sdxl-types")
    return root, tiny_image_model("sdxl"), make_images(root / "data", [("a.png", 32, 32, "sks, a yellow sun")])


def _model(setup, lora: dict, formats: list[str]):
    from engine.families import get_family

    root, model_dir, data = setup
    cfg = parse_job({"name": "t", "model": {"family": "sdxl", "path": str(model_dir), "dtype": "float32"},
                     "lora": {"rank": 4, "alpha": 8, "text_encoder": True, **lora}, "data": {"path": str(data)},
                     "output": {"formats": formats}}, root)
    fam = get_family("sdxl")
    torch.manual_seed(0)
    model = fam.load_model(cfg, root, torch.device("cpu"), Quiet())
    randomise_adapter(model)
    out = root / f"out-{lora['type']}"
    out.mkdir()
    return cfg, fam, model.eval(), fam.export(model, cfg, out, {"steps": 0}), out


def test_dora_diffusers_file_reproduces_the_unet_and_text_encoders(setup):
    from diffusers import StableDiffusionXLPipeline

    from engine.families.image.sdxl.text import IDS, open_tokenizers

    _cfg, _fam, model, names, out = _model(setup, {"type": "dora"}, ["diffusers"])
    assert names == ["pytorch_lora_weights.safetensors"]
    g = torch.Generator().manual_seed(0)
    x = dict(sample=torch.randn(1, 4, 4, 6, generator=g), timestep=torch.tensor([500]),
             encoder_hidden_states=torch.randn(1, 77, model.unet.config.cross_attention_dim, generator=g),
             added_cond_kwargs={"text_embeds": torch.randn(1, 16, generator=g),
                                "time_ids": torch.tensor([[24.0, 48.0, 0.0, 8.0, 32.0, 48.0]])}, return_dict=False)
    ids = [v[None] for v in open_tokenizers(str(setup[1]), None)(PROMPT).values()]
    assert list(open_tokenizers(str(setup[1]), None)(PROMPT)) == list(IDS)

    def run(pipe):
        return [pipe.unet(**x)[0], *pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False)[::2]]

    with torch.no_grad():
        want = [model.unet(**x)[0], *model.encode(*ids)]
        pipe = StableDiffusionXLPipeline.from_pretrained(setup[1], vae=None)
        base = run(pipe)
        pipe.load_lora_weights(str(out))
        got = run(pipe)
    for part in (pipe.unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1.to_q,
                 pipe.text_encoder_2.text_model.encoder.layers[0].self_attn.q_proj):
        assert part.use_dora["default_0"], "diffusers loaded a plain LoRA"
    for b, w, g in zip(base, want, got, strict=True):
        assert not torch.allclose(b, w, atol=1e-4)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_kohya_files_follow_comfyuis_sdxl_and_lycoris_rules(setup, kind):
    from engine.families.image.sdxl.text import file_path, parts
    from engine.training.adapters import adapter_layers

    _cfg, _fam, model, names, out = _model(setup, {"type": kind}, ["comfyui"])
    assert names == ["sdxl_lora_comfyui.safetensors"]
    sd = load_file(str(out / names[0]))
    by_key: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        key, tensor = k.split(".", 1)
        by_key.setdefault(key, {})[tensor] = v
    config = dict(model.unet.config)
    keys = comfy_key_map(config)  # ComfyUI's key -> its model's weight
    to_comfy = {d: f"diffusion_model.{s}.weight" for d, s in comfy_unet_to_diffusers(comfy_unet_config(config)).items()}
    layers = {to_comfy[n]: m for n, m in adapter_layers(model.unet).items()}
    sdk = set()
    for part, clip in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        te = parts(model)[part]
        sdk |= {f"{clip}.transformer.{file_path(n.replace('.base_layer', ''))}" for n, _ in te.named_parameters()
                if "lora_" not in n and "lokr_" not in n and "hada_" not in n}
        layers.update({f"{clip}.transformer.{file_path(n)}.weight": m for n, m in adapter_layers(te).items()})
    keys.update(comfy_clip_key_map(sdk))
    assert {keys[k] for k in by_key} == set(layers)  # every key maps, to every adapted weight
    assert {k[:9] for k in by_key if k.startswith("lora_te")} == {"lora_te1_", "lora_te2_"}
    allowed = COMFY_LOHA if kind == "loha" else COMFY_LOKR
    for key, tensors in by_key.items():
        assert set(tensors) <= allowed, set(tensors) - allowed  # ComfyUI would warn "lora key not loaded"
        want = layers[keys[key]].get_delta_weight("default").detach()
        torch.testing.assert_close(comfy_lycoris_delta(tensors, want.shape), want, rtol=1e-5, atol=1e-6, msg=key)


def test_the_text_encoders_train_at_their_own_learning_rate_along_the_schedule(setup):
    from engine.training.adapters import trainable
    from engine.training.optim import build_optimizer, set_lr

    cfg, _fam, model, _names, _out = _model(setup, {"type": "lora", "text_encoder_lr": 0.0005}, ["diffusers"])
    params = trainable(model)
    opt = build_optimizer(list(params.values()), cfg.train)
    by_id = {id(p): n for n, p in params.items()}
    unet, te = ({by_id[id(p)] for p in g["params"]} for g in opt.param_groups)
    assert unet == {n for n in params if n.startswith("unet.")} and te == set(params) - unet
    assert {n.split(".")[0] for n in te} == {"text_encoder", "text_encoder_2"}
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([cfg.train.lr, 0.0005])
    set_lr(opt, cfg.train.lr / 10)  # a step of the schedule: both scaled alike
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([cfg.train.lr / 10, 0.00005])


@pytest.mark.parametrize("lora,formats,words", [
    ({"type": "dora"}, ["comfyui"], "ComfyUI applies a DoRA magnitude"),
    ({"type": "lokr"}, ["diffusers"], "load_lora_weights cannot read a lokr"),
    ({"type": "loha"}, ["diffusers", "comfyui"], "load_lora_weights cannot read a loha"),
])
def test_a_file_the_type_cannot_be_read_from_is_refused_at_submit(setup, tmp_path, lora, formats, words):
    job = {"name": "x", "model": {"family": "sdxl", "path": "builtin:tiny-sdxl"}, "lora": lora,
           "data": {"path": str(setup[2])}, "output": {"formats": formats}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with pytest.raises(JobInvalid, match="output.formats, lora.type") as e:
        load_job(tmp_path / "job.yaml")
    assert words in str(e.value)
