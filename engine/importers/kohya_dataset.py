"""kohya-ss sd-scripts' and musubi-tuner's datasets: the dataset config TOML (`general`, `datasets[]`,
`datasets[].subsets[]`; musubi's datasets are flat) and kohya's `N_name` repeat folders under a train_data_dir,
flattened into the keys kohya.py's table maps, with what one lorad job cannot hold listed as not carried over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.importers import common as c
from engine.importers.table import NO_FEATURE, Context, Imported, flatten, not_applicable, other_way

REG_ONLY = f"{NO_FEATURE} (for a regularisation folder: lorad reads its images with their own captions)"
ONE_FOLDER = other_way("data.path", "one image folder per job: put the folders under one, as sub-folders")


def is_dataset_toml(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("datasets"), list) and any(
        isinstance(d, dict) and ({"subsets", "image_dir", "image_directory", "video_directory"} & set(d))
        for d in doc["datasets"])


def is_musubi_dataset(doc: dict) -> bool:
    return any(isinstance(d, dict) and ("image_directory" in d or "video_directory" in d)
               for d in doc.get("datasets", []))


def read_dataset(doc: dict[str, Any], flat: dict[str, Any], ctx: Context, out: Imported) -> None:
    """A dataset TOML into flat: the first training subset, its regularisation subset; the others dropped."""
    datasets = [d for d in doc.get("datasets", []) if isinstance(d, dict)]
    first_done = False
    for i, d in enumerate(datasets):
        subsets = d.get("subsets") if isinstance(d.get("subsets"), list) else None
        body = {k: v for k, v in d.items() if k != "subsets"}
        if subsets is None:  # musubi-tuner: the dataset itself is the folder
            if first_done:
                out.drop(f"datasets[{i}]", d.get("image_directory") or d.get("video_directory"), ONE_FOLDER)
                continue
            first_done = True
            flat.update({f"datasets[{i}].{k}": v for k, v in flatten(body).items()})
            continue
        kept = []
        for j, s in enumerate(subsets):
            if not isinstance(s, dict):
                continue
            if s.get("is_reg"):
                if "data.regularisation.path" not in out.origin and s.get("image_dir"):
                    out.set("data.regularisation.path", c.local_path(s["image_dir"], ctx),
                            f"datasets[{i}].subsets[{j}].image_dir = {s['image_dir']} (is_reg)")
                    if s.get("num_repeats"):
                        out.set("data.regularisation.repeats", int(s["num_repeats"]),
                                f"datasets[{i}].subsets[{j}].num_repeats")
                    for k, val in s.items():
                        if k not in ("image_dir", "num_repeats", "is_reg"):
                            out.drop(f"datasets[{i}].subsets[{j}].{k}", val, REG_ONLY)
                else:
                    out.drop(f"datasets[{i}].subsets[{j}]", s.get("image_dir"), other_way("data.regularisation",
                             "one regularisation folder per job"))
                continue
            if first_done or kept:
                out.drop(f"datasets[{i}].subsets[{j}]", s.get("image_dir"), ONE_FOLDER)
                continue
            kept.append((j, s))
        if not kept:
            continue
        if first_done:
            out.drop(f"datasets[{i}]", kept[0][1].get("image_dir"), ONE_FOLDER)
            continue
        first_done = True
        flat.update({f"datasets[{i}].{k}": v for k, v in flatten(body).items()})
        j, s = kept[0]
        flat.update({f"datasets[{i}].subsets[{j}].{k}": v for k, v in flatten(s).items() if k != "is_reg"})
    flat.update({f"general.{k}": v for k, v in flatten(doc.get("general") or {}).items()})
    for k, v in doc.items():
        if k not in ("general", "datasets"):
            out.drop(k, v, not_applicable("not a dataset setting lorad knows"))


def repeat_folders(folder: Path, flat: dict[str, Any], ctx: Context, out: Imported) -> None:
    """kohya's train_data_dir: its N_name folders' repeats and caption, carried where one value serves them all."""
    folders = c.repeat_folders(folder)
    if not folders:
        return
    counts = [(n, name, len(c.images_in(p))) for n, name, p in folders]
    repeats = sorted({n for n, _, _ in counts})
    if len(folders) == 1:
        flat["train_data_dir"] = str(folders[0][2])  # the one concept's folder itself: its name is not a caption
    flat["_folder_repeats"] = repeats[0] if len(repeats) == 1 else max(counts, key=lambda t: t[2])[0]
    if len(repeats) > 1:
        for n, name, _ in counts:
            if n != flat["_folder_repeats"]:
                out.drop(f"train_data_dir/{n}_{name}", n, f"{NO_FEATURE} (repeats per folder; "
                         f"every folder trains data.repeats = {flat['_folder_repeats']} times)")
    names = sorted({name for _, name, _ in counts})
    if len(names) == 1:
        flat["_folder_caption"] = names[0]
    else:
        out.drop("train_data_dir/N_name", ", ".join(names), f"{NO_FEATURE} (a caption per folder for images "
                 "without a caption file)")
    ctx.images = sum(n * k for n, _, k in counts) / flat["_folder_repeats"]


def count_images(flat: dict[str, Any], ctx: Context) -> None:
    """How many images the job trains on (epochs → steps), and whether every one has a caption file."""
    path = next((flat[k] for k in flat if k.endswith(("image_dir", "image_directory", "video_directory"))
                 and not k.endswith("reg_data_dir")), None) or flat.get("train_data_dir")
    if path is None:
        return
    images = c.images_in(Path(c.local_path(path, ctx)))
    ext = next((str(flat[k]) for k in ("datasets[0].subsets[0].caption_extension", "datasets[0].caption_extension",
                                       "general.caption_extension", "caption_extension") if k in flat), "txt")
    flat["_every_image_captioned"] = bool(images) and c.captions_missing(images, ext) == 0
    if ctx.images is None and images:
        ctx.images = len(images)
