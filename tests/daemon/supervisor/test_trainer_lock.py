"""One trainer per job, whoever starts it: `lorad run` takes the trainer lock the daemon's trainers hold."""

from __future__ import annotations

import os

import yaml

from daemon.client.cli import main as lorad
from daemon.system.lock import TrainerLock
from daemon.system.paths import job_dir
from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job_dict


def test_lorad_run_refuses_a_job_that_another_trainer_holds_and_names_it(tmp_path, micro_model, capsys,
                                                                          keep_signal_handlers):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                                              {"train": {"steps": 2, "warmup_steps": 0}, "checkpoint": {"every_steps": 1}})))
    home = tmp_path / "home"
    workdir = job_dir(home, "tiny")
    workdir.mkdir(parents=True)
    other = TrainerLock(workdir, "tiny")  # another trainer (a daemon child or a second terminal)
    other.acquire()
    assert lorad(["run", str(job), "--home", str(home), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"job tiny is already being trained in {workdir} (pid {os.getpid()})" in err
    assert not (workdir / "checkpoints").exists()  # it touched nothing

    other.release()
    assert lorad(["run", str(job), "--home", str(home), "--quiet"]) == 0
    assert (workdir / "output").is_dir()
    assert (workdir / "trainer.lock").read_text().strip() == str(os.getpid())  # the holder's pid, for the next refusal
