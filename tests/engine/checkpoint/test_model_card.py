"""output/ explains itself: README.md is a model card (not peft's empty template) and lorad-output.json holds the
same facts for scripts, beside the step and identity that resume reads."""

from __future__ import annotations

import json

import yaml

from engine.checkpoint.output import OUTPUT_STAMP, output_step
from engine.report import model_card as card
from tests.helpers.images import flux_job_dict, make_images


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_a_finished_job_has_a_model_card_and_the_same_facts_for_scripts(finished_tiny_job):
    _job, cfg, workdir, _names = finished_tiny_job
    readme = (workdir / "output" / "README.md").read_text()
    assert "More Information Needed" not in readme
    assert front_matter(readme) == {"base_model": cfg.model.path, "library_name": "peft",
                                    "tags": ["lora", "lorad", "causal_lm", "text-generation"]}
    for line in (f"| base model | `{cfg.model.path}` |", f"| steps | {cfg.train.steps} |",
                 f"| adapter | lora, rank {cfg.lora.rank}, alpha {cfg.lora.alpha} (scale alpha / rank = "
                 f"{cfg.lora.alpha / cfg.lora.rank:g}) |", "| weights | the adapter as trained, at the last step. |",
                 "model = PeftModel.from_pretrained(base, \"path/to/this/folder\")"):
        assert line in readme
    stamp = json.loads((workdir / "output" / OUTPUT_STAMP).read_text())
    assert stamp["weights"] == "trained" and stamp["family"] == "causal_lm" and stamp["steps"] == 12
    assert stamp["dataset"]["size"] > 0 and f"| dataset | {stamp['dataset']['size']} examples" in readme
    assert "adapter_model.safetensors" in stamp["files"] and stamp["lora"]["rank"] == cfg.lora.rank
    assert output_step(workdir, cfg) == 12  # resume still reads its step and identity from the same file


def test_an_image_card_names_the_ema_the_trigger_the_samples_and_each_file_it_can_load(tmp_path):
    from engine.config.job import parse_job

    images = make_images(tmp_path / "images")
    cfg = parse_job(flux_job_dict("builtin:tiny-flux", images, train={"ema": {"decay": 0.99, "export_raw": True}}),
                    tmp_path)
    for step, count in ((8, 5), (12, 2)):  # step 12 is past the exported step 10: not its samples
        d = tmp_path / "samples" / f"step-{step:08d}"
        d.mkdir(parents=True)
        for i in range(count):
            (d / f"{i:02d}.png").write_bytes(b"png")
    (tmp_path / "samples" / "step-x").mkdir()  # not a step: ignored
    found = card.newest_samples(tmp_path, 10)
    assert [p.parent.name for p in found] == ["step-00000008"] * 4 and [p.name for p in found][0] == "00.png"
    files = ["pytorch_lora_weights.safetensors", "flux_lora_comfyui.safetensors"]
    f = card.facts(cfg, {"steps": 10, "lorad_version": "1.2"}, files, [f"samples/{p.name}" for p in found], 3)
    assert f["weights"] == "ema" and f["trigger"] == "sks" and f["dataset"]["size"] == 3
    text = card.model_card(cfg, f)
    assert front_matter(text)["instance_prompt"] == "sks" and front_matter(text)["library_name"] == "diffusers"
    assert "exponential moving average of the adapter (decay 0.99). The raw last-step weights are in raw/." in text
    assert "| trigger word | `sks` |" in text and "| dataset | 3 images from `images` |" in text
    assert 'pipe.load_lora_weights("path/to/this/folder", weight_name="pytorch_lora_weights.safetensors")' in text
    assert "copy `flux_lora_comfyui.safetensors` into `ComfyUI/models/loras/`" in text
    assert [line for line in text.splitlines() if line.startswith("![")] == [
        f"![sample {i}](samples/{i:02d}.png)" for i in range(4)]


def test_schedule_free_weights_are_named_as_its_average(tmp_path):
    from engine.config.job import parse_job

    images = make_images(tmp_path / "images")
    cfg = parse_job(flux_job_dict("builtin:tiny-flux", images, train={"optimizer": "adamw_schedulefree"}), tmp_path)
    assert card.which_weights(cfg)[0] == "schedule_free_average"


def test_a_flux3_card_loads_the_base_as_a_modular_pipeline_and_says_comfyuis_rules_were_not_checked(tmp_path):
    """diffusers has FLUX.3's pipelines as modular pipelines only: DiffusionPipeline.from_pretrained cannot read
    the base model the card names."""
    from engine.config.job import parse_job

    images = make_images(tmp_path / "images")
    d = flux_job_dict("builtin:tiny-flux3", images)
    d["model"]["family"] = "flux3"
    cfg = parse_job(d, tmp_path)
    files = ["pytorch_lora_weights.safetensors", "flux3_lora_comfyui.safetensors"]
    text = card.model_card(cfg, card.facts(cfg, {"steps": 10}, files, [], 3))
    assert "from diffusers import ModularPipeline" in text and "DiffusionPipeline" not in text
    assert 'pipe = ModularPipeline.from_pretrained("builtin:tiny-flux3")' in text
    assert "pipe.load_components(dtype=torch.bfloat16)" in text
    assert "ComfyUI's FLUX.3 key rules were not available to check." in text
