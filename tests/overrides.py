"""Tests compose a command line from a shared base (``conftest.TINY``, a file's ``FAST``) and their
own ``key=value`` arguments; pixelsac refuses a key given twice, so the harness resolves the
repeats here: :func:`merged` keeps each key once, with its last value. Standard library only (the
helper scripts that run pixelsac import it too)."""

from __future__ import annotations


def merged(*args: str) -> list[str]:
    """``args`` with each ``key=`` once, holding the value given last, at the place given last;
    arguments that are not ``key=value`` (``--print-config``) stay as they are."""
    kept: dict[object, str] = {}
    for i, arg in enumerate(args):
        key, sep, _ = arg.partition("=")
        name: object = key.strip() if sep and key.strip() else i
        kept.pop(name, None)
        kept[name] = arg
    return list(kept.values())
