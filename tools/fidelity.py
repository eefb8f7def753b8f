"""How faithful a precision's arithmetic is, judged by float64: four judges, one command.

    python tools/fidelity.py grad RUN_DIR --batches 8           # a run's gradients against float64's
    python tools/fidelity.py step RUN_DIR --updates 500         # its optimizers and target against float64's
    python tools/fidelity.py drift --updates 1000               # each mode's weights against a float64 run
    python tools/fidelity.py drq /path/to/drq                   # fp32's update against DrQ's, in float64; time
    python tools/fidelity.py SUBCOMMAND --help                  # each judge's options and what it reports

- ``grad``: a run's ``last.ckpt`` and replay; per batch, each loss's gradients as the run computes
  them and in float64 from the same weights and draws (cosine, relative error per weight group).
- ``step``: continues a run as its trainer would, every optimizer step shadowed by float64 Adam fed
  the run's own gradient, every target update by a float64 EMA (step, path and moment errors).
- ``drift``: fresh agents of each mode and a float64 one take the same updates on the same batches;
  how far each mode's weights drift from float64's path.
- ``drq``: this project's fp32 update equals the official DrQ update in float64 (exit 1 above
  1e-9), then both timed side by side in one process.

The judges live in ``tools/judges/`` (``common.py``: what they share); each writes its tables with
the command that made them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
for path in (TOOLS, REPO):  # the judges' package, and `pixelsac` when run as a script from anywhere
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

SUBCOMMANDS = ("grad", "step", "drift", "drq")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        known = ", ".join(SUBCOMMANDS)
        print(f"error: no judge {name!r}; give one of {known} (tools/fidelity.py --help)", file=sys.stderr)
        return 2
    return importlib.import_module(f"judges.{name}").main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
