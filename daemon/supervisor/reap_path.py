"""The supervisor's reap path: a trainer that exited (or outlived SIGKILL) → its job's next state.

Part of the Supervisor (daemon/supervisor/loop.py). The exit is written in one store transaction with the
job's latest request (daemon/supervisor/exit_policy.py decides the state); until it lands, the pending writes
(daemon/store/bookkeeping.py) retry it on every tick and the job's devices stay taken.
"""

from __future__ import annotations

import time
from typing import Any

from daemon.store import states
from daemon.supervisor import disk_wait
from daemon.supervisor.exit_policy import HELD_FOR_REVIEW, decide_exit, describe_exit, same_error_in_a_row
from daemon.supervisor.notifications import event_of_exit
from daemon.supervisor.oom_replan import OomReplan, after_oom
from daemon.supervisor.stuck import StuckTrainer
from daemon.supervisor.trainer import Child
from daemon.system.log import job_event
from engine.training.stop import EXIT_INVALID, EXIT_OK, EXIT_OUT_OF_MEMORY, EXIT_STOPPED


class ReapPath:
    """The reap step, and settling the job of a trainer that is gone; mixed into Supervisor."""

    def reap(self) -> None:
        self.stuck.sweep()
        for job_id, c in list(self.children.items()):
            code = c.reap()
            if code is None:
                continue
            self._drain_beats(time.monotonic())
            # Gone: never signal it again (its pid may belong to someone else soon). Its job stays `running`
            # in the store until the exit is written, which the pending writes retry until it succeeds.
            del self.children[job_id]
            self.pending.add(job_id, c.devices, "trainer exit", lambda c=c, code=code: self._finish(c, code))
        self.pending.settle_all()

    def _finish(self, c: Child, code: int | None) -> None:
        error = c.exit_error(code)
        # A trainer that died by itself (or hung) while its GPU failed: the GPU's fault, not the job's.
        gpu_fault = self.gpu_fault_of(c.devices) \
            if c.stop_reason in (None, "hung") and code not in (EXIT_OK, EXIT_STOPPED, EXIT_INVALID) else None

        def plan(job: dict[str, Any]):
            # Runs inside the store's transaction, on the job as it is now: a pause or cancel that lands while
            # the exit is being written is either seen here or refused afterwards, never lost in between.
            stop_reason = None if c.stop_reason == "hung" else c.stop_reason
            if gpu_fault is not None:
                stop_reason = gpu_fault
            if job["requested"] in ("pause", "cancel"):
                # The user's latest word wins over drain, a power policy or shutdown (and over an earlier pause),
                # and over an exit the trainer came to on its own just before the stop.
                stop_reason = job["requested"]
            elif stop_reason is None and self.shutting_down and code == EXIT_STOPPED:
                stop_reason = "shutdown"  # SIGTERM reached it with ours (systemd signals the whole unit)
            err, oom = error, None
            if code == EXIT_OUT_OF_MEMORY:  # a smaller memory plan from the store's floors (oom_replan.py)
                oom = after_oom(job["memory"], c.oom)
                err = oom.failure or err
            d = decide_exit(code, stop_reason, job["retries"], self.cfg, err, progressed=c.new_checkpoint,
                            repeats=same_error_in_a_row(error, job["previous_errors"]), replanned=oom and oom.lever,
                            held=c.held_for_review)
            fields: dict[str, Any] = dict(pid=None, pid_start=None, gpu=None, step=c.step, retries=d.crashes,
                                          requested=None, last_error=err if err else job["last_error"])
            if oom is not None and oom.memory is not None:
                # Kept whatever the state: an out-of-memory just before a pause, a shutdown or a GPU fault
                # still ran out under this plan, and the job's next attempt (after `lorad resume`) needs the new one.
                fields["memory"] = oom.memory
            if d.state == states.WAITING:
                fields["wait_bytes"] = disk_wait.bytes_needed(c.workdir)
            if d.state == states.PAUSED and d.reason == HELD_FOR_REVIEW:
                fields.update(stage=HELD_FOR_REVIEW, eta_s=None)  # what status shows; what resume releases
            if d.state == states.WAITING_FOR_GPU:
                fields["last_error"] = d.reason  # which GPU, and its fault: what it waits on
            if d.state == states.SUCCEEDED:
                fields.update(output=str(c.workdir / "output"), eta_s=0.0, last_error=None)
            if d.retry_in is not None:
                fields["not_before"] = time.time() + d.retry_in
            moves = [(d.state, d.reason, fields)]
            if d.state == states.INTERRUPTED and not self.shutting_down:
                # Interrupted is a waypoint: back in the queue at once (same transaction), resumed from its
                # last checkpoint.
                moves.append((states.QUEUED, "requeued to resume", {}))
            return moves, (d, oom)

        d, oom = self.store.end_run(c.job_id, code, c.step, error, plan)
        if oom is not None and oom.lever is not None:
            self._oom_replanned(c, oom)
        level = "info" if d.state in (states.SUCCEEDED, states.PAUSED, states.INTERRUPTED, states.CANCELLED) else "warning"
        refused = {"refused_lines": n} if (n := c.refusals.total()) else {}  # each kind was said once already
        getattr(self.log, level)("trainer_exited", job=c.job_id, exit=describe_exit(code),
                     state=d.state, reason=d.reason, **refused)
        job_event(c.workdir, c.job_id, "trainer_exited", level=level, exit_code=code, state=d.state, reason=d.reason,
                  retry_in_s=d.retry_in)
        if d.state == states.SUCCEEDED and self.mirrors is not None:
            self.mirrors.finished(c.job_id)  # its output goes to the mirror; the job does not wait for it
        if (what := event_of_exit(d.state, d.reason)) is not None:
            self._tell(what, c.job_id, c.name, state=d.state, reason=d.reason, step=c.step, total=c.total,
                       exit_code=code, workdir=str(c.workdir))
        self._tell_policy("on_job_end", c.job_id, code)

    def _oom_replanned(self, c: Child, oom: OomReplan) -> None:
        """Said where `lorad status` (the store's events) and `lorad logs` (events.jsonl) show it."""
        ev = c.oom or {}
        what = dict(step=ev.get("step", c.step), phase=ev.get("phase"), needed_bytes=ev.get("needed_bytes"),
                    before=oom.before, lever=oom.lever, after=oom.memory)
        try:
            self.store.event(c.job_id, "oom_replan", **what)
        except Exception as e:  # noqa: BLE001 — the re-plan itself is written (end_run); only its note is lost
            self.log.error("oom_replan_not_recorded", job=c.job_id, error=f"{type(e).__name__}: {e}")
        self.log.warning("oom_replan", job=c.job_id, **what)
        job_event(c.workdir, c.job_id, "oom_replan", level="warning", **what)

    def _give_up_on(self, c: Child) -> None:
        """A trainer SIGKILLed kill_wait_s ago that has not exited: listed as stuck, its job settled as a crash.

        Nothing waits for it (daemon/supervisor/stuck.py): its GPUs stay out of scheduling until it is gone, and its job
        waits on the trainer.lock it still holds.
        """
        del self.children[c.job_id]
        c.last_error = self.stuck.add(StuckTrainer(pid=c.pid, start=c.pid_start, devices=list(c.devices),
                                                   job_id=c.job_id, workdir=c.workdir,
                                                   kill_wait_s=self.cfg.kill_wait_s))
        c.stop_reason = "hung"
        self.pending.add(c.job_id, c.devices, "trainer exit", lambda c=c: self._finish(c, None))
