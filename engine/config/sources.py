"""What a job's data paths must hold, checked cheaply when the job is loaded (engine/data/ reads them in full).

The file kinds live here, not in engine/data/, so that validating a job imports no data reader; the readers
import them from here.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.config.bounded import MAX_CHECK_READ, open_regular, tick, walk
from engine.errors import JobInvalid

CHAT_FIELD = "messages"
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
VIDEO_EXTS = (".mp4", ".webm", ".mov", ".gif")  # the video families' clips (.webp may be animated too)


def txt_files(path: Path, key: str | None = None) -> list[Path]:
    return sorted(p for p in walk(path, "*.txt", key) if p.is_file())


def first_text(path: Path, chunk: int = 1 << 16, key: str = "data.path", most: int = MAX_CHECK_READ) -> bytes:
    """The file's text from its first non-blank byte to the end of that line (or 1 MiB of it).

    Validation runs in the daemon: the file is opened as a regular file only (engine/config/bounded.py), leading
    blanks are dropped as they are read (never copied again: linear in the file), and a file with no text in
    its first `most` bytes is JobInvalid."""
    head = bytearray()
    seen = 0
    with open_regular(path, key) as f:
        while block := f.read(chunk):
            seen += len(block)
            if not head:
                block = block.lstrip()
            head += block
            if head and (b"\n" in block or len(head) > (1 << 20)):
                break
            if not head and seen >= most:
                raise JobInvalid(f"{key}: {path} holds no text in its first {most} bytes")
            tick(key, path)
    return bytes(head)


def jsonl_is_chat(path: Path, key: str = "data.path") -> bool:
    """Whether a .jsonl file holds conversations (its first line has a `messages` field)."""
    line = first_text(path, key=key).split(b"\n", 1)[0]
    try:
        obj = json.loads(line)
    except ValueError:
        return False  # read_documents names the line when it reads the whole file
    return isinstance(obj, dict) and CHAT_FIELD in obj


def list_images(folder: Path, key: str | None = None) -> list[Path]:
    folder = Path(folder)
    return sorted(
        p for p in walk(folder, key=key)
        if p.is_file() and p.suffix.lower() in IMAGE_EXTS and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def list_media(folder: Path, key: str | None = None) -> list[Path]:
    """A video family's files: clips and stills (engine/data/videos.py), hidden ones skipped."""
    folder = Path(folder)
    return sorted(
        p for p in walk(folder, key=key)
        if p.is_file() and p.suffix.lower() in IMAGE_EXTS + VIDEO_EXTS
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def check_text_source(path: Path, text_field: str, train_on: str | None = None,
                      key: str = "data.path") -> None:
    """Cheap validation at job-load time: the source exists and holds some text (and chat data where needed)."""
    if path.is_dir():
        files = txt_files(path, key)
        if not files:
            raise JobInvalid(f"{key}: {path} contains no .txt files")
        if all(f.stat().st_size == 0 for f in files):
            raise JobInvalid(f"{key}: every .txt file in {path} is empty")
    elif path.suffix not in (".jsonl", ".txt"):
        raise JobInvalid(f"{key}: {path} must be a .jsonl file, a .txt file or a directory of .txt files")
    elif not first_text(path, key=key):
        raise JobInvalid(f"{key}: {path} is empty")
    if train_on == "completions" and not (path.suffix == ".jsonl" and jsonl_is_chat(path, key)):
        where = "data.train_on" if key == "data.path" else f"{key}, data.train_on"
        raise JobInvalid(f"{where}: completions needs chat data (a .jsonl whose lines have '{CHAT_FIELD}'); "
                         f"{path.name} is plain text, use data.train_on: all")


def check_image_folder(path: Path, key: str = "data.path") -> None:
    """Cheap validation at job-load time: a directory that holds at least one image."""
    path = Path(path)
    if not path.is_dir():
        raise JobInvalid(f"{key}: {path} must be a folder of images with same-name .txt captions (model.family flux)")
    if not list_images(path, key):
        raise JobInvalid(f"{key}: {path} contains no images ({', '.join(IMAGE_EXTS)})")
