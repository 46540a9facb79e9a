"""The health watcher: reads every GPU every interval_s on its own thread and keeps each one's verdict.

NVML is read on this thread, never on the service loop's: a hung driver stalls the watcher, not the daemon.
`poll_once()` is the whole job; the thread only repeats it, so tests call it directly. The supervisor takes the
changes (`take_changes`) and the verdicts (`verdicts`, `usable`) on its own tick (daemon/gpu_health/supervision.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from daemon.gpu_health import verdict as vd
from daemon.gpu_health.reading import Reading


class HealthSource(Protocol):
    def count(self) -> int: ...
    def health_reading(self, gpu: int) -> Reading: ...


def our_pids(groups: set[int], pids: list[int]) -> set[int]:
    """Those of `pids` that belong to one of our trainers' process groups (the rest hold VRAM for others)."""
    out = set()
    for pid in pids:
        try:
            if os.getpgid(pid) in groups:
                out.add(pid)
        except OSError:  # gone, or in another pid namespace: not one of ours
            pass
    return out


class HealthWatcher:
    def __init__(self, source: HealthSource, gpus: list[int], rules: vd.Rules, interval_s: float, log: Any,
                 groups: Callable[[], set[int]] = set, clock: Callable[[], float] = time.monotonic,
                 held: dict[int, str] | None = None):
        self.source, self.rules, self.interval_s, self.log = source, rules, interval_s, log
        self.groups = groups  # our trainers' process groups (their processes' VRAM is ours)
        self.clock = clock
        self._lock = threading.Lock()
        self._v = {g: vd.GpuVerdict(gpu=g) for g in gpus}
        for g, why in (held or {}).items():  # held before a restart: still held until cleared
            if g in self._v:
                v = self._v[g]
                v.state, v.reason, v.since = vd.HELD, why, clock()
                v.faults.extend([clock()] * rules.max_faults)
        self._changes: list[vd.Change] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.polled = 0

    def poll_once(self, gpus: list[int] | None = None) -> list[vd.Change]:
        out = []
        for g in (gpus if gpus is not None else list(self._v)):
            try:
                r = self.source.health_reading(g)
            except Exception as e:  # noqa: BLE001 — a reader that breaks is an unknown error of that GPU
                r = Reading(gpu=g, error=f"{type(e).__name__}: {e}")
            ours = our_pids(self.groups(), [pid for pid, _ in r.processes]) if r.processes else set()
            with self._lock:
                ch = vd.observe(self._v[g], r, ours, self.rules, self.clock())
                if ch is not None:
                    self._changes.append(ch)
                    out.append(ch)
        self.polled += 1
        return out

    def take_changes(self) -> list[vd.Change]:
        with self._lock:
            out, self._changes = self._changes, []
        return out

    def clear(self, gpu: int) -> vd.Change | None:
        with self._lock:
            v = self._v.get(gpu)
            if v is None:
                raise KeyError(gpu)
            ch = vd.clear(v, self.clock())
            if ch is not None:
                self._changes.append(ch)
            return ch

    def verdict(self, gpu: int) -> vd.GpuVerdict | None:
        return self._v.get(gpu)

    def usable(self, gpu: int | None) -> bool:
        v = self._v.get(gpu) if gpu is not None else None
        return v is None or v.usable  # a device the watcher does not read (the CPU) is never held out

    def views(self) -> list[dict[str, Any]]:
        with self._lock:
            return [v.view() for v in self._v.values()]

    def held(self) -> dict[int, str]:
        with self._lock:
            return {g: v.reason or "" for g, v in self._v.items() if v.state == vd.HELD}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lorad-gpu-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as e:  # noqa: BLE001 — the watcher must outlive anything a reading does
                self.log.warning("gpu_health_poll_failed", error=f"{type(e).__name__}: {e}")
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def open_watcher(cfg: Any, policy: Any, devices: list[int | None], held_meta: str | None,
                 log: Any) -> HealthWatcher | None:
    """The daemon's watcher (not started), reading where telemetry reads (power.telemetry.backend); None when
    there is nothing to read (backend off, no driver, `gpu_health.enabled: false`, a CPU-only machine): said once."""
    s = cfg.gpu_health
    backend = cfg.power.telemetry.backend
    gpus = [d for d in devices if d is not None]
    if not s.enabled or backend == "off" or not gpus:
        log.info("gpu_health_off", reason="disabled" if not s.enabled else
                 ("telemetry backend off" if backend == "off" else "no GPU"))
        return None
    source: Any = None
    if backend == "simulated":
        source = getattr(policy, "device", None)  # the power policy's simulated GPUs: one device, one set of faults
        if source is None or not hasattr(source, "health_reading"):
            log.warning("gpu_health_unavailable", reason="the simulated device did not start")
            return None
    else:
        try:
            from daemon.gpu_health.nvml import NvmlHealth

            source = NvmlHealth()
        except Exception as e:  # noqa: BLE001 — ImportError, no driver: the daemon runs on without health readings
            log.warning("gpu_health_unavailable", reason=f"{type(e).__name__}: {e}")
            return None
    gpus = [g for g in gpus if g < source.count()]
    try:
        held = {int(k): str(v) for k, v in json.loads(held_meta or "{}").items()}
    except (ValueError, AttributeError):
        held = {}
    if held:
        log.warning("gpu_held", gpus=sorted(held), message="held before the restart: out until `lorad gpu clear N`")
    return HealthWatcher(source, gpus, vd.Rules(recover_s=s.recover_s, max_faults=s.max_faults,
                                                fault_window_s=s.fault_window_s), s.interval_s, log, held=held)
