"""The socket protocol: newline-delimited JSON, one typed request per CLI verb, one reply shape per request.

Every message carries `v` (the protocol version). A request line is at most
`max_request_bytes`; anything malformed, oversize, of an unknown verb or of
another version gets an ErrorReply and the connection stays usable (or is
closed, for oversize lines whose end cannot be found).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import from_json

VERSION = 1
MAX_NESTING = 200  # pydantic_core's parser refuses JSON nested deeper (its recursion limit)
JOB_REF = Field(min_length=1, max_length=200)


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: int = VERSION


# ---------------------------------------------------------------- requests (one per verb)
class Ping(_Msg):
    verb: Literal["ping"] = "ping"


class Submit(_Msg):
    verb: Literal["submit"] = "submit"
    name: str = Field(min_length=1, max_length=200)  # the job file's name, for messages
    text: str = ""  # the normalised job YAML (absolute paths); validated again by the daemon
    # MIRROR_URL/JOB, NAME/JOB or a job key: the job restored from a mirror (daemon/mirror/); text, when given,
    # must match its checkpoint's identity
    from_mirror: str | None = Field(None, min_length=1, max_length=1000)

    def __repr_args__(self):  # keep whole configs out of debug output
        return [("verb", self.verb), ("name", self.name), ("text", f"<{len(self.text)} chars>")]


class Status(_Msg):
    verb: Literal["status"] = "status"
    job: str | None = Field(None, max_length=200)  # None: the whole queue


class Logs(_Msg):
    verb: Literal["logs"] = "logs"
    job: str = JOB_REF
    offset: int = Field(-1, ge=-1)  # byte offset in events.jsonl; -1 = the last `tail` lines
    tail: int = Field(50, ge=0, le=10_000)


class Pause(_Msg):
    verb: Literal["pause"] = "pause"
    job: str = JOB_REF
    expect: str | None = Field(None, max_length=20)  # the state the asker saw; refused if the job has moved on


class Resume(_Msg):
    verb: Literal["resume"] = "resume"
    job: str = JOB_REF


class Cancel(_Msg):
    verb: Literal["cancel"] = "cancel"
    job: str = JOB_REF
    expect: str | None = Field(None, max_length=20)  # the state the asker saw; refused if the job has moved on


class Retry(_Msg):
    verb: Literal["retry"] = "retry"
    job: str = JOB_REF


class SetPriority(_Msg):
    verb: Literal["priority"] = "priority"
    job: str = JOB_REF
    priority: int = Field(ge=-1000, le=1000)


class Drain(_Msg):
    verb: Literal["drain"] = "drain"
    on: bool = True  # False: take jobs again


class Power(_Msg):
    verb: Literal["power"] = "power"
    limit_w: float | None = Field(None, ge=1, le=2000)  # set a manual power limit (W); None: only report
    gpu: int | None = Field(None, ge=0, le=63)  # the GPU for limit_w; None: every GPU
    clear: bool = False  # drop the manual limit (back to caps.default_w / the driver's limit)


class WebUrl(_Msg):
    verb: Literal["web-url"] = "web-url"


class Exports(_Msg):
    """`lorad export`: a job's saved steps and their user-format files (step: only that one, refused if absent)."""
    verb: Literal["export"] = "export"
    job: str = JOB_REF
    step: int | None = Field(None, ge=0, le=99_999_999)  # checkpoint directories name 8 digits


class Gpu(_Msg):
    """`lorad gpu`: each GPU's health (daemon/gpu_health/); `lorad gpu clear N` first forgets GPU N's faults, so
    that a GPU held out after repeated faults is scheduled again."""
    verb: Literal["gpu"] = "gpu"
    clear: int | None = Field(None, ge=0, le=63)


# A new verb: a request class above, added here, its reply model in REPLY_TYPES below, and a handler in
# daemon/service/handlers.py.
REQUEST_TYPES: list[type[_Msg]] = [Ping, Submit, Status, Logs, Pause, Resume, Cancel, Retry, SetPriority, Drain, Power,
                                   WebUrl, Exports, Gpu]
Request = Annotated[Union[tuple(REQUEST_TYPES)], Field(discriminator="verb")]  # type: ignore[valid-type]
REQUEST = TypeAdapter(Request)
VERBS = {m.model_fields["verb"].default for m in REQUEST_TYPES}


# ---------------------------------------------------------------- replies
class MirrorLag(BaseModel):
    """A job's mirror (daemon/mirror/): how far the remote copy is behind the local commits, and its last error."""
    mirror: str | None = None
    key: str | None = None  # the job's folder on the mirror
    local_step: int | None = None  # the newest local commit
    remote_step: int | None = None  # the newest complete remote checkpoint
    behind_steps: int | None = None
    behind_s: float | None = None  # since the oldest commit not mirrored yet
    last_upload_at: float | None = None
    last_error: str | None = None
    output_mirrored: bool = False
    caught_up: bool = False
    fetching: str | None = None  # lorad submit --from: the download's progress (daemon/mirror/fetcher.py)
    hub_repo: str | None = None  # output.push_to_hub (daemon/mirror/hub.py)
    hub_pushed: bool = False
    hub_error: str | None = None


class JobRow(BaseModel):
    id: str
    name: str
    state: str
    priority: int
    step: int
    total: int
    loss: float | None = None
    val_loss: float | None = None  # the last validation loss (data.validation), at val_step
    val_step: int | None = None
    s_per_step: float | None = None
    eta_s: float | None = None
    last_error: str | None = None
    requested: str | None = None
    retries: int = 0
    wait_bytes: int | None = None  # waiting: the free space it needs
    gpu_note: str | None = None  # what the daemon decided about its GPU memory (gpu_memory_policy), if anything
    mirror: MirrorLag | None = None  # a mirrored job's lag
    memory_plan: str | None = None  # the last attempt's memory plan in words (engine/memory_plan/)


class Attempt(BaseModel):
    n: int
    started_at: float
    ended_at: float | None = None
    pid: int | None = None
    exit_code: int | None = None
    start_step: int = 0
    end_step: int | None = None
    error: str | None = None


class JobDetail(JobRow):
    workdir: str
    source: str | None = None
    submitted_at: float
    last_checkpoint: str | None = None
    checkpoint_step: int | None = None
    output: str | None = None
    pid: int | None = None
    not_before: float = 0
    attempts: list[Attempt] = []
    events: list[dict[str, Any]] = []
    samples_step: int | None = None  # the newest step with rendered sample images (Flux jobs)
    samples: list[str] = []  # their PNG paths
    imported_from: str | None = None  # another trainer's config it was imported from (ai-toolkit, kohya, ...)
    not_carried_over: list[str] = []  # what of that config lorad did not carry over, and why


class Reply(_Msg):
    """The envelope of every answer: `data` is one verb's reply model (below), dumped by `answer`."""
    ok: Literal[True] = True
    data: dict[str, Any] = {}


class ErrorReply(_Msg):
    ok: Literal[False] = False
    error: str  # a short code: bad_json, too_large, bad_request, unknown_verb, version, not_found, refused, internal
    message: str


class ProtocolError(Exception):
    """A request answered with an error code and a message: raised when a line does not parse, by a handler that
    refuses, and by the client when the daemon answered with an ErrorReply."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# ---------------------------------------------------------------- reply data (one model per verb)
Number = int | float  # kept as sent: a float field would turn 5 into 5.0 on the wire


class _Data(BaseModel):
    # Fields a newer daemon adds are ignored by an older client rather than refused.
    model_config = ConfigDict(extra="ignore")

    def wire(self) -> dict[str, Any]:
        """The reply's `data` as it goes on the wire."""
        return self.model_dump()


class PingReply(_Data):
    version: str | None = None  # an older daemon does not say
    pid: int
    home: str
    socket: str
    uptime_s: Number
    protocol: int
    draining: bool
    running: int
    notes: list[str] = []


class SameName(BaseModel):
    id: str
    state: str


class SubmitReply(_Data):
    job: str
    same_name: list[SameName] = []  # other jobs of the same name, to be told apart by id
    restored: str | None = None  # --from: what the mirror holds; the download goes on in the background


class QueueReply(_Data):
    """`lorad status` without a job: the queue, the inbox's stuck files and its recent rejections."""
    jobs: list[JobRow]
    draining: bool = False
    notes: list[str] = []
    rejected: list[dict[str, Any]] = []
    rejected_within_s: Number = 86400
    rejected_total: int = 0
    rejected_dir: str = "rejected"
    inbox_stuck: list[dict[str, Any]] = []
    inbox_retry_s: Number | None = None
    gpus: list[dict[str, Any]] = []  # each GPU's health (daemon/gpu_health/verdict.py: GpuVerdict.view)


class JobStatusReply(_Data):
    """`lorad status JOB`: one job in detail and its energy figures (None: nothing measured)."""
    job: JobDetail
    power: dict[str, Any] | None = None


class LogsReply(_Data):
    job: str
    lines: list[dict[str, Any]]
    offset: int  # where the next `lorad logs -f` read starts
    state: str


class JobActionReply(_Data):
    """pause, resume, cancel, retry: the job, its state now and what happened, in words."""
    job: str
    state: str
    message: str


class PriorityReply(_Data):
    job: str
    state: str
    priority: int
    message: str


class DrainReply(_Data):
    draining: bool
    message: str


class PowerReply(_Data):
    """`lorad power`: the power report (its keys vary with what the daemon runs: kept as sent), after `set`, the
    outcome of setting or clearing a manual limit when one was asked for."""
    model_config = ConfigDict(extra="allow")
    set: dict[str, Any] | None = None  # {"ok": bool, "error" or "gpus", ...}

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)  # `set` only when a limit was asked for, as it always was


class WebUrlReply(_Data):
    url: str  # with the token
    base: str


class ExportFile(BaseModel):
    name: str  # relative to the step's export/ directory
    size: int
    sha256: str


class SavedStep(BaseModel):
    step: int
    path: str  # the checkpoint directory; its files are in path/export/
    files: list[ExportFile]


class ExportsReply(_Data):
    job: str
    state: str
    steps: list[SavedStep]  # newest first

    @classmethod
    def of(cls, job: str, state: str, saved: list[Any]) -> ExportsReply:
        """From disk_progress.saved_exports' checkpoints (the daemon's answer and the daemon-less read alike)."""
        return cls(job=job, state=state, steps=[
            SavedStep(step=c.step, path=str(c.path), files=[ExportFile(name=f.name, size=f.size, sha256=f.sha256)
                                                            for f in c.exports]) for c in saved])


class GpuReply(_Data):
    gpus: list[dict[str, Any]]  # each GPU's health (daemon/gpu_health/verdict.py: GpuVerdict.view)
    cleared: int | None = None  # the GPU `clear` named
    message: str = ""  # what clearing did: scheduled again, or still out (a lost GPU stays out until it is back)


# Each request type's reply type; `status` answers the queue or one job.
StatusReply = QueueReply | JobStatusReply
REPLY_TYPES: dict[type[_Msg], Any] = {
    Ping: PingReply, Submit: SubmitReply, Status: StatusReply, Logs: LogsReply, Pause: JobActionReply,
    Resume: JobActionReply, Cancel: JobActionReply, Retry: JobActionReply, SetPriority: PriorityReply,
    Drain: DrainReply, Power: PowerReply, WebUrl: WebUrlReply, Exports: ExportsReply, Gpu: GpuReply,
}
_REPLY_ADAPTERS = {req: TypeAdapter(reply) for req, reply in REPLY_TYPES.items()}


def parse_reply(req: BaseModel, data: dict[str, Any]) -> Any:
    """A reply's `data` → the reply model of the request it answers."""
    return _REPLY_ADAPTERS[type(req)].validate_python(data)


def parse_request(line: bytes) -> BaseModel:
    """One request line → a typed request, or ProtocolError with a code and a message."""
    try:
        # pydantic's parser, not json.loads: nesting past MAX_NESTING is a ValueError (a 100k-deep array made
        # json.loads raise RecursionError, which no one caught)
        obj = from_json(line)
    except ValueError as e:
        why = f"nesting deeper than {MAX_NESTING} levels" if "recursion limit" in str(e) else str(e)
        raise ProtocolError("bad_json", f"not a JSON object: {why}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("bad_json", "a request must be a JSON object")
    if obj.get("v", VERSION) != VERSION:
        raise ProtocolError("version", f"protocol version {obj.get('v')!r} is not supported (this daemon speaks {VERSION})")
    verb = obj.get("verb")
    if verb not in VERBS:
        raise ProtocolError("unknown_verb", f"unknown verb {verb!r} (known: {', '.join(sorted(VERBS))})")
    try:
        return REQUEST.validate_python(obj)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'][1:])) or verb}: {err['msg']}" for err in e.errors())
        raise ProtocolError("bad_request", problems) from None


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode() + b"\n"


def answer(reply: _Data) -> bytes:
    return encode(Reply(data=reply.wire()))


def error(code: str, message: str) -> bytes:
    return encode(ErrorReply(error=code, message=message))

