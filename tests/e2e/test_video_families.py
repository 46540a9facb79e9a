"""Wan 2.2 LoRA on its tiny random pipelines (TI2V-5B, and T2V-A14B's two experts trained together): exact resume
through two SIGKILLs, the exports as diffusers and ComfyUI load them, the timestep routing between the experts,
bad clips, and the sample clips.

The killed-twice chains (tests/helpers/kill_chain.py's run_killed_twice: SIGKILL while caching, SIGKILL with a
checkpoint half-written, resumed) run as forked trainers (tests/helpers/forked.py) in the background of a module
fixture while the same jobs train uninterrupted in the test process, with samples on: their clips are rendered on
generators of their own, so the two runs' adapters must still be bit-identical.
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
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.helpers.images import tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references
from tests.helpers.videos import make_clips, make_sound_clip, truncated_mid_stream

# A run name -> (family, builtin model, model.expert)
RUNS = {"wan-5b": ("wan", "tiny-wan22-5b", None), "wan-a14b": ("wan", "tiny-wan22-a14b", "both"),
        "hunyuan": ("hunyuan_video", "tiny-hunyuan-video15", None)}
FILES = {"wan-5b": ["pytorch_lora_weights.safetensors", "wan_lora_comfyui.safetensors"],
         "wan-a14b": ["wan22_high_noise_lora.safetensors", "wan22_high_noise_lora_comfyui.safetensors",
                      "wan22_low_noise_lora.safetensors", "wan22_low_noise_lora_comfyui.safetensors"],
         "hunyuan": ["pytorch_lora_weights.safetensors", "hunyuan_video15_lora_comfyui.safetensors"]}


def job_dict(model: str, data_path: Path, expert: str | None = None, family: str = "wan", **over) -> dict:
    d = {"name": "tiny-video", "model": {"family": family, "path": model, "dtype": "float32"},
         "lora": {"rank": 4, "alpha": 8, "dropout": 0.1},
         "data": {"path": str(data_path), "resolution": [32], "frames": [5], "fps": 16, "trigger": "sks",
                  "caption_dropout": 0.3},
         "train": {"steps": 4, "batch_size": 2, "lr": 0.002, "schedule": "constant", "optimizer": "adamw", "seed": 3,
                   "timestep_sampling": "shift"},
         "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
         "output": {"formats": ["diffusers", "comfyui"]}}
    if expert is not None:
        d["model"]["expert"] = expert
    return deep_update(d, over)


# data.validation per run: Wan holds out a third of data.path's 3 files (seed 3 picks red.mp4: 2 of its 4 windows);
# HunyuanVideo reads a folder of its own (one 9-frame clip: one 5-frame window).
# A run name -> (its validation, (windows trained on, windows held out)).
VALIDATION = {"wan-5b": ({"fraction": 0.34, "every_steps": 2}, (2, 2)),
              "wan-a14b": ({"fraction": 0.34, "every_steps": 2}, (2, 2)),
              "hunyuan": ({"path": "VAL", "every_steps": 2}, (4, 1))}


def _validation(run: str, val: Path) -> dict:
    v = dict(VALIDATION[run][0])
    return {**v, "path": str(val)} if "path" in v else v


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per run: (model dir, job file, uninterrupted workdir (samples on), killed-twice future)."""
    from engine.builtin.models import materialise

    root = tmp_path_factory.mktemp("video-families")
    data = make_clips(root / "data")
    val = root / "val"
    val.mkdir()
    make_sound_clip(val / "green.mp4")  # its sound is ignored here: only LTX-2 reads it
    (val / "green.txt").write_text("a green square slides right\n")
    models, jobs = {}, {}
    for run, (family, builtin, expert) in RUNS.items():
        model = models[run] = materialise(builtin, root / "models")
        job, sampled = root / f"{run}.yaml", root / f"{run}-sampled.yaml"
        over = {"validation": _validation(run, val)}
        job.write_text(yaml.safe_dump(job_dict(str(model), data, expert, family, data=over)))
        # Samples in one run per family (HunyuanVideo's quoted text goes through its glyph encoder).
        prompt = "sks" if run == "wan-5b" else 'sks "HI"'
        sampled.write_text(yaml.safe_dump(job_dict(str(model), data, expert, family, data=over, sample={
            "every_steps": 4, "prompts": [prompt], "steps": 2, "width": 32, "height": 32}) if run != "wan-a14b"
            else job_dict(str(model), data, expert, family, data=over)))
        jobs[run] = (job, sampled)
    with chains_beside_references(root, jobs) as done:
        yield {run: (models[run], jobs[run][0], *done[run]) for run in RUNS}


@pytest.mark.parametrize("run", RUNS)
def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(run, runs):
    _model, _job, ref, killed = runs[run]
    wd, story = killed.result(timeout=900)
    for name in FILES[run]:
        want, got = tensor_bytes(ref / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got) and want
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"
    # Both experts' adapters and optimizer states are in the one checkpoint (A14B), as trained.
    ckpt = load_file(str(sorted((wd / "checkpoints").glob("step-*"))[-1] / "adapter.safetensors"))
    sides = {k.split(".")[0] for k in ckpt}
    assert sides == {"wan-5b": {"blocks"}, "wan-a14b": {"transformer", "transformer_2"},
                     "hunyuan": {"transformer_blocks"}}[run]


@pytest.mark.parametrize("run", RUNS)
def test_validation_is_reported_every_two_steps_with_the_same_losses_after_two_kills(run, runs):
    """data.validation.every_steps: 2 — a finite loss over the held-out windows at steps 2 and 4; the killed-twice
    run reports the very same values at every step it evaluated (a step evaluated again after a kill included),
    and its dataset counts the held-out windows apart from the ones it trains on."""
    _model, _job, ref, killed = runs[run]
    assert_same_validation(ref, killed, VALIDATION[run][1])


def assert_same_validation(ref: Path, killed, counts: tuple[int, int]) -> None:
    """Validation at steps 2 and 4 with finite losses in the uninterrupted run `ref`; the killed-twice run reports
    the very same values at every step it evaluated; both datasets count (trained windows, held-out windows)."""
    from tests.helpers.jobs import read_events

    wd, story = killed.result(timeout=900)
    want = {e["step"]: e["loss"] for e in read_events(ref) if e["event"] == "validation"}
    assert sorted(want) == [2, 4] and all(math.isfinite(v) and v > 0 for v in want.values()), want
    got = [(e["step"], e["loss"]) for e in read_events(wd) if e["event"] == "validation"]
    assert {s for s, _ in got} == {2, 4} and [(s, v) for s, v in got if v != want[s]] == [], story
    for events in (read_events(ref), read_events(wd)):
        assert {(e["windows"], e["validation"]) for e in events if e["event"] == "dataset"} == {counts}


def test_held_out_clips_are_cached_but_never_trained_on(runs, tmp_path):
    """data.validation.fraction holds out whole clips: every window of red.mp4 comes after the training windows,
    is in the cache (nothing left to encode), and no batch of the run's order reaches it."""
    from engine.families import get_family

    _model, job, ref, _ = runs["wan-5b"]
    cfg = load_job(job)
    shutil.copytree(ref / "cache", tmp_path / "work" / "cache")
    family = get_family("wan")
    family.prepare(cfg, tmp_path / "work", Quiet())
    assert family.report.encoded == {"latent": [], "text": []}
    dataset = family.build_dataset(cfg, tmp_path / "work", Quiet())
    n = family.n_train
    assert {it.record.rel for it in family.items[n:]} == {"red.mp4"} and len(family.items) - n == 2
    assert {it.record.rel for it in family.items[:n]} == {"blue.gif", "still.png"}
    assert "red.mp4" not in {r.rel for r in family.records}  # nor in the dataset hash the export records
    trained = {i for p in range(0, 4 * len(dataset), 2) for i in dataset.indices_at(cfg.train.seed, p, 2)}
    assert trained == set(range(n))
    assert family.validation_set(cfg, tmp_path / "work", Quiet()).indices == [n, n + 1]


@pytest.mark.parametrize("run", ["wan-5b", "hunyuan"])
def test_the_sample_clip_plays_with_its_frames(run, runs):
    import av

    ref = runs[run][2]
    with av.open(str(ref / "samples" / "step-00000004" / "00.mp4")) as box:
        assert box.streams.video[0].codec_context.name == "h264"
        frames = [f.to_ndarray(format="rgb24") for f in box.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)


# ------------------------------------------------------------------ exports
def _inputs(transformer) -> dict:
    g = torch.Generator().manual_seed(0)
    c = transformer.config.in_channels
    return dict(hidden_states=torch.randn(1, c, 2, 4, 4, generator=g), timestep=torch.tensor([700.0]),
                encoder_hidden_states=torch.randn(1, 7, transformer.config.text_dim, generator=g), return_dict=False)


@pytest.mark.parametrize("run", ["wan-5b", "wan-a14b"])
def test_load_lora_weights_puts_each_experts_file_into_its_transformer_and_reproduces_it(run, runs):
    from diffusers import WanPipeline

    from engine.families import get_family

    model_dir, job, ref, _ = runs[run]
    mem = with_last_checkpoint(get_family("wan").load_model(load_job(job), ref, torch.device("cpu"), Quiet()), ref)
    sides = [("transformer", FILES[run][0], FILES[run][1])]
    if run == "wan-a14b":
        sides = [("transformer", FILES[run][0], FILES[run][1]), ("transformer_2", FILES[run][2], FILES[run][3])]
    for attr, diffusers_file, comfy_file in sides:
        trained = getattr(mem, attr) if run == "wan-a14b" else mem
        x = _inputs(trained)
        with torch.no_grad():
            want = trained(**x)[0]
            for name in (diffusers_file, comfy_file):
                pipe = WanPipeline.from_pretrained(model_dir, text_encoder=None, tokenizer=None, vae=None)
                base = getattr(pipe, attr)(**x)[0]
                pipe.load_lora_weights(str(ref / "output"), weight_name=name,
                                       load_into_transformer_2=attr == "transformer_2")
                got = getattr(pipe, attr)(**x)[0]
                assert not torch.allclose(base, want, atol=1e-4), "training changed nothing"
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{attr} from {name}")
                other = {"transformer": "transformer_2", "transformer_2": "transformer"}[attr]
                if getattr(pipe, other, None) is not None:  # the other expert got nothing from this file
                    assert not any("lora" in n for n, _ in getattr(pipe, other).named_modules())


def test_comfyui_keys_are_the_original_wan_names_that_diffusers_maps_back(runs):
    """ComfyUI's Wan model has the original names: diffusion_model.blocks.N.self_attn.q|k|v|o, cross_attn.q|k|v|o,
    ffn.0 | ffn.2, each with lora_A / lora_B and .alpha = lora.alpha; diffusers' converter maps each back to the
    module it was trained on, with the trained update (alpha / r)·B·A."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    ref = runs["wan-a14b"][2]
    names = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
             "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0",
             "ffn.net.2": "ffn.2"}
    for comfy_file, diffusers_file in ((FILES["wan-a14b"][1], FILES["wan-a14b"][0]),
                                       (FILES["wan-a14b"][3], FILES["wan-a14b"][2])):
        sd = load_file(str(ref / "output" / comfy_file))
        want = {f"diffusion_model.blocks.{i}.{c}.{x}" for i in range(2) for c in names.values()
                for x in ("lora_A.weight", "lora_B.weight", "alpha")}
        assert set(sd) == want
        assert {float(v) for k, v in sd.items() if k.endswith(".alpha")} == {8.0}
        back = _convert_non_diffusers_wan_lora_to_diffusers({k: v.clone() for k, v in sd.items()})  # it scales in place
        diff = load_file(str(ref / "output" / diffusers_file))  # alpha / r folded into B
        for i in range(2):
            for d, c in names.items():
                m = f"transformer.blocks.{i}.{d}"
                delta = (8 / 4) * sd[f"diffusion_model.blocks.{i}.{c}.lora_B.weight"] @ \
                    sd[f"diffusion_model.blocks.{i}.{c}.lora_A.weight"]
                torch.testing.assert_close(back[f"{m}.lora_B.weight"] @ back[f"{m}.lora_A.weight"], delta)
                torch.testing.assert_close(diff[f"{m}.lora_B.weight"] @ diff[f"{m}.lora_A.weight"], delta)


# ------------------------------------------------------------------ the experts' routing
def test_each_sampled_timestep_trains_only_the_expert_that_owns_it(runs):
    """expert: both — over many batches each sample goes through the transformer whose side of the boundary its σ
    is on (t ≥ 875 high noise, as WanPipeline switches), and each expert's LoRA gets gradients from its own samples
    only; both sides get their share of the draws."""
    from engine.families import get_family

    model_dir, job, ref, _ = runs["wan-a14b"]
    family = get_family("wan")
    cfg = load_job(job)
    model = family.load_model(cfg, ref, torch.device("cpu"), Quiet())
    seen = {"transformer": [], "transformer_2": []}
    for name in seen:
        getattr(model, name).register_forward_pre_hook(
            lambda _m, _a, kw, name=name: seen[name].append(kw["timestep"].clone()), with_kwargs=True)
    g = torch.Generator().manual_seed(5)
    lat = torch.randn(4, 4, 2, 4, 4)
    batch = {"latents": lat, "prompt_embeds": torch.randn(4, 8, 16), "prompt_mask": torch.ones(4, 8),
             "empty_prompt_embeds": torch.zeros(1, 8, 16), "empty_prompt_mask": torch.ones(1, 8)}
    lora = {n: [p for k, p in getattr(model, n).named_parameters() if "lora_" in k] for n in seen}
    counts = {n: 0 for n in seen}
    for _ in range(24):
        before = {n: len(v) for n, v in seen.items()}
        model.zero_grad(set_to_none=True)
        family.loss(model, batch, g).backward()
        for n in seen:
            ran = len(seen[n]) > before[n]
            counts[n] += int(seen[n][-1].numel()) if ran else 0
            got = [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in lora[n]]
            assert any(got) == ran, f"{n} ran={ran} but its LoRA gradients are {got}"
    assert all(float(t.min()) >= 875.0 for t in seen["transformer"])
    assert all(float(t.max()) < 875.0 for t in seen["transformer_2"])
    assert counts["transformer"] > 0 and counts["transformer_2"] > 0 and sum(counts.values()) == 96


@pytest.mark.parametrize("expert,side", [("high", lambda s: s >= 0.875), ("low", lambda s: s < 0.875)])
def test_one_expert_draws_sigmas_on_its_side_only(expert, side):
    from engine.config.job import parse_job
    from engine.families.video.experts import expert_sigmas

    cfg = parse_job(job_dict("builtin:tiny-wan22-a14b", "/nowhere", expert), Path("/"), check_paths=False)
    g = torch.Generator().manual_seed(0)
    s = torch.cat([expert_sigmas(cfg, expert, 0.875, 8, 12.0, g) for _ in range(20)])
    assert s.shape == (160,) and bool(side(s).all())


# ------------------------------------------------------------------ clips: bad ones, the cache
def _bad(kind: str, folder: Path) -> str:
    import av
    import numpy as np

    make_clips(folder, still=False)
    if kind == "truncated":
        data = (folder / "red.mp4").read_bytes()
        (folder / "red.mp4").write_bytes(data[: len(data) // 2])
        return "red.mp4"
    if kind == "short":  # 3 frames at 16 fps: shorter than one 5-frame window
        make_clips(folder, [("short.mp4", 3, 32, 32, 16, "x")], still=False)
        return "short.mp4"
    if kind == "no video stream":
        with av.open(str(folder / "sound.mp4"), "w") as box:
            s = box.add_stream("aac", rate=8000)
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
            frame.sample_rate = 8000
            for p in [*s.encode(frame), *s.encode()]:
                box.mux(p)
        return "sound.mp4"
    (folder / "empty.webm").write_bytes(b"")
    return "empty.webm"


@pytest.mark.parametrize("kind", ["truncated", "short", "no video stream", "0 bytes"])
def test_a_bad_clip_is_refused_at_submit_naming_it(kind, tmp_path):
    """What the inbox and `lorad submit` run (daemon/intake/accept.py: validate_text)."""
    from daemon.config.daemon import DaemonConfig
    from daemon.intake.accept import validate_text
    from engine.errors import JobInvalid

    name = _bad(kind, tmp_path / "clips")
    text = yaml.safe_dump(job_dict("builtin:tiny-wan22-5b", tmp_path / "clips"))
    with pytest.raises(JobInvalid, match=re.escape(f"data.path: {name}")) as e:
        validate_text(text, "job.yaml", tmp_path, DaemonConfig(), tmp_path)  # the home: an allowed root
    assert {"truncated": "cannot be read", "short": "shorter than one window", "no video stream": "no video stream",
            "0 bytes": "0 bytes"}[kind] in str(e.value)


def test_a_validation_folder_is_checked_like_data_path_naming_its_key(tmp_path):
    from daemon.config.daemon import DaemonConfig
    from daemon.intake.accept import validate_text
    from engine.errors import JobInvalid

    make_clips(tmp_path / "clips")
    name = _bad("short", tmp_path / "val")
    text = yaml.safe_dump(job_dict("builtin:tiny-wan22-5b", tmp_path / "clips",
                                   data={"validation": {"path": str(tmp_path / "val")}}))
    with pytest.raises(JobInvalid, match=re.escape(f"data.validation.path: {name} has 3 frames")):
        validate_text(text, "job.yaml", tmp_path, DaemonConfig(), tmp_path)


def test_a_clip_that_breaks_while_caching_is_skipped_with_a_reason_and_no_entry(runs, tmp_path):
    from engine.families import get_family
    from engine.report.events import EventLog
    from tests.helpers.jobs import read_events

    model_dir, job, ref, _ = runs["wan-5b"]
    data = tmp_path / "data"
    shutil.copytree(load_job(job).data.path, data)
    truncated_mid_stream(data / "broken.mp4")
    cfg = load_job(job)
    cfg.data.path = str(data)
    cfg.data.validation = None  # a fraction of this folder would hold out broken.mp4, of which no window survives
    work = tmp_path / "work"
    shutil.copytree(ref / "cache", work / "cache")
    family = get_family("wan")
    family.prepare(cfg, work, EventLog(work / "events.jsonl", to_stdout=False))
    skipped = [e for e in read_events(work) if e["event"] == "clip_skipped"]
    assert skipped and {e["file"] for e in skipped} == {"broken.mp4"}
    assert all("broke while decoding" in e["reason"] or "ended at" in e["reason"] for e in skipped)
    # Its index promised 40 frames (8 windows): only its windows were encoded (the rest was cached); each either
    # committed an entry and is trained on, or was skipped, with no entry.
    tried = {int(s.rsplit("+", 1)[1]) for s in family.report.encoded["latent"]}
    assert {s.split("@")[0] for s in family.report.encoded["latent"]} == {"broken.mp4"} and len(tried) == 8
    kept = {it.start for it in family.items if it.record.rel == "broken.mp4"}
    dropped = {e["start"] for e in skipped}
    assert kept | dropped == tried and not kept & dropped
    entries = [json.loads(p.read_text())["source"] for p in (work / "cache").glob("*.entry.json")]
    assert {int(s.rsplit("+", 1)[1]) for s in entries if s.startswith("broken.mp4@")} == kept
    assert {"red.mp4", "blue.gif", "still.png"} <= {it.record.rel for it in family.items}


def test_editing_one_caption_re_encodes_that_caption_only(runs, tmp_path):
    from engine.families import get_family
    from engine.report.events import EventLog

    _model, job, ref, _ = runs["wan-5b"]
    data = tmp_path / "data"
    shutil.copytree(load_job(job).data.path, data)
    (data / "red.txt").write_text("a purple square\n")
    cfg = load_job(job)
    cfg.data.path = str(data)
    shutil.copytree(ref / "cache", tmp_path / "work" / "cache")
    family = get_family("wan")
    family.prepare(cfg, tmp_path / "work", EventLog(tmp_path / "events.jsonl", to_stdout=False))
    assert family.report.encoded == {"latent": [], "text": ["sks, a purple square"]}


def test_hunyuan_video_files_load_into_its_transformer_and_reproduce_it(runs):
    """diffusers 0.42's HunyuanVideo15Pipeline has no load_lora_weights: its transformer's own loader
    (load_lora_adapter, prefix transformer) reads the diffusers file. The ComfyUI file: hunyuan_comfy_update."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from engine.families import get_family

    model_dir, job, ref, _ = runs["hunyuan"]
    mem = with_last_checkpoint(get_family("hunyuan_video").load_model(load_job(job), ref, torch.device("cpu"),
                                                                     Quiet()), ref)
    g = torch.Generator().manual_seed(0)
    c = mem.config
    x = dict(hidden_states=torch.randn(1, c.in_channels, 2, 2, 2, generator=g), timestep=torch.tensor([700.0]),
             encoder_hidden_states=torch.randn(1, 6, c.text_embed_dim, generator=g),
             encoder_attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]),
             encoder_hidden_states_2=torch.randn(1, 3, c.text_embed_2_dim, generator=g),
             encoder_attention_mask_2=torch.tensor([[1, 1, 0]]), image_embeds=torch.zeros(1, 729, c.image_embed_dim),
             return_dict=False)
    fresh = HunyuanVideo15Transformer3DModel.from_pretrained(model_dir, subfolder="transformer")
    with torch.no_grad():
        want, base = mem(**x)[0], fresh(**x)[0]
        fresh.load_lora_adapter(str(ref / "output" / FILES["hunyuan"][0]), prefix="transformer")
        got = fresh(**x)[0]
    assert not torch.allclose(base, want, atol=1e-4), "training changed nothing"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    deltas = {n: m.get_delta_weight("default") for n, m in mem.named_modules() if hasattr(m, "lora_A")}
    hunyuan_comfy_update(load_file(str(ref / "output" / FILES["hunyuan"][1])), deltas, mem)


def _docstring_rules() -> dict[str, str]:
    """diffusers sub-path of transformer_blocks.N -> ComfyUI name, read from the family's docstring as written
    (`diffusion_model.double_blocks.N.img_mlp.0 | .2 ← transformer_blocks.N.ff.net.0.proj | ff.net.2`)."""
    from engine.families.video.hunyuan_video import family

    out = {}
    for left, right in re.findall(r"^ +diffusion_model\.(\S+(?: \| \.\S+)?) +← transformer_blocks\.N\.(.+?)"
                                  r"(?: \(fused\))?$", family.__doc__, re.M):
        first, *more = left.split(" | ")
        names = [first] + [first.rsplit(".", 1)[0] + m for m in more]
        if " + " in right:  # fused: every part goes into the one ComfyUI linear
            head, *tail = right.split(" + ")
            out.update({p: names[0] for p in [head] + [head.rsplit(".", 1)[0] + "." + t for t in tail]})
        else:
            out.update(zip(right.split(" | "), names, strict=True))
    return out


def hunyuan_comfy_update(sd: dict, deltas: dict, mem) -> None:
    """Every key of the ComfyUI file is a trained module's name by the docstring's rules (comfy/lora.py's generic
    diffusion_model.<name> rule then maps it to ComfyUI's weight), and each key's update as ComfyUI's load_lora
    computes it, (alpha / rows of lora_A) · lora_B @ lora_A, is its parts' trained updates stacked in order."""
    rules = _docstring_rules()
    assert len(rules) == 12, rules  # q, k, v, out, 2 MLP linears, for image and text
    fused: dict[str, list[str]] = {}
    for n in deltas:
        block, rest = re.match(r"^transformer_blocks\.(\d+)\.(.+)$", n).groups()
        fused.setdefault(f"diffusion_model.{rules[rest].replace('N', block)}", []).append(n)
    assert set(sd) == {f"{k}.{x}" for k in fused for x in ("lora_A.weight", "lora_B.weight", "alpha")}
    for key, parts in fused.items():
        a, b = sd[f"{key}.lora_A.weight"], sd[f"{key}.lora_B.weight"]
        got = float(sd[f"{key}.alpha"]) / a.shape[0] * b @ a
        want = torch.cat([deltas[p] for p in sorted(parts, key=lambda p: _ORDER.index(p.split(".", 2)[2]))])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        assert got.shape[1] == dict(mem.named_modules())[parts[0]].get_base_layer().weight.shape[1]


_ORDER = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
          "attn.to_out.0", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
          "ff_context.net.2"]


def _doc_key_rules(page: str) -> list[tuple[str, str]]:
    """The (diffusers module, ComfyUI key) rows of a family page's key-rule table."""
    from tests.helpers.processes import REPO

    text = (REPO / "docs" / "families" / page).read_text()
    return re.findall(r"^\| `([^`]+)`[^|`]*\| `(diffusion_model\.[^`]+)` \|$", text, re.M)


@pytest.mark.parametrize("run,page", [("wan-a14b", "wan.md"), ("hunyuan", "hunyuan-video.md")])
def test_the_key_rules_the_family_page_states_are_the_ones_the_files_follow(run, page, runs):
    from engine.families.video.hunyuan_video import comfyui_name as hunyuan_name
    from engine.families.video.wan import comfyui_name

    rules = _doc_key_rules(page)
    assert rules, f"no key-rule table in docs/families/{page}"
    ref = runs[run][2]
    comfy_files = [f for f in FILES[run] if f.endswith("_comfyui.safetensors")]
    for name in comfy_files:
        keys = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in load_file(str(
            ref / "output" / name))}
        stated = {comfy.replace("N", str(i)) for _d, comfy in rules for i in range(2)}
        assert stated <= keys, f"{name} lacks {sorted(stated - keys)}"
        for module, comfy in rules:
            for i in range(2):
                want = comfy.replace("N", str(i))
                got = "diffusion_model." + (comfyui_name(module.replace("N", str(i))) if run == "wan-a14b"
                                            else hunyuan_name(module.replace("N", str(i)))[0])
                assert got == want
        if run == "wan-a14b" or run == "hunyuan":  # the table names every module the file holds
            assert keys == stated


def test_the_model_card_plays_the_last_clip_and_says_which_model_each_file_goes_into(runs):
    five, a14b = runs["wan-5b"][2] / "output", runs["wan-a14b"][2] / "output"
    assert (five / "samples" / "00.mp4").read_bytes() == (five.parent / "samples" / "step-00000004" /
                                                          "00.mp4").read_bytes()
    card = (five / "README.md").read_text()
    assert '<video src="samples/00.mp4"' in card and "- text-to-video" in card
    card = (a14b / "README.md").read_text()
    assert 'weight_name="wan22_low_noise_lora.safetensors", load_into_transformer_2=True' in card
    assert "`wan22_high_noise_lora_comfyui.safetensors` into `ComfyUI/models/loras/` and load it with " \
           "*LoraLoaderModelOnly* on the high-noise model" in card


def test_i2v_keeps_the_first_latent_frame_clean_at_t0_and_out_of_the_loss(runs, tmp_path):
    """model.task: i2v on TI2V-5B, as WanImageToVideoPipeline conditions it (expand_timesteps): the transformer sees
    the clean first latent frame with t = 0 on its tokens and σ · 1000 on the others; a change in what it predicts
    for the first frame changes nothing in the loss."""
    from engine.config.job import parse_job
    from engine.families import get_family

    model_dir, job, ref, _ = runs["wan-5b"]
    d = yaml.safe_load(job.read_text())
    d["model"]["task"] = "i2v"
    cfg = parse_job(d, tmp_path, check_paths=False)
    family = get_family("wan")
    model = family.load_model(cfg, ref, torch.device("cpu"), Quiet())
    seen = {}
    model.register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    lat = torch.randn(2, 8, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    batch = {"latents": lat, "prompt_embeds": torch.randn(2, 32, 16), "prompt_mask": torch.ones(2, 32),
             "empty_prompt_embeds": torch.zeros(1, 32, 16), "empty_prompt_mask": torch.ones(1, 32)}
    losses = []
    for bump in (0.0, 5.0):
        hook = model.register_forward_hook(lambda _m, _a, out, b=bump: (out[0].index_add(
            2, torch.tensor([0]), torch.full_like(out[0][:, :, :1], b)),))
        losses.append(family.loss(model, batch, torch.Generator().manual_seed(3)))
        hook.remove()
    assert torch.equal(seen["hidden_states"][:, :, 0], lat[:, :, 0])
    t = seen["timestep"].view(2, 3, -1)
    assert bool((t[:, 0] == 0).all()) and bool((t[:, 1:] > 0).all())
    assert torch.equal(losses[0], losses[1])


def test_a_hunyuan_target_without_a_comfyui_name_is_refused_before_training(runs, tmp_path):
    from engine.errors import JobInvalid
    from engine.families import get_family

    _model, job, _ref, _ = runs["hunyuan"]
    d = yaml.safe_load(job.read_text())
    d["lora"]["targets"] = r"^transformer_blocks\.\d+\.(attn\.to_q|norm1\.linear)$"  # norm1: a modulation linear
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(JobInvalid, match=r"lora.targets: transformer_blocks.0.norm1.linear has no name in ComfyUI"):
        get_family("hunyuan_video").load_model(load_job(tmp_path / "job.yaml"), tmp_path, torch.device("cpu"), Quiet())
