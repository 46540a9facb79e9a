"""Human output for `lorad power` (a table, or a live view with --watch) and the energy lines of `lorad status ID`.

Simulated figures are labelled SIMULATED in the title and on every GPU row.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import IO, Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text


def _f(v: Any, fmt: str = "{:.0f}", unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v) + unit


def render(rep: dict[str, Any]) -> Group:
    sim = rep.get("simulated")
    title = "GPU power" + ("  [SIMULATED device: figures come from a model, not a GPU]" if sim else "")
    t = Table(title=title, title_justify="left")
    for c in ("GPU", "W", "limit W", "SM/mem MHz", "°C", "util %", "kJ", "throttle", "cap"):
        t.add_column(c, justify="left" if c in ("cap", "throttle") else "right")
    names = []
    for g in rep.get("gpus", []):
        s = g.get("sample") or {}
        name = ("SIMULATED " if g.get("simulated") and not g["name"].startswith("SIMULATED") else "") + g["name"]
        names.append(Text(f"GPU {g['index']}: {name}" if g.get("min_w") is None else  # unreadable (lost)
                          f"GPU {g['index']}: {name}, limits {g['min_w']:.0f}-{g['max_w']:.0f} W "
                          f"(default {g['default_w']:.0f} W)"))
        cap = g.get("cap_reason") or "none"
        if g.get("refused"):
            cap += " (refused)"
        t.add_row(str(g["index"]), _f(s.get("power_w")), _f(g.get("limit_w")),
                  f"{_f(s.get('sm_mhz'))}/{_f(s.get('mem_mhz'))}", _f(s.get("temp_c")), _f(s.get("util_gpu")),
                  _f((s.get("energy_mj") or 0) / 1e6, "{:.1f}"), ",".join(s.get("throttle") or []) or "-", cap)
    parts: list[Any] = [t, *names] if names else []  # no GPU: the notes below say why, no empty table
    for jid, j in (rep.get("jobs") or {}).items():
        gpu = j.get("gpu")
        line = f"job {jid} on " + (f"GPU {gpu}: " if gpu is not None and gpu >= 0 else "CPU: ")
        tu = j.get("tuner")
        if j.get("limit_w") is not None:
            line += f"limit {j['limit_w']:.0f} W"
        elif tu is not None:
            line += (f"auto-tuned {tu['limit_w']:.0f} W" if tu["done"] and tu["limit_w"] else
                     f"auto: profiling {tu['limit_w']:.0f} W ({len(tu['points'])} points)" if tu["limit_w"] else
                     "auto: not tuned (job too short)")
        else:
            line += "no job limit"
        e = j.get("energy")
        if e:
            line += "  " + "  ".join(job_lines(e))
        parts.append(Text(line))
    if rep.get("ups"):
        u = rep["ups"]
        parts.append(Text(f"UPS: {u['state']} ({u['status'] or '?'})" + ("" if u["connected"] is not False else
                                                                        f"  unreachable: {u['error']}")))
    for n in rep.get("notes", []):
        parts.append(Text(n, style="yellow"))
    return Group(*parts)


def job_lines(e: dict[str, Any]) -> list[str]:
    """Energy of one job: average W, J/step, kWh, steps/kWh (labelled SIMULATED where it is)."""
    if e.get("error"):
        return [e["error"]]
    tag = " (SIMULATED)" if e.get("simulated") else ""
    return [f"power{tag}: {_f(e.get('avg_w'), unit=' W')} avg, {_f(e.get('j_per_step'), '{:.1f}', ' J/step')}, "
            f"{_f(e.get('kwh'), '{:.4f}', ' kWh')}, {_f(e.get('steps_per_kwh'), '{:.0f}', ' steps/kWh')}"]


def show(rep: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(render(rep))


def watch(fetch: Callable[[], dict[str, Any]], interval_s: float = 1.0, stream: IO[str] | None = None) -> int:
    """Redraw `lorad power` every interval until Ctrl-C; to a pipe or file, one timestamped table per interval."""
    from rich.live import Live

    stream = stream or sys.stdout
    try:
        if not stream.isatty():
            # Live draws nothing to a non-terminal until it stops: `lorad power --watch | tee log` would stay empty.
            console = Console(file=stream)
            while True:
                console.print(f"--- {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC", markup=False)
                console.print(render(fetch()))
                stream.flush()
                time.sleep(interval_s)
        with Live(render(fetch()), refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(render(fetch()))
    except KeyboardInterrupt:
        return 0
