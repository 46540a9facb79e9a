"""The daemon config is refused as a job file is: one line per file, each key named, `did you mean` for a typo."""

from __future__ import annotations

import pytest

from daemon.config.daemon import ConfigInvalid, load_config


@pytest.mark.parametrize("text, words", [
    ("sokcet_group: lorad\n", "sokcet_group: unknown key (did you mean socket_group? allowed here: socket, "),
    ("power:\n  telemetry:\n    backnd: nvml\n",
     "power.telemetry.backnd: unknown key (did you mean power.telemetry.backend? allowed here: backend, "),
    ("tick_s: fast\n", "tick_s: must be a valid number"),
])
def test_a_daemon_config_error_is_one_line_naming_the_key_like_the_job_validator(tmp_path, text, words):
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigInvalid) as e:
        load_config(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{cfg}: {words}") and "\n" not in msg
    assert "Extra inputs are not permitted" not in msg and "Input should be" not in msg


def test_lorad_serve_with_a_misspelt_key_says_so_in_one_line_and_exits_78(tmp_path, capsys):
    from daemon.service.serve import serve

    cfg = tmp_path / "daemon.yaml"
    cfg.write_text("trainer_uesr: lorad\n")
    assert serve(tmp_path / "home", str(cfg)) == 78
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer_uesr: unknown key (did you mean trainer_user?" in err
