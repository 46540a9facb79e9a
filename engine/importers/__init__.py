"""Importers: another trainer's job (ai-toolkit, kohya sd-scripts / musubi-tuner, OneTrainer, SimpleTuner,
diffusion-pipe) turned into a lorad job file, every setting either mapped (with a comment saying where it came
from) or listed as not carried over, with why.

Owns: recognising a format (`detect`), one module per tool, each with its one mapping table (table.py's `Key`
rows) from which both the import and docs/coming-from.md (docs.py) are made, and writing the job (writing.py).
`lorad import` and `lorad check` (daemon/client/) and the daemon's intake call `import_text` / `import_file`; the
job it writes is validated by lorad's own validator (engine/config/job.py), nothing here validates twice.
Torch-free: the thin client imports it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from engine.config.reading import MAX_JOB_FILE_BYTES, YamlProblem, read_yaml
from engine.errors import JobInvalid
from engine.importers import ai_toolkit, diffusion_pipe, kohya, kohya_dataset, onetrainer, simpletuner
from engine.importers.table import Context, Imported
from engine.importers.writing import Header, header_text, read_header, to_yaml

__all__ = ["FORMATS", "ImportResult", "Header", "detect", "import_file", "import_text", "read_header",
           "header_text", "is_foreign_name"]

# The formats `lorad import` reads, as they are named in messages, job headers and `lorad status`.
FORMATS = {
    "ai-toolkit": "ai-toolkit YAML (job: extension)",
    "kohya": "kohya sd-scripts (dataset TOML, --config_file TOML, saved command line)",
    "musubi-tuner": "musubi-tuner (dataset TOML, --config_file TOML, saved command line)",
    "onetrainer": "OneTrainer preset JSON (+ concepts/samples JSON)",
    "simpletuner": "SimpleTuner config.json (+ multidatabackend.json)",
    "diffusion-pipe": "diffusion-pipe TOML (+ dataset TOML)",
}
# File names the daemon's inbox takes as another trainer's config (besides YAML, which is looked into).
FOREIGN_SUFFIXES = (".toml", ".json")


def is_foreign_name(name: str) -> bool:
    return name.lower().endswith(FOREIGN_SUFFIXES)


def known_formats() -> str:
    return "; ".join(FORMATS.values())


@dataclass
class Parsed:
    kind: str  # "yaml", "json", "toml", "command line"
    doc: Any


def _parse(text: str, name: str) -> Parsed:
    """The text as the data its name (or, failing that, its content) says; JobInvalid when it is none of them."""
    low = name.lower()
    tries = (["json"] if low.endswith(".json") else ["toml"] if low.endswith(".toml") else
             ["yaml"] if low.endswith((".yaml", ".yml")) else ["command line"] if low.endswith(
                 (".sh", ".bat", ".ps1", ".cmd", ".txt")) else ["json", "toml", "yaml", "command line"])
    last = "empty"
    for kind in tries:
        try:
            if kind == "json":
                return Parsed(kind, json.loads(text))
            if kind == "toml":
                return Parsed(kind, tomllib.loads(text))
            if kind == "yaml":
                return Parsed(kind, read_yaml(text, max_aliases=100))
            script, args = kohya.parse_command_line(text)
            if script is None:
                raise ValueError("no training script (X_train_network.py) on it")
            return Parsed(kind, (script, args))
        except (ValueError, YamlProblem, tomllib.TOMLDecodeError, RecursionError) as e:
            last = " ".join(str(e).split())[:200]
    raise JobInvalid(f"{name}: not {' or '.join(tries)} ({last}); lorad import reads {known_formats()}")


def detect(text: str, name: str) -> str | None:
    """The FORMATS name of a text that another trainer wrote; None for a lorad job or anything unknown."""
    try:
        p = _parse(text, name)
    except JobInvalid:
        return None
    return _detect(p)


def _detect(p: Parsed) -> str | None:
    if p.kind == "command line":
        return kohya.MUSUBI if p.doc[0] in kohya.MUSUBI_SCRIPTS else kohya.NAME
    d = p.doc
    if ai_toolkit.detect(d):
        return ai_toolkit.NAME
    if onetrainer.detect(d):
        return onetrainer.NAME
    if simpletuner.detect(d):
        return simpletuner.NAME
    if diffusion_pipe.detect(d):
        return diffusion_pipe.NAME
    if p.kind != "toml":  # kohya's configs are TOML only: a lorad job's train.learning_rate is no kohya key
        return None
    if kohya_dataset.is_dataset_toml(d):
        return kohya.MUSUBI if kohya_dataset.is_musubi_dataset(d) else kohya.NAME
    if kohya.is_config_toml(d):
        return kohya.MUSUBI if "dit" in kohya.config_flat(d) else kohya.NAME
    return None


def bounded_reader(allowed: Callable[[Path], bool] | None = None) -> Callable[[Path], str]:
    """A side file's text (a dataset TOML, concepts.json, ...): a regular file, under the job file size cap, UTF-8,
    and, with `allowed`, only where it says (the daemon: its allowed roots)."""
    def read(path: Path) -> str:
        if allowed is not None and not allowed(path):
            raise OSError(f"{path} is outside the allowed roots; not read")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")
            if st.st_size > MAX_JOB_FILE_BYTES:
                raise OSError(f"{path} is larger than {MAX_JOB_FILE_BYTES} bytes")
            data = os.read(fd, MAX_JOB_FILE_BYTES + 1)
        finally:
            os.close(fd)
        return data.decode("utf-8", errors="replace")
    return read


@dataclass
class ImportResult:
    imported: Imported
    text: str  # the lorad job file, with its header and comments

    @property
    def tool(self) -> str:
        return self.imported.tool


def import_text(text: str, name: str, base_dir: Path, dataset: tuple[str, str] | None = None,
                read: Callable[[Path], str] | None = None) -> ImportResult:
    """Another trainer's config (its text and file name) as a lorad job; paths resolved against base_dir.

    dataset: (text, name) of the dataset file given beside it (kohya/musubi dataset TOML, diffusion-pipe's dataset
    TOML, SimpleTuner's backends JSON, OneTrainer's concepts JSON). JobInvalid, one line naming every key, when
    it is not a known format or a key stops it; the job itself is validated by the caller (engine/config/job.py).
    """
    p = _parse(text, name)
    if p.kind == "yaml" and not isinstance(p.doc, dict):
        raise JobInvalid(f"{name}: a YAML {type(p.doc).__name__}, not a mapping; lorad import reads {known_formats()}")
    tool = _detect(p)
    if tool is None:
        raise JobInvalid(f"{name}: not a format lorad import knows; it reads {known_formats()}")
    out = Imported(tool=tool, source=name)
    ctx = Context(source={}, base_dir=base_dir, read=read or bounded_reader())
    ctx.job, ctx.origin = out.job, out.origin
    side = _parse(dataset[0], dataset[1]).doc if dataset is not None else None
    try:
        _read(p, tool, name, side, ctx, out)
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        # a config of the right kind whose shape is not the tool's (a list where a table is, ...): one line
        raise JobInvalid(f"{name}: not a {tool} config of a shape lorad can read ({type(e).__name__}: {e})") from None
    out.notes += ctx.notes
    out.dropped += ctx.dropped
    _finish(out)
    if out.problems:
        raise JobInvalid(f"{name}: " + "; ".join(dict.fromkeys(out.problems)))
    return ImportResult(out, to_yaml(out))


def _read(p: Parsed, tool: str, name: str, side: Any, ctx: Context, out: Imported) -> None:
    if p.kind == "command line":
        script, args = p.doc
        cfg = dict(args)
        if "config_file" in cfg:  # the TOML first, the command line's own arguments over it (as sd-scripts)
            try:
                cfg = {**kohya.config_flat(tomllib.loads(ctx.read(Path(ctx.base_dir / str(cfg["config_file"]))))),
                       **cfg}
            except (OSError, ValueError) as e:
                out.problems.append(f"config_file: {args['config_file']} could not be read ({e})")
            cfg.pop("config_file", None)
        _kohya(script, cfg, side, ctx, out)
    elif tool in (kohya.NAME, kohya.MUSUBI):
        if kohya_dataset.is_dataset_toml(p.doc):
            out.problems.append(f"a dataset config only, naming no model: import the training config (--config_file "
                                f"TOML or its command line) with --dataset {name}")
            kohya.read({}, None, p.doc, ctx, out)
        else:
            _kohya(None, kohya.config_flat(p.doc), side, ctx, out)
    elif tool == ai_toolkit.NAME:
        ai_toolkit.read(p.doc, ctx, out)
    elif tool == onetrainer.NAME:
        concepts = side if isinstance(side, list) else None
        onetrainer.read(p.doc, ctx, out, concepts=concepts)
    elif tool == simpletuner.NAME:
        simpletuner.read(p.doc, ctx, out, backends=side if isinstance(side, list) else None)
    elif tool == diffusion_pipe.NAME:
        diffusion_pipe.read(p.doc, ctx, out, dataset=side if isinstance(side, dict) else None)


def _kohya(script: str | None, cfg: dict[str, Any], side: Any, ctx: Context, out: Imported) -> None:
    dataset = side if isinstance(side, dict) else None
    if dataset is None and cfg.get("dataset_config"):
        try:
            dataset = tomllib.loads(ctx.read(ctx.base_dir / str(cfg["dataset_config"])))
        except (OSError, ValueError) as e:
            out.problems.append(f"dataset_config: {cfg['dataset_config']} could not be read ({e}); "
                                "give it with --dataset")
    kohya.read(cfg, script, dataset, ctx, out)


def _finish(out: Imported) -> None:
    """What every import needs besides its table: a name, a family, a model; the note on the model."""
    from engine.config.paths import looks_like_hub_id
    from engine.importers.common import family_of_name

    if "name" not in out.job:
        stem = Path(out.source).stem
        out.set("name", "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in stem).strip("-._")[:64]
                or "imported", f"the file name {out.source}")
    mp = out.get("model.path")
    if mp is None and not any("model.path: " in p for p in out.problems):  # its refusal says it already
        out.problems.append("model: the source names no base model (set model.path)")
    refused = any("unsupported model family" in p for p in out.problems)
    if out.get("model.family") is None and mp is not None and not refused:
        fam = family_of_name(str(mp))
        if fam is None:
            out.problems.append(f"model: cannot tell the model family of {mp!r}; set model.family")
        else:
            out.set("model.family", fam, f"the model name {mp}")
    if mp is not None and looks_like_hub_id(str(mp)) and not Path(str(mp)).exists():
        out.notes.append(f"model: {mp} is a hub id; it was not looked at (offline is fine), the trainer fetches it")
    if out.get("data.path") is None:
        out.problems.append("data: the source names no image folder (set data.path, or give the dataset file "
                            "with --dataset)")


def import_file(path: Path, dataset: Path | None = None, read: Callable[[Path], str] | None = None) -> ImportResult:
    """`lorad import FILE [--dataset FILE]`: the same, reading the files (bounded)."""
    read = read or bounded_reader()
    try:
        text = read(path)
    except OSError as e:
        raise JobInvalid(f"{path.name}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    side = None
    if dataset is not None:
        try:
            side = (read(dataset), dataset.name)
        except OSError as e:
            raise JobInvalid(f"--dataset {dataset}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    return import_text(text, path.name, path.parent.resolve(), side, read)
