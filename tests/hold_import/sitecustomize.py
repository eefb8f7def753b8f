"""Test hook, loaded at interpreter start when this folder is on PYTHONPATH: in the main process
(not a ``multiprocessing`` child), and only when ``HOLD_IMPORT_DIR`` is set, the first import of
``lightning`` writes ``HOLD_IMPORT_DIR/holding`` (whole, via a rename) and then sleeps
``HOLD_IMPORT_SECONDS``: a process caught while its libraries load, for as long as a test needs to
send it a signal there, however busy the machine."""

import os
import sys
import time

if "--multiprocessing-fork" not in sys.argv and os.environ.get("HOLD_IMPORT_DIR"):

    class _HoldLightning:
        """A meta-path finder that finds nothing: it only holds the first import of lightning."""

        def find_spec(self, name, path=None, target=None):
            if name == "lightning":
                sys.meta_path.remove(self)
                folder = os.environ["HOLD_IMPORT_DIR"]
                tmp = os.path.join(folder, ".holding.tmp")
                with open(tmp, "w") as f:
                    f.write(str(os.getpid()))
                os.replace(tmp, os.path.join(folder, "holding"))
                time.sleep(float(os.environ.get("HOLD_IMPORT_SECONDS", "120")))
            return None

    sys.meta_path.insert(0, _HoldLightning())
