"""GPU telemetry: the NVML `Device` (types in daemon/power/gpu.py), the device for a backend, a 1 Hz sampler.

NVML handles live in memory only; what is sampled goes to SQLite through
`TelemetryStore`. Without a driver the daemon says "telemetry unavailable"
once and runs on without power features.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from daemon.power.gpu import CapRefused, Device, GpuInfo, Sample


def _throttle_names(pynvml: Any) -> list[tuple[int, str]]:
    """(bit, name) for every clock-event reason this pynvml knows; newer names first, older aliases as fallback."""
    out: dict[int, str] = {}
    for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
        for attr in dir(pynvml):
            if not attr.startswith(prefix):
                continue
            short = attr[len(prefix) :]
            if short in ("All", "None"):
                continue
            bit = getattr(pynvml, attr)
            if isinstance(bit, int) and bit and bit not in out:
                # SwPowerCap -> sw_power_cap
                out[bit] = "".join("_" + c.lower() if c.isupper() else c for c in short).lstrip("_")
    return sorted(out.items())


def decode_throttle(mask: int, table: list[tuple[int, str]]) -> list[str]:
    names = [name for bit, name in table if mask & bit]
    known = 0
    for bit, _ in table:
        known |= bit
    if mask & ~known:
        names.append(f"unknown_0x{mask & ~known:x}")
    return names


class NvmlDevice:
    """The real driver. Raises at construction when NVML cannot be initialised."""

    simulated = False

    def __init__(self, log: Any = None):
        import pynvml  # lazy: the daemon must import without nvidia-ml-py being usable

        self._nv = pynvml
        pynvml.nvmlInit()
        self._log = log
        self._handles: list[Any] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                self._handles.append(pynvml.nvmlDeviceGetHandleByIndex(i))
            except pynvml.NVMLError as e:  # lost or failing now: the others are read; this one when it answers
                self._handles.append(None)
                if log is not None:
                    log.warning("telemetry: GPU unreadable at start", gpu=i, error=f"{type(e).__name__}: {e}")
        self._throttle = _throttle_names(pynvml)
        # Boards without a total-energy counter (pre-Volta) get power x time integrated here.
        self._integrated: dict[int, tuple[float, float]] = {}  # gpu -> (mJ so far, monotonic time of last read)
        self._said_integrating: set[int] = set()
        self._info: dict[int, GpuInfo] = {}

    def count(self) -> int:
        return len(self._handles)

    def _h(self, gpu: int) -> Any:
        """The GPU's handle; one it could not get yet is asked for again (raises while it still fails)."""
        if self._handles[gpu] is None:
            self._handles[gpu] = self._nv.nvmlDeviceGetHandleByIndex(gpu)
        return self._handles[gpu]

    def info(self, gpu: int) -> GpuInfo:
        if gpu in self._info:  # constant for the life of the driver; the policy asks every tick
            return self._info[gpu]
        nv, h = self._nv, self._h(gpu)
        name = nv.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        lo, hi = nv.nvmlDeviceGetPowerManagementLimitConstraints(h)
        default = nv.nvmlDeviceGetPowerManagementDefaultLimit(h)
        self._info[gpu] = GpuInfo(index=gpu, name=name, min_w=lo / 1000.0, max_w=hi / 1000.0,
                                  default_w=default / 1000.0)
        return self._info[gpu]

    def limit_w(self, gpu: int) -> float:
        return self._nv.nvmlDeviceGetEnforcedPowerLimit(self._h(gpu)) / 1000.0

    def set_limit_w(self, gpu: int, watts: float) -> None:
        nv = self._nv
        try:
            nv.nvmlDeviceSetPowerManagementLimit(self._h(gpu), int(round(watts * 1000)))
        except nv.NVMLError as e:  # NoPermission (not root), NotSupported (laptops), InvalidArgument (range)
            raise CapRefused(f"GPU {gpu}: setting {watts:.0f} W refused by the driver: {e}") from e

    def energy_mj(self, gpu: int) -> float:
        nv, h = self._nv, self._h(gpu)
        if gpu not in self._said_integrating:
            try:
                return float(nv.nvmlDeviceGetTotalEnergyConsumption(h))
            except nv.NVMLError_NotSupported:
                self._said_integrating.add(gpu)
                if self._log is not None:
                    self._log.warning("energy counter unsupported; integrating power over time", gpu=gpu)
        now = time.monotonic()
        power_mw = nv.nvmlDeviceGetPowerUsage(h)
        total, last = self._integrated.get(gpu, (0.0, now))
        total += power_mw * (now - last)  # mW x s = mJ; rectangle rule at the sampling rate
        self._integrated[gpu] = (total, now)
        return total

    def sample(self, gpu: int) -> Sample:
        nv, h = self._nv, self._h(gpu)

        def opt(fn: Callable[[], Any], default: Any = float("nan")) -> Any:
            # A board may not support one metric; the rest of the sample is still worth keeping.
            try:
                return fn()
            except nv.NVMLError:
                return default

        energy = self.energy_mj(gpu)
        util = opt(lambda: nv.nvmlDeviceGetUtilizationRates(h), None)
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return Sample(
            ts=time.time(),
            gpu=gpu,
            power_w=opt(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            energy_mj=energy,
            energy_source="integrated" if gpu in self._said_integrating else "counter",
            sm_mhz=opt(lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
            mem_mhz=opt(lambda: float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM))),
            temp_c=opt(lambda: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            util_gpu=float(util.gpu) if util is not None else float("nan"),
            util_mem=float(util.memory) if util is not None else float("nan"),
            limit_w=opt(lambda: self.limit_w(gpu)),
            throttle=decode_throttle(opt(lambda: int(get_reasons(h)), 0), self._throttle),
        )

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:
            pass


def open_device(backend: str, log: Any, simulated_gpus: int = 1, clock: Callable[[], float] = time.time,
                simulated_faults: str | None = None) -> Device | None:
    """The device for a `telemetry.backend` setting, or None (said once, here) when there is none."""
    if backend == "off":
        return None
    if backend == "simulated":
        from daemon.power.simulated import SimulatedDevice

        log.warning("telemetry backend is SIMULATED: power figures come from a model, not a GPU", gpus=simulated_gpus)
        return SimulatedDevice(simulated_gpus, clock=clock, wall=clock, faults_file=simulated_faults)
    try:
        dev = NvmlDevice(log)
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.warning("telemetry unavailable", reason=f"{type(e).__name__}: {e}")
        return None
    if dev.count() == 0:
        log.warning("telemetry unavailable", reason="NVML reports no GPUs")
        dev.close()
        return None
    return dev


class TelemetrySampler:
    """Samples every GPU of a device every `interval_s` on its own thread and hands rows to `sink`.

    `sample_once()` is the whole job; the thread only repeats it, so tests call it directly.
    """

    def __init__(self, device: Device, sink: Callable[[list[Sample]], None], interval_s: float, log: Any):
        self.device, self.sink, self.interval_s, self.log = device, sink, interval_s, log
        self.latest: dict[int, Sample] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def sample_once(self) -> list[Sample]:
        rows = []
        for gpu in range(self.device.count()):
            try:
                rows.append(self.device.sample(gpu))
            except Exception as e:  # a hung or lost GPU must not stop the sampler or the daemon
                if not self._failing:
                    self.log.warning("telemetry sample failed", gpu=gpu, error=str(e))
                self._failing = True
                continue
        for s in rows:
            self.latest[s.gpu] = s
        if rows:
            self._failing = False
            self.sink(rows)
        return rows

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lorad-power-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception as e:  # the sink (SQLite) failing is reported, never fatal
                self.log.warning("telemetry write failed", error=str(e))
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
