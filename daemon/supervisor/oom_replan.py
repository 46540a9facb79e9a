"""After a trainer ran out of GPU memory (exit 69): the job's next memory floors, or the one line it fails with.

The floors live in the job's `memory` column of state.db (JSON, engine/memory_plan/attempt.py's AttemptMemory),
never in the user's job.yaml and never in the job's identity; start_path.py hands them to each attempt in
$LORAD_MEMORY_PLAN. The lever is chosen from the plan the trainer says it ran under (its checked `out_of_memory`
event), in the engine's order (engine.memory_plan.replan): a re-plan costs no crash and no backoff, and the job
resumes from its newest checkpoint. The floors are kept whatever state the exit lands in (reap_path.py): a pause,
a shutdown or a failing GPU that wins over the requeue still leaves the next attempt its new plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.memory_plan.attempt import parse, replan


@dataclass(frozen=True)
class OomReplan:
    memory: str | None  # the job's new floors (JSON); None: no lever left
    lever: str | None  # the lever pulled, in words
    before: str  # the plan the attempt ran under, in words
    failure: str | None  # no lever left: the one line the job fails with


def after_oom(memory: str | None, oom: dict[str, Any] | None) -> OomReplan:
    """The re-plan after an out-of-memory, from the job's floors so far and the trainer's `out_of_memory` event."""
    current, _ = parse(memory)
    oom = oom or {}
    ran = oom.get("plan") or {}
    before = str(ran.get("summary") or "unknown (the trainer did not say)")
    nxt = replan(ran, current, str(oom.get("phase", "step"))) if ran else None
    if nxt is not None:
        floors, words = nxt
        return OomReplan(floors.to_json(), words, before, None)
    where = f" in {oom['phase']} at step {oom.get('step', 0)}" if oom.get("phase") else ""
    needed = f", needed {oom['needed_bytes'] / 2**30:.2f} GiB more" if oom.get("needed_bytes") else ""
    tried = "; ".join(current.tried) or "nothing (the job's plan has no lever left)"
    return OomReplan(None, None, before, f"out of GPU memory{where}{needed} with no lever left; tried: {tried}; "
                                         f"last plan: {before}")
