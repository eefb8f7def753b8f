"""What one update asks of a GPU, counted on any device: aten ops, kernels, dtype casts, host reads.

:func:`count_update_ops` builds a fresh agent from a run's (or a benchmark cell's) configuration,
fits it (on the CPU unless told) and counts each update with :class:`~pixelsac.perf.dispatch.DispatchCount`:
full updates (critic, actor, temperature and, when due, the target) and critic-only ones, after
the first update cycle (whose first updates of each kind create the optimizer state and the cached
constants). A GPU launches about one kernel per op that is not a view, so the kernel estimate
(:attr:`~pixelsac.perf.dispatch.DispatchCount.kernels`: views, allocations and profiler markers
left out, a foreach op that CUDA runs tensor by tensor counted per tensor) is what a small batch
pays in launches; a cast moves memory without computing; a host read is a device-to-host
synchronisation, and an error inside CUDA graph capture.

The update is counted in the form a GPU runs it, whatever machine counts it:

* ``perf.sync_free`` as configured, else on (CUDA's default); ``perf.channels_last`` and
  ``perf.aug_backend`` as configured, else CUDA's defaults (NHWC outside fp32; kornia's warp);
* no tensor-core emulation (``lowp.fp32_accumulate=false``), hAdam on whole buckets
  (``HAdam.chunk_for("cuda")``) and the finiteness checks in their foreach form
  (``lowp.finite.foreach_checks``), as on a GPU;
* eager and uncompiled (``perf.compile`` and ``perf.cuda_graphs`` off): a CUDA graph replays the
  kernels of the eager update it captured, and compilation fuses ops, which this count does not see.

Counted on a CPU, two choices stay a CPU's: fp32 with ``perf.sync_free=false`` steps torch's
foreach Adam (a GPU runs fused Adam either way), and torch's Adam in a pure fp16/bf16 mode without
hAdam (naive fp16, the no-hAdam ablation) reads its step counts on the host, as a CPU has no
capturable Adam. Counted on a GPU (the benchmark counts on its cell's device), nothing differs.

Sizes do not enter: the counts follow the number of layers and parameter tensors, not their
sizes, so the agent is counted at :data:`COUNT_SIZES` (batch 2, narrow layers) and a small image
(:func:`count_obs_shape`) -- an update in fp16 without the emulation runs a CPU's slow reference
kernels, and at full size would take seconds (tests/test_opcount.py holds the counts equal across
sizes).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import lightning as L
import torch

from pixelsac.augment import default_backend
from pixelsac.graphs import update_cycle
from pixelsac.lowp import HAdam
from pixelsac.lowp.finite import foreach_checks
from pixelsac.perf.calibration import metered_updates, without_log_intervals
from pixelsac.perf.dispatch import DispatchCount

#: The sizes the agent is counted at (its layer counts and every switch stay as configured).
COUNT_SIZES = {"batch_size": 2, "num_filters": 4, "feature_dim": 8, "hidden_dim": 16}

KINDS = ("full", "critic-only")


@dataclasses.dataclass
class UpdateCounts:
    """The most each counted update of one kind dispatched (each figure its own maximum)."""

    ops: int
    kernels: int  # the estimate of what a GPU launches (DispatchCount.kernels)
    casts: int
    host_reads: int
    casts_by_dtypes: dict[str, int]  # "float16->float32": n, from the update with the most casts
    updates: int  # how many updates of this kind were counted


def gpu_form(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (plain data) with the device-dependent choices made as on a GPU (module
    docstring) and the sizes of :data:`COUNT_SIZES`; the caller's dict is left as it is."""
    config = copy.deepcopy(dict(config))
    perf = dict(config.get("perf") or {})
    if perf.get("sync_free") is None:
        perf["sync_free"] = True
    if perf.get("channels_last") is None:
        perf["channels_last"] = config["precision"] != "fp32"
    if perf.get("aug_backend") is None:
        perf["aug_backend"] = default_backend("cuda")
    perf.update(compile=False, cuda_graphs=False)
    config["perf"] = perf
    config["lowp"] = {**config["lowp"], "fp32_accumulate": False}
    config["agent"] = {**config["agent"], **COUNT_SIZES}
    return without_log_intervals(config)


def count_obs_shape(obs_shape: tuple[int, ...], num_conv_layers: int) -> tuple[int, ...]:
    """Pixels at a side whose last convolution still outputs 2x2 (``4·layers + 1``: stride 2,
    then 1s), no larger than they are -- at 1x1 a channels-last output is contiguous too, and
    flattening it costs fewer ops than at any larger size; state vectors as they are."""
    if len(obs_shape) != 3:
        return tuple(obs_shape)
    side = min(obs_shape[-1], 4 * num_conv_layers + 1)
    return (obs_shape[0], side, side)


class _GpuOptimizers(L.Callback):
    """hAdam on whole buckets and the Kahan-momentum target in whole passes, as
    :meth:`HAdam.chunk_for` picks for a GPU."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            raw = getattr(optimizer, "optimizer", optimizer)
            if isinstance(raw, HAdam):
                raw.chunk_numel = HAdam.chunk_for("cuda")
        updater = getattr(pl_module, "target_updater", None)
        if updater is not None and hasattr(updater, "chunk_numel"):
            updater.chunk_numel = HAdam.chunk_for("cuda")


def count_update_ops(
    config: dict[str, Any],
    obs_shape: tuple[int, ...],
    action_dim: int,
    cycles: int = 1,
    device: torch.device | str = "cpu",
) -> dict[str, UpdateCounts]:
    """Count ``cycles`` whole update cycles (:func:`pixelsac.graphs.update_cycle`) of a fresh agent
    built from ``config`` after one uncounted cycle, in the GPU's form (module docstring), on
    ``device`` (on a GPU the form is the GPU's own). Returns an :class:`UpdateCounts` per kind of
    update that occurred (``full``, ``critic-only``). The caller's random streams are left as
    they were."""
    config = gpu_form(config)
    agent = config["agent"]
    shape = count_obs_shape(tuple(obs_shape), int(agent["num_conv_layers"]))
    cycle = update_cycle(int(agent["actor_update_every"]), int(agent["critic_target_update_every"]))
    with foreach_checks(True):
        metered = metered_updates(
            config,
            shape,
            action_dim,
            (1 + cycles) * cycle,
            lambda: DispatchCount(sites=False),
            device,
            [_GpuOptimizers()],
        )
    counted = [("full" if full else "critic-only", count) for full, count in metered]
    result = {}
    for kind in KINDS:
        counts = [count for name, count in counted[cycle:] if name == kind]
        if counts:
            most_cast = max(counts, key=lambda c: c.cast_total)
            result[kind] = UpdateCounts(
                ops=max(c.total for c in counts),
                kernels=max(c.kernels for c in counts),
                casts=most_cast.cast_total,
                host_reads=max(c.host_reads for c in counts),
                casts_by_dtypes=dict(most_cast.casts),
                updates=len(counts),
            )
    return result
