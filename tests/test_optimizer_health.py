"""The optimizer-moments issue at the module level: an exact discount in every precision, and
optimizer state covered by the health check (in a module and in a real tiny run)."""

import subprocess
import sys

import pytest
import torch
from conftest import REPO, TESTS, TINY, cli_env
from overrides import merged
from test_module import fit, make_batch, make_module

from pixelsac.module import td_target
from pixelsac.precision import NumericalFailure


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_td_target_discounts_with_gamma_exactly(dtype):
    """r + γ·V̄ with γ = 0.99 exactly: rounded once from float64's value. The old form,
    ``not_terminal * γ`` first, multiplied by γ rounded to the dtype (fp16: 0.990234375)."""
    gen = torch.Generator().manual_seed(0)
    value = (1 + 999 * torch.rand(20_000, 1, generator=gen, dtype=torch.float64)).to(dtype)
    reward = torch.rand(20_000, 1, generator=gen, dtype=torch.float64).to(dtype)
    not_terminal = torch.ones(20_000, 1, dtype=dtype)
    exact = (reward.double() + 0.99 * value.double()).to(dtype)
    ours = td_target(reward, not_terminal, value, 0.99)
    old = reward + not_terminal * 0.99 * value
    # float32 arithmetic inside the op, then one rounding: float64's value rounded to the dtype
    # (in float32 itself γ and the product carry float32's own rounding: close, not equal)
    if dtype == torch.float32:
        torch.testing.assert_close(ours.double(), exact.double(), rtol=2e-7, atol=0)
    else:
        assert torch.equal(ours, exact)
    if dtype == torch.float16:
        assert (old != exact).double().mean() > 0.2  # γ = 0.990234375 moves a fifth of the targets
        effective = ((old.double() - reward.double()) / value.double()).mean()
        assert abs(float(effective) - 0.990234375) < 1e-4
    # a terminal transition bootstraps nothing, in every dtype
    assert torch.equal(td_target(reward, torch.zeros_like(not_terminal), value, 0.99), reward)


def test_nonfinite_optimizer_state_is_named_by_loss_and_kind():
    module = make_module("precision=fp16", "train.log_every_updates=2")
    module.on_fit_start = lambda: None
    fit(module, [make_batch(seed=0)])
    assert module.nonfinite_weight_groups() == []
    critic_opt = module._optimizers_by_loss["critic"]
    state = next(iter(critic_opt.state.values()))["exp_avg_root"]
    state[(0,) * state.dim()] = float("inf")  # any layout (conv weights are channels-last on a CPU)
    assert module.nonfinite_weight_groups() == ["critic optimizer exp_avg_root"]
    assert not module.weights_are_finite()  # so no checkpoint is written from this state
    with pytest.raises(NumericalFailure, match=r"non-finite critic optimizer exp_avg_root after update"):
        module.check_health({})


@pytest.mark.slow
def test_inf_optimizer_state_stops_a_tiny_run_with_exit_3(tmp_path):
    run_dir = tmp_path / "run"
    env = cli_env(TESTS)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "inject_inf_state.py"),
            *merged(*TINY, "precision=fp16", "train.eval_every_frames=100000", f"run_dir={run_dir}"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 3, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "non-finite critic optimizer exp_avg_root after update" in line, line
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()
