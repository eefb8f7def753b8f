"""Replay buffer that stores every frame once and rebuilds frame stacks at sample time.

Layout: one ring of `capacity` slots. Slot i holds

    frame_i     the frame observed after the agent step (uint8 image or float32 state vector)
    action_i    the action that led to frame_i                      (float32, A)
    reward_i    the reward of that step                             (float32)
    terminal_i  the task terminated at that step (no bootstrap)     (bool)
    first_i     frame_i is an episode's first frame                 (bool)

A transition is (slot i-1 -> slot i) for any slot i that is not first: action, reward and
terminal come from slot i. The first slot of an episode carries only its frame.

At 84x84x3 with 6-D actions a slot costs 21,168 + 24 + 4 + 1 + 1 = 21,198 bytes, against 127,044
for DrQ's layout that stores obs and next_obs already stacked.

Frame stacks are rebuilt from the single frames: the stack of obs ends at frame i-1, the stack of
next_obs at frame i, and neither reaches across the episode's first frame, which is repeated in
place of earlier frames exactly like the environment does at reset. Stacks are ordered oldest
frame first on the channel axis.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["ReplayBuffer"]

_FORMAT_VERSION = 1

# Rejection sampling draws again for the indices that landed on episode-start slots. Those are a
# small fraction in practice; after this many rounds the remaining draws come from the explicit
# list of valid slots instead, so a buffer of mostly one-frame episodes cannot loop for long.
_REJECTION_ROUNDS = 8


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class ReplayBuffer:
    """Ring buffer of single frames; samples (obs, action, reward, not_terminal, next_obs).

    Args:
        capacity: number of slots, one per stored frame; each agent step takes one slot and each
            episode start one more, so it holds about `capacity` transitions.
        frame_shape: shape of one frame, e.g. (3, 84, 84) or (D,) for state vectors.
        frame_dtype: numpy dtype of frames (uint8 for images, float32 for states).
        frame_stack: frames per observation, stacked on the first frame axis.
        action_dim: number of action components.

    Usage: `add_first(frame)` at every episode start, then `add(action, reward, terminal,
    next_frame)` after each agent step.
    """

    def __init__(
        self,
        capacity: int,
        frame_shape: tuple[int, ...],
        frame_dtype: Any,
        frame_stack: int,
        action_dim: int,
    ) -> None:
        self._capacity = _positive("capacity", capacity)
        self._frame_stack = _positive("frame_stack", frame_stack)
        self._action_dim = _positive("action_dim", action_dim)
        if self._capacity <= self._frame_stack:
            raise ValueError(
                f"capacity ({capacity}) must exceed frame_stack ({frame_stack}) to hold one "
                "transition with its whole stack"
            )
        self._frame_shape = tuple(int(size) for size in frame_shape)
        if not self._frame_shape or any(size <= 0 for size in self._frame_shape):
            raise ValueError(f"frame_shape needs positive sizes, got {frame_shape}")
        self._frame_dtype = np.dtype(frame_dtype)

        # np.zeros maps pages lazily, so a large buffer costs RAM only as it fills.
        self._frames = np.zeros((self._capacity, *self._frame_shape), dtype=self._frame_dtype)
        self._actions = np.zeros((self._capacity, self._action_dim), dtype=np.float32)
        self._rewards = np.zeros(self._capacity, dtype=np.float32)
        self._terminals = np.zeros(self._capacity, dtype=bool)
        self._firsts = np.zeros(self._capacity, dtype=bool)

        # Absolute number of slots ever written; slot of absolute index j is j % capacity.
        self._written = 0
        # add() is only legal inside an episode: after add_first() and before a terminal step.
        self._episode_open = False

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """Number of slots."""
        return self._capacity

    @property
    def frame_stack(self) -> int:
        """Frames per sampled observation."""
        return self._frame_stack

    @property
    def nbytes(self) -> int:
        """Bytes allocated by all storage arrays."""
        return int(
            self._frames.nbytes
            + self._actions.nbytes
            + self._rewards.nbytes
            + self._terminals.nbytes
            + self._firsts.nbytes
        )

    @property
    def bytes_per_transition(self) -> float:
        """`nbytes / capacity`: the memory cost of one stored step."""
        return self.nbytes / self._capacity

    def describe(self) -> str:
        """One line stating the capacity in transitions and bytes."""
        frame = "x".join(str(size) for size in self._frame_shape)
        return (
            f"replay buffer: {self._capacity:,} transitions x {self.bytes_per_transition:,.0f} B "
            f"= {self.nbytes / 1e9:.2f} GB ({self._frame_dtype.name} frames {frame} stored once, "
            f"stacks of {self._frame_stack} rebuilt at sample time)"
        )

    def __len__(self) -> int:
        """Number of transitions that can be sampled now."""
        low, high = self._sample_range()
        if high <= low:
            return 0
        return (high - low) - int(self._count_firsts(low, high))

    # ------------------------------------------------------------------ writing
    def add_first(self, frame: np.ndarray) -> None:
        """Store the first frame of a new episode."""
        slot = self._write_frame(frame)
        self._actions[slot] = 0.0
        self._rewards[slot] = 0.0
        self._terminals[slot] = False
        self._firsts[slot] = True
        self._written += 1
        self._episode_open = True

    def add(
        self, action: np.ndarray, reward: float, terminal: bool, next_frame: np.ndarray
    ) -> None:
        """Store one agent step: the action taken, its reward, and the frame it led to.

        `terminal` is True only when the task itself ended the episode; a time-limit end is
        not terminal.
        """
        if not self._episode_open:
            raise ValueError(
                "add() needs an open episode: call add_first(frame) at every episode start "
                "(including after a terminal step)"
            )
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        if action.shape != (self._action_dim,):
            raise ValueError(f"action must have {self._action_dim} components, got {action.shape}")
        slot = self._write_frame(next_frame)
        self._actions[slot] = action
        self._rewards[slot] = reward
        self._terminals[slot] = bool(terminal)
        self._firsts[slot] = False
        self._written += 1
        self._episode_open = not terminal

    def _write_frame(self, frame: np.ndarray) -> int:
        frame = np.asarray(frame)
        if frame.shape != self._frame_shape:
            raise ValueError(f"frame must have shape {self._frame_shape}, got {frame.shape}")
        if self._frame_dtype == np.uint8 and frame.dtype != np.uint8:
            # Casting floats in [0, 1] or [0, 255] to uint8 would silently wrap or truncate.
            raise ValueError(f"frames must be uint8 images, got {frame.dtype}")
        slot = self._written % self._capacity
        self._frames[slot] = frame
        return slot

    # ------------------------------------------------------------------ sampling
    def _sample_range(self) -> tuple[int, int]:
        """Absolute indices [low, high) whose transitions have their whole stack in the ring."""
        oldest = max(0, self._written - self._capacity)
        if oldest == 0:
            # Slot 0 starts an episode, and stacks stop at episode starts, so nothing reaches
            # below it.
            return 1, self._written
        # A stack reaches back at most frame_stack frames from i; the slot before the oldest has
        # been overwritten, so its episode start may be gone (a small loss at the tail).
        return oldest + self._frame_stack, self._written

    def _count_firsts(self, low: int, high: int) -> int:
        start, stop = low % self._capacity, high % self._capacity
        if start < stop:
            return np.count_nonzero(self._firsts[start:stop])
        return np.count_nonzero(self._firsts[start:]) + np.count_nonzero(self._firsts[:stop])

    def _draw_indices(self, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        low, high = self._sample_range()
        indices = rng.integers(low, high, size=batch_size)
        for _ in range(_REJECTION_ROUNDS):
            rejected = np.flatnonzero(self._firsts[indices % self._capacity])
            if rejected.size == 0:
                return indices
            indices[rejected] = rng.integers(low, high, size=rejected.size)
        rejected = np.flatnonzero(self._firsts[indices % self._capacity])
        if rejected.size:
            candidates = np.arange(low, high)
            candidates = candidates[~self._firsts[candidates % self._capacity]]
            indices[rejected] = rng.choice(candidates, size=rejected.size)
        return indices

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """Draw `batch_size` transitions uniformly (with replacement).

        Returns CPU tensors: `obs` and `next_obs` of shape (B, k*C, H, W) in the frame dtype
        (or (B, k*D) for state vectors), `action` (B, A), `reward` (B, 1) and `not_terminal`
        (B, 1, 0.0 where the task terminated), all float32 except the frames.
        """
        batch_size = _positive("batch_size", batch_size)
        if len(self) == 0:
            raise ValueError(
                "cannot sample from an empty replay buffer: add an episode start and at least "
                f"one step (stored slots: {min(self._written, self._capacity)})"
            )
        indices = self._draw_indices(batch_size, rng)

        # chain[:, m] is the absolute index of the frame m steps back from i, held at the
        # episode's first frame once it reaches it. i itself is never a first slot, so
        # chain[:, 1] = i - 1 is always in the same episode.
        stack = self._frame_stack
        chain = np.empty((batch_size, stack + 1), dtype=np.int64)
        chain[:, 0] = indices
        for back in range(1, stack + 1):
            previous = chain[:, back - 1]
            at_episode_start = self._firsts[previous % self._capacity]
            chain[:, back] = np.where(at_episode_start, previous, previous - 1)
        slots = chain % self._capacity
        # Oldest frame first: obs is frames i-k..i-1, next_obs is frames i-k+1..i.
        obs_slots = slots[:, stack:0:-1]
        next_obs_slots = slots[:, stack - 1 :: -1]

        flat_obs_shape = (batch_size, stack * self._frame_shape[0], *self._frame_shape[1:])
        obs = self._frames[obs_slots].reshape(flat_obs_shape)
        next_obs = self._frames[next_obs_slots].reshape(flat_obs_shape)
        sampled = slots[:, 0]
        return {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(self._actions[sampled]),
            "reward": torch.from_numpy(self._rewards[sampled][:, None]),
            "not_terminal": torch.from_numpy(
                (~self._terminals[sampled]).astype(np.float32)[:, None]
            ),
            "next_obs": torch.from_numpy(next_obs),
        }

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Contents and counters as CPU tensors and Python ints (only the filled slots).

        Tensors rather than numpy arrays because `torch.load(weights_only=True)`, the default
        since torch 2.6, refuses numpy arrays inside a checkpoint.
        """
        filled = min(self._written, self._capacity)
        return {
            "format_version": _FORMAT_VERSION,
            "capacity": self._capacity,
            "frame_stack": self._frame_stack,
            "written": self._written,
            "episode_open": int(self._episode_open),
            "frames": torch.from_numpy(self._frames[:filled].copy()),
            "actions": torch.from_numpy(self._actions[:filled].copy()),
            "rewards": torch.from_numpy(self._rewards[:filled].copy()),
            "terminals": torch.from_numpy(self._terminals[:filled].copy()),
            "firsts": torch.from_numpy(self._firsts[:filled].copy()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output into a buffer built with the same arguments.

        Accepts tensors or numpy arrays; raises ValueError on any mismatch without changing
        the buffer.
        """
        if int(state.get("format_version", -1)) != _FORMAT_VERSION:
            raise ValueError(
                f"replay state has format {state.get('format_version')!r}, "
                f"expected {_FORMAT_VERSION}"
            )
        for name, mine in (("capacity", self._capacity), ("frame_stack", self._frame_stack)):
            if int(state[name]) != mine:
                raise ValueError(f"replay state has {name}={int(state[name])}, this buffer {mine}")
        written = int(state["written"])
        filled = min(written, self._capacity)
        arrays = {
            "frames": self._frames,
            "actions": self._actions,
            "rewards": self._rewards,
            "terminals": self._terminals,
            "firsts": self._firsts,
        }
        # Check everything before writing anything, so a bad state leaves the buffer intact.
        loaded = {}
        for name, target in arrays.items():
            value = state[name]
            if isinstance(value, torch.Tensor):
                value = value.detach().cpu().numpy()
            source = np.asarray(value)
            if source.shape != (filled, *target.shape[1:]) or source.dtype != target.dtype:
                raise ValueError(
                    f"replay state {name!r} is {source.dtype}{list(source.shape)}, "
                    f"expected {target.dtype}{[filled, *target.shape[1:]]}"
                )
            loaded[name] = source
        for name, target in arrays.items():
            target[:filled] = loaded[name]
            target[filled:] = 0
        self._written = written
        self._episode_open = bool(int(state["episode_open"]))


class ReplaySet:
    """One :class:`ReplayBuffer` per environment (``env.num_envs``), sampled as one.

    Each environment's frames must stay consecutive for stacks to be rebuilt, so each gets its
    own ring of ``capacity // num_envs`` slots. A batch draws from the buffers in proportion to
    the transitions they hold (one multinomial draw), then concatenates.
    """

    def __init__(self, num_envs: int, capacity: int, frame_shape: tuple[int, ...], frame_dtype: Any,
                 frame_stack: int, action_dim: int) -> None:
        per_env = _positive("capacity", capacity) // _positive("num_envs", num_envs)
        if per_env <= frame_stack:
            raise ValueError(f"replay capacity {capacity} is too small for {num_envs} envs "
                             f"(each needs more than {frame_stack} slots)")
        self.buffers = [ReplayBuffer(per_env, frame_shape, frame_dtype, frame_stack, action_dim)
                        for _ in range(num_envs)]

    @property
    def capacity(self) -> int:
        return sum(b.capacity for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def bytes_per_transition(self) -> float:
        return self.nbytes / self.capacity

    def describe(self) -> str:
        """One line stating the capacity in transitions and bytes, over all rings."""
        first = self.buffers[0]
        frame = "x".join(str(size) for size in first._frame_shape)
        rings = f"; {len(self.buffers)} rings, one per env" if len(self.buffers) > 1 else ""
        return (f"replay buffer: {self.capacity:,} transitions x {self.bytes_per_transition:,.0f} B "
                f"= {self.nbytes / 1e9:.2f} GB ({first._frame_dtype.name} frames {frame} stored once, "
                f"stacks of {first.frame_stack} rebuilt at sample time){rings}")

    def __len__(self) -> int:
        return sum(len(b) for b in self.buffers)

    def add_first(self, env_index: int, frame: np.ndarray) -> None:
        self.buffers[env_index].add_first(frame)

    def add(self, env_index: int, action: np.ndarray, reward: float, terminal: bool, next_frame: np.ndarray) -> None:
        self.buffers[env_index].add(action, reward, terminal, next_frame)

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        if len(self.buffers) == 1:
            return self.buffers[0].sample(batch_size, rng)
        sizes = np.array([len(b) for b in self.buffers], dtype=np.float64)
        if sizes.sum() <= 0:
            raise ValueError("cannot sample from an empty replay buffer")
        counts = rng.multinomial(batch_size, sizes / sizes.sum())
        parts = [b.sample(int(n), rng) for b, n in zip(self.buffers, counts) if n > 0]
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": [b.state_dict() for b in self.buffers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["buffers"]) != len(self.buffers):
            raise ValueError(f"the saved replay holds {len(state['buffers'])} env rings; this run has "
                             f"{len(self.buffers)} (env.num_envs must match to resume)")
        for buffer, saved in zip(self.buffers, state["buffers"]):
            buffer.load_state_dict(saved)
