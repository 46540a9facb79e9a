"""Text data for causal-LM LoRA: .jsonl (a text field, or chat `messages` per line), .txt, or a folder of .txt.

A document is (input ids, labels): plain text is trained on every token; chat
conversations (engine/data/chat.py) by default only on the assistant turns.
Packing concatenates documents into fixed-length samples without letting one
document see another: each document's position ids restart at 0, which
transformers turns into a block-diagonal causal mask when no attention mask
is given (masking_utils.find_packed_sequence_indices; SDPA and eager on the
CPU, flash-attention's varlen kernels on a GPU), and the first token of each
document is not predicted from the one before it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config.sources import CHAT_FIELD, jsonl_is_chat, txt_files
from engine.errors import JobInvalid

if TYPE_CHECKING:
    import torch

IGNORE = -100


def read_documents(path: Path, text_field: str) -> list[str] | list[list[dict[str, str]]]:
    """Plain texts, or (for a chat .jsonl) conversations as lists of {role, content}."""
    from engine.data.chat import check_messages

    path = Path(path)
    if path.is_dir():
        docs: list[Any] = [f.read_text(encoding="utf-8") for f in txt_files(path)]
    elif path.suffix == ".txt":
        # Blank lines separate documents in a single .txt file.
        docs = [d for d in path.read_text(encoding="utf-8").split("\n\n")]
    else:
        docs = []
        chat = jsonl_is_chat(path)
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise JobInvalid(f"data.path: {path.name} line {lineno} is not valid JSON: {e.msg}") from None
            if chat:
                if not isinstance(obj, dict) or CHAT_FIELD not in obj:
                    raise JobInvalid(f"data.path: {path.name} line {lineno} has no {CHAT_FIELD!r} field (the first "
                                     "line is a conversation, so every line must be)")
                docs.append(check_messages(obj[CHAT_FIELD], f"{path.name} line {lineno}"))
                continue
            if not isinstance(obj, dict) or text_field not in obj:
                raise JobInvalid(f"data.path: {path.name} line {lineno} has no {text_field!r} field (data.text_field)")
            if not isinstance(obj[text_field], str):
                raise JobInvalid(f"data.path: {path.name} line {lineno}: field {text_field!r} is not a string")
            docs.append(obj[text_field])
        if chat:
            return docs
    docs = [d.strip() for d in docs if d.strip()]
    if not docs:
        raise JobInvalid(f"data.path: {path} has no text")
    return docs


def encode_documents(docs: list, tokenizer, train_on: str | None, log=None) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per document. Plain text ends with EOS (so packed documents are told apart)."""
    if docs and isinstance(docs[0], list):
        from engine.data.chat import encode_conversation, ensure_chat_template

        ensure_chat_template(tokenizer, log)
        return [encode_conversation(tokenizer, m, train_on or "completions", f"conversation {i + 1}")
                for i, m in enumerate(docs)]
    eos = tokenizer.eos_token_id
    out = []
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        out.append((ids, list(ids)))
    return out


def _pack(docs: list[tuple[list[int], list[int]]], seq_len: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Fixed-length (ids, labels, position ids) samples cut from the documents laid end to end.

    Positions restart at each document and at each sample (a document cut by a sample boundary continues as a
    fresh sequence, as it did before packing knew about documents); nothing predicts a document's first token.
    """
    ids: list[int] = []
    labels: list[int] = []
    doc_start: list[int] = []  # per token: where its document begins in the stream
    for d_ids, d_labels in docs:
        if not d_ids:
            continue
        doc_start.extend([len(ids)] * len(d_ids))
        ids.extend(d_ids)
        labels.extend([IGNORE, *d_labels[1:]])
    samples = []
    for i in range(0, len(ids) - seq_len + 1, seq_len):
        pos = [k - max(i, doc_start[k]) for k in range(i, i + seq_len)]
        samples.append((ids[i:i + seq_len], labels[i:i + seq_len], pos))
    return samples


class TokenDataset:
    """Fixed-length training samples built once, in memory: packed (ids, labels, position ids) or padded ones."""

    def __init__(self, docs: list[tuple[list[int], list[int]]], pad_id: int, seq_len: int, packing: bool):
        self.packing = packing
        self.samples: list[tuple[list[int], list[int], list[int]]] = []
        if packing:
            self.samples = [s for s in _pack(docs, seq_len) if any(t != IGNORE for t in s[1][1:])]
        else:
            for ids, labels in docs:
                ids, labels = ids[:seq_len], labels[:seq_len]
                if len(ids) < 2 or all(t == IGNORE for t in labels[1:]):
                    continue
                pad = seq_len - len(ids)
                self.samples.append((ids + [pad_id] * pad, labels + [IGNORE] * pad, [1] * len(ids) + [0] * pad))
        if not self.samples:
            total = sum(len(d[0]) for d in docs)
            raise JobInvalid(
                f"data: the dataset has {total} tokens, fewer than one sample of data.seq_len={seq_len} with "
                "anything to train on; add text (or assistant turns) or lower data.seq_len"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def subset(self, indices: list[int]) -> TokenDataset:
        """These samples alone, renumbered in the given order (data.validation.fraction's split)."""
        out = copy.copy(self)
        out.samples = [self.samples[i] for i in indices]
        return out

    def indices_at(self, seed: int, start: int, count: int) -> list[int]:
        """Sample indices for global positions start .. start+count-1: each epoch a seeded permutation."""
        from engine.data.order import sample_indices  # lazily: numpy, like torch below, only for training

        return sample_indices(seed, len(self), start, count)

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        import torch  # lazily: job validation (daemon, CLI) imports this module without needing torch

        ids = torch.tensor([self.samples[i][0] for i in indices], dtype=torch.long)
        labels = torch.tensor([self.samples[i][1] for i in indices], dtype=torch.long)
        third = torch.tensor([self.samples[i][2] for i in indices], dtype=torch.long)
        if self.packing:
            # No attention mask: transformers then reads document boundaries from the restarting position ids.
            return {"input_ids": ids, "position_ids": third, "labels": labels}
        return {"input_ids": ids, "attention_mask": third, "labels": labels}
