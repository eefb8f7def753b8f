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

Unbiased moments (``unbiased_moments=True``; beyond the paper): each element's step in float32
from the 16-bit state, written back once, ``s`` (and the weight without a Kahan buffer, and with
``stochastic_first_moment`` ``m``) stochastically rounded -- the float32 step of ``fused.py``,
whose docstring gives its arithmetic and why the published one drifts from float64 Adam.

Overflow of the state is a skipped step, never a silent freeze (both arithmetics). ``s`` can
reach ``(1-β1)/sqrt(1-β2)·|g| ≈ 3.16·|g|`` and, published, the bias-corrected denominator the
same at ``t = 1``: in fp16 both overflow once a (loss-scaled) gradient passes ≈20.7k although the
gradient is finite. An inf ``s`` makes the update exactly 0 and stays inf (halving keeps it), so
the weight would never move again. Here a step whose new ``s`` (or, published, denominator) is
not finite is not applied: ``state_overflow`` (a 0-dim bool tensor) is set and
:class:`~pixelsac.lowp.CompoundLossScaler` treats it like an overflowing gradient -- skip, back off
(halving ``S``, ``m``, ``s``), count it. With the switch on the denominator and update stay in
float32 and cannot overflow.

Skipping on the device (``capturable=True``, ``step(found_inf=flag, backoff=...)`` as the loss
scaler calls it): ``t`` is a 0-dim float32 tensor on the parameter's device and the step happens
when ``taken = (flag == 0) and not state_overflow``, decided there: every
state tensor is blended as ``x <- lerp(x, x_new, taken)`` (published) or ``where(taken, x_new, x)``
(float32 step), bit-exact for both values, so a skipped step leaves ``p``, ``m``, ``s``, ``c`` and
``t`` exactly as they were. Non-finite gradients count as 0 so that the unused ``x_new`` stays
finite (``0·inf`` would be NaN). Nothing is read on the host, so the step can run ahead of the
host or be captured in a CUDA graph: ``taken`` and a device ε enter foreach ops only through their
Tensor and List overloads (``masked.py``). With host counts (``capturable=False``) the step reads
its state overflow, as it must to count, and the caller skips a step whose gradients overflowed.

Where the arithmetic lives: the published form is :meth:`HAdam._published_candidates` and
:meth:`HAdam._published_apply` below; the float32 step is ``fused.py`` -- decide (``roots``,
``overflowed``, ``streams``), ``elements``, ``write`` -- which :meth:`HAdam._fp32_apply` runs eagerly
a cache-sized chunk at a time and ``HAdam(compiled=True)`` as one op that ``torch.compile`` fuses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .finite import all_finite, all_finite_many
from .fused import LOW, Float32Step, unbiased
from .kahan import kahan_add_
from .layout import in_layout_of, reads_channels_last, state_in_param_layouts_
from .masked import add_scalar_, select_

__all__ = ["HAdam"]

_LAYOUT_KEYS = ("exp_avg", "exp_avg_root", "kahan_comp")  # state tensors shaped like the parameter


def _smallest_positive(dtype: torch.dtype) -> float:
    """Smallest positive (subnormal) number of a floating dtype, e.g. 5.96e-8 for fp16."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def _exact_in(value: float, dtype: torch.dtype) -> bool:
    """Does ``dtype`` hold ``value`` exactly as a normal number (or 0)? Worked out on the host."""
    info = torch.finfo(dtype)
    if value != 0.0 and not info.tiny <= abs(value) <= info.max:
        return False
    return (math.frexp(abs(value))[0] * 2 ** (round(-math.log2(info.eps)) + 1)).is_integer()


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


class HAdam(Float32Step, Optimizer):
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
        unbiased_moments: the float32 step (module docstring): one rounding per state tensor, a
            stochastically rounded root moment. False is the published arithmetic, every op
            rounded to the parameter dtype. No effect in float32/float64.
        stochastic_first_moment: with ``unbiased_moments``, write ``m`` back stochastically
            rounded (a third stream) instead of rounded to nearest: ``m`` of a few fp16
            subnormal steps then decays as float64's does instead of sticking (module docstring).
        seed: selects the stochastic-rounding stream (different optimizers of one run should
            differ); with it, runs are deterministic.
        chunk_numel: elements per float32 temporary of the eager float32 step (its transient
            memory is a few times ``4·chunk_numel`` bytes); None: a whole bucket (the parameters
            of one device and dtype) at a time. The result does not depend on it, bit for bit.
            :meth:`chunk_for` picks it per device: cache-sized passes on a CPU, whole buckets on
            a GPU, where every chunk costs ~30 kernel launches.
        compiled: the float32 step of a one-bucket optimizer as one op whose kernels
            ``torch.compile`` generates (``fused.py``): whole buckets, the same arithmetic and
            rounding streams, but not bit for bit the eager step (an FMA in ATen's ``lerp``);
            compiled at the first step (seconds); on a CPU slower than eager. The published
            arithmetic, float32/float64 parameters and optimizers spanning several devices or
            dtypes stay eager.

    The float32 step keeps a bucket's parameters (their ``.data``) and each state tensor as views
    into one flat buffer per name (:meth:`_flat_state`), so a step reads and writes them whole or
    in slices: no ``cat`` but of the gradients, no copy back (its op budget:
    tests/test_op_budget.py).

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
        self._flat_states: dict[tuple, dict] = {}  # see _flat_state
        self._flat_param_buffers: dict[tuple, tuple] = {}  # see _flat_params
        # Set by every step: a 0-dim bool tensor, True when a new root moment or denominator
        # would not be finite and the step was therefore not applied.
        self.state_overflow = torch.zeros((), dtype=torch.bool)
        self._ones: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # see _backoff_factor
        for group in self.param_groups:  # the float32 step's parameters into flat buffers now (_flat_params)
            if group["unbiased_moments"]:
                buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
                for param in group["params"]:
                    if param.dtype in LOW:
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
        """Take one hAdam step for every parameter that has a gradient, unless it is skipped.

        Args:
            closure: recomputes the loss (optional, as in torch optimizers).
            found_inf: 0-dim tensor, nonzero when this step's gradients overflowed (a loss
                scaler's check): the step is skipped, decided on the device. Needs device step
                counts (``capturable=True``); non-finite gradients then count as 0.
            backoff: ``(f, floor)``, a compound loss scaler's backoff factor and ε floor, given
                with ``found_inf``: a skipped step also moves the state into the backed-off
                scale's units, :meth:`rescale_state_` by ``f`` (the compiled step in its own pass).

        Skipped (all state bit-exactly unchanged) when ``found_inf`` is nonzero or a new root
        moment (published: a denominator) would not be finite (:attr:`state_overflow`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if found_inf is not None and not all(group.get("capturable", False) for group in self.param_groups):
            raise ValueError(
                "HAdam.step(found_inf=...) needs capturable=True: a step that counts on the host "
                "cannot skip without reading the flag on the host"
            )
        backoff = backoff if found_inf is not None else None
        work = self._gather()
        if self._fused(work):  # decide, write and back off as one compiled op
            overflow = self._fused_step(*work[0], found_inf, backoff)
            self.state_overflow = overflow
            if not work[0][0].get("capturable", False) and not bool(overflow):  # host counts
                for state in work[0][1]["states"]:
                    state["step"] += 1
            return loss
        for group, bucket in work:  # a skipped step's gradients may hold inf/NaN; 0 keeps x_new finite
            bucket["sanitize"] = found_inf is not None
            if found_inf is not None and not unbiased(group, bucket):  # (the float32 step: in its float32 copy)
                for grad in bucket["grads"]:
                    grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        capturable = all(group.get("capturable", False) for group, _ in work) if work else False
        # Every bucket's new state is computed before any is written: an overflow anywhere skips
        # the whole step, as an overflowing gradient anywhere does.
        overflows = [self._overflows(group, bucket) for group, bucket in work]
        if not overflows:
            device = None if found_inf is None else found_inf.device
            self.state_overflow = torch.zeros((), dtype=torch.bool, device=device)
            return loss
        device = overflows[0].device
        overflow = overflows[0] if len(overflows) == 1 else torch.stack([f.to(device) for f in overflows]).any()
        self.state_overflow = overflow
        taken = None  # 0-dim bool: is the step applied, decided on the device (None: it is)
        if capturable:
            taken = ~overflow if found_inf is None else (found_inf.to(device) == 0) & ~overflow
        elif bool(overflow):  # host counts: the decision read here
            return loss
        for group, bucket in work:
            steps = [s["step"] for s in bucket["states"]]
            if not group.get("capturable", False):
                for state in bucket["states"]:
                    state["step"] += 1
            elif taken is None:
                torch._foreach_add_(steps, 1.0)
            else:
                add_scalar_(steps, taken.to(device, torch.float32))
            if unbiased(group, bucket):
                self._fp32_apply(group, bucket, taken)
            else:
                self._published_apply(group, bucket, taken)
        if backoff is not None:
            self.rescale_state_(self._backoff_factor(taken, backoff[0]), eps_floor=backoff[1])
        return loss

    def _gather(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(group, bucket) per device, dtype and Kahan buffer or not (foreach kernels need one
        device and dtype per list; the float32 step, one kind of weight update); a bucket holds
        the params with gradients, their grads, states and optimizer-wide indices."""
        work, index = [], 0
        for group in self.param_groups:
            if torch.is_tensor(group["eps"]) and not group.get("capturable", False):
                group["eps"] = float(group["eps"].item())
            buckets: dict[tuple[torch.device, torch.dtype, bool], dict[str, list]] = {}
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("HAdam does not support sparse gradients")
                state = self._init_state(param, group["kahan"], group.get("capturable", False))
                bucket = buckets.setdefault(
                    (param.device, param.dtype, "kahan_comp" in state),
                    {"params": [], "grads": [], "states": [], "indices": []},
                )
                bucket["params"].append(param)
                bucket["grads"].append(param.grad)
                bucket["states"].append(state)
                bucket["indices"].append(index - 1)
            work.extend((group, bucket) for bucket in buckets.values())
        return work

    def _overflows(self, group: dict[str, Any], bucket: dict[str, Any]) -> torch.Tensor:
        """0-dim bool: would a new root moment (or, published, a denominator) not be finite?"""
        if unbiased(group, bucket):
            return self._fp32_overflows(group, bucket)
        candidates = self._published_candidates(group, bucket)
        return ~all_finite_many([*candidates["exp_avg_root"], *candidates["denom"]])

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

    def _published_apply(self, group: dict[str, Any], bucket: dict[str, Any], taken: torch.Tensor | None) -> None:
        """``p <- p - step·m/denom`` (or its Kahan form) from the published candidates; ``taken`` (a
        0-dim device bool) blends every write so that False leaves all state bit-exactly unchanged."""
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
        if taken is None:
            torch._foreach_copy_(exp_avgs, new_avgs)
            torch._foreach_copy_(exp_avg_roots, new_roots)
        else:
            select_(exp_avgs, new_avgs, taken)
            select_(exp_avg_roots, new_roots, taken)
        if not capturable and not kahan:
            # One fused op: p - step*m/denom is rounded once.
            torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)
            return
        updates = torch._foreach_div(new_avgs, denoms)
        del denoms
        torch._foreach_mul_(updates, step_sizes)
        if kahan:
            kahan_add_(params, updates, [s["kahan_comp"] for s in states], taken=taken)
        elif taken is None:
            torch._foreach_add_(params, updates)
        else:
            select_(params, torch._foreach_add(params, updates), taken)

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

    def _backoff_factor(self, taken: torch.Tensor, backoff: float) -> torch.Tensor:
        """1 where the step was ``taken``, else ``backoff``: a 0-dim tensor of the moments' dtype
        where it holds ``backoff`` exactly (0.5 in fp16 or bf16), else float32 -- the same
        product, but CUDA multiplies a list by a 0-dim tensor of its own dtype in one kernel, by
        one of another dtype tensor by tensor."""
        key = (taken.device, backoff)
        if key not in self._ones:  # (a test on the host, once)
            dtypes = {param.dtype for group in self.param_groups for param in group["params"]}
            dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
            if not (dtype.is_floating_point and _exact_in(backoff, dtype)):
                dtype = torch.float32
            one = torch.ones((), dtype=dtype, device=taken.device)
            self._ones[key] = (one, torch.full_like(one, backoff))
        return torch.where(taken, *self._ones[key])  # (two tensors: one op)

    @torch.no_grad()
    def state_is_finite_after(self, factor: float) -> bool:
        """True when ``factor·exp_avg`` and ``factor·exp_avg_root`` are finite for every param."""
        tensors = self._moment_tensors()
        if not tensors:
            return True
        flags = [all_finite(t, factor) for t in tensors]
        # One host sync for the whole optimizer rather than one per tensor.
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
