"""The dispatch counter the tests count with: the package's own (``pixelsac/perf/opcount.py``),
which the benchmark's op, cast and host-read columns use too."""

from pixelsac.perf.opcount import HOST_READ, DispatchCount

__all__ = ["HOST_READ", "DispatchCount"]
