"""A job's paths: made absolute against the job file's directory, then checked to exist and hold the right data."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from engine.builtin.models import BUILTIN_MODELS, BUILTIN_PREFIX
from engine.config.declare import IMAGE_FAMILIES, VIDEO_FAMILIES
from engine.config.sources import check_image_folder, check_text_source
from engine.errors import JobInvalid
from engine.registry.families import display, families

if TYPE_CHECKING:
    from engine.config.schema import JobConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(p: str) -> bool:
    return bool(HUB_ID.match(p)) and not p.startswith((".", "/", "~"))


def _resolve(p: str, base_dir: Path) -> str:
    path = Path(p).expanduser()
    if not path.is_absolute():
        path = (base_dir / path).resolve()
    return str(path)


def resolve_paths(cfg: JobConfig, base_dir: Path) -> None:
    """Relative paths against base_dir, so the normalised job (jobs/ID/job.yaml) is self-contained."""
    mp = cfg.model.path
    if not mp.startswith(BUILTIN_PREFIX):
        local = Path(_resolve(mp, base_dir))
        if local.exists() or not looks_like_hub_id(mp):
            cfg.model.path = str(local)
    if (al := cfg.model.assistant_lora) is not None:  # a local file or folder, else a hub id
        local = Path(_resolve(al, base_dir))
        if local.exists() or not looks_like_hub_id(al):
            cfg.model.assistant_lora = str(local)
    cfg.data.path = _resolve(cfg.data.path, base_dir)
    if cfg.data.masks is not None and cfg.data.masks.path is not None:
        cfg.data.masks.path = _resolve(cfg.data.masks.path, base_dir)
    if cfg.data.regularisation is not None:
        cfg.data.regularisation.path = _resolve(cfg.data.regularisation.path, base_dir)
    if cfg.data.control_path is not None:
        folders = [_resolve(p, base_dir) for p in cfg.data.control_paths()]
        cfg.data.control_path = folders[0] if isinstance(cfg.data.control_path, str) else folders
    for p in cfg.sample.prompts:  # a sample prompt's control images (edit jobs)
        if not isinstance(p, str) and p.control is not None:
            files = [_resolve(c, base_dir) for c in ([p.control] if isinstance(p.control, str) else p.control)]
            p.control = files[0] if isinstance(p.control, str) else files
    if cfg.data.validation is not None and cfg.data.validation.path is not None:
        cfg.data.validation.path = _resolve(cfg.data.validation.path, base_dir)


def single_file_refusal(mp: str) -> str:
    """The one line refusing a single-file checkpoint as model.path (the importers say it too, word for word)."""
    # diffusers' from_single_file reads one only with the base's config from the hub (the network)
    return (f"model.path: {mp} is a single-file checkpoint; lorad trains on diffusers directories: convert it once "
            "where the hub is reachable (e.g. StableDiffusionXLPipeline.from_single_file(FILE).save_pretrained(DIR)) "
            "and give DIR")


def single_file_problem(mp: str, family: str | None) -> str | None:
    """A single-file .safetensors checkpoint as model.path: "refused" where the family reads none, the line saying
    why where it is not one the family reads, None where the family's trainer converts it (Facts.single_file)."""
    import importlib

    check = families()[family].single_file if family in IMAGE_FAMILIES else None
    if check is None:
        return "refused"
    if not Path(mp).is_file():
        return None  # not on this machine (an import): the validator says so where the job runs
    module, name = check.split(":")
    try:
        getattr(importlib.import_module(module), name)(mp)
    except JobInvalid as e:
        return str(e)
    return None


def _check_model_path(mp: str, family: str) -> None:
    if mp.startswith(BUILTIN_PREFIX):
        name = mp[len(BUILTIN_PREFIX):]
        if name not in BUILTIN_MODELS:
            raise JobInvalid(f"model.path: unknown built-in model {name!r} (available: {', '.join(BUILTIN_MODELS)})")
    elif Path(mp).is_absolute():
        if not Path(mp).exists():
            raise JobInvalid(f"model.path: {mp} does not exist (give a local model directory or a hub id like org/name)")
        if Path(mp).is_file() and mp.endswith(".safetensors"):
            why = single_file_problem(mp, family)
            if why == "refused":
                raise JobInvalid(single_file_refusal(mp))
            if why is not None:
                raise JobInvalid(why)
            return  # the family's trainer converts it (SDXL: engine/families/image/sdxl/single_file.py)
        if not Path(mp).is_dir():
            raise JobInvalid(f"model.path: {mp} is not a directory")


def check_paths(cfg: JobConfig) -> None:
    """Every path the trainer reads exists and holds what the family reads; JobInvalid at the first that does not."""
    mp = cfg.model.path
    _check_model_path(mp, cfg.model.family)
    sfc = getattr(cfg.model, "single_file_config", None)
    if sfc is not None:
        if not (Path(mp).is_file() and mp.endswith(".safetensors")):
            raise JobInvalid(f"model.single_file_config: only with a single-file checkpoint as model.path ({mp} is "
                             "not one); leave it out")
        if Path(sfc).is_absolute() and not (Path(sfc) / "model_index.json").is_file():
            raise JobInvalid(f"model.single_file_config: {sfc} is not a diffusers directory (no model_index.json); "
                             "give the base's diffusers directory or its hub id")
    if cfg.model.assistant_lora is not None and Path(cfg.model.assistant_lora).is_absolute():
        from engine.config.assistant import local_file

        if not Path(cfg.model.assistant_lora).exists():
            raise JobInvalid(f"model.assistant_lora: {cfg.model.assistant_lora} does not exist (give a LoRA "
                             "file, a folder holding pytorch_lora_weights.safetensors, or a hub id like org/name)")
        local_file(cfg.model.assistant_lora)
    dp = Path(cfg.data.path)
    if not dp.exists():
        raise JobInvalid(f"data.path: {dp} does not exist")
    val_path = Path(cfg.data.validation.path) if cfg.data.validation and cfg.data.validation.path else None
    if val_path is not None and not val_path.exists():
        raise JobInvalid(f"data.validation.path: {val_path} does not exist")
    if cfg.model.family == "causal_lm":
        if Path(mp).is_absolute() and not (Path(mp) / "config.json").is_file():
            raise JobInvalid(f"model.path: {mp} holds no transformers model (no config.json)")
        check_text_source(dp, cfg.data.text_field, cfg.data.train_on)
        if val_path is not None:
            check_text_source(val_path, cfg.data.text_field, cfg.data.train_on, key="data.validation.path")
    elif cfg.model.family in IMAGE_FAMILIES:
        denoiser = families()[cfg.model.family].denoiser
        single = Path(mp).is_file()  # a single-file checkpoint the family converts (_check_model_path)
        if Path(mp).is_absolute() and not single and not (Path(mp) / denoiser / "config.json").is_file():
            what = display(cfg.model.family)
            raise JobInvalid(f"model.path: {mp} is not a {what} diffusers directory (no {denoiser}/config.json)")
        if Path(mp).is_absolute() and not single:
            _check_not_another_model(cfg.model.family, mp)
        if cfg.model.family in VIDEO_FAMILIES:  # every clip probed (PyAV): a bad one is refused naming it
            from engine.config.clips import check_video_folder

            check_video_folder(dp, cfg.data.fps, cfg.data.frames)
        else:
            check_image_folder(dp)
        if cfg.data.masks is not None and cfg.data.masks.path is not None and not Path(cfg.data.masks.path).is_dir():
            raise JobInvalid(f"data.masks.path: {cfg.data.masks.path} is not a folder of masks")
        if cfg.data.regularisation is not None:
            check_image_folder(Path(cfg.data.regularisation.path), key="data.regularisation.path")
        if val_path is not None and cfg.model.family in VIDEO_FAMILIES:
            from engine.config.clips import check_video_folder

            check_video_folder(val_path, cfg.data.fps, cfg.data.frames, key="data.validation.path")
        elif val_path is not None:
            check_image_folder(val_path, key="data.validation.path")
        if cfg.data.control_path is not None:
            _check_edit_job(cfg, mp, dp)


# Pipelines only one family trains, though another family's name looks like theirs: pipeline class -> that family.
# A directory of one given to another family is refused naming the family to write, and that family refuses any
# other pipeline (Qwen-Image 2.1 is a new model, not a Qwen-Image checkpoint: docs/families/qwen-image-21.md).
PIPELINE_FAMILIES = {"QwenImage21Pipeline": "qwen_image_21"}


def _check_not_another_model(family: str, mp: str) -> None:
    from engine.config.controls import pipeline_class

    check_pipeline_family(family, pipeline_class(Path(mp)), mp)


def check_pipeline_family(family: str, pipeline: str | None, mp: str) -> None:
    """JobInvalid where model.path's pipeline class (None: unknown) is one only another family trains, or where
    `family` trains only its own pipeline and this is not it (also the trainer's check of a hub id)."""
    owner = PIPELINE_FAMILIES.get(pipeline or "")
    if owner is not None and owner != family:
        raise JobInvalid(f"model.path: {mp} is a {pipeline}, which model.family {family} does not train: "
                         f"it is {display(owner)}, a model of its own; write model.family: {owner}")
    own = [p for p, f in PIPELINE_FAMILIES.items() if f == family]
    if pipeline is not None and own and pipeline not in own:
        raise JobInvalid(f"model.family: {family} trains {display(family)} ({', '.join(own)}), but model.path: "
                         f"{mp} is a {pipeline}; give a {display(family)} directory or that model's model.family")


def _check_edit_job(cfg: JobConfig, mp: str, dp: Path) -> None:
    """data.control_path: an edit base (where its pipeline class can be read here), and every pair complete."""
    from engine.config.controls import check_controls, check_edit_base, pipeline_class, upright_size

    slots, pipeline = len(cfg.data.control_paths()), None
    if mp.startswith(BUILTIN_PREFIX):
        pipeline = BUILTIN_MODELS[mp[len(BUILTIN_PREFIX):]].pipeline
        check_edit_base(cfg.model.family, pipeline, mp, slots)
    elif Path(mp).is_absolute():
        pipeline = pipeline_class(Path(mp))
        check_edit_base(cfg.model.family, pipeline, mp, slots)
    # a hub id: the trainer checks its model_index.json when it has it (engine/families/image/edit.py)
    check_controls(dp, cfg.data.control_paths(), pipeline, cfg.data.resolution)
    for i, files in enumerate(cfg.sample.controls()):
        for f in files:
            upright_size(Path(f), key=f"sample.prompts[{i}].control")
