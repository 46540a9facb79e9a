"""Every model family lorad trains, found by looking: each package under engine/families/ whose `__init__.py`
declares `FAMILY` (engine/registry/facts.py). Adding a family is adding such a package (with its tests and docs).

The tables that name families are derived from here, never written again: the `model.family` choices
(engine/config/model.py), the image, video and edit sets (engine/config/declare.py), display names (job messages,
model cards), the adapter types per family (engine/config/rules.py), the built-in models (engine/builtin/models.py)
and the dispatch (engine/families/__init__.py). Importable without torch: a family package's `__init__.py` holds
plain data, and its training code is imported only by `trainer`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from pathlib import Path
from typing import Any

from engine.registry.facts import Facts, Offline

ROOT = "engine.families"


def _walk(package: str, found: list[Facts]) -> None:
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.ispkg:
            continue
        sub = importlib.import_module(f"{package}.{info.name}")
        facts = vars(sub).get("FAMILY")  # vars: a family package forwards other names to its training code
        if isinstance(facts, Facts):
            found.append(facts)
        else:
            _walk(sub.__name__, found)


@functools.cache
def families() -> dict[str, Facts]:
    """name -> Facts of every family package, in the order they joined (Facts.joined)."""
    found: list[Facts] = []
    _walk(ROOT, found)
    for what, values in (("name", [f.name for f in found]), ("joined", [f.joined for f in found]),
                         ("built-in model", [o.name for f in found for o in f.offline])):
        if dupes := sorted({v for v in values if values.count(v) > 1}):
            raise RuntimeError(f"two model families declare the same {what}: {dupes}")
    return {f.name: f for f in sorted(found, key=lambda f: f.joined)}


def names(*kinds: str) -> tuple[str, ...]:
    """The families of these kinds (all of them without kinds), in their order."""
    return tuple(n for n, f in families().items() if not kinds or f.kind in kinds)


def edit_families() -> tuple[str, ...]:
    return tuple(n for n, f in families().items() if f.kind == "edit" or f.edits)


def display(name: str) -> str:
    return families()[name].display


def offline_models() -> dict[str, tuple[Facts, Offline]]:
    """builtin NAME -> (its family, its declaration), families in order."""
    return {o.name: (f, o) for f in families().values() for o in f.offline}


def resolve(ref: str) -> Any:
    """The object a "module:attribute" reference names (imports the module)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def trainer(name: str):
    """A new Family object of `name` (engine/families/base.py); imports its training code."""
    if name not in families():
        raise ValueError(f"unknown model family {name!r}")
    return resolve(families()[name].trainer)()


def spatial_multiple(name: str, model_path: str | Path | None = None) -> int:
    """Pixels per latent token side of the family's base at model_path: every bucket side is a multiple of it.

    A built-in model's own, a local directory's by the family's spatial_rule (it reads the configs), else the
    family's reference base's (a hub id before download: the trainer asks again with the downloaded directory).
    """
    facts = families()[name]
    path = str(model_path or "")
    if path.startswith("builtin:"):
        entry = offline_models().get(path.removeprefix("builtin:"))
        if entry is not None and entry[1].spatial_multiple is not None:
            return entry[1].spatial_multiple
        return facts.spatial_multiple
    if facts.spatial_rule is not None and path and Path(path).is_dir():
        return int(resolve(facts.spatial_rule)(Path(path)))
    return facts.spatial_multiple
