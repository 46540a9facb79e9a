"""The family registry (engine/registry/): every family is one package that declares its facts, the registry finds
them all, and every table that names families is what the families declare. A new family is its own package and
nothing else: a copy of engine/ with one more package under engine/families/ validates and dispatches its jobs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest

from engine.registry.facts import Facts
from engine.registry.families import families, names, offline_models, resolve, spatial_multiple
from tests.helpers.images import make_images
from tests.helpers.processes import REPO, child_env
from tests.helpers.videos import make_clips

FAMILIES_DIR = REPO / "engine" / "families"


def family_packages() -> dict[str, Path]:
    """Every package under engine/families/ with training code of its own (a family.py), by its FAMILY's name."""
    out = {}
    for code in sorted(FAMILIES_DIR.rglob("family.py")):
        pkg = ".".join(code.parent.relative_to(REPO).parts)
        facts = vars(__import__(pkg, fromlist=["FAMILY"])).get("FAMILY")
        assert isinstance(facts, Facts), f"{pkg} has training code but declares no FAMILY in its __init__.py"
        out[facts.name] = code.parent
    return out


def test_the_registry_finds_every_family_package_and_only_those():
    found = family_packages()
    assert set(families()) == set(found)
    # The families that were there before the registry, at least: a new family adds its package, not an edit here.
    assert {"causal_lm", "flux", "flux2", "qwen_image", "z_image", "chroma", "flux3", "krea2", "sdxl", "wan",
            "hunyuan_video"} <= set(found)
    for name, facts in families().items():
        pkg = ".".join(found[name].relative_to(REPO).parts)
        assert facts.trainer.startswith(pkg + "."), f"{name}'s training code lives outside its package"


def test_the_config_tables_are_what_the_families_declare():
    from engine.config import declare
    from engine.config.model import ModelConfig
    from engine.config.rules import _WHY_NOT, IMAGE_LORA_TYPES

    fams = families()
    assert get_args(ModelConfig.model_fields["family"].annotation) == tuple(fams)
    assert declare.LM == tuple(n for n, f in fams.items() if f.kind == "text")
    assert declare.VIDEO_FAMILIES == tuple(n for n, f in fams.items() if f.kind == "video")
    assert declare.IMAGE_FAMILIES == tuple(n for n, f in fams.items() if f.kind != "text")
    assert declare.EDIT_FAMILIES == tuple(n for n, f in fams.items() if f.edits or f.kind == "edit")
    assert IMAGE_LORA_TYPES == {n: f.adapter_types for n, f in fams.items() if f.kind != "text"}
    assert _WHY_NOT == {n: f.why_not_others for n, f in fams.items() if f.kind != "text"}


def test_display_names_builtins_and_key_rules_are_what_the_families_declare():
    from engine.builtin.models import BUILTIN_MODELS
    from engine.report.model_card import FAMILY_NAMES, VIDEO

    fams = families()
    assert FAMILY_NAMES == {n: f.display for n, f in fams.items()}
    assert VIDEO == names("video")
    assert list(BUILTIN_MODELS) == [o.name for f in fams.values() for o in f.offline]
    for name, (facts, o) in offline_models().items():
        b = BUILTIN_MODELS[name]
        assert (b.family, b.description, b.marker, b.pipeline) == (facts.name, o.description, o.marker, o.pipeline)
        assert callable(resolve(o.build))
    for facts in fams.values():
        assert facts.export_keys is None or callable(resolve(facts.export_keys)), facts.name


def test_a_builtin_model_may_declare_its_own_spatial_multiple():
    assert spatial_multiple("wan", "builtin:tiny-wan22-5b") == 32  # 16x residual VAE, patch 2
    assert spatial_multiple("wan", "builtin:tiny-wan22-a14b") == 16
    assert spatial_multiple("wan", "Wan-AI/Wan2.2-T2V-A14B-Diffusers") == 16  # a hub id: the reference base's
    assert spatial_multiple("flux", "builtin:tiny-flux") == 16


def test_a_local_wan_base_gets_its_multiple_from_its_configs(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "vae" / "config.json").write_text('{"scale_factor_spatial": 16}')
    (tmp_path / "transformer" / "config.json").write_text('{"patch_size": [1, 2, 2]}')
    assert spatial_multiple("wan", str(tmp_path)) == 32
    (tmp_path / "vae" / "config.json").write_text("{}")  # Wan 2.1's VAE config has no such key: 8x
    assert spatial_multiple("wan", str(tmp_path)) == 16


TOY_INIT = '''
"""toy: a family added as one package and nothing else."""
from engine.registry.facts import Facts, Offline, training_code

FAMILY = Facts(name="toy", display="Toy 1", kind="image", joined=99, trainer="engine.families.image.toy.family:Toy",
               adapter_types=("lora", "dora"), why_not_others="toys bend", spatial_multiple=16,
               offline=(Offline("tiny-toy", "A toy.", "engine.families.image.toy.family:build"),))
__getattr__ = training_code(__name__)
'''
TOY_VIDEO_INIT = '''
"""toyvid: a video family whose VAE compresses time 8x."""
from engine.registry.facts import Facts, Offline

FAMILY = Facts(name="toyvid", display="Toy Video", kind="video", joined=98, trainer="engine.families.image.toy.family:Toy",
               temporal=8, offline=(Offline("tiny-toyvid", "A toy video.", "engine.families.image.toy.family:build"),))
'''
TOY_CODE = '''
class Toy:
    pass

def build(dest):
    pass
'''
CHILD = textwrap.dedent('''
    import sys
    from engine.config.job import load_job
    from engine.errors import JobInvalid
    from engine.families import get_family
    from engine.builtin.models import BUILTIN_MODELS
    from engine.report.model_card import FAMILY_NAMES
    cfg = load_job(sys.argv[1])
    assert cfg.model.family == "toy" and BUILTIN_MODELS["tiny-toy"].family == "toy"
    assert type(get_family("toy")).__name__ == "Toy" and FAMILY_NAMES["toy"] == "Toy 1"
    for job in sys.argv[2:]:
        try:
            load_job(job)
        except JobInvalid as e:
            print(e)
''')


def test_a_new_family_is_its_own_package_and_nothing_else(tmp_path):
    root = tmp_path / "tree"
    shutil.copytree(REPO / "engine", root / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    toy = root / "engine" / "families" / "image" / "toy"
    toy.mkdir()
    (toy / "__init__.py").write_text(TOY_INIT)
    (toy / "family.py").write_text(TOY_CODE)
    (root / "engine" / "families" / "video" / "toyvid").mkdir()
    (root / "engine" / "families" / "video" / "toyvid" / "__init__.py").write_text(TOY_VIDEO_INIT)
    data = make_images(tmp_path / "data", images=[("a.png", 32, 32, "a toy")])
    job = f"name: toy\nmodel: {{family: toy, path: builtin:tiny-toy}}\ndata: {{path: {data}}}\n"
    (tmp_path / "toy.yaml").write_text(job)
    (tmp_path / "loha.yaml").write_text(job + "lora: {type: loha}\noutput: {formats: [comfyui]}\n")
    clips = make_clips(tmp_path / "clips", [("a.mp4", 9, 32, 32, 16, "a toy")], still=False)
    (tmp_path / "vid.yaml").write_text(f"name: toyvid\nmodel: {{family: toyvid, path: builtin:tiny-toyvid}}\n"
                                       f"data: {{path: {clips}, frames: [5, 9]}}\n")
    env = child_env(PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", CHILD, *(str(tmp_path / f) for f in ("toy.yaml", "loha.yaml",
                                                                                     "vid.yaml"))],
                         capture_output=True, text=True, cwd=root, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "lora.type: loha is not supported for model.family toy (it trains lora, dora): toys bend" in out.stdout
    # the video family's own temporal factor: 5 is 4k + 1 but not 8k + 1
    assert "data.frames: 5 not 8k + 1, the windows model.family toyvid's VAE encodes (temporal factor 8)" in out.stdout


@pytest.mark.parametrize("name", ["causal_lm", "wan"])
def test_get_family_builds_the_declared_trainer(name):
    from engine.families import get_family

    family = get_family(name)
    assert all(callable(getattr(family, m)) for m in ("prepare", "load_model", "build_dataset", "loss", "export"))
