"""glibc's malloc told to keep large freed buffers, set by every entry point at start-up.

A DrQ update frees and re-allocates the same large activation buffers every step. glibc's
defaults serve each of them with a fresh ``mmap`` and hand it back with ``munmap`` on free (and
trim the heap top when it shrinks), so every update pays to fault those pages in again. Three
settings keep them: ``M_MMAP_MAX = 0`` (large blocks come from the heap, not ``mmap``),
``M_TRIM_THRESHOLD`` of 64 GiB (the heap top is never given back) and ``M_TOP_PAD`` of 1 GiB
(the heap grows in large steps). They are what the Makefile exports as ``MALLOC_MMAP_MAX_``,
``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_TOP_PAD_``; :func:`configure` applies them through
``mallopt`` so that ``pixelsac-train`` run directly is as fast as ``make demo``. The cost: freed
memory stays with the process, so its resident-set peak is higher (see docs/performance.md).

:func:`configure` does nothing

* off glibc (macOS, musl, Windows): ``mallopt`` is not there;
* when ``PIXELSAC_MALLOC=0`` is set;
* when the user set any of those ``MALLOC_*_`` variables (or ``glibc.malloc`` tunables in
  ``GLIBC_TUNABLES``) themselves -- the environment decides then (glibc read it at start-up).

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Mapping

#: glibc's mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4

#: parameter -> (value, the environment variable glibc reads for it)
SETTINGS: dict[int, tuple[int, str]] = {
    M_MMAP_MAX: (0, "MALLOC_MMAP_MAX_"),
    M_TRIM_THRESHOLD: (64 * 2**30, "MALLOC_TRIM_THRESHOLD_"),
    M_TOP_PAD: (2**30, "MALLOC_TOP_PAD_"),
}
#: set to 0 to leave malloc as glibc configured it
SWITCH = "PIXELSAC_MALLOC"
#: whether :func:`configure` set the three parameters in this process
applied = False


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def skip_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """Why :func:`configure` would leave malloc alone, or None when it would set it."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{SWITCH}=0"
    given = sorted(var for _, var in SETTINGS.values() if var in environ)
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        given.append("GLIBC_TUNABLES")
    if given:
        return f"{', '.join(given)} set in the environment"
    if _libc() is None:
        return "not glibc (no mallopt)"
    return None


def configure(environ: Mapping[str, str] | None = None) -> bool:
    """Apply :data:`SETTINGS` with ``mallopt``; True when all three were accepted. Call it first
    thing in an entry point, before the large allocations (it affects blocks allocated later)."""
    if skip_reason(environ) is not None:
        return False
    libc = _libc()
    assert libc is not None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    ok = True
    for param, (value, _) in SETTINGS.items():
        # M_TRIM_THRESHOLD's 64 GiB does not fit a C int: mallopt takes an int, so the largest
        # int (2 GiB - 1) is used -- as good as "never trim" for this purpose.
        ok &= libc.mallopt(param, min(value, 2**31 - 1)) == 1
    global applied
    applied = ok
    return ok


def describe(environ: Mapping[str, str] | None = None) -> str:
    """What this process's malloc runs with, in one phrase (the benchmark's header says it)."""
    environ = os.environ if environ is None else environ
    given = [f"{var}={environ[var]}" for _, var in SETTINGS.values() if var in environ]
    if given:
        return ", ".join(given) + " (environment)"
    if applied:
        return "M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB, M_TOP_PAD=1 GiB (set at start-up by pixelsac.allocator)"
    return f"glibc's defaults ({skip_reason(environ) or 'pixelsac.allocator not applied'})"
