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


def test_a_step_handed_out_is_taken_later_with_the_same_transitions(parallel):
    serial = SerialEnvs("cartpole_swingup", [3, 4], **KWARGS)
    try:
        parallel.set_rng_states(serial.get_rng_states())
        for envs in (parallel, serial):
            envs.reset([0, 1])
        actions = np.array([[0.3], [-0.7]], np.float32)
        for envs in (parallel, serial):
            envs.step_async(actions)
            assert envs.in_flight
            for ask, args in ((envs.reset, ([0],)), (envs.get_rng_states, ()), (envs.step_async, (actions,))):
                with pytest.raises(RuntimeError, match="while a step is in flight"):
                    ask(*args)
        # the workers stepped while this process went on; in this process the step runs now
        for a, b in zip(parallel.step_wait(), serial.step_wait()):
            assert np.array_equal(a.frame, b.frame) and a.reward == b.reward
        assert not parallel.in_flight and not serial.in_flight
        with pytest.raises(RuntimeError, match="without a step_async"):
            parallel.step_wait()
        assert parallel.get_rng_states() == serial.get_rng_states()  # the pipes hold no stray answer
    finally:
        serial.close()


def test_closing_with_a_step_in_flight_ends_the_workers():
    envs = ParallelEnvs("cartpole_swingup", [0], **KWARGS)
    procs = list(envs._procs)
    envs.reset([0])
    envs.step_async(np.zeros((1, 1), np.float32))  # the run ended during an update
    envs.close()
    assert not envs.in_flight and all(proc.exitcode == 0 for proc in procs)


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


@pytest.mark.slow
def test_overlapped_collection_trains_and_resumes_exactly(tmp_path):
    """train.overlap_collection: the environment steps in a worker during the updates. A run
    stopped at 320 frames and resumed to 640 ends where one run to 640 ends, bit for bit (its
    checkpoints are taken at episode boundaries, whose steps keep DrQ's order); and the updates
    did draw from fewer transitions than DrQ's order, so the weights differ from its run."""
    import torch
    from conftest import TINY, run_cli, start_cli

    args = [*TINY, "precision=fp32", "train.num_threads=1", "train.overlap_collection=true"]
    straight, split, drq = tmp_path / "straight", tmp_path / "split", tmp_path / "drq"
    straight_run = start_cli(*args, "train.env_frames=640", f"run_dir={straight}", cwd=tmp_path)
    first = run_cli(*args, "train.env_frames=320", f"run_dir={split}", cwd=tmp_path)
    _, straight_err = straight_run.communicate(timeout=600)
    assert straight_run.returncode == 0, straight_err[-2000:]
    assert first.returncode == 0, first.stderr[-2000:]
    assert "collection: 1 environment in worker processes, stepping while the learner updates" in first.stdout
    second = run_cli(f"resume={split}", "train.env_frames=640", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    in_order = run_cli(*args, "train.overlap_collection=false", "train.env_frames=640", f"run_dir={drq}", cwd=tmp_path)
    assert in_order.returncode == 0, in_order.stderr[-2000:]
    assert "collection:" not in in_order.stdout  # one env in this process, DrQ's order

    def state(run_dir):
        return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)

    a, b, c = state(straight), state(split), state(drq)
    assert a["pixelsac"]["updates"] == b["pixelsac"]["updates"] == c["pixelsac"]["updates"] == 64
    for key in a["state_dict"]:
        assert torch.equal(a["state_dict"][key], b["state_dict"][key]), key
    collected = [run["callbacks"]["Checkpointer"]["collector"] for run in (a, b, c)]
    assert collected[0] == collected[1] and collected[0]["env_frames"] == collected[2]["env_frames"] == 640
    assert any(not torch.equal(a["state_dict"][key], c["state_dict"][key]) for key in a["state_dict"])


def test_the_start_lines_say_where_the_environments_step_and_when_they_share_the_cores(monkeypatch):
    from types import SimpleNamespace

    import torch

    from pixelsac import footprint
    from pixelsac.config import load_config
    from pixelsac.train import start_lines

    cfg = load_config(["precision=fp32", "train.overlap_collection=true"])
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=1)
    run = SimpleNamespace(cfg=cfg, trainer=trainer, env=SimpleNamespace(action_repeat=8), replay=SimpleNamespace())
    run.replay.describe = lambda: "replay buffer: ..."
    monkeypatch.setattr(footprint, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    lines = start_lines(run)
    want = "collection: 1 environment in worker processes, stepping while the learner updates "
    want += "(train.overlap_collection)"
    assert want in lines
    note = "  note: the update's 2 threads and 1 worker share 2 cores and take turns rather than overlap "
    assert note + "(train.num_threads=1 leaves the workers cores of their own)" in lines
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert want in start_lines(run) and not any("note:" in line for line in start_lines(run))
    run.cfg = load_config(["precision=fp32"])
    assert not any(line.startswith("collection:") for line in start_lines(run))  # DrQ's order, in this process
