"""model.assistant_lora: a LoRA lorad trained on builtin:tiny-z-image, merged into the frozen base of a second job.

The second job's base weights are the base's plus the assistant's update; its files hold its own adapter only; a
run killed twice (real processes, SIGKILL while caching and while saving) ends bit-identical to one that was not;
the assistant's file is part of the job's identity; a LoRA that does not fit is refused in one line naming
model.assistant_lora and the key.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from engine.config.job import load_job
from engine.errors import JobInvalid
from tests.helpers.images import make_images, tensor_bytes
from tests.helpers.jobs import deep_update
from tests.helpers.kill_chain import Quiet, chains_beside_references

IMAGES = [("wide-0.png", 48, 24, "a red square on grass"), ("square-0.png", 32, 32, "a yellow sun")]
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
COMFY_FILE = "z_image_lora_comfyui.safetensors"


def _job(base: Path, data: Path, **over) -> dict:
    d = {"name": "tiny-z-image", "model": {"family": "z_image", "path": str(base), "dtype": "float32"},
         "lora": {"rank": 4, "alpha": 8},
         "data": {"path": str(data), "resolution": [32], "trigger": "sks", "caption_dropout": 0.3, "flip": True},
         "train": {"steps": 4, "batch_size": 2, "lr": 0.01, "schedule": "constant", "optimizer": "adamw", "seed": 3},
         "checkpoint": {"every_steps": 2, "every_seconds": None, "keep": 2},
         "output": {"formats": ["diffusers", "comfyui"]}}
    return deep_update(d, over)


def _write(path: Path, d: dict) -> Path:
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_image_model):
    """(base dir, the assistant's output folder, the assisted job file, its uninterrupted workdir, its killed-twice
    future). The assistant is a 2-step lorad LoRA at a high learning rate, so that its update is far from zero."""
    from engine.recipe import train

    root = tmp_path_factory.mktemp("assistant")
    model, data = tiny_image_model("z_image"), make_images(root / "data", IMAGES)
    first = _write(root / "assistant.yaml", _job(model, data, name="assistant", train={"steps": 2, "lr": 0.05},
                                                 output={"formats": ["diffusers"]}))
    assert train(load_job(first), root / "assistant", progress="none") == 0
    helper = root / "assistant" / "output"
    job = _write(root / "assisted.yaml", _job(model, data, model={"assistant_lora": str(helper)}))
    with chains_beside_references(root, {"assisted": (job, job)}) as done:
        yield model, helper, job, *done["assisted"]


def _assisted_model(job: Path, workdir: Path):
    from engine.families import get_family

    return get_family("z_image").load_model(load_job(job), workdir, torch.device("cpu"), Quiet())


def test_the_assisted_jobs_base_is_the_base_plus_the_assistants_update(runs):
    from diffusers import ZImageTransformer2DModel

    model, helper, job, reference, _ = runs
    base = ZImageTransformer2DModel.from_pretrained(model, subfolder="transformer").state_dict()
    lora = load_file(str(helper / DIFFUSERS_FILE))  # alpha / r folded into lora_B, metadata lora_alpha = r
    want = dict(base)
    for k in lora:
        if k.endswith(".lora_A.weight"):
            name = k.removeprefix("transformer.").removesuffix(".lora_A.weight") + ".weight"
            want[name] = base[name] + lora[k.replace("lora_A", "lora_B")] @ lora[k]
    got = {k.replace(".base_layer", ""): v for k, v in _assisted_model(job, reference).state_dict().items()
           if ".lora_" not in k}
    assert sorted(got) == sorted(base)
    changed = [k for k in base if not torch.equal(base[k], want[k])]
    assert len(changed) == len(lora) // 2 > 0  # every module the assistant names moved
    for k in base:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.parametrize("family", ["flux2", "qwen_image", "krea2", "qwen_image_21"])
def test_the_other_families_merge_an_assistant_through_their_own_loaders(family, tiny_image_model, tmp_path):
    """FLUX.2 (klein), Qwen-Image, Krea 2 and Qwen-Image 2.1: a diffusers-format LoRA on two of the family's default targets,
    read by that pipeline's lora_state_dict and merged: each named weight moves by exactly B·A, nothing else."""
    from engine.families import get_family

    model = tiny_image_model(family)
    fam = get_family(family)
    cls = fam.model.transformer_class()
    base = cls.from_pretrained(model, subfolder="transformer").state_dict()
    targets = [n.removesuffix(".weight") for n in base
               if re.fullmatch(fam.model.default_targets, n.removesuffix(".weight"))][:2]
    g = torch.Generator().manual_seed(0)
    sd = {}
    for t in targets:
        out, inp = base[f"{t}.weight"].shape
        sd[f"transformer.{t}.lora_A.weight"] = torch.randn(2, inp, generator=g)
        sd[f"transformer.{t}.lora_B.weight"] = torch.randn(out, 2, generator=g) / 4
    save_file(sd, str(tmp_path / "helper.safetensors"))
    job = _write(tmp_path / "job.yaml", _job(model, make_images(tmp_path / "data", IMAGES[:1]), model={
        "family": family, "assistant_lora": str(tmp_path / "helper.safetensors")}))
    got = {k.replace(".base_layer", ""): v for k, v in
           fam.load_model(load_job(job), tmp_path, torch.device("cpu"), Quiet()).state_dict().items() if ".lora_" not in k}
    assert len(targets) == 2 and sorted(got) == sorted(base)
    for k in base:
        t = k.removesuffix(".weight")
        want = base[k] + sd[f"transformer.{t}.lora_B.weight"] @ sd[f"transformer.{t}.lora_A.weight"] \
            if t in targets else base[k]
        torch.testing.assert_close(got[k], want, rtol=0, atol=1e-5, msg=k)
        assert (t in targets) != torch.equal(got[k], base[k]), k


def test_fp8_quantises_the_merged_weights(runs, tmp_path):
    """base_precision: fp8 quantises the base after the merge: an FP8 layer holds the merged weight's quantisation."""
    from engine.frozen_base.fp8 import FP8Linear, quantize_weight_rows

    _model, _helper, job, reference, _ = runs
    merged = _assisted_model(job, reference).layers[0].attention.to_q.base_layer.weight.detach()
    d = deep_update(yaml.safe_load(job.read_text()), {"model": {"base_precision": "fp8"}})
    fp8 = _assisted_model(_write(tmp_path / "fp8.yaml", d), tmp_path).layers[0].attention.to_q.base_layer
    assert isinstance(fp8, FP8Linear)
    w8, scale = quantize_weight_rows(merged)
    assert torch.equal(fp8.weight.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(fp8.weight_scale, scale)


def test_the_exported_files_hold_only_the_jobs_own_adapter(runs):
    from engine.config.assistant import assistant_sha256

    _model, helper, job, reference, _ = runs
    ckpt = sorted((reference / "checkpoints").glob("step-*"))[-1]
    own = load_file(str(ckpt / "adapter.safetensors"))  # the trainable parameters: lorad's adapter alone
    out = load_file(str(reference / "output" / DIFFUSERS_FILE))
    assistant = load_file(str(helper / DIFFUSERS_FILE))
    assert sorted(out) == sorted(assistant)  # the same targets, one adapter's worth of keys
    a_keys = sorted(k for k in out if k.endswith(".lora_A.weight"))
    own_a = sorted(k for k in own if ".lora_A." in k)
    assert len(a_keys) == len(own_a) > 0
    for k in a_keys:  # lora_A is written unscaled: it is the trained factor, not the assistant's
        trained = next(v for n, v in own.items() if n.endswith(k.removeprefix("transformer.").replace(
            ".lora_A.weight", ".lora_A.default.weight")))
        assert torch.equal(out[k], trained), k
        assert not torch.equal(out[k], assistant[k]), k
    comfy = load_file(str(reference / "output" / COMFY_FILE))
    assert len([k for k in comfy if k.endswith(".lora_A.weight")]) == len(a_keys)
    card = (reference / "output" / "README.md").read_text()
    assert str(helper) not in card and "assistant" not in card.lower()
    assert assistant_sha256(str(helper)) not in card


def test_killed_twice_and_resumed_is_bit_identical_with_an_assistant(runs):
    *_, reference, killed = runs
    wd, story = killed.result(timeout=600)
    for name in (DIFFUSERS_FILE, COMFY_FILE):
        want, got = tensor_bytes(reference / "output" / name), tensor_bytes(wd / "output" / name)
        assert sorted(want) == sorted(got)
        assert [k for k in want if want[k] != got[k]] == [], f"{name} differs; {story}"


def test_the_assistants_content_is_the_jobs_identity(runs, tmp_path):
    _model, helper, job, *_ = runs
    copy = tmp_path / "helper"
    shutil.copytree(helper, copy)
    d = yaml.safe_load(job.read_text())
    d["model"]["assistant_lora"] = str(copy)
    same = load_job(_write(tmp_path / "same.yaml", d))
    plain = load_job(_write(tmp_path / "plain.yaml", {**d, "model": {**d["model"], "assistant_lora": None}}))
    h = same.identity_hash()
    assert h == load_job(job).identity_hash() != plain.identity_hash()  # the content counts, not the path
    sd = load_file(str(copy / DIFFUSERS_FILE))
    k = next(iter(sd))
    sd[k] = sd[k] * 2
    save_file(sd, str(copy / DIFFUSERS_FILE))
    assert load_job(tmp_path / "same.yaml").identity_hash() != h


def _refusal(runs, tmp_path, sd: dict[str, torch.Tensor]) -> str:
    _model, _helper, job, reference, _ = runs
    save_file(sd, str(tmp_path / "bad.safetensors"))
    d = yaml.safe_load(job.read_text())
    d["model"]["assistant_lora"] = str(tmp_path / "bad.safetensors")
    with pytest.raises(JobInvalid) as e:
        _assisted_model(_write(tmp_path / "bad.yaml", d), tmp_path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_assistant_whose_shapes_differ_is_refused_naming_the_key(runs, tmp_path):
    sd = load_file(str(runs[1] / DIFFUSERS_FILE))
    k = sorted(x for x in sd if x.endswith(".lora_A.weight"))[0]
    sd[k] = torch.zeros(sd[k].shape[0], sd[k].shape[1] + 8)
    msg = _refusal(runs, tmp_path, sd)
    assert msg.startswith("model.assistant_lora:") and k in msg and "shape" in msg


def test_an_assistant_for_another_model_is_refused_naming_the_key(runs, tmp_path):
    k = "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight"  # a FLUX.1 module name
    msg = _refusal(runs, tmp_path, {k: torch.zeros(4, 32), k.replace("lora_A", "lora_B"): torch.zeros(32, 4)})
    assert msg.startswith("model.assistant_lora:") and k in msg and "no module" in msg


@pytest.mark.parametrize("over, words", [
    ({"model": {"base_precision": "nf4"}}, ["model.assistant_lora", "nf4"]),
    ({"model": {"family": "chroma", "path": "builtin:tiny-chroma"}}, ["model.assistant_lora", "chroma"]),
    ({"model": {"assistant_lora": "/nowhere/helper.safetensors"}}, ["model.assistant_lora", "does not exist"]),
])
def test_an_assistant_the_job_cannot_merge_is_refused_at_submit(runs, tmp_path, over, words):
    d = deep_update(yaml.safe_load(runs[2].read_text()), over)
    with pytest.raises(JobInvalid) as e:
        load_job(_write(tmp_path / "job.yaml", d))
    assert all(w in str(e.value) for w in words), str(e.value)
