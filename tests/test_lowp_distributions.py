"""The squashed normal (spec §5, §6): failure modes 2, 3 and 6 of §7, against float64.

Measured on this CPU (torch 2.13): the fused fp16 kernels F.softplus and Normal.log_prob
compute in fp32 internally and round once, so they do not show every 2020 failure; the same
math composed of fp16 primitives does. Each test says which form it exercises.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, TransformedDistribution
from torch.distributions.transforms import TanhTransform

from pixelsac.lowp import SquashedNormal, stable_softplus, tanh_log_abs_det_jacobian

F16, F64 = torch.float16, torch.float64
U16 = 2.0**-11  # fp16 unit roundoff


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of fp16 numbers at |x| (normal range), in float64."""
    return torch.exp2(torch.floor(torch.log2(x.double().abs())) - 10)


def softplus_2020(z: torch.Tensor) -> torch.Tensor:
    """PyTorch's Softplus (threshold 20) written with fp16 primitives."""
    return torch.where(z > 20.0, z, torch.log1p(torch.exp(z)))


def log1m_tanh_sq_float64(u: torch.Tensor) -> torch.Tensor:
    """log(1 - tanh(u)²) in float64, via the same identity (exact enough in float64)."""
    u = u.double()
    return 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))


# ------------------------------------------------------------------------- failure mode 2
PRE_TANH_IN_DANGER = torch.tensor([-9.9, -9.0, -8.0, -7.0, -6.0, -5.6], dtype=F64)  # u ∈ [-10, -5.55)


def test_softplus_threshold_20_from_fp16_primitives_overflows():
    z = (-2.0 * PRE_TANH_IN_DANGER).to(F16).requires_grad_()  # z ∈ (11.1, 20]
    value = softplus_2020(z)
    value.sum().backward()
    assert torch.isinf(value).all()
    assert torch.isnan(z.grad).all()  # exp'(z)·0 = inf·0


def test_stable_softplus_is_finite_and_matches_float64():
    z = torch.linspace(-20.0, 30.0, 201, dtype=F64).to(F16).requires_grad_()
    value = stable_softplus(z)
    value.sum().backward()
    z64 = z.detach().double().requires_grad_()
    exact = F.softplus(z64, threshold=1000.0)
    exact.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(z.grad).all()
    # Above the threshold the identity errs by exp(-z) <= 4.5e-5, below an fp16 half-ulp there.
    assert ((value.double() - exact).abs() <= fp16_ulp(exact.clamp(min=1e-4)) + 4.6e-5).all()
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=4 * U16, atol=5e-5)


def test_fused_softplus_threshold_20_stays_finite_on_this_cpu():
    """Recorded, not a fix: this CPU kernel computes in fp32 and rounds once. A GPU kernel or
    another torch version may differ — the stable form does not depend on it."""
    z = (-2.0 * PRE_TANH_IN_DANGER).to(F16).requires_grad_()
    value = F.softplus(z)  # threshold 20, as pytorch_sac used it
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(z.grad).all()


def test_log_jacobian_with_the_fix_is_finite_and_matches_float64():
    u = PRE_TANH_IN_DANGER.to(F16).requires_grad_()
    value = tanh_log_abs_det_jacobian(u, softplus_fix=True)
    value.sum().backward()
    u64 = u.detach().double().requires_grad_()
    exact = log1m_tanh_sq_float64(u64)
    exact.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(u.grad).all()
    # 2·(log 2 - u - softplus(-2u)): u and softplus(-2u) ≈ |2u| are each rounded to fp16,
    # so allow two ulps of |2u| (the cancellation makes it absolute, not relative).
    tol = 2 * fp16_ulp(2 * u64.detach())
    assert ((value.double() - exact).abs() <= tol).all()
    torch.testing.assert_close(u.grad.double(), u64.grad, rtol=0, atol=4 * U16 * 2)
    # The 2020 form of the same identity, from primitives, is NaN in the backward.
    u.grad = None
    broken = 2.0 * (math.log(2.0) - u - softplus_2020(-2.0 * u))
    broken.sum().backward()
    assert torch.isnan(u.grad).all()


# ------------------------------------------------------------------------- failure mode 3
def sample_log_prob_grads(dtype: torch.dtype, normal_fix: bool, softplus_fix: bool, seed: int):
    """SAC-actor shaped: per-sample log σ = -5 (B × A), reparameterised sample, Σ log π."""
    loc = torch.zeros(512, 4, dtype=dtype, requires_grad=True)
    log_std = torch.full((512, 4), -5.0, dtype=dtype, requires_grad=True)
    dist = SquashedNormal(loc, log_std.exp(), normal_fix=normal_fix, softplus_fix=softplus_fix)
    torch.manual_seed(seed)
    action = dist.rsample()
    dist.log_prob(action).sum().backward()
    return log_std.grad, loc.grad


def test_2020_normal_log_prob_gives_non_finite_log_std_gradients_at_sigma_e_minus_5():
    # (x-μ)²/(2σ²): its backward forms (2σ²)² ≈ 8e-9, below fp16's subnormal floor; the
    # quotient overflows for |ε| >~ 3.
    log_std_grad, _ = sample_log_prob_grads(F16, normal_fix=False, softplus_fix=False, seed=0)
    assert not torch.isfinite(log_std_grad).all()
    # torch.distributions.Normal has the same form and fails the same way when the sample is
    # reparameterised. For a fixed x (measured on this CPU) it is finite while |x-μ|/σ <= 2
    # and overflows from 2.5 on: there ε²·(1/σ)/(2σ²)... exceeds 65504 in the backward.
    loc = torch.zeros(8, dtype=F16, requires_grad=True)
    log_std = torch.full((8,), -5.0, dtype=F16, requires_grad=True)
    noise = torch.tensor([0.5, -1.0, 2.0, -2.5, 3.0, -3.5, 4.0, -4.0], dtype=F16)
    x = loc + log_std.exp() * noise
    Normal(loc, log_std.exp()).log_prob(x).sum().backward()
    assert not torch.isfinite(log_std.grad).all()
    log_std.grad = None
    Normal(loc, log_std.exp()).log_prob(x.detach()).sum().backward()
    assert torch.isfinite(log_std.grad).tolist() == [True] * 3 + [False] * 5


def float64_log_prob_grads(noise: torch.Tensor, log_std_value: float = -5.0):
    """Exact reference on the same ε: d/d(log σ) and d/dμ of Σ log π(tanh(μ + σε))."""
    loc = torch.zeros(noise.shape, dtype=F64, requires_grad=True)
    log_std = torch.full(noise.shape, log_std_value, dtype=F64, requires_grad=True)
    u = loc + log_std.exp() * noise.double()
    log_prob = Normal(loc, log_std.exp()).log_prob(u) - log1m_tanh_sq_float64(u)
    log_prob.sum().backward()
    return log_std.grad, loc.grad


def test_stable_normal_log_prob_gradients_are_finite_and_match_float64():
    log_std_grad, loc_grad = sample_log_prob_grads(F16, normal_fix=True, softplus_fix=True, seed=0)
    assert torch.isfinite(log_std_grad).all() and torch.isfinite(loc_grad).all()
    torch.manual_seed(0)
    noise = torch.randn(512, 4, dtype=F16).double()  # the ε rsample drew
    assert noise.abs().max() > 3.5  # the region where the 2020 form fails
    ref_log_std_grad, ref_loc_grad = float64_log_prob_grads(noise)
    # The quadratic term's two gradient paths (through x and through σ) are each ≈ ε²/σ and
    # cancel exactly in exact arithmetic; in fp16 each carries a few roundings (~4u relative),
    # so the residual is <= 8u·ε² (measured max: 6e-3 at |ε| = 4).
    tol = 8 * U16 * noise**2 + 2 * U16
    err = (log_std_grad.double() - ref_log_std_grad).abs()
    assert (err <= tol).all(), (err / tol).max()
    # d log π / dμ = 2·tanh(u) ≈ 2σε (~0.01) is what is left after two paths of size |ε|/σ
    # cancel; it is added to one of them first, so fp16 knows it only to an ulp of |ε|/σ —
    # here that is coarser than the value itself (fp16 returns 0). A limit of the
    # reparameterised form at σ = e⁻⁵, not a NaN: in SAC the -∂Q/∂a path dominates μ's gradient.
    sigma = torch.tensor(-5.0, dtype=F16).exp().double()
    loc_err = (loc_grad.double() - ref_loc_grad).abs()
    assert (loc_err <= fp16_ulp(noise / sigma)).all()


# ------------------------------------------------------------------------- failure mode 6
def test_atanh_of_saturated_tanh_is_inf_in_fp16():
    assert torch.tanh(torch.tensor(6.0, dtype=F16)).item() == 1.0
    assert torch.isinf(torch.atanh(torch.tanh(torch.tensor(6.0, dtype=F16))))


def test_cached_pre_tanh_gives_finite_log_prob_matching_float64():
    loc = torch.full((64, 2), 6.0, dtype=F16, requires_grad=True)
    log_std = torch.full((64, 2), -1.0, dtype=F16, requires_grad=True)
    dist = SquashedNormal(loc, log_std.exp())
    torch.manual_seed(1)
    action = dist.rsample()
    assert (action == 1.0).any()  # saturated: atanh(action) would be inf
    log_prob = dist.log_prob(action)
    assert log_prob.shape == action.shape
    log_prob.sum().backward()
    assert torch.isfinite(log_prob).all()
    assert torch.isfinite(loc.grad).all() and torch.isfinite(log_std.grad).all()
    # float64 on the same pre-tanh sample u.
    u = dist._cached_pre_tanh.detach().double()
    scale64 = log_std.detach().double().exp()
    exact = Normal(loc.detach().double(), scale64).log_prob(u) - log1m_tanh_sq_float64(u)
    # |log π| ≈ 10-20 here and each term (≈|2u| ≈ 12, log σ, z²/2) is rounded to fp16.
    tol = 4 * fp16_ulp(2 * u)
    assert ((log_prob.double() - exact).abs() <= tol).all()


def test_log_prob_of_a_foreign_saturated_action_is_finite():
    dist = SquashedNormal(torch.zeros(3, dtype=F16), torch.ones(3, dtype=F16))
    action = torch.tensor([1.0, -1.0, 0.5], dtype=F16)  # not from this rsample: recovered
    log_prob = dist.log_prob(action)
    assert torch.isfinite(log_prob).all()  # atanh(±(1 - eps)), never atanh(±1)
    own = dist.rsample()
    # A copy is not the same tensor: recovered by atanh, not read from the cache.
    copy = own.clone()
    assert dist._pre_tanh_of(own) is dist._cached_pre_tanh
    assert dist._pre_tanh_of(copy) is not dist._cached_pre_tanh


# ---------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("normal_fix,softplus_fix", [(True, True), (False, False), (True, False)])
def test_float64_log_prob_equals_torch_tanh_transformed_normal(normal_fix, softplus_fix):
    gen = torch.Generator().manual_seed(2)
    loc = torch.randn(6, 3, generator=gen, dtype=F64)
    scale = torch.rand(6, 3, generator=gen, dtype=F64) + 0.05
    ours = SquashedNormal(loc, scale, normal_fix=normal_fix, softplus_fix=softplus_fix)
    reference = TransformedDistribution(Normal(loc, scale), [TanhTransform(cache_size=1)])
    action = ours.rsample((5,))
    assert action.shape == (5, 6, 3)
    u = ours._cached_pre_tanh
    torch.testing.assert_close(ours.log_prob(action), reference.log_prob(torch.tanh(u)), rtol=1e-9, atol=1e-9)


def test_distribution_interface():
    loc = torch.tensor([0.3, -2.0], dtype=F16)
    dist = SquashedNormal(loc, torch.tensor([0.1, 0.2], dtype=F16))
    assert torch.equal(dist.mean, torch.tanh(loc)) and torch.equal(dist.mode, torch.tanh(loc))
    assert dist.has_rsample and dist.batch_shape == (2,) and dist.event_shape == ()
    assert dist.sample((3,)).dtype == F16 and dist.sample((3,)).shape == (3, 2)
    assert dist.support.check(torch.tensor([1.0, -1.0])).all()
    # validate_args is off by default: an out-of-support value is clamped, not rejected.
    assert torch.isfinite(dist.log_prob(torch.tensor([1.5, -1.0], dtype=F16))).all()
    with pytest.raises(ValueError):
        SquashedNormal(loc, torch.tensor([-0.1, 0.2], dtype=F16), validate_args=True)


# ------------------------------------------- beyond the paper: loss-scaled gradients at small σ
# Measured while integrating (DrQ log σ bounds [-10, 2], batch 4, S = 1e4, α = 0.1): the
# upstream gradient of each log π is S·α/B = 250, and the spec's normal-fix form then overflows
# fp16 in the backward: its two cancelling paths are 250·|ε|/σ each, and -log σ computed from σ
# sends 250/σ through the exp. The scaler would back off, but only to a much smaller S.
UPSTREAM = 1e4 * 0.1 / 4


def loss_scaled_grads(dtype: torch.dtype, use_log_scale: bool, noise_form: bool, seed: int = 3):
    loc = torch.full((64, 2), 0.3, dtype=dtype, requires_grad=True)
    log_std = torch.full((64, 2), -8.0, dtype=dtype, requires_grad=True)
    if use_log_scale:
        dist = SquashedNormal(loc, log_scale=log_std, noise_form=noise_form)
    else:
        dist = SquashedNormal(loc, log_std.exp(), noise_form=noise_form)
    torch.manual_seed(seed)
    action = dist.rsample()
    log_prob = dist.log_prob(action)
    (UPSTREAM * log_prob).sum().backward()
    return log_prob.detach(), log_std.grad, loc.grad


def test_spec_normal_fix_overflows_under_loss_scaling_at_drq_sigma():
    _, log_std_grad, loc_grad = loss_scaled_grads(F16, use_log_scale=False, noise_form=False)
    assert not (torch.isfinite(log_std_grad).all() and torch.isfinite(loc_grad).all())


def test_log_scale_and_noise_form_stay_finite_and_match_float64_under_loss_scaling():
    _, log_std_grad, loc_grad = loss_scaled_grads(F16, use_log_scale=True, noise_form=True)
    assert torch.isfinite(log_std_grad).all() and torch.isfinite(loc_grad).all()
    torch.manual_seed(3)
    noise = torch.randn(64, 2, dtype=F16).double()  # what rsample drew
    loc = torch.full((64, 2), 0.3, dtype=F64, requires_grad=True)
    log_std = torch.full((64, 2), -8.0, dtype=F64, requires_grad=True)
    u = loc + log_std.exp() * noise
    exact = Normal(loc, log_std.exp()).log_prob(u) - log1m_tanh_sq_float64(u)
    (UPSTREAM * exact).sum().backward()
    # Each gradient is a handful of fp16 roundings of O(250) quantities: 8u relative.
    torch.testing.assert_close(log_std_grad.double(), log_std.grad, rtol=8 * U16, atol=0)
    torch.testing.assert_close(loc_grad.double(), loc.grad, rtol=8 * U16, atol=0)


def test_noise_form_and_log_scale_equal_the_spec_form_in_float64():
    spec = loss_scaled_grads(F64, use_log_scale=False, noise_form=False)
    ours = loss_scaled_grads(F64, use_log_scale=True, noise_form=True)
    for a, b in zip(spec, ours):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_noise_form_falls_back_for_a_foreign_action_and_arguments_are_checked():
    dist = SquashedNormal(torch.zeros(2), log_scale=torch.zeros(2), noise_form=True)
    foreign = torch.tensor([0.5, -0.5])
    expected = Normal(0.0, 1.0).log_prob(torch.atanh(foreign)) - log1m_tanh_sq_float64(torch.atanh(foreign)).float()
    torch.testing.assert_close(dist.log_prob(foreign), expected)
    with pytest.raises(ValueError, match="exactly one"):
        SquashedNormal(torch.zeros(2), torch.ones(2), log_scale=torch.zeros(2))
    with pytest.raises(ValueError, match="exactly one"):
        SquashedNormal(torch.zeros(2))
    with pytest.raises(ValueError, match="normal_fix"):
        SquashedNormal(torch.zeros(2), torch.ones(2), normal_fix=False, noise_form=True)
