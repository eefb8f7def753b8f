"""Branching an fp32 checkpoint into fp16 or fp32 continuations (pixelsac/branching.py, tools/branch.py)."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, cli_env

from pixelsac import checkpoint as ckpt
from pixelsac.branching import branch_checkpoint, loss_scale_for
from pixelsac.module import SACModule

sys.path.insert(0, str(REPO / "tools"))
import verdict  # noqa: E402


@pytest.fixture(scope="module")
def fp32_checkpoint(tiny_fp32_run) -> dict:
    return ckpt.load(tiny_fp32_run.run_dir, prefer="last")


def test_an_fp32_branch_without_a_continuation_seed_is_the_checkpoint_itself(fp32_checkpoint):
    branched = branch_checkpoint(fp32_checkpoint, "fp32")
    for name, value in fp32_checkpoint["state_dict"].items():
        assert torch.equal(branched["state_dict"][name], value)
    assert branched["optimizer_states"] is fp32_checkpoint["optimizer_states"]
    assert branched["callbacks"] == fp32_checkpoint["callbacks"]


def test_fp16_branch_holds_fp32_state_rounded_once_in_loss_scale_units(fp32_checkpoint):
    branched = branch_checkpoint(fp32_checkpoint, "fp16")
    state, source = branched["state_dict"], fp32_checkpoint["state_dict"]
    for name in ("critic.q1.0.weight", "actor.policy.0.weight", "log_alpha"):
        assert state[name].dtype == torch.float16 and torch.equal(state[name], source[name].half())
    scales = {loss: s["scale"] for loss, s in branched["pixelsac"]["scalers"].items()}
    for scale, converted, stored in zip(
        scales.values(), branched["optimizer_states"], fp32_checkpoint["optimizer_states"]
    ):
        for index, moments in stored["state"].items():
            new = converted["state"][index]
            assert new["step"] == int(moments["step"])
            assert torch.equal(new["exp_avg"], (moments["exp_avg"].double() * scale).half())
            root = moments["exp_avg_sq"].double().sqrt() * (0.1 / math.sqrt(0.001) * scale)  # s = S·c·√v
            assert torch.equal(new["exp_avg_root"], root.half())
        assert converted["param_groups"][0]["eps"] == pytest.approx(max(1e-4 * scale / 1e4, 1e-7))
    # the target: θ̄ = θ̄_S / K_i, within fp16's rounding of the fp32 target
    module = SACModule.from_checkpoint(branched)
    updater = module.target_updater
    assert int(updater.updates_applied) == 1 and int(updater.first_nonfinite) == -1
    scaled, _ = updater._buffers_in_order()
    for name, buffer, factor in zip(updater.param_names, scaled, updater.tensor_scales().tolist()):
        average = source[f"critic_target.{name}"].double()
        assert torch.allclose(buffer.double() / factor, average, rtol=2**-10, atol=2**-24 / factor), name


def test_the_converted_optimizer_steps_on_as_float64_adam_from_the_fp32_state(fp32_checkpoint):
    """The branch's hAdam, given the next gradient in its loss scale's units, holds float64 Adam's
    moments after the step (÷ S): the conversion put it where an fp16 run with that state would be."""
    branched = branch_checkpoint(fp32_checkpoint, "fp16")
    module = SACModule.from_checkpoint(branched)
    optimizer = module.configure_optimizers()[0]
    optimizer.load_state_dict(branched["optimizer_states"][0])
    scale = branched["pixelsac"]["scalers"]["critic"]["scale"]
    stored = fp32_checkpoint["optimizer_states"][0]["state"]
    params = list(module.critic.parameters())
    generator = torch.Generator().manual_seed(0)
    wanted_m, wanted_root = [], []
    for index, param in enumerate(params):
        m, v = stored[index]["exp_avg"].double(), stored[index]["exp_avg_sq"].double()
        g = m + v.sqrt() * torch.randn(m.shape, generator=generator, dtype=torch.float64)
        param.grad = (g * scale).to(param.dtype)
        g = param.grad.double() / scale  # the gradient as fp16 holds it
        wanted_m.append(0.9 * m + 0.1 * g)
        wanted_root.append((0.999 * v + 0.001 * g * g).sqrt() * (0.1 / math.sqrt(0.001)))  # hAdam's s = c·√v
    optimizer.step()
    for name, wanted in (("exp_avg", wanted_m), ("exp_avg_root", wanted_root)):
        held = torch.cat([(optimizer.state[p][name].double() / scale).flatten() for p in params])
        expected = torch.cat([w.flatten() for w in wanted])
        assert torch.linalg.vector_norm(held - expected) / torch.linalg.vector_norm(expected) < 2e-3, name
    assert {int(optimizer.state[p]["step"]) for p in params} == {int(stored[0]["step"]) + 1}


def test_loss_scale_keeps_every_remembered_gradient_within_fp16():
    roots = [torch.tensor([0.5, 2.0]), torch.tensor([1.0])]
    scale = loss_scale_for(roots, beta2=0.999, init_scale=1e4, dtype=torch.float16)
    bound = 2.0 / math.sqrt(0.001)
    assert scale * bound <= 65504 < 2 * scale * bound and math.log2(1e4 / scale).is_integer()
    assert loss_scale_for([torch.zeros(3)], 0.999, 1e4, torch.float16) == 1e4
    with pytest.raises(ckpt.CheckpointError, match="no loss scale"):
        loss_scale_for([torch.tensor([1e30])], 0.999, 1e4, torch.float16)


def test_continuation_seeds_set_the_training_streams_and_keep_the_evaluations(fp32_checkpoint):
    one16, one32 = branch_checkpoint(fp32_checkpoint, "fp16", 1), branch_checkpoint(fp32_checkpoint, "fp32", 1)
    two = branch_checkpoint(fp32_checkpoint, "fp32", 2)
    saved = ckpt.callback_state(fp32_checkpoint, "Checkpointer")
    a, b, c = (ckpt.callback_state(x, "Checkpointer") for x in (one16, one32, two))
    assert a["collector"]["rng"] == b["collector"]["rng"] != c["collector"]["rng"] != saved["collector"]["rng"]
    assert a["collector"]["env_rngs"] == b["collector"]["env_rngs"] != c["collector"]["env_rngs"]
    assert torch.equal(a["torch_rng"], b["torch_rng"]) and not torch.equal(a["torch_rng"], c["torch_rng"])
    evaluator = ckpt.callback_state(fp32_checkpoint, "Evaluator")
    assert ckpt.callback_state(one16, "Evaluator") == evaluator == ckpt.callback_state(two, "Evaluator")


@pytest.mark.parametrize(
    "change, message",
    [
        ("precision", "starts from an fp32"),
        ("weight", "past torch.float16's range"),
        ("mode", "continues in fp32 or fp16"),
    ],
)
def test_what_cannot_convert_is_refused_in_one_line(fp32_checkpoint, change, message):
    checkpoint = copy.deepcopy(fp32_checkpoint)
    mode = "fp16"
    if change == "precision":
        checkpoint["hyper_parameters"]["config"]["precision"] = "bf16"
    elif change == "weight":
        checkpoint["state_dict"]["critic.q1.0.weight"][0, 0] = 1e5
    else:
        mode = "bf16"
    with pytest.raises(ckpt.CheckpointError, match=message) as info:
        branch_checkpoint(checkpoint, mode)
    assert "\n" not in str(info.value)


def test_paired_verdict_reads_matches_lags_and_undecided():
    assert verdict.paired_verdict([1.0, -1.0, 0.5, -0.5, 0.0], reference_mean=100.0).reading == "matches"
    lags = verdict.paired_verdict([-30.0, -25.0, -35.0, -28.0], reference_mean=300.0)
    assert lags.reading == "lags" and lags.ci95[1] < 0
    unsure = verdict.paired_verdict([-47.6, -68.5, -19.2], reference_mean=281.0)
    assert unsure.reading == "undecided" and unsure.ci95[0] < 0 < unsure.ci95[1]
    assert unsure.units_to_lag is not None and unsure.units_to_lag > 3
    assert "undecided" in unsure.sentence() and "pairs that would decide it" in unsure.sentence()
    assert verdict.paired_verdict([5.0], 100.0).reading == "too few"


@pytest.mark.slow
def test_branch_tool_continues_both_arms_and_pairs_them(tiny_fp32_run, tmp_path):
    out = tmp_path / "branches"
    command = [
        sys.executable,
        str(REPO / "tools" / "branch.py"),
        "--base",
        str(tiny_fp32_run.run_dir),
        "--modes",
        "fp16,fp32",
        "--continuations",
        "1,2",
        "--frames",
        "160",
        "--out",
        str(out),
        "--jobs",
        "2",
    ]
    result = subprocess.run(command, env=cli_env(), capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted(out.glob("*/*/c*"))
    assert len(runs) == 4 and all((run / "branch.json").is_file() for run in runs)
    rows = (out / "paired.csv").read_text().splitlines()
    assert rows[0].startswith("base,continuation,mode") and len(rows) == 3
    assert "fp16 against fp32" in (out / "results.md").read_text()
    assert (out / "curves.png").stat().st_size > 10_000  # a panel per base: the base, then every arm
    again = subprocess.run(command, env=cli_env(), capture_output=True, text=True, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.count("done") == 4  # a finished branch is not trained again


def test_branch_tool_refuses_a_non_fp32_base_in_one_line(tiny_fp16_run, tmp_path):
    command = [sys.executable, str(REPO / "tools" / "branch.py"), "--base", str(tiny_fp16_run.run_dir)]
    result = subprocess.run(
        [*command, "--out", str(tmp_path / "b")], env=cli_env(), capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "fp32" in result.stderr
    assert not list((tmp_path / "b").glob("*/*/c*/checkpoints/last.ckpt"))
    np.testing.assert_equal(result.stdout, "")
