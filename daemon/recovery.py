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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from daemon import proc, states
from daemon.daemon_config import DaemonConfig
from daemon.exit_policy import decide_exit
from daemon.log import job_event
from daemon.store import Store

CUT_OFF = "cut off: the daemon or the host went down while this attempt ran"


@dataclass
class Reconciled:
    orphans_stopped: list[int] = field(default_factory=list)
    requeued: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    intake_finished: int = 0


def reconcile(home: Path, cfg: DaemonConfig, store: Store, log, intake=None) -> Reconciled:
    r = Reconciled()
    jobs_root = Path(home) / "jobs"

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
        killed = proc.stop_all_and_wait(targets, cfg.stop_grace_s)
        for pid in targets:
            log.info("orphan_trainer_stopped", pid=pid, killed=pid in killed)
        r.orphans_stopped = list(targets)

    # 2. Jobs the store thinks are running: their trainer is gone now, and no clean stop recorded its exit.
    for job in store.jobs((states.RUNNING,)):
        jid = job["id"]
        req = job["requested"]
        cleared = dict(pid=None, pid_start=None, gpu=None, requested=None)
        if req in ("cancel", "pause"):
            dst = states.CANCELLED if req == "cancel" else states.PAUSED
            moves = [(dst, f"{req} requested before the outage", cleared)]
            store.end_run(jid, None, job["step"], CUT_OFF, lambda row, moves=moves: (moves, None))
            (r.cancelled if req == "cancel" else r.paused).append(jid)
            continue
        retries = job["retries"] + 1  # reset to 0 by every new checkpoint, so this counts crashes in a row
        d = decide_exit(None, None, retries, cfg, CUT_OFF)
        fields = dict(cleared, retries=retries, last_error=CUT_OFF)
        if d.retry_in is not None:
            fields["not_before"] = time.time() + d.retry_in
        moves = [(d.state, d.reason, fields)]
        store.end_run(jid, None, job["step"], CUT_OFF, lambda row, moves=moves: (moves, None))
        job_event(Path(job["workdir"]), jid, "trainer_exited", level="warning", exit_code=None, state=d.state,
                  reason=d.reason, retry_in_s=d.retry_in)
        (r.requeued if d.state == states.QUEUED else r.failed).append(jid)

    # 3. Interrupted jobs (a clean shutdown) resume from their newest checkpoint, with no backoff.
    for job in store.jobs((states.INTERRUPTED,)):
        store.transition(job["id"], states.INTERRUPTED, states.QUEUED, "resume after restart", not_before=0)
        job_event(Path(job["workdir"]), job["id"], "requeued", reason="daemon restart")
        r.requeued.append(job["id"])

    # 4. Job files claimed into incoming/ but not yet accepted or rejected. A file that cannot be taken now
    #    (disk full, ...) stays in incoming/ and the service loop retries it: it never stops the start.
    if intake is not None:
        try:
            r.intake_finished = sum(1 for o in intake.recover() if not o.stuck)
        except Exception as e:  # noqa: BLE001
            log.error("intake_recovery_failed", error=f"{type(e).__name__}: {e}",
                      message="files stay in incoming/; the service loop retries them")
    log.info("reconciled", orphans_stopped=r.orphans_stopped, requeued=r.requeued, paused=r.paused,
             cancelled=r.cancelled, failed=r.failed, intake_finished=r.intake_finished)
    return r
