"""Who `lorad serve` runs as: a root daemon outside a container refuses in one line and touches nothing; in a
container it starts only with `run_as_root: true`, and says so in its log."""

from __future__ import annotations

import os

import pytest

from daemon.config.daemon import ConfigInvalid
from daemon.system import privilege


def test_a_daemon_that_is_not_root_is_never_refused_whatever_the_setting():
    for run_as_root in (False, True):
        assert privilege.check_daemon_user(1000, run_as_root, container=lambda: False) is False


def test_root_outside_a_container_refuses_even_with_run_as_root():
    for run_as_root in (False, True):
        with pytest.raises(ConfigInvalid) as e:
            privilege.check_daemon_user(0, run_as_root, container=lambda: False)
        assert str(e.value) == privilege.REFUSAL and "\n" not in str(e.value)
        assert "install-service" in str(e.value) and "run_as_root: true" in str(e.value)


def test_root_in_a_container_needs_the_explicit_setting():
    with pytest.raises(ConfigInvalid, match="^running as root in a container: set run_as_root: true"):
        privilege.check_daemon_user(0, False, container=lambda: True)
    assert privilege.check_daemon_user(0, True, container=lambda: True) is True


@pytest.mark.parametrize("marker", [".dockerenv", "run/.containerenv", "proc/1/environ"])
def test_a_container_is_known_by_any_one_of_its_marks(tmp_path, marker):
    no_detect_virt = ("false",)
    (tmp_path / "run").mkdir()
    (tmp_path / "proc" / "1").mkdir(parents=True)
    (tmp_path / "proc" / "1" / "environ").write_bytes(b"PATH=/usr/bin\0HOME=/\0")
    assert not privilege.in_container(tmp_path, no_detect_virt)
    target = tmp_path / marker
    target.write_bytes(b"PATH=/bin\0container=lxc\0" if marker.endswith("environ") else b"")
    assert privilege.in_container(tmp_path, no_detect_virt)
    assert privilege.in_container(tmp_path / "nowhere", ("true",))  # systemd-detect-virt's own verdict


def run_serve(tmp_path, monkeypatch, capsys, container: bool, config: str | None):
    from daemon.service.serve import serve

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(privilege, "in_container", lambda: container)
    cfg = None
    if config is not None:
        cfg = tmp_path / "daemon.yaml"
        cfg.write_text(config)
    home = tmp_path / "home"
    code = serve(home, str(cfg) if cfg else None)
    return code, capsys.readouterr().err, home


def test_lorad_serve_as_root_outside_a_container_exits_78_in_one_line_before_making_its_home(
        tmp_path, monkeypatch, capsys):
    code, err, home = run_serve(tmp_path, monkeypatch, capsys, container=False, config="run_as_root: true\n")
    assert (code, err) == (78, f"lorad: {privilege.REFUSAL}\n")
    assert not home.exists()


def test_lorad_serve_as_root_in_a_container_without_the_setting_exits_78_naming_it(tmp_path, monkeypatch, capsys):
    code, err, home = run_serve(tmp_path, monkeypatch, capsys, container=True, config=None)
    assert code == 78 and err.count("\n") == 1 and "set run_as_root: true" in err
    assert not home.exists()
