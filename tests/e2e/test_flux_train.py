"""Flux LoRA end to end on a tiny random pipeline: exact resume, files diffusers and ComfyUI load, samples."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.config.job import load_job
from engine.families.image.flux import apply_lora
from engine.families.image.flux_export import COMFYUI_FILE, DIFFUSERS_FILE
from tests.helpers import images as fh
from tests.helpers.forked import ForkedTrainer, run_to_end
from tests.helpers.processes import REPO

flux_job = fh.flux_job  # shared session fixture
tiny_flux = fh.tiny_flux  # shared session fixture

OUTPUTS = (DIFFUSERS_FILE, COMFYUI_FILE)


_tensor_bytes = fh.tensor_bytes


@pytest.fixture(scope="module")
def reference(tmp_path_factory, flux_job):
    """One uninterrupted run of flux_job, a forked trainer started here: the kill chain runs beside it."""
    t = ForkedTrainer(flux_job, tmp_path_factory.mktemp("flux-uninterrupted") / "work")
    yield t
    if t.alive():  # a test failed before waiting for it
        t.kill()


def _finished(reference: ForkedTrainer) -> Path:
    assert reference.finish(timeout=300) == 0, reference.events[-5:]
    return reference.events_file.parent


@pytest.fixture
def flux_uninterrupted(reference) -> Path:
    """The workdir of the finished uninterrupted run."""
    return _finished(reference)


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


# ------------------------------------------------------------------ resume
def test_killed_while_caching_and_while_training_then_resumed_is_bit_identical(flux_job, reference, tmp_path):
    wd = tmp_path / "work"
    # 1. SIGKILL in the middle of encoding the cache
    t = ForkedTrainer(flux_job, wd)
    t.wait_for(lambda: any(e.get("event") == "cache_progress" and e["done"] >= 4 for e in t.events), timeout=180)
    t.kill()
    # 2. the committed encodings are reused; SIGKILL at a random step after the first checkpoint
    k = random.randint(4, 10)
    t = ForkedTrainer(flux_job, wd)
    t.wait_step(k, timeout=180)
    # checkpoints are written in the background: make sure one is committed before the kill
    t.wait_for(lambda: bool(t.named("checkpoint_committed")), timeout=180)
    t.kill()
    saved = max(e["step"] for e in t.named("checkpoint_committed"))
    start = t.named("cache_start")[0]
    assert start["reused"] >= 4, start
    # 3. resumed to the end
    t = run_to_end(flux_job, wd, timeout=300)
    assert t.named("cache_start")[0]["to_encode"] == 0
    resumed = t.named("resumed")
    assert resumed and resumed[0]["from_step"] >= saved, (k, saved, resumed)
    for name in OUTPUTS:
        ref, got = _tensor_bytes(_finished(reference) / "output" / name), _tensor_bytes(wd / "output" / name)
        assert sorted(ref) == sorted(got)
        assert [key for key in ref if ref[key] != got[key]] == [], f"{name} differs after SIGKILL at step {k}"


# ------------------------------------------------------------------ the diffusers file
def _inputs():
    """Fixed transformer inputs: a 4x6 latent (2x3 packed tokens of 16 channels), 32 text tokens."""
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 4, 4, 6, generator=g)
    return dict(
        hidden_states=FluxPipeline._pack_latents(lat, 1, 4, 4, 6),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, 2, 3, "cpu", torch.float32),
        encoder_hidden_states=torch.randn(1, 32, 32, generator=g),
        txt_ids=torch.zeros(32, 3),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.6]),
        guidance=torch.tensor([3.5]),
        return_dict=False,
    )


def _trained_in_memory(tiny_flux, job, workdir):
    """The peft-wrapped transformer with the final checkpoint's LoRA weights (what training ended with)."""
    from diffusers import FluxTransformer2DModel

    cfg = load_job(job)
    model = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer")
    apply_lora(model, cfg)
    return fh.with_last_checkpoint(model, workdir), cfg


def test_load_lora_weights_reproduces_the_trained_model_exactly(tiny_flux, flux_job, flux_uninterrupted):
    from diffusers import FluxPipeline

    mem, cfg = _trained_in_memory(tiny_flux, flux_job, flux_uninterrupted)
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    x = _inputs()
    with torch.no_grad():
        base = pipe.transformer(**x)[0]
        want = mem(**x)[0]
        pipe.load_lora_weights(str(flux_uninterrupted / "output"))
        got = pipe.transformer(**x)[0]
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing; the test would prove nothing"
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"
    # alpha/rank honoured: scale alpha / r = 8 / 4
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert layer.scaling[next(iter(layer.scaling))] == cfg.lora.alpha / cfg.lora.rank == 2.0
    md = _metadata(flux_uninterrupted / "output" / DIFFUSERS_FILE)
    assert md["rank"] == "4" and md["alpha"] == "8.0" and md["steps"] == "12" and md["trigger"] == "sks"
    assert md["base_model"] == str(tiny_flux) and len(md["dataset_hash"]) == 16 and md["lorad_version"]
    alphas = {k: float(v) for k, v in load_file(str(flux_uninterrupted / "output" / DIFFUSERS_FILE)).items()
              if k.endswith(".alpha")}
    assert len(alphas) == 17 and set(alphas.values()) == {8.0}


# ------------------------------------------------------------------ the ComfyUI file
# ComfyUI maps `lora_unet_<BFL name with _>` to `diffusion_model.<BFL name>.weight` and adds
# (alpha / lora_down.shape[0]) * lora_up @ lora_down to that weight.
EXPECTED_COMFY = {
    "double_blocks_0_img_attn_qkv": 3, "double_blocks_0_img_attn_proj": 1, "double_blocks_0_txt_attn_qkv": 3,
    "double_blocks_0_txt_attn_proj": 1, "double_blocks_0_img_mlp_0": 1, "double_blocks_0_img_mlp_2": 1,
    "double_blocks_0_txt_mlp_0": 1, "double_blocks_0_txt_mlp_2": 1, "single_blocks_0_linear1": 4,
    "single_blocks_0_linear2": 1,
}


def _delta(layer) -> torch.Tensor:
    return layer.get_delta_weight("default").detach()


def _bfl_delta(model, target: str) -> torch.Tensor:
    """The update of BFL module `target`, assembled from the diffusers model's per-module LoRA deltas."""
    db = model.transformer_blocks[0]
    sb = model.single_transformer_blocks[0]
    a = db.attn

    def d(layer):
        return _delta(layer) if hasattr(layer, "lora_A") else torch.zeros_like(layer.weight)

    return {
        "double_blocks_0_img_attn_qkv": lambda: torch.cat([d(a.to_q), d(a.to_k), d(a.to_v)]),
        "double_blocks_0_img_attn_proj": lambda: d(a.to_out[0]),
        "double_blocks_0_txt_attn_qkv": lambda: torch.cat([d(a.add_q_proj), d(a.add_k_proj), d(a.add_v_proj)]),
        "double_blocks_0_txt_attn_proj": lambda: d(a.to_add_out),
        "double_blocks_0_img_mlp_0": lambda: d(db.ff.net[0].proj),
        "double_blocks_0_img_mlp_2": lambda: d(db.ff.net[2]),
        "double_blocks_0_txt_mlp_0": lambda: d(db.ff_context.net[0].proj),
        "double_blocks_0_txt_mlp_2": lambda: d(db.ff_context.net[2]),
        "double_blocks_0_img_mod_lin": lambda: d(db.norm1.linear),
        "single_blocks_0_linear1": lambda: torch.cat([d(sb.attn.to_q), d(sb.attn.to_k), d(sb.attn.to_v), d(sb.proj_mlp)]),
        "single_blocks_0_linear2": lambda: d(sb.proj_out),
        "img_in": lambda: d(model.x_embedder),
        "guidance_in_in_layer": lambda: d(model.time_text_embed.guidance_embedder.linear_1),
        "final_layer_linear": lambda: d(model.proj_out),
        # BFL's final modulation emits (shift, scale); diffusers' norm_out emits (scale, shift)
        "final_layer_adaLN_modulation_1": lambda: torch.cat(d(model.norm_out.linear).chunk(2)[::-1]),
    }[target]()


def _comfy_deltas(path: Path) -> dict[str, torch.Tensor]:
    sd = load_file(str(path))
    out = {}
    for k in sd:
        if k.endswith(".lora_down.weight"):
            name = k[: -len(".lora_down.weight")]
            down, up, alpha = sd[k], sd[name + ".lora_up.weight"], float(sd[name + ".alpha"])
            out[name.removeprefix("lora_unet_")] = (alpha / down.shape[0]) * (up @ down)
    return out


def test_the_comfyui_file_has_comfyuis_flux_names_alphas_and_the_same_update(tiny_flux, flux_job, flux_uninterrupted):
    path = flux_uninterrupted / "output" / COMFYUI_FILE
    sd = load_file(str(path))
    names = {k.split(".")[0].removeprefix("lora_unet_") for k in sd}
    assert names == set(EXPECTED_COMFY)
    for name, parts in EXPECTED_COMFY.items():
        # a fused linear of k trained parts is one rank-k*r LoRA with alpha k*alpha: alpha'/r' = alpha/r
        assert float(sd[f"lora_unet_{name}.alpha"]) == 8.0 * parts
        assert sd[f"lora_unet_{name}.lora_down.weight"].shape[0] == 4 * parts
    md = _metadata(path)
    assert md["ss_network_dim"] == "4" and md["ss_network_alpha"] == "8.0" and md["trigger"] == "sks"
    mem, _ = _trained_in_memory(tiny_flux, flux_job, flux_uninterrupted)
    for name, delta in _comfy_deltas(path).items():
        torch.testing.assert_close(delta, _bfl_delta(mem, name), rtol=1e-5, atol=1e-7)


def test_partial_and_non_default_targets_map_to_comfyui_exactly(tiny_flux, tmp_path):
    """A subset of q/k/v (zeros for the rest), embedders, the final layer and its swapped modulation halves."""
    from diffusers import FluxTransformer2DModel

    from engine.families.image.flux_export import export
    from tests.helpers.images import make_images, write_flux_job

    targets = (r"^(transformer_blocks\.0\.(attn\.(to_k|add_v_proj)|norm1\.linear)|single_transformer_blocks\.0\."
               r"(attn\.to_v|proj_mlp)|x_embedder|proj_out|norm_out\.linear|time_text_embed\.guidance_embedder\.linear_1)$")
    job = write_flux_job(tmp_path / "job.yaml", tiny_flux, make_images(tmp_path / "data"), lora={"targets": targets})
    cfg = load_job(job)
    model = FluxTransformer2DModel.from_pretrained(tiny_flux, subfolder="transformer")
    apply_lora(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at zero; give every module a real update
    out = tmp_path / "out"
    out.mkdir()
    assert export(model, cfg, out, {"steps": 0}) == [DIFFUSERS_FILE, COMFYUI_FILE]
    deltas = _comfy_deltas(out / COMFYUI_FILE)
    assert set(deltas) == {"double_blocks_0_img_attn_qkv", "double_blocks_0_txt_attn_qkv", "double_blocks_0_img_mod_lin",
                           "single_blocks_0_linear1", "img_in", "final_layer_linear",
                           "final_layer_adaLN_modulation_1", "guidance_in_in_layer"}
    alphas = {k: float(v) for k, v in load_file(str(out / COMFYUI_FILE)).items() if k.endswith(".alpha")}
    assert alphas["lora_unet_single_blocks_0_linear1.alpha"] == 16.0  # two of four parts trained
    for name, delta in deltas.items():
        torch.testing.assert_close(delta, _bfl_delta(model, name), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ samples
def test_sample_pngs_are_rendered_at_the_configured_steps_and_listed_in_an_event(flux_uninterrupted):
    from PIL import Image

    events = [json.loads(line) for line in (flux_uninterrupted / "events.jsonl").read_text().splitlines()]
    samples = [e for e in events if e["event"] == "samples"]
    assert [e["step"] for e in samples] == [4, 8, 12]
    for e in samples:
        (path,) = e["paths"]
        assert Path(path) == flux_uninterrupted / "samples" / f"step-{e['step']:08d}" / "00.png"
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size == (48, 32)
    # the same seed renders different images as the LoRA changes
    first, last = (Image.open(samples[i]["paths"][0]).tobytes() for i in (0, -1))
    assert first != last


def test_a_sample_step_is_committed_before_its_images_and_every_prompt_is_a_heartbeat(flux_uninterrupted):
    # A render killed by the hang timeout (or anything else) must not cost the step: the retry goes on past it.
    events = [json.loads(line) for line in (flux_uninterrupted / "events.jsonl").read_text().splitlines()]
    for s in (4, 8, 12):  # sample steps; checkpoint.every_steps is 3, so 4 and 8 are saved for the samples alone
        at = [i for i, e in enumerate(events) if e.get("step") == s]
        kinds = [events[i]["event"] for i in at]
        assert kinds.index("checkpoint_committed") < kinds.index("heartbeat") < kinds.index("samples")
        beats = [events[i] for i in at if events[i]["event"] == "heartbeat"]
        assert [(b["phase"], b["prompt"], b["prompts"]) for b in beats] == [("samples", 0, 1)]


def test_rendering_samples_does_not_change_training(tiny_flux, flux_job, flux_uninterrupted, tmp_path):
    """Same job without samples, in process: the adapter is bit-identical to the run that rendered them."""
    import yaml

    from engine.recipe import train

    d = yaml.safe_load(flux_job.read_text())
    d["sample"] = {}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(d))
    # the cache is not what is under test here: start from the reference run's (saves encoding time)
    shutil.copytree(flux_uninterrupted / "cache", tmp_path / "work" / "cache")
    assert train(load_job(job), tmp_path / "work", progress="none") == 0
    assert not (tmp_path / "work" / "samples").exists()
    ref = _tensor_bytes(flux_uninterrupted / "output" / DIFFUSERS_FILE)
    assert _tensor_bytes(tmp_path / "work" / "output" / DIFFUSERS_FILE) == ref


@pytest.mark.slow
def test_the_shipped_tiny_flux_job_runs_to_its_outputs(tmp_path):
    from engine.recipe import train

    repo = REPO
    cfg = load_job(repo / "configs/examples/flux-lora-tiny.yaml")
    cfg.train.steps = cfg.sample.every_steps = 4  # the shipped keys, fewer steps (CPU time is shared)
    assert train(cfg, tmp_path / "work", progress="none") == 0
    from engine.checkpoint.output import OUTPUT_STAMP

    out = tmp_path / "work" / "output"
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUTS, OUTPUT_STAMP, "README.md", "samples"])
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["00.png", "01.png"]  # the model card's
    assert (tmp_path / "work" / "samples" / "step-00000004" / "00.png").is_file()


def test_an_fp8_base_with_activation_checkpointing_trains_and_exports_on_the_cpu(tiny_flux, tmp_path):
    """base_precision: fp8 swaps the frozen linears for FP8 layers (dequantising matmul on a CPU) under the LoRA."""
    from engine.recipe import train
    from tests.helpers.images import make_images, write_flux_job

    job = write_flux_job(tmp_path / "job.yaml", tiny_flux, make_images(tmp_path / "data"),
                         model={"base_precision": "fp8"}, train={"steps": 2, "gradient_checkpointing": True})
    assert train(load_job(job), tmp_path / "work", progress="none") == 0
    # gradients reached every LoRA B (initialised to zero) through the checkpointed blocks
    lora = load_file(str(tmp_path / "work" / "output" / DIFFUSERS_FILE))
    assert all(v.abs().sum() > 0 for k, v in lora.items() if k.endswith("lora_B.weight"))
    events = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()]
    (prec,) = [e for e in events if e["event"] == "base_precision"]
    assert prec["precision"] == "fp8" and prec["converted_layers"] > 0
    # the single blocks' large proj_out is FP8 under its LoRA; the top-level proj_out (final layer) is not
    from engine.families.image.flux import Flux
    from engine.frozen_base.fp8 import FP8Linear

    class Quiet:
        def info(self, *a, **k):
            pass

    model = Flux().load_model(load_job(job), tmp_path / "work", torch.device("cpu"), Quiet())
    assert isinstance(model.single_transformer_blocks[0].proj_out.base_layer, FP8Linear)
    assert type(model.proj_out) is torch.nn.Linear and type(model.x_embedder) is torch.nn.Linear
    comfy = load_file(str(tmp_path / "work" / "output" / COMFYUI_FILE))
    assert set(k.split(".")[0].removeprefix("lora_unet_") for k in comfy) == set(EXPECTED_COMFY)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal; on a GPU nf4 loads")
def test_nf4_on_a_machine_without_a_gpu_is_an_invalid_job_naming_the_key(tiny_flux, tmp_path):
    from engine.recipe import train
    from tests.helpers.images import make_images, write_flux_job

    job = write_flux_job(tmp_path / "job.yaml", tiny_flux, make_images(tmp_path / "data"),
                         model={"base_precision": "nf4"}, train={"steps": 1})
    assert train(load_job(job), tmp_path / "work", progress="none") == 65
    (err,) = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()
              if '"invalid_job"' in line]
    assert err["message"].startswith("model.base_precision: nf4 needs a CUDA GPU")
