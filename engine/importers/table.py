"""The shape every importer shares: a mapping table (source key → lorad key, with a converter) and what an import
produced (the job, where each key came from, what was not carried over and why).

One table per tool, in the tool's own module; the importer code applies it (`apply`) and docs/coming-from.md is
generated from it (engine/importers/docs.py), so the code and the page cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The three reasons a source setting is not carried over (the issue's words; the docs' table says them too).
NO_FEATURE = "lorad has no such feature"
NULL = object()  # a converter's value for "write null" (None means: nothing to write)
NOT_APPLICABLE = "does not apply"


def other_way(lorad_key: str, how: str = "") -> str:
    """Why: lorad does it another way, and which key does it."""
    return f"lorad does this another way ({lorad_key}{': ' + how if how else ''})"


def not_applicable(what: str) -> str:
    return f"{NOT_APPLICABLE} ({what})"


class NotCarried(Exception):
    """A converter's verdict: this value cannot be carried over, and why (one of the three reasons)."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class CarriedIn(Exception):
    """A converter's verdict: this value is carried, inside another key the table sets (its comment names both)."""

    def __init__(self, dst: str):
        super().__init__(dst)
        self.dst = dst


def carried_in(dst: str) -> Callable[[Any, Context], Any]:
    """The converter of a setting that only qualifies another (a unit, a switch): carried in dst's value."""
    def conv(v: Any, ctx: Context) -> Any:
        raise CarriedIn(dst)
    return conv


class Problem(Exception):
    """A converter's verdict: this value stops the import (exit 65); the message names the source key."""


@dataclass(frozen=True)
class Key:
    """One row of a tool's table: `src` (dotted, `[]` for any list item) → `dst` (a dotted lorad key) by `conv`.

    dst None: never carried over, for the reason `why`. conv(value, ctx) returns the lorad value, or raises
    NotCarried(why) / Problem(message). `doc` is the table's note on the row (what the conversion does).
    """

    src: str
    dst: str | None
    conv: Callable[[Any, Context], Any] | None = None
    why: str | None = None
    doc: str = ""


@dataclass
class Context:
    """What converters may look at: the whole flattened source, where it lives, and what was decided so far."""

    source: dict[str, Any]
    base_dir: Path
    job: dict[str, Any] = field(default_factory=dict)
    images: float | None = None  # images × their own repeats ÷ data.repeats, where counted (epochs → steps)
    notes: list[str] = field(default_factory=list)  # converters' one-line remarks for the header
    dropped: list[tuple[str, Any, str]] = field(default_factory=list)  # parts of a value a converter left out
    origin: dict[str, str] = field(default_factory=dict)  # the import's: a converter setting a second key says why
    read: Callable[[Path], str] | None = None  # a side file's text (bounded; the daemon's checks its roots too)


@dataclass
class Imported:
    tool: str  # the FORMATS name: ai-toolkit, kohya, musubi-tuner, onetrainer, simpletuner, diffusion-pipe
    source: str  # the file's name, for the header
    job: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # lorad dotted key → where it came from
    dropped: list[tuple[str, Any, str]] = field(default_factory=list)  # (source key, value, why)
    also: dict[str, list[str]] = field(default_factory=dict)  # lorad key → other settings carried in it
    notes: list[str] = field(default_factory=list)  # one-line remarks (the model not looked at, ...)
    problems: list[str] = field(default_factory=list)  # what stops the import, each naming its key

    def set(self, dst: str, value: Any, origin: str) -> None:
        node = self.job
        *parents, last = dst.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        self.origin[dst] = origin

    def get(self, dst: str, default: Any = None) -> Any:
        node: Any = self.job
        for p in dst.split("."):
            if not isinstance(node, dict) or p not in node:
                return default
            node = node[p]
        return node

    def drop(self, src: str, value: Any, why: str) -> None:
        self.dropped.append((src, value, why))


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted key: leaf}; lists of mappings as key[i].sub, other lists stay leaves."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten(v, name))
            elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                for i, x in enumerate(v):
                    out.update(flatten(x, f"{name}[{i}]"))
            else:
                out[name] = v
    return out


def generic(src: str) -> str:
    """`datasets[0].folder_path` → `datasets[].folder_path`: the table's spelling of a concrete key."""
    import re

    return re.sub(r"\[\d+\]", "[]", src)


def apply(table: list[Key], flat: dict[str, Any], ctx: Context, out: Imported,
          unknown_why: str = NO_FEATURE) -> None:
    """Every source key through its row, in the table's order (later rows may read what earlier ones set).

    A key with no row is not carried over (unknown_why). A row whose dst is already set by an earlier, more
    specific row (e.g. steps from max_train_steps before max_train_epochs) is dropped as done another way.
    """
    rows = {k.src: k for k in table}
    order = {k.src: i for i, k in enumerate(table)}
    keys = sorted(flat, key=lambda s: (order.get(generic(s), len(order)), s))
    for src in keys:
        value = flat[src]
        row = rows.get(generic(src))
        if src.startswith("_") and not src.startswith("__") and (row is None or row.dst is None):
            continue  # the importer's own facts (what it read from the dataset), not a source setting
        if row is None:
            out.drop(src, value, unknown_why)
            continue
        if row.dst is None and row.conv is None:
            out.drop(src, value, row.why or NO_FEATURE)
            continue
        try:
            v = row.conv(value, ctx) if row.conv else value
        except NotCarried as e:
            out.drop(src, value, e.why)
            continue
        except Problem as e:
            out.problems.append(f"{src}: {e}")
            continue
        except CarriedIn as e:
            out.also[e.dst] = [*out.also.get(e.dst, []), f"{src} = {short(value)}"]
            continue
        if v is None or row.dst is None:
            continue  # the converter says the value is lorad's default or empty: nothing to write, nothing lost
        if row.dst in out.origin:
            out.drop(src, value, other_way(row.dst, f"set from {out.origin[row.dst].split(' = ')[0]}"))
            continue
        said = f"{row.doc} = {short(value)}" if src.startswith("_") else f"{src} = {short(value)}"
        out.set(row.dst, None if v is NULL else v, said)
        ctx.job = out.job


def short(v: Any, width: int = 60) -> str:
    s = v if isinstance(v, str) else repr(v)
    s = " ".join(str(s).split())
    return s if len(s) <= width else s[: width - 1] + "…"
