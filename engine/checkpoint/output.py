"""The final adapter in output/, committed like a checkpoint: written aside, made durable, renamed into place.

output/ carries a stamp with the step it holds and the job's identity, so that a run whose `steps` was raised
after the job finished, and that died between its final checkpoint and its export, exports again instead of
calling the older adapter done.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from engine.config.job import JobConfig
from engine.report import model_card as card
from engine.storage.fsio import FileLayer, normal_file_mode
from engine.training.ema import AdapterEMA

OUTPUT_STAMP = "lorad-output.json"  # in output/: the step and settings the adapter was exported from


def output_step(workdir: Path, cfg: JobConfig) -> int | None:
    """The step output/ holds, if it was exported from this job's settings; None if absent, foreign or unreadable."""
    try:
        stamp = json.loads((workdir / "output" / OUTPUT_STAMP).read_text())
        return int(stamp["step"]) if stamp.get("config_hash") == cfg.identity_hash() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_output(family, model, cfg: JobConfig, workdir: Path, fs: FileLayer, meta: dict[str, Any], log,
                  ema: AdapterEMA | None = None) -> Path:
    """Write the final adapter to output.tmp-*, make it durable, and rename it to output/."""
    out = workdir / "output"
    # Leftovers of exports killed half-way (one trainer per job directory, so none is in use).
    for stale in workdir.glob("output.tmp-*"):
        fs.rmtree(stale)
    tmp = workdir / f"output.tmp-{os.getpid()}"
    fs.mkdir(tmp)
    raw = []
    if ema is not None and cfg.train.ema.export_raw:
        fs.mkdir(tmp / "raw")
        raw = [f"raw/{n}" for n in family.export(model, cfg, tmp / "raw", meta)]
    with ema.swapped_in() if ema is not None else nullcontext():  # train.ema: the average is the output
        names = family.export(model, cfg, tmp, meta)
    samples = _copy_samples(workdir, tmp, meta["steps"], fs)
    about = card.facts(cfg, meta, names, samples, meta.get("dataset_size"))
    fs.write(tmp / "README.md", [card.model_card(cfg, about).encode()])  # over peft's empty template
    fs.write(tmp / OUTPUT_STAMP, [json.dumps({"step": meta["steps"], "config_hash": cfg.identity_hash(), **about},
                                             indent=1).encode()])
    names = list(dict.fromkeys([*names, *raw, *samples, "README.md", OUTPUT_STAMP]))  # peft's export has a README.md
    mode = normal_file_mode()
    for name in names:
        log.info("heartbeat", phase="export", file=name)  # fsyncing a large file on a slow disk takes a while
        if (tmp / name).is_file():
            # safetensors creates its files 0600; the adapter must be as readable as anything else the user
            # writes (the service's group shares job directories through its umask).
            os.chmod(tmp / name, mode)
            fs.fsync(tmp / name)
    for sub in ("raw", "samples"):
        if (tmp / sub).is_dir():
            fs.fsync_dir(tmp / sub)
    fs.fsync_dir(tmp)
    if out.exists():
        shutil.rmtree(out)
    fs.rename(tmp, out)
    fs.fsync_dir(workdir)
    return out


def _copy_samples(workdir: Path, tmp: Path, step: int, fs: FileLayer) -> list[str]:
    """The newest samples (at most the card's four) into output/samples/, so the card shows them; their names."""
    found = card.newest_samples(workdir, step)
    if not found:
        return []
    fs.mkdir(tmp / "samples")
    for p in found:
        fs.write(tmp / "samples" / p.name, [p.read_bytes()])
    return [f"samples/{p.name}" for p in found]
