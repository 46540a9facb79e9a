"""What the socket handlers call for `lorad power` and for the energy lines of `lorad status ID`.

Kept here so the daemon's handler module needs one line per verb: the policy
may be a PowerPolicy, the NullPolicy (power features off or failed to start),
or missing, and each gets a sensible answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def power_report(policy: Any) -> dict[str, Any]:
    """`lorad power --json`: live telemetry per GPU, caps, tuner state, UPS and schedule notes."""
    if policy is None or not hasattr(policy, "report"):
        return {"available": False, "simulated": False, "gpus": [], "jobs": {},
                "notes": ["power features are not running in this daemon"]}
    return policy.report()


def set_limit(policy: Any, gpu: int | None, watts: float | None) -> dict[str, Any]:
    """`lorad power --limit W [--gpu N]` (`--clear`: watts None)."""
    if policy is None or not hasattr(policy, "set_manual_limit"):
        return {"ok": False, "error": "power features are not running in this daemon"}
    return policy.set_manual_limit(gpu, watts)


def job_power(policy: Any, db_path: Path, job_id: str) -> dict[str, Any] | None:
    """Average W, J/step, kWh and steps/kWh of one job, or None when nothing was measured."""
    import sqlite3

    try:
        if policy is not None and hasattr(policy, "job_power"):
            return policy.job_power(job_id)
        if not Path(db_path).exists():
            return None
        from daemon.power import job_power_summary

        return job_power_summary(Path(db_path), job_id)
    except sqlite3.Error as e:  # `lorad status ID` must answer even if the power tables cannot be read
        return {"error": f"power figures unavailable: {e}"}
