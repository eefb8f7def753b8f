"""Child processes end with the process that started them, however it ends -- SIGKILL included.

A worker that outlives its parent holds memory and a core and serves no one: when an out-of-memory
kill ended a trainer, 257 environment workers it had started, still importing MuJoCo, lived on
as orphans holding 14 GiB. Pipes cannot prevent that alone (a worker reads its pipe only once it
is built), so the kernel is asked: on Linux, ``prctl(PR_SET_PDEATHSIG, sig)`` makes it send
``sig`` to the child the moment its parent ends. The request is made in the child before it does
any work, followed by a check that the parent has not already gone (it may have died between the
fork and the request; the child then sends itself the signal). Elsewhere a thread in the child
polls its parent's pid (:data:`POLL_SECONDS`).

Two ways in:

* :func:`tied_process`: a ``multiprocessing`` process whose child first runs :func:`run_tied` --
  the tie, then the import of the target's module by name -- so the tie comes before the heavy
  imports (dm_control, torch) and the work. Before it, only the interpreter's start and
  ``spawn``'s re-import of the parent's ``__main__`` module run.
* :func:`tie_before_exec`: a ``preexec_fn`` for :mod:`subprocess` (Linux): the tie is made
  between fork and exec, before the child's interpreter starts, and survives the exec.

The kernel watches the *thread* that started the child: start tied children from a thread that
lives as long as they should (the main thread, or a pool thread that waits for its child).
Standard library only.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: prctl(2) option: the signal the kernel sends this process when its parent ends.
PR_SET_PDEATHSIG = 1
#: Without prctl (not Linux): how often the child checks that its parent is alive.
POLL_SECONDS = 0.5


def _prctl() -> Callable[..., int] | None:
    """The C library's ``prctl`` (Linux), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def tie_to_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child: receive ``sig`` when the parent ``parent_pid`` ends; at once if it already has."""
    prctl = _prctl()
    if prctl is not None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    else:
        threading.Thread(target=_watch, args=(parent_pid, sig), name="lifeline", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent ended before the tie: this child is an orphan already
        os.kill(os.getpid(), sig)


def _watch(parent_pid: int, sig: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), sig)


def run_tied(parent_pid: int, sig: int, target: str, *args: Any) -> Any:
    """A tied child's entry point: tie to ``parent_pid``, then import and call ``target``
    (``"module:function"``) with ``args``. The target is named, not pickled, so that its module
    is imported only after the tie."""
    tie_to_parent(parent_pid, sig)
    module, _, name = target.partition(":")
    function = importlib.import_module(module)
    for part in name.split("."):
        function = getattr(function, part)
    return function(*args)


def tied_process(
    context: Any, target: Callable[..., Any], args: tuple = (), sig: int = signal.SIGKILL, **kwargs: Any
) -> Any:
    """``context.Process(target=target, args=args, **kwargs)`` whose child receives ``sig`` when
    this process ends (see :func:`run_tied`); ``target`` must be a module-level function."""
    name = f"{target.__module__}:{target.__qualname__}"
    return context.Process(target=run_tied, args=(os.getpid(), int(sig), name, *args), **kwargs)


def tie_before_exec(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :mod:`subprocess` that ties the child to this process (Linux; None
    elsewhere, where a program started by exec cannot be tied from outside). ``prctl`` is looked
    up here, in the parent: between fork and exec the child only calls it and checks its parent."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent_pid = os.getpid()

    def tie() -> None:
        if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), sig)

    return tie
