"""HiDream-I1 in the other trainers' configs: each tool's own name for it imports to model.family hidream; HiDream's
other models (E1, O1) are refused, naming them."""

from __future__ import annotations

import pytest

from engine.config.job import parse_job
from engine.config.reading import read_yaml
from engine.errors import JobInvalid
from engine.importers import import_text
from tests.helpers.images import make_images

AI_TOOLKIT = """\
job: extension
config:
  name: hd
  process:
    - type: sd_trainer
      network: {{type: lora, linear: 16, linear_alpha: 16}}
      datasets: [{{folder_path: "{data}", resolution: [1024]}}]
      train: {{batch_size: 1, steps: 100, lr: 1e-4, optimizer: adamw8bit}}
      model: {{name_or_path: "HiDream-ai/HiDream-I1-Full", arch: "{arch}"}}
"""
SIMPLETUNER = ('{{"model_type": "lora", "model_family": "hidream", "model_flavour": "dev", "lora_rank": 16, '
               '"max_train_steps": 100, "data_backend_config": "backends.json"}}')
BACKENDS = '[{{"id": "pics", "type": "local", "instance_data_dir": "{data}", "caption_strategy": "textfile"}}]'
ONETRAINER = ('{{"training_method": "LORA", "model_type": "HI_DREAM_FULL", "base_model_name": '
              '"HiDream-ai/HiDream-I1-Full", "concepts": [{{"path": "{data}"}}]}}')
DIFFUSION_PIPE = """\
dataset = 'data.toml'
epochs = 1
[model]
type = 'hidream'
diffusers_path = '/models/HiDream-I1-Full'
[adapter]
type = 'lora'
rank = 16
[optimizer]
type = 'adamw_optimi'
lr = 1e-4
"""
DIFFUSION_PIPE_DATA = "resolutions = [1024]\n[[directory]]\npath = '{data}'\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("hd-import") / "data", [("a.png", 48, 32, "a dog")])


@pytest.mark.parametrize("tool,name,text,beside,path", [
    ("ai-toolkit", "hd.yaml", AI_TOOLKIT.replace("{arch}", "hidream"), None, "HiDream-ai/HiDream-I1-Full"),
    ("simpletuner", "st.json", SIMPLETUNER, ("backends.json", BACKENDS), "HiDream-ai/HiDream-I1-Dev"),
    ("onetrainer", "ot.json", ONETRAINER, None, "HiDream-ai/HiDream-I1-Full"),
    ("diffusion-pipe", "dp.toml", DIFFUSION_PIPE, ("data.toml", DIFFUSION_PIPE_DATA), "/models/HiDream-I1-Full"),
])
def test_each_tools_hidream_config_imports_to_the_hidream_family(tool, name, text, beside, path, data, tmp_path):
    def fill(t: str) -> str:
        return t.replace("{data}", str(data)).replace("{{", "{").replace("}}", "}")

    if beside is not None:
        (tmp_path / beside[0]).write_text(fill(beside[1]))
    result = import_text(fill(text), name, tmp_path, read=lambda p: p.read_text())
    job = parse_job(read_yaml(result.text), tmp_path, source=name, check_paths=False)
    assert (job.model.family, job.model.path) == ("hidream", path), tool


def test_hidreams_other_models_are_refused_naming_them(data, tmp_path):
    from engine.importers.common import family_of_name

    text = AI_TOOLKIT.replace("{arch}", "hidream_e1").replace("{data}", str(data)).replace("{{", "{").replace("}}", "}")
    with pytest.raises(JobInvalid) as e:
        import_text(text.replace("HiDream-I1-Full", "HiDream-E1-Full"), "e1.yaml", tmp_path)
    assert "model.arch" in str(e.value) and "hidream" in str(e.value), str(e.value)
    assert [family_of_name(n) for n in ("HiDream-ai/HiDream-I1-Dev", "/models/hidream_i1_fast", "HiDream-ai/HiDream-O1",
                                        "HiDream-ai/HiDream-E1-Full")] == ["hidream", "hidream", None, None]
