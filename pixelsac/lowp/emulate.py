"""Tensor-core semantics on a CPU: fp16/bf16 convolutions and matmuls with fp32 accumulation.

On a GPU, an fp16 convolution or matmul reads fp16 inputs, accumulates in fp32 and writes an
fp16 output. A CPU without native half kernels instead runs them ~10x slower than fp32
(measured: DrQ conv stack, batch 32, 502 ms native fp16 vs 36 ms this way). Inside
:func:`fp32_accumulate`, those ops upcast their fp16/bf16 inputs to fp32, run the fp32 kernel
and round the output back once. Everything else (elementwise ops, reductions, optimizers)
is untouched and stays genuinely low precision.

Autograd flows through the casts: the backward of the convolution/matmul runs in fp32 and
its input gradients are rounded to the leaves' fp16/bf16 dtype, again as on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["fp32_accumulate", "ACCUMULATING_OPS"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

# F.linear / F.conv* resolve to these builtins, and nn.Linear / nn.ConvNd call them.
ACCUMULATING_OPS = frozenset(
    {
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        F.linear,
        F.bilinear,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.mv,
        torch.addmm,
        torch.addmv,
        torch.baddbmm,
        torch.addbmm,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.Tensor.matmul,
        torch.Tensor.mm,
        torch.Tensor.bmm,
        torch.Tensor.mv,
        torch.Tensor.addmm,
        torch.Tensor.baddbmm,
    }
)


def _common_low_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The fp16/bf16 dtype shared by every floating tensor argument, else None."""
    leaves, _ = tree_flatten((args, kwargs))
    dtypes = {leaf.dtype for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}
    if len(dtypes) == 1:
        (dtype,) = dtypes
        if dtype in _LOW_PRECISION:
            return dtype
    return None


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION:
        return value.float()
    return value


class _Fp32AccumulateMode(TorchFunctionMode):
    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        # Ops given an out= tensor keep their native semantics; mixed dtypes keep torch's error.
        if func in ACCUMULATING_OPS and "out" not in kwargs:
            low_dtype = _common_low_dtype(args, kwargs)
            if low_dtype is not None:
                # The mode is disabled inside this handler, so these calls are not re-intercepted.
                result = func(*tree_map(_upcast, args), **tree_map(_upcast, kwargs))
                return result.to(low_dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_accumulate() -> Iterator[None]:
    """Within this context, fp16/bf16 convolutions and matmuls accumulate in fp32.

    Inputs are upcast, the fp32 kernel runs, and the output is rounded back to the inputs'
    dtype: the result differs from a native CPU fp16 kernel by at most an ulp or so (that
    kernel may round partial sums) and matches GPU tensor-core semantics. Ops whose floating
    inputs are fp32 (or mixed) are passed through unchanged.
    """
    with _Fp32AccumulateMode():
        yield
