"""The dispatch counter the tests count with: the package's own (``pixelsac/perf/dispatch.py``),
which the benchmark's op, cast and host-read columns use too (``pixelsac/perf/opcount.py``)."""

from pixelsac.perf.dispatch import HOST_READ, DispatchCount

__all__ = ["HOST_READ", "DispatchCount"]
