"""How a rank of a distributed run ends: with the code its trainer returned, never an abort at interpreter exit.

Two real processes in one gloo group (a file rendezvous, no launcher): each does some collectives, as training
does, then ends the way engine.run ends it. Without the shutdown, such an exit aborted in about one run in six
("terminate called without an active exception", exit -6: CI saw a finished job reported as a crash).
"""

from __future__ import annotations

import subprocess
import textwrap

from tests.helpers.processes import PY, REPO, child_env

RANK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from engine.distributed.ddp import leave_process_group
    rank, store, codes = int(sys.argv[1]), sys.argv[2], [int(c) for c in sys.argv[3].split(",")]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    t = torch.ones(4096)
    for _ in range(20):
        dist.all_reduce(t)
    dist.barrier()
    code = codes[rank]
    leave_process_group(code)
    assert not dist.is_initialized()  # only a clean end comes back here, with the group shut down
    sys.exit(code)
""")


def run_pair(tmp_path, codes: str, runs: int = 1) -> list[tuple[int, int]]:
    """(rank 0's, rank 1's) exit codes of `runs` pairs started at once, each ending with `codes`."""
    pairs = []
    for i in range(runs):
        store = tmp_path / f"store-{i}"
        pairs.append([subprocess.Popen([PY, "-c", RANK, str(r), str(store), codes], cwd=REPO, env=child_env(),
                                       stderr=subprocess.PIPE, text=True) for r in (0, 1)])
    out = []
    for pair in pairs:
        for p in pair:
            p.wait(120)
        assert all("terminate called" not in p.stderr.read() for p in pair)
        out.append(tuple(p.returncode for p in pair))
    return out


def test_ranks_that_finish_cleanly_exit_0_and_75_with_their_group_shut_down(tmp_path):
    assert run_pair(tmp_path, "0,75", runs=2) == [(0, 75)] * 2


def test_a_failed_rank_exits_with_its_verdict_and_the_clean_one_with_its_own(tmp_path):
    assert run_pair(tmp_path, "0,65") == [(0, 65)]
