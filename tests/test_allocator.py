"""pixelsac.allocator: the entry points set glibc's malloc as the Makefile's MALLOC_* variables do,
verified by a probe in a fresh process -- a 64 MiB block is served from the heap, not by mmap,
and stays with the process after free -- and it steps aside when asked to or when the
environment already decides."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
from conftest import cli_env

from pixelsac import allocator

try:
    _GLIBC = hasattr(ctypes.CDLL(None), "mallinfo2")
except OSError:
    _GLIBC = False
glibc_only = pytest.mark.skipif(not _GLIBC, reason="needs glibc >= 2.33 (mallinfo2)")

# Configure (directly, or through an entry point run with --help), then malloc and free 64 MiB
# and report: whether the settings were applied, how many mmapped blocks the malloc added, and
# the heap's size after the free.
PROBE = """
import ctypes, json, sys
from pixelsac import allocator
if sys.argv[1] == "direct":
    allocator.configure()
else:
    from pixelsac import cli
    sys.argv = ["pixelsac-" + sys.argv[1], "--help"]
    import contextlib, io
    with contextlib.redirect_stdout(io.StringIO()):
        getattr(cli, sys.argv[0].removeprefix("pixelsac-"))()

class Info(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2().hblks
block = libc.malloc(64 << 20)
mmapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"applied": allocator.applied, "mmapped": mmapped, "heap_after_free": libc.mallinfo2().arena}))
"""
#: what the probe's environment leaves out unless a test sets it (make exports the MALLOC_* ones)
CONTROLS = {var for _, var in allocator.SETTINGS.values()} | {allocator.SWITCH, "GLIBC_TUNABLES"}


def probe(how: str, **settings: str) -> dict:
    env = {k: v for k, v in cli_env(**settings).items() if k not in CONTROLS or k in settings}
    result = subprocess.run([sys.executable, "-c", PROBE, how], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@glibc_only
def test_configure_keeps_large_blocks_on_the_heap():
    default = probe("direct", PIXELSAC_MALLOC="0")
    assert default == {**default, "applied": False, "mmapped": 1}  # glibc: a 64 MiB block is an mmap
    tuned = probe("direct")
    assert tuned["applied"] is True and tuned["mmapped"] == 0
    assert tuned["heap_after_free"] >= 64 << 20  # freed, but not given back: no re-faulting next time


@glibc_only
@pytest.mark.parametrize("entry", ["train", "evaluate", "bench"])
def test_every_console_script_applies_it(entry):
    result = probe(entry)
    assert result["applied"] is True and result["mmapped"] == 0


@glibc_only
def test_the_environment_decides_when_it_sets_malloc():
    made = probe("direct", MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_="68719476736", MALLOC_TOP_PAD_="1073741824")
    assert made["applied"] is False and made["mmapped"] == 0  # glibc read the variables itself


def test_skip_reasons():
    assert allocator.skip_reason({"PIXELSAC_MALLOC": "0"}) == "PIXELSAC_MALLOC=0"
    assert "MALLOC_TOP_PAD_" in allocator.skip_reason({"MALLOC_TOP_PAD_": "1"})
    assert "GLIBC_TUNABLES" in allocator.skip_reason({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"})
    if _GLIBC:
        assert allocator.skip_reason({}) is None
        assert "environment" in allocator.describe({"MALLOC_MMAP_MAX_": "0"})
