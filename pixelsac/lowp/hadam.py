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
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .kahan import kahan_add_

__all__ = ["HAdam"]


def _smallest_positive(dtype: torch.dtype) -> float:
    """Smallest positive (subnormal) number of a floating dtype, e.g. 5.96e-8 for fp16."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


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
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"HAdam: invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"HAdam: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"HAdam: betas must lie in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, kahan=bool(kahan))
        super().__init__(params, defaults)

    def _init_state(self, param: torch.Tensor, kahan: bool) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_root"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if kahan and "kahan_comp" not in state:
            # Created lazily so a group can switch Kahan on after loading a checkpoint.
            state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Take one hAdam step for every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, kahan = group["lr"], group["eps"], group["kahan"]
        # foreach kernels need one device and dtype per list.
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("HAdam does not support sparse gradients")
            buckets[(param.device, param.dtype)].append(param)

        for (_, dtype), params in buckets.items():
            states = [self._init_state(p, kahan) for p in params]
            for state in states:
                state["step"] += 1
            grads = [p.grad for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_roots = [s["exp_avg_root"] for s in states]
            tiny = _smallest_positive(dtype)

            # m <- β1 m + (1-β1) g
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)

            # s <- hypot((1-β1)|g|, sqrt(β2) s), written so that nothing large is squared.
            scaled_grads = torch._foreach_abs(grads)
            torch._foreach_mul_(scaled_grads, 1.0 - beta1)
            decayed_roots = torch._foreach_mul(exp_avg_roots, math.sqrt(beta2))
            larger = torch._foreach_maximum(scaled_grads, decayed_roots)
            smaller = torch._foreach_minimum(scaled_grads, decayed_roots)
            del scaled_grads, decayed_roots
            ratio_denom = torch._foreach_add(larger, eps)
            torch._foreach_clamp_min_(ratio_denom, tiny)
            ratio = torch._foreach_div(smaller, ratio_denom)
            del smaller, ratio_denom
            torch._foreach_mul_(ratio, ratio)
            torch._foreach_add_(ratio, 1.0)
            torch._foreach_sqrt_(ratio)
            torch._foreach_mul_(ratio, larger)
            torch._foreach_copy_(exp_avg_roots, ratio)
            del larger, ratio

            # denom = s / sqrt(1 - β2^t) + ε
            steps = [s["step"] for s in states]
            root_bias_corrections = [math.sqrt(1.0 - beta2**t) for t in steps]
            denoms = torch._foreach_div(exp_avg_roots, root_bias_corrections)
            torch._foreach_add_(denoms, eps)
            torch._foreach_clamp_min_(denoms, tiny)

            # step = lr (1-β1) / (sqrt(1-β2) (1 - β1^t)); the (1-β1)/sqrt(1-β2) undoes c.
            step_sizes = [
                lr * (1.0 - beta1) / (math.sqrt(1.0 - beta2) * (1.0 - beta1**t)) for t in steps
            ]
            if kahan:
                updates = torch._foreach_div(exp_avgs, denoms)
                torch._foreach_mul_(updates, [-size for size in step_sizes])
                kahan_add_(params, updates, [s["kahan_comp"] for s in states])
            else:
                # One fused op: p - step*m/denom is rounded once.
                torch._foreach_addcdiv_(params, exp_avgs, denoms, [-size for size in step_sizes])

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
    def rescale_state_(self, factor: float, eps_floor: float = 1e-7) -> None:
        """Move the optimizer into new loss-scale units: ``S -> factor·S``.

        ``m`` and ``s`` are linear in the gradient scale, so both are multiplied by ``factor``;
        every group's ``ε <- max(ε·factor, eps_floor)``. The Kahan buffers hold parameter
        units and are left alone.
        """
        tensors = self._moment_tensors()
        if tensors:
            torch._foreach_mul_(tensors, factor)
        for group in self.param_groups:
            group["eps"] = max(group["eps"] * factor, eps_floor)

    @torch.no_grad()
    def state_is_finite_after(self, factor: float) -> bool:
        """True when ``factor·exp_avg`` and ``factor·exp_avg_root`` are finite for every param."""
        tensors = self._moment_tensors()
        if not tensors:
            return True
        flags = [torch.isfinite(t * factor).all() for t in tensors]
        # One host sync for the whole optimizer rather than one per tensor.
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
