"""The supervisor's GPU path: what it does about GPU health (daemon/gpu_health/) and the VRAM other programs hold;
mixed into Supervisor.

    gpus step     the watcher's changes are logged, told (notification `gpu_quarantined`) and persisted (held
                  GPUs outlive a restart: meta `gpu_held`; every GPU's view: meta `gpu_health`, read by /metrics,
                  the dashboard and `lorad status`). A trainer on a GPU that is out is stopped with the reason
                  "gpu: ...": SIGKILL when nothing on the GPU can be trusted (lost, unknown error, a fatal Xid),
                  else SIGTERM and a clean checkpoint; its job goes `waiting_for_gpu` (daemon/supervisor/
                  exit_policy.py: never counted as a crash). Jobs waiting for a GPU are queued again once there
                  are enough healthy GPUs for them (another one, or theirs back).
    at a start    GPUs that are out are never given; under `gpu_memory_policy: wait` neither are GPUs on which
                  other programs hold VRAM (the job waits, and says so); under `plan` the trainer gets the free
                  VRAM of its GPUs in LORAD_VRAM_BUDGET_GB (GiB) for the memory planner.
    at an exit    a trainer that crashed on its own while its GPU failed is read against a fresh reading first:
                  the GPU's fault, not the job's.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from daemon.gpu_health import verdict as vd
from daemon.gpu_health.reading import GIB
from daemon.store import states
from daemon.supervisor import gang
from daemon.supervisor.accepted_job import accepted_doc
from daemon.supervisor.exit_policy import GPU_FAULT_PREFIX
from daemon.system.log import job_event

BUDGET_ENV = "LORAD_VRAM_BUDGET_GB"  # the contract with the memory planner: free VRAM of the job's GPUs, in GiB
REQUEUE_POLL_S = 0.5


class GpuSupervision:
    health: Any = None  # daemon.gpu_health.watcher.HealthWatcher, or None: every device counts as healthy
    gpu_notes: dict[str, str]  # job id → what was decided about its GPU memory, for `lorad status`
    _next_gpu_requeue: float = 0.0
    _gpu_views: str = ""

    # ------------------------------------------------------------ the gpus step
    def _gpus(self) -> None:
        h = self.health
        if h is not None:
            for ch in h.take_changes():
                self._gpu_changed(ch)
            for c in list(self.children.values()):
                bad = [d for d in c.devices if d is not None and not h.usable(d)]
                if bad and c.stop_reason is None:
                    self._stop_for_gpu(c, bad[0])
            views = json.dumps(h.views(), sort_keys=True)
            if views != self._gpu_views:  # throttle and memory change often; written only when they do
                self.store.set_meta("gpu_health", views)
                self._gpu_views = views
        now = time.monotonic()
        if now >= self._next_gpu_requeue:
            self._next_gpu_requeue = now + REQUEUE_POLL_S
            self._requeue_waiting_for_gpu()

    def gpu_out(self) -> set[int]:
        """The devices no trainer may be given now."""
        if self.health is None:
            return set()
        return {d for d in self.devices if d is not None and not self.health.usable(d)}

    def _gpu_changed(self, ch: vd.Change) -> None:
        v = self.health.verdict(ch.gpu)
        level = "info" if ch.after == vd.OK else "warning"
        getattr(self.log, level)("gpu_health", gpu=ch.gpu, before=ch.before, state=ch.after, reason=ch.reason,
                                 faults=len(v.faults) if v else None)
        self.store.set_meta("gpu_held", json.dumps(self.health.held()))
        on_it = [c for c in self.children.values() if ch.gpu in c.devices]
        for c in on_it:
            job_event(c.workdir, c.job_id, "gpu_health", level=level, gpu=ch.gpu, state=ch.after, reason=ch.reason)
        if ch.after != vd.OK and ch.before != ch.after:
            c = on_it[0] if on_it else None
            self._tell("gpu_quarantined", c.job_id if c else "", c.name if c else None, gpu=ch.gpu, state=ch.after,
                       reason=ch.reason, held=ch.after == vd.HELD)

    def _stop_for_gpu(self, c, gpu: int) -> None:
        v = self.health.verdict(gpu)
        reason = f"{GPU_FAULT_PREFIX} GPU {gpu} {v.state} ({v.reason})"
        if not c.stopping(reason, self.cfg.stop_grace_s):
            return
        sig = signal.SIGKILL if v.fatal else signal.SIGTERM
        self.log.warning("trainer_stop", job=c.job_id, reason=reason, signal=sig.name)
        job_event(c.workdir, c.job_id, "stop_requested", level="warning", reason=reason, signal=sig.name)
        c.signal(sig)

    def gpu_fault_of(self, devices: list[int | None]) -> str | None:
        """For a trainer that exited on its own: "gpu: ..." if one of its GPUs is out now (read afresh)."""
        gpus = [d for d in devices if d is not None]
        if self.health is None or not gpus:
            return None
        self.health.poll_once(gpus)
        for g in gpus:
            v = self.health.verdict(g)
            if v is not None and not v.usable:
                return f"{GPU_FAULT_PREFIX} GPU {g} {v.state} ({v.reason})"
        return None

    def _requeue_waiting_for_gpu(self) -> None:
        jobs = self.store.jobs((states.WAITING_FOR_GPU,))
        if not jobs:
            return
        healthy = [d for d in self.devices if d not in self.gpu_out()]
        for job in jobs:
            need = 1 if self.devices == [None] else gang.job_gpus(accepted_doc(self.store, job))
            if len(healthy) < need:
                continue
            why = f"enough healthy GPUs again ({', '.join(map(str, healthy))})"
            self.store.transition(job["id"], states.WAITING_FOR_GPU, states.QUEUED, why, not_before=0)
            self.log.info("gpu_back", job=job["id"], healthy=healthy)
            job_event(Path(job["workdir"]), job["id"], "requeued", reason=why)

    # ------------------------------------------------------------ VRAM others hold
    def vram_short(self, doc: dict[str, Any], devices: list[int | None]) -> dict[int, str]:
        """Under `wait`: the devices on which other programs hold the VRAM this job would need, and why."""
        if self.health is None or self.cfg.gpu_memory_policy != "wait":
            return {}
        res = doc.get("resources")
        want = res.get("vram_gb") if isinstance(res, dict) else None
        want = float(want) if isinstance(want, (int, float)) and not isinstance(want, bool) else None
        out = {}
        for d in devices:
            v = self.health.verdict(d) if d is not None else None
            if v is None or v.memory_total is None:
                continue
            held, free = v.foreign_bytes() / GIB, v.free_bytes() / GIB
            if (want is not None and free < want) or \
                    (want is None and held > self.cfg.gpu_health.foreign_vram_tolerance_gb):
                out[d] = (f"GPU {d}: other programs hold {held:.1f} GiB of {v.memory_total / GIB:.1f} GiB "
                          f"({len(v.foreign)} process(es))")
        return out

    def _say_vram_wait(self, job: dict[str, Any], short: dict[int, str]) -> None:
        note = "waiting for VRAM (gpu_memory_policy: wait): " + "; ".join(short.values())
        if self.gpu_notes.get(job["id"]) != note:
            self._note_gpu(job["id"], note)
            self.log.info("vram_wait", job=job["id"], reason=note)
            job_event(Path(job["workdir"]), job["id"], "vram_wait", reason=note)

    def vram_budget_env(self, job_id: str, workdir: Path, devs: list[int | None]) -> dict[str, str]:
        """Under `plan`: LORAD_VRAM_BUDGET_GB, the least free VRAM among the job's GPUs (nothing without readings)."""
        self._note_gpu(job_id, None)
        if self.health is None or self.cfg.gpu_memory_policy != "plan":
            return {}
        views = [self.health.verdict(d) for d in devs if d is not None]
        views = [v for v in views if v is not None and v.memory_total is not None]
        if not views:
            return {}
        v = min(views, key=lambda v: v.free_bytes())
        budget = v.free_bytes() / GIB
        held = v.foreign_bytes() / GIB
        free = f"{budget:.1f} GiB" if budget >= 1 else f"{v.free_bytes() >> 20} MiB"  # an almost full card: in MiB
        note = f"planned for {free} free on GPU {v.gpu}" + (f" (other programs hold {held:.1f} GiB)" if held else "")
        self._note_gpu(job_id, note)
        self.log.info("vram_plan", job=job_id, budget_gb=round(budget, 6), foreign_gb=round(held, 6), gpu=v.gpu)
        job_event(workdir, job_id, "vram_plan", budget_gb=round(budget, 6), foreign_gb=round(held, 6), gpu=v.gpu)
        return {BUDGET_ENV: f"{budget:.6f}"}  # to the KiB: a card almost full still gets the plan it leaves room for

    def _note_gpu(self, job_id: str, note: str | None) -> None:
        """What was decided about a job's GPU memory: in memory for `lorad status`, in meta for the dashboard."""
        if self.gpu_notes.get(job_id) == note:
            return
        if note is None:
            self.gpu_notes.pop(job_id, None)
        else:
            self.gpu_notes[job_id] = note
        self.store.set_meta("gpu_notes", json.dumps(self.gpu_notes))

    # ------------------------------------------------------------ lorad gpu [clear N]
    def gpu_views(self) -> list[dict[str, Any]]:
        return self.health.views() if self.health is not None else []

    def clear_gpu(self, gpu: int) -> dict[str, Any]:
        if self.health is None:
            raise KeyError("this daemon reads no GPU health (power.telemetry.backend off, or gpu_health disabled)")
        try:
            self.health.clear(gpu)
        except KeyError:
            raise KeyError(f"GPU {gpu} is not one of this daemon's GPUs") from None
        self.store.set_meta("gpu_held", json.dumps(self.health.held()))
        self.wake.set()
        return self.health.verdict(gpu).view()
