"""tools/fidelity.py grad on a real (tiny) run: the float64 judge, and variants of another precision."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TrainedRun, load_tool


@pytest.mark.slow
def test_an_fp32_variant_matches_the_judge_and_bf16_is_further_off_than_the_fp16_run(
    tiny_fp16_run: TrainedRun, tmp_path
):
    """The fp16 run's weights transplanted into fp32 give float64's gradients to fp32's rounding
    (a transplant that lost the target, the weights or the loss scale would not); bf16 from the
    same weights is further from float64 than the fp16 run itself on the critic."""
    tool = load_tool("judges/grad.py")
    out = tmp_path / "fidelity"
    code = tool.main(
        [str(tiny_fp16_run.run_dir), "--batches", "2", "--variant", "fp32=precision=fp32",
         "--variant", "bf16=precision=bf16", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    error = {(r["variant"], r["group"]): r["relative_error"] for r in rows}
    groups = {group for _, group in error}
    assert {"critic.trunk", "critic.q1", "actor.policy", "log_alpha", "actor output: mu rows"} <= groups
    for group in groups:
        assert error["fp32", group] < 1e-5, (group, error["fp32", group])
        # fp16's own arithmetic: 0.03-0.051 on the critic's trunk, by the threads the tiny run trained with
        assert error["as trained", group] < 0.1, (group, error["as trained", group])
    # over the critic's groups (one group alone swings 4x between tiny runs trained with 1 or 2
    # threads): bf16 measured 1.8x (2 threads) to 2.5x (1 thread) the fp16 run's own error
    critic = ("critic.trunk", "critic.proj", "critic.q1", "critic.q2")
    bf16, fp16 = (sum(error[name, group] for group in critic) for name in ("bf16", "as trained"))
    assert bf16 > 1.5 * fp16, (bf16, fp16)


def test_the_judge_can_read_the_pixel_values_the_run_reads():
    """``--judge-pixels as-run``: the float64 judge reads k/255 as bf16 holds it (off by up to half
    a grey level), widened exactly; its own dtypes stay float64."""
    import dataclasses

    import torch

    from pixelsac.config import load_config
    from pixelsac.precision import PrecisionPolicy

    tool = load_tool("judges/grad.py")  # puts tools/ on the path
    from judges.common import float64_policy

    run_policy = PrecisionPolicy.from_config(load_config(["precision=bf16"]), "cpu")
    judge_policy = dataclasses.replace(float64_policy(run_policy), fp32_accumulate=False)
    as_run = tool.reading_pixels_as(judge_policy, run_policy)
    frames = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16)
    exact = judge_policy.cast_observation(frames)
    read = as_run.cast_observation(frames)
    assert read.dtype == exact.dtype == as_run.param_dtype == torch.float64
    assert torch.equal(read, run_policy.cast_observation(frames).double())
    assert 0.4 / 255 < float((read - exact).abs().max()) < 0.5 / 255  # bf16's spacing is 2⁻⁸ on [0.5, 1)
    assert not as_run.fp32_accumulate and as_run.mode == "bf16"


@pytest.mark.slow
def test_judge_pixels_as_run_reaches_the_judge(tiny_fp16_run: TrainedRun, tmp_path):
    """Through the command line: with the judge reading the fp16 run's pixel values, an fp32
    variant (exact pixels to fp32's rounding) no longer matches it to fp32's rounding, while the
    run as trained still compares within its own arithmetic's error."""
    tool = load_tool("judges/grad.py")
    out = tmp_path / "as_run"
    code = tool.main(
        [str(tiny_fp16_run.run_dir), "--batches", "1", "--judge-pixels", "as-run",
         "--variant", "fp32=precision=fp32", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    assert "reading the run's pixel values" in out.with_suffix(".md").read_text()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    error = {(r["variant"], r["group"]): r["relative_error"] for r in rows}
    assert error["fp32", "critic.trunk"] > 1e-5, error["fp32", "critic.trunk"]
    assert error["as trained", "critic.trunk"] < 0.1, error["as trained", "critic.trunk"]


@pytest.mark.slow
def test_loss_scale_sweep_shows_underflow_overflow_and_the_runs_own_scales(tiny_fp16_run: TrainedRun, tmp_path):
    """``--loss-scale`` as a sweep against one judge: at 1e-6 the fp16 gradients underflow (far
    from float64, where the largest finite scale is within fp16's arithmetic), at 1e30 every batch
    overflows and is counted out, and ``run`` uses the checkpoint's own scales."""
    import torch

    tool = load_tool("judges/grad.py")
    out = tmp_path / "sweep"
    code = tool.main(
        [str(tiny_fp16_run.run_dir), "--batches", "2", "--loss-scale", "largest", "--loss-scale", "run",
         "--loss-scale", "1e-6", "--loss-scale", "1e30", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    saved = tool.run_scales(torch.load(tiny_fp16_run.run_dir / "checkpoints" / "last.ckpt", weights_only=False))
    assert set(saved) == {"critic", "actor", "alpha"} and all(s > 1 for s in saved.values())
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    error = {(r["variant"], r["group"]): (r["relative_error"], r["batches"]) for r in rows}
    run_label = "as trained, S=run's (" + "/".join(f"{saved[n]:g}" for n in ("critic", "actor", "alpha")) + ")"
    for group in ("critic.trunk", "critic.q1", "actor.policy"):
        largest, batches = error["as trained, S=largest finite", group]
        assert batches == 2 and largest < 0.1, (group, largest)
        assert error[run_label, group][0] < 0.1, (group, error[run_label, group])
        tiny, batches = error["as trained, S=1e-06", group]
        assert batches == 2 and tiny > 5 * largest, (group, tiny, largest)
        assert error["as trained, S=1e+30", group][1] == 0  # every batch overflowed: a skipped step
    assert "The run's loss scales: critic" in out.with_suffix(".md").read_text()


def test_a_missing_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert load_tool("fidelity.py").main(["grad", str(tmp_path / "nowhere")]) == 2  # as a user runs it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "nowhere" in err[0]


@pytest.mark.parametrize("argv", [["gradient", "RUN"], []], ids=["unknown", "none"])
def test_fidelity_without_a_known_judge_says_which_there_are_and_exits_2(argv, capsys):
    assert load_tool("fidelity.py").main(argv) == 2
    captured = capsys.readouterr()
    if argv:
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: no judge 'gradient'") and "grad, step, drift, drq" in err[0]
    else:  # no subcommand: the usage, which names each judge
        assert all(f"tools/fidelity.py {name}" in captured.out for name in ("grad", "step", "drift", "drq"))


@pytest.mark.slow
def test_a_run_whose_replay_is_gone_is_one_line_and_exit_2(tiny_fp16_run: TrainedRun, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny_fp16_run.run_dir, run, ignore=shutil.ignore_patterns("replay-*"))
    for tool in ("judges/grad.py", "instruments/backward_peaks.py"):
        assert load_tool(tool).main([str(run)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: cannot read the replay"), err


@pytest.mark.parametrize("spec", ["zero", "0", "-4", "inf", "nan"])
def test_a_bad_loss_scale_is_one_line_and_exit_code_2(spec, capsys):
    tool = load_tool("judges/grad.py")
    with pytest.raises(SystemExit) as stopped:
        tool.main(["unused_run_dir", "--loss-scale", spec])
    assert stopped.value.code == 2
    assert f"--loss-scale takes largest, run or a positive number, not '{spec}'" in capsys.readouterr().err


def test_a_recorded_command_quotes_a_variant_with_spaces(tmp_path):
    """The command a results file records runs as written: a variant's overrides (with spaces)
    stay one argument."""
    import shlex

    load_tool("judges/grad.py")  # puts tools/ on the path
    from table_files import write_table_files

    argv = ["RUN", "--variant", "both=lowp.fp32_actor_loss=true lowp.fp32_actor_features=true", "--out", "x"]
    command = write_table_files(tmp_path / "t", "fidelity.py grad", argv, "| table |\n", {})
    assert shlex.split(command)[:3] == ["python", "tools/fidelity.py", "grad"]  # the command a user runs
    assert shlex.split(command)[3:] == argv
    assert json.loads((tmp_path / "t.json").read_text())["command"] == command
