"""What an update costs -- time and memory of the SAC update step, measured where it runs.

One job per file:

* :mod:`pixelsac.perf.meters` -- clocks and memory probes: :class:`UpdateClock`,
  :class:`PeakMemory`, :class:`SavedTensorMeter`, :class:`TensorPeakMeter`,
  :func:`state_groups`, and the :class:`UpdateTimer` callback that times each update.
* :mod:`pixelsac.perf.calibration` -- :func:`time_updates`: a fresh agent's real update step
  timed on one batch (the start-up fp32 reference and ``python -m pixelsac.bench``);
  :func:`metered_updates`: each update of a fresh agent inside a meter (the op and FLOP counts).
* :mod:`pixelsac.perf.opcount` -- :class:`DispatchCount`: the aten ops, dtype casts and host
  reads that reach torch's dispatcher; :func:`count_update_ops`: an update counted with it in
  the form a GPU runs it, on any device (the benchmark's op, cast and host-read columns).
* :mod:`pixelsac.perf.flops` -- :func:`count_update_flops`: an update's convolution and matmul
  FLOPs at any batch (the benchmark's GFLOP and achieved-TFLOP/s columns).
* :mod:`pixelsac.perf.tracker` -- :class:`PerfTracker`, the run's callback: throughput, ms and
  memory per update against the fp32 reference, in the logs and the summary.
* :mod:`pixelsac.perf.summary` -- the end-of-run summary: plain data, table, JSON, markdown.
"""

from pixelsac.perf.calibration import (
    BATCH_SOURCES,
    EMULATION_CHOICES,
    EMULATION_FORMS,
    Fp32Reference,
    TimedUpdates,
    batch_source_of,
    fp32_reference_config,
    interleaved_forms,
    metered_updates,
    place_batch,
    synthetic_batch,
    time_updates,
)
from pixelsac.perf.flops import UpdateFlops, count_update_flops
from pixelsac.perf.meters import (
    MIB,
    PeakMemory,
    SavedBytes,
    SavedTensorMeter,
    TensorPeakMeter,
    UpdateClock,
    UpdateTimer,
    group_ratios,
    module_state_tensors,
    parameters_finite,
    ratio,
    rss_bytes,
    rss_peak_bytes,
    speedup,
    state_groups,
)
from pixelsac.perf.opcount import DispatchCount, UpdateCounts, count_update_ops
from pixelsac.perf.summary import (
    MEMORY_FIGURES,
    build_summary,
    format_summary,
    summary_rows,
    write_summary,
)
from pixelsac.perf.tracker import PerfTracker

__all__ = [
    "BATCH_SOURCES",
    "DispatchCount",
    "EMULATION_CHOICES",
    "EMULATION_FORMS",
    "MEMORY_FIGURES",
    "MIB",
    "Fp32Reference",
    "PeakMemory",
    "PerfTracker",
    "SavedBytes",
    "SavedTensorMeter",
    "TensorPeakMeter",
    "TimedUpdates",
    "UpdateCounts",
    "UpdateFlops",
    "UpdateClock",
    "UpdateTimer",
    "batch_source_of",
    "build_summary",
    "count_update_flops",
    "count_update_ops",
    "format_summary",
    "fp32_reference_config",
    "group_ratios",
    "interleaved_forms",
    "metered_updates",
    "module_state_tensors",
    "parameters_finite",
    "place_batch",
    "ratio",
    "rss_bytes",
    "rss_peak_bytes",
    "speedup",
    "state_groups",
    "summary_rows",
    "synthetic_batch",
    "time_updates",
    "write_summary",
]
