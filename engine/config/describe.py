"""pydantic's validation errors in lorad's words: one line per problem, each naming its dotted key."""

from __future__ import annotations

import difflib
import re
import reprlib

from pydantic import BaseModel, ValidationError

# pydantic reports union members as extra path parts; they are dropped for a readable key.
_UNION_PART = re.compile(r"^(list\[.*\]|literal\[.*\]|int|str|float|bool|function-.*|constrained-.*)$")
SHOWN_CHARS = 200  # of a value echoed back in an error (a YAML alias bomb's value is megabytes)
SHOWN_PROBLEMS = 20  # problems listed in one message; the rest counted
_REPR = reprlib.Repr()  # a bounded repr: only the shown part of a huge value is ever formatted
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8


def shown(value: object, most: int = SHOWN_CHARS) -> str:
    """A value as an error message echoes it: its repr, cut to `most` characters (computed bounded, never whole)."""
    r = _REPR.repr(value)
    return r if len(r) <= most else f"{r[:most]}… ({len(r) - most} more)"


def _describe(err: dict, models: dict[str, type[BaseModel]]) -> str:
    key_parts = [str(p) for p in err["loc"] if not _UNION_PART.match(str(p))]
    key = ".".join(key_parts) or "(top level)"
    typ = err["type"]
    got = err.get("input")
    if typ == "extra_forbidden":
        parent = ".".join(key_parts[:-1])
        model = models.get(parent)
        if not model:
            return f"{key}: unknown key"
        close = difflib.get_close_matches(key_parts[-1], list(model.model_fields), n=1, cutoff=0.6)
        hint = f"did you mean {'.'.join([*key_parts[:-1], close[0]])}? " if close else ""
        return f"{key}: unknown key ({hint}allowed here: {', '.join(model.model_fields)})"
    if typ == "missing":
        return f"{key}: required key is missing"
    if typ == "value_error" and not key_parts:
        # A top-level validator names its keys in the message itself.
        return err["msg"].replace("Value error, ", "")
    if typ == "literal_error":
        return f"{key}: {err['msg'].replace('Input should be', 'must be')} (got {shown(got)})"
    msg = err["msg"].replace("Value error, ", "").replace("Input should be", "must be")
    if got is not None and not isinstance(got, dict):
        return f"{key}: {msg} (got {shown(got)})"
    return f"{key}: {msg}"


def describe_errors(e: ValidationError, models: dict[str, type[BaseModel]]) -> str:
    """Every problem pydantic found, one line, each naming its key (`did you mean` for a misspelt one).

    models: dotted section path ("" for the top) → its model, where an unknown key's neighbours are looked up.
    The daemon config's errors are worded by this too (daemon/config/daemon.py).
    """
    problems = list(dict.fromkeys(_describe(err, models) for err in e.errors(include_url=False)))
    # Several union branches may fail for one key; keep the distinct messages, in order (and a bounded number).
    more = f"; … and {len(problems) - SHOWN_PROBLEMS} more problems" if len(problems) > SHOWN_PROBLEMS else ""
    return "; ".join(problems[:SHOWN_PROBLEMS]) + more
