"""Kahan (compensated) summation for in-place tensor updates.

Adding a small update ``u`` to a value ``p`` in fp16 rounds the sum to 11 significant
bits; when ``|u|`` is below half an ulp of ``p`` the update is lost entirely. Kahan
summation keeps the lost low-order part in a compensation buffer ``c`` (same dtype as
``p``) and feeds it back on the next update::

    y = u - c          # the update, corrected by what was lost last time
    t = p + y          # rounded sum
    c = (t - p) - y    # (what was actually added) - (what we wanted to add)
    p = t

``p - c`` then tracks the exact running sum to about one rounding of ``p``'s dtype,
however many updates are accumulated. Each operation above must be rounded to the
working dtype (not fused), which is what separate tensor ops give us.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .masked import select_

__all__ = ["kahan_add_"]


@torch.no_grad()
def kahan_add_(
    values: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    kahan_comps: Sequence[torch.Tensor],
    taken: torch.Tensor | None = None,
) -> None:
    """Compensated in-place ``values[i] += updates[i]`` for every i.

    Args:
        values: tensors updated in place (``p``).
        updates: the increments ``u``; consumed (overwritten with ``y``).
        kahan_comps: compensation buffers ``c``, updated in place; start them at zero.
        taken: optional 0-dim bool (or 0/1): False leaves ``p`` and ``c`` bit-exactly unchanged
            (``p <- lerp(p, t, taken)``, exact for 0 and 1, see ``masked.py``), decided without a host sync.

    All three lists must have matching shapes, dtypes and devices pairwise.
    """
    if not values:
        return
    values, updates, kahan_comps = list(values), list(updates), list(kahan_comps)
    # y = u - c  (reuses the update storage)
    torch._foreach_sub_(updates, kahan_comps)
    # t = p + y
    summed = torch._foreach_add(values, updates)
    # c = (t - p) - y
    if taken is not None:
        new_comps = torch._foreach_sub(summed, values)
        torch._foreach_sub_(new_comps, updates)
        select_(kahan_comps, new_comps, taken)
        select_(values, summed, taken)
        return
    torch._foreach_copy_(kahan_comps, summed)
    torch._foreach_sub_(kahan_comps, values)
    torch._foreach_sub_(kahan_comps, updates)
    # p = t
    torch._foreach_copy_(values, summed)
