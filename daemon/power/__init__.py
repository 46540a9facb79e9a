"""Power: NVML telemetry, caps, the auto-tuned limit, schedules, outage timetables and the UPS.

Imports are lazy: `import daemon.power` must work on a machine where
nvidia-ml-py cannot load a driver (and costs nothing when power is unused).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from daemon.config.power import PowerSettings
    from daemon.power.run_policy import Policy


def make_policy(settings: PowerSettings, home: Path, db_path: Path, log: Any) -> Policy:
    """The daemon's Policy for its `power:` settings (telemetry threads started, caps applied on tick)."""
    from daemon.power.policy import PowerPolicy

    return PowerPolicy(settings, Path(home), Path(db_path), log)


def job_power_summary(db_path: Path, job_id: str) -> dict[str, Any] | None:
    """Per-job W, J/step, kWh and steps/kWh from HOME/state.db, without a running policy (e.g. the CLI)."""
    from daemon.power.telemetry_store import TelemetryStore

    st = TelemetryStore(Path(db_path))
    try:
        return st.job_summary(job_id)
    finally:
        st.close()
