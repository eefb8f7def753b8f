"""Optimizer state in its parameter's memory format.

A checkpoint keeps each tensor's strides, and ``Optimizer.load_state_dict`` moves state to the
parameter's dtype and device but keeps those strides. Resumed with another memory format
(``perf.channels_last`` switched, or a model converted after the state was made), a conv
weight's moments would then be NHWC while the weight is NCHW, or the reverse. Elementwise
tensor ops do not mind, but hAdam's unbiased step reads parameter, gradient and state as flat
vectors in memory order, and would pair each weight with another weight's moments. So every
state tensor of the parameter's shape is given the parameter's strides: the same values, another
order in memory, and a resumed run continues bit for bit as if the format had never changed.

The same memory order lets several tensors live in one flat buffer (hAdam's compiled step, the
Kahan-momentum target): :func:`flat_view` reads a tensor as a 1-D view in memory order, and
:func:`segment_views` cuts a flat buffer into views shaped and strided like given tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["flat_view", "in_layout_of", "reads_channels_last", "segment_views", "state_in_param_layouts_"]


def in_layout_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` with ``param``'s strides (a copy where they differ), for a tensor of its shape;
    anything else is returned as it is."""
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape != param.shape or value.stride() == param.stride():
        return value
    return torch.empty_like(param, dtype=value.dtype).copy_(value)


def state_in_param_layouts_(optimizer: Optimizer, keys: Any = None) -> None:
    """Give every state tensor (or those named in ``keys``) its parameter's memory format, in place
    in the state dicts."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if keys is None or key in keys:
                    state[key] = in_layout_of(param, value)


def reads_channels_last(tensor: torch.Tensor) -> bool:
    """Does :func:`flat_view` read ``tensor`` in NHWC order (a channels-last 4-D tensor that is
    not also contiguous)?"""
    return tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)


def flat_view(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """A 1-D view of ``tensor`` in the memory order of ``like`` (default: its own), so that a
    parameter, its gradient and its state line up element by element -- channels-last weights
    included. A gradient with other strides is copied into the parameter's layout (read only)."""
    like = tensor if like is None else like
    if tensor.stride() != like.stride():
        tensor = torch.empty_like(like).copy_(tensor)
    if tensor.is_contiguous():
        return tensor.view(-1)
    if reads_channels_last(tensor):  # NHWC memory: its elements in memory order, one view (not permute + view)
        return tensor.as_strided((tensor.numel(),), (1,))
    raise RuntimeError(f"unsupported tensor layout {tuple(tensor.stride())}: contiguous or channels-last only")


def segment_views(flat: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive views of the 1-D ``flat``, each with the shape and strides of its tensor in
    ``likes`` (a channels-last weight's view is NHWC in memory, NCHW in shape): the inverse of
    joining :func:`flat_view` of each. One ``as_strided`` each (a slice and a view would be two
    dispatched ops)."""
    views, start = [], flat.storage_offset()
    for like in likes:
        if not (like.is_contiguous() or reads_channels_last(like)):
            raise RuntimeError(f"unsupported tensor layout {tuple(like.stride())}: contiguous or channels-last only")
        views.append(flat.as_strided(like.shape, like.stride(), start))
        start += like.numel()
    return views
