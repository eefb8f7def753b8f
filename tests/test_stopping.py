"""Stopping on a signal: SIGTERM/SIGINT/SIGUSR1 save the run's work and exit 75, resume=auto,
data-parallel stops, a signal during an evaluation and during a checkpoint write.

End-to-end tests run ``tests/stop_helper.py`` (``pixelsac.train.main`` plus hooks that mark an
update or send a signal at a chosen point) in a subprocess on the tiny configuration: 64-frame
episodes at action repeat 8 (8 agent steps), 320 frames, 16 seed steps, evaluation every 160.
"""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, TESTS, TINY, cli_env

EXIT_STOPPED = 75
STOP_EXIT_BOUND_S = 60.0  # signal -> exit, tiny preset: 2.5-4.5 s measured on the 2-core VM (see README); CI headroom
FAST = [*TINY, "perf.calibrate_updates=0", "train.video_every_evals=0", "train.num_threads=1"]  # 1 thread: runs overlap
HELPER = REPO / "tests" / "stop_helper.py"


def start(*args: str, cwd: Path, **hooks: str) -> subprocess.Popen:
    env = cli_env(TESTS, **hooks)
    return subprocess.Popen(
        [sys.executable, str(HELPER), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(*args: str, cwd: Path, **hooks: str) -> subprocess.CompletedProcess:
    return finish(start(*args, cwd=cwd, **hooks))


def checkpoint(run_dir: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)


def collected(state: dict) -> dict:
    return state["callbacks"]["Checkpointer"]["collector"]


def assert_same_training_state(a: dict, b: dict) -> None:
    """Weights, optimizer and scaler states, counters and collection RNGs: bit for bit."""
    assert a["pixelsac"]["updates"] == b["pixelsac"]["updates"] > 0
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"], strict=True):
        for idx, state in opt_a["state"].items():
            for name, value in state.items():
                other = opt_b["state"][idx][name]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, name
    assert a["pixelsac"]["scalers"] == b["pixelsac"]["scalers"]
    assert collected(a) == collected(b)


def logged(run_dir: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(step, updates) of the training-loss rows and (step, eval/return) of the evaluation rows."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train = [(r["step"], r["updates"]) for r in rows if r.get("train/critic_loss")]
    evals = [(r["step"], r["eval/return"]) for r in rows if r.get("eval/return")]
    return train, evals


# --- the decision, in process ---------------------------------------------------------------------


class FakeCollector(SimpleNamespace):
    """What StopOnSignal reads from a collector."""

    @property
    def total_env_frames(self) -> int:
        return self.agent_steps * 8


def make_stopper(max_wait_steps: int = 500, max_wait_seconds: float = 60.0, to_boundary: int | None = 3):
    from pixelsac.stopping import StopOnSignal, StopRequest

    collector = FakeCollector(
        agent_steps=20, num_envs=1, at_episode_boundary=to_boundary == 0, steps_to_episode_boundary=to_boundary
    )
    request = StopRequest()
    return (
        StopOnSignal(request, SimpleNamespace(), collector, None, max_wait_steps, max_wait_seconds),
        request,
        collector,
    )


def signal_now(request, name: str = "SIGTERM") -> None:
    request.count += 1
    request.signal_name, request.received_at = name, time.monotonic()


def test_no_signal_no_stop():
    stopper, _, _ = make_stopper()
    assert not stopper.decide()


def test_a_near_boundary_is_waited_for_and_the_stop_is_exact():
    stopper, request, collector = make_stopper(max_wait_steps=5, to_boundary=3)
    signal_now(request)
    for _ in range(3):
        assert not stopper.decide()
        collector.agent_steps += 1
        collector.steps_to_episode_boundary -= 1
    collector.at_episode_boundary = True
    assert stopper.decide() and stopper._exact


@pytest.mark.parametrize("setting", ["far", "second_signal", "no_time", "no_common_boundary"])
def test_otherwise_the_stop_is_at_once_and_inexact(setting):
    stopper, request, _ = make_stopper(
        max_wait_steps=2 if setting == "far" else 500,
        max_wait_seconds=0.0 if setting == "no_time" else 60.0,
        to_boundary=None if setting == "no_common_boundary" else 3,
    )
    signal_now(request)
    request.save_now = setting == "second_signal"
    assert stopper.decide() and not stopper._exact


def test_the_handler_records_signals_and_restores_the_previous_handlers():
    from pixelsac.stopping import handle_stop_signals

    before = signal.getsignal(signal.SIGUSR1)
    with handle_stop_signals("SIGUSR1") as request:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.pending and request.signal_name == "SIGUSR1" and not request.save_now
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.save_now  # the second one: save at once (a third would exit the process)
    assert signal.getsignal(signal.SIGUSR1) == before


def test_collector_knows_how_far_the_episode_boundary_is():
    from pixelsac.collect import Collector
    from pixelsac.envs.vector import SerialEnvs
    from pixelsac.replay import ReplaySet

    envs = SerialEnvs("cartpole_swingup", [0, 1], obs="state", episode_frames=40)  # repeat 8: 5 steps
    try:
        replay = ReplaySet(2, 50, envs.frame_shape, envs.frame_dtype, envs.frame_stack, envs.action_dim)
        collector = Collector(envs, replay, act=None, seed_steps=100, rng=np.random.default_rng(0))
        seen = [collector.steps_to_episode_boundary]
        for _ in range(6):
            collector.step()
            seen.append(collector.steps_to_episode_boundary)
        assert seen == [0, 4, 3, 2, 1, 0, 4]
    finally:
        envs.close()


@pytest.mark.parametrize(
    "args,message",
    [
        (["stop.signals=SIGKILL"], "stop.signals: 'SIGKILL' cannot be caught; choose from SIGTERM, SIGINT, SIGUSR1"),
        (["stop.signals=SIGTREM"], "stop.signals: 'SIGTREM' is not a stop signal (did you mean 'SIGTERM'?)"),
        (["resume=auto"], "resume=auto needs run_dir=DIR"),
        (["stop.max_wait_steps=-1"], "stop.max_wait_steps=-1 must be zero or more"),
    ],
)
def test_bad_stop_and_resume_settings_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch, args, message):
    from pixelsac.train import main

    monkeypatch.chdir(tmp_path)
    assert main([*TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_resume_auto_refuses_a_foreign_nonempty_run_dir(tmp_path, capsys):
    from pixelsac.train import main

    (tmp_path / "notes.txt").write_text("not a run")
    assert main([*TINY, f"run_dir={tmp_path}", "resume=auto", "trainer.accelerator=cpu"]) == 2
    assert "holds no pixelsac run (no config.yaml, no checkpoint)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_resuming_accepts_repeated_stored_values_only():
    from pixelsac.config import ConfigError, load_config, to_plain

    stored = to_plain(load_config([*TINY, "precision=fp32", "run_dir=r"]))
    cfg = load_config([*TINY, "precision=fp32", "run_dir=r", "resume=auto", "train.env_frames=640"], base=stored)
    assert cfg.train.env_frames == 640 and cfg.agent.batch_size == 8
    with pytest.raises(ConfigError, match=r"agent.batch_size cannot change when resuming .* with agent.batch_size=8"):
        load_config(["agent.batch_size=16", "resume=auto"], base=stored)


# --- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Uninterrupted fp32 and fp16 runs of the tiny budget, started together in the background."""
    root = tmp_path_factory.mktemp("uninterrupted")
    procs = {p: start(*FAST, f"precision={p}", f"run_dir={root / p}", cwd=root) for p in ("fp32", "fp16")}
    done: dict[str, Path] = {}

    def get(precision: str) -> Path:
        if precision not in done:
            result = finish(procs[precision])
            assert result.returncode == 0, result.stderr[-3000:]
            done[precision] = root / precision
        return done[precision]

    yield get
    for proc in procs.values():
        proc.kill()
        proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("precision,signame", [("fp32", "SIGTERM"), ("fp16", "SIGINT")])
def test_signal_after_logged_updates_saves_them_and_resume_equals_uninterrupted(
    tmp_path, uninterrupted, capsys, precision, signame
):
    run_dir, mark = tmp_path / "run", tmp_path / "mark"
    command = [
        *FAST,
        f"precision={precision}",
        f"run_dir={run_dir}",
        "resume=auto",  # a job script's one command
        "stop.max_wait_seconds=120",
    ]  # the boundary is 7 updates away: exact however loaded the machine
    # marked after update 9 (agent step 25): the stop lands at the boundary at step 32 (update 16), clear
    # of the checkpoint the evaluation at frame 160 asked for (written at step 24)
    proc = start(*command, cwd=tmp_path, MARK_FILE=str(mark), MARK_UPDATES="9", UPDATE_SLEEP="0.2")
    while not mark.exists() and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, finish(proc).stderr[-3000:]
    logged_updates = int(mark.read_text())
    proc.send_signal(getattr(signal, signame))
    sent = time.monotonic()
    stopped = finish(proc)
    took = time.monotonic() - sent
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    assert took < STOP_EXIT_BOUND_S
    last_line = stopped.stdout.strip().splitlines()[-1]
    assert last_line.startswith(f"stopped by {signame} after update ") and "resume=" in last_line
    assert f"saved {run_dir / 'checkpoints' / 'last.ckpt'} with its replay (exact: at an episode boundary)" in last_line
    saved = checkpoint(run_dir)
    assert logged_updates <= saved["pixelsac"]["updates"] == 16
    assert collected(saved)["at_episode_boundary"] and saved["callbacks"]["Checkpointer"]["stopped_by"] == signame
    assert (run_dir / "checkpoints" / saved["callbacks"]["Checkpointer"]["replay_file"]).is_file()

    resumed = run(*command, cwd=tmp_path)  # the same command again: resume=auto finds the checkpoint
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'} at env frame {collected(saved)['env_frames']}, "
        f"saved on {signame}" in resumed.stdout
    )
    straight = uninterrupted(precision)
    assert_same_training_state(checkpoint(run_dir), checkpoint(straight))
    train_rows, eval_rows = logged(run_dir)
    assert (train_rows, eval_rows) == logged(straight)  # every row once, none lost, none twice
    assert len(set(train_rows)) == len(train_rows) and [s for s, _ in eval_rows] == ["160", "320"]

    if precision == "fp32":  # and once more: nothing left to do (in process: it returns before building anything)
        from pixelsac.train import main

        assert main(command) == 0
        assert capsys.readouterr().out.startswith(f"already done: {run_dir / 'checkpoints' / 'last.ckpt'} holds 320")


@pytest.mark.slow
def test_signal_during_evaluation_gives_it_up_saves_at_once_and_resume_runs_it(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    stopped = run(*FAST, "precision=fp32", f"run_dir={run_dir}", cwd=tmp_path, SIGNAL_AT_EVAL="SIGTERM")
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    assert "(inexact: mid-episode" in stopped.stdout  # the evaluation at frame 160 is mid-episode
    saved = checkpoint(run_dir)
    assert collected(saved)["env_frames"] == 160 and not collected(saved)["at_episode_boundary"]
    assert saved["callbacks"]["Evaluator"]["next_eval"] == 160  # still due
    assert logged(run_dir)[1] == []  # nothing logged for the evaluation given up

    resumed = run(f"resume={run_dir}", "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "mid-episode: new episodes start" in resumed.stdout
    evals = logged(run_dir)[1]
    assert [s for s, _ in evals] == ["160", "320"]
    # the same weights and eval-environment seeds as the uninterrupted run's evaluation at 160
    assert evals[0] == logged(uninterrupted("fp32"))[1][0]
    assert collected(checkpoint(run_dir))["env_frames"] == 320


@pytest.mark.slow
def test_signals_before_any_work_and_during_a_checkpoint_write(tmp_path):
    # a signal before the first agent step: nothing to save, exit 75, no checkpoint
    once = tmp_path / "once"
    command = [*FAST, "precision=fp32", f"run_dir={once}", "resume=auto"]
    result = run(*command, cwd=tmp_path, SIGNAL_AT_SETUP="SIGTERM")
    assert result.returncode == EXIT_STOPPED, result.stderr[-3000:]
    assert (
        "stopped by SIGTERM after update 0 at env frame 0, before any new work: nothing to save (there is no "
        "checkpoint yet)" in result.stdout
    )
    assert (once / "config.yaml").is_file() and not (once / "checkpoints" / "last.ckpt").exists()

    # the same command again starts afresh in what that attempt left; one signal while the checkpoint
    # requested by the evaluation at 160 is written (at 192, an episode boundary): the write
    # completes and is the stop's checkpoint
    result = run(*command, cwd=tmp_path, SIGNAL_DURING_SAVE="SIGTERM@1")
    assert result.returncode == EXIT_STOPPED, result.stderr[-3000:]
    assert (
        f"stopped by SIGTERM after update 8 at env frame 192: saved {once / 'checkpoints' / 'last.ckpt'}"
        in result.stdout
    )
    assert collected(checkpoint(once))["env_frames"] == 192 and collected(checkpoint(once))["at_episode_boundary"]

    # two while the next one (at 320) is written: exit at once, the one from 192 intact and loadable
    twice = tmp_path / "twice"
    result = run(
        *FAST,
        "precision=fp32",
        "train.env_frames=640",
        f"run_dir={twice}",
        cwd=tmp_path,
        SIGNAL_DURING_SAVE="SIGINT@2x2",
    )
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
    assert "SIGINT again: exiting now with code 130" in result.stderr
    previous = checkpoint(twice)  # weights_only=True
    assert collected(previous)["env_frames"] == 192
    assert (twice / "checkpoints" / previous["callbacks"]["Checkpointer"]["replay_file"]).is_file()
    assert all(torch.isfinite(v).all() for v in previous["state_dict"].values() if v.is_floating_point())


DDP = ["trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu", "train.num_threads=1"]


def rank_results(dump: Path, timeout: float = 120) -> tuple[dict, dict, list[int]]:
    """Both ranks' final states and exit codes (rank 1 may exit after rank 0, the launcher)."""
    deadline = time.monotonic() + timeout
    while not all((dump / f"exit-rank{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = [int((dump / f"exit-rank{r}").read_text()) for r in (0, 1)]
    return torch.load(dump / "rank0.pt"), torch.load(dump / "rank1.pt"), codes


@pytest.mark.slow
def test_ddp_signal_to_one_rank_stops_both_at_the_same_update_and_both_resume(tmp_path):
    run_dir, first, second = tmp_path / "run", tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    # rank 1 alone gets SIGTERM after its update 6; each rank has 160 frames = 20 steps, boundaries every 8
    stopped = run(
        *FAST,
        *DDP,
        "precision=fp32",
        f"run_dir={run_dir}",
        cwd=tmp_path,
        DUMP_DIR=str(first),
        SELF_SIGNAL="SIGTERM@6@1",
    )
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    a, b, codes = rank_results(first)
    assert codes == [EXIT_STOPPED, EXIT_STOPPED]
    assert a["updates"] == b["updates"] == 8 and a["env_frames"] == b["env_frames"] == 128  # the boundary at step 16
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    saved = checkpoint(run_dir)
    mine = saved["callbacks"]["Checkpointer"]
    assert saved["pixelsac"]["updates"] == 8 and len(mine["ranks"]) == 2
    assert mine["ranks"][0]["collector"]["rng"] != mine["ranks"][1]["collector"]["rng"]  # each rank's own
    assert all((run_dir / "checkpoints" / r["replay_file"]).is_file() for r in mine["ranks"])

    resumed = run(f"resume={run_dir}", *DDP, "trainer.enable_progress_bar=false", cwd=tmp_path, DUMP_DIR=str(second))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b, codes = rank_results(second)
    assert codes == [0, 0] and a["updates"] == b["updates"] == 12 and a["env_frames"] == 160
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert resumed.stdout.count("done:") == 1


@pytest.mark.slow
def test_ddp_a_killed_rank_leaves_the_other_with_one_line_and_exit_5(tmp_path):
    """A data-parallel rank SIGKILLed mid-run left the other with gloo's traceback and exit 1; it
    now says which rank ended and that resume=auto continues, with exit code 5."""
    run_dir, dump, mark = tmp_path / "run", tmp_path / "dump", tmp_path / "mark"
    dump.mkdir()
    proc = start(
        *FAST,
        *DDP,
        "precision=fp32",
        f"run_dir={run_dir}",
        cwd=tmp_path,
        DUMP_DIR=str(dump),
        MARK_FILE=str(mark),
        MARK_UPDATES="3",
        UPDATE_SLEEP="0.3",
    )
    try:
        deadline = time.monotonic() + 300
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), finish(proc, timeout=60).stderr[-3000:]
        os.kill(int((dump / "pid-rank1").read_text()), signal.SIGKILL)
        result = finish(proc, timeout=300)
    finally:
        proc.kill()
    assert result.returncode == 5, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "error: rank 1 of the 2 data-parallel ranks ended while rank 0 waited for it in a collective (" in (
        result.stderr
    )
    assert "run the same command with resume=auto to continue" in result.stderr
