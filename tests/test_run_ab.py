"""tools/run_ab.py: two training configurations interleaved round by round, their ratio.

The runs here are a stand-in for ``python -m pixelsac.train`` (``--python``): a script that writes
the summary and the log a run leaves, at a rate set by its arguments, and records the order it
was called in; the tool's own run of pixelsac.train is what the end-to-end results used."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import load_tool

FAKE_TRAIN = """#!{python}
import json, sys
from pathlib import Path

args = sys.argv[3:]  # after: -m pixelsac.train
run_dir = Path(next(a for a in args if a.startswith("run_dir="))[len("run_dir="):])
if "seed=13" in args:  # the failing configuration
    print("a failing run's last words")
    sys.exit(3)
rate = 150.0 if "train.overlap_collection=true" in args else 100.0
run_dir.mkdir(parents=True)
with open(run_dir.parent / "order.txt", "a") as f:
    f.write(("B" if rate > 100 else "A") + "\\n")
(run_dir / "summary.json").write_text(json.dumps(
    {{"wall_s": 6000 / rate, "env_frames": 6000, "env_frames_per_s": rate, "ms_per_update": 10.0}}))
rows = ["perf/env_frames_per_s,step"] + [f"{{rate * (0.5 if i < 2 else 1.0)}},{{i}}" for i in range(4)]
(run_dir / "metrics.csv").write_text("\\n".join(rows) + "\\n")
"""


@pytest.fixture
def fake_train(tmp_path):
    path = tmp_path / "fake_python"
    path.write_text(FAKE_TRAIN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def test_rounds_alternate_and_the_ratio_is_of_each_round(tmp_path, fake_train, capsys):
    tool = load_tool("run_ab.py")
    work, out = tmp_path / "work", tmp_path / "out" / "ab"
    argv = ["--a", "train.overlap_collection=false", "--b", "train.overlap_collection=true", "--rounds", "3"]
    argv += ["--work", str(work), "--python", fake_train, "--out", str(out), "--", "preset=tiny"]
    assert tool.main(argv) == 0
    assert (work / "order.txt").read_text().split() == ["A", "B", "B", "A", "A", "B"]  # A first in odd rounds
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["shared"] == ["preset=tiny"] and len(data["rounds"]) == 3
    first = data["rounds"][0]
    # the steady rate is the later half of the logged intervals (the first two are start-up's)
    assert first["a"]["env_frames_per_s"] == 100.0 and first["a"]["steady_env_frames_per_s"] == 100.0
    assert first["b"]["wall_s"] == 40.0
    table = out.with_suffix(".md").read_text()
    assert table.startswith("Command: `python tools/run_ab.py --a train.overlap_collection=false")
    assert "| median | | | 1.500 | 1.500 |" in table and "Machine: " in table and "torch " in table
    assert "| 1 | 60.0, 100.0, 100.0 | 40.0, 150.0, 150.0 | 1.500 | 1.500 |" in capsys.readouterr().out


def test_a_mistyped_key_is_refused_before_any_run(tmp_path, fake_train, capsys):
    tool = load_tool("run_ab.py")
    argv = ["--b", "train.overlap_collection=true", "--work", str(tmp_path / "w"), "--python", fake_train]
    assert tool.main([*argv, "--", "agent.batchsize=8"]) == 2
    assert "unknown key 'agent.batchsize'" in capsys.readouterr().err and not (tmp_path / "w").exists()
    with pytest.raises(SystemExit) as refused:
        tool.main(["--a", "x=1", "--b", "x=1"])
    assert refused.value.code == 2 and "the same configuration" in capsys.readouterr().err


def test_a_failing_run_stops_the_tool_with_its_log(tmp_path, fake_train):
    tool = load_tool("run_ab.py")
    argv = ["--b", "seed=13", "--rounds", "1", "--work", str(tmp_path / "w"), "--python", fake_train]
    with pytest.raises(SystemExit, match=r"(?s)the B run exited 3 .*a failing run's last words"):
        tool.main([*argv, "--", "preset=tiny"])
