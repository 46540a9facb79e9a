"""Start-up reconciliation: one function, run before the daemon says READY.

After any outage (SIGKILL, power cut, OOM killer, reboot) the store may say
`running` for jobs whose trainer is gone, and a trainer of the previous
daemon may still be alive (it runs in its own session; outside systemd it
survives the daemon). Both are settled here, in this order: stop every live
trainer of this home (SIGTERM to all of them at once → each commits a
checkpoint and exits 75; SIGKILL to what is left after one stop_grace_s),
then settle every `running` job, then requeue the `interrupted` ones, then
finish any job file whose intake was cut short. Nothing needs a human.

A clean stop and a crash differ in what the store says: a clean stop
(`lorad serve` SIGTERM or Ctrl-C, `systemctl stop`, a reboot that stops the
unit) waits for every trainer and records its job as `interrupted`, so those
are requeued at once and count nothing. A job still `running` was cut off by a
daemon crash, a SIGKILL or a host crash; that counts as a crash of the job,
like a trainer crash: backoff, and `failed` once the retry budget is spent.
Otherwise a job that takes the host or the daemon down with it would be
resumed forever. (What the user asked for before the outage, pause or
cancel, still wins.)

Except after an outage that is not the job's fault: the host rebooted (the
kernel's boot id differs from the one the last daemon recorded) or the UPS
had announced the power failing (meta `power_outage`, kept by the supervisor
from its policy). Then a job found `running` resumes at once: no backoff,
no crash counted. And an attempt that committed checkpoints the store never
heard of (the daemon was SIGKILLed while its trainer kept going) made
progress: its crash count starts again.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from daemon.config.daemon import DaemonConfig
from daemon.store import states
from daemon.store.db import Store
from daemon.supervisor.disk_progress import committed_checkpoints, last_event_step
from daemon.supervisor.exit_policy import decide_exit
from daemon.supervisor.stuck import StuckTrainer
from daemon.system import proc
from daemon.system.log import job_event

CUT_OFF = "cut off: the daemon or the host went down while this attempt ran"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def current_boot_id() -> str | None:
    """The running kernel's boot id (a new one at every boot); None where there is none to read."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def outage_cause(store: Store, boot_id: str | None, log) -> str | None:
    """Why the jobs still `running` were cut off by something outside them (None: maybe by themselves).

    Records this boot's id, and clears the UPS mark (the new daemon's policy sets it again if still on battery).
    """
    before = store.get_meta("boot_id")
    ups = store.get_meta("power_outage") == "1"
    try:  # written only when it changes: a start with state.db's disk full must not fail on these marks
        if boot_id is not None and boot_id != before:
            store.set_meta("boot_id", boot_id)
        if ups:
            store.set_meta("power_outage", "0")
    except sqlite3.Error as e:
        log.error("outage_marks_not_written", error=f"{type(e).__name__}: {e}")
    if before is not None and boot_id is not None and before != boot_id:
        return "the host rebooted"
    if ups:
        return "the UPS announced a power failure"
    return None


@dataclass
class Reconciled:
    orphans_stopped: list[int] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    intake_finished: int = 0
    stuck: list[StuckTrainer] = field(default_factory=list)  # orphans that outlived SIGKILL (daemon/supervisor/stuck.py)


def _stuck_orphan(pid: int, start: int | None, store: Store, cfg: DaemonConfig) -> StuckTrainer:
    """An orphan that outlived SIGKILL: its job (by recorded pid) and GPUs (its environment, else the job's row)."""
    job = next((j for j in store.jobs((states.RUNNING,)) if j["pid"] == pid), None)
    devices: list[int | None] | None = proc.visible_devices_of(pid)
    if devices is None:
        devices = [job["gpu"]] if job is not None else [None]
    return StuckTrainer(pid=pid, start=start, devices=devices, job_id=job["id"] if job else None,
                        workdir=Path(job["workdir"]) if job else None, kill_wait_s=cfg.kill_wait_s)


def catch_up(store: Store, job: dict, log) -> bool:
    """Bring a job's step and last checkpoint up to what its directory holds (checkpoints committed and steps
    logged while the daemon was down); `job` is updated in place. True if a checkpoint was new to the store."""
    wd = Path(job["workdir"])
    newest = committed_checkpoints(wd)
    fields = {}
    if newest and (job["checkpoint_step"] is None or newest[0].step > job["checkpoint_step"]):
        fields.update(last_checkpoint=str(newest[0].path), checkpoint_step=newest[0].step)
    step = max(job["step"], *(c.step for c in newest[:1]), last_event_step(wd) or 0)
    if step != job["step"]:
        fields["step"] = step
    if not fields:
        return False
    log.info("job_caught_up", job=job["id"], was_step=job["step"], was_checkpoint=job["checkpoint_step"], **fields)
    store.update(job["id"], **fields)
    job.update(fields)
    return "checkpoint_step" in fields


def reconcile(home: Path, cfg: DaemonConfig, store: Store, log, intake=None,
              boot_id: str | None | Literal["read"] = "read") -> Reconciled:
    """`boot_id`: the kernel's boot id ("read": from /proc; tests pass their own)."""
    r = Reconciled()
    jobs_root = Path(home) / "jobs"
    outage = outage_cause(store, current_boot_id() if boot_id == "read" else boot_id, log)

    # 1. No trainer of ours may outlive the daemon that started it: find by recorded pid + start time,
    #    and by command line (a trainer started just before the daemon died may not have its pid recorded).
    #    All are signalled first and waited for together: N trainers cost one stop_grace_s, not N.
    targets = {t.pid: t.start for t in proc.find_trainers(jobs_root)}
    for job in store.jobs((states.RUNNING,)):
        if job["pid"] and proc.alive(job["pid"], job["pid_start"]):
            targets[job["pid"]] = job["pid_start"]
    if targets:
        for pid in targets:
            log.warning("orphan_trainer", pid=pid, action="SIGTERM, wait for its checkpoint, SIGKILL after the grace")
        killed, stuck = proc.stop_all_and_wait(targets, cfg.stop_grace_s, cfg.kill_wait_s)
        for pid in targets:
            if pid not in stuck:
                log.info("orphan_trainer_stopped", pid=pid, killed=pid in killed)
        r.orphans_stopped = [pid for pid in targets if pid not in stuck]
        # Outlived SIGKILL (a hung driver): not waited for; the service's supervisor lists them and keeps their
        # GPUs out of scheduling until they are gone. Their jobs are settled below like any other.
        r.stuck = [_stuck_orphan(pid, targets[pid], store, cfg) for pid in stuck]

    # 2. Jobs the store thinks are running: their trainer is gone now, and no clean stop recorded its exit.
    for job in store.jobs((states.RUNNING,)):
        jid = job["id"]
        progressed = catch_up(store, job, log)  # what the trainer did while no daemon listened
        req = job["requested"]
        cleared = dict(pid=None, pid_start=None, gpu=None, requested=None)
        if req in ("cancel", "pause"):
            dst = states.CANCELLED if req == "cancel" else states.PAUSED
            moves = [(dst, f"{req} requested before the outage", cleared)]
            store.end_run(jid, None, job["step"], CUT_OFF, lambda row, moves=moves: (moves, None))
            (r.cancelled if req == "cancel" else r.paused).append(jid)
            continue
        # `retries` is reset to 0 by every new checkpoint the store heard of, so it counts crashes in a row.
        d = decide_exit(None, "outage" if outage else None, job["retries"], cfg, CUT_OFF, progressed=progressed)
        error = f"{CUT_OFF} ({outage}: resumed at once, not counted)" if outage else CUT_OFF
        fields = dict(cleared, retries=d.crashes, last_error=error)
        if d.retry_in is not None:
            fields["not_before"] = time.time() + d.retry_in
        moves = [(d.state, outage or d.reason, fields)]
        if d.state == states.INTERRUPTED:
            moves.append((states.QUEUED, "resume after the outage", {"not_before": 0}))
        store.end_run(jid, None, job["step"], CUT_OFF, lambda row, moves=moves: (moves, None))
        job_event(Path(job["workdir"]), jid, "trainer_exited", level="warning", exit_code=None, state=d.state,
                  reason=d.reason, retry_in_s=d.retry_in)
        (r.failed if d.state == states.FAILED else r.requeued).append(jid)

    # 3. Interrupted jobs (a clean shutdown) resume from their newest checkpoint, with no backoff.
    for job in store.jobs((states.INTERRUPTED,)):
        store.transition(job["id"], states.INTERRUPTED, states.QUEUED, "resume after restart", not_before=0)
        job_event(Path(job["workdir"]), job["id"], "requeued", reason="daemon restart")
        r.requeued.append(job["id"])

    # 4. Job files claimed into incoming/ but not yet accepted or rejected. A file that cannot be taken now
    #    (disk full, ...) stays in incoming/ and the service loop retries it: it never stops the start.
    if intake is not None:
        try:
            r.intake_finished = sum(1 for o in intake.recover() if not (o.stuck or o.pending))
        except Exception as e:  # noqa: BLE001
            log.error("intake_recovery_failed", error=f"{type(e).__name__}: {e}",
                      message="files stay in incoming/; the service loop retries them")
    log.info("reconciled", outage=outage, orphans_stopped=r.orphans_stopped, requeued=r.requeued, paused=r.paused,
             cancelled=r.cancelled, failed=r.failed, intake_finished=r.intake_finished)
    return r
