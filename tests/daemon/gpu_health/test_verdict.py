"""GPU health verdicts from the simulated device's faults: quarantine, taking a GPU back, holding it, clearing it.

The watcher is driven by hand (`poll_once`) against a SimulatedDevice with injected faults and a fake clock: the
same readings the daemon's watcher thread gets, without a thread or a daemon.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon.gpu_health import verdict as vd
from daemon.gpu_health.reading import slowdown
from daemon.gpu_health.watcher import HealthWatcher, our_pids
from daemon.power.simulated import FOREIGN_PID, SimulatedDevice
from tests.helpers.fakes import Clock, RecLog

RULES = vd.Rules(recover_s=5.0, max_faults=3, fault_window_s=60.0)


def watcher(n: int = 2, **kw) -> tuple[SimulatedDevice, HealthWatcher, Clock]:
    clock = Clock()
    dev = SimulatedDevice(n, clock=clock, wall=clock, **kw)
    return dev, HealthWatcher(dev, list(range(n)), RULES, 1.0, RecLog(), clock=clock), clock


def state(w: HealthWatcher, gpu: int) -> str:
    return w.verdict(gpu).state


def test_gpu_lost_is_quarantined_at_once_and_taken_back_after_reading_clean_for_recover_s():
    dev, w, clock = watcher()
    w.poll_once()
    assert state(w, 0) == state(w, 1) == vd.OK
    dev.inject(0, lost=True)
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.before, ch.after, ch.fatal) == (0, vd.OK, vd.QUARANTINED, True)
    assert not w.usable(0) and w.usable(1) and w.verdict(0).view()["lost"]
    with pytest.raises(RuntimeError, match="lost"):  # its telemetry fails too, as NVML's does
        dev.sample(0)
    clock.t += 100
    assert w.poll_once() == [] and state(w, 0) == vd.QUARANTINED  # still lost: no time counts
    dev.inject(0)  # the driver is reloaded
    w.poll_once()
    clock.t += RULES.recover_s - 1
    w.poll_once()
    assert state(w, 0) == vd.QUARANTINED
    clock.t += 1
    (ch,) = w.poll_once()
    assert (ch.after, w.usable(0), w.verdict(0).fatal) == (vd.OK, True, False)


def test_xid_storm_holds_the_gpu_until_lorad_gpu_clear():
    dev, w, clock = watcher()
    dev.inject(1, xid=[79, 79, 79])
    (ch,) = w.poll_once()
    assert (ch.gpu, ch.after) == (1, vd.HELD) and "Xid 79" in ch.reason
    assert w.held() == {1: ch.reason} and state(w, 0) == vd.OK
    clock.t += 10 * RULES.recover_s
    w.poll_once()
    assert state(w, 1) == vd.HELD  # clean readings do not bring a held GPU back
    (ch,) = [w.clear(1)]
    assert ch.after == vd.OK and w.usable(1) and w.held() == {}
    assert w.poll_once() == []  # the Xids already delivered are not seen again


def test_application_xids_are_noted_and_the_gpu_stays_in_service():
    dev, w, _ = watcher(1)
    dev.inject(0, xid=[13, 31, 43])
    assert w.poll_once() == [] and w.usable(0)
    assert any("Xid 31" in n for n in w.verdict(0).notes)


@pytest.mark.parametrize("fault, fatal", [
    ({"ecc_uncorrected": 2}, False),
    ({"pending_remap": True}, False),
    ({"remap_failed": True}, False),
    ({"error": "NVML_ERROR_UNKNOWN"}, True),
    ({"xid": [48]}, True),
])
def test_each_fatal_fault_quarantines_the_gpu(fault, fatal):
    dev, w, _ = watcher(1)
    w.poll_once()  # the ECC baseline
    dev.inject(0, **fault)
    (ch,) = w.poll_once()
    assert ch.after == vd.QUARANTINED and ch.fatal is fatal


def test_a_pending_remap_keeps_the_gpu_out_until_a_reset_and_clear_does_not_override_it():
    dev, w, clock = watcher(1)
    dev.inject(0, pending_remap=True)
    w.poll_once()
    clock.t += 100
    w.poll_once()
    assert state(w, 0) == vd.QUARANTINED
    w.clear(0)
    assert state(w, 0) == vd.QUARANTINED and "reset" in w.verdict(0).reason


def test_repeated_faults_within_the_window_hold_the_gpu_and_old_ones_are_forgotten():
    dev, w, clock = watcher(1)
    for _ in range(2):  # two faults, each followed by a recovery
        dev.inject(0, lost=True)
        w.poll_once()
        dev.inject(0)
        w.poll_once()
        clock.t += RULES.recover_s
        w.poll_once()
        assert state(w, 0) == vd.OK
    clock.t += RULES.fault_window_s  # the window passes: those two no longer count
    for fault in ({"lost": True}, {}, {"lost": True}, {}, {"error": "again"}):  # three onsets, close together
        dev.inject(0)
        dev.inject(0, **fault)
        w.poll_once()
    assert state(w, 0) == vd.HELD and len(w.verdict(0).faults) == 3


def test_foreign_vram_slowdown_and_held_gpus_are_read_and_remembered(tmp_path: Path):
    dev, w, _ = watcher(2)
    dev.inject(0, foreign_mib=6144, throttle=["hw_thermal_slowdown", "hw_slowdown"])
    w.poll_once()
    v = w.verdict(0).view()
    assert (v["foreign_gb"], v["free_gb"], v["memory_total_gb"], v["foreign_processes"]) == (6.0, 18.0, 24.0, 1)
    assert v["slowdown"] == ["thermal", "hardware"] and w.verdict(1).view()["slowdown"] == []
    assert slowdown(["sw_power_cap"]) == []  # a cap is asked for, not a slowdown of the GPU's own
    # Memory our own trainers hold is not "foreign": their processes are in our trainers' process groups.
    assert our_pids({os.getpgid(0)}, [os.getpid(), FOREIGN_PID]) == {os.getpid()}
    w.groups = lambda: {os.getpgid(0)}
    w.poll_once()
    assert w.verdict(0).foreign == [(FOREIGN_PID, 6144 << 20)]
    # A GPU held before a restart is held after it.
    again = HealthWatcher(dev, [0, 1], RULES, 1.0, RecLog(), held={1: "Xid 79"})
    assert again.verdict(1).state == vd.HELD and again.held() == {1: "Xid 79"}


def test_the_faults_file_drives_a_simulated_device_in_another_process(tmp_path: Path):
    faults = tmp_path / "faults.json"
    dev, w, _ = watcher(2, faults_file=faults)
    w.poll_once()
    assert w.usable(0) and w.usable(1)
    faults.write_text(json.dumps({"1": {"xid": [79]}, "0": {"foreign_mib": 2048}}))
    (ch,) = w.poll_once()
    assert ch.gpu == 1 and ch.after == vd.QUARANTINED and w.verdict(0).foreign_bytes() == 2048 << 20
    faults.write_text(json.dumps({"1": {"xid": [79]}}) + " ")  # the same Xid list: nothing new
    assert w.poll_once() == []
    with pytest.raises(ValueError, match="unknown simulated faults"):
        dev.inject(0, melted=True)


def test_a_restarted_daemon_is_not_delivered_the_xids_raised_before_it_as_nvml_event_sets_are_not(tmp_path: Path):
    # The faults file a power cut left behind: three Xids the daemon before the cut saw and acted on.
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"0": {"xid": [79, 79, 79]}}))
    _, w, _ = watcher(1, faults_file=faults)  # the new daemon's device registers for events now
    assert w.poll_once() == [] and w.usable(0)  # not quarantined, let alone held for `lorad gpu clear`
    faults.write_text(json.dumps({"0": {"xid": [79, 79, 79, 79]}}))  # one Xid raised after the restart
    (ch,) = w.poll_once()
    assert ch.after == vd.QUARANTINED and w.verdict(0).faults and len(w.verdict(0).faults) == 1
