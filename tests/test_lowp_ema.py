"""Kahan-momentum target updates (spec §4): failure modes 4 and 8 of §7, against float64."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from pixelsac.lowp import KahanEMA

F16, F64 = torch.float16, torch.float64
K = 1e4
TAU = 0.005


def fp16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of fp16 numbers at |x| (normal range), in float64."""
    return torch.exp2(torch.floor(torch.log2(x.double().abs())) - 10)


def tracking_tolerance(theta: torch.Tensor, kahan_sum_bound: float = 0.0) -> torch.Tensor:
    """How far Kahan-momentum may sit from the float64 EMA of the same fp16 θ.

    K·θ is rounded to fp16 (the average converges to round(Kθ)/K: up to ulp(Kθ)/2K away);
    θ̄_S omits the Kahan residue c (|c| <= ulp(θ̄_S)/2, another ulp(Kθ)/2K); θ̄_S/K is
    rounded (ulp(θ)/2); plus Kahan's own bound 2u·Σ|u_i| / K.
    """
    return fp16_ulp(K * theta) / K + fp16_ulp(theta) / 2 + kahan_sum_bound


def make_pair(values: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    source = nn.Linear(values.numel(), 1, bias=False).to(values.dtype)
    target = nn.Linear(values.numel(), 1, bias=False).to(values.dtype)
    with torch.no_grad():
        source.weight.copy_(values.view(1, -1))
    return source, target


def float64_ema(start: torch.Tensor, thetas: list[torch.Tensor]) -> torch.Tensor:
    ema = start.double().clone()
    for theta in thetas:
        ema += TAU * (theta.double() - ema)
    return ema


# ------------------------------------------------------------------------- failure mode 4
def test_naive_target_does_not_move_kahan_momentum_reaches_the_float64_ema():
    gen = torch.Generator().manual_seed(0)
    start = (0.028 + 0.004 * torch.rand(16, generator=gen, dtype=F64)).to(F16)  # θ ≈ 0.03
    gap = 1e-5 + 9e-5 * torch.rand(16, generator=gen, dtype=F64)  # θ - θ̄ ≈ 1e-5 (1-7 ulps)
    theta = (start.double() + gap).to(F16)
    gap = theta.double() - start.double()  # what fp16 θ actually holds: 1-7 ulps
    assert (gap > 0).all()
    runs = {}
    for compensated in (False, True):
        source, target = make_pair(start)
        ema = KahanEMA(source, target, scale=K, compensated=compensated)
        with torch.no_grad():
            source.weight.copy_(theta.view(1, -1))
        for _ in range(2000):
            ema.update_(TAU)
        runs[compensated] = target.weight.detach().view(-1).double()
    exact = float64_ema(start, [theta] * 2000)  # within 4.4e-5 of the gap from θ
    # Naive fp16: τ(θ - θ̄) <= 5e-7, far below half an ulp (7.6e-6) — θ̄ never moves.
    assert torch.equal(runs[False], start.double())
    assert ((runs[False] - exact).abs() > 0.9 * gap).all()
    err = (runs[True] - exact).abs()
    assert (err <= tracking_tolerance(theta)).all(), err / tracking_tolerance(theta)
    assert err.mean() < 0.3 * gap.mean()


def test_kahan_momentum_tracks_a_drifting_source_for_thousands_of_steps():
    gen = torch.Generator().manual_seed(1)
    start = (0.02 + 0.02 * torch.rand(16, generator=gen, dtype=F64)).to(F16)
    drift = 1e-6 * torch.where(torch.rand(16, generator=gen) < 0.5, -1.0, 1.0).double()
    steps = 3000
    # θ drifts by 1e-6 per step (as under training), stored in fp16 each step.
    thetas = [(start.double() + k * drift).to(F16) for k in range(1, steps + 1)]
    naive_pair, kahan_pair = make_pair(start), make_pair(start)
    naive = KahanEMA(*naive_pair, scale=K, compensated=False)
    kahan = KahanEMA(*kahan_pair, scale=K, compensated=True)
    exact = start.double().clone()
    sum_abs_updates = torch.zeros(16, dtype=F64)
    worst_ratio = 0.0
    for k, theta in enumerate(thetas, start=1):
        for source, _ in (naive_pair, kahan_pair):
            with torch.no_grad():
                source.weight.copy_(theta.view(1, -1))
        naive.update_(TAU)
        kahan.update_(TAU)
        sum_abs_updates += TAU * (K * theta.double() - K * exact).abs()
        exact += TAU * (theta.double() - exact)
        if k % 500 == 0:
            tol = tracking_tolerance(theta, 2 * 2.0**-11 * sum_abs_updates / K)
            err = (kahan_pair[1].weight.detach().view(-1).double() - exact).abs()
            worst_ratio = max(worst_ratio, (err / tol).max().item())
    assert worst_ratio <= 1.0, worst_ratio
    # The float64 target lags θ by drift/τ = 2e-4; the naive fp16 one waits until τ(θ - θ̄)
    # exceeds half an ulp, i.e. lags ~1.5e-3 — most of the 3e-3 the source travelled.
    naive_err = (naive_pair[1].weight.detach().view(-1).double() - exact).abs()
    assert (naive_err > 5e-4).all(), naive_err


# ------------------------------------------------------------------------- failure mode 8
def test_scaled_copy_overflow_is_detected_at_init():
    source, target = make_pair(torch.tensor([0.5, 6.6], dtype=F16))  # K·6.6 = 66000 > 65504
    with pytest.raises(FloatingPointError, match=r"'weight'.*K = 10000"):
        KahanEMA(source, target, scale=K)
    ok_source, ok_target = make_pair(torch.tensor([0.5, 6.5], dtype=F16))  # 65000 fits
    KahanEMA(ok_source, ok_target, scale=K)


def test_scaled_copy_overflow_is_detected_after_an_update():
    source, target = make_pair(torch.tensor([0.5, 6.0], dtype=F16))
    ema = KahanEMA(source, target, scale=K)
    ema.update_(TAU)
    with torch.no_grad():
        source.weight.fill_(7.0)
    with pytest.raises(FloatingPointError, match="weight"):
        ema.update_(TAU)


# ---------------------------------------------------------------------------- structure
class Agent(nn.Module):
    """A parent module owning critic and target, with the EMA as a submodule."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.critic = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).half()
        self.critic_target = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).half()
        self.critic_ema = KahanEMA(self.critic, self.critic_target, scale=K)


def test_buffers_are_readable_fp16_state_and_params_are_not_duplicated():
    agent = Agent(seed=0)
    state = agent.state_dict()
    keys = set(state)
    assert all(torch.is_tensor(v) for v in state.values())  # no extra (non-tensor) state
    assert "critic_ema.scaled_params.0__weight" in keys
    assert "critic_ema.kahan_comp.2__bias" in keys
    assert not any(k.startswith("critic_ema.") and "critic" in k[len("critic_ema.") :] for k in keys)
    assert len(list(agent.parameters())) == 8  # critic + target only
    assert all(b.dtype == F16 for b in agent.critic_ema.buffers())
    for p, q in zip(agent.critic.parameters(), agent.critic_target.parameters()):
        assert torch.equal(p, q)  # θ̄ = θ at init
    assert agent.critic_ema.target is agent.critic_target


def test_target_parameters_are_updated_in_place():
    agent = Agent(seed=0)
    weight = agent.critic_target[0].weight
    with torch.no_grad():
        agent.critic[0].weight.add_(0.5)
    agent.critic_ema.update_(0.5)
    assert agent.critic_target[0].weight is weight
    assert not torch.equal(weight, agent.critic[0].weight - 0.5)


def test_naive_mode_has_no_buffers():
    agent_src, agent_tgt = make_pair(torch.tensor([0.1, 0.2], dtype=F16))
    ema = KahanEMA(agent_src, agent_tgt, compensated=False)
    assert list(ema.buffers()) == []


def test_mismatched_networks_are_rejected():
    with pytest.raises(ValueError, match="shape"):
        KahanEMA(nn.Linear(3, 4), nn.Linear(3, 5))
    with pytest.raises(ValueError, match="differ"):
        KahanEMA(nn.Linear(3, 4), nn.Linear(3, 4, bias=False))


def test_state_dict_round_trip_restores_buffers_bitwise():
    original = Agent(seed=0)

    def train_step(agent: Agent, k: int) -> None:
        with torch.no_grad():
            for i, p in enumerate(agent.critic.parameters()):
                torch.manual_seed(100 * k + i)
                p.add_(1e-3 * torch.randn(p.shape).half())
        agent.critic_ema.update_(TAU)

    for k in range(20):
        train_step(original, k)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    restored = Agent(seed=1)  # different weights until loaded
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for (name, a), (_, b) in zip(original.state_dict().items(), restored.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
    assert any(b.abs().sum() > 0 for b in restored.critic_ema.kahan_comp.buffers())
    for k in range(20, 40):
        train_step(original, k)
        train_step(restored, k)
    for (name, a), (_, b) in zip(original.state_dict().items(), restored.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


# ------------------------------------------------------------------ derived target (memory)
def test_a_derived_target_runs_bitwise_like_the_stored_copy():
    gen = torch.Generator().manual_seed(3)
    start = (0.05 * torch.randn(8, generator=gen, dtype=F64)).to(F16)
    source_a, target_a = make_pair(start)
    source_b, _ = make_pair(start)
    stored = KahanEMA(source_a, target_a, scale=K)
    derived = KahanEMA(source_b, None, scale=K, derived_target=True)
    assert derived.target is None and "updates_applied" in dict(derived.named_buffers())
    x = torch.randn(3, 8, generator=gen).to(F16)
    assert torch.equal(stored(x), derived(x))  # before any update: θ̄ = θ exactly
    for step in range(50):
        change = (1e-4 * torch.randn(8, generator=gen, dtype=F64)).to(F16)
        with torch.no_grad():
            source_a.weight.add_(change)
            source_b.weight.add_(change)
        stored.update_(TAU)
        derived.update_(TAU)
        assert torch.equal(stored(x), derived(x)), step
    assert torch.equal(derived.target_parameters()[0], target_a.weight)
    # a derived state round-trips, "updated" flag included
    restored = KahanEMA(make_pair(start)[0], None, scale=K, derived_target=True)
    restored.load_state_dict(derived.state_dict())
    assert torch.equal(restored.target_parameters()[0], target_a.weight)


def test_derived_target_needs_the_scaled_copy():
    source, _ = make_pair(torch.zeros(4, dtype=F16))
    with pytest.raises(ValueError, match="derived_target needs compensated"):
        KahanEMA(source, None, compensated=False, derived_target=True)
    with pytest.raises(ValueError, match="target network is needed"):
        KahanEMA(source, None)
