"""Kahan-momentum: a compensated soft (EMA) update of a target network.

The target update ``θ̄ <- θ̄ + τ(θ - θ̄)`` loses the whole increment in fp16 when ``τ(θ - θ̄)``
is below half an ulp of ``θ̄`` (θ≈0.03, θ-θ̄≈1e-5, τ=0.005: the increment is 5e-8, the ulp
1.5e-5), and θ̄ stops moving. Kahan-momentum keeps a scaled copy ``θ̄_S = K·θ̄`` (K = 1e4)
plus a Kahan buffer ``c``, all in the parameter dtype::

    u   = τ * (K*θ - θ̄_S)
    y   = u - c
    t   = θ̄_S + y
    c   = (t - θ̄_S) - y
    θ̄_S = t
    θ̄   = θ̄_S / K              # the copy used in forward passes

Scaling by K moves the increments out of the subnormal range; the Kahan buffer keeps what
still falls below an ulp of ``θ̄_S``. Constraint: ``|K·θ| < 65504`` in fp16, i.e. ``|θ| < 6.55``.

Derived target (``derived_target=True``; a memory saving beyond the paper): ``θ̄ = θ̄_S / K`` is
a function of state already kept, so it need not be stored. The target network is then evaluated
by running the *source* network with the parameters ``θ̄_S / K`` substituted
(``torch.func.functional_call``), computed when the target is used -- the same division, so the
same bits as the stored copy -- and freed after the forward pass. This saves one parameter-sized
tensor (for DrQ's critic, 8 MiB of fp16) at the cost of one elementwise division per use. Until
the first :meth:`update_` the target is ``θ`` itself (as the stored copy is at init): exact when,
as in SAC, the first target update follows the first source step before the target is used
again (a caller that steps the source several times first should call ``update_`` or keep the
stored copy).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from .finite import all_finite
from .kahan import kahan_add_

__all__ = ["KahanEMA"]


def _after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """A loaded state says whether θ̄ is still θ (one host read, at load time only)."""
    module._fresh = int(module.updates_applied) == 0


class _BufferBag(nn.Module):
    """Holds one buffer per target parameter, named after it (dots become ``__``)."""


def _buffer_name(param_name: str) -> str:
    return param_name.replace(".", "__")


class KahanEMA(nn.Module):
    """Keeps ``target`` an exponential moving average of ``source``, compensated in low precision.

    Args:
        source: the online network θ (e.g. the critic).
        target: the network θ̄ used in forward passes (e.g. the target critic); its parameters
            are overwritten in place, at init with θ and on every :meth:`update_`.
        scale: ``K``, the factor of the scaled copy ``θ̄_S = K·θ̄``.
        compensated: False gives the naive in-dtype EMA ``θ̄ += τ(θ - θ̄)`` with no extra
            buffers (the baseline).
        check_every_update: check ``K·θ`` after every :meth:`update_` (a host synchronisation
            each time). False leaves it to the caller's :meth:`check_finite` at a moment when the
            host waits anyway (e.g. logging): an overflowed ``θ̄_S`` stays non-finite, so a
            later check still sees it.
        derived_target: do not keep ``θ̄``; compute it from ``θ̄_S`` whenever the target runs
            (module docstring). Needs ``compensated=True``; ``target`` may then be None. Adds the
            buffer ``updates_applied`` (0 until the first update, then 1).

    With ``compensated=True`` the buffers ``scaled_params.<name>`` (θ̄_S) and
    ``kahan_comp.<name>`` (c) are registered on this module, in the parameters' dtype, so they
    appear in a parent module's ``state_dict`` and follow its ``.to()``. ``source`` and
    ``target`` are referenced, not registered: their parameters stay owned by whoever owns
    the networks.

    Raises:
        FloatingPointError: when ``K·θ`` is not finite at init, after an update (with
            ``check_every_update``) or in :meth:`check_finite`.
        ValueError: when source and target parameters do not match by name and shape.
    """

    def __init__(
        self,
        source: nn.Module,
        target: nn.Module,
        scale: float = 1e4,
        compensated: bool = True,
        check_every_update: bool = True,
        derived_target: bool = False,
    ) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"KahanEMA: scale K must be positive, got {scale}")
        if derived_target and not compensated:
            raise ValueError("KahanEMA: derived_target needs compensated=True (θ̄ is derived from the scaled copy)")
        self.derived_target = bool(derived_target)
        if target is None:
            if not self.derived_target:
                raise ValueError("KahanEMA: a target network is needed unless derived_target=True")
            target = source  # only its structure is used: parameters are names and shapes here
        # A tuple keeps nn.Module from registering them as submodules (no duplicate params).
        self._networks = (source, target)
        self.scale = float(scale)
        self.compensated = bool(compensated)
        self.check_every_update = bool(check_every_update)

        source_named = list(source.named_parameters())
        target_named = list(target.named_parameters())
        source_names = [name for name, _ in source_named]
        target_names = [name for name, _ in target_named]
        if source_names != target_names:
            raise ValueError(
                "KahanEMA: source and target parameters differ: "
                f"only in source {sorted(set(source_names) - set(target_names))}, "
                f"only in target {sorted(set(target_names) - set(source_names))}"
                + ("" if set(source_names) != set(target_names) else " (order differs)")
            )
        for (name, src), (_, tgt) in zip(source_named, target_named):
            if src.shape != tgt.shape:
                raise ValueError(
                    f"KahanEMA: shape mismatch for {name!r}: source {tuple(src.shape)}, target {tuple(tgt.shape)}"
                )
        self.param_names = source_names

        if not self.derived_target:
            with torch.no_grad():
                for (_, src), (_, tgt) in zip(source_named, target_named):
                    tgt.copy_(src)

        if self.compensated:
            self.scaled_params = _BufferBag()
            self.kahan_comp = _BufferBag()
            buffer_names = [_buffer_name(name) for name in source_names]
            if len(set(buffer_names)) != len(buffer_names):
                raise ValueError(f"KahanEMA: parameter names collide as buffer names: {buffer_names}")
            with torch.no_grad():
                for buffer_name, (_, src) in zip(buffer_names, source_named):
                    # K·θ in fp32 (exact enough), rounded once into the parameter dtype.
                    scaled = (src.detach().float() * self.scale).to(src.dtype)
                    self.scaled_params.register_buffer(buffer_name, scaled)
                    self.kahan_comp.register_buffer(buffer_name, torch.zeros_like(src))
            self.check_finite()
        if self.derived_target:
            # 0 until the first update_ (the target is θ itself then), 1 after; a buffer so that a
            # checkpoint remembers it, mirrored on the host so that forward never reads the device
            self.register_buffer("updates_applied", torch.zeros((), dtype=torch.int64))
            self._fresh = True
            self.register_load_state_dict_post_hook(_after_load)

    @property
    def source(self) -> nn.Module:
        return self._networks[0]

    @property
    def target(self) -> nn.Module | None:
        """The averaged network θ̄; its parameter objects are the ones updated in place (None
        with ``derived_target``: nothing holds θ̄ between uses)."""
        return None if self.derived_target else self._networks[1]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the target network θ̄ (derived from ``θ̄_S / K`` when it is not stored)."""
        if not self.derived_target:
            return self.target(*args, **kwargs)
        if self._fresh:
            return self.source(*args, **kwargs)
        scaled, _ = self._buffers_in_order()
        derived = torch._foreach_div(scaled, self.scale)  # the stored copy's very division: the same bits
        return functional_call(self.source, dict(zip(self.param_names, derived)), args, kwargs)

    def target_parameters(self) -> list[torch.Tensor]:
        """θ̄ as tensors: the stored target's parameters, or (derived) freshly computed copies."""
        if not self.derived_target:
            return list(self.target.parameters())
        if self._fresh:
            return [p.detach() for p in self.source.parameters()]
        scaled, _ = self._buffers_in_order()
        return list(torch._foreach_div(scaled, self.scale))

    def _buffers_in_order(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        names = [_buffer_name(name) for name in self.param_names]
        return (
            [getattr(self.scaled_params, n) for n in names],
            [getattr(self.kahan_comp, n) for n in names],
        )

    def check_finite(self) -> None:
        """Raise FloatingPointError if ``K·θ̄`` is not finite (one host sync; no-op uncompensated)."""
        if not self.compensated:
            return
        scaled, _ = self._buffers_in_order()
        if not scaled:
            return
        flags = torch.stack([all_finite(t).to(scaled[0].device) for t in scaled])
        if bool(flags.all()):
            return
        for name, tensor in zip(self.param_names, scaled):
            if not bool(all_finite(tensor)):
                raise FloatingPointError(
                    f"KahanEMA: K·θ is not finite for parameter {name!r} (K = {self.scale:g}, "
                    f"dtype {tensor.dtype}); |θ| must stay below "
                    f"{torch.finfo(tensor.dtype).max / self.scale:.4g}. Lower K or check θ."
                )

    @torch.no_grad()
    def update_(self, tau: float) -> None:
        """``θ̄ <- θ̄ + τ(θ - θ̄)``, Kahan-compensated on the K-scaled copy when enabled."""
        sources = [p for _, p in self.source.named_parameters()]
        targets = [] if self.derived_target else [p for _, p in self.target.named_parameters()]
        if not self.compensated:
            increments = torch._foreach_sub(sources, targets)
            torch._foreach_mul_(increments, tau)
            torch._foreach_add_(targets, increments)
            return
        scaled, comps = self._buffers_in_order()
        # u = τ (K θ - θ̄_S)
        updates = torch._foreach_mul(sources, self.scale)
        torch._foreach_sub_(updates, scaled)
        torch._foreach_mul_(updates, tau)
        kahan_add_(scaled, updates, comps)
        if self.check_every_update:
            self.check_finite()
        if self.derived_target:
            if self._fresh:
                self.updates_applied.fill_(1)
                self._fresh = False
            return
        # θ̄ = θ̄_S / K
        torch._foreach_copy_(targets, torch._foreach_div(scaled, self.scale))
