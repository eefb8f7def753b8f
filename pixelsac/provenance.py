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
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

#: Distributions whose versions change what a run computes or renders.
LIBRARIES = ("torch", "lightning", "kornia", "numpy", "mujoco", "dm_control")


def git_state(root: Path) -> tuple[str | None, bool | None]:
    """``(commit, changed)`` of the git checkout at ``root``: the full hash of ``HEAD`` and whether
    tracked files differ from it; ``(None, None)`` where ``root`` is no checkout or git cannot say
    (not installed, too slow), ``(commit, None)`` where only the status cannot be read (a corrupt
    index).

    git runs without the caller's ``GIT_*`` variables (``GIT_DIR`` or ``GIT_WORK_TREE`` would
    point it at another repository) and with ``GIT_OPTIONAL_LOCKS=0``: a status then reads the
    index without refreshing it, so a run never takes ``index.lock`` beside a user's commit."""
    if not (root / ".git").exists():  # a file in a worktree, a folder in a clone
        return None, None
    env = {name: value for name, value in os.environ.items() if not name.startswith("GIT_")}
    env["GIT_OPTIONAL_LOCKS"] = "0"

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True, env=env
        ).stdout

    try:
        commit = git("rev-parse", "--verify", "HEAD").strip() or None
    except (OSError, subprocess.SubprocessError):
        return None, None
    try:
        changed: bool | None = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        changed = None
    return commit, changed


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
        state = {True: ", with uncommitted changes", None: ", status unreadable"}.get(code.get("changed"), "")
        where = f" (git {code['commit'][:7]}{state})"
    libraries = ", ".join(f"{name} {code[name]}" for name in (*LIBRARIES, "python") if code.get(name))
    return f"pixelsac {code.get('pixelsac')}{where}, {libraries}"
