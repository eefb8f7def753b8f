"""hAdam's unbiased step as one op whose kernels ``torch.compile`` generates (``HAdam(compiled=True)``).

The eager unbiased step (``hadam.py``) runs each element's float32 arithmetic as a chain of
whole-bucket ops -- the lerp, the hypot, the bias corrections, two stochastic roundings whose hash
alone is ~25 integer ops, the Kahan update, the blends of a sync-free step -- plus the gathers that
spread each parameter's bias corrections and rounding keys over its elements: 145-187 aten ops a
step, each a pass over memory and, on a GPU, a kernel launch. Here one function does it all, and
inductor fuses it. For a bucket whose parameter ``k`` has taken ``t_k`` steps, element ``i``::

    s32 = hypot((1-β1)|g|, sqrt(β2)·s)                    (float32; g := 0 where not finite)
    take = no skip flag and max(s32) <= the dtype's max     (one reduction over the bucket)
    t_k <- t_k + take
    m32 = lerp(m, g, 1-β1)
    u32 = step_k · m32 / (s32 / c_k + ε)      c_k = sqrt(1 - β2^t_k)
                                              step_k = -lr·(1-β1) / (sqrt(1-β2)·(1 - β1^t_k))
    m <- RN(m32), or SR(m32; key"_k, i)     s <- SR(s32; key_k, i)
    p <- SR(p + u32; key'_k, i), or Kahan: y = u32 - c, p <- RN(p + y), c <- RN((p_new - p) - y)
    every write blended with ``take`` (a skipped step changes nothing)

where ``k`` comes from a ``bucketize`` of the element's position against the bucket's layout,
``i`` is the element's index in its parameter's logical (NCHW) order, computed from the
parameter's shape (a channels-last weight is read in NHWC order), and ``c_k``, ``step_k`` and the
keys come from the step counts in float64, as in ``HAdam._bucket_streams``: the same
stochastic-rounding streams as the eager step.

The function is registered as a torch operator, ``pixelsac_lowp::hadam_step``, so a profiler and
a dispatch count see one named op a step; :func:`kernels_per_call` says how many kernels inductor
generated for it. Learning rate and betas enter as a tensor (:func:`hyperparameters`) and sizes as
symbols, so the optimizers of a run share a handful of graphs.

**Not bit for bit the eager step.** ATen's vectorised CPU ``lerp`` evaluates ``m + w·(g - m)``
with a fused multiply-add; the generated code rounds the product first. The float32 first moment
then differs by an ulp now and then, and with it, rarely, a rounded state element (measured on
200,000 random elements: 4 first moments, 1 weight and 26 Kahan buffers differ by one fp16 ulp).
Neither is nearer to float64: tests/test_lowp_fused.py holds the compiled step to float64 Adam as
the eager one is held, and to the eager step within one ulp in at most 1 in 500 elements.

**The fp16 roundings are kept.** Inside one kernel inductor keeps values in float32 and by default
drops a round trip such as ``x.to(fp16).float()``. Kahan's compensation is exactly that round trip
(``c = RN(p_new) - p - y``): without it ``c`` is 0 whatever the update, and the Kahan-gradients
modification is silently off (measured: 198,878 of 200,000 buffers differ). The step is compiled
with inductor's ``emulate_precision_casts``, which rounds at every cast.

**Cost.** Compiling takes seconds, at the first step of each form (Kahan or not, a skip flag or
not, dtype). On a CPU the compiled step is slower than the eager one: the per-parameter values an
element reads through its index keep inductor's CPU loops from vectorising (one thread, 3.1M fp16
parameters: ~62 ms eager, ~125-135 ms compiled; without the gathers the same loop took ~21 ms).
A form with a loop per parameter vectorised (~40 ms), but unrolling DrQ's 24 critic tensors
took minutes to compile; it was left out. On a GPU, where a small table sits in cache, the
gathers should cost little; that is not measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .rounding import as_int32, mix_key, stochastic_round

__all__ = ["hyperparameters", "kernels_per_call", "layout_table", "step"]

#: inductor options of both functions: round at every cast (module docstring)
COMPILE_OPTIONS = {"emulate_precision_casts": True}

_kernels: dict[str, int] = {}  # generated kernels of the last compile of each function


def layout_table(params: list[torch.Tensor], reads_channels_last: list[bool], device: torch.device) -> torch.Tensor:
    """int32 ``[n, 5]``, a row per parameter of a bucket: its first and last-plus-one position in
    the joined bucket, and ``C, H, W`` of a channels-last weight read in NHWC order (1, 1, 1 for
    anything read in logical order), so that an element's logical index follows from its
    position alone."""
    rows, start = [], 0
    for param, channels_last in zip(params, reads_channels_last):
        c, h, w = (param.shape[1], param.shape[2], param.shape[3]) if channels_last else (1, 1, 1)
        rows.append([start, start + param.numel(), int(c), int(h), int(w)])
        start += param.numel()
    if start >= 1 << 31:
        raise ValueError(f"HAdam(compiled=True): a bucket of {start:,} elements needs 64-bit positions")
    return torch.tensor(rows, dtype=torch.int32, device=device)


def hyperparameters(lr: float, beta1: float, beta2: float, device: torch.device) -> torch.Tensor:
    """float64 ``[1-β1, sqrt(β2), β1, β2, -lr·(1-β1)/sqrt(1-β2)]``, each the Python double the eager
    step computes; handed to the step as a tensor so that one compiled graph serves every
    optimizer (numbers would be compiled in as constants, a graph per learning rate)."""
    values = [1.0 - beta1, math.sqrt(beta2), beta1, beta2, -lr * (1.0 - beta1) / math.sqrt(1.0 - beta2)]
    return torch.tensor(values, dtype=torch.float64, device=device)


class _Decision(NamedTuple):
    """What a step decides for the whole bucket before any element is written."""

    grad32: torch.Tensor  # float32 gradients (non-finite -> 0 where a skip flag is given)
    root32: torch.Tensor  # the new root moments, float32
    overflow: torch.Tensor  # 0-dim bool: a new root moment overflowed the dtype
    take: torch.Tensor  # 0-dim bool: the step is applied
    counts_after: torch.Tensor  # step counts after this step (unchanged where skipped)
    root_corrections: torch.Tensor  # per parameter, float32: sqrt(1 - β2^t)
    step_sizes: torch.Tensor  # per parameter, float32: -lr·(1-β1) / (sqrt(1-β2)·(1 - β1^t))
    keys: torch.Tensor  # per parameter, int32: the root moment's rounding key
    param_keys: torch.Tensor  # per parameter, int32: the weights' rounding key
    avg_keys: torch.Tensor  # per parameter, int32: the first moment's rounding key (stochastic m)
    one_minus_beta1: torch.Tensor  # 0-dim float32


def _decide(grad, exp_avg_root, counts, found_inf, stream_starts, hyper) -> _Decision:
    # the eager step's Python numbers: a float32 operand rounds them to float32 (the first two);
    # the bias corrections use them in float64 (the rest)
    one_minus_beta1, root_beta2 = hyper[0].float(), hyper[1].float()
    beta1, beta2, step_factor = hyper[2], hyper[3], hyper[4]
    grad32 = grad.float()
    if found_inf is not None:  # a skipped step's gradients may hold inf/NaN; 0 keeps the unused state finite
        grad32 = grad32.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    root32 = torch.hypot(grad32.abs() * one_minus_beta1, exp_avg_root.float() * root_beta2)
    # the step is taken unless a gradient (found_inf) or a new root moment overflowed; root32 >= 0,
    # so amax is the test, and a NaN propagates into it and counts as an overflow
    overflow = ~(root32.amax() <= torch.finfo(exp_avg_root.dtype).max)
    take = ~overflow if found_inf is None else (found_inf == 0) & ~overflow
    counts_after = counts + take.to(torch.float32)
    # per parameter: bias corrections (float64, then float32) and rounding keys, as HAdam._bucket_streams
    counted = counts_after.clamp_min(1.0).to(torch.float64)  # t >= 1: a skipped first step must not divide by 0
    keys = mix_key(counts_after, start=stream_starts)
    return _Decision(
        grad32=grad32,
        root32=root32,
        overflow=overflow,
        take=take,
        counts_after=counts_after,
        root_corrections=(1.0 - torch.pow(beta2, counted)).sqrt().to(torch.float32),
        step_sizes=(step_factor / (1.0 - torch.pow(beta1, counted))).to(torch.float32),
        keys=as_int32(keys),
        param_keys=as_int32(mix_key(keys, 1)),
        avg_keys=as_int32(mix_key(keys, 2)),
        one_minus_beta1=one_minus_beta1,
    )


def _logical_index(within, channels, height, width):
    """An element's index in NCHW order from its position ``((n·H + h)·W + w)·C + c`` in NHWC
    memory (``C = H = W = 1``: the position itself)."""
    c, rest = within % channels, within // channels
    w, rest = rest % width, rest // width
    h, n = rest % height, rest // height
    return ((n * channels + c) * height + h) * width + w


def _elements(
    decision: _Decision, exp_avg, param, kahan_comp, root_correction, step_size, key, param_key, avg_key, counter, eps
):
    """Each element's step (module docstring): new ``m``, ``s``, weight and Kahan buffer (None
    without one), not yet blended with the skip decision. ``avg_key``: None rounds ``m`` to
    nearest, else its stochastic-rounding key."""
    dtype, root32 = param.dtype, decision.root32
    avg32 = exp_avg.float().lerp(decision.grad32, decision.one_minus_beta1)
    denom32 = (root32 / root_correction + eps).clamp_min(torch.finfo(torch.float32).tiny)
    update32 = avg32 / denom32 * step_size
    new_root = stochastic_round(root32, dtype, key, counter=counter)
    param32 = param.float()
    if kahan_comp is not None:
        update32 = update32 - kahan_comp.float()
        new_param = (param32 + update32).to(dtype)
        new_comp = (new_param.float() - param32 - update32).to(dtype)
    else:
        new_param = stochastic_round(param32 + update32, dtype, param_key, counter=counter)
        new_comp = None
    new_avg = avg32.to(dtype) if avg_key is None else stochastic_round(avg32, dtype, avg_key, counter=counter)
    return new_avg, new_root, new_param, new_comp


def _write(
    decision: _Decision, exp_avg, exp_avg_root, param, kahan_comp, counts, eps, backoff,
    new_avg, new_root, new_param, new_comp,
):  # fmt: skip
    take = decision.take
    if kahan_comp is not None:
        kahan_comp.copy_(torch.where(take, new_comp, kahan_comp))
    param.copy_(torch.where(take, new_param, param))
    if backoff is None:
        exp_avg.copy_(torch.where(take, new_avg, exp_avg))
        exp_avg_root.copy_(torch.where(take, new_root, exp_avg_root))
    else:  # a skipped step moves the state into the units of the backed-off scale: the scaler's rescale
        factor = torch.where(take, torch.ones_like(backoff[0]), backoff[0])
        dtype = exp_avg.dtype
        exp_avg.copy_(torch.where(take, new_avg, (exp_avg.float() * factor).to(dtype)))
        exp_avg_root.copy_(torch.where(take, new_root, (exp_avg_root.float() * factor).to(dtype)))
        eps.copy_(torch.clamp_min(eps * factor, backoff[1]))
    counts.copy_(decision.counts_after)
    return decision.overflow


def _step(
    grad, exp_avg, exp_avg_root, param, kahan_comp, counts, found_inf, stream_starts, layout, eps, hyper, backoff,
    stochastic_avg,
) -> torch.Tensor:  # fmt: skip
    """The step in one pass over the bucket: each element finds its parameter (a ``bucketize`` of
    its position against ``layout``) and reads that parameter's values through it -- cheap on a
    GPU, where the table sits in cache; inductor's CPU loops do not vectorise such gathers
    (module docstring, "Cost")."""
    decision = _decide(grad, exp_avg_root, counts, found_inf, stream_starts, hyper)
    position = torch.arange(param.numel(), dtype=torch.int32, device=param.device)
    owner = torch.bucketize(position, layout[:, 1].contiguous(), out_int32=True, right=True)
    rows = layout.index_select(0, owner)
    counter = _logical_index(position - rows[:, 0], rows[:, 2], rows[:, 3], rows[:, 4])
    new = _elements(
        decision, exp_avg, param, kahan_comp, decision.root_corrections[owner], decision.step_sizes[owner],
        decision.keys[owner], decision.param_keys[owner], decision.avg_keys[owner] if stochastic_avg else None,
        counter, eps,
    )  # fmt: skip
    return _write(decision, exp_avg, exp_avg_root, param, kahan_comp, counts, eps, backoff, *new)


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
