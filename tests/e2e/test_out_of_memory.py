"""Out of GPU memory is a re-plan, not a crash: a real daemon, real trainers, a real torch.OutOfMemoryError.

The trainer raises it inside optimizer step 3 through its test hook ($LORAD_DEBUG_OOM_AT_STEP) in every attempt
whose re-plan level (levers pulled so far) is below $LORAD_DEBUG_OOM_UNTIL_LEVEL=2: a job needs two levers to fit
(engine/memory_plan/oom.py). The daemon re-plans from the plan the trainer reports, keeps the floors in its store
and resumes the job from its newest checkpoint, without spending the retry budget (0 here: one crash would fail
the job). One daemon runs both jobs, one after the other.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.daemon import (
    Daemon,
    adapter_file,
    daemon_job,
    fast_config,
    job_events,
    lorad_run,
    write_yaml,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def oom_job(tmp_path_factory, micro_model) -> Path:
    return write_yaml(tmp_path_factory.mktemp("oom-job") / "fits.yaml", daemon_job(micro_model, steps=6, every=2,
                                                                                  name="fits"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, micro_model, oom_job) -> tuple[Daemon, dict[str, dict]]:
    """Both jobs run to their end on one daemon: `fits` (two swap levers and it fits) and `full` (every block
    swapped and recomputed by the job itself: the micro-batch is its one lever)."""
    tmp = tmp_path_factory.mktemp("oom")
    full = write_yaml(tmp / "full.yaml", daemon_job(micro_model, steps=4, every=2, name="full", blocks_to_swap=2,
                                                    gradient_checkpointing=True))
    d = Daemon(tmp / "home", fast_config(tmp.parent, retry_budget=0),
               LORAD_DEBUG_OOM_AT_STEP="3", LORAD_DEBUG_OOM_UNTIL_LEVEL="2")
    try:
        d.start()
        for job in (oom_job, full):
            shutil.copy(job, d.home / "inbox" / job.name)
        d.wait_job(lambda jobs: len(jobs) == 2 or None, 60, "both jobs accepted")
        ids = {j["name"]: j["id"] for j in d.jobs()}
        yield d, {name: d.wait_state(jid, {"succeeded", "failed"}, 240) for name, jid in ids.items()}
    finally:
        d.cleanup()


def test_out_of_memory_at_a_step_is_replanned_and_ends_bit_identical_without_spending_the_budget(
        finished, oom_job, tmp_path):
    d, jobs = finished
    final = jobs["fits"]
    assert final["state"] == "succeeded", final["last_error"]
    workdir = d.home / "jobs" / final["id"]
    # two more swapped blocks, over three attempts, changed no bit
    assert adapter_file(workdir) == adapter_file(lorad_run(oom_job, tmp_path / "ref-home"))

    assert [a["exit_code"] for a in final["attempts"]] == [69, 69, 0]
    assert final["retries"] == 0
    reasons = [e["data"]["reason"] for e in final["events"] if e["kind"] == "transition"]
    assert not any("crashed" in r or "retry" in r for r in reasons), reasons
    assert [r for r in reasons if r.startswith("out of GPU memory")] == [
        "out of GPU memory; re-planned: blocks_to_swap 0→1", "out of GPU memory; re-planned: blocks_to_swap 1→2"]

    events = job_events(workdir)
    ooms = [e for e in events if e["event"] == "out_of_memory"]
    assert [(e["step"], e["phase"], e["needed_bytes"]) for e in ooms] == [(3, "step", 2 << 30)] * 2
    replans = [e for e in events if e["event"] == "oom_replan"]
    assert [(e["source"], e["step"], e["lever"]) for e in replans] == [
        ("daemon", 3, "blocks_to_swap 0→1"), ("daemon", 3, "blocks_to_swap 1→2")]
    assert replans[0]["before"].startswith("swap 0/2 blocks") and replans[1]["before"].startswith("swap 1/2 blocks")
    assert json.loads(replans[1]["after"]) == {"swap_at_least": 2,
                                               "tried": ["blocks_to_swap 0→1", "blocks_to_swap 1→2"]}
    assert [(p["swap"], p["replan_level"]) for p in events if p["event"] == "memory_plan"] == [(0, 0), (1, 1), (2, 2)]
    # each attempt resumed from the newest checkpoint committed before it; nothing of step 3 was committed
    committed = [e["step"] for e in events if e["event"] == "checkpoint_committed"]
    resumed = [e["from_step"] for e in events if e["event"] == "resumed"]
    assert resumed and all(s in committed and s < 3 for s in resumed), (committed, resumed)

    human = d.cli("status", final["id"]).stdout
    assert "memory plan: swap 2/2 blocks" in human
    assert "out-of-memory: step 3 (step): swap 0/2 blocks" in human and "→ blocks_to_swap 1→2" in human


def test_out_of_memory_with_no_lever_left_fails_with_one_line_naming_what_was_tried(finished):
    d, jobs = finished
    final = jobs["full"]
    assert final["state"] == "failed"
    assert [a["exit_code"] for a in final["attempts"]] == [69, 69]
    assert final["retries"] == 0
    line = final["last_error"]
    assert "\n" not in line and line.startswith(
        "out of GPU memory in step at step 3, needed 2.00 GiB more with no lever left; "
        "tried: micro-batch 2→1 (grad_accum 1→2); last plan: swap 2/2 blocks; activations: 2 recomputed"), line
    assert "micro-batch 1 × 2" in line  # the plan it last ran under: the effective batch kept
    assert line in d.cli("status", final["id"]).stdout
