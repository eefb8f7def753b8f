"""hAdam's float32 step (``HAdam(unbiased_moments=True)``): one arithmetic, run eagerly or compiled.

Unbiased moments (``unbiased_moments=True``; beyond the paper). Held against float64 Adam, the
published arithmetic (``hadam.py``) runs biased in 16 bits: every op is rounded to the parameter dtype, the decay
``sqrt(β2)·s`` loses a whole ulp per step while the hypot's growth factor ``sqrt(1 + r²)`` is
quantised to steps of 2^-11, so over thousands of steps at β2 = 0.999 ``s`` settles 25-35% low in
fp16 (Adam steps 1.3-1.55x too large) and, in bf16, can stall high after a large gradient. With
the switch on, each element's step is computed in float32 from the 16-bit state -- what a fused
GPU optimizer does in registers -- and written back once::

    m32 = lerp(m, g, 1-β1)                 s32 = hypot((1-β1)|g|, sqrt(β2)·s)      (float32)
    u32 = -step · m32 / (s32 / sqrt(1 - β2**t) + ε)                               (float32)
    m <- RN(m32), or SR(m32) with stochastic_first_moment     s <- SR(s32)
    p <- SR(p + u32), or with Kahan-gradients:  y = u32 - c,  p <- RN(p + y),  c <- RN((p_new - p) - y)

RN rounds to nearest. Where ``m`` is normal it changes by ~10% per step, far above an ulp, and
RN is unbiased that way; but an fp16 ``m`` of 1-4 subnormal steps (2^-24 each) has
``RN(β1·m) = m``: it cannot decay and keeps stepping its weight the same way for as long as the
gradient stays small, where float64's ``m`` dies away. In DrQ's full-size critic at a loss scale
of 78 a quarter of the first moments sat there and carried most of the step's error against
float64 Adam. ``stochastic_first_moment=True`` writes ``m`` with SR too (a third
stream), unbiased at the price of an ulp of noise.
SR is the deterministic stochastic rounding of ``rounding.py`` (subnormals included), so ``E[s] = s32`` and the
quantisation bias of the decay averages out (measured: median s/s_float64 1.000 in fp16 and bf16
after 5,000 steps, against 0.73 and 0.85-2.3 published). A parameter without a Kahan buffer (the
actor, as the paper runs it) is written with SR as well: in bf16 an lr-1e-3 step is below half
an ulp of a weight of 0.25, and from DrQ's actor initialisation round-to-nearest kept only 30%
of float64's displacement over 3,000 steps (SR: 1.00, Kahan: 1.00). The random bits are a hash
of (``seed``, the parameter's index, ``t``, the element's index in logical NCHW order, whatever
the memory format), so a run is deterministic per seed, the same in either memory format, and
resumes bitwise with no generator state; a skipped step retried at the same ``t`` draws the same
bits. It costs no memory: no extra state, and float32 temporaries for at most ``chunk_numel``
elements at a time.

The step, for a bucket (the parameters of one device and dtype) whose parameter ``k`` has taken
``t_k`` steps, element ``i`` -- :func:`roots` and :func:`overflowed` decide, :func:`streams` and
:func:`spread` give each element its parameter's values, :func:`elements` computes, :func:`write`
writes::

    s32 = hypot((1-β1)|g|, sqrt(β2)·s)                    (float32; g := 0 where not finite)
    taken = no skip flag and max(s32) <= the dtype's max     (one reduction over the bucket)
    t_k <- t_k + taken
    m32 = lerp(m, g, 1-β1)
    u32 = step_k · m32 / (s32 / c_k + ε)      c_k = sqrt(1 - β2^t_k)
                                              step_k = -lr·(1-β1) / (sqrt(1-β2)·(1 - β1^t_k))
    m <- RN(m32), or SR(m32; key"_k, i)     s <- SR(s32; key_k, i)
    p <- SR(p + u32; key'_k, i), or Kahan: y = u32 - c, p <- RN(p + y), c <- RN((p_new - p) - y)
    every write blended with ``taken`` (a skipped step changes nothing)

where ``i`` is the element's index in its parameter's logical (NCHW) order (a channels-last
weight is read in NHWC order) and ``c_k``, ``step_k`` and the keys come from the step counts in
float64. Eagerly (:class:`Float32Step`) the bucket goes a cache-sized chunk at a time, a chunk
inside one parameter reading its values as scalars; compiled (:func:`step`, ``HAdam(compiled=True)``)
the whole step is one function, each element finding ``k`` by a ``bucketize`` of its position
against the bucket's layout, and inductor fuses it into a few kernels.

The function is registered as a torch operator, ``pixelsac_lowp::hadam_step``, so a profiler and
a dispatch count see one named op a step; :func:`kernels_per_call` says how many kernels inductor
generated for it. Learning rate and betas enter as a tensor (:func:`hyperparameters`) and sizes as
symbols, so the optimizers of a run share a handful of graphs.

**Compiled, the same code is not bit for bit the eager step.** ATen's vectorised CPU ``lerp``
evaluates ``m + w·(g - m)`` with a fused multiply-add; the generated code rounds the product
first. The float32 first moment then differs by an ulp now and then, and with it, rarely, a
rounded state element (measured on 200,000 random elements: 4 first moments, 1 weight and 26
Kahan buffers differ by one fp16 ulp).
Neither is nearer to float64: tests/test_lowp_fused.py holds the compiled step to float64 Adam as
the eager one is held, and to the eager step within one ulp in at most 1 in 500 elements.

**The fp16 roundings are kept.** Inside one kernel inductor keeps values in float32 and by default
drops a round trip such as ``x.to(fp16).float()``. Kahan's compensation is exactly that round trip
(``c = RN(p_new) - p - y``): without it ``c`` is 0 whatever the update, and the Kahan-gradients
modification is silently off (measured: 198,878 of 200,000 buffers differ). The step is compiled
with inductor's ``emulate_precision_casts``, which rounds at every cast.

**Cost.** Compiling takes seconds, at the first step of each form (Kahan or not, a skip flag or
not, dtype). On a CPU the compiled step is slower than the eager one: the per-parameter values an
element reads through its index keep inductor's CPU loops from vectorising (measurements:
docs/performance.md, "hAdam compiled"). On a GPU, where a small table sits in cache, the gathers
should cost little.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .layout import flat_view, reads_channels_last, segment_views
from .rounding import as_int32, mix_key, stochastic_round

__all__ = ["hyperparameters", "kernels_per_call", "layout_table", "step"]

#: inductor options of both functions: round at every cast (module docstring)
COMPILE_OPTIONS = {"emulate_precision_casts": True}

_kernels: dict[str, int] = {}  # generated kernels of the last compile of each function


def layout_table(params: list[torch.Tensor], reads_channels_last: list[bool], device: torch.device) -> torch.Tensor:
    """int32 ``[5, n]``, a column per parameter of a bucket: its first and last-plus-one position
    in the joined bucket, and ``C, H, W`` of a channels-last weight read in NHWC order (1, 1, 1
    for anything read in logical order), so that an element's logical index follows from its
    position alone."""
    columns, start = [], 0
    for param, channels_last in zip(params, reads_channels_last):
        c, h, w = (param.shape[1], param.shape[2], param.shape[3]) if channels_last else (1, 1, 1)
        columns.append([start, start + param.numel(), int(c), int(h), int(w)])
        start += param.numel()
    if start >= 1 << 31:
        raise ValueError(f"HAdam: a bucket of {start:,} elements needs 64-bit positions")
    return torch.tensor(columns, dtype=torch.int32, device=device).t().contiguous()


def hyperparameters(lr: float, beta1: float, beta2: float, device: torch.device) -> torch.Tensor:
    """float64 ``[1-β1, sqrt(β2), β1, β2, -lr·(1-β1)/sqrt(1-β2)]``, each the Python double the eager
    step computes; handed to the step as a tensor so that one compiled graph serves every
    optimizer (numbers would be compiled in as constants, a graph per learning rate)."""
    values = [1.0 - beta1, math.sqrt(beta2), beta1, beta2, -lr * (1.0 - beta1) / math.sqrt(1.0 - beta2)]
    return torch.tensor(values, dtype=torch.float64, device=device)


def logical_order(key: tuple, device: torch.device) -> torch.Tensor:
    """The logical (NCHW) index of each element of a channels-last weight of shape ``key[1]``, in
    its memory (NHWC) order (int32): what the eager step copies instead of :func:`_logical_index`."""
    shape = key[1]
    return torch.arange(math.prod(shape), dtype=torch.int32, device=device).view(shape).permute(0, 2, 3, 1).reshape(-1)


class Streams(NamedTuple):
    """Per parameter of a bucket, from its step count ``t`` after this step (float64 math, rounded
    once): the bias corrections and the stochastic-rounding keys (int32) of ``s``, ``p`` and ``m``."""

    root_corrections: torch.Tensor  # float32 sqrt(1 - β2^t)
    step_sizes: torch.Tensor  # float32 -lr·(1-β1) / (sqrt(1-β2)·(1 - β1^t))
    keys: torch.Tensor  # [k, n], a row per stochastically rounded tensor: s; p unless Kahan; m if stochastic


def roots(grad, exp_avg_root, one_minus_beta1, root_beta2, sanitize: bool):
    """float32 ``g`` (non-finite -> 0 with ``sanitize``: a skipped step's gradients may hold
    inf/NaN, and 0 keeps the unused new state finite) and the new ``s = hypot((1-β1)|g|, sqrt(β2)·s)``."""
    grad32 = grad.float()
    if sanitize:
        grad32 = grad32.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return grad32, torch.hypot(grad32.abs().mul_(one_minus_beta1), exp_avg_root.float().mul_(root_beta2))


def overflowed(root32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0-dim bool: a new root moment does not fit ``dtype`` (``root32 >= 0``, so the largest decides;
    a NaN propagates into it and counts too)."""
    return ~(root32.amax() <= torch.finfo(dtype).max)


def streams(counts_after, stream_starts, beta1, beta2, step_factor, kahan: bool, stochastic_avg: bool) -> Streams:
    """:class:`Streams` from a float32 vector of step counts ``t`` (``t >= 1`` in the corrections:
    a skipped first step must not divide by 0); ``stream_starts``: ``mix_key(seed, index)`` per
    parameter; ``step_factor``: ``-lr·(1-β1)/sqrt(1-β2)``."""
    counted = counts_after.clamp_min(1.0).to(torch.float64)
    keys = mix_key(counts_after, start=stream_starts)
    rows = [keys] + ([] if kahan else [mix_key(keys, 1)]) + ([mix_key(keys, 2)] if stochastic_avg else [])
    return Streams(
        root_corrections=(1.0 - torch.pow(beta2, counted)).sqrt().to(torch.float32),
        step_sizes=(step_factor / (1.0 - torch.pow(beta1, counted))).to(torch.float32),
        keys=as_int32(torch.stack(rows)),
    )


def _logical_index(within, channels, height, width):
    """An element's index in NCHW order from its position ``((n·H + h)·W + w)·C + c`` in NHWC
    memory (``C = H = W = 1``: the position itself)."""
    c, rest = within % channels, within // channels
    w, rest = rest % width, rest // width
    h, n = rest % height, rest // height
    return ((n * channels + c) * height + h) * width + w


def spread(
    bucket_streams: Streams,
    layout: torch.Tensor,
    start: int,
    numel: int,
    owner: tuple[int, int] | None = None,
    orders: list[tuple[int, torch.Tensor]] | None = None,
    owners: torch.Tensor | None = None,
):
    """Each element's values for the ``numel`` elements of a bucket from position ``start``:
    ``(root_correction, step_size, keys, counter)`` (keys: a list, one per stream), the counter being the
    element's index in its parameter's logical (NCHW) order. ``owner``: ``(index, first
    position)`` of the one parameter these elements belong to, when the caller knows it and it is
    read in logical order -- its values then broadcast (0-dim) and the counter is a range; else
    each element finds its parameter (a ``bucketize`` of its position against ``layout``) and
    gathers through it; the counter then comes from the parameter's shape, or, given ``orders``
    (``(offset in these elements, logical indices)`` per channels-last piece), is copied from
    there (a few small copies eagerly instead of a dozen integer ops over every element)."""
    if owner is not None:
        index, first = owner
        counter = torch.arange(start - first, start - first + numel, dtype=torch.int32, device=layout.device)
        rc, ss, keys = bucket_streams
        rc, ss = (v if v.dim() == 0 else v[index] for v in (rc, ss))  # (0-dim: shared by every parameter)
        return rc, ss, [row[index] for row in keys], counter
    position = torch.arange(start, start + numel, dtype=torch.int32, device=layout.device)
    if owners is None:  # (eagerly the caller repeats each parameter's index over its elements: cheaper)
        owners = torch.bucketize(position, layout[1], out_int32=True, right=True)
    within = position - layout[0].index_select(0, owners)  # (1-D gathers: the fast ones on a CPU)
    if orders is None:
        counter = _logical_index(within, *(layout[row].index_select(0, owners) for row in (2, 3, 4)))
    else:
        counter = within
        for offset, order in orders:
            counter[offset : offset + order.numel()].copy_(order)
    rc, ss, keys = bucket_streams
    rc, ss = (v if v.dim() == 0 else v.index_select(0, owners) for v in (rc, ss))
    return rc, ss, [row.index_select(0, owners) for row in keys], counter


def elements(
    grad32, root32, exp_avg, param, kahan_comp, one_minus_beta1, eps,
    root_correction, step_size, keys, counter, stochastic_avg: bool, paired: bool,
):  # fmt: skip
    """Each element's step (module docstring) from float32 ``g`` and new ``s``: the new ``m``, ``s``,
    weight and Kahan buffer (None without one), rounded, not yet written. ``paired``: the
    stochastically rounded tensors through one call, a row each (the bits of a call each, fewer
    ops: what a GPU pays for; a CPU is faster one by one)."""
    dtype = param.dtype
    avg32 = exp_avg.float().lerp_(grad32, one_minus_beta1)
    denom32 = (root32 / root_correction).add_(eps).clamp_min_(torch.finfo(torch.float32).tiny)
    update32 = avg32.div(denom32).mul_(step_size)
    param32 = param.float()
    rows = [root32]
    if kahan_comp is not None:  # y = u - c, p <- RN(p + y), c <- RN((p_new - p) - y)
        update32 = update32.sub_(kahan_comp.float())
        new_param = (param32 + update32).to(dtype)
        new_comp = new_param.float().sub_(param32).sub_(update32).to(dtype)
    else:  # no compensation buffer: round stochastically, so sub-ulp steps add up on average
        rows.append(param32.add_(update32))
        new_param = new_comp = None
    rows += [avg32] if stochastic_avg else []
    if paired and len(rows) > 1:
        keys = torch.stack(keys)
        keys = keys if keys.dim() == 2 else keys.view(-1, 1)  # (rows, elements) or (rows, 1)
        rounded = stochastic_round(torch.stack(rows), dtype, keys, counter=counter)
    else:
        rounded = [stochastic_round(row, dtype, key, counter=counter) for row, key in zip(rows, keys)]
    new_root = rounded[0]
    new_param = rounded[1] if new_param is None else new_param
    new_avg = rounded[-1] if stochastic_avg else avg32.to(dtype)
    return new_avg, new_root, new_param, new_comp


def write(taken: torch.Tensor | None, pairs) -> None:
    """``target <- value`` for each ``(target, value)`` (a None value: no such state), only where
    the 0-dim bool ``taken`` holds (None: always)."""
    for target, value in pairs:
        if value is not None:
            target.copy_(value if taken is None else torch.where(taken, value, target))


def _step(
    grad, exp_avg, exp_avg_root, param, kahan_comp, counts, found_inf, stream_starts, layout, eps, hyper, backoff,
    stochastic_avg,
) -> torch.Tensor:  # fmt: skip
    """The whole step of a bucket in one function, as ``torch.compile`` fuses it: decide (the new
    root moments, whether the step is taken, the counts and streams), elements, write."""
    # the eager step's Python numbers: a float32 operand rounds them to float32 (the first two);
    # the bias corrections use them in float64 (the rest)
    one_minus_beta1, root_beta2 = hyper[0].float(), hyper[1].float()
    grad32, root32 = roots(grad, exp_avg_root, one_minus_beta1, root_beta2, found_inf is not None)
    overflow = overflowed(root32, param.dtype)
    taken = ~overflow if found_inf is None else (found_inf == 0) & ~overflow
    counts_after = counts + taken.to(torch.float32)
    kahan = kahan_comp is not None
    per_param = streams(counts_after, stream_starts, hyper[2], hyper[3], hyper[4], kahan, stochastic_avg)
    per_element = spread(per_param, layout, 0, param.numel())
    new_avg, new_root, new_param, new_comp = elements(
        grad32, root32, exp_avg, param, kahan_comp, one_minus_beta1, eps, *per_element, stochastic_avg, paired=False
    )
    write(taken, [(kahan_comp, new_comp), (param, new_param)])
    if backoff is None:
        write(taken, [(exp_avg, new_avg), (exp_avg_root, new_root)])
    else:  # a skipped step moves the state into the units of the backed-off scale: the scaler's rescale
        factor = torch.where(taken, torch.ones_like(backoff[0]), backoff[0])
        dtype = param.dtype
        exp_avg.copy_(torch.where(taken, new_avg, (exp_avg.float() * factor).to(dtype)))
        exp_avg_root.copy_(torch.where(taken, new_root, (exp_avg_root.float() * factor).to(dtype)))
        eps.copy_(torch.clamp_min(eps * factor, backoff[1]))
    counts.copy_(counts_after)
    return overflow


_compiled: dict[str, Any] = {}


def compile_once(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` compiled at its first use and kept (importing inductor costs seconds, so not
    at import): the whole graph, symbolic sizes (the optimizers, scalers and targets of a run
    share its graphs), ``COMPILE_OPTIONS`` (fp16 roundings kept). Every compiled op of
    ``pixelsac.lowp`` is made here; clearing ``_compiled`` compiles them anew."""
    key = f"{function.__module__}.{function.__qualname__}"
    if key not in _compiled:
        _compiled[key] = torch.compile(function, fullgraph=True, dynamic=True, options=COMPILE_OPTIONS)
    return _compiled[key]


@torch.library.custom_op(
    "pixelsac_lowp::hadam_step", mutates_args=("exp_avg", "exp_avg_root", "param", "kahan_comp", "counts", "eps")
)  # fmt: skip
def step(
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_root: torch.Tensor,
    param: torch.Tensor,
    kahan_comp: torch.Tensor | None,
    counts: torch.Tensor,
    found_inf: torch.Tensor | None,
    stream_starts: torch.Tensor,
    layout: torch.Tensor,
    eps: torch.Tensor,
    hyper: torch.Tensor,
    backoff: torch.Tensor | None,
    stochastic_avg: bool = False,
) -> torch.Tensor:
    """One unbiased hAdam step of a whole bucket (module docstring), on 1-D tensors in the
    parameters' memory order: the joined gradient, and the bucket's flat parameters and state.

    ``param``, ``exp_avg``, ``exp_avg_root``, ``kahan_comp`` (None: stochastically rounded
    weights) and ``counts`` (float32 step count per parameter) are updated in place, each only if
    the step is taken; ``found_inf``: 0-dim, nonzero skips the step (its non-finite gradients
    count as 0); ``stream_starts``: int64 ``mix_key(seed, index)`` per parameter; ``layout``:
    :func:`layout_table`; ``eps``: 0-dim float32; ``hyper``: :func:`hyperparameters`.

    ``backoff``: None, or float32 ``[f, floor]``, a compound loss scaler's backoff factor and ε
    floor: then the step also does what the scaler's rescale after it would (``rescale_state_``
    by ``f`` if skipped, else 1) -- a skipped step multiplies ``exp_avg`` and ``exp_avg_root`` by
    ``f`` (in float32, rounded once), and every step sets ``ε <- max(ε·f, floor)`` (``f`` = 1 if
    taken) -- in the same pass, instead of another pass over the moments every step.

    ``stochastic_avg``: write ``m`` stochastically rounded (its own stream), not rounded to nearest.

    Returns the 0-dim bool "a new root moment overflowed"."""
    from torch._inductor import metrics  # (torch.compile's first call imports inductor anyway)

    before = metrics.generated_kernel_count
    # a handful of graphs a run (Kahan or not, a skip flag or not, a backoff or not, dtype, one
    # element or more), but a process that builds many agents (a benchmark, the tests) may ask
    # for more than dynamo's default limit of 8
    with torch._dynamo.config.patch(recompile_limit=64):
        overflow = compile_once(_step)(
            grad, exp_avg, exp_avg_root, param, kahan_comp, counts, found_inf, stream_starts, layout, eps, hyper,
            backoff, stochastic_avg,
        )  # fmt: skip
    if metrics.generated_kernel_count != before:  # compiled now: note this form's kernels
        _kernels["step"] = metrics.generated_kernel_count - before
    return overflow


@step.register_fake
def _(grad, exp_avg, exp_avg_root, param, *rest):
    return torch.empty((), dtype=torch.bool, device=param.device)


def kernels_per_call() -> dict[str, int]:
    """Kernels inductor generated for each function at its last compile (CPU loops or GPU
    kernels; empty before the first call)."""
    return dict(_kernels)


LOW = (torch.float16, torch.bfloat16)  # the dtypes the float32 step is for


def unbiased(group: dict[str, Any], bucket: dict[str, Any]) -> bool:
    """The float32 step applies to 16-bit parameters; wider ones are exact enough as they are."""
    return bool(group.get("unbiased_moments", False)) and bucket["params"][0].dtype in LOW


def _part(flat: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """``flat[start:end]``, the tensor itself when that is all of it (a slice is an op a GPU pays)."""
    return flat if start == 0 and end == flat.numel() else flat[start:end]


class Float32Step:
    """How :class:`~pixelsac.lowp.HAdam` runs the float32 step on a bucket (one device and
    dtype): its parameters (their ``.data``) and each state tensor live as views in one flat
    buffer per name (:meth:`_flat_state`), which the step reads and writes whole or in slices.
    Eager (:meth:`_fp32_overflows`, then :meth:`_fp32_apply` once the optimizer has decided), a
    chunk of ``chunk_numel`` elements at a time; compiled (:meth:`_fused_step`), the bucket as one
    :func:`step`. Expects the optimizer's ``seed``, ``chunk_numel``, ``_layout_constants``,
    ``_flat_states`` and ``_flat_param_buffers``."""

    # ------------------------------------------------------------------ float32 step, eager
    def _fp32_overflows(self, group: dict[str, Any], bucket: dict[str, Any]) -> torch.Tensor:
        """Decide, a chunk at a time: would a new root moment overflow? (With one chunk its
        float32 ``g`` and ``s`` are kept for :meth:`_fp32_apply`.)"""
        beta1, beta2 = group["betas"]
        params = bucket["params"]
        flat = self._flat_state(bucket, group.get("capturable", False))
        grads = [flat_view(grad, like=param) for grad, param in zip(bucket["grads"], params)]
        bounds = [0, *itertools.accumulate(param.numel() for param in params)]
        limit = self.chunk_numel or max(1, bounds[-1])
        chunks: list[tuple[int, int, int, int]] = []  # (start, end, first, last parameter + 1)
        for index in range(len(params)):  # parameters packed whole, a larger one split
            for start in range(bounds[index], bounds[index + 1], limit):
                end = min(start + limit, bounds[index + 1])
                if chunks and end - chunks[-1][0] <= limit:
                    chunks[-1] = (chunks[-1][0], end, chunks[-1][2], index + 1)
                else:
                    chunks.append((start, end, index, index + 1))
        flags, kept = [], None
        for start, end, first, last in chunks:
            kept = self._roots(group, bucket, flat, grads, bounds, (start, end, first, last))
            flags.append(overflowed(kept[1], params[0].dtype))
        bucket["fp32"] = (flat, grads, bounds, chunks, kept if len(chunks) == 1 else None)
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()

    @staticmethod
    def _roots(group, bucket, flat, grads, bounds, chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's float32 ``g`` and new ``s`` (:func:`roots`)."""
        beta1, beta2 = group["betas"]
        start, end, first, last = chunk
        pieces = [
            _part(grads[i], max(start, bounds[i]) - bounds[i], min(end, bounds[i + 1]) - bounds[i])
            for i in range(first, last)
        ]
        grad = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        root = _part(flat["exp_avg_root"], start, end)
        return roots(grad, root, 1.0 - beta1, math.sqrt(beta2), bucket["sanitize"])

    def _fp32_apply(self, group: dict[str, Any], bucket: dict[str, Any], taken: torch.Tensor | None) -> None:
        """The float32 step's elements and writes (:func:`elements`), a chunk at a time."""
        flat, grads, bounds, chunks, kept = bucket.pop("fp32")
        beta1, beta2 = group["betas"]
        params, states = bucket["params"], bucket["states"]
        device, kahan = params[0].device, "kahan_comp" in flat
        stochastic_avg = bool(group.get("stochastic_first_moment", False))
        eps = group["eps"].to(device) if torch.is_tensor(group["eps"]) else group["eps"]
        taken = None if taken is None else taken.to(device)
        if "step" in flat:  # device counts (already this step's)
            per_param = streams(
                flat["step"], self._constant(device, ("stream", tuple(bucket["indices"])), self._stream_starts),
                beta1, beta2, -group["lr"] * (1.0 - beta1) / math.sqrt(1.0 - beta2), kahan, stochastic_avg,
            )  # fmt: skip
        else:  # host counts: the same values from Python's float64 arithmetic
            steps = [state["step"] for state in states]
            keys = [mix_key(self.seed, index, t) for index, t in zip(bucket["indices"], steps)]

            def vector(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(values, dtype=dtype, device=device)

            rows = [keys] + ([] if kahan else [[mix_key(k, 1) for k in keys]])
            rows += [[mix_key(k, 2) for k in keys]] if stochastic_avg else []
            counts = steps[:1] if len(set(steps)) == 1 else steps  # one count: its values shared (0-dim)
            per_param = Streams(
                vector([math.sqrt(1.0 - beta2**t) for t in counts], torch.float32).squeeze(0),
                vector([-group["lr"] * (1.0 - beta1) / (math.sqrt(1.0 - beta2) * (1.0 - beta1**t)) for t in counts],
                       torch.float32).squeeze(0),
                vector([[as_int32(k) for k in row] for row in rows], torch.int32),
            )  # fmt: skip
        layout = self._layout(params, device)
        for start, end, first, last in chunks:
            grad32, root32 = kept or self._roots(group, bucket, flat, grads, bounds, (start, end, first, last))
            alone = last == first + 1 and not reads_channels_last(params[first])  # values broadcast
            owner = (first, bounds[first]) if alone else None
            orders = [  # (offset in the chunk, logical indices) of each channels-last piece
                (max(bounds[i], start) - start, _part(
                    self._constant(device, ("order", tuple(params[i].shape)), logical_order),
                    max(bounds[i], start) - bounds[i], min(bounds[i + 1], end) - bounds[i],
                ))
                for i in range(first, last) if reads_channels_last(params[i])
            ]  # fmt: skip
            owners = None
            if owner is None:  # each parameter's index repeated over its elements in the chunk
                pieces = tuple(min(bounds[i + 1], end) - max(bounds[i], start) for i in range(first, last))
                owners = torch.repeat_interleave(
                    self._constant(
                        device, ("owners", first, last), lambda key, dev: torch.arange(key[1], key[2], device=dev)
                    ),
                    self._constant(device, ("pieces", pieces), lambda key, dev: torch.tensor(key[1], device=dev)),
                    output_size=end - start,
                )
            per_element = spread(per_param, layout, start, end - start, owner, orders, owners)
            names = ("exp_avg", "exp_avg_root", "param", "kahan_comp")
            parts = {name: _part(flat[name], start, end) for name in names if name in flat}
            new = elements(
                grad32, root32, parts["exp_avg"], parts["param"], parts.get("kahan_comp"), 1.0 - beta1, eps,
                *per_element, stochastic_avg, "step" in flat,  # (paired with device counts)
            )  # fmt: skip
            write(taken, [(parts.get(name), value) for name, value in zip(names, new)])
        # changed in place through the flat buffer: tell autograd, as an in-place op on each would
        torch.autograd.graph.increment_version(params)

    def _stream_starts(self, key: tuple[str, tuple[int, ...]], device: torch.device) -> torch.Tensor:
        """``mix_key(seed, index)`` per parameter: the part of each key that ``t`` does not change."""
        return torch.tensor([mix_key(self.seed, index) for index in key[1]], dtype=torch.int64, device=device)

    def _layout(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """:func:`layout_table` of a bucket, kept."""
        key = ("layout", tuple((tuple(p.shape), reads_channels_last(p)) for p in params))
        return self._constant(device, key, lambda key, dev: layout_table(params, [cl for _, cl in key[1]], dev))

    # ------------------------------------------------------------------ float32 step, compiled
    def _fused(self, work: list[tuple[dict[str, Any], dict[str, Any]]]) -> bool:
        """Does this step take the compiled path? One bucket (one device and dtype: the decision
        to skip is then the bucket's own) with the float32 step."""
        return self.compiled and len(work) == 1 and unbiased(*work[0])

    def _flat_params(self, params: list[torch.Tensor]) -> torch.Tensor:
        """One 1-D buffer holding ``params``, each parameter's ``.data`` a view into it (the
        same objects, the same strides: what modules, autograd and other code hold is unchanged).
        Made when the optimizer is built -- before any memory meter, data-parallel wrapper or
        CUDA graph sees the parameters -- and again at a step that finds a parameter given other
        storage since (``module.to(...)``, a bucket of other parameters): the values copied in."""
        key = tuple(id(param) for param in params)
        cached = self._flat_param_buffers.get(key)
        if cached is not None and all(param.data_ptr() == ptr for param, ptr in zip(params, cached[1])):
            return cached[0]
        flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        for param, part in zip(params, segment_views(flat, params)):
            part.copy_(param.detach())
            param.data = part
        self._flat_param_buffers[key] = (flat, [param.data_ptr() for param in params])
        return flat

    def _flat_state(self, bucket: dict[str, Any], capturable: bool) -> dict[str, torch.Tensor]:
        """The bucket's parameters (:meth:`_flat_params`) and state as one 1-D tensor per name
        (and, with device step counts, one float32 vector of them), each state tensor a view
        into it in the parameter's memory order, so the compiled step reads and writes them
        whole: no ``cat``, no copy back. Made at the first step, and again when a state tensor
        was replaced (``load_state_dict``, a change of memory format): the values are copied in."""
        params, states = bucket["params"], bucket["states"]
        names = ("exp_avg", "exp_avg_root", "kahan_comp")[: 3 if "kahan_comp" in states[0] else 2]
        flat_param = self._flat_params(params)
        key = tuple(id(param) for param in params)
        cached = self._flat_states.get(key)
        if (
            cached is not None
            and all(state[name] is view for name in names for state, view in zip(states, cached["views"][name]))
            and (not capturable or all(state["step"] is view for state, view in zip(states, cached["views"]["step"])))
        ):
            return {**cached["flat"], "param": flat_param}
        flat, views = {}, {}
        for name in names:
            flat[name] = torch.empty_like(flat_param)
            views[name] = segment_views(flat[name], params)
            for part, state in zip(views[name], states):
                part.copy_(state[name])
                state[name] = part
        if capturable:
            flat["step"] = torch.stack([state["step"].to(params[0].device) for state in states])
            views["step"] = []
            for index, state in enumerate(states):
                state["step"] = flat["step"][index]
                views["step"].append(state["step"])
        self._flat_states[key] = {"flat": flat, "views": views}
        return {**flat, "param": flat_param}

    def _fused_step(
        self,
        group: dict[str, Any],
        bucket: dict[str, Any],
        found_inf: torch.Tensor | None,
        backoff: tuple[float, float] | None,
    ) -> torch.Tensor:
        """One step of the bucket as :func:`step`: the gradients joined (one ``cat``),
        parameters and state updated in place in their flat buffers; with ``backoff``, the
        scaler's rescale too (:meth:`step`). Returns the 0-dim bool "a new root moment
        overflowed"; host step counts are the caller's to advance."""
        beta1, beta2 = group["betas"]
        params, states, indices = bucket["params"], bucket["states"], bucket["indices"]
        device = params[0].device
        capturable = group.get("capturable", False)
        flat = self._flat_state(bucket, capturable)
        kahan = "kahan_comp" in flat
        grads = [flat_view(grad, like=param) for grad, param in zip(bucket["grads"], params)]
        grad = grads[0] if len(grads) == 1 else torch.cat(grads)
        if capturable:
            counts = flat["step"]
        else:  # host counts: a vector of this step's counts (the host adds 1 to each if the step is taken)
            counts = torch.tensor([state["step"] for state in states], dtype=torch.float32, device=device)
        eps = group["eps"]
        if backoff is not None and not (torch.is_tensor(eps) and eps.device == device):
            # the step rescales ε in place: the group's own device tensor, as rescale_state_ keeps it
            eps = group["eps"] = torch.tensor(float(eps), dtype=torch.float32, device=device)
        elif torch.is_tensor(eps):
            eps = eps.to(device)
        else:
            eps = self._constant(device, ("eps", float(eps)), lambda key, dev: torch.tensor(key[1], device=dev))
        layout = self._layout(params, device)
        stream_starts = self._constant(device, ("stream", tuple(indices)), self._stream_starts)
        hyper = self._constant(
            device, ("hyper", float(group["lr"]), beta1, beta2), lambda key, dev: hyperparameters(*key[1:], dev)
        )
        if backoff is not None:
            backoff = self._constant(
                device, ("backoff", *map(float, backoff)), lambda key, dev: torch.tensor(key[1:], device=dev)
            )
        overflow = step(
            grad, flat["exp_avg"], flat["exp_avg_root"], flat["param"], flat["kahan_comp"] if kahan else None,
            counts, None if found_inf is None else found_inf.to(device), stream_starts, layout, eps, hyper, backoff,
            bool(group.get("stochastic_first_moment", False)),
        )  # fmt: skip
        # changed in place through the flat buffer: tell autograd, as an in-place op on each would
        torch.autograd.graph.increment_version(params)
        return overflow

    def _constant(
        self, device: torch.device, key: tuple, make: Callable[[Any, torch.device], torch.Tensor]
    ) -> torch.Tensor:
        """A small device tensor that depends only on the bucket layout, built from host values at
        its first use and kept: later steps (and a CUDA graph captured after a warm-up step, as
        capture needs anyway) copy nothing from the host."""
        cache = self._layout_constants
        if (device, key) not in cache:
            cache[(device, key)] = make(key, device)
        return cache[(device, key)]
