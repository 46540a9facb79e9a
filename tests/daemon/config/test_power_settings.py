"""The shipped configs/daemon.yaml documents every power key, at its default."""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from daemon.config.daemon import load_config
from daemon.config.power import PowerSettings
from tests.helpers.processes import REPO

DAEMON_YAML = REPO / "configs" / "daemon.yaml"


def _missing(model: type[BaseModel], raw: dict, where: str) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        if name not in raw:
            out.append(f"{where}{name}")
        elif isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += _missing(f.annotation, raw[name], f"{where}{name}.")
    return out


def test_daemon_yaml_lists_every_power_key_at_its_default():
    raw = yaml.safe_load(DAEMON_YAML.read_text())["power"]
    assert _missing(PowerSettings, raw, "power.") == []
    assert load_config(DAEMON_YAML).power == PowerSettings()
