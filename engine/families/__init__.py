"""Model families behind one small interface; `get_family(name)` picks one.

Each family is a package that declares its facts (engine/registry/facts.py) and holds its training code; the
registry (engine/registry/families.py) finds them. Importable without torch: the Family protocol is imported
only where it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.families.base import Family


def get_family(name: str) -> Family:
    from engine.registry.families import trainer

    return trainer(name)
