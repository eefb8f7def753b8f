"""tools/instruments/backward_peaks.py: what headroom growth sees against the largest gradient of a backward."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TrainedRun, load_tool


def test_an_intermediate_larger_than_every_weight_gradient_is_found():
    """DrQ's temperature loss α·E[c] backs up S·E[c] before multiplying by α: the tool finds that
    intermediate, 1/α times the weight gradient; log α times the constant α·E[c] forms the
    gradient alone."""
    tool = load_tool("instruments/backward_peaks.py")
    log_alpha = torch.tensor(math.log(0.05), dtype=torch.float16, requires_grad=True)
    gap = torch.tensor([1.5, 0.5], dtype=torch.float16)
    published = (log_alpha.exp() * gap).mean()
    weight, peak, node = tool.backward_peaks(published, [log_alpha], 1e3, torch.float16)
    assert weight == pytest.approx(1e3 * 0.05, rel=1e-2) and peak == pytest.approx(1e3, rel=1e-3)
    assert node == "MulBackward0"
    rewritten = log_alpha * (log_alpha.exp().detach() * gap.mean())
    weight, peak, _ = tool.backward_peaks(rewritten, [log_alpha], 1e3, torch.float16)
    assert peak == weight == pytest.approx(1e3 * 0.05, rel=1e-2)


@pytest.mark.slow
def test_every_loss_of_a_run_is_measured_and_the_temperature_forms_its_gradient_alone(
    tiny_fp16_run: TrainedRun, tmp_path
):
    tool = load_tool("instruments/backward_peaks.py")
    out = tmp_path / "peaks"
    assert tool.main([str(tiny_fp16_run.run_dir), "--batches", "2", "--out", str(out)]) == 0
    assert out.with_suffix(".md").read_text().startswith("Command: `python tools/instruments/backward_peaks.py ")
    rows = {r["loss"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(rows) == {"critic", "actor", "alpha"}
    for row in rows.values():  # the weight gradients are formed in the backward too
        assert 0 < row["weight_peak"] <= row["backward_peak"] < 65504, row
    assert rows["alpha"]["loss_dtype"] == "float16" and rows["alpha"]["largest_ratio"] == pytest.approx(1.0)


def test_a_missing_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert load_tool("instruments/backward_peaks.py").main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
