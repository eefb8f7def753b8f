"""tools/grad_fidelity.py on a real (tiny) run: the float64 judge, and variants of another precision."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO, TrainedRun


def load_tool():
    sys.path.insert(0, str(REPO / "tools"))
    spec = importlib.util.spec_from_file_location("grad_fidelity_tool", REPO / "tools" / "grad_fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_an_fp32_variant_matches_the_judge_and_bf16_is_further_off_than_the_fp16_run(
    tiny_fp16_run: TrainedRun, tmp_path
):
    """The fp16 run's weights transplanted into fp32 give float64's gradients to fp32's rounding
    (a transplant that lost the target, the weights or the loss scale would not); bf16 from the
    same weights is further from float64 than the fp16 run itself on the critic."""
    tool = load_tool()
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
        assert error["as trained", group] < 0.05, (group, error["as trained", group])
    for group in ("critic.trunk", "critic.q1", "critic.q2"):
        assert error["bf16", group] > 2 * error["as trained", group], (group, error["bf16", group])


def test_the_judge_can_read_the_pixel_values_the_run_reads():
    """``--judge-pixels as-run``: the float64 judge reads k/255 as bf16 holds it (off by up to half
    a grey level), widened exactly; its own dtypes stay float64."""
    import dataclasses

    import torch

    from pixelsac.config import load_config
    from pixelsac.precision import PrecisionPolicy

    tool = load_tool()  # puts tools/ on the path
    from drq_side_by_side import float64_policy

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
