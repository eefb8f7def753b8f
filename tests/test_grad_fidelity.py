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
