"""`lorad run` in the foreground tells the user what happened: where it resumed, where it stopped and how to go
on, and where the adapter is. Exit codes are the engine's (0 done, 75 stopped and resumable)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import yaml

from daemon.client.cli import main as lorad
from daemon.client.foreground import run_summary
from daemon.system.paths import job_dir
from engine.report.events import read_events
from tests.helpers.jobs import QUICKSTART_DATA, deep_update, tiny_job_dict


def _sigterm_at_step(workdir, step: int) -> threading.Thread:
    """Ctrl-C's twin: SIGTERM to this process once the run has logged `step` (the handler runs in the main thread)."""

    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(e.get("event") == "step" and e["step"] >= step for e in read_events(workdir)):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_lorad_run_says_where_it_stopped_where_it_resumed_and_where_the_adapter_is(tmp_path, micro_model, capsys,
                                                                                    keep_signal_handlers):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA),
                                              {"train": {"steps": 20}, "checkpoint": {"every_steps": 1000}})))
    home = tmp_path / "home"
    workdir = job_dir(home, "tiny")
    argv = ["run", str(job), "--home", str(home), "--quiet"]

    watcher = _sigterm_at_step(workdir, 2)
    assert lorad(argv) == 75
    watcher.join(5)
    err = capsys.readouterr().err
    (stopped,) = [e for e in read_events(workdir) if e["event"] == "stopped"]
    n = stopped["step"]
    assert 2 <= n < 20  # stopped at step 2: the resumed run still has steps to train
    assert (f"lorad: stopped at step {n}; checkpoint step-{n:08d} is committed — run the same command to resume\n"
            in err)
    assert "resumed" not in err and "done" not in err  # a fresh start resumes nothing

    assert lorad(argv) == 0
    err = capsys.readouterr().err
    assert f"lorad: resumed job tiny from step {n} (checkpoint step-{n:08d})\n" in err
    assert err.endswith(f"lorad: done — adapter in {workdir / 'output'}\n")

    assert lorad(argv) == 0  # already finished: it says so, and where the adapter is
    err = capsys.readouterr().err
    assert "resumed" not in err
    assert err.endswith(f"lorad: done — adapter in {workdir / 'output'} (it had already finished: nothing trained)\n")

    # No daemon ever served this home: `lorad export` reads the saved steps from the job directory.
    assert lorad(["export", "tiny", "--home", str(home), "--step", "20", "--to", str(tmp_path / "lora")]) == 0
    adapter = "adapter_model.safetensors"
    assert (tmp_path / "lora" / adapter).read_bytes() == (workdir / "output" / adapter).read_bytes()


def test_a_stop_before_the_first_checkpoint_says_the_run_starts_again():
    events = [{"event": "start"}, {"event": "stopped", "step": 0, "reason": "SIGINT", "checkpoint": 0}]
    assert run_summary(events, 75) == [
        "stopped at step 0, before the first checkpoint — run the same command to start again"]
    assert run_summary([{"event": "invalid_job"}], 65) == []  # the engine said why already


def test_only_this_runs_events_are_read_even_after_a_line_torn_by_a_kill(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"event": "done", "output": "/old"}) + "\n" + '{"event": "st')  # killed mid-write
    offset = path.stat().st_size
    with open(path, "a") as f:
        f.write(json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "stopped", "step": 3}) + "\n" + "{")
    assert read_events(tmp_path, offset) == [{"event": "start"}, {"event": "stopped", "step": 3}]
    assert read_events(tmp_path / "missing", 0) == []


def test_an_internal_error_is_one_line_on_the_terminal_with_exit_70_and_the_traceback_in_trainer_log(tmp_path,
                                                                                                    micro_model,
                                                                                                    capsys):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{ this is not json")  # valid as a job, fails inside transformers
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job_dict(broken, QUICKSTART_DATA)))
    home = tmp_path / "home"
    assert lorad(["run", str(job), "--home", str(home), "--quiet"]) == 70
    err = capsys.readouterr().err
    log = job_dir(home, "tiny") / "trainer.log"
    assert all(line.startswith("lorad: ") for line in err.splitlines()), err  # no Python traceback on the terminal
    (line,) = [x for x in err.splitlines() if "internal error" in x]
    assert line.startswith("lorad: internal error at step 1 (") and "not a valid JSON file" in line
    assert line.endswith(f"); the traceback is in {log}")
    assert "Traceback (most recent call last)" in log.read_text()
    (event,) = [e for e in read_events(job_dir(home, "tiny")) if e["event"] == "internal_error"]
    assert event["step"] == 1 and event["message"] == line
