"""Telemetry: rows written and summarised per job, bounded retention, no NVML, refused caps, NVML decoding."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from daemon.config.power import PowerSettings
from daemon.power import job_power_summary
from daemon.power import simulated as sim
from daemon.power.gpu import Sample
from daemon.power.policy import PowerPolicy
from daemon.power.run_policy import RunningJob
from daemon.power.simulated import SimulatedDevice
from daemon.power.telemetry import NvmlDevice, decode_throttle, open_device
from daemon.power.telemetry_store import TelemetryStore
from tests.helpers.fakes import Clock, RecLog


def _job(limit=None):
    return RunningJob(job_id="j1", name="j1", pid=1, gpu=None, started_at=0.0, total=50,
                      power={"limit_w": limit, "max_slowdown": 0.1})


def test_simulated_rows_are_written_labelled_and_summarised_per_job(tmp_path: Path):
    clock = Clock()
    dev = SimulatedDevice(1, clock=clock, wall=clock)
    pol = PowerPolicy(PowerSettings(telemetry={"backend": "simulated"}), tmp_path, tmp_path / "state.db", RecLog(),
                      clock=clock, device=dev, start_threads=False)
    pol.on_job_start(_job(limit=300))
    for step in range(1, 21):
        clock.t += dev.step_time_s(0)
        pol.on_heartbeat("j1", {"event": "step", "step": step, "total": 50})
        pol.sampler.sample_once()  # what the 1 Hz thread does
    pol.on_job_end("j1", 0)

    rows = pol.store.samples(job_id="j1")
    assert len(rows) == 20 and all(r["simulated"] == 1 for r in rows)
    assert rows[0]["power_w"] == 300 and rows[0]["throttle"] == "sw_power_cap" and rows[0]["limit_w"] == 300
    s = pol.job_power("j1")
    # 19 step intervals at 300 W; J/step is the model's
    assert s["steps"] == 19 and s["simulated"] is True and s["gpu_model"].startswith("SIMULATED")
    assert s["j_per_step"] == pytest.approx(sim.joules_per_step(300))
    assert s["avg_w"] == pytest.approx(300)
    assert s["kwh"] == pytest.approx(s["energy_j"] / 3.6e6)
    assert s["steps_per_kwh"] == pytest.approx(19 / s["kwh"])
    rep = pol.report()
    assert rep["simulated"] is True and rep["gpus"][0]["name"].startswith("SIMULATED")
    pol.close()
    # readable later without a policy (the CLI's path), and across attempts it adds up
    assert job_power_summary(tmp_path / "state.db", "j1")["steps"] == 19


def test_retention_folds_old_rows_into_minutes_and_drops_old_history(tmp_path: Path):
    st = TelemetryStore(tmp_path / "state.db", raw_retention_s=3600, history_days=1)
    now = 1_000_000_020.0

    def row(ts, w):
        return Sample(ts=ts, gpu=0, power_w=w, energy_mj=ts, energy_source="simulated", sm_mhz=1, mem_mhz=1,
                      temp_c=50, util_gpu=99, util_mem=50, limit_w=300, throttle=[], simulated=True)

    old = now - 7200  # two hours ago: two full minutes of 1 Hz rows
    base = old - old % 60
    st.add_samples([row(base + i, 100 + (i % 60)) for i in range(120)], {0: "j1"})
    st.add_samples([row(now - 2 * 86400, 100)], {0: "j1"})  # older than history
    st.add_samples([row(now - 10, 200)], {0: "j1"})  # recent: stays raw
    st.maintain(now)
    rows = st.samples(gpu=0)
    folded = [r for r in rows if r["period_s"] == 60]
    assert len(folded) == 2 and folded[0]["power_w"] == pytest.approx(129.5)
    assert [r["power_w"] for r in rows if r["period_s"] == 0] == [200]
    assert len(rows) == 3
    st.close()


def test_without_nvml_the_policy_runs_and_says_telemetry_unavailable_once(tmp_path: Path):
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    except Exception:
        pass
    log = RecLog()
    pol = PowerPolicy(PowerSettings(), tmp_path, tmp_path / "state.db", log)  # backend: nvml (the default)
    pol.on_job_start(_job(limit="auto"))
    for step in range(1, 5):
        pol.on_heartbeat("j1", {"event": "step", "step": step, "total": 50})
        d = pol.tick(datetime.now(timezone.utc), [_job(limit="auto")])
        assert d.may_start and d.stop_running is None
    pol.on_job_end("j1", 0)
    pol.on_job_start(_job(limit=200))
    assert len(log.named("telemetry unavailable")) == 1
    assert len(log.named("power limit requested but telemetry is unavailable; running uncapped")) == 1
    assert "telemetry unavailable" in pol.report()["notes"]
    assert pol.set_manual_limit(0, 200)["ok"] is False
    pol.close()


def test_a_refused_limit_is_reported_once_and_the_job_runs_on(tmp_path: Path):
    log = RecLog()
    dev = SimulatedDevice(1, refuse_limits=True)
    pol = PowerPolicy(PowerSettings(caps={"default_w": 250}), tmp_path, tmp_path / "state.db", log, device=dev,
                      start_threads=False)
    pol.on_job_start(_job())
    for _ in range(5):
        d = pol.tick(datetime.now(timezone.utc), [_job()])
        assert d.may_start and d.stop_running is None
    assert len(log.named("power limit refused")) == 1
    assert dev.limit_w(0) == sim.DEFAULT_W
    assert "permissions" in pol.report()["gpus"][0]["refused"]
    pol.close()


def test_manual_limit_and_daemon_exit_restores_the_original_limit(tmp_path: Path):
    dev = SimulatedDevice(2)
    pol = PowerPolicy(PowerSettings(), tmp_path, tmp_path / "state.db", RecLog(), device=dev, start_threads=False)
    r = pol.set_manual_limit(1, 200)
    assert r["ok"] and r["simulated"] and dev.limit_w(1) == 200 and dev.limit_w(0) == sim.DEFAULT_W
    assert pol.set_manual_limit(None, 50)["gpus"][0]["applied_w"] == sim.MIN_W  # clamped to the constraint
    pol.close()
    assert dev.limit_w(0) == dev.limit_w(1) == sim.DEFAULT_W


def test_throttle_reasons_are_decoded_to_names():
    import pynvml

    from daemon.power.telemetry import _throttle_names

    table = _throttle_names(pynvml)
    mask = pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown
    assert decode_throttle(mask, table) == sorted(["sw_power_cap", "hw_thermal_slowdown"],
                                                  key=lambda n: dict((v, k) for k, v in table)[n])
    assert decode_throttle(0, table) == []
    assert decode_throttle(1 << 62, table) == ["unknown_0x4000000000000000"]


def test_nvml_device_through_the_real_pynvml_reads_a_sample_and_integrates_where_the_counter_is_unsupported():
    """NvmlDevice against nvidia-ml-py itself, on a stand-in for the driver's library (tests/helpers/nvml_lib.py)."""
    from daemon.power.gpu import CapRefused
    from tests.helpers.nvml_lib import installed

    with installed(1) as nv:
        nv.gpus[0].reasons = 0x4  # nvml.h's nvmlClocksEventReasonSwPowerCap
        d = NvmlDevice(RecLog())
        s = d.sample(0)
        assert (s.power_w, s.energy_mj, s.energy_source, s.sm_mhz, s.mem_mhz, s.temp_c, s.util_gpu, s.util_mem,
                s.limit_w, s.throttle) == (250.0, 1_000_000, "counter", 1800.0, 9501.0, 64.0, 97.0, 41.0, 300.0,
                                           ["sw_power_cap"])
        info = d.info(0)
        assert (info.name, info.min_w, info.max_w, info.default_w) == ("NVIDIA Fake 24GB", 100.0, 400.0, 300.0)
        with pytest.raises(CapRefused, match="Insufficient Permissions"):  # not root
            d.set_limit_w(0, 200)
        nv.root = True
        d.set_limit_w(0, 200)
        assert d.limit_w(0) == 200.0
        d.close()

        nv.gpus[0].energy_mj = None  # a board before Volta: no energy counter
        log = RecLog()
        d = NvmlDevice(log)
        d.sample(0)
        s = d.sample(0)
        assert s.energy_source == "integrated" and s.energy_mj >= 0
        assert len(log.named("energy counter unsupported; integrating power over time")) == 1
        d.close()
        assert nv.inits == 0


def test_a_gpu_lost_before_and_while_the_daemon_runs_leaves_the_others_capped_metered_and_reported(tmp_path: Path):
    """Real NVML answers every call about a lost GPU with NVML_ERROR_GPU_IS_LOST (the simulated device does not):
    telemetry still starts, the policy's tick never fails for it (the watchdog would restart the daemon), the
    other GPU is capped and metered, `lorad power` reports it, and a GPU that answers again is capped too."""
    from daemon.power.view import render
    from tests.helpers.nvml_lib import installed

    with installed(2) as nv:
        nv.root = True
        nv.gpus[1].lost = True  # fell off the bus before the daemon started
        log = RecLog()
        pol = PowerPolicy(PowerSettings(caps={"default_w": 250}), tmp_path, tmp_path / "state.db", log,
                          device=NvmlDevice(log), start_threads=False)
        now = datetime.now(timezone.utc)
        pol.tick(now, [])
        assert (nv.gpus[0].limit_mw, nv.gpus[1].limit_mw) == (250_000, 300_000)
        rep = pol.report()
        assert rep["gpus"][0]["limit_w"] == 250.0 and rep["gpus"][1]["name"].startswith("unreadable (NVMLError_GpuIsLost")
        render(rep)  # `lorad power` prints it
        nv.gpus[1].lost = False  # the driver is reloaded
        pol.tick(now, [])
        assert nv.gpus[1].limit_mw == 250_000

        job = RunningJob(job_id="j0", name="j0", pid=1, gpu=0, started_at=0.0, total=50,
                         power={"limit_w": None, "max_slowdown": 0.1})
        pol.on_job_start(job)
        pol.on_heartbeat("j0", {"event": "step", "step": 1, "total": 50})
        nv.gpus[0].lost = True  # its GPU is lost mid-job (the health watcher stops the job)
        assert pol.tick(now, [job]).may_start and pol.tick(now, [job]).may_start
        assert len([e for e in log.named("power: GPU unreadable") if e["gpu"] == 0]) == 1  # said once
        pol.close()


def test_open_device_off_and_simulated_are_said():
    log = RecLog()
    assert open_device("off", log) is None and log.events == []
    dev = open_device("simulated", log)
    assert dev.simulated and "SIMULATED" in log.events[0][1]


@pytest.mark.gpu
def test_real_nvml_sample():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except Exception:
        pytest.skip("no NVML on this machine")
    d = NvmlDevice(RecLog())
    s = d.sample(0)
    assert s.power_w > 0 and s.energy_mj > 0 and s.limit_w > 0 and not s.simulated
    d.close()


def test_a_job_on_a_gpu_the_device_does_not_know_runs_unmetered_and_said_once(tmp_path: Path):
    log = RecLog()
    pol = PowerPolicy(PowerSettings(), tmp_path, tmp_path / "state.db", log, device=SimulatedDevice(1),
                      start_threads=False)
    job = RunningJob(job_id="j1", name="j1", pid=1, gpu=3, started_at=0.0, total=50, power={"limit_w": 200})
    pol.on_job_start(job)
    pol.on_heartbeat("j1", {"event": "step", "step": 1})
    d = pol.tick(datetime.now(timezone.utc), [job])
    assert d.may_start and pol.device.limit_w(0) == sim.DEFAULT_W
    pol.on_job_end("j1", 0)
    assert len(log.named("job's GPU is not among the metered GPUs; it runs unmetered and uncapped")) == 1
    pol.close()


def test_the_sampler_thread_writes_at_its_interval_and_close_is_prompt(tmp_path: Path):
    import time

    pol = PowerPolicy(PowerSettings(telemetry={"backend": "simulated", "interval_s": 0.05}), tmp_path,
                      tmp_path / "state.db", RecLog())  # real threads
    time.sleep(0.5)
    t0 = time.monotonic()
    pol.close()
    assert time.monotonic() - t0 < 1.0
    st = TelemetryStore(tmp_path / "state.db")
    assert 4 <= len(st.samples(gpu=0)) <= 12
    st.close()


def test_a_job_that_vanished_without_on_job_end_releases_its_cap_on_the_next_tick(tmp_path: Path):
    dev = SimulatedDevice(1)
    pol = PowerPolicy(PowerSettings(), tmp_path, tmp_path / "state.db", RecLog(), device=dev, start_threads=False)
    job = _job(limit=220)
    pol.on_job_start(job)
    pol.tick(datetime.now(timezone.utc), [job])
    assert dev.limit_w(0) == 220
    pol.tick(datetime.now(timezone.utc), [])
    assert dev.limit_w(0) == sim.DEFAULT_W and pol.jobs == {}
    pol.close()
