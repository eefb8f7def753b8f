"""pixelsac/collect.py: the Collector's counters, seed phase and episode bookkeeping, the
experience stream's update-to-data ratio and budget, and run_episodes -- on a scripted
environment (no rendering), so each test takes milliseconds."""

from __future__ import annotations

import numpy as np
import pytest

from pixelsac.collect import Collector, ExperienceStream, run_episodes
from pixelsac.envs import TimeStep
from pixelsac.replay import ReplaySet

FRAME = (3, 4, 4)


class ScriptedEnvs:
    """``num_envs`` lockstep envs whose episodes last ``length`` agent steps; reward 1 per step."""

    def __init__(self, num_envs: int = 2, length: int = 3, action_repeat: int = 2, action_dim: int = 1) -> None:
        self.num_envs, self.length, self.action_repeat, self.action_dim = num_envs, length, action_repeat, action_dim
        self.episode_frames = length * action_repeat
        self.t = [0] * num_envs
        self.actions: list[np.ndarray] = []
        self.resets = 0

    def _timestep(self, i: int, reward: float) -> TimeStep:
        frame = np.full(FRAME, self.t[i], np.uint8)
        obs = np.concatenate([frame] * 2)
        last = self.t[i] >= self.length
        return TimeStep(obs=obs, frame=frame, reward=reward, terminal=False, last=last, first=self.t[i] == 0)

    def reset(self, indices):
        self.resets += len(indices)
        for i in indices:
            self.t[i] = 0
        return [self._timestep(i, 0.0) for i in indices]

    def step(self, actions):
        self.actions.append(np.array(actions))
        out = []
        for i in range(self.num_envs):
            self.t[i] += 1
            out.append(self._timestep(i, 1.0))
        return out

    def get_rng_states(self):
        return [None] * self.num_envs

    def set_rng_states(self, states):
        pass


def make(seed_steps: int = 2, num_envs: int = 2, world_size: int = 1, act=None):
    envs = ScriptedEnvs(num_envs)
    replay = ReplaySet(num_envs, 64, FRAME, np.uint8, 2, envs.action_dim)
    calls = []

    def policy(obs, sample):
        calls.append((obs.shape, sample))
        return np.full((obs.shape[0], envs.action_dim), 0.5, np.float32)

    collector = Collector(envs, replay, act or policy, seed_steps, np.random.default_rng(0), world_size=world_size)
    return collector, envs, replay, calls


def test_counters_seed_phase_and_episodes():
    collector, envs, replay, calls = make(seed_steps=2)
    assert collector.at_episode_boundary and collector.steps_to_episode_boundary == 0
    collector.step()  # seed steps (counted over both envs): uniform random actions, no policy
    assert calls == [] and np.all(np.abs(envs.actions[0]) <= 1) and not np.all(envs.actions[0] == 0.5)
    assert collector.agent_steps == 2 and collector.env_frames == 2 * envs.action_repeat
    assert not collector.at_episode_boundary and collector.steps_to_episode_boundary == 2
    collector.step()
    collector.step()  # the third step of each env ends its episode; the policy acts from step 2 on
    assert calls == [((2, 6, 4, 4), True)] * 2 and np.all(envs.actions[-1] == 0.5)
    assert collector.at_episode_boundary and collector.episodes == 2
    finished = collector.drain_episodes()
    assert [(e.ret, e.length) for e in finished] == [(3.0, 3), (3.0, 3)]
    assert [e.env_frames for e in finished] == [8 + 2, 8 + 4]  # frames collected when each env's episode ended
    assert collector.drain_episodes() == [] and len(replay) == 2 * 3


def test_counters_over_data_parallel_ranks_and_state_round_trip():
    collector, *_ = make(world_size=4)
    collector.step()
    assert collector.total_env_frames == 4 * collector.env_frames and collector.total_agent_steps == 8
    state = collector.state_dict()
    assert state["world_size"] == 4 and state["at_episode_boundary"] is False
    other, *_ = make(world_size=4)
    other.load_state_dict(state)
    assert (other.agent_steps, other.env_frames, other.episodes) == (2, 4, 0) and other.at_episode_boundary
    np.testing.assert_array_equal(other.rng.uniform(size=3), collector.rng.uniform(size=3))
    wrong, *_ = make(num_envs=3)
    with pytest.raises(ValueError, match="env.num_envs must match"):
        wrong.load_state_dict(state)


@pytest.mark.parametrize("updates_per_step", [0, 1, 3])
def test_stream_keeps_the_update_to_data_ratio_and_the_budget(updates_per_step):
    collector, *_ = make(seed_steps=4)
    stream = ExperienceStream(
        collector, batch_size=5, total_agent_steps=10, updates_per_step=updates_per_step, rng=np.random.default_rng(1)
    )
    assert len(stream) == (10 - 4) * updates_per_step
    batches = list(stream)
    # seed steps collect without updates; then each step of the 2 envs gives 2 x updates_per_step batches
    assert len(batches) == (10 - 4) // 2 * 2 * updates_per_step
    assert stream.exhausted and collector.agent_steps == 10
    if batches:
        assert batches[0]["obs"].shape == (5, 6, 4, 4) and batches[0]["action"].shape == (5, 1)


def test_stream_stops_before_a_step_when_asked():
    collector, *_ = make(seed_steps=0)
    stream = ExperienceStream(collector, 2, 100, 1, np.random.default_rng(1))
    stream.stop_check = lambda: collector.agent_steps >= 4
    assert len(list(stream)) == 4 and stream.stopped_early and collector.agent_steps == 4


def test_run_episodes_plays_whole_episodes_and_can_give_up():
    env = ScriptedEnvs(num_envs=1, length=4)

    class One:
        def __init__(self, envs):
            self.envs = envs

        def reset(self):
            return self.envs.reset([0])[0]

        def step(self, action):
            return self.envs.step(action[None])[0]

    frames = []
    returns = run_episodes(
        One(env),
        lambda obs, sample: np.zeros((1, 1), np.float32),
        2,
        on_frame=lambda episode, e: frames.append(episode),
    )
    assert returns == [4.0, 4.0] and frames == [0] * 5 + [1] * 5
    assert run_episodes(One(env), lambda obs, sample: np.zeros((1, 1)), 1, should_abandon=lambda: True) is None
