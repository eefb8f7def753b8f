"""Tensor-core semantics on a CPU: fp16/bf16 convolutions and matmuls with fp32 accumulation.

On a GPU, an fp16 convolution or matmul reads fp16 inputs, accumulates in fp32 and writes an
fp16 output. A CPU without native half kernels instead runs them many times slower than fp32
(docs/performance.md). Inside
:func:`fp32_accumulate`, those ops upcast their fp16/bf16 inputs to fp32, run the fp32 kernel
and round the output back once. Everything else (elementwise ops, reductions, optimizers)
is untouched and stays genuinely low precision.

Autograd flows through the casts: the backward of the convolution/matmul runs in fp32 and
its input gradients are rounded to the leaves' fp16/bf16 dtype, again as on a GPU.

What is kept for backward is what a GPU keeps, too. Written as plain autograd,
``conv2d(x.float(), w.float()).half()`` would save the fp32 copies ``x.float()`` and
``w.float()``: 4 bytes per element beside the fp16 activation that the previous op (a ReLU)
saves anyway, 6 bytes where a GPU keeps 2 -- more activation memory than fp32 itself. Here each
op runs as one autograd node (:class:`_Fp32Accumulated`) that saves the fp16/bf16 inputs and
re-creates their fp32 copies only inside its backward. The fp32 kernel and its autograd
formula are the very ones the plain form runs (the backward is that graph's own, replayed on
re-created copies that equal the forward's bit for bit, since ``float(x16)`` is exact), so
outputs and gradients are bitwise those of the plain form; fp32 buffers live for one op.

With ``batch_chunk=N``, a 2-D convolution or a linear layer whose batch is larger than N runs
its fp32 work N samples at a time (:class:`_BatchChunked`): the upcast inputs, the fp32 output
and, in backward, the fp32 gradients and the kernel's own workspaces then exist for N samples
at once instead of the whole batch -- closer to a GPU, where no fp32 copy of an activation
exists at all. Each sample's output is computed by the same fp32 kernel (bitwise the unchunked
form wherever the kernel's per-sample arithmetic does not depend on the batch size); the weight
and bias gradients, sums over the batch, are summed chunk by chunk in fp32 (a reassociation of
an fp32 sum, far below the fp16/bf16 rounding that follows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

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


# A packed save: ("upcast", slot, size, stride, storage offset) or ("kept", index).
_Packed = tuple


class _SavedLow:
    """What one emulated op keeps for backward, built by saved-tensor hooks around its fp32 call.

    A tensor the fp32 op saves that lies in the storage of an upcast input (the copy itself, or a
    view such as ``w.float().t()`` inside ``F.linear``) is replaced by the input's slot and the
    view's geometry; the low-precision input itself goes through ``ctx.save_for_backward``. Any
    other saved tensor (none for the ops above with dense inputs; e.g. a reshape that had to
    copy) is kept as it is, also through ``ctx``. Through ``ctx`` the usual in-place
    modification checks apply, and outer ``saved_tensors_hooks`` (memory meters, offloading)
    see exactly what the op keeps.
    """

    def __init__(self, upcasts: dict[int, torch.Tensor]) -> None:
        # storage address -> (input index, the upcast's size and strides); the upcasts are all
        # alive while the op runs, so addresses are unique here
        self._by_storage = {
            u.untyped_storage().data_ptr(): (i, tuple(u.size()), tuple(u.stride()))
            for i, u in upcasts.items()
            if u.untyped_storage().nbytes() > 0
        }
        self.slots: list[int] = []  # input index of each low-precision tensor saved
        self.geometry: list[tuple] = []  # its upcast's (size, stride)
        self._slot_of: dict[int, int] = {}
        self.kept: list[torch.Tensor] | None = []
        self._saved: tuple[torch.Tensor, ...] | None = None  # set during backward only
        self._copies: dict[int, torch.Tensor] = {}

    def pack(self, tensor: torch.Tensor) -> _Packed:
        source = None
        if tensor.dtype == torch.float32 and tensor.layout == torch.strided:
            source = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if source is None:
            self.kept.append(tensor)
            return ("kept", len(self.kept) - 1)
        index, size, stride = source
        slot = self._slot_of.get(index)
        if slot is None:
            slot = self._slot_of[index] = len(self.slots)
            self.slots.append(index)
            self.geometry.append((size, stride))
        return ("upcast", slot, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())

    def unpack(self, packed: _Packed) -> torch.Tensor:
        if self._saved is None:
            raise RuntimeError("fp32_accumulate: a saved tensor was read outside the op's backward")
        if packed[0] == "kept":
            return self._saved[len(self.slots) + packed[1]]
        _, slot, size, stride, offset = packed
        copy = self._copies.get(slot)
        if copy is None:
            # The forward's upcast had exactly this layout (a dense copy of the input), and
            # float(x16) is exact: these are its bits again, whatever layout the saved low
            # tensor comes back in.
            low = self._saved[slot]
            copy_size, copy_stride = self.geometry[slot]
            copy = torch.empty_strided(copy_size, copy_stride, dtype=torch.float32, device=low.device)
            copy.copy_(low)
            self._copies[slot] = copy
        if size == tuple(copy.size()) and stride == tuple(copy.stride()) and offset == 0:
            return copy
        return copy.as_strided(size, stride, offset)

    def open(self, saved: tuple[torch.Tensor, ...]) -> None:
        self._saved = saved

    def close(self) -> None:
        self._saved = None
        self._copies = {}


class _Fp32Accumulated(torch.autograd.Function):
    """``func(*upcast inputs).to(low)`` as one autograd node that saves low-precision tensors.

    Forward builds, with grad enabled, the very graph plain autograd would build for the upcast
    form -- ``x16 → float() → func → to(low)`` -- but with every save of the fp32 op redirected
    through :class:`_SavedLow`; then it keeps only that graph's nodes (no tensors) and returns the
    output detached. Backward replays the inner graph with ``torch.autograd.grad`` from the
    output's edge to the upcasts' edges, re-creating each fp32 copy when the op's backward reads
    it, and rounds the input gradients to ``low`` as the upcast's own backward would.
    """

    @staticmethod
    def forward(
        ctx: Any, func: Callable, spec: Any, template: list, low: torch.dtype, *tensors: torch.Tensor
    ) -> torch.Tensor:
        with torch.enable_grad():
            upcasts = {i: t.float() for i, t in enumerate(tensors) if t.dtype == low}
            leaves = list(template)
            positions = [i for i, leaf in enumerate(template) if leaf is _TENSOR]
            for position, (i, tensor) in zip(positions, enumerate(tensors)):
                leaves[position] = upcasts.get(i, tensor)
            args, kwargs = tree_unflatten(leaves, spec)
            saved = _SavedLow(upcasts)
            with saved_tensors_hooks(saved.pack, saved.unpack):
                out = func(*args, **kwargs).to(low)
            ctx.input_edges = {i: get_gradient_edge(u) for i, u in upcasts.items() if u.requires_grad}
        ctx.saved = saved
        ctx.low = low
        ctx.out_edge = get_gradient_edge(out) if out.requires_grad else None
        ctx.count = len(tensors)
        ctx.save_for_backward(*(tensors[i] for i in saved.slots), *saved.kept)
        saved.kept = None  # from here on only ctx holds them
        return out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads: list[torch.Tensor | None] = [None] * ctx.count
        wanted = [i for i in ctx.input_edges if ctx.needs_input_grad[4 + i]]
        if ctx.out_edge is not None and wanted:
            ctx.saved.open(ctx.saved_tensors)
            try:
                # retain_graph: the inner nodes hold only packed references (the tensors live in
                # ctx), and a second outer backward must fail or succeed as ctx's tensors decide
                found = torch.autograd.grad(
                    [ctx.out_edge],
                    [ctx.input_edges[i] for i in wanted],
                    [grad_out],
                    retain_graph=True,
                    allow_unused=True,
                )
            finally:
                ctx.saved.close()
            for i, grad in zip(wanted, found):
                # what the upcast's backward (ToCopyBackward) does with the fp32 gradient
                grads[i] = None if grad is None else grad.to(ctx.low)
        return (None, None, None, None, *grads)


def _pair(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else tuple(value)


class _BatchChunked(torch.autograd.Function):
    """A low-precision conv2d or linear computed in fp32 ``chunk`` samples at a time.

    Forward: for each slice ``x[i:i+chunk]``, ``op(float(x_i), float(w), float(b))`` rounded into
    its slice of the low-precision output. Saves the low-precision input and weight (as a GPU).
    Backward, per slice: ``∂L/∂x_i = op'(g_i)`` rounded once into its slice, and
    ``∂L/∂w = Σ_i op_w'(g_i, x_i)``, ``∂L/∂b = Σ_i Σ_n g_i`` accumulated in fp32 across slices and
    rounded once. ``conv`` holds (stride, padding, dilation, groups), or None for linear.
    """

    @staticmethod
    def forward(
        ctx: Any,
        chunk: int,
        conv: tuple | None,
        low: torch.dtype,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        w32 = weight.float()
        b32 = None if bias is None else bias.float()
        out: torch.Tensor | None = None
        for start in range(0, x.shape[0], chunk):
            x32 = x[start : start + chunk].float()
            part = F.conv2d(x32, w32, b32, *conv) if conv is not None else F.linear(x32, w32, b32)
            if out is None:  # the layout the fp32 kernel chose (channels-last in, channels-last out)
                layout = (
                    torch.channels_last
                    if part.dim() == 4
                    and part.is_contiguous(memory_format=torch.channels_last)
                    and not part.is_contiguous()
                    else torch.contiguous_format
                )
                out = torch.empty((x.shape[0], *part.shape[1:]), dtype=low, device=x.device, memory_format=layout)
            out[start : start + chunk].copy_(part)
            del x32, part
        ctx.chunk, ctx.conv, ctx.low, ctx.has_bias = chunk, conv, low, bias is not None
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[3:6]
        w32 = weight.float()
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros_like(w32) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if need_b else None
        for start in range(0, x.shape[0], ctx.chunk):
            end = start + ctx.chunk
            g32 = grad_out[start:end].float()
            # the conv kernel reads the input's geometry even for the input gradient alone
            x32 = x[start:end].float() if need_w or ctx.conv is not None else None
            if ctx.conv is not None:
                stride, padding, dilation, groups = ctx.conv
                gx, gw, gb = torch.ops.aten.convolution_backward(
                    g32,
                    x32,
                    w32,
                    [weight.shape[0]] if ctx.has_bias else None,
                    _pair(stride),
                    _pair(padding),
                    _pair(dilation),
                    False,
                    [0, 0],
                    groups,
                    [need_x, need_w, need_b],
                )
            else:
                gx = g32 @ w32 if need_x else None
                gw = g32.t() @ x32 if need_w else None
                gb = g32.sum(0) if need_b else None
            if need_x:
                grad_x[start:end].copy_(gx)
            if need_w:
                grad_w += gw
            if need_b:
                grad_b += gb
            del g32, x32, gx, gw, gb
        return (
            None,
            None,
            None,
            grad_x,
            None if grad_w is None else grad_w.to(ctx.low),
            None if grad_b is None else grad_b.to(ctx.low),
        )


def _chunkable(func: Callable, args: tuple, kwargs: dict, chunk: int | None) -> tuple | None:
    """(x, weight, bias, conv) when ``func(*args, **kwargs)`` is a conv2d or linear over a batch
    larger than ``chunk`` that :class:`_BatchChunked` computes; else None."""
    if chunk is None or (func is not F.conv2d and func is not F.linear):
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    if func is F.linear:
        names = names[:3]
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            return None
        bound[key] = value
    x, weight, bias = bound.get("input"), bound.get("weight"), bound.get("bias")
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return None
    if x.dim() != (4 if func is F.conv2d else 2) or x.shape[0] <= chunk:
        return None
    if func is F.linear:
        return x, weight, bias, None
    padding = bound.get("padding", 0)
    if isinstance(padding, str):  # "same"/"valid": left to the unchunked form
        return None
    return x, weight, bias, (bound.get("stride", 1), padding, bound.get("dilation", 1), bound.get("groups", 1))


class _TensorSlot:
    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()


def _emulate_saving_low(func: Callable, args: tuple, kwargs: dict, low: torch.dtype) -> Any:
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    template = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    return _Fp32Accumulated.apply(func, spec, template, low, *tensors)


class _Fp32AccumulateMode(TorchFunctionMode):
    def __init__(self, save_low_precision: bool = True, batch_chunk: int | None = None) -> None:
        super().__init__()
        self.save_low_precision = save_low_precision
        self.batch_chunk = batch_chunk

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Ops given an out= tensor keep their native semantics; mixed dtypes keep torch's error.
        if func in ACCUMULATING_OPS and "out" not in kwargs:
            low_dtype = _common_low_dtype(args, kwargs)
            if low_dtype is not None:
                # The mode is disabled inside this handler, so these calls are not re-intercepted.
                chunked = _chunkable(func, args, kwargs, self.batch_chunk) if self.save_low_precision else None
                if chunked is not None:
                    x, weight, bias, conv = chunked
                    return _BatchChunked.apply(self.batch_chunk, conv, low_dtype, x, weight, bias)
                leaves = tree_flatten((args, kwargs))[0]
                if (
                    self.save_low_precision
                    and torch.is_grad_enabled()
                    and any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves)
                ):
                    return _emulate_saving_low(func, args, kwargs, low_dtype)
                # Nothing to save (no grad), or the plain form asked for.
                return func(*tree_map(_upcast, args), **tree_map(_upcast, kwargs)).to(low_dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_accumulate(save_low_precision: bool = True, batch_chunk: int | None = None) -> Iterator[None]:
    """Within this context, fp16/bf16 convolutions and matmuls accumulate in fp32.

    Inputs are upcast, the fp32 kernel runs, and the output is rounded back to the inputs'
    dtype: the result differs from a native CPU fp16 kernel by at most an ulp or so (that
    kernel may round partial sums) and matches GPU tensor-core semantics. Ops whose floating
    inputs are fp32 (or mixed) are passed through unchanged.

    Args:
        save_low_precision: save the fp16/bf16 inputs for backward and re-create their fp32
            copies inside the backward (as a GPU keeps fp16 activations). False saves the fp32
            copies for the whole forward-to-backward span, as plain autograd on the upcast form
            does: the same values and gradients bit for bit, more memory (6 bytes per activation
            element with the ReLU's own fp16 save, against fp32's 4), slightly less Python work
            per op, and double backward (``create_graph=True``) through these ops, which the
            default form refuses.
        batch_chunk: run the fp32 work of 2-D convolutions and linear layers this many samples
            at a time (None: the whole batch at once), so that fp32 buffers exist for a chunk
            only (:class:`_BatchChunked`); with ``save_low_precision`` only.
    """
    if batch_chunk is not None and (
        isinstance(batch_chunk, bool) or not isinstance(batch_chunk, int) or batch_chunk < 1
    ):
        raise ValueError(f"batch_chunk must be a positive integer or None; got {batch_chunk!r}")
    with _Fp32AccumulateMode(save_low_precision, batch_chunk):
        yield
