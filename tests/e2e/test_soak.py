"""The short chaos soak (bench/soak.py, fixed seed): `lorad serve` on the power-cut file system lives through every
kind of fault, 25 of them at random moments, and every job it was given finishes bit-identical to its
uninterrupted run, with nothing lost and nobody's help; no trainer ever resumes from before a checkpoint it
reported committed (bench/soak_oracle.py), though a power cut strikes right after a fresh commit. A failure
prints the seed and the schedule."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from bench.soak import Soak, soak_config
from bench.soak_faults import KINDS
from tests.helpers.faultfs import fuse_usable
from tests.helpers.processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(fuse_usable() is not None, reason=str(fuse_usable()))]

SEED = 3
FAULTS = 25
# Every kind, the cheap ones more often: a fault that kills the daemon makes the next trainer wait for the warm
# trainer's imports (~4 s on a quiet machine), so those come once each here; bench/soak.py draws them as often as
# kills of a trainer.
KINDS_SHORT = {**{k: 1 for k in KINDS}, "kill_trainer": 3, "cli": 3, "socket_abuse": 2, "inbox_garbage": 2,
               "clock_jump": 2}


def test_a_short_soak_loses_nothing_and_needs_no_one(tmp_path, svc_job, svc_reference):
    spec = yaml.safe_load(svc_job.read_text())
    # Fast faults: a 2 s hang check, a disk full for about a second, short pauses between faults.
    cfg = soak_config(hang_timeout_s=2.0, hang_step_multiple=5.0)
    soak = Soak(tmp_path / "soak", {"lm": spec}, {"lm": {"adapter_model.safetensors": svc_reference}}, seed=SEED,
                faults=FAULTS, stop_at=time.monotonic() + 600, gap=(0.05, 0.4), kinds=KINDS_SHORT, config=cfg,
                env=child_env(OMP_NUM_THREADS="1"))
    soak.world.full_hold_s = (0.5, 1.5)
    try:
        r = soak.run()
    except Exception as e:
        schedule = "\n".join(json.dumps(f) for f in soak.faults)
        raise AssertionError(f"soak failed (seed {SEED}, {FAULTS} faults): {e}\nschedule:\n{schedule}") from None
    assert r["faults"] == FAULTS and set(r["by_kind"]) == set(KINDS), r["by_kind"]
    assert (r["jobs_lost"], r["mismatched"], r["human_actions"], r["daemon_self_exits"]) == (0, 0, 0, 0)
    assert r["jobs_verified"] >= 1 and r["steps_lost"]["n"] > 0
    # The window a missing directory fsync leaves open was there to be found.
    assert any(f.get("after_commit") for f in soak.faults if f["kind"] == "power_cut"), soak.faults
