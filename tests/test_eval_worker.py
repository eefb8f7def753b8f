"""Evaluation in a worker process (train.eval_in_worker): the same run, bit for bit, as evaluating
in the training process -- returns, videos, checkpoints' weights, training -- also when a run is
stopped with an evaluation in flight and resumed."""

import shutil
from pathlib import Path

import pytest
import torch
from test_stopping import EXIT_STOPPED, FAST, assert_same_training_state, checkpoint, logged, run

# film every evaluation
WORKER = [*(a for a in FAST if not a.startswith("train.video_every_evals")), "train.video_every_evals=1"]


@pytest.fixture(scope="module")
def in_process(tmp_path_factory) -> Path:
    """The reference: evaluations in the training process."""
    cwd = tmp_path_factory.mktemp("in_process")
    done = run(*WORKER, "train.eval_in_worker=false", f"run_dir={cwd / 'run'}", cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd / "run"


def _same_weights(a: dict, b: dict) -> None:
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    assert_same_training_state(checkpoint(run_dir), checkpoint(reference))
    _same_weights(checkpoint(run_dir, "best.ckpt"), checkpoint(reference, "best.ckpt"))
    assert logged(run_dir) == logged(reference)  # every row once, the same returns
    videos = sorted(p.name for p in (reference / "videos").glob("*.mp4"))
    assert videos == ["eval_000000160.mp4", "eval_000000320.mp4"]
    for name in videos:
        assert (run_dir / "videos" / name).read_bytes() == (reference / "videos" / name).read_bytes(), name
    assert not (run_dir / "checkpoints" / ".best-candidate.ckpt").exists()


@pytest.mark.slow
def test_evaluating_in_a_worker_is_the_same_run_bit_for_bit(tmp_path, in_process):
    done = run(*WORKER, "train.eval_in_worker=true", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = logged(in_process)[1]
    assert [s for s, _ in evals] == ["160", "320"] and len({r for _, r in evals}) == 2
    _assert_same_run(tmp_path / "run", in_process)


@pytest.fixture(scope="module")
def stopped_in_flight(tmp_path_factory) -> Path:
    """A run stopped with an evaluation in flight: the evaluation at frame 160 is handed over at
    update 4; the stop comes at update 6 and is saved at the episode boundary (frame 192), its
    result not taken yet. Tests resume copies of it."""
    cwd = tmp_path_factory.mktemp("stopped")
    stopped = run(
        *WORKER,
        "train.eval_in_worker=true",
        f"run_dir={cwd / 'run'}",
        cwd=cwd,
        SELF_SIGNAL="SIGTERM@6",
        EVAL_RESULTS_ON_WAIT="1",
    )
    assert stopped.returncode == EXIT_STOPPED, stopped.stderr[-3000:]
    return cwd / "run"


def _resume_copy(stopped: Path, tmp_path: Path, *overrides: str) -> Path:
    run_dir = Path(shutil.copytree(stopped, tmp_path / "run"))
    resumed = run(f"resume={run_dir}", *overrides, "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_a_run_stopped_with_an_evaluation_in_flight_resumes_it(tmp_path, in_process, stopped_in_flight):
    saved = checkpoint(stopped_in_flight)
    pending = saved["callbacks"]["Evaluator"]["pending"]
    assert pending is not None and pending["frames"] == 160 and pending["counters"]["updates"] == 4
    assert saved["callbacks"]["Evaluator"]["last_eval_frames"] == -1
    assert logged(stopped_in_flight)[1] == []  # its row comes with its result
    assert (stopped_in_flight / "checkpoints" / ".best-candidate.ckpt").is_file()
    _assert_same_run(_resume_copy(stopped_in_flight, tmp_path), in_process)


@pytest.mark.slow
def test_a_pending_evaluation_resumed_without_a_worker_runs_in_process(tmp_path, in_process, stopped_in_flight):
    _assert_same_run(_resume_copy(stopped_in_flight, tmp_path, "train.eval_in_worker=false"), in_process)


def test_a_resumed_run_drops_the_logged_row_of_the_evaluation_its_checkpoint_holds_in_flight(tmp_path):
    """The earlier process may have logged the result after its last checkpoint was written:
    the resumed run plays that evaluation again and logs it once."""
    import csv
    from types import SimpleNamespace

    from pixelsac.run import attach_loggers

    rows = [
        {"step": "160", "eval/return": "", "train/critic_loss": "1.0"},
        {"step": "176", "eval/return": "", "train/critic_loss": "0.9"},
        {"step": "160", "eval/return": "12.5", "train/critic_loss": ""},  # logged after the save at 192
        {"step": "192", "eval/return": "", "train/critic_loss": "0.8"},
        {"step": "224", "eval/return": "", "train/critic_loss": "0.7"},  # after the checkpoint
    ]

    def write_and_resume(pending: int | None) -> list[tuple[str, str]]:
        with open(tmp_path / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        trainer = SimpleNamespace(loggers=[], callbacks=[], is_global_zero=True)
        attach_loggers(SimpleNamespace(run_dir=tmp_path, trainer=trainer), 192, pending)
        trainer.callbacks[0].on_fit_start(trainer, None)  # the rows are kept once fit restored the checkpoint
        with open(tmp_path / "metrics.csv", newline="") as f:
            return [(r["step"], r["eval/return"]) for r in csv.DictReader(f)]

    assert write_and_resume(160) == [("160", ""), ("176", ""), ("192", "")]
    # nothing in flight: the evaluation's row is the checkpoint's and stays
    assert write_and_resume(None) == [("160", ""), ("176", ""), ("160", "12.5"), ("192", "")]
