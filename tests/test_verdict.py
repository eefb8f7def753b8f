"""The decision grid's reading (tools/verdict.py): read once at the seeds the rule fixed, interim
before that, and each seed's row naming the machine its runs were trained on."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import verdict  # noqa: E402

ZEN4 = "AMD EPYC (avx512_bf16), 2 CPUs, torch 2.13.0+cpu, no CUDA device"


def scored_grid(tmp_path: Path, scores: dict[int, tuple[float, float]], machines: dict | None = None) -> Path:
    """A grid whose fp16 and fp32 runs of each seed return one value at every evaluation to 100k;
    ``machines[(mode, seed)]`` is that run's hardware (None: no machine.txt), else ZEN4."""
    grid = tmp_path / "grid"
    for seed, by_mode in scores.items():
        for mode, value in zip(("fp16", "fp32"), by_mode):
            run_dir = grid / "cartpole_swingup" / mode / f"s{seed}"
            run_dir.mkdir(parents=True)
            rows = [f"{frames},{value}" for frames in range(10_000, 100_001, 10_000)]
            (run_dir / "metrics.csv").write_text("env_frames,eval/return\n" + "\n".join(rows) + "\n")
            machine = (machines or {}).get((mode, seed), ZEN4)
            if machine is not None:
                (run_dir / "machine.txt").write_text(
                    f"2026-12-07T09:00:00 fresh: other hardware; code 0000000\n"
                    f"2026-12-07T13:39:35 resume: {machine}; code 91ef7ac\n"
                )
    return grid


@pytest.mark.parametrize("verdict_seeds", [10, 3, None])
def test_the_grid_reading_is_the_verdict_only_from_the_seeds_fixed_for_it(tmp_path, capsys, verdict_seeds):
    """Three seeds within 2 of fp32's 200: 'matches' by the rule's arithmetic, but with 10 seeds
    fixed for the verdict the line is interim and carries no reading word."""
    grid = scored_grid(tmp_path, {1: (198.0, 200.0), 2: (201.0, 200.0), 3: (200.0, 200.0)})
    flag = [] if verdict_seeds is None else ["--verdict-seeds", str(verdict_seeds)]
    assert verdict.main([str(grid), "--out", str(tmp_path / "out"), *flag]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("**"))
    record = json.loads((tmp_path / "out" / "verdict.json").read_text())
    if verdict_seeds == 10:
        interim = "**interim, 3 of the 10 seeds the verdict is read at; decides nothing: fp16 - fp32 = -0.3"
        assert line.startswith(interim)
        assert not any(word in line for word in ("matches:", "lags:", "leads:", "undecided:"))
        assert record["interim"] is True and record["verdict_seeds"] == 10
    else:
        assert line.startswith("**matches: fp16 - fp32 = -0.3 over 3 seeds, 90% interval")
        assert record["interim"] is False
    assert record["verdict"]["reading"] == "matches"  # the arithmetic is kept either way


def test_each_seed_names_the_machine_its_runs_last_started_on(tmp_path, capsys):
    intel = "Intel(R) Xeon(R) Platinum 8480C (avx512_bf16 avx512_fp16 amx_bf16), 2 CPUs, torch 2.13.0+cpu"
    grid = scored_grid(
        tmp_path,
        {1: (190.0, 200.0), 2: (210.0, 200.0), 3: (205.0, 200.0)},
        {("fp16", 2): intel, ("fp16", 3): None, ("fp32", 3): None},
    )
    assert verdict.main([str(grid)]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert rows["1"].endswith(f"| -10.0 | {ZEN4} |")  # the last start's line, both runs alike: named once
    assert rows["2"].endswith(f"| +10.0 | fp16: {intel} / fp32: {ZEN4} |")
    assert rows["3"].endswith("| +5.0 | not recorded |")


def test_fewer_than_two_verdict_seeds_are_refused(tmp_path, capsys):
    grid = scored_grid(tmp_path, {1: (190.0, 200.0)})
    with pytest.raises(SystemExit) as stop:
        verdict.main([str(grid), "--verdict-seeds", "1"])
    assert stop.value.code == 2 and "--verdict-seeds takes 2 or more seeds" in capsys.readouterr().err
