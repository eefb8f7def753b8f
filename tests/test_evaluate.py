"""Evaluation from checkpoints and episode videos: a tiny real fp16 run, evaluated on the CPU
through the command line and in-process; videos read back; bad input refused with exit code 2
and nothing written."""

from __future__ import annotations

import csv
import dataclasses
import fractions
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from conftest import cli_env

from pixelsac import evaluate as ev
from pixelsac import video
from pixelsac.checkpoint import FORMAT_VERSION
from pixelsac.collect import run_episodes
from pixelsac.config import REPORT_SEED_OFFSET, ConfigError
from pixelsac.envs import DMCEnv

STEPS_PER_EPISODE = 64 // 8  # env.episode_frames / cartpole_swingup's action repeat
FRAMES_PER_EPISODE = STEPS_PER_EPISODE + 1  # the reset frame, then one per agent step


def read_video(path: Path) -> list[np.ndarray]:
    with imageio.get_reader(path) as reader:
        return [np.asarray(frame) for frame in reader]


def eval_frames(run_dir: Path) -> set[int]:
    """The env frames at which training evaluated (and so wrote a checkpoint)."""
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(float(row["env_frames"])) for row in csv.DictReader(f) if row.get("eval/return")}


def said(capsys) -> str:
    """What an evaluation wrote to stderr, less the line a process's first render writes once (which
    OpenGL it found): it comes or not depending on which test rendered first in the process."""
    return "".join(line for line in capsys.readouterr().err.splitlines(True) if not line.startswith("render: "))


def files_under(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


# --- the command line, end to end ----------------------------------------------------------------
@pytest.mark.slow
def test_cli_evaluates_fp16_run_on_cpu_with_agent_view_video(run16, tmp_path):
    out_dir = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pixelsac.evaluate",
            f"checkpoint={run16}",
            "episodes=2",
            "video=true",
            "agent_view=true",
            f"out_dir={out_dir}",
            "device=auto",
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)  # the table, for the record (pytest -s)
    table = result.stdout.splitlines()
    assert any(line.split()[:1] == ["0"] for line in table) and any(line.split()[:1] == ["1"] for line in table)
    assert any(line.strip().startswith("mean") and "±" in line for line in table)

    results = json.loads((out_dir / "results.json").read_text())
    assert results["task"] == "cartpole_swingup" and results["precision"] == "fp16"
    assert results["device"] == "cpu"
    # fp16's defaults: the six and the switches beyond them, except bf16's fp32 actor ones
    assert results["lowp"] == {
        **dict.fromkeys(["hadam", "loss_scaling", "kahan_gradients", "kahan_momentum", "softplus_fix"], True),
        **dict.fromkeys(["normal_fix", "unbiased_moments", "stochastic_weights", "derived_target"], True),
        "stochastic_first_moment": True,
        **dict.fromkeys(["adaptive_target_scale", "headroom_growth", "fp32_q_output"], True),
        **dict.fromkeys(["fp32_actor_loss", "fp32_actor_features"], False),
    }
    assert results["checkpoint"].endswith("best.ckpt")  # a run directory means its best checkpoint
    assert results["episodes"] == 2 and len(results["returns"]) == 2
    assert all(math.isfinite(r) for r in results["returns"])
    assert results["lengths"] == [STEPS_PER_EPISODE] * 2
    assert results["mean"] == pytest.approx(np.mean(results["returns"]))
    assert results["std"] == pytest.approx(np.std(results["returns"]))
    assert results["seed"] == 1 + REPORT_SEED_OFFSET  # training seed 1, distinct eval stream
    assert results["updates"] == 4 and results["env_frames"] in eval_frames(run16)
    assert results["wall_seconds"] > 0

    # default video_episodes=0; the policy's 32x32 view is shown at 256 beside the 256x256 scene
    assert results["videos"] == ["episode_000.mp4"]
    frames = read_video(out_dir / "episode_000.mp4")
    assert len(frames) == FRAMES_PER_EPISODE
    assert frames[0].shape == (256, 512, 3)


def test_missing_checkpoint_exits_2_from_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pixelsac.evaluate", "checkpoint=nope.ckpt"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: checkpoint nope.ckpt does not exist")
    assert list(tmp_path.iterdir()) == []


# --- in-process evaluation -----------------------------------------------------------------------
def precision_variant(real_checkpoint: Path, precision: str, dest: Path) -> Path:
    """A checkpoint laid out exactly like the real one, for another precision mode, with that
    mode's freshly initialised networks (cheaper than training each mode)."""
    from pixelsac.module import SACModule

    checkpoint = torch.load(real_checkpoint, map_location="cpu", weights_only=True)
    hparams = checkpoint["hyper_parameters"]
    config = {**hparams["config"], "precision": precision}
    module = SACModule(config, tuple(hparams["obs_shape"]), hparams["action_dim"])
    checkpoint["hyper_parameters"] = {**hparams, "config": config}
    checkpoint["state_dict"] = module.state_dict()
    checkpoint["optimizer_states"] = []
    torch.save(checkpoint, dest)
    return dest


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("amp", torch.float32)])
def test_every_precision_mode_evaluates_on_cpu(run16, tmp_path, precision, dtype):
    file = precision_variant(run16 / "checkpoints" / "last.ckpt", precision, tmp_path / f"{precision}.ckpt")
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    module = ev.load_agent(file, checkpoint, torch.device("cpu"))
    assert module.log_alpha.dtype == dtype
    lines: list[str] = []
    evaluation = ev.evaluate(
        ev.parse_options([f"checkpoint={file}", "episodes=1", f"out_dir={tmp_path / 'out'}"]), out=lines.append
    )
    assert evaluation.results["precision"] == precision
    assert math.isfinite(evaluation.results["returns"][0])
    # no video flag: the first episode is filmed all the same
    assert (tmp_path / "out" / "results.json").is_file()
    assert evaluation.videos == [tmp_path / "out" / "episode_000.mp4"] and evaluation.videos[0].stat().st_size > 0
    assert evaluation.results["videos"] == ["episode_000.mp4"]
    assert any(line.strip().startswith("mean") for line in lines)


def test_fp16_checkpoint_keeps_fp16_weights_on_cpu(run16):
    file = run16 / "checkpoints" / "best.ckpt"
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    module = ev.load_agent(file, checkpoint, torch.device("cpu"))
    assert {p.dtype for p in module.parameters()} == {torch.float16}
    env = ev.make_env(checkpoint["hyper_parameters"]["config"], seed=3)
    try:
        action = module.act(env.reset().obs[None], False)
    finally:
        env.close()
    assert action.dtype == np.float32 and np.isfinite(action).all() and np.abs(action).max() <= 1


def test_default_out_dir_is_inside_the_run_and_prefer_last(run16, tmp_path):
    run_copy = shutil.copytree(run16, tmp_path / "run")
    evaluation = ev.evaluate(
        ev.parse_options(
            [f"checkpoint={run_copy}", "prefer=last", "episodes=1", "video_episodes=all", "video_size=48"]
        ),
        out=lambda line: None,
    )
    assert evaluation.out_dir.parent == run_copy / "eval"
    assert evaluation.out_dir.name.startswith("last-")
    assert evaluation.results["checkpoint"] == str((run_copy / "checkpoints" / "last.ckpt").resolve())
    frames = read_video(evaluation.out_dir / "episode_000.mp4")
    assert len(frames) == FRAMES_PER_EPISODE and frames[0].shape == (48, 48, 3)


def test_sampled_evaluation_repeats_with_its_seed(run16, tmp_path):
    def returns(name: str) -> list[float]:
        options = ev.parse_options(
            [f"checkpoint={run16}", "episodes=2", "sample=true", "seed=7", f"out_dir={tmp_path / name}"]
        )
        return ev.evaluate(options, out=lambda line: None).results["returns"]

    first = returns("a")
    assert returns("b") == first
    deterministic = ev.evaluate(
        ev.parse_options([f"checkpoint={run16}", "episodes=2", "seed=7", f"out_dir={tmp_path / 'c'}"]),
        out=lambda line: None,
    )
    assert deterministic.results["sample"] is False and deterministic.results["returns"] != first


def test_options_parse_types_lists_and_defaults():
    options = ev.parse_options(["checkpoint=2024", "video_episodes=0,2", "episodes=3", "seed=null"])
    assert options.checkpoint == "2024"  # a path stays text even when YAML would read a number
    assert options.video and options.video_episodes == (0, 2) and options.seed is None
    assert ev.parse_options(["checkpoint=x", "video_episodes=all"]).video_episodes is None
    assert ev.parse_options(["checkpoint=x", "video_episodes=[1, 0]", "episodes=2"]).video_episodes == (0, 1)
    assert ev.parse_options(["checkpoint=x"]) == ev.EvalOptions(checkpoint="x")


# --- bad input: exit code 2, one line, nothing written ------------------------------------------------
def _bad_checkpoint(kind: str, real: Path, folder: Path) -> Path:
    if kind == "missing":
        return folder / "missing.ckpt"
    if kind == "text":
        (folder / "notes.ckpt").write_text("these are my notes, not a checkpoint\n")
        return folder / "notes.ckpt"
    if kind == "truncated":
        data = real.read_bytes()
        (folder / "cut.ckpt").write_bytes(data[: len(data) // 2])
        return folder / "cut.ckpt"
    if kind == "empty_run_dir":
        (folder / "run" / "checkpoints").mkdir(parents=True)
        return folder / "run"
    checkpoint = torch.load(real, map_location="cpu", weights_only=True)
    if kind == "format":
        checkpoint["pixelsac"]["format"] = FORMAT_VERSION + 1
    elif kind == "pickled":
        checkpoint["note"] = fractions.Fraction(1, 3)  # any class outside torch's weights_only allowlist
    elif kind == "nan":
        name = next(k for k, v in checkpoint["state_dict"].items() if v.is_floating_point())
        checkpoint["state_dict"][name] = torch.full_like(checkpoint["state_dict"][name], float("nan"))
    torch.save(checkpoint, folder / f"{kind}.ckpt")
    return folder / f"{kind}.ckpt"


@pytest.mark.parametrize(
    "kind,extra,message",
    [
        ("missing", [], "missing.ckpt does not exist"),
        ("text", [], "is not a readable checkpoint"),
        ("truncated", [], "is not a readable checkpoint, or is truncated"),
        ("empty_run_dir", [], "no checkpoint in"),
        (
            "format",
            [],
            f"has checkpoint format {FORMAT_VERSION + 1}; this pixelsac reads formats 1 and {FORMAT_VERSION}",
        ),
        ("pickled", [], "holds pickled Python objects"),
        ("nan", [], "holds non-finite weights"),
        ("good", ["episods=3"], "unknown option 'episods' (did you mean 'episodes'?)"),
        ("good", ["episodes=ten"], "episodes='ten' has the wrong type; it takes an integer"),
        ("good", ["episodes=0"], "episodes=0 must be positive"),
        ("good", ["video=yes please"], "video='yes please' has the wrong type; it takes true or false"),
        ("good", ["episodes=2", "video_episodes=3"], "video_episodes [3] do not exist"),
        ("good", ["video=false", "agent_view=true"], "video=false contradicts agent_view"),
        ("good", ["prefer=newest"], "prefer='newest'; choose one of best, last"),
        ("good", ["video=true", "video_size=100000"], "exceeds the offscreen buffer"),
        ("good", ["device=tpu"], "device='tpu'; choose auto, cpu, cuda or cuda:N"),
        pytest.param(
            "good",
            ["device=cuda"],
            "torch sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        ("good", ["verbose"], "expected key=value"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(run16, tmp_path, capsys, kind, extra, message):
    real = shutil.copy(run16 / "checkpoints" / "best.ckpt", tmp_path / "good.ckpt")
    checkpoint = real if kind == "good" else _bad_checkpoint(kind, Path(real), tmp_path)
    before = files_under(tmp_path)
    code = ev.main([f"checkpoint={checkpoint}", *extra])
    err = said(capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert files_under(tmp_path) == before  # no eval/ folder, no results


def test_existing_out_dir_is_not_clobbered(run16, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    code = ev.main([f"checkpoint={run16}", f"out_dir={tmp_path / 'out'}", "episodes=1"])
    assert code == 2 and "already exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_missing_checkpoint_option_and_help(capsys):
    assert ev.main(["episodes=3"]) == 2
    assert "checkpoint=PATH is required" in capsys.readouterr().err
    assert ev.main(["--help"]) == 0
    assert "pixelsac-evaluate" in capsys.readouterr().out


def test_pickled_checkpoint_loads_when_trusted(run16, tmp_path):
    file = _bad_checkpoint("pickled", run16 / "checkpoints" / "best.ckpt", tmp_path)
    evaluation = ev.evaluate(
        ev.parse_options([f"checkpoint={file}", "trust_checkpoint=true", "episodes=1", f"out_dir={tmp_path / 'out'}"]),
        out=lambda line: None,
    )
    assert math.isfinite(evaluation.results["mean"])


# --- the recorder and the video writer ----------------------------------------------------------------
def test_recorder_films_chosen_episode_with_the_policy_view_beside(tmp_path):
    env = DMCEnv("cartpole_swingup", image_size=32, episode_frames=64, seed=0)
    recorder = video.EpisodeRecorder(size=64, agent_view=True, episodes={1})
    current_episode = [-1]
    seen: list[np.ndarray] = []  # the observations the policy was given in episode 1, in order

    def act(obs: np.ndarray, sample: bool) -> np.ndarray:
        if current_episode[0] == 1:
            seen.append(obs[0].copy())
        return np.full((1, env.action_dim), 0.5, dtype=np.float32)

    def on_frame(episode: int, env_: DMCEnv) -> None:
        current_episode[0] = episode
        recorder(episode, env_)

    try:
        run_episodes(env, act, 2, on_frame=on_frame)
    finally:
        env.close()
    assert set(recorder.frames) == {1}
    frames = recorder.frames[1]
    assert len(frames) == FRAMES_PER_EPISODE and frames[0].shape == (64, 128, 3)
    assert recorder.fps == pytest.approx(1 / (0.01 * 8))  # cartpole: 10 ms control step, repeat 8
    # Every acted-on observation's newest frame, enlarged 2x, is the right half of its video frame.
    assert len(seen) == STEPS_PER_EPISODE
    for frame, obs in zip(frames, seen):
        newest = obs[-3:].transpose(1, 2, 0)
        np.testing.assert_array_equal(frame[:, 64:], newest.repeat(2, axis=0).repeat(2, axis=1))
    assert not np.array_equal(frames[0][:, :64], frames[0][:, 64:])  # the left half is a fresh render

    path = recorder.save(tmp_path / "ep1.mp4")
    assert path == tmp_path / "ep1.mp4" and len(read_video(path)) == FRAMES_PER_EPISODE
    with pytest.raises(ValueError, match="nothing recorded for episode 0"):
        recorder.save(tmp_path / "ep0.mp4", episode=0)


def test_mp4_keeps_small_and_odd_sizes(tmp_path):
    rng = np.random.default_rng(0)
    frames84 = [rng.integers(0, 255, (84, 84, 3), dtype=np.uint8) for _ in range(3)]
    assert read_video(video.write_video(tmp_path / "a.mp4", frames84))[0].shape == (84, 84, 3)  # not 96x96
    odd = [rng.integers(0, 255, (33, 35, 3), dtype=np.uint8) for _ in range(2)]
    back = read_video(video.write_video(tmp_path / "b.mp4", odd))
    assert len(back) == 2 and back[0].shape == (34, 36, 3)  # padded by one row/column, not resized


def test_gif_fallback_without_ffmpeg(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(video, "ffmpeg_available", lambda: False)
    frames = [np.full((20, 30, 3), value, dtype=np.uint8) for value in (0, 128, 255)]
    path = video.write_video(tmp_path / "clip.mp4", frames, fps=10)
    assert path == tmp_path / "clip.gif" and not (tmp_path / "clip.mp4").exists()
    with Image.open(path) as gif:
        assert gif.n_frames == 3 and gif.size == (30, 20) and gif.info["duration"] == 100


def test_upscale_nearest_repeats_pixels():
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    np.testing.assert_array_equal(video.upscale_nearest(image, 6), image.repeat(3, axis=0).repeat(3, axis=1))
    assert video.upscale_nearest(np.zeros((3, 3, 3), np.uint8), 7).shape == (7, 7, 3)


@pytest.fixture
def global_numerics():
    """Puts torch's process-wide TF32 switches back as they were."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def _handmade_checkpoint(tmp_path: Path, *overrides: str) -> tuple[Path, dict]:
    from test_checkpoint import written
    from test_module import make_module

    file = tmp_path / "handmade.ckpt"
    torch.save(written(make_module(*overrides)), file)
    return file, torch.load(file, map_location="cpu", weights_only=True)


def test_loading_an_agent_sets_its_policys_global_numerics(tmp_path, global_numerics):
    """cuDNN takes TF32 for fp32 convolutions unless told otherwise (torch's default): evaluation
    sets the policy's numerics as training does, so an fp32 agent is evaluated in IEEE fp32."""
    file, checkpoint = _handmade_checkpoint(tmp_path, "precision=fp32")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    ev.load_agent(file, checkpoint, torch.device("cpu"))
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True])
def test_an_fp32_agent_on_a_gpu_evaluates_with_tf32_only_when_trained_so(tmp_path, global_numerics, tf32):
    file, checkpoint = _handmade_checkpoint(tmp_path, "precision=fp32", f"perf.tf32={str(tf32).lower()}")
    torch.backends.cudnn.allow_tf32 = not tf32
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    module = ev.load_agent(file, checkpoint, torch.device("cuda"))
    assert module.precision_policy.tf32 is tf32
    assert torch.backends.cudnn.allow_tf32 is tf32 and torch.backends.cuda.matmul.allow_tf32 is tf32


def test_a_results_file_that_cannot_be_written_whole_is_not_left_half_written(run16, tmp_path, monkeypatch):
    """results.json is written beside its name and renamed (pixelsac.files): a write that fails
    after its bytes (here: fsync) leaves no results.json and no temporary behind."""
    import os

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    out_dir = tmp_path / "eval"
    options = ev.parse_options([f"checkpoint={run16}", "episodes=1", "video=false", f"out_dir={out_dir}"])
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError):
        ev.evaluate(options, out=lambda line: None)
    assert [p.name for p in out_dir.iterdir()] == [".lock"]  # the folder's lock: no results.json, no temporary


@pytest.mark.parametrize("arithmetic, dtype", [("fp32", torch.float32), ("fp64", torch.float64)])
def test_widened_arithmetic_acts_with_the_same_weights_exactly_widened(run16, arithmetic, dtype):
    """arithmetic=fp32/fp64: every weight is the fp16 value widened (exactly), the policy acts in that
    dtype without the 16-bit emulation, and its actions differ from fp16's only by acting's rounding."""
    file = run16 / "checkpoints" / "best.ckpt"
    checkpoint = torch.load(file, map_location="cpu", weights_only=True)
    trained = ev.load_agent(file, checkpoint, torch.device("cpu"))
    wide = ev.load_agent(file, checkpoint, torch.device("cpu"), arithmetic)
    assert {p.dtype for p in wide.parameters()} == {dtype}
    assert wide.precision_policy.param_dtype == dtype and not wide.precision_policy.fp32_accumulate
    for (name, p16), (_, pw) in zip(trained.named_parameters(), wide.named_parameters()):
        assert torch.equal(p16.to(dtype), pw), name
    env = ev.make_env(checkpoint["hyper_parameters"]["config"], seed=3)
    try:
        obs = env.reset().obs[None]
    finally:
        env.close()
    a16, aw = trained.act(obs, False), wide.act(obs, False)
    assert np.isfinite(aw).all() and np.abs(aw - a16).max() < 2e-2
    if dtype == torch.float64:  # fp16's acting rounds: the widened policy's action is not fp16's
        assert not np.array_equal(a16, aw)


def test_evaluation_records_its_arithmetic_and_refuses_unknown_ones(run16, tmp_path):
    options = ev.parse_options([f"checkpoint={run16}", "episodes=1", "video=false", "arithmetic=fp64"])
    assert options.arithmetic == "fp64"
    results = ev.evaluate(dataclasses.replace(options, out_dir=str(tmp_path / "e")), out=lambda line: None).results
    assert results["arithmetic"] == "fp64" and results["precision"] == "fp16"
    with pytest.raises(ConfigError, match="arithmetic"):
        ev.parse_options([f"checkpoint={run16}", "arithmetic=fp8"])


def test_an_evaluation_on_a_gpu_acts_with_the_forward_pass_training_used(tmp_path, global_numerics, monkeypatch):
    """pixelsac-evaluate on CUDA left split-K and channels-last out, so its forward pass differed
    from the one act() ran in training: loading now gives the module what SACModule.setup gives it
    on that device (SACModule.use_device). Checked on a CPU by resolving for a CUDA device
    without moving the weights: an fp16 agent's projection gets CUDA's split-K chunk (2,048) and
    its convolutions the channels-last layout."""
    import types

    from pixelsac.lowp import SplitKLinear
    from pixelsac.module import SACModule

    file, checkpoint = _handmade_checkpoint(tmp_path, "precision=fp16")
    real_to = SACModule.to

    def layout_only(self, *args, **kwargs):  # no move to the device, the layout kept
        return real_to(self, memory_format=kwargs["memory_format"]) if "memory_format" in kwargs else self

    monkeypatch.setattr(SACModule, "to", layout_only)
    module = ev.load_agent(file, checkpoint, types.SimpleNamespace(type="cuda"))
    layers = [m for m in module.modules() if isinstance(m, SplitKLinear)]
    assert layers and all(layer.split_chunk == 2048 for layer in layers)
    assert module.precision_policy.channels_last
    convs = [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert not all(w.is_contiguous() for w in convs)


# --- one writer per output folder -------------------------------------------------------------------


def test_an_out_dir_another_evaluation_writes_is_refused(run16, tmp_path, capsys):
    """Two evaluations with one out_dir both said "wrote DIR/results.json" and one result was lost
    (with video, one exited 74: the other had taken its temporary file). The folder is locked."""
    import os

    from pixelsac.rundir import RunDirLock

    out = tmp_path / "out"
    other = RunDirLock(out, key="out_dir").acquire()  # another evaluation, writing there now
    try:
        code = ev.main([f"checkpoint={run16}", f"out_dir={out}", "episodes=1", "video=false"])
    finally:
        other.release()
    err = said(capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"out_dir {out} is in use by pid {os.getpid()}" in err
    assert [p.name for p in out.iterdir()] == [".lock"]  # nothing of this evaluation's


def test_default_out_dirs_are_created_one_per_evaluation(tmp_path):
    """The default eval/<stem>-<time> was checked for and created later: two evaluations in the
    same second could both choose it. Each is made exclusively, at once."""
    import datetime

    from pixelsac.evaluate import default_out_dir

    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    first, second = default_out_dir(checkpoint, now), default_out_dir(checkpoint, now)
    assert first.name == "last-20260102-030405" and second.name == "last-20260102-030405-2"
    assert first.is_dir() and second.is_dir() and first.parent == tmp_path / "run" / "eval"


def test_an_eval_folder_that_is_a_link_is_refused(run16, tmp_path, capsys):
    run_copy, elsewhere = shutil.copytree(run16, tmp_path / "run"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_copy / "eval").symlink_to(elsewhere)
    code = ev.main([f"checkpoint={run_copy}", "episodes=1", "video=false"])
    err = capsys.readouterr().err
    assert code == 2 and f"{run_copy / 'eval'} is a symbolic link (to {elsewhere})" in err, err
    assert list(elsewhere.iterdir()) == []  # nothing written through it


def test_evaluating_a_run_being_trained_says_so(run16, tmp_path):
    import os

    from pixelsac.rundir import RunDirLock

    run_copy = shutil.copytree(run16, tmp_path / "run")
    training = RunDirLock(run_copy).acquire()  # as a training process holds it
    lines: list[str] = []
    try:
        evaluation = ev.evaluate(
            ev.parse_options([f"checkpoint={run_copy}", "episodes=1", "video=false"]), lines.append
        )
    finally:
        training.release()
    assert lines[0] == (
        f"note: {run_copy} is being trained (pid {os.getpid()} on host {__import__('socket').gethostname()}): "
        "evaluating best.ckpt as saved now, into its eval/ folder, which training does not write"
    )
    assert evaluation.out_dir.parent == run_copy / "eval" and (evaluation.out_dir / "results.json").is_file()


def test_eval_arithmetic_reads_paired_episode_differences_against_float64(run16, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import eval_arithmetic

    rows = eval_arithmetic.compare(
        {"trained": [1.0, 2.0, 3.0, 4.5], "fp32": [2.0, 3.0, 4.0, 5.0], "fp64": [2.0, 3.0, 4.0, 5.0]}
    )
    assert rows["trained"]["reading"] == "costs return" and rows["trained"]["mean_difference"] == pytest.approx(-0.875)
    assert rows["fp32"]["reading"] == "does not" and rows["fp32"]["episodes_differing"] == 0
    out = tmp_path / "arith"
    assert eval_arithmetic.main([str(run16), "--episodes", "2", "--out", str(out)]) == 0
    record = json.loads((out / "results.json").read_text())
    assert set(record["arms"]) == {"trained", "fp32", "fp64"} and set(record["against_fp64"]) == {"trained", "fp32"}
    assert [record["arms"][arm]["arithmetic"] for arm in ("trained", "fp32", "fp64")] == ["trained", "fp32", "fp64"]
    assert all(len(arm["returns"]) == 2 and arm["checkpoint"] == str(run16) for arm in record["arms"].values())
    assert "| episode |" in (out / "results.md").read_text()
