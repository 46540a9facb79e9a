"""JobConfig: a job's sections together, and what of them is its identity (what decides the trained weights).

Each section lives in its own module, its validators beside its fields; the cross-section rules are in rules.py,
reading and writing a job file in job.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import Field, field_validator

from engine.config.assistant import assistant_sha256
from engine.config.caption_edits import identity_hash, with_edits
from engine.config.checkpoint import CheckpointConfig
from engine.config.data import DataConfig
from engine.config.declare import IMAGE_FAMILIES, Strict, identity_part, key
from engine.config.lora import LoraConfig
from engine.config.model import ModelConfig
from engine.config.output import LoggingConfig, OutputConfig
from engine.config.resources import PowerConfig, ResourcesConfig
from engine.config.sample import SampleConfig
from engine.config.train import TrainConfig
from engine.errors import JobInvalid

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class JobConfig(Strict):
    name: str
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    # Not identity: the checkpoint cadence, outputs, power, priority, samples, logging and the devices may change
    # between attempts without invalidating a checkpoint.
    checkpoint: CheckpointConfig = key(default_factory=CheckpointConfig, identity=False)
    output: OutputConfig = key(default_factory=OutputConfig, identity=False)
    power: PowerConfig = key(default_factory=PowerConfig, identity=False)
    logging: LoggingConfig = key(default_factory=LoggingConfig, identity=False)
    priority: int = key(0, ge=-1000, le=1000, identity=False)
    sample: SampleConfig = key(default_factory=SampleConfig, families=IMAGE_FAMILIES, identity=False)
    resources: ResourcesConfig = key(default_factory=ResourcesConfig, identity=False)

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    def deprecated_keys(self) -> list[tuple[str, str]]:
        """(key, what to write instead) for every deprecated key this job sets; the engine warns about each."""
        if self.model.quantize is not None:
            return [("model.quantize", f"model.base_precision: {self.model.quantize}")]
        return []

    def identity_hash(self) -> str:
        """Hash of everything that decides the trained weights.

        What may change between attempts without invalidating a checkpoint is declared on its field
        (key(identity=False)). Keys at their default value are left out, so a lorad upgrade that adds
        a key (with a default that keeps the old behaviour) does not strand every checkpoint written before it.
        """
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]

    def identity(self) -> dict[str, Any]:
        """The settings identity_hash covers, as a dict (checkpoints keep it to say what changed)."""
        d = identity_part(JobConfig, self.model_dump(mode="json", exclude_defaults=True))
        # What decides the weights is the global batch, not how it is split (train.grad_accum is not identity).
        if (g := self.global_batch()) != self.train.batch_size:
            d.setdefault("train", {})["global_batch"] = g
        # model.assistant_lora's weights decide the merged base: a local file is its content (moved or renamed, the
        # same job), a hub id its repo id and assistant_lora_revision as written.
        if self.model.assistant_lora is not None:
            try:
                sha = assistant_sha256(self.model.assistant_lora)
            except (JobInvalid, OSError):
                sha = "unreadable"  # gone since the job was accepted: its checkpoints no longer match it
            if sha is not None:
                d["model"]["assistant_lora"] = f"sha256:{sha}"
        return d

    def identity_at(self, workdir) -> dict[str, Any]:
        """CheckpointStore's config_hash and identity: the job's, with the caption edits its caption stage applies
        (engine/config/caption_edits.py); without edits, exactly identity_hash()."""
        if self.data.caption_mode == "files":
            return {"config_hash": self.identity_hash(), "identity": self.identity()}
        identity = with_edits(self.identity(), workdir)
        return {"config_hash": identity_hash(identity), "identity": identity}

    def processes(self) -> int:
        """The world size the job is written for: resources.gpus × resources.nodes."""
        return self.resources.gpus * self.resources.nodes

    def global_batch(self) -> int:
        """Samples per optimizer step: batch_size × grad_accum × resources.gpus × resources.nodes."""
        return self.train.batch_size * self.train.grad_accum * self.processes()
