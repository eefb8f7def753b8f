"""Device-side decisions inside foreach calls: masked writes and device scalars, no host read.

A sync-free step decides on the device whether it happens (``taken``, a 0-dim bool) and may
hold a device scalar (a rescaled ε). Passing such a 0-dim tensor to ``torch._foreach_add_``,
``_foreach_sub_`` or ``_foreach_lerp_`` selects their *Scalar* overload, which reads the value on
the host (``aten._local_scalar_dense``: a device-to-host synchronisation on CUDA, an error inside
CUDA graph capture). Only ``_foreach_mul_``/``_foreach_div_`` pick a Tensor overload for it. The
two helpers here keep the value on the device:

* :func:`add_scalar_` adds a float, or a 0-dim tensor through ``_foreach_add_``'s Tensor
  overload (``alpha=`` selects it): one fused kernel on CUDA, the same arithmetic as the
  Scalar form (the scalar enters the op math in float32 either way);
* :func:`select_` writes ``targets[i] <- lerp(targets[i], candidates[i], taken)`` with a per-tensor
  list of weights (``_foreach_lerp_``'s List overload), the very arithmetic of the Scalar form:
  torch evaluates ``lerp(a, b, w)`` as ``a + w·(b - a)`` for ``w < 0.5`` and ``b - (b - a)·(1 - w)``
  otherwise, so ``w = 0`` gives ``a`` and ``w = 1`` gives ``b`` bit for bit (for finite
  ``b - a``). On CUDA the 0-dim weights take the per-tensor (slow-route) kernels: one launch
  per tensor instead of one per list, and still no synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["add_scalar_", "select_"]


def add_scalar_(tensors: Sequence[torch.Tensor], value: float | torch.Tensor) -> None:
    """``tensors[i] += value`` in place (dtype kept); a 0-dim tensor ``value`` is not read on the host."""
    if torch.is_tensor(value):
        torch._foreach_add_(list(tensors), value, alpha=1)  # alpha: the Tensor overload, not Scalar
    else:
        torch._foreach_add_(list(tensors), value)


def select_(targets: Sequence[torch.Tensor], candidates: Sequence[torch.Tensor], taken: torch.Tensor) -> None:
    """``targets[i] <- candidates[i]`` where the 0-dim bool (or 0/1) ``taken`` holds, else
    unchanged (bit for bit for finite differences), decided on the device."""
    if not targets:
        return
    weight = taken.to(device=targets[0].device, dtype=targets[0].dtype)  # 0 and 1 are exact in any float
    torch._foreach_lerp_(list(targets), list(candidates), [weight] * len(targets))
