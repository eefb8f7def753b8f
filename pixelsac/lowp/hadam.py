"""hAdam: Adam that stores the square root of the second moment (Björck et al., ICML 2021).

Plain Adam keeps ``v = EMA(g²)``. In fp16, ``g²`` underflows to 0 for ``|g| < ~2.4e-4`` and
overflows for ``|g| >= 256``, so ``v`` is useless exactly where training needs it. hAdam keeps
``s ≈ c·sqrt(v)`` with ``c = (1-β1)/sqrt(1-β2) ≈ 3.162`` and updates it with a hypot that never
squares a large number::

    m  <- β1*m + (1-β1)*g
    a  =  (1-β1)*|g|            b = sqrt(β2)*s
    M  =  max(a, b)             N = min(a, b)
    s  <- M * sqrt(1 + (N / (M + ε))**2)          # = hypot(a, b); the ratio is <= 1
    denom = s / sqrt(1 - β2**t) + ε
    step  = lr * (1-β1) / (sqrt(1-β2) * (1 - β1**t))
    p  <- p - step * m / denom                     # or the Kahan update, see kahan.py

``t`` counts the steps actually taken. In exact arithmetic this is Adam with
``ε_adam = ε·sqrt(1-β2)/(1-β1)`` (≈ ε/3.162).

All state lives in the parameter dtype: ``exp_avg`` (m), ``exp_avg_root`` (s) and, with
``kahan=True``, ``kahan_comp`` (the compensation buffer of the parameter update). There is
deliberately no ``exp_avg_sq`` and no fp32 master copy.

Unbiased moments (``unbiased_moments=True``; beyond the paper). Held against float64 Adam, the
arithmetic above runs biased in 16 bits: every op is rounded to the parameter dtype, the decay
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

Overflow of the state is a skipped step, never a silent freeze (both arithmetics). ``s`` can
reach ``(1-β1)/sqrt(1-β2)·|g| ≈ 3.16·|g|`` and, published, the bias-corrected denominator the
same at ``t = 1``: in fp16 both overflow once a (loss-scaled) gradient passes ≈20.7k although the
gradient is finite. An inf ``s`` makes the update exactly 0 and stays inf (halving keeps it), so
the weight would never move again. Here a step whose new ``s`` (or, published, denominator) is
not finite is not applied: ``state_overflow`` is set (a bool, or a 0-dim device tensor in the
sync-free path) and :class:`~pixelsac.lowp.CompoundLossScaler` treats it like an overflowing
gradient -- skip, back off (halving ``S``, ``m``, ``s``), count it. With the switch on the
denominator and update stay in float32 and cannot overflow.

Sync-free steps (``capturable=True``): ``t`` is a 0-dim float32 tensor on the parameter's device
and ``step(found_inf=flag)`` decides on the device whether the step happens. With
``ok = (flag == 0)`` every state tensor is blended as ``x <- lerp(x, x_new, ok)``, which is
bit-exact for both values of ``ok`` (torch evaluates ``lerp(a, b, 1)`` as ``b - (b-a)·0``), so a
skipped step leaves ``p``, ``m``, ``s``, ``c`` and ``t`` exactly as they were, and a taken step
writes exactly the new values. Non-finite gradients are first zeroed in place so that the
unused ``x_new`` stays finite (``0·inf`` would be NaN). Nothing here reads a tensor on the host,
so the step can run ahead of the host or be captured in a CUDA graph: ``ok`` and a device ε enter
foreach ops only through their Tensor and List overloads (``masked.py``; a 0-dim tensor given to
a Scalar overload would be read on the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import Optimizer

from . import fused
from .finite import all_finite, all_finite_many
from .kahan import kahan_add_
from .layout import flat_view, in_layout_of, reads_channels_last, segment_views, state_in_param_layouts_
from .masked import add_scalar_, select_
from .rounding import as_int32, mix_key, stochastic_round

__all__ = ["HAdam"]

_LAYOUT_KEYS = ("exp_avg", "exp_avg_root", "kahan_comp")  # state tensors shaped like the parameter


def _smallest_positive(dtype: torch.dtype) -> float:
    """Smallest positive (subnormal) number of a floating dtype, e.g. 5.96e-8 for fp16."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def _copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies to combine in place with fp32 device scalars (``t``-dependent terms, a tensor ε):
    in place keeps the parameter dtype, where an out-of-place op between a 0-dim fp16 tensor
    (``log_alpha``) and a 0-dim fp32 one would promote to fp32."""
    return torch._foreach_mul(tensors, 1.0)


def _hypot_root(
    grads: list[torch.Tensor],
    exp_avg_roots: list[torch.Tensor],
    beta1: float,
    beta2: float,
    eps: float | torch.Tensor,
    tiny: float,
) -> list[torch.Tensor]:
    """``hypot((1-β1)|g|, sqrt(β2)·s)`` as ``M·sqrt(1 + (N/(M+ε))²)``: nothing large is squared."""
    scaled_grads = torch._foreach_abs(grads)
    torch._foreach_mul_(scaled_grads, 1.0 - beta1)
    decayed_roots = torch._foreach_mul(exp_avg_roots, math.sqrt(beta2))
    larger = torch._foreach_maximum(scaled_grads, decayed_roots)
    smaller = torch._foreach_minimum(scaled_grads, decayed_roots)
    del scaled_grads, decayed_roots
    if torch.is_tensor(eps):  # a device ε (sync-free loss scaling) would promote a 0-dim fp16 sum
        ratio_denom = _copy(larger)
        add_scalar_(ratio_denom, eps)
    else:
        ratio_denom = torch._foreach_add(larger, eps)
    torch._foreach_clamp_min_(ratio_denom, tiny)
    ratio = torch._foreach_div(smaller, ratio_denom)
    del smaller, ratio_denom
    torch._foreach_mul_(ratio, ratio)
    torch._foreach_add_(ratio, 1.0)
    torch._foreach_sqrt_(ratio)
    torch._foreach_mul_(ratio, larger)
    return ratio


def _unbiased(group: dict[str, Any], bucket: dict[str, Any]) -> bool:
    """The float32-math path applies to 16-bit parameters; wider ones are exact enough as they are."""
    return bool(group.get("unbiased_moments", False)) and bucket["params"][0].dtype in (torch.float16, torch.bfloat16)


@dataclass
class _Pack:
    """Consecutive parameter segments ``(position in bucket, first element, length)`` whose
    unbiased step runs as one float32 workspace."""

    kahan: bool
    step: int | None  # the shared step count on the host path (None: device counts)
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    numel: int = 0


class HAdam(Optimizer):
    """Adam with a root second moment updated by hypot; optional Kahan-compensated update.

    Args:
        params: parameters or parameter groups (each group may set ``lr``, ``betas``,
            ``eps``, ``kahan``).
        lr: learning rate.
        betas: ``(β1, β2)``, the decay rates of the first and (root) second moment.
        eps: ``ε``, added to the bias-corrected root moment and inside the hypot ratio.
            1e-8 without loss scaling; 1e-4 with compound loss scaling, where ε is in
            "×S" units like the gradients.
        kahan: apply the update ``p <- p + u`` with Kahan summation (state ``kahan_comp``).
            The paper enables it for the critic and ``log_alpha``, not for the actor.
        capturable: keep ``step`` (and, once rescaled by a tensor, ``eps``) as device tensors
            and accept ``step(found_inf=...)``: no host synchronisation anywhere in a step.
        unbiased_moments: float32 step math with one rounding per state tensor and a
            stochastically rounded root moment (module docstring). False is the published
            arithmetic, every op rounded to the parameter dtype. No effect in float32/float64.
        stochastic_first_moment: with ``unbiased_moments``, write ``m`` back stochastically
            rounded (a third stream) instead of rounded to nearest: ``m`` of a few fp16
            subnormal steps then decays as float64's does instead of sticking (module docstring).
        seed: selects the stochastic-rounding stream (different optimizers of one run should
            differ); with it, runs are deterministic.
        chunk_numel: elements per float32 temporary in the unbiased path (bounds its
            transient memory to a few times ``4·chunk_numel`` bytes); None: a whole bucket
            (the parameters of one device and dtype) at a time. The result does not depend on
            it, bit for bit. :meth:`chunk_for` picks it per device: 2^18 (1 MiB temporaries) on
            a CPU keeps each pass in cache (the DrQ critic's step, 4.2M fp16 parameters, one
            thread: 117 ms against 153 ms at 2^20); on a GPU every chunk costs ~30 kernel
            launches, so whole buckets.
        compiled: the unbiased step of a one-bucket optimizer as one op whose kernels
            ``torch.compile`` generates (``fused.py``), the parameters (their ``.data``) and the
            state kept in one flat buffer per name and updated in place: whole buckets
            (``chunk_numel`` unused), the same arithmetic and rounding streams, but not bit for
            bit the eager step (an FMA in ATen's ``lerp``); compiled at the first step (seconds);
            on a CPU slower than eager. The published arithmetic, float32/float64
            parameters and optimizers spanning several devices or dtypes stay eager.

    Op budget (what a GPU pays in launches): a sync-free step of one bucket with
    ``chunk_numel=None`` dispatches at most ``130 + 2.5·n`` aten ops for ``n`` parameters (views
    included, a foreach op counted once; bias corrections and rounding keys are vectors over the
    bucket, the per-element spreads gathers, the flat views of parameters and state kept from step
    to step, the root moments, the weights and the first moments stochastically rounded in one
    call) -- DrQ's critic 170, actor 148, ``log_alpha`` 129 in fp16 (10 fewer each with ``m``
    rounded to nearest) -- and a whole fp16
    update (critic, actor, temperature and target, forward and backward) 1,216, against fp32's
    540, as the benchmark counts them (``pixelsac.perf.opcount``, tests/test_op_budget.py). At
    2^18-element chunks the same update at 84×84 dispatched 5,415 (~30 ops a chunk; counted when
    the whole update was 1,465), which is why a GPU takes whole buckets.

    Two numerical guards beyond the formulas: the denominators ``M + ε`` and ``denom`` are
    floored at the dtype's smallest positive number. They only act when the value is exactly
    zero (an all-zero gradient history with an ε that rounds to 0 in fp16, e.g. 1e-8), where
    they turn 0/0 into a zero update instead of NaN.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        kahan: bool = False,
        capturable: bool = False,
        unbiased_moments: bool = False,
        stochastic_first_moment: bool = False,
        seed: int = 0,
        chunk_numel: int | None = 1 << 18,
        compiled: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"HAdam: invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"HAdam: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"HAdam: betas must lie in [0, 1), got {betas}")
        if chunk_numel is not None and chunk_numel < 1:
            raise ValueError(f"HAdam: chunk_numel must be positive or None, got {chunk_numel}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            kahan=bool(kahan),
            capturable=bool(capturable),
            unbiased_moments=bool(unbiased_moments),
            stochastic_first_moment=bool(stochastic_first_moment),
        )
        super().__init__(params, defaults)
        self.seed = int(seed)
        self.chunk_numel = None if chunk_numel is None else int(chunk_numel)
        self.compiled = bool(compiled)
        self._layout_constants: dict[tuple, torch.Tensor] = {}  # see _constant
        self._flat_views: dict[int, tuple] = {}  # see _state_flats
        self._flat_states: dict[tuple, dict] = {}  # see _flat_state
        self._flat_param_buffers: dict[tuple, tuple] = {}  # see _flat_params
        # Set by every step: True (or a 0-dim bool device tensor) when a new root moment or
        # denominator would not be finite and the step was therefore not applied.
        self.state_overflow: bool | torch.Tensor = False
        # Set by every step: did it also apply the loss scaler's rescale it was given (``backoff``)?
        self.backed_off = False
        if self.compiled:  # the parameters into their flat buffers now (_flat_params says why)
            for group in self.param_groups:
                if not group["unbiased_moments"]:
                    continue
                buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
                for param in group["params"]:
                    if param.dtype in (torch.float16, torch.bfloat16):
                        buckets.setdefault((param.device, param.dtype), []).append(param)
                for params in buckets.values():
                    if all(reads_channels_last(p) or p.is_contiguous() for p in params):
                        self._flat_params(params)

    @staticmethod
    def chunk_for(device_type: str) -> int | None:
        """``chunk_numel`` for a device type: 2^18 on a CPU (cache-sized passes), None (whole
        buckets) elsewhere, where a step is bound by kernel launches, not by cache."""
        return 1 << 18 if device_type == "cpu" else None

    def _init_state(self, param: torch.Tensor, kahan: bool, capturable: bool) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device) if capturable else 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_root"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        elif capturable and not torch.is_tensor(state["step"]):
            # a state saved by a host-side run, continued sync-free
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=param.device)
        elif not capturable and torch.is_tensor(state["step"]):
            state["step"] = int(state["step"].item())
        if kahan and "kahan_comp" not in state:
            # Created lazily so a group can switch Kahan on after loading a checkpoint.
            state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        for key in _LAYOUT_KEYS:  # a parameter converted to another memory format since: follow it
            if key in state and state[key].stride() != param.stride():
                state[key] = in_layout_of(param, state[key])
        return state

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        found_inf: torch.Tensor | None = None,
        backoff: tuple[float, float] | None = None,
    ) -> torch.Tensor | None:
        """Take one hAdam step for every parameter that has a gradient.

        Args:
            closure: recomputes the loss (optional, as in torch optimizers).
            found_inf: 0-dim tensor; when nonzero the step is skipped on the device (parameters,
                moments, Kahan buffers and ``t`` bit-exactly unchanged). Needs ``capturable=True``
                in every group; non-finite gradients count as 0 (published arithmetic: sanitised in place).
            backoff: ``(f, floor)``, a compound loss scaler's backoff factor and ε floor, given
                with ``found_inf``: the compiled step then also does the scaler's rescale after a
                step (``rescale_state_`` by ``f`` if the step is skipped, by 1 if taken) in the
                same pass and sets :attr:`backed_off` True; any other step ignores it and sets
                :attr:`backed_off` False (the caller rescales).

        A step whose new state would overflow is not applied either (module docstring); it
        sets :attr:`state_overflow`.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is not None and not all(group.get("capturable", False) for group in self.param_groups):
            raise ValueError(
                "HAdam.step(found_inf=...) needs capturable=True: a host-side step "
                "cannot skip without reading the flag on the host"
            )
        work = self._gather()
        self.backed_off = False
        if self._fused(work):  # (found_inf also tells it to count non-finite gradients as 0)
            backoff = backoff if found_inf is not None else None  # (found_inf: capturable, checked above)
            self._fused_step(*work[0], found_inf, backoff)
            self.backed_off = backoff is not None
            return loss
        for group, bucket in work:  # a skipped step's gradients may hold inf/NaN; 0 keeps x_new finite
            bucket["sanitize"] = found_inf is not None
            if found_inf is not None and not _unbiased(group, bucket):  # (the unbiased path: in its float32 copy)
                for grad in bucket["grads"]:
                    grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        capturable = all(group.get("capturable", False) for group, _ in work) if work else False
        # Every bucket's new state is computed before any is written: an overflow anywhere skips
        # the whole step, as an overflowing gradient anywhere does.
        overflows = [self._overflows(group, bucket) for group, bucket in work]
        if not overflows:
            self.state_overflow = False
            return loss
        device = overflows[0].device
        overflow = overflows[0] if len(overflows) == 1 else torch.stack([f.to(device) for f in overflows]).any()
        take = None  # 0-dim bool: is the step applied (decided on the device)
        if capturable:
            take = ~overflow if found_inf is None else (found_inf.to(device) == 0) & ~overflow
            self.state_overflow = overflow
        else:
            self.state_overflow = bool(overflow)  # the host path reads its decisions anyway
            if self.state_overflow:
                return loss
        ok = None if take is None else take.to(torch.float32)  # 1.0 or 0.0: the blend weight
        for group, bucket in work:
            self._apply(group, bucket, ok, take)
        return loss

    def _gather(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(group, bucket) per device and dtype (foreach kernels need one of each per list); a
        bucket holds the params with gradients, their grads, states and optimizer-wide indices."""
        work, index = [], 0
        for group in self.param_groups:
            if torch.is_tensor(group["eps"]) and not group.get("capturable", False):
                group["eps"] = float(group["eps"].item())
            buckets: dict[tuple[torch.device, torch.dtype], dict[str, list]] = {}
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("HAdam does not support sparse gradients")
                bucket = buckets.setdefault(
                    (param.device, param.dtype), {"params": [], "grads": [], "states": [], "indices": []}
                )
                bucket["params"].append(param)
                bucket["grads"].append(param.grad)
                bucket["states"].append(self._init_state(param, group["kahan"], group.get("capturable", False)))
                bucket["indices"].append(index - 1)
            work.extend((group, bucket) for bucket in buckets.values())
        return work

    # ------------------------------------------------------------------ published arithmetic
    def _published_candidates(self, group: dict[str, Any], bucket: dict[str, Any]) -> dict[str, Any]:
        """New ``m``, ``s`` and the denominators, every op rounded to the parameter dtype."""
        if "candidates" in bucket:
            return bucket["candidates"]
        beta1, beta2 = group["betas"]
        eps, capturable = group["eps"], group.get("capturable", False)
        grads, states = bucket["grads"], bucket["states"]
        dtype, device = bucket["params"][0].dtype, bucket["params"][0].device
        tiny = _smallest_positive(dtype)
        if capturable and torch.is_tensor(eps):
            eps = eps.to(device)
        new_avgs = torch._foreach_lerp([s["exp_avg"] for s in states], grads, 1.0 - beta1)
        new_roots = _hypot_root(grads, [s["exp_avg_root"] for s in states], beta1, beta2, eps, tiny)
        steps = [s["step"] for s in states]
        if capturable:
            # t >= 1 in the corrections: a skipped first step (t = 0) must not divide by 1 - β^0 = 0.
            counted = torch._foreach_clamp_min(torch._foreach_add(steps, 1.0), 1.0)
            root_bias_corrections = torch._foreach_pow(beta2, counted)
            torch._foreach_neg_(root_bias_corrections)
            torch._foreach_add_(root_bias_corrections, 1.0)
            torch._foreach_sqrt_(root_bias_corrections)
            denoms = _copy(new_roots)
            torch._foreach_div_(denoms, root_bias_corrections)
            add_scalar_(denoms, eps)
        else:
            root_bias_corrections = [math.sqrt(1.0 - beta2 ** (t + 1)) for t in steps]
            denoms = torch._foreach_div(new_roots, root_bias_corrections)
            torch._foreach_add_(denoms, eps)
        torch._foreach_clamp_min_(denoms, tiny)
        bucket["candidates"] = {"exp_avg": new_avgs, "exp_avg_root": new_roots, "denom": denoms}
        return bucket["candidates"]

    def _overflows(self, group: dict[str, Any], bucket: dict[str, Any]) -> torch.Tensor:
        """0-dim bool: would a new root moment (or, published, a denominator) not be finite?"""
        if _unbiased(group, bucket):
            return self._fp32_overflows(group, bucket)
        candidates = self._published_candidates(group, bucket)
        return ~all_finite_many([*candidates["exp_avg_root"], *candidates["denom"]])

    def _apply(
        self, group: dict[str, Any], bucket: dict[str, Any], ok: torch.Tensor | None, take: torch.Tensor | None
    ) -> None:
        params, states = bucket["params"], bucket["states"]
        steps = [s["step"] for s in states]
        if group.get("capturable", False):
            if ok is not None:
                add_scalar_(steps, ok.to(params[0].device))
            else:
                torch._foreach_add_(steps, 1.0)
        else:
            for state in states:
                state["step"] += 1
        if _unbiased(group, bucket):
            self._fp32_apply(group, bucket, take)
        else:
            self._published_apply(group, bucket, ok)

    def _published_apply(self, group: dict[str, Any], bucket: dict[str, Any], ok: torch.Tensor | None) -> None:
        """``p <- p - step·m/denom`` (or its Kahan form) from the published candidates; ``ok`` (0/1
        device scalar) blends every write so that 0 leaves all state bit-exactly unchanged."""
        beta1, beta2 = group["betas"]
        lr, kahan, capturable = group["lr"], group["kahan"], group.get("capturable", False)
        params, states = bucket["params"], bucket["states"]
        candidates = bucket.pop("candidates")
        new_avgs, new_roots, denoms = candidates["exp_avg"], candidates["exp_avg_root"], candidates["denom"]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_roots = [s["exp_avg_root"] for s in states]
        steps = [s["step"] for s in states]
        if capturable:
            counted = torch._foreach_clamp_min(steps, 1.0)
            step_sizes = torch._foreach_pow(beta1, counted)  # -> -lr (1-β1) / (sqrt(1-β2) (1-β1^t))
            torch._foreach_sub_(step_sizes, 1.0)
            torch._foreach_reciprocal_(step_sizes)
            torch._foreach_mul_(step_sizes, lr * (1.0 - beta1) / math.sqrt(1.0 - beta2))
        else:
            # step = lr (1-β1) / (sqrt(1-β2) (1 - β1^t)); the (1-β1)/sqrt(1-β2) undoes c.
            step_sizes = [-lr * (1.0 - beta1) / (math.sqrt(1.0 - beta2) * (1.0 - beta1**t)) for t in steps]
        if ok is None:
            torch._foreach_copy_(exp_avgs, new_avgs)
            torch._foreach_copy_(exp_avg_roots, new_roots)
        else:
            select_(exp_avgs, new_avgs, ok)
            select_(exp_avg_roots, new_roots, ok)
        if not capturable and not kahan:
            # One fused op: p - step*m/denom is rounded once.
            torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)
            return
        updates = torch._foreach_div(new_avgs, denoms)
        del denoms
        torch._foreach_mul_(updates, step_sizes)
        if kahan:
            kahan_add_(params, updates, [s["kahan_comp"] for s in states], mask=ok)
        elif ok is None:
            torch._foreach_add_(params, updates)
        else:
            select_(params, torch._foreach_add(params, updates), ok)

    # ------------------------------------------------------------------ unbiased arithmetic
    def _fp32_packs(self, bucket: dict[str, Any]) -> list[_Pack]:
        """The bucket's elements as packs of at most ``chunk_numel`` (None: the whole bucket):
        consecutive parameters packed whole (one float32 workspace and one pass of ops for many
        small tensors, where a pass per tensor would be all per-op overhead), a larger one split
        into chunks of its own. A pack never mixes parameters with and without a Kahan buffer,
        nor (on the host path) different step counts, so its bias corrections are scalars."""
        capturable = torch.is_tensor(bucket["states"][0]["step"]) if bucket["states"] else False
        limit = self.chunk_numel or max(1, sum(param.numel() for param in bucket["params"]))
        packs: list[_Pack] = []
        current: _Pack | None = None
        for position, (param, state) in enumerate(zip(bucket["params"], bucket["states"])):
            numel, kahan = param.numel(), "kahan_comp" in state
            step = None if capturable else state["step"]
            for start in range(0, numel, limit):
                length = min(limit, numel - start)
                if current is None or current.numel + length > limit or current.kahan != kahan or current.step != step:
                    current = _Pack(kahan=kahan, step=step)
                    packs.append(current)
                current.segments.append((position, start, length))
                current.numel += length
        return packs

    def _pack_views(self, bucket: dict[str, Any], pack: _Pack) -> dict[str, list[torch.Tensor]]:
        """1-D views, in each parameter's own memory order, of every segment of a pack."""
        views: dict[str, list[torch.Tensor]] = {
            "grad": [],
            "exp_avg": [],
            "exp_avg_root": [],
            "param": [],
            "kahan_comp": [],
        }
        flats: dict[int, dict[str, torch.Tensor]] = {}
        for position, start, length in pack.segments:
            if position not in flats:
                param, state = bucket["params"][position], bucket["states"][position]
                flats[position] = {
                    "grad": flat_view(bucket["grads"][position], like=param),
                    **self._state_flats(param, state, pack.kahan),
                }
            whole = length == flats[position]["param"].numel()  # a whole parameter: its flat view itself
            for name, flat in flats[position].items():
                views[name].append(flat if whole else flat[start : start + length])
        return views

    def _state_flats(self, param: torch.Tensor, state: dict[str, Any], kahan: bool) -> dict[str, torch.Tensor]:
        """:func:`flat_view` views of a parameter and its state tensors, made at the first step and
        kept while those tensors are the same objects with the same storage and strides (a view
        is a dispatched op, and a GPU step would otherwise make four per parameter each time;
        a parameter given new storage or a state tensor replaced, e.g. by ``load_state_dict`` or
        a change of memory format, gets new views)."""
        names = ("param", "exp_avg", "exp_avg_root", "kahan_comp")[: 4 if kahan else 3]
        tensors = (param, *(state[name] for name in names[1:]))
        where = tuple((t.data_ptr(), t.storage_offset(), t.stride(), t.shape) for t in tensors)
        cached = self._flat_views.get(id(param))
        if cached is None or cached[1] != where or any(a is not b for a, b in zip(cached[0], tensors)):
            # the parameter's view made from a detached alias: a view of a leaf that requires grad,
            # made under no_grad, may not be read by autograd-aware code (torch.compile's inputs)
            # once the leaf is changed in place with grad enabled
            flats = [flat_view(t.detach() if t.requires_grad else t) for t in tensors]
            cached = (tensors, where, dict(zip(names, flats)))
            self._flat_views[id(param)] = cached
        return cached[2]

    @staticmethod
    def _joined(views: list[torch.Tensor]) -> torch.Tensor:
        """The segments as one 1-D tensor (no copy for a single segment)."""
        return views[0] if len(views) == 1 else torch.cat(views)

    def _pack_root32(
        self, group: dict[str, Any], views: dict[str, list[torch.Tensor]], sanitize: bool
    ) -> tuple[torch.Tensor, ...]:
        """float32 ``g`` (non-finite -> 0 when ``sanitize``) and the new ``s = hypot((1-β1)|g|, sqrt(β2)·s)``."""
        beta1, beta2 = group["betas"]
        grad32 = self._joined(views["grad"]).float()
        if sanitize:  # a skipped step's gradients may hold inf/NaN; 0 keeps the unused new state finite
            grad32.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        root32 = torch.hypot(
            grad32.abs().mul_(1.0 - beta1), self._joined(views["exp_avg_root"]).float().mul_(math.sqrt(beta2))
        )
        return grad32, root32

    def _fp32_overflows(self, group: dict[str, Any], bucket: dict[str, Any]) -> torch.Tensor:
        largest = torch.finfo(bucket["params"][0].dtype).max
        packs = bucket["fp32_packs"] = self._fp32_packs(bucket)  # the layout, once per step
        flags = []
        for pack in packs:
            views = self._pack_views(bucket, pack)
            grad32, root32 = self._pack_root32(group, views, bucket["sanitize"])
            flags.append(~(root32.amax() <= largest))  # root32 >= 0; a NaN propagates into amax: overflow too
            if len(packs) == 1:  # one pack: keep its work for the step (at most chunk_numel floats)
                bucket["fp32_pack"] = (pack, views, grad32, root32)
        return flags[0] if len(flags) == 1 else torch.stack(flags).any()

    def _bucket_streams(self, group: dict[str, Any], bucket: dict[str, Any]) -> dict[str, Any]:
        """Per parameter of the bucket: the bias corrections and the stochastic-rounding keys.

        Device step counts: one float32 (corrections) or int64 (keys) vector for the whole bucket,
        a few ops however many parameters, each entry the IEEE operations of a 0-dim tensor per
        parameter -- the same bits for any packing. Host counts: Python numbers per parameter."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        states, indices = bucket["states"], bucket["indices"]
        steps = [state["step"] for state in states]
        if torch.is_tensor(steps[0]):
            device = steps[0].device
            counts = torch.stack([t.to(device) for t in steps])
            counted = counts.clamp_min(1.0).to(torch.float64)  # t >= 1: see the published path
            root_corrections = (1.0 - beta2**counted).sqrt().to(torch.float32)
            step_sizes = (-lr * (1.0 - beta1) / math.sqrt(1.0 - beta2) / (1.0 - beta1**counted)).to(torch.float32)
            keys = mix_key(counts, start=self._constant(device, ("stream", tuple(indices)), self._stream_starts))
            streams = {
                "root_correction": root_corrections,
                "step_size": step_sizes,
                "key": keys,
                "param_key": mix_key(keys, 1),
            }
            if group.get("stochastic_first_moment", False):
                streams["avg_key"] = mix_key(keys, 2)
            return streams
        keys = [mix_key(self.seed, index, t) for index, t in zip(indices, steps)]
        streams = {
            "root_correction": [math.sqrt(1.0 - beta2**t) for t in steps],
            "step_size": [-lr * (1.0 - beta1) / (math.sqrt(1.0 - beta2) * (1.0 - beta1**t)) for t in steps],
            "key": keys,
            "param_key": [mix_key(k, 1) for k in keys],
        }
        if group.get("stochastic_first_moment", False):
            streams["avg_key"] = [mix_key(k, 2) for k in keys]
        return streams

    def _stream_starts(self, key: tuple[str, tuple[int, ...]], device: torch.device) -> torch.Tensor:
        """``mix_key(seed, index)`` per parameter: the part of each key that ``t`` does not change."""
        return torch.tensor([mix_key(self.seed, index) for index in key[1]], dtype=torch.int64, device=device)

    def _fp32_apply(self, group: dict[str, Any], bucket: dict[str, Any], take: torch.Tensor | None) -> None:
        """One element's step in float32, written back once (SR for s; RN or SR for m; SR for p
        without a Kahan buffer), a pack of parameters at a time."""
        beta1 = group["betas"][0]
        stochastic_avg = bool(group.get("stochastic_first_moment", False))
        eps = group["eps"]
        params = bucket["params"]
        dtype, device = params[0].dtype, params[0].device
        if torch.is_tensor(eps):
            eps = eps.to(device)
        if take is not None:
            take = take.to(device)
        tiny32 = torch.finfo(torch.float32).tiny
        streams = self._bucket_streams(group, bucket)
        cached = bucket.pop("fp32_pack", None)
        packs = bucket.pop("fp32_packs", None) or self._fp32_packs(bucket)
        for pack in packs if cached is None else [cached[0]]:
            if cached is None:
                views = self._pack_views(bucket, pack)
                grad32, root32 = self._pack_root32(group, views, bucket["sanitize"])
            else:
                _, views, grad32, root32 = cached
            lengths = [length for _, _, length in pack.segments]
            # every element's segment (several segments only): one repeat_interleave a pack
            segment = self._segment_index(pack, device) if len(pack.segments) > 1 else None
            spread = self._spreader(pack, segment)
            root_correction = spread(streams["root_correction"])
            step_size = spread(streams["step_size"])
            # the stochastic-rounding streams: one per (parameter, t), indexed by element. Without
            # Kahan buffers the root moments, the weights (and the first moments) are rounded in one
            # call (device counts): the streams spread at once, as the rows of one tensor (the bits
            # of one call each)
            paired = not pack.kahan and torch.is_tensor(streams["key"])
            if paired:
                names = ["key", "param_key", "avg_key"][: 3 if stochastic_avg else 2]
                keys = spread(torch.stack([streams[name] for name in names]), as_key=True)
            else:
                key = spread(streams["key"], as_key=True)
                param_key = None if pack.kahan else spread(streams["param_key"], as_key=True)
                avg_key = spread(streams["avg_key"], as_key=True) if stochastic_avg else None
            counter = self._counter(bucket, pack, device, segment)
            avg16 = self._joined(views["exp_avg"])
            avg32 = avg16.float().lerp_(grad32, 1.0 - beta1)
            denom32 = (root32 / root_correction).add_(eps).clamp_min_(tiny32)
            update32 = avg32.div(denom32).mul_(step_size)
            del denom32, grad32
            if not stochastic_avg:
                self._write(views["exp_avg"], avg32.to(dtype), avg16, take, lengths)
                del avg32
            param16 = self._joined(views["param"])
            param32 = param16.float()
            if paired:  # the root moments, the weights (and m) in one call: fewer of the hash's ops
                rows = [root32, param32.add_(update32)] + ([avg32] if stochastic_avg else [])
                rounded = stochastic_round(
                    torch.stack(rows), dtype, keys if keys.dim() == 2 else keys.view(len(rows), 1), counter=counter
                )
                new_root, new_param = rounded[0], rounded[1]
                new_avg = rounded[2] if stochastic_avg else None
            else:
                new_root = stochastic_round(root32, dtype, key, counter=counter)
                new_avg = stochastic_round(avg32, dtype, avg_key, counter=counter) if stochastic_avg else None
            if stochastic_avg:
                self._write(views["exp_avg"], new_avg, avg16, take, lengths)
                del avg32, new_avg
            self._write(
                views["exp_avg_root"],
                new_root,
                None if take is None else self._joined(views["exp_avg_root"]),
                take,
                lengths,
            )
            del root32, new_root
            if pack.kahan:  # Kahan with the float32 update: y = u - c, t = RN(p + y), c = RN((t - p) - y)
                comp16 = self._joined(views["kahan_comp"])
                update32.sub_(comp16.float())
                new_param = (param32 + update32).to(dtype)
                self._write(
                    views["kahan_comp"], new_param.float().sub_(param32).sub_(update32).to(dtype), comp16, take, lengths
                )
            elif not paired:  # no compensation buffer: round stochastically, so sub-ulp steps add up on average
                new_param = stochastic_round(param32.add_(update32), dtype, param_key, counter=counter)
            self._write(views["param"], new_param, param16, take, lengths)

    # ------------------------------------------------------------------ compiled unbiased step
    def _fused(self, work: list[tuple[dict[str, Any], dict[str, Any]]]) -> bool:
        """Does this step take the compiled path? One bucket (one device and dtype: the decision
        to skip is then the bucket's own), 16-bit with unbiased moments, and every parameter with
        or every one without a Kahan buffer (a group switched to Kahan after loading has them all)."""
        if not self.compiled or len(work) != 1 or not _unbiased(*work[0]):
            return False
        kahan = ["kahan_comp" in state for state in work[0][1]["states"]]
        return all(kahan) or not any(kahan)

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
    ) -> None:
        """One step of the bucket as :func:`fused.step`: the gradients joined (one ``cat``),
        parameters and state updated in place in their flat buffers; with ``backoff``, the
        scaler's rescale too (:meth:`step`)."""
        beta1, beta2 = group["betas"]
        params, states, indices = bucket["params"], bucket["states"], bucket["indices"]
        device = params[0].device
        capturable = group.get("capturable", False)
        flat = self._flat_state(bucket, capturable)
        kahan = "kahan_comp" in flat
        grad = self._joined([flat_view(grad, like=param) for grad, param in zip(bucket["grads"], params)])
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
        layout = self._constant(
            device,
            ("layout", tuple((tuple(p.shape), reads_channels_last(p)) for p in params)),
            lambda key, dev: fused.layout_table(params, [channels_last for _, channels_last in key[1]], dev),
        )
        stream_starts = self._constant(device, ("stream", tuple(indices)), self._stream_starts)
        hyper = self._constant(
            device, ("hyper", float(group["lr"]), beta1, beta2), lambda key, dev: fused.hyperparameters(*key[1:], dev)
        )
        if backoff is not None:
            backoff = self._constant(
                device, ("backoff", *map(float, backoff)), lambda key, dev: torch.tensor(key[1:], device=dev)
            )
        overflow = fused.step(
            grad, flat["exp_avg"], flat["exp_avg_root"], flat["param"], flat["kahan_comp"] if kahan else None,
            counts, None if found_inf is None else found_inf.to(device), stream_starts, layout, eps, hyper, backoff,
            bool(group.get("stochastic_first_moment", False)),
        )  # fmt: skip
        # changed in place through the flat buffer: tell autograd, as an in-place op on each would
        torch.autograd.graph.increment_version(params)
        if capturable:
            self.state_overflow = overflow
        else:
            self.state_overflow = bool(overflow)  # the host path reads its decisions anyway
            if not self.state_overflow:
                for state in states:
                    state["step"] += 1

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

    def _spreader(self, pack: _Pack, segment: torch.Tensor | None) -> Callable[..., Any]:
        """``spread(values)``: a pack's per-segment value for each of its elements.

        ``values`` holds one entry per bucket parameter: a device vector (device step counts) or a
        list of Python numbers (host counts, which a pack shares). One segment: the 0-dim entry
        (or number) itself, broadcast by the ops that use it. Several: the entries of the pack's
        parameters gathered per element through the segment index (two ops however many
        segments). ``as_key``: as int32 stochastic-rounding keys (their low 32 bits). A device
        tensor may hold several rows (parameters along its last dimension): each row is spread."""
        first = pack.segments[0][0]
        if len(pack.segments) == 1:
            return lambda values, as_key=False: values.select(-1, first) if torch.is_tensor(values) else values[first]
        last = pack.segments[-1][0]
        device = segment.device

        def spread(values: torch.Tensor | list[Any], as_key: bool = False) -> Any:
            if not torch.is_tensor(values):
                if not as_key:
                    return values[first]  # a host pack shares its step: one number for all
                values = torch.tensor([as_int32(k) for k in values[first : last + 1]], dtype=torch.int32, device=device)
            else:
                if first > 0 or last + 1 < values.shape[-1]:  # (a slice is an op too: none for the whole bucket)
                    values = values.narrow(-1, first, last + 1 - first)
                if as_key:
                    values = as_int32(values)
            return values.index_select(-1, segment)

        return spread

    def _segment_index(self, pack: _Pack, device: torch.device) -> torch.Tensor:
        """Every element's segment in a pack of several (int32, ``pack.numel`` long)."""
        lengths = self._constant(
            device,
            ("lengths", tuple(pack.segments)),
            lambda key, dev: torch.tensor([length for _, _, length in key[1]], dtype=torch.int32, device=dev),
        )
        return torch.repeat_interleave(lengths, output_size=pack.numel)

    def _counter(
        self, bucket: dict[str, Any], pack: _Pack, device: torch.device, segment: torch.Tensor | None
    ) -> torch.Tensor:
        """Every element's stochastic-rounding counter: its index within its own parameter in
        logical (row-major, NCHW) order, whatever the memory order the pack reads it in, so that
        the rounding -- and a run -- does not depend on the memory format (``layout.py``)."""
        params = bucket["params"]

        def logical(position: int, start: int, length: int) -> torch.Tensor | None:
            """The segment's logical indices when its parameter is channels-last, else None."""
            if not reads_channels_last(params[position]):
                return None
            order = self._constant(
                device,
                ("logical order", tuple(params[position].shape)),
                lambda key, dev: (
                    torch.arange(math.prod(key[1]), dtype=torch.int32, device=dev)
                    .view(key[1])
                    .permute(0, 2, 3, 1)
                    .reshape(-1)
                ),
            )
            return order if length == order.numel() else order[start : start + length]

        if len(pack.segments) == 1:
            position, start, length = pack.segments[0]
            order = logical(position, start, length)
            return order if order is not None else torch.arange(start, start + length, dtype=torch.int32, device=device)

        def shifts(key: tuple, dev: torch.device) -> torch.Tensor:  # parameter index - pack index, per segment
            values, offset = [], 0
            for _, start, length in key[1]:
                values.append(start - offset)
                offset += length
            return torch.tensor(values, dtype=torch.int32, device=dev)

        shift = self._constant(device, ("shifts", tuple(pack.segments)), shifts)
        counter = torch.arange(pack.numel, dtype=torch.int32, device=device)
        counter.add_(shift.index_select(0, segment))
        offset = 0
        for position, start, length in pack.segments:
            order = logical(position, start, length)
            if order is not None:
                counter[offset : offset + length].copy_(order)
            offset += length
        return counter

    @staticmethod
    def _write(
        targets: list[torch.Tensor],
        value: torch.Tensor,
        old: torch.Tensor | None,
        take: torch.Tensor | None,
        lengths: list[int],
    ) -> None:
        """Each segment view ``<- value``'s part, or only where the 0-dim bool ``take`` is true."""
        if take is not None:
            value = torch.where(take, value, old)
        if len(targets) == 1:
            targets[0].copy_(value)
        else:
            torch._foreach_copy_(targets, list(value.split(lengths)))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load moments and hyperparameters, but keep this optimizer's ``capturable``: whether a
        step reads the host is decided by the run (its device), not by the checkpoint. State
        tensors take their parameter's memory format (``layout.py``)."""
        capturable = [group.get("capturable", False) for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, flag in zip(self.param_groups, capturable):
            group["capturable"] = flag
        state_in_param_layouts_(self)  # saved in another memory format: see layout.py

    # ----------------------------------------------------------------- loss-scaler hooks
    def _moment_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if state:
                    tensors.append(state["exp_avg"])
                    tensors.append(state["exp_avg_root"])
        return tensors

    @torch.no_grad()
    def rescale_state_(self, factor: float | torch.Tensor, eps_floor: float = 1e-7) -> None:
        """Move the optimizer into new loss-scale units: ``S -> factor·S``.

        ``m`` and ``s`` are linear in the gradient scale, so both are multiplied by ``factor``;
        every group's ``ε <- max(ε·factor, eps_floor)``. The Kahan buffers hold parameter
        units and are left alone. A 0-dim tensor ``factor`` (decided on the device) keeps ε a
        device tensor too, updated in place, so no value is read on the host.
        """
        tensors = self._moment_tensors()
        if tensors:
            torch._foreach_mul_(tensors, factor)
        for group in self.param_groups:
            eps = group["eps"]
            if torch.is_tensor(factor) and not torch.is_tensor(eps):
                eps = group["eps"] = torch.tensor(float(eps), dtype=torch.float32, device=factor.device)
            if torch.is_tensor(eps):
                if torch.is_tensor(factor) and eps.device != factor.device:  # e.g. loaded on another device
                    eps = group["eps"] = eps.to(factor.device)
                eps.mul_(factor).clamp_min_(eps_floor)
            else:
                group["eps"] = max(eps * factor, eps_floor)

    @torch.no_grad()
    def state_is_finite_after(self, factor: float) -> bool:
        """True when ``factor·exp_avg`` and ``factor·exp_avg_root`` are finite for every param."""
        tensors = self._moment_tensors()
        if not tensors:
            return True
        flags = [all_finite(t, factor) for t in tensors]
        # One host sync for the whole optimizer rather than one per tensor.
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
