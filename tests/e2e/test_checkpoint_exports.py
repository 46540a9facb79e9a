"""A usable LoRA at every save: each checkpoint's export/ holds what the final export of a job stopped at that step
holds, and a save killed half-way leaves no export where a user looks (a committed step-N/, `lorad export`).

Trainers are forked from the shared server (tests/helpers/forked.py); the micro Llama and the tiny FLUX.1 keep it
to a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from daemon.supervisor.disk_progress import committed_checkpoints
from tests.helpers import images
from tests.helpers.forked import ForkedTrainer, run_to_end
from tests.helpers.images import flux_job_dict, make_images, tensor_bytes

tiny_flux = images.tiny_flux  # shared session fixture

ADAPTER = "adapter_model.safetensors"


def _export(wd: Path, step: int) -> Path:
    return wd / "checkpoints" / f"step-{step:08d}" / "export"


def _lm_job(write_job, name: str, steps: int, optimizer: str) -> Path:
    return write_job(name, train={"steps": steps, "warmup_steps": 1, "optimizer": optimizer, "schedule": "constant"},
                     checkpoint={"every_steps": 2, "keep": 5})


def test_the_export_in_checkpoint_n_is_the_final_export_of_the_job_stopped_at_n(write_job, tmp_path):
    # Schedule-free exports its evaluation point x, which the writer computes from the saved y and z: it must
    # equal what the final export writes from the live optimizer (the weights as trained: the image test's raw/).
    longer, stopped = tmp_path / "steps-4", tmp_path / "steps-2"
    run_to_end(_lm_job(write_job, "steps-4.yaml", 4, "adamw_schedulefree"), longer)
    run_to_end(_lm_job(write_job, "steps-2.yaml", 2, "adamw_schedulefree"), stopped)
    got = (_export(longer, 2) / ADAPTER).read_bytes()
    assert got == (stopped / "output" / ADAPTER).read_bytes()
    assert got != (longer / "output" / ADAPTER).read_bytes(), "step 2 and step 4 trained the same weights?"
    assert (_export(longer, 4) / ADAPTER).read_bytes() == (longer / "output" / ADAPTER).read_bytes()
    assert json.loads((_export(longer, 2) / "adapter_config.json").read_text()) == \
        json.loads((stopped / "output" / "adapter_config.json").read_text())
    # listed and checksummed in the manifest, as `lorad export` and the dashboard offer them
    listed = {f.name for c in committed_checkpoints(longer) if c.step == 2 for f in c.exports}
    assert {ADAPTER, "adapter_config.json", "README.md"} <= listed


def test_an_image_checkpoint_exports_the_ema_and_the_raw_weights_as_the_output_does(tmp_path, tiny_flux):
    data = make_images(tmp_path / "data")
    job = tmp_path / "flux.yaml"
    job.write_text(yaml.safe_dump(flux_job_dict(
        tiny_flux, data, train={"steps": 2, "ema": {"decay": 0.5, "export_raw": True}},
        checkpoint={"every_steps": 1, "keep": 5})))
    wd = tmp_path / "work"
    run_to_end(job, wd)
    for name in ("pytorch_lora_weights.safetensors", "flux_lora_comfyui.safetensors"):
        for sub in ("", "raw/"):
            # safetensors writes its metadata from a hash map, in no fixed order: the tensors and the metadata
            # are compared, not the bytes
            ckpt, out = _export(wd, 2) / f"{sub}{name}", wd / "output" / f"{sub}{name}"
            assert tensor_bytes(ckpt) == tensor_bytes(out), f"{sub}{name}"
            assert _metadata(ckpt) == _metadata(out)
        assert tensor_bytes(_export(wd, 2) / name) != tensor_bytes(_export(wd, 2) / "raw" / name)
        assert (_export(wd, 1) / name).is_file()


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_a_save_killed_half_way_leaves_no_export_where_a_user_looks(write_job, tmp_path):
    job = _lm_job(write_job, "job.yaml", 6, "adamw")
    wd = tmp_path / "work"
    t = ForkedTrainer(job, wd, LORAD_DEBUG_CKPT_WRITE_DELAY_S="0.3", LORAD_CKPT_WRITER_NICE="0")
    # the export is written first, then the checkpoint's files, one per 0.3 s: killed with the export complete
    t.wait_for(lambda: any((d / "export" / ADAPTER).is_file() for d in _torn(wd)), timeout=120)
    t.kill()
    torn = _torn(wd)
    assert torn and not any((d / "manifest.json").exists() for d in torn)
    committed = committed_checkpoints(wd)
    # Where a user looks: the committed step-N/ directories (each export verifies) and `lorad export`'s list.
    steps_on_disk = sorted(p.name for p in (wd / "checkpoints").glob("step-*") if ".tmp-" not in p.name)
    assert steps_on_disk == sorted(c.path.name for c in committed)
    assert all(d.name.split(".")[0] not in steps_on_disk for d in torn)
    assert not (wd / "output").exists()
    run_to_end(job, wd)
    assert not _torn(wd)  # removed after the next commit
    for c in committed_checkpoints(wd):
        assert {f.name for f in c.exports} >= {ADAPTER}


def _torn(wd: Path) -> list[Path]:
    root = wd / "checkpoints"
    return sorted(p for p in root.iterdir() if ".tmp-" in p.name) if root.is_dir() else []

