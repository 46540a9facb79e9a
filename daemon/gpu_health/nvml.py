"""Health readings from NVML: an event set for Xid critical errors, the ECC counters, row remaps, the processes
holding memory, and the clock-event reasons.

A GPU that answers NVML_ERROR_GPU_IS_LOST is lost; any other NVML error on the calls every board supports is an
unknown error. After either, NVML is started again before the next reading (a driver reload makes old handles
useless), so a GPU brought back by an admin is seen without restarting the daemon; a GPU whose handle cannot be
had is lost (or in error) alone, the others read on. Calls a board does not support (no ECC, no row remapping)
are skipped, not faults. Never run on a GPU yet: tests run it through the real pynvml on a stand-in for the
driver's library at its C ABI (tests/helpers/nvml_lib.py).
"""

from __future__ import annotations

import ctypes
from typing import Any

from daemon.gpu_health.reading import Reading


class NvmlHealth:
    """Raises at construction when NVML cannot be initialised (the daemon then runs without health readings)."""

    def __init__(self):
        import pynvml  # lazy: the daemon imports without nvidia-ml-py being usable

        from daemon.power.telemetry import _throttle_names

        self._nv = pynvml
        self._throttle = _throttle_names(pynvml)
        self._events: Any = None
        self._handles: list[Any] = []
        self._xids: dict[int, list[int]] = {}
        self._stale = True
        self._inited = False
        self._start()
        self._count = len(self._handles)

    def _start(self) -> None:
        nv = self._nv
        if self._events is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except nv.NVMLError:
                pass
            self._events = None
        if self._inited:
            # Only our own nvmlInit is undone: NVML counts them, and telemetry (daemon/power/telemetry.py) holds one
            # in the same process; shutting NVML down under it would stop its readings.
            self._inited = False
            try:
                nv.nvmlShutdown()
            except nv.NVMLError:  # the driver went away
                pass
        nv.nvmlInit()
        self._inited = True
        self._events = nv.nvmlEventSetCreate()
        self._handles = []
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except nv.NVMLError:  # this GPU is lost or failing: its readings say so
                h = None
            if h is not None:
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
                except nv.NVMLError:  # not supported on this board: no Xid events from it
                    pass
            self._handles.append(h)
        self._stale = False

    def count(self) -> int:
        return self._count

    def _drain_events(self) -> None:
        nv = self._nv
        while True:
            try:
                ev = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                return
            gpu = self._index_of(ev.device)
            if gpu is not None:
                self._xids.setdefault(gpu, []).append(int(ev.eventData))

    def _index_of(self, device: Any) -> int | None:
        """The index of an event's GPU. A GPU that fell off the bus (its last Xid is often 79) may answer
        nvmlDeviceGetIndex with GPU_IS_LOST too: it is then found among our handles, so that its event neither
        goes missing nor makes the GPU being read look lost."""
        nv = self._nv
        try:
            return int(nv.nvmlDeviceGetIndex(device))
        except nv.NVMLError:
            pass
        addr = ctypes.cast(device, ctypes.c_void_p).value
        for i, h in enumerate(self._handles):
            if h is not None and ctypes.cast(h, ctypes.c_void_p).value == addr:
                return i
        return None

    def health_reading(self, gpu: int) -> Reading:
        nv = self._nv
        r = Reading(gpu=gpu)
        try:
            if self._stale:
                self._start()
            self._drain_events()
            r.xids = self._xids.pop(gpu, [])
            h = self._handles[gpu] if gpu < len(self._handles) else None
            if h is None:
                h = nv.nvmlDeviceGetHandleByIndex(gpu)  # raises what is wrong with it
                self._stale = True  # it answers again: start over, with its events registered
            r.memory_total = int(nv.nvmlDeviceGetMemoryInfo(h).total)
            r.processes = [(int(p.pid), int(p.usedGpuMemory or 0))
                           for p in nv.nvmlDeviceGetComputeRunningProcesses(h)]
            r.ecc_uncorrected = _optional(nv, lambda: int(nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)))
            remap = _optional(nv, lambda: nv.nvmlDeviceGetRemappedRows(h))
            if remap is not None:
                r.pending_remap, r.remap_failed = bool(remap[2]), bool(remap[3])
            else:  # boards before Ampere retire pages instead
                pending = _optional(nv, lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
                r.pending_remap = pending == nv.NVML_FEATURE_ENABLED
            get = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            mask = _optional(nv, lambda: int(get(h))) or 0
            from daemon.power.telemetry import decode_throttle

            r.throttle = decode_throttle(mask, self._throttle)
            return r
        except nv.NVMLError as e:
            self._stale = True
            xids = r.xids + self._xids.pop(gpu, [])  # with the fault they came with, never after it is back
            if getattr(e, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                return Reading(gpu=gpu, lost=True, xids=xids)
            return Reading(gpu=gpu, error=str(e), xids=xids)

    def close(self) -> None:
        try:
            if self._events is not None:
                self._nv.nvmlEventSetFree(self._events)
                self._events = None
            if self._inited:
                self._inited = False
                self._nv.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _optional(nv: Any, fn) -> Any:
    try:
        return fn()
    except nv.NVMLError_NotSupported:
        return None
