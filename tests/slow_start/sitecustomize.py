"""Test hook, loaded at interpreter start when this folder is on PYTHONPATH: in a process started
by ``multiprocessing``'s spawn, and only when ``SLOW_START_DIR`` is set, importing dm_control first
writes ``SLOW_START_DIR/<pid>`` (whole, via a rename) and then sleeps ``SLOW_START_SECONDS`` -- a
worker still starting, as on a machine swapping under too many of them. The parent (a trainer)
imports dm_control at full speed."""

import os
import sys
import time

if "--multiprocessing-fork" in sys.argv and os.environ.get("SLOW_START_DIR"):

    class _SlowDmControl:
        """A meta-path finder that finds nothing: it only delays the first import of dm_control."""

        def find_spec(self, name, path=None, target=None):
            if name == "dm_control":
                sys.meta_path.remove(self)
                folder = os.environ["SLOW_START_DIR"]
                tmp = os.path.join(folder, f".{os.getpid()}.tmp")
                with open(tmp, "w") as f:
                    f.write(str(os.getppid()))
                os.replace(tmp, os.path.join(folder, str(os.getpid())))
                time.sleep(float(os.environ.get("SLOW_START_SECONDS", "60")))
            return None

    sys.meta_path.insert(0, _SlowDmControl())
