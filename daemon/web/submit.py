"""The submit page's error display: the validator's "key: message" problems, each placed at its key's line.

engine/config/ (describe.py, rules.py) names every problem by its dotted key (`train.steps: must be
greater than 0`); yaml.compose keeps each node's line, so the page can show the
message next to the key it names. A missing key points at its section's line.
"""

from __future__ import annotations

import re

import yaml

_KEY = re.compile(r"^([A-Za-z_][\w]*(?:\.[\w]+)*): ")


def problems_of(message: str, source: str) -> list[str]:
    """'SOURCE: a.b: msg; c: msg' → ['a.b: msg', 'c: msg']."""
    if message.startswith(source + ": "):
        message = message[len(source) + 2:]
    return [m for m in message.split("; ") if m]


def key_line(text: str, dotted: str) -> int | None:
    """The 0-based line of `dotted` (a.b.0.c) in the YAML text, or of its nearest parent that exists."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        return mark.line if mark is not None else None
    line = None
    for part in dotted.split("."):
        if isinstance(node, yaml.MappingNode):
            hit = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
            if hit is None:
                return line
            line, node = hit[0].start_mark.line, hit[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line
        else:
            return line
    return line


def locate(text: str, message: str, source: str) -> list[tuple[int | None, str]]:
    """Each problem of a rejected job with the line of the key it names (None when it names no key)."""
    out = []
    for prob in problems_of(message, source):
        m = _KEY.match(prob)
        out.append((key_line(text, m.group(1)) if m else None, prob))
    return out
