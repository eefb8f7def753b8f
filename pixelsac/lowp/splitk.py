"""Split-K for long fp16/bf16 matmuls, with every sum kept in fp32.

A linear layer ``y = x Wᵀ + b`` with ``x`` of shape (B, K) and ``W`` of shape (N, K) and a long
reduction (DrQ's encoder projection: K = 32·35·35 = 39,200, N = 50) gives a GPU few output tiles
to work on: B·N outputs and one long dot product each. cuBLAS parallelises such a GEMM by
splitting K across thread blocks, but for fp16/bf16 it only does so when reduced-precision
reductions are allowed -- the partial sums are then rounded to fp16/bf16 before they are added,
and the product is no longer the fp32-accumulated one the numerics were validated with.

Here the split is done outside the library and every sum stays fp32. With ``s`` chunks of
length ``k = K / s``::

    P_c = x[:, c·k:(c+1)·k] · W[:, c·k:(c+1)·k]ᵀ      (fp32, c = 0..s-1; one batched GEMM)
    y   = round_low( Σ_c P_c + b )                     (fp32 sum over the chunks, one rounding)

Each ``P_c`` is a product of fp16/bf16 inputs accumulated in fp32 (on CUDA, ``torch.bmm`` with
``out_dtype=torch.float32``; elsewhere the same arithmetic on exact fp32 copies, since a
product of two fp16 or bf16 numbers is exact in fp32). ``y`` is therefore an fp32 dot product
in another summation order, rounded once: what ``F.linear`` computes on tensor cores, up to
the reassociation of an fp32 sum (far below the final rounding: outputs differ from the
unsplit form by at most one ulp of the output dtype, and only where the fp32 sums straddle a
rounding boundary). The chunks form the batch of one GEMM, so the GPU has ``s`` times the tiles.

Backward needs no split: ``∂L/∂x = g W`` reduces over N and ``∂L/∂W = gᵀ x`` over B, both short.
They are computed as ``F.linear``'s backward would be on tensor cores: fp16/bf16 inputs, fp32
accumulation, one rounding (on a CPU, on exact fp32 copies). ``∂L/∂b`` is ``g`` summed over the
batch, as torch sums half-precision tensors: in fp32, rounded once.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["split_k_linear", "split_count", "SplitKLinear", "split_k_paths", "describe_split_k", "reset_split_k_paths"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=64)
def split_count(k: int, chunk: int) -> int:
    """The number of chunks for a reduction of length ``k``: the divisor of ``k`` closest to
    ``k / chunk`` (ties to the larger count), so that chunks are equal and about ``chunk`` long;
    1 where ``k`` is at most ``chunk``."""
    if chunk <= 0:
        raise ValueError(f"split_count: chunk must be positive, got {chunk}")
    if k <= chunk:
        return 1
    wanted = k / chunk
    divisors = [d for d in range(1, k + 1) if k % d == 0 and d <= 2 * wanted + 1]
    return min(divisors, key=lambda d: (abs(d - wanted), -d))


#: Whether ``torch.bmm(..., out_dtype=torch.float32)`` is usable here: None until its first call on
#: a GPU, then True, or False after it failed as "this GEMM form is not supported"
#: (:func:`_unsupported`), with the failure's first line in ``why_not``.
_MIXED_GEMM: dict[str, Any] = {"usable": None, "why_not": None}
#: The products split-K computed since the last :func:`reset_split_k_paths`: path -> why.
_PATHS_TAKEN: dict[str, str] = {}
MIXED_GEMM = "mixed_gemm"  # one fp16/bf16 GEMM with an fp32 output (CUDA)
FP32_COPIES = "fp32_copies"  # the same product of exact fp32 copies


def _unsupported(exc: BaseException) -> bool:
    """Whether ``exc`` from ``torch.bmm(..., out_dtype=float32)`` says that this GEMM form is not
    supported here (a torch without the keyword, no kernel for the backend, cuBLAS refusing the
    form), rather than anything else -- out of memory, a failed capture, an illegal address --
    which must reach the caller."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    message = str(exc)
    if isinstance(exc, TypeError):
        return "out_dtype" in message
    if isinstance(exc, NotImplementedError):
        return True
    return isinstance(exc, RuntimeError) and any(
        mark in message for mark in ("Could not run 'aten::bmm.dtype'", "out_dtype", "NOT_SUPPORTED")
    )


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_k_paths() -> dict[str, str]:
    """The products split-K ran since the last :func:`reset_split_k_paths` (process start):
    ``{"mixed_gemm": ...}`` and/or ``{"fp32_copies": why}``; empty when no layer was split."""
    return dict(_PATHS_TAKEN)


def describe_split_k() -> str:
    """:func:`split_k_paths` in a few words, for a benchmark row or a run's summary."""
    if not _PATHS_TAKEN:
        return "off"
    return ", ".join(f"{path} ({why})" if why else path for path, why in sorted(_PATHS_TAKEN.items()))


def reset_split_k_paths() -> None:
    """Forget the paths taken (a benchmark does this before each cell); the mixed GEMM's
    verdict stays, since it is the device's and torch's."""
    _PATHS_TAKEN.clear()


def _fp32_product(a: torch.Tensor, b: torch.Tensor, mixed: bool | None = None) -> torch.Tensor:
    """``torch.bmm(a, b)`` of fp16/bf16 inputs accumulated and returned in fp32.

    ``mixed`` (default: on CUDA): one mixed-dtype GEMM with an fp32 output. Where that form is
    not supported (the first such failure is remembered, :func:`_unsupported`), and on a CPU,
    which has none, the same product of fp32 copies: ``float(x16)`` is exact, so the values are
    those of the mixed GEMM up to the order of the fp32 sums. Any other failure is raised, and
    nothing is tried or caught while a CUDA graph is being captured (a failed call there breaks
    the capture, which must end with the error): the eager warm-ups before capture decide."""
    if mixed is None:
        mixed = a.device.type == "cuda"
    if mixed and _MIXED_GEMM["usable"] is not False:
        if _MIXED_GEMM["usable"] is None and not _capturing(a.device):
            try:
                out = torch.bmm(a, b, out_dtype=torch.float32)
            except (RuntimeError, TypeError, NotImplementedError) as exc:
                if not _unsupported(exc):
                    raise
                _MIXED_GEMM.update(usable=False, why_not=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            else:
                _MIXED_GEMM["usable"] = True
                _PATHS_TAKEN[MIXED_GEMM] = ""
                return out
        else:
            _PATHS_TAKEN[MIXED_GEMM] = ""
            return torch.bmm(a, b, out_dtype=torch.float32)
    why = "no mixed-dtype GEMM on a CPU" if not mixed else f"mixed GEMM unsupported: {_MIXED_GEMM['why_not']}"
    _PATHS_TAKEN[FP32_COPIES] = why
    return torch.bmm(a.float(), b.float())


def _low_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as tensor cores compute it: fp16/bf16 inputs, fp32 accumulation, one rounding."""
    if a.device.type == "cuda":  # cuBLAS accumulates in fp32 (reduced-precision reductions are off)
        return a @ b
    return (a.float() @ b.float()).to(a.dtype)


class _SplitKLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int
    ) -> torch.Tensor:
        batch, k = x.shape
        out_features = weight.shape[0]
        chunk = k // splits
        # (s, B, k) and (s, k, N): views, no copies (x and W are row-major in K)
        x_chunks = x.view(batch, splits, chunk).transpose(0, 1)
        w_chunks = weight.view(out_features, splits, chunk).permute(1, 2, 0)
        partial = _fp32_product(x_chunks, w_chunks)  # (s, B, N) fp32
        total = partial.sum(dim=0)
        if bias is not None:
            total = total + bias.float()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        grad_x = _low_product(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = _low_product(grad.t(), x) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def split_k_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, splits: int
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its reduction split into ``splits`` equal chunks whose
    fp32 partial products are summed in fp32 and rounded once (module docstring).

    Applies to 2-D fp16/bf16 ``x`` with ``weight`` of the same dtype, contiguous, and ``splits``
    dividing K; anything else (fp32, one split, other shapes) is plain ``F.linear``.
    """
    k = x.shape[-1]
    if (
        splits <= 1
        or x.dim() != 2
        or x.dtype not in _LOW_PRECISION
        or weight.dtype != x.dtype
        or (bias is not None and bias.dtype != x.dtype)
        or k % splits
        or not x.is_contiguous()
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    return _SplitKLinear.apply(x, weight, bias, splits)


class SplitKLinear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict keys and initialisation) that runs its
    fp16/bf16 forward through :func:`split_k_linear` when ``split_chunk`` is set.

    ``split_chunk`` (None: off) is the wanted chunk length; the count is
    :func:`split_count` of ``in_features``. Set it after construction, per device
    (``pixelsac.precision``: on for fp16/bf16 on CUDA).
    """

    split_chunk: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_chunk is None:
            return super().forward(x)
        return split_k_linear(x, self.weight, self.bias, splits=split_count(self.in_features, self.split_chunk))
