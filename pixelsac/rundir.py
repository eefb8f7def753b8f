"""A run directory: what a run writes there, its one writer, and the checks made before the first write.

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

A run writes only the names in :data:`RUN_FILES` and :data:`RUN_FOLDERS` (and what is inside
those folders). The directory may be shared or prepared by someone else, so before anything is
written (:func:`check_contents`) none of them may be a symbolic link, and each must be a regular
file or a folder as expected: a link there would make a write overwrite whatever it points to.
The run directory itself may be a link; the writes themselves never follow one
(:mod:`pixelsac.files`). A ``run_dir`` that cannot become a directory -- a dangling link, a link
loop, a path on a kernel filesystem such as ``/proc`` -- is refused with what is wrong with it
(:func:`check_writable`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from pixelsac.cli import RUN_DIR_LOCK, UsageError
from pixelsac.files import temporary_name

#: The lock file in every run directory (``cli.out_dir_is_free`` does not count it as content).
LOCK_NAME = RUN_DIR_LOCK
#: The files a training run writes at the top of its directory.
RUN_FILES = ("config.yaml", "metrics.csv", "hparams.yaml", "summary.json", "summary.md", "failure.json")
#: The folders a training run writes into (all of their contents are the run's).
RUN_FOLDERS = ("checkpoints", "tb", "videos")
#: Kernel filesystems that hold no files of their own: a run directory there cannot be made.
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "configfs",
        "pstore",
        "bpf",
        "efivarfs",
        "fusectl",
        "devpts",
        "mqueue",
        "binfmt_misc",
        "hugetlbfs",
    }
)
#: How a refusal ends: what to do about a link or a special file in the run directory.
_WAYS_OUT = "a run writes only regular files and folders of its own: remove it, or choose another run_dir=..."


class RunDirLock:
    """An exclusive lock on ``run_dir`` (created if absent), held until :meth:`release` or the
    process's end. A UsageError names the holder when another process has it. ``key``: the
    option that names the folder, for that line (an evaluation's ``out_dir``)."""

    def __init__(self, run_dir: Path, key: str = "run_dir") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.key = key
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _check_entry(self.path, folder=False)  # before opening: opening a device node can act on it
        try:  # O_NOFOLLOW: a link planted as .lock is refused, never written through
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                _check_entry(self.path, folder=False)  # a link appeared since: says so
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            _check_entry(self.path, folder=False)
            raise UsageError(f"{self.path} is not a regular file; {_WAYS_OUT}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UsageError(
                    f"{self.key} {self.run_dir} is in use by {holder} (lock {self.path}); one process writes "
                    f"it: wait for it to end, or choose another {self.key}=..."
                ) from None
            raise UsageError(
                f"cannot lock {self.key} {self.run_dir} ({os.strerror(exc.errno or 0)}): its filesystem "
                f"offers no file locks; choose a {self.key} on one that does"
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


def holder(run_dir: Path) -> str | None:
    """Who holds ``run_dir``'s lock (a training run: ``pid N on host H``), or None when nobody
    does; nothing is created. Tested with a shared lock, taken and dropped at once."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None  # no lock file (never trained here), or a link: no training run holds it
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            return _read_holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
        return None
    finally:
        os.close(fd)  # drops the shared lock with it


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
    """A UsageError, saying what is wrong with the path, when ``run_dir`` cannot be made or
    written: a component that is a dangling link or a link loop, or not a folder; a kernel
    filesystem (``/proc``, ``/sys``); a read-only filesystem or missing permission on the
    nearest folder that exists. Said before anything is written or built."""
    probe = Path(run_dir)
    while True:
        try:
            found = os.stat(probe)
            break
        except FileNotFoundError:
            if os.path.islink(probe):
                raise UsageError(
                    f"run_dir {run_dir}: {probe} is a symbolic link to {os.readlink(probe)}, which does not exist; "
                    "create what it points to, remove the link, or choose another run_dir=..."
                ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UsageError(
                    f"run_dir {run_dir}: {probe} is a symbolic link that loops (following it never ends at a "
                    "folder); remove or correct the link, or choose another run_dir=..."
                ) from None
            if exc.errno == errno.ENOTDIR:
                pass  # a file above it: found as the walk goes up
            else:
                raise UsageError(f"run_dir {run_dir} cannot be reached ({probe}: {exc.strerror})") from None
        if probe == probe.parent:
            break
        probe = probe.parent
    if not stat.S_ISDIR(found.st_mode):
        raise UsageError(f"run_dir {run_dir}: {probe} is not a directory")
    kernel_fs = _filesystem_of(probe)
    if kernel_fs is not None and kernel_fs[0] in PSEUDO_FILESYSTEMS:
        kind, mount = kernel_fs
        raise UsageError(
            f"run_dir {run_dir}: {mount} is a {kind} filesystem, which the kernel makes up and which holds no "
            "files of ours; choose a run_dir on a disk"
        )
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


def _filesystem_of(folder: Path) -> tuple[str, str] | None:
    """(filesystem type, mount point) of the mount that holds ``folder``, from
    ``/proc/self/mountinfo``; None where that cannot be read (not Linux)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
        where = os.path.realpath(folder)
    except OSError:
        return None
    best: tuple[str, str] | None = None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # \040 is a space
        inside = where == mount or where.startswith(mount.rstrip("/") + "/")
        if inside and (best is None or len(mount) >= len(best[1])):
            best = (rest.split()[0], mount)
    return best


def check_contents(run_dir: Path) -> None:
    """A UsageError when a name the run writes in ``run_dir`` (:data:`RUN_FILES`, their temporary
    names, the lock, :data:`RUN_FOLDERS` and everything inside them) is a symbolic link, or not
    the regular file or folder the run would write there. Nothing is written through a link, but
    a link found there means someone else shaped the directory: say so rather than replace it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return  # nothing there yet
    for name in (LOCK_NAME, *RUN_FILES):
        _check_entry(run_dir / name, folder=False)
        _check_entry(temporary_name(run_dir / name), folder=False)
    for name in RUN_FOLDERS:
        if _check_entry(run_dir / name, folder=True):
            _check_tree(run_dir / name)


def _check_tree(folder: Path) -> None:
    with os.scandir(folder) as entries:
        for entry in entries:
            path, folder = Path(entry.path), entry.is_dir(follow_symlinks=False)
            if _check_entry(path, folder=folder) and folder:
                _check_tree(path)


def _check_entry(path: Path, folder: bool) -> bool:
    """Whether ``path`` is there (as the regular file, or with ``folder`` the folder, expected);
    a UsageError for a link or anything else."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        raise UsageError(f"{path} is a symbolic link (to {os.readlink(path)}); {_WAYS_OUT}")
    if folder and not stat.S_ISDIR(mode):
        raise UsageError(f"{path} is not a folder, where the run keeps its {path.name}; {_WAYS_OUT}")
    if not folder and not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise UsageError(f"{path} is {kind}, where the run writes a file; {_WAYS_OUT}")
    return True


def remove_partial_files(run_dir: Path) -> None:
    """Temporary files of writes that did not finish (``.NAME.tmp`` beside config.yaml or
    metrics.csv, in ``checkpoints/`` or ``videos/``): a fault or a SIGKILL mid-write leaves none
    behind for long. Complete files are never touched."""
    run_dir = Path(run_dir)
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "videos"):
        if folder.is_dir() and not folder.is_symlink():
            for tmp in folder.glob(".*.tmp"):
                if tmp.is_file() or tmp.is_symlink():
                    with contextlib.suppress(OSError):
                        tmp.unlink()


def tidy(run_dir: Path) -> None:
    """A finished run's directory, answered ``already done``: what a killed write left behind
    goes (:func:`remove_partial_files`) -- unless a process holds the directory, whose
    temporaries are its own, or the lock cannot be taken (then nothing is touched)."""
    try:
        lock = RunDirLock(run_dir).acquire()
    except (UsageError, OSError):
        return
    try:
        remove_partial_files(run_dir)
    finally:
        lock.release()
