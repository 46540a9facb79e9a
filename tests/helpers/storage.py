"""Real storage servers on loopback for the mirror tests: moto's S3 server and Debian's sshd (SFTP).

moto runs with authentication on (after the few unauthenticated calls that create the bucket, a user, its policy
and its access key), so a wrong secret is refused as by AWS. sshd runs from a test config on a free port with a
generated host key, accepting one generated user key; its SFTP is internal-sftp. Both can be killed and started
again on the same port (the network faults); sshd's files survive that, moto's memory does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

SSHD = "/usr/sbin/sshd"
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


@dataclass
class Server:
    """One server process, killable and restartable on its port."""
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True)
        wait_port(self.port)
        return self

    def kill(self) -> None:
        """The server goes down with every connection it holds, as a machine that dies or reboots does."""
        if self.proc is not None and self.proc.poll() is None:
            # sshd's per-connection processes each start a session of their own: killing the listener's group
            # left established SFTP connections up, and an upload in flight never saw the server go.
            below = descendants(self.proc.pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)


def descendants(pid: int) -> list[int]:
    """The processes below pid (children, grandchildren, ...), read from /proc."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


@dataclass
class S3:
    server: Server
    endpoint: str
    bucket: str
    credentials: Path  # key and secret, as a mirror's credentials_file
    secret: str

    def provision(self) -> None:
        """The bucket, and a user whose access key the credentials file holds (the unauthenticated calls)."""
        import boto3

        kw = dict(endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                  aws_secret_access_key="bootstrap")
        boto3.client("s3", **kw).create_bucket(Bucket=self.bucket)
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="lorad")
        iam.put_user_policy(UserName="lorad", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="lorad")["AccessKey"]
        self.secret = key["SecretAccessKey"]
        self.credentials.write_text(yaml.safe_dump({"key": key["AccessKeyId"], "secret": self.secret}))
        self.credentials.chmod(0o600)

    def restart(self) -> None:
        """Killed and started again: empty (moto keeps nothing) and, this time, checking no credentials (the
        uploader's retries would take the unauthenticated calls that provisioning needs); the bucket made again."""
        import boto3

        self.server.kill()
        self.server.env = {}
        self.server.start()
        boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id="bootstrap",
                     aws_secret_access_key="bootstrap").create_bucket(Bucket=self.bucket)

    def mirror(self, prefix: str, **over) -> dict:
        return {"url": f"s3://{self.bucket}/{prefix}", "endpoint_url": self.endpoint, "region": REGION,
                "credentials_file": str(self.credentials), "retry_base_s": 0.2, "retry_max_s": 1.0,
                "timeout_s": 3.0, **over}


def start_s3(root: Path) -> S3:
    port = free_port()
    # Four calls without credentials (bucket, user, policy, access key), then every request is checked.
    server = Server([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port,
                    root / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"}).start()
    s3 = S3(server, f"http://127.0.0.1:{port}", "lorad-mirror", root / "s3-credentials.yaml", "")
    s3.provision()
    return s3


@dataclass
class Sftp:
    server: Server
    port: int
    root: Path  # the served folder (a local path: what the tests look at directly)
    credentials: Path
    user: str

    def restart(self) -> None:
        self.server.kill()
        self.server.start()

    def mirror(self, prefix: str, **over) -> dict:
        return {"url": f"sftp://{self.user}@127.0.0.1:{self.port}{self.root}/{prefix}",
                "credentials_file": str(self.credentials), "retry_base_s": 0.2, "retry_max_s": 1.0,
                "timeout_s": 3.0, **over}


def sshd_available() -> str | None:
    """Why sshd cannot be run here (None: it can)."""
    if not Path(SSHD).exists():
        return f"no {SSHD} (make test installs openssh-server: the `system-deps` target)"
    return None


def start_sftp(root: Path) -> Sftp:
    d = root / "sshd"
    d.mkdir()
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port = free_port()
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host_key'}", f"PidFile {d / 'sshd.pid'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", f"AllowUsers {user}", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "StrictModes no", "UsePAM no",
        "Subsystem sftp internal-sftp", ""]))
    host = (d / "host_key.pub").read_text().split()
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {host[0]} {host[1]}\n")
    creds = d / "credentials.yaml"
    creds.write_text(yaml.safe_dump({"username": user, "client_keys": [str(d / "user_key")],
                                     "known_hosts": str(d / "known_hosts")}))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
    served = root / "sftp-root"
    served.mkdir()
    server = Server([SSHD, "-D", "-e", "-f", str(d / "sshd_config"), "-p", str(port)], port, d / "sshd.log").start()
    return Sftp(server, port, served, creds, user)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on loopback, once per session (its bucket: lorad-mirror; each test its own prefix)."""
    s3 = start_s3(tmp_path_factory.mktemp("s3"))
    yield s3
    s3.server.kill()


@pytest.fixture(scope="session")
def sftp_server(tmp_path_factory):
    """sshd on loopback with SFTP, once per session; skipped with the reason only when sshd cannot be had."""
    if (why := sshd_available()) is not None:
        pytest.skip(why)
    sftp = start_sftp(tmp_path_factory.mktemp("sftp"))
    yield sftp
    sftp.server.kill()
