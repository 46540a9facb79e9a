"""Each tool's configs import to a lorad job that lorad's own validator accepts, with the values the source meant,
and every source setting either carried (a comment names it) or listed as not carried over with one of the three
reasons; configs lorad cannot train are refused in one message naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.config.job import parse_job
from engine.config.reading import read_yaml
from engine.errors import JobInvalid
from engine.importers import detect, import_file, read_header
from engine.importers.table import NO_FEATURE
from tests.engine.importers.configs import CASES, REFUSED
from tests.helpers.images import make_images

# What every case states (None: the import leaves it to lorad's default): the list.
STATED = ("lora.rank", "lora.alpha", "train.lr", "train.steps", "train.batch_size", "data.resolution",
          "train.optimizer", "checkpoint.every_steps", "data.trigger", "data.path")
WHY = re.compile(rf"^({NO_FEATURE}|lorad does this another way \(.+\)|does not apply \(.+\))")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("sources")
    make_images(r / "data", [("a.png", 64, 48, "a dog"), ("b.png", 48, 64, "a dog running"), ("c.png", 40, 40, "x")])
    make_images(r / "kohya" / "10_sks dog", [("k0.png", 64, 64, None), ("k1.png", 64, 48, None)])
    make_images(r / "concepts" / "4_sks dog", [("d0.png", 64, 64, "x"), ("d1.png", 48, 64, "y")])
    make_images(r / "concepts" / "2_cat", [("c0.png", 64, 48, "z")])
    make_images(r / "reg", [("r0.png", 48, 48, "a dog"), ("r1.png", 48, 48, "a dog")])
    return r


def fill(text: str, root: Path) -> str:
    """The case's text with the images' folder in it (the JSON cases double their braces)."""
    return text.replace("{root}", str(root)).replace("{{", "{").replace("}}", "}")


def write_case(root: Path, tmp: Path, name: str, text: str, dataset) -> tuple[Path, Path | None]:
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / name
    src.write_text(fill(text, root))
    side = None
    for i, (n, t) in enumerate(dataset if isinstance(dataset, list) else [dataset] if dataset else []):
        beside = n.startswith("+")  # only beside the config, which names it: not given with --dataset
        n = n.lstrip("+")
        (tmp / n).write_text(fill(t, root))
        side = tmp / n if i == 0 and not beside else side
    return src, side


def value(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_config_imports_to_a_valid_job_with_the_values_it_meant(case, root, tmp_path):
    cid, name, text, dataset, want, dropped = case
    assert set(STATED) <= set(want), f"the case must state {sorted(set(STATED) - set(want))}"
    src, side = write_case(root, tmp_path, name, text, dataset)
    tool = cid.split("-")[0] if not cid.startswith(("ai-toolkit", "diffusion-pipe", "musubi")) else \
        "-".join(cid.split("-")[:2]) if not cid.startswith("musubi") else "musubi-tuner"
    assert detect(src.read_text(), name) == tool
    result = import_file(src, side)
    cfg = parse_job(read_yaml(result.text), src.parent, source=name)  # lorad's validator, paths checked
    job = cfg.model_dump(mode="json")
    for key, expected in want.items():
        if expected is None:  # not carried: lorad's own default stays, and the import wrote nothing there
            assert result.imported.get(key) is None, key
            continue
        expected = fill(expected, root) if isinstance(expected, str) else expected
        assert value(job, key) == expected, key
    got = {src_key for src_key, _, _ in result.imported.dropped}
    assert got == dropped, f"extra: {sorted(got - dropped)}; missing: {sorted(dropped - got)}"
    for src_key, _, why in result.imported.dropped:
        assert WHY.match(why), (src_key, why)
    # every key of the job file says where it came from, and the header lists what was not carried over
    body = [ln for ln in result.text.splitlines() if ln and not ln.startswith("#")]
    leaves = [ln for ln in body if not ln.rstrip().endswith(":")]
    assert all("  # from " in ln for ln in leaves), [ln for ln in leaves if "# from" not in ln]
    h = read_header(result.text)
    assert h.tool == tool and len(h.dropped) == len(dropped)
    assert all(" — " in line for line in h.dropped)


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_config_lorad_cannot_train_is_refused_in_one_line_naming_the_key(case, root, tmp_path):
    cid, name, text, dataset, pattern = case
    src, side = write_case(root, tmp_path, name, text, dataset)
    with pytest.raises(JobInvalid) as e:
        import_file(src, side)
    msg = str(e.value)
    assert "\n" not in msg and re.search(pattern, msg), msg


def test_model_names_map_to_their_families_and_the_unknown_to_none():
    from engine.importers.common import family_of_name

    assert [family_of_name(n) for n in ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.2-dev",
                                        "Qwen/Qwen-Image", "Tongyi-MAI/Z-Image-Turbo", "lodestones/Chroma",
                                        "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "builtin:tiny-flux",
                                        "stabilityai/stable-diffusion-xl-base-1.0", "Laxhar/noobai-XL-Vpred-1.0",
                                        "stable-diffusion-v1-5/stable-diffusion-v1-5", "Qwen/Qwen-Image-2.1",
                                        "Qwen/Qwen-Image-2512")] == \
        ["flux", "flux2", "qwen_image", "z_image", "chroma", "wan", "flux", "sdxl", "sdxl", None, "qwen_image_21",
         "qwen_image"]


ODD = [  # the right kind of file, the wrong shape inside: one line each, never a traceback
    ("a.yaml", "job: extension\nconfig:\n  process: []\n"),
    ("a.yaml", "job: extension\nconfig:\n  process:\n    - network: x\n      model: 3\n      datasets: 5\n"),
    ("a.yaml", "job: extension\nconfig:\n  process:\n    - model: {name_or_path: [1, 2]}\n      train: {lr: abc}\n"),
    ("k.toml", "pretrained_model_name_or_path = 5\nnetwork_args = 3\nnetwork_dim = 'x'\nmax_train_epochs = 2\n"),
    ("k.toml", "[[datasets]]\nsubsets = 3\n"),
    ("o.json", '{"model_type": 5, "training_method": "LORA", "concepts": "x", "samples": 7}'),
    ("s.json", '{"--model_family": ["flux"], "--lora_rank": "a"}'),
    ("d.toml", "dataset = 5\n[model]\ntype = 'flux'\n[adapter]\nrank = 'x'\n"),
    ("c.sh", "python flux_train_network.py --network_dim --resolution 512,512,512 --max_train_epochs x"),
]


@pytest.mark.parametrize("name,text", ODD, ids=[f"{i}-{n}" for i, (n, _) in enumerate(ODD)])
def test_a_config_of_an_odd_shape_is_one_line_never_a_traceback(name, text, tmp_path):
    from engine.importers import import_text

    with pytest.raises(JobInvalid) as e:
        import_text(text, name, tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{name}: ")
