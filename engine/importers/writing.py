"""The imported job as a lorad job file: a header saying where it came from and what was not carried over, then
every key with a comment naming the source setting it came from. `read_header` reads the header back (the
daemon's intake and `lorad submit`: "imported from ai-toolkit" and the note go into the job's events)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from engine.importers.table import Imported, short

HEADER = "# lorad import: from "
DROPPED = "# not carried over:"
HEADER_MAX_LINES = 400  # the header is read back from a job file of at most 256 KiB: bounded either way
SECTION_ORDER = ("name", "model", "lora", "data", "train", "checkpoint", "output", "sample")


def _scalar(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10_000, allow_unicode=True).strip().removesuffix("...").strip()


def _comment(text: str) -> str:
    return " ".join(text.split())


def to_yaml(imp: Imported) -> str:
    """The job file text: header, then the sections in lorad's order, each key commented with its origin."""
    lines = [f"{HEADER}{imp.tool} ({imp.source})"]
    lines += [f"# {_comment(n)}" for n in imp.notes]
    if imp.dropped:
        lines.append(DROPPED)
        lines += [f"#   {src} = {short(v)} — {why}" for src, v, why in imp.dropped]
    lines.append("")
    keys = sorted(imp.job, key=lambda k: (SECTION_ORDER.index(k) if k in SECTION_ORDER else len(SECTION_ORDER), k))
    for k in keys:
        _emit(lines, imp, k, imp.job[k], 0)
    return "\n".join(lines) + "\n"


def _emit(lines: list[str], imp: Imported, dotted: str, v: Any, depth: int) -> None:
    name = dotted.rsplit(".", 1)[-1]
    pad = "  " * depth
    if isinstance(v, dict) and v and dotted not in imp.origin:
        lines.append(f"{pad}{name}:")
        for k, sub in v.items():
            _emit(lines, imp, f"{dotted}.{k}", sub, depth + 1)
        return
    where = "; ".join(x for x in (imp.origin.get(dotted), *imp.also.get(dotted, [])) if x)
    comment = f"  # from {_comment(where)}" if where else ""
    lines.append(f"{pad}{name}: {_scalar(v)}{comment}")


@dataclass
class Header:
    tool: str
    source: str
    notes: list[str]
    dropped: list[str]  # "KEY = VALUE — why" lines


def read_header(text: str) -> Header | None:
    """The import header at the top of a job file's text, or None when the file was not written by `lorad import`."""
    lines = text.splitlines()[:HEADER_MAX_LINES]
    if not lines or not lines[0].startswith(HEADER):
        return None
    first = lines[0][len(HEADER):]
    tool, _, rest = first.partition(" (")
    notes, dropped, in_dropped = [], [], False
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        if line == DROPPED:
            in_dropped = True
        elif in_dropped and line.startswith("#   "):
            dropped.append(line[4:])
        else:
            notes.append(line[2:])
    return Header(tool=tool.strip()[:40], source=rest.removesuffix(")")[:200], notes=notes, dropped=dropped)


def header_text(text: str) -> str:
    """The header lines themselves (kept when a client re-writes the job normalised: `lorad submit`)."""
    out = []
    for line in text.splitlines()[:HEADER_MAX_LINES]:
        if not line.startswith("#"):
            break
        out.append(line)
    return "\n".join(out) + "\n" if out and out[0].startswith(HEADER) else ""
