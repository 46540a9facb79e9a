"""libnvidia-ml.so.1 at its C ABI, in Python, for the real pynvml (nvidia-ml-py) to call on a machine without a driver.

lorad's NVML readers (daemon/gpu_health/nvml.py, daemon/power/telemetry.py) call pynvml; pynvml calls the driver's
library through ctypes (`pynvml.nvmlLib`, one function pointer per C symbol). `installed()` puts a FakeNvml there:
each C function is a ctypes callback with nvml.h's signature that writes its results through the pointers pynvml
passes, and returns nvml.h's status codes (as numbers, never pynvml's names). So pynvml's own code runs for real:
the symbols it looks up (a missing one is NVMLError_FunctionNotFound), its structs and out-parameters, the
two-call dance of the process list, the mapping of a status to an NVMLError subclass. What lorad reads from the
results (attribute names, tuple shapes, exception classes, constants) is what a real driver would give it.

Its GPUs follow the driver's rules that the readers depend on: nvmlInit/nvmlShutdown are counted (a call while
the count is 0 is NVML_ERROR_UNINITIALIZED); an event set delivers only the Xids raised after a GPU was
registered in it; a lost GPU answers NVML_ERROR_GPU_IS_LOST to every call, its handle included.
"""

from __future__ import annotations

import ctypes as C
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

# nvml.h's nvmlReturn_t
SUCCESS, UNINITIALIZED, INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION = 0, 1, 2, 3, 4
INSUFFICIENT_SIZE, TIMEOUT, GPU_IS_LOST, UNKNOWN = 7, 10, 15, 999
XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC = 1, 0
CLOCK_SM, CLOCK_MEM, TEMPERATURE_GPU = 1, 2, 0
HANDLE_BASE, SET_BASE = 0x7F0000, 0x7E0000  # opaque pointers: never dereferenced, by the driver's contract
P = C.c_void_p


@dataclass
class FakeGpu:
    index: int
    name: bytes = b"NVIDIA Fake 24GB"
    lost: bool = False
    failing: int = SUCCESS  # another status every call about it returns (UNKNOWN: the driver cannot say why)
    total: int = 24 << 30
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, bytes)
    ecc_uncorrected: int | None = 0  # None: the board has no ECC
    remap: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corrected, uncorrected, pending, failed; None: no remapping
    pages_pending: bool = False
    reasons: int = 0  # clock-event reasons mask
    power_mw: int = 250_000
    energy_mj: int | None = 1_000_000  # None: the board has no energy counter
    limit_mw: int = 300_000


def c(*argtypes):
    """Marks a method as the C function of its name with these argument types (it returns nvmlReturn_t)."""
    def mark(fn):
        fn.c_argtypes = argtypes
        return fn
    return mark


def out(ptr: int, ctype, value) -> None:
    C.cast(ptr, C.POINTER(ctype))[0] = value


class FakeNvml:
    def __init__(self, n: int = 2):
        self.gpus = [FakeGpu(i) for i in range(n)]
        self.inits = 0  # the driver's count of nvmlInit calls not yet shut down
        self.init_calls = 0
        self.sets: dict[int, dict] = {}  # event set → {"gpus": registered, "events": [(gpu, xid)]}
        self.root = False
        self.errors: list[str] = []  # a callback that raised (ctypes would only print it): the test fails
        self.lib = SimpleNamespace()
        for name in dir(type(self)):
            fn = getattr(type(self), name)
            if hasattr(fn, "c_argtypes"):
                setattr(self.lib, name, C.CFUNCTYPE(C.c_int, *fn.c_argtypes)(self._guard(getattr(self, name))))

    def _guard(self, fn):
        def call(*args):
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 — reported through self.errors
                self.errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")
                return UNKNOWN
        return call

    def raise_xid(self, gpu: int, xid: int) -> None:
        """The driver reports an Xid on `gpu`: every event set it is registered in gets it."""
        for s in self.sets.values():
            if gpu in s["gpus"]:
                s["events"].append((gpu, xid))

    def _gpu(self, handle: int | None) -> tuple[FakeGpu | None, int]:
        if not self.inits:
            return None, UNINITIALIZED
        i = (handle or 0) - HANDLE_BASE
        if handle is None or not 0 <= i < len(self.gpus) * 16 or i % 16:
            return None, INVALID_ARGUMENT
        g = self.gpus[i // 16]
        if g.lost or g.failing:
            return None, GPU_IS_LOST if g.lost else g.failing
        return g, SUCCESS

    # ---------------------------------------------------------------- the library
    @c(C.c_uint)
    def nvmlInitWithFlags(self, flags):
        self.inits += 1
        self.init_calls += 1
        return SUCCESS

    @c()
    def nvmlShutdown(self):
        if not self.inits:
            return UNINITIALIZED
        self.inits -= 1
        if not self.inits:
            self.sets.clear()  # the driver frees what this client had
        return SUCCESS

    @c(P)
    def nvmlDeviceGetCount_v2(self, count):
        if not self.inits:
            return UNINITIALIZED
        out(count, C.c_uint, len(self.gpus))
        return SUCCESS

    @c(C.c_uint, P)
    def nvmlDeviceGetHandleByIndex_v2(self, index, device):
        if not self.inits:
            return UNINITIALIZED
        if index >= len(self.gpus):
            return INVALID_ARGUMENT
        if self.gpus[index].lost:
            return GPU_IS_LOST
        out(device, P, HANDLE_BASE + 16 * index)
        return SUCCESS

    @c(P, P)
    def nvmlDeviceGetIndex(self, device, index):
        g, rc = self._gpu(device)
        if g is not None:
            out(index, C.c_uint, g.index)
        return rc

    # ---------------------------------------------------------------- events
    @c(P)
    def nvmlEventSetCreate(self, es):
        if not self.inits:
            return UNINITIALIZED
        addr = SET_BASE + 16 * (len(self.sets) + 1)
        self.sets[addr] = {"gpus": set(), "events": []}
        out(es, P, addr)
        return SUCCESS

    @c(P, C.c_ulonglong, P)
    def nvmlDeviceRegisterEvents(self, device, types, es):
        g, rc = self._gpu(device)
        if g is None:
            return rc
        if es not in self.sets or types & ~XID_CRITICAL_ERROR:
            return INVALID_ARGUMENT  # this fake only knows Xid events
        self.sets[es]["gpus"].add(g.index)
        return SUCCESS

    @c(P, P, C.c_uint)
    def nvmlEventSetWait_v2(self, es, data, timeout_ms):
        if es not in self.sets:
            return INVALID_ARGUMENT
        if not self.sets[es]["events"]:
            return TIMEOUT
        gpu, xid = self.sets[es]["events"].pop(0)
        ev = C.cast(data, C.POINTER(pynvml.c_nvmlEventData_t))[0]
        ev.device = C.cast(HANDLE_BASE + 16 * gpu, pynvml.c_nvmlDevice_t)
        ev.eventType, ev.eventData = XID_CRITICAL_ERROR, xid
        return SUCCESS

    @c(P)
    def nvmlEventSetFree(self, es):
        return SUCCESS if self.sets.pop(es, None) is not None else INVALID_ARGUMENT

    # ---------------------------------------------------------------- health
    @c(P, P)
    def nvmlDeviceGetMemoryInfo(self, device, memory):
        g, rc = self._gpu(device)
        if g is not None:
            m = C.cast(memory, C.POINTER(pynvml.c_nvmlMemory_t))[0]
            used = sum(b for _, b in g.processes)
            m.total, m.used, m.free = g.total, used, g.total - used
        return rc

    @c(P, P, P)
    def nvmlDeviceGetComputeRunningProcesses_v3(self, device, count, infos):
        g, rc = self._gpu(device)
        if g is None:
            return rc
        have = C.cast(count, C.POINTER(C.c_uint))[0]
        out(count, C.c_uint, len(g.processes))
        if not g.processes:
            return SUCCESS
        if infos is None or have < len(g.processes):
            return INSUFFICIENT_SIZE
        arr = C.cast(infos, C.POINTER(pynvml.c_nvmlProcessInfo_v3_t))
        for i, (pid, used) in enumerate(g.processes):
            arr[i].pid, arr[i].usedGpuMemory = pid, used
        return SUCCESS

    @c(P, C.c_uint, C.c_uint, P)
    def nvmlDeviceGetTotalEccErrors(self, device, error_type, counter_type, count):
        g, rc = self._gpu(device)
        if g is not None:
            if (error_type, counter_type) != (MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC):
                return INVALID_ARGUMENT  # lorad asks for volatile uncorrected errors alone
            if g.ecc_uncorrected is None:
                return NOT_SUPPORTED
            out(count, C.c_ulonglong, g.ecc_uncorrected)
        return rc

    @c(P, P, P, P, P)
    def nvmlDeviceGetRemappedRows(self, device, corr, unc, pending, failed):
        g, rc = self._gpu(device)
        if g is None:
            return rc
        if g.remap is None:
            return NOT_SUPPORTED
        for ptr, v in zip((corr, unc, pending, failed), g.remap, strict=True):
            out(ptr, C.c_uint, v)
        return SUCCESS

    @c(P, P)
    def nvmlDeviceGetRetiredPagesPendingStatus(self, device, pending):
        g, rc = self._gpu(device)
        if g is not None:
            out(pending, C.c_uint, int(g.pages_pending))
        return rc

    @c(P, P)
    def nvmlDeviceGetCurrentClocksEventReasons(self, device, reasons):
        g, rc = self._gpu(device)
        if g is not None:
            out(reasons, C.c_ulonglong, g.reasons)
        return rc

    # ---------------------------------------------------------------- telemetry and caps
    @c(P, P, C.c_uint)
    def nvmlDeviceGetName(self, device, name, length):
        g, rc = self._gpu(device)
        if g is not None:
            C.memmove(name, g.name + b"\0", min(length, len(g.name) + 1))
        return rc

    def _uint(self, device, ptr, attr) -> int:
        g, rc = self._gpu(device)
        if g is not None:
            out(ptr, C.c_uint, getattr(g, attr))
        return rc

    @c(P, P, P)
    def nvmlDeviceGetPowerManagementLimitConstraints(self, device, lo, hi):
        g, rc = self._gpu(device)
        if g is not None:
            out(lo, C.c_uint, 100_000)
            out(hi, C.c_uint, 400_000)
        return rc

    @c(P, P)
    def nvmlDeviceGetPowerManagementDefaultLimit(self, device, limit):
        g, rc = self._gpu(device)
        if g is not None:
            out(limit, C.c_uint, 300_000)
        return rc

    @c(P, P)
    def nvmlDeviceGetEnforcedPowerLimit(self, device, limit):
        return self._uint(device, limit, "limit_mw")

    @c(P, C.c_uint)
    def nvmlDeviceSetPowerManagementLimit(self, device, limit):
        g, rc = self._gpu(device)
        if g is None:
            return rc
        if not self.root:
            return NO_PERMISSION
        if not 100_000 <= limit <= 400_000:
            return INVALID_ARGUMENT
        g.limit_mw = limit
        return SUCCESS

    @c(P, P)
    def nvmlDeviceGetPowerUsage(self, device, power):
        return self._uint(device, power, "power_mw")

    @c(P, P)
    def nvmlDeviceGetTotalEnergyConsumption(self, device, energy):
        g, rc = self._gpu(device)
        if g is None:
            return rc
        if g.energy_mj is None:
            return NOT_SUPPORTED
        out(energy, C.c_ulonglong, g.energy_mj)
        return SUCCESS

    @c(P, C.c_uint, P)
    def nvmlDeviceGetClockInfo(self, device, kind, mhz):
        g, rc = self._gpu(device)
        if g is not None:
            out(mhz, C.c_uint, {CLOCK_SM: 1800, CLOCK_MEM: 9501}.get(kind, 0))
        return rc

    @c(P, C.c_uint, P)
    def nvmlDeviceGetTemperature(self, device, sensor, temp):
        g, rc = self._gpu(device)
        if g is not None:
            if sensor != TEMPERATURE_GPU:
                return INVALID_ARGUMENT
            out(temp, C.c_uint, 64)
        return rc

    @c(P, P)
    def nvmlDeviceGetUtilizationRates(self, device, util):
        g, rc = self._gpu(device)
        if g is not None:
            u = C.cast(util, C.POINTER(pynvml.c_nvmlUtilization_t))[0]
            u.gpu, u.memory = 97, 41
        return rc


@contextmanager
def installed(n: int = 2) -> Iterator[FakeNvml]:
    """The real pynvml module, loaded with a FakeNvml of `n` GPUs instead of libnvidia-ml.so.1."""
    fake = FakeNvml(n)
    saved = pynvml.nvmlLib, dict(pynvml._nvmlGetFunctionPointer_cache), pynvml._nvmlLib_refcount
    pynvml.nvmlLib = fake.lib
    pynvml._nvmlGetFunctionPointer_cache.clear()  # cached pointers into another library
    try:
        yield fake
    finally:
        pynvml.nvmlLib, pynvml._nvmlLib_refcount = saved[0], saved[2]
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlGetFunctionPointer_cache.update(saved[1])
    assert not fake.errors, fake.errors
