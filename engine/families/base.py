"""The interface every model family implements.

The training recipe (engine/recipe.py) only talks to a family through these
methods, so a family owns everything specific to its models: how to load the
base, which modules get LoRA, how a batch turns into a loss, how the dataset
is built and how the finished adapter is exported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from engine.config.job import JobConfig


class Dataset(Protocol):
    def __len__(self) -> int:
        """Samples per epoch."""

    def indices_at(self, seed: int, start: int, count: int) -> list[int]:
        """The dataset indices of global sample positions start .. start+count-1 (one micro-batch).

        A pure function of its arguments: resume needs only the count of samples consumed.
        """

    def collate(self, indices: list[int]) -> dict[str, Any]:
        """The batch (tensors on the CPU) of these samples."""


class Family(Protocol):
    def prepare(self, cfg: JobConfig, workdir: Path, log) -> None:
        """One-off work before loading (e.g. caching latents). Must be idempotent and crash-safe."""

    def load_model(self, cfg: JobConfig, workdir: Path, device: torch.device, log) -> torch.nn.Module:
        """Load the frozen base and wrap it with peft LoRA; only LoRA parameters require grad."""

    def build_dataset(self, cfg: JobConfig, workdir: Path, log) -> Dataset:
        """The training samples; their order is the dataset's own `indices_at`."""

    def loss(self, model: torch.nn.Module, batch: dict[str, Any], generator: torch.Generator) -> torch.Tensor:
        """Loss of one micro-batch. Any randomness (noise, timesteps) must come from `generator`."""

    def validation_set(self, cfg: JobConfig, workdir: Path, log) -> Any:
        """data.validation's samples (engine.training.heldout.ValidationSet), after build_dataset held a fraction out."""

    def validation_loss(self, model: torch.nn.Module, dataset: Any, indices: list[int], seed: int,
                        device: torch.device) -> torch.Tensor:
        """Mean loss per sample of these validation samples; randomness from engine.training.heldout.sample_generator."""

    def on_step_end(self, model: torch.nn.Module, step: int, cfg: JobConfig, workdir: Path, log) -> None:
        """Hook after an optimizer step (e.g. render samples every N steps). Must not touch training RNG."""

    def export(self, model: torch.nn.Module, cfg: JobConfig, out_dir: Path, meta: dict[str, Any]) -> list[str]:
        """Write the final adapter files into out_dir (not yet durable); return the file names written."""


def hub_refusal(exc: BaseException, cfg: JobConfig) -> str | None:
    """One line for a Hugging Face Hub answer that no retry can change (no such repo, revision, or access); else None.

    transformers and diffusers wrap these in OSError; network failures stay errors of their own (a crash
    the daemon retries with backoff), since the network may come back.
    """
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        repo = cfg.model.path
        if isinstance(exc, GatedRepoError):
            return (f"model.path: {repo} is a gated model: request access at https://huggingface.co/{repo} "
                    "and give the trainer a token (HF_TOKEN)")
        if isinstance(exc, RevisionNotFoundError):
            return f"model.revision: {cfg.model.revision!r} does not exist in {repo} on the Hugging Face Hub"
        if isinstance(exc, RepositoryNotFoundError):
            return (f"model.path: {repo} is not on the Hugging Face Hub (or it is private and needs a token in "
                    "HF_TOKEN)")
        exc = exc.__cause__ or exc.__context__
    return None
