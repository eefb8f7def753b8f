"""Kahan-momentum target updates (spec §4): failure modes 4 and 8 of §7, against float64."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch import nn

from pixelsac.lowp import HAdam, KahanEMA

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
    assert all(b.dtype == F16 for b in agent.critic_ema.buffers() if b.is_floating_point())
    assert {n for n, b in agent.critic_ema.named_buffers() if not b.is_floating_point()} == {
        "scale_shifts",
        "target_updates",
        "first_nonfinite",
    }
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


# --------------------------------------------------------- adaptive scale: no ceiling on θ
def scaled_ema_error(ema: KahanEMA, exact: torch.Tensor) -> torch.Tensor:
    """|θ̄ - EMA_float64| of a one-tensor pair, in units of the bound that holds for any K_i:
    ulp(K_i·θ)/K_i (the scaled copy's rounding and the omitted residue) + ulp(θ)/2."""
    theta_bar = ema.target_parameters()[0].detach().view(-1).double()
    k_i = float(ema.tensor_scales()[0])
    bound = fp16_ulp(k_i * exact) / k_i * 1.5 + fp16_ulp(exact) / 2
    return (theta_bar - exact).abs() / bound


def test_a_fixed_k_stops_beyond_its_ceiling_the_adaptive_scale_tracks_float64():
    """Critic weights of 8-40 (the full-size DrQ critic passed 6.55 = 65504 / K after ~4,850
    updates): the published K stops the run; the per-tensor power-of-two scale follows the
    float64 EMA within the rounding bound of its own K_i."""
    gen = torch.Generator().manual_seed(5)
    start = (8.0 + 32.0 * torch.rand(16, generator=gen, dtype=F64)).to(F16)
    with pytest.raises(FloatingPointError, match=r"\|θ\| must stay below 6.55"):
        KahanEMA(*make_pair(start), scale=K)
    source, target = make_pair(start)
    ema = KahanEMA(source, target, scale=K, adaptive_scale=True)
    assert float(ema.tensor_scales()[0]) == K / 32  # 40·K/16 = 25,000 > 16,376 >= 40·K/32 = 12,500
    thetas = []
    for step in range(1500):
        theta = (start.double() * (1 + 0.1 * step / 1500) + 1e-3 * torch.randn(16, generator=gen, dtype=F64)).to(F16)
        with torch.no_grad():
            source.weight.copy_(theta.view(1, -1))
        ema.update_(TAU)
        thetas.append(theta)
    exact = float64_ema(start, thetas)
    assert (scaled_ema_error(ema, exact) <= 1.0).all(), scaled_ema_error(ema, exact)
    assert ema.first_nonfinite_update() is None
    assert float(ema.peak_fraction()) <= 0.25 * (1 + 2 * TAU)


def test_the_scale_follows_a_weight_that_grows_through_the_ceiling_and_shrinks_back():
    """θ grows from 0.5-1 to 30-60 and back over 4,000 updates: K_i halves as it must and
    doubles back to K; the target tracks float64 throughout (each rescale is exact)."""
    gen = torch.Generator().manual_seed(6)
    base = (0.5 + 0.5 * torch.rand(8, generator=gen, dtype=F64)).to(F16)
    source, target = make_pair(base)
    ema = KahanEMA(source, target, scale=K, adaptive_scale=True, check_every_update=False)
    exact, seen_scales = base.double().clone(), set()
    for step in range(5500):
        growth = 1 + 59 * math.sin(math.pi * min(step, 4000) / 4000)  # 1 -> 60 -> 1, then held while θ̄ catches up
        theta = (base.double() * growth).to(F16)
        with torch.no_grad():
            source.weight.copy_(theta.view(1, -1))
        ema.update_(TAU)
        exact += TAU * (theta.double() - exact)
        seen_scales.add(float(ema.tensor_scales()[0]))
        if step % 500 == 499:
            assert (scaled_ema_error(ema, exact) <= 1.0).all(), (step, scaled_ema_error(ema, exact))
    assert min(seen_scales) <= K / 32 and float(ema.tensor_scales()[0]) == K
    assert ema.first_nonfinite_update() is None
    ema.check_finite()


def test_below_its_threshold_the_adaptive_scale_is_the_published_update_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    start = (0.05 * torch.randn(32, generator=gen, dtype=F64)).to(F16)
    pairs = [make_pair(start) for _ in range(2)]
    fixed = KahanEMA(*pairs[0], scale=K)
    adaptive = KahanEMA(*pairs[1], scale=K, adaptive_scale=True)
    for _ in range(200):
        change = (1e-3 * torch.randn(32, generator=gen, dtype=F64)).to(F16)
        for source, _ in pairs:
            with torch.no_grad():
                source.weight.add_(change.view(1, -1))
        fixed.update_(TAU)
        adaptive.update_(TAU)
    assert torch.equal(pairs[0][1].weight, pairs[1][1].weight)
    for a, b in zip(fixed.buffers(), adaptive.buffers()):
        assert torch.equal(a, b)


def test_the_first_failed_update_is_recorded_on_the_device_and_named_later():
    """With the check deferred (sync-free), a fixed K's overflow at update 5 is still reported as
    update 5 after ten more updates, and recording it read nothing on the host."""
    from dispatch_count import DispatchCount

    source, target = make_pair(torch.tensor([0.5, 6.0], dtype=F16))
    ema = KahanEMA(source, target, scale=K, check_every_update=False)
    with DispatchCount() as count:
        for step in range(1, 16):
            if step == 5:
                with torch.no_grad():
                    source.weight.fill_(7.0)  # K·7 = 70000 > 65504
            ema.update_(TAU)
    assert count.host_reads == 0, dict(count.read_sites)
    assert ema.first_nonfinite_update() == 5
    with pytest.raises(FloatingPointError, match=r"since target update 5 of 15.*must stay below 6.55"):
        ema.check_finite()


def test_an_adaptive_update_reads_nothing_on_the_host():
    from dispatch_count import DispatchCount

    source, target = make_pair(torch.tensor([0.5, 3.0, -20.0], dtype=F16))
    ema = KahanEMA(source, None, scale=K, adaptive_scale=True, derived_target=True, check_every_update=False)
    ema.update_(TAU)  # the derived target's first update flips a host-side flag
    with DispatchCount() as count:
        for _ in range(3):
            with torch.no_grad():
                source.weight.mul_(1.5)
            ema.update_(TAU)
            ema(torch.ones(1, 3, dtype=F16))
    assert count.host_reads == 0, dict(count.read_sites)


def test_a_state_from_before_the_adaptive_scale_loads_with_k_for_every_tensor():
    old_agent = Agent(seed=0)
    for _ in range(3):
        old_agent.critic_ema.update_(TAU)
    state = {
        k: v
        for k, v in old_agent.state_dict().items()
        if not k.endswith(("scale_shifts", "target_updates", "first_nonfinite"))
    }
    restored = Agent(seed=1)
    restored.critic_ema.adaptive_scale = True
    restored.load_state_dict(state)
    assert torch.equal(restored.critic_ema.scale_shifts, torch.zeros(4, dtype=torch.int32))
    assert restored.critic_ema.first_nonfinite_update() is None
    for a, b in zip(old_agent.critic_target.parameters(), restored.critic_target.parameters()):
        assert torch.equal(a, b)
    restored.critic_ema.update_(TAU)
    restored.critic_ema.check_finite()


def test_adaptive_scale_in_bf16_keeps_k():
    """bf16 has fp32's range: K·θ never nears it, the shifts stay 0 for any sensible θ."""
    start = torch.tensor([0.5, 40.0, -300.0], dtype=torch.bfloat16)
    source, target = make_pair(start)
    ema = KahanEMA(source, target, scale=K, adaptive_scale=True)
    ema.update_(TAU)
    assert float(ema.tensor_scales()[0]) == K


class _Critic(nn.Module):
    """A conv weight (channels-last, read in NHWC order), its bias and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.head = nn.Linear(6, 2)


def _growing_updates(ema: KahanEMA, source: nn.Module, between: Any = None) -> list:
    """60 target updates, each counted (``DispatchCount``), of a source whose weights grow by 10%
    before each (past H/K = 1.64, where the adaptive scale moves, and past a fixed K's 6.55);
    ``between(step)`` runs before each update."""
    from pixelsac.perf.opcount import DispatchCount

    counts = []
    for step in range(60):
        with torch.no_grad():
            for param in source.parameters():
                param.mul_(1.1).add_(torch.randn_like(param) * 0.01)
        if between is not None:
            between(step)
        with DispatchCount(sites=False) as count:
            ema.update_(TAU)
        counts.append(count)
    return counts


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "passes-of-7"])
@pytest.mark.parametrize("one_buffer", [False, True], ids=["separate-source", "source-in-one-buffer"])
@pytest.mark.parametrize("derived", [True, False], ids=["derived", "stored"])
def test_one_flat_buffer_per_kind_gives_the_per_tensor_forms_bits_in_a_few_kernels(
    derived, one_buffer, chunk, monkeypatch
):
    """θ̄_S and c as views into one buffer each (the default where the parameters share a dtype):
    60 adaptive updates of a source that grows through the headroom (so the shifts change and the
    scaled copies are rescaled) give, bit for bit, the per-tensor form's buffers, shifts and
    target; a buffer given other storage is copied back in. A source that lies in one buffer (as
    hAdam's compiled step keeps the critic) is read in place, not joined; passes of 7 elements
    (a CPU's cache-sized passes, across parameter boundaries) change no bit. On CUDA the per-tensor form runs its
    per-parameter scales tensor by tensor (the counter's model says how many kernels); the flat
    form runs none so. (Both multiply by the float32 τ; a CPU's in-place foreach would round it
    to fp16 first.)"""

    def run(flat: bool):
        torch.manual_seed(0)
        source = _Critic().half()
        if one_buffer:
            HAdam(source.parameters(), lr=1e-3, unbiased_moments=True, compiled=True)  # moves them into one
        target = None if derived else _Critic().half()
        ema = KahanEMA(
            source, target, scale=K, derived_target=derived, adaptive_scale=True, check_every_update=False,
            chunk_numel=chunk,
        )  # fmt: skip
        if not flat:
            monkeypatch.setattr(ema, "_flat_buffers", lambda: None)

        def move_a_buffer(step: int) -> None:
            if step == 30 and flat:
                name = next(iter(ema.scaled_params._buffers))
                setattr(ema.scaled_params, name, ema.scaled_params._buffers[name].clone())  # elsewhere now

        return ema, _growing_updates(ema, source, move_a_buffer)

    flat_ema, flat_counts = run(True)
    tensor_ema, tensor_counts = run(False)
    assert int(tensor_ema.scale_shifts.min()) < 0  # the scales moved
    for name, value in tensor_ema.state_dict().items():
        assert torch.equal(flat_ema.state_dict()[name], value), name
    for a, b in zip(flat_ema.target_parameters(), tensor_ema.target_parameters()):
        assert torch.equal(a, b)
    flat = flat_ema._flat
    scaled, comps = flat_ema._buffers_in_order()
    assert all(t.untyped_storage().data_ptr() == flat["scaled"].untyped_storage().data_ptr() for t in scaled)
    assert all(t.untyped_storage().data_ptr() == flat["comps"].untyped_storage().data_ptr() for t in comps)
    assert scaled[0].is_contiguous(memory_format=torch.channels_last)
    assert all(not c.per_tensor for c in flat_counts)
    assert (flat["source"] is not None) == one_buffer  # read in place
    assert all(("aten.cat.default" in c.ops) != one_buffer for c in flat_counts)
    assert all(sum(c.per_tensor.values()) >= 3 * 4 for c in tensor_counts)  # θ̄_S, c and K_i·θ: 4 tensors each
    if chunk is None:
        assert flat_counts[-1].kernels < tensor_counts[-1].kernels


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-k"])
@pytest.mark.parametrize("one_buffer", [False, True], ids=["separate-source", "source-in-one-buffer"])
@pytest.mark.parametrize("derived", [True, False], ids=["derived", "stored"])
def test_the_compiled_update_gives_the_flat_forms_bits_as_one_op(derived, one_buffer, adaptive):
    """``KahanEMA(compiled=True)`` (``perf.compile_optimizer``): 60 updates of a source that grows
    through the headroom (the adaptive shifts change, the copies are rescaled), then overflows
    (a fixed K meets its ceiling, the record names the update), give the eager flat form's
    buffers, shifts, counts, record and target bit for bit; each update dispatches the op, the
    peaks' foreach norm and the source's join (none where the source lies in one buffer), and no
    per-tensor loop; a derived target is one op too."""

    def run(compiled: bool):
        torch.manual_seed(0)
        source = _Critic().half()
        if one_buffer:
            HAdam(source.parameters(), lr=1e-3, unbiased_moments=True, compiled=True)
        target = None if derived else _Critic().half()
        ema = KahanEMA(
            source, target, scale=K, derived_target=derived, adaptive_scale=adaptive, check_every_update=False,
            compiled=compiled,
        )  # fmt: skip
        return ema, _growing_updates(ema, source)

    compiled_ema, compiled_counts = run(True)
    eager_ema, _ = run(False)
    if adaptive:
        assert int(eager_ema.scale_shifts.min()) < 0  # the scales moved
        assert eager_ema.first_nonfinite_update() is None
    else:
        assert eager_ema.first_nonfinite_update() is not None  # K·θ overflowed

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bit for bit, a NaN where the other has one
        return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])

    for name, value in eager_ema.state_dict().items():
        assert same(compiled_ema.state_dict()[name], value), name
    for a, b in zip(compiled_ema.target_parameters(), eager_ema.target_parameters()):
        assert same(a, b)
    last = compiled_counts[-1]
    assert last.ops["pixelsac_lowp.kahan_target_update.default"] == 1
    assert not last.per_tensor
    expected = 1 + adaptive + (not one_buffer) + (not derived)  # op, norm, join, target copy
    assert last.kernels == expected, dict(last.ops)
    if derived:  # the target's division, one op (the eager form spreads the scales first: 6 kernels)
        from pixelsac.perf.opcount import DispatchCount

        with DispatchCount(sites=False) as count:
            compiled_ema.target_parameters()
        assert count.kernels == 1 and count.ops["pixelsac_lowp.kahan_target_derive.default"] == 1, dict(count.ops)


def test_the_compiled_update_keeps_kahans_compensation():
    """The compensation is a round trip through fp16 that inductor would drop inside a kernel
    without ``emulate_precision_casts``. θ = 1 + 3 ulps, θ̄ = 1: each increment τ·K·(θ - θ̄) ≈ 0.15
    is a fiftieth of an ulp of θ̄_S = 10,000 (8), so only the compensation moves θ̄_S. After 300
    updates the compiled target sits within the tracking bound of float64's EMA (the uncompensated
    copy would still be 1, 2.3e-3 away: outside it), and its buffers equal the eager update's."""
    start = torch.full((64,), 1.0, dtype=F16)
    theta = start + 3 * float(fp16_ulp(start[0]))
    ema = KahanEMA(*make_pair(theta), scale=K, adaptive_scale=True, compiled=True)
    eager = KahanEMA(*make_pair(theta), scale=K, adaptive_scale=True)
    for module in (ema, eager):
        with torch.no_grad():
            module.scaled_params.weight.fill_(K)  # θ̄ = 1 (θ̄_S = K·1), behind θ by 3 ulps
            module.target.weight.fill_(1.0)
    for _ in range(300):
        ema.update_(TAU)
        eager.update_(TAU)
    for name, value in eager.state_dict().items():
        assert torch.equal(ema.state_dict()[name], value), name
    want = float64_ema(start, [theta] * 300)
    got = ema.target.weight.detach().view(-1).double()
    assert float((want - start.double()).abs().max()) > 2e-3  # where an uncompensated θ̄ (still 1) would be
    assert ((got - want).abs() <= tracking_tolerance(theta.double())).all()


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable numbers of their dtype lie between a and b (same sign), elementwise."""
    as_int = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return (a.view(as_int).long() - b.view(as_int).long()).abs()


def states_apart(compiled: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> list[str]:
    """The buffers where the compiled update left the eager one's values by more than the stated
    tolerance: on CUDA, Triton lowers an fp32 division to an approximate one (not IEEE's correctly
    rounded quotient), so a value may differ in its last bit: one ulp of its dtype, elementwise.
    Integer buffers (counters) must be equal."""
    apart = []
    for name, value in eager.items():
        other = compiled[name]
        if not value.is_floating_point():
            if not torch.equal(other, value):
                apart.append(name)
        elif int(ulps_apart(other.detach().cpu(), value.detach().cpu()).max()) > 1:
            apart.append(name)
    return apart


def test_the_gpu_tolerance_takes_one_ulp_and_refuses_two():
    x = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float16)
    up = torch.nextafter(x, torch.full_like(x, float("inf")))
    assert states_apart({"a": up, "n": torch.tensor(3)}, {"a": x, "n": torch.tensor(3)}) == []
    two = torch.nextafter(up, torch.full_like(x, float("inf")))
    assert states_apart({"a": two, "n": torch.tensor(3)}, {"a": x, "n": torch.tensor(4)}) == ["a", "n"]
    y = torch.tensor([0.1, 7.0], dtype=torch.float32)
    assert states_apart({"b": torch.nextafter(y, torch.zeros_like(y))}, {"b": y}) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_compiled_update_equals_the_flat_form_and_replays_in_a_cuda_graph():
    """On CUDA (triton kernels): 40 adaptive updates compiled equal the eager flat form's within
    one ulp per element (states_apart: the CPU's equality is bit for bit, CUDA's fp32 division
    under Triton is approximate), and the compiled update captured in a CUDA graph and replayed
    moves the buffers as the eager update does, with no host read inside."""
    device = torch.device("cuda")

    def make(compiled: bool) -> tuple[nn.Module, KahanEMA]:
        torch.manual_seed(0)
        source = _Critic().half().to(device)
        ema = KahanEMA(
            source, None, scale=K, derived_target=True, adaptive_scale=True, check_every_update=False,
            compiled=compiled,
        )  # fmt: skip
        return source, ema

    (source_a, compiled), (source_b, eager) = make(True), make(False)
    for _ in range(40):
        with torch.no_grad():
            for a, b in zip(source_a.parameters(), source_b.parameters()):
                a.mul_(1.1).add_(0.01)
                b.mul_(1.1).add_(0.01)
        compiled.update_(TAU)
        eager.update_(TAU)
    assert states_apart(compiled.state_dict(), eager.state_dict()) == []
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        compiled.update_(TAU)
    for _ in range(3):
        graph.replay()
        eager.update_(TAU)
    torch.cuda.synchronize()
    for name, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[name], value), name
