"""Is every element of a tensor finite? One reduction pass instead of three.

``torch.isfinite(t).all()`` builds a bool tensor from ``t == t`` and ``|t| != inf`` and then
reduces it: on a CPU, many times a min-max reduction's time (docs/performance.md). The loss
scaler asks this of every gradient at every step, and Kahan-momentum and hAdam of their state.

:func:`all_finite` reads ``(lo, hi) = aminmax(t)`` instead. NaN propagates through both, and
an infinity is the minimum or the maximum, so ``-max <= lo and hi <= max`` (``max`` the dtype's
largest finite number) holds exactly when every element is finite.

The scaled form, "would ``factor·t`` still be finite?", is the same test on the products of
the extremes: for ``factor > 0``, rounding ``x·factor`` into the dtype is monotone in ``x``, so
the smallest and largest products are ``lo·factor`` and ``hi·factor`` rounded the same way --
the elementwise ``isfinite(t * factor).all()`` bit for bit, without the product tensor.

:func:`all_finite_many` asks it of a list at once. On a CPU that is the check above per tensor
(one cache-friendly pass each). On a GPU, where each tensor's few ops would be as many kernel
launches, it is three foreach passes for the whole list: ``p = t·factor`` (the same rounding),
``p·0`` (±0 where ``p`` is finite, NaN where it is not), and the L1 norm of each, which is 0 or
NaN -- a NaN survives every sum, so no max-like reduction has to propagate it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["all_finite", "all_finite_many", "finite_bits", "finite_pattern", "foreach_checks"]

_forced_form: list[bool] = []  # foreach_checks' setting, innermost last


def all_finite(tensor: torch.Tensor, factor: float | None = None) -> torch.Tensor:
    """0-dim bool tensor on ``tensor``'s device: are all elements (times ``factor > 0``, rounded
    into ``tensor``'s dtype) finite? True for an empty or integer tensor. No host sync."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if factor is not None and not factor > 0:
        raise ValueError(f"all_finite: factor must be positive, got {factor!r}")
    lo, hi = torch.aminmax(tensor)
    if factor is not None:
        lo, hi = lo * factor, hi * factor  # 0-dim, in tensor's dtype: the elementwise rounding
    largest = torch.finfo(tensor.dtype).max
    return (lo >= -largest) & (hi <= largest)


def foreach_by_default(device: torch.device) -> bool:
    """Whether :func:`all_finite_many` takes the foreach form unless told: off the CPU, where a
    launch per tensor costs more than the passes (on a CPU the foreach form is the slower one:
    docs/performance.md), unless :func:`foreach_checks` says otherwise."""
    if _forced_form:
        return _forced_form[-1]
    return device.type != "cpu"


@contextlib.contextmanager
def foreach_checks(on: bool = True) -> Iterator[None]:
    """Within it, :func:`all_finite_many` takes the foreach form (``on``) or the per-tensor one on
    every device: to count on a CPU the ops a GPU's checks dispatch (``pixelsac.perf.opcount``).
    The answer is the same either way."""
    _forced_form.append(bool(on))
    try:
        yield
    finally:
        _forced_form.pop()


def all_finite_many(
    tensors: list[torch.Tensor], factor: float | None = None, foreach: bool | None = None
) -> torch.Tensor:
    """0-dim bool tensor: is :func:`all_finite` true of every tensor in the list (same ``factor``)?
    One device for all of them. ``foreach``: the three-pass form of the module docstring
    (default: off the CPU); the answer is the same either way. No host sync."""
    floating = [t for t in tensors if t.is_floating_point() and t.numel() > 0]
    if not floating:
        return torch.ones((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    if factor is not None and not factor > 0:
        raise ValueError(f"all_finite_many: factor must be positive, got {factor!r}")
    if foreach is None:
        foreach = foreach_by_default(floating[0].device)
    if not foreach:
        flags = [all_finite(t, factor) for t in floating]
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()
    probes = torch._foreach_mul(floating, 1.0 if factor is None else factor)  # rounded like t·factor
    torch._foreach_mul_(probes, 0.0)  # ±0 where finite, NaN where not
    sums = torch._foreach_norm(probes, 1, dtype=torch.float32)
    return ~torch.stack(sums).isnan().any()


def finite_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Elementwise ``isfinite`` of a float32 tensor from its bits: finite exactly when the
    exponent field is not all ones (which marks ±inf and NaN)."""
    if tensor.dtype != torch.float32:
        raise TypeError(f"finite_bits: expects float32, got {tensor.dtype}")
    return finite_pattern(tensor.view(torch.int32))


def finite_pattern(bits: torch.Tensor) -> torch.Tensor:
    """:func:`finite_bits` of float32 values given as their int32 bit patterns (``t.view(torch.int32)``,
    for a caller that has the view already)."""
    exponent = 0x7F800000
    return bits.bitwise_and(exponent).ne(exponent)
