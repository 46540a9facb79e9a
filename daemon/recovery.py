"""Start-up reconciliation: one function, run before the daemon says READY.

After any outage (SIGKILL, power cut, OOM killer, reboot) the store may say
`running` for jobs whose trainer is gone, and a trainer of the previous
daemon may still be alive (it runs in its own session and survives the
daemon). Both are settled here, in this order: stop every live trainer of
this home (SIGTERM → it commits a checkpoint and exits 75; SIGKILL after the
grace), then move every `running` job to `interrupted` and back to `queued`
(or to what the user asked for before the outage: paused, cancelled), then
finish any job file whose intake was cut short. Nothing needs a human.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from daemon import proc, states
from daemon.log import job_event
from daemon.settings import DaemonConfig
from daemon.store import Store


@dataclass
class Reconciled:
    orphans_stopped: list[int] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    intake_finished: int = 0


def reconcile(home: Path, cfg: DaemonConfig, store: Store, log, intake=None) -> Reconciled:
    r = Reconciled()
    jobs_root = Path(home) / "jobs"

    # 1. No trainer of ours may outlive the daemon that started it: find by recorded pid + start time,
    #    and by command line (a trainer started just before the daemon died may not have its pid recorded).
    targets = {t.pid: t.start for t in proc.find_trainers(jobs_root)}
    for job in store.jobs((states.RUNNING,)):
        if job["pid"] and proc.alive(job["pid"], job["pid_start"]):
            targets[job["pid"]] = job["pid_start"]
    for pid, started in targets.items():
        log.warning("orphan_trainer", pid=pid, action="SIGTERM, wait for its checkpoint, SIGKILL after the grace")
        killed = proc.stop_and_wait(pid, started, cfg.stop_grace_s)
        log.info("orphan_trainer_stopped", pid=pid, killed=killed)
        r.orphans_stopped.append(pid)

    # 2. Jobs the store thinks are running: their trainer is gone now.
    for job in store.jobs((states.RUNNING,)):
        jid = job["id"]
        store.end_attempt(jid, None, job["step"], "the daemon stopped while this attempt ran")
        req = job["requested"]
        if req == "cancel":
            store.transition(jid, states.RUNNING, states.CANCELLED, "cancel requested before the outage",
                             pid=None, pid_start=None, requested=None)
            r.cancelled.append(jid)
            continue
        if req == "pause":
            store.transition(jid, states.RUNNING, states.PAUSED, "pause requested before the outage",
                             pid=None, pid_start=None, requested=None)
            r.paused.append(jid)
            continue
        store.transition(jid, states.RUNNING, states.INTERRUPTED, "the daemon restarted; the trainer is gone",
                         pid=None, pid_start=None, gpu=None)
    # 3. Interrupted jobs (a shutdown, or step 2) resume from their newest checkpoint, with no backoff.
    for job in store.jobs((states.INTERRUPTED,)):
        store.transition(job["id"], states.INTERRUPTED, states.QUEUED, "resume after restart", not_before=0)
        job_event(Path(job["workdir"]), job["id"], "requeued", reason="daemon restart")
        r.requeued.append(job["id"])

    # 4. Job files claimed into incoming/ but not yet accepted or rejected.
    if intake is not None:
        r.intake_finished = len(intake.recover())
    log.info("reconciled", orphans_stopped=r.orphans_stopped, requeued=r.requeued, paused=r.paused,
             cancelled=r.cancelled, intake_finished=r.intake_finished)
    return r
