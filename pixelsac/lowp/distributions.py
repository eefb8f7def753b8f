"""A tanh-squashed diagonal Gaussian whose log-density is safe in fp16.

The SAC policy samples ``u = μ + σ·ε`` and acts with ``a = tanh(u)``. Its log-density is::

    log π(a) = log N(u; μ, σ) - log(1 - tanh(u)²)

Two fp16 hazards and their fixes (Björck et al., ICML 2021):

* softplus-fix: ``log(1 - tanh(u)²) = 2·(log 2 - u - softplus(-2u))``. Softplus written as
  ``log1p(exp(z))`` with PyTorch's threshold 20 overflows ``exp(z)`` for z in (11.09, 20]
  (u in [-10, -5.55)) and the backward gives inf/inf = NaN. Threshold 10 fixes it (the error
  ``log1p(exp(z)) - z ≈ exp(-z) = 4.5e-5`` at z = 10 is far below the fp16 ulp there).
* normal-fix: ``log N(x; μ, σ) = -0.5·((x - μ)/σ)² - log σ - 0.5·log 2π``, dividing before
  squaring. The form ``-(x - μ)²/(2σ²)`` needs σ² (4.5e-5 at σ = e⁻⁵, near the subnormal
  range) and, in the backward, ``(2σ²)²`` which overflows the quotient: inf/NaN gradients.

And the log-density is computed from the cached pre-tanh ``u`` of the sample: fp16
``tanh(u) == 1.0`` for u >= 5 (roughly) and ``atanh(1) = inf``.

Beyond the paper (opt-in): under compound loss scaling the upstream gradient of each log π is
``S·α/B`` (250 at S = 1e4, α = 0.1, B = 4), and at small σ (DrQ allows log σ = -10) the
normal-fix form still overflows in the backward. ``log_scale=`` (take log σ, not σ) and
``noise_form=True`` (quadratic term ``-0.5·ε²`` from the cached noise) keep every gradient path
bounded by the upstream gradient times O(|ε|); both are exact rewrites.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributions import Distribution, constraints
from torch.distributions.utils import broadcast_all

__all__ = [
    "SquashedNormal",
    "stable_softplus",
    "gaussian_log_prob",
    "tanh_log_abs_det_jacobian",
]

_HALF_LOG_TWO_PI = 0.5 * math.log(2.0 * math.pi)
_LOG_TWO = math.log(2.0)


def stable_softplus(z: torch.Tensor, threshold: float = 10.0) -> torch.Tensor:
    """``softplus(z) = log(1 + exp(z))``, switching to ``z`` above ``threshold``.

    Composed of primitives so that no intermediate can overflow whatever the kernel's
    internal precision: ``exp`` only ever sees ``min(z, threshold)`` (exp(10) = 22026 < 65504),
    and the unselected branch gets a zero (not NaN) gradient.
    """
    return torch.where(z > threshold, z, torch.log1p(torch.exp(z.clamp(max=threshold))))


def gaussian_log_prob(
    x: torch.Tensor,
    loc: torch.Tensor,
    scale: torch.Tensor,
    stable: bool = True,
    log_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Elementwise ``log N(x; loc, scale)``.

    ``stable=True``: ``-0.5·((x - μ)/σ)² - log σ - 0.5·log 2π`` (divide before squaring).
    ``stable=False``: ``-(x - μ)²/(2σ²) - log σ - log sqrt(2π)``, torch ``Normal.log_prob``'s form.
    ``log σ`` is ``log_scale`` when given, else ``scale.log()``.
    """
    log_sigma = scale.log() if log_scale is None else log_scale
    if stable:
        standardized = (x - loc) / scale
        return -0.5 * standardized * standardized - log_sigma - _HALF_LOG_TWO_PI
    variance = scale**2
    return -((x - loc) ** 2) / (2 * variance) - log_sigma - math.log(math.sqrt(2 * math.pi))


def tanh_log_abs_det_jacobian(
    pre_tanh: torch.Tensor, softplus_fix: bool = True, softplus_threshold: float = 10.0
) -> torch.Tensor:
    """``log(1 - tanh(u)²) = 2·(log 2 - u - softplus(-2u))``, elementwise.

    ``softplus_fix=False`` uses ``F.softplus`` with torch's default threshold 20, as
    pytorch_sac did; whether that overflows in fp16 depends on the kernel's internal precision.
    """
    z = -2.0 * pre_tanh
    softplus = stable_softplus(z, softplus_threshold) if softplus_fix else F.softplus(z)
    return 2.0 * (_LOG_TWO - pre_tanh - softplus)


class SquashedNormal(Distribution):
    """``a = tanh(u)``, ``u ~ N(loc, scale²)`` elementwise (diagonal).

    Args:
        loc: ``μ``.
        scale: ``σ`` (positive). Give either ``scale`` or ``log_scale``.
        softplus_fix: use the threshold-``softplus_threshold`` softplus in the log-Jacobian.
        normal_fix: use the divide-before-square Gaussian log-density.
        softplus_threshold: 10 in the paper.
        validate_args: as for torch distributions; off by default (it costs syncs).
        log_scale: ``log σ`` instead of ``scale``; the ``-log σ`` term then uses it directly,
            so its gradient is ``-1`` rather than ``-1/σ`` (which, times a loss-scaled upstream
            gradient, overflows fp16 once σ is small: e.g. 1e4·0.1/4 / e⁻⁸ > 65504).
        noise_form: on the cached path, compute the quadratic term from the sampled noise,
            ``-0.5·ε²``, instead of ``-0.5·((u - μ)/σ)²`` (requires ``normal_fix``). Equal in
            exact arithmetic, values and total gradients alike; it drops the two gradient
            paths of size ``|ε|/σ`` that cancel in the spec's form and overflow fp16 under loss
            scaling when σ is small. An extension of the paper's normal-fix (off by default).

    ``log_prob(a)`` is per dimension (shape of ``a``); sum over the last dim for the action
    log-likelihood. It reuses the pre-tanh sample when ``a`` is the tensor returned by this
    distribution's latest :meth:`rsample`; otherwise it recovers ``u = atanh(a)`` with ``a``
    clamped to ``±(1 - eps)`` of its dtype, which is finite but, near saturation, inexact.
    """

    arg_constraints = {"loc": constraints.real, "scale": constraints.positive}
    support = constraints.interval(-1.0, 1.0)
    has_rsample = True

    def __init__(
        self,
        loc: torch.Tensor,
        scale: torch.Tensor | None = None,
        softplus_fix: bool = True,
        normal_fix: bool = True,
        softplus_threshold: float = 10.0,
        validate_args: bool | None = False,
        *,
        log_scale: torch.Tensor | None = None,
        noise_form: bool = False,
    ) -> None:
        if (scale is None) == (log_scale is None):
            raise ValueError("SquashedNormal: give exactly one of scale and log_scale")
        if noise_form and not normal_fix:
            raise ValueError("SquashedNormal: noise_form refines normal_fix; it needs normal_fix=True")
        if log_scale is not None:
            self.loc, self.log_scale = broadcast_all(loc, log_scale)
            self.scale = self.log_scale.exp()
        else:
            self.loc, self.scale = broadcast_all(loc, scale)
            self.log_scale = None
        self.softplus_fix = softplus_fix
        self.normal_fix = normal_fix
        self.softplus_threshold = softplus_threshold
        self.noise_form = noise_form
        self._cached_action: torch.Tensor | None = None
        self._cached_pre_tanh: torch.Tensor | None = None
        self._cached_noise: torch.Tensor | None = None
        super().__init__(batch_shape=self.loc.shape, validate_args=validate_args)

    @property
    def mean(self) -> torch.Tensor:
        """``tanh(loc)``: the deterministic action (not the true mean of the squashed law)."""
        return torch.tanh(self.loc)

    @property
    def mode(self) -> torch.Tensor:
        return torch.tanh(self.loc)

    def rsample(self, sample_shape: torch.Size | tuple[int, ...] = ()) -> torch.Tensor:
        shape = self._extended_shape(torch.Size(sample_shape))
        noise = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        pre_tanh = self.loc + self.scale * noise
        action = torch.tanh(pre_tanh)
        self._cached_action, self._cached_pre_tanh, self._cached_noise = action, pre_tanh, noise
        return action

    def _is_cached(self, action: torch.Tensor) -> bool:
        return action is self._cached_action and self._cached_pre_tanh is not None

    def _pre_tanh_of(self, action: torch.Tensor) -> torch.Tensor:
        if self._is_cached(action):
            return self._cached_pre_tanh
        # Never atanh(±1) = ±inf: the largest usable |a| is 1 - eps of the dtype.
        bound = 1.0 - torch.finfo(action.dtype).eps
        return torch.atanh(action.clamp(-bound, bound))

    def _log_normal(self, pre_tanh: torch.Tensor, cached: bool) -> torch.Tensor:
        if self.noise_form and cached:
            noise = self._cached_noise
            log_scale = self.scale.log() if self.log_scale is None else self.log_scale
            return -0.5 * noise * noise - log_scale - _HALF_LOG_TWO_PI
        return gaussian_log_prob(pre_tanh, self.loc, self.scale, stable=self.normal_fix, log_scale=self.log_scale)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """``log N(u; μ, σ) - log(1 - tanh(u)²)`` per dimension, with ``a = tanh(u)``."""
        if self._validate_args:
            self._validate_sample(value)
        cached = self._is_cached(value)
        pre_tanh = self._pre_tanh_of(value)
        log_normal = self._log_normal(pre_tanh, cached)
        log_jacobian = tanh_log_abs_det_jacobian(
            pre_tanh, softplus_fix=self.softplus_fix, softplus_threshold=self.softplus_threshold
        )
        return log_normal - log_jacobian
