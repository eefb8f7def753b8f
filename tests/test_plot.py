"""tools/plot: learning curves from run directories -- grouping by task and precision label,
seeds on a common frame grid, mean/IQM with a bootstrap band, PNG + SVG, exit 2 on missing data.

One real tiny run (conftest's, shared with test_evaluate.py) proves the tool reads what training writes;
extra seeds and precision modes are synthesised from its config.yaml, cheaply."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, cli_env


def _load_tool():
    spec = importlib.util.spec_from_file_location("pixelsac_tools_plot", REPO / "tools" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


plot = _load_tool()


@pytest.fixture(scope="session")
def base_config(run16) -> dict:
    return yaml.safe_load((run16 / "config.yaml").read_text())


def make_run(
    folder: Path,
    base: dict,
    frames,
    returns,
    task: str | None = None,
    precision: str | None = None,
    seed: int = 1,
    **lowp,
) -> Path:
    """A run directory as training writes it: config.yaml, and metrics.csv in the CSV logger's
    layout (eval rows interleaved with training rows that leave eval/return empty)."""
    config = {**base, "seed": seed, "lowp": {**base["lowp"], **lowp}}
    if task:
        config["task"] = task
    if precision:
        config["precision"] = precision
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    lines = ["env_frames,eval/return,eval/return_std,step,train/critic_loss,updates"]
    for frame, value in zip(frames, returns):
        lines.append(f"{frame},,,{frame},0.25,{frame // 8}")
        lines.append(f"{frame},{value},1.5,{frame},,{frame // 8}")
    (folder / "metrics.csv").write_text("\n".join(lines) + "\n")
    return folder


def run_tool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REPO / "tools" / "plot"), *args], cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300
    )


# --- end to end --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_wrapper_plots_a_real_run_beside_a_second_run(run16, base_config, tmp_path):
    real_frames, real_returns = plot.read_eval_curve(run16)
    # evaluations start with the first update (after the seed steps) and end at 160 frames
    assert len(real_frames) == 2 and real_frames[-1] == 160 and np.isfinite(real_returns).all()
    fp32 = make_run(tmp_path / "runs" / "fp32_s2", base_config, [80, 160], [3.0, 5.0], precision="fp32", seed=2)
    out = tmp_path / "figs" / "curves.png"
    result = run_tool(str(run16), str(fp32), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in out.with_suffix(".svg").read_text()[:2000]
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 300 and height > 200
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("cartpole_swingup")]
    assert [row[1] for row in rows] == ["fp16", "fp32"]  # one line per precision, one subplot
    assert rows[1][2:5] == ["1", "160", "5.0"]  # runs, final env frames, final return


# --- grouping and labels ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "precision,lowp,obs,label",
    [
        ("fp32", {}, "pixels", "fp32"),
        ("fp16", {}, "pixels", "fp16"),
        ("fp16", {"all": False}, "pixels", "fp16 naive"),
        ("fp16", {"hadam": False}, "pixels", "fp16 -hadam"),
        ("fp16", {"hadam": False, "normal_fix": False}, "pixels", "fp16 -hadam -normal_fix"),
        (
            "fp16",
            {"all": False, "loss_scaling": True},
            "pixels",
            "fp16 -hadam -kahan_gradients -kahan_momentum -softplus_fix -normal_fix",
        ),
        ("bf16", {}, "pixels", "bf16"),
        ("bf16", {"loss_scaling": True}, "pixels", "bf16 +loss_scaling"),
        ("amp", {}, "pixels", "amp"),
        ("fp32", {}, "state", "fp32 (state)"),
    ],
)
def test_precision_labels(base_config, precision, lowp, obs, label):
    config = {
        **base_config,
        "precision": precision,
        "lowp": {**base_config["lowp"], **lowp},
        "env": {**base_config["env"], "obs": obs},
    }
    assert plot.precision_label(config) == label


def test_runs_grouped_by_task_and_label_on_a_common_grid(base_config, tmp_path):
    runs_dir = tmp_path / "runs"
    make_run(runs_dir / "a", base_config, [0, 10, 20, 30], [0.0, 10.0, 20.0, 30.0], precision="fp32", seed=1)
    make_run(runs_dir / "b", base_config, [5, 15, 25], [100.0, 100.0, 100.0], precision="fp32", seed=2)
    make_run(runs_dir / "c", base_config, [10, 20], [1.0, 2.0], seed=1, all=False)
    make_run(runs_dir / "d", base_config, [10, 20], [7.0, 9.0], task="walker_walk", precision="fp32")
    runs = [plot.load_run(path) for path in plot.find_run_dirs([str(runs_dir)])]
    curves = {(c.task, c.label): c for c in plot.build_curves(runs, resamples=500)}
    assert set(curves) == {("cartpole_swingup", "fp32"), ("cartpole_swingup", "fp16 naive"), ("walker_walk", "fp32")}

    fp32 = curves["cartpole_swingup", "fp32"]
    # only the frames both seeds reached, never extrapolated: 5..25
    np.testing.assert_array_equal(fp32.grid, [5, 10, 15, 20, 25])
    np.testing.assert_allclose(fp32.values[0], [5, 10, 15, 20, 25])  # seed 1 interpolated
    np.testing.assert_allclose(fp32.center, (fp32.values[0] + 100.0) / 2)
    assert np.all(fp32.low <= fp32.center) and np.all(fp32.center <= fp32.high)
    assert np.all(fp32.high - fp32.low > 1)  # two different seeds: a real band

    single = curves["walker_walk", "fp32"]  # one seed: the band is the line
    np.testing.assert_array_equal(single.low, single.center)
    np.testing.assert_array_equal(single.high, single.center)


def test_iqm_trims_the_outer_quarters():
    assert plot.iqm(np.array([1, 2, 3, 4, 5, 6, 7, 100])) == pytest.approx(4.5)
    assert plot.iqm(np.array([3.0, 1.0, 2.0])) == pytest.approx(2.0)  # fewer than four: the mean
    values = np.array([[10.0, 11.0], [10.0, 11.0], [10.0, 11.0], [1000.0, 1000.0]])  # one seed runs away
    center_iqm, low, high = plot.bootstrap_band(values, "iqm", resamples=500)
    center_mean, _, _ = plot.bootstrap_band(values, "mean", resamples=500)
    np.testing.assert_allclose(center_iqm, [10.0, 11.0])
    np.testing.assert_allclose(center_mean, [257.5, 258.25])
    assert np.all(low <= center_iqm) and np.all(high >= center_iqm)


def test_bootstrap_band_is_reproducible_and_narrows_with_more_seeds():
    few = np.array([[90.0], [100.0], [110.0]])
    many = np.tile(few, (10, 1))  # the same spread, ten times the seeds
    np.testing.assert_array_equal(plot.bootstrap_band(few), plot.bootstrap_band(few))  # fixed resampling seed

    def width(values: np.ndarray) -> float:
        _, low, high = plot.bootstrap_band(values)
        return float(high[0] - low[0])

    assert 0 < width(many) < width(few)


def test_cli_in_process_iqm_png_svg_table_and_reference(base_config, tmp_path, capsys):
    for seed, final in zip(range(1, 5), [700.0, 720.0, 740.0, 5.0]):
        make_run(
            tmp_path / "runs" / f"s{seed}", base_config, [50_000, 100_000], [300.0, final], precision="fp32", seed=seed
        )
    out = tmp_path / "iqm.png"
    assert plot.main([str(tmp_path / "runs" / "*"), "--stat", "iqm", "--out", str(out)]) == 0
    assert out.is_file() and out.with_suffix(".svg").is_file()
    table = capsys.readouterr().out
    assert "IQM [95% CI]" in table
    row = next(line for line in table.splitlines() if line.startswith("cartpole_swingup"))
    assert " 4 " in row and "100,000" in row and "710.0 [" in row  # IQM of 5, 700, 720, 740
    assert "759±92 @100k" in row  # DrQ's published cartpole_swingup return at 100k frames


# --- missing or empty metrics: exit 2, nothing written ------------------------------------------------------
@pytest.mark.parametrize(
    "case,message",
    [
        ("not_a_run", "holds no metrics.csv (not a run directory, nor a folder of runs)"),
        ("no_metrics", "has no metrics.csv"),
        ("no_eval_column", "has no eval/return column"),
        ("no_eval_values", "has no eval/return values yet"),
        ("no_config", "has no config.yaml"),
        ("nothing_matches", "no run directory matches"),
    ],
)
def test_missing_or_empty_metrics_exit_2(base_config, tmp_path, capsys, case, message):
    run = tmp_path / "run"
    if case not in ("nothing_matches", "not_a_run"):
        make_run(run, base_config, [10], [1.0])
    if case == "not_a_run":
        run.mkdir()
    elif case == "no_metrics":
        (run / "metrics.csv").unlink()
    elif case == "no_eval_column":
        (run / "metrics.csv").write_text("env_frames,train/critic_loss,step\n8,0.5,8\n")
    elif case == "no_eval_values":
        (run / "metrics.csv").write_text("env_frames,eval/return,step\n8,,8\n16,,16\n")
    elif case == "no_config":
        (run / "config.yaml").unlink()
    pattern = str(tmp_path / "nothing*") if case == "nothing_matches" else str(run)
    out = tmp_path / "figs" / "c.png"
    assert plot.main([pattern, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (tmp_path / "figs").exists()


def test_skip_incomplete_leaves_out_empty_runs(base_config, tmp_path, capsys):
    make_run(tmp_path / "runs" / "good", base_config, [10, 20], [1.0, 2.0])
    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "runs" / "empty" / "metrics.csv").write_text("env_frames,step\n")
    runs = [str(tmp_path / "runs" / "good"), str(tmp_path / "runs" / "empty")]
    assert plot.main([*runs, "--out", str(tmp_path / "a.png")]) == 2
    assert "--skip-incomplete" in capsys.readouterr().err
    assert plot.main([*runs, "--skip-incomplete", "--out", str(tmp_path / "b.png")]) == 0
    assert "warning: skipped" in capsys.readouterr().err and (tmp_path / "b.png").is_file()
