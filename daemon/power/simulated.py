"""A deterministic simulated GPU: power, clocks and step time as functions of the power limit.

It exists so that telemetry, caps, the tuner and the UPS logic can be built,
tested and demonstrated on a machine without NVML. Everything it produces
carries `simulated=True` and its model name starts with "SIMULATED", so a
simulated figure can never pass for a measured one (and a simulated tuning
profile is never reused on a real GPU).

The model, per device, with limit L watts (clamped to [MIN_W, MAX_W]):

    busy power     P(L)  = min(L, FULL_W)                 the board runs at its cap
    SM clock       f(L)  = ((P - STATIC_W) / (FULL_W - STATIC_W)) ** (1/3)
                           (dynamic power ~ f * V^2 with V ~ f, so ~ f^3)
    step time      t(L)  = BASE_STEP_S * (MEM_FRACTION + (1 - MEM_FRACTION) / f)
                           (the memory-bound share does not speed up with the SM clock)
    energy / step  E(L)  = P(L) * t(L)
    idle power           = IDLE_W, SM clock at IDLE_SM_MHZ
    temperature          = 30 + 0.11 * P  (deg C)

With the defaults below E(L) falls from 400 J at 400 W to a minimum near
180 W (275 J, 53% slower) and rises again below it (static power over a longer step), which is
the shape measured on real GPUs; the tuner has to find the bottom within the
allowed slowdown, not simply take the lowest limit.

Energy is integrated exactly (power is piecewise constant between state
changes) against an injectable clock, so tests can drive it with a fake one.

Faults (daemon/gpu_health/): each GPU can be lost, answer an unknown error, raise Xid events, count
uncorrectable ECC errors, have a row remap pending, slow itself down (thermal, hardware) and have other
processes hold its VRAM (VRAM_GB in all). In-process tests call `inject(gpu, ...)`; a daemon in its own process
reads them from `power.telemetry.simulated_faults`, a JSON file re-read when it changes:

    {"1": {"xid": [79, 79, 79]}, "0": {"lost": true, "foreign_mib": 6144, "throttle": ["hw_thermal_slowdown"]}}

keys: lost, error (a message), xid (every Xid so far: the new ones are delivered once; those already in the file
when the device is made are not, as NVML's event set delivers no Xid raised before it was registered, so a
restarted daemon never sees old ones again), ecc_uncorrected (a count),
pending_remap, remap_failed, throttle (clock-event names), foreign_mib (memory another program holds). A GPU
not named is healthy. A lost GPU's telemetry samples fail, as NVML's do.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daemon.power.gpu import CapRefused, GpuInfo, HealthReading, Sample

MODEL_NAME = "SIMULATED lorad-sim-400W"
MAX_W = 400.0
MIN_W = 150.0
DEFAULT_W = 400.0
FULL_W = 400.0  # busy power at full clock
STATIC_W = 130.0  # leakage + memory + fans while busy
IDLE_W = 60.0
MAX_SM_MHZ = 1980.0
IDLE_SM_MHZ = 345.0
MEM_MHZ = 2619.0
BASE_STEP_S = 1.0
MEM_FRACTION = 0.3
VRAM_GB = 24.0
FOREIGN_PID = 1 << 22  # beyond Linux's pid_max: a "process" that is never one of the daemon's trainers
FAULT_KEYS = frozenset({"lost", "error", "xid", "ecc_uncorrected", "pending_remap", "remap_failed", "throttle",
                        "foreign_mib"})


def clock_fraction(limit_w: float) -> float:
    p = min(max(limit_w, MIN_W), FULL_W)
    return ((p - STATIC_W) / (FULL_W - STATIC_W)) ** (1.0 / 3.0)


def step_time_s(limit_w: float, base_step_s: float = BASE_STEP_S) -> float:
    return base_step_s * (MEM_FRACTION + (1.0 - MEM_FRACTION) / clock_fraction(limit_w))


def busy_power_w(limit_w: float) -> float:
    return min(max(limit_w, MIN_W), FULL_W)


def joules_per_step(limit_w: float, base_step_s: float = BASE_STEP_S) -> float:
    return busy_power_w(limit_w) * step_time_s(limit_w, base_step_s)


class SimulatedDevice:
    """`n` identical simulated GPUs. `set_busy(gpu, True)` while a (simulated or real) trainer runs on it."""

    simulated = True

    def __init__(self, n: int = 1, clock: Callable[[], float] = time.monotonic, refuse_limits: bool = False,
                 wall: Callable[[], float] = time.time, faults_file: str | Path | None = None):
        self._clock, self._wall = clock, wall
        self._faults_file = Path(faults_file) if faults_file else None
        self._faults_seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._fault: list[dict[str, Any]] = [{} for _ in range(n)]
        self._lock = threading.Lock()
        self._refuse = refuse_limits  # pretend to be a non-root daemon: every set_limit_w is refused
        now = clock()
        self._limit = [DEFAULT_W] * n
        self._busy = [False] * n
        self._energy_mj = [0.0] * n
        self._last = [now] * n
        # "Registered" now: the Xids a faults file already lists happened before this device (a daemon's start).
        self._read_faults()
        self._xids_delivered = [len(f["xid"]) if isinstance(f.get("xid"), list) else 0 for f in self._fault]

    def count(self) -> int:
        return len(self._limit)

    # --- faults (daemon/gpu_health/) --------------------------------------------------------------------------
    def inject(self, gpu: int, **fault: Any) -> None:
        """Set some of a GPU's faults (the keys of the faults file); `inject(gpu)` with nothing: healthy again."""
        unknown = set(fault) - FAULT_KEYS
        if unknown:
            raise ValueError(f"unknown simulated faults: {sorted(unknown)}")
        with self._lock:
            self._fault[gpu] = {**self._fault[gpu], **fault} if fault else {}

    def _read_faults(self) -> None:
        if self._faults_file is None:
            return
        try:
            st = os.stat(self._faults_file)
        except OSError:
            seen, data = None, {}
        else:
            seen = (st.st_mtime_ns, st.st_size)
            if seen == self._faults_seen:
                return
            try:
                data = json.loads(self._faults_file.read_text())
            except (OSError, ValueError):
                return  # caught mid-write: the next reading sees the whole file
        if seen == self._faults_seen:
            return
        self._faults_seen = seen
        for gpu in range(len(self._fault)):
            f = data.get(str(gpu)) if isinstance(data, dict) else None
            self._fault[gpu] = {k: v for k, v in f.items() if k in FAULT_KEYS} if isinstance(f, dict) else {}

    def _faults(self, gpu: int) -> dict[str, Any]:
        self._read_faults()
        return self._fault[gpu]

    def health_reading(self, gpu: int):
        """One health reading (daemon/gpu_health/reading.py), from the injected faults."""
        with self._lock:
            f = self._faults(gpu)
            if f.get("lost"):
                return HealthReading(gpu=gpu, lost=True)
            if f.get("error"):
                return HealthReading(gpu=gpu, error=f"simulated: {f['error']}")
            xids = [int(x) for x in f.get("xid") or []]
            if len(xids) < self._xids_delivered[gpu]:
                self._xids_delivered[gpu] = 0  # a new list: its events are new
            new, self._xids_delivered[gpu] = xids[self._xids_delivered[gpu]:], len(xids)
            foreign = int(float(f.get("foreign_mib") or 0) * (1 << 20))
            return HealthReading(gpu=gpu, xids=new, ecc_uncorrected=int(f.get("ecc_uncorrected") or 0),
                           pending_remap=bool(f.get("pending_remap")), remap_failed=bool(f.get("remap_failed")),
                           throttle=self._throttle(gpu) + list(f.get("throttle") or []),
                           memory_total=int(VRAM_GB * (1 << 30)),
                           processes=[(FOREIGN_PID, foreign)] if foreign else [])

    def _throttle(self, gpu: int) -> list[str]:
        if not self._busy[gpu]:
            return ["gpu_idle"]
        return ["sw_power_cap"] if self._limit[gpu] < FULL_W else []

    def info(self, gpu: int) -> GpuInfo:
        return GpuInfo(index=gpu, name=MODEL_NAME, min_w=MIN_W, max_w=MAX_W, default_w=DEFAULT_W, simulated=True)

    def _power(self, gpu: int) -> float:
        return busy_power_w(self._limit[gpu]) if self._busy[gpu] else IDLE_W

    def _advance(self, gpu: int) -> None:
        now = self._clock()
        self._energy_mj[gpu] += self._power(gpu) * (now - self._last[gpu]) * 1000.0
        self._last[gpu] = now

    def set_busy(self, gpu: int, busy: bool) -> None:
        with self._lock:
            self._advance(gpu)
            self._busy[gpu] = busy

    def limit_w(self, gpu: int) -> float:
        return self._limit[gpu]

    def set_limit_w(self, gpu: int, watts: float) -> None:
        if self._refuse:
            raise CapRefused("simulated: insufficient permissions to change the power limit")
        if not MIN_W <= watts <= MAX_W:
            raise CapRefused(f"simulated: {watts:.0f} W is outside [{MIN_W:.0f}, {MAX_W:.0f}] W")
        with self._lock:
            self._advance(gpu)
            self._limit[gpu] = float(watts)

    def energy_mj(self, gpu: int) -> float:
        with self._lock:
            self._advance(gpu)
            return self._energy_mj[gpu]

    def step_time_s(self, gpu: int, base_step_s: float = BASE_STEP_S) -> float:
        """How long one training step takes at this device's current limit (for simulated trainers)."""
        return step_time_s(self._limit[gpu], base_step_s)

    def sample(self, gpu: int) -> Sample:
        with self._lock:
            f = self._faults(gpu)
            if f.get("lost") or f.get("error"):
                raise RuntimeError(f"simulated: GPU {gpu} " + ("is lost" if f.get("lost") else f["error"]))
            self._advance(gpu)
            busy, limit = self._busy[gpu], self._limit[gpu]
            p = self._power(gpu)
            return Sample(
                ts=self._wall(),
                gpu=gpu,
                power_w=p,
                energy_mj=self._energy_mj[gpu],
                energy_source="simulated",
                sm_mhz=MAX_SM_MHZ * clock_fraction(limit) if busy else IDLE_SM_MHZ,
                mem_mhz=MEM_MHZ,
                temp_c=30.0 + 0.11 * p,
                util_gpu=99.0 if busy else 0.0,
                util_mem=60.0 if busy else 0.0,
                limit_w=limit,
                throttle=self._throttle(gpu) + list(f.get("throttle") or []),
                simulated=True,
            )

    def close(self) -> None:
        pass
