"""bench/fast_targets.py judges issue 39's targets from a table bench/engine_speed.py writes, never adjusting them."""

from __future__ import annotations

import sys

from tests.helpers.processes import REPO

sys.path.insert(0, str(REPO / "bench"))

import engine_speed as es  # noqa: E402
import fast_targets as ft  # noqa: E402


def a_table(fp8_s: float, fp8_compile_s: float, joules: dict[str, float | None]) -> str:
    """A measured-looking table: the baseline at 1.0 s/step and 20 GiB, the other rows as given."""
    rows = []
    for name, s, gib in [("baseline", 1.0, 20.0), ("bf16-8bit", 0.9, 19.0), ("fp8-8bit", fp8_s, 11.0),
                         ("bf16-8bit-compile", 0.7, 19.0), ("fp8-8bit-compile", fp8_compile_s, 11.0)]:
        rows.append(es.Row("flux-dev", es.CONFIGS[name], 16, s_per_step=s, peak_gib=gib, loss=2.0,
                           joules_per_step=joules.get(name)))
    return es.table(rows, "an H200", "**Measured** (a test's table)")


def test_targets_are_met_or_missed_by_the_tables_numbers():
    table = a_table(0.75, 0.5, {"baseline": 500.0, "fp8-8bit-compile": 250.0})
    met = {t: v for t, _, v in ft.verdicts(ft.read_table(table))}
    assert met["eager fp8 ≥ 1.3× baseline at ≤ 0.6× memory"] == "met"  # 1.33×, 0.55×
    assert met["compiled fp8 ≥ 1.25× compiled bf16 and ≥ 1.9× baseline"] == "met"  # 1.4×, 2.0×
    assert met["J/step of the default plan ≤ 0.6× the baseline's"] == "met"  # 0.5×
    assert met["the 24 GB plan ≥ 1.8× baseline"] == "not measured"  # no planner row
    assert met["loss after 200 steps within 2% of bf16-8bit"] == "not measured"

    missed = {t: v for t, _, v in ft.verdicts(ft.read_table(a_table(0.8, 0.6, {"baseline": 500.0})))}
    assert missed["eager fp8 ≥ 1.3× baseline at ≤ 0.6× memory"] == "missed"  # 1.25×: just short, not rounded up
    assert missed["compiled fp8 ≥ 1.25× compiled bf16 and ≥ 1.9× baseline"] == "missed"
    assert missed["J/step of the default plan ≤ 0.6× the baseline's"] == "not measured"  # no energy counter


def test_a_smoke_table_gets_no_verdicts(tmp_path, capsys):
    path = tmp_path / "t.md"
    path.write_text(es.table([], "CPU", "**SMOKE RUN (tiny shapes, not a performance measurement)**"))
    assert ft.main([str(path)]) == 0
    assert "no verdicts" in capsys.readouterr().out
