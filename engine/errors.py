"""What the engine raises across modules, in one place that imports nothing.

engine/recipe.py (train) turns each into an exit code: JobInvalid and ConfigMismatch → 65
(never retried), DiskError → 74 (retried after backoff). The thin client
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
