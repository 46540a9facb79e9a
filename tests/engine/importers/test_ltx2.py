"""LTX-2 configs of the peer trainers that have it (ai-toolkit's arch ltx2, SimpleTuner's model_family ltxvideo2)
import as model.family ltx2 with their windows (frames, fps), size, rank, alpha, lr and steps; LTX-Video (the older
model) and LTX-2's later variants (2.3, 2.5: diffusion-pipe's ltx2 type trains 2.3 only) stay refused by name.
musubi-tuner and OneTrainer have no LTX model at all."""

from __future__ import annotations

import re

import pytest

from engine.config.job import parse_job
from engine.config.reading import read_yaml
from engine.errors import JobInvalid
from engine.importers import import_file, import_text
from engine.importers.common import family_of_name
from tests.helpers.videos import make_clips

# the shape of ai-toolkit's UI defaults for arch ltx2 (ui/src/app/jobs/new/options.tsx)
AI_TOOLKIT_LTX2 = """\
job: extension
config:
  name: ltx2 clips
  process:
    - type: sd_trainer
      trigger_word: ohwx
      network: {type: lora, linear: 32, linear_alpha: 16}
      datasets:
        - folder_path: {data}
          caption_ext: txt
          resolution: [512]
          num_frames: 9
          fps: 24
          do_audio: true
          shrink_video_to_frames: false
      train:
        batch_size: 1
        steps: 2000
        lr: 0.0001
        optimizer: adamw8bit
        noise_scheduler: flowmatch
        timestep_type: weighted
        audio_loss_multiplier: 1.0
        dtype: bf16
      model:
        name_or_path: Lightricks/LTX-2
        arch: ltx2
        quantize: true
        low_vram: true
      sample:
        sample_every: 250
        num_frames: 121
        fps: 24
        prompts: ["ohwx walking"]
"""

# the shape of SimpleTuner's examples/ltxvideo2-19b-t2v.peft-lora and its quickstart's video backend
SIMPLETUNER_LTX2 = """{
  "model_family": "ltxvideo2", "model_type": "lora", "model_flavour": "dev", "lora_rank": 16,
  "learning_rate": 6e-5, "max_train_steps": 200, "train_batch_size": 1, "optimizer": "adamw_bf16",
  "checkpointing_steps": 100, "data_backend_config": "backend.json", "resolution": 480,
  "resolution_type": "pixel_area", "validation_num_video_frames": 81
}"""
SIMPLETUNER_BACKEND = """[
  {"id": "clips", "type": "local", "dataset_type": "video", "instance_data_dir": "{data}",
   "caption_strategy": "textfile", "video": {"num_frames": 10, "min_frames": 10}},
  {"id": "text-embeds", "type": "local", "dataset_type": "text_embeds", "default": true, "cache_dir": "c"}
]"""

CASES = [
    ("ai-toolkit", "ltx2.yaml", AI_TOOLKIT_LTX2, None,
     {"model.family": "ltx2", "model.path": "Lightricks/LTX-2", "model.base_precision": "fp8",
      "model.dtype": "bfloat16", "lora.rank": 32, "lora.alpha": 16.0, "train.lr": 1e-4, "train.steps": 2000,
      "train.optimizer": "adamw8bit", "data.resolution": [512], "data.frames": [9], "data.fps": 24.0,
      "data.trigger": "ohwx", "sample.every_steps": 250},
     {"job", "type", "datasets[0].do_audio", "datasets[0].shrink_video_to_frames", "train.noise_scheduler",
      "train.timestep_type", "train.audio_loss_multiplier", "model.low_vram", "sample.num_frames", "sample.fps"}),
    ("simpletuner", "config.json", SIMPLETUNER_LTX2, ("backend.json", SIMPLETUNER_BACKEND),
     {"model.family": "ltx2", "model.path": "Lightricks/LTX-2", "lora.rank": 16,
      "lora.alpha": 16.0,  # SimpleTuner's alpha is the rank when unset
      "train.lr": 6e-5, "train.steps": 200, "data.resolution": [480],
      "data.frames": [9],  # 10 is not 8k + 1: cut to 9, as SimpleTuner trims LTX-2's clips
      "data.fps": 25.0},  # SimpleTuner's LTX-2 framerate default
     {"data_backend_config", "backends[text-embeds]", "backends[0].id", "backends[0].type",
      "backends[0].dataset_type", "backends[0].video.min_frames",
      "backends[0].video.is_i2v",  # SimpleTuner's default for ltxvideo2: image-to-video, which lorad's is not
      "validation_num_video_frames"}),
]


def value(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    return make_clips(tmp_path_factory.mktemp("clips"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_tools_ltx2_config_imports_to_a_valid_ltx2_job_with_its_values(case, clips, tmp_path):
    tool, name, text, beside, want, dropped = case
    src = tmp_path / name
    src.write_text(text.replace("{data}", str(clips)))
    if beside:
        (tmp_path / beside[0]).write_text(beside[1].replace("{data}", str(clips)))
    result = import_file(src)
    job = parse_job(read_yaml(result.text), tmp_path, source=name).model_dump(mode="json")  # lorad's validator
    for key, expected in want.items():
        assert value(job, key) == expected, key
    got = {k for k, _, _ in result.imported.dropped}  # everything else was carried
    assert got == dropped, f"extra: {sorted(got - dropped)}; missing: {sorted(dropped - got)}"


def test_an_ai_toolkit_ltx2_dataset_without_frames_or_fps_gets_ai_toolkits_defaults(clips, tmp_path):
    text = re.sub(r"\n          (num_frames|fps): \d+", "", AI_TOOLKIT_LTX2)
    # LTX-2's own single file (here its fp8 one) is read as the same weights' diffusers repository
    text = text.replace("Lightricks/LTX-2\n", "/models/ltx-2-19b-dev-fp8.safetensors\n")
    job = read_yaml(import_text(text.replace("{data}", str(clips)), "a.yaml", tmp_path).text)
    assert job["data"]["frames"] == [1] and job["data"]["fps"] == 24  # DatasetConfig's 1 frame (stills), 24 fps
    assert job["model"]["path"] == "Lightricks/LTX-2"


REFUSED = [
    ("diffusion-pipe LTX-Video", "d.toml", "[model]\ntype = 'ltx-video'\ndiffusers_path = '/m/LTX-Video'\n"
     "[adapter]\ntype = 'lora'\nrank = 16\n", r"model\.type: unsupported model family: 'ltx-video' \(LTX-Video,"),
    ("simpletuner LTX-Video", "s.json", '{"model_family": "ltxvideo", "model_type": "lora", '
     '"pretrained_model_name_or_path": "Lightricks/LTX-Video"}',
     r"model_family: unsupported model family: 'ltxvideo' \(LTX-Video,"),
    ("diffusion-pipe ltx2 (LTX-2.3 only)", "d.toml", "[model]\ntype = 'ltx2'\ndiffusion_model = "
     "'/m/ltx-2.3-22b-dev.safetensors'\n[adapter]\ntype = 'lora'\nrank = 16\n",
     r"model\.type: unsupported model family: 'ltx2' \(LTX-2\.3; lorad's ltx2 trains LTX-2 itself"),
    ("ai-toolkit ltx2.3", "a.yaml", AI_TOOLKIT_LTX2.replace("arch: ltx2", "arch: ltx2.3"),
     r"model\.arch: unsupported model family: 'ltx2\.3' \(LTX-2\.3;"),
    ("ai-toolkit ltx2 arch, LTX-2.5 weights", "a.yaml",
     AI_TOOLKIT_LTX2.replace("Lightricks/LTX-2\n", "Lightricks/LTX-2.5\n"),
     r"model\.name_or_path: unsupported model family: 'Lightricks/LTX-2\.5' \(LTX-2\.5;"),
    ("simpletuner 2.3 flavour", "s.json", SIMPLETUNER_LTX2.replace('"dev"', '"2.3-dev"'),
     r"model_flavour: unsupported model family: 'LTX-2\.3-dev' \(LTX-2\.3;"),
]


@pytest.mark.parametrize("name,text,pattern", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_ltx_video_and_ltx2s_later_variants_are_refused_by_name(name, text, pattern, clips, tmp_path):
    (tmp_path / "backend.json").write_text(SIMPLETUNER_BACKEND.replace("{data}", str(clips)))
    with pytest.raises(JobInvalid) as e:
        import_text(text.replace("{data}", str(clips)), name, tmp_path)
    assert re.search(pattern, str(e.value)), str(e.value)


def test_ltx2_names_map_to_ltx2_and_ltx_video_and_later_variants_to_none():
    assert [family_of_name(n) for n in ("Lightricks/LTX-2", "/models/ltx-2-19b-dev-fp8.safetensors",
                                        "Lightricks/LTX-Video", "ltx-video-2b-v0.9.1", "dg845/LTX-2.3-Diffusers",
                                        "Lightricks/LTX-2.5")] == ["ltx2", "ltx2", None, None, None, None]
