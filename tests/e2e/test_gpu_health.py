"""End to end: the real `lorad serve` on simulated GPUs that fail (daemon/gpu_health/, daemon/power/simulated.py).

The daemon's simulated device reads its faults from a JSON file the test rewrites (power.telemetry.simulated_faults):
1. a GPU lost mid-job: the job waits (`waiting_for_gpu`), is never counted as crashed, resumes when the GPU
   returns, and ends bit-identical to an uninterrupted run;
2. an Xid storm on GPU 1 of 2: the GPU is quarantined (held until `lorad gpu clear 1`), a notification goes out,
   and GPU 0's job trains on untouched; the job from GPU 1 finishes on GPU 0, uncounted;
3. another program holding VRAM: under `wait` the job waits and says why; under `plan` it starts with the free
   VRAM in LORAD_VRAM_BUDGET_GB, read from the trainer process's own environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.daemon import (
    Daemon,
    adapter_file,
    daemon_job,
    fast_config,
    job_events,
    last_step,
    wait_until,
    write_yaml,
)
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow


def set_faults(path: Path, faults: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, path)  # the daemon never reads half a file


def gpu_config(tmp_path: Path, micro_model: Path, path: Path, gpus: int, faults: dict | None = None,
               **over) -> dict:
    set_faults(path, faults or {})
    return fast_config(tmp_path, allowed_roots=["{home}", str(tmp_path), str(micro_model.parent), str(REPO)],
                       devices=list(range(gpus)),
                       power={"telemetry": {"backend": "simulated", "simulated_gpus": gpus,
                                            "simulated_faults": str(path)}},
                       gpu_health={"interval_s": 0.1, "recover_s": 0.5}, **over)


def submit(d: Daemon, job: Path) -> str:
    return json.loads(d.cli("submit", str(job), "--json").stdout)["job"]


def committed(workdir: Path) -> int:
    c = [e["step"] for e in job_events(workdir) if e.get("event") == "checkpoint_committed"]
    return max(c) if c else 0


def gpus_of(workdir: Path) -> list[int]:
    return [e["gpu"] for e in job_events(workdir) if e.get("event") == "attempt_started"]


def test_gpu_lost_mid_job_waits_uncounted_and_resumes_bit_identical(tmp_path, micro_model, svc_job, svc_reference):
    faults = tmp_path / "faults.json"
    d = Daemon(tmp_path / "home", gpu_config(tmp_path, micro_model, faults, 1),
               LORAD_DEBUG_STEP_DELAY_S="0.15").start()
    try:
        jid = submit(d, svc_job)
        workdir = d.home / "jobs" / jid
        wait_until(lambda: committed(workdir) > 0 and last_step(workdir) > committed(workdir), 240,
                   "a step past the first checkpoint")
        set_faults(faults, {"0": {"lost": True}})
        j = d.wait_state(jid, {"waiting_for_gpu"}, 30)
        assert j["retries"] == 0 and "GPU 0 quarantined" in j["last_error"]
        wait_until(lambda: not d.trainers(), 10, "the trainer on the lost GPU to be gone")
        time.sleep(0.5)  # lost for a while (five health readings): nothing starts, nothing is counted
        assert d.job(jid)["state"] == "waiting_for_gpu" and not d.trainers()
        (gpu,) = json.loads(d.cli("status", "--json").stdout)["gpus"]
        assert gpu["state"] == "quarantined" and gpu["lost"]
        assert "waiting for GPU" in d.cli("status", jid).stdout

        set_faults(faults, {})  # the driver is reloaded: the GPU is back, taken back without a restart
        final = d.wait_state(jid, {"succeeded", "failed"}, 300)
        assert final["state"] == "succeeded" and final["retries"] == 0, final
        assert adapter_file(workdir) == svc_reference
        detail = d.job(jid)
        assert len(detail["attempts"]) == 2 and detail["attempts"][0]["exit_code"] != 0  # killed, not a crash
        exits = [e for e in job_events(workdir) if e.get("event") == "trainer_exited"]
        assert [e["state"] for e in exits] == ["waiting_for_gpu", "succeeded"]
        states = [e["state"] for e in job_events(workdir) if e.get("event") == "gpu_health"]
        assert states[0] == "quarantined"
        assert json.loads(d.cli("gpu", "--json").stdout)["gpus"][0]["state"] == "ok"
    finally:
        d.cleanup()


def test_xid_storm_on_gpu_1_of_2_quarantines_it_and_gpu_0s_job_goes_on(tmp_path, micro_model):
    faults, told = tmp_path / "faults.json", tmp_path / "notified.jsonl"
    notify = {"command": [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'a').write("
                          "os.environ['LORAD_EVENT_JSON'] + chr(10))", str(told)], "on": ["gpu_quarantined"]}
    d = Daemon(tmp_path / "home", gpu_config(tmp_path, micro_model, faults, 2, notify=notify),
               LORAD_DEBUG_STEP_DELAY_S="0.15").start()
    try:
        ids = [submit(d, write_yaml(tmp_path / f"{n}.yaml", daemon_job(micro_model, steps=12, every=3, name=n)))
               for n in ("a", "b")]
        dirs = {jid: d.home / "jobs" / jid for jid in ids}
        wait_until(lambda: all(last_step(w) >= 2 for w in dirs.values()), 240, "both jobs to train")
        on = {gpus_of(w)[0]: jid for jid, w in dirs.items()}
        assert set(on) == {0, 1}

        set_faults(faults, {"1": {"xid": [79, 79, 79]}})  # three fatal Xids at once: held
        wait_until(lambda: any(e.get("event") == "trainer_exited" for e in job_events(dirs[on[1]])), 30,
                   "the trainer on GPU 1 to be stopped")
        first = d.job(on[0])
        assert first["state"] == "running" and len(first["attempts"]) == 1  # GPU 0's job never noticed
        gpu1 = json.loads(d.cli("status", "--json").stdout)["gpus"][1]
        assert gpu1["state"] == "held" and "Xid 79" in gpu1["reason"]
        assert "lorad gpu clear 1" in d.cli("status").stdout
        ev = wait_until(lambda: told.exists() and [json.loads(x) for x in told.read_text().splitlines()], 15,
                        "the quarantine notification")
        assert ev[0]["event"] == "gpu_quarantined" and ev[0]["gpu"] == 1 and ev[0]["held"] is True

        for jid in ids:
            j = d.wait_state(jid, {"succeeded", "failed"}, 300)
            assert j["state"] == "succeeded" and j["retries"] == 0, j
        assert len(d.job(on[0])["attempts"]) == 1
        assert gpus_of(dirs[on[1]]) == [1, 0]  # finished on the healthy GPU, never sent back to GPU 1
        exits = [e["state"] for e in job_events(dirs[on[1]]) if e.get("event") == "trainer_exited"]
        assert exits == ["waiting_for_gpu", "succeeded"]

        out = d.cli("gpu", "clear", "1").stdout
        assert "GPU 1 cleared: scheduled again" in out
        assert json.loads(d.cli("gpu", "--json").stdout)["gpus"][1]["state"] == "ok"
    finally:
        d.cleanup()


def test_foreign_vram_under_wait_holds_the_job_and_under_plan_it_starts_with_a_smaller_plan(tmp_path, micro_model):
    faults = tmp_path / "faults.json"
    held = {"0": {"foreign_mib": 8192}}  # a game holds 8 GiB of the simulated 24
    job = write_yaml(tmp_path / "v.yaml", daemon_job(micro_model, steps=6, every=3, name="v"))

    d = Daemon(tmp_path / "wait", gpu_config(tmp_path, micro_model, faults, 1, gpu_memory_policy="wait",
                                             faults=held)).start()
    try:
        jid = submit(d, job)
        row = d.wait_job(lambda jobs: jobs[0] if (jobs[0].get("gpu_note") or "").startswith("waiting for VRAM")
                         else None, 30, "the job to wait for VRAM")
        assert row["state"] == "queued" and "other programs hold 8.0 GiB of 24.0 GiB" in row["gpu_note"]
        time.sleep(0.5)
        assert d.job(jid)["state"] == "queued" and not d.trainers()
        assert "waiting for VRAM" in d.cli("status").stdout
        set_faults(faults, {})  # the game quits
        assert d.wait_state(jid, {"succeeded", "failed"}, 240)["state"] == "succeeded"
        (roomy,) = [e for e in job_events(d.home / "jobs" / jid) if e.get("event") == "memory_plan"]
    finally:
        d.cleanup()

    held = {"0": {"foreign_mib": 24 * 1024 - 2}}  # now the game leaves 2 MiB: less than the micro model's plan wants
    set_faults(faults, held)
    d = Daemon(tmp_path / "plan", gpu_config(tmp_path, micro_model, faults, 1, gpu_memory_policy="plan",
                                             faults=held, warm_trainer=False),
               LORAD_DEBUG_STEP_DELAY_S="0.3").start()
    try:
        jid = submit(d, job)
        (t,) = wait_until(d.trainers, 60, "the trainer to start")
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{t.pid}/environ").read_text().split("\0") if "=" in kv)
        assert env["LORAD_VRAM_BUDGET_GB"] == f"{2 / 1024:.6f}"  # 24 GiB less what the game holds
        assert d.wait_state(jid, {"succeeded", "failed"}, 240)["state"] == "succeeded"
        row = d.jobs()[0]
        assert row["gpu_note"] == "planned for 2 MiB free on GPU 0 (other programs hold 24.0 GiB)"
        events = job_events(d.home / "jobs" / jid)
        plan = [e for e in events if e.get("event") == "vram_plan"]
        assert plan[0]["budget_gb"] == round(2 / 1024, 6) and plan[0]["foreign_gb"] == round(24 - 2 / 1024, 6)
        # The trainer planned within it (engine/memory_plan/): where the first job, with no budget, kept every
        # block's activations resident, this one pulls levers until its estimate fits the 2 MiB (or pulls them all).
        (mp,) = [e for e in events if e.get("event") == "memory_plan"]
        assert mp["source"] == "LORAD_VRAM_BUDGET_GB" and abs(mp["budget"] - (2 << 20)) < 1 << 10  # to the KiB
        assert roomy["budget"] is None and roomy["keep"] == roomy["blocks"] and roomy["swap"] == 0
        assert mp["keep"] < roomy["keep"] or mp["swap"] > 0, mp["summary"]
        assert mp["estimate"] < roomy["estimate"], (mp["summary"], roomy["summary"])
    finally:
        d.cleanup()
