"""FLUX.2, Qwen-Image, Z-Image, Chroma, FLUX.3 and Krea 2 LoRA on their tiny random pipelines: exact resume, the two output formats, the cache, fp8 + swap.

Each family's killed-twice run (SIGKILL while caching, SIGKILL with a checkpoint half-written, then resumed) runs
as real processes (the trainer's command line, engine/run.py) in the background of a module fixture while the same job trains
uninterrupted in the test process; the other tests read the uninterrupted run's files. The processes are forked
from a server that imported the training stack once (tests/helpers/forked.py): this file needs fifteen of them.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.helpers.images import make_images, tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references

FAMILIES = ("flux2", "qwen_image", "z_image", "chroma", "flux3", "krea2")
IMAGES = [("wide-0.png", 48, 24, "a red square on grass"), ("tall-0.png", 20, 40, "a green tower"),
          ("square-0.png", 32, 32, "a yellow sun")]
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
COMFY = {"flux2": "flux2_lora_comfyui.safetensors", "qwen_image": "qwen_image_lora_comfyui.safetensors",
         "z_image": "z_image_lora_comfyui.safetensors", "chroma": "chroma_lora_comfyui.safetensors",
         "flux3": "flux3_lora_comfyui.safetensors",
         "krea2": "krea2_lora_comfyui.safetensors"}


def _build(family: str, dest: Path) -> Path:
    from engine.builtin.tiny_chroma import build_tiny_chroma
    from engine.builtin.tiny_flux3 import build_tiny_flux3
    from engine.builtin.tiny_krea2 import build_tiny_krea2
    from engine.builtin.tiny_pipelines import build_tiny_flux2, build_tiny_qwen_image
    from engine.builtin.tiny_z_image import build_tiny_z_image

    {"flux2": build_tiny_flux2, "qwen_image": build_tiny_qwen_image, "z_image": build_tiny_z_image,
     "chroma": build_tiny_chroma, "flux3": build_tiny_flux3,
     "krea2": build_tiny_krea2}[family](dest)
    return dest


def job_dict(family: str, model_dir: Path, data_dir: Path, **over) -> dict:
    d = {
        "name": f"tiny-{family.replace('_', '-')}",
        "model": {"family": family, "path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data_dir), "resolution": [32], "trigger": "sks", "caption_dropout": 0.3, "flip": True},
        "train": {"steps": 4, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw",
                  "seed": 3, "timestep_sampling": "shift"},
        "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }
    return deep_update(d, over)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per family: (model dir, job file, uninterrupted workdir, killed-twice future); the chains run meanwhile."""
    root = tmp_path_factory.mktemp("image-families")
    data = make_images(root / "data", IMAGES)
    models, jobs = {}, {}
    for family in FAMILIES:
        models[family] = _build(family, root / f"tiny-{family}")
        job = root / f"{family}.yaml"
        job.write_text(yaml.safe_dump(job_dict(family, models[family], data)))
        jobs[family] = (job, job)
    with chains_beside_references(root, jobs) as done:
        yield {family: (models[family], jobs[family][0], *done[family]) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(family, runs):
    _model, _job, reference, killed = runs[family]
    wd, story = killed.result(timeout=900)
    ref = reference
    for name in (DIFFUSERS_FILE, COMFY[family]):
        want, got = tensor_bytes(ref / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got)
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"


# ------------------------------------------------------------------ outputs
def _trained_in_memory(family: str, job: Path, workdir: Path):
    """The LoRA-wrapped transformer with the last checkpoint's adapter: what training ended with."""
    from engine.families import get_family

    cfg = load_job(job)
    model = get_family(family).load_model(cfg, workdir, torch.device("cpu"), Quiet())
    return with_last_checkpoint(model, workdir), cfg


def _inputs(family: str, model) -> dict:
    """Fixed transformer inputs for a 4x6 latent and 9 text tokens, in each model's own layout."""
    g = torch.Generator().manual_seed(0)
    c = model.config.in_channels
    if family == "krea2":  # packed latents, the tapped text layers per token, σ itself as the time
        from diffusers import Krea2Pipeline

        text = torch.randn(1, 9, model.config.num_text_layers, model.config.text_hidden_dim, generator=g)
        return dict(hidden_states=torch.randn(1, 2 * 3, c, generator=g), encoder_hidden_states=text,
                    timestep=torch.tensor([0.6]), position_ids=Krea2Pipeline.prepare_position_ids(9, 2, 3, "cpu"),
                    encoder_attention_mask=torch.ones(1, 9, dtype=torch.bool), return_dict=False)
    text = torch.randn(1, 9, model.config.get("joint_attention_dim") or model.config.cap_feat_dim, generator=g)
    if family == "z_image":  # a list of [C, 1, h, w] latents and a list of unpadded captions, the time as 1 - σ
        lat = torch.randn(1, c, 1, 4, 6, generator=g)
        return dict(x=list(lat), t=torch.tensor([0.4]), cap_feats=[text[0]], return_dict=False)
    if family == "flux2":
        from diffusers import Flux2Pipeline

        lat = torch.randn(1, c, 4, 6, generator=g)
        return dict(hidden_states=Flux2Pipeline._pack_latents(lat), encoder_hidden_states=text,
                    timestep=torch.tensor([0.6]), img_ids=Flux2Pipeline._prepare_latent_ids(lat),
                    txt_ids=Flux2Pipeline._prepare_text_ids(text), return_dict=False)
    if family == "flux3":  # tokens in row order, ids from the modular blocks' helpers
        from diffusers.modular_pipelines.flux3.before_denoise import (
            Flux3TextRoPEInputsStep,
            _prepare_image_ids,
        )

        return dict(hidden_states=torch.randn(1, 24, c, generator=g), encoder_hidden_states=text,
                    timestep=torch.tensor([0.6]), img_ids=_prepare_image_ids(4, 6, 0.5),
                    txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text), return_dict=False)
    if family == "chroma":
        from diffusers import ChromaPipeline

        lat = torch.randn(1, c // 4, 4, 6, generator=g)
        return dict(hidden_states=ChromaPipeline._pack_latents(lat, 1, c // 4, 4, 6), encoder_hidden_states=text,
                    timestep=torch.tensor([0.6]), img_ids=ChromaPipeline._prepare_latent_image_ids(1, 2, 3, "cpu",
                                                                                                  torch.float32),
                    txt_ids=torch.zeros(9, 3), return_dict=False)
    from diffusers import QwenImagePipeline

    lat = torch.randn(1, c // 4, 4, 6, generator=g)
    return dict(hidden_states=QwenImagePipeline._pack_latents(lat, 1, c // 4, 4, 6), encoder_hidden_states=text,
                encoder_hidden_states_mask=torch.ones(1, 9, dtype=torch.long), timestep=torch.tensor([0.6]),
                img_shapes=[[(1, 2, 3)]], return_dict=False)


def _forward(model, x: dict) -> torch.Tensor:
    out = model(**x)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image returns one tensor per sample


def _first_q(model):
    """The first block's query projection (Z-Image: layers.0.attention.to_q; FLUX.3 its first joint block's; the
    others transformer_blocks.0.attn)."""
    if hasattr(model, "layers"):
        return model.layers[0].attention.to_q
    return (model.transformer_blocks if hasattr(model, "transformer_blocks") else model.single_transformer_blocks)[0].attn.to_q


def _pipeline_with_transformer(family: str, model_dir: Path):
    """The model's own pipeline with only its transformer (FLUX.3's is a modular pipeline: diffusers has no other)."""
    if family == "flux3":
        from diffusers import ModularPipeline

        pipe = ModularPipeline.from_pretrained(model_dir)
        pipe.load_components(names=["transformer"])
        return pipe
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(model_dir, text_encoder=None, tokenizer=None, vae=None)


# Families whose diffusers file carries alpha / r inside lora_B, with lora_alpha = r in its metadata, so that
# loaders reading no metadata and no .alpha key (ComfyUI) apply the trained strength too.
FOLDED = {"flux2", "qwen_image", "z_image", "flux3", "krea2"}


@pytest.mark.parametrize("family", FAMILIES)
def test_load_lora_weights_of_both_files_reproduces_the_trained_transformer(family, runs):
    model_dir, job, reference, _ = runs[family]
    wd = reference
    mem, cfg = _trained_in_memory(family, job, wd)
    x = _inputs(family, mem)
    with torch.no_grad():
        want = _forward(mem, x)
        pipe = _pipeline_with_transformer(family, model_dir)
        base = _forward(pipe.transformer, x)
        pipe.load_lora_weights(str(wd / "output"), weight_name=DIFFUSERS_FILE)
        got = _forward(pipe.transformer, x)
        layer = _first_q(pipe.transformer)
        # alpha / r = 2 is a power of two: folded into lora_B it gives bit-identical outputs too.
        scale = 1.0 if family in FOLDED else cfg.lora.alpha / cfg.lora.rank
        assert layer.scaling[next(iter(layer.scaling))] == scale and cfg.lora.alpha / cfg.lora.rank == 2.0
        pipe.unload_lora_weights()
        # The ComfyUI file loads in diffusers too (kohya names for FLUX.2, diffusion_model.* for Qwen-Image,
        # Z-Image and FLUX.3); its scale is folded into the weights there, so it matches up to rounding. (diffusers' kohya
        # converter for Chroma's FLUX.1 names splits linear1 at FLUX.1's fixed 3072 width, which the tiny model
        # is not: checked by hand at 3072 wide, 3.3e-7.)
        comfy = None
        if family != "chroma":
            pipe.load_lora_weights(str(wd / "output"), weight_name=COMFY[family])
            comfy = _forward(pipe.transformer, x)
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing; the test would prove nothing"
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"
    if comfy is not None:
        torch.testing.assert_close(comfy, want, rtol=1e-5, atol=1e-5)
    with safe_open(str(wd / "output" / DIFFUSERS_FILE), "pt") as f:
        md = f.metadata()
    assert md["rank"] == "4" and md["steps"] == "4" and md["trigger"] == "sks" and md["lorad_version"]
    if family == "chroma":  # FLUX.1's layout: the scale is in the alpha keys, which ComfyUI reads too
        alphas = {k: float(v) for k, v in load_file(str(wd / "output" / DIFFUSERS_FILE)).items() if k.endswith(".alpha")}
        assert len(alphas) == 34 and set(alphas.values()) == {8.0}
    else:
        assert json.loads(md["lora_adapter_metadata"])["transformer.lora_alpha"] == (4.0 if family in FOLDED else 8.0)


def _comfyui_file_and_deltas(family: str, runs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The uninterrupted run's ComfyUI file, and per diffusers module path its trained update (alpha/r)·B·A."""
    _model, job, reference, _ = runs[family]
    wd = reference
    mem, _ = _trained_in_memory(family, job, wd)
    deltas = {n: m.get_delta_weight("default").detach() for n, m in mem.named_modules() if hasattr(m, "lora_A")}
    return load_file(str(wd / "output" / COMFY[family])), deltas


@pytest.mark.parametrize("family", sorted(FOLDED))
def test_the_diffusers_file_gives_the_trained_update_to_a_loader_that_reads_no_alpha(family, runs):
    """A loader reading plain A/B at scale 1 (ComfyUI has no alpha for these keys and reads no metadata) applies
    exactly the trained (alpha / r)·B·A: the scale is folded into lora_B."""
    _, d = _comfyui_file_and_deltas(family, runs)
    sd = load_file(str(runs[family][2] / "output" / DIFFUSERS_FILE))
    assert not any(k.endswith(".alpha") for k in sd)
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in sd} == set(d)
    for m, delta in d.items():
        b, a = sd[f"transformer.{m}.lora_B.weight"], sd[f"transformer.{m}.lora_A.weight"]
        torch.testing.assert_close(b @ a, delta, rtol=1e-5, atol=1e-7, msg=m)


def _double_block_updates(d: dict[str, torch.Tensor], i: int, mlp_in: str, mlp_out: str) -> dict[str, tuple]:
    """ComfyUI's BFL names for double block i and (fused parts, trained update), from the per-module deltas d:
    q/k/v fused per stream, the projections and both MLPs (FLUX.2 and Chroma differ only in the MLPs' names)."""
    b = f"transformer_blocks.{i}."
    want = {f"double_blocks_{i}_img_attn_qkv": (3, torch.cat([d[b + f"attn.to_{x}"] for x in "qkv"])),
            f"double_blocks_{i}_txt_attn_qkv": (3, torch.cat([d[b + f"attn.add_{x}_proj"] for x in "qkv"])),
            f"double_blocks_{i}_img_attn_proj": (1, d[b + "attn.to_out.0"]),
            f"double_blocks_{i}_txt_attn_proj": (1, d[b + "attn.to_add_out"])}
    for bfl, mod in (("img_mlp_0", f"ff.{mlp_in}"), ("img_mlp_2", f"ff.{mlp_out}"),
                     ("txt_mlp_0", f"ff_context.{mlp_in}"), ("txt_mlp_2", f"ff_context.{mlp_out}")):
        want[f"double_blocks_{i}_{bfl}"] = (1, d[b + mod])
    return want


def test_flux2_comfyui_keys_are_bfl_names_with_fused_qkv_and_the_same_update(runs):
    """ComfyUI: lora_unet_<BFL name> -> diffusion_model.<BFL name>.weight, update (alpha / down rows)·up·down."""
    sd, d = _comfyui_file_and_deltas("flux2", runs)
    want = {}
    for i in range(2):
        want.update(_double_block_updates(d, i, "linear_in", "linear_out"))
        s = f"single_transformer_blocks.{i}.attn."
        want[f"single_blocks_{i}_linear1"] = (1, d[s + "to_qkv_mlp_proj"])
        want[f"single_blocks_{i}_linear2"] = (1, d[s + "to_out"])
    assert {k.split(".")[0].removeprefix("lora_unet_") for k in sd} == set(want)
    for name, (parts, delta) in want.items():
        down, up, alpha = sd[f"lora_unet_{name}.lora_down.weight"], sd[f"lora_unet_{name}.lora_up.weight"], \
            float(sd[f"lora_unet_{name}.alpha"])
        assert down.shape[0] == 4 * parts and alpha == 8.0 * parts  # alpha'/r' = alpha/r
        torch.testing.assert_close((alpha / down.shape[0]) * (up @ down), delta, rtol=1e-5, atol=1e-7)


def test_qwen_image_comfyui_keys_are_diffusion_model_paths_with_alphas(runs):
    """ComfyUI's Qwen-Image model keeps diffusers' names: diffusion_model.<path>.lora_A/B + .alpha per module."""
    sd, d = _comfyui_file_and_deltas("qwen_image", runs)
    per_block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                 "txt_mlp.net.2"]
    modules = {f"transformer_blocks.{i}.{m}" for i in range(4) for m in per_block}
    assert set(d) == modules
    assert set(sd) == {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    for m in modules:
        a, b, alpha = sd[f"diffusion_model.{m}.lora_A.weight"], sd[f"diffusion_model.{m}.lora_B.weight"], \
            float(sd[f"diffusion_model.{m}.alpha"])
        assert alpha == 8.0
        torch.testing.assert_close((alpha / a.shape[0]) * (b @ a), d[m], rtol=1e-5, atol=1e-7)


def _as_comfyui_lumina2(sd: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """The weight updates ComfyUI's loader makes of a Z-Image LoRA file on its Lumina2 model (comfy/lora.py with
    comfy/utils.py's z_image_to_diffusers): `diffusion_model.` or `transformer.` + a diffusers path; to_q/k/v
    patch row blocks [0, d) / [d, 2d) / [2d, 3d) of the fused attention.qkv, to_out.0 patches attention.out,
    feed_forward.w1-3 keep their names; scale alpha / rank with an `.alpha` key, 1 without."""
    rows = {"to_q": 0, "to_k": 1, "to_v": 2}
    out: dict[str, torch.Tensor] = {}
    for key in (k.removesuffix(".lora_A.weight") for k in sd if k.endswith(".lora_A.weight")):
        path = re.sub(r"^(diffusion_model|transformer)\.", "", key)
        m = re.fullmatch(r"((?:layers|noise_refiner|context_refiner)\.\d+)\.(attention\.(to_q|to_k|to_v|to_out\.0)"
                         r"|feed_forward\.w[123])", path)
        assert m and path != key, f"{key}: ComfyUI's Z-Image loader maps no weight to it"
        a, b, alpha = sd[f"{key}.lora_A.weight"], sd[f"{key}.lora_B.weight"], sd.get(f"{key}.alpha")
        delta = (float(alpha) / a.shape[0] if alpha is not None else 1.0) * (b @ a)
        block, part, proj = m.groups()
        if proj in rows:
            qkv = out.setdefault(f"{block}.attention.qkv.weight", torch.zeros(3 * width, a.shape[1]))
            qkv[rows[proj] * width : (rows[proj] + 1) * width] += delta
        else:
            out[f"{block}.{'attention.out' if proj else part}.weight"] = delta
    return out


def test_z_image_both_files_patch_comfyuis_fused_model_at_the_trained_strength(runs):
    """The ComfyUI file: diffusion_model.<path>.lora_A/B + .alpha; the diffusers file: transformer.<path>, alpha / r
    folded in, no .alpha. Read by ComfyUI's rules, both give each fused weight the trained update."""
    sd, d = _comfyui_file_and_deltas("z_image", runs)
    blocks = [f"layers.{i}" for i in range(4)] + ["noise_refiner.0", "context_refiner.0"]
    per_block = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3"]
    modules = {f"{b}.{m}" for b in blocks for m in per_block}
    assert set(d) == modules
    assert set(sd) == {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert {float(sd[f"diffusion_model.{m}.alpha"]) for m in modules} == {8.0}
    width = d["layers.0.attention.to_q"].shape[0]
    want = {}
    for b in blocks:
        want[f"{b}.attention.qkv.weight"] = torch.cat([d[f"{b}.attention.to_{x}"] for x in "qkv"])
        want[f"{b}.attention.out.weight"] = d[f"{b}.attention.to_out.0"]
        for w in ("w1", "w2", "w3"):
            want[f"{b}.feed_forward.{w}.weight"] = d[f"{b}.feed_forward.{w}"]
    diffusers_file = load_file(str(runs["z_image"][2] / "output" / DIFFUSERS_FILE))
    assert not any(k.endswith(".alpha") for k in diffusers_file)
    for name, patches in (("ComfyUI file", _as_comfyui_lumina2(sd, width)),
                          ("diffusers file", _as_comfyui_lumina2(diffusers_file, width))):
        assert sorted(patches) == sorted(want), name
        for k, v in want.items():
            torch.testing.assert_close(patches[k], v, rtol=1e-5, atol=1e-7, msg=f"{name}: {k}")


def test_chroma_files_have_the_keys_and_alphas_comfyuis_flux_rules_map(runs):
    """ComfyUI's Chroma is a Flux model to its LoRA loader. Its ComfyUI file: lora_unet_<BFL name> ->
    diffusion_model.<BFL name>.weight, q/k/v (and the single blocks' mlp input) fused, update (alpha / down rows)·up·down.
    The diffusers file: transformer.<diffusers path> with its `.alpha`, update (alpha / r)·B·A."""
    sd, d = _comfyui_file_and_deltas("chroma", runs)
    want = {}
    for i in range(2):
        want.update(_double_block_updates(d, i, "net.0.proj", "net.2"))
        s = f"single_transformer_blocks.{i}."
        want[f"single_blocks_{i}_linear1"] = (4, torch.cat([d[s + p] for p in ("attn.to_q", "attn.to_k", "attn.to_v",
                                                                                 "proj_mlp")]))
        want[f"single_blocks_{i}_linear2"] = (1, d[s + "proj_out"])
    assert {k.split(".")[0].removeprefix("lora_unet_") for k in sd} == set(want)
    for name, (parts, delta) in want.items():
        down, up = sd[f"lora_unet_{name}.lora_down.weight"], sd[f"lora_unet_{name}.lora_up.weight"]
        alpha = float(sd[f"lora_unet_{name}.alpha"])
        assert down.shape[0] == 4 * parts and alpha == 8.0 * parts  # alpha'/r' = alpha/r
        torch.testing.assert_close((alpha / down.shape[0]) * (up @ down), delta, rtol=1e-5, atol=1e-7)

    diff = load_file(str(runs["chroma"][2] / "output" / DIFFUSERS_FILE))
    assert set(diff) == {f"transformer.{m}.{t}" for m in d for t in ("lora_A.weight", "lora_B.weight", "alpha")}
    for m, delta in d.items():
        a, b, alpha = diff[f"transformer.{m}.lora_A.weight"], diff[f"transformer.{m}.lora_B.weight"], \
            float(diff[f"transformer.{m}.alpha"])
        torch.testing.assert_close((alpha / a.shape[0]) * (b @ a), delta, rtol=1e-5, atol=1e-7)


def test_flux3_comfyui_keys_are_bfl_names_that_diffusers_own_converter_maps_back(runs):
    """FLUX.3's file: diffusion_model.<BFL name>.lora_A/B, alpha / r folded (no .alpha keys, which diffusers' FLUX.3
    loader refuses); diffusers' converter for the original LoRA format maps every key back to its trained module,
    and each <BFL name>.weight is an original checkpoint's weight (diffusers' single-file converter maps it to that
    module): what ComfyUI's generic rule patches, diffusion_model.<name>.weight, on a model with BFL's names."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_flux3_lora_to_diffusers
    from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers

    sd, d = _comfyui_file_and_deltas("flux3", runs)
    blocks = ["txt_mode_blocks.0", "mode_blocks.image.0"] + [f"single_transformer_blocks.{i}" for i in range(4)]
    modules = {f"{b}.{m}" for b in blocks for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                                                      "ff.linear_in", "ff.linear_out")}
    assert set(d) == modules
    assert "diffusion_model.content_mode_blocks.image.0.attn_out.lora_A.weight" in sd
    assert "diffusion_model.single_blocks.3.mlp_in.lora_B.weight" in sd and not any(k.endswith(".alpha") for k in sd)
    weights = {k.removeprefix("diffusion_model.").removesuffix(".lora_A.weight") + ".weight": torch.zeros(1)
               for k in sd if k.endswith(".lora_A.weight")}
    assert set(convert_flux3_transformer_checkpoint_to_diffusers(weights)) == {f"{m}.weight" for m in modules}
    back = _convert_non_diffusers_flux3_lora_to_diffusers(dict(sd))
    assert set(back) == {f"transformer.{m}.lora_{x}.weight" for m in modules for x in "AB"}
    for m in modules:
        b, a = back[f"transformer.{m}.lora_B.weight"], back[f"transformer.{m}.lora_A.weight"]
        torch.testing.assert_close(b @ a, d[m], rtol=1e-5, atol=1e-7, msg=m)


def test_krea2_comfyui_file_has_the_reference_names_comfyui_maps_at_the_trained_strength(runs):
    """ComfyUI's Krea 2 model keeps the reference checkpoint's names (comfy/ldm/krea2/model.py): blocks.i.attn.wq |
    wk | wv | gate | wo and blocks.i.mlp.gate | up | down. Its generic rule maps diffusion_model.<name> to
    <name>.weight, and with no .alpha key applies B·A at scale 1: alpha / r is folded into B. (diffusers' Krea 2
    converter reads the same file back: test_load_lora_weights_of_both_files_reproduces_the_trained_transformer.)"""
    sd, d = _comfyui_file_and_deltas("krea2", runs)
    names = {"attn.to_q": "attn.wq", "attn.to_k": "attn.wk", "attn.to_v": "attn.wv", "attn.to_gate": "attn.gate",
             "attn.to_out.0": "attn.wo", "ff.gate": "mlp.gate", "ff.up": "mlp.up", "ff.down": "mlp.down"}
    assert set(d) == {f"transformer_blocks.{i}.{m}" for i in range(4) for m in names}
    want = {f"diffusion_model.blocks.{i}.{c}": d[f"transformer_blocks.{i}.{m}"] for i in range(4)
            for m, c in names.items()}
    assert set(sd) == {f"{k}.lora_{x}.weight" for k in want for x in "AB"}
    for k, delta in want.items():
        torch.testing.assert_close(sd[f"{k}.lora_B.weight"] @ sd[f"{k}.lora_A.weight"], delta, rtol=1e-5, atol=1e-7,
                                   msg=k)


# ------------------------------------------------------------------ cache
@pytest.mark.parametrize("family", FAMILIES)
def test_editing_one_caption_re_encodes_that_caption_only(family, runs, tmp_path):
    from engine.families import get_family
    from engine.report.events import EventLog

    model_dir, job, reference, _ = runs[family]
    wd = reference
    data = tmp_path / "data"
    shutil.copytree(load_job(job).data.path, data)
    (data / "square-0.txt").write_text("a purple moon\n")
    cfg = load_job(job)
    cfg.data.path = str(data)
    work = tmp_path / "work"
    shutil.copytree(wd / "cache", work / "cache")
    family_ = get_family(family)
    family_.prepare(cfg, work, EventLog(tmp_path / "events.jsonl", to_stdout=False))
    assert family_.report.encoded == {"latent": [], "text": ["sks, a purple moon"]}


# ------------------------------------------------------------------ fp8 + block swapping
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_base_with_block_swapping_trains_on_the_tiny_model(family, runs, tmp_path):
    from engine.frozen_base.fp8 import FP8Linear
    from engine.recipe import train
    from tests.helpers.jobs import read_events

    model_dir, job, reference, _ = runs[family]
    d = deep_update(yaml.safe_load(job.read_text()), {"model": {"base_precision": "fp8"},
                                                       "train": {"steps": 2, "blocks_to_swap": 2}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    shutil.copytree(reference / "cache", tmp_path / "work" / "cache")  # same inputs: no encoding
    cfg = load_job(tmp_path / "job.yaml")
    assert train(cfg, tmp_path / "work", progress="none") == 0
    events = read_events(tmp_path / "work")
    (prec,) = [e for e in events if e["event"] == "base_precision"]
    (swap,) = [e for e in events if e["event"] == "block_swap"]
    assert prec["precision"] == "fp8" and prec["converted_layers"] > 0
    assert swap["swapped"] == 2 and swap["blocks"] == 4 and swap["host_bytes"] > 0
    lora = load_file(str(tmp_path / "work" / "output" / DIFFUSERS_FILE))
    untrained = {k for k, v in lora.items() if k.endswith("lora_B.weight") and not v.abs().sum() > 0}
    # Gradients reached every LoRA B (initialised to zero) through FP8 and swapped blocks — except, in
    # Qwen-Image, the last block's text queries and text-stream outputs, which the model discards.
    dead = r"transformer\.transformer_blocks\.3\.(attn\.(add_q_proj|to_add_out)|txt_mlp\..*)\.lora_B\.weight"
    assert untrained == ({k for k in untrained if re.fullmatch(dead, k)} if family == "qwen_image" else set())
    mem, _ = _trained_in_memory(family, tmp_path / "job.yaml", tmp_path / "work")
    assert isinstance(_first_q(mem).base_layer, FP8Linear)
    final = {"z_image": lambda: mem.all_final_layer["2-1"].linear,
             "krea2": lambda: mem.final_layer.linear}.get(family, lambda: mem.proj_out)()
    assert type(final) is torch.nn.Linear  # the final layer stays in the model dtype


# ------------------------------------------------------------------ samples
@pytest.mark.parametrize("family", FAMILIES)
def test_samples_render_with_the_current_lora_and_leave_training_bit_identical(family, runs, tmp_path):
    from engine.recipe import train

    _model, job, reference, _ = runs[family]
    ref = reference
    d = deep_update(yaml.safe_load(job.read_text()),
                    {"sample": {"every_steps": 2, "prompts": ["sks"], "steps": 2, "width": 32, "height": 32}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    shutil.copytree(ref / "cache", tmp_path / "work" / "cache")  # only the sample prompt is encoded
    assert train(load_job(tmp_path / "job.yaml"), tmp_path / "work", progress="none") == 0
    for step in (2, 4):
        assert (tmp_path / "work" / "samples" / f"step-{step:08d}" / "00.png").stat().st_size > 0
    # The model card shows the last step's samples, copied into output/ with it.
    out = tmp_path / "work" / "output"
    assert (out / "samples" / "00.png").read_bytes() == (tmp_path / "work" / "samples" / "step-00000004" / "00.png").read_bytes()
    assert "![sample 0](samples/00.png)" in (out / "README.md").read_text()
    # The renders ran on their own generators: the adapter trained is the one the run without samples trained.
    assert tensor_bytes(ref / "output" / DIFFUSERS_FILE) == tensor_bytes(tmp_path / "work" / "output" / DIFFUSERS_FILE)


# ------------------------------------------------------------------ job validation
@pytest.mark.parametrize("family,over,words", [
    ("flux2", {"lora": {"type": "lokr", "dropout": 0}}, ["lora.type", "flux2", "fuses q, k and v"]),
    ("qwen_image", {"model": {"path": "builtin:tiny-flux2"}}, ["model.path", "flux2 model", "qwen_image"]),
    ("qwen_image", {"data": {"seq_len": 64}}, ["data.seq_len", "qwen_image reads images"]),
    ("flux2", {"output": {"formats": ["peft"]}}, ["output.formats", "flux2 writes"]),
    ("z_image", {"lora": {"type": "dora"}, "output": {"formats": ["comfyui"]}}, ["lora.type", "dora", "diffusers"]),
    ("z_image", {"model": {"path": "builtin:tiny-qwen-image"}}, ["model.path", "qwen_image model", "z_image"]),
    ("chroma", {"train": {"batch_size": 2, "gradient_checkpointing": True}},
     ["train.batch_size, train.gradient_checkpointing", "drops the caption mask", "train.grad_accum"]),
    ("chroma", {"lora": {"type": "loha", "dropout": 0}, "output": {"formats": ["diffusers"]}},
     ["lora.type", "loha", "comfyui"]),
    ("flux3", {"model": {"path": "builtin:tiny-z-image"}}, ["model.path", "z_image model", "flux3"]),
    ("krea2", {"lora": {"type": "lokr", "dropout": 0}, "output": {"formats": ["diffusers"]}},
     ["lora.type", "lokr", "comfyui"]),
])
def test_a_job_key_that_does_not_fit_the_image_family_is_refused_naming_it(family, over, words, tmp_path):
    from engine.config.job import parse_job
    from engine.errors import JobInvalid

    data = make_images(tmp_path / "data", IMAGES[:1])
    d = job_dict(family, f"builtin:tiny-{family.replace('_', '-')}", data, **over)
    with pytest.raises(JobInvalid) as e:
        parse_job(d, tmp_path)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_the_builtin_tiny_pipelines_are_valid_job_targets(tmp_path):
    from engine.config.job import parse_job

    data = make_images(tmp_path / "data", IMAGES[:1])
    for family in FAMILIES:
        cfg = parse_job(job_dict(family, f"builtin:tiny-{family.replace('_', '-')}", data), tmp_path)
        assert cfg.output.formats == ["diffusers", "comfyui"] and cfg.model.family == family


def test_z_image_shift_is_the_schedulers_own_static_or_dynamic_shift():
    """Z-Image-Turbo's scheduler shifts by a fixed 3 (σ = 3t / (1 + 2t)); a dynamic one by calculate_shift's μ."""
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    from engine.families.image.z_image import ZImageModel

    m = ZImageModel()
    assert m.shift_mu({"shift": 3.0, "use_dynamic_shifting": False}, 4096) == pytest.approx(math.log(3.0))
    dynamic = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15}
    assert m.shift_mu(dynamic, 1024) == pytest.approx(calculate_shift(1024)) != m.shift_mu(dynamic, 4096)


def test_z_image_predicts_the_velocity_its_pipeline_integrates_and_ignores_caption_padding(runs):
    """predict (what the loss compares with ε − x0) is the velocity ZImagePipeline hands its scheduler: the
    transformer's output negated, at time 1 − σ, with each caption unpadded; padding values change nothing."""
    from diffusers import ZImagePipeline

    from engine.families.image.z_image import ZImageModel

    pipe = ZImagePipeline.from_pretrained(runs["z_image"][0], text_encoder=None, tokenizer=None)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 4, 4, generator=g)
    caption = torch.randn(9, pipe.transformer.config.cap_feat_dim, generator=g)
    with torch.no_grad():
        after = pipe(prompt_embeds=[caption], guidance_scale=0.0, sigmas=[0.6], latents=x.clone(),
                     height=32, width=32, output_type="latent").images
        sigma = pipe.scheduler.sigmas[0]  # 0.6 moved by the scheduler's static shift
        velocity = (after - x) / (0 - sigma)  # the Euler step x + (σ_next − σ)·v, σ_next = 0
        padded = torch.cat([caption, torch.randn(3, caption.shape[1], generator=g)])[None]
        mask = torch.tensor([[1] * 9 + [0] * 3])
        pred = ZImageModel().predict(pipe.transformer, pipe.transformer, x, sigma[None], padded, mask, None)
    assert float(sigma) == pytest.approx(3 * 0.6 / (1 + 2 * 0.6))
    torch.testing.assert_close(pred, velocity, rtol=1e-4, atol=1e-5)
