"""The command line, end to end: a tiny real run, and bad input refused with exit code 2."""

import subprocess
import sys

import pytest
import torch
from conftest import TINY, cli_env, main_in, run_cli


@pytest.mark.slow
def test_tiny_run_writes_logs_config_and_checkpoints(tiny_fp32_run):
    run_dir = tiny_fp32_run.run_dir
    assert "replay buffer:" in tiny_fp32_run.stdout and "done:" in tiny_fp32_run.stdout
    assert (run_dir / "config.yaml").is_file()
    assert "cartpole_swingup" in (run_dir / "config.yaml").read_text()
    csv = (run_dir / "metrics.csv").read_text().splitlines()
    header = csv[0].split(",")
    for column in (
        "env_frames",
        "agent_steps",
        "updates",
        "train/critic_loss",
        "train/actor_loss",
        "train/alpha",
        "train/entropy",
        "train/episode_return",
        "eval/return",
    ):
        assert column in header, column
    assert len(csv) > 3
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_file() and (run_dir / "checkpoints" / "best.ckpt").is_file()
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    assert checkpoint["pixelsac"]["updates"] > 0
    assert len(checkpoint["optimizer_states"]) == 3
    assert checkpoint["hyper_parameters"]["config"]["task"] == "cartpole_swingup"
    # 320 env frames at repeat 8 = 40 agent steps; 16 seed steps -> 24 updates
    assert checkpoint["pixelsac"]["updates"] == 24
    # every 5th evaluation is filmed, starting with the first (at frame 160)
    assert sorted(p.name for p in (run_dir / "videos").iterdir()) == ["eval_000000160.mp4"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["agent.batchsize=3"], "unknown key 'agent.batchsize' (did you mean 'agent.batch_size'?)"),
        (["agent.batch_size=big"], "has the wrong type"),
        (["agent.batch_size=0"], "must be positive"),
        (["task=cheeta_run"], "unknown task 'cheeta_run' (did you mean 'cheetah_run'?)"),
        (["precision=fp64"], "unknown precision"),
        (["trainer.accelerator=tpu-nope"], "invalid trainer settings"),
        (
            ["task=cartpole_swingup", "train.env_frames=320", "train.seed_steps=40"],
            "train.env_frames=320 ends within the random seed phase (train.seed_steps=40 x action "
            "repeat 8 = 320 frames), so no update would run",
        ),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys, args, message):
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *args, "run_dir=out")
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert list(tmp_path.iterdir()) == []


# python -m pixelsac.train, then whether Lightning (seconds to import) was loaded before the refusal
AS_MAIN_THEN_LIGHTNING_LOADED = """
import runpy, sys
sys.argv = ["pixelsac.train", *sys.argv[1:]]
try:
    runpy.run_module("pixelsac.train", run_name="__main__", alter_sys=True)
finally:
    print("lightning" in sys.modules)
"""


def test_bad_input_from_the_command_line_exits_2_in_one_line_before_loading_lightning(tmp_path):
    """The cases above call main() in process; this one is the process and its exit code."""
    result = subprocess.run(
        [sys.executable, "-c", AS_MAIN_THEN_LIGHTNING_LOADED, "agent.batchsize=3", "run_dir=out"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: unknown key 'agent.batchsize'") and result.stderr.count("\n") == 1
    assert result.stdout.strip() == "False"
    assert list(tmp_path.iterdir()) == []


def test_existing_run_dir_is_not_clobbered(tmp_path, monkeypatch, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *TINY, "run_dir=out")
    assert code == 2
    assert "already exists" in stderr and "overwrite=true" in stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]


def test_help_exits_0(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0 and "pixelsac-train" in result.stdout


@pytest.mark.slow
def test_tiny_fp16_run_ends_with_finite_fp16_weights(tiny_fp16_run):
    run_dir = tiny_fp16_run.run_dir  # no precision= given: the default, fp16 + six
    assert "precision fp16" in tiny_fp16_run.stdout and "fp16: " in tiny_fp16_run.stdout
    assert "x fp32's updates/s" in tiny_fp16_run.stdout  # what this CPU runs fp16 with, and the speed to expect
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    weights = {k: v for k, v in checkpoint["state_dict"].items() if v.is_floating_point()}
    assert weights and all(v.dtype == torch.float16 for v in weights.values())
    assert all(torch.isfinite(v).all() for v in weights.values())
    scalers = checkpoint["pixelsac"]["scalers"]
    assert set(scalers) == {"critic", "actor", "alpha"}
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "lowp/loss_scale_critic" in header and "lowp/skipped_critic" in header


@pytest.mark.parametrize(
    "error,said",
    [
        (
            "worker",
            "error: env worker 1 (cartpole_swingup, seed 2) died with exit code -9; the last checkpoint in ",
        ),
        (
            "rank",
            "error: rank 1 of the 2 data-parallel ranks ended while rank 0 waited for it in a collective "
            "(Connection closed by peer [127.0.0.1]:15009); the last checkpoint in ",
        ),
    ],
)
def test_a_process_of_the_run_that_died_exits_5_saying_resume_continues(tmp_path, monkeypatch, capsys, error, said):
    """A killed env worker exited 2 ("bad input": a grid recorded the run as refused) and a killed
    data-parallel rank left the other with gloo's traceback and exit 1. Neither is bad input: one
    line, its own code, and resume=auto continues."""
    import pixelsac.distributed  # noqa: F401  (loaded by every run; lost_rank reads the gloo error)
    import pixelsac.train as train_mod
    from pixelsac.envs.vector import EnvWorkerError

    def dies(cfg, stop=None, resume=None):
        if error == "worker":
            raise EnvWorkerError("env worker 1 (cartpole_swingup, seed 2) died with exit code -9")
        raise RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:15009. "
            "This is typically caused by a remote worker crashing."
        )

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_mod, "train", dies)
    code, err = main_in(tmp_path, monkeypatch, capsys, *TINY, "run_dir=out")
    assert code == 5 and err.count("\n") == 1, err
    assert err.startswith(said) and err.rstrip().endswith("run the same command with resume=auto to continue"), err
