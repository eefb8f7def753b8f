"""tools/experiment.py: a tiny real grid (fp32 trains, naive fp16 fails numerically), resumed
without retraining, extended by raising the budget, re-collected; the table arithmetic on
synthetic runs; bad arguments refused in one line."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY, cli_env
from overrides import merged


def _load_tool():
    spec = importlib.util.spec_from_file_location("pixelsac_tools_experiment", REPO / "tools" / "experiment.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


experiment = _load_tool()
GRID_OVERRIDES = [o for o in TINY if not o.startswith("task=")]


def run_tool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "experiment.py"), *args],
        cwd=cwd,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_tiny_grid_runs_resumes_extends_and_collects(tmp_path):
    out = tmp_path / "grid"
    grid = [
        "--modes",
        "fp32,fp16-naive",
        "--tasks",
        "cartpole_swingup",
        "--seeds",
        "1,2",
        "--obs",
        "pixels",
        "--jobs",
        "2",
        "--out",
        str(out),
    ]
    first = run_tool(*grid, *GRID_OVERRIDES, cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    state = json.loads((out / "grid.json").read_text())
    runs = state["runs"]
    assert {k: v["status"] for k, v in runs.items()} == {
        "cartpole_swingup/fp32/s1": "done",
        "cartpole_swingup/fp32/s2": "done",
        "cartpole_swingup/fp16-naive/s1": "failed",
        "cartpole_swingup/fp16-naive/s2": "failed",
    }
    assert runs["cartpole_swingup/fp16-naive/s1"]["returncode"] == 3
    assert state["spec"]["budget"] == 320 and state["spec"]["modes"] == ["fp32", "fp16-naive"]
    for seed in (1, 2):
        fp32 = out / "cartpole_swingup" / "fp32" / f"s{seed}"
        assert (fp32 / "checkpoints" / "last.ckpt").is_file() and "done:" in (fp32 / "train.log").read_text()
        assert "train.num_threads=1" in runs[f"cartpole_swingup/fp32/s{seed}"]["command"]
        assert (out / "cartpole_swingup" / "fp16-naive" / f"s{seed}" / "failure.json").is_file()
    # where each run was trained: the CPU (model, 16-bit extensions), cores, torch and the code
    machine = (out / "cartpole_swingup" / "fp32" / "s1" / "machine.txt").read_text().splitlines()
    assert len(machine) == 1 and " fresh: " in machine[0] and experiment.cpu_line() in machine[0]
    assert "CPUs, torch" in machine[0] and f"; code {experiment.code_version()}" in machine[0]
    rows = {(r["mode"], r["env_frames"]): r for r in read_csv(out / "results.csv")}
    assert set(rows) == {("fp32", "160"), ("fp32", "320"), ("fp16-naive", "160"), ("fp16-naive", "320")}
    assert rows[("fp32", "320")]["n"] == "2" and rows[("fp32", "320")]["failed"] == "0"
    assert rows[("fp32", "320")]["mean"] != "" and rows[("fp32", "320")]["iqm_ci_low"] != ""
    naive = rows[("fp16-naive", "320")]
    assert (naive["n"], naive["failed"], naive["mean"]) == ("0", "2", "")  # failed, not zero
    md = (out / "results.md").read_text()
    assert "**2 failed**" in md and "| cartpole_swingup | fp32 | 2/2 |" in md
    assert "hardware" in md and "torch" in md and "CPUs" in md and "--modes fp32,fp16-naive" in md
    assert (out / "curves.png").is_file()

    # the same command again: nothing retrains
    ckpt = out / "cartpole_swingup" / "fp32" / "s1" / "checkpoints" / "last.ckpt"
    mtime = ckpt.stat().st_mtime_ns
    again = run_tool(*grid, *GRID_OVERRIDES, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("skip-done") == 2 and again.stdout.count("skip-failed") == 2
    assert "0 trained" in again.stdout and ckpt.stat().st_mtime_ns == mtime
    assert "fp16-naive" in (out / "grid.json").read_text()

    # a larger budget: the finished runs continue with resume=, the failed ones stay failed
    more = run_tool(*grid, *merged(*GRID_OVERRIDES, "train.env_frames=480"), cwd=tmp_path)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert more.stdout.count("resume ") == 2 and more.stdout.count("skip-failed") == 2
    assert f"resume={out / 'cartpole_swingup' / 'fp32' / 's1'}" in more.stdout
    log = (out / "cartpole_swingup" / "fp32" / "s1" / "train.log").read_text()
    assert "resuming from" in log and "done: 480 env frames" in log
    machine = (out / "cartpole_swingup" / "fp32" / "s1" / "machine.txt").read_text().splitlines()
    assert [line.split()[1] for line in machine] == ["fresh:", "resume:"]  # a line per start
    assert experiment.checkpoint_frames(ckpt.parent.parent) == 480
    assert json.loads((out / "grid.json").read_text())["runs"]["cartpole_swingup/fp32/s1"]["env_frames"] == 480
    assert {r["env_frames"] for r in read_csv(out / "results.csv")} == {"240", "480"}

    # tables only, from the folder, at chosen budgets, and exported without checkpoints (as
    # committed under docs/results/); then continued elsewhere: the finished runs count as done
    # from their summary.json, the failed ones as failed
    (out / "results.md").unlink()
    exported = tmp_path / "exported"
    collect = run_tool(
        "--out", str(out), "--collect-only", "--budgets", "160,480", "--export", str(exported), cwd=tmp_path
    )
    assert collect.returncode == 0, collect.stderr[-3000:]
    rows = {(r["mode"], r["env_frames"]): r for r in read_csv(out / "results.csv")}
    assert set(rows) == {("fp32", "160"), ("fp32", "480"), ("fp16-naive", "160"), ("fp16-naive", "480")}
    assert rows[("fp32", "480")]["n"] == "2" and rows[("fp16-naive", "480")]["failed"] == "2"
    assert "--collect-only" in (out / "results.md").read_text()
    assert (exported / "results.md").read_text() == (out / "results.md").read_text().replace(str(out), "GRID")
    assert (exported / "grid.json").is_file() and (exported / "seeds.csv").is_file()
    for name in ("grid.json", "results.md"):  # the commands they record name the grid as GRID
        assert str(out) not in (exported / name).read_text() and "--out GRID" in (exported / name).read_text()
    # naive fp16 failed at every seed: its pairs with fp32 are none, and say so
    assert {r["reading"] for r in read_csv(exported / "paired.csv")} == {"no seed reached the budget in both"}
    assert (exported / "runs" / "cartpole_swingup" / "fp32" / "s2" / "metrics.csv").is_file()
    machine_file = Path("cartpole_swingup", "fp32", "s2", "machine.txt")
    assert (exported / "runs" / machine_file).read_text() == (out / machine_file).read_text()
    assert not [p for p in exported.rglob("*") if p.suffix in (".ckpt", ".pt", ".npz")]
    config = (exported / "runs" / "cartpole_swingup" / "fp32" / "s2" / "config.yaml").read_text()
    assert "run_dir: GRID/cartpole_swingup/fp32/s2" in config and str(tmp_path) not in config
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(exported / "runs", elsewhere)
    plan = run_tool(
        *grid[:-1], str(elsewhere), *merged(*GRID_OVERRIDES, "train.env_frames=480"), "--dry-run", cwd=tmp_path
    )
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert plan.stdout.count("skip-done") == 2 and plan.stdout.count("skip-failed") == 2, plan.stdout


# --- the table arithmetic on synthetic runs ------------------------------------------------------------------
def fake_run(run_dir: Path, frames, returns, failed_at: int | None = None) -> None:
    run_dir.mkdir(parents=True)
    lines = ["env_frames,eval/return,step,train/critic_loss"]
    for frame, value in zip(frames, returns):
        lines += [f"{frame},,{frame},0.5", f"{frame},{value},{frame},"]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")
    if failed_at is not None:
        (run_dir / "failure.json").write_text(json.dumps({"message": "non-finite", "env_frames": failed_at}))


def test_table_mean_std_iqm_and_failed_counting(tmp_path):
    out = tmp_path / "grid"
    task = "cartpole_swingup"
    fake_run(out / task / "fp32" / "s1", [100, 200], [10, 20])
    fake_run(out / task / "fp32" / "s2", [100, 200], [30, 40])
    fake_run(out / task / "fp32" / "s3", [100, 200], [50, 90])
    fake_run(out / task / "fp16" / "s1", [100, 200], [12, 24])
    fake_run(out / task / "fp16" / "s2", [100, 150], [14, 16], failed_at=170)  # failed between the budgets
    fake_run(out / task / "fp16" / "s3", [100], [20])  # still running: short of 200
    # fp16-naive s1..s3 never ran; s1 failed at once
    fake_run(out / task / "fp16-naive" / "s1", [], [], failed_at=8)
    state = experiment.GridState(out)
    rows = experiment.collect(
        out, [task], ["fp32", "fp16", "fp16-naive"], [1, 2, 3], [100, 200], ["--collect-only"], state, resamples=200
    )
    table = {(r.mode, r.budget): r for r in rows}
    fp32 = table[("fp32", 200)]
    assert (fp32.n, fp32.failed, fp32.missing, fp32.seeds) == (3, 0, 0, 3)
    assert fp32.mean == pytest.approx(50.0) and fp32.std == pytest.approx(np.std([20, 40, 90]))
    assert fp32.iqm == pytest.approx(50.0)  # fewer than four seeds: nothing trimmed
    assert fp32.iqm_low <= fp32.iqm <= fp32.iqm_high and fp32.iqm_low >= 20 and fp32.iqm_high <= 90
    assert table[("fp32", 100)].mean == pytest.approx(30.0)
    at100 = table[("fp16", 100)]
    assert (at100.n, at100.failed, at100.missing) == (3, 0, 0) and at100.mean == pytest.approx(46 / 3)
    at200 = table[("fp16", 200)]
    assert (at200.n, at200.failed, at200.missing) == (1, 1, 1) and at200.mean == pytest.approx(24.0)
    assert at200.std == pytest.approx(0.0)
    naive = table[("fp16-naive", 200)]
    assert (naive.n, naive.failed, naive.missing, naive.mean) == (0, 1, 2, None)
    csv_rows = {(r["mode"], r["env_frames"]): r for r in read_csv(out / "results.csv")}
    assert csv_rows[("fp16", "200")]["failed"] == "1" and csv_rows[("fp16-naive", "200")]["mean"] == ""
    assert csv_rows[("fp32", "200")]["mean"] == "50.0"
    md = (out / "results.md").read_text()
    assert "| cartpole_swingup | fp32 | 3/3 | 50.0 ± " in md and "**1 failed**" in md
    assert "fp16/s2 at 170 frames" in md and "fp16-naive/s1 at 8 frames" in md


def test_paired_differences_are_per_seed_over_the_seeds_both_reached(tmp_path):
    out = tmp_path / "grid"
    task = "cartpole_swingup"
    # fp16 is ahead of fp32 on every seed by 5..15 although the seeds spread from 10 to 90: the
    # pairs see it, the two modes' intervals overlap
    runs = {  # (mode, seed): (evaluation frames, returns, frame of a numerical failure)
        ("fp32", 1): ([100, 200], [10, 10], None),
        ("fp32", 2): ([100, 200], [50, 50], None),
        ("fp32", 3): ([100, 200], [90, 90], None),
        ("fp32", 4): ([100], [40], None),  # short of 200
        ("fp16", 1): ([100, 200], [15, 20], None),
        ("fp16", 2): ([100, 200], [55, 65], None),
        ("fp16", 3): ([100, 200], [95, 100], None),
        ("fp16", 4): ([100, 200], [0, 0], None),
        ("fp16-six", 1): ([100, 200], [30, 0], None),
        ("fp16-six", 2): ([100, 200], [40, 100], None),
        ("fp16-six", 3): ([100, 150], [60, 60], 170),
    }
    for (mode, seed), (frames, returns, failed_at) in runs.items():
        fake_run(out / task / mode / f"s{seed}", frames, returns, failed_at=failed_at)
    modes = ["fp32", "fp16", "fp16-six"]
    experiment.collect(out, [task], modes, [1, 2, 3, 4], [100, 200], ["--collect-only"], experiment.GridState(out))
    paired = {(r["mode"], r["env_frames"]): r for r in read_csv(out / "paired.csv")}
    assert set(paired) == {(m, b) for m in ("fp16", "fp16-six") for b in ("100", "200")}
    ahead = paired[("fp16", "200")]
    assert (ahead["against"], ahead["pairs"], ahead["left_out"], ahead["seeds"]) == ("fp32", "3", "1", "1 2 3")
    assert ahead["differences"] == "10.0 15.0 10.0" and ahead["mean_difference"] == "11.7"
    assert 10 <= float(ahead["ci_low"]) and float(ahead["ci_high"]) <= 15 and ahead["reading"] == "fp16 higher"
    level = paired[("fp16", "100")]  # s4 counts here: 0 - 40
    assert level["differences"] == "5.0 5.0 5.0 -40.0" and level["higher_in"] == "3"
    assert level["reading"] == "the CI covers 0" and float(level["ci_low"]) < 0 < float(level["ci_high"])
    mixed = paired[("fp16-six", "200")]  # s3 failed, s4 never ran: two left out
    assert (mixed["pairs"], mixed["left_out"], mixed["differences"]) == ("2", "2", "-10.0 50.0")
    seeds = {(r["mode"], r["seed"], r["env_frames"]): (r["status"], r["return"]) for r in read_csv(out / "seeds.csv")}
    assert seeds[("fp16-six", "3", "200")] == ("failed", "") and seeds[("fp32", "4", "200")] == ("missing", "")
    assert seeds[("fp16", "2", "200")] == ("ok", "65.0")
    md = (out / "results.md").read_text()
    assert "| cartpole_swingup | fp16-six | 0.0 | 100.0 | failed | – |" in md  # per seed at 200
    assert "| cartpole_swingup | fp16 | 3 (1 left out) | s1: +10.0, s2: +15.0, s3: +10.0 | +11.7 [" in md
    assert "| 3/3 | fp16 higher |" in md
    # no fp32 in the grid (or --paired-against none): no paired table, and none left from before
    experiment.collect(
        out, [task], ["fp16", "fp16-six"], [1, 2, 3], [200], ["--collect-only"], experiment.GridState(out)
    )
    assert not (out / "paired.csv").exists() and "Paired with" not in (out / "results.md").read_text()
    experiment.collect(
        out, [task], modes, [1, 2, 3], [200], ["--collect-only"], experiment.GridState(out), against=("fp16",)
    )
    assert {r["mode"]: r["against"] for r in read_csv(out / "paired.csv")} == {"fp32": "fp16", "fp16-six": "fp16"}
    experiment.collect(
        out, [task], modes, [1, 2, 3], [200], ["--collect-only"], experiment.GridState(out), against=("fp32", "fp16")
    )  # each pair once: fp16 against fp32, not fp32 against fp16 again
    assert [(r["mode"], r["against"]) for r in read_csv(out / "paired.csv")] == [
        ("fp16", "fp32"),
        ("fp16-six", "fp32"),
        ("fp16-six", "fp16"),
    ]


def test_a_run_stopped_by_a_signal_is_stopped_not_crashed(tmp_path):
    """Exit 75 is a run stopped with its work saved (Ctrl-C, SIGTERM, a scheduler's preemption):
    the grid's next start resumes it, so it is not labelled a crash."""
    assert experiment.run_status(75, tmp_path) == "stopped"
    assert experiment.run_status(0, tmp_path) == "done"
    assert experiment.run_status(2, tmp_path) == "refused"
    assert experiment.run_status(3, tmp_path) == "failed"
    assert experiment.run_status(1, tmp_path) == "crashed" and experiment.run_status(-9, tmp_path) == "crashed"
    (tmp_path / "failure.json").write_text("{}")
    assert experiment.run_status(1, tmp_path) == "failed"


def test_value_at_interpolates_and_tolerates_action_repeat_rounding():
    result = experiment.RunResult("t", "fp32", 1, Path("."), np.array([0.0, 10_008.0]), np.array([0.0, 100.0]), None)
    assert experiment.value_at(result, 10_000) == ("ok", pytest.approx(100 * 10_000 / 10_008))
    short = experiment.RunResult("t", "fp32", 1, Path("."), np.array([9_900.0]), np.array([5.0]), None)
    assert experiment.value_at(short, 10_000) == ("ok", 5.0)  # within 2%: rounding to whole agent steps
    assert experiment.value_at(short, 20_000) == ("missing", None)
    failed = experiment.RunResult("t", "fp16", 1, Path("."), np.array([100.0]), np.array([5.0]), 150.0)
    assert experiment.value_at(failed, 100) == ("ok", 5.0) and experiment.value_at(failed, 200) == ("failed", None)


def test_records_hold_commands_as_typed_in_the_repository():
    command = [
        sys.executable,
        "-m",
        "pixelsac.train",
        "seed=2",
        f"run_dir={REPO / 'runs' / 'g' / 's2'}",
        f"resume={REPO / 'runs' / 'g' / 's2'}",
        "run_dir=/elsewhere/s2",
    ]
    assert experiment.as_typed(command) == (
        "python -m pixelsac.train seed=2 run_dir=runs/g/s2 resume=runs/g/s2 run_dir=/elsewhere/s2"
    )
    assert experiment.relative(REPO / "docs" / "results") == "docs/results"


def test_modes_and_commands(tmp_path):
    assert experiment.parse_modes("main") == ["fp32", "fp16", "fp16-naive"]
    every = experiment.parse_modes("all")
    assert (
        len(every) == 11
        and "amp" in every
        and "fp16-six" in every
        and "fp16-no-kahan_momentum" in every
        and "bf16" not in every
    )
    assert experiment.MODES["fp16-no-hadam"] == ["precision=fp16", "lowp.hadam=false"]
    from pixelsac.config import load_config
    from pixelsac.precision import PrecisionPolicy

    fp32_actor_loss = PrecisionPolicy.from_config(load_config(experiment.MODES["fp16-fp32_actor_loss"]), "cpu")
    assert fp32_actor_loss.mode == "fp16" and fp32_actor_loss.loss_scaling and fp32_actor_loss.fp32_actor_loss
    assert not PrecisionPolicy.from_config(load_config(experiment.MODES["fp16"]), "cpu").fp32_actor_loss
    specs = experiment.build_grid(
        ["cartpole_swingup"], ["fp16-naive"], [4], "state", ["preset=state", "train.env_frames=3000"], tmp_path
    )
    (spec,) = specs
    assert spec.budget == 3000 and spec.run_dir == tmp_path / "cartpole_swingup" / "fp16-naive" / "s4"
    args = spec.fresh_args()
    assert {"precision=fp16", "lowp.all=false", "seed=4", "env.obs=state", "train.num_threads=1"} <= set(args)
    resume = spec.resume_args()
    assert resume[0] == f"resume={spec.run_dir}" and "train.env_frames=3000" in resume
    assert not any(a.startswith(("preset=", "env.", "precision=")) for a in resume)  # not resumable keys


@pytest.mark.parametrize(
    "args,message",
    [
        (["--modes", "fp16-no-hadm", "--tasks", "cartpole_swingup"], "did you mean 'fp16-no-hadam'"),
        (["--tasks", "cartpole_swingup", "--seeds", "1,x"], "not a whole number"),
        (["--tasks", "cartpole_swingup", "--jobs", "0"], "--jobs"),
        (["--tasks", "cartpole_swingup", "agent.batchsize=3"], "unknown key 'agent.batchsize'"),
        (["--tasks", "cheeta_run"], "unknown task 'cheeta_run'"),
        (["--tasks", "cartpole_swingup", "seed=3"], "seed= is set by the grid"),
        (["--tasks", "cartpole_swingup", "--bogus"], "unrecognized arguments"),
        (["--collect-only"], "no grid.json"),
        (["--tasks", "cartpole_swingup", "--paired-against", "fp33"], "--paired-against: unknown mode 'fp33'"),
        ([], "--tasks is required"),
        (["--tasks", "cartpole_swingup", "--dry-run", "agent.lr=.nan"], "agent.lr=nan must be a finite number"),
        (["--tasks", "cartpole_swingup", "--dry-run", "--seeds", "1,4294967295"], "seed=4294967295 is out of range"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "grid"
    assert experiment.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()


def test_dry_run_prints_commands_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "grid"
    assert (
        experiment.main(
            [
                "--modes",
                "main",
                "--tasks",
                "cartpole_swingup",
                "--seeds",
                "1,2",
                "--dry-run",
                "--out",
                str(out),
                *GRID_OVERRIDES,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert printed.count("-m pixelsac.train") == 6 and "lowp.all=false" in printed
    assert "6 of 6 runs would train" in printed and not out.exists()


# --- one grid per folder, signals, its record ------------------------------------------------------

GRID = ["--tasks", "cartpole_swingup", "--modes", "fp32,fp16", "--seeds", "1,2", *GRID_OVERRIDES]
#: a stand-in for pixelsac.train: marks its run directory, then waits; SIGTERM ends it as a stopped run
FAKE_TRAIN = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
    "run_dir = next(a.partition('=')[2] for a in sys.argv if a.startswith(('run_dir=', 'resume=')))\n"
    "(pathlib.Path(run_dir) / 'started').touch()\n"
    "time.sleep(300)\n"
)
GRID_WITH_FAKE_RUNS = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('experiment', sys.argv[1])\n"
    "experiment = sys.modules['experiment'] = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(experiment)\n"
    "experiment.train_command = lambda args: [sys.executable, '-c', sys.argv[2], *args]\n"
    "sys.exit(experiment.main(sys.argv[3:]))\n"
)


def test_a_signal_stops_the_grid_with_75_and_grid_json_says_what_ran(tmp_path):
    """SIGTERM to a grid of --jobs 2 exited 143 and left grid.json saying "running". It is passed
    on to the runs in progress (they stop with their work saved), none starts after it, and the
    grid exits 75 with them recorded as stopped and the rest as pending."""
    out = tmp_path / "grid"
    grid = subprocess.Popen(
        [sys.executable, "-c", GRID_WITH_FAKE_RUNS, str(REPO / "tools" / "experiment.py"), FAKE_TRAIN]
        + [*GRID, "--jobs", "2", "--out", str(out)],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(out.glob("*/*/*/started"))) < 2 and grid.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(out.glob("*/*/*/started"))) == 2, grid.communicate(timeout=60)
        grid.send_signal(signal.SIGTERM)
        stdout, stderr = grid.communicate(timeout=60)
    finally:
        grid.kill()
    assert grid.returncode == 75, stderr[-2000:]
    assert "grid: stopped by SIGTERM: 2 run(s) stopped with their work saved, 2 not started" in stdout
    runs = json.loads((out / "grid.json").read_text())["runs"]
    assert sorted(run["status"] for run in runs.values()) == ["pending", "pending", "stopped", "stopped"]


def test_a_second_grid_on_one_out_folder_is_refused(tmp_path, monkeypatch, capsys):
    """Two grids on one --out both rewrote grid.json and results.md and appended to one log."""
    from pixelsac.rundir import RunDirLock

    out = tmp_path / "grid"
    started = []
    monkeypatch.setattr(experiment, "execute", lambda plan, state, stop=None: started.append(plan) or "done")
    first = RunDirLock(out).acquire()  # the first grid, running
    try:
        assert experiment.main([*GRID, "--out", str(out)]) == 2
        assert experiment.main(["--collect-only", *GRID, "--budgets", "320", "--out", str(out)]) == 2
    finally:
        first.release()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(f"error: --out {out} is in use by pid {os.getpid()}" in line for line in err), err
    assert started == [] and [p.name for p in out.iterdir()] == [".lock"]


@pytest.mark.parametrize("collect_only", [False, True])
def test_a_grid_json_that_cannot_be_read_is_refused_not_overwritten(tmp_path, monkeypatch, capsys, collect_only):
    out = tmp_path / "grid"
    out.mkdir()
    (out / "grid.json").write_text('{"spec": {"tasks": ["cartpole_swingup"]}, "runs": {')  # cut short
    monkeypatch.setattr(experiment, "execute", lambda plan, state, stop=None: "done")
    args = ["--collect-only", *GRID, "--budgets", "320"] if collect_only else GRID
    assert experiment.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out / 'grid.json'} cannot be read ("), err
    assert "is not overwritten" in err[0]
    assert (out / "grid.json").read_text().endswith('"runs": {')
