"""The daemon config's `mirrors:` section: named off-box copies of jobs (daemon/mirror/), and the default one.

A mirror is an fsspec URL: `s3://BUCKET/PREFIX` (AWS or any S3-compatible endpoint: R2, B2, MinIO),
`sftp://[USER@]HOST[:PORT]/PATH` (a NAS, another machine) or `file:///PATH` (a mounted NFS share). Secrets are
never written here: they come from the environment (AWS_ACCESS_KEY_ID, ...) or from the credentials file named
here, which the daemon reads when it opens the mirror, and nothing it reads is written anywhere.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

SCHEMES = ("s3", "sftp", "file")


class MirrorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str  # s3://bucket/prefix, sftp://user@host:22/path or file:///mnt/nas/lorad
    endpoint_url: str | None = None  # S3-compatible: the endpoint (http://127.0.0.1:9000, https://ACCOUNT.r2...)
    region: str | None = None  # S3: the region name, when the endpoint needs one
    # YAML or JSON, readable by the daemon alone: S3 `key`, `secret`, `token`; SFTP `username`, `password`,
    # `client_keys` (private key files), `known_hosts` (a file; the user's ~/.ssh/known_hosts when unset)
    credentials_file: str | None = None
    bandwidth_bytes_s: int | None = Field(None, gt=0)  # uploads are paced to this many bytes a second; null: no cap
    timeout_s: float = Field(10.0, gt=0, le=600)  # connect and per-request timeout
    retry_base_s: float = Field(2.0, gt=0, le=3600)  # a failed upload is retried after this long, then doubled ...
    retry_max_s: float = Field(60.0, gt=0, le=3600)  # ... up to this; a mirror that is down never fails a job

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"must be an s3://, sftp:// or file:// URL (got {v!r})")
        if parts.scheme in ("s3", "sftp") and not parts.netloc:
            raise ValueError(f"names no {'bucket' if parts.scheme == 's3' else 'host'} (got {v!r})")
        if parts.scheme == "file" and not parts.path.startswith("/"):
            raise ValueError(f"must be an absolute path (got {v!r})")
        if parts.password:
            raise ValueError("holds a password: put it in credentials_file, never in the config")
        return v.rstrip("/")
