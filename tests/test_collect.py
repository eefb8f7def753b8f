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
        self.pending = None  # actions handed out by step_async

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

    def step_async(self, actions):
        assert self.pending is None, "a step handed out twice"
        self.pending = actions

    def step_wait(self):
        actions, self.pending = self.pending, None
        return self.step(actions)

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
    collector, *_ = make(seed_steps=0, num_envs=1)
    stream = ExperienceStream(collector, 2, 100, 1, np.random.default_rng(1))
    stream.stop_check = lambda: collector.agent_steps >= 4
    assert len(list(stream)) == 4 and stream.stopped_early and collector.agent_steps == 4


def _stream(collector, updates_per_step, total_agent_steps=16):
    """A stream sampling with the collector's RNG, as a run's does (so the state holds it)."""
    return ExperienceStream(collector, 3, total_agent_steps, updates_per_step, collector.rng)


def _same_batches(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x) for x, y in zip(a, b))


@pytest.mark.parametrize("updates_per_step,num_envs", [(2, 1), (1, 2), (3, 2)])
def test_a_checkpoint_between_a_steps_updates_resumes_with_the_rest_of_them(updates_per_step, num_envs):
    """A checkpoint taken after the first update of a step that ended an episode (where the
    Checkpointer writes one) holds the step's updates still due: the resumed stream draws them
    first, and the two halves are the uninterrupted stream's batches. Before, the resume
    collected the next step at once: updates_per_step x num_envs - 1 updates were lost."""
    collector, *_ = make(seed_steps=2, num_envs=num_envs)
    straight = list(_stream(collector, updates_per_step))

    collector, _, replay, _ = make(seed_steps=2, num_envs=num_envs)
    first = []
    for batch in _stream(collector, updates_per_step):
        first.append(batch)
        if collector.agent_steps > 2 and collector.at_episode_boundary:
            break  # a checkpoint now, then a crash
    saved, saved_replay = collector.state_dict(), replay.state_dict()
    assert saved["batches_due"] == updates_per_step * num_envs - 1

    resumed, _, resumed_replay, _ = make(seed_steps=2, num_envs=num_envs)
    resumed_replay.load_state_dict(saved_replay)
    resumed.load_state_dict(saved)
    rest = list(_stream(resumed, updates_per_step))
    assert _same_batches(first + rest, straight)
    assert resumed.agent_steps == 16 and resumed.batches_due == 0


def test_a_stop_lands_between_the_updates_of_a_step():
    """However many updates a step holds, a stop is asked between them (its wait is bounded, a
    second signal saves at once); the updates left stay due. With one update per step (the
    default) the stop is asked before each step only, as it always was."""
    collector, *_ = make(seed_steps=0, num_envs=1)
    stream = _stream(collector, updates_per_step=1000)
    drawn = []
    stream.stop_check = lambda: len(drawn) >= 3
    for batch in stream:
        drawn.append(batch)
    assert len(drawn) == 3 and stream.stopped_early and stream.collector.agent_steps == 1
    assert collector.batches_due == 997 and not stream.exhausted and len(stream) == 997 + 15 * 1000

    collector, *_ = make(seed_steps=2, num_envs=1)
    stream, asked = _stream(collector, updates_per_step=1), []
    stream.stop_check = lambda: asked.append(collector.agent_steps) or False
    assert len(list(stream)) == 16 - 2 and asked == list(range(16))  # before every step, seed steps included

    collector, *_ = make(seed_steps=2, num_envs=2)  # a step of two envs holds two updates: asked between them
    stream, asked = _stream(collector, updates_per_step=1), []
    stream.stop_check = lambda: asked.append(collector.agent_steps) or False
    assert len(list(stream)) == 16 - 2 and asked == [0, 2, *[n for n in range(4, 16, 2) for _ in "ab"], 16]


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


def _consume(stream, collector, replay):
    """Each batch with what a callback after its update would see: (in flight, at the episode
    boundary, transitions stored, agent steps)."""
    seen = []
    for _batch in stream:
        seen.append((collector.in_flight, collector.at_episode_boundary, len(replay), collector.agent_steps))
    return seen


@pytest.mark.parametrize("num_envs", [1, 2])
def test_an_overlapped_stream_updates_while_the_step_is_in_flight(num_envs):
    """Each step's batches come while its transitions are still with the environments (drawn
    from one step fewer than in DrQ's order), except in a step that ends an episode, after whose
    updates a callback sees the boundary as before, and the budget's last step; the counters,
    the number of updates and every stored transition are DrQ's order's."""
    runs = {}
    for overlap in (False, True):
        collector, envs, replay, _ = make(seed_steps=2 * num_envs, num_envs=num_envs)
        stream = ExperienceStream(collector, 4, 10 * num_envs, 1, np.random.default_rng(1), overlap=overlap)
        runs[overlap] = (_consume(stream, collector, replay), collector, replay)
    (drq, collector_a, replay_a), (overlapped, collector_b, replay_b) = runs[False], runs[True]
    assert len(drq) == len(overlapped) == 8 * num_envs  # (10 - 2) steps of each env, one update each
    assert not any(in_flight for in_flight, *_ in drq)
    episodes = 3  # ScriptedEnvs: an episode is 3 steps; the seed phase took steps 1-2
    per_batch = [(step, k) for step in range(3, 11) for k in range(num_envs)]
    for (step, _), (in_flight, boundary, stored, _steps), (_, drq_boundary, drq_stored, _) in zip(
        per_batch, overlapped, drq
    ):
        ends_episode, last_of_budget = step % episodes == 0, step == 10
        assert in_flight == (not ends_episode and not last_of_budget), step
        assert boundary == drq_boundary == ends_episode, step
        assert stored == drq_stored - (num_envs if in_flight else 0), step
    assert (collector_a.agent_steps, collector_a.env_frames, collector_a.episodes) == (
        collector_b.agent_steps,
        collector_b.env_frames,
        collector_b.episodes,
    )
    assert not collector_b.in_flight
    for buffer_a, buffer_b in zip(replay_a.buffers, replay_b.buffers):
        state_a, state_b = buffer_a.state_dict(), buffer_b.state_dict()
        for key in state_a:
            assert np.array_equal(np.asarray(state_a[key]), np.asarray(state_b[key])), key


def test_a_step_in_flight_is_stored_before_the_collection_state_is_taken():
    collector, envs, replay, _ = make(seed_steps=0)
    collector.begin_step()
    assert collector.in_flight and envs.pending is not None and not collector.at_episode_boundary
    with pytest.raises(RuntimeError, match="in flight"):
        collector.begin_step()
    with pytest.raises(RuntimeError, match="in flight"):
        collector.load_state_dict({})
    state = collector.state_dict()  # a checkpoint taken during an overlapped update
    assert state["agent_steps"] == 2 and len(replay) == 2 and not collector.in_flight
    collector.finish_step()  # the stream's own finish then has nothing left to do
    assert collector.agent_steps == 2 and len(replay) == 2


def test_whether_the_next_step_may_end_an_episode():
    collector, *_ = make(seed_steps=0)  # 3-step episodes
    assert not collector.next_step_may_end_episode()  # a fresh episode is 3 steps long
    collector.step()
    assert not collector.next_step_may_end_episode()
    collector.step()
    assert collector.next_step_may_end_episode()
    collector.step()
    assert collector.at_episode_boundary and not collector.next_step_may_end_episode()
    one_step, *_ = make(seed_steps=0)
    one_step.envs.length, one_step.envs.episode_frames = 1, one_step.envs.action_repeat
    assert one_step.next_step_may_end_episode()
    no_limit, *_ = make(seed_steps=0)
    no_limit.envs.episode_frames = None
    assert no_limit.next_step_may_end_episode()


def test_overlap_leaves_a_stream_without_updates_in_drq_order():
    collector, envs, replay, _ = make(seed_steps=0)
    stream = ExperienceStream(collector, 4, 10, 0, np.random.default_rng(1), overlap=True)
    assert list(stream) == [] and collector.agent_steps == 10 and not collector.in_flight


def test_a_checkpoint_written_during_an_overlapped_update_holds_the_step_in_flight_everywhere(tmp_path):
    """A save between the updates of an overlapped step (a stop with no wait, a numerical
    failure) stores the step first: the replay file, its name and the collection state in the
    checkpoint all hold it (a replay one step short would not match its checkpoint on resume)."""
    import torch

    from pixelsac.callbacks import Checkpointer
    from pixelsac.checkpoint import REPLAY_OWNER

    collector, envs, replay, _ = make(seed_steps=0)
    collector.step()
    collector.begin_step()  # in flight, as during the overlapped step's updates
    saved = {}

    class Trainer:  # what Checkpointer._write asks of Lightning's
        is_global_zero, global_rank, world_size = True, 0, 1

        def save_checkpoint(self, path, weights_only=False):
            saved["collector"] = checkpointer.state_dict()["collector"]
            torch.save({}, path)

    class Module:
        updates = 7

    checkpointer = Checkpointer(tmp_path, collector, save_replay=True)
    assert checkpointer._write(Trainer(), Module(), ["last.ckpt"])
    replay_file = tmp_path / "checkpoints" / f"replay-{4:010d}.pt"
    contents = torch.load(replay_file, weights_only=True)
    assert saved["collector"]["agent_steps"] == 4 and contents[REPLAY_OWNER]["agent_steps"] == 4
    # each env's ring: the first frame's slot and both steps (one slot fewer without the one in flight)
    assert [len(ring["actions"]) for ring in contents["buffers"]] == [3, 3] and len(replay) == 4
    assert not collector.in_flight and checkpointer.saved_at == (4, 7)
