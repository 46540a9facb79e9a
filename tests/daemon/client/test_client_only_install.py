"""`pip install lorad` without extras is a client: no training stack, and every client verb works against a
real daemon (`lorad serve` from the full install). `serve`, `run` and `cache` say to install `lorad[train]`.

The client is installed into a fresh virtualenv from a copy of the source (a plain `pip install SRC`,
build isolation included), so nothing of this checkout's own environment can leak into it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib

from daemon.client.cli import TRAINING_STACK
from tests.helpers.daemon import Daemon, fast_config
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow

DECLARED = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

TRAINING_STACK_DISTS = ("torch", "transformers", "diffusers", "bitsandbytes", "peft", "accelerate")
# pip's words when no package index can be reached at all (then this test cannot run here: skipped, saying so).
OFFLINE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
           "Network is unreachable", "ConnectTimeoutError", "ProxyError")


class Client:
    """A virtualenv holding `pip install SRC` and nothing else; commands run outside the checkout."""

    def __init__(self, root: Path):
        self.root = root
        self.python = root / "venv" / "bin" / "python"
        self.lorad = root / "venv" / "bin" / "lorad"
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LORAD_SOCKET", "LORAD_HOME")}

    def run(self, *argv: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=self.env, cwd=self.root,
                              timeout=timeout)

    def lorad_cli(self, *args: str | Path) -> subprocess.CompletedProcess:
        r = self.run(self.lorad, *args)
        assert "Traceback" not in r.stderr and "ImportError" not in r.stderr, r.stderr
        return r


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> Client:
    root = tmp_path_factory.mktemp("client")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for pkg in ("engine", "daemon"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    c = Client(root)
    # No pip inside the new venv: this checkout's pip installs into it (--python), which saves ensurepip.
    made = c.run(sys.executable, "-m", "venv", "--without-pip", root / "venv")
    assert made.returncode == 0, made.stderr
    r = c.run(sys.executable, "-m", "pip", "--python", c.python, "install", "--quiet", "--disable-pip-version-check",
              "--retries", "1", "--timeout", "30", src, timeout=600)
    if r.returncode != 0 and any(word in r.stderr for word in OFFLINE):
        pytest.skip(f"pip cannot reach a package index from here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return c


def test_a_client_install_has_no_training_stack(client):
    r = client.run(client.python, "-c", "import torch")
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr
    listed = client.run(sys.executable, "-m", "pip", "--python", client.python, "list", "--format=freeze",
                        "--disable-pip-version-check")
    installed = {line.split("==")[0].lower() for line in listed.stdout.splitlines()}
    assert "lorad" in installed and not installed & set(TRAINING_STACK_DISTS)


def test_the_client_verbs_work_against_a_real_daemon(client, tmp_path):
    home = tmp_path / "home"
    r = client.lorad_cli("status", "--home", home)
    assert r.returncode == 69 and "the daemon is not running" in r.stderr  # documented: EX_UNAVAILABLE
    d = Daemon(home, fast_config(tmp_path)).start()  # the full install's `lorad serve`
    try:
        r = client.lorad_cli("ping", "--home", home)
        assert r.returncode == 0 and r.stdout.startswith(f"lorad {DECLARED} is up"), r.stdout + r.stderr
        assert client.lorad_cli("drain", "--home", home).returncode == 0  # nothing starts: no trainer runs here
        jobs = []
        for example in ("quickstart.yaml", "flux-lora-tiny.yaml"):  # validated locally first, engine included
            r = client.lorad_cli("submit", REPO / "configs" / "examples" / example, "--home", home)
            assert r.returncode == 0, r.stderr
            jobs.append(r.stdout.strip())
        r = client.lorad_cli("status", "--home", home)
        assert r.returncode == 0 and all(j in r.stdout for j in jobs) and "draining" in r.stdout, r.stdout
        r = client.lorad_cli("status", jobs[1], "--home", home)
        assert r.returncode == 0 and "state: queued" in r.stdout
        assert client.lorad_cli("cancel", jobs[0], "--home", home).returncode == 0
        assert client.lorad_cli("logs", jobs[0], "--home", home).returncode == 0
        assert client.lorad_cli("power", "--home", home, "--json").returncode == 0
    finally:
        d.cleanup()


@pytest.mark.parametrize("argv", [["serve"], ["run", "JOB"], ["cache", "JOB"]])
def test_the_training_commands_say_to_install_the_training_stack(client, tmp_path, argv):
    job = str(REPO / "configs" / "examples" / "quickstart.yaml")
    r = client.lorad_cli(*[job if a == "JOB" else a for a in argv], "--home", tmp_path / "home")
    assert r.returncode == 78
    assert len(r.stderr.strip().splitlines()) == 1 and "pip install 'lorad[train]'" in r.stderr
    assert not (tmp_path / "home").exists()  # refused before doing anything


def test_the_modules_the_cli_looks_for_are_the_train_extra():
    """`lorad serve` checks for the training stack by module name: the same packages as pyproject's `train`."""
    def norm(dist: str) -> str:
        return re.sub(r"[-_.]+", "-", dist).lower()

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    dists = {norm(re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]) for req in extra}
    owners = {mod: {norm(d) for d in ds} for mod, ds in packages_distributions().items()}
    assert all(owners.get(mod, set()) & dists for mod in TRAINING_STACK)  # each module comes from the extra
    assert all(any(dist in owners.get(mod, set()) for mod in TRAINING_STACK) for dist in dists)  # and each package
