"""fp16's subnormals against float64: stochastic rounding there, and moments that must decay.

Below 2^-14 fp16 keeps a fixed grid of 2^-24. A moment held in ×S units sits there whenever its
gradients are small against the loss scale, and rounding to nearest cannot shrink it: ``RN(0.9·m)
= m`` for ``m`` of 1-4 grid steps, ``RN(sqrt(β2)·s) = s`` for every subnormal ``s``. Float64 is
the judge: the stochastically rounded value is right on average, the value rounded to nearest is
not, and hAdam's first moment decays as float64's does only with ``stochastic_first_moment``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pixelsac.lowp import HAdam
from pixelsac.lowp.rounding import mix_key, stochastic_round

F16, F32, F64 = torch.float16, torch.float32, torch.float64
GRID = 2.0**-24  # fp16's subnormal spacing
BETAS = (0.9, 0.999)
ROOT_FACTOR = (1 - BETAS[0]) / math.sqrt(1 - BETAS[1])


@pytest.mark.parametrize("steps", [0.3, 3.6, -2.7, 499.75, 1023.5])
def test_stochastic_rounding_is_unbiased_on_the_subnormal_grid(steps):
    """Values between two subnormals (and just below the smallest normal, 1024 steps): the mean of
    200,000 roundings is the value to within 4 standard errors, each lands on a neighbour, while
    rounding to nearest is off by at least a fifth of a step."""
    value = torch.tensor(steps * GRID, dtype=F32)
    n = 200_000
    rounded = stochastic_round(value.expand(n).contiguous(), F16, key=mix_key(4, 1))
    in_steps = rounded.double() / GRID
    assert set(in_steps.unique().tolist()) == {math.floor(steps), math.ceil(steps)}
    fraction = steps - math.floor(steps)
    standard_error = math.sqrt(fraction * (1 - fraction) / n)
    assert abs(float(in_steps.mean()) - steps) < 4 * standard_error + 2**-13
    assert abs(float(value.to(F16).double()) / GRID - steps) >= 0.2  # to nearest: biased


def test_zeros_keep_their_sign_and_normal_values_are_untouched_by_the_subnormal_path():
    x = torch.tensor([0.0, -0.0, 2.0**-14, -(2.0**-14), 1.0, 65504.0, float("inf"), float("nan")])
    out = stochastic_round(x, F16, key=9)
    assert torch.equal(torch.signbit(out[:2]), torch.tensor([False, True])) and bool((out[:2] == 0).all())
    assert torch.equal(out[2:6], x[2:6].to(F16)) and out[6] == float("inf") and out[7].isnan()


@pytest.mark.parametrize(
    "start, decay, steps",
    [(4.0, BETAS[0], 40), (500.0, math.sqrt(BETAS[1]), 2000)],
    ids=["first moment: 4 steps, x0.9", "root moment: 500 steps, x sqrt(0.999)"],
)
def test_a_decaying_subnormal_state_follows_float64_only_when_rounded_stochastically(start, decay, steps):
    """``x <- round(decay·x)`` with no new gradient, as a moment whose gradient has gone quiet:
    float64 decays geometrically; stochastically rounded (a fresh key each step) the mean over
    20,000 elements follows it, rounded to nearest it never moves."""
    n = 20_000
    stochastic = torch.full((n,), start * GRID, dtype=F16)
    nearest = stochastic.clone()
    for step in range(steps):
        stochastic = stochastic_round(stochastic.float() * decay, F16, key=mix_key(11, step))
        nearest = (nearest.float() * decay).to(F16)
    expected = start * decay**steps
    assert float(nearest.double().mean()) / GRID == start
    assert float(stochastic.double().mean()) / GRID == pytest.approx(expected, rel=0.05, abs=0.02)


def quiet_gradient_displacement(stochastic_first_moment: bool, quiet_steps: int = 150) -> tuple[float, float]:
    """A weight per element (20,000 alike) takes one step on a gradient small enough that its
    ``m = 0.1·g`` is 3.5 subnormal steps, then ``quiet_steps`` steps on zero gradients. Returns the
    mean displacement and float64 Adam's (ε in hAdam's units, as its docstring maps it)."""
    n, lr, eps = 20_000, 1e-3, 1e-4
    grad0 = 35 * GRID  # (1-β1)·g = 3.5 grid steps
    param = torch.nn.Parameter(torch.full((n,), 0.5, dtype=F16))
    optimizer = HAdam(
        [param],
        lr=lr,
        betas=BETAS,
        eps=eps,
        unbiased_moments=True,
        stochastic_first_moment=stochastic_first_moment,
        seed=5,
    )
    judge = torch.nn.Parameter(torch.full((1,), 0.5, dtype=F64))
    reference = torch.optim.Adam([judge], lr=lr, betas=BETAS, eps=eps / ROOT_FACTOR)
    for step in range(1 + quiet_steps):
        grad = grad0 if step == 0 else 0.0
        param.grad = torch.full_like(param, grad)
        judge.grad = torch.full_like(judge, grad)
        optimizer.step()
        reference.step()
    return float(param.detach().double().mean()) - 0.5, float(judge.detach()[0]) - 0.5


def test_hadam_first_moment_decays_like_float64_only_when_rounded_stochastically():
    """After the gradient goes quiet float64's step dies away with its first moment (0.9 a step);
    hAdam's ``m`` rounded to nearest stays at 3-4 subnormal steps and keeps stepping the weight
    -- several times float64's displacement after 150 quiet steps and growing --, rounded
    stochastically it decays and the weight lands where float64's does."""
    nearest, judge = quiet_gradient_displacement(False)
    stochastic, judge_again = quiet_gradient_displacement(True)
    assert judge == judge_again and judge < 0
    assert stochastic / judge == pytest.approx(1.0, abs=0.1)
    assert nearest / judge > 3.0
