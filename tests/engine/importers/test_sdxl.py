"""SDXL's own import rules: a single-file checkpoint as the model imports as it is (the SDXL trainer converts
it), and one that is not an SDXL checkpoint is refused by `lorad import` with lorad's validator's own line (exit 65,
naming model.path), word for word; a prediction switch is SDXL's only (model.prediction
is an SDXL key): on another family it is listed as not applying, and the job stays valid."""

from __future__ import annotations

import argparse

import pytest

from daemon.client.importing import cmd_import
from engine.config.job import parse_job
from engine.errors import JobInvalid
from engine.importers import import_file
from tests.helpers.images import make_images


def test_an_sdxl_single_file_checkpoint_imports_as_the_model_path(tmp_path):
    import torch
    from safetensors.torch import save_file

    make_images(tmp_path / "data", [("a.png", 32, 32, "a dog")])
    ckpt = tmp_path / "illustrious.safetensors"  # an SDXL checkpoint's header: its UNet and bigG
    save_file({"model.diffusion_model.out.2.bias": torch.zeros(1),
               "conditioner.embedders.1.model.positional_embedding": torch.zeros(1)}, str(ckpt))
    src = tmp_path / "sdxl.sh"
    src.write_text(f"accelerate launch sdxl_train_network.py --pretrained_model_name_or_path {ckpt.name} "
                   f"--train_data_dir {tmp_path}/data --max_train_steps 10\n")
    result = import_file(src)
    assert result.imported.get("model.path") == str(ckpt)
    assert result.imported.get("model.family") == "sdxl"


def test_a_file_that_is_no_sdxl_checkpoint_is_refused_with_the_validators_own_line(tmp_path, capsys):
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


def test_a_v_prediction_switch_on_another_family_does_not_apply_and_writes_nothing(tmp_path):
    from engine.config.reading import read_yaml

    make_images(tmp_path / "data", [("a.png", 32, 32, "a dog")])
    src = tmp_path / "flux.sh"
    src.write_text("accelerate launch flux_train_network.py --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev "
                   f"--train_data_dir {tmp_path}/data --max_train_steps 10 --v_parameterization --zero_terminal_snr\n")
    result = import_file(src)
    assert result.imported.get("model.prediction") is None
    why = {k: w for k, _, w in result.imported.dropped}
    assert why["v_parameterization"].startswith("does not apply") and why["zero_terminal_snr"].startswith("lorad has")
    assert parse_job(read_yaml(result.text), tmp_path).model.family == "flux"
