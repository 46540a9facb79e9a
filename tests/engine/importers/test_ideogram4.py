"""Configs that train Ideogram 4 in the peer trainers import as model.family ideogram4 (each tool's own name for it:
ai-toolkit's arch, musubi-tuner's script, OneTrainer's model type, SimpleTuner's model_family, diffusion-pipe's type)."""

from __future__ import annotations

import pytest

from engine.config.reading import read_yaml
from engine.importers import import_file
from engine.importers.common import family_of_name
from tests.helpers.images import make_images

CASES = [
    ("a.yaml", "job: extension\nconfig:\n  name: i4\n  process:\n    - type: sd_trainer\n      network: {type: lora, "
               "linear: 16, linear_alpha: 16}\n      datasets:\n        - folder_path: {data}\n      model:\n"
               "        name_or_path: /models/ideogram-v4\n        arch: ideogram4\n"),
    ("k.sh", "accelerate launch src/musubi_tuner/ideogram4_train_network.py --dit /models/ideogram4 "
             "--network_module networks.lora_ideogram4 --network_dim 16 --dataset_config d.toml"),
    ("o.json", '{"model_type": "IDEOGRAM_4", "training_method": "LORA", "base_model_name": "/models/ideogram-v4", '
               '"concepts": [{"path": "{data}"}]}'),
    ("s.json", '{"model_family": "ideogram", "model_type": "lora", "pretrained_model_name_or_path": "/models/i4", '
               '"data_backend_config": "b.json"}'),
    ("dp.toml", "dataset = 'dp-data.toml'\n[model]\ntype = 'ideogram4'\ndiffusers_path = '/models/ideogram-v4'\n[adapter]\ntype = 'lora'\n"
               "rank = 16\n"),
]


@pytest.mark.parametrize("name,text", CASES, ids=[c[0] for c in CASES])
def test_each_tools_ideogram4_config_imports_as_the_ideogram4_family(name, text, tmp_path):
    data = make_images(tmp_path / "data", [("a.png", 32, 32, "a dog")])
    src = tmp_path / name
    src.write_text(text.replace("{data}", str(data)))
    (tmp_path / "b.json").write_text(f'[{{"id": "p", "type": "local", "instance_data_dir": "{data}"}}]')
    (tmp_path / "dp-data.toml").write_text(f"[[directory]]\npath = '{data}'\n")
    (tmp_path / "d.toml").write_text(f"[general]\nresolution = [32, 32]\n[[datasets]]\nimage_directory = '{data}'\n")
    job = read_yaml(import_file(src).text)
    assert job["model"]["family"] == "ideogram4"


def test_ideogram_4_model_names_map_to_the_family():
    assert family_of_name("ideogram-ai/ideogram-v4") == family_of_name("Comfy-Org/Ideogram-4") == "ideogram4"
