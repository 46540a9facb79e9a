"""data.control_path (edit LoRAs): a bad paired dataset is refused at submit naming the file, in the inbox and over
`lorad submit` alike, and a control_path on a base that is not an edit model is refused naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.store.db import Store
from daemon.system.log import setup
from engine.config.job import load_job
from engine.errors import JobInvalid


def _image(path: Path, w: int, h: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def pairs(tmp_path) -> Path:
    """target/{a,b}.png with captions and control/{a.jpg,b.png}: a good paired dataset."""
    root = tmp_path / "allowed"
    for i, (name, w, h) in enumerate([("a", 48, 32), ("b", 32, 32)]):
        _image(root / "target" / f"{name}.png", w, h, i)
        (root / "target" / f"{name}.txt").write_text("make it red\n")
    _image(root / "control" / "a.jpg", 96, 64, 5)  # another size, the same aspect ratio: fine
    _image(root / "control" / "b.png", 32, 32, 6)
    return root


def job(root: Path, model: str = "builtin:tiny-flux-kontext", **data) -> dict:
    return {"name": "edit", "model": {"family": "flux", "path": model, "dtype": "float32"},
            "data": {"path": str(root / "target"), "control_path": str(root / "control"), "resolution": [32], **data},
            "train": {"steps": 2}}


@pytest.fixture
def intake(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "state.db")
    yield Intake(home, DaemonConfig(allowed_roots=["{home}", str(tmp_path / "allowed")]), store, setup())
    store.close()


def refused_everywhere(intake: Intake, raw: dict, words: str) -> None:
    """The inbox rejects it, `lorad submit` (the socket's submit_text) raises, both with `words`; no job made."""
    before = (len(intake.store.jobs()), sorted((intake.home / "jobs").glob("*")))
    (intake.inbox / "edit.yaml").write_text(yaml.safe_dump(raw))
    out = intake.take(intake.inbox / "edit.yaml")
    assert out is not None and out.job_id is None and words in out.error, out
    with pytest.raises(JobInvalid) as e:
        intake.submit_text("edit.yaml", yaml.safe_dump(raw))
    assert words in str(e.value)
    assert (len(intake.store.jobs()), sorted((intake.home / "jobs").glob("*"))) == before


def test_a_good_paired_dataset_is_accepted_by_the_inbox(intake, pairs):
    (intake.inbox / "edit.yaml").write_text(yaml.safe_dump(job(pairs)))
    out = intake.take(intake.inbox / "edit.yaml")
    assert out.job_id is not None, out.error


def test_a_target_without_its_control_is_refused_naming_the_target(intake, pairs):
    (pairs / "control" / "b.png").unlink()
    refused_everywhere(intake, job(pairs), f"data.control_path: {pairs / 'target' / 'b.png'} has no control")


def test_a_control_without_a_target_is_refused_naming_the_control(intake, pairs):
    _image(pairs / "control" / "c.png", 32, 32)
    refused_everywhere(intake, job(pairs), f"data.control_path: {pairs / 'control' / 'c.png'} has no target")


def test_two_controls_of_one_stem_are_refused_naming_both(intake, pairs):
    _image(pairs / "control" / "b.webp", 32, 32)
    refused_everywhere(intake, job(pairs), "are two controls for one target")


def test_a_corrupt_control_image_is_refused_naming_it(intake, pairs):
    bad = pairs / "control" / "b.png"
    bad.write_bytes(bad.read_bytes()[:60])  # truncated
    refused_everywhere(intake, job(pairs), f"data.control_path: {bad} is not a readable image")


def test_a_control_of_another_aspect_ratio_than_its_target_is_refused_naming_both(intake, pairs):
    _image(pairs / "control" / "b.png", 48, 32)
    refused_everywhere(intake, job(pairs), f"{pairs / 'control' / 'b.png'} is 48x32 but its target "
                                           f"{pairs / 'target' / 'b.png'} is 32x32")


def test_a_control_smaller_than_a_latent_patch_is_refused(intake, pairs):
    _image(pairs / "control" / "b.png", 8, 8)
    refused_everywhere(intake, job(pairs), "is 8x8; a control needs at least 16 px a side")


def test_control_path_on_a_base_that_is_not_an_edit_model_is_refused_naming_the_key(intake, pairs):
    refused_everywhere(intake, job(pairs, model="builtin:tiny-flux"),
                       "data.control_path: builtin:tiny-flux is not an edit model")


def test_kontext_takes_one_control_folder(pairs):
    shutil.copytree(pairs / "control", pairs / "control2")
    raw = job(pairs)
    raw["data"]["control_path"] = [str(pairs / "control"), str(pairs / "control2")]
    (pairs / "job.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(JobInvalid, match="FluxKontextPipeline takes one control image per target"):
        load_job(pairs / "job.yaml")


@pytest.mark.parametrize("over, words", [
    ({"regularisation": {"path": "x"}}, "data.regularisation, data.control_path"),
    ({"validation": {"path": "x"}}, "data.validation.path, data.control_path"),
])
def test_image_sets_without_controls_are_refused_beside_control_path(pairs, over, words):
    raw = job(pairs)
    raw["data"].update(over)
    (pairs / "job.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(JobInvalid, match=words):
        load_job(pairs / "job.yaml", check_paths=False)


def test_control_path_outside_the_allowed_roots_is_refused(tmp_path, pairs):
    outside = tmp_path / "elsewhere"
    shutil.copytree(pairs / "control", outside)
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "state.db")
    try:
        it = Intake(home, DaemonConfig(allowed_roots=["{home}", str(pairs)]), store, setup())
        raw = job(pairs)
        raw["data"]["control_path"] = [str(outside)]
        with pytest.raises(JobInvalid, match="data.control_path: .* outside the allowed roots"):
            it.submit_text("edit.yaml", yaml.safe_dump(raw))
    finally:
        store.close()


def test_flux2_refuses_a_pair_whose_bucket_its_pipeline_refuses_as_a_reference(intake, pairs):
    raw = job(pairs, model="builtin:tiny-flux2")
    raw["model"]["family"] = "flux2"
    refused_everywhere(intake, raw, f"data.control_path: the controls of {pairs / 'target' / 'a.png'} train at "
                                    "its bucket 32x32 (data.resolution 32), which Flux2KleinPipeline refuses")
    raw["data"]["resolution"] = [96]  # buckets 112x80 and 96x96
    (intake.inbox / "ok.yaml").write_text(yaml.safe_dump(raw))
    assert intake.take(intake.inbox / "ok.yaml").job_id is not None


def test_the_reference_limits_are_flux2s_own_image_processor_defaults():
    """Read from diffusers' source (importing it would import torch: seconds, in a test of the validator)."""
    import ast
    import importlib.util

    from engine.config.controls import REFERENCE_LIMITS

    spec = importlib.util.find_spec("diffusers")
    src = Path(spec.origin).parent / "pipelines" / "flux2" / "image_processor.py"
    fn = next(n for n in ast.walk(ast.parse(src.read_text()))
              if isinstance(n, ast.FunctionDef) and n.name == "check_image_input")
    args = fn.args.args[-len(fn.args.defaults):]
    defaults = {a.arg: d for a, d in zip(args, fn.args.defaults, strict=True)}
    own = (ast.literal_eval(defaults["min_side_length"]), float(ast.literal_eval(defaults["max_aspect_ratio"])))
    assert set(REFERENCE_LIMITS.values()) == {own}


def test_qwen_image_edit_plus_takes_a_control_folder_per_slot_and_edit_one(intake, pairs):
    shutil.copytree(pairs / "control", pairs / "control2")
    raw = job(pairs, model="builtin:tiny-qwen-image-edit-plus")
    raw["model"]["family"] = "qwen_image"
    raw["data"]["control_path"] = [str(pairs / "control"), str(pairs / "control2")]
    (intake.inbox / "plus.yaml").write_text(yaml.safe_dump(raw))
    assert intake.take(intake.inbox / "plus.yaml").job_id is not None
    raw["model"]["path"] = "builtin:tiny-qwen-image-edit"
    refused_everywhere(intake, raw, "QwenImageEditPipeline takes one control image per target; give one folder")


def test_qwen_image_edit_refuses_sample_prompts_it_cannot_read_yet(pairs):
    raw = job(pairs, model="builtin:tiny-qwen-image-edit")
    raw["model"]["family"] = "qwen_image"
    raw["sample"] = {"prompts": ["a cat"]}
    (pairs / "job.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(JobInvalid, match="sample.prompts, data.control_path: Qwen-Image-Edit reads every prompt"):
        load_job(pairs / "job.yaml")


def test_a_sample_prompt_names_its_control_image_and_a_bad_one_is_refused_naming_it(intake, pairs):
    raw = job(pairs)
    raw["sample"] = {"every_steps": 2, "prompts": [{"prompt": "make it red", "control": str(pairs / "control" / "b.png")}]}
    (intake.inbox / "ok.yaml").write_text(yaml.safe_dump(raw))
    assert intake.take(intake.inbox / "ok.yaml").job_id is not None
    raw["sample"]["prompts"][0]["control"] = str(pairs / "control" / "nope.png")
    refused_everywhere(intake, raw, f"sample.prompts[0].control: {pairs / 'control' / 'nope.png'} is not a readable")
    raw["sample"]["prompts"][0]["control"] = [str(pairs / "control" / "b.png")] * 2
    refused_everywhere(intake, raw, "sample.prompts[0].control: one image per data.control_path folder (1)")
    del raw["data"]["control_path"]
    raw["model"]["path"] = "builtin:tiny-flux"
    raw["sample"]["prompts"][0]["control"] = str(pairs / "control" / "b.png")
    refused_everywhere(intake, raw, "sample.prompts[0].control: control images are for edit jobs")


def test_a_sample_control_outside_the_allowed_roots_is_refused(tmp_path, pairs):
    outside = tmp_path / "elsewhere"
    shutil.copytree(pairs / "control", outside)
    home = tmp_path / "home"
    home.mkdir()
    store = Store(home / "state.db")
    try:
        it = Intake(home, DaemonConfig(allowed_roots=["{home}", str(pairs)]), store, setup())
        raw = job(pairs)
        raw["sample"] = {"prompts": [{"prompt": "x", "control": str(outside / "b.png")}]}
        with pytest.raises(JobInvalid, match=r"sample.prompts\[0\].control: .* outside the allowed roots"):
            it.submit_text("edit.yaml", yaml.safe_dump(raw))
    finally:
        store.close()
