"""An SDXL config whose model is a single-file checkpoint is refused by `lorad import` with lorad's validator's own
line (exit 65, naming model.path), word for word: the import does not carry a path the job could never train from."""

from __future__ import annotations

import argparse

import pytest

from daemon.client.importing import cmd_import
from engine.config.job import parse_job
from engine.errors import JobInvalid
from engine.importers import import_file
from tests.helpers.images import make_images


def test_a_single_file_checkpoint_is_refused_with_the_validators_own_line(tmp_path, capsys):
    make_images(tmp_path / "data", [("a.png", 32, 32, "a dog")])
    ckpt = tmp_path / "illustrious.safetensors"
    ckpt.write_bytes(b"\0" * 16)
    with pytest.raises(JobInvalid) as validator:
        parse_job({"name": "x", "model": {"family": "sdxl", "path": str(ckpt)}, "data": {"path": "data"}}, tmp_path)
    src = tmp_path / "sdxl.sh"
    src.write_text(f"accelerate launch sdxl_train_network.py --pretrained_model_name_or_path {ckpt.name} "
                   f"--train_data_dir {tmp_path}/data --max_train_steps 10\n")
    with pytest.raises(JobInvalid) as imported:
        import_file(src)
    assert str(validator.value).startswith("model.path: ")
    assert str(imported.value) == f"sdxl.sh: pretrained_model_name_or_path: {validator.value}"
    rc = cmd_import(argparse.Namespace(file=str(src), dataset=None, to=None, json=False))
    err = capsys.readouterr().err
    assert rc == 65 and err.count("\n") == 1 and str(validator.value) in err
