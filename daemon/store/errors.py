"""What the store raises: an unknown or ambiguous job reference, a state.db that cannot be used."""

from __future__ import annotations

from typing import Any


class UnknownJob(KeyError):
    pass


class AmbiguousJob(LookupError):
    """A job reference (a name or an id prefix) that could mean more than one job; `matches` newest first."""

    def __init__(self, ref: str, matches: list[dict[str, Any]]):
        super().__init__(ref)
        self.ref = ref
        self.matches = matches


class StoreUnusable(Exception):
    """state.db cannot be used as it is (corrupt, or locked by another process): restarting will not help."""
