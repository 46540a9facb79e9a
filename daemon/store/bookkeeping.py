"""Store writes for jobs whose trainer is gone (it exited, or never started), retried until they land.

The job stays `running` in the store until its write succeeds; the supervisor tries every pending write on
every tick, so one failed store write (disk full, a lock held too long) never leaves a job running with no
trainer, and its device stays taken until the job's state is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from daemon.store import states
from daemon.store.errors import UnknownJob


@dataclass
class Pending:
    job_id: str
    devices: list[int | None]
    what: str  # for the log: "trainer exit", "failed start"
    write: Callable[[], None]
    failures: int = 0


class PendingWrites:
    """Job id → its write not yet done. One per job: a job has at most one trainer, so one ending."""

    def __init__(self, log):
        self.log = log
        self._pending: dict[str, Pending] = {}

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._pending

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._pending))

    def __len__(self) -> int:
        return len(self._pending)

    def gpus(self) -> set[int | None]:
        """The devices of these jobs: still taken until the job's state is written."""
        return {d for p in self._pending.values() for d in p.devices}

    def add(self, job_id: str, devices: list[int | None], what: str, write: Callable[[], None]) -> Pending:
        p = self._pending[job_id] = Pending(job_id, devices, what, write)
        return p

    def settle_all(self) -> None:
        """Write what is pending; raise (the tick is unhealthy) if some of it still fails."""
        failed = [e for p in list(self._pending.values()) if (e := self.settle(p)) is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} job(s) not yet recorded: {failed[0]}")

    def settle(self, p: Pending) -> str | None:
        """Try one write: None once it is done (or moot), else why it failed (it stays pending)."""
        try:
            p.write()
        except (states.IllegalTransition, UnknownJob) as e:
            # Written already (a retry after the transaction committed), or the job is gone: nothing to redo.
            self.log.warning("bookkeeping_dropped", job=p.job_id, what=p.what, error=str(e))
        except Exception as e:  # noqa: BLE001 — kept, and tried again on the next tick
            p.failures += 1
            if p.failures == 1:
                self.log.error("bookkeeping_failed", job=p.job_id, what=p.what, error=f"{type(e).__name__}: {e}",
                               message="the job stays running in the store; retried every tick")
            return f"{p.job_id} ({p.what}): {type(e).__name__}: {e}"
        if p.failures:
            self.log.info("bookkeeping_written", job=p.job_id, what=p.what, failed_tries=p.failures)
        del self._pending[p.job_id]
        return None
