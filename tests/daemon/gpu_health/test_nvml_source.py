"""The NVML health source against a stand-in pynvml (this machine has no driver): Xid events go to their GPU, a
lost GPU is lost alone, a GPU brought back is read again without a restart, unsupported counters are no fault."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from daemon.gpu_health import verdict as vd
from daemon.gpu_health.nvml import NvmlHealth
from daemon.gpu_health.watcher import HealthWatcher
from tests.helpers.fakes import Clock, RecLog


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(n: int):
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVMLError_Timeout = type("NVMLError_Timeout", (NVMLError,), {})
    nv.NVMLError_NotSupported = type("NVMLError_NotSupported", (NVMLError,), {})
    nv.NVML_ERROR_GPU_IS_LOST, nv.NVML_ERROR_UNKNOWN = 15, 999
    nv.nvmlEventTypeXidCriticalError, nv.NVML_FEATURE_ENABLED = 8, 1
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC = 1, 0
    nv.nvmlClocksEventReasonHwThermalSlowdown = 0x40
    nv.lost, nv.events, nv.inits = set(), [], 0

    def handle(i):
        if i in nv.lost:
            raise NVMLError(15)
        return SimpleNamespace(i=i)

    def checked(fn):
        def call(h, *a):
            if h.i in nv.lost:
                raise NVMLError(15)
            return fn(h, *a)
        return call

    def wait(es, timeout_ms):
        if not nv.events:
            raise nv.NVMLError_Timeout(10)
        gpu, xid = nv.events.pop(0)
        return SimpleNamespace(device=SimpleNamespace(i=gpu), eventData=xid)

    def unsupported(h, *a):
        raise nv.NVMLError_NotSupported(3)

    nv.nvmlInit = lambda: setattr(nv, "inits", nv.inits + 1)
    nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetCount = lambda: n
    nv.nvmlDeviceGetHandleByIndex = handle
    nv.nvmlEventSetCreate = lambda: object()
    nv.nvmlEventSetFree = lambda es: None
    nv.nvmlDeviceRegisterEvents = lambda h, t, es: None
    nv.nvmlEventSetWait_v2 = wait
    nv.nvmlDeviceGetIndex = lambda h: h.i
    nv.nvmlDeviceGetMemoryInfo = checked(lambda h: SimpleNamespace(total=24 << 30))
    nv.nvmlDeviceGetComputeRunningProcesses = checked(lambda h: [SimpleNamespace(pid=1 << 22, usedGpuMemory=2 << 30)])
    nv.nvmlDeviceGetTotalEccErrors = checked(lambda h, t, c: 0)
    nv.nvmlDeviceGetRemappedRows = unsupported  # a board before Ampere ...
    nv.nvmlDeviceGetRetiredPagesPendingStatus = checked(lambda h: 0)  # ... retires pages
    nv.nvmlDeviceGetCurrentClocksEventReasons = checked(lambda h: 0x40 if h.i == 1 else 0)
    return nv


@pytest.fixture
def nv(monkeypatch):
    fake = fake_pynvml(2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_nvml_readings_map_xids_to_their_gpu_and_a_lost_gpu_is_lost_alone(nv):
    src = NvmlHealth()
    clock = Clock()
    w = HealthWatcher(src, [0, 1], vd.Rules(recover_s=1.0), 1.0, RecLog(), clock=clock)
    w.poll_once()
    assert w.usable(0) and w.usable(1)
    assert w.verdict(1).view()["slowdown"] == ["thermal"] and w.verdict(0).view()["foreign_gb"] == 2.0
    nv.events.append((1, 79))
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.after, ch.reason) == (1, vd.QUARANTINED, "Xid 79") and w.usable(0)

    nv.lost.add(0)
    (ch,) = w.poll_once([0])
    assert (ch.gpu, ch.after, w.verdict(0).lost) == (0, vd.QUARANTINED, True)
    inits = nv.inits
    assert w.poll_once([1]) == [] and w.verdict(1).state == vd.QUARANTINED  # GPU 1 reads on (Xid: not lost)
    assert nv.inits > inits  # NVML was started again after the loss

    nv.lost.clear()  # the driver is reloaded
    w.poll_once()
    clock.t += 1.0
    changes = w.poll_once()
    assert {(c.gpu, c.after) for c in changes} == {(0, vd.OK), (1, vd.OK)}
