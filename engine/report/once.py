"""Say a thing once: the first time a key is seen, not again."""

from __future__ import annotations

from collections.abc import Hashable


class Once:
    """`first(key)` is True the first time `key` is seen and False after, e.g. one warning per slow save."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True
