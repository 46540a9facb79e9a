"""A running job's energy: its GPU's energy counter read at each step's own timestamp, added up per job and
written at most every few seconds, and the tuner that profiles power limits for `limit_w: auto`.

Part of PowerPolicy (daemon/power/policy.py), which holds the lock, the device, the caps and the telemetry store
these methods use; the Policy hooks there call them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from daemon.power.run_policy import RunningJob
from daemon.power.tuner import Point, Tuner, candidate_limits, choose, profiling_steps

_FLUSH_S = 5.0  # per-job energy is added up in memory and written at most this often (and at job end)
_HISTORY = 64  # (time, energy) readings kept per GPU to find the energy at a step's own timestamp


def event_time(event: dict[str, Any], now: float) -> float:
    """The trainer's own timestamp of a heartbeat (it was written before the supervisor's tick read it)."""
    ts = event.get("ts")
    if isinstance(ts, str):
        try:
            t = datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return now
        if now - 30.0 <= t <= now:  # a clock that disagrees with ours: fall back to the arrival time
            return t
    return now


@dataclass
class MeteredJob:
    job: RunningJob
    gpu: int
    shape_key: str
    limit_w: float | None = None  # a fixed per-job cap
    auto: bool = False
    max_slowdown: float = 0.10
    tuner: Tuner | None = None
    last: tuple[int, float, float] | None = None  # (step, wall time, energy mJ) at the previous heartbeat
    pending: tuple[float, float, int] = (0.0, 0.0, 0)  # energy J, seconds, steps not yet written
    flushed_at: float = 0.0
    metered: bool = True  # False: the job's GPU is not one the telemetry device knows


class JobEnergy:
    """Energy metering and the tuner of PowerPolicy's jobs; mixed into PowerPolicy."""

    def _make_tuner(self, j: MeteredJob, total: int) -> None:
        assert self.device is not None
        info = self.device.info(j.gpu)
        prof = self.store.load_profile(info.name, j.shape_key)
        if prof is not None and prof["complete"]:
            j.tuner = Tuner.from_profile(prof["points"], j.max_slowdown)
            self.log.info("power profile reused", job=j.job.job_id, gpu_model=info.name, shape=j.shape_key,
                          limit_w=j.tuner.limit_w, simulated=info.simulated)
            return
        t = self.s.tuner
        cands = candidate_limits(info.min_w, info.max_w, total, t.warmup_steps, t.measure_steps,
                                 t.max_candidates, t.budget_fraction, t.round_w)
        measured = [Point(**p) for p in prof["points"]] if prof is not None else []
        j.tuner = Tuner(cands, t.warmup_steps, t.measure_steps, j.max_slowdown, measured)
        if j.tuner.done and measured:  # every candidate was measured before the interruption
            j.tuner.chosen = choose(j.tuner.points, j.max_slowdown)
            self._tuned(j)
            return
        if cands:
            self.log.info("power profiling", job=j.job.job_id, candidates_w=j.tuner.candidates, total_steps=total,
                          already_measured_w=[p.limit_w for p in measured],
                          max_profile_steps=profiling_steps(len(j.tuner.candidates), t.warmup_steps, t.measure_steps),
                          simulated=info.simulated)
        else:
            self.log.info("power profiling skipped: job too short for the profiling budget", job=j.job.job_id,
                          total_steps=total)

    def _flush(self, j: MeteredJob, now: float, force: bool = False) -> None:
        e, secs, steps = j.pending
        if steps == 0 or (not force and now - j.flushed_at < _FLUSH_S):
            return
        assert self.device is not None
        info = self.device.info(j.gpu)
        limit = self.caps.applied.get(j.gpu) if self.caps else None
        self.store.add_job_energy(j.job.job_id, info.name, info.simulated, e, secs, steps, limit)
        j.pending, j.flushed_at = (0.0, 0.0, 0), now

    def _read_energy(self, gpu: int) -> None:
        assert self.device is not None
        self._energy.setdefault(gpu, deque(maxlen=_HISTORY)).append((self.clock(), self.device.energy_mj(gpu)))

    def _energy_at(self, gpu: int, t: float) -> float:
        """The energy counter at time t, linear between the two readings around it (power is near constant
        over a tick while training)."""
        h = list(self._energy[gpu])
        i = bisect_left([x[0] for x in h], t)
        if i >= len(h):
            return h[-1][1]
        if i == 0 or h[i][0] == t:
            return h[i][1]
        (t0, e0), (t1, e1) = h[i - 1], h[i]
        return e0 + (e1 - e0) * (t - t0) / (t1 - t0)

    def _save_partial(self, j: MeteredJob) -> None:
        assert self.device is not None and j.tuner is not None
        info = self.device.info(j.gpu)
        self.store.save_profile(info.name, j.shape_key, info.default_w, [p.to_dict() for p in j.tuner.points],
                                info.simulated, complete=False)

    def _tuned(self, j: MeteredJob) -> None:
        assert self.device is not None and j.tuner is not None
        info = self.device.info(j.gpu)
        pts = [p.to_dict() for p in j.tuner.points]
        self.store.save_profile(info.name, j.shape_key, info.default_w, pts, info.simulated)
        base, best = j.tuner.points[0], j.tuner.chosen
        assert best is not None
        self.log.info("power tuned", job=j.job.job_id, gpu_model=info.name, limit_w=best.limit_w,
                      j_per_step_saved=round(1 - best.j_per_step / base.j_per_step, 4),
                      slowdown=round(best.s_per_step / base.s_per_step - 1, 4), points=len(pts),
                      simulated=info.simulated)
