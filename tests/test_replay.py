"""Tests for the single-frame replay buffer against a naive stacked-observation reference."""

from __future__ import annotations

import collections
import io

import numpy as np
import pytest
import torch

from pixelsac.replay import ReplayBuffer

# (length in agent steps, ends by termination). Lengths 1 and 2 are shorter than a 3-frame
# stack, so the episode-start clamping is exercised on both obs and next_obs.
EPISODES = [(5, False), (1, True), (2, False), (7, True), (3, False), (1, False), (4, True)]


class NaiveReference:
    """Stores each transition's full stacked obs and next_obs, built the way the env does."""

    def __init__(self, frame_stack: int) -> None:
        self.frame_stack = frame_stack
        self.by_action: dict[bytes, dict] = {}
        self.frames_written = 0
        self._window: collections.deque = collections.deque(maxlen=frame_stack)
        self._window_indices: collections.deque = collections.deque(maxlen=frame_stack)

    def first(self, frame: np.ndarray) -> None:
        for _ in range(self.frame_stack):
            self._window.append(frame)
            self._window_indices.append(self.frames_written)
        self.frames_written += 1

    def step(self, action, reward, terminal, frame) -> None:
        obs = np.concatenate(self._window, axis=0)
        obs_indices = list(self._window_indices)
        self._window.append(frame)
        self._window_indices.append(self.frames_written)
        self.by_action[action.tobytes()] = {
            "obs": obs,
            "action": action,
            "reward": np.float32(reward),
            "not_terminal": 0.0 if terminal else 1.0,
            "next_obs": np.concatenate(self._window, axis=0),
            "oldest_frame": min(obs_indices),
        }
        self.frames_written += 1

    def still_stored(self, capacity: int) -> set[bytes]:
        """Transitions whose every frame is still in a ring of `capacity` slots."""
        oldest_kept = self.frames_written - capacity
        return {key for key, t in self.by_action.items() if t["oldest_frame"] >= oldest_kept}


def fill(
    buffer: ReplayBuffer,
    reference: NaiveReference,
    rng: np.random.Generator,
    frame_shape: tuple[int, ...],
    frame_dtype,
    action_dim: int,
    episodes=EPISODES,
) -> None:
    def random_frame():
        if np.dtype(frame_dtype) == np.uint8:
            return rng.integers(0, 256, size=frame_shape, dtype=np.uint8)
        return rng.standard_normal(frame_shape).astype(frame_dtype)

    for length, ends_terminal in episodes:
        frame = random_frame()
        buffer.add_first(frame)
        reference.first(frame)
        for step in range(length):
            # Random actions are distinct, so they identify the transition a sample came from.
            action = rng.uniform(-1, 1, size=action_dim).astype(np.float32)
            reward = float(rng.standard_normal())
            terminal = ends_terminal and step == length - 1
            frame = random_frame()
            buffer.add(action, reward, terminal, frame)
            reference.step(action, reward, terminal, frame)


def sample_keys(batch: dict[str, torch.Tensor]) -> list[bytes]:
    return [row.tobytes() for row in batch["action"].numpy()]


@pytest.mark.parametrize(
    "frame_shape, frame_dtype, frame_stack, capacity, repeats",
    [
        ((3, 5, 4), np.uint8, 3, 1000, 1),  # no wrap-around
        ((3, 5, 4), np.uint8, 3, 17, 3),  # ring overwritten several times, mid-episode
        ((3, 5, 4), np.uint8, 1, 13, 2),
        ((7,), np.float32, 1, 500, 1),  # state vectors
        ((7,), np.float32, 2, 11, 3),
    ],
)
def test_samples_match_naive_stacks(frame_shape, frame_dtype, frame_stack, capacity, repeats):
    rng = np.random.default_rng(0)
    action_dim = 2
    buffer = ReplayBuffer(capacity, frame_shape, frame_dtype, frame_stack, action_dim)
    reference = NaiveReference(frame_stack)
    for _ in range(repeats):
        fill(buffer, reference, rng, frame_shape, frame_dtype, action_dim)
    assert reference.frames_written > capacity or repeats == 1

    stored = reference.still_stored(capacity)
    # The buffer may drop up to frame_stack - 1 transitions at the ring's tail, never more.
    assert len(stored) - (frame_stack - 1) <= len(buffer) <= len(stored)

    batch = buffer.sample(4000, np.random.default_rng(1))
    keys = sample_keys(batch)
    assert set(keys) <= stored, "sampled a transition that is overwritten or an episode start"
    assert len(set(keys)) == len(buffer), "some sampleable transitions were never drawn"
    counts = collections.Counter(keys)
    expected = len(keys) / len(buffer)
    assert min(counts.values()) > 0.6 * expected and max(counts.values()) < 1.4 * expected

    stacked_shape = (frame_shape[0] * frame_stack, *frame_shape[1:])
    assert batch["obs"].shape == (4000, *stacked_shape)
    assert batch["next_obs"].shape == (4000, *stacked_shape)
    for row, key in enumerate(keys):
        want = reference.by_action[key]
        np.testing.assert_array_equal(batch["obs"][row].numpy(), want["obs"])
        np.testing.assert_array_equal(batch["next_obs"][row].numpy(), want["next_obs"])
        assert batch["reward"][row, 0].item() == want["reward"]
        assert batch["not_terminal"][row, 0].item() == want["not_terminal"]


def test_sample_types_and_shapes():
    buffer = ReplayBuffer(50, (3, 6, 6), np.uint8, 3, 4)
    fill(buffer, NaiveReference(3), np.random.default_rng(0), (3, 6, 6), np.uint8, 4)
    batch = buffer.sample(8, np.random.default_rng(0))
    assert set(batch) == {"obs", "action", "reward", "not_terminal", "next_obs"}
    assert batch["obs"].dtype == torch.uint8 and batch["obs"].shape == (8, 9, 6, 6)
    assert batch["next_obs"].dtype == torch.uint8 and batch["next_obs"].shape == (8, 9, 6, 6)
    assert batch["action"].dtype == torch.float32 and batch["action"].shape == (8, 4)
    assert batch["reward"].dtype == torch.float32 and batch["reward"].shape == (8, 1)
    assert batch["not_terminal"].dtype == torch.float32 and batch["not_terminal"].shape == (8, 1)
    assert all(tensor.is_contiguous() for tensor in batch.values())


def test_terminal_and_time_limit_ends():
    buffer = ReplayBuffer(20, (2,), np.float32, 1, 1)
    frame = np.zeros(2, dtype=np.float32)
    # Episode 1 ends by termination, episode 2 by a time limit: only the first stops bootstrap.
    buffer.add_first(frame)
    buffer.add(np.array([0.1]), 1.0, False, frame)
    buffer.add(np.array([0.2]), 1.0, True, frame)
    buffer.add_first(frame)
    buffer.add(np.array([0.3]), 1.0, False, frame)
    buffer.add(np.array([0.4]), 1.0, False, frame)
    batch = buffer.sample(200, np.random.default_rng(0))
    actions = [round(action, 3) for action in batch["action"][:, 0].tolist()]
    not_terminal_by_action = dict(zip(actions, batch["not_terminal"][:, 0].tolist()))
    assert not_terminal_by_action == {0.1: 1.0, 0.2: 0.0, 0.3: 1.0, 0.4: 1.0}


@pytest.mark.parametrize("action_dim, expected", [(6, 21_198), (1, 21_178)])
def test_bytes_per_transition_at_84x84(action_dim, expected):
    buffer = ReplayBuffer(10, (3, 84, 84), np.uint8, 3, action_dim)
    assert buffer.bytes_per_transition == buffer.nbytes / 10
    assert buffer.bytes_per_transition == expected
    assert buffer.bytes_per_transition <= 21_200
    description = buffer.describe()
    assert "\n" not in description and "10 transitions" in description
    assert f"{expected:,}" in description


def test_state_dict_round_trip_gives_identical_samples():
    frame_shape = (3, 4, 4)
    rng = np.random.default_rng(3)
    original = ReplayBuffer(23, frame_shape, np.uint8, 3, 2)
    fill(original, NaiveReference(3), rng, frame_shape, np.uint8, 2)
    fill(original, NaiveReference(3), rng, frame_shape, np.uint8, 2, episodes=[(4, False)])

    state = original.state_dict()
    for value in state.values():
        assert type(value) is int or isinstance(value, torch.Tensor)
    # A checkpoint must load under torch.load's default weights_only=True.
    stream = io.BytesIO()
    torch.save(state, stream)
    stream.seek(0)
    restored = ReplayBuffer(23, frame_shape, np.uint8, 3, 2)
    restored.load_state_dict(torch.load(stream, weights_only=True))

    def assert_same_samples(seed):
        first = original.sample(64, np.random.default_rng(seed))
        second = restored.sample(64, np.random.default_rng(seed))
        for key in first:
            assert torch.equal(first[key], second[key]), key

    assert len(restored) == len(original)
    assert_same_samples(7)
    # The counters came back too: the next writes land in the same slots in both buffers.
    more = [(2, False)]
    fill(original, NaiveReference(3), np.random.default_rng(9), frame_shape, np.uint8, 2, more)
    fill(restored, NaiveReference(3), np.random.default_rng(9), frame_shape, np.uint8, 2, more)
    assert_same_samples(8)


def test_state_dict_round_trip_of_open_episode():
    frame = np.zeros(2, dtype=np.float32)
    original = ReplayBuffer(10, (2,), np.float32, 1, 1)
    original.add_first(frame)
    restored = ReplayBuffer(10, (2,), np.float32, 1, 1)
    restored.load_state_dict(original.state_dict())
    restored.add(np.array([0.5]), 1.0, False, frame)  # legal only if the open episode came back
    assert len(restored) == 1


def test_load_state_dict_rejects_other_layouts():
    source = ReplayBuffer(10, (2,), np.float32, 1, 1)
    source.add_first(np.zeros(2, dtype=np.float32))
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(11, (2,), np.float32, 1, 1).load_state_dict(source.state_dict())
    target = ReplayBuffer(10, (3,), np.float32, 1, 1)
    with pytest.raises(ValueError, match="frames"):
        target.load_state_dict(source.state_dict())
    assert target.state_dict()["written"] == 0


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, (2,), np.float32, 1, 1), "capacity"),
        ((-5, (2,), np.float32, 1, 1), "capacity"),
        ((3, (2,), np.float32, 3, 1), "exceed frame_stack"),
        ((10, (2,), np.float32, 0, 1), "frame_stack"),
        ((10, (2,), np.float32, 1, 0), "action_dim"),
        ((10, (0,), np.float32, 1, 1), "frame_shape"),
    ],
)
def test_constructor_errors(args, match):
    with pytest.raises(ValueError, match=match):
        ReplayBuffer(*args)


def test_usage_errors():
    buffer = ReplayBuffer(10, (3, 2, 2), np.uint8, 2, 1)
    rng = np.random.default_rng(0)
    frame = np.zeros((3, 2, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(4, rng)
    with pytest.raises(ValueError, match="add_first"):
        buffer.add(np.zeros(1), 0.0, False, frame)
    buffer.add_first(frame)
    with pytest.raises(ValueError, match="empty"):
        buffer.sample(4, rng)  # an episode start alone is no transition
    with pytest.raises(ValueError, match="shape"):
        buffer.add(np.zeros(1), 0.0, False, np.zeros((3, 2, 3), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        buffer.add(np.zeros(1), 0.0, False, frame.astype(np.float32))
    with pytest.raises(ValueError, match="action"):
        buffer.add(np.zeros(2), 0.0, False, frame)
    buffer.add(np.zeros(1), 0.0, True, frame)
    assert len(buffer) == 1
    with pytest.raises(ValueError, match="batch_size"):
        buffer.sample(0, rng)
    with pytest.raises(ValueError, match="add_first"):
        buffer.add(np.zeros(1), 0.0, False, frame)  # a terminal step closes the episode
