"""How long a running job has left, as the CLI's status table and the dashboard both show it."""

from __future__ import annotations


def fmt_eta(s: float | None) -> str:
    """`1h05m` from an hour up, `4m07s` below, `-` when there is no estimate."""
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
