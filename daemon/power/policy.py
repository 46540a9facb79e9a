"""PowerPolicy: telemetry, caps, the tuner, schedules and the UPS behind the supervisor's Policy seam.

The supervisor calls on_job_start / on_heartbeat / on_job_end and tick(now);
this class never touches a process — it answers with a Decision. It owns the
GPU limits: on every tick each GPU gets the lowest of the caps that apply to it

    manual (`lorad power --limit`) or caps.default_w,  the open schedule cap,
    the UPS's lowest cap while on battery,  the running job's limit_w or tuned limit

and a GPU none of them applies to goes back to the limit it had before lorad
touched it (so a job's own cap ends with the job).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from daemon.config.power import PowerSettings
from daemon.power.caps import CapManager
from daemon.power.gpu import Device, GpuInfo
from daemon.power.helper_client import caps_seam
from daemon.power.job_energy import JobEnergy, MeteredJob, event_time
from daemon.power.run_policy import Decision, RunningJob
from daemon.power.schedule import Schedule
from daemon.power.telemetry import TelemetrySampler, open_device
from daemon.power.telemetry_store import TelemetryStore
from daemon.power.tuner import job_shape_key
from daemon.power.ups import UpsMonitor


class PowerPolicy(JobEnergy):
    def __init__(self, settings: PowerSettings, home: Path, db_path: Path, log: Any,
                 clock: Callable[[], float] = time.time, device: Device | None = None,
                 start_threads: bool = True):
        # `clock` is wall time: heartbeats carry the trainer's wall-clock timestamp. The UPS keeps its own
        # monotonic clock (resume_after_s must not jump with NTP).
        self.s, self.home, self.log, self.clock = settings, Path(home), log, clock
        self._energy: dict[int, deque[tuple[float, float]]] = {}
        self._lock = threading.RLock()  # supervisor thread + socket handlers (lorad power)
        self.store = TelemetryStore(db_path, settings.telemetry.raw_retention_s, settings.telemetry.history_days)
        self.device = device if device is not None else caps_seam(open_device(
            settings.telemetry.backend, log, settings.telemetry.simulated_gpus, clock,
            settings.telemetry.simulated_faults), settings.caps.helper_socket)
        self.caps = CapManager(self.device, log) if self.device is not None else None
        self.sampler = (TelemetrySampler(self.device, self._write_samples, settings.telemetry.interval_s, log)
                        if self.device is not None else None)
        sch = settings.schedule
        self.schedule = Schedule(sch, log) if (sch.run_windows or sch.caps or sch.outages_file) else None
        self.ups = UpsMonitor(settings.ups, log) if settings.ups.enabled else None
        self.jobs: dict[str, MeteredJob] = {}
        self.manual: dict[int, float] = {}  # gpu -> W from `lorad power --limit`
        self._said: set[str] = set()
        self.last_notes: list[str] = []
        if start_threads:
            if self.sampler is not None:
                self.sampler.start()
            if self.ups is not None:
                self.ups.start()

    # --- helpers -------------------------------------------------------------------------------------------

    def _say_once(self, key: str, event: str, **kw: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log.warning(event, **kw)

    def _write_samples(self, rows: list) -> None:
        with self._lock:
            by_gpu = {j.gpu: jid for jid, j in self.jobs.items()}
        self.store.add_samples(rows, by_gpu)

    def _gpu_of(self, job: RunningJob) -> int:
        # A CPU-only machine reports gpu=None: the simulated device stands in with its GPU 0 (demos, tests);
        # a real one has nothing to meter for a CPU job (-1: unmetered).
        if job.gpu is None:
            return 0 if self.device is not None and self.device.simulated else -1
        return job.gpu

    def _shape_key(self, job: RunningJob) -> str:
        # The job as accepted (state.db's copy), never jobs/ID/job.yaml: the trainer user may replace that file.
        if job.doc:
            return job_shape_key(job.doc)
        return "name:" + job.name  # no job to read: at least jobs of one name share a profile

    # --- the Policy protocol -------------------------------------------------------------------------------

    def on_job_start(self, job: RunningJob) -> None:
        with self._lock:
            power = job.power or {}
            lim = power.get("limit_w")
            j = MeteredJob(job=job, gpu=self._gpu_of(job), shape_key=self._shape_key(job),
                     limit_w=float(lim) if isinstance(lim, (int, float)) else None, auto=lim == "auto",
                     max_slowdown=float(power.get("max_slowdown", 0.10)), flushed_at=self.clock())
            self.jobs[job.job_id] = j
            if self.device is None:
                if lim is not None:
                    self._say_once("nocaps", "power limit requested but telemetry is unavailable; running uncapped",
                                   job=job.job_id, limit_w=lim)
                return
            if not 0 <= j.gpu < self.device.count():
                j.metered = False
                self._say_once(f"gpu{j.gpu}", "job's GPU is not among the metered GPUs; it runs unmetered and uncapped",
                               job=job.job_id, gpu=j.gpu, gpus=self.device.count())
                return
            if getattr(self.device, "simulated", False) and hasattr(self.device, "set_busy"):
                self.device.set_busy(j.gpu, True)
            if j.auto and job.total:
                self._make_tuner(j, job.total)
            self._apply_caps(j.gpu)

    def on_heartbeat(self, job_id: str, event: dict[str, Any]) -> None:
        if event.get("event") != "step" or self.device is None:
            return
        with self._lock:
            j = self.jobs.get(job_id)
            if j is None or not j.metered:
                return
            step = int(event.get("step", 0))
            # The supervisor reads heartbeats once per tick, up to a tick after the step ended. The step's
            # own timestamp and the energy counter interpolated to it keep the tuner's windows exact.
            self._read_energy(j.gpu)
            now = event_time(event, self.clock())
            energy = self._energy_at(j.gpu, now)
            if j.last is not None and step > j.last[0]:
                e, secs, n = j.pending
                j.pending = (e + (energy - j.last[2]) / 1000.0, secs + now - j.last[1], n + step - j.last[0])
            j.last = (step, now, energy)
            self._flush(j, now)
            if j.auto and j.tuner is None and event.get("total"):
                self._make_tuner(j, int(event["total"]))
            if j.tuner is not None and not j.tuner.done:
                before, n_points = j.tuner.limit_w, len(j.tuner.points)
                if j.tuner.observe(step, now, energy, self.caps.applied.get(j.gpu) if self.caps else None):
                    self._tuned(j)
                elif len(j.tuner.points) > n_points:
                    self._save_partial(j)  # a restart mid-profile measures only the remaining limits
                if j.tuner.limit_w != before:
                    self._apply_caps(j.gpu)

    def on_job_end(self, job_id: str, exit_code: int | None) -> None:
        with self._lock:
            j = self.jobs.pop(job_id, None)
            if j is None or self.device is None or not j.metered:
                return
            self._flush(j, self.clock(), force=True)
            if not any(o.gpu == j.gpu for o in self.jobs.values()):
                if hasattr(self.device, "set_busy"):
                    self.device.set_busy(j.gpu, False)
            self._apply_caps(j.gpu)

    def tick(self, now: datetime, running: list[RunningJob]) -> Decision:
        with self._lock:
            d = Decision()
            for r in running:  # a job adopted after a daemon restart, or started before the policy existed
                if r.job_id not in self.jobs:
                    self.on_job_start(r)
                else:
                    self.jobs[r.job_id].job = r
            for gone in set(self.jobs) - {r.job_id for r in running}:
                self.on_job_end(gone, None)  # its end was not reported (a hook that failed): caps must not stay
            sched = self.schedule.state(now) if self.schedule is not None else None
            ups = self.ups.advice() if self.ups is not None else None
            self._sched_cap = sched.cap_w if sched else None
            self._ups_lowest = bool(ups and ups.lowest_cap)
            reasons = []
            if ups is not None:
                d.may_start &= ups.may_start
                d.checkpoint_now = ups.checkpoint_now
                d.outage = ups.outage
                d.notes += ups.notes
                if ups.stop_reason:
                    reasons.append(ups.stop_reason)
            if sched is not None:
                d.may_start &= sched.may_run
                d.notes += sched.notes
                if sched.reason:
                    reasons.append(sched.reason)
            if reasons and running:
                d.stop_running = reasons[0]  # the UPS first: it is the most urgent
                d.checkpoint_now = False  # the stop itself commits a final checkpoint
            if not running:
                d.checkpoint_now = False
            if self.device is not None:
                for gpu in range(self.device.count()):
                    self._per_gpu(gpu, self._apply_caps)
                for gpu in {j.gpu for j in self.jobs.values() if j.metered}:
                    self._per_gpu(gpu, self._read_energy)  # brackets the next heartbeat's timestamp within one tick
            self.store.maintain()
            self.last_notes = list(d.notes)
            return d

    def close(self) -> None:
        # Threads first and outside the lock: the sampler takes the lock to write its last round.
        if self.ups is not None:
            self.ups.stop()
        if self.sampler is not None:
            self.sampler.stop()
        with self._lock:
            for j in self.jobs.values():
                self._flush(j, self.clock(), force=True)
            if self.caps is not None and self.s.caps.restore_on_exit:
                self.caps.restore_all("daemon exit")
            self.store.close()
            if self.device is not None:
                self.device.close()

    # --- caps ----------------------------------------------------------------------------------------------

    _sched_cap: float | None = None
    _ups_lowest: bool = False

    def wanted_limit(self, gpu: int) -> tuple[float | None, str]:
        """The lowest cap that applies to a GPU now, and why; (None, ...) = the driver's own limit."""
        assert self.device is not None
        c: list[tuple[float, str]] = []
        base = self.manual.get(gpu, self.s.caps.default_w)
        if base is not None:
            c.append((float(base), "manual" if gpu in self.manual else "caps.default_w"))
        if self._sched_cap is not None:
            c.append((self._sched_cap, "schedule"))
        if self._ups_lowest:
            c.append((self.device.info(gpu).min_w, "ups on battery"))
        for j in self.jobs.values():
            if j.gpu != gpu:
                continue
            if j.limit_w is not None:
                c.append((j.limit_w, f"job {j.job.job_id}"))
            elif j.tuner is not None and j.tuner.limit_w is not None:
                c.append((j.tuner.limit_w, f"job {j.job.job_id} " + ("tuned" if j.tuner.done else "profiling")))
        if not c:
            return None, "none"
        return min(c)

    def _per_gpu(self, gpu: int, fn: Callable[[int], Any]) -> None:
        # A lost GPU answers every NVML call with an error (daemon/gpu_health/ quarantines it): the other GPUs'
        # caps and meters go on, and the tick (the supervisor's health, the watchdog) does not fail with it.
        try:
            fn(gpu)
        except Exception as e:  # noqa: BLE001
            self._say_once(f"unreadable-{gpu}-{type(e).__name__}", "power: GPU unreadable", gpu=gpu,
                           error=f"{type(e).__name__}: {e}")

    def _apply_caps(self, gpu: int) -> None:
        if self.caps is None:
            return
        w, why = self.wanted_limit(gpu)
        self.caps.apply(gpu, w, why)

    def set_manual_limit(self, gpu: int | None, watts: float | None) -> dict[str, Any]:
        """`lorad power --limit W [--gpu N]` (None W: clear the manual limit). Applied at once."""
        with self._lock:
            if self.device is None:
                return {"ok": False, "error": "telemetry unavailable: no NVML device to cap"}
            gpus = range(self.device.count()) if gpu is None else [gpu]
            out = {}
            for g in gpus:
                if not 0 <= g < self.device.count():
                    return {"ok": False, "error": f"no GPU {g}"}
                if watts is None:
                    self.manual.pop(g, None)
                else:
                    self.manual[g] = float(watts)
                self._apply_caps(g)
                out[g] = {"wanted_w": self.wanted_limit(g)[0], "applied_w": self.caps.applied.get(g),  # type: ignore[union-attr]
                          "refused": self.caps.last_refusal.get(g)}  # type: ignore[union-attr]
            return {"ok": True, "gpus": out, "simulated": self.device.simulated}

    # --- reports -------------------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Everything `lorad power --json` shows: live telemetry per GPU, caps, tuner, UPS, schedule."""
        with self._lock:
            rep: dict[str, Any] = {"backend": self.s.telemetry.backend, "available": self.device is not None,
                                   "simulated": bool(self.device and self.device.simulated), "gpus": [],
                                   "jobs": {}, "notes": list(self.last_notes)}
            if self.device is None:
                rep["notes"].insert(0, "telemetry unavailable")
            elif why := getattr(self.device, "caps_unavailable", lambda: None)():
                rep["notes"].insert(0, why)
            if self.device is not None:
                for g in range(self.device.count()):
                    try:
                        info = self.device.info(g)
                        limit = self.device.limit_w(g)
                    except Exception as e:  # noqa: BLE001 — a lost GPU: said, not a failed report
                        info, limit = GpuInfo(g, f"unreadable ({type(e).__name__}: {e})", None, None, None), None
                    latest = self.sampler.latest.get(g) if self.sampler else None
                    want, why = self.wanted_limit(g)
                    rep["gpus"].append({
                        "index": g, "name": info.name, "simulated": info.simulated,
                        "min_w": info.min_w, "max_w": info.max_w, "default_w": info.default_w,
                        "limit_w": limit, "wanted_w": want, "cap_reason": why,
                        "original_w": self.caps.original.get(g) if self.caps else None,
                        "refused": self.caps.last_refusal.get(g) if self.caps else None,
                        "sample": latest.to_dict() if latest else None,
                    })
            for jid, j in self.jobs.items():
                t = j.tuner
                rep["jobs"][jid] = {"gpu": j.gpu if j.gpu >= 0 else None,  # None: a CPU job, nothing to meter
                                    "limit_w": j.limit_w, "auto": j.auto,
                                    "tuner": None if t is None else {
                                        "done": t.done, "limit_w": t.limit_w,
                                        "points": [p.to_dict() for p in t.points]},
                                    "energy": self.store.job_summary(jid)}
            if self.ups is not None:
                rep["ups"] = {"state": self.ups.mode, "status": self.ups.status, "connected": self.ups.connected,
                              "error": self.ups.last_error}
            return rep

    def job_power(self, job_id: str) -> dict[str, Any] | None:
        """Per-job W, J/step, kWh, steps/kWh for `lorad status ID` (None: no energy recorded)."""
        with self._lock:
            j = self.jobs.get(job_id)
            if j is not None:
                self._flush(j, self.clock(), force=True)
            return self.store.job_summary(job_id)
