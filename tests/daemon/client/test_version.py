"""The lorad version shown anywhere (`lorad --version`, the ping reply) is the package's, from its metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest
import tomllib

from daemon.client.cli import main as lorad
from engine import version as version_mod
from tests.helpers.processes import REPO

DECLARED = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_lorad_version_prints_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        lorad(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"lorad {version('lorad')}\n"
    assert version("lorad") == DECLARED  # this checkout is what is installed (make venv: pip install -e)


def test_a_source_tree_that_was_never_installed_reports_its_declared_version_marked_as_such(monkeypatch):
    def not_installed(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(version_mod, "version", not_installed)
    assert version_mod.lorad_version() == f"{DECLARED}+source"
    monkeypatch.setattr(version_mod, "PYPROJECT", REPO / "no-such-pyproject.toml")
    assert version_mod.lorad_version() == "0+unknown"


def test_the_trainer_and_the_client_report_one_version():
    """The trainer's start event and exported files carry the version the client and daemon show: one rule."""
    from engine import recipe

    assert recipe.VERSION == version_mod.lorad_version() == version("lorad")
