"""Plain Adam with the Kahan-compensated parameter update (the "Kahan without hAdam" ablation).

The math of ``torch.optim.Adam`` (foreach path, no weight decay)::

    m <- β1*m + (1-β1)*g
    v <- β2*v + (1-β2)*g²             # one fused op, as torch does it
    denom = sqrt(v) / sqrt(1 - β2**t) + ε
    u = -(lr / (1 - β1**t)) * m / denom

applied with Kahan summation (see kahan.py) instead of ``p += u``. It keeps ``exp_avg_sq``
and therefore Adam's fp16 failures (v flushes to 0 or overflows); it exists so an ablation can
switch hAdam off while keeping Kahan-gradients on.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .kahan import kahan_add_
from .layout import state_in_param_layouts_

__all__ = ["KahanAdam"]


class KahanAdam(Optimizer):
    """Adam (``exp_avg``, ``exp_avg_sq``) whose update is applied with Kahan summation.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        betas: ``(β1, β2)``.
        eps: ``ε`` added to the bias-corrected ``sqrt(v)``.

    State per parameter: ``step`` (python int), ``exp_avg``, ``exp_avg_sq``, ``kahan_comp``,
    all tensors in the parameter dtype.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"KahanAdam: invalid learning rate {lr}")
        if not eps >= 0.0:
            raise ValueError(f"KahanAdam: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"KahanAdam: betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as torch does; state tensors take their parameter's memory format (``layout.py``),
        so that the foreach lists keep one layout."""
        super().load_state_dict(state_dict)
        state_in_param_layouts_(self)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
            for param in group["params"]:
                if param.grad is not None:
                    buckets[(param.device, param.dtype)].append(param)
            for params in buckets.values():
                states = []
                for param in params:
                    state = self.state[param]
                    if not state:
                        state["step"] = 0
                        for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
                            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["step"] += 1
                    states.append(state)
                grads = [p.grad for p in params]
                exp_avgs = [s["exp_avg"] for s in states]
                exp_avg_sqs = [s["exp_avg_sq"] for s in states]
                steps = [s["step"] for s in states]

                torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)

                denoms = torch._foreach_sqrt(exp_avg_sqs)
                torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2**t) for t in steps])
                torch._foreach_add_(denoms, group["eps"])
                updates = torch._foreach_div(exp_avgs, denoms)
                torch._foreach_mul_(updates, [-group["lr"] / (1.0 - beta1**t) for t in steps])
                kahan_add_(params, updates, [s["kahan_comp"] for s in states])
        return loss
