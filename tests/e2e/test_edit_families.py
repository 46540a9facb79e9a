"""Edit LoRAs (data.control_path) on the tiny edit pipelines: exact resume, the export through the edit pipeline's
own loader, the control tokens the pipeline builds, the cache keyed by each control's content.

As in test_image_families.py: per family a killed-twice run (SIGKILL while caching, SIGKILL with a checkpoint
half-written, resumed) runs forked in the background while the same job trains uninterrupted in this process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from engine.config.job import load_job
from tests.helpers.images import tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references

# family -> (its tiny edit builtin, the pipeline class diffusers drives it with)
EDIT = {"flux": ("tiny-flux-kontext", "FluxKontextPipeline"), "qwen_image": ("tiny-qwen-image-edit", "QwenImageEditPipeline"),
        "flux2": ("tiny-flux2", "Flux2KleinPipeline")}
FAMILIES = tuple(EDIT)
PAIRS = [("wide", 96, 64), ("tall", 64, 96), ("square", 64, 64)]
# Kontext trains at 32 px (one 32x32 bucket); FLUX.2 takes references of 64 px a side or more, so 96 (buckets
# 112x80, 80x112, 96x96).
RESOLUTION = {"flux": 32, "qwen_image": 32, "flux2": 96}
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"


def make_pairs(root: Path) -> Path:
    """target/NAME.png + NAME.txt (the instruction) and control/NAME.png: the control's block is grey, the
    target's red."""
    rng = np.random.default_rng(0)
    for sub in ("target", "control"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for name, w, h in PAIRS:
        yy, xx = np.mgrid[0:h, 0:w]
        base = rng.integers(0, 255, size=3)
        ctl = np.stack([(base[c] + xx * (c + 2) + yy * (3 - c)) % 256 for c in range(3)], -1).astype(np.uint8)
        ctl[h // 4: h // 2, w // 4: w // 2] = 128
        tgt = ctl.copy()
        tgt[h // 4: h // 2, w // 4: w // 2] = (220, 30, 30)
        Image.fromarray(ctl).save(root / "control" / f"{name}.png")
        Image.fromarray(tgt).save(root / "target" / f"{name}.png")
        (root / "target" / f"{name}.txt").write_text("make the block red\n")
    return root


def job_dict(family: str, model_dir: Path, data: Path) -> dict:
    d = {
        "name": f"edit-{family.replace('_', '-')}",
        "model": {"family": family, "path": str(model_dir), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
        "data": {"path": str(data / "target"), "control_path": str(data / "control"), "resolution": [RESOLUTION[family]],
                 "caption_dropout": 0.3, "flip": True},
        "train": {"steps": 4, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw",
                  "seed": 3, "timestep_sampling": "shift"},
        "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
        "output": {"formats": ["diffusers", "comfyui"]},
    }
    return deep_update(d, {"train": {"guidance": 2.5}} if family == "flux" else {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per family: (model dir, job file, uninterrupted workdir, killed-twice future)."""
    from engine.builtin.models import materialise

    root = tmp_path_factory.mktemp("edit-families")
    data = make_pairs(root / "data")
    models, jobs = {}, {}
    for family in FAMILIES:
        models[family] = materialise(EDIT[family][0], root / "models")
        job = root / f"{family}.yaml"
        job.write_text(yaml.safe_dump(job_dict(family, models[family], data)))
        jobs[family] = (job, job)
    with chains_beside_references(root, jobs) as done:
        yield {family: (models[family], jobs[family][0], *done[family]) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_edit_job_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(family, runs):
    _model, _job, reference, killed = runs[family]
    wd, story = killed.result(timeout=900)
    ref = reference
    want, got = tensor_bytes(ref / "output" / DIFFUSERS_FILE), tensor_bytes(wd / "output" / DIFFUSERS_FILE)
    assert sorted(want) == sorted(got) and [k for k in want if want[k] != got[k]] == [], story


def _edit_pipeline(family: str, model_dir: Path, transformer=None):
    import diffusers

    cls = getattr(diffusers, EDIT[family][1])
    kw = {} if transformer is None else {"transformer": transformer}
    return cls.from_pretrained(model_dir, **kw)


def _denoise(pipe, control: Image.Image, family: str) -> torch.Tensor:
    """Two denoising steps of the edit pipeline on a fixed (control, noise, prompt), as latents."""
    g = torch.Generator().manual_seed(7)
    kw = {"_auto_resize": False, "guidance_scale": 2.5, "max_area": 32 * 32} if family == "flux" else {}
    image = control if family == "flux" else [control]
    return pipe(prompt="make the block red", image=image, height=32, width=32, num_inference_steps=2,
                generator=g, output_type="latent", **kw).images


def _as_trained(path: Path, family: str) -> Image.Image:
    """A control as training saw it: at its target's bucket (its square target's, for these tests)."""
    from engine.data.images import load_for_bucket

    side = RESOLUTION[family]
    return load_for_bucket(path, (side, side))


@pytest.fixture
def small_qwen_controls(monkeypatch):
    """Qwen-Image-Edit's pipeline resizes its control to about 1 MP (calculate_dimensions): here to the 32x32
    bucket the tests trained at, so that a tiny inference costs what a tiny training step does."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: (32, 32, None))


@pytest.mark.usefixtures("small_qwen_controls")
@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_through_the_edit_pipelines_load_lora_weights_reproduces_the_trained_transformer(family, runs):
    from engine.families import get_family

    model_dir, job, reference, _ = runs[family]
    wd = reference
    cfg = load_job(job)
    mem = with_last_checkpoint(get_family(family).load_model(cfg, wd, torch.device("cpu"), Quiet()), wd)
    control = _as_trained(Path(cfg.data.control_paths()[0]) / "square.png", family)
    with torch.no_grad():
        want = _denoise(_edit_pipeline(family, model_dir, mem), control, family)
        pipe = _edit_pipeline(family, model_dir)
        base = _denoise(pipe, control, family)
        pipe.load_lora_weights(str(wd / "output"), weight_name=DIFFUSERS_FILE)
        got = _denoise(pipe, control, family)
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing; the test would prove nothing"
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max())}"


def _captured_forward(pipe) -> dict:
    """The first transformer call's keyword arguments, recorded by a pre-hook."""
    seen: dict = {}

    def hook(_mod, _args, kwargs):
        if not seen:
            seen.update(kwargs)

    pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _cached_control(family: str, runs, name: str) -> tuple[Path, Path, torch.Tensor]:
    """(model dir, the control's file, its latent [1, C, h, w] as training cached it)."""
    import hashlib

    from engine.families.image.cache import model_id
    from engine.storage.cache import Cache, content_key

    model_dir, job, reference, _ = runs[family]
    wd, cfg = reference, load_job(job)
    ctl_path = Path(cfg.data.control_paths()[0]) / name
    side = RESOLUTION[family]
    key = content_key(kind="control", image=hashlib.sha256(ctl_path.read_bytes()).hexdigest(), bucket=[side, side],
                      flip=True, model=model_id(cfg, str(model_dir)), dtype="float32")
    return model_dir, ctl_path, Cache(wd / "cache").load(key)["latent"][None]


def test_kontext_control_tokens_and_ids_are_what_its_pipeline_builds_at_inference(runs):
    """Our packed input for one pair (the cached control latent after the noisy target, their ids) is the
    pipeline's own, for the same control image and noise."""
    from diffusers import FluxPipeline

    from engine.families.image.edit import kontext_inputs

    model_dir, ctl_path, control = _cached_control("flux", runs, "square.png")
    noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    packed = FluxPipeline._pack_latents(noise, 1, 4, 4, 4)
    ours, our_ids = kontext_inputs(packed, control, 4, 4, torch.float32)

    pipe = _edit_pipeline("flux", model_dir)
    seen = _captured_forward(pipe)
    with torch.no_grad():
        pipe(prompt="make the block red", image=_as_trained(ctl_path, "flux"), height=32, width=32,
             latents=packed, num_inference_steps=1, _auto_resize=False, max_area=32 * 32, output_type="latent")
    assert torch.equal(seen["img_ids"], our_ids)
    assert seen["img_ids"][4:, 0].eq(1).all() and seen["img_ids"][:4, 0].eq(0).all()  # 2x2 target tokens, then the control's
    torch.testing.assert_close(seen["hidden_states"], ours, rtol=0, atol=1e-6)


def test_flux2_reference_tokens_and_ids_are_what_its_pipeline_builds_at_inference(runs):
    """FLUX.2: the cached reference latent packed after the noisy target, with time coordinate 10, as the
    pipeline's multi-reference conditioning builds them for the same reference image and noise."""
    from diffusers import Flux2Pipeline

    from engine.families.image.edit import flux2_reference_inputs

    model_dir, ctl_path, control = _cached_control("flux2", runs, "square.png")
    noise = torch.randn(1, 16, 2, 2, generator=torch.Generator().manual_seed(1))
    ours, our_ids = flux2_reference_inputs(Flux2Pipeline._pack_latents(noise), Flux2Pipeline._prepare_latent_ids(noise),
                                           [control], torch.float32)
    pipe = _edit_pipeline("flux2", model_dir)
    seen = _captured_forward(pipe)
    with torch.no_grad():
        pipe(prompt="make the block red", image=[_as_trained(ctl_path, "flux2")], height=32, width=32,
             latents=noise, num_inference_steps=1, output_type="latent")
    assert torch.equal(seen["img_ids"], our_ids)
    # 2x2 target tokens at time 0, then the 96x96 reference's 6x6 at time 10
    assert seen["img_ids"].shape[1] == 4 + 36
    assert seen["img_ids"][0, 4:, 0].eq(10).all() and seen["img_ids"][0, :4, 0].eq(0).all()
    assert torch.equal(seen["hidden_states"][:, :4], ours[:, :4])
    # The same pixels through the same VAE function (Flux2Pipeline._encode_vae_image), run once for the cache and
    # once here: equal up to float rounding of the convolutions (measured 4.6e-6 on values of order 1).
    torch.testing.assert_close(seen["hidden_states"], ours, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("small_qwen_controls")
def test_qwen_edit_control_tokens_shapes_and_instruction_are_what_its_pipeline_builds_at_inference(runs):
    """Qwen-Image-Edit: the cached control latent after the noisy target with both img_shapes, and the instruction
    encoded with the control image by the model's own encode_text, are the pipeline's own inputs."""
    from diffusers import QwenImagePipeline

    from engine.families.image.edit import qwen_edit_inputs
    from engine.families.image.qwen_image import QwenImageModel

    model_dir, ctl_path, control = _cached_control("qwen_image", runs, "square.png")
    noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    packed = QwenImagePipeline._pack_latents(noise, 1, 4, 4, 4)
    ours, shapes = qwen_edit_inputs(packed, [control], 4, 4, torch.float32)
    pipe = _edit_pipeline("qwen_image", model_dir)
    seen = _captured_forward(pipe)
    image = _as_trained(ctl_path, "qwen_image")
    with torch.no_grad():
        pipe(prompt="make the block red", image=image, height=32, width=32, latents=packed, num_inference_steps=2,
             output_type="latent")
        text = QwenImageModel().encode_text(pipe, "make the block red", 1024, torch.device("cpu"), images=[image])
    assert seen["img_shapes"] == shapes == [[(1, 2, 2), (1, 2, 2)]]
    torch.testing.assert_close(seen["hidden_states"], ours, rtol=0, atol=1e-5)
    assert torch.equal(seen["hidden_states"][:, :4], ours[:, :4])
    assert torch.equal(seen["encoder_hidden_states"][0], text)


@pytest.mark.parametrize("family", FAMILIES)
def test_changing_one_control_image_re_encodes_that_control_only(family, runs, tmp_path):
    from engine.families import get_family
    from engine.report.events import EventLog

    _model, job, reference, _ = runs[family]
    wd = reference
    cfg = load_job(job)
    shutil.copytree(Path(cfg.data.control_paths()[0]), tmp_path / "control")
    img = Image.open(tmp_path / "control" / "tall.png")
    img.transpose(Image.Transpose.FLIP_TOP_BOTTOM).save(tmp_path / "control" / "tall.png")
    cfg.data.control_path = str(tmp_path / "control")
    shutil.copytree(wd / "cache", tmp_path / "work" / "cache")
    fam = get_family(family)
    fam.prepare(cfg, tmp_path / "work", EventLog(tmp_path / "events.jsonl", to_stdout=False))
    side = {"flux": "32x32", "qwen_image": "32x32", "flux2": "80x112"}[family]
    # Qwen-Image-Edit reads the instruction (and the empty one of caption dropout) with the control: re-encoded too.
    texts = [" | tall.png", "make the block red | tall.png"] if family == "qwen_image" else []
    assert fam.report.encoded == {"latent": [f"tall.png@{side}"], "text": texts}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pair_broken_after_submit_is_refused_by_the_trainer_before_anything_is_cached(family, runs, tmp_path):
    from engine.errors import JobInvalid
    from engine.families import get_family
    from engine.report.events import EventLog

    _model, job, _reference, _ = runs[family]
    cfg = load_job(job)
    shutil.copytree(Path(cfg.data.control_paths()[0]), tmp_path / "control")
    (tmp_path / "control" / "wide.png").unlink()
    cfg.data.control_path = str(tmp_path / "control")
    with pytest.raises(JobInvalid, match=r"target/wide\.png has no control in"):
        get_family(family).prepare(cfg, tmp_path / "work", EventLog(tmp_path / "events.jsonl", to_stdout=False))
    assert not list((tmp_path / "work").rglob("*.safetensors"))


def test_qwen_edit_plus_two_controls_are_packed_and_read_as_its_pipeline_does(runs, tmp_path, monkeypatch):
    """Edit-Plus with two control slots: both control latents (encoded as the cache encodes them) after the target,
    an img_shapes entry each, and the instruction read with both images, as QwenImageEditPlusPipeline builds them."""
    import numpy as np
    from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from engine.builtin.models import materialise
    from engine.families.image.edit import qwen_edit_inputs
    from engine.families.image.qwen_image import QwenImageModel

    monkeypatch.setattr(plus, "calculate_dimensions", lambda area, ratio: (32, 32))  # as small_qwen_controls
    data = Path(load_job(runs["qwen_image"][1]).data.control_paths()[0])
    images = [_as_trained(data / "square.png", "qwen_image"), _as_trained(data / "wide.png", "qwen_image")]
    pipe = QwenImageEditPlusPipeline.from_pretrained(materialise("tiny-qwen-image-edit-plus", tmp_path))
    model = QwenImageModel()
    with torch.no_grad():
        controls = [model.encode_latents(pipe, torch.from_numpy(np.asarray(im, dtype=np.float32).copy())
                                         .permute(2, 0, 1)[None] / 127.5 - 1.0)[None] for im in images]
        text = model.encode_text(pipe, "make the block red", 1024, torch.device("cpu"), images=images)
    noise = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    packed = QwenImagePipeline._pack_latents(noise, 1, 4, 4, 4)
    ours, shapes = qwen_edit_inputs(packed, controls, 4, 4, torch.float32)
    seen = _captured_forward(pipe)
    with torch.no_grad():
        pipe(prompt="make the block red", image=images, height=32, width=32, latents=packed, num_inference_steps=2,
             output_type="latent")
    assert seen["img_shapes"] == shapes == [[(1, 2, 2), (1, 2, 2), (1, 2, 2)]]
    torch.testing.assert_close(seen["hidden_states"], ours, rtol=0, atol=1e-5)
    assert torch.equal(seen["encoder_hidden_states"][0], text)


def test_a_kontext_sample_prompt_renders_from_its_control_image(runs, tmp_path):
    """A sample prompt that names a control image renders through the edit pipeline from it (another image than the
    same prompt and seed without one), and the samples event lists it beside the prompt."""
    import json

    from engine.recipe import train

    _model, job, reference, _ = runs["flux"]
    cfg = load_job(job)
    control = str(Path(cfg.data.control_paths()[0]) / "square.png")
    raw = yaml.safe_load(job.read_text())
    raw["train"]["steps"] = 2
    raw["sample"] = {"every_steps": 2, "steps": 2, "width": 32, "height": 32, "guidance": 2.5,
                     "prompts": [{"prompt": "make the block red", "seed": 5, "control": control},
                                 {"prompt": "make the block red", "seed": 5}]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(raw))
    shutil.copytree(reference / "cache", tmp_path / "work" / "cache")
    assert train(load_job(tmp_path / "job.yaml"), tmp_path / "work", progress="none") == 0
    events = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()]
    samples = [e for e in events if e["event"] == "samples"][-1]
    assert samples["controls"] == [[control], []]
    (shown,), none = samples["control_images"]  # the control as rendered from, beside the samples (the dashboard)
    assert none == [] and Image.open(shown).size == (32, 32) and Path(shown).parent == Path(samples["paths"][0]).parent
    with_control, without = (np.asarray(Image.open(p)) for p in samples["paths"])
    assert with_control.shape == without.shape == (32, 32, 3) and not np.array_equal(with_control, without)
