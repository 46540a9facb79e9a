"""Resume is exact: kills at any point, signals, and re-running a finished or changed job.

The kills and signals hit real trainer processes on a micro Llama, forked from a server that imported the stack once
(tests/helpers/forked.py); the SIGTERM test starts a cold `python -m engine.run` child and reads its stdout, the
process boundary and JSON-lines contract the daemon uses.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from engine.checkpoint.store import CheckpointStore
from engine.config.job import load_job, parse_job
from engine.recipe import train
from tests.helpers.forked import LM_PRELOAD, ForkedTrainer
from tests.helpers.jobs import QUICKSTART_DATA, adapter_bytes, deep_update, read_events, tiny_job_dict
from tests.helpers.processes import Trainer

OPTIMIZERS = ["adamw8bit", "adamw"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, micro_model) -> dict[str, Path]:
    """One job file per optimizer, shared by the uninterrupted and the interrupted runs."""
    root = tmp_path_factory.mktemp("jobs")
    out = {}
    for opt in OPTIMIZERS:
        d = deep_update(tiny_job_dict(micro_model, QUICKSTART_DATA), {"name": f"tiny-{opt}", "train": {"optimizer": opt}})
        path = root / f"{opt}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        out[opt] = path
    return out


def _tmp_dirs(workdir: Path) -> list[Path]:
    ck = workdir / "checkpoints"
    return [p for p in ck.iterdir() if ".tmp-" in p.name] if ck.is_dir() else []


def run_uninterrupted(job: Path, wd: Path) -> Path:
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD)
    assert t.finish(timeout=600) == 0, t.events[-5:]
    return wd


def run_with_three_sigkills(job: Path, wd: Path) -> tuple[Path, list[str]]:
    """SIGKILL at a random step, then in the middle of a save, then at another random step; resume to the end."""
    rnd = random.Random()
    story: list[str] = []  # what happened, for failure messages

    # 1. killed at a random step after the first checkpoint is committed (the writer may lag under load)
    k1 = rnd.randint(6, 10)
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD)
    t.wait_for(lambda: bool(t.named("checkpoint_committed")))
    t.wait_step(k1)
    t.kill()
    story.append(f"run1 SIGKILL after step {k1} (last step seen {t.named('step')[-1]['step']})")

    # 2. resumed, then killed while a checkpoint is half-written
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD, LORAD_DEBUG_CKPT_WRITE_DELAY_S="0.25")
    t.wait_for(lambda: any(len(list(d.iterdir())) >= 2 for d in _tmp_dirs(wd)))
    t.kill()
    torn = _tmp_dirs(wd)
    story.append(f"run2 resumed {[e['from_step'] for e in t.named('resumed')]}, "
                 f"SIGKILL with {[d.name for d in torn]} half-written")
    assert torn, story
    torn_step = int(torn[0].name.split(".")[0].split("-")[1])
    assert not (wd / "checkpoints" / f"step-{torn_step:08d}").exists(), story

    # 3. resumed from before the torn save, then killed at another random step
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD)
    t.wait_for(lambda: bool(t.named("resumed")) or bool(t.named("step")))
    resumed3 = t.named("resumed")
    assert resumed3 and resumed3[0]["from_step"] < torn_step, story + [f"run3 events {t.events[:3]}"]
    lo = min(resumed3[0]["from_step"] + 1, 23)  # at most 23 of 24: the kill must land before the end
    k3 = rnd.randint(lo, max(lo, 21))
    t.wait_step(k3)
    t.kill()
    story.append(f"run3 resumed from {resumed3[0]['from_step']}, SIGKILL after step {k3}")

    # 4. resumed and run to the end
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD)
    assert t.finish(timeout=600) == 0, t.events[-5:]
    resumed4 = t.named("resumed")
    story.append(f"run4 resumed from {[e['from_step'] for e in resumed4]}")
    assert resumed4 and resumed4[0]["from_step"] > 0, story
    assert not _tmp_dirs(wd), "the stale half-written checkpoint was not cleaned up"
    return wd, story


@pytest.fixture(scope="module")
def runs(tmp_path_factory, jobs):
    """Both optimizers' uninterrupted and interrupted runs, started together.

    Each child spends most of its life importing torch/transformers/peft on one
    core; running the four chains side by side keeps the test's wall time near
    that of one chain. Each test waits for its own futures.
    """
    root = tmp_path_factory.mktemp("runs")
    pool = ThreadPoolExecutor(max_workers=2 * len(OPTIMIZERS))
    futures = {
        opt: (pool.submit(run_uninterrupted, jobs[opt], root / f"{opt}-uninterrupted"),
              pool.submit(run_with_three_sigkills, jobs[opt], root / f"{opt}-interrupted"))
        for opt in OPTIMIZERS
    }
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_three_sigkills_then_resume_is_bit_identical(opt, runs):
    reference, interrupted = runs[opt]
    wd, story = interrupted.result(timeout=600)
    ref, got = adapter_bytes(reference.result(timeout=600)), adapter_bytes(wd)
    assert sorted(ref) == sorted(got)
    differing = [k for k in ref if ref[k] != got[k]]
    assert not differing, f"{len(differing)} tensors differ, e.g. {differing[:2]}; {story}"


def test_sigterm_commits_the_current_step_and_exits_75(jobs, tmp_path):
    wd = tmp_path / "work"
    t = Trainer.engine(jobs["adamw8bit"], wd)
    t.wait_step(5)
    t.send(signal.SIGTERM)
    assert t.wait() == 75, t.stderr
    stopped = t.named("stopped")
    last_step = t.named("step")[-1]["step"]
    assert stopped and stopped[0]["step"] == last_step < 24
    store = CheckpointStore(wd / "checkpoints", load_job(jobs["adamw8bit"]).identity_hash(), keep=3)
    loaded, skipped = store.load_latest()
    assert skipped == [] and loaded is not None
    assert loaded.step == last_step and loaded.state["step"] == last_step


def test_second_sigint_exits_at_once_and_the_last_checkpoint_stands(tmp_path, write_job):
    job = write_job(train={"steps": 200}, checkpoint={"every_steps": 4})
    wd = tmp_path / "work"
    # Each save takes >= 2 s, so a prompt exit can only come from the second SIGINT.
    t = ForkedTrainer(job, wd, preload=LM_PRELOAD, LORAD_DEBUG_CKPT_WRITE_DELAY_S="0.4")
    t.wait_for(lambda: bool(t.named("checkpoint_committed")))
    t.send(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    t.send(signal.SIGINT)
    rc = t.finish(timeout=180)
    assert rc == 130, t.events[-3:]
    assert time.monotonic() - t0 < 1.5
    assert not t.named("stopped")
    committed = max(e["step"] for e in t.named("checkpoint_committed"))
    store = CheckpointStore(wd / "checkpoints", load_job(job).identity_hash(), keep=3)
    loaded, skipped = store.load_latest()
    assert skipped == []
    assert loaded is not None and loaded.step == committed


def test_rerunning_a_finished_job_reports_done_without_training(finished_tiny_job, tmp_path):
    _, cfg, workdir, _ = finished_tiny_job
    wd = tmp_path / "finished"
    shutil.copytree(workdir, wd)
    before = adapter_bytes(wd)
    n_events = len(read_events(wd))
    assert train(cfg, wd, progress="none") == 0
    new = read_events(wd)[n_events:]
    assert not [e for e in new if e["event"] == "step"]
    done = [e for e in new if e["event"] == "done"]
    assert done and done[0].get("already") is True
    assert adapter_bytes(wd) == before


def test_changed_training_settings_refuse_to_resume_with_a_clear_message(finished_tiny_job, tmp_path, capfd):
    job, cfg, workdir, _ = finished_tiny_job
    wd = tmp_path / "changed"
    shutil.copytree(workdir, wd)
    raw = yaml.safe_load(job.read_text())
    raw["train"]["lr"] = 0.005
    changed = parse_job(raw, job.parent)
    assert train(changed, wd, progress="none") == 65
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("lorad:")]
    # the line names the key that changed, with both values
    assert len(lines) == 1 and "different" in lines[0] and "train.lr 0.002 → 0.005" in lines[0], err
    assert "Traceback" not in err
    assert read_events(wd)[-1]["event"] == "invalid_job"


def test_checkpoints_from_before_the_identity_was_kept_still_get_the_hashes():
    from engine.checkpoint.store import changed_keys

    assert changed_keys(None, {"train": {"lr": 1}}) == ""  # the message falls back to the two hashes
    assert changed_keys({"train": {"lr": 1}, "lora": {"rank": 8}}, {"train": {"lr": 2}}) == \
        "lora.rank 8 → (default), train.lr 1 → 2"


def test_sigusr1_commits_now_and_training_continues_unchanged(jobs, runs, tmp_path):
    """The UPS-on-battery save: a checkpoint of the current step at once, then the run goes on as if untouched."""
    wd = tmp_path / "work"
    t = ForkedTrainer(jobs["adamw8bit"], wd, preload=LM_PRELOAD)
    t.wait_step(2)
    t.send(signal.SIGUSR1)
    assert t.finish(timeout=300) == 0, t.events[-3:]
    urgent = [e["step"] for e in t.events if e.get("phase") == "urgent_checkpoint"]
    assert len(urgent) == 1
    assert urgent[0] in [e["step"] for e in t.named("checkpoint_committed")]
    reference, _ = runs["adamw8bit"]
    assert adapter_bytes(wd) == adapter_bytes(reference.result(timeout=600))


def test_a_job_continued_past_its_end_never_calls_the_old_adapter_done(finished_tiny_job, tmp_path, monkeypatch):
    """steps raised after the job finished; the export of the new end fails (disk full, or a kill): the next run
    must export the new end, not report the older adapter in output/ as done."""
    import errno

    import engine.recipe as run
    from engine.checkpoint.output import OUTPUT_STAMP

    job, cfg, workdir, _ = finished_tiny_job
    wd = tmp_path / "continued"
    shutil.copytree(workdir, wd)
    old = adapter_bytes(wd)
    raw = yaml.safe_load(job.read_text())
    raw["train"]["steps"] = cfg.train.steps + 4
    longer = parse_job(raw, job.parent)

    real_export = run.export_output

    def disk_full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run, "export_output", disk_full)
    assert train(longer, wd, progress="none") == 74  # the final checkpoint (step 16) is committed, output/ is not
    monkeypatch.setattr(run, "export_output", real_export)
    assert train(longer, wd, progress="none") == 0
    done = read_events(wd)[-1]
    assert done["event"] == "done" and not done.get("already") and done["step"] == cfg.train.steps + 4
    assert json.loads((wd / "output" / OUTPUT_STAMP).read_text())["step"] == cfg.train.steps + 4
    assert adapter_bytes(wd) != old


def test_an_export_killed_half_way_is_redone_and_its_leftovers_removed(finished_tiny_job, tmp_path):
    """Killed between the final checkpoint and output/: the rerun exports again from that checkpoint."""
    _, cfg, workdir, _ = finished_tiny_job
    wd = tmp_path / "half-exported"
    shutil.copytree(workdir, wd)
    want = adapter_bytes(wd)
    shutil.rmtree(wd / "output")
    (wd / "output.tmp-99999").mkdir()
    (wd / "output.tmp-99999" / "adapter_model.safetensors").write_bytes(b"torn")
    assert train(cfg, wd, progress="none") == 0
    assert adapter_bytes(wd) == want
    assert not list(wd.glob("output.tmp-*"))
