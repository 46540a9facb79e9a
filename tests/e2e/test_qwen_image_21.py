"""Qwen-Image 2.1 LoRA on its tiny random pipeline: killed twice and resumed bit-identical, both export files against
QwenImage21Pipeline's own loader and ComfyUI's key rules, and the model's conventions against its pipeline.

The killed-twice run (SIGKILL while caching, SIGKILL with a checkpoint half-written, then resumed) runs as real
forked trainers (tests/helpers/kill_chain.py) in the background while the same job trains uninterrupted here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.e2e.test_image_families import IMAGES, job_dict
from tests.helpers.images import make_images, tensor_bytes, with_last_checkpoint
from tests.helpers.kill_chain import Quiet, chains_beside_references

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "qwen_image_21_lora_comfyui.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from engine.builtin.tiny_qwen_image_21 import build_tiny_qwen_image_21

    path = tmp_path_factory.mktemp("tiny-qwen-image-21")
    build_tiny_qwen_image_21(path)
    return path


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """(job file, uninterrupted workdir, killed-twice future)."""
    root = tmp_path_factory.mktemp("qwen-image-21")
    job = root / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict("qwen_image_21", tiny, make_images(root / "data", IMAGES))))
    with chains_beside_references(root, {"q21": (job, job)}) as done:
        reference, killed = done["q21"]
        yield job, reference, killed


@pytest.fixture(scope="module")
def trained(run):
    """The LoRA transformer as training ended (the last checkpoint's adapter) and its per-module updates."""
    from engine.families import get_family

    job, reference, _ = run
    cfg = load_job(job)
    model = with_last_checkpoint(get_family("qwen_image_21").load_model(cfg, reference, torch.device("cpu"), Quiet()),
                                 reference)
    deltas = {n: m.get_delta_weight("default").detach() for n, m in model.named_modules() if hasattr(m, "lora_A")}
    return model, deltas


def _inputs(model, g: torch.Generator, text_len: int = 9) -> dict:
    """Fixed transformer inputs: a 4x6 latent (24 tokens, 6 vision slots) after a caption of text_len tokens."""
    c = model.config.in_channels
    return dict(hidden_states=torch.randn(1, 24, c, generator=g),
                encoder_hidden_states=torch.randn(1, text_len, model.config.context_in_dim, generator=g),
                timestep=torch.tensor([0.6]), img_shapes=[[(1, 4, 6)]],
                img_mask=torch.tensor([[False] * text_len + [True] * 6]), return_dict=False)


def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(run):
    _job, reference, killed = run
    wd, story = killed.result(timeout=900)
    for name in (DIFFUSERS_FILE, COMFY_FILE):
        want, got = tensor_bytes(reference / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got) and want, name
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"
    # A LoRA at every save: each committed checkpoint holds both files too.
    for step in sorted((reference / "checkpoints").glob("step-*")):
        assert {DIFFUSERS_FILE, COMFY_FILE} <= {p.name for p in (step / "export").iterdir()}, step


def test_load_lora_weights_of_both_files_reproduces_the_trained_transformer(run, trained, tiny):
    from diffusers import QwenImage21Pipeline

    _job, reference, _ = run
    mem, _ = trained
    x = _inputs(mem, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mem(**x)[0]
        pipe = QwenImage21Pipeline.from_pretrained(tiny, text_encoder=None, vae=None)
        base = pipe.transformer(**x)[0]
        pipe.load_lora_weights(str(reference / "output"), weight_name=DIFFUSERS_FILE)
        got = pipe.transformer(**x)[0]
        layer = pipe.transformer.transformer_blocks[0].img_mlp.gate_layer
        assert layer.scaling[next(iter(layer.scaling))] == 1.0  # alpha / r = 2 folded into lora_B
        pipe.unload_lora_weights()
        pipe.load_lora_weights(str(reference / "output"), weight_name=COMFY_FILE)  # bare names + .alpha: converted
        comfy = pipe.transformer(**x)[0]
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing; the test would prove nothing"
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"
    torch.testing.assert_close(comfy, want, rtol=1e-5, atol=1e-5)


def _comfyui_weights(tiny: Path) -> dict[str, torch.Tensor]:
    """The tiny transformer's weights as ComfyUI's Qwen-Image 2.1 model holds them: diffusion_model.<path>, each
    block's SwiGLU gate_layer and proj fused into one gate_up ([gate; up] by rows)."""
    sd = load_file(str(tiny / "transformer" / "diffusion_pytorch_model.safetensors"))
    out = {}
    for k, v in sd.items():
        if ".img_mlp.proj." in k:
            continue
        if ".img_mlp.gate_layer." in k:
            k, v = k.replace(".gate_layer.", ".gate_up."), torch.cat([v, sd[k.replace(".gate_layer.", ".proj.")]])
        out[f"diffusion_model.{k}"] = v
    return out


def _patched(sd: dict[str, torch.Tensor], prefix: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per ComfyUI weight, the update ComfyUI's LoRA loader adds: (alpha / r)·B·A per file key, 1 without .alpha,
    at the rows comfyui_target names (the family docstring's rules)."""
    from engine.families.image.qwen_image_21 import comfyui_target

    updates: dict[str, torch.Tensor] = {}
    for k in [k for k in sd if k.endswith(".lora_A.weight")]:
        key = k.removesuffix(".lora_A.weight")
        a, b = sd[k], sd[f"{key}.lora_B.weight"]
        scale = float(sd[f"{key}.alpha"]) / a.shape[0] if f"{key}.alpha" in sd else 1.0
        name = key.removeprefix(prefix)
        fused = weights.get(comfyui_target(name, 1)[0])
        weight, rows = comfyui_target(name, None if fused is None else fused.shape[0])
        assert weight in weights, f"{key} maps to {weight}, which ComfyUI's model does not have"
        delta = updates.setdefault(weight, torch.zeros_like(weights[weight]))
        start, n = rows or (0, delta.shape[0])
        delta[start:start + n] += scale * (b @ a)
    return updates


def test_both_files_map_through_comfyuis_rules_to_the_trained_update(run, trained, tiny):
    """ComfyUI's Qwen-Image 2.1 model fuses each SwiGLU's gate_layer and proj into gate_up; its key map takes the
    bare module paths (the ComfyUI file, with .alpha) and transformer.<path> (the diffusers file, alpha folded)
    and puts the two halves at their rows. Every key lands on a weight of the model, with the trained update."""
    _job, reference, _ = run
    _mem, d = trained
    weights = _comfyui_weights(tiny)
    want = {}
    for m, delta in d.items():
        if m.endswith(".img_mlp.gate_layer"):
            want[f"diffusion_model.{m.removesuffix('.gate_layer')}.gate_up.weight"] = torch.cat(
                [delta, d[m.replace(".gate_layer", ".proj")]])
        elif not m.endswith(".img_mlp.proj"):
            want[f"diffusion_model.{m}.weight"] = delta
    assert len(want) == 4 * 6  # 4 blocks: q, k, v, out, the fused gate_up and out
    comfy = load_file(str(reference / "output" / COMFY_FILE))
    assert {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in comfy} == set(d)
    for name, prefix in ((COMFY_FILE, ""), (DIFFUSERS_FILE, "transformer.")):
        got = _patched(load_file(str(reference / "output" / name)), prefix, weights)
        assert set(got) == set(want), name
        for w, delta in want.items():
            torch.testing.assert_close(got[w], delta, rtol=1e-5, atol=1e-7, msg=f"{name}: {w}")


def test_predict_is_the_velocity_qwenimage21pipeline_integrates_at_its_shift(tiny):
    """predict (what the loss compares with ε − x0) is the velocity QwenImage21Pipeline hands its scheduler — the
    last h·w rows of the transformer's output, at time σ, over the pipeline's packing and image slots — and `shift`
    is the pipeline's μ over the h·w unpatched tokens; padded caption tokens are never attended to."""
    from diffusers import QwenImage21Pipeline

    from engine.families.image.flow_lora import scheduler_settings
    from engine.families.image.qwen_image_21 import QwenImage21Model

    pipe = QwenImage21Pipeline.from_pretrained(tiny, text_encoder=None, vae=None)
    model = QwenImage21Model()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, pipe.transformer.config.in_channels, 2, 4, generator=g)  # a 32x64 image's latent
    caption = torch.randn(1, 9, pipe.transformer.config.context_in_dim, generator=g)
    packed = model.pack(x)
    with torch.no_grad():
        after = pipe(prompt_embeds=caption, sigmas=[0.6], latents=packed.clone(), height=32, width=64,
                     output_type="latent").images
        sigma = pipe.scheduler.sigmas[0]
        velocity = (after - packed) / (0 - sigma)  # the Euler step x + (σ_next − σ)·v, σ_next = 0
        pred = model.predict(pipe.transformer, pipe.transformer, x, sigma[None], caption, torch.ones(1, 9), None)
        mask = torch.tensor([[1] * 9 + [0] * 3])
        padded = [model.predict(pipe.transformer, pipe.transformer, x, sigma[None],
                                torch.cat([caption, torch.randn(1, 3, caption.shape[2], generator=g)], 1), mask, None)
                  for _ in range(2)]
    torch.testing.assert_close(pred, velocity, rtol=1e-4, atol=1e-5)
    mu = model.shift_mu(scheduler_settings(str(tiny), None), (2 // 2) * (4 // 2))  # ImageFamily's (h/2)·(w/2)
    assert float(sigma) == pytest.approx(math.exp(mu) / (math.exp(mu) + 1 / 0.6 - 1)) != pytest.approx(0.6)
    torch.testing.assert_close(padded[0], padded[1], rtol=0, atol=0)


def test_an_image_is_encoded_opaque_as_the_pipeline_encodes_its_rgba_images(tiny):
    """The 16x VAE reads RGBA: an RGB training image is the pipeline's RGBA conversion of it (alpha 255), encoded to
    the normalised posterior mode exactly as QwenImage21Pipeline._encode_vae_image does."""
    import numpy as np
    from diffusers import QwenImage21Pipeline
    from PIL import Image

    from engine.families.image.qwen_image_21 import QwenImage21Model

    pipe = QwenImage21Pipeline.from_pretrained(tiny, text_encoder=None, transformer=None)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 64, 3), dtype=np.uint8))
    rgb = torch.from_numpy(np.asarray(img)).permute(2, 0, 1)[None].float() / 127.5 - 1
    with torch.no_grad():
        want = pipe._encode_vae_image(pipe.image_processor.preprocess(img.convert("RGBA")).unsqueeze(2), None)
        got = QwenImage21Model().encode_latents(pipe, rgb)
    assert got.shape == (8, 2, 4)
    torch.testing.assert_close(got, want[0, :, 0], rtol=1e-5, atol=1e-6)


def test_edit_pairs_are_refused_at_submit_naming_data_control_path(tmp_path):
    """The docs' "left out": this family trains no image-conditioned (edit) LoRA."""
    from engine.config.job import parse_job
    from engine.errors import JobInvalid

    data = make_images(tmp_path / "data", IMAGES[:1])
    with pytest.raises(JobInvalid, match="data.control_path: not read by model.family qwen_image_21"):
        parse_job(job_dict("qwen_image_21", "builtin:tiny-qwen-image-21", data, data={"control_path": str(data)}),
                  tmp_path)


def test_a_directory_whose_qwen3vl_processor_needs_torchvision_encodes_captions_the_same(tiny, tmp_path):
    """The real checkpoint's processor is a Qwen3VLProcessor, which transformers builds only with torchvision (its
    video processor); lorad installs none. The family then reads the directory's own tokenizer and chat template,
    and the captions' embeddings are the ones the tiny processor gives."""
    import json
    import shutil

    from transformers import AutoProcessor

    from engine.families.image.qwen_image_21.family import load_pipeline

    real = tmp_path / "real"
    shutil.copytree(tiny, real)
    config = json.loads((real / "processor" / "processor_config.json").read_text())
    config.update(processor_class="Qwen3VLProcessor", video_processor={
        "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2})
    (real / "processor" / "processor_config.json").write_text(json.dumps(config))
    index = json.loads((real / "model_index.json").read_text())
    (real / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen3VLProcessor"]}))
    with pytest.raises(ImportError):
        AutoProcessor.from_pretrained(real, subfolder="processor")
    want, got = (load_pipeline(str(p), None, torch.float32, ("text_encoder",)) for p in (tiny, real))
    with torch.no_grad():
        torch.testing.assert_close(got.encode_prompt("sks, a red square", device="cpu")[0],
                                   want.encode_prompt("sks, a red square", device="cpu")[0], rtol=0, atol=0)


def test_the_trainer_refuses_a_base_of_another_pipeline_it_could_not_check_at_submit(tmp_path):
    """A hub id is checked only when the trainer has its model_index.json: the same refusal, before any weight."""
    import json

    from engine.config.job import parse_job
    from engine.errors import JobInvalid
    from engine.families import get_family

    base = tmp_path / "qwen-image"
    (base / "transformer").mkdir(parents=True)
    (base / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    cfg = parse_job(job_dict("qwen_image_21", base, make_images(tmp_path / "data", IMAGES[:1])), tmp_path,
                    check_paths=False)
    with pytest.raises(JobInvalid, match=r"^model\.family: qwen_image_21 trains Qwen-Image 2\.1 .* is a "
                                         r"QwenImagePipeline"):
        get_family("qwen_image_21").load_model(cfg, tmp_path, torch.device("cpu"), Quiet())


def test_fp8_base_with_block_swapping_and_samples_train_on_the_tiny_model(run, tmp_path):
    """base_precision fp8 (the embedders, modulation and output layers kept in the model dtype) with two of the four
    blocks swapped, rendering samples through the pipeline's own call (which has no guidance_scale) at every save."""
    import shutil

    from engine.recipe import train
    from tests.helpers.jobs import deep_update, read_events

    job, reference, _ = run
    d = deep_update(yaml.safe_load(job.read_text()), {
        "model": {"base_precision": "fp8"}, "train": {"steps": 2, "blocks_to_swap": 2},
        "sample": {"every_steps": 2, "prompts": ["sks"], "steps": 2, "width": 32, "height": 64, "guidance": 2.0}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    shutil.copytree(reference / "cache", tmp_path / "work" / "cache")  # same inputs: only the sample prompt encodes
    assert train(load_job(tmp_path / "job.yaml"), tmp_path / "work", progress="none") == 0
    events = read_events(tmp_path / "work")
    (prec,) = [e for e in events if e["event"] == "base_precision"]
    (swap,) = [e for e in events if e["event"] == "block_swap"]
    assert prec["converted_layers"] == 4 * 7 and "modulation.1" in prec["skipped_layers"]
    assert swap["swapped"] == 2 and swap["blocks"] == 4
    from PIL import Image

    with Image.open(tmp_path / "work" / "samples" / "step-00000002" / "00.png") as im:
        assert im.size == (32, 64) and im.mode == "RGBA"  # the RGBA VAE's image, as the pipeline returns it
