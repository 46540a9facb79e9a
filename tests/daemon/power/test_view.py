"""`lorad power` output and the per-job energy lines: simulated figures are always labelled."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from daemon.config.power import PowerSettings
from daemon.power import api, view
from daemon.power.policy import PowerPolicy
from daemon.power.run_policy import NullPolicy, RunningJob
from daemon.power.simulated import SimulatedDevice


class NoLog:
    def __getattr__(self, level):
        return lambda event, **kw: None


def _text(renderable) -> str:
    c = Console(width=120, record=True)
    c.print(renderable)
    return c.export_text()


def test_power_report_and_view_label_the_simulated_device(tmp_path: Path):
    pol = PowerPolicy(PowerSettings(telemetry={"backend": "simulated"}), tmp_path, tmp_path / "state.db", NoLog(),
                      device=SimulatedDevice(2), start_threads=False)
    pol.on_job_start(RunningJob("j1", "j1", 1, 1, 0.0, total=2000, power={"limit_w": "auto"}))
    pol.sampler.sample_once()
    rep = api.power_report(pol)
    assert rep["simulated"] and len(rep["gpus"]) == 2
    out = _text(view.render(rep))
    assert "SIMULATED device" in out
    assert out.count("SIMULATED lorad-sim") == 2  # one line per GPU
    assert "profiling 400 W" in out
    r = api.set_limit(pol, 0, 200)
    assert r["ok"] and r["gpus"][0]["applied_w"] == 200
    pol.close()


def test_without_a_power_policy_the_answers_say_so(tmp_path: Path):
    assert api.power_report(NullPolicy())["available"] is False
    assert api.set_limit(None, 0, 200)["ok"] is False
    assert api.job_power(NullPolicy(), tmp_path / "state.db", "j1") is None


def test_job_energy_line_has_w_j_per_step_kwh_and_steps_per_kwh():
    line = view.job_lines({"avg_w": 310.0, "j_per_step": 333.3, "kwh": 0.1852, "steps_per_kwh": 10800,
                           "simulated": True})[0]
    assert line == "power (SIMULATED): 310 W avg, 333.3 J/step, 0.1852 kWh, 10800 steps/kWh"


def ctrl_c_at_the_third_fetch(calls: list):
    def fetch():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return api.power_report(None)

    return fetch


def test_watch_redraws_until_ctrl_c():
    calls = []
    assert view.watch(ctrl_c_at_the_third_fetch(calls), interval_s=0.01) == 0
    assert len(calls) == 3


def test_watch_to_a_pipe_writes_a_timestamped_table_per_interval():
    import io

    out = io.StringIO()  # not a terminal, as `lorad power --watch | tee power.log`
    assert view.watch(ctrl_c_at_the_third_fetch([]), interval_s=0.01, stream=out) == 0
    text = out.getvalue()
    first_line = _text(view.render(api.power_report(None))).strip().splitlines()[0]
    assert text.count("--- ") == 3 and text.count(first_line) == 2  # the third fetch was the Ctrl-C


def test_without_a_gpu_the_view_says_why_instead_of_an_empty_table():
    from rich.console import Console

    from daemon.power.view import render

    c = Console(record=True, width=100)
    c.print(render({"backend": "nvml", "available": False, "simulated": False, "gpus": [], "jobs": {},
                    "notes": ["telemetry unavailable"]}))
    out = c.export_text()
    assert "telemetry unavailable" in out
    assert "limit W" not in out


def test_a_job_without_a_gpu_is_shown_on_the_cpu_not_on_gpu_minus_one(tmp_path: Path):
    pol = PowerPolicy(PowerSettings(telemetry={"backend": "off"}), tmp_path, tmp_path / "state.db", NoLog(),
                      start_threads=False)
    pol.on_job_start(RunningJob("cpu-job", "cpu-job", 1, None, 0.0, total=100))  # a CPU-only machine: gpu None
    rep = api.power_report(pol)
    assert rep["jobs"]["cpu-job"]["gpu"] is None  # --json: no GPU index where there is none
    out = _text(view.render(rep))
    assert "job cpu-job on CPU: no job limit" in out and "GPU -1" not in out
    pol.close()
    assert "job j2 on GPU 1:" in _text(view.render({"gpus": [], "jobs": {"j2": {"gpu": 1, "limit_w": None}}}))
