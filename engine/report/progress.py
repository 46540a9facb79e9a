"""Foreground progress: a rich bar with step, loss, s/step and ETA (`lorad run`), or nothing."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class _NoBar:
    def update(self, step: int, loss: float, s_per_step: float) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    def __init__(self, total: int, start: int):
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[sps]} s/step"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=start, loss="-", sps="-")

    def update(self, step: int, loss: float, s_per_step: float) -> None:
        self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", sps=f"{s_per_step:.3f}")

    def close(self) -> None:
        self.progress.stop()


def make_progress(kind: str, total: int, start: int):
    return _RichBar(total, start) if kind == "bar" else _NoBar()
