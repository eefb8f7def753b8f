"""``python -m pixelsac.bench`` in parts: :mod:`~pixelsac.benchmark.plan` (modes, options, cells),
:mod:`~pixelsac.benchmark.cells` (measuring them) and :mod:`~pixelsac.benchmark.report` (ratios
and reports). The entry point itself is :mod:`pixelsac.bench`."""
