"""The daemon's policy over what a job may name: remote code, and where its model and data may live.

Checked twice: by the daemon when a job file comes in (daemon/intake/accept.py), and by the trainer itself on the
job.yaml it is about to run, from command-line arguments the daemon sets at spawn. The second check is what
makes the policy hold: jobs/ID/job.yaml is a file on disk, and whoever can change it between intake and
start must not be able to widen the policy; a trainer's argv is the daemon's alone.

    python -m engine.run --job J --workdir W --enforce-policy --allowed-root /srv/data [--allow-trust-remote-code]

Without --enforce-policy (`lorad run` in a terminal) nothing is restricted: the user runs their own job.

A data folder is checked file by file: a symlink inside an allowed folder (to /etc/shadow, to another user's
file, to a folder elsewhere) would otherwise be read and trained on. Every symlink in the folder's tree is
resolved, and symlinked subfolders are walked as the data readers follow them; the first entry that resolves
outside the roots refuses the whole job (JobInvalid: exit 65 in the trainer, a rejection at intake), naming the
entry, where it leads and the roots. Refused rather than skipped: a job silently trained on less data than its
folder shows would be a quieter surprise. A link that stays inside the roots is fine. What the check cannot
see: an entry swapped for a link after it ran, by whoever can write the data folder (the job's own submitter),
and a model folder's files (a hub cache's snapshot links into its blobs; model.path itself is checked).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config.bounded import tick
from engine.errors import JobInvalid

# Keys whose value is a local path the trainer reads; a hub id (org/name) for model.path is not a path.
# Every path a trainer reads: a key missing here would let a job read outside the roots.
PATH_KEYS = (("data", "path"), ("model", "path"), ("data", "validation", "path"), ("data", "masks", "path"),
             ("data", "regularisation", "path"), ("data", "control_path"),
             ("model", "assistant_lora"), ("model", "single_file_config"))
WALKED = "data"  # the section whose folders are checked file by file


def _outside(top: Path, roots: tuple[Path, ...]) -> tuple[Path, Path] | None:
    """The first entry in the tree of the folder `top` (already resolved, under the roots) that is a symlink
    leading outside the roots: (the entry as the readers reach it, its real path). Symlinked folders inside the
    roots are walked too, each once (a link loop ends). Only links need resolving: any other entry lies in its
    folder's real path."""
    seen: set[Path] = set()
    stack = [(top, top)]  # (the folder as reached, its real path)
    while stack:
        shown, real = stack.pop()
        if real in seen:
            continue
        seen.add(real)
        tick(None, shown)  # a tree of a million folders ends at the check's deadline (engine/config/bounded.py)
        try:
            entries = list(os.scandir(real))
        except OSError:
            continue  # unreadable: the reader fails on it with its own message
        for e in entries:
            here = shown / e.name
            if e.is_symlink():
                target = Path(os.path.realpath(e.path))
                if not _under(target, roots):
                    return here, target
                if target.is_dir():
                    stack.append((here, target))
            elif e.is_dir(follow_symlinks=False):
                stack.append((here, Path(e.path)))
    return None


def _under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path == r or r in path.parents for r in roots)


@dataclass(frozen=True)
class JobPolicy:
    allow_trust_remote_code: bool
    roots: tuple[Path, ...]  # resolved
    cache_max_bytes: int | None = None  # HOME/cache's size limit (engine/storage/cache_evict.py); None: none

    def check(self, raw: dict[str, Any], base_dir: Path) -> None:
        """Raise JobInvalid naming the first key the policy refuses (raw: the parsed YAML mapping). Its switches
        are checked again on the validated job (check_parsed): here, before anything reads a path."""
        model = raw.get("model")
        if isinstance(model, dict):  # 'true' or 1 pass this; check_parsed sees them as the validator reads them
            self.check_switches(model.get("trust_remote_code") is True)
        self.check_roots(raw, base_dir)

    def check_parsed(self, cfg: Any) -> None:
        """The policy's switches on the validated job (engine.config.schema.JobConfig): the values the trainer
        acts on, whatever spelling the file used."""
        self.check_switches(cfg.model.trust_remote_code is True)

    def check_switches(self, trust_remote_code: bool) -> None:
        if trust_remote_code and not self.allow_trust_remote_code:
            raise JobInvalid("model.trust_remote_code: true is not allowed by this daemon "
                             "(set allow_trust_remote_code: true in the daemon config to permit it)")

    def check_roots(self, raw: dict[str, Any], base_dir: Path) -> None:
        """Local paths (after following symlinks) must lie under an allowed root; checked before anything reads them."""
        shown = ", ".join(str(r) for r in self.roots)
        for keys in PATH_KEYS:
            section, name = keys[0], ".".join(keys)
            p: Any = raw
            for k in keys:
                p = p.get(k) if isinstance(p, dict) else None
            for one in p if isinstance(p, list) else [p]:  # data.control_path may list a folder per slot
                self._check_root(section, name, one, base_dir, shown)
        sample = raw.get("sample")
        prompts = sample.get("prompts") if isinstance(sample, dict) else None
        for i, prompt in enumerate(prompts if isinstance(prompts, list) else []):
            control = prompt.get("control") if isinstance(prompt, dict) else None  # an edit job's sample controls
            for one in control if isinstance(control, list) else [control]:
                self._check_root("sample", f"sample.prompts[{i}].control", one, base_dir, shown)

    def _check_root(self, section: str, name: str, p: Any, base_dir: Path, shown: str) -> None:
        if not isinstance(p, str) or p.startswith("builtin:"):
            return
        cand = Path(os.path.expanduser(p))
        if not cand.is_absolute():
            cand = base_dir / cand
        if section == "model" and not cand.exists() and not p.startswith((".", "/", "~")):
            return  # a hub id (org/name), not a local path
        if not os.path.lexists(cand):
            return  # the engine's validator says "does not exist", which is the clearer message
        real = Path(os.path.realpath(cand))
        if not _under(real, self.roots):
            raise JobInvalid(f"{name}: {p} resolves to {real}, outside the allowed roots ({shown}); "
                             "add a root to allowed_roots in the daemon config")
        if name == "model.assistant_lora" and real.is_dir():  # the one file read from that folder
            from engine.config.assistant import LORA_FILE

            inner = Path(os.path.realpath(real / LORA_FILE))
            if os.path.lexists(real / LORA_FILE) and not _under(inner, self.roots):
                raise JobInvalid(f"{name}: {LORA_FILE} in {p} resolves to {inner}, outside the allowed roots "
                                 f"({shown}); add a root to allowed_roots in the daemon config")
        if section == WALKED and real.is_dir() and (bad := _outside(real, self.roots)) is not None:
            raise JobInvalid(f"{name}: {bad[0].relative_to(real)} in {p} resolves to {bad[1]}, outside the "
                             f"allowed roots ({shown}); every file in a data folder must lie under one "
                             "(add a root to allowed_roots in the daemon config)")

    def allows_path(self, path: Path) -> bool:
        return _under(Path(os.path.realpath(path)), self.roots)

    def argv(self) -> list[str]:
        """The trainer arguments that carry this policy (add_arguments/from_args read them back)."""
        out = ["--enforce-policy"]
        for r in self.roots:
            out += ["--allowed-root", str(r)]
        if self.allow_trust_remote_code:
            out.append("--allow-trust-remote-code")
        if self.cache_max_bytes:
            out += ["--cache-max-bytes", str(self.cache_max_bytes)]
        return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--enforce-policy", action="store_true",
                    help="re-check the job against the policy below (the daemon sets these at spawn)")
    ap.add_argument("--allowed-root", action="append", default=[], metavar="DIR",
                    help="model.path / data.path must lie under one of these (repeatable)")
    ap.add_argument("--allow-trust-remote-code", action="store_true")
    ap.add_argument("--cache-max-bytes", type=int, default=None, metavar="N",
                    help="evict least-recently-used entries of the shared cache beyond N bytes after a cache fill")


def from_args(args: argparse.Namespace) -> JobPolicy | None:
    if not args.enforce_policy:
        return None
    return JobPolicy(allow_trust_remote_code=args.allow_trust_remote_code,
                     roots=tuple(Path(r).resolve() for r in args.allowed_root), cache_max_bytes=args.cache_max_bytes)
