"""Imported jobs train: an ai-toolkit FLUX config and a kohya config on kohya's `N_name` folder layout, each
imported by `lorad import`, train on the tiny FLUX pipeline, and a run killed after its first checkpoint resumes
to adapter weights bit-identical to an uninterrupted run's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from daemon.client import cli
from engine.config.job import load_job
from engine.families.image.flux_export import DIFFUSERS_FILE
from tests.helpers import images as fh
from tests.helpers.forked import killed_then_resumed, run_to_end

AI_TOOLKIT = """\
job: extension
config:
  name: imported-aitk
  process:
    - type: sd_trainer
      trigger_word: sks
      network: {type: lora, linear: 4, linear_alpha: 8}
      save: {save_every: 2, max_step_saves_to_keep: 2}
      datasets: [{folder_path: data, caption_ext: txt, resolution: [32]}]
      train: {batch_size: 1, steps: 6, lr: 2e-3, optimizer: adamw, dtype: fp32, seed: 3}
      model: {name_or_path: "builtin:tiny-flux", is_flux: true}
"""

KOHYA = """\
pretrained_model_name_or_path = "builtin:tiny-flux"
network_module = "networks.lora_flux"
train_data_dir = "train"
resolution = "32,32"
train_batch_size = 1
max_train_steps = 6
learning_rate = 2e-3
optimizer_type = "AdamW"
mixed_precision = "no"
network_dim = 4
network_alpha = 4
save_every_n_steps = 2
seed = 5
"""


def imported(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    assert cli.main(["import", str(tmp / name), "--to", str(tmp / "job.yaml")]) == 0
    return tmp / "job.yaml"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Path]:
    a = tmp_path_factory.mktemp("aitk")
    fh.make_images(a / "data", [("a.png", 40, 32, "a red square"), ("b.png", 32, 40, None)])
    k = tmp_path_factory.mktemp("kohya")
    fh.make_images(k / "train" / "3_sks cat", [("c.png", 32, 32, None), ("d.png", 40, 32, None)])
    return {"ai-toolkit": imported(a, "flux.yaml", AI_TOOLKIT), "kohya": imported(k, "config.toml", KOHYA)}


def test_the_imports_are_the_jobs_they_meant(jobs):
    a, k = load_job(jobs["ai-toolkit"]), load_job(jobs["kohya"])
    assert (a.model.family, a.lora.rank, a.lora.alpha, a.data.trigger, a.train.steps, a.checkpoint.every_steps) == \
        ("flux", 4, 8.0, "sks", 6, 2)
    # kohya's folder: its N is the repeats, its name the caption of the images that have none
    assert (k.data.path.endswith("train/3_sks cat"), k.data.repeats, k.data.trigger, k.train.schedule) == \
        (True, 3, "sks cat", "constant")


@pytest.mark.parametrize("tool", ["ai-toolkit", "kohya"])
def test_an_imported_job_killed_after_a_checkpoint_resumes_bit_identical(tool, jobs, tmp_path):
    job = jobs[tool]
    with ThreadPoolExecutor(max_workers=2) as pool:
        ref = pool.submit(run_to_end, job, tmp_path / "uninterrupted")
        got = pool.submit(killed_then_resumed, job, tmp_path / "interrupted", kill_at=(3, 4))
        ref.result(timeout=600)
        from_step = got.result(timeout=600)
    want, have = (fh.tensor_bytes(tmp_path / wd / "output" / DIFFUSERS_FILE) for wd in ("uninterrupted", "interrupted"))
    assert sorted(want) == sorted(have) and want
    assert [name for name in want if want[name] != have[name]] == [], f"resumed from step {from_step}"
