"""Children end with the process that started them, however it ends (pixelsac/lifeline.py): a
tied multiprocessing child, one whose parent died before the tie, a subprocess tied before exec,
and end to end, the environment workers of a trainer killed with SIGKILL while they start."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TESTS, TINY, cli_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

PARENT = """
import multiprocessing as mp, os, subprocess, sys, time
from pixelsac import lifeline

if __name__ == "__main__":
    how = sys.argv[1]
    if how == "exec":
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        child = subprocess.Popen(sleeper, preexec_fn=lifeline.tie_before_exec())
    else:
        child = lifeline.tied_process(mp.get_context("spawn"), time.sleep, (600,), daemon=True)
        child.start()
    print(child.pid, flush=True)
    if how == "die-at-once":  # before the child could tie itself: it must notice by itself
        os.kill(os.getpid(), 9)
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for a reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def gone_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after ``seconds`` (then killed, so a failing test leaves no orphan)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.parametrize("how", ["spawn", "die-at-once", "exec"])
def test_a_tied_child_ends_with_its_parent_even_by_sigkill(tmp_path, how):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, how], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the parent printed {line!r}"
        child = int(line)
        if how != "die-at-once":
            time.sleep(1.0)  # the child starts (tied, or about to tie and check its parent)
            parent.kill()
        parent.wait(timeout=30)
        assert gone_within([child], 10.0) == [], f"{how}: the child outlived its parent"
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.slow
def test_sigkilled_trainer_takes_its_starting_env_workers_with_it(tmp_path):
    """The report: a trainer killed while its workers were still starting left them running.
    Here the workers' import of dm_control is held for a minute (tests/slow_start); the trainer
    is SIGKILLed meanwhile, and both workers must be gone within seconds."""
    marks = tmp_path / "marks"
    marks.mkdir()
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pixelsac.train",
            *TINY,
            "env.obs=state",
            "env.num_envs=2",
            "precision=fp32",
            "perf.calibrate_updates=0",
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        env=cli_env(TESTS / "slow_start", SLOW_START_DIR=str(marks), SLOW_START_SECONDS="120"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while len(workers) < 2 and time.monotonic() < deadline and trainer.poll() is None:
            workers = [int(p.name) for p in marks.iterdir() if p.name.isdigit()]
            time.sleep(0.1)
        assert len(workers) == 2, f"the workers did not start: {trainer.stderr.read() if trainer.poll() else ''}"
        assert {int((marks / str(w)).read_text()) for w in workers} == {trainer.pid}
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        assert gone_within(workers, 5.0) == [], "env workers outlived their SIGKILLed trainer"
    finally:
        trainer.kill()
        trainer.wait()
        gone_within(workers, 0.0)


def test_benchmark_cells_and_grid_runs_are_started_tied(tmp_path, monkeypatch):
    """The two subprocesses pixelsac starts by exec: a benchmark cell (killed with the benchmark)
    and a grid's training run (sent SIGTERM: it saves and the grid resumes it)."""
    from test_experiment import experiment

    from pixelsac.bench import cells

    calls = []

    def fake_run(command, **kwargs):
        if command[0] != "git":  # a run's machine.txt asks git for the code: a query, not a process left running
            calls.append(kwargs)
        return subprocess.CompletedProcess(command, 0, "", "")

    class FakePopen:  # the grid starts its runs with Popen (a stop signal is passed on to them)
        def __init__(self, command, **kwargs):
            calls.append(kwargs)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "run", fake_run)  # the benchmark's cells
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    cell = cells.CellSpec("fp32", [], 4, None, False, "default", "inductor", 1, 0, "cpu", [9, 84, 84], 6)
    with pytest.raises(RuntimeError, match="cell process exited 0"):  # the fake cell printed no row
        cells.run_cell_isolated(cell)
    spec = experiment.RunSpec("cartpole_swingup", "fp32", 1, tmp_path / "run", 320, [])
    experiment.execute(experiment.Plan(spec, "fresh"), experiment.GridState(tmp_path))
    assert len(calls) == 2 and all(callable(call.get("preexec_fn")) for call in calls)
