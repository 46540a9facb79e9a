"""The cross-section rules: every problem reported together, each naming its key; no rule changes a value."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from engine.config.defaults import resolve_defaults
from engine.config.job import load_job, parse_job
from engine.config.rules import RULES, problems_of
from engine.config.schema import JobConfig
from engine.errors import JobInvalid

PINS = yaml.safe_load((Path(__file__).parent / "pinned_jobs.yaml").read_text())
LM = {"name": "lm", "model": {"path": "/m/lm"}, "data": {"path": "/d/train.jsonl"}}


def test_three_cross_section_errors_are_reported_together_in_one_line_each_naming_its_key(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        **LM,
        "train": {"steps": 10, "warmup_steps": 20, "optimizer": "adamw", "optimizer_args": {"momentum": 0.9}},
        "resources": {"nodes": 2, "min_nodes": 3},
    }))
    with pytest.raises(JobInvalid) as e:
        load_job(job, check_paths=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("job.yaml: ")
    lines = msg.removeprefix("job.yaml: ").split("; ")
    assert len(lines) == 3, msg
    assert lines[0].startswith("train.warmup_steps (20) exceeds train.steps (10)")
    assert lines[1].startswith("train.optimizer_args.momentum: not an argument lorad passes to adamw")
    assert lines[2].startswith("resources.min_nodes: 3 is more than resources.nodes (2)")


def test_problems_carry_their_key_and_the_line_names_it():
    cfg = JobConfig.model_validate({**LM, "model": {"family": "flux", "path": "/m/flux"},
                                    "data": {"path": "/d/imgs", "seq_len": 64},
                                    "sample": {"width": 1000}, "output": {"formats": ["peft"]}})
    resolve_defaults(cfg)
    problems = problems_of(cfg)
    assert [p.key for p in problems] == ["data.seq_len", "output.formats", "sample.width"]
    assert all(p.message.startswith(p.key) for p in problems)


RAW_JOBS = [v["raw"] for v in PINS["jobs"].values()] + [
    {**LM, "train": {"optimizer": "adamw_schedulefree", "schedule": "cosine", "ema": {}}},
    {**LM, "train": {"optimizer": "scao", "sharding": "fsdp", "blocks_to_swap": 2}, "model": {"path": "/m",
     "quantize": "nf4", "base_precision": "int8"}},
    {**LM, "model": {"family": "flux2", "path": "/m/f2"}, "data": {"path": "/d/i", "masks": {"alpha": True}},
     "lora": {"type": "dora"}, "output": {"formats": ["comfyui"]}, "train": {"dop": {"preservation_class": "x"}}},
]


def _state(cfg: JobConfig):
    def fields_set(m):
        out = {"": set(m.model_fields_set)}
        for name in type(m).model_fields:
            sub = getattr(m, name)
            if hasattr(sub, "model_fields_set"):
                out.update({f"{name}.{k}": v for k, v in fields_set(sub).items()})
        return out
    return cfg.model_dump(mode="json"), fields_set(cfg)


@pytest.mark.parametrize("raw", RAW_JOBS, ids=range(len(RAW_JOBS)))
def test_no_rule_changes_a_value(raw):
    cfg = JobConfig.model_validate(copy.deepcopy(raw))
    resolve_defaults(cfg)
    before = _state(cfg)
    for rule in RULES:
        rule(cfg)
        assert _state(cfg) == before, rule.__name__


def test_defaults_that_depend_on_other_keys_are_resolved_before_the_rules_and_only_where_unset():
    prodigy = parse_job({**LM, "train": {"optimizer": "prodigy"}}, Path("/"), check_paths=False)
    assert prodigy.train.lr == 1.0
    assert parse_job({**LM, "train": {"optimizer": "prodigy", "lr": 0.5}}, Path("/"), check_paths=False).train.lr == 0.5
    free = parse_job({**LM, "train": {"optimizer": "adamw_schedulefree"}}, Path("/"), check_paths=False)
    assert free.train.schedule == "constant"
    flux = {**LM, "model": {"family": "flux", "path": "/m"}, "data": {"path": "/d"}}
    assert parse_job(flux, Path("/"), check_paths=False).output.formats == ["diffusers"]
    lokr = parse_job({**flux, "lora": {"type": "lokr"}}, Path("/"), check_paths=False)
    assert lokr.output.formats == ["comfyui"]
    assert parse_job(LM, Path("/"), check_paths=False).output.formats == ["peft"]


def test_the_text_encoders_own_lr_is_refused_under_fsdp_naming_both_keys_and_kept_under_ddp():
    # fully_shard replaces the parameters that carry the encoders' optimizer group: refused, not trained at train.lr
    sdxl = {**LM, "model": {"family": "sdxl", "path": "/m/sdxl"}, "data": {"path": "/d"},
            "lora": {"text_encoder": True, "text_encoder_lr": 5e-5}, "train": {"optimizer": "adamw", "lr": 1e-4}}
    ddp = parse_job(sdxl, Path("/"), check_paths=False)
    assert (ddp.train.sharding, ddp.lora.text_encoder_lr) == ("ddp", 5e-5)
    with pytest.raises(JobInvalid) as e:
        parse_job({**sdxl, "train": {**sdxl["train"], "sharding": "fsdp"}}, Path("/"), check_paths=False)
    assert str(e.value).startswith("job: lora.text_encoder_lr, train.sharding: not with train.sharding: fsdp")
    assert "leave lora.text_encoder_lr out or use train.sharding: ddp" in str(e.value)
    same_lr = parse_job({**sdxl, "lora": {"text_encoder": True}, "train": {**sdxl["train"], "sharding": "fsdp"}},
                        Path("/"), check_paths=False)
    assert same_lr.lora.text_encoder and same_lr.lora.text_encoder_lr is None
