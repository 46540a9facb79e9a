"""Smoke test of bench/power_tune.py: on a machine without NVML it runs on the simulated device, labelled so."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.processes import REPO


def test_power_bench_runs_simulated_and_says_so():
    out = subprocess.run([sys.executable, str(REPO / "bench" / "power_tune.py"), "--simulated"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("SIMULATED power sweep")
    rows = [ln for ln in lines if ln.startswith("| ") and ln[2].isdigit()]
    assert len(rows) == 8 and rows[0].startswith("| 400 |")
    assert lines[-1].startswith("SIMULATED chosen limit (max_slowdown 10%): 329 W vs default 400 W: 11.6% fewer J/step")
