"""Issue 39's GPU targets against one `fast` table (bench/gpu_session.sh fast): each met, missed or not measured.

    python bench/fast_targets.py bench/out/flux-r16-fast.md

Reads the markdown table bench/engine_speed.py wrote and prints one line per target, the numbers it used,
and the verdict. Targets are never adjusted here; a target this table cannot decide says where its figure
comes from instead. A smoke table (tiny shapes on the CPU) gets no verdicts.
"""

from __future__ import annotations

import sys
from pathlib import Path


def read_table(md: str) -> dict[str, dict[str, str]]:
    """config name -> {column header: cell} for the table's rows."""
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[header.index("config")]] = dict(zip(header, cells, strict=False))
    return rows


def number(cell: str | None) -> float | None:
    try:
        return float(cell.rstrip("×").replace(",", "")) if cell else None
    except ValueError:
        return None


def verdicts(rows: dict[str, dict[str, str]]) -> list[tuple[str, str, str]]:
    """(target, what was measured, met / missed / not measured)."""
    def col(config: str, name: str) -> float | None:
        return number(rows.get(config, {}).get(name))

    def judge(ok: bool | None) -> str:
        return "not measured" if ok is None else ("met" if ok else "missed")

    out = []
    speed, mem = col("fp8-8bit", "× baseline speed"), col("fp8-8bit", "× baseline mem")
    out.append(("eager fp8 ≥ 1.3× baseline at ≤ 0.6× memory", f"fp8-8bit: {speed}× speed, {mem}× memory",
                judge(None if speed is None or mem is None else speed >= 1.3 and mem <= 0.6)))
    fc, bc = col("fp8-8bit-compile", "s/step"), col("bf16-8bit-compile", "s/step")
    fcs = col("fp8-8bit-compile", "× baseline speed")
    over = bc / fc if fc and bc else None
    out.append(("compiled fp8 ≥ 1.25× compiled bf16 and ≥ 1.9× baseline",
                f"fp8-8bit-compile: {over and round(over, 2)}× bf16-8bit-compile, {fcs}× baseline",
                judge(None if over is None or fcs is None else over >= 1.25 and fcs >= 1.9)))
    plan = next((c for c in rows if c.startswith("plan-24")), None)
    ps = col(plan, "× baseline speed") if plan else None
    out.append(("the 24 GB plan ≥ 1.8× baseline", f"{plan}: {ps}×" if plan else "no plan row (no planner yet)",
                judge(None if ps is None else ps >= 1.8)))
    out.append(("compile on resume ≤ 5 s with the cache", "not in this table (bench/compile_cache.py, on a GPU)",
                "not measured"))
    default = plan or "fp8-8bit-compile"
    j = col(default, "× baseline J")
    out.append(("J/step of the default plan ≤ 0.6× the baseline's", f"{default}: {j}× baseline J/step",
                judge(None if j is None else j <= 0.6)))
    out.append(("loss after 200 steps within 2% of bf16-8bit", "the loss-bf16 and loss-fp8 stages", "not measured"))
    return out


def main(argv: list[str]) -> int:
    md = Path(argv[0]).read_text()
    if "SMOKE RUN" in md:
        print("# fast targets: a smoke table (tiny shapes, CPU): no verdicts")
        return 0
    print("# issue 39's targets, as measured in this table")
    for target, measured, verdict in verdicts(read_table(md)):
        print(f"- {target}: {measured} -> {verdict.upper()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
