"""Which code a run ran: pixelsac's version and git commit, and the versions of the libraries whose
numerics and environments it depends on.

A run says it in its start-up lines and keeps it in ``summary.json`` (``code``), so two runs' files
tell whether they came from the same code: a configuration cannot, since a key added later reads
as its default in an older run's file. The commit is read from the checkout pixelsac is imported
from, when that is a git checkout (an installed wheel has none: ``commit`` is then None).
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

#: Distributions whose versions change what a run computes or renders.
LIBRARIES = ("torch", "lightning", "kornia", "numpy", "mujoco", "dm_control")


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """``(commit, changed)`` of the git checkout at ``root``: the full hash of ``HEAD`` and whether
    tracked files differ from it; ``(None, None)`` where ``root`` is no checkout or git cannot say
    (not installed, too slow)."""
    if not (root / ".git").exists():  # a file in a worktree, a folder in a clone
        return None, None
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    return commit or None, bool(status.strip())


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, Any]:
    """pixelsac's version, ``commit`` and ``changed`` (see :func:`git_state`), Python's version and
    each of :data:`LIBRARIES`' (None where not installed). Read once a process."""
    import pixelsac

    commit, changed = git_state(Path(pixelsac.__file__).resolve().parent.parent)
    return {
        "pixelsac": pixelsac.__version__,
        "commit": commit,
        "changed": changed,
        "python": platform.python_version(),
        **{name: _version(name) for name in LIBRARIES},
    }


def describe(code: dict[str, Any]) -> str:
    """One line: ``pixelsac 0.1.0 (git 4b4eb93, with uncommitted changes), torch 2.13.0+cpu, ...``."""
    where = ""
    if code.get("commit"):
        where = f" (git {code['commit'][:7]}{', with uncommitted changes' if code.get('changed') else ''})"
    libraries = ", ".join(f"{name} {code[name]}" for name in (*LIBRARIES, "python") if code.get(name))
    return f"pixelsac {code.get('pixelsac')}{where}, {libraries}"
