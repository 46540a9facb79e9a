"""Ideogram 4 LoRA on the tiny random pipeline: killed twice and resumed bit-identical, both export files through the
pipeline's own loader and through the ComfyUI rules the family docstring writes down, and the family's layout, time
and sign against Ideogram4Pipeline itself.

The killed-twice chain (tests/helpers/kill_chain.py: SIGKILL while caching, SIGKILL with a checkpoint half-written,
resumed) runs in forked trainers while the same job trains uninterrupted here; the other tests read that run's files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.helpers.images import make_images, tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references

IMAGES = [("wide-0.png", 48, 24, "a red square on grass"), ("tall-0.png", 20, 40, "a green tower"),
          ("square-0.png", 32, 32, "a yellow sun")]
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "ideogram4_lora_comfyui.safetensors"


def job_dict(model_dir, data_dir: Path, **over) -> dict:
    d = {
        "name": "tiny-ideogram4",
        "model": {"family": "ideogram4", "path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data_dir), "resolution": [32], "trigger": "sks", "caption_dropout": 0.3, "flip": True},
        "train": {"steps": 4, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw",
                  "seed": 3, "timestep_sampling": "shift"},
        "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }
    return deep_update(d, over)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from engine.builtin.tiny_ideogram4 import build_tiny_ideogram4

    path = tmp_path_factory.mktemp("tiny-ideogram4")
    build_tiny_ideogram4(path)
    return path


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """(job file, uninterrupted workdir, killed-twice future); the chain runs while the reference trains."""
    root = tmp_path_factory.mktemp("ideogram4-run")
    data = make_images(root / "data", IMAGES)
    job = root / "ideogram4.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny, data)))
    with chains_beside_references(root, {"ideogram4": (job, job)}) as done:
        yield (job, *done["ideogram4"])


@pytest.fixture(scope="module")
def pipe(tiny):
    from diffusers import Ideogram4Pipeline

    p = Ideogram4Pipeline.from_pretrained(tiny)
    p.set_progress_bar_config(disable=True)
    return p


def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(run):
    _job, reference, killed = run
    wd, story = killed.result(timeout=900)
    for name in (DIFFUSERS_FILE, COMFY_FILE):
        want, got = tensor_bytes(reference / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got) and want
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"


def _trained(job: Path, wd: Path):
    from engine.families import get_family

    model = get_family("ideogram4").load_model(load_job(job), wd, torch.device("cpu"), Quiet())
    return with_last_checkpoint(model, wd)


def _inputs(model) -> dict:
    """A packed [9 text | 2x3 image] sequence in the pipeline's layout, model time 0.4."""
    from diffusers import Ideogram4Pipeline

    g = torch.Generator().manual_seed(0)
    pos, seg, ind = Ideogram4Pipeline._prepare_ids([7], 2, 3, 9, "cpu")
    text = torch.randn(1, 15, model.config.llm_features_dim, generator=g)
    return dict(hidden_states=torch.randn(1, 15, model.config.in_channels, generator=g), timestep=torch.tensor([0.4]),
                encoder_hidden_states=text, position_ids=pos, segment_ids=seg, indicator=ind, return_dict=False)


def test_load_lora_weights_of_both_files_reproduces_the_trained_transformer(run, pipe):
    """Ideogram4Pipeline.load_lora_weights: the diffusers file gives the trained transformer bit for bit (alpha / r =
    2 folded into lora_B); the ComfyUI file, through diffusers' own converter for the original names, up to rounding."""
    job, wd, _ = run
    mem = _trained(job, wd)
    x = _inputs(mem)
    with torch.no_grad():
        want = mem(**x)[0]
        base = pipe.transformer(**x)[0]
        pipe.load_lora_weights(str(wd / "output"), weight_name=DIFFUSERS_FILE)
        got = pipe.transformer(**x)[0]
        pipe.unload_lora_weights()
        pipe.load_lora_weights(str(wd / "output"), weight_name=COMFY_FILE)
        comfy = pipe.transformer(**x)[0]
        pipe.unload_lora_weights()
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing; the test would prove nothing"
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"
    torch.testing.assert_close(comfy, want, rtol=1e-5, atol=1e-5)


def _as_comfyui(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight updates ComfyUI's generic rule makes of the file, as the family docstring writes it: each
    diffusion_model.<name> patches <name>.weight by (alpha / rows of lora_A)·B·A (scale 1 without .alpha)."""
    out = {}
    for key in (k.removesuffix(".lora_A.weight") for k in sd if k.endswith(".lora_A.weight")):
        a, b, alpha = sd[f"{key}.lora_A.weight"], sd[f"{key}.lora_B.weight"], sd.get(f"{key}.alpha")
        assert key.startswith("diffusion_model."), key
        out[key.removeprefix("diffusion_model.") + ".weight"] = (float(alpha) / a.shape[0] if alpha is not None
                                                                 else 1.0) * (b @ a)
    return out


def test_comfyui_file_patches_the_checkpoints_fused_weights_at_the_trained_strength(run):
    """Per the docstring's table: layers.i.attention.qkv (rows q, k, v), attention.o, feed_forward.w1-3. Every name
    is a weight of the original checkpoint layout: diffusers' converter for that layout maps each back to the module
    trained (checked bit for bit through the loader above)."""
    from engine.families.image.ideogram4.family import comfyui_name

    job, wd, _ = run
    mem = _trained(job, wd)
    d = {n: m.get_delta_weight("default").detach() for n, m in mem.named_modules() if hasattr(m, "lora_A")}
    assert set(d) == {f"layers.{i}.{m}" for i in range(4) for m in ("attention.to_q", "attention.to_k",
                                                                      "attention.to_v", "attention.to_out.0",
                                                                      "feed_forward.w1", "feed_forward.w2",
                                                                      "feed_forward.w3")}
    want = {}
    for i in range(4):
        b = f"layers.{i}."
        want[f"{b}attention.qkv.weight"] = torch.cat([d[f"{b}attention.to_{x}"] for x in "qkv"])
        want[f"{b}attention.o.weight"] = d[f"{b}attention.to_out.0"]
        for w in ("w1", "w2", "w3"):
            want[f"{b}feed_forward.{w}.weight"] = d[f"{b}feed_forward.{w}"]
    sd = load_file(str(wd / "output" / COMFY_FILE))
    patches = _as_comfyui(sd)
    assert sorted(patches) == sorted(want)
    assert {comfyui_name(m) + ".weight" for m in d} == set(want)
    for k, v in want.items():
        torch.testing.assert_close(patches[k], v, rtol=1e-5, atol=1e-7, msg=k)
    assert {float(v) for k, v in sd.items() if k.endswith("qkv.alpha")} == {24.0}  # 3·alpha over 3·r rows


def test_predict_is_the_velocity_the_pipeline_integrates_and_ignores_caption_padding(pipe):
    """predict (what the loss compares with ε − x0) is the velocity Ideogram4Pipeline hands its scheduler (the
    conditional transformer's output negated, at model time 1 − σ, in the pipeline's packed layout), for a caption
    padded at the end of a batch; the padding's values change nothing."""
    from engine.families.image.ideogram4.family import CachedCaption, Ideogram4Model, cached_prompt_pipeline

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 4, 4, generator=g)
    caption = torch.randn(9, pipe.transformer.config.llm_features_dim, generator=g)
    model, sampler = Ideogram4Model(), cached_prompt_pipeline(pipe)
    with torch.no_grad():
        # One step at guidance 1: the blend is the conditional velocity alone, x_next = x + (0 − σ)·(−v_model).
        after = sampler(CachedCaption(caption), height=32, width=32, num_inference_steps=1, guidance_scale=1.0,
                        guidance_schedule=None, max_sequence_length=9, latents=model.pack(x),
                        output_type="latent").images
        sigma = sampler.scheduler.sigmas[0]
        velocity = (after - model.pack(x)) / (0 - sigma)
        padded = torch.cat([caption, torch.randn(3, caption.shape[1], generator=g)])[None]
        pred = model.predict(pipe.transformer, pipe.transformer, x, sigma[None], padded,
                             torch.tensor([[1] * 9 + [0] * 3]), None)
    torch.testing.assert_close(pred, velocity, rtol=1e-4, atol=1e-5)


def test_cached_latents_decode_through_the_pipelines_own_unpatch_and_denormalisation(pipe):
    """encode_latents (the cache) packed by `pack` is what Ideogram4Pipeline decodes: handed to the pipeline as its
    final latents, it decodes to the VAE's own decode of the posterior mode (batch-norm statistics undone, patches
    in the pipeline's order)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import retrieve_latents

    from engine.families.image.ideogram4.family import CachedCaption, Ideogram4Model, cached_prompt_pipeline

    model = Ideogram4Model()
    pixels = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(2)) * 2 - 1
    with torch.no_grad():
        cached = model.encode_latents(pipe, pixels)
        want = pipe.vae.decode(retrieve_latents(pipe.vae.encode(pixels), sample_mode="argmax")).sample
        got = cached_prompt_pipeline(pipe)(
            CachedCaption(torch.zeros(2, pipe.transformer.config.llm_features_dim)), height=32, width=48,
            num_inference_steps=1, guidance_scale=1.0, guidance_schedule=None, max_sequence_length=2,
            callback_on_step_end=lambda p, i, t, kw: {"latents": model.pack(cached[None])}, output_type="pt").images
    assert cached.shape == (4, 4, 6)
    torch.testing.assert_close(got, pipe.image_processor.postprocess(want, output_type="pt"), rtol=1e-4, atol=1e-5)


def test_the_cached_prompt_sampler_renders_what_the_pipeline_renders_from_the_caption(pipe):
    """The sampler (encode_prompt answered from the cache) against Ideogram4Pipeline encoding the caption itself:
    the same image; and the cache's encoding at the caption's own length is the pipeline's padded one."""
    from engine.families.image.ideogram4.family import CachedCaption, Ideogram4Model, cached_prompt_pipeline

    text = "sks, a red square"
    feats = Ideogram4Model().encode_text(pipe, text, 96, torch.device("cpu"))
    n = feats.shape[0]
    # Encoded at the caption's own length: the real tokens of the pipeline's encoding left-padded to 96.
    emb, _pos, _seg, ind = pipe.encode_prompt(text, 1, 1, 96, torch.device("cpu"))
    torch.testing.assert_close(feats, emb[0, :96][ind[0, :96] == 3], rtol=1e-5, atol=1e-6)
    common = dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.0, guidance_schedule=None,
                  max_sequence_length=n, output_type="pt")
    with torch.no_grad():
        want = pipe(text, generator=torch.Generator().manual_seed(4), **common).images
        got = cached_prompt_pipeline(pipe)(CachedCaption(feats), generator=torch.Generator().manual_seed(4),
                                           **common).images
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fp8_base_with_block_swapping_trains_and_samples_render(run, tmp_path):
    """base_precision fp8 with two blocks swapped trains (every LoRA B moved off zero, the final layer kept in the
    model dtype), and sample.prompts render through the cached-prompt pipeline with the unconditional transformer."""
    from engine.frozen_base.fp8 import FP8Linear
    from engine.recipe import train
    from tests.helpers.jobs import read_events

    job, reference, _ = run
    d = deep_update(yaml.safe_load(job.read_text()), {
        "model": {"base_precision": "fp8"}, "train": {"steps": 2, "blocks_to_swap": 2},
        "sample": {"every_steps": 2, "prompts": ["sks"], "steps": 2, "width": 32, "height": 32, "guidance": 3.0}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    shutil.copytree(reference / "cache", tmp_path / "work" / "cache")  # only the sample prompt is encoded
    assert train(load_job(tmp_path / "job.yaml"), tmp_path / "work", progress="none") == 0
    events = read_events(tmp_path / "work")
    (prec,) = [e for e in events if e["event"] == "base_precision"]
    (swap,) = [e for e in events if e["event"] == "block_swap"]
    assert prec["precision"] == "fp8" and prec["converted_layers"] > 0 and swap["swapped"] == 2
    lora = load_file(str(tmp_path / "work" / "output" / DIFFUSERS_FILE))
    assert all(v.abs().sum() > 0 for k, v in lora.items() if k.endswith("lora_B.weight"))
    mem = _trained(tmp_path / "job.yaml", tmp_path / "work")
    assert isinstance(mem.layers[0].attention.to_q.base_layer, FP8Linear)
    assert type(mem.final_layer.linear) is torch.nn.Linear
    assert (tmp_path / "work" / "samples" / "step-00000002" / "00.png").stat().st_size > 0
    # The unconditional transformer renders in the base's fp8 too.
    from engine.families.image.ideogram4.family import Ideogram4Model

    pipe = Ideogram4Model().sample_pipeline(str(load_job(job).model.path), load_job(tmp_path / "job.yaml"), mem)
    assert isinstance(pipe.unconditional_transformer.layers[0].attention.to_q, FP8Linear)


def test_a_caption_longer_than_the_pipeline_reads_is_refused_naming_it(pipe):
    from engine.errors import JobInvalid
    from engine.families.image.ideogram4.family import Ideogram4Model

    with pytest.raises(JobInvalid) as e:
        Ideogram4Model().encode_text(pipe, "sks, " + "a red square " * 8, 24, torch.device("cpu"))
    assert "caption is too long for Ideogram 4" in str(e.value) and "sks, a red square" in str(e.value)


def test_diffusers_converter_refuses_comfyui_keys_outside_the_blocks():
    """What the docs say of lora.targets beyond layers.i: ComfyUI's generic rule would map them, diffusers' converter
    for the original names does not."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers

    sd = {"diffusion_model.input_proj.lora_A.weight": torch.zeros(2, 16),
          "diffusion_model.input_proj.lora_B.weight": torch.zeros(32, 2)}
    with pytest.raises(ValueError, match="unsupported Ideogram4 LoRA layout"):
        _convert_non_diffusers_ideogram4_lora_to_diffusers(sd)


def test_the_model_card_says_comfyuis_rules_were_not_checked(run):
    _job, wd, _ = run
    card = (wd / "output" / "README.md").read_text()
    assert COMFY_FILE in card and "ComfyUI's Ideogram 4 key rules were not available to check." in card
