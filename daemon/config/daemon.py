"""The daemon config (`lorad serve --config FILE`); configs/daemon.yaml documents every key and default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from daemon.config.cluster import ClusterSettings
from daemon.config.gpu_health import GpuHealthSettings
from daemon.config.mirrors import MirrorSettings
from daemon.config.notify import NotifySettings
from daemon.config.power import PowerSettings
from daemon.config.web import WebSettings
from engine.config.describe import describe_errors
from engine.config.policy import JobPolicy
from engine.config.reading import MAX_JOB_FILE_BYTES, YamlProblem, read_yaml


class ConfigInvalid(Exception):
    pass


class DaemonConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # --- socket API
    socket: str | None = None  # default: $RUNTIME_DIRECTORY/lorad.sock under systemd, else HOME/lorad.sock
    socket_group: str | None = None  # members of this group may use the socket (besides root and the daemon's user)
    max_request_bytes: int = Field(1 << 20, ge=1024, le=64 << 20)
    client_timeout_s: float = Field(10.0, gt=0, le=3600)  # each request line must arrive whole within this long
    max_connections: int = Field(32, ge=1, le=4096)
    max_connections_per_user: int = Field(8, ge=1, le=4096)  # of those, the most one peer uid may hold

    # --- inbox and job intake
    allowed_roots: list[str] = Field(default_factory=lambda: ["{home}", "~"])  # job data/model paths must lie under one
    allow_trust_remote_code: bool = False
    max_job_file_bytes: int = Field(MAX_JOB_FILE_BYTES, ge=1024, le=MAX_JOB_FILE_BYTES)
    max_yaml_aliases: int = Field(16, ge=0, le=10_000)
    inbox_settle_s: float = Field(1.0, ge=0, le=3600)  # a file found by a rescan must be this old (mtime)
    inbox_rescan_s: float = Field(10.0, gt=0, le=3600)  # a rescan catches what the watcher missed
    rejected_keep_days: float = Field(30.0, gt=0, le=36500)  # older rejections are removed from rejected/
    rejected_keep: int = Field(1000, ge=1, le=1_000_000)  # and all but the newest this many
    # the events in state.db of a finished job: removed this long after it ended, and beyond the newest this many
    finished_events_keep_days: float = Field(90.0, gt=0, le=36500)
    finished_events_keep: int = Field(1000, ge=1, le=1_000_000)
    # one job's path checks (reading what it names) end by this deadline, or it is rejected naming the path
    intake_check_s: float = Field(30.0, gt=0, le=3600)

    # --- supervisor
    tick_s: float = Field(0.25, gt=0, le=10)
    devices: Union[Literal["auto"], list[int]] = "auto"  # GPU indices to use; auto = all visible (none: CPU, one job)
    hang_timeout_s: float = Field(600.0, gt=0)  # no heartbeat for this long (once steps flow) = hung
    hang_step_multiple: float = Field(20.0, gt=0)  # ... or this many median step times, whichever is longer
    startup_timeout_s: float = Field(1800.0, gt=0)  # loading the model, or a final checkpoint, may take this long
    rank_silence_s: float = Field(60.0, gt=0)  # a rank's liveness file this old, its process alive = hung
    retry_budget: int = Field(5, ge=0, le=1000)  # retries after crashes in a row; crash retry_budget + 1 = failed
    backoff_base_s: float = Field(10.0, ge=0)  # first retry after this long, then doubled
    backoff_max_s: float = Field(600.0, ge=0)
    stop_grace_s: float = Field(120.0, gt=0)  # SIGTERM → SIGKILL; keep systemd's TimeoutStopSec above it
    kill_wait_s: float = Field(30.0, gt=0, le=3600)  # alive this long after SIGKILL = stuck (hung driver): reported
    preempt: bool = True  # lower-priority running jobs checkpoint and yield to a higher-priority job that waits
    trainer_env: dict[str, str] = Field(default_factory=dict)  # extra environment for trainers (HF_HOME, ...)
    run_as_root: bool = False  # a root daemon starts only in a container, and only with this (daemon/system/privilege.py)
    warm_trainer: bool = True  # fork trainers from one pre-imported process (cold start whenever it cannot)
    trainer_user: str | None = None  # such a root daemon runs trainers as this user (else as root); else unused
    cache_max_bytes: int = Field(100 << 30, ge=0)  # HOME/cache's size limit (LRU eviction after a fill); 0: none

    # VRAM other programs hold (daemon/gpu_health/): plan = start with the free memory as the job's budget
    # (LORAD_VRAM_BUDGET_GB for the memory planner); wait = do not start until it is free
    gpu_memory_policy: Literal["plan", "wait"] = "plan"
    gpu_health: GpuHealthSettings = Field(default_factory=GpuHealthSettings)

    power: PowerSettings = Field(default_factory=PowerSettings)
    web: WebSettings = Field(default_factory=WebSettings)
    notify: NotifySettings = Field(default_factory=NotifySettings)
    cluster: ClusterSettings | None = None  # jobs that span machines (daemon/supervisor/cluster.py); none: refused at submit
    mirrors: dict[str, MirrorSettings] = Field(default_factory=dict)  # named off-box copies (daemon/mirror/)
    default_mirror: str | None = None  # the mirror of a job that names none (output.mirror); null: none
    # Hub users/organisations a job's output.push_to_hub may name (the daemon's HF token writes only there); none:
    # no job may push (daemon/mirror/hub.py)
    hub_namespaces: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9][\w.-]{0,95}$")]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _default_mirror_named(self) -> DaemonConfig:
        if self.default_mirror is not None and self.default_mirror not in self.mirrors:
            raise ValueError(f"default_mirror {self.default_mirror!r} is not one of mirrors: {sorted(self.mirrors)}")
        return self

    def roots(self, home: Path) -> list[Path]:
        out = []
        for r in self.allowed_roots:
            p = Path(os.path.expanduser(r.replace("{home}", str(home))))
            out.append(p.resolve())
        return out

    def job_policy(self, home: Path) -> JobPolicy:
        """What jobs may name: checked at intake, and by each trainer from its arguments."""
        return JobPolicy(allow_trust_remote_code=self.allow_trust_remote_code, roots=tuple(self.roots(home)),
                         cache_max_bytes=self.cache_max_bytes or None)

    def socket_path(self, home: Path) -> Path:
        if self.socket:
            return Path(self.socket)
        return socket_default(home)


def check_hub_repo(repo: str, namespaces: list[str]) -> None:
    """JobInvalid, in one line naming the key, unless REPO (USER/NAME) lies in one of `namespaces` (hub_namespaces:
    where the daemon's Hub token may write)."""
    from engine.errors import JobInvalid

    if repo.partition("/")[0] not in namespaces:
        allowed = f"hub_namespaces: {sorted(namespaces)}" if namespaces else "its hub_namespaces is empty"
        raise JobInvalid(f"output.push_to_hub: {repo!r} is not in a namespace this daemon may push to ({allowed}; "
                         f"the daemon's config decides where its Hub token writes)")


def socket_default(home: Path) -> Path:
    rd = os.environ.get("RUNTIME_DIRECTORY")
    if rd:
        return Path(rd.split(":")[0]) / "lorad.sock"
    return Path(home) / "lorad.sock"


def load_config(path: str | Path | None) -> DaemonConfig:
    if path is None:
        return DaemonConfig()
    try:
        raw = read_yaml(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, YamlProblem) as e:
        raise ConfigInvalid(f"{path}: cannot read the daemon config: {e}") from None
    try:
        return DaemonConfig.model_validate(raw or {})
    except ValidationError as e:
        raise ConfigInvalid(f"{path}: {describe_errors(e, section_models(DaemonConfig))}") from None


def section_models(model: type[BaseModel], prefix: str = "") -> dict[str, type[BaseModel]]:
    """Every section of the config by its dotted path ("" is the top): where an unknown key's neighbours live."""
    out: dict[str, type[BaseModel]] = {prefix: model}
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out.update(section_models(f.annotation, f"{prefix}.{name}" if prefix else name))
    return out
