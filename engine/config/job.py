"""The job file: reading, validating and writing a JobConfig (engine/config/schema.py).

Validation, in order: pydantic checks every section's keys and values (each section's own validators beside its
fields); defaults that depend on other keys are resolved (defaults.py); the cross-section rules (rules.py) run.
Every problem of a step is reported together, one `; `-separated line naming each key; a later step runs only
when the earlier ones found nothing. Relative paths are then resolved against the job file's directory so the
normalised job (written to jobs/ID/job.yaml) is self-contained, and checked (paths.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from engine.config import paths
from engine.config.declare import drop_other_families, drop_quiet_defaults
from engine.config.defaults import resolve_defaults
from engine.config.describe import describe_errors
from engine.config.policy import JobPolicy
from engine.config.reading import MAX_JOB_FILE_BYTES, decode_job_bytes, load_yaml_text
from engine.config.rules import problems_of
from engine.config.schema import JobConfig
from engine.errors import JobInvalid


def _section_models() -> dict[str, type[BaseModel]]:
    """The top and each section it holds directly: where an unknown key's neighbours are looked up."""
    out: dict[str, type[BaseModel]] = {"": JobConfig}
    for name, field in JobConfig.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = ann
    return out


def parse_job(raw: Any, base_dir: Path, source: str = "job", check_paths: bool = True) -> JobConfig:
    """Validate a parsed YAML document and resolve its paths; raise JobInvalid naming every problem.

    check_paths=False validates the schema only (documentation jobs whose model lives on another machine).
    """
    if raw is None:
        raise JobInvalid(f"{source}: the job file is empty (it needs at least name, model and data)")
    if not isinstance(raw, dict):
        raise JobInvalid(f"{source}: the job file must be a YAML mapping of sections (name, model, data, ...), got {type(raw).__name__}")
    try:
        cfg = JobConfig.model_validate(raw)
    except ValidationError as e:
        raise JobInvalid(f"{source}: {describe_errors(e, _section_models())}") from None
    resolve_defaults(cfg)
    if problems := problems_of(cfg):
        raise JobInvalid(f"{source}: {'; '.join(dict.fromkeys(p.message for p in problems))}")
    paths.resolve_paths(cfg, base_dir)
    if check_paths:
        paths.check_paths(cfg)
    return cfg



def load_job(path: str | Path, check_paths: bool = True, policy: JobPolicy | None = None) -> JobConfig:
    """Read, size-check, safely parse and validate a job file; with a policy (a daemon's trainer), check it first."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise JobInvalid(f"{path}: cannot read the job file: {e.strerror}") from None
    if size > MAX_JOB_FILE_BYTES:
        raise JobInvalid(f"{path}: job file is {size} bytes, larger than the {MAX_JOB_FILE_BYTES}-byte limit")
    text = decode_job_bytes(path.read_bytes(), path.name)
    raw = load_yaml_text(text, str(path.name))
    if policy is not None and isinstance(raw, dict):
        policy.check(raw, path.parent.resolve())
    cfg = parse_job(raw, path.parent.resolve(), source=path.name, check_paths=check_paths)
    if policy is not None:
        policy.check_parsed(cfg)
    return cfg


def dump_job(cfg: JobConfig) -> str:
    """The normalised job (absolute paths, defaults filled in) as YAML; load_job reads it back unchanged."""
    d = cfg.model_dump(mode="json")
    # The other families' keys stay out: they only hold defaults here, and written out they would be refused
    # (rules.keys_are_for_the_family) when the trainer reads jobs/ID/job.yaml back.
    drop_other_families(JobConfig, d, cfg.model.family)
    drop_quiet_defaults(JobConfig, d)
    return yaml.safe_dump(d, sort_keys=False)
