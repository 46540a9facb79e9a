"""LTX-2 LoRA on its tiny random pipeline (`builtin:tiny-ltx2`): exact resume through two SIGKILLs, the exports as
`LTX2Pipeline.load_lora_weights` reads them, the ComfyUI file's keys by the rules in the family's docstring, the
audio branch trained by clips with sound only, and sample clips with their sound.

The data: `talk.mp4` (9 frames at 16 fps with a 440 Hz stereo tone, built here with PyAV) and `quiet.mp4` (the same
length, no audio track): one 9-frame window each, one bucket, batches of 2 that mix them (two forwards: joint and
isolated). The killed-twice chain
runs as a forked trainer (tests/helpers/kill_chain.py) while the same job trains uninterrupted here, samples on.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from engine.config.job import load_job
from tests.e2e.test_video_families import assert_same_validation
from tests.e2e.test_video_families import job_dict as video_job_dict
from tests.helpers.images import tensor_bytes, with_last_checkpoint
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references
from tests.helpers.videos import make_clips, make_sound_clip

FILES = ["pytorch_lora_weights.safetensors", "ltx2_lora_comfyui.safetensors"]


def job_dict(model: str, data_path: Path, **over) -> dict:
    """The video families' tiny job (test_video_families), as LTX-2: 9-frame windows (8k + 1 frames)."""
    return deep_update(video_job_dict(model, data_path, family="ltx2"),
                       deep_update({"name": "tiny-ltx2", "data": {"frames": [9]}}, over))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(model dir, job file, uninterrupted workdir (samples on), killed-twice future)."""
    from engine.builtin.models import materialise

    root = tmp_path_factory.mktemp("ltx2")
    data = make_clips(root / "data", [("quiet.mp4", 9, 32, 32, 16, "a red square slides right")], still=False)
    make_sound_clip(data / "talk.mp4")
    (data / "talk.txt").write_text("a green square hums\n")
    val = make_clips(root / "val", [("hush.mp4", 10, 32, 32, 16, "a red square slides right")], still=False)
    make_sound_clip(val / "hum.mp4", tone=660.0, seed=4)
    (val / "hum.txt").write_text("a green square hums higher\n")
    model = materialise("tiny-ltx2", root / "models")
    job, sampled = root / "ltx2.yaml", root / "ltx2-sampled.yaml"
    over = {"validation": {"path": str(val), "every_steps": 2}}
    job.write_text(yaml.safe_dump(job_dict(str(model), data, data=over)))
    sampled.write_text(yaml.safe_dump(job_dict(str(model), data, data=over, sample={
        "every_steps": 4, "prompts": ["sks"], "steps": 2, "width": 32, "height": 32})))
    with chains_beside_references(root, {"ltx2": (job, sampled)}) as done:
        yield (model, job, *done["ltx2"])


def test_killed_while_caching_and_while_saving_then_resumed_is_bit_identical(run):
    _model, _job, ref, killed = run
    wd, story = killed.result(timeout=900)
    for name in FILES:
        want, got = tensor_bytes(ref / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got) and want
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"


def test_validation_is_reported_every_two_steps_with_the_same_losses_after_two_kills(run):
    """data.validation.path (hum.mp4 with sound, hush.mp4 without, one window each) every 2 steps: a finite loss at
    steps 2 and 4, the same values in the killed-twice run at every step it evaluated, the 2 windows counted apart
    from the 2 trained on."""
    _model, _job, ref, killed = run
    assert_same_validation(ref, killed, (2, 2))


def test_held_out_clips_validate_on_the_loss_they_would_train_on(run):
    """Each validation window's loss is the training loss in evaluate mode (no flip, no caption dropout) on its own
    fixed generator: hum.mp4's with its audio term, so a change to the audio branch's LoRA moves its loss, and
    hush.mp4's (no sound: the isolated forward) on the video alone, which that change leaves bit-identical."""
    from engine.families import get_family
    from engine.families.video.ltx2.family import AUDIO_BRANCH
    from engine.report.events import EventLog
    from engine.training.heldout import sample_generator

    _model, job, ref, _ = run
    cfg, fam, cpu = load_job(job), get_family("ltx2"), torch.device("cpu")
    fam.prepare(cfg, ref, EventLog(ref / "events-validation.jsonl", to_stdout=False))
    dataset = fam.build_dataset(cfg, ref, Quiet())
    model = fam.load_model(cfg, ref, cpu, Quiet()).eval()
    by_clip = {fam.items[i].record.rel: i for i in fam.validation_set(cfg, ref, Quiet()).indices}
    assert sorted(by_clip) == ["hum.mp4", "hush.mp4"] and min(by_clip.values()) == fam.n_train

    def losses() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {c: fam.validation_loss(model, dataset, [i], cfg.train.seed, cpu) for c, i in by_clip.items()}

    first = losses()
    for clip, i in by_clip.items():
        batch = dataset.collate([i])
        assert batch["has_audio"].tolist() == [clip == "hum.mp4"]
        with torch.no_grad():
            assert torch.equal(first[clip], fam.loss(model, batch, sample_generator(cfg.train.seed, i), evaluate=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n and re.search(AUDIO_BRANCH, n):
                p.add_(0.1)
    moved = losses()
    assert not torch.equal(moved["hum.mp4"], first["hum.mp4"]) and torch.equal(moved["hush.mp4"], first["hush.mp4"])


def _inputs(transformer) -> dict:
    g = torch.Generator().manual_seed(0)
    c = transformer.config
    return dict(hidden_states=torch.randn(1, 2 * 4 * 4, c.in_channels, generator=g),
                audio_hidden_states=torch.randn(1, 5, c.audio_in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, 16, c.caption_channels, generator=g),
                audio_encoder_hidden_states=torch.randn(1, 16, c.caption_channels, generator=g),
                timestep=torch.tensor([700.0]), sigma=torch.tensor([700.0]), num_frames=2, height=4, width=4,
                fps=16.0, audio_num_frames=5, use_cross_timestep=True, return_dict=False)


def test_load_lora_weights_reads_both_files_and_reproduces_the_trained_transformer(run):
    """Both outputs of the trained transformer (video and audio) through LTX2Pipeline's own load_lora_weights, from
    the diffusers file and from the ComfyUI file (its converter strips diffusion_model.)."""
    from diffusers import LTX2Pipeline

    from engine.families import get_family

    model_dir, job, ref, _ = run
    mem = with_last_checkpoint(get_family("ltx2").load_model(load_job(job), ref, torch.device("cpu"), Quiet()), ref)
    x = _inputs(mem)
    with torch.no_grad():
        want = mem(**x)
        for name in FILES:
            pipe = LTX2Pipeline.from_pretrained(model_dir, text_encoder=None, tokenizer=None, vae=None,
                                                audio_vae=None, vocoder=None)
            base = pipe.transformer(**x)
            pipe.load_lora_weights(str(ref / "output"), weight_name=name)
            got = pipe.transformer(**x)
            for i, part in enumerate(("video", "audio")):
                assert not torch.allclose(base[i], want[i], atol=1e-4), f"training changed no {part} output"
                torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-6, msg=f"{part} from {name}")


def _docstring_names(blocks: int) -> set[str]:
    """The ComfyUI module names the family's docstring states, its `<attn>` and `<ff>` expanded, N each block."""
    from engine.families.video.ltx2 import family

    doc = family.__doc__
    kinds = {k: v.split() for k, v in re.findall(r"(<\w+>): ([\w ]+)", doc)}
    out = set()
    for kind, tails in re.findall(r"^ +diffusion_model\.transformer_blocks\.N\.(<\w+>)\.(\S+) +← "
                                  r"transformer_blocks\.N\.<\w+>\.\(same\)$", doc, re.M):
        out |= {f"diffusion_model.transformer_blocks.{n}.{mod}.{tail}" for n in range(blocks)
                for mod in kinds[kind] for tail in tails.split("|")}
    return out


def test_comfyui_keys_follow_the_docstring_rules_with_the_trained_update(run):
    """Every key is a name the docstring's rules give (ComfyUI's generic diffusion_model.<name> rule maps it to its
    model's weight), with lora_A / lora_B only (alpha folded: ComfyUI's scale 1) and B @ A the trained update."""
    from engine.families import get_family

    _model, job, ref, _ = run
    sd = load_file(str(ref / "output" / FILES[1]))
    stated = _docstring_names(2)
    assert len(stated) == 2 * (6 * 4 + 2 * 2)  # 6 attentions × q/k/v/out and 2 feed-forwards × 2 linears, per block
    assert set(sd) == {f"{k}.{x}" for k in stated for x in ("lora_A.weight", "lora_B.weight")}
    mem = with_last_checkpoint(get_family("ltx2").load_model(load_job(job), ref, torch.device("cpu"), Quiet()), ref)
    for name, mod in mem.named_modules():
        if hasattr(mod, "lora_A") and "default" in mod.lora_A:
            key = f"diffusion_model.{name}"
            torch.testing.assert_close(sd[f"{key}.lora_B.weight"] @ sd[f"{key}.lora_A.weight"],
                                       mod.get_delta_weight("default"), rtol=1e-5, atol=1e-7)


def test_clips_with_sound_train_the_audio_branch_and_clips_without_do_not(run):
    """The cache holds an audio latent for the windows of the clips with sound only, of the pipeline's audio length for 9 frames at
    16 fps (round(9 / 16 · 16000 / 160 / 4) = 14); the quiet clip's batch gives the audio branch's LoRA no gradient
    (its forward isolates the modalities), the sound clip's does, and both train the video branch."""
    from engine.families import get_family
    from engine.families.video.ltx2.family import AUDIO_BRANCH
    from engine.report.events import EventLog

    _model, job, ref, _ = run
    cfg = load_job(job)
    fam = get_family("ltx2")
    fam.prepare(cfg, ref, EventLog(ref / "events-again.jsonl", to_stdout=False))
    assert fam.report.encoded == {"latent": [], "text": []}  # all cached by the run
    dataset = fam.build_dataset(cfg, ref, Quiet())
    model = fam.load_model(cfg, ref, torch.device("cpu"), Quiet())
    by_clip = {}
    for i, it in enumerate(fam.items):
        by_clip.setdefault(it.record.rel, []).append(i)
        entry = fam.cache.load(fam.plan.item_latent[i])
        assert ("audio_latent" in entry) == (it.record.rel in ("talk.mp4", "hum.mp4"))  # hum.mp4: validation's
        if "audio_latent" in entry:
            assert entry["audio_latent"].shape == (14, 4) and entry["audio_latent"].std() > 0
    for clip, sound in (("quiet.mp4", False), ("talk.mp4", True)):
        batch = dataset.collate(by_clip[clip])
        assert batch["has_audio"].tolist() == [sound] * len(by_clip[clip])
        model.zero_grad(set_to_none=True)
        fam.loss(model, batch, torch.Generator().manual_seed(1)).backward()
        grads = {n: p.grad is not None and bool(p.grad.abs().sum() > 0)
                 for n, p in model.named_parameters() if "lora_B" in n}
        audio = [g for n, g in grads.items() if re.search(AUDIO_BRANCH, n)]
        video = [g for n, g in grads.items() if re.search(r"\.(attn1|attn2|ff)\.", n)]
        assert audio and video and all(video)
        assert all(audio) if sound else not any(audio), (clip, audio)


def test_the_sample_clip_plays_with_its_frames_and_its_sound(run):
    import av

    ref = run[2]
    with av.open(str(ref / "samples" / "step-00000004" / "00.mp4")) as box:
        assert box.streams.video[0].codec_context.name == "h264"
        assert box.streams.audio[0].codec_context.name == "aac" and box.streams.audio[0].channels == 2
        frames = [f.to_ndarray(format="rgb24") for f in box.decode(video=0)]
        box.seek(0)
        samples = sum(f.samples for f in box.decode(audio=0))
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    card = (ref / "output" / "README.md").read_text()
    assert '<video src="samples/00.mp4" controls loop></video>' in card  # not muted: it has sound
    # The vocoder's waveform for the clip's 9 / 16 s: 14 audio latents · 4 mel frames · 160 samples (AAC pads).
    assert 14 * 4 * 160 <= samples <= 14 * 4 * 160 + 2048


@pytest.mark.parametrize("over,key", [
    ({"data": {"masks": {"alpha": True}}}, "data.masks"),
    ({"data": {"regularisation": {"path": "/nowhere"}}}, "data.regularisation"),
    ({"train": {"dop": {"preservation_class": "a person"}}}, "train.dop"),
    ({"lora": {"type": "dora"}}, "lora.type"),
    ({"data": {"frames": [5]}}, "data.frames"),
    ({"resources": {"gpus": 2}}, "model.family, resources.gpus"),
])
def test_what_ltx2_does_not_read_is_refused_at_submit_naming_the_key(over, key):
    from engine.config.job import parse_job
    from engine.errors import JobInvalid

    with pytest.raises(JobInvalid, match=re.escape(key)):
        parse_job(job_dict("builtin:tiny-ltx2", Path("/nowhere"), **over), Path("/"), check_paths=False)


def test_timestep_bias_and_ema_are_accepted_and_the_bias_moves_the_sigmas():
    """train.timestep_bias reweights LTX-2's σ draws (the shared sampler, after the model's own shift); EMA is the
    loop's, over any adapter."""
    from engine.config.job import parse_job
    from engine.families.video.ltx2.family import LTX2Model

    draws = {}
    for strategy in ("balanced", "later"):
        cfg = parse_job(job_dict("builtin:tiny-ltx2", Path("/nowhere"), train={
            "timestep_bias": {"strategy": strategy, "multiplier": 4.0}, "ema": {"decay": 0.99}}), Path("/"),
            check_paths=False)
        draws[strategy] = LTX2Model().sigmas(cfg, {}, 4000, torch.Generator().manual_seed(0), 32)
    assert float(draws["later"].mean()) > float(draws["balanced"].mean()) + 0.05


def test_the_sound_of_a_window_is_its_span_of_the_track_and_its_spectrogram_peaks_at_the_tone(tmp_path):
    """window_audio: the clip's 440 Hz tone from the window's start for its length, stereo at the VAE's rate (about
    2 · 440 · seconds zero crossings); log_mel (LTX-2's 64 Slaney bands at 16 kHz, hop 160): N // 160 + 1 frames,
    the loudest band the one whose centre is nearest 440 Hz; a clip without a track has no sound."""
    from engine.families.video.ltx2.audio import _hz_to_mel, _mel_to_hz, log_mel, window_audio

    clip = make_sound_clip(tmp_path / "tone.mp4", frames=16)
    wave = window_audio(clip, 0.25, 0.5, 16000)
    assert wave.shape == (2, 8000) and torch.equal(wave[0], wave[1])
    crossings = int(((wave[0][:-1] > 0) != (wave[0][1:] > 0)).sum())
    assert abs(crossings - 2 * 440 * 0.5) <= 8, crossings
    mel = log_mel(wave, 16000, 64, 160)
    assert mel.shape == (1, 2, 8000 // 160 + 1, 64)
    centres = _mel_to_hz(torch.linspace(0, float(_hz_to_mel(torch.tensor(8000.0))), 66))[1:-1]
    assert int(mel[0, 0, 10:-10].mean(0).argmax()) == int((centres - 440).abs().argmin())
    quiet = make_clips(tmp_path / "quiet", [("q.mp4", 9, 32, 32, 16, "x")], still=False) / "q.mp4"
    assert window_audio(quiet, 0.0, 0.5, 16000) is None
