"""SDXL's own import rules: a single-file checkpoint as the model imports as it is (the SDXL trainer converts
it), and one that is not an SDXL checkpoint is refused by `lorad import` with lorad's validator's own line (exit 65,
naming model.path), word for word; a prediction switch is SDXL's only (model.prediction
is an SDXL key): on another family it is listed as not applying, and the job stays valid. kohya's SDXL configs
train the text encoders as sd-scripts would (both unless network_train_unet_only, at text_encoder_lr's first
value, else learning_rate; the UNet at unet_lr, else learning_rate); another family's text-encoder rate is not
carried."""

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


# sd-scripts' SDXL text-encoder rules (train_network.py, networks/lora.py): (extra arguments, lora.text_encoder,
# lora.text_encoder_lr, train.lr, a note the header must hold or None)
KOHYA_TE = [
    ("--learning_rate 1e-4", True, None, 1e-4, None),  # both encoders train by default, at learning_rate
    ("--learning_rate 1e-4 --text_encoder_lr 5e-5 2e-5", True, 5e-5, 1e-4,  # networks.lora: the first, for both
     "text_encoder_lr 5e-5 2e-5: sd-scripts' networks.lora trains both text encoders at the first, 5e-5"),
    ("--unet_lr 3e-4", True, 2e-6, 3e-4,  # the encoders at sd-scripts' default learning_rate
     "text_encoder_lr not set there: sd-scripts trains the text encoders at learning_rate (2e-06)"),
    ("--learning_rate 1e-4 --text_encoder_lr 0", False, None, 1e-4, None),  # a 0 group is skipped there
    ("--learning_rate 1e-4 --unet_lr 2e-4 --cache_text_encoder_outputs", False, None, 2e-4,
     "cache_text_encoder_outputs without network_train_unet_only: sd-scripts refuses"),
    ("--learning_rate 1e-4 --network_train_unet_only --unet_lr 2e-4", False, None, 2e-4, None),
]


@pytest.mark.parametrize("extra, trains, te_lr, lr, note", KOHYA_TE, ids=range(len(KOHYA_TE)))
def test_kohya_sdxl_trains_the_text_encoders_as_sd_scripts_would(tmp_path, extra, trains, te_lr, lr, note):
    from engine.config.reading import read_yaml

    make_images(tmp_path / "data", [("a.png", 32, 32, "a dog")])
    src = tmp_path / "sdxl.sh"
    src.write_text("accelerate launch sdxl_train_network.py --pretrained_model_name_or_path "
                   f"stabilityai/stable-diffusion-xl-base-1.0 --train_data_dir {tmp_path}/data --max_train_steps 10 "
                   f"{extra}\n")
    result = import_file(src)
    job = parse_job(read_yaml(result.text), tmp_path)
    assert (job.lora.text_encoder, job.lora.text_encoder_lr, job.train.lr) == (trains, te_lr, lr)
    assert note is None or any(n.startswith(note) for n in result.imported.notes), result.imported.notes
    assert not any(k in ("text_encoder_lr", "network_train_unet_only") for k, _, _ in result.imported.dropped)


def test_a_text_encoder_lr_on_another_family_is_not_carried_and_the_job_stays_valid(tmp_path):
    from engine.config.reading import read_yaml

    make_images(tmp_path / "data", [("a.png", 32, 32, "a dog")])
    src = tmp_path / "flux.sh"
    src.write_text("accelerate launch flux_train_network.py --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev "
                   f"--train_data_dir {tmp_path}/data --max_train_steps 10 --text_encoder_lr 5e-5 "
                   "--network_train_unet_only\n")
    result = import_file(src)
    why = {k: w for k, _, w in result.imported.dropped}
    assert why["text_encoder_lr"] == "lorad has no such feature (a text-encoder LoRA; lorad trains one for SDXL only)"
    assert why["network_train_unet_only"].startswith("does not apply (lorad always trains the transformer's LoRA")
    assert parse_job(read_yaml(result.text), tmp_path).lora.text_encoder is False
