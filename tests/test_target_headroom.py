"""tools/instruments/target_headroom.py: a run's critic weights against the published fixed-K ceiling."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TrainedRun, load_tool

from pixelsac import checkpoint as ckpt_io
from pixelsac.module import SACModule


@pytest.mark.slow
def test_a_weight_past_6_55_is_reported_as_overflowing_the_published_target(tiny_fp16_run: TrainedRun, tmp_path):
    tool = load_tool("instruments/target_headroom.py")
    out = tmp_path / "headroom"
    assert tool.main([str(tiny_fp16_run.run_dir), "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert rows and all(r["tensor"].startswith("critic.") for r in rows)
    assert not any(r["published_overflows"] for r in rows)  # a tiny run's weights stay small
    assert all(r["published_ceiling"] == pytest.approx(6.5504) for r in rows)
    assert rows == sorted(rows, key=lambda r: -max(r["max_abs_theta"], r["max_abs_target"]))

    module = SACModule.from_checkpoint(ckpt_io.load(tiny_fp16_run.run_dir, prefer="last"))
    with torch.no_grad():
        module.critic.q1[2].weight.view(-1)[0] = 7.0  # past 65504 / 10^4, as on the H200 run
    rows = {r["tensor"]: r for r in tool.headroom_rows(module)}
    hit = rows["critic.q1.2.weight"]
    assert hit["published_overflows"] and hit["max_abs_theta"] == 7.0
    assert not any(r["published_overflows"] for name, r in rows.items() if name != "critic.q1.2.weight")


def test_a_missing_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert load_tool("instruments/target_headroom.py").main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
