"""Writing a run's files: whole or not at all, never through a link, and a failed write names its file.

A run directory may be shared, or prepared by someone else; a link planted in it must not turn a
write into an overwrite of the file it points to. And a full disk must leave either the old file
or none, never a part, and say in one line which file it could not write. Every file a training
run writes goes through one of these:

* :func:`replace_atomically` -- the file's bytes go to ``.NAME.tmp`` beside it, are flushed and
  fsynced, and the temporary is renamed over ``NAME`` (a rename replaces a link, it does not
  follow it): readers see the old file or the new one. Checkpoints, replay files, config.yaml,
  hparams.yaml, summaries, failure.json and metrics.csv when its columns change.
* :class:`RecordFile` -- a log that grows by appending (metrics.csv rows, TensorBoard's event
  records): each record is written whole or the file is cut back to where it was.
* :func:`open_new` -- what both open: whatever is at the name is removed first (a leftover of a
  killed write, or a link), and the file is created with ``O_EXCL | O_NOFOLLOW``, so nothing
  that appears there meanwhile is followed.

An ``OSError`` from any of them names the file (a failed ``write`` on an open file names none;
:func:`naming` adds it), so the command line can say which file and why in one line.

Imports: the standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

#: The permissions of a new file (less the umask), as ``open(path, "w")`` gives.
FILE_MODE = 0o666


def temporary_name(path: Path) -> Path:
    """``.NAME.tmp`` beside ``path``: where :func:`replace_atomically` writes ``path``'s bytes."""
    return path.with_name(f".{path.name}.tmp")


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """An OSError raised inside that names no file (a write to an open file) names ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename:
            raise
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno or errno.EIO), str(path)) from exc


def open_new(path: Path, append: bool = False) -> int:
    """A new, empty regular file at ``path``, opened for writing: its descriptor. What was there
    goes first (unlinking a link removes the link, not its target); ``O_EXCL | O_NOFOLLOW`` then
    refuse anything that appeared at the name meanwhile. ``append``: ``O_APPEND``."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError), naming(path):
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    with naming(path):
        return os.open(path, flags, FILE_MODE)


def open_existing(path: Path) -> int:
    """``path`` opened for appending, or created when absent; never through a link (``ELOOP``),
    and a FIFO, device or folder there is an OSError naming it, not a file to write."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return open_new(path, append=True)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    os.set_blocking(fd, True)
    return fd


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` reach the disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replace_atomically(path: Path) -> Iterator[BinaryIO]:
    """A binary file whose bytes become ``path`` when the block ends without an error: written as
    ``.NAME.tmp``, fsynced, renamed over ``path``, the folder fsynced. Any error (and an
    interrupt) removes the temporary and leaves ``path`` as it was; an OSError names the file."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with naming(tmp), os.fdopen(open_new(tmp), "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        with naming(tmp):
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with naming(path.parent):
        fsync_folder(path.parent)


def move_into_place(tmp: Path, path: Path) -> None:
    """A complete file written at ``tmp`` (by someone else's writer: torch's, ffmpeg) becomes
    ``path``: fsynced, renamed over it, the folder fsynced. The caller removes ``tmp`` on failure."""
    with naming(tmp), open(tmp, "rb") as file:
        os.fsync(file.fileno())
    with naming(tmp):
        os.replace(tmp, path)
    with naming(path.parent):
        fsync_folder(path.parent)


def write_atomically(path: Path, data: bytes | str) -> None:
    """``path`` holds ``data`` (text is UTF-8), or, when the write fails, what it held before."""
    with replace_atomically(path) as file:
        file.write(data.encode() if isinstance(data, str) else data)


class RecordFile:
    """A file that grows by whole records (CSV rows, TensorBoard event records), written in the
    calling thread. A record that cannot be written whole (disk full) is cut off again: the file
    ends with its last whole record, and the OSError names the file. ``new=True`` starts an empty
    file (:func:`open_new`); otherwise an existing one is appended to (:func:`open_existing`)."""

    def __init__(self, path: Path, new: bool = False) -> None:
        self.path = Path(path)
        self._fd: int | None = open_new(self.path, append=True) if new else open_existing(self.path)

    def write(self, record: bytes) -> None:
        if self._fd is None:
            raise OSError(errno.EBADF, "written after it was closed", str(self.path))
        start = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(record)
        try:
            with naming(self.path):
                while view:
                    view = view[os.write(self._fd, view) :]
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def sync(self) -> None:
        """Records written so far reach the disk."""
        if self._fd is not None:
            with naming(self.path):
                os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None
