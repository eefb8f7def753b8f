"""tools/plot counts distinct seeds, not runs, and warns when the runs it puts on one curve
differ in configuration (anything but the seed, the run directory and how the run started)."""

from __future__ import annotations

import importlib.util
import sys

import yaml
from conftest import REPO

from pixelsac.config import load_config, to_plain


def _load_tool():
    spec = importlib.util.spec_from_file_location("pixelsac_tools_plot_seeds", REPO / "tools" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


plot = _load_tool()
BASE = to_plain(load_config(["task=cartpole_swingup", "precision=fp16"]))


def make_run(folder, seed, final, **changes):
    config = {**BASE, "seed": seed, "run_dir": str(folder)}
    for dotted, value in changes.items():
        group, _, key = dotted.partition("__")
        if key:
            config[group] = {**config[group], key: value}
        else:
            config[group] = value
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    rows = ["env_frames,eval/return,step", f"1000,{final / 2},1000", f"2000,{final},2000"]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_two_runs_of_one_seed_are_one_seed_and_a_warning(tmp_path, capsys):
    make_run(tmp_path / "a", seed=1, final=100.0)
    make_run(tmp_path / "b", seed=1, final=300.0, train__env_frames=40_000, resume="x")
    out = tmp_path / "c.png"
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    row = next(line for line in captured.out.splitlines() if line.startswith("cartpole_swingup"))
    assert row.split()[2] == "1"  # the seeds column
    warnings = captured.err.strip().splitlines()
    assert any("2 runs, 1 seed" in line and "more than once" in line for line in warnings), warnings
    differ = next(line for line in warnings if "configurations differ" in line)
    assert "train.env_frames (500000, 40000)" in differ
    assert "resume" not in differ and "seed" not in differ and "run_dir" not in differ


def test_distinct_seeds_with_one_config_plot_quietly(tmp_path, capsys):
    runs = [make_run(tmp_path / f"s{seed}", seed=seed, final=100.0 * seed) for seed in (1, 2, 3)]
    assert plot.main([*map(str, runs), "--out", str(tmp_path / "c.png")]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    curves = plot.build_curves([plot.load_run(run) for run in runs])
    assert curves[0].seeds == 3 and curves[0].count_text == "3 seeds"


def test_config_differences_names_each_key_once():
    runs = [
        plot.Run(tmp, "t", "fp16", seed, None, None, config)
        for tmp, seed, config in [
            ("a", 1, {"seed": 1, "agent": {"lr": 0.001, "batch_size": 64}}),
            ("b", 2, {"seed": 2, "agent": {"lr": 0.0003, "batch_size": 64}}),
            ("c", 3, {"seed": 3, "agent": {"lr": 0.001, "batch_size": 64}}),
        ]
    ]
    assert plot.config_differences(runs) == {"agent.lr": ["0.001", "0.0003"]}
