"""Kahan-momentum's flat target update as one op whose kernels ``torch.compile`` generates
(``KahanEMA(compiled=True)``).

The flat update of ``ema.py`` (the scaled copy ``θ̄_S`` and its Kahan buffer ``c`` one 1-D buffer
each, the source ``θ`` joined in the same order) is a chain of whole-buffer ops: the adaptive
scale's choice (a dozen ops on per-parameter vectors), the spread of each parameter's factor and
scale over its elements, the rescale, ``K_i·θ``, the increment, the four Kahan ops, the
finiteness sum and the failure record -- about 40 kernels an update on a GPU. Here one function
does it, and inductor fuses it. For parameter ``i`` with peaks ``P_i`` (``max|θ_i|``) and
``Q_i`` (``max|θ̄_S,i|``), both read by one foreach norm before the op, and element ``e`` of it::

    k_i' = clamp(floor(log2(H / (K·max(P_i, Q_i / K_i)))), k_min, 0)      (adaptive only)
    f_i = K_i' / K_i;   θ̄_S <- RN(θ̄_S·f_i);   c <- RN(c·f_i);   K_i <- K_i'
    u = RN(RN(RN(K_i·θ) - θ̄_S)·τ)
    y = RN(u - c);   t = RN(θ̄_S + y);   c <- RN(RN(t - θ̄_S) - y);   θ̄_S <- t
    updates += 1;   first_nonfinite <- updates  if Σ|θ̄_S| is not finite and none was recorded

(``RN``: rounded to the buffers' dtype; ``τ`` float32; ``H`` = headroom · the dtype's largest
value) -- the eager flat form's arithmetic, op for op: each product, difference and quotient is
computed in float32 from its 16-bit operands and rounded once, as ATen rounds it, and the
shift's ``log2``/``floor`` are the same functions. Each element finds its parameter by a
``bucketize`` of its position against the parameters' ends. With a stored target the op also
writes ``θ̄ = RN(θ̄_S / K_i)`` into ``target`` (a 1-D buffer the caller copies out); a derived
target computes the same quotients whenever it runs, as one op of its own (:func:`derive`).

Compiled with inductor's ``emulate_precision_casts`` (as ``fused.py``): without it a kernel keeps
``t`` in float32 and the compensation ``(t - θ̄_S) - y`` comes out 0 -- Kahan-momentum silently
off. tests/test_lowp_ema.py holds the op to the eager flat form bit for bit (buffers, shifts,
record, target) through 60 updates whose scales change.
"""

from __future__ import annotations

import itertools

import torch

from .fused import compile_once

__all__ = ["derive", "ends_table", "hyperparameters", "target_update"]


def ends_table(numels: list[int], device: torch.device) -> torch.Tensor:
    """int32: each parameter's last-plus-one position in the joined buffers (``bucketize``'s
    boundaries: an element at position ``e`` belongs to the first parameter whose end exceeds it)."""
    ends = list(itertools.accumulate(numels))
    if ends and ends[-1] >= 1 << 31:
        raise ValueError(f"KahanEMA(compiled=True): {ends[-1]:,} elements need 64-bit positions")
    return torch.tensor(ends, dtype=torch.int32, device=device)


def hyperparameters(tau: float, scale: float, limit_over_scale: float, device: torch.device) -> torch.Tensor:
    """float32 ``[τ, K, H/K]``: the Python numbers the eager update multiplies by, as its float32
    ops round them; a tensor, so that one compiled graph serves any τ and K."""
    return torch.tensor([tau, scale, limit_over_scale], dtype=torch.float32, device=device)


def _scales_and_owners(scaled, shifts, ends, scale):
    """``K_i = K·2^{k_i}`` per parameter (as ``KahanEMA.tensor_scales``) and each element's
    parameter (a ``bucketize`` of its position against the parameters' ends)."""
    position = torch.arange(scaled.numel(), dtype=torch.int32, device=scaled.device)
    return torch.exp2(shifts.float()) * scale, torch.bucketize(position, ends, out_int32=True, right=True)


def _update(
    source, scaled, comps, target, norms, shifts, target_updates, first_nonfinite, ends, hyper, min_shift
):  # fmt: skip
    tau, scale, limit_over_scale = hyper[0], hyper[1], hyper[2]
    dtype = scaled.dtype
    scales, owner = _scales_and_owners(scaled, shifts, ends, scale)
    if norms:  # the adaptive scale: ema.KahanEMA._shifts_for, op for op
        peaks = torch.stack(norms).float().view(2, -1)
        peak = torch.maximum(peaks[0], peaks[1] / scales)
        wanted = torch.log2(peak.reciprocal() * limit_over_scale).floor()
        wanted = torch.nan_to_num(wanted, nan=0.0, posinf=0.0, neginf=float(min_shift))
        new_shifts = wanted.clamp(min_shift, 0).to(torch.int32)
        new_scales = torch.exp2(new_shifts.float()) * scale
        factor = (new_scales / scales)[owner]
        held = (scaled.float() * factor).to(dtype)
        held_comps = (comps.float() * factor).to(dtype)
        shifts.copy_(new_shifts)
        scales = new_scales
    else:
        held, held_comps = scaled, comps
    element_scales = scales[owner]
    increment = (source.float() * element_scales).to(dtype)
    increment = ((increment - held).float() * tau).to(dtype)
    corrected = increment - held_comps  # y
    summed = held + corrected  # t
    comps.copy_((summed - held) - corrected)
    scaled.copy_(summed)
    # one comparison: False for inf and NaN (the eager form's test: an L1 norm in float32, which no
    # fp16 copy can overflow, and a bf16 one only with weights beyond ~1e33)
    finite = summed.float().abs().sum() <= torch.finfo(torch.float32).max
    target_updates.add_(1)
    failed_now = ~finite & (first_nonfinite < 0)
    first_nonfinite.copy_(torch.where(failed_now, target_updates, first_nonfinite))
    if target is not None:
        target.copy_((summed.float() / element_scales).to(dtype))


def _derive(scaled, shifts, ends, hyper):
    scales, owner = _scales_and_owners(scaled, shifts, ends, hyper[1])
    return (scaled.float() / scales[owner]).to(scaled.dtype)


_MUTATED = ("scaled", "comps", "target", "shifts", "target_updates", "first_nonfinite")


@torch.library.custom_op("pixelsac_lowp::kahan_target_update", mutates_args=_MUTATED)
def target_update(
    source: torch.Tensor,
    scaled: torch.Tensor,
    comps: torch.Tensor,
    target: torch.Tensor | None,
    norms: list[torch.Tensor],
    shifts: torch.Tensor,
    target_updates: torch.Tensor,
    first_nonfinite: torch.Tensor,
    ends: torch.Tensor,
    hyper: torch.Tensor,
    min_shift: int,
) -> None:
    """One Kahan-momentum target update (module docstring) on 1-D buffers in the parameters'
    order: ``source`` (θ, read), ``scaled`` (θ̄_S) and ``comps`` (c), updated in place, and
    ``target`` (None, or θ̄ written). ``norms``: empty for the fixed scale, else the per-parameter
    ``max|θ_i|`` then ``max|θ̄_S,i|`` as 0-dim tensors (one ``_foreach_norm``); ``shifts`` (int32
    ``k_i``), ``target_updates`` and ``first_nonfinite`` (int64, 0-dim): ``KahanEMA``'s buffers,
    updated in place; ``ends``: :func:`ends_table`; ``hyper``: :func:`hyperparameters`;
    ``min_shift``: the smallest ``k_i``."""
    with torch._dynamo.config.patch(recompile_limit=64):  # a process may build many agents
        compile_once(_update)(
            source, scaled, comps, target, norms, shifts, target_updates, first_nonfinite, ends, hyper, min_shift
        )


@torch.library.custom_op("pixelsac_lowp::kahan_target_derive", mutates_args=())
def derive(scaled: torch.Tensor, shifts: torch.Tensor, ends: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """The derived target ``θ̄ = RN(θ̄_S / K_i)`` as a new 1-D buffer in ``scaled``'s order (the
    eager flat form's quotients, each rounded once; ``K_i = K·2^{k_i}`` from ``shifts`` and
    ``hyper``'s K): one op where the eager form spreads the scales over the elements first."""
    with torch._dynamo.config.patch(recompile_limit=64):
        return compile_once(_derive)(scaled, shifts, ends, hyper)


@derive.register_fake
def _(scaled, shifts, ends, hyper):
    return torch.empty_like(scaled)
