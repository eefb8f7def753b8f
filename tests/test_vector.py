"""Several environments in worker processes: same transitions as in-process, loud failures."""

import numpy as np
import pytest

from pixelsac.collect import Collector
from pixelsac.envs.vector import EnvWorkerError, ParallelEnvs, SerialEnvs
from pixelsac.replay import ReplaySet

KWARGS = dict(obs="pixels", image_size=24, frame_stack=3, episode_frames=40)  # cartpole: repeat 8, 5 steps


@pytest.fixture(scope="module")
def parallel():
    envs = ParallelEnvs("cartpole_swingup", [3, 4], **KWARGS)
    yield envs
    envs.close()


def test_workers_reproduce_in_process_envs_step_for_step(parallel):
    serial = SerialEnvs("cartpole_swingup", [3, 4], **KWARGS)
    try:
        assert parallel.num_envs == 2 and parallel.obs_shape == serial.obs_shape == (9, 24, 24)
        rng = np.random.default_rng(0)
        for _episode in range(2):
            for a, b in zip(parallel.reset([0, 1]), serial.reset([0, 1])):
                assert np.array_equal(a.obs, b.obs)
            for _ in range(5):
                actions = rng.uniform(-1, 1, size=(2, 1)).astype(np.float32)
                for a, b in zip(parallel.step(actions), serial.step(actions)):
                    assert np.array_equal(a.frame, b.frame) and a.reward == b.reward and a.last == b.last
        assert parallel.get_rng_states() == serial.get_rng_states()
        # the two envs really are different (different seeds)
        first = parallel.reset([0, 1])
        assert not np.array_equal(first[0].obs, first[1].obs)
    finally:
        serial.close()


def _collect(envs, steps: int) -> ReplaySet:
    replay = ReplaySet(2, 200, envs.frame_shape, envs.frame_dtype, envs.frame_stack, envs.action_dim)
    act = lambda obs, sample: np.tanh(obs.reshape(len(obs), -1)[:, :1].astype(np.float32) / 100.0)  # noqa: E731
    collector = Collector(envs, replay, act, seed_steps=4, rng=np.random.default_rng(7))
    for _ in range(steps):
        collector.step()
    assert collector.agent_steps == 2 * steps and collector.env_frames == 16 * steps
    return replay


def test_collection_with_workers_equals_serial_collection(parallel):
    serial = SerialEnvs("cartpole_swingup", [3, 4], **KWARGS)
    try:
        parallel.set_rng_states(serial.get_rng_states())  # the fixture's envs have been used
        a, b = _collect(parallel, 12), _collect(serial, 12)  # 12 steps: two episodes and a bit
    finally:
        serial.close()
    for buffer_a, buffer_b in zip(a.buffers, b.buffers):
        state_a, state_b = buffer_a.state_dict(), buffer_b.state_dict()
        for key in state_a:
            value_a, value_b = state_a[key], state_b[key]
            assert np.array_equal(np.asarray(value_a), np.asarray(value_b)), key
    batch = a.sample(8, np.random.default_rng(0))
    assert batch["obs"].shape == (8, 9, 24, 24)


def test_a_worker_error_is_reported_with_its_message():
    envs = ParallelEnvs("cartpole_swingup", [0], **KWARGS)
    try:
        envs.reset([0])
        with pytest.raises(
            EnvWorkerError, match=r"env worker 0 \(cartpole_swingup, seed 0\) failed: ValueError: .*1 action"
        ):
            envs.step(np.zeros((1, 3), np.float32))
    finally:
        envs.close()


def test_a_dead_worker_is_reported_not_waited_on():
    envs = ParallelEnvs("cartpole_swingup", [0, 1], **KWARGS)
    try:
        envs.reset([0, 1])
        envs._procs[1].kill()
        envs._procs[1].join()
        with pytest.raises(EnvWorkerError, match=r"env worker 1 .* died"):
            envs.step(np.zeros((2, 1), np.float32))
    finally:
        envs.close()


@pytest.mark.slow
def test_training_with_two_env_workers(tmp_path):
    import torch
    from conftest import TINY, run_cli

    run_dir = tmp_path / "run"
    result = run_cli(*TINY, "precision=fp32", "env.num_envs=2", f"run_dir={run_dir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 rings, one per env" in result.stdout
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    collector = state["callbacks"]["Checkpointer"]["collector"]
    assert collector["env_frames"] == 320 and collector["agent_steps"] == 40 and len(collector["env_rngs"]) == 2
    assert state["pixelsac"]["updates"] == 24  # the update-to-data ratio holds per agent step
