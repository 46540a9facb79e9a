"""Another trainer's config dropped in the inbox or sent by `lorad submit` is taken as is: imported, the note of
what was not carried over in the job's events, `lorad status ID` saying where it came from; bad ones are
refused in one line and nothing is queued."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.client import cli
from daemon.client.verbs import local_import
from daemon.config.daemon import DaemonConfig
from daemon.intake.accept import Intake
from daemon.service import handlers
from daemon.store.db import Store
from daemon.system.log import setup
from engine.config.job import dump_job
from tests.engine.importers.configs import DIFFUSION_PIPE_DATASET, DIFFUSION_PIPE_FLUX
from tests.engine.importers.configs_sdxl import AI_TOOLKIT_SD15
from tests.engine.importers.test_tools import fill
from tests.helpers.images import make_images

AI_TOOLKIT = """\
job: extension
config:
  name: imported-flux
  process:
    - type: sd_trainer
      trigger_word: sks
      network: {type: lora, linear: 4, linear_alpha: 8}
      save: {dtype: float16, save_every: 2}
      datasets: [{folder_path: {root}/data, resolution: [32]}]
      train: {steps: 4, lr: 1e-3, optimizer: adamw}
      model: {name_or_path: builtin:tiny-flux, is_flux: true}
"""


@pytest.fixture
def intake(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    make_images(tmp_path / "allowed" / "data", [("a.png", 48, 32, "a cat"), ("b.png", 32, 48, None)])
    store = Store(home / "state.db")
    cfg = DaemonConfig(allowed_roots=["{home}", str(tmp_path / "allowed")])
    it = Intake(home, cfg, store, setup())
    yield it
    store.close()


def root(it: Intake) -> Path:
    return it.home.parent / "allowed"


def events(it: Intake, job_id: str) -> list[dict]:
    return [json.loads(line) for line in (it.home / "jobs" / job_id / "events.jsonl").read_text().splitlines()]


def status(it: Intake, job_id: str) -> p.JobDetail:
    ctx = handlers.Context(home=it.home, store=it.store, intake=it, supervisor=None, started_at=time.time(),
                           socket_path=it.home / "lorad.sock")
    return handlers.status(ctx, p.Status(job=job_id)).job


def test_an_ai_toolkit_file_in_the_inbox_is_imported_and_status_says_from_where(intake, capsys):
    f = intake.inbox / "flux.yaml"
    f.write_text(fill(AI_TOOLKIT, root(intake)))
    out = intake.take(f)
    assert out.error is None and out.job_id
    (ev,) = [e for e in events(intake, out.job_id) if e["event"] == "imported"]
    assert ev["from_tool"] == "ai-toolkit" and ev["from_file"] == "flux.yaml"
    assert any(line.startswith("save.dtype = float16 — lorad does this another way") for line in ev["not_carried_over"])
    detail = status(intake, out.job_id)
    assert detail.imported_from == "ai-toolkit" and detail.not_carried_over == ev["not_carried_over"]
    from daemon.client.render import print_detail

    print_detail(p.JobStatusReply(job=detail))
    assert "imported from ai-toolkit" in capsys.readouterr().out
    job = (intake.home / "jobs" / out.job_id / "job.yaml").read_text()
    assert "rank: 4" in job and "alpha: 8.0" in job


def test_a_diffusion_pipe_toml_and_its_dataset_inside_the_roots_are_taken(intake):
    r = root(intake)
    make_images(r / "reg", [("r.png", 32, 32, "x")])
    (r / "dataset.toml").write_text(fill(DIFFUSION_PIPE_DATASET, r))
    f = intake.inbox / "main.toml"
    f.write_text(fill(DIFFUSION_PIPE_FLUX, r).replace("dataset = 'dataset.toml'", f"dataset = '{r}/dataset.toml'")
                 .replace("black-forest-labs/FLUX.1-dev", "builtin:tiny-flux"))
    out = intake.take(f)
    assert out.error is None, out.error
    assert status(intake, out.job_id).imported_from == "diffusion-pipe"


def test_a_side_file_outside_the_allowed_roots_is_not_read(intake, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "dataset.toml").write_text(fill(DIFFUSION_PIPE_DATASET, root(intake)))
    f = intake.inbox / "main.toml"
    f.write_text(DIFFUSION_PIPE_FLUX.replace("dataset = 'dataset.toml'", f"dataset = '{outside}/dataset.toml'"))
    out = intake.take(f)
    assert out.job_id is None and "outside the allowed roots; not read" in out.error
    assert intake.store.jobs() == []


@pytest.mark.parametrize("name,text,says", [
    ("odd.toml", "x = 1\n", "not a format lorad import knows; it reads ai-toolkit YAML"),
    ("sd15.yaml", AI_TOOLKIT_SD15, "model.arch: unsupported model family: 'sd1' (Stable Diffusion 1.5)"),
])
def test_a_bad_foreign_file_is_rejected_in_one_line_and_nothing_is_queued(intake, name, text, says):
    f = intake.inbox / name
    f.write_text(fill(text, root(intake)))
    out = intake.take(f)
    assert out.job_id is None and says in out.error and "\n" not in out.error
    assert intake.store.jobs() == [] and (intake.rejected / name).is_file()


def test_submit_imports_on_the_client_and_the_daemon_keeps_the_note(intake, tmp_path):
    src = tmp_path / "allowed" / "flux.yaml"
    src.write_text(fill(AI_TOOLKIT, root(intake)))
    header, cfg = local_import(src)  # what `lorad submit` sends: the header, then the normalised job
    assert header.startswith("# lorad import: from ai-toolkit (flux.yaml)")
    out = intake.submit_text("flux.yaml", header + dump_job(cfg))
    assert status(intake, out.job_id).imported_from == "ai-toolkit"


@pytest.mark.parametrize("name,text,says", [
    ("odd.toml", "x = 1\n", "not a format lorad import knows"),
    ("list.yaml", "- 1\n- 2\n", "mapping"),
    ("sd15.yaml", AI_TOOLKIT_SD15, "unsupported model family: 'sd1'"),
])
@pytest.mark.parametrize("verb", ["import", "submit", "check"])
def test_bad_input_is_one_line_and_exit_65_for_import_submit_and_check(verb, name, text, says, tmp_path, capsys):
    f = tmp_path / name
    f.write_text(fill(text, tmp_path))
    # submit: refused here, before the socket (none exists: a queued job is impossible, and it is not reached)
    argv = [verb, str(f)] + (["--socket", str(tmp_path / "no.sock")] if verb == "submit" else [])
    assert cli.main(argv) == 65
    err = capsys.readouterr().err.strip().splitlines()
    if verb == "check" and name == "list.yaml":
        assert err == ["lorad: list.yaml: the job file must be a YAML mapping of sections (name, model, data, ...), "
                       "got list"]
        return
    assert len(err) == 1 and says in err[0] and name in err[0], err


def test_import_json_gives_the_job_its_origins_and_what_was_not_carried(tmp_path, capsys):
    make_images(tmp_path / "data", [("a.png", 40, 32, "a dog")])
    (tmp_path / "main.toml").write_text(fill(DIFFUSION_PIPE_FLUX, tmp_path))
    (tmp_path / "dataset.toml").write_text(fill(DIFFUSION_PIPE_DATASET, tmp_path))
    assert cli.main(["import", str(tmp_path / "main.toml"), "--json", "--to", str(tmp_path / "job.yaml")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["tool"] == "diffusion-pipe" and out["written"] == str(tmp_path / "job.yaml")
    assert out["job"]["lora"]["rank"] == 32 and out["origin"]["lora.rank"] == "adapter.rank = 32"
    assert {"key": "pipeline_stages", "value": 1} in [{k: d[k] for k in ("key", "value")} for d in out["not_carried"]]
    assert (tmp_path / "job.yaml").read_text().startswith("# lorad import: from diffusion-pipe (main.toml)")
    assert cli.main(["import", str(tmp_path / "dataset.toml"), "--json"]) == 65  # a dataset alone: no model
    bad = json.loads(capsys.readouterr().out)
    assert bad["ok"] is False and bad["problems"]
