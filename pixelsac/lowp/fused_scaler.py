"""The compound loss scaler's device bookkeeping after a step as one op (``CompoundLossScaler(compiled=True)``).

A sync-free step of the scaler (``scaler.py``) ends with a dozen 0-dim or per-parameter device
updates, each its own kernel on a GPU: the skip decision from the gradients' flag and the
optimizer's state overflow, the skipped-peak and largest-peak records, the backoff factor, the
scale and the interval peak in the backed-off units, and the skipped/taken/clean counts::

    skipped = found_inf > 0  or  state_overflow
    skipped_peaks <- skipped ? peaks : skipped_peaks
    step_peak = skipped ? 0 : peak;   grad_peak <- max(grad_peak, step_peak)
    interval_peak <- max(interval_peak, step_peak) · f          f = skipped ? backoff : 1
    S <- S·f;   skipped_steps += skipped;   taken_steps += !skipped;   clean <- (clean + 1)·!skipped

Here one function does it all, compiled by ``torch.compile`` (inductor fuses the 0-dim updates
and the per-parameter record into a few kernels) and registered as the torch operator
``pixelsac_lowp::scaler_after_step``. Every value is the eager form's bit for bit: the updates
are selections, maxima, integer adds and products by 1 or by the backoff, each rounded once into
its tensor's dtype (compiled with ``emulate_precision_casts``, as ``fused.py``, so a 16-bit
record is rounded where the eager op rounds it).
"""

from __future__ import annotations

from typing import Any

import torch

from .fused import COMPILE_OPTIONS

__all__ = ["after_step"]

_compiled: dict[str, Any] = {}


def _after_step(
    found_inf, overflow, peaks, peak, skipped_peaks, grad_peak, interval_peak, scale, skipped_steps, taken_steps,
    clean_steps, one, backoff,
):  # fmt: skip
    skipped = (found_inf > 0) | overflow
    if peaks is not None:
        skipped_peaks.copy_(torch.where(skipped, peaks, skipped_peaks))
        step_peak = (peaks.max() if peak is None else peak).masked_fill(skipped, 0.0)
        grad_peak.copy_(torch.maximum(grad_peak, step_peak))
        if interval_peak is not None:
            interval_peak.copy_(torch.maximum(interval_peak, step_peak))
    factor = one.masked_fill(skipped, backoff)
    if interval_peak is not None:
        interval_peak.copy_(interval_peak * factor)
    scale.copy_(scale * factor)
    taken = ~skipped
    skipped_steps.copy_(skipped_steps + skipped)
    taken_steps.copy_(taken_steps + taken)
    clean_steps.copy_((clean_steps + 1) * taken)
    return taken, factor


def _compiled_after_step():
    if "after_step" not in _compiled:
        _compiled["after_step"] = torch.compile(_after_step, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)
    return _compiled["after_step"]


_MUTATED = ("skipped_peaks", "grad_peak", "interval_peak", "scale", "skipped_steps", "taken_steps", "clean_steps")


@torch.library.custom_op("pixelsac_lowp::scaler_after_step", mutates_args=_MUTATED)
def after_step(
    found_inf: torch.Tensor,
    overflow: torch.Tensor,
    peaks: torch.Tensor | None,
    peak: torch.Tensor | None,
    skipped_peaks: torch.Tensor | None,
    grad_peak: torch.Tensor | None,
    interval_peak: torch.Tensor | None,
    scale: torch.Tensor,
    skipped_steps: torch.Tensor,
    taken_steps: torch.Tensor,
    clean_steps: torch.Tensor,
    one: torch.Tensor,
    backoff: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bookkeeping after one sync-free step (module docstring), every record and count updated
    in place. ``found_inf``: 0-dim float32; ``overflow``: 0-dim bool (the optimizer's state
    overflow); ``peaks``: each gradient's peak, with ``skipped_peaks`` and ``grad_peak`` (None, all
    three, where the step keeps no record); ``peak``: ``peaks.max()`` if already taken;
    ``interval_peak``: None without headroom growth; ``scale``: float32; the counts int64; ``one``:
    float32 1.0. Returns the 0-dim bool "taken" and the float32 factor (1 or ``backoff``)."""
    with torch._dynamo.config.patch(recompile_limit=64):  # a process may build many scalers
        return _compiled_after_step()(
            found_inf, overflow, peaks, peak, skipped_peaks, grad_peak, interval_peak, scale, skipped_steps,
            taken_steps, clean_steps, one, backoff,
        )  # fmt: skip


@after_step.register_fake
def _(found_inf, overflow, *rest):
    return torch.empty((), dtype=torch.bool, device=found_inf.device), torch.empty((), device=found_inf.device)
