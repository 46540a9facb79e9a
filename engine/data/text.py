"""Text data for causal-LM LoRA: .jsonl (one object per line with a text field), .txt, or a folder of .txt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from engine.config import JobInvalid

if TYPE_CHECKING:
    import torch


def _txt_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*.txt") if p.is_file())


def _has_text(path: Path, chunk: int = 1 << 16) -> bool:
    # Validation runs in the daemon's service loop too: read only until the first non-blank byte.
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if block.strip():
                return True
    return False


def check_text_source(path: Path, text_field: str) -> None:
    """Cheap validation at job-load time: the source exists and holds some text."""
    if path.is_dir():
        files = _txt_files(path)
        if not files:
            raise JobInvalid(f"data.path: {path} contains no .txt files")
        if all(f.stat().st_size == 0 for f in files):
            raise JobInvalid(f"data.path: every .txt file in {path} is empty")
        return
    if path.suffix not in (".jsonl", ".txt"):
        raise JobInvalid(f"data.path: {path} must be a .jsonl file, a .txt file or a directory of .txt files")
    if not _has_text(path):
        raise JobInvalid(f"data.path: {path} is empty")


def read_documents(path: Path, text_field: str) -> list[str]:
    path = Path(path)
    if path.is_dir():
        docs = [f.read_text(encoding="utf-8") for f in _txt_files(path)]
    elif path.suffix == ".txt":
        # Blank lines separate documents in a single .txt file.
        docs = [d for d in path.read_text(encoding="utf-8").split("\n\n")]
    else:
        docs = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise JobInvalid(f"data.path: {path.name} line {lineno} is not valid JSON: {e.msg}") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise JobInvalid(f"data.path: {path.name} line {lineno} has no {text_field!r} field (data.text_field)")
            if not isinstance(obj[text_field], str):
                raise JobInvalid(f"data.path: {path.name} line {lineno}: field {text_field!r} is not a string")
            docs.append(obj[text_field])
    docs = [d.strip() for d in docs if d.strip()]
    if not docs:
        raise JobInvalid(f"data.path: {path} has no text")
    return docs


class TokenDataset:
    """Fixed-length training samples (input_ids, attention_mask, labels) built once, in memory."""

    def __init__(self, docs: list[str], tokenizer, seq_len: int, packing: bool):
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
        encoded = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]
        self.samples: list[tuple[list[int], list[int]]] = []
        if packing:
            stream: list[int] = []
            for ids in encoded:
                stream.extend(ids)
                if eos is not None:
                    stream.append(eos)
            for i in range(0, len(stream) - seq_len + 1, seq_len):
                chunk = stream[i : i + seq_len]
                self.samples.append((chunk, [1] * seq_len))
        else:
            for ids in encoded:
                ids = ids[:seq_len]
                if len(ids) < 2:
                    continue
                mask = [1] * len(ids) + [0] * (seq_len - len(ids))
                self.samples.append((ids + [pad] * (seq_len - len(ids)), mask))
        if not self.samples:
            total = sum(len(e) for e in encoded)
            raise JobInvalid(
                f"data: the dataset has {total} tokens, fewer than one sample of data.seq_len={seq_len}; "
                "add text or lower data.seq_len"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        import torch  # lazily: job validation (daemon, CLI) imports this module without needing torch

        ids = torch.tensor([self.samples[i][0] for i in indices], dtype=torch.long)
        mask = torch.tensor([self.samples[i][1] for i in indices], dtype=torch.long)
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
