"""TensorBoard for a job: jobs/ID/tb/ (`logging.tensorboard`; on by default when the package is installed).

Scalars per optimizer step: train/loss, train/lr, train/grad_norm (before clipping; with max_grad_norm
set), perf/s_per_step, perf/peak_memory_gib (CUDA only); validation/loss at the steps data.validation
evaluates; Flux sample images at the steps they are rendered.
Power (W, J/step) is measured by the daemon's sampler, not the trainer, so it is not here: `lorad power`
and the dashboard show it.

Across resumes, TensorBoard's own mechanism keeps one value per step: each attempt writes its own event
file, and an attempt resumed from checkpoint step S opens it with `purge_step = S + 1`, which makes
TensorBoard drop every event of earlier files at a later step (what a killed attempt wrote after S; the
resumed attempt writes those steps again). The writer is flushed whenever a checkpoint commits, so the
events up to a committed step are on disk before anything depends on them being there.
"""

from __future__ import annotations

from pathlib import Path


def available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TrainingBoard:
    def __init__(self, log_dir: Path, resumed_from: int):
        from torch.utils.tensorboard import SummaryWriter

        log_dir = Path(log_dir)
        earlier = log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resumed_from + 1 if earlier else None,
                                    flush_secs=30)

    def step(self, step: int, **scalars: float | None) -> None:
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, step)

    def images(self, step: int, pngs: list[Path]) -> None:
        import numpy as np
        from PIL import Image

        for i, png in enumerate(pngs):
            with Image.open(png) as im:
                self.writer.add_image(f"samples/{i:02d}", np.asarray(im.convert("RGB")), step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
