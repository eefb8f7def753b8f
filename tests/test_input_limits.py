"""What a user types is read the way they mean it or refused in one line, exit code 2, before
anything is written: numbers in ordinary notation, a key given twice, counts that leave a result
undefined, sizes this machine cannot hold."""

import pytest
import torch
from conftest import TINY

STATE = [*TINY, "env.obs=state", "precision=fp32", "perf.calibrate_updates=0", "train.video_every_evals=0"]


def typed(tmp_path, monkeypatch, capsys, *args: str, entry: str = "train") -> tuple[int, str, str]:
    """An entry point's ``main(args)`` in this process, with ``args`` exactly as given (the
    harness's ``main_in`` resolves a repeated key; these tests type one on purpose)."""
    import importlib

    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    try:
        code = importlib.import_module(f"pixelsac.{entry}").main(list(args))
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


# --- numbers as people write them ------------------------------------------------------------------


def test_ordinary_float_notation_passes_the_command_line(tmp_path, monkeypatch, capsys):
    code, out, err = typed(
        tmp_path,
        monkeypatch,
        capsys,
        "agent.lr=1e-3",
        "agent.init_temperature=1E-1",
        "lowp.init_scale=1e6",
        "train.env_frames=1e6",
        "--print-config",
    )
    assert code == 0, err
    assert "lr: 0.001" in out and "init_temperature: 0.1" in out and "init_scale: 1000000.0" in out
    assert "env_frames: 1000000" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["agent.lr=" + "1" * 100_000], "error: agent.lr=1111111111... (100,000 digits) is too long to be a number"),
        (["train.env_frames=1e30"], "error: train.env_frames=1e30 is too large: integers stop at 2^63 - 1"),
        (["train.eval_episodes=0"], "error: train.eval_episodes=0 must be positive"),
        (
            ["agent.lr=1e-3", "seed=3", "agent.lr=3e-4"],
            "error: agent.lr is given twice: 'agent.lr=1e-3' and 'agent.lr=3e-4'; give each key once",
        ),
        (["resume=auto", "run_dir=r", "run_dir=s"], "error: run_dir is given twice: 'run_dir=r' and 'run_dir=s'"),
    ],
)
def test_train_refuses_in_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    given = {arg.partition("=")[0] for arg in args}
    code, _, err = typed(tmp_path, monkeypatch, capsys, *(o for o in STATE if o.partition("=")[0] not in given), *args)
    assert code == 2 and one_error_line(err).startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_evaluate_and_bench_refuse_a_key_given_twice(tmp_path, monkeypatch, capsys):
    code, _, err = typed(tmp_path, monkeypatch, capsys, "checkpoint=x", "episodes=2", "episodes=3", entry="evaluate")
    assert code == 2 and "episodes is given twice: 'episodes=2' and 'episodes=3'" in one_error_line(err)
    code, _, err = typed(tmp_path, monkeypatch, capsys, "agent.batch_size=8", "agent.batch_size=16", entry="bench")
    assert code == 2 and "agent.batch_size is given twice" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []
