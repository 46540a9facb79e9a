"""The warm trainer's process (the zygote): the training stack imported once, one trainer forked per request.

    python -m daemon.supervisor.zygote FD

FD is its end of a SOCK_SEQPACKET socket pair with the daemon (daemon/supervisor/warm_trainer.py). A child keeps
this command line (no rewriting of process memory): it is found as a trainer by its working directory, the job's
(daemon/system/proc.find_trainers), and by the pid the daemon records. Messages are JSON, one per packet:

    zygote → daemon   {"ready": FINGERPRINT, "cuda": false}     once the imports are done
    daemon → zygote   {"argv", "env", "cwd", "umask", "lock_fd"} + SCM_RIGHTS [stdout, stderr, lock]
    zygote → daemon   {"pid": N} | {"error": "..."}             the answer to each request, in order
    zygote → daemon   {"exited": N, "code": C}                   a child ended (Popen's returncode convention)
    daemon → zygote   {"reap": N}                                 collect it now (its pid is free again)

A child's status is collected only when the daemon asks, so that, as with a Popen, the daemon can SIGKILL what
the trainer left in its process group before the pid can be handed to anyone else. On EOF the zygote exits and
leaves its children alone: they are orphans, exactly like a cold trainer after a daemon death.
"""

from __future__ import annotations

import array
import atexit
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time

from engine.imports import unwalked_imports
from engine.training.stop import EXIT_INVALID

# What a trainer imports before its first step, whatever its family (tests/helpers/forked.py keeps a like list).
# A family's training code is its package's family.py (the package itself is plain data: engine/registry/).
PRELOAD = ["engine.recipe", "engine.config.job", "engine.distributed.ddp", "engine.families.image.base",
           "engine.families.image.flux2.family", "engine.families.image.qwen_image.family",
           "engine.families.image.z_image.family", "engine.families.image.chroma.family",
           "engine.families.image.flux.family", "engine.families.causal_lm.family", "peft",
           "torch.utils.tensorboard", "diffusers.pipelines.flux2.pipeline_flux2_klein",
           "diffusers.pipelines.qwenimage.pipeline_qwenimage", "diffusers.pipelines.z_image.pipeline_z_image",
           "diffusers.pipelines.chroma.pipeline_chroma", "diffusers.models.transformers.transformer_flux",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.llama.modeling_llama",
           "transformers.models.t5.modeling_t5", "transformers.models.clip.modeling_clip"]
MAX_MSG = 1 << 20
# Tests only: a path; when it exists, the zygote removes it, writes the pid of the child it just forked to PATH.pid
# and dies before answering (the daemon must then count the start as failed: a trainer may run).
DIE_AFTER_FORK = os.environ.get("LORAD_TEST_ZYGOTE_DIES_AFTER_FORK")
ORPHAN_DELAY_S = 1.0  # that child waits this long before training: a start in that window would be a second


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: what Popen(start_new_session, umask, pass_fds, cwd, env) does, then engine.run."""
    code = 1
    try:
        os.setsid()
        os.umask(req["umask"])
        signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGUSR1})  # unblocked by the trainer's handler
        high = [fcntl_dup_above(fd, max(req["lock_fd"], 2) + 1) for fd in fds]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(high[0], 1)
        os.dup2(high[1], 2)
        os.dup2(high[2], req["lock_fd"], inheritable=True)
        for fd in {null, *fds, *high} - {0, 1, 2, req["lock_fd"]}:
            os.close(fd)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        try:
            os.chdir(req["cwd"])
        except PermissionError as e:
            # The trainer user cannot enter its job directory: a configuration error (docs/security.md), which
            # every retry would meet again. 65, as an invalid job: failed with this line, never retried.
            print(f"configuration error: the trainer (uid {os.getuid()}) cannot enter its job directory "
                  f"{req['cwd']}: {e.strerror}", file=sys.stderr)
            code = EXIT_INVALID
            return
        os.environ.clear()
        os.environ.update(req["env"])
        if "OMP_NUM_THREADS" in req["env"]:  # torch read it at import: apply it as a new interpreter would
            import torch

            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        argv = req["argv"]
        sys.argv = [argv[0], *argv[3:]]  # [python, -m, engine.run, ...]: runpy puts the module's path first
        try:
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 — as an interpreter would: the traceback on stderr, exit 1
        import traceback

        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def fcntl_dup_above(fd: int, low: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, low)


def _take(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _exit_code(info) -> int:
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class Zygote:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.children: set[int] = set()  # forked, not yet reported as exited
        self.reported: set[int] = set()  # reported, waiting for the daemon's reap
        self.wake: tuple[int, int] = (-1, -1)

    def send(self, msg: dict) -> None:
        self.sock.send(json.dumps(msg).encode())

    def request(self) -> bool:
        fds = array.array("i")
        msg, anc, _flags, _addr = self.sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(16 * fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if not msg:
            return False  # EOF: the daemon is gone
        req = json.loads(msg)
        if "reap" in req:
            if req["reap"] in self.reported:
                self.reported.discard(req["reap"])
                os.waitpid(req["reap"], 0)
            return True
        die = DIE_AFTER_FORK is not None and _take(DIE_AFTER_FORK)
        try:
            pid = os.fork()
        except OSError as e:
            self.send({"error": f"fork: {e}"})
        else:
            if pid == 0:
                self.leave()
                if die:
                    time.sleep(ORPHAN_DELAY_S)
                _child(req, list(fds))
            if die:
                with open(f"{DIE_AFTER_FORK}.pid", "w") as f:
                    f.write(str(pid))
                os.kill(os.getpid(), signal.SIGKILL)
            self.children.add(pid)
            self.send({"pid": pid})
        for fd in fds:
            os.close(fd)
        return True

    def check_children(self) -> None:
        for pid in list(self.children):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                self.children.discard(pid)
                self.reported.add(pid)
                self.send({"exited": pid, "code": _exit_code(info)})

    def leave(self) -> None:
        """In a new child: nothing of the zygote's loop stays (its socket, SIGCHLD's handler and wake-up pipe)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in self.wake:
            os.close(fd)
        self.sock.close()

    def serve(self) -> None:
        r, w = self.wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ, "sock")
        sel.register(r, selectors.EVENT_READ, "chld")
        while True:
            for key, _ in sel.select():
                if key.data == "chld":
                    while True:
                        try:
                            os.read(r, 4096)
                        except BlockingIOError:
                            break
                    self.check_children()
                elif not self.request():
                    os._exit(0)  # its children are left alone: orphans, as after a cold trainer's daemon dies


def main(argv: list[str]) -> int:
    from daemon.supervisor.warm_fingerprint import fingerprint

    sock = socket.socket(fileno=int(argv[0]))
    fp = fingerprint()  # before the imports: a file changed while they run makes the next look differ
    # Frozen, the imported heap also stays shared with every child, unwalked by their collections.
    with unwalked_imports():
        from engine.training.adapters import import_bitsandbytes

        import_bitsandbytes()  # before PRELOAD's peft: without compiling kernels no trainer calls (~1 s)
        for name in PRELOAD:
            importlib.import_module(name)
        import torch

    cuda = torch.cuda.is_initialized()
    if cuda:  # a forked child cannot use CUDA initialised in its parent
        sock.send(json.dumps({"error": "CUDA was initialised by the imports"}).encode())
        return 1
    z = Zygote(sock)
    z.send({"ready": fp, "cuda": cuda, "pid": os.getpid()})
    z.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
