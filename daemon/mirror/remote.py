"""One mirror's storage, over fsspec: S3-compatible (s3fs), SFTP (sshfs, asyncssh) or a mounted path.

The same few operations whatever the backend: put bytes, get bytes, list a folder, remove. Credentials come from
the environment (botocore's AWS_* variables, asyncssh's ~/.ssh) or the mirror's credentials file, read here
each time the storage is opened; they live only in this object's connection and never in a message: every
error this module raises has them scrubbed out (`scrub`).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from daemon.config.mirrors import MirrorSettings

SCRUBBED = "***"
# A key (the first part of every remote path) is a job id, as lorad makes them (daemon/store/db.py new_id: the
# job's name, engine/config/schema.py NAME_RE, and a suffix): one path component, never "." or "..".
KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
CHUNK = 1 << 20  # reads and writes go in pieces of this size: memory stays flat whatever a file's size
WRITE_BLOCK = 8 << 20  # an object store's buffer per open file: a part sent (S3's smallest: 5 MiB), a range read
GET_MOST = 64 << 20  # get(): what a caller that names no limit may read into memory at most
BURST_S = 0.25  # the bandwidth cap lets this many seconds of unused budget go at once after a quiet spell


class MirrorError(Exception):
    """A mirror operation that failed, its message free of credentials."""


class TooLarge(MirrorError):
    """A remote file larger than it may be (its manifest's size, a bound on small files): not read further."""


def check_key(key: str) -> str:
    """KEY itself, or MirrorError in one line naming it: a job id, never a path (no "/", "..", nothing absolute)."""
    if not isinstance(key, str) or not KEY.match(key):
        raise MirrorError(f"mirror key {str(key)[:200]!r} is not a job id (letters, digits, '.', '_' and '-', "
                          f"starting with a letter or digit: no '/', no '..', nothing absolute)")
    return key


def read_credentials(path: str | None) -> dict[str, Any]:
    """The credentials file (YAML or JSON mapping); {} when none is named."""
    if path is None:
        return {}
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        # The path, never the content: a YAML error quotes the line it stopped on.
        raise MirrorError(f"cannot read the credentials file {path} ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise MirrorError(f"the credentials file {path} is not a mapping of names to values")
    return doc


def secrets_of(creds: dict[str, Any]) -> list[str]:
    """The values a message must never show (user names and key file paths are not secret)."""
    return [str(v) for k, v in creds.items() if k in ("key", "secret", "token", "password", "passphrase") and v]


def scrub(message: str, secrets: list[str]) -> str:
    for s in secrets:
        if len(s) >= 4:
            message = message.replace(s, SCRUBBED)
    return message


class Remote:
    """A mirror's storage under its URL's path: opened lazily, dropped after a failure (reopened on next use)."""

    def __init__(self, name: str, settings: MirrorSettings, read_only: bool = False):
        self.name = name
        self.settings = settings
        self.read_only = read_only  # a download (lorad submit --from): it never writes or removes there
        parts = urlsplit(settings.url)
        self.scheme = parts.scheme
        self.root = (parts.netloc + parts.path if parts.scheme == "s3" else parts.path).rstrip("/")
        self._fs = None
        self._secrets: list[str] = []
        self._sent_at = 0.0  # pacing: when the bytes sent so far may have left at the capped rate

    # ------------------------------------------------------------------ opening
    def fs(self):
        if self._fs is None:
            creds = read_credentials(self.settings.credentials_file)
            self._secrets = secrets_of(creds)
            try:
                self._fs = self._open(creds)
            except Exception as e:  # noqa: BLE001 — every backend has its own errors; one message for all
                raise self.error("cannot connect", e) from None
        return self._fs

    def _open(self, creds: dict[str, Any]):
        s, t = self.settings, self.settings.timeout_s
        if self.scheme == "s3":
            import s3fs

            client: dict[str, Any] = {"region_name": s.region} if s.region else {}
            fs = s3fs.S3FileSystem(key=creds.get("key"), secret=creds.get("secret"), token=creds.get("token"),
                                   endpoint_url=s.endpoint_url, client_kwargs=client, skip_instance_cache=True,
                                   use_listings_cache=False,
                                   config_kwargs={"connect_timeout": t, "read_timeout": t,
                                                  "retries": {"max_attempts": 1}})
            fs.retries = 1  # our own backoff retries (daemon/mirror/uploader.py); s3fs's would stall a pass
            return fs
        if self.scheme == "sftp":
            from sshfs import SSHFileSystem

            parts = urlsplit(s.url)
            opts: dict[str, Any] = {"port": parts.port or 22, "connect_timeout": t, "timeout": t}
            user = creds.get("username") or parts.username
            if user:
                opts["username"] = user
            for k in ("password", "passphrase", "client_keys", "known_hosts"):
                if k in creds:
                    opts[k] = creds[k]
            return SSHFileSystem(parts.hostname, skip_instance_cache=True, **opts)
        import fsspec

        return fsspec.filesystem("file", skip_instance_cache=True)

    def reset(self) -> None:
        """Forget the connection (after a failure: the server may have gone and come back)."""
        self._fs = None

    def error(self, what: str, e: BaseException) -> MirrorError:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return MirrorError(scrub(f"mirror {self.name!r}: {what}: {text}"[:500], self._secrets))

    def path(self, rel: str) -> str:
        """ROOT/REL, REL being KEY/...: its key a job id and no part of it empty, "." or ".." (MirrorError)."""
        if not rel:
            return self.root
        parts = rel.split("/")
        check_key(parts[0])
        if any(part in ("", ".", "..") or "\\" in part for part in parts):
            raise MirrorError(f"mirror path {rel[:200]!r} is not a path below its key")
        return f"{self.root}/{rel}"

    def _open_opts(self, block: int, **more: Any) -> dict[str, Any]:
        """An object store's buffer per open file, kept small; SFTP (sshfs) reads and writes what it is given at
        once, its own request sizes (a larger one would pass the 256 KiB OpenSSH allows), and a path has none."""
        return {"block_size": block, **more} if self.scheme == "s3" else {}

    def _writable(self, rel: str) -> None:
        if self.read_only:
            raise MirrorError(f"mirror {self.name!r}: {rel} not written: this use of the mirror only reads it")

    def _call(self, what: str, fn, *args, missing: bool = True):
        """fn(fs, *args); FileNotFoundError passes through when `missing` (a read of what is not there), every
        other failure is a MirrorError (and the connection is dropped)."""
        fs = self.fs()
        try:
            return fn(fs, *args)
        except FileNotFoundError as e:
            if missing:
                raise
            self.reset()
            raise self.error(what, e) from None
        except MirrorError:
            raise  # ours, already worded (a file too large, a checksum that does not match)
        except Exception as e:  # noqa: BLE001
            self.reset()
            raise self.error(what, e) from None

    # ------------------------------------------------------------------ operations
    def put(self, rel: str, data: bytes) -> None:
        self.put_stream(rel, (data[i:i + CHUNK] for i in range(0, len(data), CHUNK)))

    def put_stream(self, rel: str, chunks: Iterable[bytes]) -> int:
        """Write REL from `chunks`, one at a time (the bandwidth cap paced per chunk); the bytes written.

        A MirrorError or FileNotFoundError raised by `chunks` (a checksum that does not match, a local file pruned
        meanwhile) passes through; what was written of REL may stay (a checkpoint's manifest goes last, so a torn
        file is never used)."""
        self._writable(rel)
        n, source = 0, iter(chunks)
        failed: list[BaseException] = []  # what `chunks` raised: passed on as it is, not as the server's error

        def do(fs, path: str) -> None:
            nonlocal n
            if self.scheme != "s3":  # object stores have no folders; a missing bucket must stay an error
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with fs.open(path, "wb", **self._open_opts(WRITE_BLOCK)) as f:
                while True:
                    try:
                        chunk = next(source)
                    except StopIteration:
                        return
                    except Exception as e:
                        failed.append(e)
                        raise
                    f.write(chunk)
                    n += len(chunk)
                    self._pace(len(chunk))

        try:
            # never "pruned locally" to the uploader: a FileNotFoundError of the server's is a MirrorError
            self._call(f"upload {rel}", do, self.path(rel), missing=False)
        except MirrorError:
            if failed:
                raise failed[0] from None
            raise
        return n

    def put_json(self, rel: str, doc: Any) -> None:
        self.put(rel, json.dumps(doc, indent=1).encode())

    def get(self, rel: str, most: int = GET_MOST) -> bytes:
        """REL's bytes (a small file: a job.yaml, a manifest): TooLarge beyond `most`."""
        out = bytearray()
        self.read_to(rel, out.extend, most)
        return bytes(out)

    def read_to(self, rel: str, sink: Callable[[bytes], object], most: int) -> int:
        """Stream REL into sink(chunk), CHUNK bytes at a time; the bytes read. A file larger than `most` is refused
        (TooLarge) as soon as it passes it: nothing beyond is read. FileNotFoundError when it is not there."""
        n = 0

        def do(fs, path: str) -> None:
            nonlocal n
            with fs.open(path, "rb", **self._open_opts(WRITE_BLOCK, cache_type="readahead")) as f:
                while chunk := f.read(min(CHUNK, most + 1 - n)):
                    n += len(chunk)
                    if n > most:
                        raise TooLarge(f"mirror {self.name!r}: {rel} is larger than the {most} bytes it may have")
                    sink(chunk)

        self._call(f"download {rel}", do, self.path(rel))
        return n

    def listdir(self, rel: str) -> list[str]:
        """Names in a folder ([] when it does not exist)."""
        def do(fs, path: str) -> list[str]:
            try:
                return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
            except FileNotFoundError:
                return []

        return self._call(f"list {rel or '/'}", do, self.path(rel))

    def exists(self, rel: str) -> bool:
        return bool(self._call(f"look for {rel}", lambda fs, p: fs.exists(p), self.path(rel)))

    def remove(self, rel: str) -> None:
        self._writable(rel)

        def do(fs, path: str) -> None:
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass

        self._call(f"remove {rel}", do, self.path(rel))

    def check(self) -> None:
        """Reachable, credentials accepted, the bucket (or folder) there: a listing of the root, or MirrorError."""
        def do(fs, path: str) -> None:
            if self.scheme == "s3":
                fs.ls(path.split("/", 1)[0], detail=False)  # NoSuchBucket, InvalidAccessKeyId, ...
            elif not fs.exists(path):
                fs.makedirs(path, exist_ok=True)

        try:
            self._call("check", do, self.root)
        except FileNotFoundError as e:
            raise self.error("the bucket or folder does not exist", e) from None

    def _pace(self, n: int) -> None:
        """The bandwidth cap, as an average: after n bytes, wait until they would have left at the capped rate."""
        cap = self.settings.bandwidth_bytes_s
        if cap is None:
            return
        now = time.monotonic()
        self._sent_at = max(self._sent_at, now - BURST_S) + n / cap  # unused budget carried: at most BURST_S
        if self._sent_at > now:
            time.sleep(self._sent_at - now)
