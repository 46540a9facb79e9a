"""The soak's report: what it did and what it found, as figures (a dict) and as the lines bench/RESULTS.md keeps."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import Any


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def report(soak) -> dict[str, Any]:
    faults = soak.faults
    lost = [f["lost"] for f in faults if "lost" in f]
    rec = [f["recovery_s"] for f in faults if "recovery_s" in f]
    inst = soak.world.instances
    longest = max(inst, key=lambda i: i.get("ended", time.monotonic()) - i["ready"]) if inst else None
    r = {
        "seed": soak.seed, "faults": len(faults), "requested": soak.n_faults,
        "elapsed_s": round(time.monotonic() - soak.t_start, 1),
        "by_kind": dict(sorted(Counter(f["kind"] for f in faults).items())),
        "rounds": soak.round, "jobs_verified": soak.verified, "jobs_lost": soak.lost, "mismatched": soak.mismatched,
        "human_actions": soak.human, "daemon_self_exits": soak.world.self_exits,
        "steps_lost": {"n": len(lost), "median": statistics.median(lost) if lost else None,
                       "max": max(lost) if lost else None},
        "save_every_steps": {k: s["checkpoint"]["every_steps"] for k, s in soak.specs.items()},
        "recovery_s": {"n": len(rec), "median": pct(rec, 0.5), "p95": pct(rec, 0.95), "max": max(rec, default=None)},
        "recovery_by_kind": {k: pct([f["recovery_s"] for f in faults if f["kind"] == k and "recovery_s" in f], 0.5)
                             for k in sorted({f["kind"] for f in faults if "recovery_s" in f})},
        "daemon": {"instances": len(inst), "first": inst[0] if inst else None, "last": inst[-1] if inst else None,
                   "longest": longest, "each": inst if len(inst) <= EACH else None},
    }
    for line in lines(r):
        print(line, flush=True)
    return r


EACH = 8  # up to this many daemon instances are listed one by one


def _mem(i: dict[str, Any] | None) -> str:
    if not i:
        return "-"
    s, e = i.get("start") or {}, i.get("end") or {}
    life = i.get("ended", time.monotonic()) - i["ready"]
    rounds = [x["rss_kib"] for x in i.get("rounds", []) if x]
    return (f"pid {i['pid']}, lived {life:.0f} s: RSS {s.get('rss_kib', '?')} → {e.get('rss_kib', '?')} KiB, "
            f"open fds {s.get('fds', '?')} → {e.get('fds', '?')}"
            + (f"; RSS at each round's end {', '.join(map(str, rounds))} KiB" if len(rounds) > 1 else ""))


def lines(r: dict[str, Any]) -> list[str]:
    sl, rc, d = r["steps_lost"], r["recovery_s"], r["daemon"]
    return [
        "",
        f"soak report (seed {r['seed']}): {r['faults']} faults of {r['requested']} requested in {r['elapsed_s']:.0f} s",
        "  faults by kind: " + ", ".join(f"{k} {n}" for k, n in r["by_kind"].items()),
        f"  jobs: {r['jobs_verified']} finished and bit-identical to their uninterrupted references "
        f"({r['rounds']} rounds); lost {r['jobs_lost']}; mismatched {r['mismatched']}; human actions "
        f"{r['human_actions']}; daemon exits on its own {r['daemon_self_exits']}",
        f"  steps lost per killing fault (n={sl['n']}): median {sl['median']}, max {sl['max']} "
        f"(saves every {r['save_every_steps']} steps)",
        f"  recovery, fault → next training step (n={rc['n']}): median {_s(rc['median'])}, p95 {_s(rc['p95'])}, "
        f"max {_s(rc['max'])}",
        "  recovery median by kind: " + ", ".join(f"{k} {_s(v)}" for k, v in r["recovery_by_kind"].items()),
        *([f"  daemon: {d['instances']} instance(s)"] + [f"    #{k} {_mem(i)}" for k, i in enumerate(d["each"], 1)]
          if d.get("each") is not None else
          [f"  daemon: {d['instances']} instances; first {_mem(d['first'])}", f"          last {_mem(d['last'])}",
           f"          longest-lived {_mem(d['longest'])}"]),
    ]


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"
