"""``python -m pixelsac.bench``: the process set up as the console script sets it (:func:`pixelsac.cli.bench`)."""

import sys

from pixelsac.cli import bench

sys.exit(bench())
