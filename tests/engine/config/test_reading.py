"""The one YAML reader (engine/config/reading.py): job files, the daemon's intake and the daemon config."""

from __future__ import annotations

import pytest

from engine.config.reading import YamlProblem, load_yaml_text, read_yaml
from engine.errors import JobInvalid

ALIASES = "a: &x [1, 2]\nb: [*x, *x, *x]\n"


def test_aliases_beyond_the_cap_are_refused_as_a_possible_bomb():
    assert read_yaml(ALIASES, max_aliases=3) == {"a": [1, 2], "b": [[1, 2]] * 3}
    with pytest.raises(JobInvalid, match=r"^job.yaml: uses more than 2 YAML aliases \(\*name\); refused as a "
                                         r"possible YAML bomb$"):
        load_yaml_text(ALIASES, "job.yaml", max_aliases=2)


def test_without_a_cap_aliases_are_read():
    assert load_yaml_text(ALIASES, "job.yaml") == {"a": [1, 2], "b": [[1, 2]] * 3}


def test_a_syntax_error_names_the_line_and_column():
    with pytest.raises(JobInvalid, match=r"^job.yaml: not valid YAML at line 3, column 1: expected .,. or .\]., but got .<stream end>.$"):
        load_yaml_text("name: x\nmodel: [unclosed\n", "job.yaml")


def test_a_document_nested_too_deeply_is_a_problem_not_a_crash():
    with pytest.raises(YamlProblem, match="YAML nested too deeply"):
        read_yaml("[" * 100_000 + "]" * 100_000)
