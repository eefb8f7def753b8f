"""Branching an fp32 checkpoint into fp16 or fp32 continuations (pixelsac/branching.py, tools/branch.py)."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, cli_env

from pixelsac import checkpoint as ckpt
from pixelsac.branching import branch_checkpoint, loss_scale_for
from pixelsac.module import SACModule
from pixelsac.rundir import RunDirLock

sys.path.insert(0, str(REPO / "tools"))
import branch as branch_tool  # noqa: E402
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


HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: a unit roundoff of each half type, and the smallest positive value it holds
ROUNDOFF = {"fp16": (2**-11, 2**-24), "bf16": (2**-8, 2**-133)}


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_a_half_branch_holds_fp32_state_rounded_once_in_loss_scale_units(fp32_checkpoint, mode):
    """fp16 holds the moments ×S (S chosen per loss, ε ×S/S0); bf16 has fp32's range, so S = 1
    and its ε is the bf16 run's own."""
    branched = branch_checkpoint(fp32_checkpoint, mode)
    dtype = HALF[mode]
    state, source = branched["state_dict"], fp32_checkpoint["state_dict"]
    for name in ("critic.q1.0.weight", "actor.policy.0.weight", "log_alpha"):
        assert state[name].dtype == dtype and torch.equal(state[name], source[name].to(dtype))
    scales = {loss: s["scale"] for loss, s in branched["pixelsac"]["scalers"].items()}
    if mode == "bf16":
        assert set(scales.values()) == {1.0}
    fresh = SACModule(branched["hyper_parameters"]["config"], *_shapes(branched)).configure_optimizers()
    for scale, converted, stored, own in zip(
        scales.values(), branched["optimizer_states"], fp32_checkpoint["optimizer_states"], fresh
    ):
        for index, moments in stored["state"].items():
            new = converted["state"][index]
            assert new["step"] == int(moments["step"])
            assert torch.equal(new["exp_avg"], (moments["exp_avg"].double() * scale).to(dtype))
            root = moments["exp_avg_sq"].double().sqrt() * (0.1 / math.sqrt(0.001) * scale)  # s = S·c·√v
            assert torch.equal(new["exp_avg_root"], root.to(dtype))
        eps = max(1e-4 * scale / 1e4, 1e-7) if mode == "fp16" else own.param_groups[0]["eps"]
        assert converted["param_groups"][0]["eps"] == pytest.approx(eps)
    # the target: θ̄ = θ̄_S / K_i, within the half type's rounding of the fp32 target
    module = SACModule.from_checkpoint(branched)
    updater = module.target_updater
    assert int(updater.updates_applied) == 1 and int(updater.first_nonfinite) == -1
    scaled, _ = updater._buffers_in_order()
    roundoff, smallest = ROUNDOFF[mode]
    for name, buffer, factor in zip(updater.param_names, scaled, updater.tensor_scales().tolist()):
        average = source[f"critic_target.{name}"].double()
        assert torch.allclose(buffer.double() / factor, average, rtol=roundoff, atol=smallest / factor), name


def _shapes(checkpoint: dict) -> tuple[tuple[int, ...], int]:
    hparams = checkpoint["hyper_parameters"]
    return tuple(hparams["obs_shape"]), int(hparams["action_dim"])


@pytest.mark.parametrize("mode, tolerance", [("fp16", 2e-3), ("bf16", 1e-2)])
def test_the_converted_optimizer_steps_on_as_float64_adam_from_the_fp32_state(fp32_checkpoint, mode, tolerance):
    """The branch's hAdam, given the next gradient in its loss scale's units, holds float64 Adam's
    moments after the step (÷ S): the conversion put it where a half run with that state would be
    (within a few roundings of the type: bf16 keeps 8 bits to fp16's 11)."""
    branched = branch_checkpoint(fp32_checkpoint, mode)
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
        assert torch.linalg.vector_norm(held - expected) / torch.linalg.vector_norm(expected) < tolerance, name
    assert {int(optimizer.state[p]["step"]) for p in params} == {int(stored[0]["step"]) + 1}


def test_loss_scale_keeps_every_remembered_gradient_within_fp16():
    roots = [torch.tensor([0.5, 2.0]), torch.tensor([1.0])]
    scale = loss_scale_for(roots, beta2=0.999, init_scale=1e4, dtype=torch.float16)
    bound = 2.0 / math.sqrt(0.001)
    assert scale * bound <= 65504 < 2 * scale * bound and math.log2(1e4 / scale).is_integer()
    assert loss_scale_for([torch.zeros(3)], 0.999, 1e4, torch.float16) == 1e4
    with pytest.raises(ckpt.CheckpointError, match="no loss scale"):
        loss_scale_for([torch.tensor([1e30])], 0.999, 1e4, torch.float16)


Q_SCALE = 10.0


def _losses_and_gradients(module: SACModule, batch: dict[str, torch.Tensor]) -> tuple[list[float], dict]:
    """The critic's, actor's and temperature's losses on ``batch`` (same noise for every module),
    and each optimizer's gradients by parameter name; rewards enter ×reward_scale as in update()."""
    module.train()
    names = {id(p): n for n, p in module.named_parameters()}
    obs = batch["obs"].float().repeat(2, 1, 1, 1)
    next_obs = batch["next_obs"].float().repeat(2, 1, 1, 1)
    reward = batch["reward"] * module.reward_scale
    torch.manual_seed(1)
    critic_loss, _ = module.critic_loss(obs, batch["action"], reward, batch["not_terminal"], next_obs)
    critic_loss.backward()
    grads = {
        "critic": {names[id(p)]: p.grad.double().clone() for p in module.critic.parameters() if p.grad is not None}
    }
    module.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    actor_loss, alpha_loss, _ = module.actor_and_alpha_loss(obs[: batch["action"].shape[0]])
    actor_loss.backward()
    grads["actor"] = {names[id(p)]: p.grad.double().clone() for p in module.actor.parameters() if p.grad is not None}
    alpha_loss.backward()
    grads["alpha"] = {"log_alpha": module.log_alpha.grad.double().clone()}
    module.zero_grad(set_to_none=True)
    return [float(critic_loss), float(actor_loss)], grads  # log α·(α·E[...]): only its gradient is ×c


def test_a_q_scaled_branch_is_the_same_run_in_units_c_times_larger(fp32_checkpoint):
    """Rewards, α and Q ×c: the critic's loss ×c² and its gradients ×c² (×c in the Q heads' last
    layers), the actor's and temperature's ×c, and the moments moved into those same units, so
    Adam steps every weight but the last layers as the base does."""
    c = Q_SCALE
    scaled = branch_checkpoint(fp32_checkpoint, "fp32", q_scale=c)
    assert scaled["hyper_parameters"]["config"]["agent"]["reward_scale"] == c
    assert fp32_checkpoint["hyper_parameters"]["config"]["agent"].get("reward_scale", 1.0) == 1.0  # not changed
    base, moved = SACModule.from_checkpoint(fp32_checkpoint), SACModule.from_checkpoint(scaled)
    assert float(moved.alpha.detach()) == pytest.approx(c * float(base.alpha.detach()), rel=1e-6)
    generator = torch.Generator().manual_seed(5)
    obs_shape, action_dim = _shapes(fp32_checkpoint)
    batch = {
        "obs": torch.randint(0, 256, (4, *obs_shape), generator=generator).float(),
        "next_obs": torch.randint(0, 256, (4, *obs_shape), generator=generator).float(),
        "action": torch.rand(4, action_dim, generator=generator) * 2 - 1,
        "reward": torch.rand(4, 1, generator=generator),
        "not_terminal": torch.ones(4, 1),
    }
    with torch.no_grad():
        for q_base, q_moved in zip(
            base.critic(batch["obs"], batch["action"]), moved.critic(batch["obs"], batch["action"])
        ):
            torch.testing.assert_close(q_moved, c * q_base, rtol=1e-5, atol=1e-6)
    losses_base, grads_base = _losses_and_gradients(base, batch)
    losses_moved, grads_moved = _losses_and_gradients(moved, batch)
    for factor, a, b in zip((c * c, c), losses_base, losses_moved):
        assert b == pytest.approx(factor * a, rel=1e-4)
    last_layers = {f"critic.{h}.4.{k}" for h in ("q1", "q2") for k in ("weight", "bias")}
    for loss, index in (("critic", 0), ("actor", 1), ("alpha", 2)):
        params = [n for n, _ in base.named_parameters() if n in grads_base[loss]]
        stored, converted = (
            fp32_checkpoint["optimizer_states"][index]["state"],
            scaled["optimizer_states"][index]["state"],
        )
        for position, name in enumerate(params):
            k = c if loss != "critic" or name in last_layers else c * c
            wanted = k * grads_base[loss][name]
            assert torch.linalg.vector_norm(grads_moved[loss][name] - wanted) <= 1e-4 * torch.linalg.vector_norm(
                wanted
            ), name
            # the stored moments are in the units of these gradients (Adam's step m/√v unchanged)
            assert torch.allclose(converted[position]["exp_avg"], k * stored[position]["exp_avg"], rtol=1e-6)
            assert torch.allclose(converted[position]["exp_avg_sq"], k * k * stored[position]["exp_avg_sq"], rtol=1e-6)


def test_the_update_feeds_rewards_times_reward_scale_to_the_critic():
    from test_module import fit, make_batch, make_module

    module = make_module("precision=fp32", "agent.reward_scale=2.5")
    seen = []
    critic_loss = module.critic_loss

    def recording(obs_aug, action, reward, *rest):
        seen.append(reward.clone())
        return critic_loss(obs_aug, action, reward, *rest)

    module.critic_loss = recording
    batch = make_batch()
    fit(module, [batch])
    assert torch.equal(seen[0], batch["reward"] * 2.5)


def test_a_q_scaled_fp16_branch_takes_a_loss_scale_c_squared_smaller(fp32_checkpoint):
    """The critic's remembered gradients are c² larger, the actor's c: the conversion's scale (the
    largest power-of-two step below init_scale that holds them) shrinks with them, by up to c² (c)
    rounded to a power of two, less where the base's scale sat at init_scale with room to spare."""
    plain = branch_checkpoint(fp32_checkpoint, "fp16")["pixelsac"]["scalers"]
    moved = branch_checkpoint(fp32_checkpoint, "fp16", q_scale=Q_SCALE)["pixelsac"]["scalers"]
    for loss, factor in (("critic", Q_SCALE**2), ("actor", Q_SCALE)):
        ratio = plain[loss]["scale"] / moved[loss]["scale"]
        assert 2 <= ratio <= 2 * factor and math.log2(ratio).is_integer(), (loss, ratio)
    assert plain["critic"]["scale"] / moved["critic"]["scale"] >= Q_SCALE**2 / 2


def test_the_default_safety_floor_leaves_a_q_scaled_critic_room_to_train(fp32_checkpoint):
    """The scale a run needs falls with its gradients: with Q ×10 the critic's is ~100× lower
    (0.31 at full size, batch 32), a healthy run that a floor of 1 stopped at its first check."""
    from pixelsac.config import load_config

    scale = branch_checkpoint(fp32_checkpoint, "fp16", q_scale=Q_SCALE)["pixelsac"]["scalers"]["critic"]["scale"]
    assert load_config([]).safety.min_loss_scale * 2**10 < scale


@pytest.mark.parametrize("q_scale", [0.0, -1.0, float("nan"), float("inf")])
def test_a_q_scale_that_is_not_a_positive_number_is_refused(fp32_checkpoint, q_scale):
    with pytest.raises(ckpt.CheckpointError, match="finite number above 0"):
        branch_checkpoint(fp32_checkpoint, "fp16", q_scale=q_scale)


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
        ("mode", "continues in fp32, fp16, bf16, not 'amp'"),
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
        mode = "amp"
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
    by_base = unsure.sentence(units="bases")  # the unit is named: pairs, bases or seeds
    assert "over 3 bases" in by_base and "bases that would decide it" in by_base and "pairs" not in by_base
    assert verdict.paired_verdict([5.0], 100.0).reading == "too few"


def scored_pairs(tmp_path: Path, returns: dict[tuple[str, int], tuple[float, float]]) -> list:
    """Finished fp16 and fp32 branches of (base label, continuation), each returning its one
    value (fp16's, fp32's) at every evaluation after a branch point at 100 frames."""
    branches = []
    for (label, c), by_mode in returns.items():
        base = branch_tool.Base(label, tmp_path / label / "last.ckpt", 100)
        for mode, value in zip(("fp16", "fp32"), by_mode):
            run_dir = tmp_path / "out" / label / mode / f"c{c}"
            run_dir.mkdir(parents=True)
            rows = [f"{frames},{value}" for frames in (100, 150, 200)]
            (run_dir / "metrics.csv").write_text("env_frames,eval/return\n" + "\n".join(rows) + "\n")
            branches.append(branch_tool.Branch(base, mode, c, run_dir))
    return branches


@pytest.mark.parametrize("verdict_bases, label", [(3, "By base (the verdict)"), (10, "interim, 3 of the 10 bases")])
def test_the_base_reading_is_the_verdict_only_from_the_bases_fixed_for_it(tmp_path, verdict_bases, label):
    """Three bases of one continuation each, fp16 lower on each; below ``--verdict-bases`` the
    base-level reading says it is interim, never 'the verdict'."""
    branches = scored_pairs(
        tmp_path,
        {(f"b{index}", 1): (200.0 + index + gap, 200.0 + index) for index, gap in enumerate((-30.0, -10.0, -20.0))},
    )
    text = branch_tool.collect(branches, 100, "fp32", tmp_path / "out", verdict_bases)
    assert label in text and "over 3 bases" in text and text.count("By base") == 1
    assert ("By base (the verdict)" in text) == (verdict_bases == 3)
    # only the verdict carries a reading word; the pairs (which share bases) never do here
    readings = ("matches:", "lags:", "leads:", "undecided:")
    base_line = next(line for line in text.splitlines() if line.startswith("**By base"))
    pair_line = next(line for line in text.splitlines() if line.startswith("**By pair"))
    assert any(word in base_line for word in readings) == (verdict_bases == 3)
    assert not any(word in pair_line for word in readings) and "not the verdict" in pair_line
    if verdict_bases == 10:
        assert "decides nothing): fp16 - fp32 = -20.0 over 3 bases" in base_line


def test_a_reading_below_three_bases_is_interim_unless_the_bases_asked_for_are_fewer(tmp_path):
    """One base, two continuations: by pair is the only reading; it decides only when
    ``--verdict-bases`` asks for no more bases than there are."""
    branches = scored_pairs(tmp_path, {("b0", 1): (196.0, 200.0), ("b0", 2): (202.0, 200.0)})
    for verdict_bases, decides in ((1, True), (3, False)):
        text = branch_tool.collect(branches, 100, "fp32", tmp_path / "out", verdict_bases)
        pair_line = next(line for line in text.splitlines() if line.startswith("**By pair"))
        assert pair_line.startswith("**By pair: matches:") == decides
        assert ("interim, 1 of the 3 bases" in pair_line) == (not decides)


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
    wider = subprocess.run(
        [*command[:7], "1,2,3", *command[8:], "--collect-only"], env=cli_env(), capture_output=True, text=True
    )
    assert wider.returncode == 0, wider.stderr[-2000:]
    listed = (out / "results.md").read_text()  # a planned continuation nobody ran is not called unfinished
    assert "Not started: " in listed and listed.count("/c3") == 2 and "Started, not finished" not in listed


def test_branch_tool_refuses_a_non_fp32_base_in_one_line(tiny_fp16_run, tmp_path):
    command = [sys.executable, str(REPO / "tools" / "branch.py"), "--base", str(tiny_fp16_run.run_dir)]
    result = subprocess.run(
        [*command, "--out", str(tmp_path / "b")], env=cli_env(), capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "fp32" in result.stderr
    too_few = subprocess.run(
        [*command, "--out", str(tmp_path / "c"), "--verdict-bases", "2"],
        env=cli_env(),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert too_few.returncode == 2 and too_few.stderr.count("\n") == 1 and "--verdict-bases" in too_few.stderr
    assert not list((tmp_path / "b").glob("*/*/c*/checkpoints/last.ckpt"))
    np.testing.assert_equal(result.stdout, "")


def test_branch_tool_refuses_a_bad_or_changed_q_scale_in_one_line(tiny_fp32_run, tmp_path, capsys):
    base = ["--base", str(tiny_fp32_run.run_dir), "--out", str(tmp_path / "b"), "--collect-only"]
    assert branch_tool.main([*base, "--q-scale", "0"]) == 2
    assert "--q-scale must be a finite number above 0" in capsys.readouterr().err
    assert branch_tool.main([*base, "--q-scale", "10"]) == 0  # the plan holds 10 from now on
    capsys.readouterr()
    assert branch_tool.main(base) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--q-scale 10; give each Q scale its own --out" in err


def test_one_process_writes_a_branch_folder_and_a_bare_collect_reads_it_while_held(tiny_fp32_run, tmp_path, capsys):
    out = tmp_path / "b"
    planned = ["--base", str(tiny_fp32_run.run_dir), "--out", str(out), "--collect-only"]
    assert branch_tool.main(planned) == 0  # writes the plan
    capsys.readouterr()
    plan_before = (out / "plan.json").read_text()
    holder = RunDirLock(out, key="--out").acquire()  # another process's branch run, as far as flock can tell
    try:
        assert branch_tool.main([*planned, "--continuations", "7"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--out {out} is in use by pid" in err
        assert (out / "plan.json").read_text() == plan_before  # the refused command changed nothing
        assert branch_tool.main(["--out", str(out)]) == 2  # continuing the plan trains: refused too
        capsys.readouterr()
        assert branch_tool.main(["--out", str(out), "--collect-only"]) == 0  # looking is not writing
        assert "c1" in capsys.readouterr().out
    finally:
        holder.release()
    assert branch_tool.main([*planned, "--continuations", "7"]) == 0
    assert '"continuations": [\n    7\n  ]' in (out / "plan.json").read_text()


def test_a_branch_is_listed_as_started_once_its_training_began_before_its_first_checkpoint(tmp_path):
    base = branch_tool.Base("b_40k", tmp_path / "base" / "last.ckpt", 40_000)
    running, planned = (branch_tool.Branch(base, "fp16", c, tmp_path / "out" / f"c{c}") for c in (1, 2))
    for branch in (running, planned):
        branch.run_dir.mkdir(parents=True)
    (running.run_dir / "train.log").write_text("# python -m pixelsac.train resume=...\n")  # no checkpoint yet
    listed = branch_tool.collect([running, planned], 20_000, "fp32", tmp_path / "out")
    assert "Started, not finished: b_40k/fp16/c1" in listed and "Not started: b_40k/fp16/c2" in listed
