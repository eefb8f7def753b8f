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

Sync-free steps (``capturable=True``): ``t`` is a 0-dim float32 tensor on the parameter's device
and ``step(found_inf=flag)`` decides on the device whether the step happens. With
``ok = (flag == 0)`` every state tensor is blended as ``x <- lerp(x, x_new, ok)``, which is
bit-exact for both values of ``ok`` (torch evaluates ``lerp(a, b, 1)`` as ``b - (b-a)·0``), so a
skipped step leaves ``p``, ``m``, ``s``, ``c`` and ``t`` exactly as they were, and a taken step
writes exactly the new values. Non-finite gradients are first zeroed in place so that the
unused ``x_new`` stays finite (``0·inf`` would be NaN). Nothing here reads a tensor on the host,
so the step can run ahead of the host or be captured in a CUDA graph.
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


def _copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies to combine in place with fp32 device scalars (``t``-dependent terms, a tensor ε):
    in place keeps the parameter dtype, where an out-of-place op between a 0-dim fp16 tensor
    (``log_alpha``) and a 0-dim fp32 one would promote to fp32."""
    return torch._foreach_mul(tensors, 1.0)


def _hypot_root(grads: list[torch.Tensor], exp_avg_roots: list[torch.Tensor], beta1: float, beta2: float,
                eps: float | torch.Tensor, tiny: float) -> list[torch.Tensor]:
    """``hypot((1-β1)|g|, sqrt(β2)·s)`` as ``M·sqrt(1 + (N/(M+ε))²)``: nothing large is squared."""
    scaled_grads = torch._foreach_abs(grads)
    torch._foreach_mul_(scaled_grads, 1.0 - beta1)
    decayed_roots = torch._foreach_mul(exp_avg_roots, math.sqrt(beta2))
    larger = torch._foreach_maximum(scaled_grads, decayed_roots)
    smaller = torch._foreach_minimum(scaled_grads, decayed_roots)
    del scaled_grads, decayed_roots
    if torch.is_tensor(eps):  # a device ε (sync-free loss scaling) would promote a 0-dim fp16 sum
        ratio_denom = _copy(larger)
        torch._foreach_add_(ratio_denom, eps)
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
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"HAdam: invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"HAdam: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"HAdam: betas must lie in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, kahan=bool(kahan), capturable=bool(capturable))
        super().__init__(params, defaults)

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
        return state

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Take one hAdam step for every parameter that has a gradient.

        Args:
            closure: recomputes the loss (optional, as in torch optimizers).
            found_inf: 0-dim tensor; when nonzero the step is skipped on the device (parameters,
                moments, Kahan buffers and ``t`` bit-exactly unchanged). Needs ``capturable=True``
                in every group; the gradients are sanitised in place (non-finite -> 0).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ok = None
        if found_inf is not None:
            if not all(group.get("capturable", False) for group in self.param_groups):
                raise ValueError("HAdam.step(found_inf=...) needs capturable=True: a host-side step "
                                 "cannot skip without reading the flag on the host")
            ok = (found_inf == 0).to(torch.float32)
        for group in self.param_groups:
            self._step_group(group, ok)
        return loss

    def _step_group(self, group: dict[str, Any], ok: torch.Tensor | None = None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, kahan, capturable = group["lr"], group["eps"], group["kahan"], group.get("capturable", False)
        if torch.is_tensor(eps) and not capturable:
            eps = group["eps"] = float(eps.item())
        # foreach kernels need one device and dtype per list.
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse:
                raise RuntimeError("HAdam does not support sparse gradients")
            buckets[(param.device, param.dtype)].append(param)

        for (device, dtype), params in buckets.items():
            states = [self._init_state(p, kahan, capturable) for p in params]
            grads = [p.grad for p in params]
            if capturable:
                self._capturable_update(params, grads, states, group, device, dtype, ok)
                continue
            for state in states:
                state["step"] += 1
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_roots = [s["exp_avg_root"] for s in states]
            tiny = _smallest_positive(dtype)

            # m <- β1 m + (1-β1) g
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)

            # s <- hypot((1-β1)|g|, sqrt(β2) s), written so that nothing large is squared.
            new_roots = _hypot_root(grads, exp_avg_roots, beta1, beta2, eps, tiny)
            torch._foreach_copy_(exp_avg_roots, new_roots)
            del new_roots

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

    def _capturable_update(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                           states: list[dict[str, Any]], group: dict[str, Any], device: torch.device,
                           dtype: torch.dtype, ok: torch.Tensor | None) -> None:
        """The same step with ``t`` on the device and an optional device-side skip (``ok`` 0/1)."""
        beta1, beta2 = group["betas"]
        lr, eps, kahan = group["lr"], group["eps"], group["kahan"]
        if torch.is_tensor(eps):
            eps = eps.to(device)
        tiny = _smallest_positive(dtype)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_roots = [s["exp_avg_root"] for s in states]
        steps = [s["step"] for s in states]
        if ok is not None:
            ok = ok.to(device)
            for grad in grads:  # a skipped step's gradients may hold inf/NaN; 0 keeps x_new finite
                grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            torch._foreach_add_(steps, ok)
        else:
            torch._foreach_add_(steps, 1.0)

        new_avgs = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
        new_roots = _hypot_root(grads, exp_avg_roots, beta1, beta2, eps, tiny)

        # t >= 1 in the corrections: a skipped first step (t = 0) must not divide by 1 - β^0 = 0.
        counted = torch._foreach_clamp_min(steps, 1.0)
        root_bias_corrections = torch._foreach_pow(beta2, counted)
        torch._foreach_neg_(root_bias_corrections)
        torch._foreach_add_(root_bias_corrections, 1.0)
        torch._foreach_sqrt_(root_bias_corrections)
        step_sizes = torch._foreach_pow(beta1, counted)      # -> -lr (1-β1) / (sqrt(1-β2) (1-β1^t))
        torch._foreach_sub_(step_sizes, 1.0)
        torch._foreach_reciprocal_(step_sizes)
        torch._foreach_mul_(step_sizes, lr * (1.0 - beta1) / math.sqrt(1.0 - beta2))

        denoms = _copy(new_roots)
        torch._foreach_div_(denoms, root_bias_corrections)
        torch._foreach_add_(denoms, eps)
        torch._foreach_clamp_min_(denoms, tiny)
        updates = torch._foreach_div(new_avgs, denoms)
        del denoms
        torch._foreach_mul_(updates, step_sizes)
        if ok is None:
            torch._foreach_copy_(exp_avgs, new_avgs)
            torch._foreach_copy_(exp_avg_roots, new_roots)
        else:
            torch._foreach_lerp_(exp_avgs, new_avgs, ok)
            torch._foreach_lerp_(exp_avg_roots, new_roots, ok)
        if kahan:
            kahan_add_(params, updates, [s["kahan_comp"] for s in states], mask=ok)
        elif ok is None:
            torch._foreach_add_(params, updates)
        else:
            torch._foreach_lerp_(params, torch._foreach_add(params, updates), ok)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load moments and hyperparameters, but keep this optimizer's ``capturable``: whether a
        step reads the host is decided by the run (its device), not by the checkpoint."""
        capturable = [group.get("capturable", False) for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, flag in zip(self.param_groups, capturable):
            group["capturable"] = flag

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
        flags = [torch.isfinite(t * factor).all() for t in tensors]
        # One host sync for the whole optimizer rather than one per tensor.
        return bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
