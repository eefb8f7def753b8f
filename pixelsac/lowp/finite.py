"""Is every element of a tensor finite? One reduction pass instead of three.

``torch.isfinite(t).all()`` builds a bool tensor from ``t == t`` and ``|t| != inf`` and then
reduces it: on a CPU, 4.3 ms for a million fp16 gradients, where a min-max reduction takes
0.2 ms. The loss scaler asks this of every gradient at every step, and Kahan-momentum and hAdam
of their state, so the checks were a few per cent of a small update.

:func:`all_finite` reads ``(lo, hi) = aminmax(t)`` instead. NaN propagates through both, and
an infinity is the minimum or the maximum, so ``-max <= lo and hi <= max`` (``max`` the dtype's
largest finite number) holds exactly when every element is finite.

The scaled form, "would ``factor·t`` still be finite?", is the same test on the products of
the extremes: for ``factor > 0``, rounding ``x·factor`` into the dtype is monotone in ``x``, so
the smallest and largest products are ``lo·factor`` and ``hi·factor`` rounded the same way --
the elementwise ``isfinite(t * factor).all()`` bit for bit, without the product tensor.
"""

from __future__ import annotations

import torch

__all__ = ["all_finite", "finite_bits"]


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


def finite_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Elementwise ``isfinite`` of a float32 tensor from its bits: finite exactly when the
    exponent field is not all ones (which marks ±inf and NaN)."""
    if tensor.dtype != torch.float32:
        raise TypeError(f"finite_bits: expects float32, got {tensor.dtype}")
    exponent = 0x7F800000
    return tensor.view(torch.int32).bitwise_and(exponent).ne(exponent)
