"""Defaults that depend on other keys: the one place where validation fills in a value the job file left out.

parse_job calls resolve_defaults once, after pydantic's validation and before the cross-section rules
(engine/config/rules.py), which only read. Each default applies only where the job file leaves the key out, and
dump_job then writes it, so jobs/ID/job.yaml holds the value the run used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config.declare import IMAGE_FAMILIES

if TYPE_CHECKING:
    from engine.config.schema import JobConfig


def resolve_defaults(cfg: JobConfig) -> None:
    train = cfg.train
    if train.optimizer == "prodigy" and "lr" not in train.model_fields_set:
        train.lr = 1.0  # Prodigy's lr scales its own step-size estimate: 1.0 is its default
    if train.optimizer == "adamw_schedulefree" and "schedule" not in train.model_fields_set:
        train.schedule = "constant"  # it replaces the decaying schedule with iterate averaging
    if cfg.model.family in IMAGE_FAMILIES and "formats" not in cfg.output.model_fields_set:
        # the family-aware default; diffusers' load_lora_weights reads LoRA and DoRA only
        cfg.output.formats = ["comfyui"] if cfg.lora.type in ("lokr", "loha") else ["diffusers"]
