"""The NVML health source through the real pynvml (nvidia-ml-py), on a stand-in for the driver's library at its C
ABI (tests/helpers/nvml_lib.py): pynvml's own wrappers run, so the symbols, structs, out-parameters, status codes and
exception classes the reader relies on are those of the nvidia-ml-py that requirements.lock pins.

Xid events go to their GPU and only those raised after registration arrive; a lost GPU is lost alone and read
again without a restart (its events registered again); ECC, row remaps, retired pages, other programs' memory and
slowdowns are read; unsupported counters are no fault; NVML's init count is kept balanced with telemetry's.
"""

from __future__ import annotations

import pytest

from daemon.gpu_health import verdict as vd
from daemon.gpu_health.nvml import NvmlHealth
from daemon.gpu_health.watcher import HealthWatcher
from daemon.power.telemetry import NvmlDevice
from tests.helpers.fakes import Clock, RecLog
from tests.helpers.nvml_lib import installed

FOREIGN = 1 << 22  # a pid no process of ours has
HW_THERMAL_SLOWDOWN = 0x40  # nvml.h's nvmlClocksEventReasonHwThermalSlowdown


@pytest.fixture
def nv():
    with installed(2) as fake:
        yield fake


def test_xid_events_reach_their_gpu_and_a_gpu_lost_is_lost_alone_and_taken_back_without_a_restart(nv):
    nv.gpus[1].processes = [(FOREIGN, 2 << 30)]
    nv.gpus[1].reasons = HW_THERMAL_SLOWDOWN
    nv.raise_xid(1, 79)  # before the daemon started: no event set had GPU 1 yet, so it is never delivered
    src = NvmlHealth()
    clock = Clock()
    w = HealthWatcher(src, [0, 1], vd.Rules(recover_s=1.0), 1.0, RecLog(), clock=clock)
    w.poll_once()
    assert w.usable(0) and w.usable(1)
    v1 = w.verdict(1).view()
    assert v1["slowdown"] == ["thermal"] and v1["foreign_gb"] == 2.0 and v1["memory_total_gb"] == 24.0
    nv.raise_xid(1, 79)
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.after, ch.reason) == (1, vd.QUARANTINED, "Xid 79") and w.usable(0)

    nv.gpus[0].lost = True  # NVML_ERROR_GPU_IS_LOST from every call, its handle's too
    (ch,) = w.poll_once([0])
    assert (ch.gpu, ch.after, w.verdict(0).lost) == (0, vd.QUARANTINED, True)
    starts = nv.init_calls
    assert w.poll_once([1]) == [] and w.verdict(1).state == vd.QUARANTINED  # GPU 1 reads on (an Xid: not lost)
    assert nv.init_calls > starts  # NVML was started again after the loss
    w.poll_once([0])
    assert w.verdict(0).lost  # still lost: its handle cannot be had

    nv.gpus[0].lost = False  # the driver is reloaded
    w.poll_once()
    clock.t += 1.0
    assert {(c.gpu, c.after) for c in w.poll_once()} == {(0, vd.OK), (1, vd.OK)}
    nv.raise_xid(0, 48)  # GPU 0 is in the new event set: its Xids arrive again
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.after, ch.reason) == (0, vd.QUARANTINED, "Xid 48")
    src.close()
    assert nv.inits == 0 and not nv.sets


def test_ecc_row_remaps_retired_pages_and_unknown_errors_are_read_and_counters_a_board_lacks_are_no_fault(nv):
    src = NvmlHealth()
    nv.gpus[0].ecc_uncorrected, nv.gpus[0].remap = 3, (0, 1, 1, 0)
    r = src.health_reading(0)
    assert (r.ecc_uncorrected, r.pending_remap, r.remap_failed, r.error, r.lost) == (3, True, False, None, False)
    nv.gpus[0].remap = (0, 1, 0, 1)
    assert src.health_reading(0).remap_failed
    # A board before Ampere: no row remapping, pages retired instead; no ECC at all (a GeForce card).
    nv.gpus[1].remap, nv.gpus[1].ecc_uncorrected, nv.gpus[1].pages_pending = None, None, True
    r = src.health_reading(1)
    assert (r.ecc_uncorrected, r.pending_remap, r.remap_failed, r.error) == (None, True, False, None)
    nv.gpus[1].pages_pending = False
    assert not src.health_reading(1).pending_remap
    nv.gpus[1].failing = 999  # NVML_ERROR_UNKNOWN: an unknown error, not a lost GPU
    r = src.health_reading(1)
    assert (r.error, r.lost) == ("Unknown Error", False)
    nv.gpus[1].failing = 0
    assert src.health_reading(1).error is None  # read again (NVML started again after the error)
    src.close()


def test_the_health_reader_and_telemetry_share_nvml_and_neither_shuts_it_down_under_the_other(nv):
    telemetry = NvmlDevice(RecLog())
    src = NvmlHealth()
    assert nv.inits == 2  # one each: NVML counts its nvmlInit calls
    nv.gpus[0].lost = True
    src.health_reading(0)
    nv.gpus[0].lost = False
    assert src.health_reading(0).lost is False and nv.inits == 2  # started again: its own init, not telemetry's
    src.close()
    assert nv.inits == 1 and telemetry.sample(0).power_w == 250.0  # telemetry reads on
    telemetry.close()
    assert nv.inits == 0


def test_the_daemon_reads_nvml_for_the_gpus_the_driver_has_and_a_quarantine_follows_a_lost_one(nv):
    from daemon.config.daemon import DaemonConfig
    from daemon.gpu_health.watcher import open_watcher

    w = open_watcher(DaemonConfig(), None, [0, 1, 2], None, RecLog())  # the default backend: nvml
    assert [v["gpu"] for v in w.views()] == [0, 1]  # no GPU 2 on this machine
    w.poll_once()
    nv.gpus[1].lost = True
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.after, ch.fatal, w.usable(0)) == (1, vd.QUARANTINED, True, True)
    w.source.close()


def test_a_gpu_lost_after_its_xid_79_is_quarantined_with_it_and_the_gpu_read_before_it_stays_in_service(nv):
    """NVML may answer nvmlDeviceGetIndex for a GPU that fell off the bus with GPU_IS_LOST: its pending Xid must
    neither make the GPU being read look lost nor wait to quarantine the GPU again once it is back."""
    src = NvmlHealth()
    clock = Clock()
    w = HealthWatcher(src, [0, 1], vd.Rules(recover_s=1.0), 1.0, RecLog(), clock=clock)
    w.poll_once()
    nv.raise_xid(1, 79)
    nv.gpus[1].lost = True
    (ch,) = w.poll_once()  # GPU 0 is read first, and drains the event set
    assert (ch.gpu, ch.after, ch.reason) == (1, vd.QUARANTINED, "GPU lost (fell off the bus); Xid 79") and w.usable(0)
    nv.gpus[1].lost = False
    w.poll_once()
    clock.t += 1.0
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.after) == (1, vd.OK)
    clock.t += 1.0
    assert w.poll_once() == [] and w.usable(1)  # no Xid left over to take it out again
    src.close()
