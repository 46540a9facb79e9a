"""`lorad install-service` points a root unit (the power helper) at a lorad: one that someone other than root could
change (a venv or a checkout writable by a user) is refused in one line, before anything is written (issue 38)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.processes import REPO, child_env

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="install-service runs as root; it refuses others first")


@pytest.fixture
def root_only_dir():
    """A fresh directory on a path only root may change (pytest's own is under /tmp, which everyone may write)."""
    from daemon.system.install_service import changeable_by_others

    for base in ("/run", "/var/cache", "/root", str(REPO.parent)):
        if os.path.isdir(base) and changeable_by_others(Path(base)) is None:
            d = Path(tempfile.mkdtemp(prefix="lorad-install-", dir=base))
            yield d
            shutil.rmtree(d, ignore_errors=True)
            return
    pytest.skip("no directory here that only root may change")


@ROOT_ONLY
@pytest.mark.parametrize("how", ["a user's directory", "a directory everyone may write"])
def test_install_service_refuses_a_lorad_that_someone_other_than_root_could_change(root_only_dir, how):
    from daemon.system.install_service import changeable_by_others

    tmp_path = root_only_dir
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "lorad").write_text(f"#!{sys.executable}\n")
    (venv / "lorad").chmod(0o755)
    if how == "a user's directory":
        os.chown(venv, 65534, 65534)  # nobody's: it may swap the script root would run
    else:
        venv.chmod(0o777)
    assert changeable_by_others(venv / "lorad") is not None
    dest = tmp_path / "units" / "lorad.service"
    dest.parent.mkdir()
    env = {**child_env(), "PATH": f"{venv}:{os.environ.get('PATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "daemon.client.cli", "install-service", "--dest", str(dest),
                        "--no-enable"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"lorad: install-service refused: the root power helper would run {venv / 'lorad'}, and "
                           f"{venv} is ")
    assert list(dest.parent.iterdir()) == []  # nothing written


@ROOT_ONLY
def test_a_lorad_only_root_can_change_is_accepted():
    from daemon.system.install_service import changeable_by_others

    env = shutil.which("env")
    if env is None or changeable_by_others(Path(env)) is not None:
        pytest.skip("no root-only env(1) on this machine to compare with")
    assert changeable_by_others(Path(env)) is None
    assert changeable_by_others(Path("/tmp")) == "/tmp is writable by everyone (mode 1777)"
