"""The image and video families' killed-twice chain, run in forked trainers beside an uninterrupted reference.

run_killed_twice: SIGKILL while the cache is encoded, SIGKILL with a checkpoint half-written, then resumed to the
end (tests/helpers/forked.py trainers: real processes, real kills). chains_beside_references starts one chain per
job in the background and trains each job's reference in the test process meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.forked import ForkedTrainer


class Quiet:
    """A logger that says nothing (a family's load_model outside a run)."""

    def info(self, *a, **k):
        pass

    warning = info


def _tmp_dirs(wd: Path) -> list[Path]:
    root = wd / "checkpoints"
    return sorted(p for p in root.iterdir() if ".tmp-" in p.name) if root.is_dir() else []


def _committed(wd: Path) -> list[str]:
    root = wd / "checkpoints"
    return sorted(p.name for p in root.glob("step-*") if ".tmp-" not in p.name) if root.is_dir() else []


def run_killed_twice(job: Path, wd: Path) -> tuple[Path, list[str]]:
    """SIGKILL while encoding the cache, then while a checkpoint is half-written; resume to the end."""
    story: list[str] = []
    wd.mkdir(parents=True, exist_ok=True)
    t = ForkedTrainer(job, wd)
    t.wait_for(lambda: any(e.get("event") == "cache_progress" and e["done"] >= 2 for e in t.events), timeout=300)
    t.kill()
    story.append(f"run1 SIGKILL while caching ({t.named('cache_progress')[-1]['done']} encoded)")

    # Killed inside the second save (step 4), once step 2 is committed: run 3 must resume from a committed
    # checkpoint (optimizer, RNG, data order), not start over, and never load the torn one.
    t = ForkedTrainer(job, wd, LORAD_DEBUG_CKPT_WRITE_DELAY_S="0.25")
    t.wait_for(lambda: _committed(wd) and any(len(list(d.iterdir())) >= 2 for d in _tmp_dirs(wd)), timeout=300)
    t.kill()
    torn = _tmp_dirs(wd)
    start = t.named("cache_start")[0]
    story.append(f"run2 reused {start['reused']} cache entries, SIGKILL with {_committed(wd)} committed and "
                 f"{[d.name for d in torn]} half-written")
    assert torn and start["reused"] >= 2, story

    t = ForkedTrainer(job, wd)
    assert t.finish(timeout=300) == 0, t.events[-5:]
    story.append(f"run3 resumed from {[e['from_step'] for e in t.named('resumed')]}")
    assert t.named("cache_start")[0]["to_encode"] == 0, story
    assert [e["from_step"] for e in t.named("resumed")] == [2], story
    return wd, story


@contextmanager
def chains_beside_references(root: Path, jobs: dict[str, tuple[Path, Path]]) -> Iterator[dict[str, tuple[Path, Future]]]:
    """jobs: name -> (job file killed twice, job file trained uninterrupted here — the same one, or it with samples
    on). Yields name -> (the reference's workdir ROOT/NAME-uninterrupted, the chain's future of (workdir, story));
    the chains run while the references train, and are waited for on exit."""
    from engine.config.job import load_job
    from engine.recipe import train

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        killed = {name: pool.submit(run_killed_twice, job, root / f"{name}-killed") for name, (job, _) in jobs.items()}
        out = {}
        for name, (_job, reference) in jobs.items():
            wd = root / f"{name}-uninterrupted"
            assert train(load_job(reference), wd, progress="none") == 0
            out[name] = (wd, killed[name])
        yield out
