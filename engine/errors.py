"""What the engine raises across modules, in one place that imports nothing.

engine/recipe.py (train) turns each into an exit code: JobInvalid and ConfigMismatch → 65
(never retried), DiskError → 74 (retried after backoff), OutOfMemory → 69 (the daemon re-plans memory),
HeldForReview → 75 (stopped, resumable). The thin client
imports this module too, so it must stay free of torch and of the rest of the
engine.
"""

from __future__ import annotations


class JobInvalid(Exception):
    """A job file that can never run as written. The engine exits 65 on it."""


class ConfigMismatch(Exception):
    """The newest valid checkpoint was written by a job with different training settings."""


class NewerCheckpoint(ConfigMismatch):
    """A checkpoint written by a newer lorad: never set aside (pruning would delete it), never walked past."""


class DiskError(Exception):
    """A checkpoint or output could not be written (disk full, read-only, ...)."""


class OutOfMemory(Exception):
    """The GPU ran out of memory in a phase (load, step, validation, sample); nothing of that phase was committed.
    The engine exits 69 on it, with the plan it ran under, so the daemon can re-plan (engine/memory_plan/)."""

    def __init__(self, phase: str, step: int, message: str, needed: int | None, plan: dict | None):
        super().__init__(message)
        self.phase, self.step, self.needed, self.plan = phase, step, needed, plan


class HeldForReview(Exception):
    """The caption stage is done and the job stops for a person to review its captions
    (data.captioner.hold_for_review): nothing trained yet, resumable. The engine exits 75 on it."""
