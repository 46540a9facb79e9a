"""Reading a job file's text: the size limit, the decoding, and the one safe YAML reader (the daemon's config too)."""

from __future__ import annotations

from typing import Any

import yaml

from engine.errors import JobInvalid

MAX_JOB_FILE_BYTES = 256 * 1024


class YamlProblem(ValueError):
    """Why a text is not acceptable YAML, in words for the user (the caller adds which file)."""


def _loader(text: str, max_aliases: int | None) -> yaml.SafeLoader:
    loader = yaml.SafeLoader(text)
    if max_aliases is None:
        return loader
    count = 0
    compose_node = loader.compose_node

    def counting_compose_node(parent, index):
        # billion-laughs bombs: each alias may expand a whole subtree again
        nonlocal count
        if loader.check_event(yaml.AliasEvent):
            count += 1
            if count > max_aliases:
                raise YamlProblem(f"uses more than {max_aliases} YAML aliases (*name); "
                                  "refused as a possible YAML bomb")
        return compose_node(parent, index)

    loader.compose_node = counting_compose_node  # type: ignore[method-assign]
    return loader


def read_yaml(text: str, max_aliases: int | None = None) -> Any:
    """One YAML document through the safe loader; raise YamlProblem saying what is wrong and where."""
    loader = _loader(text, max_aliases)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise YamlProblem(f"not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise YamlProblem("YAML nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml_text(text: str, source: str, max_aliases: int | None = None) -> Any:
    """A job file's YAML; JobInvalid naming the source when it is not (or has more aliases than max_aliases)."""
    try:
        return read_yaml(text, max_aliases)
    except YamlProblem as e:
        raise JobInvalid(f"{source}: {e}") from None


def decode_job_bytes(data: bytes, display: str) -> str:
    """A job file's text; binary or non-UTF-8 content is refused in the same words wherever a job is read."""
    if b"\x00" in data:
        raise JobInvalid(f"{display}: job file is binary (contains NUL bytes), not YAML text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise JobInvalid(f"{display}: job file is not UTF-8 text") from None
