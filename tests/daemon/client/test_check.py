"""`lorad check JOB`: without a daemon, the normalised job with its defaults, the family and model, the dataset
(items, buckets, captions missing), the steps, the outputs and the memory plan; each problem on its own line."""

from __future__ import annotations

import json

import yaml

from daemon.client import cli
from tests.helpers.images import make_images


def write_job(tmp_path, **train) -> str:
    make_images(tmp_path / "data", [("a.png", 64, 32, "a cat"), ("b.png", 32, 64, None), ("c.png", 48, 48, "x")])
    job = {"name": "checked", "model": {"family": "flux", "path": "builtin:tiny-flux"},
           "data": {"path": "data", "resolution": [32, 64], "trigger": "sks", "repeats": 2},
           "train": {"steps": 30, "batch_size": 2, **train}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return str(tmp_path / "job.yaml")


def test_check_json_says_what_the_job_will_do_with_its_defaults_filled(tmp_path, capsys):
    assert cli.main(["check", write_job(tmp_path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert (rep["family"], rep["model"], rep["steps"], rep["global_batch"]) == ("flux", "builtin:tiny-flux", 30, 2)
    d = rep["dataset"]
    assert (d["files"], d["items"], d["samples_per_epoch"], d["captions_missing"]) == (3, 6, 12, 1)
    assert d["captions_missing_files"] == ["b.png"]
    # at 64 the wide and the tall image get a wide and a tall bucket; at 32 only the square fits within 2:1
    assert sum(d["buckets"].values()) == 6 and {"80x48", "48x80", "32x32"} <= set(d["buckets"])
    assert rep["epochs"] == 5.0 and rep["output_formats"] == ["diffusers"]
    assert rep["memory_plan"].startswith("decided at start") and "built in" in rep["model_note"]
    assert rep["job"]["train"]["optimizer"] == "adamw8bit" and rep["job"]["checkpoint"]["keep"] == 3  # defaults


def test_check_prints_each_problem_on_its_own_line_naming_the_key(tmp_path, capsys):
    job = write_job(tmp_path, lr=5.0, warmup_steps=-1)
    assert cli.main(["check", job]) == 65
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert any("train.lr" in line for line in err) and any("train.warmup_steps" in line for line in err)


def test_check_a_hub_model_offline_says_it_was_not_looked_at(tmp_path, capsys):
    job = write_job(tmp_path)
    text = open(job).read().replace("builtin:tiny-flux", "black-forest-labs/FLUX.1-dev")
    open(job, "w").write(text)
    assert cli.main(["check", job]) == 0
    out = capsys.readouterr().out
    assert "not looked at (offline is fine)" in out and "memory plan: decided at start" in out
    assert "captions missing: 1 (their caption: the trigger 'sks')" in out


def test_lorad_run_and_cache_take_another_trainers_config_as_the_job_it_imports_to(tmp_path):
    import argparse

    from daemon.client.foreground import _local_job
    from tests.daemon.intake.test_import_intake import AI_TOOLKIT
    from tests.engine.importers.test_tools import fill

    make_images(tmp_path / "data", [("a.png", 48, 32, "a cat")])
    (tmp_path / "flux.yaml").write_text(fill(AI_TOOLKIT, tmp_path))
    cfg, workdir = _local_job(argparse.Namespace(job=str(tmp_path / "flux.yaml"), home=str(tmp_path / "home")))
    assert (cfg.name, cfg.model.family, cfg.lora.rank, cfg.lora.alpha, cfg.train.steps) == ("imported-flux", "flux",
                                                                                             4, 8.0, 4)
    assert workdir.parent.parent == tmp_path / "home"
