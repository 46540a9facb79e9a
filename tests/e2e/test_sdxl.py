"""SDXL LoRA on its tiny random pipeline (builtin:tiny-sdxl): an epsilon run that trains both text encoders too
(lora.text_encoder) and a v run (LoCon targets), each killed twice and resumed bit-identical in both files; the
diffusers file reproduces the trained UNet and text encoders through StableDiffusionXLPipeline.load_lora_weights;
the kohya file's keys are the ones ComfyUI's rules map (written out below as comfy/utils.py's unet_to_diffusers
and comfy/lora.py's model_lora_keys_unet and model_lora_keys_clip have them), with kohya's alphas, and carry the
trained update.

The killed-twice chains run as forked trainers (tests/helpers/kill_chain.py) while the references train here; the
epsilon reference renders samples on the way, so its match with the chain also shows samples leave training alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.helpers.comfy_sdxl import (
    comfy_clip_key_map,
    comfy_key_map,
    comfy_unet_config,
    comfy_unet_to_diffusers,
)
from tests.helpers.images import make_images, tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references

IMAGES = [("wide-0.png", 48, 24, "a red square on grass"), ("tall-0.png", 20, 40, "a green tower"),
          ("square-0.png", 32, 32, "a yellow sun")]
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "sdxl_lora_comfyui.safetensors"
# LoCon: attention plus every resnet conv and the samplers (the v run)
LOCON = r"^.*(transformer_blocks\.\d+\.attn[12]\.(to_q|to_k|to_v|to_out\.0)|resnets\.\d+\.(conv1|conv2|conv_shortcut)" \
        r"|(down|up)samplers\.0\.conv)$"
RUNS = {"epsilon": {"lora": {"text_encoder": True, "text_encoder_lr": 0.001}}, "v": {"lora": {"targets": LOCON}}}


def job_dict(model_dir, data_dir, prediction: str, **over) -> dict:
    d = {
        "name": f"tiny-sdxl-{prediction}",
        "model": {"family": "sdxl", "path": str(model_dir), "dtype": "float32", "prediction": prediction},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data_dir), "resolution": [32], "trigger": "sks", "caption_dropout": 0.3, "flip": True},
        "train": {"steps": 4, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw",
                  "seed": 3, "timestep_sampling": "linear"},
        "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }
    return deep_update(deep_update(d, RUNS[prediction]), over)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per prediction: (model dir, job file, uninterrupted workdir, killed-twice future)."""
    from engine.builtin.tiny_sdxl import build_tiny_sdxl

    root = tmp_path_factory.mktemp("sdxl")
    data = make_images(root / "data", IMAGES)
    model = root / "tiny-sdxl"
    build_tiny_sdxl(model)
    jobs = {}
    for pred in RUNS:
        job = root / f"{pred}.yaml"
        job.write_text(yaml.safe_dump(job_dict(model, data, pred)))
        reference = job
        if pred == "epsilon":  # samples while training: they must not change what trains
            reference = root / f"{pred}-samples.yaml"
            reference.write_text(yaml.safe_dump(job_dict(model, data, pred, sample={
                "every_steps": 2, "prompts": ["sks"], "steps": 2, "width": 32, "height": 32, "guidance": 4.0})))
        jobs[pred] = (job, reference)
    with chains_beside_references(root, jobs) as done:
        yield {pred: (model, jobs[pred][0], *done[pred]) for pred in RUNS}


@pytest.mark.parametrize("pred", list(RUNS))
def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(pred, runs):
    _model, _job, reference, killed = runs[pred]
    wd, story = killed.result(timeout=900)
    for name in (DIFFUSERS_FILE, KOHYA_FILE):
        want, got = tensor_bytes(reference / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got)
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"
    if pred == "epsilon":
        assert (reference / "samples" / "step-00000004" / "00.png").stat().st_size > 0


def _trained(job, wd):
    """The LoRA model with the last checkpoint's adapter (what training ended with: the UNet, or with
    lora.text_encoder the UNet and both encoders), and the family object."""
    from engine.families import get_family

    fam = get_family("sdxl")
    model = fam.load_model(load_job(job), job.parent, torch.device("cpu"), Quiet())
    return with_last_checkpoint(model, wd), fam


def _inputs(unet) -> dict:
    g = torch.Generator().manual_seed(0)
    c = unet.config
    return dict(sample=torch.randn(1, c.in_channels, 4, 6, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 77, c.cross_attention_dim, generator=g),
                added_cond_kwargs={"text_embeds": torch.randn(1, 16, generator=g),
                                   "time_ids": torch.tensor([[24.0, 48.0, 0.0, 8.0, 32.0, 48.0]])},
                return_dict=False)


PROMPT = "sks, a red square on grass"


@pytest.mark.parametrize("pred", list(RUNS))
def test_load_lora_weights_reproduces_the_trained_unet_and_text_encoders(pred, runs):
    """The UNet at fixed inputs, and (epsilon: lora.text_encoder) the pipeline's own encode_prompt of a caption
    against the trained encoders' encoding of its token ids."""
    from diffusers import StableDiffusionXLPipeline

    from engine.families.image.sdxl.text import IDS, open_tokenizers, parts

    model_dir, job, wd, _ = runs[pred]
    mem, fam = _trained(job, wd)
    unet, te = parts(mem)["unet"], "text_encoder" in parts(mem)
    assert te == (pred == "epsilon")
    x = _inputs(unet)
    ids = {k: v[None] for k, v in open_tokenizers(str(model_dir), None)(PROMPT).items()}

    def both(pipe) -> tuple[torch.Tensor, list[torch.Tensor]]:
        text = list(pipe.encode_prompt(PROMPT, device="cpu", do_classifier_free_guidance=False)[::2]) if te else []
        return pipe.unet(**x)[0], text

    with torch.no_grad():
        want = unet(**x)[0], list(mem.encode(*(ids[k] for k in IDS))) if te else []
        pipe = StableDiffusionXLPipeline.from_pretrained(model_dir, vae=None, **({} if te else dict.fromkeys(
            ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"))))
        base = both(pipe)
        pipe.load_lora_weights(str(wd / "output"), weight_name=DIFFUSERS_FILE)
        got = both(pipe)
        pipe.unload_lora_weights()
        # diffusers reads kohya's file too (its SGM-name converter, lora_te1_/lora_te2_ included): the same update,
        # up to rounding
        pipe.load_lora_weights(str(wd / "output"), weight_name=KOHYA_FILE)
        kohya = both(pipe)
    for b, w, g, k in zip([base[0], *base[1]], [want[0], *want[1]], [got[0], *got[1]], [kohya[0], *kohya[1]],
                          strict=True):
        assert not torch.allclose(b, w, atol=1e-4), "training changed nothing; the test would prove nothing"
        assert torch.equal(g, w), f"max diff {float((g - w).abs().max())}"
        torch.testing.assert_close(k, w, rtol=1e-5, atol=1e-5)
    assert len(want[1]) == (2 if te else 0)  # prompt_embeds and pooled_prompt_embeds
    with safe_open(str(wd / "output" / DIFFUSERS_FILE), "pt") as f:
        md = f.metadata()
    assert md["lorad_prediction"] == pred and md["steps"] == "4"
    assert json.loads(md["lora_adapter_metadata"])["unet.lora_alpha"] == 4  # alpha / r folded into lora_B
    assert fam.pred == pred
    if pred == "v":  # zero terminal SNR: the last step is pure noise; epsilon keeps SDXL's own schedule
        assert fam.ac[-1] == 0
    else:
        assert 0.004 < float(fam.ac[-1]) < 0.005


SDXL_UNET = dict(  # stabilityai/stable-diffusion-xl-base-1.0's unet/config.json, the keys that shape it
    sample_size=128, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)


def test_every_sdxl_unet_module_maps_to_the_key_comfyui_maps():
    """Every linear and conv of the real SDXL UNet (built on the meta device: no weights) gets the kohya key ComfyUI
    maps to that module's own SGM weight; kohya's published names for a few of them, literally."""
    from diffusers import UNet2DConditionModel

    from engine.families.image.sdxl.export import kohya_key

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SDXL_UNET)
    config = dict(unet.config)
    rules = comfy_unet_to_diffusers(comfy_unet_config(config))
    keys = comfy_key_map(config)
    mods = [n for n, m in unet.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    mapped = [n for n in mods if n in rules]
    assert len(mapped) > 700
    for name in mapped:
        assert keys[kohya_key(name, config)] == f"diffusion_model.{rules[name]}.weight", name
    assert kohya_key("down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k", config) == \
        "lora_unet_input_blocks_4_1_transformer_blocks_1_attn2_to_k"
    assert kohya_key("up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_out.0", config) == \
        "lora_unet_output_blocks_2_1_transformer_blocks_9_attn1_to_out_0"
    assert kohya_key("mid_block.attentions.0.transformer_blocks.0.attn1.to_q", config) == \
        "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q"
    assert kohya_key("up_blocks.1.upsamplers.0.conv", config) == "lora_unet_output_blocks_5_2_conv"
    assert kohya_key("down_blocks.0.resnets.1.conv2", config) == "lora_unet_input_blocks_2_0_out_layers_3"


@pytest.mark.parametrize("pred", list(RUNS))
def test_the_kohya_file_has_kohya_keys_and_alphas_with_the_trained_update(pred, runs):
    """Every key of the file is one ComfyUI's maps (UNet and, with lora.text_encoder, both encoders), to every
    trained module, with kohya's alpha and the trained update."""
    from engine.families.image.sdxl.text import file_path, parts

    _model, job, wd, _ = runs[pred]
    mem, _fam = _trained(job, wd)
    unet = parts(mem)["unet"]
    sd = load_file(str(wd / "output" / KOHYA_FILE))
    keys = comfy_key_map(dict(unet.config))
    to_comfy = {d: f"diffusion_model.{s}.weight" for d, s in comfy_unet_to_diffusers(
        comfy_unet_config(dict(unet.config))).items()}
    deltas = {to_comfy[n]: m.get_delta_weight("default").detach() for n, m in unet.named_modules()
              if hasattr(m, "lora_A")}
    sdk: set[str] = set()  # ComfyUI's CLIP weights: clip_l / clip_g .transformer. + the transformers names
    for part, clip in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        if part not in parts(mem):
            continue
        te = parts(mem)[part]
        sdk |= {f"{clip}.transformer.{file_path(n.replace('.base_layer', ''))}" for n, _ in te.named_parameters()
                if "lora_" not in n}
        deltas.update({f"{clip}.transformer.{file_path(n)}.weight": m.get_delta_weight("default").detach()
                       for n, m in te.named_modules() if hasattr(m, "lora_A")})
    keys.update(comfy_clip_key_map(sdk))
    bases = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in sd}
    assert set(sd) == {f"{b}.{s}" for b in bases for s in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert all(b.startswith("lora_unet_") and ("_input_blocks_" in b or "_output_blocks_" in b or "_middle_block_"
                                                in b) or b.startswith(("lora_te1_", "lora_te2_")) for b in bases)
    assert {keys[b] for b in bases} == set(deltas)  # every key maps, to every trained module
    convs = 0
    for b in bases:
        down, up, alpha = sd[f"{b}.lora_down.weight"], sd[f"{b}.lora_up.weight"], float(sd[f"{b}.alpha"])
        assert alpha == 8.0 and down.shape[0] == 4
        delta = deltas[keys[b]]
        update = (alpha / down.shape[0]) * (up.flatten(1) @ down.flatten(1))
        convs += delta.dim() == 4
        torch.testing.assert_close(update.reshape(delta.shape), delta, rtol=1e-5, atol=1e-7, msg=b)
    assert (convs > 0) == (pred == "v")  # the v run trains LoCon (convs too)
    te_keys = {b[:9] for b in bases if b.startswith("lora_te")}
    assert te_keys == ({"lora_te1_", "lora_te2_"} if pred == "epsilon" else set())
    with safe_open(str(wd / "output" / KOHYA_FILE), "pt") as f:
        md = f.metadata()
    assert md["ss_network_dim"] == "4" and float(md["ss_network_alpha"]) == 8.0
    assert md["ss_v_parameterization"] == str(pred == "v")
    assert md["ss_network_train_unet_only"] == str(pred != "epsilon")
