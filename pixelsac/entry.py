"""The console scripts ``pixelsac-train``, ``pixelsac-evaluate`` and ``pixelsac-bench``.

Each sets up the process the way ``make`` does (:func:`pixelsac.allocator.configure`: glibc's
malloc keeps large freed buffers) and runs the entry point's ``main``. ``python -m pixelsac.X``
does the same in its ``__main__`` block. The entry points' own modules are imported only after
the allocator is set. A Ctrl-C while they import is one line and exit code 130, as it is once
``main`` runs (:func:`pixelsac.cli.run_command`).
"""

from __future__ import annotations

import os
import sys

from pixelsac import allocator


def train() -> int:
    allocator.configure()
    try:
        from pixelsac.train import main
    except KeyboardInterrupt:
        return _interrupted_while_importing()
    return main()


def evaluate() -> int:
    allocator.configure()
    try:
        from pixelsac.evaluate import main
    except KeyboardInterrupt:
        return _interrupted_while_importing()
    return main()


def bench() -> int:
    # The benchmark renders nothing; without this, importing dm_control (for the task's shapes)
    # loads the OpenGL library MUJOCO_GL names, which a GPU box without display libraries lacks.
    os.environ["MUJOCO_GL"] = "disable"
    allocator.configure()
    try:
        from pixelsac.bench import main
    except KeyboardInterrupt:
        return _interrupted_while_importing()
    return main()


def _interrupted_while_importing() -> int:
    from pixelsac import cli

    print(f"pixelsac: {cli.INTERRUPTED_WHILE_STARTING}", file=sys.stderr)
    return cli.EXIT_INTERRUPTED
