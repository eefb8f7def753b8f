"""The console scripts ``pixelsac-train``, ``pixelsac-evaluate`` and ``pixelsac-bench``.

Each sets up the process the way ``make`` does (:func:`pixelsac.allocator.configure`: glibc's
malloc keeps large freed buffers) and runs the entry point's ``main``. ``python -m pixelsac.X``
does the same in its ``__main__`` block. The entry points' own modules are imported only after
the allocator is set.
"""

from __future__ import annotations

import os

from pixelsac import allocator


def train() -> int:
    allocator.configure()
    from pixelsac.train import main

    return main()


def evaluate() -> int:
    allocator.configure()
    from pixelsac.evaluate import main

    return main()


def bench() -> int:
    # The benchmark renders nothing; without this, importing dm_control (for the task's shapes)
    # loads the OpenGL library MUJOCO_GL names, which a GPU box without display libraries lacks.
    os.environ["MUJOCO_GL"] = "disable"
    allocator.configure()
    from pixelsac.bench import main

    return main()
