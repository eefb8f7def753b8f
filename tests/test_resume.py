"""Reliability: exact resume, crash safety, numerical failure, safe checkpoint loading."""

import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TESTS, TINY, cli_env, main_in, run_cli, start_cli
from test_stopping import assert_same_training_state

from pixelsac.precision import native_half_kernels

# TINY: 64-frame episodes at action repeat 8 (8 agent steps), 320 frames, evaluation every 160.
HALF, FULL = 320, 640


def weights(run_dir: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)


NATIVE_BF16 = native_half_kernels(torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision",
    [
        "fp16",
        pytest.param(
            "bf16", marks=pytest.mark.skipif(NATIVE_BF16 is None, reason="this CPU has no native bf16 kernels")
        ),
        "fp16-compiled",
    ],
)
def test_n_steps_resume_n_steps_equals_2n_straight(tmp_path, precision):
    """fp16 + six: its checkpoint holds all that fp32's does and the loss scalers and Kahan
    buffers besides (fp32's resume is compared bit for bit in test_stopping's SIGTERM case);
    bf16 where the CPU runs it on native kernels (the default there); fp16 with the compiled hAdam
    step, whose parameters and state are views into flat buffers when saved and loaded."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    # one thread each: the straight run and the first half run side by side on two cores, and the
    # sums' order (which follows the thread count) is the same in all three processes
    compiled = precision == "fp16-compiled"
    mode = ["precision=fp16", "perf.compile_optimizer=true"] if compiled else [f"precision={precision}"]
    args = [*TINY, *mode, "train.num_threads=1"]
    straight_run = start_cli(*args, f"train.env_frames={FULL}", f"run_dir={straight}", cwd=tmp_path)
    first = run_cli(*args, f"train.env_frames={HALF}", f"run_dir={split}", cwd=tmp_path)
    _, straight_err = straight_run.communicate(timeout=600)
    assert straight_run.returncode == 0, straight_err[-2000:]
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_cli(f"resume={split}", f"train.env_frames={FULL}", "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resuming from {split / 'checkpoints' / 'last.ckpt'} at env frame {HALF}" in second.stdout
    if precision == "bf16":
        assert f"bf16: native kernels ({NATIVE_BF16})" in first.stdout + second.stdout
    if compiled:
        assert "compiled hAdam step" in first.stdout and "compiled hAdam step" in second.stdout

    a, b = weights(straight), weights(split)
    assert a["pixelsac"]["updates"] == b["pixelsac"]["updates"] > 0
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    for opt_a, opt_b in zip(a["optimizer_states"], b["optimizer_states"]):
        for idx, state in opt_a["state"].items():
            for name, value in state.items():
                other = opt_b["state"][idx][name]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other, name
    assert a["pixelsac"]["scalers"] == b["pixelsac"]["scalers"]
    assert a["callbacks"]["Checkpointer"]["collector"] == b["callbacks"]["Checkpointer"]["collector"]
    # the CSV continues: one row per evaluation, no duplicates
    rows = (split / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    eval_frames = [r.split(",")[header.index("step")] for r in rows[1:] if r.split(",")[header.index("eval/return")]]
    assert eval_frames == ["160", "320", "480", "640"]


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    env = cli_env(TESTS)
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "kill_during_save.py"),
            str(marker),
            *TINY,
            "precision=fp32",
            f"train.env_frames={HALF}",  # the 2nd save is the evaluation's at the end
            f"run_dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no save"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert Path(marker.read_text()).is_file()  # the new checkpoint was cut off before its rename

    previous = weights(run_dir)  # weights_only=True
    # evaluation at frame 160 asked for it; it was written at the next episode boundary
    assert previous["callbacks"]["Checkpointer"]["collector"]["env_frames"] == 192
    replay_file = previous["callbacks"]["Checkpointer"]["replay_file"]
    assert (run_dir / "checkpoints" / replay_file).is_file()

    resumed = run_cli(f"resume={run_dir}", "trainer.enable_progress_bar=false", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = weights(run_dir)
    assert final["callbacks"]["Checkpointer"]["collector"]["env_frames"] == HALF
    assert all(torch.isfinite(v).all() for v in final["state_dict"].values() if v.is_floating_point())
    assert [p.name for p in (run_dir / "checkpoints").glob("replay-*.pt")] == [
        final["callbacks"]["Checkpointer"]["replay_file"]
    ]


# agent steps holding several updates: two per step, or one per step of each of two envs
SEVERAL = {"updates": ["train.updates_per_step=2"], "envs": ["env.num_envs=2"]}
SEVERAL_ARGS = [*TINY, "precision=fp32", "perf.calibrate_updates=0", "train.video_every_evals=0", "train.num_threads=1"]


@pytest.fixture(scope="module")
def straight_several(tmp_path_factory):
    """Uninterrupted runs of each SEVERAL setting, started together in the background."""
    root = tmp_path_factory.mktemp("straight_several")
    procs = {k: start_cli(*SEVERAL_ARGS, *v, f"run_dir={root / k}", cwd=root) for k, v in SEVERAL.items()}

    def get(setting: str) -> Path:
        _, err = procs[setting].communicate(timeout=600)
        assert procs[setting].returncode == 0, err[-2000:]
        return root / setting

    yield get
    for proc in procs.values():
        proc.kill()
        proc.communicate()


def assert_same_end(a: dict, b: dict) -> None:
    """test_stopping's bit-for-bit comparison, and the same best evaluation."""
    assert_same_training_state(a, b)
    assert a["callbacks"]["Evaluator"]["best_return"] == b["callbacks"]["Evaluator"]["best_return"]


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["updates", "envs"])
def test_sigkill_after_a_checkpoint_between_a_steps_updates_resumes_bit_for_bit(tmp_path, straight_several, setting):
    """The evaluation at frame 160 asks for a checkpoint; it is written at the next episode
    boundary, after the first of that agent step's two updates. Killed (SIGKILL) at the next save,
    the run resumes from it with resume=auto and ends where the uninterrupted run does: before,
    the step's second update was lost (47 updates instead of 48, 23 instead of 24)."""
    run_dir, marker = tmp_path / "run", tmp_path / "saving"
    command = [*SEVERAL_ARGS, *SEVERAL[setting], f"run_dir={run_dir}", "resume=auto"]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "kill_during_save.py"), str(marker), *command],
        cwd=tmp_path,
        env=cli_env(TESTS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 500
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no save"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = weights(run_dir)["callbacks"]["Checkpointer"]["collector"]
    assert saved["at_episode_boundary"] and saved["batches_due"] == 1  # one of the step's two updates to come

    resumed = run_cli(*command, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_end(weights(run_dir), weights(straight_several(setting)))


@pytest.mark.slow
def test_a_stop_between_a_steps_updates_saves_there_and_resumes_bit_for_bit(tmp_path, straight_several):
    """SIGTERM after the first of a step's two updates, at an episode boundary: the stop lands
    before the second (it used to wait for the whole step), exact, and the resume does that update
    first and ends where the uninterrupted run does."""
    run_dir = tmp_path / "run"
    command = [*SEVERAL_ARGS, *SEVERAL["updates"], f"run_dir={run_dir}", "resume=auto"]
    # update 15 is the first of agent step 24's, which ends the third episode
    stopped = subprocess.run(
        [sys.executable, str(REPO / "tests" / "stop_helper.py"), *command],
        cwd=tmp_path,
        env=cli_env(TESTS, SELF_SIGNAL="SIGTERM@15"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "stopped by SIGTERM after update 15 at env frame 192" in stopped.stdout
    assert "(exact: at an episode boundary)" in stopped.stdout
    assert weights(run_dir)["callbacks"]["Checkpointer"]["collector"]["batches_due"] == 1

    resumed = run_cli(*command, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_end(weights(run_dir), weights(straight_several("updates")))


@pytest.mark.slow
def test_collapsed_loss_scale_stops_with_message_and_loadable_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(*TINY, "precision=fp16", "safety.min_loss_scale=20000", f"run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert (
        line.startswith("error: training stopped: the ")
        and "loss scale collapsed below safety.min_loss_scale=20000" in line
    )
    assert "after update" in line and "at env frame" in line and "loss scales critic=" in line
    assert "last good checkpoint:" in line
    state = weights(run_dir)  # written at the failure (weights still finite), loads safely
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    assert (run_dir / "failure.json").is_file()


def test_nonfinite_weights_stop_the_run_and_are_never_checkpointed(tmp_path):
    from test_module import fit, make_batch, make_module

    from pixelsac.precision import NumericalFailure

    module = make_module("precision=fp32", "train.log_every_updates=1")
    with torch.no_grad():
        module.critic.q1[0].weight[0, 0] = float("nan")
    with pytest.raises(NumericalFailure, match=r"non-finite critic .*weights.* after update 1 \(losses critic_loss="):
        fit(module, [make_batch()])
    assert not module.weights_are_finite()
    from pixelsac.callbacks import Checkpointer

    Checkpointer(tmp_path, collector=None, save_replay=True).save(None, module, ["last.ckpt"])
    assert list(tmp_path.iterdir()) == []


def test_injected_inf_gradient_skips_the_step_and_leaves_parameters_bitwise_unchanged():
    from test_module import fit, make_batch, make_module

    torch.manual_seed(0)
    module = make_module("precision=fp16")
    before = {k: v.clone() for k, v in module.critic.state_dict().items()}
    module.critic.q1[0].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    fit(module, [make_batch()])
    assert module.skipped["critic"] == 1
    for key, value in module.critic.state_dict().items():
        assert torch.equal(before[key], value), key
    assert module.loss_scales()["critic"] == 5000.0


@pytest.mark.parametrize(
    "args,message",
    [
        (["resume=nowhere"], "checkpoint nowhere does not exist"),
        (["resume=."], "no checkpoint in ."),
        (["env.image_size=-3"], "env.image_size=-3 must be positive"),
        (["replay.capacity=0"], "replay.capacity=0 must be positive"),
        ([*TINY, "replay.capacity=1"], "error: replay.capacity=1 leaves each of the 1 env(s) 1 slot(s)"),
        ([*TINY, "replay.capacity=7", "env.num_envs=2"], "leaves each of the 2 env(s) 3 slot(s)"),
    ],
)
def test_bad_paths_and_sizes_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys, args, message):
    code, stderr = main_in(tmp_path, monkeypatch, capsys, *args, "run_dir=out")
    assert code == 2 and message in stderr, stderr[-1000:]
    assert list(tmp_path.iterdir()) == []


def test_no_opengl_exits_2_with_what_to_install(tmp_path):
    env = cli_env(MUJOCO_GL="no-such-backend")
    result = subprocess.run(
        [sys.executable, "-m", "pixelsac.train", *TINY, "run_dir=out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "libegl1 libegl-mesa0 libgl1-mesa-dri" in result.stderr and "MUJOCO_GL=egl" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_corrupt_and_foreign_checkpoints_are_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    code, stderr = main_in(tmp_path, monkeypatch, capsys, "resume=text.ckpt")
    assert code == 2 and "is not a readable checkpoint" in stderr


class _Payload:
    """Stands for any pickled object: unpickling it would run its class's code."""


@pytest.mark.slow
def test_pickled_objects_are_refused_unless_trusted(tmp_path, tiny_fp32_run, monkeypatch, capsys):
    run_dir = shutil.copytree(tiny_fp32_run.run_dir, tmp_path / "run")
    last = run_dir / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    checkpoint["stranger"] = _Payload()  # what a crafted checkpoint would carry
    torch.save(checkpoint, last)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(last, weights_only=True)
    code, stderr = main_in(tmp_path, monkeypatch, capsys, f"resume={run_dir}")
    assert code == 2
    assert "holds pickled Python objects, which could run code when loaded; refusing" in stderr
    trusted = run_cli(
        f"resume={run_dir}",
        "trust_checkpoint=true",
        f"train.env_frames={HALF + 64}",
        "trainer.enable_progress_bar=false",
        cwd=tmp_path,
        extra_path=str(REPO / "tests"),
    )
    assert trusted.returncode == 0, trusted.stderr[-2000:]


def test_naive_fp16_run_stops_loudly_at_its_first_update(tmp_path):
    """Naive fp16 (all six off) turns the weights to NaN at the first update; the run must stop
    with exit code 3 and say so -- never act, train or checkpoint on NaNs."""
    run_dir = tmp_path / "run"
    result = run_cli(*TINY, "precision=fp16", "lowp.all=false", f"run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: training stopped: ")
    assert "non-finite" in result.stderr
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()
    assert (run_dir / "failure.json").is_file()


def test_target_copy_overflow_becomes_a_numerical_failure():
    """With the published single K (``lowp.adaptive_target_scale=false``), Kahan-momentum's K·θ
    overflow (|θ| > 6.55 at K = 1e4) stops the run like any other numerical failure, naming the
    parameter and the update, instead of escaping as a raw FloatingPointError. The default's
    per-tensor scale takes the same weight in its stride."""
    from test_module import fit, make_batch, make_module

    from pixelsac.precision import NumericalFailure

    module = make_module("precision=fp16", "lowp.adaptive_target_scale=false")
    with torch.no_grad():
        module.critic.q1[0].weight[0, 0] = 8.0  # K·θ = 80000 > 65504
    with pytest.raises(
        NumericalFailure,
        match=r"target update in update 1 \(stopped after update 0\): KahanEMA: K·θ is not finite for parameter "
        r"'q1.0.weight' since target update 1 of 1",
    ):
        fit(module, [make_batch()])
    default = make_module("precision=fp16")
    with torch.no_grad():
        default.critic.q1[0].weight[0, 0] = 8.0
    fit(default, [make_batch(seed=i) for i in range(3)])
    assert float(default.target_updater.tensor_scales().min()) < 1e4 and default.weights_are_finite()


def test_sync_free_target_copy_overflow_stops_at_the_next_health_check():
    """Sync-free updates do not read K·θ on the host; the device records the first target update
    that overflowed, and the health check (every log_every_updates) stops the run naming it."""
    from test_module import fit, make_batch, make_module

    from pixelsac.precision import NumericalFailure

    module = make_module(
        "precision=fp16", "perf.sync_free=true", "train.log_every_updates=3", "lowp.adaptive_target_scale=false"
    )
    with torch.no_grad():
        module.critic.q1[0].weight[0, 0] = 8.0
    with pytest.raises(
        NumericalFailure,
        match=r"target update in update 1 \(stopped after update 3\): KahanEMA: K·θ is not finite for parameter "
        r"'q1.0.weight' since target update 1 of 2",
    ):
        fit(module, [make_batch(seed=i) for i in range(6)])
    assert module.updates == 3


@pytest.mark.parametrize(
    "saved_with,resumed_with",
    [("perf.sync_free=false", "perf.sync_free=true"), ("perf.sync_free=true", "perf.sync_free=false")],
)
def test_a_resume_under_other_settings_keeps_the_optimizers_built_for_it(tmp_path, saved_with, resumed_with):
    """torch Adam's fused / capturable / foreach come from this run's settings, not from the
    checkpoint's param_groups (restored as they were, AMP failed its first step and fp32 CUDA
    graphs their capture). fp32 on a CPU: perf.sync_free picks fused Adam, else foreach."""
    import lightning as L
    from test_module import fit, make_batch, make_module
    from torch.utils.data import DataLoader

    from pixelsac.precision import EXECUTION_FLAGS

    def flags(optimizers):
        return [{key: group.get(key) for key in EXECUTION_FLAGS} for opt in optimizers for group in opt.param_groups]

    def steps(optimizers):
        return [float(state["step"]) for opt in optimizers for state in opt.state.values()]

    torch.manual_seed(0)
    first = make_module("precision=fp32", saved_with)
    trainer = fit(first, [make_batch(seed=0), make_batch(seed=1)])
    saved_flags, saved_steps = flags(trainer.optimizers), steps(trainer.optimizers)
    trainer.save_checkpoint(tmp_path / "a.ckpt")

    seen = {}

    class Look(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if not seen:  # after the checkpoint's optimizer states were loaded, before a step
                seen["flags"] = flags(trainer.optimizers)
                seen["steps"] = steps(trainer.optimizers)

    second = make_module("precision=fp32", resumed_with)
    resumed = L.Trainer(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Look()],
    )
    resumed.fit(second, DataLoader([make_batch(seed=2)], batch_size=None), ckpt_path=tmp_path / "a.ckpt")
    expected = make_module("precision=fp32", resumed_with)
    expected_flags = flags(expected.configure_optimizers())
    assert saved_flags != expected_flags  # the two settings do build different optimizers
    assert seen["flags"] == expected_flags
    assert seen["steps"] == saved_steps and saved_steps  # the moments and counts were restored all the same
    assert second.updates == 3
