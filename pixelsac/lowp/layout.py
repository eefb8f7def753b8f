"""Optimizer state in its parameter's memory format.

A checkpoint keeps each tensor's strides, and ``Optimizer.load_state_dict`` moves state to the
parameter's dtype and device but keeps those strides. Resumed with another memory format
(``perf.channels_last`` switched, or a model converted after the state was made), a conv
weight's moments would then be NHWC while the weight is NCHW, or the reverse. Elementwise
tensor ops do not mind, but hAdam's unbiased step reads parameter, gradient and state as flat
vectors in memory order, and would pair each weight with another weight's moments. So every
state tensor of the parameter's shape is given the parameter's strides: the same values, another
order in memory, and a resumed run continues bit for bit as if the format had never changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["in_layout_of", "state_in_param_layouts_"]


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
