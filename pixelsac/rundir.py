"""A run directory has one writer: an exclusive lock, and the checks made under it.

Two processes writing one run directory (a job started twice, a requeue while the first attempt
still runs) would interleave their rows in ``metrics.csv`` and overwrite each other's
checkpoints. A training run therefore holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock``
from before its first write to its exit. The kernel releases it when the process ends, however
it ends (SIGKILL included), so a requeued job always gets it; a second process while the first
holds it is refused in one line that names the holder's pid and host, which the holder writes
into the file.

``flock`` works on local filesystems and, on Linux, on NFS (where it is an fcntl byte-range lock
on the server); on a filesystem without locks the run says so and stops rather than running
unguarded.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path

from pixelsac.cli import RUN_DIR_LOCK, UsageError

#: The lock file in every run directory (``cli.out_dir_is_free`` does not count it as content).
LOCK_NAME = RUN_DIR_LOCK


class RunDirLock:
    """An exclusive lock on ``run_dir`` (created if absent), held until :meth:`release` or the
    process's end. A UsageError names the holder when another process has it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UsageError(
                    f"run_dir {self.run_dir} is in use by {holder} (lock {self.path}); one process writes a "
                    "run directory: wait for it to end, or choose another run_dir=..."
                ) from None
            raise UsageError(
                f"cannot lock run_dir {self.run_dir} ({os.strerror(exc.errno or 0)}): its filesystem "
                "offers no file locks; choose a run_dir on one that does"
            ) from None
        self._fd = fd
        try:  # who holds it, for the refusal another process prints (the lock holds without it)
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
        except OSError:
            pass
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process (it has not written its pid yet)"


def clear_checkpoints(run_dir: Path) -> None:
    """``overwrite=true``: the earlier run's checkpoints go before anything else is written, so
    that neither ``resume=auto`` nor anything else can continue the run meant to be discarded."""
    folder = Path(run_dir) / "checkpoints"
    if folder.is_dir():
        shutil.rmtree(folder)


def check_writable(run_dir: Path) -> None:
    """A UsageError when ``run_dir`` (or, while it does not exist, the folder it would be made
    in) cannot be written: a read-only filesystem or missing permission, said before anything is
    written or built."""
    probe = Path(run_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"run_dir {run_dir}: {probe} is not a directory")
    try:
        readonly = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        readonly = False
    if readonly:
        why = "its filesystem is mounted read-only"
    elif not os.access(probe, os.W_OK | os.X_OK):
        why = "permission denied"
    else:
        return
    raise UsageError(f"run_dir {run_dir} cannot be written ({probe}: {why}); choose a writable run_dir=...")
