"""Tests for the dm_control wrapper. Images are tiny and episodes short: rendering costs ~15-60 ms
per frame on these CPUs, physics steps ~0.1 ms."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("MUJOCO_GL", "egl")  # before dm_control is imported anywhere

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import REPO, cli_env  # noqa: E402
from dm_control import suite  # noqa: E402

from pixelsac.envs import (  # noqa: E402
    PLANET_ACTION_REPEAT,
    DMCEnv,
    EnvError,
    TimeStep,
    available_tasks,
)
from pixelsac.replay import ReplayBuffer  # noqa: E402


@pytest.fixture
def make_env():
    """Build envs that are closed after the test."""
    envs = []

    def make(*args, **kwargs) -> DMCEnv:
        env = DMCEnv(*args, **kwargs)
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


def flat_state(observation) -> np.ndarray:
    return np.concatenate([np.asarray(value, np.float32).ravel() for value in observation.values()])


def test_pixel_obs_shapes_dtypes_and_stacking(make_env):
    env = make_env("cheetah_run", image_size=32, frame_stack=3, seed=0)
    assert env.obs_shape == (9, 32, 32)
    assert env.frame_shape == (3, 32, 32)
    assert env.frame_dtype == np.uint8
    assert env.action_dim == 6

    first = env.reset()
    assert isinstance(first, TimeStep) and first.first and not first.last and not first.terminal
    assert first.obs.shape == env.obs_shape and first.obs.dtype == np.uint8
    assert first.frame.shape == env.frame_shape and first.frame.dtype == np.uint8
    # At reset the first frame fills the whole stack.
    for slot in range(3):
        np.testing.assert_array_equal(first.obs[3 * slot : 3 * slot + 3], first.frame)

    frames = [first.frame]
    for _ in range(2):
        step = env.step(np.ones(env.action_dim, dtype=np.float32))
        assert not step.first and step.obs.shape == env.obs_shape
        frames.append(step.frame)
    assert not np.array_equal(frames[0], frames[2]), "the cheetah should visibly move"
    # Oldest frame first on the channel axis.
    np.testing.assert_array_equal(step.obs, np.concatenate([frames[0], frames[1], frames[2]]))
    # The frame is channels-first RGB of the observation camera.
    np.testing.assert_array_equal(env.render(32).transpose(2, 0, 1), step.frame)


def test_state_obs_is_flat_float32_in_spec_order(make_env):
    env = make_env("walker_walk", obs="state", seed=4)
    reference = suite.load("walker", "walk", task_kwargs={"random": 4})
    ours, theirs = env.reset(), reference.reset()
    assert env.frame_stack == 1  # states are never stacked, whatever frame_stack says
    assert ours.obs.ndim == 1 and ours.obs.dtype == np.float32
    assert ours.obs.shape == env.obs_shape == env.frame_shape == (24,)
    assert env.frame_dtype == np.float32
    np.testing.assert_array_equal(ours.obs, flat_state(theirs.observation))
    np.testing.assert_array_equal(ours.frame, ours.obs)


def test_action_repeat_advances_physics_and_sums_rewards(make_env):
    env = make_env("cheetah_run", obs="state", seed=1)
    assert env.action_repeat == 4
    reference = suite.load("cheetah", "run", task_kwargs={"random": 1})
    env.reset()
    reference.reset()
    control_dt = reference.control_timestep()
    actions = np.random.default_rng(0).uniform(-1, 1, size=(5, 6)).astype(np.float32)
    rewards = []
    for agent_step, action in enumerate(actions, start=1):
        step = env.step(action)
        manual_reward = 0.0
        for _ in range(4):
            reference_step = reference.step(action)
            manual_reward += reference_step.reward
        assert step.reward == pytest.approx(manual_reward, rel=1e-12, abs=1e-12)
        assert env.physics.time() == pytest.approx(agent_step * 4 * control_dt)
        np.testing.assert_array_equal(step.obs, flat_state(reference_step.observation))
        rewards.append(step.reward)
    # Per-frame rewards differ, so a sum over the wrong number of frames would not match.
    assert len(set(rewards)) == len(rewards) and max(rewards) > 0


def test_renders_once_per_agent_step(make_env, monkeypatch):
    env = make_env("cartpole_swingup", image_size=16, seed=0)
    assert env.action_repeat == 8
    physics = env.physics
    real_render = physics.render
    calls = []

    def counting_render(*args, **kwargs):
        calls.append(physics.time())
        return real_render(*args, **kwargs)

    monkeypatch.setattr(physics, "render", counting_render)
    env.reset()
    for _ in range(3):
        env.step(np.zeros(1, dtype=np.float32))
    control_dt = env.dmc_env.control_timestep()
    # One render at reset and one after the last repeat of each agent step.
    assert calls == pytest.approx([0.0] + [8 * control_dt * n for n in (1, 2, 3)])


def test_actions_are_rescaled_to_the_spec_and_clipped(make_env):
    # quadruped's action bounds are not [-1, 1] (e.g. [-1, 1.1] and [-0.8, 0.8]).
    env = make_env("quadruped_walk", obs="state", action_repeat=1)
    spec = env.dmc_env.action_spec()
    assert not np.all(spec.maximum == 1.0)
    env.reset()
    env.step(np.ones(env.action_dim, dtype=np.float32))
    np.testing.assert_allclose(env.physics.data.ctrl, spec.maximum)
    env.step(np.full(env.action_dim, -7.0, dtype=np.float32))  # clipped to -1
    np.testing.assert_allclose(env.physics.data.ctrl, spec.minimum)
    env.step(np.zeros(env.action_dim, dtype=np.float32))
    np.testing.assert_allclose(env.physics.data.ctrl, (spec.minimum + spec.maximum) / 2)


def test_planet_action_repeat_presets(make_env):
    expected = {
        "cartpole_swingup": 8,
        "reacher_easy": 4,
        "cheetah_run": 4,
        "finger_spin": 2,
        "ball_in_cup_catch": 4,
        "walker_walk": 2,
    }
    assert PLANET_ACTION_REPEAT == expected
    for task, repeat in expected.items():
        assert make_env(task, obs="state").action_repeat == repeat
    assert make_env("walker_stand", obs="state").action_repeat == 1
    assert make_env("cartpole_swingup", obs="state", action_repeat=3).action_repeat == 3


def test_dm_control_time_limit_is_last_but_not_terminal(make_env):
    # episode_frames above dm_control's own 1000-step limit: dm_control's limit ends it.
    env = make_env("cartpole_swingup", obs="state", episode_frames=5000)
    env.reset()
    agent_steps = 0
    while True:
        step = env.step(np.zeros(1, dtype=np.float32))
        agent_steps += 1
        if step.last:
            break
        assert agent_steps < 200, "dm_control's time limit never ended the episode"
    assert agent_steps == 1000 // 8
    assert not step.terminal
    assert env.physics.time() == pytest.approx(1000 * env.dmc_env.control_timestep())
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(1, dtype=np.float32))
    assert env.reset().first


def test_episode_frames_truncates_inside_a_repeat(make_env):
    env = make_env("cheetah_run", obs="state", episode_frames=10)  # repeat 4: 4 + 4 + 2 frames
    control_dt = env.dmc_env.control_timestep()
    for _episode in range(2):
        env.reset()
        steps = [env.step(np.zeros(6, dtype=np.float32)) for _ in range(3)]
        assert [step.last for step in steps] == [False, False, True]
        assert not any(step.terminal for step in steps)
        assert env.physics.time() == pytest.approx(10 * control_dt)


def test_task_termination_is_terminal_and_stops_the_repeat(make_env, monkeypatch):
    env = make_env("cheetah_run", obs="state")  # repeat 4
    env.reset()
    control_dt = env.dmc_env.control_timestep()
    # No suite task terminates within a few steps, so make one: discount 0 after 6 frames.
    monkeypatch.setattr(
        env.dmc_env.task,
        "get_termination",
        lambda physics: 0.0 if physics.time() > 5.5 * control_dt else None,
    )
    step = env.step(np.zeros(6, dtype=np.float32))
    assert not step.last and not step.terminal
    step = env.step(np.zeros(6, dtype=np.float32))
    assert step.last and step.terminal
    assert env.physics.time() == pytest.approx(6 * control_dt)


def test_same_seed_gives_same_frames_across_resets(make_env):
    # reacher_easy randomises arm and target at every reset, visibly even at 24 px.
    def rollout(seed):
        env = make_env("reacher_easy", image_size=24, seed=seed, episode_frames=8)
        frames = []
        actions = np.random.default_rng(0).uniform(-1, 1, size=(2, 2, env.action_dim))
        for episode_actions in actions:
            frames.append(env.reset().frame)
            for action in episode_actions:
                frames.append(env.step(action).frame)
        return frames

    first, again, other = rollout(5), rollout(5), rollout(6)
    for ours, theirs in zip(first, again):
        np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(first[0], first[3]), "the second episode should start elsewhere"
    assert not np.array_equal(first[0], other[0]), "another seed should start elsewhere"


def test_rng_state_round_trip_repeats_the_next_episode(make_env):
    env = make_env("reacher_easy", obs="state", seed=0)
    env.reset()
    saved = json.loads(json.dumps(env.get_rng_state()))  # plain containers only
    expected = env.reset().obs

    resumed = make_env("reacher_easy", obs="state", seed=99)
    assert not np.array_equal(resumed.reset().obs, expected)
    resumed.set_rng_state(saved)
    np.testing.assert_array_equal(resumed.reset().obs, expected)


def test_default_camera(make_env):
    quadruped = make_env("quadruped_walk", obs="state")
    assert quadruped.camera_id == 2
    assert make_env("cheetah_run", obs="state").camera_id == 0
    assert make_env("quadruped_walk", obs="state", camera_id=1).camera_id == 1
    image = quadruped.render(16)
    assert image.shape == (16, 16, 3) and image.dtype == np.uint8
    assert not np.array_equal(image, quadruped.render(16, camera_id=0))


def test_available_tasks_keeps_underscored_domains():
    tasks = available_tasks()
    assert tasks == [f"{domain}_{task}" for domain, task in suite.ALL_TASKS]
    assert {"ball_in_cup_catch", "point_mass_easy", "acrobot_swingup_sparse"} <= set(tasks)
    assert set(PLANET_ACTION_REPEAT) <= set(tasks)


def test_underscored_domain_loads(make_env):
    env = make_env("ball_in_cup_catch", obs="state")
    assert env.dmc_env.task.__class__.__module__.endswith("ball_in_cup")
    env = make_env("point_mass_easy", obs="state")
    assert env.dmc_env.task.__class__.__module__.endswith("point_mass")


def test_unknown_task_suggests_close_matches():
    with pytest.raises(EnvError) as info:
        DMCEnv("cheetah_runn")
    message = str(info.value)
    assert "cheetah_run" in message and "available_tasks()" in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"obs": "rgb"}, "obs"),
        ({"image_size": 0}, "image_size"),
        ({"frame_stack": 0}, "frame_stack"),
        ({"action_repeat": -1}, "action_repeat"),
        ({"episode_frames": 0}, "episode_frames"),
        ({"image_size": 2.5}, "image_size"),
        ({"camera_id": 7}, "camera_id"),
        ({"image_size": 4000}, "offscreen"),
    ],
)
def test_bad_arguments_raise_env_error(kwargs, match):
    with pytest.raises(EnvError, match=match):
        DMCEnv("cartpole_swingup", **kwargs)


def test_step_usage_errors(make_env):
    env = make_env("cartpole_swingup", obs="state")
    with pytest.raises(RuntimeError, match="reset"):
        env.step(np.zeros(1))
    env.reset()
    with pytest.raises(ValueError, match="1 action"):
        env.step(np.zeros(2))
    with pytest.raises(ValueError, match="finite"):
        env.step(np.array([np.nan]))
    env.close()
    env.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        env.reset()


def test_render_failure_is_an_env_error_naming_the_packages(make_env, monkeypatch):
    env = make_env("cartpole_swingup", image_size=16)

    def broken_render(*args, **kwargs):
        raise RuntimeError("an OpenGL platform library has not been loaded into this process")

    monkeypatch.setattr(env.physics, "render", broken_render)
    with pytest.raises(EnvError) as info:
        env.reset()
    message = str(info.value)
    assert "libegl1 libegl-mesa0 libgl1-mesa-dri" in message and "MUJOCO_GL=egl" in message
    assert "\n" not in message


def test_broken_gl_backend_at_import_is_an_env_error():
    script = (
        "import sys\n"
        "from pixelsac.envs import DMCEnv, EnvError\n"
        "try:\n"
        "    DMCEnv('cartpole_swingup', image_size=16).reset()\n"
        "except EnvError as err:\n"
        "    print('ENVERROR', err)\n"
        "    sys.exit(2)\n"
    )
    environment = cli_env(MUJOCO_GL="not-a-backend")
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # imports alone take 10-15 s on a loaded 2-core machine
    )
    assert result.returncode == 2, result.stderr
    assert "ENVERROR" in result.stdout and "libegl1" in result.stdout


def test_replay_rebuilds_the_env_stacks(make_env):
    """The buffer's rebuilt stacks equal what the env showed the policy, across a reset."""
    env = make_env("cheetah_run", image_size=12, frame_stack=3, episode_frames=12)
    buffer = ReplayBuffer(100, env.frame_shape, env.frame_dtype, env.frame_stack, env.action_dim)
    rng = np.random.default_rng(0)
    seen = {}
    for _episode in range(2):
        step = env.reset()
        buffer.add_first(step.frame)
        while not step.last:
            action = rng.uniform(-1, 1, size=env.action_dim).astype(np.float32)
            next_step = env.step(action)
            buffer.add(action, next_step.reward, next_step.terminal, next_step.frame)
            seen[action.tobytes()] = (step.obs, next_step.obs)
            step = next_step
    assert len(buffer) == len(seen) == 6
    batch = buffer.sample(64, np.random.default_rng(1))
    for row, action in enumerate(batch["action"].numpy()):
        obs, next_obs = seen[action.tobytes()]
        np.testing.assert_array_equal(batch["obs"][row].numpy(), obs)
        np.testing.assert_array_equal(batch["next_obs"][row].numpy(), next_obs)


def test_a_smaller_shadow_map_changes_only_shadow_edges(make_env):
    """env.shadow_size: the suite's 2048² shadow map is what software OpenGL spends most of a small
    render on; 512 keeps the images within a few shadow-edge pixels (the README measures its speed)."""
    default = make_env("cartpole_swingup", image_size=84, seed=3)
    small = make_env("cartpole_swingup", image_size=84, seed=3, shadow_size=512)
    none = make_env("cartpole_swingup", image_size=84, seed=3, shadow_size=0)
    assert small._env.physics.model.vis.quality.shadowsize == 512
    assert default._env.physics.model.vis.quality.shadowsize == 2048
    frames = [env.reset().frame.astype(int) for env in (default, small, none)]
    for _ in range(20):
        frames = [env.step(np.full(1, 0.7)).frame.astype(int) for env in (default, small, none)]
    changed_small = np.mean(np.abs(frames[1] - frames[0]) > 0)
    changed_none = np.mean(np.abs(frames[2] - frames[0]) > 0)
    assert changed_small < 0.01 < changed_none  # without shadows many pixels change
    with pytest.raises(EnvError, match="shadow_size must be an integer >= 0"):
        DMCEnv("cartpole_swingup", shadow_size=-1)


@pytest.mark.parametrize(
    "environ,gpus,expected",
    [
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "1"}, 2, "1"),
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "2,3"}, 4, "3"),
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "2,3"}, 4, "2"),
        ({"MUJOCO_GL": "egl", "CUDA_VISIBLE_DEVICES": "2,3"}, 4, "2"),  # rank 0 before LOCAL_RANK is set
        ({"MUJOCO_GL": "egl", "CUDA_VISIBLE_DEVICES": "3"}, 4, "3"),  # one run on GPU 3 renders there, not on 0
        ({"MUJOCO_GL": "egl"}, 2, "0"),  # one run, every GPU visible: cuda:0
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}, 2, None),
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "1", "MUJOCO_EGL_DEVICE_ID": "0"}, 2, None),  # the user's choice
        ({"MUJOCO_GL": "egl", "MUJOCO_EGL_DEVICE_ID": "0", "CUDA_VISIBLE_DEVICES": "3"}, 4, None),
        ({"MUJOCO_GL": "osmesa", "LOCAL_RANK": "1"}, 2, None),
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "1"}, 0, None),  # no NVIDIA GPU: Mesa's one device
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "2"}, 2, None),  # more ranks than GPUs: EGL's choice
        ({"MUJOCO_GL": "egl", "CUDA_VISIBLE_DEVICES": ""}, 2, None),  # no GPU visible to CUDA
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "x"}, 2, None),
    ],
)
def test_each_process_renders_on_the_egl_device_of_its_cuda_device(environ, gpus, expected):
    from pixelsac.envs.dmc import egl_device_for_process

    assert egl_device_for_process(environ, gpus) == expected


@pytest.mark.parametrize(
    "environ,cuda_index,expected",
    [
        ({"MUJOCO_GL": "egl"}, 1, "1"),  # e.g. pixelsac-evaluate device=cuda:1
        ({"MUJOCO_GL": "egl", "CUDA_VISIBLE_DEVICES": "1,2"}, 1, "2"),
        ({"MUJOCO_GL": "egl", "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1,2"}, 1, "2"),  # the known device wins
        ({"MUJOCO_GL": "egl", "CUDA_VISIBLE_DEVICES": "1,2"}, 2, None),
    ],
)
def test_a_known_cuda_device_picks_the_egl_device(environ, cuda_index, expected):
    from pixelsac.envs.dmc import egl_device_for_process

    assert egl_device_for_process(environ, 4, cuda_index) == expected


def test_egl_device_is_set_before_dm_control_is_imported_and_the_renderer_is_said():
    """In a fresh process as rank 1 of a 2-GPU machine: MUJOCO_EGL_DEVICE_ID is set before
    dm_control is imported (dm_control reads it at import), and the first render names the GL
    renderer on stderr, once."""
    script = (
        "import os, sys\n"
        "import pixelsac.envs.dmc as dmc\n"
        "dmc._nvidia_gpu_count = lambda: 2\n"
        "real = dmc.select_egl_device\n"
        "def select():\n"
        "    print('DM_CONTROL_IMPORTED', 'dm_control' in sys.modules)\n"
        "    print('SET', real())\n"
        "    os.environ['MUJOCO_EGL_DEVICE_ID'] = '0'  # this machine has one (software) EGL device\n"
        "dmc.select_egl_device = select\n"
        "env = dmc.DMCEnv('cartpole_swingup', image_size=16)\n"
        "env.reset()\n"
        "env.reset()\n"
        "env.close()\n"
    )
    environ = cli_env(MUJOCO_GL="egl", LOCAL_RANK="1")
    environ.pop("PIXELSAC_GL_RENDERER_SAID", None)  # this process may have said it already
    environ.pop("MUJOCO_EGL_DEVICE_ID", None)
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=environ, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "DM_CONTROL_IMPORTED False" in result.stdout
    assert "SET 1" in result.stdout
    said = [line for line in result.stderr.splitlines() if line.startswith("render:")]
    assert len(said) == 1, result.stderr
    assert "MUJOCO_GL=egl, EGL device 0 (local rank 1), GL renderer '" in said[0]


@pytest.mark.parametrize(
    "devices,local_rank,expected",
    [
        ([2, 3], None, 2),  # rank 0, started before LOCAL_RANK is set
        ([2, 3], "1", 3),
        ("2,3", "1", 3),
        ("1,", None, 1),
        ([2, 3], "2", None),  # more ranks than listed devices
        (2, "1", None),  # a count: rank r on device r, which LOCAL_RANK says
        ("2", "1", None),
        (-1, None, None),
        ("auto", None, None),
        ([True], None, None),
        ("a,b", None, None),
    ],
)
def test_a_listed_device_is_the_one_each_rank_trains_on(devices, local_rank, expected):
    from pixelsac.envs.dmc import listed_cuda_index

    environ = {} if local_rank is None else {"LOCAL_RANK": local_rank}
    assert listed_cuda_index(devices, environ) == expected


@pytest.mark.parametrize(
    "visible,local_rank,expected",
    [(None, "1", "3"), (None, None, "2"), ("4,5,6,7", "1", "7"), ("4,5,6,7", None, "6")],
)
def test_a_run_with_a_device_list_renders_on_its_ranks_gpu_before_dm_control_loads(
    monkeypatch, visible, local_rank, expected
):
    """``trainer.devices=[2,3]``: rank r trains on the r-th listed device, so it renders there; the
    EGL device is chosen before the task is validated (which imports dm_control, whose EGL
    display opens at import). Before, every rank without a count of devices rendered on
    LOCAL_RANK's device (rank 1 on EGL device 1, not 3)."""
    import pixelsac.envs
    import pixelsac.envs.dmc as dmc
    from pixelsac import train

    seen = []
    monkeypatch.setattr(dmc, "_nvidia_gpu_count", lambda: 8)
    monkeypatch.setattr(
        pixelsac.envs,
        "available_tasks",
        lambda: seen.append(os.environ.get("MUJOCO_EGL_DEVICE_ID")) or ["cartpole_swingup"],
    )
    monkeypatch.setenv("MUJOCO_GL", "egl")
    monkeypatch.setenv("MUJOCO_EGL_DEVICE_ID", "unset")  # recorded, so that what the run sets is undone
    monkeypatch.delenv("MUJOCO_EGL_DEVICE_ID")
    for name, value in (("CUDA_VISIBLE_DEVICES", visible), ("LOCAL_RANK", local_rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    train.resolve_run(["task=cartpole_swingup", "trainer.devices=[2,3]"])
    assert seen == [expected]
