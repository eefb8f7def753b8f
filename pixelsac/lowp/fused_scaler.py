"""The compound loss scaler's device work around a step: the gradient check before it
and the bookkeeping after it, each one function run eagerly or as one compiled op
(``CompoundLossScaler(compiled=True)``).

Before the step, :func:`verdict` turns the gradients' peaks ``max|S·g|`` (one foreach norm over
the gradients) into the skip flag: the peaks stacked, their largest, and
``found_inf = 1 if margin·peak is not finite in the gradients' dtype, else 0`` (rounding
``margin·g`` is monotone in ``|g|``, so it overflows somewhere exactly when ``margin·max|g|``
does; a NaN anywhere is a NaN peak, and ``NaN <= max`` is false). Four kernels eager (stack,
max, product, comparison-and-select); compiled, :func:`gradient_verdict`
(``pixelsac_lowp::gradient_verdict``) is one op.

A step of the scaler (``scaler.py``) ends with a dozen 0-dim or per-parameter device
updates, each its own kernel on a GPU: the skip decision from the gradients' flag and the
optimizer's state overflow, the skipped-peak and largest-peak records, the backoff factor, the
scale and the interval peak in the backed-off units, and the skipped/taken/clean counts::

    skipped = found_inf > 0  or  state_overflow             (the step's one skip decision)
    skipped_peaks <- skipped ? peaks : skipped_peaks
    step_peak = skipped ? 0 : peak;   grad_peak <- max(grad_peak, step_peak)
    interval_peak <- max(interval_peak, step_peak) · f          f = skipped ? backoff : 1
    S <- S·f;   skipped_steps += skipped;   taken_steps += !skipped;   clean <- (clean + 1)·!skipped

:func:`bookkeeping` is that, in place; the eager scaler calls it as it is. :func:`after_step` is
the same function compiled by ``torch.compile`` (inductor fuses the 0-dim updates and the
per-parameter record into a few kernels) and registered as the torch operator
``pixelsac_lowp::scaler_after_step``. Both give the same bits: the updates are selections,
maxima, integer adds and products by 1 or by the backoff, each rounded once into its tensor's
dtype (compiled with ``emulate_precision_casts``, as ``fused.py``, so a 16-bit record is rounded
where the eager op rounds it).
"""

from __future__ import annotations

import torch

from .fused import compile_once

__all__ = ["after_step", "bookkeeping", "gradient_verdict", "verdict"]


def bookkeeping(
    found_inf, state_overflow, peaks, peak, skipped_peaks, grad_peak, interval_peak, scale, skipped_steps, taken_steps,
    clean_steps, one, backoff,
):  # fmt: skip
    """The bookkeeping after one step (module docstring), every record and count updated
    in place; the arguments as :func:`after_step`'s. Returns the 0-dim bools "skipped" and
    "taken" and the float32 factor (1 or ``backoff``)."""
    skipped = (found_inf > 0) | state_overflow
    if peaks is not None:
        torch.where(skipped, peaks, skipped_peaks, out=skipped_peaks)
        step_peak = (peaks.max() if peak is None else peak).masked_fill(skipped, 0.0)
        torch.maximum(grad_peak, step_peak, out=grad_peak)
        if interval_peak is not None:
            torch.maximum(interval_peak, step_peak, out=interval_peak)
    factor = one.masked_fill(skipped, backoff)
    if interval_peak is not None:  # in the units of the (possibly halved) scale
        interval_peak.mul_(factor)
    scale.mul_(factor)
    taken = ~skipped
    # a bool adds and multiplies as 0/1 into the int64 counts: no cast of its own
    skipped_steps.add_(skipped)
    taken_steps.add_(taken)
    clean_steps.add_(1).mul_(taken)
    return skipped, taken, factor


def verdict(
    norms: list[torch.Tensor], margin: float, one: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient check before a step (module docstring) from each gradient's peak ``norms``
    (0-dim, one dtype, on ``one``'s device): the stacked peaks, their largest, and ``found_inf``
    (0-dim float32, ``one`` where ``margin·peak`` does not fit the dtype, else 0)."""
    peaks = torch.stack(norms)
    peak = peaks.max()
    fits = peak * margin <= torch.finfo(peaks.dtype).max  # False for inf and NaN
    return peaks, peak, one.masked_fill(fits, 0.0)


@torch.library.custom_op("pixelsac_lowp::gradient_verdict", mutates_args=())
def gradient_verdict(
    norms: list[torch.Tensor], margin: float, one: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verdict`, compiled: one op instead of four kernels, the same values."""
    with torch._dynamo.config.patch(recompile_limit=64):  # one compile per number of gradients
        return compile_once(verdict)(norms, margin, one)


@gradient_verdict.register_fake
def _(norms, margin, one):
    peaks = torch.empty(len(norms), dtype=norms[0].dtype, device=norms[0].device)
    return peaks, torch.empty((), dtype=peaks.dtype, device=peaks.device), torch.empty_like(one)


_MUTATED = ("skipped_peaks", "grad_peak", "interval_peak", "scale", "skipped_steps", "taken_steps", "clean_steps")


@torch.library.custom_op("pixelsac_lowp::scaler_after_step", mutates_args=_MUTATED)
def after_step(
    found_inf: torch.Tensor,
    state_overflow: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bookkeeping`, compiled: every record and count updated in place. ``found_inf``:
    0-dim float32; ``state_overflow``: 0-dim bool (the optimizer's new state overflowed); ``peaks``: each
    gradient's peak, with ``skipped_peaks`` and ``grad_peak`` (None, all three, where the step
    keeps no record); ``peak``: ``peaks.max()`` if already taken; ``interval_peak``: None without
    headroom growth; ``scale``: float32; the counts int64; ``one``: float32 1.0. Returns the 0-dim
    bools "skipped" and "taken" and the float32 factor (1 or ``backoff``)."""
    with torch._dynamo.config.patch(recompile_limit=64):  # a process may build many scalers
        return compile_once(bookkeeping)(
            found_inf, state_overflow, peaks, peak, skipped_peaks, grad_peak, interval_peak, scale, skipped_steps,
            taken_steps, clean_steps, one, backoff,
        )  # fmt: skip


@after_step.register_fake
def _(found_inf, state_overflow, *rest):
    flag = torch.empty((), dtype=torch.bool, device=found_inf.device)
    return flag, torch.empty_like(flag), torch.empty((), device=found_inf.device)
